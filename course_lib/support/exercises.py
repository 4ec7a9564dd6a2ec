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
import math
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from course_lib import accumulation, collectives, costmodel, data_parallel, lowrank, powersgd
from course_lib.launch import WorkerError, spawn
from course_lib.support.digits import digits_tensors, mlp

__all__ = [
    "check",
    "check_distributed",
    "compare",
    "Rules",
    "check_sum_of_squares",
    "check_elementwise_max",
    "check_accumulate",
    "check_micro_batch_loss",
    "check_combine_gradients",
    "check_count_all_reduces",
    "check_reduce_scatter",
    "check_ring_shift",
    "check_halving_doubling",
    "check_ddp_buckets",
    "check_sync_time",
    "check_orthogonalize",
    "check_power_step",
    "check_smallest_rank",
    "check_largest_worth_rank",
    "check_should_compress",
    "check_error_feedback_step",
    "check_numbers_per_step",
    "check_topk_allgather_bytes",
    "check_random_k",
    "check_dgc_step",
    "check_break_even_bandwidth",
    "check_all_gather_busbw",
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
            return f"expected {expected:.6g}, got {got:.6g}"
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
    name = name or getattr(student, "__name__", "your function")
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
    ``sends``: world size -> how many messages each rank must send. ``why`` ends the message when
    a count is off.
    """

    point_to_point_only: bool = False
    collectives: int | None = None
    sends: dict | None = None
    why: str = ""

    def broken(self, used: dict, world_size: int) -> str | None:
        """Why ``used`` (what one rank called) breaks these rules, or ``None``."""
        if self.collectives is not None and len(used["collectives"]) != self.collectives:
            called = ", ".join(used["collectives"]) or "none"
            return f"called {len(used['collectives'])} collectives ({called}); {self.why}"
        if self.sends is not None and used["sends"] != self.sends[world_size]:
            return f"sent {used['sends']} messages; {self.why}"
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
        self._depth = 0  # > 0 inside a watched function: what it calls in turn is not counted again
        self._saved: list = []

    def _refuse(self, what: str):
        raise NotAllowed(f"{self.name} may use only {POINT_TO_POINT}; it called {what}")

    def _replace(self, owner, attr: str, new) -> None:
        self._saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, new)

    def _function(self, name: str, original):
        def watched(*args, **kwargs):
            if self.rules.point_to_point_only:
                self._refuse(f"dist.{name}")
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
                else:
                    if self.rules.point_to_point_only:
                        self._refuse(f"a collective (ProcessGroup.{name})")
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
        return {"collectives": list(self.collectives), "sends": self.sends}


def _run_both(rank, world_size, student, reference, make_inputs, rules=None, name="your function"):
    args = make_inputs(rank, world_size)
    expected = reference(*copy.deepcopy(args))
    with _Watch(rules or Rules(), name) as watch:
        got = student(*copy.deepcopy(args))
    return args, expected, got, watch.used()


def check_distributed(student, reference, make_inputs, world_sizes=(2, 3), *, name: str | None = None,
                      timeout_s: float = 20.0, rtol: float = 1e-5, atol: float = 1e-6,
                      rules: Rules | None = None) -> bool:
    """Like :func:`check`, for functions that communicate: both run in real gloo processes.

    ``student`` and ``reference`` are top-level functions of importable modules (a student's lives
    in a ``.py`` file written from the notebook); ``make_inputs(rank, world_size)`` returns each
    rank's arguments. The reference runs first, then the student's function, on copies; ``rules``
    (see :class:`Rules`) says what the student's may call.
    """
    name = name or getattr(student, "__name__", "your function")
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


def _name(student_fn, default: str) -> str:
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

def _grads_after(accumulate_fn, sizes) -> list[torch.Tensor]:
    x_train, y_train, _, _ = digits_tensors()
    n = 48 if isinstance(sizes, int) else sum(sizes)
    model = mlp(seed=1)
    accumulate_fn(model, nn.CrossEntropyLoss(), accumulation.split(x_train[:n], y_train[:n], sizes))
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _whole_batch_grads(sizes) -> list[torch.Tensor]:
    """The reference, another way: autograd on the mean loss of the whole batch at once."""
    x_train, y_train, _, _ = digits_tensors()
    n = 48 if isinstance(sizes, int) else sum(sizes)
    model = mlp(seed=1)
    nn.CrossEntropyLoss()(model(x_train[:n]), y_train[:n]).backward()
    return [p.grad.clone() for p in model.parameters()]


def check_accumulate(student_fn) -> bool:
    """``student_fn(model, loss_fn, micro_batches)`` leaves the large batch's gradient in ``.grad``.

    Checked on 48 digits split in 4 equal parts, then in unequal parts [30, 10, 5, 3], against
    autograd on the 48 at once.
    """
    return check(lambda s: _grads_after(student_fn, s), _whole_batch_grads,
                 [(4,), ([30, 10, 5, 3],)], name=_name(student_fn, "accumulate"))


def _micro_batch_loss(logits: torch.Tensor, y: torch.Tensor, n_total: int) -> torch.Tensor:
    """Cross-entropy written out: minus the log-probability of each true class, summed, over n_total."""
    return -logits.log_softmax(dim=1).gather(1, y.unsqueeze(1)).sum() / n_total


def check_micro_batch_loss(student_fn) -> bool:
    """``student_fn(logits, y, n_total)`` so that the micro-batch losses sum to the batch's mean loss."""
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(n, 10, generator=g), torch.randint(0, 10, (n,), generator=g), total)
             for n, total in [(30, 48), (3, 48), (16, 16)]]
    return check(student_fn, _micro_batch_loss, cases, name=_name(student_fn, "micro_batch_loss"))


