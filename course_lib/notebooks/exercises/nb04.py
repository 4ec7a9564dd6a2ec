"""Notebook 04's exercises (DDP in practice): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import data_parallel, memory
from course_lib.notebooks.exercises.core import _name, _run_student, check, compare, refused_calls
from course_lib.utils.digits import batch_slice, digits_tensors, mlp


def ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    """The payload in bytes of every all-reduce torch's DDP issues, in order, for ``steps`` optimizer
    steps of ``k`` micro-batches each (``no_sync`` around the first k - 1 of each step or not), when
    backward produces gradients of ``sizes_bytes`` in that order. The first backward that
    synchronizes sends one bucket of every gradient; DDP then rebuilds its buckets in the order the
    gradients arrived, the first closed at 1 MiB when ``bucket_cap_mb`` is None (not given, 25 MiB
    for the others), else every one at ``bucket_cap_mb``. Checked against DDP itself in
    tests/test_data_parallel.py."""
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap
    first = data_parallel.assign_buckets(sizes_bytes, first_cap)[0]
    rest = data_parallel.assign_buckets(sizes_bytes[len(first):], cap) if len(first) < len(sizes_bytes) else []
    rebuilt = [sum(sizes_bytes[i] for i in first)] + [sum(sizes_bytes[len(first) + i] for i in b) for b in rest]
    sent = []
    for _ in range(steps):
        for micro in range(k):
            if no_sync and micro < k - 1:
                continue  # inside no_sync: backward only accumulates
            sent += rebuilt if sent else [sum(sizes_bytes)]
    return sent


def check_ddp_all_reduces(student_fn) -> bool:
    """``student_fn(sizes_bytes, bucket_cap_mb, steps, k, no_sync)``: the payload of every all-reduce
    DDP issues, in bytes, in order (see :func:`ddp_all_reduces`)."""
    mlp_sizes = [40, 20480, 2048, 1048576, 2048, 1048576, 2048, 1048576, 2048, 131072]  # hidden 512, depth 4
    cases = [(mlp_sizes, None, 2, 1, False), (mlp_sizes, 1, 3, 4, True), (mlp_sizes, 1, 2, 3, False),
             (mlp_sizes, 25, 2, 2, False), ([2**20] * 3 + [10], 0.5, 2, 2, True),
             ([300_000, 600_000, 900_000], None, 1, 1, False), ([4, 4, 4], 1e-5, 2, 1, False)]
    return check(student_fn, ddp_all_reduces, cases, name=_name(student_fn, "ddp_all_reduces"))


class MemoryHookState:
    """What the memory-hook exercise hands the student's hook: ``memory``, a dict for the hook to fill,
    one entry per parameter, keyed by the parameter itself (a tensor hashes by identity), and
    ``process_group`` (``None``: the default group)."""

    def __init__(self):
        self.memory: dict = {}
        self.process_group = None


# Two hidden layers of 32 and a 4 KB cap: DDP's first backward hands the hook one bucket of all six
# gradients; its rebuilt buckets hold (last layer first) four, then two.
_MEMORY_EXERCISE = dict(hidden=32, depth=2, bucket_cap_mb=0.004, steps=4, lr=0.1, batch_size=64)
_MEMORY_HELPERS = (memory.ParameterKeys,)


def _memory_hook_worker(rank: int, world_size: int, student_hook) -> dict:
    """Train with the student's hook; what it kept per parameter, and the same computed another way: each
    step, this rank's gradient by ``torch.autograd.grad`` on the module itself (no DDP, no hook),
    all-reduced and divided by the world size here, summed over the steps. Also the largest difference
    between that average and the ``.grad`` DDP left (what the hook returned), and which bucket each
    parameter was in, per iteration (the rebuild)."""
    c = _MEMORY_EXERCISE
    x, y, _, _ = digits_tensors(seed=0)
    model = DDP(mlp(hidden=c["hidden"], depth=c["depth"], seed=0), bucket_cap_mb=c["bucket_cap_mb"])
    params = list(model.parameters())
    state, buckets = MemoryHookState(), []
    name = getattr(student_hook, "__name__", "your hook")

    def hook(st, bucket):
        index = {id(p): i for i, p in enumerate(params)}  # (by identity: == on tensors compares their values)
        buckets.append((len(buckets), bucket.index(), [index[id(p)] for p in bucket.parameters()]))
        with refused_calls(_MEMORY_HELPERS, name, "it keys a bucket's parameters for you: that is this exercise"):
            return student_hook(st, bucket)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=c["lr"])
    want = [torch.zeros_like(p) for p in params]
    grad_off = 0.0  # the largest |p.grad - the average| over the steps: a hook that does not average shows here
    for step in range(c["steps"]):
        rows = batch_slice(step, c["batch_size"], len(x), rank, world_size)
        own = torch.autograd.grad(nn.functional.cross_entropy(model.module(x[rows]), y[rows]), params)
        averaged = []
        for g in own:
            g = g.clone()
            dist.all_reduce(g)
            averaged.append(g / world_size)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        for total, a, p in zip(want, averaged, params):
            total += a
            grad_off = max(grad_off, (p.grad - a).abs().max().item())
        opt.step()
    missing = [i for i, p in enumerate(params) if p not in state.memory]
    got = [state.memory[p].detach().clone() if i not in missing else None for i, p in enumerate(params)]
    return {"want": want, "got": got, "missing": missing, "buckets": buckets, "grad_off": grad_off,
            "shapes": [tuple(p.shape) for p in params]}


def check_memory_hook(student_fn) -> bool:
    """``student_fn(state, bucket)`` in a ``.py`` file: a communication hook that averages the bucket as
    ``allreduce_hook`` does and keeps in ``state.memory[p]``, for each parameter ``p``, the sum of the
    averaged gradients ``p`` has received so far (a :class:`MemoryHookState`). Trained on 2 gloo ranks for
    4 steps with ``bucket_cap_mb=0.004``, so that DDP's buckets change after the first backward: every
    step's ``.grad`` must be the average over the ranks, and after the last step every parameter's entry
    the sum of those averages, both computed another way (the module's own gradient, all-reduced)."""
    name = _name(student_fn, "my_memory_hook", in_processes=True)
    results = _run_student(_memory_hook_worker, 2, student_fn, name)
    if results is None:
        return False
    for rank, out in enumerate(results):
        if out["grad_off"] > 1e-5:
            print(f"[FAIL] {name}, rank {rank}: the gradient your hook returned is not the average over the ranks "
                  f"(off by up to {out['grad_off']:.3g}): divide the bucket by the world size and all-reduce it")
            return False
        if out["missing"]:
            print(f"[FAIL] {name}, rank {rank}: state.memory has no entry for parameter(s) {out['missing']} "
                  f"(shapes {[out['shapes'][i] for i in out['missing']]}): key it by the parameter itself")
            return False
        for i, (want, got) in enumerate(zip(out["want"], out["got"])):
            why = compare(want, got)
            if why:
                print(f"[FAIL] {name}, rank {rank}: the memory of parameter {i} (shape {out['shapes'][i]}) is not "
                      f"the sum of its averaged gradients over the steps: {why}")
                return False
    print(f"[PASS] {name}: every parameter's memory is the sum of its averaged gradients over "
          f"{_MEMORY_EXERCISE['steps']} steps, across DDP's bucket rebuild, on 2 ranks.")
    return True
