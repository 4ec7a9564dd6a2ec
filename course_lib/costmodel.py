"""The cost of communication on paper: the latency-bandwidth (alpha-beta) model, bus bandwidth, fits.

Sending n bytes costs ``alpha + n * beta``: alpha is the per-message latency (seconds), beta the
time per byte (1 / bandwidth). Adding n bytes costs ``n * gamma``. With p processes, the costs of
the algorithms in ``course_lib.collectives`` are (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005):

* naive all-reduce through one root: 2(p-1)(alpha + n beta) + (p-1) n gamma
* binomial-tree broadcast: ceil(log2 p)(alpha + n beta)
* binomial-tree reduce: ceil(log2 p)(alpha + n beta + n gamma)
* ring all-reduce: 2(p-1) alpha + 2((p-1)/p) n beta + ((p-1)/p) n gamma

The naive root pays for every other rank's message in full; the tree pays log p full messages;
the ring pays a constant 2 n beta however many ranks there are, which is why large all-reduces use it.

Bus bandwidth, as NVIDIA's nccl-tests reports it (doc/PERFORMANCE.md): ``algbw = bytes / time`` is
how fast an operation moved the user's buffer; ``busbw = algbw * factor`` is the speed each link must
have run at, so that numbers for different world sizes and operations compare with each other and
with the hardware's peak. The factor counts how much of the buffer crosses each rank's link in the
best algorithm: 2(n-1)/n for all-reduce (reduce-scatter plus all-gather), (n-1)/n for all-gather and
reduce-scatter, 1 for broadcast and reduce.

Only arithmetic here: measuring a machine (timing collectives in workers) is ``course_lib.bandwidth``.
"""

import math
from typing import NamedTuple

import torch

from course_lib.utils import checks

__all__ = ["ALGORITHMS", "alpha_beta_time", "fit_alpha_beta", "BUS_FACTORS", "bus_factor", "ring_all_reduce_time",
           "below_which", "ring_crossover_bytes", "fit_ring_all_reduce", "predict_step_time", "Interconnect",
           "INTERCONNECTS", "collective_time", "fit_collective", "fit_residuals", "predict_compressed_step_time",
           "break_even_bandwidth", "periodic_step_time", "break_even_period"]

ALGORITHMS = ("naive_all_reduce", "tree_broadcast", "tree_reduce", "ring_all_reduce")


def _check_link(world_size, alpha_s, busbw_GBps=1.0, nbytes=0.0) -> None:
    # A negative or NaN input would otherwise come out as a negative or NaN time, without a word.
    checks.integer("world_size", world_size, 1)
    checks.number("alpha_s (seconds)", alpha_s, 0)
    checks.number("nbytes", nbytes, 0)
    # inf is allowed: a link whose bandwidth costs nothing (what a fit with no slope returns)
    if isinstance(busbw_GBps, bool) or not isinstance(busbw_GBps, (int, float)) or not busbw_GBps > 0:
        raise ValueError(f"busbw_GBps must be a number > 0 (GB/s), got {busbw_GBps!r}")


def alpha_beta_time(op: str, nbytes: float, world_size: int, alpha_s: float, beta_s_per_byte: float,
                    gamma_s_per_byte: float = 0.0) -> float:
    """Predicted seconds for ``op`` (one of ``ALGORITHMS``) on ``nbytes`` per rank among ``world_size``:
    ``alpha_s`` per message, ``beta_s_per_byte`` per byte sent (1 / bandwidth), ``gamma_s_per_byte``
    per byte reduced (the addition's own cost)."""
    checks.integer("world_size", world_size, 1)
    for name, value in (("nbytes", nbytes), ("alpha_s", alpha_s), ("beta_s_per_byte", beta_s_per_byte),
                        ("gamma_s_per_byte", gamma_s_per_byte)):
        checks.number(name, value, 0)
    p, n, alpha, beta, gamma = world_size, nbytes, alpha_s, beta_s_per_byte, gamma_s_per_byte
    if p == 1:
        return 0.0
    if op == "naive_all_reduce":
        return 2 * (p - 1) * (alpha + n * beta) + (p - 1) * n * gamma
    if op == "tree_broadcast":
        return math.ceil(math.log2(p)) * (alpha + n * beta)
    if op == "tree_reduce":
        return math.ceil(math.log2(p)) * (alpha + n * beta + n * gamma)
    if op == "ring_all_reduce":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    raise ValueError(f"unknown algorithm {op!r}: use one of {ALGORITHMS}")


