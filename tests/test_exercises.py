import math

import pytest
import torch
import torch.distributed as dist
from torch.optim import SGD  # imported by name: bypasses `torch.optim.SGD`

from course_lib import collectives, costmodel, local_sgd, sharding
from course_lib.launch import spawn
from course_lib.notebooks import exercises as ex
from course_lib.notebooks.exercises import NotAllowed, Rules, check, compare
from course_lib.notebooks.exercises.core import _input_numbers, _Watch
from solutions import nb05, nb11
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


# --- notebook 05: sharded data parallelism ---------------------------------------------------------


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
    assert _input_numbers((torch.zeros(7),)) == 7
    assert _input_numbers(([torch.zeros(3, 4), torch.zeros(5)], None)) == 17
    assert _input_numbers((torch.zeros(2), (torch.zeros(3), "a"), 4, [1.0, 2.0])) == 5


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
    return nb05.my_zero_bytes(n, min(stage + 1, 3) if stage else 0, p)


def _zero_bytes_by_the_calculator(n, stage, p):  # the notebook's widget: it calls sharding.bytes_per_rank
    from course_lib.notebooks.widgets import MemoryCalculator
    calculator = MemoryCalculator(n_params=n, world_size=p, stage=stage, optimizer="adam", precision="mixed")
    return calculator.ledger()["total"]


def _bytes_sent_without_ceil(n, stage, p):
    return 4 * (3 if stage == 3 else 2) * (p - 1) * n // p  # (p - 1)/p of the unpadded vector


def _bytes_sent_one_gather_at_stage_3(n, stage, p):
    return 4 * 2 * (p - 1) * math.ceil(n / p)  # the parameters gathered once, kept for backward


def _bytes_sent_first_step(n, stage, p):
    return 4 * {0: 2, 1: 1, 2: 1, 3: 3}[stage] * (p - 1) * math.ceil(n / p)  # the all-gather of stages 1, 2 forgotten


# wrong answers to notebook 05's exercises, and what the check says (test_solutions.py counts them too)
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
            assert formula == nb05.my_bytes_sent(n, stage, world_size)
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


# --- notebook 11: local SGD, post-local SGD and DiLoCo ---------------------------------------------


def _deltas(shared, locals_):  # the pseudo-gradient, averaged over the ranks
    return [sum(s - rank[i] for rank in locals_) / len(locals_) for i, s in enumerate(shared)]


def _outer_plain_momentum(shared, locals_, momentum, lr=0.7, mu=0.9):  # nesterov=False: the step is the buffer
    d = _deltas(shared, locals_)
    buf = d if momentum is None else [mu * b + x for b, x in zip(momentum, d)]
    return [s - lr * b for s, b in zip(shared, buf)], buf


def _outer_delta_reversed(shared, locals_, momentum, lr=0.7, mu=0.9):  # Δ = θ_rank − θ_start
    return nb11.my_outer_step(shared, [[2 * s - x for s, x in zip(shared, rank)] for rank in locals_], momentum, lr, mu)


def _outer_summed(shared, locals_, momentum, lr=0.7, mu=0.9):  # Δ summed over the ranks, not averaged
    d = [len(locals_) * x for x in _deltas(shared, locals_)]
    buf = d if momentum is None else [mu * b + x for b, x in zip(momentum, d)]
    return [s - lr * (x + mu * b) for s, x, b in zip(shared, d, buf)], buf


def _outer_buffer_not_carried(shared, locals_, momentum, lr=0.7, mu=0.9):  # every step as if it were the first
    return nb11.my_outer_step(shared, locals_, None, lr, mu)


def _outer_in_place(shared, locals_, momentum, lr=0.7, mu=0.9):  # θ_start updated in place, as an optimizer does
    new_shared, new_momentum = nb11.my_outer_step(shared, locals_, momentum, lr, mu)
    for s, n in zip(shared, new_shared):
        s.copy_(n)
    return shared, new_momentum