def _micro_batch_gradients(sizes):
    x_train, y_train, _, _ = digits_tensors()
    model = mlp(seed=2)
    grads, start = [], 0
    for n in sizes:
        model.zero_grad()
        nn.functional.cross_entropy(model(x_train[start : start + n]), y_train[start : start + n]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        start += n
    model.zero_grad()  # the reference, another way: autograd on the whole batch at once
    nn.functional.cross_entropy(model(x_train[:start]), y_train[:start]).backward()
    return grads, [p.grad.clone() for p in model.parameters()]


def check_combine_gradients(student_fn) -> bool:
    """``student_fn(grads, sizes)``: the whole batch's gradient from each micro-batch's *mean-loss* gradient.

    ``grads[i]`` is the list of parameter gradients of micro-batch i (of ``sizes[i]`` examples);
    the answer is checked against autograd on the whole batch.
    """
    cases = []
    for sizes in ([16, 16, 16], [30, 10, 5, 3], [1, 47]):
        grads, _ = _micro_batch_gradients(sizes)
        cases.append((grads, list(sizes)))
    return check(student_fn, lambda grads, sizes: _micro_batch_gradients(sizes)[1], cases,
                 name=_name(student_fn, "combine_gradients"), rtol=1e-5, atol=1e-6)


def _all_reduces(steps: int, k: int, buckets: int, no_sync: bool) -> int:
    return steps * buckets * (1 if no_sync else k)


def check_count_all_reduces(student_fn) -> bool:
    """``student_fn(steps, k, buckets, no_sync)``: the all-reduces DDP issues for ``steps`` steps of
    ``k`` micro-batches each, when the gradients fill ``buckets`` buckets."""
    cases = [(5, 4, 1, False), (5, 4, 1, True), (10, 8, 3, False), (10, 8, 3, True), (1, 1, 2, True)]
    return check(student_fn, _all_reduces, cases, name=_name(student_fn, "count_all_reduces"))


# --- notebook 02: collectives ----------------------------------------------------------------------

def exercise_inputs(rank: int, world_size: int):
    """Each rank's input for the exercises: a length that does not divide evenly among ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(2 * world_size + 1, generator=g),)


# Notebook 02's exercises build collectives from messages: each is run with every collective refused.
POINT_TO_POINT_ONLY = Rules(point_to_point_only=True)


def check_reduce_scatter(student_fn) -> bool:
    """``student_fn(tensor)`` in a ``.py`` file: this rank's chunk of the sum, from send/recv only;
    checked against ``collectives.reduce_scatter`` (an all-reduce of torch's, then this rank's chunk)."""
    return check_distributed(student_fn, collectives.reduce_scatter, exercise_inputs,
                             name=_name(student_fn, "reduce_scatter"), rules=POINT_TO_POINT_ONLY)


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


def check_halving_doubling(student_fn) -> bool:
    """``student_fn(tensor)`` in a ``.py`` file: a recursive-doubling all-reduce (sum) for power-of-two
    world sizes, from send/recv only, one whole-tensor message per rank in each of the log2 p rounds;
    checked against ``dist.all_reduce`` on 2 and 4 ranks."""
    rules = Rules(point_to_point_only=True, sends={2: 1, 4: 2},
                  why="recursive doubling sends one message (the whole tensor) per round: log2 p in all "
                      "(1 on 2 ranks, 2 on 4)")
    return check_distributed(student_fn, all_reduce_expected, exercise_inputs, world_sizes=(2, 4),
                             name=_name(student_fn, "halving_doubling_all_reduce"), rules=rules)


# --- notebook 03: data parallelism ----------------------------------------------------------------

def _ddp_buckets(sizes_bytes, first_cap_bytes, cap_bytes):
    first = data_parallel.assign_buckets(sizes_bytes, first_cap_bytes)[0]
    rest = data_parallel.assign_buckets(sizes_bytes[len(first):], cap_bytes) if len(first) < len(sizes_bytes) else []
    return [first] + [[len(first) + i for i in b] for b in rest]


def check_ddp_buckets(student_fn) -> bool:
    """``student_fn(sizes_bytes, first_cap_bytes, cap_bytes)``: the buckets (indices, in the order the
    gradients are ready) when the first bucket closes at ``first_cap_bytes`` and every other at ``cap_bytes``."""
    cases = [([4, 4, 4, 4], 4, 8), ([10, 1, 1, 1], 8, 8), ([3, 3, 3], 1, 100), ([5, 3, 7, 1, 8, 2], 2, 8),
             ([1], 1, 1), ([2, 2, 2, 2, 2], 3, 5), ([1, 1, 1, 1, 1, 1], 100, 2)]
    return check(student_fn, _ddp_buckets, cases, name=_name(student_fn, "ddp_buckets"))


def _sync_time(sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    naive = sum(costmodel.ring_all_reduce_time(n, world_size, alpha_s, busbw_GBps) for n in sizes_bytes)
    buckets = data_parallel.assign_buckets(sizes_bytes, cap_bytes)
    bucketed = sum(costmodel.ring_all_reduce_time(sum(sizes_bytes[i] for i in b), world_size, alpha_s, busbw_GBps)
                   for b in buckets)
    return naive, bucketed


def check_sync_time(student_fn) -> bool:
    """``student_fn(sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps)``: seconds of ring all-reduce
    for one step, ``(naive, bucketed)``: one all-reduce per tensor, against one per bucket of
    ``data_parallel.assign_buckets``; busbw in GB/s of 1e9 bytes."""
    mlp_sizes = [40, 10 * 512 * 4, 2048, 512 * 512 * 4, 2048, 512 * 512 * 4, 2048, 512 * 64 * 4]
    cases = [(mlp_sizes, 25 * 2**20, 2, 50e-6, 1.0), (mlp_sizes, 2**20, 8, 5e-6, 100.0),
             ([4] * 100, 400, 4, 1e-5, 10.0), ([10**9], 10**6, 16, 2e-5, 200.0)]
    return check(student_fn, _sync_time, cases, name=_name(student_fn, "sync_time"), rtol=1e-9, atol=1e-15)


# --- notebook 05: power iteration ------------------------------------------------------------------

def _random_matrices(shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in shapes]


def check_orthogonalize(student_fn) -> bool:
    """``student_fn(matrices)`` orthonormalizes the columns in place, like ``lowrank.orthogonalize_``."""
    cases = [(m,) for m in _random_matrices([(6, 1), (20, 3), (4, 30, 2)])]
    zero = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    zero[:, 1] = 0
    cases.append((zero,))

    def in_place(fn):  # what counts is the tensor after the call, whatever the function returns
        return lambda m: (fn(m), m)[1]

    return check(in_place(student_fn), in_place(lowrank.orthogonalize_), cases, name=_name(student_fn, "orthogonalize"))


def _power_step_view(out) -> dict:
    """What every right ``(P, Q_new)`` shares, whatever the signs of P's columns (Gram-Schmidt and
    ``torch.linalg.qr`` differ there): the shapes, PᵀP (the identity: orthonormal columns), P Pᵀ (the
    projection onto the columns of M Q: the right subspace) and P Q_newᵀ (= P Pᵀ M, the approximation)."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"return (P, Q_new), a pair of tensors; got {_short(out)}")
    P, Q_new = out
    view = {"shapes": f"P {tuple(P.shape)}, Q_new {tuple(Q_new.shape)}", "PᵀP": None, "P Pᵀ": None, "P Q_newᵀ": None}
    if P.dim() == 2 and Q_new.dim() == 2 and P.shape[1] == Q_new.shape[1]:
        view.update({"PᵀP": P.T @ P, "P Pᵀ": P @ P.T, "P Q_newᵀ": P @ Q_new.T})
    return view


