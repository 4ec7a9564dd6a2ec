"""Notebook 08's runs of a communication hook: how a run ended, and when a step's collectives ran.

``try_training`` trains a :class:`~course_lib.train.TrainConfig` in worker processes and says how
the run ended (an :class:`Outcome`: finished, raised, crashed or hung) instead of raising: what
notebook 08 needs to show torch's PowerSGD hooks crashing or hanging where the course's do not,
without the notebook hanging with them. ``hook_timeline`` trains with several hooks in turn and
notes, step by step, when each gradient was ready and when each collective ran, on which thread.
Neither is the training loop: that is :func:`course_lib.train.ddp_train`, which both start.
"""

import dataclasses
import linecache
import os
import tempfile
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks
from course_lib.data_parallel import Event
from course_lib.launch import WorkerError, spawn
from course_lib.train import TrainConfig, ddp_train, make_hook, train_several
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["Frame", "Outcome", "try_training", "try_worker", "callbacks_that_wait", "hook_timeline"]


class Frame(NamedTuple):
    """Where one thread of a hung worker was: its innermost Python frame, as ``faulthandler`` dumped it."""

    function: str
    file: str  # the file's name, without its folders
    line: int
    code: str  # that line of source, stripped ("" where the file cannot be read)


class Outcome(NamedTuple):
    """How a run of :func:`try_training` ended: ``kind`` is ``"finished"``, ``"raised <ExceptionType>"``
    (a worker raised), ``"crashed"`` (a worker process died) or ``"hung"`` (killed at the timeout).
    For a hung run, ``stacks`` holds, per rank, where each of its threads was shortly before the
    timeout (threads that were running Python; the innermost frame of each)."""

    kind: str
    seconds: float
    detail: str
    stacks: dict = {}


