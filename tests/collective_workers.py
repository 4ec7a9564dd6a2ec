"""Workers for test_collectives: run the course's collectives and torch's on the same inputs."""

import torch
import torch.distributed as dist

from course_lib import collectives as C

LENGTHS = [0, 1, 2, 3, 5, 7, 64, 1001]
DTYPES = [torch.float32, torch.float64]


def _data(rank, n, dtype):
    g = torch.Generator().manual_seed(7919 * rank + n)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def compare_with_torch(rank, world_size):
    out = []
    for n in LENGTHS:
        for dtype in DTYPES:
            x = _data(rank, n, dtype)
            for name, ours, theirs in [
                ("naive_all_reduce", C.naive_all_reduce, dist.all_reduce),
                ("ring_all_reduce", C.ring_all_reduce, dist.all_reduce),
            ]:
                a, b = x.clone(), x.clone()
                returned = ours(a)
                theirs(b)
                out.append((name, n, dtype, a, b, returned is a))
            for root in sorted({0, world_size - 1}):
                a, b = x.clone(), x.clone()
                C.tree_broadcast(a, src=root)
                dist.broadcast(b, src=root)
                out.append((f"tree_broadcast(src={root})", n, dtype, a, b, True))
                a, b = x.clone(), x.clone()
                C.tree_reduce(a, dst=root)
                dist.reduce(b, dst=root)
                if rank == root:  # defined on dst only
                    out.append((f"tree_reduce(dst={root})", n, dtype, a, b, True))
    return out


def subgroup(rank, world_size):
    """Ranks 1..p-1 form a group; its rank 0 is global rank 1."""
    group = dist.new_group(list(range(1, world_size)))
    if rank == 0:
        return None
    x = torch.arange(5, dtype=torch.float32) * (rank + 1)
    ring, naive, bcast, red = x.clone(), x.clone(), x.clone(), x.clone()
    C.ring_all_reduce(ring, group=group)
    C.naive_all_reduce(naive, group=group)
    C.tree_broadcast(bcast, src=1, group=group)  # group rank 1 = global rank 2
    C.tree_reduce(red, dst=0, group=group)
    return {"ring": ring, "naive": naive, "bcast": bcast, "reduce": red}


def ring_trace(rank, world_size):
    trace = []
    C.ring_all_reduce(torch.full((world_size,), float(2**rank)), trace=trace)
    return trace


def measure_all_ops(rank, world_size):
    from course_lib.bandwidth import BUS_FACTORS, measure_collective

    return {op: measure_collective(op, [4096, 65536], iters=2, warmup=1) for op in BUS_FACTORS}
