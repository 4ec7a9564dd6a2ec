"""Gradient compressors from scratch: sparsification and quantization, numerics apart from communication.

A compressor turns a flat float tensor into a *payload* (a list of tensors, what crosses the wire)
and back::

    payload, ctx = compressor.compress(tensor)
    approx = compressor.decompress(payload, ctx)
    compressor.wire_bytes(tensor.numel())   # the bytes of the payload's tensors, exactly

``ctx`` stays on the rank that compressed (shape, the kept indices of a shared draw, ...): only the
payload is sent. Random draws come from the compressor's own ``torch.Generator`` (``seed=``, default
0): repeated calls give fresh draws, and two compressors built with the same seed draw the same, on
every rank.

Whether ranks can *sum* payloads decides how they communicate (:attr:`Compressor.summable`):

* ``FP16``, ``BF16`` and ``RandomK`` with a shared seed: every rank's payload lines up entry for entry,
  so the sum of payloads is the payload of the sum: one all-reduce.
* ``TopK``, ``Threshold``, ``QSGD``, ``SignSGD``, ``TernGrad``: each rank keeps other entries, or
  scales its own way; the ranks all-gather every payload and each decompresses all of them.

The compressors follow the papers: top-k and thresholding (Strom 2015; Aji & Heafield 2017), random-k
(Stich et al. 2018), QSGD (Alistarh et al. 2017), signSGD (Bernstein et al. 2018), TernGrad (Wen et
al. 2017). PowerSGD, the low-rank one, is ``course_lib.powersgd``.
"""

import math

import torch
import torch.distributed as dist

from course_lib import hooks

__all__ = [
    "Compressor",
    "TopK",
    "RandomK",
    "Threshold",
    "QSGD",
    "SignSGD",
    "TernGrad",
    "FP16",
    "BF16",
    "pack_bits",
    "unpack_bits",
    "payload_bytes",
    "ErrorFeedback",
    "NoMemory",
    "communicate",
    "CompressionState",
    "compression_hook",
]


