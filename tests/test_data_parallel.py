"""course_lib.data_parallel on real gloo processes, against torch's DistributedDataParallel."""

import pytest
import torch

from course_lib import data_parallel
from course_lib.launch import spawn
from tests import data_parallel_workers as W


@pytest.mark.parametrize("kind, world_size, bucket_cap_mb", [
    ("naive", 2, 25.0), ("overlap", 3, 25.0), ("bucket", 4, 0.002), ("bucket", 2, 25.0),
])
def test_same_gradients_and_parameters_as_torch_ddp(kind, world_size, bucket_cap_mb):
    outs = spawn(W.against_ddp, world_size, kind, bucket_cap_mb, backend="gloo", timeout_s=120)
    for rank, out in enumerate(outs):
        for step, pairs in enumerate(out["grads"]):
            for i, (ours, theirs) in enumerate(pairs):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"rank {rank} step {step} grad {i}")
        for step, pairs in enumerate(out["params"]):
            for i, (ours, theirs) in enumerate(pairs):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"rank {rank} step {step} param {i}")
    # and every rank holds the same parameters (they started from different inits)
    for out in outs[1:]:
        for (a, _), (b, _) in zip(out["params"][-1], outs[0]["params"][-1]):
            assert torch.equal(a, b)


def test_collectives_and_bytes_counted():
    n_params, n_bytes = 9, 4 * sum(p.numel() for p in W.ManyShapes().parameters())
    naive = spawn(W.against_ddp, 2, "naive", backend="gloo")[0]
    assert naive["traffic"] == [{"collectives": n_params, "bytes": n_bytes}] * 3
    overlap = spawn(W.against_ddp, 2, "overlap", backend="gloo")[0]
    assert overlap["traffic"] == [{"collectives": n_params, "bytes": n_bytes}] * 3
    bucket = spawn(W.against_ddp, 2, "bucket", 0.002, backend="gloo")[0]
    n_buckets = len(bucket["buckets"])
    assert 1 < n_buckets < n_params
    assert bucket["traffic"] == [{"collectives": n_buckets, "bytes": n_bytes}] * 3
    # filled in reverse order of parameters(): the output layer's gradients arrive first
    names = [n for b in bucket["buckets"] for n in b]
    assert names == [n for n, _ in W.ManyShapes().named_parameters()][::-1]


def test_timeline_has_a_backward_and_an_all_reduce_per_parameter():
    out = spawn(W.against_ddp, 2, "overlap", backend="gloo")[0]
    kinds = [e[0] for e in out["events"]]
    assert kinds.count("backward") == 9 and kinds.count("all_reduce") == 9
    for kind, label, start, end in out["events"]:
        assert start <= end, (kind, label)
    # the first gradient's all-reduce started before the last gradient was ready: overlap
    first_ar = min(e[2] for e in out["events"] if e[0] == "all_reduce")
    last_ready = max(e[3] for e in out["events"] if e[0] == "backward")
    assert first_ar < last_ready


def test_assign_buckets_closes_a_bucket_once_it_reaches_the_cap():
    assert data_parallel.assign_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert data_parallel.assign_buckets([10, 1, 1, 1], 8) == [[0], [1, 2, 3]]
    assert data_parallel.assign_buckets([3, 3, 3], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="positive"):
        data_parallel.assign_buckets([1], 0)


@pytest.mark.parametrize("kind", ["naive", "overlap", "bucket"])
def test_unused_parameter_is_a_clear_error(kind):
    message = spawn(W.misuse, 2, kind, "unused", backend="gloo")[0]
    assert message is not None and "unused.weight" in message and "find_unused_parameters" in message


@pytest.mark.parametrize("kind", ["overlap", "bucket"])
def test_two_backwards_without_finishing_is_a_clear_error(kind):
    message = spawn(W.misuse, 2, kind, "two_backwards", backend="gloo")[0]
    assert message is not None and "finish_gradient_synchronization" in message


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a process group"):
        data_parallel.DataParallelNaive(W.ManyShapes())


@pytest.mark.parametrize("kind", ["overlap", "bucket"])
def test_no_sync_accumulates_as_torch_ddp_does(kind):
    for rank, out in enumerate(spawn(W.accumulate_against_ddp, 2, kind, backend="gloo")):
        for i, (ours, theirs) in enumerate(out["pairs"]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"rank {rank} grad {i}")
        # one step's communication, not two
        assert out["sent"]["bytes"] == 4 * sum(p.numel() for p in W.ManyShapes().parameters())


def test_wrapping_a_module_twice_is_a_clear_error():
    message = spawn(W.wrap_twice, 2, backend="gloo")[0]
    assert message is not None and "already wrapped by DataParallelBucket" in message
