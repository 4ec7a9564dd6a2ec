"""Notebook 08's exercises (PowerSGD in practice): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import (
    hooks,
    powersgd,
)
from course_lib.notebooks.exercises.core import _COURSE_ANSWER, _name, _run_student, compare, refused_calls
from course_lib.utils.digits import batch_slice, digits_tensors, mlp


class PowerSGDHookState:
    """What the PowerSGD-hook exercise hands the student's hook.

    ``matrix_approximation_rank`` (r), two dicts for the memory, keyed as the student likes
    (``error_dict``: error feedback; ``q_memory_dict``: last step's Q's, for warm start), and
    :meth:`fresh_qs`, which draws the first Q's of a bucket as ``powersgd.powerSGD_hook`` draws them
    (one seed per bucket from a generator seeded alike on every rank), so that the two hooks can be
    compared number for number.
    """

    def __init__(self, matrix_approximation_rank: int = 2, random_seed: int = 0):
        self.matrix_approximation_rank = matrix_approximation_rank
        self.error_dict: dict = {}
        self.q_memory_dict: dict = {}
        self.rng = np.random.RandomState(random_seed)

    def fresh_qs(self, shapes, dtype=torch.float32) -> list[torch.Tensor]:
        """One Gaussian Q per shape (``(m, r)`` for an n x m matrix), for the matrices of one bucket,
        in the order of ``bucket.gradients()``: call it once per bucket, at its first compressed step."""
        return powersgd._fresh_q(self, [tuple(shape) for shape in shapes], dtype, "cpu")


@dataclass
class _HookRun:  # the student's hook, its state, and the step DDP is at (plain all-reduce before start)
    hook: object
    state: PowerSGDHookState
    start: int
    step: int = 0


# The course's and torch's PowerSGD hooks: what the exercise asks to write
_HOOKS = (powersgd.powerSGD_hook, powersgd.ordered_powerSGD_hook, powersgd.batched_powerSGD_hook,
          powersgd.compress_on_one_process, powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook)


def _student_after_start(run: _HookRun, bucket):
    if run.step < run.start:
        return hooks.allreduce_fut(None, bucket.buffer())
    with refused_calls(_HOOKS, getattr(run.hook, "__name__", "your hook"), _COURSE_ANSWER):
        return run.hook(run.state, bucket)


_HOOK_EXERCISE = dict(hidden=32, bucket_cap_mb=0.004, rank=2, start=2, steps=6, lr=0.2, batch_size=64)


def _hook_exercise_worker(rank: int, world_size: int, student_hook) -> dict:
    """Train the same model twice, under the course's ``powerSGD_hook`` and under the student's;
    the parameters after each step, both ways."""
    c = _HOOK_EXERCISE
    x, y, _, _ = digits_tensors(seed=0)
    out = {}
    for who in ("reference", "student"):
        model = DDP(mlp(hidden=c["hidden"], seed=0), bucket_cap_mb=c["bucket_cap_mb"])
        if who == "reference":
            state = powersgd.PowerSGDState(matrix_approximation_rank=c["rank"], start_powerSGD_iter=c["start"])
            model.register_comm_hook(state, powersgd.powerSGD_hook)
        else:
            run = _HookRun(student_hook, PowerSGDHookState(c["rank"]), c["start"])
            model.register_comm_hook(run, _student_after_start)
        opt = torch.optim.SGD(model.parameters(), lr=c["lr"])
        params = []
        for step in range(c["steps"]):
            if who == "student":
                run.step = step
            idx = batch_slice(step, c["batch_size"], len(x), rank, world_size)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        out[who] = params
    return out


def check_powersgd_hook(student_fn) -> bool:
    """``student_fn(state, bucket)``: a DDP communication hook doing PowerSGD with error feedback
    and warm start (``state`` is a :class:`PowerSGDHookState`). It trains an MLP on 2 gloo ranks
    (two buckets, rank 2, plain all-reduce for steps 0 and 1, then 4 compressed steps) and must
    leave the parameters of ``powersgd.powerSGD_hook`` after every step, to 1e-4 relative."""
    name = _name(student_fn, "my_powersgd_hook", in_processes=True)
    c, world_size = _HOOK_EXERCISE, 2
    results = _run_student(_hook_exercise_worker, world_size, student_fn, name)
    if results is None:
        return False
    for rank, out in enumerate(results):
        for step, (expected, got) in enumerate(zip(out["reference"], out["student"])):
            why = compare(expected, got, rtol=1e-4, atol=1e-6)
            if why:
                kind = "a plain all-reduce step" if step < c["start"] else f"compressed step {step - c['start'] + 1}"
                print(f"[FAIL] {name}, rank {rank}: the parameters after step {step} ({kind}) differ from "
                      f"powersgd.powerSGD_hook's: {why}")
                return False
    print(f"[PASS] {name}: the same parameters as powersgd.powerSGD_hook after each of {c['steps']} steps "
          f"({c['steps'] - c['start']} compressed) on {world_size} ranks.")
    return True
