import math
import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from course_lib import powersgd
from course_lib.launch import WorkerError, spawn
from course_lib.notebooks.hook_runs import callbacks_that_wait, hook_timeline, try_training, try_worker
from course_lib.train import TrainConfig, ddp_train, train_several
from tests import ddp_workers as W


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kwargs, match", [
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an integer >= 1"),
    (dict(start_powerSGD_iter=1), "start_powerSGD_iter must be > 1"),
    (dict(start_powerSGD_iter=0, warm_start=False), "start_powerSGD_iter must be > 1"),
    (dict(orthogonalization_epsilon=-1e-8), r"orthogonalization_epsilon \(.*\) must be a finite number >= 0"),
    (dict(orthogonalization_epsilon=float("nan")), r"orthogonalization_epsilon \(.*\) must be .*, got nan"),
    (dict(min_compression_rate=-1), r"min_compression_rate \(.*\) must be a finite number >= 0"),
    (dict(min_compression_rate=float("nan")), "min_compression_rate .* got nan"),
    (dict(start_powerSGD_iter="10"), "start_powerSGD_iter must be an integer >= 0, got '10'"),
    (dict(matrix_approximation_rank=True), "matrix_approximation_rank must be an integer >= 1"),
])
def test_bad_arguments_say_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        powersgd.PowerSGDState(**kwargs)


def test_start_iter_one_is_fine_without_memory():
    s = powersgd.PowerSGDState(start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    assert s.start_powerSGD_iter == 1


def test_should_compress_matches_torch():
    for n, m, r, rate in [(1024, 512, 2, 2), (10, 64, 4, 2), (64, 1, 1, 2), (100, 100, 25, 2), (100, 100, 24, 2)]:
        assert powersgd.should_compress(n, m, r, rate) == torch_psgd._should_compress(n, m, r, rate)


def test_same_seed_same_numbers_as_torch_step_by_step():
    configs = []
    for r in (1, 2, 4):
        base = TrainConfig(steps=20, start_powerSGD_iter=4, matrix_approximation_rank=r, record_params=True,
                           bucket_cap_mb=100, hidden=96, lr=0.1,
                    eval_every=15)
        configs += [replace(base, hook="torch_powersgd"), replace(base, hook="powersgd")]
    out = spawn(train_several, 2, configs, backend="gloo", timeout_s=300)[0]
    for i in range(0, len(configs), 2):
        theirs, ours = out[i], out[i + 1]
        assert ours.bytes[-1] > 0
        worst = max(_rel(a, b) for a, b in zip(ours.params, theirs.params))
        assert worst < 1e-5, f"rank {configs[i].matrix_approximation_rank}: relative difference {worst:.2e}"
        assert ours.compression_stats == pytest.approx(theirs.compression_stats)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_many_small_buckets_keep_ranks_identical(world_size):
    cfg = TrainConfig(hook="powersgd", steps=12, start_powerSGD_iter=3, matrix_approximation_rank=2, hidden=256,
                      n_in=128, bucket_cap_mb=0.1,
               batch_size=96, lr=0.3, eval_every=12)
    out = spawn(ddp_train, world_size, cfg, backend="gloo", timeout_s=300)
    for o in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o.final_params, out[0].final_params))
    rate, before, after = out[0].compression_stats
    assert rate > 20 and before > after
    assert out[0].loss[-1] < out[0].loss[0]


def test_resume_from_checkpoint_equals_training_straight_through():
    cfg = TrainConfig(hook="powersgd", steps=24, start_powerSGD_iter=5, matrix_approximation_rank=2, hidden=96, lr=0.3,
                      eval_every=24)
    straight, resumed = spawn(train_several, 2, [cfg, replace(cfg, resume_at=12)], backend="gloo")[0]
    for a, b in zip(straight.final_params, resumed.final_params):
        assert _rel(b, a) < 1e-5
    assert straight.bytes == resumed.bytes


def _filled_state():
    s = powersgd.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=5, random_seed=3)
    s.iter = 17
    s.rng.randint(1000)
    s.error_dict = {0: torch.arange(6.0), 1: torch.ones(3)}
    s.q_memory_dict = {0: torch.randn(4, 2)}
    s.total_numel_before_compression, s.total_numel_after_compression = 1000, 10
    return s


