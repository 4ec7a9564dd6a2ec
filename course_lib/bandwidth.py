"""Measuring collectives on this machine, inside worker processes: the numbers the cost model is fitted to.

* :func:`measure_collective` and :func:`sweep` time a collective the way NVIDIA's nccl-tests does
  and report its algorithm and bus bandwidth (definitions in ``course_lib.costmodel``);
* :func:`ping_pong` times point-to-point messages, to fit alpha and beta; :func:`measure_gamma`
  times an addition;
* :func:`time_algorithms` times the course's own collectives against gloo's all-reduce.

``size_bytes`` is the size of the per-rank buffer for all-reduce, broadcast and reduce, and of the
*whole* gathered buffer for all-gather and reduce-scatter, as in nccl-tests.
"""

import statistics
import time

import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib.costmodel import bus_factor
from course_lib.launch import report_progress, worker_device
from course_lib.support.timing import median_seconds

__all__ = ["measure_collective", "sweep", "ping_pong", "time_algorithms", "measure_gamma"]


def _torch_op(op, n):
    if op == "all_reduce":
        return lambda t: dist.all_reduce(t)
    if op == "broadcast":
        return lambda t: dist.broadcast(t, src=0)
    if op == "reduce":
        return lambda t: dist.reduce(t, dst=0)
    if op == "all_gather":
        # (all_gather_into_tensor under its newer name, which does not warn that it is deprecated)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda t: gather(t, t.chunk(n)[dist.get_rank()].clone())
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
    device = worker_device()
    if sizes_bytes is None:
        top = 256 * 2**20 if device.type == "cuda" else 64 * 2**20
        sizes_bytes = [4096 * 4**k for k in range(20) if 4096 * 4**k <= top]
    out = {"backend": dist.get_backend(), "device": str(device), "world_size": world_size}
    for op in ops:
        for size in sizes_bytes:
            out.setdefault(op, []).extend(measure_collective(op, [size], iters=iters, warmup=warmup, device=device))
            report_progress()
    return out


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
    runs = {
        "naive_all_reduce": ("all_reduce", C.naive_all_reduce),
        "ring_all_reduce": ("all_reduce", C.ring_all_reduce),
        "tree_broadcast": ("broadcast", C.tree_broadcast),
        "tree_reduce": ("reduce", C.tree_reduce),
        "torch all_reduce": ("all_reduce", None),
    }
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
        return median_seconds(lambda: a.add_(b), repeats=iters, warmup=1) / (a.numel() * 4)
    finally:
        torch.set_num_threads(saved)
