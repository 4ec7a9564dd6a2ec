"""What is remembered: error feedback, one memory for every compressor and for PowerSGD.

A compressor drops part of each gradient. *Error feedback* keeps what was dropped on this rank and
adds it to the next gradient, so that nothing is lost for good, only late (GRACE's ``residual``
memory; Seide et al. 2014, Karimireddy et al. 2019). The hooks call it in two halves, around
compression::

    corrected = memory.compensate(key, gradient)   # the gradient plus what was left out last time
    ... compress and send corrected; ``sent`` is what this rank's gradient became ...
    memory.update(key, corrected, sent)            # keep corrected - sent for next time

Memory is kept per *parameter*, not per bucket: DDP lays its buckets out in parameter order for a
new model's first iteration and rebuilds them in gradient-ready order afterwards, and a memory keyed
by bucket would then hand one parameter's error to another. :class:`ParameterKeys` gives each
parameter a key; a bucket's *layout*, ``((key, numel), ...)``, tells the memory how to cut the
bucket's flat buffer into parameters.
"""

import math
import weakref

import torch
import torch.distributed as dist

from course_lib.utils import checks

__all__ = ["ParameterKeys", "ErrorFeedback", "NoMemory", "DGCMemory"]


class ParameterKeys:
    """A key per parameter: its position in the first layout that included it (parameter order, for
    a new DDP model's first bucket layout), so that keys match across ranks and after a checkpoint
    is loaded into a new model."""

    def __init__(self):
        self._keys: dict[int, tuple] = {}
        self._next = 0

    def __call__(self, params) -> list[int]:
        """The keys of ``params``; parameters never seen get the next free keys."""
        keys = []
        for p in params:
            entry = self._keys.get(id(p))
            if entry is None or entry[0]() is not p:  # unseen, or an id reused by a new object
                # a counter that only grows: a parameter that takes a dead one's id must not take
                # its key too, nor give its key to the next unseen parameter
                entry = (weakref.ref(p), self._next)
                self._next += 1
                self._keys[id(p)] = entry
            keys.append(entry[1])
        return keys

    def layout(self, params) -> tuple:
        """``((key, numel), ...)`` for ``params`` in order: how a bucket's buffer is cut into them."""
        if isinstance(params, torch.Tensor):  # its rows are not parameters
            raise TypeError("params is a list of parameters (bucket.parameters()), not one tensor: pass [p]")
        params = list(params)
        return tuple(zip(self(params), (p.numel() for p in params)))

    def reset(self) -> None:
        """Forget every parameter: the next ones seen take keys 0, 1, ... again (after a checkpoint
        is loaded, so that a new model's parameters find their memory)."""
        self._keys, self._next = {}, 0

    def __getstate__(self) -> dict:
        # Saved with a checkpoint, the keys start afresh when it is loaded: the parameters are then a
        # new model's, and take keys 0, 1, ... in the same first layout as the saved ones did.
        return {}

    def __setstate__(self, state: dict) -> None:
        self.reset()


