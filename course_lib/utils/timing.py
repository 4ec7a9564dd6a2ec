"""How the course times code on one process: warm up, repeat, take the median.

The median, not the mean, because a shared machine's slow outliers (another process taking the
core, a page fault) land on one side only. Timings across processes are in ``course_lib.bandwidth``.
"""

import statistics
import time

import torch

from course_lib.utils import checks

__all__ = ["median_seconds"]


def median_seconds(fn, repeats: int = 5, warmup: int = 1, once_above_s: float | None = None,
                   device: torch.device | str | None = None) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls
    (allocations, kernel selection, caches). With ``once_above_s``, a call whose warm-up took longer than
    that is timed once: the timer's noise is far below it, and repeating it only costs time.

    With a CUDA ``device``, the device is synchronized before and after each call: a GPU runs the
    kernels a call queues after the call has returned, and timing the call alone times the queueing."""
    if not callable(fn):
        raise TypeError(f"fn must be a function to call with no arguments (e.g. lambda: model(x)), got {fn!r}")
    checks.integer("repeats", repeats, 1)
    checks.integer("warmup", warmup, 0)
    cuda = device is not None and torch.device(device).type == "cuda"

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    warm_s = 0.0
    for _ in range(warmup):
        warm_s = timed()
    if once_above_s is not None and warmup and warm_s > once_above_s:
        repeats = 1
    return statistics.median(timed() for _ in range(repeats))
