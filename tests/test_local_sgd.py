"""course_lib.local_sgd on real gloo processes: against torch's averager and post-local SGD, and DiLoCo
against the same algorithm computed another way (one process, the ranks one after another)."""

import pytest
import torch

from course_lib import local_sgd
from course_lib.launch import spawn
from course_lib.notebooks import local_sgd_runs as R
from tests import local_sgd_workers as W

CONFIGS = [(period, warmup, groups) for period in (1, 2, 4) for warmup in (0, 3) for groups in (False, True)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_periodic_averager_matches_torchs_at_every_step(world_size):
    outs = spawn(R.averagers, world_size, CONFIGS, backend="gloo")
    for rank, rows in enumerate(outs):
        for (period, warmup, groups), row in zip(CONFIGS, rows):
            assert row["worst"] <= 1e-6, (rank, period, warmup, groups, row["worst"])
            assert row["step"] == 8
            averaged = [s >= warmup and (s - warmup) % period == 0 for s in range(8)]
            # the ranks agree exactly after an average, and drift apart (own data) between averages
            assert row["agreed"] == averaged, (period, warmup, row["agreed"])
            ring = 4 * row["numel"] * 2 * (world_size - 1) // world_size
            # one ring all-reduce of the parameters per average (a length p divides: 2 (p-1)/p of them)
            if row["numel"] % world_size == 0:
                assert row["sent"] == [ring if a else 0 for a in averaged]
            else:
                assert all((s > 0) == a for s, a in zip(row["sent"], averaged))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", ["", "+subgroup"])
def test_post_local_sgd_matches_torchs(world_size, variant):
    ours = spawn(R.post_local, world_size, "course" + variant, backend="gloo")
    theirs = spawn(R.post_local, world_size, "torch" + variant, backend="gloo")
    for rank in range(world_size):
        for step, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank} step {step}")
    # the warm-up (3 steps) is plain data parallelism: the ranks agree; after it, without a gradient
    # all-reduce, they agree only on the averaging steps (3, 5, 7)
    agree = [all(torch.equal(out[step], ours[0][step]) for out in ours) for step in range(8)]
    on_schedule = [True, True, True, True, False, True, False, True]
    if variant:  # ranks 0 and 1 share a subgroup (on 2 ranks, the only one): their gradients stay averaged
        assert all(torch.equal(ours[0][step], ours[1][step]) for step in range(8))
        assert agree == ([True] * 8 if world_size == 2 else on_schedule)
    else:
        assert agree == on_schedule


def test_average_parameters_averages_what_it_is_given_and_outside_its_group_returns_at_once():
    outs = spawn(W.averaging_edges, 3, backend="gloo")
    for rank, out in enumerate(outs):
        # before any backward: every parameter replaced by the mean torch's all_gather gives
        assert out["mean_error"] < 1e-6
        # ranks 0 and 1 average over their pair; rank 2, outside it, keeps its values
        assert out["pair_average"] == ([0.5] * 5 if rank < 2 else [2.0] * 5)
        if rank == 2:
            assert out["collective_outside"] == (True, [2.0] * 3)
        # the averager leaves the parameter without a gradient alone, as torch's
        assert out["averager"] == ([1.0, 1.0], [float(rank)] * 2)


