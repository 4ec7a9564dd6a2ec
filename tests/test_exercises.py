import math

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives, sharding
from course_lib.launch import spawn
from course_lib.support import exercises as ex
from course_lib.support.exercises import NotAllowed, Rules, _Watch, check, compare
from solutions import nb04
from tests import sharding_exercise_workers as Z


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


# --- notebook 04: sharded data parallelism ---------------------------------------------------------


def test_zero2_rules_refuse_every_all_reduce_by_name_and_put_them_back():
    # no process group is needed: a refused function raises before torch is reached
    before = (dist.all_reduce, dist.ProcessGroup.__dict__["allreduce"], collectives.ring_all_reduce,
              collectives.naive_all_reduce, collectives.reduce_scatter, collectives.ring_reduce_scatter)
    with _Watch(ex.ZERO2_RULES, "zero2_gradient"):
        with pytest.raises(NotAllowed, match="zero2_gradient may not call dist.all_reduce: ZeRO-2 reduce-scatters"):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises(NotAllowed, match=r"may not call dist.all_reduce \(ProcessGroup.allreduce\)"):
            dist.ProcessGroup.allreduce(None, [torch.zeros(1)])
        for name in ("ring_all_reduce", "naive_all_reduce", "reduce_scatter"):
            with pytest.raises(NotAllowed, match=f"may not call collectives.{name}: .* half of what an all-reduce"):
                getattr(collectives, name)(torch.zeros(1))
        assert collectives.ring_reduce_scatter is before[-1]  # what the exercise is built on
    assert (dist.all_reduce, dist.ProcessGroup.__dict__["allreduce"], collectives.ring_all_reduce,
            collectives.naive_all_reduce, collectives.reduce_scatter, collectives.ring_reduce_scatter) == before


def test_zero2_units_and_the_numbers_a_padded_reduce_scatter_sends():
    # each world size's units: a length p does not divide, one it divides, one shorter than p
    for p, units in ex.ZERO2_SHAPES.items():
        lengths = [sum(g.numel() for g in ex.zero2_inputs(0, p, shapes)[0]) for shapes in units]
        assert [n % p != 0 for n in lengths] == [True, False, True] and lengths[-1] < p, (p, lengths)
    assert [ex.all_but_own_padded_chunk(n, 0, 2) for n in (17, 8, 1)] == [9, 4, 1]
    assert [ex.all_but_own_padded_chunk(n, 2, 3) for n in (14, 12, 2)] == [10, 8, 2]


def test_rules_count_the_numbers_of_tensors_in_lists_as_zero2_passes_them():
    # the rules count the input's numbers: a unit's gradients come as a list of tensors
    assert ex._input_numbers((torch.zeros(7),)) == 7
    assert ex._input_numbers(([torch.zeros(3, 4), torch.zeros(5)], None)) == 17
    assert ex._input_numbers((torch.zeros(2), (torch.zeros(3), "a"), 4, [1.0, 2.0])) == 5


def _zero_bytes_fp32(n, stage, p):  # 4 + 4 + 8 per parameter, fp32 training: 16 in all too, sharded otherwise
    shard = math.ceil(n / p)
    return 4 * (shard if stage >= 3 else n) + 4 * (shard if stage >= 2 else n) + 8 * (shard if stage >= 1 else n)


def test_bytes_compare_shows_every_digit_where_six_are_alike():
    assert compare(5500024, 5500016.5, rtol=0, atol=0) == "expected 5500024, got 5500016.5"
    assert compare(96.0, 92.0) == "expected 96, got 92"


def _zero_bytes_held(n, stage, shard):  # 2 + 2 + 12 bytes per parameter, each category n or shard numbers
    return 2 * (shard if stage >= 3 else n) + 2 * (shard if stage >= 2 else n) + 12 * (shard if stage >= 1 else n)


def _zero_bytes_without_ceil(n, stage, p):
    return _zero_bytes_held(n, stage, n / p)  # a fraction of a number where p does not divide n