def _pieces(key, numel: int) -> tuple:
    # A key that is a layout, ((parameter key, numel), ...), is kept piece by piece; any other key whole.
    if isinstance(key, tuple) and key and all(isinstance(k, tuple) and len(k) == 2 for k in key):
        return key
    return ((key, numel),)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pieces as one flat tensor: a view when they lie one after another in one buffer (as
    ``_Memory._put`` leaves a layout it was given whole), else a copy."""
    first = parts[0]
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for part in parts:
        if part.untyped_storage().data_ptr() != ptr or part.storage_offset() != offset or not part.is_contiguous():
            return torch.cat(parts)
        offset += part.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


class _Memory:
    """Tensors kept between steps, per parameter when the key is a layout ``((key, numel), ...)``:
    the hook passes its bucket's layout, so what is kept follows the parameters when DDP rebuilds
    its buckets in another order after the first iteration."""

    @staticmethod
    def _get(store: dict, key, numel: int) -> torch.Tensor | None:
        pieces = _pieces(key, numel)
        if any(k not in store for k, _ in pieces):
            return None
        kept = _joined([store[k] for k, _ in pieces])
        if kept.numel() != numel:
            raise ValueError(f"the memory kept {kept.numel()} numbers for key {key!r}, and now gets {numel}: a memory "
                             f"belongs to one model's tensors. Make a new one when the tensors change.")
        return kept

    @staticmethod
    def _put(store: dict, key, flat: torch.Tensor) -> None:
        pieces = _pieces(key, flat.numel())
        if sum(n for _, n in pieces) != flat.numel():
            raise ValueError(f"the layout {key!r} holds {sum(n for _, n in pieces)} numbers and the tensor "
                             f"{flat.numel()}: a layout lists every parameter of the bucket, ((key, numel), ...), "
                             f"as ParameterKeys.layout(bucket.parameters()) makes it")
        offset = 0
        for k, n in pieces:
            store[k] = flat[offset: offset + n]
            offset += n


class ErrorFeedback(_Memory):
    """Error feedback (memory): what compression left out of a tensor is added to it next time.

    ``compensate(key, tensor)`` returns tensor + what was left out last time; after compressing,
    ``update(key, corrected, sent)`` keeps ``corrected - sent``. Biased compressors (top-k, signs)
    need it to converge; unbiased ones can do without.
    """

    def __init__(self):
        self.memory: dict = {}

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        error = self._get(self.memory, key, tensor.numel())
        return tensor + error.view_as(tensor) if error is not None else tensor.clone()

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        _same_size(corrected, sent)
        self._put(self.memory, key, (corrected - sent).flatten())


def _same_size(corrected: torch.Tensor, sent: torch.Tensor) -> None:
    # corrected - sent would broadcast a (1,)-shaped or a (n, 1) tensor and keep a memory of the wrong size
    if corrected.shape != sent.shape:
        raise ValueError(f"update(key, corrected, sent): sent is what the corrected tensor became, of its shape; "
                         f"got shapes {tuple(corrected.shape)} and {tuple(sent.shape)}")


class NoMemory:
    """No error feedback: what compression leaves out is lost."""

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        pass


class DGCMemory(_Memory):
    """Deep Gradient Compression's memory (Lin et al., ICLR 2018), for top-k with momentum SGD.

    Plain error feedback keeps what was not sent and adds it to the next gradient; momentum is then
    applied by the optimizer to the *sparse* update, after the fact. DGC moves momentum before the
    sparsification, into each rank's memory (**momentum correction**)::

        u = momentum * u + g          # the rank's own velocity
        v = v + u                     # accumulated velocity: what top-k chooses from
        send top-k of v;  v = v - sent

    so that what is eventually sent is the momentum SGD update (train with the optimizer's
    ``momentum=0``). Two more pieces: **local gradient clipping** scales g so that its norm is at
    most ``clip_norm * sqrt(world_size)`` before it is added (the bucket's norm: the whole model when
    it fits one bucket). ``clip_norm`` is the norm one would clip the *averaged* gradient at. The
    paper's rule (Section 3.2, Appendix D) scales that threshold by N^(-1/2) for a worker's share of
    the sum, g / N in its Algorithm 1, since the sum of N independent shares has about sqrt(N) times
    the norm of one; on the worker's mean gradient g, N times its share, the same limit is
    ``clip_norm * sqrt(N)``. **Momentum-factor masking** zeroes u where an entry was sent, so that a
    stale velocity does not keep pushing an entry that has just been applied. ``momentum=0`` without
    clipping and masking is plain error feedback.
    """

    def __init__(self, momentum: float = 0.9, clip_norm: float | None = None, masking: bool = True,
                 world_size: int | None = None):
        if checks.number("momentum (in [0, 1), e.g. 0.9)", momentum, 0) >= 1:
            raise ValueError(f"momentum must be in [0, 1), e.g. 0.9; got {momentum}")
        if clip_norm is not None:  # NaN or inf would never clip: refused, not taken as "off" (that is None)
            checks.number("clip_norm (a gradient norm, or None for no clipping)", clip_norm, 0, low_open=True)
        checks.boolean("masking", masking)
        if world_size is not None:
            checks.integer("world_size", world_size, 1)
        self.momentum, self.clip_norm, self.masking, self.world_size = momentum, clip_norm, masking, world_size
        self.velocity: dict = {}  # u
        self.memory: dict = {}  # v, after what was sent is taken out

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        g = tensor.flatten()
        if self.clip_norm is not None:
            world_size = self.world_size if self.world_size is not None else dist.get_world_size()
            limit, norm = self.clip_norm * math.sqrt(world_size), g.norm()  # g: the mean, not g / N
            g = g * (limit / norm) if norm > limit else g
        u = self._get(self.velocity, key, g.numel())
        u = g.clone() if u is None else self.momentum * u + g
        self._put(self.velocity, key, u)
        v = self._get(self.memory, key, g.numel())
        return (u.clone() if v is None else v + u).view_as(tensor)

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        _same_size(corrected, sent)
        self._put(self.memory, key, (corrected - sent).flatten())
        if self.masking:
            u = self._get(self.velocity, key, sent.numel())
            self._put(self.velocity, key, u.masked_fill(sent.flatten() != 0, 0.0))
