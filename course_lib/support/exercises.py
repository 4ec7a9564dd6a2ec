"""Every exercise of the course, checked against the course's reference, with a clear verdict.

One pattern in every notebook: write ``my_thing``, then run ``exercises.check_thing(my_thing)``.
Each ``check_*`` below holds the exercise's inputs and its reference answer (the course's own
function) and calls :func:`check`, which runs both on the same inputs (each on its own copy, since
many functions here work in place), compares the results, and prints either a pass or the first
case that differs: which input, expected, got. Functions that communicate go through
:func:`check_distributed`, which runs them in real gloo processes, and can hold them to what the
exercise allows (only send and recv, one collective, log2 p messages: see :class:`Rules`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import (
    accumulation,
    collectives,
    costmodel,
    data_parallel,
    hooks,
    local_sgd,
    lowrank,
    memory,
    powersgd,
    sharding,
)
from course_lib.launch import WorkerError, _check_picklable_by_reference, spawn
from course_lib.support.digits import batch_slice, digits_tensors, mlp

__all__ = [
    "check",
    "check_distributed",
    "compare",
    "Rules",
    "check_sum_of_squares",
    "check_elementwise_max",
    "check_ddp_token_step",
    "check_ring_shift",
    "check_recursive_doubling",
    "check_recursive_halving",
    "check_ddp_all_reduces",
    "check_exposed_time",
    "check_zero2_gradient",
    "check_bytes_per_rank",
    "check_zero3_bytes_sent",
    "check_stable_orthogonalize",
    "check_rank1_error",
    "check_smallest_rank",
    "check_pq_singular_values",
    "check_mean_and_own_buffer",
    "check_numbers_per_step",
    "check_powersgd_hook",
    "PowerSGDHookState",
    "check_memory_per_rank",
    "check_topk_average",
    "check_stochastic_rounding",
    "check_dgc_step",
    "check_outer_step",
    "check_break_even_period",
    "check_break_even_bandwidth",
    "check_ring_fit",
]


def compare(expected, got, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """``None`` when ``got`` matches ``expected`` (tensors, numbers, sequences, dicts); else why not."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
            diff = (got - expected).abs().max().item()
            return f"values differ (largest difference {diff:.3g})"
        return None
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)):
            return f"expected a number, got {type(got).__name__}"
        if math.isnan(expected) and math.isnan(got):
            return None  # both say "never"
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            shown = f"{expected:.6g}", f"{got:.6g}"
            if shown[0] == shown[1]:  # they differ beyond 6 digits: show every digit
                shown = repr(expected), repr(got)
            return f"expected {shown[0]}, got {shown[1]}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"expected a sequence of {len(expected)} items, got {_short(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = compare(e, g, rtol, atol)
            if why:
                return f"item {i}: {why}"
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"expected keys {sorted(expected)}, got {_short(got)}"
        for k in expected:
            why = compare(expected[k], got[k], rtol, atol)
            if why:
                return f"key {k!r}: {why}"
        return None
    if got != expected:
        return f"expected {_short(expected)}, got {_short(got)}"
    return None


def _short(x, limit: int = 80) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(args) -> str:
    return "(" + ", ".join(_short(a, 40) for a in args) + ")"


def check(student, reference, cases, *, name: str | None = None, rtol: float = 1e-5,
          atol: float = 1e-6) -> bool:
    """Run ``student(*args)`` and ``reference(*args)`` for each ``args`` in ``cases``; print a verdict.

    When both return ``None`` (functions that work in place), the arguments they modified are
    compared instead. Returns ``True`` when every case passes.
    """
    name = name or _name(student, "your_function")
    _name(student, name)
    cases = list(cases)
    for i, args in enumerate(cases):
        if not isinstance(args, tuple):
            args = (args,)
        mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
        expected = reference(*theirs)
        try:
            got = student(*mine)
        except NotImplementedError:
            print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
            return False
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"[FAIL] {name}, case {i} {_describe(args)}: raised {type(e).__name__}: {e} "
                  f"(line {where.lineno})")
            return False
        if expected is None and got is None:
            expected, got = theirs, mine
        why = compare(expected, got, rtol, atol)
        if why:
            print(f"[FAIL] {name}, case {i} {_describe(args)}: {why}")
            return False
    print(f"[PASS] {name}: all {len(cases)} cases match the reference.")
    return True


@dataclass(frozen=True)
class Rules:
    """What a distributed exercise allows besides the right answer, checked in the worker.

    ``point_to_point_only``: every collective is refused the moment it is called (barrier, which
    moves no data, excepted); ``collectives``: how many collectives each rank must call;
    ``sends``: world size -> how many messages each rank must send; ``sent_below_input``: each rank
    must send fewer numbers than its input holds (a reduce-scatter that never sends the whole
    tensor); ``sent_numbers``: a top-level function ``(input_numbers, rank, world_size) -> int``, how
    many numbers each rank must send in all; ``refused``: functions refused the moment they are
    called, by the name a student calls (``"dist.all_reduce"``, also caught when imported by name, as
    it ends in ``ProcessGroup.allreduce``; ``"collectives.ring_all_reduce"``, any function of
    ``course_lib.collectives``). ``why`` ends the message when a count is off or a function refused.
    """

    point_to_point_only: bool = False
    collectives: int | None = None
    sends: dict | None = None
    sent_below_input: bool = False
    sent_numbers: object = None
    refused: tuple = ()
    why: str = ""

    def broken(self, used: dict, world_size: int) -> str | None:
        """Why ``used`` (what one rank called) breaks these rules, or ``None``."""
        if self.collectives is not None and len(used["collectives"]) != self.collectives:
            called = ", ".join(used["collectives"]) or "none"
            return f"called {len(used['collectives'])} collectives ({called}); {self.why}"
        if self.sends is not None and used["sends"] != self.sends[world_size]:
            return f"sent {used['sends']} messages; {self.why}"
        if self.sent_below_input and used["numbers_sent"] >= used["input_numbers"]:
            return f"sent {used['numbers_sent']} numbers of a {used['input_numbers']}-number input; {self.why}"
        if self.sent_numbers is not None:
            want = self.sent_numbers(used["input_numbers"], used["rank"], world_size)
            if used["numbers_sent"] != want:
                return f"sent {used['numbers_sent']} numbers, not {want}; {self.why}"
        return None


class NotAllowed(RuntimeError):
    """A student's function called what its exercise does not allow."""


POINT_TO_POINT = "dist.send, dist.recv, dist.isend and dist.irecv (or dist.batch_isend_irecv)"
# torch.distributed's collectives by the names a student calls, and the ProcessGroup methods they end
# in: watching the methods too catches `from torch.distributed import all_reduce`, imported before
# the watch began. barrier moves no data and is not watched.
_COLLECTIVE_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "_all_gather_base", "gather",
    "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single",
)
# the ProcessGroup methods whose name is not the function's (for a refusal by the function's name)
_FUNCTION_OF_METHOD = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
                       "allgather": "all_gather", "allgather_coalesced": "all_gather_coalesced",
                       "_allgather_base": "_all_gather_base", "alltoall": "all_to_all"}
