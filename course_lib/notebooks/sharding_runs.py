"""Notebook 05's runs: the workers that train the digits MLP sharded, and what each measures.

Each function is one experiment of the notebook, run in every worker by ``launch.spawn``; each
returns plain numbers (rank 0's are the ones shown) so that a cell reads like the idea it teaches.
The algorithms are ``course_lib.sharding``'s and ``course_lib.collectives``'; torch's classes appear
only as the reference they are checked against.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import collectives, sharding
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["HIDDEN", "BATCH", "LR", "STEPS", "notebook_model", "layers", "split_all_reduce", "zero1_against_torch",
           "every_stage", "prefetch_runs"]

HIDDEN, BATCH, LR, STEPS = 256, 64, 1e-3, 4


def notebook_model(hidden: int = HIDDEN, depth: int = 2) -> nn.Sequential:
    """The digits MLP every run here starts from (the same initial values on every rank)."""
    return mlp(hidden=hidden, depth=depth, seed=0)


def layers(model: nn.Module) -> list[nn.Module]:
    """The units sharded one by one: the Linear layers (a ReLU has no parameters)."""
    return [m for m in model if isinstance(m, nn.Linear)]


def _batch(rank: int, world_size: int, step: int, batch_size: int = BATCH):
    x, y, _, _ = digits_tensors()
    where = batch_slice(step, batch_size, len(x), rank, world_size)
    return x[where], y[where]


def _train(model, opt, rank, world_size, steps=STEPS, first=0):
    for step in range(first, first + steps):
        x, y = _batch(rank, world_size, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _max_diff(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _params(model: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def split_all_reduce(rank: int, world_size: int, n: int = 12) -> dict:
    """A ring all-reduce, and the same sum as a reduce-scatter then an all-gather: equal results,
    and the bytes each rank sent in each."""
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    whole = x.clone()
    collectives.sent.reset()
    collectives.ring_all_reduce(whole)
    all_reduce_sent = collectives.sent.bytes
    halves = x.clone()
    collectives.sent.reset()
    mine = collectives.ring_reduce_scatter(halves).clone()
    scatter_sent = collectives.sent.bytes
    collectives.sent.reset()
    collectives.ring_all_gather(halves)
    return {"mine": mine.tolist(), "whole": whole.tolist(), "equal": torch.equal(halves, whole),
            "bytes": 4 * n, "all_reduce_sent": all_reduce_sent, "reduce_scatter_sent": scatter_sent,
            "all_gather_sent": collectives.sent.bytes}


def zero1_against_torch(rank: int, world_size: int) -> dict:
    """DDP with Adam, with torch's ZeroRedundancyOptimizer and with the course's ShardedOptimizer:
    how far apart their parameters end, the numbers whose Adam state each rank keeps, and the bytes
    the course's optimizer broadcasts per step from this rank (besides DDP's all-reduce)."""
    runs, kept, broadcast = {}, {}, 0
    for name in ("Adam", "torch ZeroRedundancyOptimizer", "course ShardedOptimizer"):
        model = DDP(notebook_model())
        collectives.sent.reset()  # counts the course's broadcasts (DDP's all-reduce is torch's own)
        if name == "Adam":
            opt = torch.optim.Adam(model.parameters(), lr=LR)
        elif name.startswith("torch"):
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
        else:
            opt = sharding.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
        _train(model, opt, rank, world_size)
        broadcast = collectives.sent.bytes // STEPS  # per step: only the course's optimizer sends any here
        runs[name] = _params(model.module)
        inner = opt.optim if name.startswith(("course", "torch")) else opt
        kept[name] = sum(s["exp_avg"].numel() for s in inner.state.values())
    return {"max_diff": {name: _max_diff(p, runs["Adam"]) for name, p in runs.items()}, "kept": kept,
            "broadcast_sent": broadcast}


def every_stage(rank: int, world_size: int) -> dict:
    """Torch's DDP (its gradients views into its buckets), then the course's ShardedDataParallel at
    stages 0 to 3, then torch's FSDP2 (``fully_shard`` on each layer and the root), each trained the
    same steps with Adam. For each: how far its parameters end from DDP's, the memory ledger after
    the last step (activations measured on one batch) and the bytes this rank sent in the last step."""
    x, _ = _batch(rank, world_size, 0)
    ddp = DDP(notebook_model(), gradient_as_bucket_view=True)  # the gradients are DDP's buckets: no second copy
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    _train(ddp, opt, rank, world_size)
    want = _params(ddp.module)
    rows = {"torch DDP": {"ledger": sharding.memory_ledger(ddp.module, opt, x), "max_diff": 0.0, "sent": None,
                          "tensors": len(opt.state)}}
    for stage in range(4):
        model = sharding.ShardedDataParallel(_fresh := notebook_model(), stage, units=layers(_fresh))
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        _train(model, opt, rank, world_size, STEPS - 1)
        collectives.sent.reset()
        _train(model, opt, rank, world_size, 1, first=STEPS - 1)  # the last step, its bytes counted
        sent = collectives.sent.bytes
        ledger = sharding.memory_ledger(model, opt, x)
        rows[f"stage {stage}"] = {"ledger": ledger, "max_diff": _max_diff(model.gathered_parameters(), want),
                                  "sent": sent, "tensors": len(opt.state),
                                  "shard_numel": sum(p.numel() for p in model.parameters())}
    fsdp = notebook_model()
    for layer in layers(fsdp):
        fully_shard(layer)
    fully_shard(fsdp)
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)
    _train(fsdp, opt, rank, world_size)
    whole = {name: p.full_tensor().detach() for name, p in fsdp.named_parameters()}
    rows["torch fully_shard"] = {"ledger": None, "max_diff": _max_diff(whole, want), "sent": None, "tensors": None,
                                 "shard_numel": sum(p.to_local().numel() for p in fsdp.parameters())}
    return rows


def mixed_precision_units(rank: int, world_size: int) -> dict:
    """torch's FSDP2 on the notebook's model (``fully_shard`` on each layer and the root), in float32 and
    with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, one step of
    Adam each. Measured, per policy: the dtype and bytes of each unit's parameters gathered whole (seen
    by a forward pre-hook, inside the step), of this rank's shards (the optimizer's copy, between
    steps) and of the gradient shards after backward."""
    x, y = _batch(rank, world_size, 0)
    out = {}
    for name, policy in (("float32", MixedPrecisionPolicy()),
                         ("bf16 params", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        model = notebook_model()
        gathered = []

        def seen(module, args, gathered=gathered):
            params = list(module.parameters(recurse=False))
            whole = sum(p.numel() * p.element_size() for p in params)
            gathered.append((str(params[0].dtype).removeprefix("torch."), whole))

        for layer in layers(model):
            fully_shard(layer, mp_policy=policy)
            layer.register_forward_pre_hook(seen)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.to_local() for p in model.parameters()]
        opt.step()
        shards = [p.to_local() for p in model.parameters()]
        out[name] = {"gathered_dtype": gathered[0][0], "largest_gathered_bytes": max(b for _, b in gathered),
                     "shard_dtype": str(shards[0].dtype).removeprefix("torch."),
                     "shard_bytes": sum(t.numel() * t.element_size() for t in shards),
                     "grad_dtype": str(grads[0].dtype).removeprefix("torch.")}
    return out


def prefetch_runs(rank: int, world_size: int, hidden: int = 1024, depth: int = 3, batch_size: int = 256,
                  steps: int = 6) -> dict:
    """Stage 3 without and with prefetch on a wider MLP: per step (after a first, warm-up one), seconds and
    the time the main thread spent communicating or waiting for a prefetched all-gather; the events of
    the median step. Timings: this machine's."""
    out = {}
    for prefetch in (False, True):
        events: list = []
        model = sharding.ShardedDataParallel(_fresh := notebook_model(hidden, depth), 3, units=layers(_fresh),
                                             prefetch=prefetch, events=events)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        seconds, waiting, steps_events = [], [], []
        for step in range(steps):
            x, y = _batch(rank, world_size, step, batch_size)
            events.clear()
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            seconds.append(time.perf_counter() - start)
            # the main thread blocked on communication: its own all-gathers and reduce-scatters, and waits
            main = [e for e in events if e[0] in ("wait", "reduce-scatter", "all-gather")]
            waiting.append(sum(end - begin for _, _, begin, end in main))
            steps_events.append(list(events))
        # the first step is a warm-up; the events shown are those of the median step of the rest
        seconds, waiting, steps_events = seconds[1:], waiting[1:], steps_events[1:]
        median = sorted(range(len(seconds)), key=seconds.__getitem__)[len(seconds) // 2]
        out[prefetch] = {"seconds": seconds, "waiting": waiting, "events": steps_events[median]}
    return out