def fit_alpha_beta(sizes_bytes, times_s) -> tuple[float, float]:
    """Least-squares fit of ``time = alpha + size * beta``, weighted so small and large sizes count alike.

    Returns ``(alpha_s, beta_s_per_byte)``, as :func:`alpha_beta_time` takes them; both are clipped
    at 0 (noise can push a tiny alpha below zero).
    """
    sizes_bytes, times_s = list(sizes_bytes), list(times_s)
    if len(sizes_bytes) != len(times_s):
        raise ValueError(f"got {len(sizes_bytes)} sizes and {len(times_s)} times: one time per size")
    for size, t in zip(sizes_bytes, times_s):
        checks.number("a size (bytes)", size, 0)
        checks.number("a time (seconds; the fit weighs each by 1/time)", t, 0, low_open=True)
    x = torch.tensor([float(s) for s in sizes_bytes], dtype=torch.float64)
    y = torch.tensor([float(t) for t in times_s], dtype=torch.float64)
    if len(set(sizes_bytes)) < 2:
        raise ValueError(f"need at least two different sizes to fit alpha and beta, got {sizes_bytes}")
    w = 1.0 / y  # relative errors: otherwise the largest message decides everything
    a = torch.stack([torch.ones_like(x), x], dim=1) * w[:, None]
    sol = torch.linalg.lstsq(a, (y * w)[:, None]).solution.flatten()
    return max(sol[0].item(), 0.0), max(sol[1].item(), 0.0)


BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: use one of {sorted(BUS_FACTORS)}")
    checks.integer("world_size", world_size, 1)
    return BUS_FACTORS[op](world_size)


