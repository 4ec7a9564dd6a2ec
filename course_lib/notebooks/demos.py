"""Small workers that the notebooks start with ``launch.spawn`` to show the algorithms at work.

They are top-level functions of an importable module, as ``spawn`` requires, and each is short
enough to be printed in a notebook. Nothing here is an algorithm of its own: the algorithms are in
``course_lib.launch``, ``course_lib.collectives`` and the modules after them.
"""

import os

import torch
import torch.distributed as dist

from course_lib.collectives import (
    blocking_ring_shift,
    naive_all_reduce,
    ring_all_reduce,
    ring_shift,
    tree_broadcast,
    tree_reduce,
)
from course_lib.launch import worker_device

__all__ = ["all_reduce_check", "rendezvous_demo", "ring_trace", "LENGTHS", "DTYPES", "compare_with_torch",
           "shift_worker"]


def all_reduce_check(rank: int, world_size: int) -> dict:
    """Notebook 00's smoke test: every rank contributes ``rank + 1``; all should end with the sum."""
    device = worker_device()
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    return {"rank": rank, "backend": dist.get_backend(), "sum": t.item(), "threads": torch.get_num_threads()}


def rendezvous_demo(rank: int, world_size: int, init_methods: list[str], env_port: int) -> list[dict]:
    """Worker for notebook 02: leave spawn's group and meet again through each of ``init_methods``.

    ``tcp://host:port`` (rank 0 listens there), ``file:///path`` (a file on a disk all ranks see)
    and ``env://`` (MASTER_ADDR and MASTER_PORT from the environment, as torchrun sets them; here
    ``env_port``) are three ways for processes to find each other. Each ends in a key-value Store
    through which the ranks swap their addresses.
    """
    out = []
    for method in init_methods:
        dist.destroy_process_group()
        if method == "env://":
            os.environ["MASTER_PORT"] = str(env_port)
        dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world_size)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out.append({"method": method.split(":")[0], "rank": dist.get_rank(), "sum": t.item()})
    return out


def ring_trace(rank: int, world_size: int) -> list:
    """Worker: a ring all-reduce in which rank r contributes 2**r to every chunk, traced step by step.

    A chunk's value is then the set of ranks whose data it holds, written in binary.
    """
    trace = [("start", 0, torch.full((world_size,), float(2**rank)))]
    ring_all_reduce(trace[0][2].clone(), trace=trace)
    return trace


LENGTHS = [0, 1, 2, 3, 5, 7, 64, 1001]
DTYPES = [torch.float32, torch.float64]


def _data(rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + n)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def compare_with_torch(rank: int, world_size: int, lengths=LENGTHS) -> list:
    """Worker: each algorithm and torch.distributed's on the same inputs, every length and dtype.

    Returns rows ``(name, length, dtype, ours, torch's, returned_the_input)``; a reduce's row
    only on its root, where its result is defined.
    """
    out = []
    for n in lengths:
        for dtype in DTYPES:
            x = _data(rank, n, dtype)
            for name, ours, theirs in [
                ("naive_all_reduce", naive_all_reduce, dist.all_reduce),
                ("ring_all_reduce", ring_all_reduce, dist.all_reduce),
            ]:
                a, b = x.clone(), x.clone()
                returned = ours(a)
                theirs(b)
                out.append((name, n, dtype, a, b, returned is a))
            for root in sorted({0, world_size - 1}):
                a, b = x.clone(), x.clone()
                tree_broadcast(a, src=root)
                dist.broadcast(b, src=root)
                out.append((f"tree_broadcast(src={root})", n, dtype, a, b, True))
                a, b = x.clone(), x.clone()
                tree_reduce(a, dst=root)
                dist.reduce(b, dst=root)
                if rank == root:  # defined on dst only
                    out.append((f"tree_reduce(dst={root})", n, dtype, a, b, True))
    return out


def shift_worker(rank: int, world_size: int, name: str) -> torch.Tensor:
    """Worker: ``ring_shift`` or ``blocking_ring_shift`` of the tensor ``[rank]``."""
    return {"ring_shift": ring_shift, "blocking_ring_shift": blocking_ring_shift}[name](torch.tensor([float(rank)]))
