"""Low-rank approximation by power iteration: the numerics of PowerSGD, and nothing about processes.

A matrix M (n x m) is approximated by P Q^T with P (n x r) and Q (m x r). Sending P and Q instead
of M costs (n + m) r numbers instead of n m. The best rank-r approximation is the truncated SVD
(Eckart-Young), but an SVD is expensive. One step of *subspace* (block power) iteration is two
matrix products and an orthogonalization:

    P = M Q;  orthogonalize P;  Q = M^T P      so that  P Q^T = P P^T M

which projects M onto the span of P. Repeated, span(P) converges to the top-r left singular
vectors. PowerSGD takes one step per training iteration and starts from the previous step's Q
(*warm start*): gradients change slowly, so the iteration keeps converging across steps.

This module is used by ``course_lib.powersgd``: it holds the package's one orthogonalization and
its one power step (``power_step_p`` and ``power_step_qt``, the two products).
"""

import torch

from course_lib.utils import checks
from course_lib.utils.progress import progress_bar
from course_lib.utils.timing import median_seconds

__all__ = [
    "orthogonalize_",
    "power_step_p",
    "power_step_qt",
    "power_step",
    "power_iteration",
    "power_iteration_without_orthogonalization",
    "relative_error",
    "svd_error",
    "compression_ratio",
    "track_errors",
    "track_error_feedback",
    "time_methods",
]


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of an (n, r) or a batch of (b, n, r) matrices, in place.

    Column i is normalized, then its component is removed from every later column. A column that
    is (or becomes) all zeros stays all zeros instead of turning into NaN: with ``epsilon`` > 0
    each norm gets ``epsilon`` added (as torch's PowerSGD does); with ``epsilon`` = 0 a zero norm
    is explicitly left undivided. Returns ``matrices``.
    """
    checks.number("epsilon", epsilon, 0)
    if matrices.dim() not in (2, 3):
        raise ValueError(f"expected an (n, r) or (b, n, r) tensor, got shape {tuple(matrices.shape)}")
    if not matrices.is_floating_point():
        raise TypeError(f"orthogonalize_ works in place on a floating-point tensor, got {matrices.dtype}: "
                        f"pass matrices.float()")
    m = matrices if matrices.dim() == 3 else matrices.unsqueeze(0)
    num_cols = m.shape[2]
    for i in range(num_cols):
        col = m[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon:
            col /= norm + epsilon
        else:
            col /= torch.where(norm == 0, torch.ones_like(norm), norm)
        if i + 1 < num_cols:
            rest = m[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    return matrices


def _check_matrix(M: torch.Tensor) -> None:
    if not isinstance(M, torch.Tensor) or M.dim() not in (2, 3):
        raise ValueError(f"expected a matrix (n, m) or a batch (b, n, m), got "
                         f"{f'shape {tuple(M.shape)}' if isinstance(M, torch.Tensor) else type(M).__name__}")
    if not M.is_floating_point():
        raise TypeError(f"M must hold floating-point numbers, got {M.dtype}: pass M.float()")


def _check_product(a: str, A: torch.Tensor, b: str, B: torch.Tensor) -> None:
    """A @ B must be defined: the columns of A are the rows of B (per matrix of a batch)."""
    if A.shape[-1] != B.shape[-2] or A.shape[:-2] != B.shape[:-2] or A.dtype != B.dtype:
        raise ValueError(f"{a} @ {b} needs {a}'s columns to be {b}'s rows, one batch and one dtype: "
                         f"{a} is {tuple(A.shape)} {A.dtype}, {b} {tuple(B.shape)} {B.dtype}")


def _check_rank(M: torch.Tensor, rank: int) -> None:
    _check_matrix(M)
    limit = min(M.shape[-2], M.shape[-1])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= limit:
        raise ValueError(f"rank must be an integer between 1 and min(n, m) = {limit} for a {tuple(M.shape)} "
                         f"matrix, got {rank!r}")


def power_step_p(M: torch.Tensor, Q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first half of a power step: ``P = M Q`` (n x r; batches (b, n, r) too), into ``out`` if given.

    PowerSGD all-reduces this P, then orthogonalizes it, before the second half.
    """
    _check_product("M", M, "Q", Q)
    return torch.matmul(M, Q, out=out)


def power_step_qt(M: torch.Tensor, P: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The second half: ``Q = M^T P``, returned *transposed*, as ``Q^T = P^T M`` (r x m), into ``out`` if given.

    The same numbers as ``M.mT @ P``, but on the CPU a product with a transposed *large* operand was
    measured several times slower than this one, whose transposed operand is the thin P.
    """
    _check_product("P^T", P.mT, "M", M)
    return torch.matmul(P.mT, M, out=out)


def power_step(M: torch.Tensor, Q: torch.Tensor, epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of subspace iteration: ``(P, Q_new)`` with P orthonormal and ``M ~ P @ Q_new.T``.

    The two halves with the orthogonalization between them, on one process. PowerSGD calls the
    same two halves with an all-reduce after each.
    """
    P = orthogonalize_(power_step_p(M, Q), epsilon)
    return P, power_step_qt(M, P).mT


def power_iteration(M: torch.Tensor, rank: int, iters: int = 1, q: torch.Tensor | None = None,
                    generator: torch.Generator | None = None, epsilon: float = 0.0):
    """``iters`` steps of subspace iteration; returns ``(P, Q)`` with ``M ~ P @ Q.T``.

    P has orthonormal columns. ``q`` (m x rank) warm-starts from a previous step's Q; otherwise Q
    starts as Gaussian noise from ``generator``. Works on batches (b, n, m) too.
    """
    _check_rank(M, rank)
    checks.integer("iters", iters, 1)
    shape = (*M.shape[:-2], M.shape[-1], rank)
    if q is None:
        q = torch.randn(shape, generator=generator, dtype=M.dtype, device="cpu").to(M.device)
    elif tuple(q.shape) != shape or q.dtype != M.dtype:
        raise ValueError(f"q must be {shape} {M.dtype} like M, got {tuple(q.shape)} {q.dtype}")
    Q = q
    for _ in range(iters):
        P, Q = power_step(M, Q, epsilon)
    return P, Q


def power_iteration_without_orthogonalization(M: torch.Tensor, rank: int, iters: int,
                                              generator: torch.Generator | None = None) -> torch.Tensor:
    """The naive block version, to see why orthogonalization is needed: returns the r directions.

    Each column is just a single-vector power iteration, so every column converges to the *same*
    top singular vector. Columns are rescaled to unit length after each step (only to avoid
    overflow; scaling does not change directions).
    """
    _check_rank(M, rank)
    checks.integer("iters", iters, 1)
    X = torch.randn(M.shape[-2], rank, generator=generator, dtype=M.dtype)
    for _ in range(iters):
        X = M @ (M.mT @ X)
        X = X / torch.linalg.vector_norm(X, dim=0, keepdim=True)
    return X


def relative_error(M: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> float:
    """||M - P Q^T||_F / ||M||_F."""
    _check_product("P", P, "Q^T", Q.mT)
    if (P @ Q.mT).shape != M.shape:
        raise ValueError(f"P @ Q^T must have M's shape {tuple(M.shape)}: P is {tuple(P.shape)}, Q {tuple(Q.shape)}")
    norm = torch.linalg.norm(M)
    if norm == 0:
        raise ValueError("M is all zeros: an error relative to its norm is 0/0. Compare ||M - P Q^T|| itself.")
    return (torch.linalg.norm(M - P @ Q.mT) / norm).item()


def svd_error(M: torch.Tensor, rank: int) -> float:
    """The best possible relative error at ``rank`` (Eckart-Young).

    ``sqrt(sum_{i>r} s_i^2 / sum_i s_i^2)`` with ``s_1 >= s_2 >= ...``: the energy beyond the first r
    singular values (``s[rank:]`` below, counting from 0).
    """
    if not isinstance(M, torch.Tensor) or M.dim() != 2:
        raise ValueError(f"svd_error expects a matrix (n, m), got "
                         f"{f'shape {tuple(M.shape)}' if isinstance(M, torch.Tensor) else type(M).__name__}")
    if not bool(torch.isfinite(M).all()):
        raise ValueError("M holds nan or inf: no singular values to compare with (look for a diverged gradient)")
    checks.integer("rank", rank, 0, min(M.shape))  # rank 0: nothing kept, error 1
    s = torch.linalg.svdvals(M.double())
    energy = s.square()
    if energy.sum() == 0:
        raise ValueError("M is all zeros: an error relative to its norm is 0/0 (every rank represents it exactly)")
    return (energy[rank:].sum() / energy.sum()).sqrt().item()


def compression_ratio(n: int, m: int, rank: int) -> float:
    """Numbers in M over numbers in P and Q: n m / ((n + m) rank)."""
    checks.integer("n", n, 1), checks.integer("m", m, 1), checks.integer("rank", rank, 1)
    return n * m / ((n + m) * rank)


def track_errors(matrices, rank: int, warm_start: bool = True, iters: int = 1, seed: int = 0) -> list[float]:
    """Relative error of a power-iteration approximation of each matrix in a sequence.

    With ``warm_start`` each step starts from the previous step's Q, as PowerSGD does; without,
    from fresh noise each time.
    """
    g = torch.Generator().manual_seed(seed)
    errors, q = [], None
    for M in matrices:
        P, Q = power_iteration(M, rank, iters, q=q if warm_start else None, generator=g)
        errors.append(relative_error(M, P, Q))
        q = Q
    return errors


def track_error_feedback(matrices, rank: int, warm_start: bool = True, iters: int = 1,
                         seed: int = 0) -> tuple[list[float], list[float]]:
    """Power iteration on what PowerSGD compresses: each matrix plus the error the last step left.

    Step t approximates ``C_t = M_t + e_t`` (``e_0 = 0``) and keeps ``e_{t+1} = C_t - P Q^T``:
    PowerSGD's error feedback, on one process. Returns ``(errors, optima)``: the relative error of
    each approximation of ``C_t``, and the SVD optimum for that ``C_t`` at ``rank``. The ``C_t``
    depend on the approximations before them, so warm and cold runs compress matrices of their own,
    and each is measured against its own optima.
    """
    g = torch.Generator().manual_seed(seed)
    errors, optima, q, e = [], [], None, None
    for t, M in enumerate(matrices):
        if e is not None and M.shape != e.shape:
            raise ValueError(f"matrices must all have one shape (the error carried is the last one's): matrix {t} "
                             f"is {tuple(M.shape)}, matrix {t - 1} was {tuple(e.shape)}")
        C = M if e is None else M + e
        P, Q = power_iteration(C, rank, iters, q=q if warm_start else None, generator=g)
        errors.append(relative_error(C, P, Q))
        optima.append(svd_error(C, rank))
        e, q = C - P @ Q.mT, Q
    return errors, optima


def time_methods(shapes, rank: int = 2, repeats: int = 5, seed: int = 0, progress: bool = False,
                 device: torch.device | str = "cpu") -> list[dict]:
    """Median seconds of a full SVD, ``torch.svd_lowrank`` and one power-iteration step, per shape, over
    ``repeats`` calls after one warm-up; a call whose warm-up took over a second is timed once. The
    matrices are drawn on the CPU (the same numbers on every device), then moved to ``device``; on a
    GPU each call is timed until its kernels have finished."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    shapes = list(shapes)
    for shape in shapes:
        if (not isinstance(shape, (tuple, list)) or len(shape) != 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
            raise ValueError(f"each of shapes must be a pair (n, m) of integers >= 1, got {shape!r}")
        checks.integer(f"rank (for shape {tuple(shape)})", rank, 1, min(shape))
    checks.integer("repeats", repeats, 1)
    if progress:
        shapes = progress_bar(shapes, desc="timing")
    for n, m in shapes:
        M = torch.randn(n, m, generator=g).to(device)
        q = torch.randn(m, rank, generator=g).to(device)
        row = {"shape": (n, m)}
        for key, fn in (
            ("svd_s", lambda M=M: torch.linalg.svd(M, full_matrices=False)),
            ("svd_lowrank_s", lambda M=M: torch.svd_lowrank(M, q=rank, niter=2)),
            ("power_step_s", lambda M=M, q=q: power_iteration(M, rank, 1, q=q)),
        ):
            row[key] = median_seconds(fn, repeats, once_above_s=1.0, device=device)
        rows.append(row)
    return rows
