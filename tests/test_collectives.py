import pytest
import torch

from course_lib import collectives as C
from course_lib.launch import WorkerError, spawn
from course_lib.notebooks import demos
from course_lib.notebooks import exercises as ex
from course_lib.notebooks.exercises import check_distributed
from solutions import nb02
from tests import collective_workers as W


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_torch_distributed(world_size):
    results = spawn(demos.compare_with_torch, world_size, backend="gloo")
    checked = 0
    for rank, rows in enumerate(results):
        for name, n, dtype, ours, theirs, in_place in rows:
            assert in_place, f"{name} should return the tensor it was given"
            assert ours.dtype == dtype and ours.shape == (n,)
            tol = 1e-6 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol,
                                       msg=f"{name}, rank {rank}, length {n}, {dtype}")
            checked += 1
    # every algorithm, length and dtype was compared on every rank (reduce only on its root)
    roots = len({0, world_size - 1})
    per_rank = len(demos.LENGTHS) * len(demos.DTYPES) * (2 + roots)
    assert checked == world_size * per_rank + len(demos.LENGTHS) * len(demos.DTYPES) * roots


def test_all_reduce_equals_the_sum_computed_locally():
    world_size = 3
    results = spawn(demos.compare_with_torch, world_size, backend="gloo")
    want = sum(demos._data(r, 1001, torch.float64) for r in range(world_size))
    for rows in results:
        picked = [(name, ours) for name, n, dtype, ours, _, _ in rows
                  if n == 1001 and dtype == torch.float64 and "all_reduce" in name]
        assert sorted(name for name, _ in picked) == ["naive_all_reduce", "ring_all_reduce"]
        for _, ours in picked:
            torch.testing.assert_close(ours, want)


def test_subgroups_use_group_ranks():
    out = spawn(W.subgroup, 4, backend="gloo")
    base = torch.arange(5, dtype=torch.float32)
    assert out[0] is None
    for rank in (1, 2, 3):
        torch.testing.assert_close(out[rank]["ring"], base * (2 + 3 + 4))
        torch.testing.assert_close(out[rank]["naive"], base * (2 + 3 + 4))
        torch.testing.assert_close(out[rank]["bcast"], base * 3)  # global rank 2's data
    torch.testing.assert_close(out[1]["reduce"], base * (2 + 3 + 4))


def test_ring_trace_shows_reduce_scatter_then_all_gather():
    p = 4
    traces = spawn(demos.ring_trace, p, backend="gloo")
    for rank, trace in enumerate(traces):
        assert [phase for phase, _, _ in trace] == ["start"] + ["reduce-scatter"] * (p - 1) + ["all-gather"] * (p - 1)
        # after reduce-scatter this rank owns chunk rank+1, summed over all ranks (bits 0..p-1 set)
        assert trace[p - 1][2][(rank + 1) % p].item() == 2**p - 1
        assert torch.equal(trace[-1][2], torch.full((p,), 2.0**p - 1))


def test_non_contiguous_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        C.ring_all_reduce(torch.zeros(4, 4).t())


def test_blocking_ring_shift_deadlocks_and_ring_shift_does_not():
    with pytest.raises(TimeoutError, match=r"\[0, 1, 2\]"):
        spawn(demos.shift_worker, 3, "blocking_ring_shift", backend="gloo", timeout_s=5)
    out = spawn(demos.shift_worker, 3, "ring_shift", backend="gloo")
    assert [t.item() for t in out] == [2.0, 0.0, 1.0]


def test_exercise_checks(capsys):
    # check_distributed itself: the instructors' reduce-scatter (recursive halving) against
    # C.reduce_scatter, which is computed another way (torch's all-reduce, then this rank's chunk)
    assert check_distributed(nb02.recursive_halving_reduce_scatter, C.reduce_scatter, ex.exercise_inputs,
                             world_sizes=(2, 4), name="halving")
    assert "[PASS] halving" in capsys.readouterr().out
    assert not check_distributed(W.wrong_reduce_scatter, C.reduce_scatter, ex.exercise_inputs, name="wrong")
    assert "[FAIL] wrong, world size 2, rank 0" in capsys.readouterr().out
    assert not check_distributed(W.todo, C.reduce_scatter, ex.exercise_inputs, name="todo")
    assert "[not yet] todo" in capsys.readouterr().out
    assert not check_distributed(C.blocking_ring_shift, ex.ring_shift_expected, ex.exercise_inputs, name="dl",
                                 timeout_s=5)
    assert "no answer after 5 s. A deadlock?" in capsys.readouterr().out
    # the notebook's exercises, as a student runs them: the instructors' ring shift (send/recv) against
    # torch's all-gather passes; the course's own (C.ring_shift) and the check's reference
    # (C.reduce_scatter) are right but refused, being the answer
    assert ex.check_ring_shift(nb02.ring_shift)
    assert not ex.check_ring_shift(C.ring_shift)
    assert "may not call course_lib.collectives." in capsys.readouterr().out
    assert not ex.check_recursive_halving(C.reduce_scatter)
    assert "may not call course_lib.collectives.reduce_scatter" in capsys.readouterr().out
    assert not ex.check_ring_shift(W.todo)
    assert "[not yet] todo" in capsys.readouterr().out


def test_a_root_outside_the_group_is_refused_on_every_rank_before_any_message():
    # Taken modulo the world size, src=5 on 2 ranks used to broadcast from rank 1, silently.
    cases = [(op, root) for op in ("tree_broadcast", "tree_reduce") for root in (2, 5, -1, 0.0, True)]
    expected = [f"{'src' if op == 'tree_broadcast' else 'dst'} must be a rank of the group, 0 to 1, got {root!r}"
                for op, root in cases]
    assert spawn(W.bad_roots, 2, cases, backend="gloo", timeout_s=30) == [expected] * 2
    # a root inside the group still works (ones sent from rank 1, or summed into it)
    assert spawn(W.bad_roots, 2, [("tree_broadcast", 1), ("tree_reduce", 1)], backend="gloo") == [["accepted"] * 2] * 2


@pytest.mark.parametrize("op, seen", [
    ("ring_all_reduce", "rank 0: shape (3,), torch.float32; rank 1: shape (4,), torch.float32"),
    ("tree_broadcast", "rank 0: shape (3,), torch.float32, src=0; rank 1: shape (3,), torch.float32, src=1"),
])
def test_ranks_that_disagree_are_told_so_under_debug_detail(monkeypatch, op, seen):
    # Without the check, the first ends in a SIGABRT in gloo and the second waits until the timeout.
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(WorkerError, match="different arguments") as info:
        spawn(W.mismatched, 2, op, backend="gloo", timeout_s=30)
    assert seen in str(info.value)


def test_a_length_mismatch_without_the_check_is_reported_with_the_way_to_find_it(monkeypatch):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    # gloo's "Received data size doesn't match expected size" goes to stderr, then it aborts
    with pytest.raises(WorkerError, match=r"killed by SIGABRT.*TORCH_DISTRIBUTED_DEBUG=DETAIL"):
        spawn(W.mismatched, 2, "ring_all_reduce", backend="gloo", timeout_s=20)


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_staged_through_host_memory_give_torchs_results(world_size):
    # gloo's send/recv take host memory only, so CUDA tensors travel through host copies (on a GPU:
    # benchmarks/gpu_check.py); here every tensor takes that path, on the CPU
    for rank, checks in enumerate(spawn(W.through_host_memory, world_size, backend="gloo", timeout_s=60)):
        assert all(checks.values()), (rank, checks)