_GROUP_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single", "all_gather_single_coalesced",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single",
)
_MISSING = object()


class _Watch:
    """Around a student's call, in the worker: counts the collectives called and the messages sent,
    and refuses collectives at once under ``point_to_point_only``. Everything is put back on exit,
    so the reference (run before) and the process group's teardown (after) use torch as it is."""

    def __init__(self, rules: Rules, name: str):
        self.rules, self.name = rules, name
        self.collectives: list[str] = []
        self.sends = 0
        self.numbers_sent = 0
        self._depth = 0  # > 0 inside a watched function: what it calls in turn is not counted again
        self._saved: list = []

    def _refuse(self, what: str):
        raise NotAllowed(f"{self.name} may use only {POINT_TO_POINT}; it called {what}")

    def _refuse_named(self, what: str, called: str | None = None):
        if what in self.rules.refused:
            raise NotAllowed(f"{self.name} may not call {called or what}: {self.rules.why}")

    def _refusing(self, what: str):
        def refused(*args, **kwargs):
            self._refuse_named(what)
        return refused

    def _replace(self, owner, attr: str, new) -> None:
        self._saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, new)

    def _function(self, name: str, original):
        def watched(*args, **kwargs):
            if self.rules.point_to_point_only:
                self._refuse(f"dist.{name}")
            self._refuse_named(f"dist.{name}")
            if self._depth == 0:
                self.collectives.append(name)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return watched

    def _method(self, name: str, original):
        def watched(group, *args, **kwargs):
            if self._depth == 0:  # called directly, or through a name imported before the watch
                if name == "send":  # dist.send and dist.isend both end here
                    self.sends += 1
                    tensors = args[0] if args else kwargs.get("tensors", [])
                    self.numbers_sent += sum(t.numel() for t in ([tensors] if torch.is_tensor(tensors) else tensors))
                else:
                    if self.rules.point_to_point_only:
                        self._refuse(f"a collective (ProcessGroup.{name})")
                    function = f"dist.{_FUNCTION_OF_METHOD.get(name, name)}"
                    self._refuse_named(function, f"{function} (ProcessGroup.{name})")
                    self.collectives.append(name)
            return original(group, *args, **kwargs)
        return watched

    def __enter__(self):
        for name in _COLLECTIVE_FUNCTIONS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            watched = self._function(name, original)
            self._replace(c10d, name, watched)  # what torch's own functions call by name
            if getattr(dist, name, None) is original:
                self._replace(dist, name, watched)  # what a student calls as dist.all_reduce
        for name in _GROUP_COLLECTIVES + ("send",):
            if hasattr(dist.ProcessGroup, name):
                self._replace(dist.ProcessGroup, name, self._method(name, getattr(dist.ProcessGroup, name)))
        for what in self.rules.refused:
            module, _, attr = what.partition(".")
            if module == "collectives":
                self._replace(collectives, attr, self._refusing(what))
            elif module != "dist":
                raise ValueError(f"Rules.refused names dist.* and collectives.* functions, got {what!r}")
        return self

    def __exit__(self, *exc):
        for owner, attr, saved in reversed(self._saved):
            if saved is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, saved)
        self._saved.clear()
        return False

    def used(self) -> dict:
        return {"collectives": list(self.collectives), "sends": self.sends, "numbers_sent": self.numbers_sent}


def _input_numbers(args) -> int:
    """How many numbers the tensor arguments hold: each tensor argument, and each tensor in a list or
    tuple argument (a unit's gradients); other arguments count nothing."""
    total = 0
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            total += t.numel() if torch.is_tensor(t) else 0
    return total


def _run_both(rank, world_size, student, reference, make_inputs, rules=None, name="your function"):
    args = make_inputs(rank, world_size)
    expected = reference(*copy.deepcopy(args))
    with _Watch(rules or Rules(), name) as watch:
        got = student(*copy.deepcopy(args))
    used = watch.used() | {"input_numbers": _input_numbers(args), "rank": rank}
    return args, expected, got, used


