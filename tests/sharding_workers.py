"""Workers for tests/test_sharding.py (spawn sends functions by name, so they live in a module)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import collectives, sharding
from course_lib.notebooks.demos import LENGTHS, _data
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

BATCH = 48
LR = 0.01


def new_collectives(rank, world_size):
    """ring_reduce_scatter and ring_all_gather beside torch's, every length, with the bytes each sent."""
    out = []
    for n in LENGTHS:
        x = _data(rank, n, torch.float64)
        mine = x.clone()
        collectives.sent.reset()
        chunk = collectives.ring_reduce_scatter(mine)
        rs_sent = collectives.sent.bytes
        total = x.clone()
        dist.all_reduce(total)
        want = total.tensor_split(world_size)[rank]
        gathered = torch.zeros(n, dtype=torch.float64)
        gathered.tensor_split(world_size)[rank].copy_(x.tensor_split(world_size)[rank])
        collectives.sent.reset()
        returned = collectives.ring_all_gather(gathered)
        ag_sent = collectives.sent.bytes
        everyone = [torch.empty(n, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(everyone, x)
        want_gathered = torch.cat([e.tensor_split(world_size)[r] for r, e in enumerate(everyone)])
        out.append({"n": n, "chunk": chunk, "want": want, "is_view": chunk.data_ptr() == mine.tensor_split(
                    world_size)[rank].data_ptr() or n < world_size, "rs_sent": rs_sent, "gathered": gathered,
                    "want_gathered": want_gathered, "in_place": returned is gathered, "ag_sent": ag_sent})
    return out


class Uneven(nn.Module):
    """Parameters of uneven sizes, in two groups, and a frozen one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(64, 13)
        self.norm = nn.LayerNorm(13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(13, 10)
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.b(torch.relu(self.frozen(self.norm(torch.relu(self.a(x)))))) * self.scale


def _batch(rank, world_size, step):
    x, y, _, _ = digits_tensors()
    where = batch_slice(step, BATCH, len(x), rank, world_size)
    return x[where], y[where]


def _groups(model):
    return [{"params": list(model.a.parameters()), "lr": 2 * LR},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("a.")]}]


def sharded_optimizer(rank, world_size, kind, steps=3):
    """DDP + Adam, + torch's ZeroRedundancyOptimizer or + the course's ShardedOptimizer: parameters
    after each step, and the numbers this rank's optimizer keeps state for."""
    model = DDP(Uneven())
    if kind == "adam":
        opt = torch.optim.Adam(_groups(model.module), lr=LR)
    elif kind == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(_groups(model.module), optimizer_class=torch.optim.Adam, lr=LR)
    else:
        opt = sharding.ShardedOptimizer(_groups(model.module), torch.optim.Adam, lr=LR)
    params = []
    for step in range(steps):
        x, y = _batch(rank, world_size, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        params.append({n: p.detach().clone() for n, p in model.module.named_parameters()})
    state_numbers = None
    if kind == "course":
        state_numbers = sum(s["exp_avg"].numel() for s in opt.optim.state.values())
    return {"params": params, "state_numbers": state_numbers}


def _units(model):
    return [m for m in model if isinstance(m, nn.Linear)]


def sharded_training(rank, world_size, stage, prefetch=False, steps=3, hidden=32, kind="course"):
    """Train the digits MLP with ShardedDataParallel at ``stage`` (or torch's fully_shard: kind="fsdp"):
    the memory ledger and the bytes this rank sent at each step, the last step's events, and the whole
    parameters at the end."""
    model = mlp(hidden=hidden, depth=2, seed=0)
    units = _units(model)
    events = []
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
    else:
        model = sharding.ShardedDataParallel(model, stage, units=units, prefetch=prefetch, events=events)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = {"params": [], "ledger": [], "sent": [], "events": []}
    for step in range(steps):
        x, y = _batch(rank, world_size, step)
        collectives.sent.reset()
        events.clear()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["sent"].append(collectives.sent.bytes)
        out["events"] = list(events)  # the last step's (gathered_parameters below gathers too)
        if kind != "fsdp":
            out["ledger"].append(sharding.memory_ledger(model, opt))
    # after the last step only: gathering here would move the next forward's all-gather out of its count
    if kind == "fsdp":
        out["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        out["params"] = model.gathered_parameters()
    return out


STAGES = [(0, False), (1, False), (2, False), (3, False), (3, True)]


def every_stage(rank, world_size, configs=STAGES, steps=3):
    """sharded_training for each (stage, prefetch), one after the other in the same processes."""
    return [sharded_training(rank, world_size, stage, prefetch, steps) for stage, prefetch in configs]


def ddp_ledger(rank, world_size, hidden=32):
    """The memory ledger of torch's DDP + Adam after one step."""
    model = DDP(mlp(hidden=hidden, depth=2, seed=0), gradient_as_bucket_view=True)  # else DDP keeps a second copy
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _batch(rank, world_size, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return sharding.memory_ledger(model.module, opt)


def reference_training(world_size, steps=3, hidden=32):
    """One process, the whole batch: what every data-parallel scheme must reproduce."""
    model = mlp(hidden=hidden, depth=2, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        xs, ys = zip(*(_batch(r, world_size, step) for r in range(world_size)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, opt, rank, world_size, steps, first_step=0, scheduler=None):
    for step in range(first_step, first_step + steps):
        x, y = _batch(rank, world_size, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _make(kind, model):
    if kind == "adam":
        return torch.optim.Adam(_groups(model), lr=LR)
    if kind == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.Adam, lr=LR)
    return sharding.ShardedOptimizer(_groups(model), optimizer_class=torch.optim.Adam, lr=LR)


def checkpoint_with_scheduler(rank, world_size, kind):
    """DDP + Adam (plain, torch's ZeroRedundancyOptimizer's or the course's ShardedOptimizer's), the LR
    halved at every step by StepLR: 2 steps, a checkpoint (consolidated on rank 0, handed to every rank
    by broadcast_object_list), a fresh model and optimizer loaded from it, 2 more steps. Returns the
    saved optimizer state dict (rank 0), the parameters and the groups' learning rates at the end."""
    model = DDP(Uneven())
    opt = _make(kind, model.module)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, rank, world_size, 2, scheduler=scheduler)
    if kind != "adam":
        opt.consolidate_state_dict(to=0)
    # a copy: a state dict holds the optimizer's live tensors, which the steps below would change
    box = [copy.deepcopy((opt.state_dict(), scheduler.state_dict(), model.module.state_dict())) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    saved, saved_scheduler, saved_model = box[0]
    kept = copy.deepcopy(saved)  # plain Adam's load_state_dict keeps the tensors it is given, and steps them

    fresh = Uneven()  # the same initial values as model's: a wrong load would show
    fresh.load_state_dict(saved_model)
    model = DDP(fresh)
    opt = _make(kind, model.module)
    opt.load_state_dict(saved)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scheduler.load_state_dict(saved_scheduler)
    _train(model, opt, rank, world_size, 2, first_step=2, scheduler=scheduler)
    return {"saved": kept if rank == 0 else None, "lrs": [g["lr"] for g in opt.param_groups],
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


class RecordingSGD(torch.optim.SGD):
    """SGD that notes the keyword arguments its step was given."""

    def __init__(self, params, **defaults):
        super().__init__(params, **defaults)
        self.seen = []

    def step(self, closure=None, **kwargs):
        self.seen.append(kwargs)
        return super().step(closure)


def sharded_optimizer_api(rank, world_size):
    """The parts of ZeroRedundancyOptimizer's interface a user touches, tried on the course's class."""
    out = {}
    model = DDP(Uneven())
    opt = sharding.ShardedOptimizer(_groups(model.module), torch.optim.Adam, lr=LR)
    out["adam_keys_visible"] = all("betas" in g and "eps" in g for g in opt.param_groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, rank, world_size, 1, scheduler=scheduler)
    out["moved_under_lr_0"] = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    out["lrs_in_local_groups"] = [g["lr"] for g in opt.optim.param_groups]

    try:
        opt.state_dict()
    except RuntimeError as e:
        out["unconsolidated"] = str(e)
    opt.consolidate_state_dict(to=0)
    try:
        out["consolidated_keys"] = sorted(opt.state_dict()["state"])
    except RuntimeError as e:
        out["consolidated_keys"] = str(e)

    extra = nn.Parameter(torch.ones(1))  # one number: one rank owns it, the others nothing of its group
    opt.add_param_group({"params": [extra], "lr": 0.5})
    out["owns_extra"] = opt.owner[extra] == rank
    out["group_sizes"] = ([len(g["params"]) for g in opt.param_groups],
                          [len(g["params"]) for g in opt.optim.param_groups])
    out["extra_lr_local"] = opt.optim.param_groups[-1]["lr"]

    recording = sharding.ShardedOptimizer(Uneven().parameters(), RecordingSGD, lr=LR)
    loss = recording.step(closure=lambda: torch.tensor(1.5))
    recording.step(scale=0.5)
    out["kwargs_seen"] = recording.optim.seen
    out["closure_loss"] = float(loss)

    sparse = nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (4,)))
    try:
        sharding.ShardedOptimizer([sparse], torch.optim.SGD, lr=LR)
    except ValueError as e:
        out["sparse"] = str(e)
    return out
