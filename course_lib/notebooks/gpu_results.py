"""What ``benchmarks/gpu_check.py`` measured on a GPU, as the notebooks show it: always with the device.

The stored notebooks run on a CPU. Their GPU figures come from one committed run of
``benchmarks/gpu_check.py`` on a GPU machine (``benchmarks/results/gpu_check.json``): this module
reads that file and names where it was measured, so that no notebook shows a GPU figure as if it
had been measured on the reader's machine.
"""

import json
from pathlib import Path

__all__ = ["RESULTS", "load", "label"]

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_check.json"


def load(path: str | Path | None = None) -> dict:
    """The committed results (or those at ``path``); refuses a dry run's, which ran on no GPU."""
    path = Path(path) if path is not None else RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: it is committed with the course; run "
                                f"`PYTHONPATH=. python benchmarks/gpu_check.py` on a machine with a GPU to make it")
    results = json.loads(path.read_text())
    if results.get("dry_run") or results["environment"]["device"] == "cpu":
        raise ValueError(f"{path} holds a dry run (no GPU): its figures are not a GPU's")
    return results


def label(results: dict) -> str:
    """Where and with what the figures were measured, e.g. ``NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130,
    CUDA 13.0, NCCL 2.28.9), 2026-11-26``."""
    env = results["environment"]
    return (f"{env['device']} (torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}), "
            f"{env['date_utc'][:10]}")
