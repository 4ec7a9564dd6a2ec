"""The latency-bandwidth (alpha-beta) cost model of collectives, and fitting it to a machine.

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
"""

import math
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["ALGORITHMS", "alpha_beta_time", "fit_alpha_beta", "ping_pong", "time_algorithms", "measure_gamma"]

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


def _bounce(t: torch.Tensor, rank: int) -> None:
    """One round trip of ``t``: rank 0 sends it to rank 1, which sends it back. Other ranks idle."""
    if rank == 0:
        dist.send(t, dst=1)
        dist.recv(t, src=1)
    elif rank == 1:
        dist.recv(t, src=0)
        dist.send(t, dst=0)


def ping_pong(rank: int, world_size: int, sizes_bytes, iters: int = 5) -> list[tuple[int, float]]:
    """Worker: ranks 0 and 1 bounce a message back and forth; one-way seconds per size (median).

    Other ranks only wait. Returns ``[(nbytes, seconds), ...]`` on every rank (rank 0's numbers).
    """
    out = []
    warm = torch.zeros(1)
    for _ in range(20):  # the first messages between two processes are slow: connections, caches
        _bounce(warm, rank)
    for size in sizes_bytes:
        t = torch.zeros(max(1, int(size) // 4), dtype=torch.float32)
        times = []
        for i in range(iters + 1):  # the first round trip warms the connection up
            dist.barrier()
            start = time.perf_counter()
            _bounce(t, rank)
            if i:
                times.append((time.perf_counter() - start) / 2)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.broadcast(med, src=0)
        out.append((t.numel() * 4, med.item()))
    return out


def time_algorithms(rank: int, world_size: int, sizes_bytes, iters: int = 3) -> dict:
    """Worker: median time of each course algorithm and of gloo's own all-reduce, per size."""
    from course_lib import collectives as C
    from course_lib.bandwidth import measure_collective

    runs = {
        "naive_all_reduce": ("all_reduce", C.naive_all_reduce),
        "ring_all_reduce": ("all_reduce", C.ring_all_reduce),
        "tree_broadcast": ("broadcast", C.tree_broadcast),
        "tree_reduce": ("reduce", C.tree_reduce),
        "torch all_reduce": ("all_reduce", None),
    }
    from course_lib.launch import report_progress

    out = {}
    for name, (op, fn) in runs.items():
        out[name] = measure_collective(op, sizes_bytes, iters=iters, warmup=1, fn=fn)
        report_progress()
    return out


def measure_gamma(nbytes: int = 16 * 2**20, iters: int = 7, threads: int = 1) -> float:
    """Seconds per byte of an in-place float32 addition ``a += b``, as a worker does it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        times = []
        for _ in range(iters + 1):
            start = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) / (a.numel() * 4)
    finally:
        torch.set_num_threads(saved)
