"""Notebook 05: power iteration."""

import torch

from course_lib import lowrank as L


def my_orthogonalize(matrices):
    m = matrices if matrices.dim() == 3 else matrices.unsqueeze(0)
    for i in range(m.shape[2]):
        col = m[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        col /= torch.where(norm == 0, torch.ones_like(norm), norm)  # a zero column stays zero
        rest = m[:, :, i + 1 :]
        rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def my_power_step(M, Q):
    P = L.orthogonalize_(M @ Q)
    return P, M.T @ P


def my_smallest_rank(M, max_error):
    # Eckart-Young: the best rank-r error is the energy beyond the first r singular values
    energy = torch.linalg.svdvals(M.double()).square()
    for r in range(1, len(energy) + 1):
        if (energy[r:].sum() / energy.sum()).sqrt().item() <= max_error:
            return r
    return len(energy)


def my_largest_worth_rank(n, m, min_compression_rate):
    # (n + m) r * rate < n m  <=>  r < n m / ((n + m) rate)
    r = 0
    while r + 1 <= min(n, m) and (n + m) * (r + 1) * min_compression_rate < n * m:
        r += 1
    return r
