"""Notebook 02: collectives from send and recv (the functions a student writes in my_collectives.py)."""

import torch
import torch.distributed as dist


def reduce_scatter(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send_i, recv_i = (rank - step - 1) % p, (rank - step - 2) % p
        received = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i], dst=right), dist.irecv(received, src=left)]
        for r in reqs:
            r.wait()
        chunks[recv_i] += received
    return chunks[rank]


def ring_shift(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    # post both at once: a blocking send to the right would wait for a receive the neighbour has
    # not posted yet, on every rank at the same time
    reqs = [dist.isend(tensor, dst=(rank + 1) % p), dist.irecv(received, src=(rank - 1) % p)]
    for r in reqs:
        r.wait()
    return received


def halving_doubling_all_reduce(tensor):
    # Recursive doubling, the simplest form: in round k swap the whole tensor with the rank that
    # differs in bit k and add. log2(p) rounds. (Rabenseifner's halving-doubling sends halves
    # instead; the sums are the same.)
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
