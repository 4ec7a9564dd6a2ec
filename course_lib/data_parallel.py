"""Data parallelism from scratch: four ways to average the gradients over the ranks.

Every rank holds the whole model and takes its own slice of each batch; after ``loss.backward()``
the ranks average their gradients, so that every rank takes the same optimizer step. The four
wrappers below do that average, from the simplest to what ``DistributedDataParallel`` does:

* :class:`DataParallelNaive`: after backward, one blocking all-reduce per parameter;
* :class:`DataParallelFlat`: after backward, all gradients in one flat buffer, one blocking
  all-reduce: the fewest messages, and no overlap (the naive step towards fewer messages);
* :class:`DataParallelOverlap`: each parameter's all-reduce starts (asynchronously) the moment its
  gradient is ready, while backward goes on with the layers below;
* :class:`DataParallelBucket`: gradients are packed into flat buckets in the order they become
  ready, and each bucket is all-reduced as soon as it is full: fewer, larger messages, still
  overlapped with backward.

Each is an ``nn.Module`` whose ``forward`` is the wrapped module's; construction broadcasts the
parameters from rank 0; ``finish_gradient_synchronization()`` after backward leaves the average in
every ``.grad``; ``with model.no_sync():`` around a backward skips the communication, so that
gradients accumulate locally (notebook 01), as DDP's ``no_sync`` does. Every all-reduce goes
through :func:`course_lib.hooks.all_reduce_counted`, so ``hooks.traffic`` counts them, and each
wrapper records a timeline of its last backward (``events``): when each gradient became ready and
when each all-reduce started and ended. :func:`exposed_communication` reads from it how long the
step waited for communication once backward was over; :func:`communication_time`, how long an
all-reduce was in flight at all.

Timings are read over several runs (each a ``spawn`` of :func:`step_times`): :func:`run_medians` gives
one median per run, :func:`noise_floor` how far apart two configurations that do the same work land,
and :func:`established_faster` ranks two wrappers only where the runs say so beyond that floor.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks
from course_lib.bandwidth import measure_collective
from course_lib.utils import checks
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["DataParallelNaive", "DataParallelFlat", "DataParallelOverlap", "DataParallelBucket", "assign_buckets",
           "Event", "WRAPPERS", "exposed_communication", "communication_time", "waiting_for_peers", "step_times",
           "communication_alone", "run_medians", "noise_floor", "established_faster"]


class Event(NamedTuple):
    """One bar of the timeline: ``kind`` is ``"backward"`` (autograd working until the gradient of
    parameter ``label`` was ready, the wrapper's own hook work included) or ``"all_reduce"``; times
    from :func:`time.perf_counter` (on Linux one clock for every process of a machine)."""

    kind: str
    label: str
    start_s: float
    end_s: float


def _finished_at(events: list, kind: str, label: str, start: float):
    # A callback on the collective's future: it runs when the all-reduce completes, on whichever
    # thread completes it, and records that moment.
    def done(fut):
        events.append(Event(kind, label, start, time.perf_counter()))
        return fut.value()
    return done


class _DataParallel(nn.Module):
    """What the wrappers share: the broadcast at construction, forward, the timeline."""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs a process group: call it inside a worker started "
                               "by course_lib.launch.spawn or torchrun (after dist.init_process_group)")
        if getattr(module, "_course_data_parallel", None):
            raise RuntimeError(f"this module is already wrapped by {module._course_data_parallel}: its gradient "
                               "hooks are registered; wrap a fresh model (a new mlp(...), or a copy.deepcopy of the "
                               "original taken before wrapping)")
        module._course_data_parallel = type(self).__name__
        self.module = module
        self.sync = True  # False inside no_sync()
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Every rank starts from rank 0's parameters and buffers (as DDP does), whatever its own init.
        src = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=src, group=self.process_group)
        self.events: list[Event] = []
        self._mark = 0.0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate ``.grad`` locally; the next backward
        outside it communicates the accumulated sum (then call ``finish_gradient_synchronization``)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_starts)  # runs when backward reaches the output
        return out

    def _backward_starts(self, _grad):
        self.events = []
        self._mark = time.perf_counter()

    def _gradient_ready(self, name: str) -> None:
        # the backward of the layer that owns ``name`` ran from the previous mark until now
        now = time.perf_counter()
        self.events.append(Event("backward", name, self._mark, now))
        self._mark = now

    def _second_backward(self):
        return RuntimeError("a second backward before finish_gradient_synchronization(): call it after every backward, "
                            "or run the backward passes that only accumulate inside `with model.no_sync():`")

    def _missing_gradients(self) -> None:
        missing = [n for n, p in self.named if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward: every rank must use every "
                               "parameter (torch's DDP needs find_unused_parameters=True for models that do not)")


class DataParallelNaive(_DataParallel):
    """Not used in practice, but the place to start: after backward, one blocking all-reduce per
    parameter, in the order of ``module.parameters()``. Nothing overlaps; each small tensor pays the
    full latency of a collective."""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__(module, process_group)
        for name, p in self.named:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: self._gradient_ready(name))

    def finish_gradient_synchronization(self) -> None:
        self._missing_gradients()
        for name, p in self.named:
            start = time.perf_counter()
            hooks.all_reduce_counted(p.grad, self.process_group)
            # sum, then divide: in float32 either order gives the average (DDP divides first, so
            # that 16-bit gradients cannot overflow in the sum; the other three wrappers do too)
            p.grad.div_(self.world_size)
            self.events.append(Event("all_reduce", name, start, time.perf_counter()))


class DataParallelFlat(_DataParallel):
    """Fewer messages, no overlap: after backward, every gradient is copied into one flat buffer,
    averaged with a single blocking all-reduce, and copied back. One latency per step instead of
    one per parameter, but nothing is sent before backward is over, and the two copies cost a pass
    over the gradients each. (Horovod's *tensor fusion* and DDP's single first bucket do the same.)"""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__(module, process_group)
        dtypes = {p.dtype for _, p in self.named}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of several dtypes {sorted(map(str, dtypes))}: one flat buffer needs one; "
                             "convert the model with .to(dtype) first")
        for name, p in self.named:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: self._gradient_ready(name))

    def finish_gradient_synchronization(self) -> None:
        self._missing_gradients()
        grads = [p.grad for _, p in self.named]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        start = time.perf_counter()
        hooks.all_reduce_counted(flat, self.process_group)
        self.events.append(Event("all_reduce", "all gradients", start, time.perf_counter()))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class DataParallelOverlap(_DataParallel):
    """Each parameter's all-reduce is launched asynchronously the moment its gradient has been
    accumulated (a post-accumulate-grad hook), while autograd goes on with the layers below;
    ``finish_gradient_synchronization`` waits for them all."""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__(module, process_group)
        self._works: list = []
        self._launched: set[str] = set()
        for name, p in self.named:
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._launch(name, p))

    def _launch(self, name: str, p: nn.Parameter) -> None:
        self._gradient_ready(name)
        if not self.sync:
            return
        if name in self._launched:
            raise self._second_backward()
        self._launched.add(name)
        p.grad.div_(self.world_size)  # sum of grad / world_size: the average, as DDP's allreduce hook does
        start = time.perf_counter()
        work = hooks.all_reduce_counted(p.grad, self.process_group, async_op=True)
        self._works.append(work.get_future().then(_finished_at(self.events, "all_reduce", name, start)))

    def finish_gradient_synchronization(self) -> None:
        self._missing_gradients()
        for fut in self._works:
            fut.wait()
        self._works, self._launched = [], set()


def assign_buckets(sizes_bytes: list[int], cap_bytes: float) -> list[list[int]]:
    """Indices into ``sizes_bytes`` (tensors in the order their gradients become ready), grouped into
    buckets: a bucket is closed as soon as it holds ``cap_bytes`` or more, so a tensor larger than the
    cap gets a bucket of its own. The rule of DDP's ``compute_bucket_assignment_by_size``, with one
    cap for every bucket."""
    checks.number("cap_bytes", cap_bytes, 0, low_open=True)
    sizes_bytes = [checks.number("each of sizes_bytes", size, 0) for size in sizes_bytes]
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Bucket:
    """One flat buffer and the parameters whose gradients it carries."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]):
        self.params = params
        self.offsets = []
        n = 0
        for _, p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0][1].dtype, device=params[0][1].device)
        self.label = params[0][0] if len(params) == 1 else f"{params[0][0]}..{params[-1][0]}"
        self.arrived: set[str] = set()
        self.future = None


