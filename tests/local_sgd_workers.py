"""Workers for tests/test_local_sgd.py (spawn sends functions by name, so they live in a module)."""

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import collectives, local_sgd
from course_lib.support.digits import batch_slice, digits_tensors, mlp

BATCH, LR = 48, 0.05


def _batch(rank, world_size, step):
    x, y, _, _ = digits_tensors()
    where = batch_slice(step, BATCH, len(x), rank, world_size)
    return x[where], y[where]


def _local_step(model, opt, rank, world_size, step):
    x, y = _batch(rank, world_size, step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _groups(model):
    first, rest = list(model[0].parameters()), [p for layer in list(model)[1:] for p in layer.parameters()]
    return [{"params": first, "lr": 2 * LR}, {"params": rest}]


def averagers(rank, world_size, configs, steps=8):
    """For each (period, warmup_steps, as_groups): the course's averager and torch's, each after its
    own SGD-with-momentum step on this rank's data; the largest difference between their parameters
    over the steps, whether the ranks agreed after each step, and the bytes sent per step."""
    out = []
    for period, warmup, as_groups in configs:
        worst, agreed, sent = 0.0, [], []
        models = [mlp(hidden=16, depth=1, seed=0) for _ in range(2)]
        opts = [torch.optim.SGD(_groups(m) if as_groups else m.parameters(), lr=LR, momentum=0.9) for m in models]
        ours = local_sgd.PeriodicModelAverager(period, warmup_steps=warmup)
        with warnings.catch_warnings():  # torch's warns that period 1 is DDP's job; the test wants it anyway
            warnings.simplefilter("ignore", UserWarning)
            theirs = torch_averagers.PeriodicModelAverager(period, warmup_steps=warmup)
        for step in range(steps):
            for model, opt, averager in zip(models, opts, (ours, theirs)):
                _local_step(model, opt, rank, world_size, step)
                collectives.sent.reset()
                averager.average_parameters(opt.param_groups if as_groups else model.parameters())
                if averager is ours:
                    sent.append(collectives.sent.bytes)
            flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
            worst = max(worst, (flat[0] - flat[1]).abs().max().item())
            everyone = [torch.empty_like(flat[0]) for _ in range(world_size)]
            dist.all_gather(everyone, flat[0])
            agreed.append(all(torch.equal(e, everyone[0]) for e in everyone))
        out.append({"worst": worst, "agreed": agreed, "sent": sent, "step": ours.step,
                    "numel": sum(p.numel() for p in models[0].parameters())})
    return out


def post_local(rank, world_size, kind, start=3, period=2, steps=8):
    """DDP with a post-local-SGD hook and optimizer, the course's or torch's (kind), on this rank's data;
    ``gradient_subgroup``: after the warm-up, gradients all-reduced in singleton groups (no-ops) instead
    of not at all. Parameters after each step."""
    kind, _, variant = kind.partition("+")
    model = DDP(mlp(hidden=16, depth=1, seed=0))
    subgroup = dist.new_subgroups(group_size=1)[0] if variant == "subgroup" else None
    if kind == "course":
        state = local_sgd.PostLocalSGDState(None, subgroup, start)
        model.register_comm_hook(state, local_sgd.post_localSGD_hook)
        opt = local_sgd.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                              local_sgd.PeriodicModelAverager(period, warmup_steps=start))
    else:
        state = torch_post.PostLocalSGDState(None, subgroup, start,
                                             post_local_gradient_allreduce=variant == "subgroup")
        model.register_comm_hook(state, torch_post.post_localSGD_hook)
        opt = TorchPostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                         torch_averagers.PeriodicModelAverager(period, warmup_steps=start))
    params = []
    for step in range(steps):
        _local_step(model, opt, rank, world_size, step)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return params


def diloco(rank, world_size, period, steps, outer_lr=0.7, outer_momentum=0.9):
    """The course's DiLoCo with AdamW inside, on this rank's data: parameters at the end, bytes sent."""
    model = mlp(hidden=16, depth=1, seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = local_sgd.DiLoCo(model.parameters(), inner, period, outer_lr=outer_lr, outer_momentum=outer_momentum)
    communicated, sent = [], 0
    collectives.sent.reset()
    for step in range(steps):
        x, y = _batch(rank, world_size, step)
        inner.zero_grad()
        F.cross_entropy(model(x), y).backward()
        communicated.append(outer.step())
    sent = collectives.sent.bytes
    return {"params": [p.detach().clone() for p in model.parameters()], "communicated": communicated, "sent": sent}


def local_sgd_adamw(rank, world_size, period, steps):
    """Local SGD with AdamW inside and the course's averager: what DiLoCo with outer SGD (lr 1, no
    momentum) must equal."""
    model = mlp(hidden=16, depth=1, seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    averager = local_sgd.PeriodicModelAverager(period, warmup_steps=period - 1)
    for step in range(steps):
        _local_step(model, inner, rank, world_size, step)
        averager.average_parameters(model.parameters())
    return [p.detach().clone() for p in model.parameters()]


def diloco_reference(world_size, period, steps, outer_lr=0.7, outer_momentum=0.9):
    """DiLoCo computed another way: one process, the ranks' models one after another, the pseudo-
    gradients averaged with torch.stack(...).mean, the outer Nesterov step written out by hand."""
    shared = [p.detach().clone() for p in mlp(hidden=16, depth=1, seed=0).parameters()]
    workers = [mlp(hidden=16, depth=1, seed=0) for _ in range(world_size)]
    inners = [torch.optim.AdamW(w.parameters(), lr=1e-2) for w in workers]
    momentum = [torch.zeros_like(s) for s in shared]
    for step in range(steps):
        for rank, (worker, inner) in enumerate(zip(workers, inners)):
            x, y = _batch(rank, world_size, step)
            inner.zero_grad()
            F.cross_entropy(worker(x), y).backward()
            inner.step()
        if (step + 1) % period:
            continue
        with torch.no_grad():
            for i, s in enumerate(shared):
                delta = torch.stack([s - list(w.parameters())[i] for w in workers]).mean(0)
                momentum[i] = outer_momentum * momentum[i] + delta if step + 1 > period else delta.clone()
                s -= outer_lr * (delta + outer_momentum * momentum[i])  # Nesterov
            for worker in workers:
                for p, s in zip(worker.parameters(), shared):
                    p.copy_(s)
    return [copy.deepcopy(s) for s in shared]
