"""Notebook 00's exercises (setup): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.notebooks.exercises.core import Rules, _name, check_distributed


def rank_inputs(rank: int, world_size: int):
    """Each rank's input for notebook 00's exercises: ``[rank + 1]`` and a vector drawn from ``rank``."""
    return (torch.tensor([float(rank + 1)]), torch.randn(5, generator=torch.Generator().manual_seed(rank)))


def sum_of_squares_expected(one: torch.Tensor, _vector: torch.Tensor) -> torch.Tensor:
    """The answer computed without communication: 1^2 + 2^2 + ... + p^2."""
    p = dist.get_world_size()
    return one.new_tensor([float(sum((r + 1) ** 2 for r in range(p)))])


def elementwise_max_expected(_one: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """The answer computed without communication: every rank's vector drawn again, and the largest kept."""
    p = dist.get_world_size()
    return torch.stack([torch.randn(5, generator=torch.Generator().manual_seed(r)) for r in range(p)]).amax(0)


def check_sum_of_squares(student_fn) -> bool:
    """``student_fn(one, vector)`` in a ``.py`` file: every rank returns the sum over ranks of ``one ** 2``,
    with one collective (the formula for 1 + 4 + ... + p^2, computed without communicating, is refused)."""
    return check_distributed(student_fn, sum_of_squares_expected, rank_inputs, world_sizes=(2, 3, 4),
                             name=_name(student_fn, "sum_of_squares"),
                             rules=Rules(collectives=1, why="the exercise asks for exactly one collective"))


def check_elementwise_max(student_fn) -> bool:
    """``student_fn(one, vector)`` in a ``.py`` file: every rank returns the elementwise maximum of ``vector``."""
    return check_distributed(student_fn, elementwise_max_expected, rank_inputs, world_sizes=(2, 3),
                             name=_name(student_fn, "elementwise_max"))
