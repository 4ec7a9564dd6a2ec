"""Notebook 04's debugging demos: what goes wrong in a data-parallel job, and the tools that say where.

Each worker below is started with :func:`course_lib.launch.spawn` on gloo, as the notebook starts it:

* :func:`mismatched_all_reduce`: a desync, ranks that call the same collective on different shapes, run
  once as is and once under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which checks every collective's
  signature on every rank before it runs it;
* :func:`late_ranks`: ranks that do not arrive, named by ``monitored_barrier``;
* :func:`stuck_in_a_desync`: a job that hangs, whose every rank's stack ``spawn`` prints at its timeout;
* :func:`profiled_ddp_step`: one DDP step as ``torch.profiler`` records it, beside the course's own
  bucketed wrapper timed by its own clock (``course_lib.data_parallel``);
* :func:`unused_parameter`: DDP with a parameter that gets no gradient, with and without
  ``find_unused_parameters``;
* :func:`uneven_inputs`: ranks with different numbers of batches, with and without ``Join``.
"""

from __future__ import annotations

import datetime
import re
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from course_lib.accumulation import _quiet_stderr  # (gloo's and the profiler's C++ logs, timestamped)
from course_lib.data_parallel import DataParallelBucket
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["mismatched_all_reduce", "late_ranks", "stuck_in_a_desync", "profiled_ddp_step", "unused_parameter",
           "uneven_inputs", "first_line"]


def first_line(message: str, width: int = 200) -> str:
    """The first line of an error message, without gloo's ``[/path/of/its/source.cc:123] `` in front, cut at
    ``width`` characters (gloo's run to a screenful)."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\] ", "", line)
    return line if len(line) <= width else line[: width - 1] + "…"


def mismatched_all_reduce(rank: int, world_size: int) -> str:
    """Worker: rank r all-reduces a tensor of r + 3 ones, so the ranks disagree on its shape. Returns
    what this rank saw: ``"returned [...]"`` or the exception's type and message."""
    t = torch.ones(3 + rank)
    try:
        dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - shown, not handled
        return f"{type(exc).__name__}: {exc}"
    return f"returned {t.tolist()}"


def late_ranks(rank: int, world_size: int, late: tuple = (2,), timeout_s: float = 2.0) -> str:
    """Worker: every rank not in ``late`` enters ``monitored_barrier`` (``wait_all_ranks=True``: rank 0 waits
    for all and names every rank that did not arrive); the ranks in ``late`` are busy elsewhere for
    ``timeout_s`` + 2 seconds. Returns what this rank saw."""
    if rank in late:
        time.sleep(timeout_s + 2)
        return "busy elsewhere: never entered the barrier"
    try:
        with _quiet_stderr():  # (gloo logs the same lines there)
            dist.monitored_barrier(timeout=_seconds(timeout_s), wait_all_ranks=True)
    except Exception as exc:  # noqa: BLE001 - shown, not handled
        return f"{type(exc).__name__}: {first_line(str(exc))}"
    return "passed the barrier"


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def stuck_in_a_desync(rank: int, world_size: int) -> None:
    """Worker that hangs: rank 0 all-reduces, while every other rank waits for a message from rank 0 that
    it never sends (each rank's code took a different branch: a desync)."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.recv(torch.zeros(1), src=0)


def _accumulated(prof) -> list:
    """The profiler's view of one step as the course's events: ``backward`` when DDP's reducer took a
    gradient (autograd's AccumulateGrad node, in which DDP's hook runs), ``all_reduce`` each gloo
    all-reduce from its launch to its completion; times in seconds from the profile's start."""
    out = []
    for e in prof.events():
        if e.name == "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad":
            kind = "backward"
        elif e.name == "gloo:all_reduce":
            kind = "all_reduce"
        else:
            continue
        out.append(SimpleNamespace(kind=kind, start_s=e.time_range.start / 1e6, end_s=e.time_range.end / 1e6))
    return sorted(out, key=lambda e: e.start_s)


