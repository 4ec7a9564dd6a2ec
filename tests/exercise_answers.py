"""Answers a student might give to the distributed exercises (notebooks 00 and 02): wrong ones, each
wrong in one way the exercise is about, and a few right ones in other styles than solutions/.
spawn sends functions by name, so they live in a module."""

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # imported by name: bypasses `dist.all_reduce`

from course_lib import collectives as C


def todo(*args):
    raise NotImplementedError  # the unsolved exercise, as the notebooks store it


# --- notebook 00: sum of squares with one collective ------------------------------------------------


def sum_of_squares_without_communicating(one, vector):
    p = dist.get_world_size()
    return one.new_tensor([float(sum((r + 1) ** 2 for r in range(p)))])  # the formula: no collective


def sum_of_squares_in_two_collectives(one, vector):
    out = one * one
    dist.reduce(out, dst=0)
    dist.broadcast(out, src=0)
    return out


def sum_without_squaring(one, vector):
    out = one.clone()
    dist.all_reduce(out)
    return out


def sum_of_squares_by_imported_all_reduce(one, vector):
    out = one * one
    all_reduce(out)  # right, and still one collective when imported by name
    return out


def elementwise_sum(one, vector):
    out = vector.clone()
    dist.all_reduce(out)  # the default op is a sum, not the maximum
    return out


# --- notebook 02: collectives from send and recv ------------------------------------------------------


def reduce_scatter_by_all_reduce(tensor):
    total = tensor.clone()
    dist.all_reduce(total)  # right numbers, but the exercise allows only send/recv
    return total.tensor_split(dist.get_world_size())[dist.get_rank()].clone()


def reduce_scatter_by_imported_all_reduce(tensor):
    total = tensor.clone()
    all_reduce(total)
    return total.tensor_split(dist.get_world_size())[dist.get_rank()].clone()


def reduce_scatter_by_reduce_scatter(tensor):
    p = dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    out = torch.empty_like(chunks[dist.get_rank()])
    dist.reduce_scatter(out, chunks)  # gloo has none: refused before it gets that far
    return out


def reduce_scatter_ring_owner(tensor):
    # the first half of ring_all_reduce as it is: rank r ends owning chunk r + 1, not chunk r
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send_i, recv_i = (rank - step) % p, (rank - step - 1) % p
        received = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i], dst=right), dist.irecv(received, src=left)]
        for r in reqs:
            r.wait()
        chunks[recv_i] += received
    return chunks[(rank + 1) % p]


def ring_shift_by_all_gather(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    everyone = [torch.empty_like(tensor) for _ in range(p)]
    dist.all_gather(everyone, tensor)
    return everyone[(rank - 1) % p]


def ring_shift_the_wrong_way(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    reqs = [dist.isend(tensor, dst=(rank - 1) % p), dist.irecv(received, src=(rank + 1) % p)]
    for r in reqs:
        r.wait()
    return received


def halving_doubling_by_all_reduce(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def halving_doubling_by_ring(tensor):
    # a right all-reduce from send/recv, but a ring (2(p - 1) messages), not recursive doubling
    return C.ring_all_reduce(tensor.clone())


def ring_shift_by_batch_isend_irecv(tensor):
    # right, and allowed: batch_isend_irecv posts isend and irecv together
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, (rank + 1) % p), dist.P2POp(dist.irecv, received, (rank - 1) % p)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return received


def halving_doubling_by_blocking_send_recv(tensor):
    # right: in each round the lower rank of a pair sends first, the higher receives first
    rank, p = dist.get_rank(), dist.get_world_size()
    out, distance = tensor.clone(), 1
    while distance < p:
        peer, received = rank ^ distance, torch.empty_like(out)
        if rank < peer:
            dist.send(out, dst=peer)
            dist.recv(received, src=peer)
        else:
            dist.recv(received, src=peer)
            dist.send(out, dst=peer)
        out += received
        distance *= 2
    return out
