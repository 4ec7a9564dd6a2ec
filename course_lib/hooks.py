"""DDP communication hooks, from scratch: what DDP does with a gradient bucket, and cheaper variants.

DDP groups gradients into *buckets* (25 MiB each by default; its first synchronizing backward uses
one bucket of every gradient, then DDP rebuilds them in the order the gradients arrived) and, as
soon as every gradient of a bucket is ready during ``backward``, calls the registered hook with it:
``hook(state, bucket) -> Future[Tensor]``, ``bucket`` being a ``dist.GradBucket`` (``buffer()``:
its gradients, flat; ``index()``; ``parameters()``). The hook must start the communication and
return a future whose value is the bucket's averaged gradient; DDP waits for it before
``backward()`` returns.

These hooks have the names, signatures and behaviour of torch's ``ddp_comm_hooks.default_hooks``
and ``debugging_hooks``, and run on gloo as well as NCCL (DDP refuses torch's own bf16 hook on a
torch build without CUDA and NCCL >= 2.10, whatever the backend). Each counts the payload it
all-reduces in :data:`traffic`, so that notebooks can compare hooks exactly.

Every hook issues its collectives directly inside the hook call, never from a future's callback:
DDP calls hooks bucket by bucket in the same order on every rank, so the collectives are then
issued in the same order on every rank too (see ``course_lib.powersgd`` for why that matters).
"""

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from course_lib.utils.per_rank import PerRank

__all__ = [
    "traffic",
    "count",
    "Collective",
    "all_reduce_counted",
    "all_gather_counted",
    "allreduce_fut",
    "completed_future",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "noop_hook",
    "BucketLog",
    "logging_allreduce_hook",
]


class Traffic:
    """What this process's hooks have sent: collectives issued and payload bytes.

    ``bytes`` counts each all-reduce's tensor once (numel x element size): what this rank hands to
    the collective, whatever algorithm then moves it (a ring sends 2(p-1)/p of it per rank).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.collectives = 0
        self.bytes = 0
        # the same, op by op: {"all_reduce": [collectives, bytes], "all_gather": [...]}
        self.by_op: dict[str, list[int]] = {}
        # None, or a list that every all-reduce appends a Collective to (see record_timeline)
        self.timeline: list | None = None

    def record_timeline(self) -> list:
        """From now on (until :meth:`reset`), note when each all-reduce ran and on which thread;
        returns the list the :class:`Collective` records go to."""
        self.timeline = []
        return self.timeline

    def snapshot(self) -> dict:
        return {"collectives": self.collectives, "bytes": self.bytes}


traffic = PerRank(Traffic)  # one per process; one per rank in a simulation (course_lib.simulated)


class Collective(NamedTuple):
    """One all-reduce in :attr:`Traffic.timeline`: bytes, the issuing thread's name, and when it
    was issued and completed (:func:`time.perf_counter`; for an asynchronous one, when its future
    completed)."""

    nbytes: int
    thread: str
    start_s: float
    end_s: float


def count(op: str, nbytes: int) -> None:
    """Add one collective ``op`` ("all_reduce", "all_gather") of ``nbytes`` handed to it to :data:`traffic`."""
    traffic.collectives += 1
    traffic.bytes += nbytes
    tally = traffic.by_op.setdefault(op, [0, 0])
    tally[0] += 1
    tally[1] += nbytes


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def all_reduce_counted(tensor: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_reduce`` (sum) that adds to :data:`traffic`; the one door all hooks send through."""
    count("all_reduce", tensor.numel() * tensor.element_size())
    if traffic.timeline is not None:  # asked for by Traffic.record_timeline
        return _all_reduce_timed(tensor, _group(group), async_op)
    return dist.all_reduce(tensor, group=_group(group), async_op=async_op)


