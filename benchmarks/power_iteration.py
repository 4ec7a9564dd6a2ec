"""One rank-2 power-iteration step against a full SVD at 1024 x 1024, and warm-start convergence.

Goals (issue: notebook 06): the step is at least 30x faster than torch.linalg.svd; after at most
10 warm-started steps on a real gradient its error is within 1% of the SVD optimum.
    .venv/bin/python benchmarks/power_iteration.py
"""

import statistics
import time

import torch

from course_lib import lowrank as L
from course_lib.utils.digits import gradient_snapshots


def main(repeats: int = 7):
    g = torch.Generator().manual_seed(0)
    M = torch.randn(1024, 1024, generator=g)
    q = torch.randn(1024, 2, generator=g)
    svd, step = [], []
    L.power_iteration(M, 2, q=q)
    torch.linalg.svd(M, full_matrices=False)
    for _ in range(repeats):  # interleaved, so both see the same machine
        t = time.perf_counter()
        torch.linalg.svd(M, full_matrices=False)
        svd.append(time.perf_counter() - t)
        t = time.perf_counter()
        L.power_iteration(M, 2, q=q)
        step.append(time.perf_counter() - t)
    s, p = statistics.median(svd), statistics.median(step)
    print(f"1024 x 1024, float32, {torch.get_num_threads()} threads, median of {repeats}:")
    print(f"  full SVD {s * 1e3:.1f} ms, one rank-2 power-iteration step {p * 1e3:.2f} ms: "
          f"speed-up {s / p:.0f}x (goal >= 30x)")

    grads = [snap["2.weight"] for snap in gradient_snapshots(12, hidden=1024)]
    fixed = grads[-1]
    best = L.svd_error(fixed, 2)
    errors = L.track_errors([fixed] * 10, 2)
    within = next((i + 1 for i, e in enumerate(errors) if e <= 1.01 * best), None)
    print("\nreal gradient (digits MLP, hidden layer 1024 x 1024, step 12), rank 2, warm-started steps:")
    print("  error / SVD optimum: " + " ".join(f"{e / best:.3f}" for e in errors))
    print(f"  within 1% of the optimum after {within} steps (goal <= 10)")
    moving = L.track_errors(grads, 2)
    ratios = [e / L.svd_error(m, 2) for e, m in zip(moving, grads)]
    print("consecutive gradients of training (each step a new matrix), warm start:")
    print("  error / that step's optimum: " + " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
