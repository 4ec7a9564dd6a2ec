"""Notebook 05: sharded data parallelism, ZeRO-1, 2 and 3 and FSDP (``zero2_gradient`` is what a student
writes in my_sharding.py: it runs in the worker processes; the other two are written in the notebook).

``zero2_gradient(grads, group=None)`` takes one unit's gradients (a list of tensors of any shapes) and
returns this rank's slice of their average over the ranks as sharded data parallelism keeps it: the
tensors flattened in order, padded with zeros to p·c numbers (c = ceil(n / p)), numbers
[rank·c, (rank + 1)·c) of the average, in a tensor of its own."""

import math

import torch
import torch.distributed as dist

from course_lib import collectives


def zero2_gradient(grads, group=None):
    p = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % p)])  # p chunks of c numbers each
    # sums in place and returns this rank's chunk, a view into padded; dividing makes a new tensor of the
    # chunk alone, so the whole padded gradient need not be kept
    return collectives.ring_reduce_scatter(padded, group=group) / p


def my_zero_bytes(n_params, stage, world_size):
    shard = math.ceil(n_params / world_size)  # each rank's slice of a vector padded to a multiple of p

    def held(sharded_from):  # numbers held of a category that stages >= sharded_from shard
        return shard if stage >= sharded_from else n_params

    # fp16 parameters (2 bytes) from stage 3, fp16 gradients (2) from stage 2, and from stage 1 Adam's
    # fp32 master copy, momentum and variance (4 + 4 + 4 = 12)
    return 2 * held(3) + 2 * held(2) + 12 * held(1)


def my_bytes_sent(n_params, stage, world_size):
    chunk = math.ceil(n_params / world_size)  # the unit is padded: every ring step sends a whole chunk
    # stage 0: an all-reduce, 2 (p - 1) chunks; 1 and 2: a reduce-scatter + an all-gather, the same;
    # 3: the parameters gathered for forward and again for backward, + a reduce-scatter: 3 (p - 1)
    ring_halves = 3 if stage == 3 else 2
    return 4 * ring_halves * (world_size - 1) * chunk