def ring_all_reduce_time(nbytes: float, world_size: int, alpha_s: float, busbw_GBps: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` per rank, from latency and *bus* bandwidth.

    ``2(p-1) alpha + 2(p-1)/p * n / busbw``: the ring's ``2(p-1)/p * n * beta`` with nccl-tests'
    busbw (``algbw * 2(p-1)/p``) standing for the link's ``1 / beta``. At p = 2 the factor is 1, and
    busbw equals algbw; at 8 ranks it is 1.75. The package's one statement of this formula.
    """
    _check_link(world_size, alpha_s, busbw_GBps, nbytes)
    if world_size == 1:
        return 0.0
    return 2 * (world_size - 1) * alpha_s + bus_factor("all_reduce", world_size) * nbytes / (busbw_GBps * 1e9)


def ring_crossover_bytes(world_size: int, alpha_s: float, busbw_GBps: float) -> float:
    """The size at which a ring all-reduce's two terms are equal, ``2(p-1) alpha = 2(p-1)/p * n / busbw``:
    ``n* = p alpha busbw``. Smaller messages are latency-bound, larger ones bandwidth-bound."""
    checks.integer("world_size (a ring of one rank has no crossover)", world_size, 2)
    latency = ring_all_reduce_time(0, world_size, alpha_s, busbw_GBps)
    return latency * busbw_GBps * 1e9 / bus_factor("all_reduce", world_size)


def _sizes_and_times(rows) -> tuple[list, list]:
    """The ``size_bytes`` and ``time_s`` of measured rows (what ``course_lib.bandwidth`` returns)."""
    try:
        return [r["size_bytes"] for r in rows], [r["time_s"] for r in rows]
    except (KeyError, TypeError):
        raise ValueError("rows must be measurements as course_lib.bandwidth returns them: dicts with "
                         f"'size_bytes' and 'time_s', got {list(rows)[:2]!r}") from None


def fit_ring_all_reduce(rows: list[dict], world_size: int) -> tuple[float, float]:
    """alpha (s) and bus bandwidth (GB/s) of a ring all-reduce fitted to measured ``rows``.

    :func:`ring_all_reduce_time` is a straight line in n: intercept ``2(p-1) alpha``, slope
    ``2(p-1)/p / busbw``. A least-squares line through the measurements gives both.
    """
    if world_size < 2:
        raise ValueError(f"a ring all-reduce needs world_size >= 2 to be fitted, got {world_size}")
    intercept, slope = fit_alpha_beta(*_sizes_and_times(rows))
    alpha = intercept / (2 * (world_size - 1))
    return alpha, (bus_factor("all_reduce", world_size) / slope / 1e9 if slope > 0 else float("inf"))


def predict_step_time(compute_s: float, nbytes: float, collectives: int, world_size: int, alpha_s: float,
                      busbw_GBps: float) -> float:
    """Seconds per training step if the all-reduces do not overlap computation (the course's hooks):
    compute, plus ``collectives`` ring all-reduces that together carry ``nbytes`` per rank."""
    checks.number("compute_s", compute_s, 0)
    checks.number("collectives", collectives, 0)
    _check_link(world_size, alpha_s, busbw_GBps, nbytes)
    if world_size == 1:
        return compute_s
    latency = ring_all_reduce_time(0, world_size, alpha_s, busbw_GBps)  # 2(p-1) alpha, paid per all-reduce
    bandwidth = ring_all_reduce_time(nbytes, world_size, alpha_s, busbw_GBps) - latency  # paid per byte
    return compute_s + collectives * latency + bandwidth


def collective_time(op: str, nbytes: float, world_size: int, alpha_s: float, busbw_GBps: float) -> float:
    """Seconds of one ring collective in which each rank contributes ``nbytes``, on links of ``busbw_GBps``.

    * ``"all_reduce"``: ``2(p-1) alpha + 2(p-1)/p * n / busbw`` (:func:`ring_all_reduce_time`);
    * ``"all_gather"``: ``(p-1) alpha + (p-1) * n / busbw``: each rank receives the p - 1 other
      payloads whole, so its time grows with p where the all-reduce's stays near ``2 n / busbw``.
    """
    if op == "all_reduce":
        return ring_all_reduce_time(nbytes, world_size, alpha_s, busbw_GBps)
    if op == "all_gather":
        _check_link(world_size, alpha_s, busbw_GBps, nbytes)
        return (world_size - 1) * (alpha_s + nbytes / (busbw_GBps * 1e9))
    raise ValueError(f"unknown collective {op!r}: use 'all_reduce' or 'all_gather'")


def fit_collective(rows: list[dict], op: str, world_size: int) -> tuple[float, float]:
    """alpha (s) and bus bandwidth (GB/s) of ``op`` fitted to measured ``rows`` (``course_lib.bandwidth``:
    ``size_bytes`` is the whole buffer, p payloads for an all-gather), so that :func:`collective_time`
    reproduces them."""
    if op == "all_reduce":
        return fit_ring_all_reduce(rows, world_size)
    if op != "all_gather":
        raise ValueError(f"unknown collective {op!r}: use 'all_reduce' or 'all_gather'")
    if world_size < 2:
        raise ValueError(f"an all-gather needs world_size >= 2 to be fitted, got {world_size}")
    # time = (p-1) alpha + (p-1)/p * N / busbw for a buffer of N = p n bytes
    intercept, slope = fit_alpha_beta(*_sizes_and_times(rows))
    busbw = bus_factor("all_gather", world_size) / slope / 1e9 if slope > 0 else float("inf")
    return intercept / (world_size - 1), busbw


def fit_residuals(rows: list[dict], op: str, world_size: int, alpha_s: float, busbw_GBps: float) -> list[float]:
    """Measured / fitted time at each of ``rows`` (as :func:`fit_collective` takes them) for ``op`` on
    the link ``(alpha_s, busbw_GBps)``: 1 where the line goes through a point, above 1 where the
    measurement took longer. An all-gather's ``size_bytes`` is its whole buffer, p payloads."""
    sizes, times = _sizes_and_times(rows)
    per_rank = [n / world_size if op == "all_gather" else n for n in sizes]
    return [t / collective_time(op, n, world_size, alpha_s, busbw_GBps) for n, t in zip(per_rank, times)]


def predict_compressed_step_time(compute_s: float, codec_s: float, collectives, world_size: int,
                                 links: dict, overlap_s: float = 0.0, wait_s: float = 0.0) -> float:
    """Seconds per step of a compressed hook: compute, encode + decode, and the communication that
    computation does not hide.

    ``collectives``: ``[(op, nbytes), ...]`` issued per step (what ``hooks.traffic.by_op`` counts);
    ``links``: ``{op: (alpha_s, busbw_GBps)}`` (one link for both ops, or each op's own fit);
    ``overlap_s``: the computation the communication can run behind. DDP starts a bucket's
    all-reduce while backward goes on with the next bucket, so an asynchronous hook on many buckets
    hides up to the rest of backward; a hook that compresses and communicates inside its call (as
    :func:`course_lib.compression.compression_hook` does) or a single bucket hides nothing: 0.
    ``wait_s``: what a step that communicates spends waiting for the slowest rank, beyond alpha (a
    benchmark that starts its ranks together with a barrier does not see it); 0 if it sends nothing.
    """
    for name, value in (("compute_s", compute_s), ("codec_s", codec_s), ("overlap_s", overlap_s), ("wait_s", wait_s)):
        checks.number(name, value, 0)
    if not collectives:
        return compute_s + codec_s
    comm = sum(collective_time(op, nbytes, world_size, *links[op]) for op, nbytes in collectives)
    return compute_s + codec_s + wait_s + max(0.0, comm - overlap_s)


def break_even_bandwidth(method: dict, reference: dict, world_size: int, alpha_s: float,
                         method_steps: float = 1.0, reference_steps: float = 1.0) -> float:
    """The link bandwidth (GB/s) below which ``method`` steps faster than ``reference``, both given as
    the keyword arguments of :func:`predict_compressed_step_time` (``compute_s``, ``codec_s``,
    ``collectives``, ``overlap_s``) on one link of latency ``alpha_s``. ``inf`` when the method is
    faster at every bandwidth, ``0.0`` when at none (bisection in log space between 1 MB/s and 1 PB/s).

    With ``method_steps`` and ``reference_steps``, the steps each needs to reach the same accuracy,
    it compares times to that accuracy (steps x step time) instead: a method that steps faster but
    needs more steps pays below a lower bandwidth, or never."""
    checks.integer("world_size", world_size, 1)
    checks.number("alpha_s (seconds)", alpha_s, 0)
    checks.number("method_steps", method_steps, 0, low_open=True)
    checks.number("reference_steps", reference_steps, 0, low_open=True)

    def gap(busbw):
        links = {"all_reduce": (alpha_s, busbw), "all_gather": (alpha_s, busbw)}
        return (method_steps * predict_compressed_step_time(world_size=world_size, links=links, **method)
                - reference_steps * predict_compressed_step_time(world_size=world_size, links=links, **reference))

    low, high = 1e-3, 1e6
    if gap(high) < 0 <= gap(low):
        raise ValueError("the method is faster only above some bandwidth, not below one: swap method and "
                         "reference to get the bandwidth below which the reference is faster")
    return below_which(gap, low, high)


def below_which(gap, low: float, high: float, iterations: int = 200) -> float:
    """The x between ``low`` and ``high`` below which ``gap(x)`` is negative, for a gap that turns from
    negative to non-negative once as x grows (a method's step time minus a reference's, against the
    bandwidth): ``inf`` if it is negative even at ``high``, ``0.0`` if not even at ``low``; else
    bisection in log x."""
    if gap(high) < 0:
        return float("inf")
    if gap(low) >= 0:
        return 0.0
    for _ in range(iterations):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    return math.sqrt(low * high)


class Interconnect(NamedTuple):
    """An interconnect for the what-if: all-reduce bus bandwidth, latency per message, and the source."""

    busbw_GBps: float
    latency_s: float  # an assumed typical order of magnitude, not a measurement
    source: str  # where busbw_GBps comes from, and what it means


# One table. Ethernet rows are line rates: a ring's busbw cannot exceed its slowest link, so these
# are upper bounds. The GPU rows are measured or modelled all-reduce busbw:
# nccl-tests issue #212 (8 x H100 over NVLink: about 370 GB/s ring, about 480 GB/s with NVLink
# SHARP) and NCCL's topology model (24 GB/s for a PCIe Gen4 x16 link). The latencies are typical
# orders of magnitude, an assumption stated in the multi-GPU notebook.
INTERCONNECTS = {
    "1 Gb/s Ethernet": Interconnect(0.125, 50e-6, "line rate, 1 Gb/s = 0.125 GB/s (an upper bound)"),
    "10 Gb/s Ethernet": Interconnect(1.25, 20e-6, "line rate (an upper bound)"),
    "100 Gb/s Ethernet": Interconnect(12.5, 10e-6, "line rate (an upper bound)"),
    "PCIe Gen4 x16": Interconnect(24.0, 5e-6, "NCCL's model of a PCIe Gen4 x16 link"),
    "NVLink, 8 H100 (ring)": Interconnect(370.0, 3e-6, "nccl-tests issue #212: ring all-reduce, 8 H100"),
    "NVLink SHARP, 8 H100": Interconnect(480.0, 3e-6, "nccl-tests issue #212: all-reduce with NVLS, 8 H100"),
}


def periodic_step_time(compute_s: float, nbytes: float, period: int, world_size: int, alpha_s: float,
                       busbw_GBps: float) -> float:
    """Seconds per step, on average, when the ranks all-reduce ``nbytes`` (the parameters, or DiLoCo's
    pseudo-gradient) once every ``period`` steps and compute alone in between: compute, plus one ring
    all-reduce (:func:`ring_all_reduce_time`) shared by ``period`` steps."""
    checks.number("compute_s", compute_s, 0)
    checks.integer("period", period, 1)
    return compute_s + ring_all_reduce_time(nbytes, world_size, alpha_s, busbw_GBps) / period


def break_even_period(compute_s: float, nbytes: float, reference_step_s: float, world_size: int, alpha_s: float,
                      busbw_GBps: float) -> float:
    """The smallest period H at which averaging every H steps (:func:`periodic_step_time`) steps faster
    than a reference that takes ``reference_step_s`` per step (e.g. a compressor's predicted step time):
    the first integer H > T / (reference_step_s - compute_s), T being the all-reduce's time. ``inf`` when
    the reference is no slower than computing alone (no period beats it)."""
    checks.number("reference_step_s", reference_step_s, 0)
    checks.number("compute_s", compute_s, 0)
    spare = reference_step_s - compute_s
    if spare <= 0:
        return float("inf")
    period = math.floor(ring_all_reduce_time(nbytes, world_size, alpha_s, busbw_GBps) / spare) + 1
    # The division rounds: settle the last step on the step times themselves, a few steps at most.
    # Where the reference lies within a rounding step of compute_s, no period's time can be told
    # apart from it: that is an error, not a search without end.
    def faster(h: int) -> bool:
        return periodic_step_time(compute_s, nbytes, h, world_size, alpha_s, busbw_GBps) < reference_step_s

    for _ in range(_SETTLE_STEPS):
        if faster(period):
            break
        period += 1
    else:
        raise ValueError(f"reference_step_s ({reference_step_s!r}) is within rounding of compute_s ({compute_s!r}): "
                         f"no period's step time can be told apart from it; give times further apart")
    for _ in range(_SETTLE_STEPS):
        if period == 1 or not faster(period - 1):
            return float(period)
        period -= 1
    raise ValueError(f"break_even_period could not settle the period near {period} (reference_step_s "
                     f"{reference_step_s!r}, compute_s {compute_s!r}): give times further apart")


_SETTLE_STEPS = 64  # how far rounding can move the period found by division
