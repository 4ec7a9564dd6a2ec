"""Measuring collectives the way NVIDIA's nccl-tests does: time, algorithm and bus bandwidth.

* ``algbw = bytes / time``: how fast *this* operation moved the user's buffer.
* ``busbw = algbw * factor``: the speed each link must have run at, so that numbers for different
  world sizes and operations compare with each other and with the hardware's peak. The factor
  counts how much of the buffer crosses each rank's link in the best algorithm: 2(n-1)/n for
  all-reduce (reduce-scatter plus all-gather), (n-1)/n for all-gather and reduce-scatter, 1 for
  broadcast and reduce (nccl-tests, doc/PERFORMANCE.md).

``size_bytes`` is the size of the per-rank buffer for all-reduce, broadcast and reduce, and of the
*whole* gathered buffer for all-gather and reduce-scatter, as in nccl-tests.
"""

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["BUS_FACTORS", "bus_factor", "measure_collective", "sweep", "fit_ring_all_reduce", "predict_step_time"]

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


def _torch_op(op, n):
    if op == "all_reduce":
        return lambda t: dist.all_reduce(t)
    if op == "broadcast":
        return lambda t: dist.broadcast(t, src=0)
    if op == "reduce":
        return lambda t: dist.reduce(t, dst=0)
    if op == "all_gather":
        return lambda t: dist.all_gather_into_tensor(t, t.chunk(n)[dist.get_rank()].clone())
    if op == "reduce_scatter":
        return lambda t: dist.reduce_scatter_tensor(t.chunk(n)[dist.get_rank()].clone(), t)
    raise ValueError(op)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_collective(op: str, sizes_bytes, iters: int = 5, warmup: int = 1, device=None,
                       fn=None, dtype=torch.float32) -> list[dict]:
    """Time collective ``op`` at each size, inside a worker; one dict per size.

    Keys: ``size_bytes``, ``time_s`` (median over ``iters`` after ``warmup`` runs, of the slowest
    rank: the collective is done when the last rank is), ``algbw_GBps``, ``busbw_GBps``.
    ``fn(tensor)``, when given, replaces torch's implementation (e.g. ``ring_all_reduce``); the
    bus factor still comes from ``op``. On a GPU the device is synchronized around each timed run.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    n = dist.get_world_size()
    factor = bus_factor(op, n)
    device = torch.device(device) if device is not None else torch.device("cpu")
    run = fn or _torch_op(op, n)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for size in sizes_bytes:
        numel = max(1, int(size) // elem)
        if op in ("all_gather", "reduce_scatter"):  # the buffer splits into n equal shards
            numel = max(n, numel // n * n)
        t = torch.ones(numel, dtype=dtype, device=device)
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            run(t)
            _sync(device)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        median = statistics.median(slowest.tolist())
        nbytes = numel * elem
        algbw = nbytes / median / 1e9
        rows.append({"size_bytes": nbytes, "time_s": median, "algbw_GBps": algbw, "busbw_GBps": algbw * factor})
    return rows


def sweep(rank: int, world_size: int, ops=("all_reduce",), sizes_bytes=None, iters: int = 5,
          warmup: int = 1) -> dict:
    """Worker: :func:`measure_collective` for each op on this worker's device (``cuda:rank`` under
    NCCL, else the CPU). Sizes default to 4 KB-256 MB on a GPU, 4 KB-64 MB on a CPU."""
    from course_lib.launch import worker_device

    device = worker_device()
    if sizes_bytes is None:
        top = 256 * 2**20 if device.type == "cuda" else 64 * 2**20
        sizes_bytes = [4096 * 4**k for k in range(20) if 4096 * 4**k <= top]
    out = {"backend": dist.get_backend(), "device": str(device), "world_size": world_size}
    from course_lib.launch import report_progress

    for op in ops:
        for size in sizes_bytes:
            out.setdefault(op, []).extend(measure_collective(op, [size], iters=iters, warmup=warmup, device=device))
            report_progress()
    return out


def fit_ring_all_reduce(rows: list[dict], world_size: int) -> tuple[float, float]:
    """alpha (s) and bus bandwidth (GB/s) of a ring all-reduce fitted to measured ``rows``.

    The ring's time is 2(p-1) alpha + n / busbw (nccl-tests' busbw is defined so that the
    bandwidth term is exactly that), a straight line in n: its intercept and slope give both.
    """
    from course_lib.alphabeta import fit_alpha_beta

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