def check_distributed(student, reference, make_inputs, world_sizes=(2, 3), *, name: str | None = None,
                      timeout_s: float = 20.0, rtol: float = 1e-5, atol: float = 1e-6,
                      rules: Rules | None = None) -> bool:
    """Like :func:`check`, for functions that communicate: both run in real gloo processes.

    ``student`` and ``reference`` are top-level functions of importable modules (a student's lives
    in a ``.py`` file written from the notebook); ``make_inputs(rank, world_size)`` returns each
    rank's arguments. The reference runs first, then the student's function, on copies; ``rules``
    (see :class:`Rules`) says what the student's may call.
    """
    name = name or _name(student, "your_function")
    _name(student, name, in_processes=True)
    for world_size in world_sizes:
        try:
            results = spawn(_run_both, world_size, student, reference, make_inputs, rules, name,
                            backend="gloo", timeout_s=timeout_s)
        except WorkerError as e:
            if e.exc_type == "NotImplementedError":
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, "
                      f"save the file, then run this again.")
            elif e.exc_type == "NotAllowed":
                print(f"[FAIL] {name}, world size {world_size}, rank {e.rank}: {e.message}")
            else:
                print(f"[FAIL] {name}, world size {world_size}: rank {e.rank} raised {e.exc_type}: {e.message}")
            return False
        except TimeoutError:
            print(f"[FAIL] {name}, world size {world_size}: no answer after {timeout_s:g} s. A deadlock? "
                  f"Check that every send is matched by a receive that the peer can reach.")
            return False
        for rank, (args, expected, got, used) in enumerate(results):
            why = compare(expected, got, rtol, atol) or (rules.broken(used, world_size) if rules else None)
            if why:
                print(f"[FAIL] {name}, world size {world_size}, rank {rank}, input {_describe(args)}: {why}")
                return False
    print(f"[PASS] {name}: matches the reference on world sizes {', '.join(map(str, world_sizes))}.")
    return True


def _name(student_fn, default: str, in_processes: bool = False) -> str:
    """The student's function's name, once it is known to be a function (and, for a check that runs
    it in new processes, one they can import by name)."""
    if not callable(student_fn):
        raise TypeError(f"pass your function itself ({default}, not {default}(...), which is what it returns); "
                        f"got {_short(student_fn)}")
    if in_processes:
        _check_picklable_by_reference(student_fn, who="this check, which runs your function in new processes,")
    return getattr(student_fn, "__name__", default)


# --- notebook 00: setup ---------------------------------------------------------------------------

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


# --- notebook 01: gradient accumulation ------------------------------------------------------------

_TOKEN_EXERCISE = dict(sequences_per_micro_batch=2, k=3)


def _token_step_worker(rank: int, world_size: int, student_fn) -> dict:
    """The student's DDP step on this rank's share of unequal-length sequences, and what it did.

    The reference, another way: one model (no DDP) and autograd on the mean loss over every token of
    every rank's sequences at once. The profiler records each all-reduce the step runs (its number
    of elements), and a forward pre-hook the number of tokens each forward pass saw.
    """
    c = _TOKEN_EXERCISE
    per_rank = c["sequences_per_micro_batch"] * c["k"]
    sequences = accumulation.token_sequences(per_rank * world_size, seed=world_size)
    ref = accumulation.bigram_lm()
    accumulation.token_losses(ref, sequences).mean().backward()
    share = sequences[rank * per_rank:(rank + 1) * per_rank]
    micro = [share[i::c["k"]] for i in range(c["k"])]
    model = DDP(accumulation.bigram_lm())
    forwards: list[int] = []
    model.module.register_forward_pre_hook(lambda _module, args: forwards.append(args[0].numel()))
    with accumulation._quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        student_fn(model, micro)
    all_reduces = [sum(torch.Size(s).numel() for s in e.input_shapes) for e in prof.events()
                   if e.name.endswith(":all_reduce") and not e.name.startswith("c10d")]
    return {
        "want": [p.grad.clone() for p in ref.parameters()],
        "got": [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.module.parameters()],
        "tokens": [sum(len(s) - 1 for s in m) for m in micro],
        "forwards": forwards,
        "all_reduces": all_reduces,
        "gradient_numbers": sum(p.numel() for p in ref.parameters()),
    }


def _run_student(worker, world_size: int, student_fn, name: str, timeout_s: float = 60) -> list | None:
    """``spawn(worker, world_size, student_fn)`` on gloo; the results, or ``None`` after printing why not
    (not written yet, a rank that raised, or no answer: a deadlock)."""
    try:
        return spawn(worker, world_size, student_fn, backend="gloo", timeout_s=timeout_s)
    except WorkerError as e:
        if e.exc_type == "NotImplementedError":
            print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, save the file, "
                  f"then run this again.")
        elif e.exc_type == "NotAllowed":
            print(f"[FAIL] {name}, world size {world_size}, rank {e.rank}: {e.message}")
        else:
            print(f"[FAIL] {name}, world size {world_size}: rank {e.rank} raised {e.exc_type}: {e.message}")
    except TimeoutError:
        print(f"[FAIL] {name}, world size {world_size}: no answer after {timeout_s:g} s. A deadlock? Every rank "
              f"must call the same collectives in the same order.")
    return None


