"""Workers for tests/test_local_sgd.py (spawn sends functions by name, so they live in a module); the
parity runs against torch's classes are notebook 11's own, in course_lib.notebooks.local_sgd_runs."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import collectives, local_sgd
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

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


def averaging_edges(rank, world_size):
    """average_parameters before any backward, and on a rank outside its group; the averager beside it."""
    out = {}
    model = mlp(hidden=8, depth=1, seed=rank)  # different values on every rank, no gradient yet
    everyone = [[torch.empty_like(p) for _ in range(world_size)] for p in model.parameters()]
    for gathered, p in zip(everyone, model.parameters()):
        dist.all_gather(gathered, p.detach())
    local_sgd.average_parameters(model.parameters())
    out["mean_error"] = max((p.detach() - torch.stack(g).mean(0)).abs().max().item()
                            for p, g in zip(model.parameters(), everyone))

    pair = dist.new_group([0, 1])  # every rank creates it; rank 2 is outside it
    value = torch.full((5,), float(rank))
    local_sgd.average_parameters([value], process_group=pair)
    out["pair_average"] = value.tolist()
    outside = torch.full((3,), float(rank))
    out["collective_outside"] = (collectives.ring_all_reduce(outside, group=pair) is outside, outside.tolist())

    with_grad, without = torch.full((2,), float(rank)), torch.full((2,), float(rank))
    with_grad.grad = torch.zeros(2)
    local_sgd.PeriodicModelAverager(period=1).average_parameters([with_grad, without])
    out["averager"] = (with_grad.tolist(), without.tolist())
    return out


def train_and_notebook_loop(rank, world_size, cases):
    """For each (TrainConfig fields, local_sgd_runs.train arguments): the flat parameters, bytes and test
    accuracy of ``course_lib.train``'s run and of notebook 11's loop on the same data and model."""
    from course_lib.notebooks import local_sgd_runs as R
    from course_lib.train import TrainConfig, ddp_train

    out = []
    for fields, notebook in cases:
        config = TrainConfig(hidden=R.HIDDEN, batch_size=R.BATCH, steps=8, eval_every=8, **fields)
        ours = ddp_train(rank, world_size, config)
        theirs = R.train(rank, world_size, steps=8, **notebook)
        out.append({"ours": torch.cat([p.reshape(-1) for p in ours.final_params]), "theirs": theirs["params"],
                    "bytes": ours.bytes, "accuracy": (100 * ours.test_accuracy[-1], theirs["accuracy"])})
    return out
