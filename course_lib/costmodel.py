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

import torch

__all__ = ["ALGORITHMS", "alpha_beta_time", "fit_alpha_beta", "BUS_FACTORS", "bus_factor", "fit_ring_all_reduce",
           "predict_step_time", "INTERCONNECTS"]

ALGORITHMS = ("naive_all_reduce", "tree_broadcast", "tree_reduce", "ring_all_reduce")


def alpha_beta_time(op: str, nbytes: float, world_size: int, alpha: float, beta: float,
                    gamma: float = 0.0) -> float:
    """Predicted seconds for ``op`` (one of ``ALGORITHMS``) on ``nbytes`` per rank among ``world_size``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if min(nbytes, alpha, beta, gamma) < 0:
        raise ValueError("nbytes, alpha, beta and gamma must be >= 0")
    p, n = world_size, nbytes
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

    Returns ``(alpha, beta)``; both are clipped at 0 (noise can push a tiny alpha below zero).
    """
    x = torch.tensor([float(s) for s in sizes_bytes], dtype=torch.float64)
    y = torch.tensor([float(t) for t in times_s], dtype=torch.float64)
    if len(x) < 2:
        raise ValueError("need at least two sizes to fit alpha and beta")
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
    return BUS_FACTORS[op](world_size)


def fit_ring_all_reduce(rows: list[dict], world_size: int) -> tuple[float, float]:
    """alpha (s) and bus bandwidth (GB/s) of a ring all-reduce fitted to measured ``rows``.

    The ring's time is 2(p-1) alpha + n / busbw (nccl-tests' busbw is defined so that the
    bandwidth term is exactly that), a straight line in n: its intercept and slope give both.
    """
    intercept, slope = fit_alpha_beta([r["size_bytes"] for r in rows], [r["time_s"] for r in rows])
    alpha = intercept / (2 * (world_size - 1)) if world_size > 1 else 0.0
    return alpha, (1 / slope / 1e9 if slope > 0 else float("inf"))


def predict_step_time(compute_s: float, nbytes: float, collectives: int, world_size: int, busbw_GBps: float,
                      alpha_s: float) -> float:
    """Seconds per training step if the all-reduces do not overlap computation (the course's hooks):
    compute, plus for each ring all-reduce 2(p-1) alpha, plus all the bytes at the bus bandwidth."""
    if world_size == 1:
        return compute_s
    return compute_s + collectives * 2 * (world_size - 1) * alpha_s + nbytes / (busbw_GBps * 1e9)


# Interconnects for the what-if: bus bandwidth (GB/s) and a latency per message (s). Bandwidths
# from nccl-tests reports and NCCL's model (../shared/FACTS.md); latencies are typical orders of
# magnitude, an assumption stated in the multi-GPU notebook.
INTERCONNECTS = {
    "1 Gb/s Ethernet": (0.125, 50e-6),
    "10 Gb/s Ethernet": (1.25, 20e-6),
    "100 Gb/s Ethernet": (12.5, 10e-6),
    "PCIe Gen4 x16": (24.0, 5e-6),
    "NVLink (H100, 8 GPUs)": (400.0, 3e-6),
    "900 GB/s": (900.0, 3e-6),
}