def check_ddp_token_step(student_fn) -> bool:
    """``student_fn(model, micro_batches)`` in a ``.py`` file: one accumulation step under DDP on
    sequences of unequal lengths. ``model`` is a DDP-wrapped ``accumulation.bigram_lm()``,
    ``micro_batches`` this rank's k lists of token sequences. After it, every rank's ``.grad`` must
    hold the gradient of the mean loss over *all* tokens of all ranks (checked on 2 and 3 gloo ranks
    against autograd on the whole batch in one process), with one forward and backward per
    micro-batch and the gradient all-reduced once (``no_sync`` around the first k - 1)."""
    name = _name(student_fn, "ddp_token_step", in_processes=True)
    k = _TOKEN_EXERCISE["k"]
    for world_size in (2, 3):
        results = _run_student(_token_step_worker, world_size, student_fn, name)
        if results is None:
            return False
        for rank, r in enumerate(results):
            where = f"[FAIL] {name}, world size {world_size}, rank {rank} (tokens per micro-batch {r['tokens']})"
            if r["forwards"] != r["tokens"]:
                print(f"{where}: the forward passes saw {r['forwards']} tokens; the exercise asks for one "
                      f"forward and backward per micro-batch.")
                return False
            why = compare(r["want"], r["got"], rtol=1e-9, atol=1e-12)
            if why:
                print(f"{where}: .grad is not the gradient of the mean loss over every rank's tokens: {why}")
                return False
            syncs = sum(n == r["gradient_numbers"] for n in r["all_reduces"])
            if syncs != 1:
                print(f"{where}: DDP all-reduced the gradient {syncs} times in the step; with no_sync around "
                      f"the first k − 1 = {k - 1} micro-batches it does so once, after the last.")
                return False
    print(f"[PASS] {name}: the whole batch's gradient on every rank, world sizes 2 and 3, "
          f"one gradient all-reduce per step.")
    return True


# --- notebook 02: collectives ----------------------------------------------------------------------

