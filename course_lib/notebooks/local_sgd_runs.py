"""Notebook 11's runs: the workers that train the digits MLP communicating less often, and what
each measures.

Each function is one experiment of the notebook, run in every worker by ``launch.spawn``. The
algorithms are ``course_lib.local_sgd``'s; torch's classes appear only as the reference they are
checked against (:func:`averagers`, :func:`post_local`, also run by tests/test_local_sgd.py).
"""

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import collectives, local_sgd
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["HIDDEN", "BATCH", "STEPS", "averagers", "post_local", "post_local_pairs", "drift", "train", "sweep"]

HIDDEN, BATCH, STEPS = 256, 64, 256  # the compression notebook's model; 64 a step in all, 32 per rank
PARITY_LR = 0.05


@functools.cache
def _digits():  # loaded once per process: scikit-learn reads its files at every call
    return digits_tensors()


def _parity_batch(rank, world_size, step, batch=48):
    x, y, _, _ = _digits()
    where = batch_slice(step, batch, len(x), rank, world_size)
    return x[where], y[where]


def _parity_step(model, opt, rank, world_size, step):
    x, y = _parity_batch(rank, world_size, step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _groups(model):
    first, rest = list(model[0].parameters()), [p for layer in list(model)[1:] for p in layer.parameters()]
    return [{"params": first, "lr": 2 * PARITY_LR}, {"params": rest}]


def averagers(rank: int, world_size: int, configs, steps: int = 8) -> list[dict]:
    """For each (period, warmup_steps, as_groups): the course's averager and torch's, each after its
    own SGD-with-momentum step on this rank's data; the largest difference between their parameters
    over the steps, whether the ranks agreed after each step, and the bytes the course's sent per step."""
    out = []
    for period, warmup, as_groups in configs:
        worst, agreed, sent = 0.0, [], []
        models = [mlp(hidden=16, depth=1, seed=0) for _ in range(2)]
        opts = [torch.optim.SGD(_groups(m) if as_groups else m.parameters(), lr=PARITY_LR, momentum=0.9)
                for m in models]
        ours = local_sgd.PeriodicModelAverager(period, warmup_steps=warmup)
        with warnings.catch_warnings():  # torch's warns that period 1 is DDP's job; compared all the same
            warnings.simplefilter("ignore", UserWarning)
            theirs = torch_averagers.PeriodicModelAverager(period, warmup_steps=warmup)
        for step in range(steps):
            for model, opt, averager in zip(models, opts, (ours, theirs)):
                _parity_step(model, opt, rank, world_size, step)
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


def post_local_pairs(rank: int, world_size: int, variants=("", "+subgroup")) -> dict:
    """:func:`post_local`, the course's and torch's, for each variant, in the same processes: for each
    variant, the largest difference between their parameters over the steps."""
    out = {}
    for variant in variants:
        ours, theirs = post_local(rank, world_size, "course" + variant), post_local(rank, world_size, "torch" + variant)
        out[variant] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    return out


def post_local(rank: int, world_size: int, kind: str, start: int = 3, period: int = 2, steps: int = 8) -> list:
    """DDP with a post-local-SGD hook and optimizer, the course's (kind "course") or torch's ("torch"),
    on this rank's data; "+subgroup": after the warm-up, gradients all-reduced within a subgroup (on 3
    ranks: {0, 1} and {2}) instead of not at all. The parameters after each step, flat."""
    kind, _, variant = kind.partition("+")
    model = DDP(mlp(hidden=16, depth=1, seed=0))
    # "+subgroup": after the warm-up the gradients are averaged within subgroups: on 3 ranks {0, 1} and
    # {2}, so that an all-reduce over every rank (or none) would give other parameters; on 2, both ranks
    groups = [list(range(world_size - 1)), [world_size - 1]] if world_size > 2 else [list(range(world_size))]
    subgroup = dist.new_subgroups_by_enumeration(groups)[0] if variant == "subgroup" else None
    sgd = torch.optim.SGD(model.parameters(), lr=PARITY_LR, momentum=0.9)
    if kind == "course":
        state = local_sgd.PostLocalSGDState(None, subgroup, start)
        model.register_comm_hook(state, local_sgd.post_localSGD_hook)
        opt = local_sgd.PostLocalSGDOptimizer(sgd, local_sgd.PeriodicModelAverager(period, warmup_steps=start))
    else:
        state = torch_post.PostLocalSGDState(None, subgroup, start,
                                             post_local_gradient_allreduce=variant == "subgroup")
        model.register_comm_hook(state, torch_post.post_localSGD_hook)
        opt = TorchPostLocalSGDOptimizer(sgd, torch_averagers.PeriodicModelAverager(period, warmup_steps=start))
    params = []
    for step in range(steps):
        _parity_step(model, opt, rank, world_size, step)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return params


def _data(seed: int):
    x, y, x_test, y_test = _digits()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x[order], y[order], x_test, y_test


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def drift(rank: int, world_size: int, period: int = 8, steps: int = 32, lr: float = 0.1) -> list[dict]:
    """Local SGD (momentum 0.9) with an average every ``period`` steps: after each step, how far apart
    the ranks' parameters are (the largest distance from a rank to their mean) before and after the
    averager ran."""
    model = mlp(hidden=HIDDEN, depth=2, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    averager = local_sgd.PeriodicModelAverager(period, warmup_steps=period - 1)
    x, y, _, _ = _data(0)
    rows = []

    def spread():
        flat = _flat(model)
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        mean = torch.stack(everyone).mean(0)
        return max((e - mean).norm().item() for e in everyone)

    for step in range(steps):
        where = batch_slice(step, BATCH, len(x), rank, world_size)
        opt.zero_grad()
        F.cross_entropy(model(x[where]), y[where]).backward()
        opt.step()
        before = spread()
        averager.average_parameters(model.parameters())
        rows.append({"step": step + 1, "before": before, "after": spread()})
    return rows


def train(rank: int, world_size: int, method: str, period: int = 1, lr: float = 0.1, seed: int = 0,
          warmup: int = 0, steps: int = STEPS, fp16: bool = False) -> dict:
    """Train the digits MLP on this rank's half of each batch, with ``method``:

    * ``"ddp"``: torch's DDP, SGD with momentum 0.9 at ``lr``; ``"ddp-adamw"``: the same with AdamW;
    * ``"alone"``: no communication, each rank AdamW at ``lr`` on its own data (the model read out: its own);
    * ``"local"``: local SGD, the same optimizer on each rank, parameters averaged every ``period`` steps;
    * ``"post-local"``: DDP with the course's post-local-SGD hook for ``warmup`` steps, then local SGD;
    * ``"diloco"``: DiLoCo, AdamW at ``lr`` inside, the paper's outer step every ``period`` steps
      (``fp16``: the pseudo-gradient sent in 16 bits).

    The model read out is the ranks' average (one more average at the end where the last step was not
    one). Returns the test accuracy (%), the bytes of parameters or gradients each rank handed to a
    collective per step on average (``bytes_per_step``), the bytes the course's ring sent from this
    rank per step (``sent_per_step``, measured; not DDP's all-reduces, which are torch's), and the
    parameters read out (``params``, flat)."""
    x, y, x_test, y_test = _data(seed)
    model = mlp(hidden=HIDDEN, depth=2, seed=seed)
    numel = sum(p.numel() for p in model.parameters())
    if method in ("ddp", "ddp-adamw", "post-local"):
        model = DDP(model)
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    outer = None
    if method == "ddp":
        opt = sgd
    elif method in ("ddp-adamw", "alone"):
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    elif method == "local":
        opt = local_sgd.PostLocalSGDOptimizer(sgd, local_sgd.PeriodicModelAverager(period, warmup_steps=period - 1))
    elif method == "post-local":
        model.register_comm_hook(local_sgd.PostLocalSGDState(None, None, warmup), local_sgd.post_localSGD_hook)
        opt = local_sgd.PostLocalSGDOptimizer(sgd, local_sgd.PeriodicModelAverager(period, warmup_steps=warmup))
    elif method == "diloco":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        outer = local_sgd.DiLoCo(model.parameters(), opt, period, compress=torch.Tensor.half if fp16 else None)
    else:
        raise ValueError(f"method must be 'ddp', 'ddp-adamw', 'alone', 'local', 'post-local' or 'diloco', "
                         f"got {method!r}")
    averaged = True
    collectives.sent.reset()
    for step in range(steps):
        where = batch_slice(step, BATCH, len(x), rank, world_size)
        opt.zero_grad()
        F.cross_entropy(model(x[where]), y[where]).backward()
        if outer is not None:
            averaged = outer.step()
        else:
            opt.step()
            if method == "local":
                averaged = step % period == period - 1
            elif method == "post-local":  # gradients averaged in the warm-up, then parameters from its end on
                averaged = step < warmup or (step - warmup) % period == 0
    sent = collectives.sent.bytes / steps  # what the course's ring sent (DDP's all-reduce is torch's)
    if not averaged and method != "alone":
        local_sgd.average_parameters(model.parameters())
    with torch.no_grad():
        accuracy = 100 * (model(x_test).argmax(1) == y_test).float().mean().item()
    if method == "alone":
        per_step = 0
    elif method.startswith("ddp"):
        per_step = 4 * numel
    elif method == "post-local":
        per_step = 4 * numel * (warmup + (steps - warmup) / period) / steps
    else:
        per_step = (2 if fp16 else 4) * numel / period
    return {"accuracy": accuracy, "bytes_per_step": per_step, "sent_per_step": sent, "params": _flat(model)}


def sweep(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """:func:`train` for each config (its keyword arguments), one after the other in the same processes."""
    return [train(rank, world_size, **config) for config in configs]

