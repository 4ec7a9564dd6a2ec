"""Notebook 02: collectives from send and recv (the functions a student writes in my_collectives.py)."""

import torch
import torch.distributed as dist


def ring_shift(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    # post both at once: a blocking send to the right would wait for a receive the neighbour has
    # not posted yet, on every rank at the same time
    reqs = [dist.isend(tensor, dst=(rank + 1) % p), dist.irecv(received, src=(rank - 1) % p)]
    for r in reqs:
        r.wait()
    return received


def recursive_doubling_all_reduce(tensor):
    # in round k swap the whole tensor with the rank that differs in bit k and add: log2(p) rounds
    rank, p = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    distance = 1
    while distance < p:
        peer = rank ^ distance
        received = torch.empty_like(out)
        reqs = [dist.isend(out, dst=peer), dist.irecv(received, src=peer)]
        for r in reqs:
            r.wait()
        out += received  # a + b == b + a exactly, so both partners hold the same sum
        distance *= 2
    return out


def recursive_halving_reduce_scatter(tensor):
    # chunks lo..hi-1 are this rank's to reduce; each round the partner (the rank that differs in the
    # round's bit) gets the half it keeps and sends us the half we keep, which we add
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    lo, hi = 0, p
    distance = p // 2
    while distance >= 1:
        peer, mid = rank ^ distance, lo + distance
        keep, give = (range(mid, hi), range(lo, mid)) if rank & distance else (range(lo, mid), range(mid, hi))
        outgoing = torch.cat([chunks[i] for i in give])
        incoming = torch.empty(sum(chunks[i].numel() for i in keep), dtype=tensor.dtype)
        reqs = [dist.isend(outgoing, dst=peer), dist.irecv(incoming, src=peer)]
        for r in reqs:
            r.wait()
        for i, part in zip(keep, incoming.split([chunks[i].numel() for i in keep])):
            chunks[i] += part
        lo, hi = keep.start, keep.stop
        distance //= 2
    return chunks[rank]