def exercise_inputs(rank: int, world_size: int):
    """Each rank's input for the exercises: a length that does not divide evenly among ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(2 * world_size + 1, generator=g),)


# Notebook 02's exercises build collectives from messages: each is run with every collective refused.
POINT_TO_POINT_ONLY = Rules(point_to_point_only=True)


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
                  sent_numbers=all_but_own_chunk,
                  why="recursive halving sends one message per round, log2 p in all (1 on 2 ranks, 2 on 4), "
                      "each the half of the remaining chunks that the partner keeps: every chunk but your own "
                      "in all, each once")
    return check_distributed(student_fn, collectives.reduce_scatter, halving_inputs, world_sizes=(2, 4),
                             name=_name(student_fn, "recursive_halving_reduce_scatter"), rules=rules)


# --- notebook 03: data parallelism ----------------------------------------------------------------

def ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    """The payload in bytes of every all-reduce torch's DDP issues, in order, for ``steps`` optimizer
    steps of ``k`` micro-batches each (``no_sync`` around the first k - 1 of each step or not), when
    backward produces gradients of ``sizes_bytes`` in that order. The first backward that
    synchronizes sends one bucket of every gradient; DDP then rebuilds its buckets in the order the
    gradients arrived, the first closed at 1 MiB when ``bucket_cap_mb`` is None (not given, 25 MiB
    for the others), else every one at ``bucket_cap_mb``. Checked against DDP itself in
    tests/test_data_parallel.py."""
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap
    first = data_parallel.assign_buckets(sizes_bytes, first_cap)[0]
    rest = data_parallel.assign_buckets(sizes_bytes[len(first):], cap) if len(first) < len(sizes_bytes) else []
    rebuilt = [sum(sizes_bytes[i] for i in first)] + [sum(sizes_bytes[len(first) + i] for i in b) for b in rest]
    sent = []
    for _ in range(steps):
        for micro in range(k):
            if no_sync and micro < k - 1:
                continue  # inside no_sync: backward only accumulates
            sent += rebuilt if sent else [sum(sizes_bytes)]
    return sent


def check_ddp_all_reduces(student_fn) -> bool:
    """``student_fn(sizes_bytes, bucket_cap_mb, steps, k, no_sync)``: the payload of every all-reduce
    DDP issues, in bytes, in order (see :func:`ddp_all_reduces`)."""
    mlp_sizes = [40, 20480, 2048, 1048576, 2048, 1048576, 2048, 1048576, 2048, 131072]  # hidden 512, depth 4
    cases = [(mlp_sizes, None, 2, 1, False), (mlp_sizes, 1, 3, 4, True), (mlp_sizes, 1, 2, 3, False),
             (mlp_sizes, 25, 2, 2, False), ([2**20] * 3 + [10], 0.5, 2, 2, True),
             ([300_000, 600_000, 900_000], None, 1, 1, False), ([4, 4, 4], 1e-5, 2, 1, False)]
    return check(student_fn, ddp_all_reduces, cases, name=_name(student_fn, "ddp_all_reduces"))


def exposed_time(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    """Seconds of communication left after backward, by the α-β model, for the bucketed wrapper: the
    buckets of ``data_parallel.assign_buckets`` (gradients of ``sizes_bytes`` ready at ``ready_s``,
    both in backward's order), each all-reduced once its last gradient is ready and the bucket
    before it is done, one at a time; the end of the last minus the last gradient's time."""
    end = 0.0
    for bucket in data_parallel.assign_buckets(sizes_bytes, cap_bytes):
        start = max(end, max(ready_s[i] for i in bucket))
        end = start + costmodel.ring_all_reduce_time(sum(sizes_bytes[i] for i in bucket), world_size, alpha_s,
                                                     busbw_GBps)
    return max(0.0, end - max(ready_s))


def check_exposed_time(student_fn) -> bool:
    """``student_fn(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps)``: the seconds of
    all-reduce left after the last gradient is ready (see :func:`exposed_time`)."""
    mlp_sizes = [40, 20480, 2048, 1048576, 2048, 1048576, 2048, 1048576, 2048, 131072]  # hidden 512, depth 4
    even = [2e-4 * (i + 1) for i in range(len(mlp_sizes))]  # a 2 ms backward
    cases = [(even, mlp_sizes, 2**20, 8, 5e-6, 100.0), (even, mlp_sizes, 1024, 8, 5e-6, 100.0),
             (even, mlp_sizes, 25 * 2**20, 2, 50e-6, 1.0), (even, mlp_sizes, 2**20, 2, 100e-6, 0.5),
             ([0.001, 0.002, 0.010], [4e6, 4e6, 4e6], 4e6, 4, 1e-5, 10.0)]
    return check(student_fn, exposed_time, cases, name=_name(student_fn, "exposed_time"), rtol=1e-9, atol=1e-15)


# --- notebook 04: sharded data parallelism (ZeRO, FSDP) -------------------------------------------

# Each world size's units: the shapes of one unit's gradients (a weight and a bias), whose length p
# does not divide, does, and is shorter than p (some ranks' slices padding alone).
ZERO2_SHAPES = {2: ([(3, 4), (5,)], [(2, 2), (4,)], [(1,)]),
                3: ([(3, 4), (2,)], [(3, 3), (3,)], [(2,)])}


def zero2_inputs(rank: int, world_size: int, shapes):
    """Each rank's input for notebook 04's ZeRO-2 exercise: its own gradients of one unit, of ``shapes``."""
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


# --- notebook 05: power iteration ------------------------------------------------------------------

def _nearly_dependent(n: int, r: int, condition: float, seed: int) -> torch.Tensor:
    """An (n, r) float64 matrix whose singular values fall from 1 to 1/condition: nearly dependent
    columns, as the products of power iteration become without orthogonalization (notebook 05)."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64)).Q
    s = torch.logspace(0, -math.log10(condition), r, dtype=torch.float64)
    return U @ torch.diag(s) @ V.T


# torch's, numpy's and scipy's factorizations, each of which hands over an orthonormal basis (or, for
# Cholesky, the triangle that gives one): what the exercise asks to write
_FACTORIZATIONS = [(torch.linalg, "qr"), (torch.linalg, "svd"), (torch.linalg, "eigh"), (torch.linalg, "eig"),
                   (torch.linalg, "householder_product"), (torch.linalg, "pinv"), (torch, "qr"), (torch, "svd"),
                   (torch, "geqrf"), (torch, "orgqr"), (torch, "svd_lowrank"), (torch, "pca_lowrank"),
                   (torch.Tensor, "qr"), (torch.Tensor, "svd"), (torch.Tensor, "geqrf"), (torch.Tensor, "orgqr"),
                   (np.linalg, "qr"), (np.linalg, "svd"), (np.linalg, "eig"), (np.linalg, "eigh"),
                   (np.linalg, "cholesky")]
try:
    import scipy.linalg as _scipy_linalg
except ImportError:  # scipy is optional: nothing of it to refuse then
    _scipy_linalg = None
else:
    _FACTORIZATIONS += [(_scipy_linalg, name) for name in ("qr", "svd", "eig", "eigh", "cholesky", "orth", "polar",
                                                           "qr_multiply", "rq", "null_space")]
_WHERE = {torch.linalg: "torch.linalg", torch: "torch", torch.Tensor: "Tensor", np.linalg: "numpy.linalg",
          _scipy_linalg: "scipy.linalg"}


def _refusing(student_fn, refused, why, allowed=lambda *args, **kwargs: False):
    """``student_fn`` with each ``(owner, attr)`` of ``refused`` replaced while it runs by a function
    that raises NotAllowed (``why`` ends the message) unless ``allowed(*args, **kwargs)``; every
    original is put back afterwards, even after a refusal."""
    def run(*args):
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr in refused]

        def refuse(name, original):
            def refused_fn(*a, **kw):
                if allowed(*a, **kw):
                    return original(*a, **kw)
                raise NotAllowed(f"{name} {why}")
            return refused_fn

        for owner, attr, original in saved:
            setattr(owner, attr, refuse(f"{_WHERE.get(owner, getattr(owner, '__name__', owner))}.{attr}", original))
        try:
            return student_fn(*args)
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)
    return run


def _without_factorizations(student_fn):
    return _refusing(student_fn, _FACTORIZATIONS,
                     "does the work this exercise asks for: write it with products, norms and sums")


def _basis_view(X: torch.Tensor, P) -> dict:
    """What every right answer shares, whatever its signs or its choice of basis: the shape and dtype,
    orthonormal columns to 1e-12, and the columns of X inside their span to 1e-12 of ‖X‖."""
    if not isinstance(P, torch.Tensor):
        raise TypeError(f"return P, a tensor; got {_short(P)}")
    view = {"shape and dtype": f"{tuple(P.shape)} {P.dtype}", "‖PᵀP − I‖ ≤ 1e-12": False,
            "‖X − P PᵀX‖ ≤ 1e-12 ‖X‖": False}
    if P.shape == X.shape and P.dtype == X.dtype and bool(torch.isfinite(P).all()):
        eye = torch.eye(P.shape[1], dtype=P.dtype)
        view["‖PᵀP − I‖ ≤ 1e-12"] = torch.linalg.matrix_norm(P.T @ P - eye).item() <= 1e-12
        view["‖X − P PᵀX‖ ≤ 1e-12 ‖X‖"] = (torch.linalg.matrix_norm(X - P @ (P.T @ X))
                                            <= 1e-12 * torch.linalg.matrix_norm(X)).item()
    return view


def check_stable_orthogonalize(student_fn) -> bool:
    """``student_fn(X)`` returns P (n x r, X's dtype): orthonormal columns spanning those of X, to
    1e-12 in float64, even when X's columns are nearly dependent (condition numbers 1e8 and 1e10,
    where one pass of Gram-Schmidt leaves PᵀP 1e-9 to 1e-6 from the identity). torch's factorizations
    (qr, svd, eigh, ...) are refused while it runs."""
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(20, 3, generator=g, dtype=torch.float64),),
             (torch.randn(50, 6, generator=g, dtype=torch.float64),),
             (_nearly_dependent(60, 6, 1e10, seed=1),),
             (_nearly_dependent(8, 8, 1e8, seed=2),)]
    return check(lambda X: _basis_view(X, _without_factorizations(student_fn)(X.clone())),  # X itself kept
                 lambda X: _basis_view(X, torch.linalg.qr(X).Q), cases,
                 name=_name(student_fn, "stable_orthogonalize"))


def _rank1_error_measured(s: torch.Tensor, c: torch.Tensor, k: int) -> float:
    """The reference, another way than a formula: build M = U diag(s) Vᵀ with random orthonormal U
    and V, start from q = V c, run k steps of ``lowrank.power_iteration`` and measure the error."""
    g = torch.Generator().manual_seed(7)
    n = len(s)
    U = torch.linalg.qr(torch.randn(n + 3, n, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    M = U @ torch.diag(s.double()) @ V.T
    P, Q = lowrank.power_iteration(M, 1, k, q=(V @ c.double()).unsqueeze(1))
    return lowrank.relative_error(M, P, Q)


def check_rank1_error(student_fn) -> bool:
    """``student_fn(s, c, k)``: the relative error ‖M − P Qᵀ‖ / ‖M‖ of k rank-1 power steps, from M's
    singular values ``s`` (descending), the start's coordinates ``c`` on M's right singular vectors
    (q = Σ cᵢ vᵢ) and k, compared with k steps run on a matrix with those singular values."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    decay = 0.8 ** torch.arange(12, dtype=torch.float64)
    c = torch.randn(12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    cases = [(t(3.0, 2.0, 1.0, 0.5), t(1.0, 1.0, 1.0, 1.0), 1),
             (t(3.0, 2.0, 1.0, 0.5), t(1.0, 1.0, 1.0, 1.0), 2),
             (t(3.0, 2.0, 1.0, 0.5), t(0.1, 1.0, 1.0, 1.0), 3),
             (decay, c, 1), (decay, c, 4), (decay, c, 12),
             (t(2.0, 1.5, 1.0), t(0.0, 1.0, 1.0), 5)]  # a start with nothing along v₁ never finds it
    return check(student_fn, _rank1_error_measured, cases, name=_name(student_fn, "rank1_error"),
                 rtol=1e-6, atol=1e-9)


def _smallest_rank(M: torch.Tensor, max_error: float) -> int:
    return next(r for r in range(1, min(M.shape) + 1) if lowrank.svd_error(M, r) <= max_error)


def check_smallest_rank(student_fn) -> bool:
    """``student_fn(M, max_error)``: the smallest rank r whose *best* rank-r approximation has relative
    error at most ``max_error``, from M's singular values. ``lowrank.svd_error`` (the notebook calls
    it rank by rank) and ``lowrank.relative_error`` are refused while it runs."""
    g = torch.Generator().manual_seed(3)
    u, v = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))[0], \
        torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([2.0 ** -i for i in range(30)], dtype=torch.float64)
    decaying = u[:, :30] @ torch.diag(s) @ v.T
    flat = torch.randn(40, 30, generator=g, dtype=torch.float64)
    # singular values 2^-i: the best rank-r error is 2^-r, almost exactly, so no bound sits on one of them
    cases = [(decaying, 0.45), (decaying, 0.1), (decaying, 1.5e-3), (flat, 0.5), (flat, 0.9)]
    student = _refusing(student_fn, [(lowrank, "svd_error"), (lowrank, "relative_error")],
                        "is refused here: compute the error from the singular values (Eckart-Young)")
    return check(student, _smallest_rank, cases, name=_name(student_fn, "smallest_rank"))


