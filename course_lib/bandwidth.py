"""Measuring collectives on this machine, inside worker processes: the numbers the cost model is fitted to.

* :func:`measure_like_nccl_tests` times a collective the way NVIDIA's nccl-tests does (warm-up
  iterations, then a timed loop of back-to-back iterations, the mean per iteration, averaged over
  ranks) and reports its algorithm and bus bandwidth (definitions in ``course_lib.costmodel``);
* :func:`measure_collective` times each run on its own between barriers (the slowest rank, the
  median of the runs): what one collective issued after a synchronization costs;
* :func:`sweep` runs either over sizes and ops, in a worker;
* :func:`one_message` times one message from rank 0 to rank 1 on :func:`measure_collective`'s harness,
  the one the algorithms are timed with: what alpha and beta are fitted to; :func:`ping_pong` times
  half a round trip, the textbook's way, to set beside it; :func:`measure_gamma` times an addition;
* :func:`time_algorithms` times the course's own collectives against gloo's all-reduce;
* :func:`concurrent_messages` times 1, 2, … messages in flight at once, and the cores they keep busy
  (:func:`time_with_cpu`): whether ranks on one machine have a link each, as the α-β model assumes.

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
from course_lib.utils import checks
from course_lib.utils.timing import median_seconds

__all__ = ["measure_like_nccl_tests", "time_like_nccl_tests", "measure_collective", "METHODS", "sweep", "one_message",
           "send_to_rank_1", "ping_pong",
           "time_algorithms", "measure_gamma", "time_with_cpu", "concurrent_messages"]


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


OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")


def _check_op(op) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def _check_loop(iters, warmup) -> None:
    checks.integer("iters", iters, 1)
    checks.integer("warmup", warmup, 0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buffer(op: str, size_bytes: int, n: int, dtype, device) -> torch.Tensor:
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(1, int(size_bytes) // elem)
    if op in ("all_gather", "reduce_scatter"):  # the buffer splits into n equal shards
        numel = max(n, numel // n * n)
    return torch.ones(numel, dtype=dtype, device=device)


def _row(t: torch.Tensor, time_s: float, factor: float) -> dict:
    nbytes = t.numel() * t.element_size()
    algbw = nbytes / time_s / 1e9
    return {"size_bytes": nbytes, "time_s": time_s, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}


def time_like_nccl_tests(run, tensor: torch.Tensor, iters: int = 20, warmup: int = 5, device=None) -> float:
    """Seconds per iteration of ``run(tensor)``, as nccl-tests times it, inside a worker.

    ``warmup`` untimed runs; a barrier; ``iters`` runs back to back, timed as one loop (on a GPU the
    device is synchronized once, after the loop); the loop's time divided by ``iters`` on each rank;
    then the mean over ranks (nccl-tests' default ``-a 1``). Every rank returns the same number.
    """
    _check_loop(iters, warmup)
    device = torch.device(device) if device is not None else tensor.device
    for _ in range(warmup):
        run(tensor)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run(tensor)
    _sync(device)
    per_iter = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(per_iter)  # sum over ranks, then the mean
    return per_iter.item() / dist.get_world_size()


def _prepare(op: str, sizes_bytes, iters: int, warmup: int, device, fn) -> tuple:
    """What both measurements start with: arguments checked, then ``(sizes, world size, bus factor,
    device, the function to time)``."""
    _check_op(op)
    _check_loop(iters, warmup)
    sizes_bytes = checks.integers("sizes_bytes", sizes_bytes, 1)
    n = dist.get_world_size()
    device = torch.device(device) if device is not None else torch.device("cpu")
    return sizes_bytes, n, bus_factor(op, n), device, fn or _torch_op(op, n)


def measure_like_nccl_tests(op: str, sizes_bytes, iters: int = 20, warmup: int = 5, device=None,
                            fn=None, dtype=torch.float32) -> list[dict]:
    """Time collective ``op`` at each size as nccl-tests does (:func:`time_like_nccl_tests`: its
    defaults ``-w 5 -n 20``), inside a worker; one dict per size, keys as :func:`measure_collective`'s.

    How it differs from nccl-tests: one buffer, in place (nccl-tests also times out-of-place), and no
    correctness column. ``fn(tensor)``, when given, replaces torch's implementation; the bus factor
    still comes from ``op``.
    """
    sizes_bytes, n, factor, device, run = _prepare(op, sizes_bytes, iters, warmup, device, fn)
    rows = []
    for size in sizes_bytes:
        t = _buffer(op, size, n, dtype, device)
        rows.append(_row(t, time_like_nccl_tests(run, t, iters=iters, warmup=warmup, device=device), factor))
    return rows


def measure_collective(op: str, sizes_bytes, iters: int = 5, warmup: int = 1, device=None,
                       fn=None, dtype=torch.float32) -> list[dict]:
    """Time collective ``op`` at each size, each run on its own between barriers, inside a worker;
    one dict per size.

    Keys: ``size_bytes``, ``time_s`` (median over ``iters`` after ``warmup`` runs, of the slowest
    rank: the collective is done when the last rank is), ``algbw_GBps``, ``busbw_GBps``.
    ``fn(tensor)``, when given, replaces torch's implementation (e.g. ``ring_all_reduce``); the
    bus factor still comes from ``op``. On a GPU the device is synchronized around each timed run.
    Unlike :func:`measure_like_nccl_tests`, each time includes leaving the barrier, as a collective
    issued once per training step does.
    """
    sizes_bytes, n, factor, device, run = _prepare(op, sizes_bytes, iters, warmup, device, fn)
    rows = []
    for size in sizes_bytes:
        t = _buffer(op, size, n, dtype, device)
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
        rows.append(_row(t, statistics.median(slowest.tolist()), factor))
    return rows


METHODS = {"barrier": measure_collective, "nccl-tests": measure_like_nccl_tests}


def sweep(rank: int, world_size: int, ops=("all_reduce",), sizes_bytes=None, iters: int = 5,
          warmup: int = 1, method: str = "barrier") -> dict:
    """Worker: time each op at each size on this worker's device (``cuda:rank`` under NCCL, else the
    CPU). ``method``: ``"barrier"`` (:func:`measure_collective`) or ``"nccl-tests"``
    (:func:`measure_like_nccl_tests`; pass ``iters=20, warmup=5`` for its defaults). Sizes default
    to 4 KB-256 MB on a GPU, 4 KB-64 MB on a CPU."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {sorted(METHODS)}")
    if isinstance(ops, str):
        ops = (ops,)
    for op in ops:
        _check_op(op)
    _check_loop(iters, warmup)
    if sizes_bytes is not None:
        sizes_bytes = checks.integers("sizes_bytes", sizes_bytes, 1)
    device = worker_device()
    if sizes_bytes is None:
        top = 256 * 2**20 if device.type == "cuda" else 64 * 2**20
        sizes_bytes = [4096 * 4**k for k in range(20) if 4096 * 4**k <= top]
    out = {"backend": dist.get_backend(), "device": str(device), "world_size": world_size, "method": method}
    for op in ops:
        for size in sizes_bytes:
            out.setdefault(op, []).extend(METHODS[method](op, [size], iters=iters, warmup=warmup, device=device))
            report_progress()
    return out


