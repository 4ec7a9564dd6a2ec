"""Notebook 05's exercises: answers a student might give to the ZeRO-2 exercise (wrong ones, each wrong in
one way the exercise is about, and right ones in other styles than solutions/), and the worker that
measures what ShardedDataParallel sends. spawn sends functions by name, so they live in a module."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import all_reduce  # imported by name: bypasses `dist.all_reduce`

from course_lib import collectives, sharding
from course_lib.collectives import ring_all_reduce  # imported by name: bypasses `collectives.ring_all_reduce`


def _padded(grads, group=None):
    """The unit's gradients flattened in order, padded with zeros to a multiple of p: as the exercise asks."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    return torch.cat([flat, flat.new_zeros(-len(flat) % dist.get_world_size(group))])


def _mine(vector, group=None):
    return vector.tensor_split(dist.get_world_size(group))[dist.get_rank(group)]


def zero2_by_all_reduce(grads, group=None):
    padded = _padded(grads, group)
    dist.all_reduce(padded, group=group)  # the right numbers, for twice the bytes
    return _mine(padded / dist.get_world_size(group), group).clone()


def zero2_by_imported_all_reduce(grads, group=None):
    padded = _padded(grads, group)
    all_reduce(padded, group=group)
    return _mine(padded / dist.get_world_size(group), group).clone()


def zero2_by_ring_all_reduce(grads, group=None):
    padded = _padded(grads, group)
    collectives.ring_all_reduce(padded, group=group)
    return _mine(padded / dist.get_world_size(group), group).clone()


def zero2_by_imported_ring_all_reduce(grads, group=None):
    padded = _padded(grads, group)
    ring_all_reduce(padded, group=group)
    return _mine(padded / dist.get_world_size(group), group).clone()


def zero2_by_course_reduce_scatter(grads, group=None):
    padded = _padded(grads, group)  # notebook 02's reference: an all-reduce inside
    return collectives.reduce_scatter(padded, group=group) / dist.get_world_size(group)


def zero2_sum(grads, group=None):
    return collectives.ring_reduce_scatter(_padded(grads, group), group=group).clone()  # the sum, not the mean


def zero2_whole_gradient(grads, group=None):
    padded = _padded(grads, group)
    collectives.ring_reduce_scatter(padded, group=group)
    return padded / dist.get_world_size(group)  # the whole vector: this rank's slice and others' partial sums


def zero2_unpadded(grads, group=None):
    flat = torch.cat([g.reshape(-1) for g in grads])  # tensor_split's chunks, of unequal lengths where p does
    return collectives.ring_reduce_scatter(flat, group=group) / dist.get_world_size(group)  # not divide n


def zero2_view(grads, group=None):
    padded = _padded(grads, group)  # the right numbers, in a view that keeps all of padded alive
    return collectives.ring_reduce_scatter(padded, group=group).div_(dist.get_world_size(group))


def zero2_wrong_rank(grads, group=None):
    padded = _padded(grads, group)
    collectives.ring_reduce_scatter(padded, group=group)
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    return padded.tensor_split(p)[(rank + 1) % p] / p  # the next rank's chunk: a partial sum


def zero2_reversed(grads, group=None):
    flat = torch.cat([g.reshape(-1) for g in reversed(grads)])  # the bias before the weight
    padded = torch.cat([flat, flat.new_zeros(-len(flat) % dist.get_world_size(group))])
    return collectives.ring_reduce_scatter(padded, group=group) / dist.get_world_size(group)


def zero2_divided_first(grads, group=None):
    padded = _padded(grads, group) / dist.get_world_size(group)  # right: the mean of the shares, then a copy
    return collectives.ring_reduce_scatter(padded, group=group).clone()


def measure_bytes_sent(rank, world_size, steps=3):
    """For each stage, a model of 12 parameters (divisible by 2 and 3) and one of 23 (prime), each one
    ShardedDataParallel unit trained with Adam: the bytes this rank sent in each step (collectives.sent)."""
    out = []
    for stage in range(4):
        for inputs, make in ((5, lambda: nn.Linear(5, 2)),
                             (4, lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))):
            torch.manual_seed(0)
            module = make()
            n_params = sum(p.numel() for p in module.parameters())
            model = sharding.ShardedDataParallel(module, stage)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            sent = []
            for _ in range(steps):
                x = torch.randn(6, inputs, generator=gen)
                collectives.sent.reset()
                opt.zero_grad()
                F.mse_loss(model(x), torch.zeros(6, 2)).backward()
                opt.step()
                sent.append(collectives.sent.bytes)
            out.append({"stage": stage, "n_params": n_params, "sent": sent})
    return out
