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
