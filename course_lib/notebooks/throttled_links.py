"""What ``benchmarks/throttled_links.py`` measured on slow links made real, as the notebooks show it.

That script throttles a loopback of its own with a token-bucket filter and times the contest's steps
at 0.1, 1 and 10 Gbit/s and unthrottled, beside two predictions: the step-time model fitted on the
unthrottled runs (notebook 10's), and the same model with the two terms it lacks, each measured (the
in-step cost of a collective and the filter's token bucket). The notebooks read the committed file
(``benchmarks/results/throttled_links.json``), since making the namespace needs root on Linux.
"""

import json
import statistics
from pathlib import Path

__all__ = ["RESULTS", "load", "rates", "mean_error", "print_steps", "print_break_evens"]

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "throttled_links.json"
PREDICTIONS = {"model": "ratio", "with measured terms": "ratio_with_measured_terms"}


def load(path: str | Path | None = None) -> dict:
    """The committed results (or those at ``path``)."""
    path = Path(path) if path is not None else RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: it is committed with the course; run "
                                f"`sudo .venv/bin/python benchmarks/throttled_links.py` on Linux to make it")
    return json.loads(path.read_text())


def rates(results: dict) -> list[str]:
    """The rates' keys, slowest first, then ``"unthrottled"``."""
    return [f"{g:g} Gbit/s" for g in results["settings"]["rates_gbit"]] + ["unthrottled"]


def mean_error(results: dict, rate: str, prediction: str = "model") -> float:
    """Mean |predicted / measured - 1| over the methods at ``rate``, for ``"model"`` or ``"with measured terms"``."""
    field = PREDICTIONS[prediction]
    return statistics.mean(abs(m[field][rate] - 1) for m in results["methods"].values())


def print_steps(results: dict, names=None) -> None:
    """Each method's measured step (median over the repeats, min-max) at each rate, and predicted / measured
    for the model and for the model with its measured terms."""
    names = list(results["methods"]) if names is None else names
    keys = rates(results)
    print(f"step time, ms, at each rate of the one filter (shared by the {results['settings']['world_size']} ranks: "
          f"each gets 1/{results['settings']['world_size']}): measured median (min-max) over "
          f"{results['settings']['repeats']} repeats;\npredicted / measured by the model | by the model with its "
          "measured terms (exact unthrottled by construction: measured there)")
    print(f"{'':18s}" + "".join(f"{k:>29s}" for k in keys))
    for name in names:
        m = results["methods"][name]
        cells = [f"{1e3 * m['measured'][k]['median_s']:6.2f} ({1e3 * m['measured'][k]['min_s']:.1f}-"
                 f"{1e3 * m['measured'][k]['max_s']:.1f}) {m['ratio'][k]:4.2f}|{m['ratio_with_measured_terms'][k]:4.2f}"
                 for k in keys]
        print(f"{name:18s}" + "".join(f"{c:>29s}" for c in cells))
    for prediction in PREDICTIONS:
        print(f"mean |predicted / measured - 1|, {prediction}: "
              + ", ".join(f"{k} {mean_error(results, k, prediction):.0%}" for k in keys))


def _gbit(b) -> str:
    if b is None:
        return "-"
    return "always" if b == float("inf") else "never" if b == 0 else f"{b:.2g}"


def print_break_evens(results: dict, reference: str = "fp32 all-reduce") -> None:
    """The rate (Gbit/s through the filter) below which each method steps faster than ``reference``:
    measured (where the measured times cross, between the rates; "-": not inside the range), and as the
    model and the model with its measured terms predict it."""
    low, high = results["settings"]["rates_gbit"][0], results["settings"]["rates_gbit"][-1]
    print(f"steps faster than {reference} below (Gbit/s): measured between {low:g} and {high:g} | the model | "
          "with its measured terms")
    for name, refs in results["break_even"].items():
        if reference in refs:
            b = refs[reference]
            print(f"  {name:18s} {_gbit(b['measured_gbit']):>7s} | {_gbit(b['predicted_gbit']):>7s} | "
                  f"{_gbit(b['predicted_with_measured_terms_gbit']):>7s}")
