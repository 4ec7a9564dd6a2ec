"""Check a student's answer against the course's reference and say clearly what is right or wrong.

Every notebook's exercises use :func:`check`: it runs the student's function and the reference on
the same inputs (each on its own copy, since many functions here work in place), compares the
results, and prints either a pass or the first case that differs: which input, expected, got.
"""

from __future__ import annotations

import copy
import math
import traceback

import torch

from course_lib.launch import WorkerError, spawn

__all__ = ["check", "check_distributed", "compare"]


def compare(expected, got, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """``None`` when ``got`` matches ``expected`` (tensors, numbers, sequences, dicts); else why not."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
            diff = (got - expected).abs().max().item()
            return f"values differ (largest difference {diff:.3g})"
        return None
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)):
            return f"expected a number, got {type(got).__name__}"
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            return f"expected {expected:.6g}, got {got:.6g}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"expected a sequence of {len(expected)} items, got {_short(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = compare(e, g, rtol, atol)
            if why:
                return f"item {i}: {why}"
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"expected keys {sorted(expected)}, got {_short(got)}"
        for k in expected:
            why = compare(expected[k], got[k], rtol, atol)
            if why:
                return f"key {k!r}: {why}"
        return None
    if got != expected:
        return f"expected {_short(expected)}, got {_short(got)}"
    return None


def _short(x, limit: int = 80) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(args) -> str:
    return "(" + ", ".join(_short(a, 40) for a in args) + ")"


def check(student, reference, cases, *, name: str | None = None, rtol: float = 1e-5,
          atol: float = 1e-6) -> bool:
    """Run ``student(*args)`` and ``reference(*args)`` for each ``args`` in ``cases``; print a verdict.

    When both return ``None`` (functions that work in place), the arguments they modified are
    compared instead. Returns ``True`` when every case passes.
    """
    name = name or getattr(student, "__name__", "your function")
    cases = list(cases)
    for i, args in enumerate(cases):
        if not isinstance(args, tuple):
            args = (args,)
        mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
        expected = reference(*theirs)
        try:
            got = student(*mine)
        except NotImplementedError:
            print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
            return False
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"[FAIL] {name}, case {i} {_describe(args)}: raised {type(e).__name__}: {e} "
                  f"(line {where.lineno})")
            return False
        if expected is None and got is None:
            expected, got = theirs, mine
        why = compare(expected, got, rtol, atol)
        if why:
            print(f"[FAIL] {name}, case {i} {_describe(args)}: {why}")
            return False
    print(f"[PASS] {name}: all {len(cases)} cases match the reference.")
    return True


def _run_both(rank, world_size, student, reference, make_inputs):
    args = make_inputs(rank, world_size)
    expected = reference(*copy.deepcopy(args))
    got = student(*copy.deepcopy(args))
    return args, expected, got


def check_distributed(student, reference, make_inputs, world_sizes=(2, 3), *, name: str | None = None,
                      timeout_s: float = 20.0, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Like :func:`check`, for functions that communicate: both run in real gloo processes.

    ``student`` and ``reference`` are top-level functions of importable modules (a student's lives
    in a ``.py`` file written from the notebook); ``make_inputs(rank, world_size)`` returns each
    rank's arguments. The reference runs first, then the student's function, on copies.
    """
    name = name or getattr(student, "__name__", "your function")
    for world_size in world_sizes:
        try:
            results = spawn(_run_both, world_size, student, reference, make_inputs,
                            backend="gloo", timeout_s=timeout_s)
        except WorkerError as e:
            if e.exc_type == "NotImplementedError":
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, "
                      f"save the file, then run this again.")
            else:
                print(f"[FAIL] {name}, world size {world_size}: rank {e.rank} raised {e.exc_type}: {e.message}")
            return False
        except TimeoutError:
            print(f"[FAIL] {name}, world size {world_size}: no answer after {timeout_s:g} s. A deadlock? "
                  f"Check that every send is matched by a receive that the peer can reach.")
            return False
        for rank, (args, expected, got) in enumerate(results):
            why = compare(expected, got, rtol, atol)
            if why:
                print(f"[FAIL] {name}, world size {world_size}, rank {rank}, input {_describe(args)}: {why}")
                return False
    print(f"[PASS] {name}: matches the reference on world sizes {', '.join(map(str, world_sizes))}.")
    return True
