"""Low-rank approximation by power iteration: the numerics of PowerSGD, and nothing about processes.

A matrix M (n x m) is approximated by P Q^T with P (n x r) and Q (m x r). Sending P and Q instead
of M costs (n + m) r numbers instead of n m. The best rank-r approximation is the truncated SVD
(Eckart-Young), but an SVD is expensive. One step of *subspace* (block power) iteration is two
matrix products and an orthogonalization:

    P = M Q;  orthogonalize P;  Q = M^T P      so that  P Q^T = P P^T M

which projects M onto the span of P. Repeated, span(P) converges to the top-r left singular
vectors. PowerSGD takes one step per training iteration and starts from the previous step's Q
(*warm start*): gradients change slowly, so the iteration keeps converging across steps.

This module is used by ``course_lib.powersgd``: it holds the package's one orthogonalization.
"""

import statistics
import time

import torch

from course_lib.exercises import check

__all__ = [
    "orthogonalize_",
    "power_iteration",
    "power_iteration_without_orthogonalization",
    "relative_error",
    "svd_error",
    "compression_ratio",
    "track_errors",
    "time_methods",
    "check_orthogonalize",
    "check_power_step",
]


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of an (n, r) or a batch of (b, n, r) matrices, in place.

    Column i is normalized, then its component is removed from every later column. A column that
    is (or becomes) all zeros stays all zeros instead of turning into NaN: with ``epsilon`` > 0
    each norm gets ``epsilon`` added (as torch's PowerSGD does); with ``epsilon`` = 0 a zero norm
    is explicitly left undivided. Returns ``matrices``.
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if matrices.dim() not in (2, 3):
        raise ValueError(f"expected an (n, r) or (b, n, r) tensor, got shape {tuple(matrices.shape)}")
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


def _check_rank(M: torch.Tensor, rank: int) -> None:
    if M.dim() not in (2, 3):
        raise ValueError(f"expected a matrix (n, m) or a batch (b, n, m), got shape {tuple(M.shape)}")
    limit = min(M.shape[-2], M.shape[-1])
    if not 1 <= rank <= limit:
        raise ValueError(f"rank must be between 1 and min(n, m) = {limit} for a {tuple(M.shape)} matrix, got {rank}")


def power_iteration(M: torch.Tensor, rank: int, iters: int = 1, q: torch.Tensor | None = None,
                    generator: torch.Generator | None = None, epsilon: float = 0.0):
    """``iters`` steps of subspace iteration; returns ``(P, Q)`` with ``M ~ P @ Q.T``.

    P has orthonormal columns. ``q`` (m x rank) warm-starts from a previous step's Q; otherwise Q
    starts as Gaussian noise from ``generator``. Works on batches (b, n, m) too.
    """
    _check_rank(M, rank)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    shape = (*M.shape[:-2], M.shape[-1], rank)
    if q is None:
        q = torch.randn(shape, generator=generator, dtype=M.dtype, device="cpu").to(M.device)
    elif tuple(q.shape) != shape:
        raise ValueError(f"q must have shape {shape}, got {tuple(q.shape)}")
    Q = q
    for _ in range(iters):
        P = orthogonalize_(M @ Q, epsilon)
        # (P^T M)^T rather than M^T P: the same numbers, but on the CPU the product with a
        # transposed *large* operand was measured several times slower.
        Q = (P.mT @ M).mT
    return P, Q


def power_iteration_without_orthogonalization(M: torch.Tensor, rank: int, iters: int,
                                              generator: torch.Generator | None = None) -> torch.Tensor:
    """The naive block version, to see why orthogonalization is needed: returns the r directions.

    Each column is just a single-vector power iteration, so every column converges to the *same*
    top singular vector. Columns are rescaled to unit length after each step (only to avoid
    overflow; scaling does not change directions).
    """
    _check_rank(M, rank)
    X = torch.randn(M.shape[-2], rank, generator=generator, dtype=M.dtype)
    for _ in range(iters):
        X = M @ (M.mT @ X)
        X = X / torch.linalg.vector_norm(X, dim=0, keepdim=True)
    return X


def relative_error(M: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> float:
    """||M - P Q^T||_F / ||M||_F."""
    return (torch.linalg.norm(M - P @ Q.mT) / torch.linalg.norm(M)).item()


def svd_error(M: torch.Tensor, rank: int) -> float:
    """The best possible relative error at ``rank`` (Eckart-Young): sqrt(sum_{i>=rank} s_i^2 / sum s_i^2)."""
    s = torch.linalg.svdvals(M.double())
    energy = s.square()
    return (energy[rank:].sum() / energy.sum()).sqrt().item()


def compression_ratio(n: int, m: int, rank: int) -> float:
    """Numbers in M over numbers in P and Q: n m / ((n + m) rank)."""
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


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_methods(shapes, rank: int = 2, repeats: int = 5, seed: int = 0, progress: bool = False) -> list[dict]:
    """Median seconds of a full SVD, ``torch.svd_lowrank`` and one power-iteration step, per shape."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    if progress:
        from tqdm.auto import tqdm

        shapes = tqdm(shapes, desc="timing")
    for n, m in shapes:
        M = torch.randn(n, m, generator=g)
        q = torch.randn(m, rank, generator=g)
        row = {"shape": (n, m)}
        for key, fn in (
            ("svd_s", lambda M=M: torch.linalg.svd(M, full_matrices=False)),
            ("svd_lowrank_s", lambda M=M: torch.svd_lowrank(M, q=rank, niter=2)),
            ("power_step_s", lambda M=M, q=q: power_iteration(M, rank, 1, q=q)),
        ):
            row[key] = _median_time(fn, repeats)
        rows.append(row)
    return rows


# --- exercises --------------------------------------------------------------------------------

def _exercise_matrices(shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in shapes]


def check_orthogonalize(student_fn) -> bool:
    """Exercise: ``student_fn(matrices)`` orthonormalizes the columns in place, like ``orthogonalize_``."""
    cases = [(m,) for m in _exercise_matrices([(6, 1), (20, 3), (4, 30, 2)])]
    zero = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    zero[:, 1] = 0
    cases.append((zero,))
    return check(student_fn, orthogonalize_, cases, name=getattr(student_fn, "__name__", "orthogonalize"))


def _one_step(M, Q):
    return power_iteration(M, Q.shape[-1], 1, q=Q)


def check_power_step(student_fn) -> bool:
    """Exercise: ``student_fn(M, Q)`` returns ``(P, Q_new)``: one step of subspace iteration."""
    cases = [tuple(_exercise_matrices([(30, 20), (20, 2)])), tuple(_exercise_matrices([(16, 40), (40, 3)]))]
    return check(student_fn, _one_step, cases, name=getattr(student_fn, "__name__", "power_step"), rtol=1e-4,
                 atol=1e-5)
