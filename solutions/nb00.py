"""Notebook 00: two small workers (each rank holds ``one = [rank + 1]`` and a random ``vector``)."""

import torch.distributed as dist


def sum_of_squares(one, vector):
    out = one * one
    dist.all_reduce(out)  # the sum over ranks of each rank's square
    return out


def elementwise_max(one, vector):
    out = vector.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out