def send_to_rank_1(t: torch.Tensor) -> None:
    """One message: rank 0 sends ``t`` to rank 1, which receives it into its own ``t``. Other ranks idle."""
    rank = dist.get_rank()
    if rank == 0:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)


def one_message(rank: int, world_size: int, sizes_bytes, iters: int = 5, warmup: int = 1) -> list[dict]:
    """Worker: one message of each size from rank 0 to rank 1, timed as :func:`measure_collective`
    times the collectives (each run on its own between barriers, the slowest rank, the median of
    ``iters`` after ``warmup``): alpha and beta fitted to these rows are tested on the same harness.

    One dict per size, keys as :func:`measure_collective`'s (``busbw_GBps`` = ``algbw_GBps``: one
    message crosses one link). Other ranks only wait at the barriers. As in :func:`ping_pong`, 20
    untimed messages first: the first between two processes are slow (connections, caches).
    """
    if world_size < 2:
        raise ValueError(f"one_message needs 2 or more ranks (rank 0 sends to rank 1), got world_size={world_size}")
    warm = torch.zeros(1)
    for _ in range(20):
        send_to_rank_1(warm)
    return measure_collective("broadcast", sizes_bytes, iters=iters, warmup=warmup, fn=send_to_rank_1)


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
    if world_size < 2:
        raise ValueError(f"ping_pong needs 2 or more ranks (0 and 1 bounce the message), got world_size={world_size}")
    sizes_bytes = checks.integers("sizes_bytes", sizes_bytes, 1)
    checks.integer("iters", iters, 1)
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
    sizes_bytes = checks.integers("sizes_bytes", sizes_bytes, 1)
    checks.integer("iters", iters, 1)
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
    checks.integer("nbytes", nbytes, 4)
    checks.integer("iters", iters, 1)
    checks.integer("threads", threads, 1)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        return median_seconds(lambda: a.add_(b), repeats=iters, warmup=1) / (a.numel() * 4)
    finally:
        torch.set_num_threads(saved)


