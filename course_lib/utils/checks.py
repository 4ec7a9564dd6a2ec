"""Argument checks for the public entry points: one line at the top of a function, an error that
names the argument, the value and what is allowed, so that the algorithm below stays in view.

A check belongs where a bad value would otherwise give a silently wrong result (a rank taken modulo
the world size, an empty micro-batch averaged to NaN) or an error that does not say what was wrong.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["boolean", "integer", "integers", "number"]


def _describe(low, high, low_open: bool) -> str:
    if low is not None and high is not None:
        return f"between {low} and {high}"
    if low is not None:
        return f"> {low}" if low_open else f">= {low}"
    return f"<= {high}" if high is not None else ""


def integer(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) within ``[low, high]``; else a ValueError naming ``name``."""
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or (low is not None and value < low) or (high is not None and value > high)):
        allowed = _describe(low, high, False)
        raise ValueError(f"{name} must be an integer{' ' + allowed if allowed else ''}, got {value!r}")
    return int(value)


def number(name: str, value, low: float | None = None, high: float | None = None, *,
           low_open: bool = False) -> float:
    """``value`` if it is a finite real number within the bounds (``low_open``: strictly above ``low``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        allowed = _describe(low, high, low_open)
        raise ValueError(f"{name} must be a finite number{' ' + allowed if allowed else ''}, got {value!r}")
    return float(value)


def integers(name: str, values, low: int | None = None) -> list[int]:
    """``values`` as a list if each is an integer >= ``low``; one integer is taken as a list of one."""
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a list of integers{f' >= {low}' if low is not None else ''}, "
                         f"got {values!r}") from None
    return [integer(f"each of {name}", v, low) for v in values]


def boolean(name: str, value) -> bool:
    """``value`` if it is True or False (numpy's bool too); else a TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)