def _larger_than_rank(r: int):
    """Whether a factorization's arguments include a matrix with both sides larger than ``r``."""
    def large(*args, **kwargs):
        return any(hasattr(a, "shape") and len(a.shape) >= 2 and min(a.shape[-2:]) > r
                   for a in (*args, *kwargs.values()))
    return large


# every routine that hands over singular values or eigenvalues
_SPECTRA = [(torch.linalg, n) for n in ("svd", "svdvals", "eig", "eigvals", "eigh", "eigvalsh", "matrix_norm", "norm",
                                        "cond", "matrix_rank", "pinv")] + \
    [(torch, n) for n in ("svd", "svd_lowrank", "pca_lowrank", "lobpcg")] + [(torch.Tensor, "svd")] + \
    [(np.linalg, n) for n in ("svd", "eig", "eigvals", "eigh", "eigvalsh", "norm", "cond", "matrix_rank", "pinv")] + \
    ([(_scipy_linalg, n) for n in ("svd", "svdvals", "eig", "eigvals", "eigh", "eigvalsh", "norm")]
     if _scipy_linalg is not None else [])


def _pq_singular_values(P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """The reference, the long way: the singular values of the n x m product itself, its top r."""
    return torch.linalg.svdvals(P @ Q.mT)[: P.shape[1]]


def check_pq_singular_values(student_fn) -> bool:
    """``student_fn(P, Q)``: the r singular values of ``P Qᵀ`` (descending, a float64 tensor), for P
    with orthonormal columns as power iteration returns it, without factorizing any matrix whose
    two sides both exceed r (no SVD of the n x m product): those calls are refused while it runs.
    Cases after 1 and 2 iterations, where Q's columns are not yet orthogonal."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, m, r, k in ((30, 20, 1, 1), (30, 20, 2, 1), (40, 25, 3, 2), (25, 40, 4, 1), (50, 50, 3, 1)):
        U = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
        V = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64)).Q
        s = 0.7 ** torch.arange(min(n, m), dtype=torch.float64)
        M = U[:, : len(s)] @ torch.diag(s) @ V[:, : len(s)].T
        cases.append(tuple(lowrank.power_iteration(M, r, k, generator=g)))
    large = {r: _larger_than_rank(r) for r in range(1, 5)}

    def student(P, Q):
        return _refusing(student_fn, _SPECTRA, f"is refused on a matrix larger than r x r here: P Qᵀ is "
                         f"{P.shape[0]} x {Q.shape[0]}, and the point is not to factorize it",
                         allowed=lambda *a, **kw: not large[P.shape[1]](*a, **kw))(P, Q)
    return check(student, _pq_singular_values, cases, name=_name(student_fn, "pq_singular_values"),
                 rtol=1e-9, atol=1e-12)


# --- notebook 06: PowerSGD -------------------------------------------------------------------------

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
    return check(student_fn, _mean_and_own_buffer, cases, name=_name(student_fn, "mean_and_own_buffer"))


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
    return check(student_fn, _numbers_per_step, cases, name=_name(student_fn, "numbers_per_step"))


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


# --- notebook 07: PowerSGD in practice -----------------------------------------------------------

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


def _student_after_start(run: _HookRun, bucket):
    if run.step < run.start:
        return hooks.allreduce_fut(None, bucket.buffer())
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


# --- notebook 08: compression ---------------------------------------------------------------------

def topk_inputs(rank: int, world_size: int):
    """Each rank's input for notebook 08's top-k exercise: its own gradient (40 entries, alike enough
    across ranks that some of their largest entries share indices and others do not) and k = 6."""
    shared = torch.randn(40, generator=torch.Generator().manual_seed(299))
    return (shared + 0.5 * torch.randn(40, generator=torch.Generator().manual_seed(300 + rank)), 6)


def topk_average_expected(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """The mean over ranks of each rank's top-k, another way than ``compressors.TopK``: every rank's
    whole tensor all-gathered, each kept at its k largest magnitudes found by a full sort."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    out = torch.zeros_like(tensor)
    for t in everyone:
        keep = t.abs().argsort(descending=True)[:k]
        out[keep] += t[keep]
    return out / len(everyone)


def check_topk_average(student_fn) -> bool:
    """``student_fn(tensor, k)`` in a ``.py`` file: on every rank, the mean over the ranks of each
    rank's top-k of its ``tensor`` (its k entries of largest magnitude, zeros elsewhere), exchanged as
    values and indices; checked on 2 and 3 gloo ranks against ``topk_average_expected``."""
    return check_distributed(student_fn, topk_average_expected, topk_inputs, name=_name(student_fn, "topk_average"))


def _stochastic_round(x: torch.Tensor, levels: int, u: torch.Tensor) -> torch.Tensor:
    """QSGD's rounding with one norm for all of ``x`` (``compressors.QSGD``'s rule, bucket_size=None)."""
    norm = x.norm()
    if norm == 0:
        return torch.zeros_like(x)
    a = x.abs() / norm * levels
    low = a.floor()
    return torch.sign(x) * norm * (low + (u < a - low).to(x.dtype)) / levels


def check_stochastic_rounding(student_fn, draws: int = 2000) -> bool:
    """``student_fn(x, levels, u)``: each entry of flat ``x`` rounded to one of the levels
    ``norm * sign(x) * l / levels`` (l = 0 ... levels, norm = ||x||) next to it, down or up as decided by
    the uniform draw ``u`` (one per entry, in [0, 1)), so that the result is unbiased.

    Checked two ways, not against one formula (``u < fraction`` and ``u >= 1 - fraction`` are both
    right): in every one of ``draws`` draws each entry is one of its two neighbouring levels, with x's
    sign; and the mean over the draws is x, within 5 standard errors of the rounding's own spread."""
    name = _name(student_fn, "stochastic_round")
    gen = torch.Generator().manual_seed(8)
    cases = [(torch.randn(12, generator=gen), 15), (1e-3 * torch.randn(7, generator=gen), 3),
             (torch.tensor([0.0, 3.0, -4.0, 0.5]), 1), (torch.zeros(5), 15)]
    for i, (x, levels) in enumerate(cases):
        norm = x.norm()
        a = x.abs() / norm * levels if norm > 0 else torch.zeros_like(x)
        step = (norm / levels).item()
        low, high = torch.sign(x) * a.floor() * step, torch.sign(x) * a.ceil() * step
        fraction = (a - a.floor()).double()
        total = torch.zeros_like(x, dtype=torch.float64)
        for _ in range(draws):
            u = torch.rand(x.shape, generator=gen)
            try:
                got = student_fn(x.clone(), levels, u.clone())
            except NotImplementedError:
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
                return False
            except Exception as e:
                print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: raised {type(e).__name__}: {e}")
                return False
            if not isinstance(got, torch.Tensor) or got.shape != x.shape:
                print(f"[FAIL] {name}, case {i}: expected a tensor of shape {tuple(x.shape)}, got {_short(got)}")
                return False
            on_level = torch.isclose(got, low, rtol=1e-5, atol=1e-9) | torch.isclose(got, high, rtol=1e-5, atol=1e-9)
            if not bool(on_level.all()):
                j = int((~on_level).nonzero()[0])
                print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: entry {j} is {got[j].item():.6g}, not one "
                      f"of its two neighbouring levels {low[j].item():.6g} and {high[j].item():.6g}")
                return False
            total += got.double()
        mean = total / draws
        tolerance = 5 * step * (fraction * (1 - fraction)).sqrt() / math.sqrt(draws) + 1e-6 * step
        biased = (mean - x.double()).abs() > tolerance
        if bool(biased.any()):
            j = int(biased.nonzero()[0])
            print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: biased: entry {j} is {x[j].item():.6g}, but its "
                  f"mean over {draws} draws of u is {mean[j].item():.6g} (the levels each side are "
                  f"{low[j].item():.6g} and {high[j].item():.6g}: round up with the right probability)")
            return False
    print(f"[PASS] {name}: every entry on a neighbouring level, and unbiased over {draws} draws, "
          f"in all {len(cases)} cases.")
    return True


