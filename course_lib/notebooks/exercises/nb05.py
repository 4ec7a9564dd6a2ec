"""Notebook 05's exercises (sharded data parallelism (ZeRO, FSDP)): each ``check_*`` holds the
inputs and the reference answer."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from course_lib import (
    sharding,
)
from course_lib.notebooks.exercises.core import Rules, _name, _refusing, _run_both, _run_student, check, compare

# Each world size's units: the shapes of one unit's gradients (a weight and a bias), whose length p
# does not divide, does, and is shorter than p (some ranks' slices padding alone).
ZERO2_SHAPES = {2: ([(3, 4), (5,)], [(2, 2), (4,)], [(1,)]),
                3: ([(3, 4), (2,)], [(3, 3), (3,)], [(2,)])}


def zero2_inputs(rank: int, world_size: int, shapes):
    """Each rank's input for notebook 05's ZeRO-2 exercise: its own gradients of one unit, of ``shapes``."""
    n = sum(math.prod(shape) for shape in shapes)
    g = torch.Generator().manual_seed(400 + 10 * n + rank)
    return ([torch.randn(shape, generator=g) for shape in shapes],)


def zero2_gradient_expected(grads, group=None) -> torch.Tensor:
    """The reference, another way than a reduce-scatter: the unit's gradients flattened in order into
    one vector, padded with zeros to p·c numbers (c = ceil(n / p)), torch's all-reduce of the whole
    vector, divided by p, then numbers [rank·c, (rank + 1)·c), cloned."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    c = -(-flat.numel() // p)
    padded = flat.new_zeros(p * c)
    padded[: flat.numel()] = flat
    dist.all_reduce(padded, group=group)
    return (padded / p)[rank * c:(rank + 1) * c].clone()


