"""Notebook 07's exercises (PowerSGD): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import math

import torch

from course_lib import (
    lowrank,
    memory,
    powersgd,
)
from course_lib.notebooks.exercises.core import _name, check


def _rank1(X):  # a deterministic rank-1 compressor: two power steps from a fixed seed
    P, Q = lowrank.power_iteration(X, 1, 2, generator=torch.Generator().manual_seed(0))
    return P @ Q.T


def _mean_and_own_buffer(grads, compress):
    """The reference: every worker's buffer kept by the package's ``memory.ErrorFeedback`` as the hook keeps
    it (what it put in, its gradient plus its buffer, minus the compression of the average of what all
    put in), from zero; then the mean of the buffers and worker 0's own."""
    memories = [memory.ErrorFeedback() for _ in grads[0]]
    for step in grads:
        corrected = [m.compensate("g", g) for m, g in zip(memories, step)]
        update = compress(sum(corrected) / len(corrected))
        for m, c in zip(memories, corrected):
            m.update("g", c, update)
    errors = [m.memory["g"].view_as(grads[0][0]) for m in memories]
    return sum(errors) / len(errors), errors[0]


def check_mean_and_own_buffer(student_fn) -> bool:
    """``student_fn(grads, compress)``: ``grads[t][i]`` is worker i's gradient at compressed step t;
    returns ``(mean of the workers' error buffers, worker 0's buffer)`` after the last step."""
    def case(workers, steps, seed):
        g = torch.Generator().manual_seed(seed)
        shared = torch.randn(6, 5, generator=g)  # the workers' gradients share a part, as real ones do
        return [[shared + 0.5 * torch.randn(6, 5, generator=g) for _ in range(workers)] for _ in range(steps)], _rank1

    cases = [case(2, 1, 0), case(2, 3, 1), case(3, 4, 2), case(4, 5, 3)]
    return check(student_fn, _mean_and_own_buffer, cases, name=_name(student_fn, "mean_and_own_buffer"),
                 refuse=(memory.ErrorFeedback,))


def _numbers_per_step(shapes, r: int, min_compression_rate: float) -> int:
    return powersgd.numbers_per_step(shapes, r, min_compression_rate)[1]


def check_numbers_per_step(student_fn) -> bool:
    """``student_fn(shapes, r, min_compression_rate)``: the numbers PowerSGD sends per compressed step
    for parameters of these shapes, each viewed as rows x everything else (a vector as n x 1), as
    the hooks send them."""
    mlp512 = [(512, 64), (512,), (512, 512), (512,), (10, 512), (10,)]
    conv = [(16, 3, 3, 3), (16,), (10, 64), (10,)]
    cases = [(mlp512, 2, 2), (mlp512, 1, 2), (mlp512, 64, 2), (conv, 1, 2), ([(4, 4)], 1, 1),
             (mlp512, 2, 0), (conv, 4, 0.5), (conv, 2, 0.92)]  # below 1, vectors go as n x 1 matrices
    return check(student_fn, _numbers_per_step, cases, name=_name(student_fn, "numbers_per_step"),
                 refuse=(powersgd.numbers_per_step,))


def _memory_per_rank(shapes, r: int, min_compression_rate: float, use_error_feedback: bool, warm_start: bool) -> int:
    """The reference: an error as large as the gradient (every parameter, compressed or not), and a
    Q (columns x rank) for each tensor that is compressed."""
    total = sum(math.prod(s) for s in shapes) if use_error_feedback else 0
    for shape in shapes:
        numel = math.prod(shape)
        if warm_start and len(shape) > 0 and numel > 0:
            n, m = shape[0], numel // shape[0]
            rank = min(n, m, r)
            if powersgd.should_compress(n, m, rank, min_compression_rate)[0]:
                total += m * rank
    return total


def check_memory_per_rank(student_fn) -> bool:
    """``student_fn(shapes, r, min_compression_rate, use_error_feedback, warm_start)``: how many numbers
    PowerSGD keeps on each rank from one compressed step to the next."""
    mlp512 = [(512, 64), (512,), (512, 512), (512,), (10, 512), (10,)]
    conv = [(16, 3, 3, 3), (16,), (10, 64), (10,)]
    cases = [(mlp512, 2, 2, True, True), (mlp512, 4, 2, True, False), (mlp512, 1, 2, False, True),
             (conv, 2, 2, True, True), (conv, 8, 2, False, True), (mlp512, 2, 0, False, True),
             (mlp512, 2, 2, False, False)]
    return check(student_fn, _memory_per_rank, cases, name=_name(student_fn, "memory_per_rank"))


def _orthonormal(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(X).Q


def _alternating(grads, p0: torch.Tensor, q0: torch.Tensor) -> list[torch.Tensor]:
    """The reference: the PowerSGD authors' alternating scheme (epfml/powersgd, ``BasicPowerSGD``), one
    matrix, the workers simulated in one process. Each step adds the worker's error to its gradient
    (M); even steps orthogonalize P and average Q = Mᵀ P, odd steps orthogonalize Q and average P = M Q
    (one all-reduce a step); every worker applies P Qᵀ and keeps M − P Qᵀ as its error."""
    P, Q = p0.clone(), q0.clone()
    errors = [torch.zeros_like(g) for g in grads[0]]
    applied = []
    for t, step in enumerate(grads):
        M = [e + g for e, g in zip(errors, step)]
        if t % 2 == 0:
            P = _orthonormal(P)
            Q = torch.stack([m.T @ P for m in M]).mean(0)
        else:
            Q = _orthonormal(Q)
            P = torch.stack([m @ Q for m in M]).mean(0)
        approximation = P @ Q.T
        errors = [m - approximation for m in M]
        applied.append(approximation)
    return applied


def alternating_cases() -> list[tuple]:
    """``(grads, p0, q0)``: 2 and 3 workers, 6 steps, n x m matrices at ranks 1 and 2, float64; one case
    with a gradient that does not change from step to step (the approximation should close in on it)."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for workers, (n, m), r in ((2, (6, 5), 2), (3, (8, 3), 1), (2, (4, 7), 2)):
        grads = [[torch.randn(n, m, generator=g, dtype=torch.float64) for _ in range(workers)] for _ in range(6)]
        cases.append((grads, torch.randn(n, r, generator=g, dtype=torch.float64),
                      torch.randn(m, r, generator=g, dtype=torch.float64)))
    fixed = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    cases.append(([fixed] * 6, torch.randn(5, 1, generator=g, dtype=torch.float64),
                  torch.randn(4, 1, generator=g, dtype=torch.float64)))
    return cases


def check_alternating_powersgd(student_fn) -> bool:
    """``student_fn(grads, p0, q0)``: the PowerSGD authors' alternating scheme, in one process: ``grads[t][i]``
    is worker i's gradient (an n x m matrix) at step t, ``p0`` (n x r) and ``q0`` (m x r) the starting
    factors. Returns, per step, the n x m approximation every worker applies. One all-reduce a step: even
    steps send Q, odd steps P, each computed from the other factor of the step before (orthonormalized), on
    each worker's gradient plus its error-feedback buffer, which then keeps what the approximation left
    out. Compared step by step with the reference (any orthonormalization: the products do not depend on
    the columns' signs)."""
    return check(student_fn, _alternating, alternating_cases(), name=_name(student_fn, "alternating_powersgd"),
                 rtol=1e-7, atol=1e-9)