def _dgc_step(g, u, v, momentum, k):
    """The package's own DGC memory (``memory.DGCMemory``: momentum correction, masking) around a top-k."""
    dgc = memory.DGCMemory(momentum, masking=True)
    dgc.velocity["g"], dgc.memory["g"] = u.clone(), v.clone()  # the state the case starts from
    corrected = dgc.compensate("g", g)
    chosen = torch.topk(corrected.abs(), k).indices
    sent = torch.zeros_like(corrected)
    sent[chosen] = corrected[chosen]
    dgc.update("g", corrected, sent)
    return sent, dgc.velocity["g"], dgc.memory["g"]


def check_dgc_step(student_fn) -> bool:
    """``student_fn(g, u, v, momentum, k)``: one DGC step on one rank with momentum correction and
    momentum-factor masking: ``(sent, u, v)`` after it (the new velocity and accumulation)."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n, k, m in ((8, 2, 0.9), (100, 5, 0.9), (50, 1, 0.0), (20, 20, 0.5)):
        cases.append((torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                      torch.randn(n, generator=gen), m, k))
    return check(student_fn, _dgc_step, cases, name=_name(student_fn, "dgc_step"))


# --- notebook 09: local SGD, post-local SGD and DiLoCo ---------------------------------------------

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


# --- notebook 10: multi-GPU ------------------------------------------------------------------------

def _as_compressed(hook: dict) -> dict:
    """A ``{compute_s, bytes, collectives}`` entry as :func:`costmodel.predict_compressed_step_time` takes
    it: its all-reduces, the bytes shared among them (the time of a ring is linear in the bytes)."""
    n = hook["collectives"]
    return {"compute_s": hook["compute_s"], "codec_s": 0.0, "collectives": [("all_reduce", hook["bytes"] / n)] * n}


def _break_even_busbw(hook: dict, reference: dict, world_size: int, alpha_s: float) -> float:
    """The package's own answer: ``costmodel.break_even_bandwidth`` (a bisection, not the formula)."""
    return costmodel.break_even_bandwidth(_as_compressed(hook), _as_compressed(reference), world_size, alpha_s)