def _power_step_qr(M: torch.Tensor, Q: torch.Tensor):
    """The reference, another way: torch's QR (Householder) in place of Gram-Schmidt."""
    P = torch.linalg.qr(M @ Q).Q
    return P, M.T @ P


def check_power_step(student_fn) -> bool:
    """``student_fn(M, Q)`` returns ``(P, Q_new)``: one step of subspace iteration. P may be any
    orthonormal basis of the columns of M Q (so ``L.orthogonalize_`` and ``torch.linalg.qr`` both do):
    compared are PᵀP, P Pᵀ and P Q_newᵀ, which do not depend on the signs of P's columns."""
    cases = [tuple(_random_matrices([(30, 20), (20, 2)])), tuple(_random_matrices([(16, 40), (40, 3)]))]
    return check(lambda M, Q: _power_step_view(student_fn(M, Q)), lambda M, Q: _power_step_view(_power_step_qr(M, Q)),
                 cases, name=_name(student_fn, "power_step"), rtol=1e-4, atol=1e-5)


def _smallest_rank(M: torch.Tensor, max_error: float) -> int:
    return next(r for r in range(1, min(M.shape) + 1) if lowrank.svd_error(M, r) <= max_error)


def check_smallest_rank(student_fn) -> bool:
    """``student_fn(M, max_error)``: the smallest rank r whose *best* rank-r approximation has relative
    error at most ``max_error``."""
    g = torch.Generator().manual_seed(3)
    u, v = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))[0], \
        torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([2.0 ** -i for i in range(30)], dtype=torch.float64)
    decaying = u[:, :30] @ torch.diag(s) @ v.T
    flat = torch.randn(40, 30, generator=g, dtype=torch.float64)
    # singular values 2^-i: the best rank-r error is 2^-r, almost exactly, so no bound sits on one of them
    cases = [(decaying, 0.45), (decaying, 0.1), (decaying, 1.5e-3), (flat, 0.5), (flat, 0.9)]
    return check(student_fn, _smallest_rank, cases, name=_name(student_fn, "smallest_rank"))


