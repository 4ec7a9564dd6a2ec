"""The course's dataset and model: scikit-learn's bundled handwritten digits and a small MLP.

Bundled with scikit-learn (1,797 images of 8x8 pixels, 10 classes), so nothing is downloaded.
Every notebook that trains uses these two functions, so their numbers are comparable.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from course_lib.utils import checks
from course_lib.utils.rng import global_generator

__all__ = ["digits_tensors", "mlp", "batch_slice", "dirichlet_shards", "gradient_snapshots"]


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits()`` returns them: ``(data, target)``, read once per process.

    Read from the file scikit-learn ships, as ``load_digits`` reads it, without importing scikit-learn:
    that import takes most of a second, in every process that trains (each worker server, each
    notebook kernel, each fresh interpreter). ``tests/test_digits.py`` checks the arrays against
    ``load_digits()``.
    """
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / "datasets" / "data" / "digits.csv.gz" if locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"scikit-learn's digits file was not found (looked for {path}): install "
                                f"the course's pinned scikit-learn (`make install`, or "
                                f"pip install -c constraints.txt -e .)")
    table = np.loadtxt(path, delimiter=",")  # 64 pixels, then the label, on each row
    return table[:, :-1], table[:, -1].astype(int)


def digits_tensors(test_fraction: float = 0.25, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: float32 pixels scaled to [0, 1], int64 labels.

    The split is a fixed permutation drawn from ``seed``, the same on every machine.
    """
    checks.number("test_fraction", test_fraction, 0, 1, low_open=True)
    if test_fraction == 1:
        raise ValueError("test_fraction must be below 1: a test fraction of 1 leaves no training data")
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(round(len(x) * test_fraction))
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def mlp(hidden: int = 64, depth: int = 2, seed: int = 0, n_in: int = 64, n_out: int = 10) -> nn.Sequential:
    """An ordinary ``nn.Sequential`` MLP with ``depth`` hidden layers, initialized from ``seed``."""
    for name, value, low in (("hidden", hidden, 1), ("depth", depth, 0), ("n_in", n_in, 1), ("n_out", n_out, 1)):
        checks.integer(name, value, low)
    with global_generator:  # the layers draw their weights from the global generator, seeded here
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = n_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, n_out))
        return nn.Sequential(*layers)


def batch_slice(step: int, batch_size: int, n: int, rank: int = 0, world_size: int = 1) -> slice:
    """Where, in a dataset of ``n`` (in a fixed shuffled order), ``rank`` finds its share of batch ``step``.

    Batches of ``batch_size`` follow each other and wrap around before running off the end: the
    batch of step s starts at ``(s * batch_size) % (n - batch_size + 1)``. Each of ``world_size``
    ranks takes the next ``batch_size / world_size`` items of it, in rank order, so the ranks
    together see exactly the batch one process would.
    """
    checks.integer("step", step, 0)
    checks.integer("world_size", world_size, 1)
    checks.integer("rank", rank, 0, world_size - 1)
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and the dataset's {n}, got {batch_size}")
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} must be divisible by world_size {world_size}")
    per_rank = batch_size // world_size
    start = (step * batch_size) % (n - batch_size + 1) + rank * per_rank
    return slice(start, start + per_rank)


def dirichlet_shards(labels: torch.Tensor, world_size: int, alpha: float, seed: int = 0,
                     min_size: int = 1) -> list[torch.Tensor]:
    """A non-i.i.d. split of a labelled dataset over ``world_size`` ranks, as federated-learning
    benchmarks draw one (Yurochkin et al. 2019; Hsu, Qi & Brown 2019, arXiv:1909.06335, draw a class mix
    per client instead): for each class, the ranks' shares of its samples are drawn from a
    Dirichlet(``alpha``) distribution, so shards differ in size and mix. Small ``alpha`` gives each rank
    a few classes; large ``alpha``, about every class in its share. Returns each rank's indices into ``labels``
    (disjoint, together every index once), the same on every rank for the same ``seed``. A draw that
    leaves a rank fewer than ``min_size`` samples is drawn again (up to 100 times).
    """
    checks.integer("world_size", world_size, 1)
    checks.number("alpha", alpha, 0, low_open=True)
    checks.integer("min_size", min_size, 0)
    if min_size * world_size > len(labels):
        raise ValueError(f"{len(labels)} samples cannot give each of {world_size} ranks {min_size}: lower min_size")
    generator, shares = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for _ in range(100):
        shards = _dirichlet_draw(labels, world_size, alpha, generator, shares)
        if min(len(shard) for shard in shards) >= min_size:
            return shards
    raise ValueError(f"100 Dirichlet({alpha:g}) draws each left some rank under {min_size} samples of "
                     f"{len(labels)} over {world_size} ranks: raise alpha or lower world_size")


def _dirichlet_draw(labels, world_size, alpha, generator, shares) -> list[torch.Tensor]:
    shards: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for label in torch.unique(labels).tolist():
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        share = shares.dirichlet([alpha] * world_size)  # this class's share for each rank
        cuts = np.round(np.cumsum(share) * len(members)).astype(int).tolist()
        start = 0
        for rank, end in enumerate(cuts):
            shards[rank].append(members[start:end])
            start = end
    return [torch.cat(parts).sort().values for parts in shards]


def gradient_snapshots(steps: int, hidden: int = 256, batch_size: int = 64, lr: float = 0.05,
                       seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Train the digits MLP with SGD for ``steps`` steps; each step's weight gradients, by layer name.

    Real gradients for the low-rank notebooks: consecutive steps change slowly, and their spectra
    decay fast, unlike random matrices.
    """
    checks.integer("steps", steps, 0)
    checks.number("lr", lr, 0, low_open=True)
    x_train, y_train, _, _ = digits_tensors(seed=seed)
    model = mlp(hidden=hidden, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    out = []
    for step in range(steps):
        # (slicing as if the last example were not there: the windows these snapshots have always
        # used, from which the notebooks' stored numbers come)
        idx = order[batch_slice(step, batch_size, len(x_train) - 1)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        out.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.dim() == 2})
        opt.step()
    return out
