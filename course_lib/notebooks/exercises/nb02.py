"""Notebook 02's exercises (collectives): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import (
    collectives,
)
from course_lib.notebooks.exercises.core import Rules, _name, check_distributed


def exercise_inputs(rank: int, world_size: int):
    """Each rank's input for the exercises: a length that does not divide evenly among ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(2 * world_size + 1, generator=g),)


# Notebook 02's exercises build collectives from messages: each is run with every collective refused.
POINT_TO_POINT_ONLY = Rules(point_to_point_only=True, refused_functions=(
    "course_lib.collectives:ring_shift", "course_lib.collectives:blocking_ring_shift"))


def ring_shift_expected(tensor: torch.Tensor) -> torch.Tensor:
    """The left neighbour's tensor, another way: torch's all-gather, then the left one's entry."""
    rank, p = dist.get_rank(), dist.get_world_size()
    everyone = [torch.empty_like(tensor) for _ in range(p)]
    dist.all_gather(everyone, tensor)
    return everyone[(rank - 1) % p]


def check_ring_shift(student_fn) -> bool:
    """``student_fn(tensor)`` in a ``.py`` file: the left neighbour's tensor, from send/recv only."""
    return check_distributed(student_fn, ring_shift_expected, exercise_inputs, name=_name(student_fn, "ring_shift"),
                             rules=POINT_TO_POINT_ONLY)


def all_reduce_expected(tensor: torch.Tensor) -> torch.Tensor:
    """torch.distributed's own all-reduce (sum), on a copy: the reference for a student's all-reduce."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def check_recursive_doubling(student_fn) -> bool:
    """``student_fn(tensor)`` in a ``.py`` file: a recursive-doubling all-reduce (sum) for power-of-two
    world sizes, from send/recv only, one whole-tensor message per rank in each of the log2 p rounds;
    checked against ``dist.all_reduce`` on 2 and 4 ranks."""
    rules = Rules(point_to_point_only=True, sends={2: 1, 4: 2},
                  why="recursive doubling sends one message (the whole tensor) per round: log2 p in all "
                      "(1 on 2 ranks, 2 on 4)")
    return check_distributed(student_fn, all_reduce_expected, exercise_inputs, world_sizes=(2, 4),
                             name=_name(student_fn, "recursive_doubling_all_reduce"), rules=rules)


def halving_inputs(rank: int, world_size: int):
    """Each rank's input for recursive halving: 4p + 1 numbers, chunks of unequal length, and room
    between every chunk but one's own and the whole tensor (so sending a little too much is caught)."""
    g = torch.Generator().manual_seed(200 + rank)
    return (torch.randn(4 * world_size + 1, generator=g),)


def all_but_own_chunk(input_numbers: int, rank: int, world_size: int) -> int:
    """How many numbers recursive halving sends in all: every chunk (``tensor_split``) but one's own."""
    return input_numbers - len(torch.empty(input_numbers).tensor_split(world_size)[rank])


def check_recursive_halving(student_fn) -> bool:
    """``student_fn(tensor)`` in a ``.py`` file: a reduce-scatter by recursive halving for power-of-two
    world sizes: this rank's chunk (``tensor_split(p)[rank]``) of the sum, from send/recv only, in
    log2 p rounds of one message each, sending every chunk but its own exactly once in all (each round
    the half of the remaining chunks the partner keeps). Checked against ``collectives.reduce_scatter``
    (an all-reduce of torch's, then this rank's chunk) on 2 and 4 ranks."""
    rules = Rules(point_to_point_only=True, sends={2: 1, 4: 2}, sent_below_input=True,
                  sent_numbers=all_but_own_chunk, refused_functions=("course_lib.collectives:ring_reduce_scatter",),
                  why="recursive halving sends one message per round, log2 p in all (1 on 2 ranks, 2 on 4), "
                      "each the half of the remaining chunks that the partner keeps: every chunk but your own "
                      "in all, each once")
    return check_distributed(student_fn, collectives.reduce_scatter, halving_inputs, world_sizes=(2, 4),
                             name=_name(student_fn, "recursive_halving_reduce_scatter"), rules=rules)