def _all_reduce_timed(tensor: torch.Tensor, group, async_op: bool):
    # note when the all-reduce was issued, from which thread, and when it completed
    timeline, nbytes = traffic.timeline, tensor.numel() * tensor.element_size()
    thread, start = threading.current_thread().name, time.perf_counter()
    work = dist.all_reduce(tensor, group=group, async_op=async_op)
    if not async_op:
        timeline.append(Collective(nbytes, thread, start, time.perf_counter()))
        return work

    def done(fut):
        timeline.append(Collective(nbytes, thread, start, time.perf_counter()))
        return fut.value()

    work.get_future().then(done)
    return work


def all_gather_counted(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """``dist.all_gather`` of ``tensor`` (every rank's of the same size), counted in :data:`traffic`
    as the bytes this rank hands over, as :func:`all_reduce_counted` counts them; every rank's
    tensor, in rank order. (A ring all-gather then moves (p - 1) / p of all p of them past each rank.)"""
    group = _group(group)
    count("all_gather", tensor.numel() * tensor.element_size())
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(out, tensor, group=group)
    return out


def allreduce_fut(process_group, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over the group in place; a future of it (torch's ``default_hooks._allreduce_fut``)."""
    group = _group(process_group)
    tensor.div_(group.size())
    work = all_reduce_counted(tensor, group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def completed_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds ``tensor``: what a hook returns when its work is done already."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """What DDP does without a hook: average the bucket with one all-reduce."""
    return allreduce_fut(process_group, bucket.buffer())


def _compress_hook(dtype: torch.dtype, process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = _group(process_group)
    buffer = bucket.buffer()
    # Divide *after* casting, as torch does: fewer bytes to touch; float16 keeps 10 bits of mantissa
    # (bfloat16 only 7, but float32's range, so no overflow of large gradients).
    compressed = buffer.to(dtype).div_(group.size())
    work = all_reduce_counted(compressed, group, async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to float16, average it, cast back: half the bytes of ``allreduce_hook``."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to bfloat16, average it, cast back. Works on gloo too."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


# DDP refuses any hook whose __name__ is "bf16_compress_hook" or "bf16_compress_wrapper_hook"
# unless torch was built with CUDA and NCCL >= 2.10: it checks the function's *name*, not what it does, and
# gloo all-reduces bfloat16 perfectly well. So ours keeps torch's name to import, not to be looked at.
bf16_compress_hook.__name__ = "course_lib_bf16_compress_hook"


def _compress_wrapper(dtype: torch.dtype, hook: Callable) -> Callable:
    def compress_wrapper_hook(hook_state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(fut):
            original.copy_(fut.value())
            return original

        return fut.then(decompress)

    # (not torch's "bf16_compress_wrapper_hook": DDP refuses that name without NCCL, see above)
    dtype_name = str(dtype).split(".")[-1]
    compress_wrapper_hook.__name__ = f"{dtype_name}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return compress_wrapper_hook


def fp16_compress_wrapper(hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]) -> Callable:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back.

    ``fp16_compress_wrapper(allreduce_hook)`` is ``fp16_compress_hook``; wrapping PowerSGD halves
    its P and Q too.
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]) -> Callable:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back."""
    return _compress_wrapper(torch.bfloat16, hook)


def noop_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send nothing, return the local gradient: the speed of training with free communication.

    For headroom analysis only: ranks stop agreeing on the parameters.
    """
    return completed_future(bucket.buffer())


class BucketLog:
    """State for :func:`logging_allreduce_hook`: what DDP handed the hook, call by call."""

    def __init__(self, process_group=None):
        self.process_group = process_group
        self.calls: list[dict] = []


def logging_allreduce_hook(state: BucketLog, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``allreduce_hook`` that first writes down the bucket: index, parameter shapes, size."""
    state.calls.append({
        "index": bucket.index(),
        "is_last": bucket.is_last(),
        "shapes": [tuple(p.shape) for p in bucket.parameters()],
        "numel": bucket.buffer().numel(),
    })
    return allreduce_fut(state.process_group, bucket.buffer())
