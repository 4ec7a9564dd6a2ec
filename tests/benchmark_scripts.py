"""The scripts under benchmarks/ (not a package), imported by file, and their committed results."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """benchmarks/NAME.py as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(name: str) -> dict:
    """benchmarks/results/NAME.json, as committed."""
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
