"""Workers for test_collectives: run the course's collectives and torch's on the same inputs."""

import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib.bandwidth import measure_collective
from course_lib.costmodel import BUS_FACTORS


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


def measure_all_ops(rank, world_size):
    return {op: measure_collective(op, [4096, 65536], iters=2, warmup=1) for op in BUS_FACTORS}


def wrong_reduce_scatter(tensor, group=None):
    return tensor.tensor_split(dist.get_world_size())[dist.get_rank()].clone()  # forgot to sum


def todo(tensor, group=None):
    raise NotImplementedError


def nccl_tests_rows(rank, world_size, warmup=2, iters=3):
    """measure_like_nccl_tests on a real all-reduce of ones, and the buffer's value afterwards: each
    in-place all-reduce multiplies it by p, so it tells how many ran (warm-ups included)."""
    from course_lib.bandwidth import _buffer, _torch_op, measure_like_nccl_tests, time_like_nccl_tests

    rows = measure_like_nccl_tests("all_reduce", [4096, 65536], iters=iters, warmup=warmup)
    t = _buffer("all_reduce", 4096, world_size, torch.float32, "cpu")
    time_like_nccl_tests(_torch_op("all_reduce", world_size), t, iters=iters, warmup=warmup)
    return rows, t[0].item()


def nccl_tests_of_known_sleeps(rank, world_size, d):
    """time_like_nccl_tests of a run whose durations are known, on a fake clock: warm-ups take 20 d;
    timed iteration k takes (rank + 1) d, five times longer when k % 4 == 0 (so mean, median and max differ)."""
    from course_lib.bandwidth import time_like_nccl_tests
    from tests.fake_clock import fake_clock

    calls = []
    with fake_clock() as clock:
        def run(t):
            k = len(calls) - 5
            calls.append(k)
            clock.spend(20 * d if k < 0 else (rank + 1) * d * (5 if k % 4 == 0 else 1))

        seconds = time_like_nccl_tests(run, torch.zeros(1), iters=20, warmup=5)
    return seconds, len(calls)


def ddp_bucket_numels(rank, world_size, bucket_cap_mb, iterations=3):
    """The buckets DDP hands its hook (numbers per bucket, per iteration), for notebook 12's
    benchmark model (MLP 512-1024-1024-10): what the hooks' counters must agree with."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib import hooks
    from course_lib.utils.digits import mlp

    model = DDP(mlp(hidden=1024, depth=2, seed=0, n_in=512), bucket_cap_mb=bucket_cap_mb)
    log = hooks.BucketLog()
    model.register_comm_hook(log, hooks.logging_allreduce_hook)
    x, y = torch.randn(32, 512, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 10
    out = []
    for _ in range(iterations):
        before = len(log.calls)
        nn.functional.cross_entropy(model(x), y).backward()
        out.append([c["numel"] for c in log.calls[before:]])
    return out


def bad_roots(rank, world_size, cases):
    """Worker: call each ``(tree collective, root)`` of ``cases``; the error messages (or "accepted")."""
    out = []
    for op, root in cases:
        try:
            getattr(C, op)(torch.ones(3), root)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    return out


def mismatched(rank, world_size, op):
    """Worker: a course collective called with arguments that differ across ranks."""
    if op == "ring_all_reduce":
        return C.ring_all_reduce(torch.ones(3 + rank))  # rank 1 passes one more element
    return C.tree_broadcast(torch.ones(3), src=rank)  # every rank thinks it is the root


def through_host_memory(rank, world_size):
    """Every collective of the module with its tensors staged through host memory, as CUDA tensors are
    over gloo (``_on_host`` says yes to every tensor here), against torch's own collectives."""
    C._on_host = lambda tensor, group: True
    g = torch.Generator().manual_seed(rank)
    out = {}
    x = torch.randn(11, generator=g)
    expected = x.clone()
    dist.all_reduce(expected)
    for name, fn in (("ring", C.ring_all_reduce), ("naive", C.naive_all_reduce)):
        mine = x.clone()
        fn(mine)
        out[name] = torch.allclose(mine, expected, atol=1e-6)
    rs = x.clone()
    chunk = C.ring_reduce_scatter(rs)  # a view of rs, as on the CPU, holding this rank's part of the sum
    out["reduce_scatter"] = (torch.allclose(chunk, expected.tensor_split(world_size)[rank], atol=1e-6)
                             and chunk.untyped_storage().data_ptr() == rs.untyped_storage().data_ptr())
    y = torch.full((5,), float(rank))
    C.tree_broadcast(y, src=world_size - 1)
    out["broadcast"] = torch.equal(y, torch.full((5,), float(world_size - 1)))
    z = torch.ones(7)
    C.tree_reduce(z, dst=0)
    out["reduce"] = rank != 0 or torch.equal(z, torch.full((7,), float(world_size)))
    left = torch.tensor([float((rank - 1) % world_size)])
    out["shift"] = torch.equal(C.ring_shift(torch.tensor([float(rank)])), left)
    return out


def measure_collective_of_known_sleeps(rank, world_size, d):
    """measure_collective of a run whose durations are known, on a fake clock: the warm-up takes 20 d;
    timed run k takes (rank + 1) d, five times longer when k is 0 or 4 (so mean, median, max differ)."""
    from course_lib.bandwidth import measure_collective
    from tests.fake_clock import fake_clock

    calls = []
    with fake_clock() as clock:
        def run(t):
            k = len(calls) - 1
            calls.append(k)
            clock.spend(20 * d if k < 0 else (rank + 1) * d * (5 if k in (0, 4) else 1))

        (row,) = measure_collective("all_reduce", [4096], iters=5, warmup=1, fn=run)
    return row["time_s"], len(calls)


def one_message_arrives(rank, world_size):
    """bandwidth.send_to_rank_1 on a tensor that differs by rank, and one_message's rows."""
    from course_lib.bandwidth import one_message, send_to_rank_1

    t = torch.full((1000,), float(rank + 1))
    send_to_rank_1(t)
    return t.tolist(), one_message(rank, world_size, [4096, 4 * 2**20], iters=2)