def _outer_buffer_in_place(shared, locals_, momentum, lr=0.7, mu=0.9):  # torch's buffer.mul_(mu).add_(Δ)
    d = _deltas(shared, locals_)
    buf = d if momentum is None else [b.mul_(mu).add_(x) for b, x in zip(momentum, d)]
    return [s - lr * (x + mu * b) for s, x, b in zip(shared, d, buf)], buf


def _outer_mu_fixed(shared, locals_, momentum, lr=0.7, mu=0.9):  # the paper's 0.9 whatever mu is given
    return nb11.my_outer_step(shared, locals_, momentum, lr, 0.9)


def _outer_new_locals(shared, locals_, momentum, lr=0.7, mu=0.9):  # each rank's list reset to θ_start, in place
    out = nb11.my_outer_step(shared, locals_, momentum, lr, mu)
    for rank in locals_:
        rank[:] = [s.clone() for s in shared]
    return out


def _outer_update_as_buffer(shared, locals_, momentum, lr=0.7, mu=0.9):  # the look-ahead kept as the buffer
    new_shared, new_momentum = nb11.my_outer_step(shared, locals_, momentum, lr, mu)
    return new_shared, [x + mu * b for x, b in zip(_deltas(shared, locals_), new_momentum)]


def _outer_by_torch_sgd(shared, locals_, momentum, lr=0.7, mu=0.9):
    params = [s.clone().requires_grad_() for s in shared]
    torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=mu > 0)


def _outer_by_imported_sgd(shared, locals_, momentum, lr=0.7, mu=0.9):  # SGD imported by name, before the check
    params = [s.clone().requires_grad_() for s in shared]
    for p, x in zip(params, _deltas(shared, locals_)):
        p.grad = x
    SGD(params, lr=lr, momentum=mu, nesterov=mu > 0).step()


def _outer_by_diloco(shared, locals_, momentum, lr=0.7, mu=0.9):
    local_sgd.DiLoCo(shared, None, period=1)


def _break_even_at_or_below(c, n, r, p, a, b):  # ≥: the period at which the two only tie counts as faster
    spare = r - c
    return math.ceil(costmodel.ring_all_reduce_time(n, p, a, b) / spare) if spare > 0 else math.inf


def _break_even_bytes_every_step(c, n, r, p, a, b):  # only the latency shared by H steps, the bytes paid at each
    bandwidth_s = costmodel.ring_all_reduce_time(n, p, a, b) - 2 * (p - 1) * a
    spare = r - c - bandwidth_s
    return math.floor(2 * (p - 1) * a / spare) + 1 if spare > 0 else math.inf


def _break_even_without_latency(c, n, r, p, a, b):
    spare = r - c
    return math.floor(2 * (p - 1) / p * n / (b * 1e9) / spare) + 1 if spare > 0 else math.inf


def _break_even_algbw(c, n, r, p, a, b):  # the bytes over busbw, without the ring's 2(p − 1)/p
    spare = r - c
    return math.floor((2 * (p - 1) * a + n / (b * 1e9)) / spare) + 1 if spare > 0 else math.inf


def _break_even_not_rounded(c, n, r, p, a, b):
    spare = r - c
    return costmodel.ring_all_reduce_time(n, p, a, b) / spare if spare > 0 else math.inf


def _break_even_no_never(c, n, r, p, a, b):  # the formula everywhere: nothing said when no period is faster
    return math.floor(costmodel.ring_all_reduce_time(n, p, a, b) / (r - c)) + 1


def _break_even_only_equal_is_never(c, n, r, p, a, b):  # inf where the reference computes alone, not below it
    return math.inf if r == c else math.floor(costmodel.ring_all_reduce_time(n, p, a, b) / (r - c)) + 1


def _break_even_by_search(c, n, r, p, a, b):  # the course's step time, period by period
    H = 1
    while costmodel.periodic_step_time(c, n, H, p, a, b) >= r:
        H += 1
    return H


