"""What is sent: gradient compressors from scratch, sparsification and quantization.

A compressor turns a flat float tensor into a *payload* (a list of tensors, what crosses the wire)
and back::

    payload, ctx = compressor.compress(tensor)
    approx = compressor.decompress(payload, ctx)
    compressor.wire_bytes(tensor.numel(), tensor.dtype)   # the bytes of the payload's tensors, exactly

``ctx`` stays on the rank that compressed (shape, the kept indices of a shared draw, ...): only the
payload is sent. Random draws come from the compressor's own ``torch.Generator`` (``seed=``, default
0): repeated calls give fresh draws, and two compressors built with the same seed draw the same, on
every rank. A compressor knows nothing of ranks: what is remembered between steps is
``course_lib.memory``, how payloads travel ``course_lib.exchange``, and how DDP calls it all
``course_lib.compression`` (GRACE's split: compressor, memory, communicator).

The compressors follow the papers: top-k and thresholding (Strom 2015; Aji & Heafield 2017), random-k
with memory (Stich et al. 2018), QSGD with buckets (Alistarh et al. 2017), signSGD (Bernstein et al.
2018), TernGrad with clipping (Wen et al. 2017). Those that keep a scale (QSGD's norms, signSGD's mean
magnitude, TernGrad's maximum) scale each parameter's gradient on its own, as the papers and GRACE
do: the hook cuts its bucket into the parameters' gradients (:class:`PerTensor`). PowerSGD, the
low-rank one, is ``course_lib.powersgd``.
"""

import math

import torch

from course_lib.utils import checks

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
    "PerTensor",
    "DensityWarmUp",
    "pack_bits",
    "unpack_bits",
    "payload_bytes",
]


def payload_bytes(payload: list[torch.Tensor]) -> int:
    """The bytes of a payload's tensors: what ``wire_bytes`` promises."""
    if isinstance(payload, torch.Tensor):
        raise TypeError("payload_bytes takes a list of tensors (a compressor's payload), got one tensor: "
                        "pass [tensor]")
    return sum(t.numel() * t.element_size() for t in payload)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers below ``2**bits`` (1 <= bits <= 8) into ``ceil(numel * bits / 8)``
    bytes (uint8): 1, 2, 4 or 8 bits go ``8 // bits`` to a byte; other widths (3, 5, 6, 7) are cut
    into single bits first, so that no byte carries padding except the last."""
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
    if values.numel() and (values.min() < 0 or values.max() >= 2**bits
                           or (values.is_floating_point() and (values != values.trunc()).any())):
        # a value that does not fit would lose its high bits and unpack as another value
        low, high = (values.min().item(), values.max().item())
        raise ValueError(f"pack_bits packs integers from 0 to {2**bits - 1} in {bits} bits; got {values.dtype} "
                         f"values from {low} to {high}")
    v = values.to(torch.uint8).flatten()
    if 8 % bits:  # each value as `bits` single bits, lowest first, then eight bits to a byte
        shifts = torch.arange(bits, dtype=torch.uint8, device=v.device)
        return pack_bits((v.view(-1, 1) >> shifts) & 1, 1)
    per_byte = 8 // bits
    v = torch.cat([v, v.new_zeros(-v.numel() % per_byte)]).view(-1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=v.device)
    return (v << shifts).sum(1, dtype=torch.uint8) if per_byte > 1 else v.view(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` values that :func:`pack_bits` packed (uint8)."""
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
    if not (isinstance(numel, int) and 0 <= numel <= packed.numel() * 8 // bits):
        raise ValueError(f"numel must be an integer from 0 to {packed.numel() * 8 // bits} ({packed.numel()} bytes "
                         f"hold at most that many {bits}-bit values), got {numel!r}")
    if 8 % bits:
        shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
        single = unpack_bits(packed, 1, numel * bits).view(numel, bits)
        return (single << shifts).sum(1, dtype=torch.uint8)
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).view(-1)[:numel] if per_byte > 1 else packed[:numel]


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio is the fraction of entries kept: 0 < ratio <= 1 (e.g. 0.01), got {ratio}")