def profiled_ddp_step(rank: int, world_size: int, hidden: int = 512, depth: int = 4, bucket_cap_mb: float = 1.0,
                      warmup: int = 3) -> dict:
    """Worker: the digits MLP (``hidden``, ``depth``) under torch's DDP and under the course's
    ``DataParallelBucket``, the same cap; ``warmup`` steps of each, then one more step of each: DDP's
    recorded by ``torch.profiler``, the course's by its own clock.

    Returns, in the form :func:`course_lib.notebooks.figures.plot_timeline` draws: ``{"ddp (torch.profiler)":
    {"events", "step_start_s"}, "bucket (its own clock)": {...}}``, and ``"table"``: the profiler's
    operators of DDP's step by count, ``[(name, count, self CPU µs)]``, and ``"count"``: ``{name: count}``.
    """
    torch.set_num_threads(1)
    x, y, _, _ = digits_tensors(seed=0)
    ddp = DDP(mlp(hidden=hidden, depth=depth, seed=0), bucket_cap_mb=bucket_cap_mb)
    ours = DataParallelBucket(mlp(hidden=hidden, depth=depth, seed=0), bucket_cap_mb=bucket_cap_mb)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (ddp, ours)}

    def step(model, s):
        rows = batch_slice(s, 64, len(x), rank, world_size)
        opts[model].zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        if model is ours:
            model.finish_gradient_synchronization()
        opts[model].step()

    for s in range(warmup):
        step(ddp, s)
        step(ours, s)
    dist.barrier()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:  # (it logs its start and stop)
        step(ddp, warmup)
    dist.barrier()
    start = time.perf_counter()
    step(ours, warmup)
    averages = sorted(prof.key_averages(), key=lambda a: (-a.count, a.key))
    return {
        "ddp (torch.profiler)": {"events": _accumulated(prof), "step_start_s": 0.0},
        "bucket (its own clock)": {"events": list(ours.events), "step_start_s": start},
        "table": [(a.key, a.count, a.self_cpu_time_total) for a in averages],
        "count": {a.key: a.count for a in averages},
    }


class _TwoHeads(nn.Module):
    """A model whose second head is used only when asked: its parameters get no gradient otherwise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.spare = nn.Linear(64, 32), nn.Linear(32, 10), nn.Linear(32, 10)

    def forward(self, x, use_spare: bool = False):
        h = torch.relu(self.body(x))
        return self.spare(h) if use_spare else self.head(h)


def unused_parameter(rank: int, world_size: int, find_unused_parameters: bool, steps: int = 3) -> str:
    """Worker: ``steps`` steps of a model whose ``spare`` head is never used, under DDP with
    ``find_unused_parameters`` as given. Returns what happened: the step it failed at and the first line
    of DDP's error, or the steps done and whether the ranks' parameters agree."""
    x, y, _, _ = digits_tensors(seed=0)
    model = DDP(_TwoHeads(), find_unused_parameters=find_unused_parameters)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        rows = batch_slice(s, 64, len(x), rank, world_size)
        try:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
        except RuntimeError as exc:
            return f"step {s}: RuntimeError: {first_line(str(exc), 400)}"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    return f"{steps} steps done; the ranks' parameters are {'the same' if same else 'different'}"


def uneven_inputs(rank: int, world_size: int, join: bool, timeout_s: float = 3.0) -> str:
    """Worker: rank r has 3 + r batches of the digits (uneven inputs, as a sharded dataset that does not
    divide evenly gives); it trains on all of them under DDP, inside ``Join([model])`` or not. Without
    ``Join`` the rank that has finished no longer calls all-reduce and the others wait for it: the group's
    ``timeout_s`` (a subgroup of all ranks made with it) turns that wait into an error. Returns what this
    rank saw."""
    group = dist.new_group(list(range(world_size)), timeout=_seconds(timeout_s))
    x, y, _, _ = digits_tensors(seed=0)
    model = DDP(mlp(hidden=32, seed=0), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 3 + rank

    def train():
        for s in range(batches):
            rows = batch_slice(s, 60, len(x), rank, world_size)  # (60: divisible by 2, 3 and 4 ranks)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()

    try:
        if join:
            with Join([model]):
                train()
        else:
            train()
            time.sleep(timeout_s + 2)  # then on to other work (evaluation, a checkpoint) while a peer trains
    except RuntimeError as exc:
        return f"{batches} batches: RuntimeError ({first_line(str(exc), 90)})"
    return f"{batches} batches: done"