_OUTER_CASE_0 = "case 0 (2 ranks, shapes [(4, 3), (3,)], lr 0.7, mu 0.9)"
_TIE = "case 8 (0.5, 1250000000.0, 0.7500076293945312, 2, 1.52587890625e-05, 1.25)"
# wrong answers to notebook 11's exercises, and what the check says (test_solutions.py counts them too)
LOCAL_SGD_NEAR_MISSES = [
    (ex.check_outer_step, _outer_plain_momentum, f"{_OUTER_CASE_0}, outer step 1 of 4: new_shared: item 0: values"),
    (ex.check_outer_step, _outer_delta_reversed, f"{_OUTER_CASE_0}, outer step 1 of 4: new_shared: item 0: values"),
    (ex.check_outer_step, _outer_summed, f"{_OUTER_CASE_0}, outer step 1 of 4: new_shared: item 0: values differ"),
    (ex.check_outer_step, _outer_buffer_not_carried, f"{_OUTER_CASE_0}, outer step 2 of 4: new_shared: item 0"),
    (ex.check_outer_step, _outer_update_as_buffer, f"{_OUTER_CASE_0}, outer step 1 of 4: new_momentum: item 0"),
    (ex.check_outer_step, _outer_mu_fixed, "case 2 (3 ranks, shapes [(6, 4), (4,), (1,)], lr 0.5, mu 0.5), outer "
     "step 1 of 3: new_shared"),
    (ex.check_outer_step, _outer_in_place, f"{_OUTER_CASE_0}, outer step 1 of 4: changed `shared` in place; leave "
     "shared, locals_ and momentum as they were and return new tensors"),
    (ex.check_outer_step, _outer_buffer_in_place, f"{_OUTER_CASE_0}, outer step 2 of 4: changed `momentum` in place"),
    (ex.check_outer_step, _outer_new_locals, f"{_OUTER_CASE_0}, outer step 1 of 4: changed `locals_` in place"),
    (ex.check_outer_step, _outer_by_torch_sgd, f"{_OUTER_CASE_0}, outer step 1 of 4: torch.optim.SGD is refused here"),
    (ex.check_outer_step, _outer_by_imported_sgd, "torch.optim.SGD.step is refused here"),
    (ex.check_outer_step, _outer_by_diloco, "course_lib.local_sgd.DiLoCo is refused here"),
    (ex.check_break_even_period, _break_even_at_or_below, f"{_TIE}: expected 5, got 4"),
    (ex.check_break_even_period, _break_even_bytes_every_step, "case 0 (0.2, 496000000.0, 0.25, 2, 5e-05, 0.125): "
     "expected 80, got inf"),
    (ex.check_break_even_period, _break_even_without_latency, "case 5 (0.01, 4000000.0, 0.0105, 8, 5e-05, 12.5): "
     "expected 3, got 2"),
    (ex.check_break_even_period, _break_even_algbw, "case 1 (0.2, 496000000.0, 0.3, 8, 5e-05, 0.125): expected 70, "
     "got 40"),
    (ex.check_break_even_period, _break_even_not_rounded, "case 0 (0.2, 496000000.0, 0.25, 2, 5e-05, 0.125): "
     "expected 80, got 79.362"),
    (ex.check_break_even_period, _break_even_no_never, "case 9 (0.2, 496000000.0, 0.2, 8, 5e-05, 1.25): raised "
     "ZeroDivisionError"),
    (ex.check_break_even_period, _break_even_only_equal_is_never, "case 10 (0.2, 496000000.0, 0.15, 2, 5e-05, 12.5): "
     "expected inf, got 0"),
    (ex.check_break_even_period, lambda c, n, r, p, a, b: costmodel.break_even_period(c, n, r, p, a, b),
     "course_lib.costmodel.break_even_period is refused here"),
    (ex.check_break_even_period, _break_even_by_search, "course_lib.costmodel.periodic_step_time is refused here"),
]


def _refused_by_notebook_11():
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch wraps SGD.step once, at the first SGD
    return (torch.optim.SGD, torch.optim.SGD.step, torch.optim.Optimizer.step, local_sgd.DiLoCo,
            local_sgd.DiLoCo.step, costmodel.break_even_period, costmodel.periodic_step_time)