class DataParallelBucket(_DataParallel):
    """Gradients copied into flat buckets of about ``bucket_cap_mb`` MiB, filled in reverse order of
    ``module.parameters()`` (for a feed-forward model, the order backward produces them); each
    bucket's all-reduce is launched asynchronously as soon as its last gradient has arrived. One
    collective per bucket instead of one per parameter. (torch's DDP puts everything in one bucket
    for its first iteration, then rebuilds its buckets in the order the gradients really arrived.)"""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None):
        checks.number("bucket_cap_mb", bucket_cap_mb, 0, low_open=True)
        super().__init__(module, process_group)
        ordered = self.named[::-1]
        dtypes = {p.dtype for _, p in ordered}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of several dtypes {sorted(map(str, dtypes))}: one flat buffer needs one; "
                             "convert the model with .to(dtype) first")
        sizes = [p.numel() * p.element_size() for _, p in ordered]
        self.buckets = [_Bucket([ordered[i] for i in idx])
                        for idx in assign_buckets(sizes, bucket_cap_mb * 1024 * 1024)]
        for bucket in self.buckets:
            for (name, p), offset in zip(bucket.params, bucket.offsets):
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name, bucket=bucket, offset=offset: self._arrived(name, p, bucket, offset))

    def _arrived(self, name: str, p: nn.Parameter, bucket: _Bucket, offset: int) -> None:
        self._gradient_ready(name)
        if not self.sync:
            return
        if name in bucket.arrived:
            raise self._second_backward()
        bucket.buffer[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        bucket.arrived.add(name)
        if len(bucket.arrived) == len(bucket.params):
            bucket.buffer.div_(self.world_size)
            start = time.perf_counter()
            work = hooks.all_reduce_counted(bucket.buffer, self.process_group, async_op=True)
            bucket.future = work.get_future().then(_finished_at(self.events, "all_reduce", bucket.label, start))

    def finish_gradient_synchronization(self) -> None:
        self._missing_gradients()
        for bucket in self.buckets:
            if bucket.future is None:
                raise RuntimeError(f"bucket {bucket.label} was never all-reduced: some of its gradients did not "
                                   "arrive through backward")
            bucket.future.wait()
            for (_, p), offset in zip(bucket.params, bucket.offsets):
                p.grad.copy_(bucket.buffer[offset : offset + p.numel()].view_as(p.grad))
            bucket.arrived, bucket.future = set(), None


WRAPPERS = {"naive": DataParallelNaive, "flat": DataParallelFlat, "overlap": DataParallelOverlap,
            "bucket": DataParallelBucket}


def exposed_communication(events: list[Event]) -> float:
    """Seconds the step waited for communication after backward: the end of the last all-reduce
    minus the end of backward (when the last gradient was ready), 0 if the all-reduces were all
    over by then. All of it when nothing overlaps; only the tail when the all-reduces run behind
    backward."""
    backward_end = max((e.end_s for e in events if e.kind == "backward"), default=None)
    if backward_end is None:
        raise ValueError("events hold no backward: pass one step's events, as a wrapper records them")
    return max(0.0, max((e.end_s for e in events if e.kind == "all_reduce"), default=0.0) - backward_end)


def communication_time(events: list[Event]) -> float:
    """Seconds during which at least one all-reduce was in flight (launched, not yet completed): the
    length of the union of the all-reduce bars, so that all-reduces queued together count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((e.start_s, e.end_s) for e in events if e.kind == "all_reduce"):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def waiting_for_peers(events_by_rank: list[list[Event]]) -> list[float]:
    """Per rank, the seconds its all-reduces of one step spent waiting for the last rank to launch
    the same all-reduce: the sum over all-reduces of (latest launch among the ranks - its own
    launch). ``events_by_rank``: each rank's events of the same step; the all-reduces are matched
    by their order, which is the same on every rank for the blocking wrappers (naive, flat)."""
    launches = [[e.start_s for e in events if e.kind == "all_reduce"] for events in events_by_rank]
    if len({len(x) for x in launches}) != 1:
        raise ValueError(f"the ranks issued different numbers of all-reduces: {[len(x) for x in launches]}")
    latest = [max(starts) for starts in zip(*launches)]
    return [sum(last - own for last, own in zip(latest, mine)) for mine in launches]


def step_times(rank: int, world_size: int, kinds: tuple = ("naive", "flat", "overlap", "bucket", "ddp"),
               steps: int = 20, hidden: int = 512, depth: int = 4, batch_size: int = 64, bucket_cap_mb: float = 25.0,
               threads: int = 1) -> dict:
    """Worker: train steps of the digits MLP with each wrapper in ``kinds`` (``"ddp"``: torch's
    DistributedDataParallel), taking turns step by step so that all see the same machine load.
    ``"bucket:0.25"`` (or ``"ddp:0.25"``) is that wrapper with ``bucket_cap_mb=0.25``; a plain
    ``"bucket"`` or ``"ddp"`` takes ``bucket_cap_mb``.

    Returns, per kind: ``step_s`` (forward, backward, synchronization, SGD step; after 3 warm-up
    steps); for the course's wrappers, per timed step, ``backward_s`` (from the start of backward to
    the last gradient), ``exposed_s`` (:func:`exposed_communication`),
    ``comm_s`` (:func:`communication_time`) and ``step_events`` (the timeline), with ``events`` and
    ``step_start_s`` of the last step; the collectives of one step and their payload bytes
    (``traffic``), and the parameters after the last step (``params``, flat).
    """
    torch.set_num_threads(threads)
    x, y, _, _ = digits_tensors(seed=0)
    models, opts = {}, {}
    for kind in kinds:
        name, _, cap = kind.partition(":")
        cap_mb = float(cap) if cap else bucket_cap_mb
        model = mlp(hidden=hidden, depth=depth, seed=0)
        if name == "ddp":
            models[kind] = DDP(model, bucket_cap_mb=cap_mb)
        elif name == "bucket":
            models[kind] = DataParallelBucket(model, bucket_cap_mb=cap_mb)
        else:
            models[kind] = WRAPPERS[name](model)
        opts[kind] = torch.optim.SGD(models[kind].parameters(), lr=0.01)
    out = {kind: {"step_s": [], "backward_s": [], "exposed_s": [], "comm_s": [], "step_events": []} for kind in kinds}
    for step in range(steps + 3):
        rows = batch_slice(step, batch_size, len(x), rank, world_size)
        for kind in kinds:
            model, opt = models[kind], opts[kind]
            dist.barrier()
            hooks.traffic.reset()
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            if isinstance(model, _DataParallel):
                model.finish_gradient_synchronization()
            opt.step()
            if step >= 3:
                out[kind]["step_s"].append(time.perf_counter() - start)
                if isinstance(model, _DataParallel):
                    backward = [e for e in model.events if e.kind == "backward"]
                    out[kind]["backward_s"].append(max(e.end_s for e in backward) - min(e.start_s for e in backward))
                    out[kind]["exposed_s"].append(exposed_communication(model.events))
                    out[kind]["comm_s"].append(communication_time(model.events))
                    out[kind]["step_events"].append(list(model.events))
            out[kind]["step_start_s"] = start
            out[kind]["traffic"] = hooks.traffic.snapshot()
            out[kind]["events"] = list(getattr(model, "events", []))
    for kind in kinds:
        out[kind]["params"] = torch.cat([p.detach().flatten() for p in models[kind].parameters()])
    return out


def communication_alone(rank: int, world_size: int, sequences: dict, fit_sizes: tuple = (), iters: int = 10) -> dict:
    """Worker: the all-reduces of a step without the step. For each ``name: [bytes, ...]`` of
    ``sequences`` (one step's float32 messages, in order), the time of those all-reduces issued back to
    back after a barrier, as a wrapper that does not overlap issues them (``"sequence"``), and of
    each message issued alone between barriers (``"alone"``, by size); ``"fit"``: the rows of
    ``fit_sizes`` timed alone, for :func:`course_lib.costmodel.fit_ring_all_reduce`. Every time is
    the median over ``iters`` runs (after one warm-up) of the slowest rank.
    """
    sizes = sorted({n for msgs in sequences.values() for n in msgs})
    alone = {row["size_bytes"]: row["time_s"] for row in measure_collective("all_reduce", sizes, iters=iters)}
    out = {"fit": measure_collective("all_reduce", list(fit_sizes), iters=iters), "alone": alone, "sequence": {}}
    for name, msgs in sequences.items():
        tensors = [torch.ones(n // 4) for n in msgs]
        times = []
        for i in range(iters + 1):
            dist.barrier()
            start = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            if i:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out["sequence"][name] = statistics.median(slowest.tolist())
    return out


def run_medians(runs: list[list[dict]], kind: str, key: str = "step_s") -> list[float]:
    """One number per run: the median of ``key`` (seconds) over the timed steps of every rank.

    ``runs``: what several ``spawn(step_times, ...)`` returned, one list of its ranks' results each;
    ``kind``: a wrapper as ``step_times`` names it (``"bucket:0.01"``)."""
    if not runs:
        raise ValueError("runs is empty: pass the results of one or more spawn(step_times, ...)")
    return [statistics.median(v for out in run for v in out[kind][key]) for run in runs]


def noise_floor(runs: list[list[dict]], kind: str, twin: str, key: str = "step_s") -> float:
    """The largest relative gap, over runs, between the medians of ``kind`` and ``twin``: two names for
    the same configuration (``"bucket"`` with ``bucket_cap_mb=1`` and ``"bucket:1"``), trained in the
    same processes, taking turns: the slower of the two over the faster, less 1 (0.1: 10%). Two
    wrappers of one run whose medians differ by no more than this differ by no more than the same
    configuration did from itself. It measures the noise within a run (both see the same load), not
    from run to run."""
    # the slower over the faster, as established_faster compares two wrappers
    return max(max(a, b) / min(a, b) - 1 for a, b in zip(run_medians(runs, kind, key), run_medians(runs, twin, key)))


def established_faster(a: list[float], b: list[float], floor: float) -> bool:
    """Whether runs ``a`` and ``b`` (one median per run, the same runs in the same order, as
    :func:`run_medians` gives them) show a faster than b: in every run, b's median above a's by more
    than the relative noise ``floor`` (:func:`noise_floor`). Otherwise these runs do not establish it."""
    if not a or len(a) != len(b):
        raise ValueError(f"a and b need one median per run each, from the same runs: got {len(a)} and {len(b)}")
    return all(y > x * (1 + floor) for x, y in zip(a, b))
