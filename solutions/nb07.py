"""Notebook 07: PowerSGD."""

import math

import torch

from course_lib.lowrank import orthogonalize_


def my_mean_and_own_buffer(grads, compress):
    errors = [torch.zeros_like(g) for g in grads[0]]
    for step in grads:
        # each worker puts in its gradient plus its buffer; the all-reduces give every worker the
        # compression of the average of what was put in; each keeps what it put in minus that
        put_in = [g + e for g, e in zip(step, errors)]
        update = compress(sum(put_in) / len(put_in))
        errors = [p - update for p in put_in]
    return sum(errors) / len(errors), errors[0]


def my_numbers_per_step(shapes, r, min_compression_rate):
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) == 0 or numel == 0:  # nothing to factor
            total += numel
            continue
        n, m = shape[0], numel // shape[0]  # rows x everything else; a vector is n x 1
        rank = min(n, m, r)
        compressed = (n + m) * rank
        total += compressed if compressed * min_compression_rate < n * m else numel
    return total


def my_memory_per_rank(shapes, r, min_compression_rate, use_error_feedback, warm_start):
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if use_error_feedback:  # an error for every parameter: the averaged ones differ from this rank's too
            total += numel
        if warm_start and len(shape) > 0 and numel > 0:
            n, m = shape[0], numel // shape[0]
            rank = min(n, m, r)
            if (n + m) * rank * min_compression_rate < n * m:  # compressed: its Q (m x rank) is kept
                total += m * rank
    return total


def my_alternating_powersgd(grads, p0, q0):
    """One factor a step, from the other one of the step before, Gram-Schmidt-orthonormalized; each
    worker's error buffer added before and refilled after."""
    P, Q = p0.clone(), q0.clone()
    buffers = [torch.zeros_like(g) for g in grads[0]]
    out = []
    for t, step in enumerate(grads):
        corrected = [b + g for b, g in zip(buffers, step)]
        if t % 2 == 0:  # send Q
            orthogonalize_(P)
            Q = sum(c.T @ P for c in corrected) / len(corrected)
        else:  # send P
            orthogonalize_(Q)
            P = sum(c @ Q for c in corrected) / len(corrected)
        approx = P @ Q.T
        buffers = [c - approx for c in corrected]
        out.append(approx)
    return out