@pytest.mark.parametrize("check, wrong, says", LOCAL_SGD_NEAR_MISSES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(LOCAL_SGD_NEAR_MISSES)])
def test_local_sgd_near_misses_fail(check, wrong, says, capsys):
    before = _refused_by_notebook_11()
    assert not check(wrong)
    out = capsys.readouterr().out
    assert "[FAIL]" in out and says in out, out
    assert _refused_by_notebook_11() == before  # put back, even after a refusal


def _outer_another_way(shared, locals_, momentum, lr=0.7, mu=0.9):  # stacked, and in place on copies
    d = [torch.stack([s - rank[i] for rank in locals_]).mean(0) for i, s in enumerate(shared)]
    buf = [x.clone() for x in d] if momentum is None else [b.clone().mul_(mu).add_(x) for b, x in zip(momentum, d)]
    return [s.clone().add_(x.add(b, alpha=mu), alpha=-lr) for s, x, b in zip(shared, d, buf)], buf


def _break_even_by_step_time(c, n, r, p, a, b):  # the step time written out, period by period
    if r <= c:
        return math.inf
    H = 1
    while not c + costmodel.ring_all_reduce_time(n, p, a, b) / H < r:
        H += 1
    return H


def _break_even_by_ceil(c, n, r, p, a, b):  # in bits, then ceil, one more where H only ties
    spare = r - c
    if spare <= 0:
        return math.inf
    T = 2 * (p - 1) * a + n * 8 * 2 * (p - 1) / p / (b * 8e9)
    H = math.ceil(T / spare)
    return H + 1 if H * spare <= T else H


@pytest.mark.parametrize("check, answer", [(ex.check_outer_step, _outer_another_way),
                                           (ex.check_break_even_period, _break_even_by_step_time),
                                           (ex.check_break_even_period, _break_even_by_ceil)])
def test_local_sgd_other_right_answers_pass(check, answer, capsys):
    assert check(answer), capsys.readouterr().out


def test_the_outer_step_reference_is_the_nesterov_formula_and_plain_averaging_at_mu_0():
    for world_size, shapes, lr, mu, steps in ex.OUTER_STEP_CASES:
        momentum = None
        for shared, locals_, (new_shared, new_momentum) in ex.outer_step_rounds(world_size, shapes, lr, mu, steps, 0):
            assert len(locals_) == world_size and [tuple(t.shape) for t in shared] == shapes
            d = [torch.stack([s - rank[i] for rank in locals_]).mean(0) for i, s in enumerate(shared)]
            momentum = d if momentum is None else [mu * b + x for b, x in zip(momentum, d)]
            assert compare(momentum, new_momentum) is None
            assert compare([s - lr * (x + mu * b) for s, x, b in zip(shared, d, momentum)], new_shared) is None
            if (lr, mu) == (1.0, 0.0):  # local SGD: θ_start becomes the ranks' average
                average = [torch.stack([rank[i] for rank in locals_]).mean(0) for i in range(len(shapes))]
                assert compare(average, new_shared) is None
    assert {(w, lr, mu) for w, _, lr, mu, _ in ex.OUTER_STEP_CASES} >= {(2, 0.7, 0.9), (3, 0.7, 0.9), (2, 1.0, 0.0)}


def test_break_even_cases_are_far_from_ties_but_one_exact_tie():
    links = set()
    for i, (c, n, r, p, a, b) in enumerate(ex.BREAK_EVEN_PERIOD_CASES):
        links.add((b * 8, p))
        if r <= c:
            continue
        x = costmodel.ring_all_reduce_time(n, p, a, b) / (r - c)
        if i == 8:  # the tie: exact, however the student orders the arithmetic
            assert x == 4.0 and c + (2 * a + n / (b * 1e9)) / 4 == r and 4 * (r - c) == 2 * a + n / b / 1e9
            assert costmodel.periodic_step_time(c, n, 4, p, a, b) == r
        else:
            assert abs(x - round(x)) > 0.04, (i, x)
    assert {gbit for gbit, _ in links} == {1.0, 10.0, 100.0} and {p for _, p in links} == {2, 8}
