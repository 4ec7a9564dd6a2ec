"""How DDP calls it: any compressor of ``course_lib.compressors`` as a DDP communication hook.

:func:`compression_hook` is the three roles in order, for each bucket: the memory adds what was left
out last step (``course_lib.memory``), the compressor makes the payload
(``course_lib.compressors``), the payloads travel and are averaged (``course_lib.exchange``).
:class:`CompressionState` holds the choices; :func:`dgc_state` is Deep Gradient Compression's.
"""

import time

import torch
import torch.distributed as dist

from course_lib import hooks
from course_lib.compressors import Compressor, DensityWarmUp, PerTensor, TopK, _Sparsifier
from course_lib.exchange import WAYS, combine, exchange
from course_lib.memory import DGCMemory, ErrorFeedback, NoMemory, ParameterKeys
from course_lib.utils import checks

__all__ = ["CompressionState", "compression_hook", "dgc_state"]


class CompressionState:
    """What :func:`compression_hook` needs: the compressor first; error feedback and the way to
    communicate default to what fits it.

    ``memory``: ``"auto"`` gives :class:`ErrorFeedback` where the compressor's paper uses it (top-k,
    threshold, signSGD, unscaled random-k: ``compressor.error_feedback``) and none elsewhere (QSGD,
    TernGrad, scaled random-k, 16-bit casts); or pass ``ErrorFeedback()``, ``NoMemory()`` or
    ``DGCMemory(...)``.
    ``per_tensor``: ``"auto"`` compresses each parameter's gradient on its own (:class:`PerTensor`)
    for the compressors that keep a scale (QSGD, signSGD, TernGrad: ``compressor.has_scale``), as their
    papers do, and the bucket whole for the others; True or False to choose.
    ``communicator``: ``"auto"`` all-reduces summable payloads (``"all_reduce"``) and all-gathers the
    others (``"all_gather"``).
    ``process_group``: the ranks that average (None: all of them).
    ``density``: for sparsifiers, a function of the step giving the ratio to keep (e.g.
    :class:`DensityWarmUp`); None keeps the compressor's own.

    It counts as it goes: ``iteration`` (steps seen: one per last bucket) and ``codec_s``, the seconds
    spent compressing and decompressing (memory included; collectives not).
    """

    def __init__(self, compressor: Compressor, memory="auto", communicator: str = "auto", process_group=None,
                 density=None, per_tensor="auto"):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"the first argument is a compressor, e.g. CompressionState(TopK(0.01)); "
                            f"got {type(compressor).__name__}")
        self.compressor = compressor
        if memory == "auto":
            memory = ErrorFeedback() if compressor.error_feedback else NoMemory()
        if not (callable(getattr(memory, "compensate", None)) and callable(getattr(memory, "update", None))):
            raise TypeError(f"memory must be 'auto' or an object with compensate() and update(), such as "
                            f"ErrorFeedback(), NoMemory() or DGCMemory(); got {memory!r}")
        self.memory = memory
        if per_tensor == "auto":
            per_tensor = compressor.has_scale
        if per_tensor not in (True, False):
            raise ValueError(f"per_tensor must be 'auto', True or False, got {per_tensor!r}")
        if per_tensor and compressor.variable_size:
            raise ValueError(f"{compressor!r} keeps entries one by one: per_tensor changes nothing; use False")
        self.per_tensor = per_tensor
        if communicator == "auto":
            communicator = "all_reduce" if compressor.summable else "all_gather"
        if communicator not in WAYS:
            raise ValueError(f"communicator must be 'auto', 'all_reduce' or 'all_gather', got {communicator!r}")
        if communicator == "all_reduce" and not compressor.summable:
            raise ValueError(f"{compressor!r} cannot be all-reduced: its payloads do not line up across ranks; "
                             f"use communicator='all_gather' (or 'auto')")
        if density is not None and not isinstance(compressor, _Sparsifier):
            raise ValueError(f"density sets the ratio of a sparsifier (TopK, RandomK); {compressor!r} has none")
        if density is not None and not callable(density):
            raise TypeError(f"density is a function of the step giving the ratio to keep, e.g. DensityWarmUp(0.01, "
                            f"warmup_steps=100); for a fixed ratio, give it to the compressor (TopK({density!r})); "
                            f"got {density!r}")
        self.communicator = communicator
        self.process_group = process_group
        self.keys = ParameterKeys()  # memory is kept per parameter: see course_lib.memory
        self.density = density
        self.iteration = 0
        self.codec_s = 0.0


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: compress the bucket (with error feedback if the state keeps it),
    each parameter's gradient on its own when ``state.per_tensor``, exchange the payloads as the
    state says, and hand DDP the mean of what every rank sent.

    Every collective is issued inside the hook call, in DDP's bucket order, so the ranks' collectives
    pair up whatever the timing. Memory is kept per parameter, not per bucket, so it follows the
    parameters when DDP rebuilds its buckets in another order after the first iteration.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    compressor, buffer = state.compressor, bucket.buffer()
    if state.density is not None:
        ratio = state.density(state.iteration)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"state.density({state.iteration}) must be a ratio: 0 < ratio <= 1, got {ratio!r}")
        compressor.ratio = ratio
    start = time.perf_counter()
    layout = state.keys.layout(bucket.parameters())  # ((key, numel), ...): memory is kept per parameter
    if state.per_tensor:  # the bucket's buffer holds its parameters' gradients one after another, in this order
        compressor = PerTensor(compressor, [n for _, n in layout])
    corrected = state.memory.compensate(layout, buffer)
    payload, ctx = compressor.compress(corrected)
    sent = compressor.decompress([t.clone() for t in payload], ctx)  # what this rank contributes
    state.memory.update(layout, corrected, sent)
    encoded = time.perf_counter()
    received = exchange(compressor, payload, group, state.communicator)
    decoding = time.perf_counter()
    buffer.copy_(combine(compressor, received, ctx, group.size()))
    state.codec_s += (encoded - start) + (time.perf_counter() - decoding)
    if bucket.is_last():
        state.iteration += 1
    return hooks.completed_future(buffer)


def dgc_state(density: float = 0.001, momentum: float = 0.9, clip_norm: float | None = None, masking: bool = True,
              warmup_steps: int = 0, process_group=None) -> CompressionState:
    """Deep Gradient Compression as a :class:`CompressionState`: top-k at ``density`` (after a warm-up
    over ``warmup_steps``, :class:`DensityWarmUp`), with :class:`DGCMemory` (momentum correction,
    local clipping, momentum-factor masking) and an all-gather. Train with the optimizer's
    momentum at 0: the momentum is in the memory."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"density is the fraction of entries sent: 0 < density <= 1 (e.g. 0.001), got {density}")
    checks.integer("warmup_steps", warmup_steps, 0)
    return CompressionState(TopK(density), memory=DGCMemory(momentum, clip_norm, masking),
                            communicator="all_gather", process_group=process_group,
                            density=DensityWarmUp(density, warmup_steps) if warmup_steps else None)
