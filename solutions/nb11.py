"""Notebook 11: local SGD, post-local SGD and DiLoCo (both written in the notebook)."""

import math


def my_outer_step(shared, locals_, momentum, lr=0.7, mu=0.9):
    p = len(locals_)
    # the pseudo-gradient: how far the ranks moved from θ_start, reversed (a step of gradient *descent*
    # moves against the gradient), averaged over the ranks: what the all-reduce gives each of them
    deltas = [sum(start - rank[i] for rank in locals_) / p for i, start in enumerate(shared)]
    # SGD with Nesterov momentum as torch's: the buffer is Δ at the first step, mu·buffer + Δ after it, and
    # the step looks ahead along it: Δ + mu·buffer. New tensors: the inputs stay as they were.
    new_momentum = deltas if momentum is None else [mu * b + d for b, d in zip(momentum, deltas)]
    new_shared = [start - lr * (d + mu * b) for start, d, b in zip(shared, deltas, new_momentum)]
    return new_shared, new_momentum


def my_break_even(compute_s, nbytes, reference_step_s, world_size, alpha_s, busbw_GBps):
    # one ring all-reduce of the parameters (or of the pseudo-gradient), every H steps
    p = world_size
    all_reduce_s = 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes / (busbw_GBps * 1e9)
    # compute_s + all_reduce_s / H < reference_step_s  <=>  H > all_reduce_s / spare_s, where spare_s > 0
    spare_s = reference_step_s - compute_s
    if spare_s <= 0:
        return math.inf  # the reference steps no slower than computing alone: no period beats it
    return math.floor(all_reduce_s / spare_s) + 1  # the first integer strictly above: at equality it only ties