@pytest.mark.parametrize("roundtrip", ["pickle", "state_dict"])
def test_state_roundtrips_without_the_process_group(roundtrip, caplog):
    s = _filled_state()
    s.process_group = object()  # not picklable, and must not be saved
    if roundtrip == "pickle":
        with caplog.at_level("WARNING", logger="course_lib.powersgd"):
            t = pickle.loads(pickle.dumps(s))
        # as torch's: one note when saved, one when loaded
        assert [r.getMessage().split(";")[0] for r in caplog.records] == [
            "PowerSGDState: a process group cannot be pickled",
            "PowerSGDState: loaded with the default process group (every rank)"]
    else:
        t = powersgd.PowerSGDState(start_powerSGD_iter=2)
        t.load_state_dict(s.state_dict())
    # the group is not saved: a restored state uses the default group, whatever the saved one had
    assert t.process_group is None
    assert "process_group" not in s.state_dict() and "process_group" not in s.state_dict()["hyperparameters"]
    assert t.iter == 17 and t.matrix_approximation_rank == 2 and t.start_powerSGD_iter == 5
    assert t.rng.randint(10**9) == s.rng.randint(10**9)  # same random stream from here on
    assert torch.equal(t.error_dict[0], s.error_dict[0]) and torch.equal(t.q_memory_dict[0], s.q_memory_dict[0])
    assert t.compression_stats() == (100.0, 1000, 10)
    assert isinstance(t.rng, np.random.RandomState)


def test_an_unpickled_state_takes_the_default_group_as_torchs():
    for rank, out in enumerate(spawn(W.pickled_powersgd_state, 3, backend="gloo")):
        assert out == {"default": True, "size": 3}, rank


def test_bytes_per_compressed_step_are_exact():
    out = spawn(W.one_compressed_step, 2, 2, backend="gloo")[0]
    shapes = out["shapes"]  # [w0, b0, w1, b1, w2, b2]
    n_all = sum(torch.Size(s).numel() for s in shapes)
    assert out["sent"][0] == {"collectives": 1, "bytes": 4 * n_all}  # before start: plain all-reduce
    # compressed: every weight (64x64, 64x64, and 10x64: (10 + 64) * 2 * 2 < 640) as P and Q of rank 2;
    # the biases as they are
    p_q = sum((n + m) * 2 for n, m in (shapes[0], shapes[2], shapes[4]))
    plain = sum(shapes[k][0] for k in (1, 3, 5))
    assert p_q + plain == 798
    assert out["sent"][2] == {"collectives": 2, "bytes": 4 * (p_q + plain)}


def test_non_finite_gradient_is_a_clear_error():
    with pytest.raises(WorkerError, match="not finite") as info:
        spawn(W.nan_on_rank_one, 2, backend="gloo", timeout_s=60)
    assert "clip gradients" in str(info.value)


def test_batched_hook_works_on_gloo_with_small_buckets():
    out = spawn(W.batched_and_torch_batched, 2, backend="gloo", timeout_s=120)
    (ours0, theirs), (ours1, _) = out
    assert theirs == "AssertionError"  # torch's batched hook: its 2-D Q refused by _orthogonalize
    assert all(torch.equal(a, b) for a, b in zip(ours0.final_params, ours1.final_params))
    assert ours0.compression_stats[0] > 5
    assert ours0.loss[-1] < ours0.loss[0]


