"""course_lib.notebooks.ddp_debugging and spawn's stacks at a timeout: notebook 04's debugging demos, run as
the notebook runs them, in real gloo processes."""

import glob
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.launch import spawn
from course_lib.notebooks import ddp_debugging as D
from course_lib.utils.digits import batch_slice, digits_tensors


def test_a_hung_job_times_out_with_every_rank_s_stack(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where spawn's stack files go, this test's own
    with pytest.raises(TimeoutError) as info:
        spawn(D.stuck_in_a_desync, 3, backend="gloo", timeout_s=5)
    stacks = info.value.stacks
    assert sorted(stacks) == [0, 1, 2]
    # innermost first, down to the worker's own function: rank 0 in all_reduce, the others in recv
    assert stacks[0].splitlines()[0].endswith(" in all_reduce")
    assert all(stacks[r].splitlines()[0].endswith(" in recv") for r in (1, 2))
    assert all(s.splitlines()[-1].startswith("course_lib/notebooks/ddp_debugging.py, line ")
               and s.splitlines()[-1].endswith(" in stuck_in_a_desync") for s in stacks.values())
    assert "rank 1 was in (most recent call first):\ntorch/distributed/" in str(info.value)
    assert not glob.glob(os.path.join(tmp_path, "course_lib_rank*.stack"))  # cleaned up


def test_each_rank_s_stack_shows_where_it_waits():
    with pytest.raises(TimeoutError) as info:
        spawn(D.late_ranks, 2, (1,), 30.0, backend="gloo", timeout_s=4)  # rank 1 sleeps, rank 0 waits in the barrier
    stacks = info.value.stacks
    assert stacks[0].splitlines()[0].endswith(" in monitored_barrier")
    assert stacks[1].splitlines() == [stacks[1].splitlines()[0]] and stacks[1].endswith(" in late_ranks")  # sleeping


def test_detail_names_the_mismatched_shapes_and_plain_gloo_does_not(monkeypatch):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    plain = spawn(D.mismatched_all_reduce, 2, backend="gloo", timeout_s=60)
    assert not any("mismatch" in s for s in plain)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    detail = spawn(D.mismatched_all_reduce, 2, backend="gloo", timeout_s=60)
    for rank, message in enumerate(detail):
        assert message.startswith("RuntimeError: Detected mismatch between collectives on ranks.")
        assert f"Rank {rank} is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, " \
               f"TensorShape=[{3 + rank}]" in message
        assert message.endswith(f"Tensor Tensor shapes: {3 + rank}vs {4 - rank}")


def test_monitored_barrier_names_every_rank_that_did_not_arrive():
    outs = spawn(D.late_ranks, 4, (1, 3), 1.0, backend="gloo", timeout_s=60)
    assert outs[0].startswith("RuntimeError: [Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms")
    assert outs[1] == outs[3] == "busy elsewhere: never entered the barrier"
    assert spawn(D.late_ranks, 3, (), 1.0, backend="gloo", timeout_s=60) == ["passed the barrier"] * 3


def _one_process_two_heads(steps):
    """What DDP with find_unused_parameters must give, computed another way: one process, whole batches."""
    model = D._TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _, _ = digits_tensors(seed=0)
    for s in range(steps):
        rows = batch_slice(s, 64, len(x))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return model


def test_an_unused_parameter_stops_ddp_unless_it_is_told():
    refused = spawn(D.unused_parameter, 2, False, backend="gloo", timeout_s=60)
    assert all(m.startswith("step 1: RuntimeError: Expected to have finished reduction in the prior iteration")
               and "find_unused_parameters=True" in m for m in refused)
    told = spawn(D.unused_parameter, 2, True, 3, backend="gloo", timeout_s=60)
    assert told == ["3 steps done; the ranks' parameters are the same"] * 2


def test_find_unused_parameters_trains_as_one_process_would():
    got = spawn(_params_after_unused, 2, backend="gloo", timeout_s=60)
    want = torch.cat([p.detach().flatten() for p in _one_process_two_heads(3).parameters()])
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def _params_after_unused(rank, world_size):
    x, y, _, _ = digits_tensors(seed=0)
    model = DDP(D._TwoHeads(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(3):
        rows = batch_slice(s, 64, len(x), rank, world_size)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


def test_uneven_inputs_time_out_without_join_and_finish_with_it():
    without = spawn(D.uneven_inputs, 2, False, 2.0, backend="gloo", timeout_s=60)
    assert without[0] == "3 batches: done"
    assert without[1].startswith("4 batches: RuntimeError (") and "Timed out" in without[1]
    assert spawn(D.uneven_inputs, 3, True, 2.0, backend="gloo", timeout_s=60) == [
        "3 batches: done", "4 batches: done", "5 batches: done"]


def test_the_profiler_sees_as_many_all_reduces_as_the_course_s_wrapper_sends():
    outs = spawn(D.profiled_ddp_step, 2, 512, 4, 1.0, backend="gloo", timeout_s=120)
    for out in outs:
        ddp = out["ddp (torch.profiler)"]["events"]
        ours = out["bucket (its own clock)"]["events"]
        n_ours = sum(e.kind == "all_reduce" for e in ours)
        assert n_ours == 4  # 1 MiB buckets of the 512-wide, 4-deep MLP's 3.3 M gradient bytes... in 4
        assert sum(e.kind == "all_reduce" for e in ddp) == out["count"]["gloo:all_reduce"] == n_ours
        assert sum(e.kind == "backward" for e in ddp) == out["count"][
            "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"] == 10  # one per tensor
        first_grad = min(e.start_s for e in ddp if e.kind == "backward")
        assert all(e.start_s > first_grad for e in ddp if e.kind == "all_reduce")  # launched during backward
