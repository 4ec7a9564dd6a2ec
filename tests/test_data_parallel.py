"""course_lib.data_parallel on real gloo processes, against torch's DistributedDataParallel."""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

from course_lib import data_parallel, hooks
from course_lib.launch import spawn
from course_lib.notebooks import ddp_program
from course_lib.utils.digits import mlp
from tests import data_parallel_workers as W


@pytest.mark.parametrize("kind, world_size, bucket_cap_mb", [
    ("naive", 2, 25.0), ("flat", 3, 25.0), ("overlap", 3, 25.0), ("bucket", 4, 0.002), ("bucket", 2, 25.0),
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
    flat = spawn(W.against_ddp, 2, "flat", backend="gloo")[0]
    assert flat["traffic"] == [{"collectives": 1, "bytes": n_bytes}] * 3
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


def test_exposed_communication_is_what_outlasts_backward():
    E = data_parallel.Event
    backward = [E("backward", "b", 0.0, 1.0), E("backward", "w", 1.0, 3.0)]
    # two all-reduces after backward, one after the other: all of it exposed
    after = [E("all_reduce", "w", 3.0, 4.0), E("all_reduce", "b", 4.0, 6.0)]
    assert data_parallel.exposed_communication(backward + after) == 3.0
    assert data_parallel.communication_time(backward + after) == 3.0
    # launched during backward, queued together: only the tail after backward is exposed, and
    # the time in flight counts the overlapping bars once
    during = [E("all_reduce", "b", 1.0, 2.5), E("all_reduce", "w", 1.5, 3.5)]
    assert data_parallel.exposed_communication(backward + during) == 0.5
    assert data_parallel.communication_time(backward + during) == 2.5
    # all over before backward ended: nothing exposed
    assert data_parallel.exposed_communication(backward + [E("all_reduce", "b", 1.0, 2.0)]) == 0.0
    # gaps between bars are not communication
    assert data_parallel.communication_time([E("all_reduce", "a", 0.0, 1.0), E("all_reduce", "b", 2.0, 2.5)]) == 1.5


def test_waiting_for_peers_is_the_wait_for_the_latest_launch():
    E = data_parallel.Event
    rank0 = [E("backward", "w", 0.0, 1.0), E("all_reduce", "w", 1.0, 3.0), E("all_reduce", "b", 3.0, 4.0)]
    rank1 = [E("backward", "w", 0.0, 2.0), E("all_reduce", "w", 2.0, 3.0), E("all_reduce", "b", 3.5, 4.0)]
    assert data_parallel.waiting_for_peers([rank0, rank1]) == [1.0 + 0.5, 0.0]
    with pytest.raises(ValueError, match="different numbers"):
        data_parallel.waiting_for_peers([rank0, rank1[:2]])


def test_communication_alone_times_every_message_and_sequence():
    sequences = {"two": [4096, 400], "one": [4496]}
    for out in spawn(data_parallel.communication_alone, 2, sequences, (4096, 8192), 2, backend="gloo"):
        assert sorted(out["alone"]) == [400, 4096, 4496]
        assert [row["size_bytes"] for row in out["fit"]] == [4096, 8192]
        assert sorted(out["sequence"]) == ["one", "two"]
        assert all(t > 0 for t in [*out["alone"].values(), *out["sequence"].values()])


def test_step_times_measures_what_each_wrapper_exposes():
    kinds = ("naive", "flat", "overlap", "bucket:0.001", "ddp:0.001")
    outs = spawn(data_parallel.step_times, 2, kinds, 2, 32, 2, 16, backend="gloo", timeout_s=120)
    sizes = [p.numel() * 4 for p in reversed(list(mlp(hidden=32, depth=2).parameters()))]
    for out in outs:
        assert out["flat"]["traffic"]["collectives"] == 1
        assert out["naive"]["traffic"]["collectives"] == len(sizes)
        assert out["bucket:0.001"]["traffic"]["collectives"] == len(data_parallel.assign_buckets(sizes, 0.001 * 2**20))
        for kind in kinds:
            assert len(out[kind]["step_s"]) == 2
            torch.testing.assert_close(out[kind]["params"], out["ddp:0.001"]["params"], rtol=0, atol=1e-6)
        # nothing overlaps in naive and flat: every moment an all-reduce was in flight came after backward
        for kind in ("naive", "flat"):
            for exposed, comm in zip(out[kind]["exposed_s"], out[kind]["comm_s"]):
                assert exposed >= comm > 0
        assert out["ddp:0.001"]["exposed_s"] == []  # torch's DDP keeps no timeline


def _runs(per_run: list[dict]) -> list[list[dict]]:
    # runs as spawn(step_times) returns them, 2 ranks each: {kind: step times of rank 0, of rank 1}
    return [[{kind: {"step_s": times[0]} for kind, times in run.items()},
             {kind: {"step_s": times[1]} for kind, times in run.items()}] for run in per_run]


def test_run_medians_noise_floor_and_ranking_read_every_run():
    runs = _runs([{"a": ([1, 2, 9], [3, 4, 5]), "twin": ([1, 2, 3], [4, 5, 6]), "b": ([8, 8, 8], [9, 9, 9])},
                  {"a": ([2, 2, 2], [2, 2, 2]), "twin": ([3, 3, 3], [3, 3, 3]), "b": ([5, 6, 7], [7, 7, 9])}])
    # the median over both ranks' 6 steps of each run: (3 + 4) / 2 for a's first run, not a mean (4) or rank 0's (2)
    assert data_parallel.run_medians(runs, "a") == [3.5, 2]
    assert data_parallel.run_medians(runs, "b") == [8.5, 7]
    # the slower over the faster, less 1: 0 in run 1, 3 / 2 - 1 = 0.5 in run 2 (not |2 / 3 - 1| = 1/3: the
    # rule compares the slower with the faster too)
    assert data_parallel.noise_floor(runs, "a", "twin") == pytest.approx(0.5)
    assert data_parallel.noise_floor(runs, "twin", "a") == pytest.approx(0.5)
    assert data_parallel.established_faster([3.5, 2], [8.5, 7], floor=0.5)
    assert not data_parallel.established_faster([8.5, 7], [3.5, 2], floor=0.5)  # the other way round
    # run by run, not range against range: b is slower in each run, though the ranges overlap
    assert data_parallel.established_faster([1.0, 3.0], [2.0, 4.0], floor=0.2)
    assert not data_parallel.established_faster([1.0, 3.0], [2.0, 3.3], floor=0.2)  # run 2: 10% apart, floor 20%
    assert not data_parallel.established_faster([1.0, 3.0], [4.0, 2.0], floor=0.0)  # the runs disagree
    with pytest.raises(ValueError, match="same runs"):
        data_parallel.established_faster([1.0, 2.0], [3.0], floor=0.0)


def test_assign_buckets_closes_a_bucket_once_it_reaches_the_cap():
    assert data_parallel.assign_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert data_parallel.assign_buckets([10, 1, 1, 1], 8) == [[0], [1, 2, 3]]
    assert data_parallel.assign_buckets([3, 3, 3], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="cap_bytes must be a finite number > 0, got 0"):
        data_parallel.assign_buckets([1], 0)


@pytest.mark.parametrize("kind", ["naive", "flat", "overlap", "bucket"])
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


@pytest.mark.parametrize("world_size, batch_size", [(2, 64), (3, 63)])
def test_the_hook_check_accepts_right_hooks_and_refuses_wrong_ones(world_size, batch_size):
    right = {"allreduce": (hooks.allreduce_hook, torch.float32), "fp16": (hooks.fp16_compress_hook, torch.float16),
             "bf16": (hooks.bf16_compress_hook, torch.bfloat16),
             "torch allreduce": (default_hooks.allreduce_hook, torch.float32),
             "torch fp16": (default_hooks.fp16_compress_hook, torch.float16)}
    wrong = {"noop": (hooks.noop_hook, torch.float32), "torch noop": (debugging_hooks.noop_hook, torch.float32),
             "sum": (W.sum_hook, torch.float32), "fp16 sum": (W.fp16_sum_hook, torch.float16),
             "rank 0 only": (W.rank0_only_hook, torch.float32),
             # right, but judged at float32's tolerance: the check knows what rounding to expect
             "fp16 as if float32": (hooks.fp16_compress_hook, torch.float32)}
    runs = {name: hook for name, (hook, _) in {**right, **wrong}.items()}
    outs = spawn(ddp_program.one_step_gradients, world_size, runs, 64, batch_size, backend="gloo", timeout_s=120)
    for rank, out in enumerate(outs):
        # the reference is one process's gradient of the whole batch: the same on every rank
        assert torch.equal(out["reference"], outs[0]["reference"])
        for name, (_, dtype) in right.items():
            assert ddp_program.check_gradient(out[name], out["reference"], dtype), (rank, name)
        for name, (_, dtype) in wrong.items():
            assert not ddp_program.check_gradient(out[name], out["reference"], dtype), (rank, name)
        # the course's hooks are torch's code: the same gradient, bit for bit
        assert torch.equal(out["allreduce"], out["torch allreduce"]) and torch.equal(out["fp16"], out["torch fp16"])


def test_a_hook_ddp_refuses_is_reported_not_raised():
    out = spawn(ddp_program.one_step_gradients, 2, {"torch bf16": default_hooks.bf16_compress_hook,
                                                    "bf16": hooks.bf16_compress_hook}, backend="gloo")[0]
    # DDP's refusal depends on how torch was built (CUDA or ROCm with NCCL 2.10+, or XPU with XCCL),
    # not on the backend or on a GPU being present: ddp_accepts_bf16_hook mirrors DDP's test
    if ddp_program.ddp_accepts_bf16_hook():
        assert torch.equal(out["torch bf16"], out["bf16"])  # accepted: the course's code, bit for bit
    else:
        assert isinstance(out["torch bf16"], str) and "NCCL" in out["torch bf16"]


def test_the_fp16_wrapper_around_allreduce_is_torchs_and_passes_the_check():
    from course_lib.train import TrainConfig

    runs = {"fp16 wrapper": TrainConfig(compress_wrapper="fp16"),
            "torch fp16 wrapper": ddp_program.torch_fp16_wrapped_allreduce_hook,
            "wrapped noop": TrainConfig(hook="noop", compress_wrapper="fp16")}  # a wrong hook, wrapped
    for out in spawn(ddp_program.one_step_gradients, 2, runs, backend="gloo"):
        assert torch.equal(out["fp16 wrapper"], out["torch fp16 wrapper"])
        assert ddp_program.check_gradient(out["fp16 wrapper"], out["reference"], torch.float16)
        assert not ddp_program.check_gradient(out["wrapped noop"], out["reference"], torch.float16)


def test_the_bucket_exercise_predicts_what_ddp_sends():
    # notebook 04's exercise 1: its reference (a formula: one bucket at the first synchronizing backward,
    # then the rebuilt buckets, the first at 1 MiB when no cap is given) against DDP's own hook calls
    from course_lib.notebooks.exercises import ddp_all_reduces

    runs = [(None, 2, 1, False), (1, 2, 3, True), (0.01, 2, 2, False), (25, 1, 2, False)]
    sent = spawn(W.ddp_payloads, 2, runs, backend="gloo")[0]
    sizes = [p.numel() * 4 for p in reversed(list(mlp(hidden=512, depth=4).parameters()))]  # backward's order
    for run, got in zip(runs, sent):
        assert got == ddp_all_reduces(sizes, *run), run
    assert len(set(sent[0])) > 1 and sent[0][0] == sum(sizes)  # the first iteration is one bucket, then more