def _largest_worth_rank(n: int, m: int, min_compression_rate: float) -> int:
    return max([r for r in range(1, min(n, m) + 1) if lowrank.compression_ratio(n, m, r) > min_compression_rate],
               default=0)


def check_largest_worth_rank(student_fn) -> bool:
    """``student_fn(n, m, min_compression_rate)``: the largest rank at which sending P and Q is more
    than ``min_compression_rate`` times fewer numbers than M (0 if none)."""
    cases = [(512, 512, 2), (1024, 64, 2), (64, 10, 2), (100, 100, 2), (10, 10, 8), (4096, 4096, 100)]
    return check(student_fn, _largest_worth_rank, cases, name=_name(student_fn, "largest_worth_rank"))


# --- notebook 06: PowerSGD -------------------------------------------------------------------------

def check_should_compress(student_fn) -> bool:
    """``student_fn(n, m, r, min_compression_rate)`` is True when PowerSGD compresses an n x m matrix."""
    cases = [(512, 512, 2, 2), (10, 512, 4, 2), (512, 1, 1, 2), (100, 100, 25, 2), (100, 100, 24, 2), (64, 64, 8, 3)]
    return check(student_fn, lambda n, m, r, rate: powersgd.should_compress(n, m, r, rate)[0], cases,
                 name=_name(student_fn, "should_compress"))