def _index_dtype(numel: int) -> torch.dtype:
    # indices as int32 while they fit: half the bytes of int64 on the wire
    return torch.int32 if numel < 2**31 else torch.int64


def _size(dtype) -> int:
    """Bytes per entry of a gradient of ``dtype`` (a floating torch dtype: float32, float16, bfloat16...)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype is the gradient's: a floating torch dtype such as torch.float32 or torch.bfloat16, "
                         f"got {dtype!r}")
    return torch.empty(0, dtype=dtype).element_size()


def _numel(numel) -> int:
    return checks.integer("numel", numel, 0)


def _stacked(payloads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The ranks' payloads, position by position, as one tensor each: row r is rank r's."""
    if not payloads:
        raise ValueError("no payloads to decompress: a group has at least one rank")
    return [torch.stack(parts) for parts in zip(*payloads)]


def _unpack_rows(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """:func:`unpack_bits` of each row (a payload's bytes) on its own: rows x numel values."""
    rows, width = packed.shape
    if 8 % bits:
        return torch.stack([unpack_bits(row, bits, numel) for row in packed])
    return unpack_bits(packed.flatten(), bits, rows * width * 8 // bits).view(rows, -1)[:, :numel]


class Compressor:
    """What every compressor has: a seeded generator, ``compress``/``decompress``, ``wire_bytes``."""

    summable = False  # True when the sum of the ranks' payloads decompresses to the sum of their tensors
    unbiased = False  # True when the mean of many decompressed draws is the tensor
    variable_size = False  # True when the payload's size depends on the data (not only on numel)
    error_feedback = True  # whether its paper runs it with error feedback (CompressionState's "auto")
    has_scale = False  # True when it keeps a scale (norm, mean, max): then its paper compresses tensor by tensor

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

    def decompress_sum(self, payloads: list[list[torch.Tensor]], ctx) -> torch.Tensor:
        """The sum of the decompressed payloads (one per rank, each compressed with this same ``ctx``):
        what :func:`course_lib.exchange.combine` averages after an all-gather. The compressors with a
        fixed-size payload decompress all of them in one go (``_rows``: one row per rank) and add the rows
        with one ``sum``, so that the number of operations does not grow with the number of ranks
        (simulated ranks run p of these in one process). The same sum as adding up :meth:`decompress` one
        payload after another; in another order of float additions past 4 ranks (the last bits differ)."""
        if hasattr(self, "_rows"):
            return self._rows(_stacked(payloads), ctx).sum(0).view(self._shape(ctx))
        total = None
        for p in payloads:
            total = self.decompress(p, ctx) if total is None else total + self.decompress(p, ctx)
        if total is None:
            raise ValueError("no payloads to decompress: a group has at least one rank")
        return total

    @staticmethod
    def _shape(ctx):
        return ctx

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """The payload's bytes for a tensor of ``numel`` entries of ``dtype``, exactly."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Sparsifier(Compressor):
    """A compressor that keeps ``k = ceil(ratio * numel)`` entries (at least one of a tensor that has any)."""

    def __init__(self, ratio: float, seed: int = 0):
        super().__init__(seed)
        _check_ratio(ratio)
        self.ratio = ratio

    def k(self, numel: int) -> int:
        _numel(numel)
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def __repr__(self):
        return f"{type(self).__name__}({self.ratio})"


class TopK(_Sparsifier):
    """Keep the ``k = ceil(ratio * numel)`` entries of largest magnitude: values (in the tensor's dtype)
    and int32 indices."""

    def compress(self, tensor):
        flat = tensor.flatten()
        _, indices = torch.topk(flat.abs(), self.k(flat.numel()), sorted=False)
        return [flat[indices], indices.to(_index_dtype(flat.numel()))], tensor.shape

    def decompress(self, payload, ctx):
        values, indices = payload
        out = values.new_zeros(math.prod(ctx))
        return out.index_add_(0, indices.long(), values).view(ctx)  # add: repeated indices sum up

    def decompress_sum(self, payloads, ctx):
        # one index_add_ over every rank's entries, in rank order: the same additions as one payload after another
        if not payloads:
            raise ValueError("no payloads to decompress: a group has at least one rank")
        values, indices = (torch.cat(parts) for parts in zip(*payloads))
        return self.decompress([values, indices], ctx)

    def wire_bytes(self, numel, dtype=torch.float32):
        k = self.k(numel)
        return k * _size(dtype) + k * torch.empty(0, dtype=_index_dtype(numel)).element_size()


class RandomK(_Sparsifier):
    """Keep ``k`` entries chosen at random.

    ``scaled=False`` (the default) sends them as they are and needs error feedback: Stich, Cordonnier
    and Jaggi (NeurIPS 2018, "Sparsified SGD with memory") run rand-k this way. ``scaled=True``
    multiplies them by numel / k so that the result is unbiased, without memory; its variance is
    numel / k times larger, so it needs a smaller step.

    With the same ``seed`` on every rank the ranks choose the same entries: the indices need not be
    sent (each rank draws them), and the values can be all-reduced.
    """

    summable = True

    def __init__(self, ratio: float, seed: int = 0, scaled: bool = False):
        super().__init__(ratio, seed)
        self.scaled = checks.boolean("scaled", scaled)
        self.unbiased = scaled
        self.error_feedback = not scaled

    def compress(self, tensor):
        flat = tensor.flatten()
        n, k = flat.numel(), self.k(flat.numel())
        indices = torch.randperm(n, generator=self.generator)[:k].to(flat.device)
        return [flat[indices] * (n / k) if self.scaled and k else flat[indices]], (indices, tensor.shape)

    def decompress(self, payload, ctx):
        indices, shape = ctx
        out = payload[0].new_zeros(math.prod(shape))
        out[indices] = payload[0]
        return out.view(shape)

    def wire_bytes(self, numel, dtype=torch.float32):
        return self.k(numel) * _size(dtype)

    def __repr__(self):
        return f"RandomK({self.ratio}, scaled={self.scaled})"


class Threshold(Compressor):
    """Keep the entries whose magnitude is at least ``value``: values (in the tensor's dtype) and int32 indices.

    How many are kept depends on the gradient, so the payload's size does too: ``wire_bytes(numel,
    kept)`` needs the count (``len(payload[0])``); with ``kept=None`` it is the most it can be.
    """

    variable_size = True

    def __init__(self, value: float, seed: int = 0):
        super().__init__(seed)
        if not value > 0 or value == float("inf"):  # (NaN is not > 0)
            raise ValueError(f"value is a magnitude: it must be a finite number > 0, got {value}")
        self.value = value

    def compress(self, tensor):
        flat = tensor.flatten()
        # "not below the threshold" rather than ">=": a NaN is kept and sent, where it shows, not dropped to 0
        indices = (~(flat.abs() < self.value)).nonzero().view(-1)
        return [flat[indices], indices.to(_index_dtype(flat.numel()))], tensor.shape

    decompress = TopK.decompress
    decompress_sum = TopK.decompress_sum

    def wire_bytes(self, numel, kept: int | None = None, dtype=torch.float32):
        _numel(numel)
        kept = numel if kept is None else checks.integer("kept", kept, 0, numel)
        return kept * (_size(dtype) + torch.empty(0, dtype=_index_dtype(numel)).element_size())

    def __repr__(self):
        return f"Threshold({self.value})"


class QSGD(Compressor):
    """Stochastic quantization to ``levels`` levels of a norm (Alistarh et al. 2017): unbiased.

    The tensor is cut into buckets of ``bucket_size`` consecutive entries (the last one shorter), each
    with its own norm: GRACE's default is 128 entries (``None``: one norm for the whole tensor). Each
    entry x becomes norm * sign(x) * l / levels, where l in {0, ..., levels} is |x| / norm * levels
    rounded down or up at random, up with probability equal to the fraction dropped.

    Sent, exactly: one float32 norm per bucket, l in ``ceil(log2(levels + 1))`` bits and the sign in
    one bit, each packed tightly: 15 levels are 4 bits + a sign, 5 bits per entry.
    """

    unbiased = True
    error_feedback = False
    has_scale = True

    def __init__(self, levels: int, bucket_size: int | None = 128, seed: int = 0):
        super().__init__(seed)
        if not (isinstance(levels, int) and 1 <= levels <= 255):
            raise ValueError(f"levels must be an integer from 1 to 255 (at most 8 bits), got {levels!r}")
        if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                                        or bucket_size < 1):
            raise ValueError(f"bucket_size is a number of entries (e.g. 128), or None for one norm; "
                             f"got {bucket_size!r}")
        self.levels, self.bucket_size = levels, bucket_size
        self.bits = max(1, math.ceil(math.log2(levels + 1)))  # bits of l, sign apart

    def _bucket(self, numel: int) -> int:
        return max(1, numel if self.bucket_size is None else min(self.bucket_size, numel))

    def compress(self, tensor):
        flat = tensor.flatten().float()
        n, b = flat.numel(), self._bucket(flat.numel())
        rows = torch.cat([flat, flat.new_zeros(-n % b)]).view(-1, b)
        norms = rows.norm(dim=1)
        safe = torch.where(norms == 0, torch.ones_like(norms), norms)  # nan or inf stays: its levels are zeroed below
        scaled = (rows.abs() / safe[:, None] * self.levels).flatten()[:n]
        level = torch.floor(scaled + self._uniform(scaled))  # floor(s + u): up with probability s - floor(s)
        # A gradient that is not finite (a run diverging) keeps its nan or inf in the norms, which decompress
        # multiplies back in, so the loss shows it; its levels, which must be integers to pack, are zeroed.
        level = torch.nan_to_num(level, nan=0.0, posinf=0.0)
        return [norms, pack_bits(level, self.bits), pack_bits(flat < 0, 1)], tensor.shape

    def decompress(self, payload, ctx):
        norms, levels, negative = payload
        n = math.prod(ctx)
        level = unpack_bits(levels, self.bits, n).float()
        sign = 1 - 2 * unpack_bits(negative, 1, n).float()
        return (norms.repeat_interleave(self._bucket(n))[:n] * sign * level / self.levels).view(ctx)

    def _rows(self, stacked, ctx):  # decompress, one rank's payload per row
        norms, levels, negative = stacked
        n = math.prod(ctx)
        level = _unpack_rows(levels, self.bits, n).float()
        sign = 1 - 2 * _unpack_rows(negative, 1, n).float()
        return norms.repeat_interleave(self._bucket(n), dim=1)[:, :n] * sign * level / self.levels

    def wire_bytes(self, numel, dtype=torch.float32):  # float32 norms whatever the dtype: compressed as float32
        _numel(numel), _size(dtype)
        return 4 * math.ceil(numel / self._bucket(numel)) + math.ceil(numel * self.bits / 8) + math.ceil(numel / 8)

    def __repr__(self):
        return f"QSGD({self.levels}, bucket_size={self.bucket_size})"


class SignSGD(Compressor):
    """One bit per entry, its sign, packed eight to a byte, plus one scale: the mean magnitude.

    Decompressed, each entry is ±scale. Biased: use it with error feedback. ``aggregate`` says how the
    ranks' signs combine after the all-gather: ``"mean"`` of the decompressed tensors, or
    ``"majority"``, the sign of the sum of signs times the mean scale (Bernstein et al. 2018).
    """

    has_scale = True

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

    def scales(self, payload, ctx) -> torch.Tensor:
        """The scale of each entry (one per tensor, repeated): what a majority vote averages."""
        return payload[0].expand(math.prod(ctx))

    def decompress(self, payload, ctx):
        return (payload[0] * self.signs(payload, ctx)).view(ctx)

    def _rows(self, stacked, ctx):
        scales, packed = stacked
        return scales * (_unpack_rows(packed, 1, math.prod(ctx)).float() * 2 - 1)

    def wire_bytes(self, numel, dtype=torch.float32):  # a float32 scale whatever the dtype
        _numel(numel), _size(dtype)
        return 4 + math.ceil(numel / 8)

    def __repr__(self):
        return f"SignSGD({self.aggregate!r})"


class TernGrad(Compressor):
    """Each entry to {-1, 0, +1} times the largest magnitude s, at random (Wen et al. 2017): ±s with
    probability |x| / s, else 0. Sent: s (float32) and 2 bits per entry, four to a byte.

    As the paper (and GRACE's ``terngrad.py``) does, the tensor is first clipped to ``clip_sigma``
    standard deviations (2.5), so that one outlier does not set s; ``clip_sigma=None`` does not clip.
    Unbiased for the clipped tensor (for the tensor itself only without clipping); run without memory.
    """

    error_feedback = False
    has_scale = True

    def __init__(self, clip_sigma: float | None = 2.5, seed: int = 0):
        super().__init__(seed)
        if clip_sigma is not None and not (isinstance(clip_sigma, (int, float)) and not isinstance(clip_sigma, bool)
                                           and 0 < clip_sigma < math.inf):
            raise ValueError(f"clip_sigma is a number of standard deviations (e.g. 2.5), or None; got {clip_sigma!r}")
        self.clip_sigma = clip_sigma
        self.unbiased = clip_sigma is None

    def compress(self, tensor):
        flat = tensor.flatten().float()
        # Entries all equal (or just one) have no outlier to clip, and a standard deviation of 0 (or,
        # rounded, 1e-8) would clip them all to nothing.
        if self.clip_sigma is not None and flat.numel() > 1 and bool((flat != flat[0]).any()):
            limit = self.clip_sigma * (flat - flat.mean()).square().mean().sqrt()
            flat = torch.maximum(torch.minimum(flat, limit), -limit)
        scale = flat.abs().max() if flat.numel() else flat.new_zeros(())
        keep = self._uniform(flat) < (flat.abs() / scale if scale > 0 else torch.zeros_like(flat))
        # -1, 0, 1; where the gradient is not finite (a run diverging) 0, and its nan or inf stays in the scale
        ternary = torch.where(keep, torch.sign(flat), torch.zeros_like(flat))
        return [scale.view(1), pack_bits(ternary + 1, 2)], tensor.shape

    def decompress(self, payload, ctx):
        scale, packed = payload
        return (scale * (unpack_bits(packed, 2, math.prod(ctx)).float() - 1)).view(ctx)

    def _rows(self, stacked, ctx):
        scales, packed = stacked
        return scales * (_unpack_rows(packed, 2, math.prod(ctx)).float() - 1)

    def wire_bytes(self, numel, dtype=torch.float32):  # a float32 scale whatever the dtype
        _numel(numel), _size(dtype)
        return 4 + math.ceil(numel / 4)

    def __repr__(self):
        return f"TernGrad(clip_sigma={self.clip_sigma})"


class _Cast(Compressor):
    summable = True
    error_feedback = False
    dtype = torch.float16

    def compress(self, tensor):
        cast = tensor.flatten().to(self.dtype)
        if not torch.isfinite(cast).all() and torch.isfinite(tensor).all():
            raise OverflowError(f"{self!r}: entries up to {tensor.abs().max().item():.3g} do not fit in {self.dtype} "
                                f"(largest {torch.finfo(self.dtype).max:.5g}) and would be sent as inf. Scale the "
                                f"gradient down first (torch's fp16 hook divides by the world size before the "
                                f"cast), or use BF16, which has float32's range.")
        return [cast], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].to(dtype).view(shape)

    def wire_bytes(self, numel, dtype=torch.float32):  # sent in its own 16 bits, whatever the gradient's dtype
        _size(dtype)
        return _numel(numel) * _size(self.dtype)


class FP16(_Cast):
    """Every entry as float16: half the bytes, summable (all-reduced in float16, as torch's fp16 hook)."""


class BF16(_Cast):
    """Every entry as bfloat16: float32's range with 8 bits of mantissa; summable."""

    dtype = torch.bfloat16


class PerTensor(Compressor):
    """A compressor applied to each of a flat tensor's pieces on its own: a bucket holds the
    gradients of several parameters, ``numels`` long each, and GRACE and the papers compress each
    parameter's gradient with its own scale (a norm, a mean, a maximum), not one for the bucket.

    The pieces' payloads are concatenated position by position (all the norms, then all the packed
    levels, ...), so a bucket still sends as many tensors as one piece does; what is sent is the sum
    of the pieces' bytes, exactly. Only for compressors whose payload size depends on numel alone.
    """

    def __init__(self, inner: Compressor, numels):
        if not isinstance(inner, Compressor) or isinstance(inner, PerTensor):
            raise TypeError(f"inner is the compressor applied to each piece, e.g. PerTensor(QSGD(15), numels); "
                            f"got {inner!r}")
        numels = checks.integers("numels", numels, 0)
        if not numels:
            raise ValueError("numels lists the pieces' sizes: at least one")
        if inner.variable_size:
            raise ValueError(f"{inner!r}: its payload size depends on the data; compress the bucket whole")
        self.inner, self.numels = inner, numels
        self.summable, self.unbiased, self.error_feedback = inner.summable, inner.unbiased, inner.error_feedback
        self.aggregate = getattr(inner, "aggregate", None)

    def _pieces(self, payload, ctx):
        ctxs, sizes, _ = ctx
        split = [t.split([s[i] for s in sizes]) for i, t in enumerate(payload)]
        return [([part[j] for part in split], c) for j, c in enumerate(ctxs)]

    def compress(self, tensor):
        flat = tensor.flatten()
        if flat.numel() != sum(self.numels):
            raise ValueError(f"the tensor has {flat.numel()} entries, the pieces {sum(self.numels)}")
        done = [self.inner.compress(piece) for piece in flat.split(self.numels)]
        sizes = [[t.numel() for t in payload] for payload, _ in done]
        payload = [torch.cat(parts) for parts in zip(*(p for p, _ in done))]
        return payload, ([c for _, c in done], sizes, tensor.shape)

    def decompress(self, payload, ctx):
        return torch.cat([self.inner.decompress(p, c).flatten() for p, c in self._pieces(payload, ctx)]).view(ctx[2])

    def decompress_sum(self, payloads, ctx):
        if not hasattr(self.inner, "_rows"):
            pieces = [self._pieces(p, ctx) for p in payloads]  # [rank][piece] -> (payload, ctx)
            return torch.cat([self.inner.decompress_sum([rank[j][0] for rank in pieces], c).flatten()
                              for j, c in enumerate(ctx[0])]).view(ctx[2])
        return super().decompress_sum(payloads, ctx)

    def _rows(self, stacked, ctx):  # the ranks' payloads cut into pieces along the rows, each piece decompressed
        ctxs, sizes, _ = ctx
        split = [t.split([s[i] for s in sizes], dim=1) for i, t in enumerate(stacked)]
        return torch.cat([self.inner._rows([part[j] for part in split], c).flatten(1) for j, c in enumerate(ctxs)],
                         dim=1)

    @staticmethod
    def _shape(ctx):
        return ctx[2]

    def signs(self, payload, ctx):
        return torch.cat([self.inner.signs(p, c) for p, c in self._pieces(payload, ctx)])

    def scales(self, payload, ctx):
        return torch.cat([self.inner.scales(p, c) for p, c in self._pieces(payload, ctx)])

    def wire_bytes(self, numel, dtype=torch.float32):
        if _numel(numel) != sum(self.numels):
            raise ValueError(f"numel {numel} is not the pieces' {sum(self.numels)}")
        return sum(self.inner.wire_bytes(n, dtype) for n in self.numels)

    def __repr__(self):
        return f"PerTensor({self.inner!r}, {len(self.numels)} tensors)"


class DensityWarmUp:
    """DGC's warm-up of the density (the fraction of entries sent): over the first ``warmup_steps``
    steps, ``stages`` equal stages at 25%, 6.25%, 1.5625%, 0.39%, ... (each a quarter of the one
    before, never below ``final``), then ``final``. Lin et al. warm up over 4 epochs to 0.1%."""

    def __init__(self, final: float, warmup_steps: int = 0, stages: int = 4):
        _check_ratio(final)
        checks.integer("warmup_steps", warmup_steps, 0)
        checks.integer("stages", stages, 1)
        self.final, self.warmup_steps, self.stages = final, warmup_steps, stages

    def __call__(self, step: int) -> float:
        checks.integer("step", step, 0)
        if step >= self.warmup_steps:
            return self.final
        stage = step * self.stages // self.warmup_steps
        return max(self.final, 0.25 ** (stage + 1))

    def __repr__(self):
        return f"DensityWarmUp({self.final}, warmup_steps={self.warmup_steps}, stages={self.stages})"