def _zero_bytes_floor(n, stage, p):
    return _zero_bytes_held(n, stage, n // p)  # the remainder's numbers held by nobody


def _zero_bytes_stage_shards_one_more(n, stage, p):  # stage 1 read as "optimizer state and gradients"
    return nb04.my_zero_bytes(n, min(stage + 1, 3) if stage else 0, p)


def _zero_bytes_by_the_calculator(n, stage, p):  # the notebook's widget: it calls sharding.bytes_per_rank
    from course_lib.support.widgets import MemoryCalculator
    calculator = MemoryCalculator(n_params=n, world_size=p, stage=stage, optimizer="adam", precision="mixed")
    return calculator.ledger()["total"]


def _bytes_sent_without_ceil(n, stage, p):
    return 4 * (3 if stage == 3 else 2) * (p - 1) * n // p  # (p - 1)/p of the unpadded vector


def _bytes_sent_one_gather_at_stage_3(n, stage, p):
    return 4 * 2 * (p - 1) * math.ceil(n / p)  # the parameters gathered once, kept for backward


def _bytes_sent_first_step(n, stage, p):
    return 4 * {0: 2, 1: 1, 2: 1, 3: 3}[stage] * (p - 1) * math.ceil(n / p)  # the all-gather of stages 1, 2 forgotten


# wrong answers to notebook 04's exercises, and what the check says (test_solutions.py counts them too)
# the first unit checked: 17 numbers, which 2 does not divide
_ZERO2_UNIT = "world size 2, rank 0, gradients of shapes [(3, 4), (5,)] (17 numbers)"
SHARDING_NEAR_MISSES = [
    (ex.check_zero2_gradient, Z.zero2_by_all_reduce, "may not call dist.all_reduce: ZeRO-2 reduce-scatters"),
    (ex.check_zero2_gradient, Z.zero2_by_imported_all_reduce, "may not call dist.all_reduce (ProcessGroup.allreduce)"),
    (ex.check_zero2_gradient, Z.zero2_by_ring_all_reduce, "may not call collectives.ring_all_reduce"),
    (ex.check_zero2_gradient, Z.zero2_by_course_reduce_scatter, "may not call collectives.reduce_scatter"),
    # not refused by name, but it sends what an all-reduce sends
    (ex.check_zero2_gradient, Z.zero2_by_imported_ring_all_reduce,
     f"{_ZERO2_UNIT}: sent 18 numbers, not 9; ZeRO-2 reduce-scatters"),
    (ex.check_zero2_gradient, Z.zero2_sum, f"{_ZERO2_UNIT}: values differ"),
    (ex.check_zero2_gradient, Z.zero2_whole_gradient,
     f"{_ZERO2_UNIT}: returned 18 numbers; return c = ceil(17/2) = 9 numbers, this rank's slice of the flat "
     "gradient padded with zeros to a multiple of p (18 numbers)"),
    # tensor_split's chunks of the unpadded 17: rank 0 keeps 9 numbers (the right ones) but sends 8
    (ex.check_zero2_gradient, Z.zero2_unpadded, f"{_ZERO2_UNIT}: sent 8 numbers, not 9"),
    (ex.check_zero2_gradient, Z.zero2_view,
     f"{_ZERO2_UNIT}: the slice is a view that keeps the whole padded gradient alive (a storage of 72 bytes behind "
     "9 numbers); copy it (`.clone()`) or divide into a new tensor: ZeRO-2 keeps 1/p of the gradient"),
    (ex.check_zero2_gradient, Z.zero2_wrong_rank, f"{_ZERO2_UNIT}: values differ"),
    (ex.check_zero2_gradient, Z.zero2_reversed, f"{_ZERO2_UNIT}: values differ"),
    (ex.check_bytes_per_rank, lambda n, stage, p: sharding.bytes_per_rank(n, stage, p, "adam", "mixed")["total"],
     "course_lib.sharding.bytes_per_rank is refused here"),
    (ex.check_bytes_per_rank, _zero_bytes_by_the_calculator, "course_lib.sharding.bytes_per_rank is refused here"),
    (ex.check_bytes_per_rank, _zero_bytes_fp32, "case 1 (7500000000, 1, 64): expected 31406250000, got"),
    (ex.check_bytes_per_rank, _zero_bytes_without_ceil, "case 5 (1000003, 1, 8): expected 5500024, got 5500016.5"),
    (ex.check_bytes_per_rank, _zero_bytes_floor, "case 5"),
    (ex.check_bytes_per_rank, _zero_bytes_stage_shards_one_more, "case 1"),
    (ex.check_zero3_bytes_sent, _bytes_sent_without_ceil, "case 5 (23, 1, 2): expected 96, got 92"),
    (ex.check_zero3_bytes_sent, _bytes_sent_one_gather_at_stage_3, "case 3"),
    (ex.check_zero3_bytes_sent, _bytes_sent_first_step, "case 1"),
]


@pytest.mark.parametrize("check, wrong, says", SHARDING_NEAR_MISSES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(SHARDING_NEAR_MISSES)])
def test_sharding_near_misses_fail(check, wrong, says, capsys):
    before = sharding.bytes_per_rank
    assert not check(wrong)
    out = capsys.readouterr().out
    assert "[FAIL]" in out and says in out, out
    assert sharding.bytes_per_rank is before  # put back, even after a refusal


def test_zero2_another_right_answer_passes(capsys):
    assert ex.check_zero2_gradient(Z.zero2_divided_first), capsys.readouterr().out  # divides, then reduce-scatters


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_sent_reference_is_what_sharded_data_parallel_sends(world_size):
    for rank, rows in enumerate(spawn(Z.measure_bytes_sent, world_size, backend="gloo")):
        assert {row["n_params"] % world_size == 0 for row in rows} == {True, False}  # padded and not
        for row in rows:
            n, stage, sent = row["n_params"], row["stage"], row["sent"]
            formula = ex.zero_bytes_sent(n, stage, world_size)
            assert formula == nb04.my_bytes_sent(n, stage, world_size)
            if stage == 0 and n % world_size:
                # stage 0 pads nothing: a ring all-reduce of tensor_split's chunks sends every chunk but two
                # (the next rank's, then the one after), so the exercise asks stage 0 only where p divides n
                chunks = [len(c) for c in torch.empty(n).tensor_split(world_size)]
                skipped = chunks[(rank + 1) % world_size] + chunks[(rank + 2) % world_size]
                assert sent == [4 * (2 * n - skipped)] * 3 and sent[0] < formula, (rank, n, sent)
                continue
            assert sent[1:] == [formula] * 2, (rank, n, stage, sent)
            # the first step of stages 1 and 2 has no all-gather: the shard has not changed yet
            assert sent[0] == (formula // 2 if stage in (1, 2) else formula), (rank, n, stage, sent)