def payload_bytes(payload: list[torch.Tensor]) -> int:
    """The bytes of a payload's tensors: what ``wire_bytes`` promises."""
    return sum(t.numel() * t.element_size() for t in payload)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers below ``2**bits`` (bits = 1, 2, 4 or 8), ``8 // bits`` to a byte (uint8)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    per_byte = 8 // bits
    v = values.to(torch.uint8).flatten()
    v = torch.cat([v, v.new_zeros(-v.numel() % per_byte)]).view(-1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=v.device)
    return (v << shifts).sum(1, dtype=torch.uint8) if per_byte > 1 else v.view(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` values that :func:`pack_bits` packed (uint8)."""
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).view(-1)[:numel] if per_byte > 1 else packed[:numel]


def _check_ratio(ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio is the fraction of entries kept: 0 < ratio <= 1 (e.g. 0.01), got {ratio}")


def _index_dtype(numel: int) -> torch.dtype:
    # indices as int32 while they fit: half the bytes of int64 on the wire
    return torch.int32 if numel < 2**31 else torch.int64


class Compressor:
    """What every compressor has: a seeded generator, ``compress``/``decompress``, ``wire_bytes``."""

    summable = False  # True when the sum of the ranks' payloads decompresses to the sum of their tensors
    unbiased = False  # True when the mean of many decompressed draws is the tensor
    variable_size = False  # True when the payload's size depends on the data (not only on numel)

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def _uniform(self, tensor: torch.Tensor) -> torch.Tensor:
        # drawn on the CPU from the compressor's own generator, so every device draws the same numbers
        return torch.rand(tensor.shape, generator=self.generator).to(tensor.device, tensor.dtype)

    def compress(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        raise NotImplementedError

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Sparsifier(Compressor):
    """A compressor that keeps ``k = ceil(ratio * numel)`` entries (at least one)."""

    def __init__(self, ratio: float, seed: int = 0):
        super().__init__(seed)
        _check_ratio(ratio)
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def __repr__(self):
        return f"{type(self).__name__}({self.ratio})"


class TopK(_Sparsifier):
    """Keep the ``k = ceil(ratio * numel)`` entries of largest magnitude: values and int32 indices."""

    def compress(self, tensor):
        flat = tensor.flatten()
        _, indices = torch.topk(flat.abs(), self.k(flat.numel()), sorted=False)
        return [flat[indices], indices.to(_index_dtype(flat.numel()))], tensor.shape

    def decompress(self, payload, ctx):
        values, indices = payload
        out = values.new_zeros(math.prod(ctx))
        return out.index_add_(0, indices.long(), values).view(ctx)  # add: repeated indices sum up

    def wire_bytes(self, numel):
        k = self.k(numel)
        return k * 4 + k * torch.empty(0, dtype=_index_dtype(numel)).element_size()


class RandomK(_Sparsifier):
    """Keep ``k`` entries chosen at random, scaled by numel / k so that the result is unbiased.

    With the same ``seed`` on every rank the ranks choose the same entries: the indices need not be
    sent (each rank draws them), and the values can be all-reduced.
    """

    summable = True
    unbiased = True

    def compress(self, tensor):
        flat = tensor.flatten()
        n, k = flat.numel(), self.k(flat.numel())
        indices = torch.randperm(n, generator=self.generator)[:k].to(flat.device)
        return [flat[indices] * (n / k)], (indices, tensor.shape)

    def decompress(self, payload, ctx):
        indices, shape = ctx
        out = payload[0].new_zeros(math.prod(shape))
        out[indices] = payload[0]
        return out.view(shape)

    def wire_bytes(self, numel):
        return self.k(numel) * 4


class Threshold(Compressor):
    """Keep the entries whose magnitude is at least ``value``: values and int32 indices.

    How many are kept depends on the gradient, so the payload's size does too: ``wire_bytes(numel,
    kept)`` needs the count (``len(payload[0])``); with ``kept=None`` it is the most it can be.
    """

    variable_size = True

    def __init__(self, value: float, seed: int = 0):
        super().__init__(seed)
        if value <= 0:
            raise ValueError(f"value is a magnitude: it must be > 0, got {value}")
        self.value = value

    def compress(self, tensor):
        flat = tensor.flatten()
        indices = (flat.abs() >= self.value).nonzero().view(-1)
        return [flat[indices], indices.to(_index_dtype(flat.numel()))], tensor.shape

    decompress = TopK.decompress

    def wire_bytes(self, numel, kept: int | None = None):
        kept = numel if kept is None else kept
        return kept * (4 + torch.empty(0, dtype=_index_dtype(numel)).element_size())

    def __repr__(self):
        return f"Threshold({self.value})"


class QSGD(Compressor):
    """Stochastic quantization to ``levels`` levels of the norm (Alistarh et al. 2017): unbiased.

    Each entry x becomes norm * sign(x) * l / levels, where l is |x| / norm * levels rounded down or
    up at random, up with probability equal to the fraction dropped. Sent: the norm (float32) and
    sign * l as int8 (so levels <= 127).
    """

    unbiased = True

    def __init__(self, levels: int, seed: int = 0):
        super().__init__(seed)
        if not (isinstance(levels, int) and 1 <= levels <= 127):
            raise ValueError(f"levels must be an integer from 1 to 127 (they are sent as int8), got {levels!r}")
        self.levels = levels

    def compress(self, tensor):
        flat = tensor.flatten().float()
        norm = flat.norm()
        scaled = flat.abs() / norm * self.levels if norm > 0 else torch.zeros_like(flat)
        level = torch.floor(scaled + self._uniform(scaled))  # floor(s + u): up with probability s - floor(s)
        return [norm.view(1), (torch.sign(flat) * level).to(torch.int8)], tensor.shape

    def decompress(self, payload, ctx):
        norm, levels = payload
        return (norm * levels.float() / self.levels).view(ctx)

    def wire_bytes(self, numel):
        return 4 + numel

    def __repr__(self):
        return f"QSGD({self.levels})"


class SignSGD(Compressor):
    """One bit per entry, its sign, packed eight to a byte, plus one scale: the mean magnitude.

    Decompressed, each entry is ±scale. Biased: use it with error feedback. ``aggregate`` says how the
    ranks' signs combine after the all-gather: ``"mean"`` of the decompressed tensors, or
    ``"majority"``, the sign of the sum of signs times the mean scale (Bernstein et al. 2018).
    """

    def __init__(self, aggregate: str = "mean", seed: int = 0):
        super().__init__(seed)
        if aggregate not in ("mean", "majority"):
            raise ValueError(f"aggregate must be 'mean' or 'majority', got {aggregate!r}")
        self.aggregate = aggregate

    def compress(self, tensor):
        flat = tensor.flatten().float()
        return [flat.abs().mean().view(1), pack_bits(flat >= 0, 1)], tensor.shape

    def signs(self, payload, ctx) -> torch.Tensor:
        return unpack_bits(payload[1], 1, math.prod(ctx)).float() * 2 - 1

    def decompress(self, payload, ctx):
        return (payload[0] * self.signs(payload, ctx)).view(ctx)

    def wire_bytes(self, numel):
        return 4 + math.ceil(numel / 8)

    def __repr__(self):
        return f"SignSGD({self.aggregate!r})"


class TernGrad(Compressor):
    """Each entry to {-1, 0, +1} times the largest magnitude s, at random, unbiased (Wen et al. 2017):
    ±s with probability |x| / s, else 0. Sent: s (float32) and 2 bits per entry, four to a byte."""

    unbiased = True

    def compress(self, tensor):
        flat = tensor.flatten().float()
        scale = flat.abs().max()
        keep = self._uniform(flat) < (flat.abs() / scale if scale > 0 else torch.zeros_like(flat))
        ternary = torch.sign(flat) * keep  # -1, 0, 1
        return [scale.view(1), pack_bits(ternary + 1, 2)], tensor.shape

    def decompress(self, payload, ctx):
        scale, packed = payload
        return (scale * (unpack_bits(packed, 2, math.prod(ctx)).float() - 1)).view(ctx)

    def wire_bytes(self, numel):
        return 4 + math.ceil(numel / 4)


class _Cast(Compressor):
    summable = True
    dtype = torch.float16

    def compress(self, tensor):
        return [tensor.flatten().to(self.dtype)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].to(dtype).view(shape)

    def wire_bytes(self, numel):
        return 2 * numel


class FP16(_Cast):
    """Every entry as float16: half the bytes, summable (all-reduced in float16, as torch's fp16 hook)."""


class BF16(_Cast):
    """Every entry as bfloat16: float32's range with 8 bits of mantissa; summable."""

    dtype = torch.bfloat16


# --- error feedback: a memory any compressor can use -----------------------------------------------

class ErrorFeedback:
    """Error feedback (memory): what compression left out of a tensor is added to it next time.

    ``compensate(key, tensor)`` returns tensor + what was left out last time; after compressing,
    ``update(key, corrected, sent)`` keeps ``corrected - sent``. Biased compressors (top-k, signs)
    need it to converge; unbiased ones can do without.
    """

    def __init__(self):
        self.memory: dict = {}

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        error = self.memory.get(key)
        return tensor + error if error is not None else tensor.clone()

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        self.memory[key] = corrected - sent


class NoMemory:
    """No error feedback: what compression leaves out is lost."""

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        pass


# --- communication: by what the payload allows -----------------------------------------------------

def communicate(compressor: Compressor, payload: list[torch.Tensor], ctx, process_group=None,
                how: str = "allreduce") -> torch.Tensor:
    """The mean over the group's ranks of their decompressed payloads, every rank the same.

    ``how="allreduce"``: sum the payloads (only for summable compressors), decompress once.
    ``how="allgather"``: gather every rank's payload, decompress each, average. Payloads whose size
    depends on the data (``variable_size``: ``Threshold``) first gather their sizes (one int64 each) and are padded to
    the largest. Every tensor sent goes through ``hooks`` and is counted in ``hooks.traffic``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = group.size()
    if how == "allreduce":
        if not compressor.summable:
            raise ValueError(f"{compressor!r} payloads cannot be summed (each rank keeps other entries or its "
                             f"own scale): use how='allgather'")
        summed = [t.clone() for t in payload]
        for t in summed:
            hooks.all_reduce_counted(t, group)
        return compressor.decompress(summed, ctx) / world_size
    if how != "allgather":
        raise ValueError(f"how must be 'allreduce' or 'allgather', got {how!r}")
    if compressor.variable_size:
        kept = hooks.all_gather_counted(torch.tensor([payload[0].numel()], device=payload[0].device), group)
        counts = [int(k) for k in kept]
        padded = [torch.cat([t, t.new_zeros(max(counts) - t.numel())]) for t in payload]
        gathered = [hooks.all_gather_counted(t, group) for t in padded]
        per_rank = [[g[r][: counts[r]] for g in gathered] for r in range(world_size)]
    else:
        gathered = [hooks.all_gather_counted(t, group) for t in payload]
        per_rank = [[g[r] for g in gathered] for r in range(world_size)]
    if isinstance(compressor, SignSGD) and compressor.aggregate == "majority":
        votes = sum(compressor.signs(p, ctx) for p in per_rank)
        scale = sum(p[0] for p in per_rank) / world_size
        return (scale * torch.sign(votes)).view(ctx)
    return sum(compressor.decompress(p, ctx) for p in per_rank) / world_size


# --- the DDP communication hook ---------------------------------------------------------------------

class CompressionState:
    """What :func:`compression_hook` needs: the compressor first; error feedback and the way to
    communicate default to what fits it.

    ``memory``: ``"auto"`` gives :class:`ErrorFeedback` to biased compressors (top-k, threshold,
    signSGD) and none to unbiased ones and 16-bit casts; or pass ``ErrorFeedback()`` / ``NoMemory()``.
    ``communicator``: ``"auto"`` all-reduces summable payloads and all-gathers the others.
    ``process_group``: the ranks that average (None: all of them).
    """

    def __init__(self, compressor: Compressor, memory="auto", communicator: str = "auto", process_group=None):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"the first argument is a compressor, e.g. CompressionState(TopK(0.01)); "
                            f"got {type(compressor).__name__}")
        self.compressor = compressor
        if memory == "auto":
            memory = NoMemory() if compressor.unbiased or isinstance(compressor, _Cast) else ErrorFeedback()
        self.memory = memory
        if communicator == "auto":
            communicator = "allreduce" if compressor.summable else "allgather"
        if communicator not in ("allreduce", "allgather"):
            raise ValueError(f"communicator must be 'auto', 'allreduce' or 'allgather', got {communicator!r}")
        if communicator == "allreduce" and not compressor.summable:
            raise ValueError(f"{compressor!r} cannot be all-reduced: its payloads do not line up across ranks; "
                             f"use communicator='allgather' (or 'auto')")
        self.communicator = communicator
        self.process_group = process_group


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: compress the bucket (with error feedback if the state keeps it),
    exchange the payloads as the state says, and hand DDP the mean of what every rank sent.

    Every collective is issued inside the hook call, in DDP's bucket order, so the ranks' collectives
    pair up whatever the timing. Memory is keyed by the bucket's parameters, not its index, so it
    follows them when DDP rebuilds its buckets.
    """
    buffer = bucket.buffer()
    key = tuple(id(p) for p in bucket.parameters())
    corrected = state.memory.compensate(key, buffer)
    payload, ctx = state.compressor.compress(corrected)
    sent = state.compressor.decompress([t.clone() for t in payload], ctx)  # what this rank contributes
    state.memory.update(key, corrected, sent)
    buffer.copy_(communicate(state.compressor, payload, ctx, state.process_group, state.communicator))
    return hooks.completed_future(buffer)
