"""Workers for test_collectives: run the course's collectives and torch's on the same inputs."""

import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib.bandwidth import measure_collective
from course_lib.costmodel import BUS_FACTORS


def subgroup(rank, world_size):
    """Ranks 1..p-1 form a group; its rank 0 is global rank 1."""
    group = dist.new_group(list(range(1, world_size)))
    if rank == 0:
        return None
    x = torch.arange(5, dtype=torch.float32) * (rank + 1)
    ring, naive, bcast, red = x.clone(), x.clone(), x.clone(), x.clone()
    C.ring_all_reduce(ring, group=group)
    C.naive_all_reduce(naive, group=group)
    C.tree_broadcast(bcast, src=1, group=group)  # group rank 1 = global rank 2
    C.tree_reduce(red, dst=0, group=group)
    return {"ring": ring, "naive": naive, "bcast": bcast, "reduce": red}


def measure_all_ops(rank, world_size):
    return {op: measure_collective(op, [4096, 65536], iters=2, warmup=1) for op in BUS_FACTORS}


def wrong_reduce_scatter(tensor, group=None):
    return tensor.tensor_split(dist.get_world_size())[dist.get_rank()].clone()  # forgot to sum


def todo(tensor, group=None):
    raise NotImplementedError