def _rank1(X):  # a deterministic rank-1 compressor: two power steps from a fixed seed
    P, Q = lowrank.power_iteration(X, 1, 2, generator=torch.Generator().manual_seed(0))
    return P @ Q.T


def check_error_feedback_step(student_fn) -> bool:
    """``student_fn(grad, error, compress)`` returns ``(sent, new_error)``, as ``powersgd.error_feedback_step``."""
    cases = [(torch.randn(6, 5, generator=torch.Generator().manual_seed(s)),
              torch.randn(6, 5, generator=torch.Generator().manual_seed(s + 10)) * 0.1, _rank1) for s in range(3)]
    return check(student_fn, powersgd.error_feedback_step, cases, name=_name(student_fn, "error_feedback_step"))


def _numbers_per_step(shapes, r: int, min_compression_rate: float) -> int:
    return powersgd.numbers_per_step(shapes, r, min_compression_rate)[1]


def check_numbers_per_step(student_fn) -> bool:
    """``student_fn(shapes, r, min_compression_rate)``: the numbers PowerSGD sends per compressed step
    for parameters of these shapes (biases and matrices not worth compressing go as they are)."""
    mlp512 = [(512, 64), (512,), (512, 512), (512,), (10, 512), (10,)]
    cases = [(mlp512, 2, 2), (mlp512, 1, 2), (mlp512, 64, 2), ([(16, 3, 3, 3), (16,)], 1, 2), ([(4, 4)], 1, 1)]
    return check(student_fn, _numbers_per_step, cases, name=_name(student_fn, "numbers_per_step"))


# --- notebook 08: compression ---------------------------------------------------------------------

def _topk_allgather_bytes(numel: int, ratio: float, world_size: int) -> int:
    k = max(1, math.ceil(ratio * numel))
    return (world_size - 1) * k * (4 + 4)


def check_topk_allgather_bytes(student_fn) -> bool:
    """``student_fn(numel, ratio, world_size)``: the bytes one rank *receives* when every rank
    all-gathers its top-k payload (float32 values and int32 indices, k = ceil(ratio * numel), at least 1)."""
    cases = [(85_002, 0.01, 2), (85_002, 0.01, 4), (85_002, 0.001, 3), (11_173_962, 0.001, 16), (10, 0.01, 8),
             (1000, 1.0, 2)]
    return check(student_fn, _topk_allgather_bytes, cases, name=_name(student_fn, "topk_allgather_bytes"))