def test_post_local_sgd_optimizer_warns_when_a_state_dict_has_no_step():
    model = torch.nn.Linear(2, 2)
    opt = local_sgd.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          local_sgd.PeriodicModelAverager(period=2))
    opt.averager.step = 5
    with pytest.warns(UserWarning, match="does not contain a step counter"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    assert opt.averager.step == 0
    opt.averager.step = 5
    saved = opt.state_dict()
    opt.averager.step = 0
    opt.load_state_dict(saved)
    assert opt.averager.step == 5


@pytest.mark.parametrize("world_size, period", [(2, 3), (3, 2)])
def test_diloco_is_the_algorithm_computed_in_one_process(world_size, period):
    steps = 3 * period
    want = W.diloco_reference(world_size, period, steps)
    outs = spawn(W.diloco, world_size, period, steps, backend="gloo")
    for rank, out in enumerate(outs):
        for a, b in zip(out["params"], want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank}")
        assert out["communicated"] == [(s + 1) % period == 0 for s in range(steps)]


def test_diloco_with_a_plain_outer_step_is_local_sgd():
    # outer SGD with lr 1 and no momentum sets the shared copy to the mean of the ranks' parameters
    plain = spawn(W.diloco, 2, 4, 8, 1.0, 0.0, backend="gloo")
    local = spawn(W.local_sgd_adamw, 2, 4, 8, backend="gloo")
    for a, b in zip(plain[0]["params"], local[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # and the paper's outer step is not: Nesterov momentum with lr 0.7 moves elsewhere
    nesterov = spawn(W.diloco, 2, 4, 8, backend="gloo")
    assert max((a - b).abs().max().item() for a, b in zip(nesterov[0]["params"], local[0])) > 1e-4


@pytest.mark.parametrize("call, message", [
    (lambda: local_sgd.PeriodicModelAverager(0), "period"),
    (lambda: local_sgd.PeriodicModelAverager(2, warmup_steps=-1), "warmup_steps"),
    (lambda: local_sgd.PostLocalSGDState(None, None, -2), "start_localSGD_iter"),
    (lambda: local_sgd.PostLocalSGDOptimizer(object(), local_sgd.PeriodicModelAverager(2)), "torch.optim.Optimizer"),
    (lambda: local_sgd.DiLoCo([], torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 4), "none"),
    (lambda: local_sgd.DiLoCo([torch.zeros(1, requires_grad=True)], "adamw", 4), "inner must be"),
    (lambda: local_sgd.DiLoCo([p := torch.zeros(1, requires_grad=True)], torch.optim.SGD([p], lr=1), 0), "period"),
    (lambda: local_sgd.DiLoCo([p := torch.zeros(1, requires_grad=True)], torch.optim.SGD([p], lr=1), 4,
                              outer_momentum=1.5), "outer_momentum"),
    (lambda: local_sgd.average_parameters([3.0]), "parameters or parameter groups"),
])
def test_bad_input_is_refused_with_a_clear_message(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# course_lib.train's local SGD, post-local SGD, DiLoCo and AdamW (the bench's runs: benchmarks/local_sgd_at_scale.py)
# against notebook 11's own loop (local_sgd_runs.train, whose pieces are checked against torch's above)
TRAIN_CASES = [
    (dict(optimizer="adamw", lr=3e-3), dict(method="ddp-adamw", lr=3e-3)),
    (dict(averaging="local", period=2, momentum=0.9), dict(method="local", period=2)),
    (dict(averaging="local", period=2, local_sgd_start=3, momentum=0.9), dict(method="post-local", period=2, warmup=3)),
    (dict(averaging="diloco", period=2, optimizer="adamw", lr=3e-3), dict(method="diloco", period=2, lr=3e-3)),
]
AVERAGES = [8, 4, 3 + 3, 4]  # all-reduces in 8 steps: every step; steps 2, 4, 6, 8; 3 of DDP then 4, 6, 8; outer steps


@pytest.mark.parametrize("world_size", [2, 4])
def test_train_averaging_runs_are_notebook_11s(world_size):
    outs = spawn(W.train_and_notebook_loop, world_size, TRAIN_CASES, backend="gloo")
    numel = outs[0][0]["ours"].numel()
    for rank, rows in enumerate(outs):
        for (fields, _), row, averages in zip(TRAIN_CASES, rows, AVERAGES):
            torch.testing.assert_close(row["ours"], row["theirs"], rtol=0, atol=1e-6, msg=f"{fields}, rank {rank}")
            assert row["bytes"][-1] == 4 * numel * averages, fields
            assert abs(row["accuracy"][0] - row["accuracy"][1]) < 1e-4, fields


def test_a_local_sgd_that_averages_off_schedule_is_not_notebook_11s():
    # the same comparison fails when the runs differ only in when they average (period 2 against 4)
    cases = [(dict(averaging="local", period=2, momentum=0.9), dict(method="local", period=4))]
    row = spawn(W.train_and_notebook_loop, 2, cases, backend="gloo")[0][0]
    assert (row["ours"] - row["theirs"]).abs().max().item() > 1e-4


def test_the_alone_run_sends_nothing_and_keeps_each_ranks_own_model():
    # notebook 11's "no communication" reference: no average at any step, nor at the end
    outs = spawn(R.sweep, 2, [dict(method="alone", steps=4, lr=3e-3)], backend="gloo")
    first, second = outs[0][0], outs[1][0]
    assert first["sent_per_step"] == second["sent_per_step"] == 0 and first["bytes_per_step"] == 0
    assert (first["params"] - second["params"]).abs().max().item() > 1e-4