def all_but_own_padded_chunk(input_numbers: int, rank: int, world_size: int) -> int:
    """How many numbers a reduce-scatter of a vector padded to a multiple of p sends: every chunk of
    c = ceil(n / p) numbers but one's own, (p − 1)·c."""
    return (world_size - 1) * -(-input_numbers // world_size)


# The ZeRO-2 exercise's rules: every all-reduce refused, and a reduce-scatter's bytes, no more.
ZERO2_RULES = Rules(
    refused=("dist.all_reduce", "collectives.ring_all_reduce", "collectives.naive_all_reduce",
             "collectives.reduce_scatter"),  # the last: notebook 02's reference, an all-reduce inside
    sent_numbers=all_but_own_padded_chunk,
    why="ZeRO-2 reduce-scatters the gradient padded to a multiple of p: each rank sends every chunk but its own "
        "once, (p − 1)·c numbers, half of what an all-reduce sends (the whole average on every rank, of which "
        "ZeRO-2 keeps 1/p). Build it on collectives.ring_reduce_scatter")


def _zero2_worker(rank: int, world_size: int, student_fn) -> list:
    """The reference and the student's function (under :data:`ZERO2_RULES`) on each unit, and the bytes
    of the storage behind what the student's returned (measured here: a view sent between processes
    need not keep its storage)."""
    name = getattr(student_fn, "__name__", "zero2_gradient")
    cases = []
    for shapes in ZERO2_SHAPES[world_size]:
        args, expected, got, used = _run_both(rank, world_size, student_fn, zero2_gradient_expected,
                                              functools.partial(zero2_inputs, shapes=shapes), ZERO2_RULES, name)
        used["storage_bytes"] = got.untyped_storage().nbytes() if torch.is_tensor(got) else None
        cases.append((args, expected, got, used))
    return cases


def check_zero2_gradient(student_fn) -> bool:
    """``student_fn(grads, group=None)`` in a ``.py`` file: given this rank's gradients of one unit (a
    list of tensors of any shapes), this rank's slice of the unit's gradient averaged over the ranks,
    as sharded data parallelism keeps it: the tensors flattened in order into one vector of n numbers,
    padded with zeros to p·c numbers (c = ceil(n / p)), numbers [rank·c, (rank + 1)·c) of the average,
    a tensor of c numbers with a storage of its own (not a view into a whole-size buffer), reduce-
    scattered. Checked on 2 and 3 gloo ranks, units whose length p does not divide, does, and shorter
    than p, against torch's all-reduce of the padded vector then the slice. Every all-reduce is refused
    while it runs (``dist.all_reduce``, ``collectives.ring_all_reduce``, ``naive_all_reduce`` and
    notebook 02's ``collectives.reduce_scatter``), and each rank must send what a reduce-scatter of the
    padded vector sends: every chunk but its own, once, (p − 1)·c numbers."""
    name = _name(student_fn, "zero2_gradient", in_processes=True)
    for world_size in ZERO2_SHAPES:
        results = _run_student(_zero2_worker, world_size, student_fn, name)
        if results is None:
            return False
        for rank, cases in enumerate(results):
            for args, expected, got, used in cases:
                shapes = [tuple(g.shape) for g in args[0]]
                n = sum(g.numel() for g in args[0])
                c = expected.numel()
                where = (f"[FAIL] {name}, world size {world_size}, rank {rank}, gradients of shapes {shapes} "
                         f"({n} numbers)")
                if torch.is_tensor(got) and got.numel() != c:
                    print(f"{where}: returned {got.numel()} numbers; return c = ceil({n}/{world_size}) = {c} "
                          f"numbers, this rank's slice of the flat gradient padded with zeros to a multiple of p "
                          f"({world_size * c} numbers): ZeRO-2 keeps 1/p of the gradient")
                    return False
                why = compare(expected, got)
                if not why and used["storage_bytes"] > got.numel() * got.element_size():
                    why = (f"the slice is a view that keeps the whole padded gradient alive (a storage of "
                           f"{used['storage_bytes']} bytes behind {c} numbers); copy it (`.clone()`) or divide into "
                           f"a new tensor: ZeRO-2 keeps 1/p of the gradient")
                why = why or ZERO2_RULES.broken(used, world_size)
                if why:
                    print(f"{where}: {why}")
                    return False
    print(f"[PASS] {name}: this rank's slice of the averaged gradient, padded to a multiple of p, in a tensor of "
          f"its own, on world sizes {', '.join(map(str, ZERO2_SHAPES))} (units whose length p does not divide, "
          f"does, and shorter than p), sending (p − 1)/p of the padded gradient: half an all-reduce.")
    return True


def _zero_bytes(n_params: int, stage: int, world_size: int) -> int:
    """The package's own arithmetic: ``sharding.bytes_per_rank`` for Adam in mixed precision."""
    return sharding.bytes_per_rank(n_params, stage, world_size, "adam", "mixed")["total"]


def check_bytes_per_rank(student_fn) -> bool:
    """``student_fn(n_params, stage, world_size)``: the bytes one rank holds of parameters, gradients and
    optimizer state under ZeRO ``stage`` (0: plain data parallelism) for Adam in mixed precision, as the
    ZeRO paper counts them: 2 + 2 + 12 bytes per parameter; stage 1 shards the 12, stage 2 the gradients'
    2 too, stage 3 all 16; a sharded category holds ceil(n_params / world_size) numbers. Compared exactly
    with ``sharding.bytes_per_rank(..., "adam", "mixed")["total"]``, which is refused while it runs."""
    cases = [(7_500_000_000, stage, 64) for stage in range(4)]  # the paper's Figure 1
    cases += [(1_000_003, stage, 8) for stage in range(4)] + [(10, stage, 4) for stage in range(4)]
    cases += [(1000, 3, 1), (1000, 0, 1), (3, 3, 8), (3, 2, 8), (12, 1, 3), (7, 0, 5)]
    student = _refusing(student_fn, [(sharding, "bytes_per_rank")],
                        "is refused here: count the bytes yourself, 2 + 2 + 12 per parameter and what each stage "
                        "shards")
    return check(student, _zero_bytes, cases, name=_name(student_fn, "zero_bytes"), rtol=0, atol=0)


def zero_bytes_sent(n_params: int, stage: int, world_size: int) -> int:
    """Bytes one rank sends per training step under :class:`sharding.ShardedDataParallel` with the course's
    ring collectives: fp32, one unit of ``n_params`` numbers padded to a multiple of p, so every ring step
    sends a chunk of ceil(n_params / p) numbers. Stage 0 all-reduces the gradient (2 (p − 1) chunks);
    stages 1 and 2 reduce-scatter it and all-gather the updated parameters (p − 1 chunks each); stage 3
    all-gathers the parameters before forward and again before backward, and reduce-scatters the
    gradient: 3 (p − 1) chunks. (Stages 1 and 2 all-gather at the next forward, after the optimizer has
    changed the shard: a first step sends the reduce-scatter alone.) Stage 0 pads nothing: where p does
    not divide n_params its chunks are tensor_split's, and what a rank sends depends on its rank, so
    the exercise asks stage 0 only where p divides n_params. Checked against the bytes
    ``ShardedDataParallel`` sends (``collectives.sent``) in tests/test_exercises.py."""
    ring_halves = 3 if stage == 3 else 2  # an all-reduce is a reduce-scatter and an all-gather
    return 4 * ring_halves * (world_size - 1) * math.ceil(n_params / world_size)


def check_zero3_bytes_sent(student_fn) -> bool:
    """``student_fn(n_params, stage, world_size)``: the bytes one rank sends per training step under ZeRO
    ``stage`` with the course's ring collectives, fp32, one unit padded to a multiple of the world size
    (see :func:`zero_bytes_sent`; stage 0, which pads nothing, only where p divides n_params); compared exactly."""
    cases = [(7_500_000_000, stage, 64) for stage in range(4)]
    cases += [(24, 0, 2)] + [(23, stage, 2) for stage in (1, 2, 3)]  # stage 0 only where p divides n_params
    cases += [(12, 0, 4)] + [(10, stage, 4) for stage in (1, 2, 3)]
    cases += [(1_000_003, 3, 8), (1_000_003, 1, 8), (3, 3, 8), (8, 0, 8), (12, 2, 3), (1000, 3, 1), (1000, 0, 1)]
    return check(student_fn, zero_bytes_sent, cases, name=_name(student_fn, "bytes_sent"), rtol=0, atol=0)
