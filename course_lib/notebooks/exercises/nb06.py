"""Notebook 06's exercises (power iteration): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import math

import numpy as np
import torch

from course_lib import (
    lowrank,
)
from course_lib.notebooks.exercises.core import _name, _refusing, _scipy_linalg, _short, check


def _nearly_dependent(n: int, r: int, condition: float, seed: int) -> torch.Tensor:
    """An (n, r) float64 matrix whose singular values fall from 1 to 1/condition: nearly dependent
    columns, as the products of power iteration become without orthogonalization (notebook 06)."""
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
if _scipy_linalg is not None:
    _FACTORIZATIONS += [(_scipy_linalg, name) for name in ("qr", "svd", "eig", "eigh", "cholesky", "orth", "polar",
                                                           "qr_multiply", "rq", "null_space")]


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
    return check(_without_factorizations(student_fn), _rank1_error_measured, cases,
                 name=_name(student_fn, "rank1_error"),
                 refuse=(lowrank.power_iteration, lowrank.power_step, lowrank.relative_error, lowrank.svd_error),
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