def _random_k(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[indices] = x[indices] * (x.numel() / indices.numel())
    return out


def check_random_k(student_fn) -> bool:
    """``student_fn(x, indices)``: the unbiased random-k of flat ``x`` whose chosen entries are
    ``indices`` (k distinct ones): zeros elsewhere."""
    g = torch.Generator().manual_seed(6)
    cases = []
    for n, k in ((10, 3), (1000, 10), (7, 7), (64, 1)):
        cases.append((torch.randn(n, generator=g), torch.randperm(n, generator=g)[:k]))
    return check(student_fn, _random_k, cases, name=_name(student_fn, "random_k"))


def _dgc_step(g, u, v, momentum, k):
    u = momentum * u + g
    v = v + u
    chosen = torch.topk(v.abs(), k).indices
    sent = torch.zeros_like(v)
    sent[chosen] = v[chosen]
    v = v - sent
    u = u.clone()
    u[chosen] = 0
    return sent, u, v


def check_dgc_step(student_fn) -> bool:
    """``student_fn(g, u, v, momentum, k)``: one DGC step on one rank with momentum correction and
    momentum-factor masking: ``(sent, u, v)`` after it (the new velocity and accumulation)."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n, k, m in ((8, 2, 0.9), (100, 5, 0.9), (50, 1, 0.0), (20, 20, 0.5)):
        cases.append((torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                      torch.randn(n, generator=gen), m, k))
    return check(student_fn, _dgc_step, cases, name=_name(student_fn, "dgc_step"))


# --- notebook 10: multi-GPU ------------------------------------------------------------------------

def _break_even_busbw(hook: dict, reference: dict, world_size: int, alpha_s: float) -> float:
    """Bisection on the cost model's predictions, in log space: where hook and reference take equally long."""
    def gap(busbw):
        t = costmodel.predict_step_time
        return (t(hook["compute_s"], hook["bytes"], hook["collectives"], world_size, busbw, alpha_s)
                - t(reference["compute_s"], reference["bytes"], reference["collectives"], world_size, busbw, alpha_s))

    low, high = 1e-6, 1e6
    if gap(low) * gap(high) > 0:
        return float("nan")
    for _ in range(200):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gap(low) * gap(mid) > 0 else (low, mid)
    return math.sqrt(low * high)


def check_break_even_bandwidth(student_fn) -> bool:
    """``student_fn(hook, reference, world_size, alpha_s)``: the bus bandwidth (GB/s) at which the two
    predicted step times are equal (``nan`` if never), each a dict of compute_s, bytes, collectives."""
    allreduce = {"compute_s": 0.010, "bytes": 6_400_000, "collectives": 1}
    psgd = {"compute_s": 0.016, "bytes": 80_000, "collectives": 2}
    fp16 = {"compute_s": 0.011, "bytes": 3_200_000, "collectives": 1}
    cases = [(psgd, allreduce, 2, 10e-6), (psgd, allreduce, 8, 10e-6), (fp16, allreduce, 4, 20e-6),
             (allreduce, allreduce | {"compute_s": 0.02}, 2, 10e-6),
             (fp16 | {"compute_s": 0.009}, allreduce, 4, 20e-6)]  # fewer bytes and less compute: always faster
    return check(student_fn, _break_even_busbw, cases, name=_name(student_fn, "break_even_bandwidth"),
                 rtol=1e-4, atol=0)


def _all_gather_busbw(size_bytes: int, time_s: float, world_size: int) -> float:
    return size_bytes / time_s / 1e9 * costmodel.bus_factor("all_gather", world_size)


def check_all_gather_busbw(student_fn) -> bool:
    """``student_fn(size_bytes, time_s, world_size)``: nccl-tests' busbw (GB/s) of an all-gather that
    moved ``size_bytes`` (the whole gathered buffer) in ``time_s``."""
    cases = [(2**30, 0.5, 2), (2**30, 0.5, 8), (64 * 2**20, 1e-3, 4), (4096, 1e-5, 1)]
    return check(student_fn, _all_gather_busbw, cases, name=_name(student_fn, "all_gather_busbw"))
