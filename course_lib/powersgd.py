"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) as a DDP communication hook, from scratch.

A drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: the same names
(``PowerSGDState``, ``powerSGD_hook``, ``batched_powerSGD_hook``), the same
arguments, and, given the same ``random_seed``, the same numbers. So ``import
course_lib.powersgd as powerSGD`` swaps it in. Each gradient matrix M (a layer's weight gradient,
viewed as rows x everything else) is sent as two thin matrices::

    Q <- orthogonalize(Q)         (warm start: last step's Q; else Gaussian noise)
    P <- M Q;   all-reduce P;   orthogonalize P
    Q <- M^T P; all-reduce Q;   Q <- Q / world_size
    M <- P Q^T                    (the average of every rank's M, projected on span(P))

with *error feedback*: what compression dropped on this rank is added to its next gradient.
The numerics (``orthogonalize_`` and the power step's two products, ``power_step_p`` and
``power_step_qt``) come from ``course_lib.lowrank``; the all-reduces from ``course_lib.hooks``
(counted in ``hooks.traffic``); error feedback is ``course_lib.memory``'s, the one every compressor
uses. ``powerSGD_hook`` reads as its steps: ``memory.compensate``, ``_group_matrices`` (into
:class:`_MatrixGroup` records), ``_start_q``, ``_all_reduce_p``, ``_all_reduce_q``, ``_decompress``,
``memory.update``.

Two differences from torch's hook, both on purpose:

1. **Every collective is issued inside the hook call, in bucket order.** torch's hook issues the P
   and Q all-reduces from future callbacks, which run when the previous collective of *that*
   bucket's future completes. On NCCL that future is marked complete as soon as the collective is
   enqueued on the GPU's stream, so the callbacks run at once, on the thread that called the hook,
   in bucket order. On gloo it completes when the collective has finished, on a gloo thread, so
   the callbacks of different buckets run in the order their collectives finish, which can differ
   from rank to rank: with several buckets, one rank can then issue bucket 1's P all-reduce while
   another issues bucket 0's Q all-reduce, and the collectives pair up wrongly (a "collective
   mismatch" abort, a hang, or a closed connection). Here the hook waits for its own all-reduces,
   so collectives follow DDP's bucket order, which is the same on every rank. The price is that
   communication does not overlap the rest of the backward pass. ``ordered_powerSGD_hook`` gets
   the overlap back without giving up the order: it hands each bucket to one communication thread
   per process, which runs ``powerSGD_hook`` on the buckets one at a time, in the order DDP handed
   them over, while backward goes on.
2. **Memory follows parameters, not bucket indices.** DDP lays buckets out in parameter order for
   a new model's first iteration and rebuilds them in gradient-ready order afterwards; torch keys
   its error and Q memory by bucket index, so after a checkpoint resume they land on the wrong
   parameters. Here each parameter gets a key (its position in the first bucket layout this state
   sees, which is parameter order for any new DDP model), and error and Q are kept per key.

torch's ``batched_powerSGD_hook`` fails for another reason, on any backend and with one bucket on
one process: it passes its 2-D Q (side x rank) to ``_orthogonalize``, which requires a 3-D batch of
matrices and raises ``AssertionError`` at the first compressed step (checked in torch 2.13). The
course's ``batched_powerSGD_hook`` orthogonalizes the 2-D matrix.
"""

import logging
import math
import queue
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from course_lib import hooks
from course_lib.lowrank import orthogonalize_, power_step_p, power_step_qt
from course_lib.memory import ErrorFeedback, ParameterKeys
from course_lib.utils import checks
from course_lib.utils.rng import global_generator
from course_lib.utils.timing import median_seconds

__all__ = [
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "ordered_powerSGD_hook",
    "compress_on_one_process",
    "encode_decode_seconds",
    "should_compress",
    "numbers_per_step",
]

logger = logging.getLogger(__name__)


def should_compress(num_rows: int, num_cols: int, matrix_approximation_rank: int,
                    min_compression_rate: float) -> tuple[bool, int, int]:
    """``(worth it, numbers before, numbers after)``: compress when (n + m) r * rate < n m."""
    checks.integer("num_rows", num_rows, 1), checks.integer("num_cols", num_cols, 1)
    checks.integer("matrix_approximation_rank", matrix_approximation_rank, 1)
    checks.number("min_compression_rate", min_compression_rate, 0)
    before = num_rows * num_cols
    after = (num_rows + num_cols) * matrix_approximation_rank
    return after * min_compression_rate < before, before, after


def numbers_per_step(shapes, matrix_approximation_rank: int, min_compression_rate: float = 2) -> tuple[int, int]:
    """``(before, after)``: the numbers one rank sends per compressed step for parameters of these
    shapes, uncompressed and as the hooks send them. Each tensor is viewed as a matrix, rows x
    everything else, as both hooks view it: a vector of n is an n x 1 matrix, which
    :func:`should_compress` accepts when ``min_compression_rate`` is below n / (n + 1) (then it
    goes as P and Q, n + 1 numbers); matrices it turns down, scalars and empty tensors go as they are."""
    checks.integer("matrix_approximation_rank", matrix_approximation_rank, 1)
    before = after = 0
    for shape in shapes:
        numel = math.prod(shape)
        before += numel
        if len(shape) == 0 or numel == 0:  # nothing to factor: sent as it is (_group_matrices)
            after += numel
            continue
        n, m = shape[0], numel // shape[0]
        worth, _, compressed = should_compress(n, m, min(n, m, matrix_approximation_rank), min_compression_rate)
        after += compressed if worth else numel
    return before, after


class PowerSGDState:
    """Hyperparameters and memory of PowerSGD, for every bucket of one DDP model.

    Arguments and defaults are torch's. ``matrix_approximation_rank`` (1-4 typical) sets the
    compression; ``start_powerSGD_iter`` runs plain all-reduce first (about 10% of training is a
    good start), because early training is sensitive to compression error, and because DDP
    rebuilds its buckets after iteration 1. It pickles as torch's does (the process group left out,
    the default group on loading, a note in the log each time), with two differences named where
    ``__getstate__`` is defined.
    """

    __slots__ = [
        "process_group",
        # tuned by the user
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        # seldom tuned
        "min_compression_rate",
        "orthogonalization_epsilon",
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "compression_stats_logging_frequency",
        # internal: random numbers, memory keyed by parameter, progress
        "rng",
        "memory",
        "keys",
        "q_memory_dict",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "next_stats_report",
        "__weakref__",  # ordered_powerSGD_hook finds its thread by the state, without keeping it alive
    ]

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False):
        if (not isinstance(matrix_approximation_rank, int) or isinstance(matrix_approximation_rank, bool)
                or matrix_approximation_rank < 1):
            raise ValueError(f"matrix_approximation_rank must be an integer >= 1 (1 to 4 is typical), "
                             f"got {matrix_approximation_rank!r}")
        checks.integer("start_powerSGD_iter", start_powerSGD_iter, 0)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                f"start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on, got "
                f"{start_powerSGD_iter}: DDP rebuilds its buckets after the first iteration, and memory "
                f"kept from before would not match. Use start_powerSGD_iter=2 or more (about 10% of "
                f"the training steps is a good start), or turn both options off."
            )
        # NaN passes a `< 0` test, and would later surface as a "non-finite gradient"
        checks.number("orthogonalization_epsilon (0, or a small value such as 1e-8)", orthogonalization_epsilon, 0)
        checks.number("min_compression_rate (2 is the default)", min_compression_rate, 0)
        for name in ("use_error_feedback", "warm_start", "batch_tensors_with_same_shape"):
            checks.boolean(name, locals()[name])  # a string such as "no" would be taken as True
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.orthogonalization_epsilon = orthogonalization_epsilon
        # Error feedback costs a gradient-sized buffer, but PowerSGD is a biased compressor (the
        # average of many compressions is not the gradient): without it, what is dropped is lost.
        self.use_error_feedback = use_error_feedback
        # Warm start costs the Q matrices (tiny) and makes one power iteration per step enough.
        self.warm_start = warm_start
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        # The seed of each fresh Q comes from this generator, the same on every rank, and differs
        # from step to step; torch draws the same way, so the two hooks match number for number.
        self.rng = np.random.RandomState(random_seed)
        self.memory = ErrorFeedback()  # course_lib.memory's, as every compressor's: kept per parameter
        self.keys = ParameterKeys()
        self.q_memory_dict: dict = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0

    @property
    def error_dict(self) -> dict:
        """torch's name for the error feedback memory: parameter key -> what compression left out."""
        return self.memory.memory

    @error_dict.setter
    def error_dict(self, value: dict) -> None:
        self.memory.memory = value

    def maybe_increase_iter(self, bucket) -> None:
        # DDP processes bucket 0 last in each iteration
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numbers before compression, numbers after)``, summed over compressed steps."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    def _report(self, bucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %s, before %s, after %s, rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to resume, without the process group (tensors are copies)."""
        return {
            "hyperparameters": {k: getattr(self, k) for k in _HYPERPARAMETERS},
            "iter": self.iter,
            "rng": self.rng.get_state(),
            "error_dict": {k: v.clone() for k, v in self.error_dict.items()},
            "q_memory_dict": {k: v.clone() for k, v in self.q_memory_dict.items()},
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`. Register the hook on the new DDP model before training:
        keys are matched to parameters by the new model's first bucket layout (parameter order)."""
        missing = sorted(set(_STATE_KEYS) - set(state)) if isinstance(state, dict) else "everything"
        if missing:
            raise ValueError(f"state must be what PowerSGDState.state_dict() returned; it lacks {missing}")
        for k, v in state["hyperparameters"].items():
            setattr(self, k, v)
        self.iter = state["iter"]
        self.rng = np.random.RandomState()
        self.rng.set_state(state["rng"])
        self.error_dict = {k: v.clone() for k, v in state["error_dict"].items()}
        self.q_memory_dict = {k: v.clone() for k, v in state["q_memory_dict"].items()}
        self.total_numel_before_compression = state["total_numel_before_compression"]
        self.total_numel_after_compression = state["total_numel_after_compression"]
        self.next_stats_report = state["next_stats_report"]
        self.keys.reset()  # the new model's parameters take keys 0, 1, ... again, in parameter order

    # Pickled (``torch.save`` of a checkpoint holding the state) as torch's: the process group cannot
    # be pickled, so it is left out, with a note in the log; unpickled, the state takes the default
    # group (every rank), with a note to set another. Two differences a test of torch's would see: the
    # notes go to this module's logger, in the course's words; and the memory is new objects (keys
    # start again in the new model, see load_state_dict) holding copies of the tensors, so that two
    # states are compared by their state_dict(), not attribute by attribute.
    def __getstate__(self) -> dict:
        logger.warning("PowerSGDState: a process group cannot be pickled; it is left out of the saved state.")
        return self.state_dict()

    def __setstate__(self, state: dict) -> None:
        self.process_group = dist.group.WORLD
        logger.warning("PowerSGDState: loaded with the default process group (every rank); set "
                       "state.process_group afterwards to use another.")
        self.memory, self.keys = ErrorFeedback(), ParameterKeys()  # (__init__ did not run)
        self.load_state_dict(state)


_STATE_KEYS = ("hyperparameters", "iter", "rng", "error_dict", "q_memory_dict", "total_numel_before_compression",
               "total_numel_after_compression", "next_stats_report")  # what state_dict returns
_HYPERPARAMETERS = (
    "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "orthogonalization_epsilon",
    "use_error_feedback", "warm_start", "batch_tensors_with_same_shape", "compression_stats_logging_frequency",
)


def _check_finite(tensor: torch.Tensor, state: PowerSGDState, bucket) -> None:
    # Checked after the all-reduce, so that every rank sees the same values and raises together.
    if not torch.isfinite(tensor).all():
        raise FloatingPointError(
            f"PowerSGD: a gradient in bucket {bucket.index()} at iteration {state.iter} is not finite "
            f"(NaN or Inf) on some rank. Lower the learning rate, clip gradients, or check the loss "
            f"for a division by zero or a log of 0."
        )


def _fresh_q(state: PowerSGDState, shapes, dtype, device) -> list[torch.Tensor]:
    # One seed per bucket and per draw, as torch: fork the CPU generator so training's own random
    # numbers are untouched, draw on the CPU (forking every GPU's generator is slow), then move.
    with global_generator, torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(1_000_000_000))
        return [torch.randn(*shape, device="cpu", dtype=dtype).to(device) for shape in shapes]


@dataclass
class _MatrixGroup:
    """Gradient matrices that PowerSGD compresses together: one matrix, or, with
    ``batch_tensors_with_same_shape``, every matrix of one shape in the bucket, stacked."""

    keys: list[int]  # the parameters' keys: error and Q memory follow them
    matrix: torch.Tensor  # M: (n, m), a view of the gradient; or (b, n, m), a stacked copy
    matrix_approximation_rank: int  # r: the state's, or less for a thin matrix
    gradients: list[torch.Tensor] | None = None  # stacked: where each result is copied back
    q: torch.Tensor | None = None  # (m, r) or (b, m, r)
    p: torch.Tensor | None = None  # (n, r) or (b, n, r): a view into the first all-reduce's buffer
    qt: torch.Tensor | None = None  # Q^T, (r, m) or (b, r, m): a view into the second one's

    @property
    def stacked(self) -> bool:
        return self.matrix.dim() == 3


def _group_matrices(state: PowerSGDState, keys, grads) -> tuple[list[torch.Tensor], list[_MatrixGroup]]:
    """``(plain, groups)``: the gradients sent as they are, and the matrices worth compressing.

    A gradient is viewed as a matrix (rows x everything else) and compressed when
    :func:`should_compress` says so. Matrices are grouped by shape in order of appearance, as
    torch does (the order of random draws depends on it), and stacked per shape if asked.
    Adds to the state's compression statistics.
    """
    plain, by_shape = [], {}
    for key, grad in zip(keys, grads):
        if grad.dim() == 0 or grad.numel() == 0:  # a scalar, or a parameter with no elements: nothing to factor
            plain.append(grad)
            continue
        matrix = grad.view(grad.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        worth, before, after = should_compress(n, m, r, state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            by_shape.setdefault((n, m), []).append((key, matrix))
            state.total_numel_after_compression += after
        else:
            plain.append(grad)
            state.total_numel_after_compression += before
    groups = []
    for (n, m), members in by_shape.items():
        r = min(n, m, state.matrix_approximation_rank)
        if state.batch_tensors_with_same_shape and len(members) > 1:
            groups.append(_MatrixGroup([k for k, _ in members], torch.stack([mat for _, mat in members]), r,
                                      [mat for _, mat in members]))
        else:
            groups.extend(_MatrixGroup([k], mat, r) for k, mat in members)
    return plain, groups


def _start_q(state: PowerSGDState, groups: list[_MatrixGroup], dtype, device) -> None:
    """Each group's Q, orthogonalized: last step's (warm start), else fresh noise (one seed per bucket)."""
    missing = [g for g in groups if not state.warm_start or any(k not in state.q_memory_dict for k in g.keys)]
    if missing:
        drawn = _fresh_q(state, [(len(g.keys), g.matrix.shape[-1], g.matrix_approximation_rank) for g in missing],
                         dtype, device)
        for g, q in zip(missing, drawn):
            g.q = q if g.stacked else q[0]
    for g in groups:
        if g.q is None:
            g.q = torch.stack([state.q_memory_dict[k] for k in g.keys]) if g.stacked else state.q_memory_dict[g.keys[0]]
        orthogonalize_(g.q, state.orthogonalization_epsilon)


def _all_reduce_p(state: PowerSGDState, groups: list[_MatrixGroup], plain: list[torch.Tensor], process_group,
                 bucket) -> None:
    """First all-reduce: every ``P = M Q`` and the uncompressed gradients, in one buffer.

    One collective instead of two. The P's are summed, not averaged: they are orthogonalized
    next, which undoes any scale. The uncompressed gradients are averaged, in place. The P's come
    first, laid out as torch lays out its P memory: the same alignment, the same rounding.
    """
    buffer = bucket.buffer()
    p_sizes = [g.matrix.shape[:-1].numel() * g.matrix_approximation_rank for g in groups]
    n_p = sum(p_sizes)
    comm = torch.empty(n_p + sum(t.numel() for t in plain), dtype=buffer.dtype, device=buffer.device)
    offset = 0
    for g, size in zip(groups, p_sizes):
        g.p = comm[offset : offset + size].view(*g.matrix.shape[:-1], g.matrix_approximation_rank)
        power_step_p(g.matrix, g.q, out=g.p)
        offset += size
    for t in plain:
        comm[offset : offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    hooks.all_reduce_counted(comm, process_group)
    _check_finite(comm, state, bucket)
    offset = n_p
    for t in plain:
        t.copy_(comm[offset : offset + t.numel()].view_as(t).div_(process_group.size()))
        offset += t.numel()


def _all_reduce_q(state: PowerSGDState, groups: list[_MatrixGroup], process_group, bucket) -> None:
    """Second all-reduce: orthogonalize each P, compute ``Q = M^T P`` (kept as Q^T), average the Q's."""
    buffer = bucket.buffer()
    q_sizes = [g.matrix.shape[-1] * g.matrix_approximation_rank * (g.matrix.shape[0] if g.stacked else 1)
               for g in groups]
    comm = torch.empty(sum(q_sizes), dtype=buffer.dtype, device=buffer.device)
    offset = 0
    for g, size in zip(groups, q_sizes):
        orthogonalize_(g.p, state.orthogonalization_epsilon)
        g.qt = comm[offset : offset + size].view(*g.matrix.shape[:-2], g.matrix_approximation_rank,
                                                 g.matrix.shape[-1])
        power_step_qt(g.matrix, g.p, out=g.qt)
        offset += size
    hooks.all_reduce_counted(comm, process_group)
    comm.div_(process_group.size())


def _decompress(state: PowerSGDState, groups: list[_MatrixGroup]) -> None:
    """Write ``M = P Q^T`` into each gradient, and keep each Q for the next step's warm start.

    Q is made contiguous (m x r, small) as torch keeps it: a product with a differently laid out
    operand takes another kernel, which rounds differently, and power iteration amplifies such
    differences step after step.
    """
    for g in groups:
        q = g.qt.mT.contiguous()
        torch.matmul(g.p, q.mT, out=g.matrix)
        if g.gradients is not None:  # stacked: copy each back to its gradient
            for i, grad in enumerate(g.gradients):
                grad.copy_(g.matrix[i])
        if state.warm_start:
            for i, k in enumerate(g.keys):
                state.q_memory_dict[k] = q[i] if g.stacked else q


def compress_on_one_process(state: PowerSGDState, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``powerSGD_hook`` computes, without the collectives: each gradient worth compressing is
    replaced (in place) by its rank-r approximation ``P Q^T``, as a world of one process would get
    it; the others are left as they are. For timing and trying out the arguments in one process.
    The state's memory (warm start, keys) is used and updated as the hook would; error feedback is not.
    """
    keys = state.keys(grads)
    _, groups = _group_matrices(state, keys, grads)
    if groups:
        _start_q(state, groups, grads[0].dtype, grads[0].device)
    for g in groups:
        g.p = orthogonalize_(power_step_p(g.matrix, g.q), state.orthogonalization_epsilon)
        g.qt = power_step_qt(g.matrix, g.p)
    _decompress(state, groups)
    return grads


def encode_decode_seconds(shapes, matrix_approximation_rank: int = 2, repeats: int = 20, threads: int = 1) -> float:
    """Median seconds of one step of PowerSGD's computation on gradients of ``shapes`` (random, fixed),
    in one process, with error feedback as the hook runs it: add the memory, compress
    (:func:`compress_on_one_process`), keep what compression left out. What a step spends computing
    rather than communicating, for the step-time model (the hook itself interleaves the two). On
    ``threads`` compute threads, as a worker computes (``spawn`` gives each of 2 workers on 2 cores one)."""
    checks.integer("threads", threads, 1)
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    state = PowerSGDState(None, matrix_approximation_rank=matrix_approximation_rank, start_powerSGD_iter=2)
    work = [g.clone() for g in grads]  # the same tensors every call, so that the memory finds its entries
    layout = state.keys.layout(work)

    def step():
        corrected = state.memory.compensate(layout, torch.cat([g.flatten() for g in grads]))
        for w, piece in zip(work, corrected.split([w.numel() for w in work])):
            w.copy_(piece.view_as(w))
        compress_on_one_process(state, work)
        state.memory.update(layout, corrected, torch.cat([w.flatten() for w in work]))

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return median_seconds(step, repeats=repeats)
    finally:
        torch.set_num_threads(saved)


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Layer-wise PowerSGD: each gradient worth compressing (viewed as rows x everything else) is
    sent as P and Q, the rest (at the default ``min_compression_rate``, biases and small layers) as
    is, in two all-reduces per bucket: [P..., uncompressed] then [Q...]."""
    process_group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    layout = state.keys.layout(bucket.parameters())  # ((key, numel), ...): memory follows parameters
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return hooks.allreduce_fut(process_group, buffer)

    grads = bucket.gradients()  # views into buffer, one per parameter
    if state.use_error_feedback:  # add what compression left out of each gradient last step
        corrected = state.memory.compensate(layout, buffer)
        buffer.copy_(corrected)
    plain, groups = _group_matrices(state, [k for k, _ in layout], grads)
    state._report(bucket)
    _start_q(state, groups, buffer.dtype, buffer.device)
    _all_reduce_p(state, groups, plain, process_group, bucket)
    _all_reduce_q(state, groups, process_group, bucket)
    _decompress(state, groups)
    if state.use_error_feedback:  # keep what this rank wanted to send, minus what everyone received
        state.memory.update(layout, corrected, buffer)
    state.maybe_increase_iter(bucket)
    return hooks.completed_future(buffer)


class _OrderedWorker:
    """One thread that runs a blocking hook on each bucket put in ``jobs``, one at a time, first in
    first out, and completes the bucket's future with the result (or the exception)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="ordered_powerSGD_hook", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # the state is gone: no more buckets will come
                return
            hook, state, bucket, future = job
            try:
                future.set_result(hook(state, bucket).wait())
            except Exception as e:  # the rank that raised reports it; DDP re-raises it from backward
                future.set_exception(e)


# One worker per state, kept beside it (a thread cannot be pickled with the state); when the state
# is garbage-collected, its entry goes and its thread is told to end.
_workers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ordered_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`powerSGD_hook`, run on a communication thread so that backward goes on meanwhile.

    DDP calls a hook bucket by bucket, in the same order on every rank. This hook only queues the
    bucket and returns a future; one thread per process (per state) takes the buckets from the
    queue in that order and runs the blocking hook on each. So every rank issues the same
    collectives in the same order, whatever the timing, unlike torch's hook, whose collectives are
    issued from callbacks of other collectives; and the numbers are those of ``powerSGD_hook``,
    which does the same work on the same state in the same order. DDP waits for the futures at the
    end of backward, before the optimizer step.
    """
    worker = _workers.get(state)
    if worker is None:
        worker = _workers[state] = _OrderedWorker()
        weakref.finalize(state, worker.jobs.put, None)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    worker.jobs.put((powerSGD_hook, state, bucket, future))
    return future



def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Simplified PowerSGD: the whole bucket, padded with zeros, as one square matrix.

    Fewer, larger products than the layer-wise hook, but a worse approximation (a bucket mixes
    layers). The memory of Q is kept per bucket *layout*; error feedback per parameter.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer = bucket.buffer()
    layout = state.keys.layout(bucket.parameters())
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return hooks.allreduce_fut(group, buffer)

    total = buffer.numel()
    side = math.ceil(math.sqrt(total))
    matrix_approximation_rank = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += total
    state.total_numel_after_compression += 2 * side * matrix_approximation_rank
    state._report(bucket)
    if state.use_error_feedback:
        corrected = state.memory.compensate(layout, buffer)
        buffer.copy_(corrected)
    padded = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    padded[:total].copy_(buffer)
    matrix = padded.view(side, side)

    bucket_keys = tuple(k for k, _ in layout)  # Q is kept per bucket layout: one matrix for the bucket
    q = state.q_memory_dict.get(bucket_keys) if state.warm_start else None
    if q is None:
        q = _fresh_q(state, [(side, matrix_approximation_rank)], buffer.dtype, buffer.device)[0]
    orthogonalize_(q, state.orthogonalization_epsilon)
    p = power_step_p(matrix, q)
    hooks.all_reduce_counted(p, group)
    _check_finite(p, state, bucket)
    orthogonalize_(p, state.orthogonalization_epsilon)
    qt = power_step_qt(matrix, p)
    hooks.all_reduce_counted(qt, group)
    qt.div_(world_size)
    torch.matmul(p, qt, out=matrix)
    buffer.copy_(padded[:total])
    if state.warm_start:
        state.q_memory_dict[bucket_keys] = qt.mT.contiguous()
    if state.use_error_feedback:
        state.memory.update(layout, corrected, buffer)
    state.maybe_increase_iter(bucket)
    return hooks.completed_future(buffer)