def time_with_cpu(run, tensor: torch.Tensor, iters: int = 5, warmup: int = 1) -> tuple[float, float]:
    """Inside a worker: ``(seconds, cpu_seconds)`` of ``run(tensor)``, each run on its own between barriers.

    ``seconds``: the median over runs of the slowest rank's wall-clock time, as in :func:`measure_collective`.
    ``cpu_seconds``: the median over runs of the CPU time of every rank's process (all its threads,
    gloo's included), added up over ranks. Their ratio is how many cores the run kept busy on average:
    on one machine the bytes of a message are copied by its cores, so this says how much of the
    machine a transfer takes. Every rank returns the same pair.
    """
    _check_loop(iters, warmup)
    for _ in range(warmup):
        run(tensor)
    walls, cpus = [], []
    for _ in range(iters):
        dist.barrier()
        cpu0, start = time.process_time(), time.perf_counter()
        run(tensor)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu0)
    wall = torch.tensor(walls, dtype=torch.float64)
    cpu = torch.tensor(cpus, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a run is over when its last rank is
    dist.all_reduce(cpu)  # the machine's CPU time: every rank's, added up
    return statistics.median(wall.tolist()), statistics.median(cpu.tolist())


def concurrent_messages(rank: int, world_size: int, sizes_bytes, senders: int | None = None,
                        iters: int = 5) -> list[dict]:
    """Worker: ranks 0 … ``senders`` − 1 (default: all) each send one message of n bytes to their right
    neighbour, all at once; each rank whose left neighbour sends receives it. One row per size.

    With 2 ranks, ``senders=1`` is one message (the ping-pong's one way), ``senders=2`` an exchange;
    with p ranks and every rank sending, one step of the ring. Keys: ``size_bytes`` (per message),
    ``messages`` (how many were in flight at once), ``time_s`` and ``cpu_s`` (:func:`time_with_cpu`),
    ``cores_busy`` (their ratio) and ``wrong`` (elements received that differ from what the sender
    sent, added over ranks, as nccl-tests' #wrong column: 0 when the messages went where they should).
    """
    senders = world_size if senders is None else senders
    if not 1 <= senders <= world_size or world_size < 2:
        raise ValueError(f"need 2 or more ranks and 1 <= senders <= world_size, got {senders} of {world_size}")
    sizes_bytes = checks.integers("sizes_bytes", sizes_bytes, 1)
    checks.integer("iters", iters, 1)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    sends, receives = rank < senders, left < senders
    rows = []
    for size in sizes_bytes:
        numel = max(1, int(size) // 4)
        out = torch.full((numel,), float(rank + 1))
        incoming = torch.zeros(numel)

        def run(_, out=out, incoming=incoming):
            works = [dist.irecv(incoming, src=left)] if receives else []
            if sends:
                works.append(dist.isend(out, dst=right))
            for work in works:
                work.wait()

        seconds, cpu_s = time_with_cpu(run, out, iters=iters)
        incoming.zero_()  # one more run, untimed, from a clean buffer: did each message arrive?
        run(out)
        expected = float(left + 1) if receives else 0.0  # a rank nobody sends to keeps its zeros
        wrong = torch.tensor([(incoming != expected).sum().item()], dtype=torch.float64)
        dist.all_reduce(wrong)
        rows.append({"size_bytes": numel * 4, "messages": senders, "time_s": seconds, "cpu_s": cpu_s,
                     "cores_busy": cpu_s / seconds, "wrong": int(wrong.item())})
        report_progress()
    return rows
