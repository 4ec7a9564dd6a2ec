"""Workers for tests/test_data_parallel.py (spawn sends functions by name, so they live in a module)."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import data_parallel, hooks


class ManyShapes(nn.Module):
    """Parameters of several shapes: 4-d (conv), 2-d, 1-d and 0-d."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 6 * 6, 20)
        self.norm = nn.LayerNorm(20)
        self.out = nn.Linear(20, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.out(self.norm(torch.relu(self.fc(h)))) * self.scale


def _wrap(kind, model, bucket_cap_mb):
    if kind == "naive":
        return data_parallel.DataParallelNaive(model)
    if kind == "flat":
        return data_parallel.DataParallelFlat(model)
    if kind == "overlap":
        return data_parallel.DataParallelOverlap(model)
    return data_parallel.DataParallelBucket(model, bucket_cap_mb=bucket_cap_mb)


def against_ddp(rank, world_size, kind, bucket_cap_mb=25.0, steps=3):
    """The wrapper and torch's DDP from the same (per-rank different) initial model, on the same
    per-rank data: the gradients after each backward, the parameters after each SGD step."""
    torch.manual_seed(100 + rank)  # every rank its own init: both must start from rank 0's
    model = ManyShapes()
    ours, theirs = _wrap(kind, copy.deepcopy(model), bucket_cap_mb), DDP(copy.deepcopy(model))
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    out = {"grads": [], "params": [], "traffic": []}
    for _ in range(steps):
        x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
        hooks.traffic.reset()
        opt_ours.zero_grad()
        nn.functional.cross_entropy(ours(x), y).backward()
        ours.finish_gradient_synchronization()
        out["traffic"].append(hooks.traffic.snapshot())
        opt_theirs.zero_grad()
        nn.functional.cross_entropy(theirs(x), y).backward()
        out["grads"].append([(a.grad.clone(), b.grad.clone()) for a, b in zip(ours.parameters(), theirs.parameters())])
        opt_ours.step()
        opt_theirs.step()
        out["params"].append([(a.detach().clone(), b.detach().clone())
                              for a, b in zip(ours.parameters(), theirs.parameters())])
    out["events"] = list(ours.events)
    out["buckets"] = [[n for n, _ in b.params] for b in getattr(ours, "buckets", [])]
    return out


def misuse(rank, world_size, kind, what):
    """What a student may get wrong; returns the message of the error raised, or None."""
    model = ManyShapes()
    if what == "unused":
        model.unused = nn.Linear(2, 2)
    dp = _wrap(kind, model, 0.001)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 5, (4,))
    try:
        nn.functional.cross_entropy(dp(x), y).backward()
        if what == "two_backwards":
            nn.functional.cross_entropy(dp(x), y).backward()
        dp.finish_gradient_synchronization()
    except RuntimeError as e:
        return str(e)
    return None


def accumulate_against_ddp(rank, world_size, kind):
    """Two micro-batches per step, the first inside no_sync(), in the wrapper and in torch's DDP."""
    torch.manual_seed(0)
    model = ManyShapes()
    ours, theirs = _wrap(kind, copy.deepcopy(model), 0.002), DDP(copy.deepcopy(model))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(2)]
    hooks.traffic.reset()
    for wrapped in (ours, theirs):
        with wrapped.no_sync():
            nn.functional.cross_entropy(wrapped(batches[0][0]), batches[0][1]).backward()
        nn.functional.cross_entropy(wrapped(batches[1][0]), batches[1][1]).backward()
        if wrapped is ours:
            ours.finish_gradient_synchronization()
            sent = hooks.traffic.snapshot()
    return {"pairs": [(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters())], "sent": sent}


def wrap_twice(rank, world_size):
    model = ManyShapes()
    data_parallel.DataParallelBucket(model)
    try:
        data_parallel.DataParallelNaive(model)
    except RuntimeError as e:
        return str(e)
    return None


# Wrong hooks, for the hook check of course_lib.notebooks.ddp_program (spawn sends them by name).

def sum_hook(process_group, bucket):
    """Forgets to divide by the world size: the sum of the ranks' gradients, not their average."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def fp16_sum_hook(process_group, bucket):
    """torch's fp16 hook without its division by the world size."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def rank0_only_hook(process_group, bucket):
    """Broadcasts rank 0's gradient instead of averaging: every rank agrees, on the wrong gradient."""
    work = dist.broadcast(bucket.buffer(), src=0, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_payloads(rank, world_size, runs, hidden=512, depth=4):
    """Worker: for each ``(bucket_cap_mb, steps, k, no_sync)`` of ``runs``, a new DDP model (``None``:
    no cap given) trained ``steps`` steps of ``k`` micro-batches; the bytes of every bucket DDP
    handed its hook, in order (what notebook 04's exercise 1 must predict)."""
    import contextlib

    from course_lib.utils.digits import digits_tensors, mlp

    x, y, _, _ = digits_tensors(seed=0)
    out = []
    for cap, steps, k, no_sync in runs:
        model = DDP(mlp(hidden=hidden, depth=depth, seed=0), **({} if cap is None else {"bucket_cap_mb": cap}))
        log = hooks.BucketLog()
        model.register_comm_hook(log, hooks.logging_allreduce_hook)
        for _ in range(steps):
            for micro in range(k):
                with model.no_sync() if no_sync and micro < k - 1 else contextlib.nullcontext():
                    nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        out.append([call["numel"] * 4 for call in log.calls])
    return out
