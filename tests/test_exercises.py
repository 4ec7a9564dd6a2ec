import pytest
import torch
import torch.distributed as dist

from course_lib.support.exercises import NotAllowed, Rules, _Watch, check, compare


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

    def right(t):  # the same result another way
        t.add_(t)

    def wrong(t):
        t.add_(1)

    assert check(right, ref, [torch.arange(4.0)], name="inplace")
    assert not check(wrong, ref, [torch.arange(4.0)], name="inplace")
    assert "[FAIL]" in capsys.readouterr().out.splitlines()[-1]


def test_rules_say_which_count_is_off():
    one = Rules(collectives=1, why="one, please")
    assert one.broken({"collectives": ["all_reduce"], "sends": 0}, 2) is None
    assert one.broken({"collectives": [], "sends": 3}, 2) == "called 0 collectives (none); one, please"
    log = Rules(sends={2: 1, 4: 2}, why="log2 p")
    assert log.broken({"collectives": [], "sends": 2}, 4) is None
    assert log.broken({"collectives": [], "sends": 2}, 2) == "sent 2 messages; log2 p"


def test_the_watch_refuses_collectives_and_puts_torch_back():
    # no process group is needed: a refused collective raises before torch is reached
    before = (dist.all_reduce, dist.distributed_c10d.all_gather, dist.ProcessGroup.__dict__["allreduce"])
    with _Watch(Rules(point_to_point_only=True), "my_fn"):
        with pytest.raises(NotAllowed, match="my_fn may use only dist.send.*; it called dist.all_reduce"):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises(NotAllowed, match="it called dist.all_gather"):
            dist.distributed_c10d.all_gather([torch.zeros(1)], torch.zeros(1))
        with pytest.raises(NotAllowed, match=r"ProcessGroup.allreduce"):
            dist.ProcessGroup.allreduce(None, [torch.zeros(1)])
    assert (dist.all_reduce, dist.distributed_c10d.all_gather, dist.ProcessGroup.__dict__["allreduce"]) == before


def test_compare_shapes_and_numbers():
    assert compare(torch.zeros(2), torch.zeros(3)).startswith("expected shape")
    assert compare(1.0, 1.5) == "expected 1, got 1.5"
    assert compare({"a": 1}, {"a": 1}) is None
    assert compare([1, 2], (1, 3)).startswith("item 1")
