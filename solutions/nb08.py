"""Notebook 08: compression."""

import math

import torch


def my_topk_allgather_bytes(numel, ratio, world_size):
    k = max(1, math.ceil(ratio * numel))
    return (world_size - 1) * k * 8  # 4 bytes of value and 4 of index from each other rank


def my_random_k(x, indices):
    out = torch.zeros_like(x)
    out[indices] = x[indices] * x.numel() / len(indices)
    return out


def my_dgc_step(g, u, v, momentum, k):
    u = momentum * u + g  # momentum correction: the velocity first...
    v = v + u  # ...then accumulated
    chosen = v.abs().topk(k).indices
    sent = torch.zeros_like(v)
    sent[chosen] = v[chosen]
    u = u.clone()
    u[chosen] = 0  # momentum-factor masking
    return sent, u, v - sent
