import torch

from course_lib.support.exercises import check, compare


def double(x):
    return x * 2


def test_pass_fail_and_not_yet(capsys):
    cases = [torch.arange(3.0), torch.ones(2, 2)]
    assert check(lambda x: x + x, double, cases, name="double")
    assert "[PASS] double: all 2 cases" in capsys.readouterr().out

    assert not check(lambda x: x * 3, double, cases, name="double")
    out = capsys.readouterr().out
    assert "[FAIL] double, case 0" in out and "largest difference 2" in out

    def todo(x):
        raise NotImplementedError

    assert not check(todo, double, cases)
    assert "[not yet] todo" in capsys.readouterr().out

    assert not check(lambda x: x[10], double, cases, name="oops")
    assert "raised IndexError" in capsys.readouterr().out


def test_in_place_functions_compare_their_arguments(capsys):
    def ref(t):
        t.mul_(2)

    def wrong(t):
        t.add_(1)

    assert check(ref, ref, [torch.arange(4.0)], name="inplace")
    assert not check(wrong, ref, [torch.arange(4.0)], name="inplace")
    assert "[FAIL]" in capsys.readouterr().out.splitlines()[-1]


def test_compare_shapes_and_numbers():
    assert compare(torch.zeros(2), torch.zeros(3)).startswith("expected shape")
    assert compare(1.0, 1.5) == "expected 1, got 1.5"
    assert compare({"a": 1}, {"a": 1}) is None
    assert compare([1, 2], (1, 3)).startswith("item 1")
