"""Notebook 04: DDP in practice."""

import torch.distributed as dist

from solutions.nb03 import _buckets


def my_ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap  # DDP's smaller first bucket, only when no cap is given
    rebuilt = [sum(sizes_bytes[i] for i in b) for b in _buckets(sizes_bytes, first_cap, cap)]
    synchronizing = steps * (1 if no_sync else k)  # backward passes outside no_sync
    if synchronizing == 0:
        return []
    # the first one: a single bucket of every gradient, in parameter order; then the rebuilt buckets
    return [sum(sizes_bytes)] + rebuilt * (synchronizing - 1)


def my_memory_hook(state, bucket):
    """Average the bucket; add each parameter's slice of the average to its own memory, keyed by the
    parameter, which stays the same tensor whichever bucket DDP puts it in."""
    params, buffer = bucket.parameters(), bucket.buffer()
    buffer.div_(dist.get_world_size(state.process_group))
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()

    def keep(fut):
        averaged = fut.value()[0]
        offset = 0
        for p in params:
            piece = averaged[offset:offset + p.numel()].view_as(p)
            state.memory[p] = state.memory.get(p, 0) + piece.detach().clone()
            offset += p.numel()
        return averaged

    return fut.then(keep)
