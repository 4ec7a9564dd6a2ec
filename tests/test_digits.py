"""The digits the course trains on are scikit-learn's, read without importing scikit-learn."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from course_lib.utils import digits


def test_the_arrays_are_load_digits_own():
    pixels, labels = digits._digits_arrays()
    want = load_digits()
    assert pixels.dtype == want.data.dtype and labels.dtype == want.target.dtype
    assert np.array_equal(pixels, want.data) and np.array_equal(labels, want.target)


def test_without_scikit_learn_the_error_says_what_to_install(monkeypatch):
    digits._digits_arrays.cache_clear()
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)
    try:
        with pytest.raises(FileNotFoundError, match="install the course's pinned scikit-learn"):
            digits.digits_tensors()
    finally:
        digits._digits_arrays.cache_clear()


def test_the_split_is_the_same_tensors_every_call_and_callers_cannot_change_it():
    first = digits.digits_tensors()
    first[0].add_(1.0)  # a caller changing its copy
    again = digits.digits_tensors()
    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_test = round(len(x) * 0.25)  # 449 of 1,797
    assert torch.equal(again[0], x[order][n_test:]) and torch.equal(again[2], x[order][:n_test])


def test_training_data_does_not_import_scikit_learn():
    code = ("import sys; from course_lib.utils.digits import digits_tensors; digits_tensors(); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_dirichlet_split_deals_every_sample_once_and_skews_the_classes_as_alpha_falls():
    dirichlet_shards = digits.dirichlet_shards

    _, y, _, _ = digits.digits_tensors()

    def top_class_share(shards):  # the mean over ranks of the largest class's share of the rank's shard
        return sum(torch.bincount(y[s], minlength=10).max().item() / len(s) for s in shards) / len(shards)

    skewed, even = dirichlet_shards(y, 8, 0.1, seed=0), dirichlet_shards(y, 8, 1000.0, seed=0)
    for shards in (skewed, even):
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(len(y)))
    assert top_class_share(skewed) > 0.45 and top_class_share(even) < 0.15  # i.i.d. would give about 0.1
    assert all(torch.equal(a, b) for a, b in zip(skewed, dirichlet_shards(y, 8, 0.1, seed=0)))
    assert not all(torch.equal(a, b) for a, b in zip(skewed, dirichlet_shards(y, 8, 0.1, seed=1)))
    assert min(len(s) for s in dirichlet_shards(y, 64, 0.5, seed=0, min_size=8)) >= 8  # drawn again until so
    with pytest.raises(ValueError, match="cannot give each of 64 ranks 100"):
        dirichlet_shards(y, 64, 0.1, min_size=100)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_shards(y, 8, 0.0)


def test_train_config_refuses_an_unknown_split_and_a_validation_fraction_out_of_range():
    from course_lib.train import TrainConfig

    with pytest.raises(ValueError, match="split must be 'iid' or 'dirichlet'"):
        TrainConfig(split="non-iid")
    with pytest.raises(ValueError, match="dirichlet_alpha must be a number > 0"):
        TrainConfig(split="dirichlet", dirichlet_alpha=0)
    with pytest.raises(ValueError, match=r"validation_fraction must be in \[0, 1\)"):
        TrainConfig(validation_fraction=1.0)
