"""Notebook 11's exercises (local SGD, post-local SGD and DiLoCo): each ``check_*`` holds the
inputs and the reference answer."""

from __future__ import annotations

import copy
import importlib
import traceback

import torch

from course_lib import (
    costmodel,
    local_sgd,
)
from course_lib.notebooks.exercises.core import _WHERE, NotAllowed, _name, _refusing, _short, check, compare

# The outer step's cases: the ranks, the shapes of the parameters, lr, mu, and how many outer steps in a row
# (the buffer carried from one to the next). mu = 0 with lr = 1 is the plain average of the ranks' parameters.
OUTER_STEP_CASES = [
    (2, [(4, 3), (3,)], 0.7, 0.9, 4),  # the paper's outer optimizer
    (3, [(5,), (2, 2, 2)], 0.7, 0.9, 4),
    (3, [(6, 4), (4,), (1,)], 0.5, 0.5, 3),
    (2, [(4, 3), (3,)], 1.0, 0.0, 3),  # local SGD's averaging
    (3, [(5,)], 0.7, 0.0, 2),
]


def outer_step_rounds(world_size: int, shapes, lr: float, mu: float, steps: int, seed: int) -> list:
    """The reference: ``steps`` outer steps in a row, run by ``torch.optim.SGD(nesterov=True)`` on the shared
    parameters θ_start with the pseudo-gradient Δ = mean over ranks of (θ_start − θ_rank) as their gradient, as
    ``local_sgd.DiLoCo`` runs it. Each rank's parameters θ_rank after its inner steps are θ_start moved by a
    part all ranks share and a part of their own. Returns, for each outer step, ``(shared, locals_, (new_shared,
    new_momentum))``: θ_start, each rank's list of tensors, and what the step returns; at mu = 0 (plain SGD,
    which keeps no buffer) the buffer is Δ itself, what ``buffer = mu·buffer + Δ`` gives."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g).requires_grad_() for shape in shapes]
    outer = torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=mu > 0)
    rounds = []
    for _ in range(steps):
        start = [p.detach().clone() for p in params]
        common = [0.1 * torch.randn(shape, generator=g) for shape in shapes]
        locals_ = [[s - c - 0.05 * torch.randn(s.shape, generator=g) for s, c in zip(start, common)]
                   for _ in range(world_size)]
        for i, p in enumerate(params):
            p.grad = sum(start[i] - rank[i] for rank in locals_) / world_size
        outer.step()
        new_shared = [p.detach().clone() for p in params]
        new_momentum = [(outer.state[p]["momentum_buffer"] if mu > 0 else p.grad).detach().clone() for p in params]
        rounds.append((start, locals_, (new_shared, new_momentum)))
    return rounds


# what does the outer step for the student: torch's SGD (the class, its step and the function behind it, also
# when imported by name before the check), the optimizers' step, and the course's DiLoCo
_OUTER_STEP_REFUSED = [(torch.optim, "SGD"), (torch.optim.SGD, "step"), (torch.optim.Optimizer, "step"),
                       (importlib.import_module("torch.optim.sgd"), "sgd"),
                       (importlib.import_module("torch.optim._functional"), "sgd"), (local_sgd, "DiLoCo"),
                       (local_sgd.DiLoCo, "step")]
_WHERE.update({torch.optim.SGD: "torch.optim.SGD", torch.optim.Optimizer: "torch.optim.Optimizer",
               local_sgd.DiLoCo: "course_lib.local_sgd.DiLoCo"})


def check_outer_step(student_fn) -> bool:
    """``student_fn(shared, locals_, momentum, lr=0.7, mu=0.9)``: DiLoCo's outer step, in one process.
    ``shared`` is θ_start (a list of tensors), ``locals_`` each rank's list of tensors after its inner
    steps, ``momentum`` the buffers (None at the first outer step). Returns ``(new_shared, new_momentum)``:
    Δ = mean over ranks of (θ_start − θ_rank), then SGD with Nesterov momentum as torch's (dampening 0):
    buffer = Δ at the first step, else mu·buffer + Δ; θ_start − lr·(Δ + mu·buffer). Several outer steps in a
    row, each given the buffers the function returned at the one before, compared with
    :func:`outer_step_rounds` on 2 and 3 ranks, mu = 0 included. The inputs must be left as they were, and
    torch's SGD and the course's DiLoCo are refused while it runs."""
    name = _name(student_fn, "outer_step")
    student = _refusing(student_fn, _OUTER_STEP_REFUSED,
                        "is refused here: write the outer step with tensor arithmetic, the point is to see what "
                        "the outer optimizer does with the pseudo-gradient")
    for i, (world_size, shapes, lr, mu, steps) in enumerate(OUTER_STEP_CASES):
        momentum = None  # the first outer step's
        for t, (shared, locals_, expected) in enumerate(outer_step_rounds(world_size, shapes, lr, mu, steps, 900 + i)):
            where = (f"[FAIL] {name}, case {i} ({world_size} ranks, shapes {shapes}, lr {lr}, mu {mu}), "
                     f"outer step {t + 1} of {steps}")
            args = (shared, locals_, momentum)
            before = copy.deepcopy(args)
            try:
                got = student(*args, lr, mu)
            except NotImplementedError:
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
                return False
            except NotAllowed as e:
                print(f"{where}: {e}")
                return False
            except Exception as e:
                line = traceback.extract_tb(e.__traceback__)[-1].lineno
                print(f"{where}: raised {type(e).__name__}: {e} (line {line})")
                return False
            for what, was, now in zip(("shared", "locals_", "momentum"), before, args):
                if compare(was, now, rtol=0, atol=0):
                    print(f"{where}: changed `{what}` in place; leave shared, locals_ and momentum as they were and "
                          f"return new tensors (θ_start, each rank's parameters and the buffers are the caller's)")
                    return False
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                print(f"{where}: return (new_shared, new_momentum), two lists of tensors; got {_short(got)}")
                return False
            for what, e, g in zip(("new_shared", "new_momentum"), expected, got):
                why = compare(e, g)
                if why:
                    print(f"{where}: {what}: {why}")
                    return False
            momentum = got[1]  # what the next outer step is given: the buffers the function returned
    print(f"[PASS] {name}: θ_start and the buffers of torch.optim.SGD(nesterov=True) at every outer step, "
          f"{len(OUTER_STEP_CASES)} runs of 2 to 4 outer steps on 2 and 3 ranks (mu = 0 and lr = 1 included: the "
          f"plain average).")
    return True


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s / 8  # a link's line rate in Gbit/s, as a bus bandwidth in GB/s


# (compute_s, nbytes, reference_step_s, world_size, alpha_s, busbw_GBps): a 124M-parameter model in fp32 (GPT-2
# small) at 1, 10 and 100 Gbit/s; a 1M-parameter one, where latency counts; and never. T / (reference − compute)
# is at least 0.04 from an integer in every case but one, so that no rounding decides the answer; that one (case
# 8) is an exact tie, every number in it a binary fraction, so that T / 4 + compute = reference in floating point
# too: there H = 4 is as fast as the reference, not faster.
BREAK_EVEN_PERIOD_CASES = [
    (0.2, 496e6, 0.25, 2, 50e-6, _gbit(1)),
    (0.2, 496e6, 0.3, 8, 50e-6, _gbit(1)),
    (0.2, 496e6, 0.23, 2, 50e-6, _gbit(10)),
    (0.2, 496e6, 0.21, 8, 50e-6, _gbit(10)),
    (0.2, 496e6, 0.205, 2, 50e-6, _gbit(100)),
    (0.01, 4e6, 0.0105, 8, 50e-6, _gbit(100)),  # 14 α is more than the bytes' time
    (0.05, 4e6, 0.062, 8, 1e-3, _gbit(1)),  # across data centres: a millisecond per message
    (0.2, 496e6, 1.0, 2, 50e-6, _gbit(10)),  # a slow reference: averaging at every step already beats it
    (0.5, 1.25e9, 0.75 + 2**-17, 2, 2**-16, _gbit(10)),  # the tie: T = 1 + 2^-15 s, four times the spare
    (0.2, 496e6, 0.2, 8, 50e-6, _gbit(10)),  # the reference is computing alone: no period beats it
    (0.2, 496e6, 0.15, 2, 50e-6, _gbit(100)),  # the reference computes faster: never
]


def check_break_even_period(student_fn) -> bool:
    """``student_fn(compute_s, nbytes, reference_step_s, world_size, alpha_s, busbw_GBps)``: the smallest
    integer period H at which averaging every H steps (one ring all-reduce of ``nbytes``, 2(p − 1)α +
    2(p − 1)/p · nbytes / (busbw · 1e9), shared by H steps, plus ``compute_s`` per step) is strictly faster than
    ``reference_step_s`` per step; ``math.inf`` when no period is. Compared exactly with
    ``costmodel.break_even_period``, which is refused while it runs, as is ``costmodel.periodic_step_time``."""
    student = _refusing(student_fn, [(costmodel, "break_even_period"), (costmodel, "periodic_step_time")],
                        "is refused here: write the step time of averaging every H steps yourself, and solve for H")
    return check(student, costmodel.break_even_period, BREAK_EVEN_PERIOD_CASES, name=_name(student_fn, "break_even"),
                 rtol=0, atol=0)
