"""course_lib.verdicts: the gap's standard error from the formula, and verdicts two standard errors
from their line, checked on hand-made numbers (including those a one-standard-error or a
signed rule would call otherwise)."""

import math

import pytest

from course_lib import verdicts as V


def test_difference_and_its_standard_error():
    gap, se = V.difference(97.5, 0.8, 94.6, 0.8, 3)
    assert gap == pytest.approx(2.9) and se == pytest.approx(math.sqrt(2 * 0.64 / 3))
    assert V.difference(1.0, 0.0, 1.0, 0.0, 2) == (0.0, 0.0)


@pytest.mark.parametrize("gap, se, limit, expected", [
    (0.5, 0.2, 2, V.WITHIN),  # 1.5 below the line, 0.4 needed
    (1.5, 0.3, 2, V.UNDECIDED),  # 0.5 below the line: a one-standard-error rule would say "within"
    (-1.5, 0.3, 2, V.UNDECIDED),  # the size of the gap counts, not its sign
    (-0.5, 0.2, 2, V.WITHIN),
    (2.9, 0.67, 2, V.UNDECIDED),  # 0.9 above the line, 1.34 needed
    (-3.0, 0.4, 2, V.BEYOND),
    (1.46, 0.40, 0, V.BEYOND),  # limit 0: the two differ
    (0.64, 0.40, 0, V.UNDECIDED),
    (0.0, 0.0, 0, V.UNDECIDED),  # equal means and no spread: nothing to tell apart
])
def test_verdicts_are_given_two_standard_errors_from_the_line(gap, se, limit, expected):
    assert V.verdict(gap, se, limit) == expected


@pytest.mark.parametrize("call, message", [
    (lambda: V.difference(1, 0.1, 1, 0.1, 1), "at least 2"),
    (lambda: V.difference(1, 0.1, 1, 0.1, 2.0), "number of runs"),
    (lambda: V.difference(1, -0.1, 1, 0.1, 3), "standard deviations"),
    (lambda: V.difference(1, math.nan, 1, 0.1, 3), "standard deviations"),
    (lambda: V.verdict(1.0, -0.1, 2), "se and limit"),
    (lambda: V.verdict(1.0, 0.1, -2), "se and limit"),
])
def test_bad_input_is_refused_with_what_to_pass(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_paired_differences_cancel_what_the_seeds_share():
    a, b = [96.0, 98.0, 94.0], [95.5, 97.6, 93.3]  # seeds far apart, each pair close
    gap, se = V.paired(a, b)
    assert gap == pytest.approx(0.5333, abs=1e-4) and se == pytest.approx(0.0882, abs=1e-4)
    unpaired = V.difference(96.0, 2.0, 95.4667, 2.1502, 3)[1]
    assert V.verdict(gap, se, 0) == V.BEYOND and V.verdict(gap, unpaired, 0) == V.UNDECIDED
    with pytest.raises(ValueError, match="same length"):
        V.paired([1.0, 2.0], [1.0])


def test_a_signed_verdict_asks_about_one_direction():
    # "at most 2 points behind": 0.1 ahead with a standard error of 1 is decided, though |gap| < 2 is not
    assert V.verdict(-0.1, 1.0, 2, signed=True) == V.WITHIN and V.verdict(-0.1, 1.0, 2) == V.UNDECIDED
    assert V.verdict(-5.0, 0.5, 2, signed=True) == V.WITHIN and V.verdict(-5.0, 0.5, 2) == V.BEYOND
    assert V.verdict(3.5, 0.5, 2, signed=True) == V.BEYOND
    assert V.verdict(2.5, 0.5, 2, signed=True) == V.UNDECIDED
