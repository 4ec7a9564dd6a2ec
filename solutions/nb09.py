"""Notebook 09: compression."""

import torch
import torch.distributed as dist


def topk_average(tensor, k):
    # each rank's k largest magnitudes, at indices of its own: they do not line up across ranks, so
    # values and indices are all-gathered (an all-reduce would add values at different places)
    indices = tensor.abs().topk(k).indices
    values = tensor[indices]
    p = dist.get_world_size()
    all_values = [torch.empty_like(values) for _ in range(p)]
    all_indices = [torch.empty_like(indices) for _ in range(p)]
    dist.all_gather(all_values, values)
    dist.all_gather(all_indices, indices)
    out = torch.zeros_like(tensor)
    for v, i in zip(all_values, all_indices):
        out.index_add_(0, i, v)  # two ranks may keep the same entry: add, do not overwrite
    return out / p


def my_stochastic_round(x, levels, u):
    norm = x.norm()
    if norm == 0:
        return torch.zeros_like(x)
    scaled = x.abs() / norm * levels  # between 0 and levels
    low = scaled.floor()
    up = u < scaled - low  # up with probability equal to the fraction dropped: E = scaled
    return torch.sign(x) * norm * (low + up.float()) / levels


def my_dgc_step(g, u, v, momentum, k):
    u = momentum * u + g  # momentum correction: the velocity first...
    v = v + u  # ...then accumulated
    chosen = v.abs().topk(k).indices
    sent = torch.zeros_like(v)
    sent[chosen] = v[chosen]
    u = u.clone()
    u[chosen] = 0  # momentum-factor masking
    return sent, u, v - sent
