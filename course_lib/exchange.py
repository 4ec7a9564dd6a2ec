"""How payloads travel: by what the compressor's payload allows.

Whether ranks can *sum* payloads decides how they communicate (:attr:`Compressor.summable`):

* ``FP16``, ``BF16`` and ``RandomK`` with a shared seed: every rank's payload lines up entry for entry,
  so the sum of payloads is the payload of the sum: one all-reduce.
* ``TopK``, ``Threshold``, ``QSGD``, ``SignSGD``, ``TernGrad``: each rank keeps other entries, or
  scales its own way; the ranks all-gather every payload and each decompresses all of them.

Every tensor sent goes through ``course_lib.hooks``' counted collectives (``hooks.traffic``).
"""

import torch
import torch.distributed as dist

from course_lib import hooks
from course_lib.compressors import Compressor, PerTensor
from course_lib.utils import checks

__all__ = ["exchange", "combine", "communicate", "WAYS"]

WAYS = ("all_reduce", "all_gather")  # torch's names of the two collectives


def exchange(compressor: Compressor, payload: list[torch.Tensor], process_group=None,
             communicator: str = "all_reduce") -> list[list[torch.Tensor]]:
    """Send this rank's payload; what came back: ``[summed payload]`` after an all-reduce (summable
    compressors only), or every rank's payload in rank order after an all-gather. Payloads whose size
    depends on the data (``variable_size``: ``Threshold``) first gather their sizes (one int64 each)
    and are padded to the largest. Every tensor sent goes through ``hooks``, counted in ``hooks.traffic``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(payload, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in payload):
        raise TypeError(f"payload is a list of tensors, as compressor.compress(tensor)[0] gives it; "
                        f"got {type(payload).__name__}")
    if communicator == "all_reduce":
        if not compressor.summable:
            raise ValueError(f"{compressor!r} payloads cannot be summed (each rank keeps other entries or its "
                             f"own scale): use communicator='all_gather'")
        summed = [t.clone() for t in payload]
        for t in summed:
            hooks.all_reduce_counted(t, group)
        return [summed]
    if communicator != "all_gather":
        raise ValueError(f"communicator must be 'all_reduce' or 'all_gather', got {communicator!r}")
    if compressor.variable_size:
        kept = hooks.all_gather_counted(torch.tensor([payload[0].numel()], device=payload[0].device), group)
        counts = [int(k) for k in kept]
        padded = [torch.cat([t, t.new_zeros(max(counts) - t.numel())]) for t in payload]
        gathered = [hooks.all_gather_counted(t, group) for t in padded]
        return [[g[r][: counts[r]] for g in gathered] for r in range(group.size())]
    gathered = [hooks.all_gather_counted(t, group) for t in payload]
    return [[g[r] for g in gathered] for r in range(group.size())]


def combine(compressor: Compressor, received: list[list[torch.Tensor]], ctx, world_size: int) -> torch.Tensor:
    """The mean over ``world_size`` ranks, from what :func:`exchange` returned: one summed payload
    decompressed once, or every rank's decompressed and averaged (``decompress_sum``; signSGD with ``"majority"``: the
    sign of the sum of signs, times the mean scale)."""
    checks.integer("world_size", world_size, 1)
    if len(received) == 1:  # summed by an all-reduce (or a group of one)
        return compressor.decompress(received[0], ctx) / world_size
    if getattr(compressor, "aggregate", None) == "majority":  # SignSGD, whole or per tensor
        votes = sum(compressor.signs(p, ctx) for p in received)
        scale = sum(compressor.scales(p, ctx) for p in received) / world_size
        shape = ctx[2] if isinstance(compressor, PerTensor) else ctx
        return (scale * torch.sign(votes)).view(shape)
    return compressor.decompress_sum(received, ctx) / world_size


def communicate(compressor: Compressor, payload: list[torch.Tensor], ctx, process_group=None,
                communicator: str = "all_reduce") -> torch.Tensor:
    """The mean over the group's ranks of their decompressed payloads, every rank the same:
    :func:`exchange`, then :func:`combine`. ``communicator="all_reduce"`` sums the payloads (summable
    compressors only) and decompresses once; ``communicator="all_gather"`` gathers every rank's payload."""
    group = process_group if process_group is not None else dist.group.WORLD
    return combine(compressor, exchange(compressor, payload, group, communicator), ctx, group.size())
