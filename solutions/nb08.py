"""Notebook 08: PowerSGD in practice (the hook a student writes in my_powersgd_hook.py)."""

import torch
import torch.distributed as dist

from course_lib import hooks
from course_lib.lowrank import orthogonalize_


def my_powersgd_hook(state, bucket):
    r = state.matrix_approximation_rank
    world_size = dist.get_world_size()
    buffer = bucket.buffer()
    key = bucket.index()  # the buckets keep their layout from step 1 on: a bucket's index is enough
    if key in state.error_dict:
        buffer += state.error_dict[key]  # error feedback: add what was left out last step
    wanted = buffer.clone()  # what this rank wants to send
    grads = bucket.gradients()  # views into buffer
    matrices = [g for g in grads if g.dim() == 2]
    vectors = [g for g in grads if g.dim() != 2]
    if key not in state.q_memory_dict:  # the first compressed step: fresh Q's; then warm start
        state.q_memory_dict[key] = state.fresh_qs([(M.shape[1], r) for M in matrices])
    qs = state.q_memory_dict[key]

    # first all-reduce: every P = M Q and the vectors (sent whole), in one buffer
    ps = [M @ orthogonalize_(q) for M, q in zip(matrices, qs)]
    flat = torch.cat([p.flatten() for p in ps] + [v.flatten() for v in vectors])
    dist.all_reduce(flat)  # summed: P is orthogonalized next, which undoes any scale
    offset = 0
    for p in ps:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    for v in vectors:
        v.copy_(flat[offset : offset + v.numel()].view_as(v) / world_size)
        offset += v.numel()

    # second all-reduce: every Q = M^T P, from the orthogonalized P
    new_qs = [M.T @ orthogonalize_(p) for M, p in zip(matrices, ps)]
    flat = torch.cat([q.flatten() for q in new_qs])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for q in new_qs:
        q.copy_(flat[offset : offset + q.numel()].view_as(q))
        offset += q.numel()

    for M, p, q in zip(matrices, ps, new_qs):
        M.copy_(p @ q.T)  # the average of every rank's M, projected on span(P)
    state.q_memory_dict[key] = new_qs  # warm start
    state.error_dict[key] = wanted - buffer  # what this rank wanted to send, minus what all received
    return hooks.completed_future(buffer)