def test_the_hook_does_error_feedback_as_written_out():
    # sent = compress(grad + error), new error = grad + error - sent, computed in the worker with
    # plain products, against what the hook sent and kept
    for rank, out in enumerate(spawn(W.hook_against_error_feedback_step, 2, backend="gloo")):
        torch.testing.assert_close(out["hook_sent"], out["sent"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(out["hook_error"], out["error"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        assert out["error"].norm() > 0.01 * out["sent"].norm()  # really compressed: something was left out


def test_a_parameter_that_reuses_a_dead_ones_id_gets_a_key_of_its_own():
    s = powersgd.PowerSGDState(start_powerSGD_iter=2)
    first = torch.zeros(3)
    assert s.keys([first]) == [0]
    dead = id(first)
    del first
    # CPython reuses the memory, and so the id, of a freed object of the same size
    keep, reused = [], None
    for _ in range(10_000):
        t = torch.zeros(3)
        if id(t) == dead:
            reused = t
            break
        keep.append(t)
    assert reused is not None, "no new tensor took the freed tensor's id"
    other = torch.zeros(4)
    keys = s.keys([reused, other])
    assert keys == [1, 2]  # neither the dead parameter's key, nor one key for two parameters
    assert s.keys([other, reused]) == [2, 1]  # and they stay


def test_try_training_says_how_torchs_layerwise_hook_ends_with_many_buckets_on_gloo():
    # what notebook 08 runs: with two buckets (after DDP's rebuild) torch's layer-wise hook issues P and Q
    # from callbacks that gloo runs when each collective finishes, so the two ranks can pair up different
    # collectives (a gloo abort) or wait on gloo's own threads (a hang). Which, if either, is a race that the
    # machine's load decides (on a busy machine callbacks run at once and it can finish): each outcome is
    # checked for what try_training says of it. The course's hook issues them in bucket order and finishes.
    tiny = TrainConfig(hidden=256, depth=2, lr=0.05, steps=10, start_powerSGD_iter=3, bucket_cap_mb=0.05,
                       eval_every=1000)
    ours = try_training(replace(tiny, hook="powersgd"), timeout_s=60)
    assert ours.kind == "finished" and ours.detail == "" and ours.stacks == {}
    layerwise = try_training(replace(tiny, hook="torch_powersgd"), timeout_s=10)
    assert layerwise.kind in ("crashed", "hung", "finished"), layerwise
    if layerwise.kind == "crashed":
        assert "collective mismatch" in layerwise.detail, layerwise.detail
    elif layerwise.kind == "hung":  # cut off at the timeout, not before; any thread in torch's hook waits
        assert layerwise.seconds >= 10
        waiting = [f for frames in layerwise.stacks.values() for f in frames if f.file == "powerSGD_hook.py"]
        assert all(".wait()" in f.code for f in waiting), layerwise.stacks


def test_callbacks_that_wait_deadlock_gloos_two_threads_and_one_in_flight_does_not():
    # torch's layer-wise hook's pattern alone: each callback issues an all-reduce and waits for it, on the
    # gloo thread that ran the collective; with two in flight both of rank 0's gloo threads wait, every
    # time (rank 1 issues the same all-reduces without callbacks, after rank 0 has attached its own)
    two = try_worker(callbacks_that_wait, 2, 2, timeout_s=12)
    assert two.kind == "hung", two
    waiting = [f for f in two.stacks[0] if f.function == "callback"]
    assert len(waiting) == 2 and all(".wait()" in f.code for f in waiting), two.stacks
    one = try_worker(callbacks_that_wait, 2, 1, timeout_s=30)
    assert one.kind == "finished" and one.stacks == {}, one


def test_torchs_layerwise_hook_with_one_bucket_finishes_on_one_process():
    # nothing else in flight: a waiting callback always leaves gloo's other thread free
    tiny = TrainConfig(hidden=256, depth=2, lr=0.05, steps=10, start_powerSGD_iter=3, bucket_cap_mb=100,
                       eval_every=1000)
    one = try_training(replace(tiny, hook="torch_powersgd"), world_size=1, timeout_s=30)
    assert one.kind == "finished" and one.stacks == {}, one


def test_torchs_batched_hook_fails_with_one_bucket_on_one_process():
    # not a race: it passes its 2-D Q to _orthogonalize, which takes only a 3-D batch of matrices
    one = TrainConfig(hidden=256, depth=2, lr=0.05, steps=6, start_powerSGD_iter=3, bucket_cap_mb=100,
                      eval_every=1000)
    theirs = try_training(replace(one, hook="torch_batched_powersgd"), world_size=1, timeout_s=60)
    assert theirs.kind == "raised AssertionError" and "_orthogonalize" in theirs.detail, theirs
    ours = try_training(replace(one, hook="batched_powersgd"), world_size=1, timeout_s=60)
    assert ours.kind == "finished", ours
    q = torch.randn(292, 1)
    with pytest.raises(AssertionError):
        torch_psgd._orthogonalize(q.clone())
    batch = q.clone().unsqueeze(0)
    torch_psgd._orthogonalize(batch)
    torch.testing.assert_close(batch.norm(), torch.tensor(1.0))


def test_try_training_reports_a_workers_exception():
    # start_powerSGD_iter=1 with error feedback is refused in PowerSGDState, inside the workers
    outcome = try_training(TrainConfig(hook="powersgd", start_powerSGD_iter=1, steps=2), timeout_s=60)
    assert outcome.kind == "raised ValueError" and "start_powerSGD_iter" in outcome.detail


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ordered_hook_overlaps_yet_gives_the_blocking_hooks_numbers(world_size):
    # several buckets (a 0.05 MB cap against a 0.34 MB model: two after DDP's rebuild), where torch's
    # hook mismatches its collectives; the ordered hook runs three times in the same processes, then
    # the blocking hook once
    base = TrainConfig(steps=20, start_powerSGD_iter=3, matrix_approximation_rank=2, hidden=256, depth=2,
                       bucket_cap_mb=0.05, lr=0.1, batch_size=60, record_params=True, eval_every=100)
    configs = [replace(base, hook="ordered_powersgd")] * 3 + [replace(base, hook="powersgd")]
    outs = spawn(train_several, world_size, configs, backend="gloo", timeout_s=240)
    blocking = outs[0][3]
    assert blocking.compression_stats[0] > 2  # it did compress
    for rank, runs in enumerate(outs):
        for run, ordered in enumerate(runs[:3]):
            worst = max(_rel(a, b) for a, b in zip(ordered.params, blocking.params))
            assert worst < 1e-5, f"rank {rank} run {run}: relative difference {worst:.2e} from the blocking hook"
            assert ordered.bytes == blocking.bytes
            for a, b in zip(ordered.final_params, outs[0][run].final_params):
                assert torch.equal(a, b), f"rank {rank} run {run} differs from rank 0"


def test_ordered_hook_resumes_from_a_checkpoint():
    cfg = TrainConfig(hook="ordered_powersgd", steps=20, start_powerSGD_iter=3, hidden=128, bucket_cap_mb=0.05,
                      lr=0.1, eval_every=100)
    straight, resumed = spawn(train_several, 2, [cfg, replace(cfg, resume_at=12)], backend="gloo")[0]
    for a, b in zip(straight.final_params, resumed.final_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert straight.bytes == resumed.bytes


def test_log_lines_and_process_group_reach_the_training():
    # compression_stats_logging_frequency: one line at the start, then one every 4 iterations;
    # hook_group="self": each rank a group of its own, so the ranks' parameters drift apart
    base = TrainConfig(hook="powersgd", steps=12, start_powerSGD_iter=3, hidden=32, eval_every=100,
                       compression_stats_logging_frequency=4)
    outs = spawn(train_several, 2, [base, replace(base, hook_group="self")], backend="gloo", timeout_s=120)
    (world0, alone0), (world1, alone1) = outs
    assert world0.log_lines[0] == "Start to apply PowerSGD after 3 iterations."
    iters = [int(line.split("iter ")[1].split(",")[0]) for line in world0.log_lines[1:]]
    assert iters == [3, 7, 11], world0.log_lines
    assert world0.log_lines == world1.log_lines
    assert all(torch.equal(a, b) for a, b in zip(world0.final_params, world1.final_params))
    assert not all(torch.equal(a, b) for a, b in zip(alone0.final_params, alone1.final_params))
    assert alone0.bytes == world0.bytes  # the same is sent, to nobody


def test_try_training_takes_a_list_of_configs():
    tiny = TrainConfig(hidden=64, steps=4, start_powerSGD_iter=2, eval_every=100)
    ok = try_training([replace(tiny, hook="powersgd"), replace(tiny, hook="ordered_powersgd")], timeout_s=60)
    assert ok.kind == "finished"
    bad = try_training([replace(tiny, hook="powersgd"), replace(tiny, hook="powersgd", start_powerSGD_iter=1)],
                       timeout_s=60)
    assert bad.kind == "raised ValueError" and "start_powerSGD_iter" in bad.detail


def test_numbers_per_step_reproduces_the_papers_resnet18_ratios():
    from course_lib.utils.shapes import resnet18_cifar_shapes
    shapes = [shape for _, shape in resnet18_cifar_shapes()]
    assert sum(int(np.prod(s)) for s in shapes) == 11_173_962  # ResNet-18 for CIFAR-10's well-known count
    for r, paper in ((1, 243), (2, 136), (4, 72)):  # Vogels et al. 2019, Table 3
        before, after = powersgd.numbers_per_step(shapes, r)
        # the same count written out: every 2+-d tensor as (rows + rest) * r, every vector as is
        by_hand = sum((s[0] + int(np.prod(s[1:]))) * r if len(s) > 1 else s[0] for s in shapes)
        assert after == by_hand
        assert round(before / after) == paper
    # a matrix not worth compressing goes as it is; a vector always does
    assert powersgd.numbers_per_step([(10, 12), (10,)], 4, 2) == (130, 130)
    assert powersgd.numbers_per_step([(10, 12), (10,)], 4, 1) == (130, 98)


@pytest.mark.parametrize("batched", [False, True])
def test_compress_on_one_process_is_exact_where_the_rank_allows(batched):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 40, generator=g) for _ in range(3)]  # rank 6 = min(n, m): exact
    low = [torch.randn(30, 1, generator=g) @ torch.randn(1, 20, generator=g) for _ in range(2)]  # rank 1
    for grads, r in ((full, 6), (low, 1)):
        state = powersgd.PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2, min_compression_rate=0,
                                       batch_tensors_with_same_shape=batched)
        out = powersgd.compress_on_one_process(state, [t.clone() for t in grads])
        for a, b in zip(out, grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a rank-2 approximation of a generic matrix is not exact, and keeps the warm-start Q
    state = powersgd.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   batch_tensors_with_same_shape=batched)
    thin, square = torch.randn(4, 40, generator=g), torch.randn(50, 50, generator=g)
    out = powersgd.compress_on_one_process(state, [thin.clone(), square.clone()])
    assert torch.equal(out[0], thin)  # (4 + 40) * 2 * 2 > 4 * 40: not worth compressing, left as it is
    assert torch.linalg.matrix_rank(out[1]) == 2
    assert list(state.q_memory_dict) == [1]  # the square's Q, kept for the next step


def test_hook_timeline_shows_which_thread_issues_the_collectives():
    cfg = TrainConfig(hidden=128, depth=3, bucket_cap_mb=0.05, steps=4, start_powerSGD_iter=2)
    for rank, out in enumerate(spawn(hook_timeline, 2, cfg, backend="gloo", timeout_s=120)):
        counts = {}
        for name, run in out.items():
            collectives = [e for e in run["events"] if e.kind == "all_reduce"]
            backward = [e for e in run["events"] if e.kind == "backward"]
            assert len(backward) == 8  # one per parameter of the 4 layers
            assert all(e.start_s <= e.end_s for e in run["events"])
            counts[name] = len(collectives)
            threads = {e.label for e in collectives}
            assert threads == ({"MainThread"} if name == "powersgd" else {"ordered_powerSGD_hook"}), (rank, threads)
        assert counts["powersgd"] == counts["ordered_powersgd"] > 2  # two per bucket, several buckets


def test_a_parameter_with_no_elements_is_sent_as_it_is():
    # It used to end in "cannot reshape tensor of 0 elements into shape [0, -1]".
    state = powersgd.PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2)
    big = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    grads = [torch.zeros(0, 5), big.clone(), torch.zeros(3, 0)]
    plain, groups = powersgd._group_matrices(state, state.keys(grads), grads)
    assert [tuple(g.shape) for g in plain] == [(0, 5), (3, 0)]
    assert [tuple(g.matrix.shape) for g in groups] == [(16, 16)]
    out = powersgd.compress_on_one_process(state, grads)
    assert out[0].shape == (0, 5) and out[2].shape == (3, 0)
    # the 16 x 16 one became rank 1: its singular values past the first are zero (checked by the SVD)
    s = torch.linalg.svdvals(out[1])
    assert s[1] < 1e-4 * s[0]


def test_numbers_per_step_and_memory_agree_with_both_hooks_at_every_min_compression_rate():
    """numbers_per_step against what the course's hook sent (hooks.traffic) and what both hooks count
    (compression_stats), and notebook 07's memory exercise against what both states keep: at rates
    where both vectors (6 and 10: compressed below 6/7 and 10/11), one, or none go as n x 1 matrices."""
    from course_lib.notebooks.exercises import nb07

    settings = [(which, r, rate, ef, warm) for which in ("course", "torch") for r in (1, 2)
                for rate in (0, 0.5, 0.88, 1, 2, 8) for ef, warm in ((True, True), (False, True), (True, False))]
    out = spawn(W.compressed_step_counts, 2, settings, backend="gloo", timeout_s=120)[0]
    vectors_compressed = set()
    for (which, r, rate, ef, warm), row in zip(settings, out):
        before, after = powersgd.numbers_per_step(row["shapes"], r, rate)
        assert row["stats"] == (before, after), (which, r, rate)
        if which == "course":
            assert row["sent"] == {"collectives": 2, "bytes": 4 * after}, (r, rate)
        assert row["memory"] == nb07._memory_per_rank(row["shapes"], r, rate, ef, warm), (which, r, rate, ef, warm)
        if which == "torch":  # torch also keeps its P buffers with warm start: n x r per compressed tensor
            matrices = [(s[0], math.prod(s[1:])) for s in row["shapes"]]
            p_numbers = sum(n * min(n, m, r) for n, m in matrices
                            if powersgd.should_compress(n, m, min(n, m, r), rate)[0])
            assert row["p_memory"] == (p_numbers if warm else 0), (r, rate, ef, warm)
        vectors_compressed.add(after - powersgd.numbers_per_step(row["shapes"], r, 1)[1])
    assert vectors_compressed >= {0, 1, 2}  # 0.88 compresses one vector, 0 and 0.5 both (one number more each)


def test_mean_error_norm_is_the_norm_of_the_ranks_average_buffer():
    """TrainResult.mean_error_norm against the ranks' final error buffers averaged here; the
    mean differs from rank 0's own buffer (which the old plot showed)."""
    out = spawn(W.mean_error_recorded, 2, backend="gloo", timeout_s=120)
    keys = sorted(out[0]["errors"])
    assert keys and keys == sorted(out[1]["errors"])
    flat = [torch.cat([o["errors"][k].double().flatten() for k in keys]) for o in out]
    mean = (flat[0] + flat[1]) / 2
    for rank, o in enumerate(out):
        res = o["result"]
        assert len(res.mean_error_norm) == len(res.error_norm) == 10
        assert res.mean_error_norm[:3] == [0.0] * 3  # nothing compressed yet
        assert res.error_norm[-1] == pytest.approx(flat[rank].norm().item(), rel=1e-9)
        assert res.mean_error_norm[-1] == pytest.approx(mean.norm().item(), rel=1e-9)
        assert res.error_minus_mean_norm[-1] == pytest.approx((flat[rank] - mean).norm().item(), rel=1e-9)
    # the same mean on both ranks; rank 0's buffer is not the mean
    assert out[0]["result"].mean_error_norm == out[1]["result"].mean_error_norm
    r0 = out[0]["result"]
    assert abs(r0.error_norm[-1] - r0.mean_error_norm[-1]) > 0.05 * r0.error_norm[-1]
    # recorded only when asked (record_error_memory), and recording changes nothing else
    for o in out:
        assert o["unrecorded"].error_norm == o["unrecorded"].mean_error_norm == []
        assert o["unrecorded"].error_minus_mean_norm == []
        assert o["unrecorded"].loss == o["result"].loss and o["unrecorded"].bytes == o["result"].bytes


def test_each_ranks_error_minus_the_mean_is_the_running_sum_of_its_gradient_minus_the_mean():
    """(e_i - e_bar) after step t = sum over compressed steps s <= t of (M_i - M_bar)_s, whatever the
    compression: the part of a rank's buffer that the all-reduce averages away."""
    out = spawn(W.error_identity, 2, backend="gloo", timeout_s=120)
    start, steps = 2, len(out[0]["grads"])
    for rank in range(2):
        running = torch.zeros(12, 16)
        for t in range(steps):
            mean_grad = (out[0]["grads"][t] + out[1]["grads"][t]) / 2
            mean_error = (out[0]["errors"][t] + out[1]["errors"][t]) / 2
            if t >= start:
                running += out[rank]["grads"][t] - mean_grad
            torch.testing.assert_close(out[rank]["errors"][t] - mean_error, running, rtol=1e-4, atol=1e-4,
                                       msg=f"rank {rank}, step {t}")
        assert running.norm() > 0.1 * out[rank]["errors"][-1].norm()  # not trivially zero
    mean_error = (out[0]["errors"][-1] + out[1]["errors"][-1]) / 2
    assert mean_error.norm() > 1e-3  # compression left something out: the mean buffer is not zero


def test_torchs_hook_trains_on_cpu_tensors_where_a_gpu_is_visible():
    # torch's hook ends with torch.cuda.synchronize(the bucket's device) whenever a GPU is visible, which
    # raises on CPU tensors (seen on an H100, benchmarks/results/gpu_check.json); the course's training
    # worker lets a synchronize of the CPU pass. Without that, this CPU build raises in the hook.
    losses = spawn(W.torch_hook_on_cpu_with_a_gpu_visible, 2, backend="gloo", timeout_s=120)
    assert losses[0] == losses[1] and len(losses[0]) == 6 and all(math.isfinite(v) for v in losses[0])


def test_encode_decode_seconds_times_on_the_threads_asked_and_gives_the_others_back():
    before = torch.get_num_threads()
    seconds = powersgd.encode_decode_seconds([(64, 32), (32,)], 2, repeats=3, threads=1)
    assert 0 < seconds < 1 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        powersgd.encode_decode_seconds([(4, 4)], threads=0)