def _quietly(rank: int, world_size: int, fn, stderr_dir: str, args: tuple):
    # What a worker's C++ code writes before aborting goes to fd 2, which Jupyter shows in the cell
    # that started it; here it goes to a file that try_worker reads.
    fd = os.open(os.path.join(stderr_dir, f"rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    return fn(rank, world_size, *args)


def _train(rank: int, world_size: int, config):
    if isinstance(config, TrainConfig):
        return ddp_train(rank, world_size, config)
    return train_several(rank, world_size, config)


def try_training(config: TrainConfig | list[TrainConfig], world_size: int = 2, timeout_s: float = 10.0) -> Outcome:
    """Train ``config`` on ``world_size`` gloo processes and say how it ended, instead of raising.

    For hooks that may crash, hang or raise (torch's layer-wise PowerSGD hook with several buckets on
    gloo; its batched hook, which raises anywhere): see :func:`try_worker`. A list of configs is
    trained one after another in the same processes (``"finished"`` when all did; else how the first
    failure ended).
    """
    return try_worker(_train, world_size, config, timeout_s=timeout_s)


def try_worker(fn, world_size: int, *args, timeout_s: float = 10.0) -> Outcome:
    """Run worker ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes and say how it ended,
    instead of raising: a hang is cut off after ``timeout_s`` seconds and reported as ``"hung"``, with
    where each rank's threads were (``Outcome.stacks``, from the stacks ``spawn`` has each worker dump at
    its timeout: what `py-spy dump` shows of a live process, from inside it); what a crashed worker
    wrote to its stderr before dying ends up in ``detail``."""
    start = time.monotonic()
    stacks = {}
    with tempfile.TemporaryDirectory() as stderr_dir:
        try:
            spawn(_quietly, world_size, fn, stderr_dir, args, backend="gloo", timeout_s=timeout_s)
            kind, detail = "finished", ""
        except TimeoutError as e:
            kind, detail = "hung", str(e).split(";")[0]
            dumps = getattr(e, "dumps", {})
            stacks = {rank: _innermost_frames(dumps.get(rank, "")) for rank in range(world_size)}
        except WorkerError as e:
            kind = "crashed" if e.exc_type == "ProcessExited" else f"raised {e.exc_type}"
            frames = [ln.strip() for ln in e.worker_traceback.splitlines() if ln.strip().startswith("File ")]
            where = f" ({frames[-1].rsplit(', ', 1)[-1]})" if frames else ""
            detail = f"rank {e.rank}{where}: {e.message}".rstrip(": ")
            if kind == "crashed":
                with open(os.path.join(stderr_dir, f"rank{e.rank}.txt"), errors="replace") as fh:
                    last = [ln.strip() for ln in fh if ln.strip()][-1:]
                detail = f"rank {e.rank} died" + (f"; its stderr: {last[0]}" if last else "")
    return Outcome(kind, time.monotonic() - start, detail, stacks)


def callbacks_that_wait(rank: int, world_size: int, in_flight: int = 2) -> list[str]:
    """Worker: torch's PowerSGD hook's pattern alone, on rank 0. ``in_flight`` all-reduces at once; the
    callback of each one's future issues another all-reduce and waits for it. The other ranks issue the
    same all-reduces in the same order without callbacks, so that no pairing can go wrong, and only once
    rank 0 has attached its callbacks (a barrier on a second group, which has threads of its own): rank
    0's all-reduces cannot finish before then, so its callbacks run on gloo's threads, however loaded
    the machine. Returns the threads rank 0's callbacks ran on."""
    ran_on = []
    side = dist.new_group(backend="gloo")

    def callback(fut):
        dist.all_reduce(torch.ones(1), async_op=True).get_future().wait()
        ran_on.append(threading.current_thread().name)
        return fut.value()

    if rank != 0:
        dist.barrier(group=side)
        works = [dist.all_reduce(torch.ones(n), async_op=True) for n in [4] * in_flight + [1] * in_flight]
        for work in works:
            work.wait()
        return ran_on
    futures = [dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback) for _ in range(in_flight)]
    dist.barrier(group=side)
    for future in futures:
        future.wait()
    return ran_on


def _innermost_frames(dump: str) -> list[Frame]:
    """Each dumped thread's innermost frame (faulthandler writes "most recent call first"); none for a
    worker that never started."""
    frames, fresh = [], False
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            fresh = True
        elif fresh and line.strip().startswith("File "):
            fresh = False
            file, rest = line.strip()[len('File "'):].split('", line ', 1)
            number, function = rest.split(" in ", 1)
            code = linecache.getline(file, int(number)).strip()
            frames.append(Frame(function.strip(), os.path.basename(file), int(number), code))
    return frames


def hook_timeline(rank: int, world_size: int, config: TrainConfig,
                  hook_names: tuple = ("powersgd", "ordered_powersgd")) -> dict:
    """Worker: ``config.steps`` steps with each hook in ``hook_names`` in turn, step by step (all see
    the same machine load); per hook, the timeline of the last step in the format of
    :func:`course_lib.notebooks.figures.plot_timeline`, and each step's time (forward, backward,
    communication, update).

    ``events`` holds ``data_parallel.Event("backward", parameter, start, end)`` for each gradient
    (from the previous gradient, or from the start of backward, until this one was accumulated) and
    ``Event("all_reduce", thread, start, end)`` for each collective the hook issued, named by the
    thread that issued it. The rest of ``config`` (model, buckets, PowerSGD's arguments) applies to
    every hook.
    """
    x, y, _, _ = digits_tensors(seed=0)
    runs = {}
    for name in hook_names:
        c = dataclasses.replace(config, hook=name)
        model = DDP(mlp(hidden=c.hidden, depth=c.depth, seed=c.seed, n_in=c.n_in), bucket_cap_mb=c.bucket_cap_mb)
        model.register_comm_hook(*make_hook(c))
        ready: list = []
        for pname, p in model.module.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, pname=pname, ready=ready: ready.append((pname, time.perf_counter())))
        runs[name] = {"model": model, "ready": ready, "opt": torch.optim.SGD(model.parameters(), lr=c.lr),
                      "step_s": []}
    for step in range(config.steps):
        idx = batch_slice(step, config.batch_size, len(x), rank, world_size)
        for run in runs.values():
            dist.barrier()
            hooks.traffic.reset()
            collectives = hooks.traffic.record_timeline()
            run["ready"].clear()
            start = time.perf_counter()
            run["opt"].zero_grad()
            loss = nn.functional.cross_entropy(run["model"](x[idx]), y[idx])
            backward_start = time.perf_counter()
            loss.backward()
            run["opt"].step()
            run["step_s"].append(time.perf_counter() - start)
            dist.barrier()  # every collective of this step has completed on every rank
            events, previous = [], backward_start
            for pname, at in run["ready"]:
                events.append(Event("backward", pname, previous, at))
                previous = at
            events += [Event("all_reduce", done.thread, done.start_s, done.end_s) for done in collectives]
            run["step_start_s"], run["events"] = start, events
    hooks.traffic.reset()
    return {name: {k: run[k] for k in ("step_start_s", "events", "step_s")} for name, run in runs.items()}