def check_break_even_bandwidth(student_fn) -> bool:
    """``student_fn(hook, reference, world_size, alpha_s)``: the bus bandwidth (GB/s) below which the hook's
    predicted step is faster than the reference's: ``math.inf`` if faster at every bandwidth, ``0.0`` if at
    none (as ``costmodel.break_even_bandwidth``), each a dict of compute_s, bytes, collectives."""
    allreduce = {"compute_s": 0.010, "bytes": 6_400_000, "collectives": 1}
    psgd = {"compute_s": 0.016, "bytes": 80_000, "collectives": 2}
    fp16 = {"compute_s": 0.011, "bytes": 3_200_000, "collectives": 1}
    cases = [(psgd, allreduce, 2, 10e-6), (psgd, allreduce, 8, 10e-6), (fp16, allreduce, 4, 20e-6),
             (allreduce, allreduce | {"compute_s": 0.02}, 2, 10e-6),  # less compute, the same bytes: always faster
             (fp16 | {"compute_s": 0.009}, allreduce, 4, 20e-6),  # fewer bytes and less compute: always faster
             (allreduce | {"compute_s": 0.02}, allreduce, 2, 10e-6),  # more compute, the same bytes: never
             (allreduce | {"compute_s": 0.02, "bytes": 7_000_000}, allreduce, 2, 10e-6),  # more of both: never
             (allreduce, allreduce, 4, 10e-6)]  # the same step: never faster
    return check(student_fn, _break_even_busbw, cases, name=_name(student_fn, "break_even_bandwidth"),
                 rtol=1e-4, atol=0)


# The ring fits' cases: timings made from known (alpha s, busbw GB/s) on p ranks, one p per case; the
# reference is those known numbers, not a fit.
_RING_FIT_TRUTH = {2: (20e-6, 1.3), 3: (50e-6, 12.5), 4: (5e-6, 24.0), 8: (3e-6, 370.0)}


def _ring_fit_case(world_size: int) -> tuple:
    alpha, busbw = _RING_FIT_TRUTH[world_size]
    sizes = [4096 * 4**k for k in range(9)]  # 4 KB to 256 MB, as the notebook's sweep
    times = [costmodel.ring_all_reduce_time(n, world_size, alpha, busbw) for n in sizes]
    return sizes, times, world_size


def _ring_fit_truth(sizes_bytes, times_s, world_size) -> tuple[float, float]:
    return _RING_FIT_TRUTH[world_size]


def check_ring_fit(student_fn) -> bool:
    """``student_fn(sizes_bytes, times_s, world_size)``: ``(alpha_s, busbw_GBps)`` of the ring all-reduce
    whose measured times these are, from a straight line fitted through them. The timings are made
    from known numbers on 2, 3, 4 and 8 ranks; the answer must give those numbers back."""
    cases = [_ring_fit_case(p) for p in (2, 3, 4, 8)]
    return check(student_fn, _ring_fit_truth, cases, name=_name(student_fn, "ring_fit"), rtol=1e-6, atol=0)
