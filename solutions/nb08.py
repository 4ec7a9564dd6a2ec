"""Notebook 08: PowerSGD in practice (the batched hook a student writes in my_batched_hook.py)."""

import math

import torch
import torch.distributed as dist

from course_lib import hooks
from course_lib.lowrank import orthogonalize_


def my_batched_hook(state, bucket):
    r = state.matrix_approximation_rank
    world_size = dist.get_world_size()
    buffer = bucket.buffer()
    key = bucket.index()  # the buckets keep their layout once DDP has rebuilt them (after step 1)
    n = buffer.numel()
    rows = math.ceil(math.sqrt(n))
    cols = math.ceil(n / rows)  # rows * cols >= n, and rows + cols <= 2 ceil(sqrt(n))
    r = min(r, rows, cols)
    error, q = state.memory.get(key, (torch.zeros_like(buffer), None))
    wanted = buffer + error  # error feedback: what this rank wants to send
    matrix = torch.zeros(rows * cols, dtype=buffer.dtype)
    matrix[:n] = wanted
    matrix = matrix.view(rows, cols)
    if q is None:
        q = state.fresh_q(cols, r)

    p = matrix @ orthogonalize_(q)
    dist.all_reduce(p)  # summed: the orthogonalization next undoes any scale
    orthogonalize_(p)
    q = matrix.T @ p
    dist.all_reduce(q)
    q /= world_size

    received = (p @ q.T).flatten()[:n]
    buffer.copy_(received)
    state.memory[key] = (wanted - received, q)  # what was left out, and Q for the next step (warm start)
    return hooks.completed_future(buffer)
