"""Notebook 06: power iteration."""

import torch


def my_stable_orthogonalize(X):
    # Householder: reflect column k onto a multiple of e_k, which zeroes it below the diagonal without
    # subtracting nearly equal columns from each other (what makes Gram-Schmidt lose orthogonality).
    # The product of the reflections, applied to the first r columns of the identity, is P.
    n, r = X.shape
    A = X.clone()
    vs = []
    for k in range(r):
        x = A[k:, k]
        v = x.clone()
        alpha = torch.linalg.vector_norm(x)
        v[0] += alpha if x[0] >= 0 else -alpha  # the sign that adds, never cancels
        norm = torch.linalg.vector_norm(v)
        if norm > 0:
            v /= norm
            A[k:, k:] -= 2 * torch.outer(v, v @ A[k:, k:])
        vs.append(v)
    P = torch.eye(n, r, dtype=X.dtype)
    for k in reversed(range(r)):
        P[k:] -= 2 * torch.outer(vs[k], vs[k] @ P[k:])
    return P


def my_rank1_error(s, c, k):
    # q = sum c_i v_i; M v_i = s_i u_i and M^T u_i = s_i v_i, so after k steps
    # P ~ M (M^T M)^(k-1) q = sum s_i^(2k-1) c_i u_i. For a unit P, ||M - P P^T M||^2 = ||M||^2 - ||P^T M||^2,
    # and ||P^T M||^2 = sum s_i^2 (P . u_i)^2.
    a = s ** (2 * k - 1) * c
    w = a.square() / a.square().sum()  # (P . u_i)^2
    energy = s.square()
    return (1 - (w * energy).sum() / energy.sum()).clamp(min=0).sqrt().item()


def my_smallest_rank(M, max_error):
    # Eckart-Young: the best rank-r error is the energy beyond the first r singular values
    energy = torch.linalg.svdvals(M.double()).square()
    for r in range(1, len(energy) + 1):
        if (energy[r:].sum() / energy.sum()).sqrt().item() <= max_error:
            return r
    return len(energy)


def my_pq_singular_values(P, Q):
    # For P with orthonormal columns, ||P Q^T x|| = ||Q^T x|| for every x: P Q^T and Q^T (r x m) have the
    # same singular values, and Q's r x r Gram matrix Q^T Q holds their squares as its eigenvalues.
    # Q's column norms are not them: Q's columns are orthogonal only once the iteration has converged.
    return torch.linalg.eigvalsh(Q.mT @ Q).clamp(min=0).sqrt().flip(0)
