"""Notebook 04's exercises: answers a student might give to the ZeRO-2 exercise (wrong ones, each wrong in
one way the exercise is about, and right ones in other styles than solutions/), and the worker that
measures what ShardedDataParallel sends. spawn sends functions by name, so they live in a module."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import all_reduce  # imported by name: bypasses `dist.all_reduce`

from course_lib import collectives, sharding
from course_lib.collectives import ring_all_reduce  # imported by name: bypasses `collectives.ring_all_reduce`


def _slice(tensor, group=None):
    return tensor.tensor_split(dist.get_world_size(group))[dist.get_rank(group)]


def zero2_by_all_reduce(grad, group=None):
    dist.all_reduce(grad, group=group)  # the right numbers, for twice the bytes
    return _slice(grad / dist.get_world_size(group), group).clone()


def zero2_by_imported_all_reduce(grad, group=None):
    all_reduce(grad, group=group)
    return _slice(grad / dist.get_world_size(group), group).clone()


def zero2_by_ring_all_reduce(grad, group=None):
    collectives.ring_all_reduce(grad, group=group)
    return _slice(grad / dist.get_world_size(group), group).clone()


def zero2_by_imported_ring_all_reduce(grad, group=None):
    ring_all_reduce(grad, group=group)
    return _slice(grad / dist.get_world_size(group), group).clone()


def zero2_by_course_reduce_scatter(grad, group=None):
    return collectives.reduce_scatter(grad, group=group) / dist.get_world_size(group)  # notebook 02's reference


def zero2_sum(grad, group=None):
    return collectives.ring_reduce_scatter(grad, group=group).clone()  # the sum, not the mean


def zero2_whole_gradient(grad, group=None):
    collectives.ring_reduce_scatter(grad, group=group)
    return grad / dist.get_world_size(group)  # the whole buffer: this rank's slice and others' partial sums


def zero2_padded(grad, group=None):
    p = dist.get_world_size(group)
    padded = torch.cat([grad, grad.new_zeros(-len(grad) % p)])  # as ShardedDataParallel's units, but the
    return collectives.ring_reduce_scatter(padded, group=group) / p  # exercise asks for tensor_split's slices


def zero2_divided_first(grad, group=None):
    return collectives.ring_reduce_scatter(grad / dist.get_world_size(group), group=group).clone()  # right


def zero2_view_of_the_gradient(grad, group=None):
    return collectives.ring_reduce_scatter(grad, group=group).div_(dist.get_world_size(group))  # right: a view


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
