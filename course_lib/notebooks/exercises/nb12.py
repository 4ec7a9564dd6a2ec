"""Notebook 12's exercises (multi-GPU): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

from course_lib import (
    costmodel,
)
from course_lib.notebooks.exercises.core import _name, check


def _as_compressed(hook: dict) -> dict:
    """A ``{compute_s, bytes, collectives}`` entry as :func:`costmodel.predict_compressed_step_time` takes
    it: its all-reduces, the bytes shared among them (the time of a ring is linear in the bytes)."""
    n = hook["collectives"]
    return {"compute_s": hook["compute_s"], "codec_s": 0.0, "collectives": [("all_reduce", hook["bytes"] / n)] * n}


def _break_even_busbw(hook: dict, reference: dict, world_size: int, alpha_s: float) -> float:
    """The package's own answer: ``costmodel.break_even_bandwidth`` (a bisection, not the formula)."""
    return costmodel.break_even_bandwidth(_as_compressed(hook), _as_compressed(reference), world_size, alpha_s)


def check_break_even_bandwidth(student_fn) -> bool:
    """``student_fn(hook, reference, world_size, alpha_s)``: the bus bandwidth (GB/s) below which the hook's
    predicted step is faster than the reference's: ``math.inf`` if faster at every bandwidth, ``0.0`` if at
    none (as ``costmodel.break_even_bandwidth``), each a dict of compute_s, bytes, collectives."""
    allreduce = {"compute_s": 0.010, "bytes": 6_400_000, "collectives": 1}
    psgd = {"compute_s": 0.016, "bytes": 80_000, "collectives": 2}
    fp16 = {"compute_s": 0.011, "bytes": 3_200_000, "collectives": 1}
    cases = [(psgd, allreduce, 2, 10e-6), (psgd, allreduce, 8, 10e-6), (fp16, allreduce, 4, 20e-6),
             (allreduce, allreduce | {"compute_s": 0.02}, 2, 10e-6),  # less compute, the same bytes: always faster
             (fp16 | {"compute_s": 0.009}, allreduce, 4, 20e-6),  # fewer bytes and less compute: always faster
             (allreduce | {"compute_s": 0.02}, allreduce, 2, 10e-6),  # more compute, the same bytes: never
             (allreduce | {"compute_s": 0.02, "bytes": 7_000_000}, allreduce, 2, 10e-6),  # more of both: never
             (allreduce, allreduce, 4, 10e-6)]  # the same step: never faster
    return check(student_fn, _break_even_busbw, cases, name=_name(student_fn, "break_even_bandwidth"),
                 refuse=(costmodel.break_even_bandwidth,),
                 rtol=1e-4, atol=0)


# The ring fits' cases: timings made from known (alpha s, busbw GB/s) on p ranks, one p per case; the
# reference is those known numbers, not a fit.
_RING_FIT_TRUTH = {2: (20e-6, 1.3), 3: (50e-6, 12.5), 4: (5e-6, 24.0), 8: (3e-6, 370.0)}


def _ring_fit_case(world_size: int) -> tuple:
    alpha, busbw = _RING_FIT_TRUTH[world_size]
    sizes = [4096 * 4**k for k in range(9)]  # 4 KB to 256 MB, as the notebook's sweep
    times = [costmodel.ring_all_reduce_time(n, world_size, alpha, busbw) for n in sizes]
    return sizes, times, world_size


def _ring_fit_truth(sizes_bytes, times_s, world_size) -> tuple[float, float]:
    return _RING_FIT_TRUTH[world_size]


def check_ring_fit(student_fn) -> bool:
    """``student_fn(sizes_bytes, times_s, world_size)``: ``(alpha_s, busbw_GBps)`` of the ring all-reduce
    whose measured times these are, from a straight line fitted through them. The timings are made
    from known numbers on 2, 3, 4 and 8 ranks; the answer must give those numbers back."""
    cases = [_ring_fit_case(p) for p in (2, 3, 4, 8)]
    return check(student_fn, _ring_fit_truth, cases, name=_name(student_fn, "ring_fit"), rtol=1e-6, atol=0,
                 refuse=(costmodel.fit_ring_all_reduce, costmodel.fit_collective, costmodel.fit_alpha_beta))
