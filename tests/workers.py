"""Worker functions for the tests: spawn sends functions by name, so they live in a module."""

import os
import time

import torch
import torch.distributed as dist

from course_lib.launch import report_progress


def report(rank, world_size, tag):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "tag": tag,
        "sum": t.item(),
        "env": {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "pid": os.getpid(),
    }


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError("rank one divides by zero")
    dist.barrier()  # the peer waits here for a rank that never comes
    return rank


def sleep_on_rank_zero(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def exit_hard_on_last_rank(rank, world_size):
    if rank == world_size - 1:
        os._exit(3)
    dist.barrier()
    return rank


def big_tensor(rank, world_size):
    return torch.full((1000, 1000), float(rank))


def count_up(rank, world_size, n):
    for _ in range(n):
        report_progress()
    return n
