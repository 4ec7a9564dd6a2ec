"""Bad input gets a clear error: a ValueError that names the argument and the value, never a silent
wrong result. One row per (function, bad argument); the distributed ones (launch.spawn, the tree
collectives) are in test_launch.py and test_collectives.py, where they run real processes.
"""

import math

import pytest
import torch

from course_lib import accumulation, lowrank
from course_lib.utils import checks

M = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
X, Y = torch.randn(5, 3), torch.arange(5)

BAD = [
    # (call, the words the message must contain)
    (lambda: lowrank.svd_error(M, -1), "rank must be an integer between 0 and 4, got -1"),
    (lambda: lowrank.svd_error(M, 5), "rank must be an integer between 0 and 4, got 5"),
    (lambda: lowrank.svd_error(M, 1.5), "rank must be an integer between 0 and 4, got 1.5"),
    (lambda: lowrank.svd_error(M[None], 1), "expects a matrix (n, m), got shape (1, 6, 4)"),
    (lambda: lowrank.compression_ratio(6, 4, -1), "rank must be an integer >= 1, got -1"),
    (lambda: lowrank.compression_ratio(6, 4, 0), "rank must be an integer >= 1, got 0"),
    (lambda: lowrank.compression_ratio(0, 4, 1), "n must be an integer >= 1, got 0"),
    (lambda: lowrank.compression_ratio(6, "4", 1), "m must be an integer >= 1, got '4'"),
    (lambda: lowrank.power_iteration(M, 0), "rank must be an integer between 1 and min(n, m) = 4"),
    (lambda: lowrank.power_iteration(M, True), "got True"),
    (lambda: accumulation.split(X, Y, 6), "k (the number of micro-batches) must be an integer between 1 and 5, got 6"),
    (lambda: accumulation.split(X, Y, 0), "k (the number of micro-batches) must be an integer between 1 and 5, got 0"),
    (lambda: accumulation.split(X, Y, [5, 0]), "micro-batch sizes must be integers >= 1, got [5, 0]"),
    (lambda: accumulation.split(X, Y, [3, 3]), "add up to 6, not the batch size 5"),
    (lambda: accumulation.train_with_accumulation(64, 65, 1), "k must be an integer between 1 and 64, got 65"),
    (lambda: accumulation.train_with_accumulation(0, 1, 1), "batch_size must be an integer between 1 and 1348, got 0"),
    (lambda: accumulation.train_with_accumulation(64, 4, -1), "steps must be an integer >= 0, got -1"),
    (lambda: accumulation.train_with_accumulation(64, 4, 1, lr=math.nan), "lr must be a finite number > 0, got nan"),
    (lambda: accumulation.train_with_accumulation(64, 4, 1, lr=0), "lr must be a finite number > 0, got 0"),
    (lambda: checks.number("busbw", math.inf, 0, low_open=True), "busbw must be a finite number > 0, got inf"),
    (lambda: checks.number("x", 2, 0, 1), "x must be a finite number between 0 and 1, got 2"),
    (lambda: checks.integer("p", 2.0, 1), "p must be an integer >= 1, got 2.0"),
]


@pytest.mark.parametrize("call, words", BAD, ids=[w[:40] for _, w in BAD])
def test_bad_input_is_refused_naming_the_argument(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)


def test_the_edges_of_what_is_allowed_still_work():
    # rank 0 keeps nothing (error 1), full rank keeps everything (error 0); checked against the SVD
    assert lowrank.svd_error(M, 0) == pytest.approx(1.0)
    assert lowrank.svd_error(M, 4) == pytest.approx(0.0, abs=1e-12)
    s = torch.linalg.svdvals(M.double())
    assert lowrank.svd_error(M, 1) == pytest.approx(float(s[1:].norm() / s.norm()))
    assert lowrank.compression_ratio(6, 4, 1) == pytest.approx(24 / 10)
    # k equal to the batch size: micro-batches of one sample each, none empty
    assert [len(y) for _, y in accumulation.split(X, Y, 5)] == [1] * 5
    assert checks.number("x", 1, 0, 1) == 1.0 and checks.integer("p", 1, 1) == 1


def _widgets():
    pytest.importorskip("ipywidgets")
    from course_lib.notebooks import widgets
    return widgets


ONE = {"all-reduce": {"compute_s": 1e-3, "bytes": 1e6, "collectives": 1}}
FP32 = {"fp32 all-reduce": {"compute_s": 1e-3, "codec_s": 0.0, "collectives": {"all_reduce": [1e6]}}}

WIDGETS = [
    (lambda w: w.rank_explorer({"m": M}, rank=0), "rank (for 'm', whose limit is min(max_rank, n, m)) must be an "
                                                  "integer between 1 and 4, got 0"),
    (lambda w: w.rank_explorer({"m": M}, rank=5), "between 1 and 4, got 5"),
    (lambda w: w.rank_explorer({"m": M}, iters=0), "iters must be an integer >= 1, got 0"),
    (lambda w: w.bandwidth_explorer(ONE, 2, busbw=0), "busbw (GB/s, the slider's start) must be a finite number "
                                                      "between 0.1 and 1000, got 0"),
    (lambda w: w.bandwidth_explorer(ONE, 0), "world_size must be an integer >= 1, got 0"),
    (lambda w: w.bandwidth_explorer(ONE, 2, alpha_s=float("nan")), "alpha_s must be a finite number >= 0, got nan"),
    (lambda w: w.compression_explorer(FP32, 2, 1e-5, busbw=500), "between 0.01 and 100, got 500"),
]


@pytest.mark.parametrize("call, words", WIDGETS, ids=[w[:40] for _, w in WIDGETS])
def test_a_widget_refuses_a_start_its_slider_would_silently_clip(call, words):
    with pytest.raises(ValueError) as info:
        call(_widgets())
    assert words in str(info.value)


CONFIGS = [
    (dict(lr=math.nan), "lr must be a finite number > 0, got nan"),
    (dict(lr=-0.1), "lr must be a finite number > 0, got -0.1"),
    (dict(bucket_cap_mb=-1), "bucket_cap_mb must be a finite number > 0, got -1"),
    (dict(momentum=1.5), "momentum must be a finite number between 0 and 1, got 1.5"),
    (dict(ratio=0), "ratio must be a finite number between 0 and 1, got 0"),
    (dict(ratio=2.0), "ratio must be a finite number between 0 and 1, got 2.0"),
    (dict(threshold=math.inf), "threshold must be a finite number >= 0, got inf"),
    (dict(levels=0), "levels must be an integer >= 1, got 0"),
    (dict(qsgd_bucket=1.5), "qsgd_bucket must be an integer >= 0, got 1.5"),
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an integer >= 1, got 0"),
    (dict(orthogonalization_epsilon=math.nan), "orthogonalization_epsilon must be a finite number >= 0, got nan"),
    (dict(sign_aggregate="vote"), "sign_aggregate must be 'mean' or 'majority', got 'vote'"),
    (dict(steps=5, resume_at=50), "resume_at (a step before steps=5, or None) must be an integer between 1 and 4, "
                                  "got 50"),
    (dict(resume_at=0), "must be an integer between 1 and 99, got 0"),
]


@pytest.mark.parametrize("kwargs, words", CONFIGS, ids=[w[:40] for _, w in CONFIGS])
def test_a_training_config_that_would_train_silently_wrong_is_refused(kwargs, words):
    from course_lib.train import TrainConfig

    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs)
    assert words in str(info.value)


def test_the_command_line_refuses_a_nan_learning_rate_before_starting_anything():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "course_lib.train", "--lr", "nan"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr  # argparse's usage error, not a run that trains to NaN
    assert "argument --lr: lr must be a finite number > 0, got nan" in proc.stderr


def _costmodel():
    from course_lib import costmodel
    return costmodel


COSTMODEL = [
    (lambda c: c.ring_all_reduce_time(1e6, 2, 1e-5, -1), "busbw_GBps must be a number > 0 (GB/s), got -1"),
    (lambda c: c.ring_all_reduce_time(1e6, 2, 1e-5, 0), "busbw_GBps must be a number > 0 (GB/s), got 0"),
    (lambda c: c.ring_all_reduce_time(1e6, 2, 1e-5, math.nan), "busbw_GBps must be a number > 0 (GB/s), got nan"),
    (lambda c: c.ring_all_reduce_time(-1, 2, 1e-5, 1), "nbytes must be a finite number >= 0, got -1"),
    (lambda c: c.ring_all_reduce_time(1e6, 0, 1e-5, 1), "world_size must be an integer >= 1, got 0"),
    (lambda c: c.ring_all_reduce_time(1e6, -2, 1e-5, 1), "world_size must be an integer >= 1, got -2"),
    (lambda c: c.ring_all_reduce_time(1e6, 2, -1e-5, 1), "alpha_s (seconds) must be a finite number >= 0, got -1e-05"),
    (lambda c: c.collective_time("all_gather", 1e6, 2, 1e-5, -1), "busbw_GBps must be a number > 0"),
    (lambda c: c.predict_step_time(-1e-3, 1e6, 1, 2, 1e-5, 1), "compute_s must be a finite number >= 0, got -0.001"),
    (lambda c: c.alpha_beta_time("ring_all_reduce", 1e6, 2, math.nan, 1e-9), "alpha_s must be a finite number >= 0"),
    (lambda c: c.fit_alpha_beta([1, 2], [0.0, 1.0]), "a time (seconds; the fit weighs each by 1/time) must be a "
                                                     "finite number > 0, got 0.0"),
    (lambda c: c.fit_alpha_beta([1, 2, 3], [1.0, 2.0]), "got 3 sizes and 2 times"),
    (lambda c: c.fit_alpha_beta([4, 4], [1.0, 2.0]), "need at least two different sizes"),
    (lambda c: c.ring_crossover_bytes(2, 1e-5, "1"), "busbw_GBps must be a number > 0 (GB/s), got '1'"),
    (lambda c: c.break_even_bandwidth({}, {}, 2, 1e-5, method_steps=0), "method_steps must be a finite number > 0"),
]


@pytest.mark.parametrize("call, words", COSTMODEL, ids=[w[:40] for _, w in COSTMODEL])
def test_the_cost_model_refuses_what_would_give_a_negative_or_nan_time(call, words):
    with pytest.raises(ValueError) as info:
        call(_costmodel())
    assert words in str(info.value)


def test_an_infinitely_fast_link_costs_only_latency():
    c = _costmodel()
    assert c.ring_all_reduce_time(1e9, 4, 1e-5, math.inf) == pytest.approx(2 * 3 * 1e-5)


MORE = [
    (lambda: lowrank.orthogonalize_(torch.randn(5, 2), math.nan), ValueError, "epsilon must be a finite number >= 0"),
    (lambda: lowrank.orthogonalize_(torch.ones(5, 2, dtype=torch.int64)), TypeError, "pass matrices.float()"),
    (lambda: lowrank.power_step(M, torch.randn(5, 2)), ValueError,
     "M @ Q needs M's columns to be Q's rows, one batch and one dtype: M is (6, 4) torch.float32, Q (5, 2)"),
    (lambda: lowrank.relative_error(torch.zeros(3, 3), torch.zeros(3, 1), torch.zeros(3, 1)), ValueError,
     "M is all zeros"),
    (lambda: lowrank.svd_error(torch.zeros(3, 3), 1), ValueError, "M is all zeros"),
    (lambda: accumulation.accumulate_tokens(accumulation.bigram_lm(), [accumulation.token_sequences(2)], 0),
     ValueError, "n_tokens must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("call, kind, words", MORE, ids=[w[:40] for _, _, w in MORE])
def test_more_bad_input(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    assert words in str(info.value)


def test_model_data_and_powersgd_helpers_refuse_bad_sizes():
    from course_lib import powersgd
    from course_lib.utils import digits

    for call, words in ((lambda: digits.mlp(hidden=0), "hidden must be an integer >= 1, got 0"),
                        (lambda: digits.mlp(depth=-1), "depth must be an integer >= 0, got -1"),
                        (lambda: digits.batch_slice(0, 64, 100, 0, 0), "world_size must be an integer >= 1, got 0"),
                        (lambda: digits.batch_slice(0, 64, 100, 3, 2),
                         "rank must be an integer between 0 and 1, got 3"),
                        (lambda: powersgd.numbers_per_step([(6, 4)], 0),
                         "matrix_approximation_rank must be an integer >= 1, got 0"),
                        (lambda: powersgd.should_compress(-6, 4, 1, 2), "num_rows must be an integer >= 1, got -6")):
        with pytest.raises(ValueError) as info:
            call()
        assert words in str(info.value)
    assert len(digits.mlp(depth=0)) == 1  # no hidden layer: one Linear, allowed


def test_compressors_refuse_or_show_what_they_cannot_send():
    from course_lib import compression
    from course_lib import compressors as C

    with pytest.raises(ValueError, match=r"pack_bits packs integers from 0 to 15 in 4 bits; got torch.int64 values "
                                         r"from 0 to 16"):
        C.pack_bits(torch.tensor([0, 3, 16]), 4)  # 16 used to come back as 0
    with pytest.raises(ValueError, match="got torch.float32 values"):
        C.pack_bits(torch.tensor([0.5, 1.0]), 4)  # a fraction would be cut off
    assert C.unpack_bits(C.pack_bits(torch.tensor([4.0, 7.0]), 3), 3, 2).tolist() == [4, 7]  # whole floats are fine
    assert C.unpack_bits(C.pack_bits(torch.tensor([0, 3, 15]), 4), 4, 3).tolist() == [0, 3, 15]
    with pytest.raises(ValueError, match="must be a finite number > 0, got nan"):
        C.Threshold(math.nan)
    # a NaN gradient entry is sent, and arrives as NaN, instead of being dropped to 0
    payload, ctx = C.Threshold(0.5).compress(torch.tensor([0.1, math.nan, 2.0]))
    out = C.Threshold(0.5).decompress(payload, ctx)
    assert out[0] == 0 and math.isnan(out[1]) and out[2] == 2.0
    with pytest.raises(OverflowError, match=r"entries up to 1e\+06 do not fit in torch.float16 \(largest 65504\)"):
        C.FP16().compress(torch.tensor([1.0, 1e6]))
    assert torch.isinf(C.FP16().decompress(*C.FP16().compress(torch.tensor([math.inf]))))[0]  # inf in, inf out
    with pytest.raises(TypeError, match="memory must be 'auto' or an object with compensate"):
        compression.CompressionState(C.TopK(0.01), memory="bogus")


def _bandwidth():
    from course_lib import bandwidth

    return bandwidth


BANDWIDTH = [  # refused before any collective: no process group is needed to see the message
    (lambda b: b.measure_collective("allreduce", [4096]), "op must be one of all_reduce, broadcast, reduce, "
     "all_gather, reduce_scatter, got 'allreduce'"),
    (lambda b: b.measure_like_nccl_tests("all_reduce", [4096, 0]),
     "each of sizes_bytes must be an integer >= 1, got 0"),
    (lambda b: b.measure_like_nccl_tests("all_reduce", [-8]), "each of sizes_bytes must be an integer >= 1, got -8"),
    (lambda b: b.measure_collective("all_reduce", [1.5e6]),
     "each of sizes_bytes must be an integer >= 1, got 1500000.0"),
    (lambda b: b.measure_collective("all_reduce", None), "sizes_bytes must be a list of integers >= 1, got None"),
    (lambda b: b.measure_collective("all_reduce", [4096], iters=0), "iters must be an integer >= 1, got 0"),
    (lambda b: b.measure_like_nccl_tests("all_reduce", [4096], warmup=-1), "warmup must be an integer >= 0, got -1"),
    (lambda b: b.sweep(0, 2, ops=("all_reduce", "gather")), "op must be one of all_reduce"),
    (lambda b: b.sweep(0, 2, sizes_bytes=[0]), "each of sizes_bytes must be an integer >= 1, got 0"),
    (lambda b: b.sweep(0, 2, method="nccl"), "unknown method 'nccl'"),
    (lambda b: b.ping_pong(0, 1, [4096]), "ping_pong needs 2 or more ranks"),
    (lambda b: b.one_message(0, 1, [4096]), "one_message needs 2 or more ranks"),
    (lambda b: b.ping_pong(0, 2, [4096], iters=0), "iters must be an integer >= 1, got 0"),
    (lambda b: b.time_algorithms(0, 2, [-1]), "each of sizes_bytes must be an integer >= 1, got -1"),
    (lambda b: b.measure_gamma(nbytes=0), "nbytes must be an integer >= 4, got 0"),
    (lambda b: b.measure_gamma(threads=0), "threads must be an integer >= 1, got 0"),
    (lambda b: b.concurrent_messages(0, 2, [4096], senders=3), "1 <= senders <= world_size, got 3 of 2"),
    (lambda b: b.concurrent_messages(0, 2, [0]), "each of sizes_bytes must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("call, words", BANDWIDTH, ids=[w[:40] for _, w in BANDWIDTH])
def test_measurements_refuse_sizes_ops_and_loops_they_cannot_time(call, words):
    with pytest.raises(ValueError) as info:
        call(_bandwidth())
    assert words in str(info.value)


def _dgc_state(**kwargs):
    from course_lib import compression

    return compression.dgc_state(**kwargs)


def _modules():
    from course_lib import compressors as compression
    from course_lib import costmodel
    from course_lib.utils import digits, shapes, timing

    return costmodel, compression, digits, timing, shapes


SWEEP = [  # found by trying, as a student would: each used to divide by zero, raise a KeyError or return a value
    (lambda cm, C, D, T, S: cm.bus_factor("all_reduce", 0), ValueError, "world_size must be an integer >= 1, got 0"),
    (lambda cm, C, D, T, S: cm.bus_factor("all_reduce", "2"), ValueError, "world_size must be an integer >= 1"),
    (lambda cm, C, D, T, S: cm.ring_crossover_bytes(1, 1e-5, 10), ValueError,
     "world_size (a ring of one rank has no crossover) must be an integer >= 2, got 1"),
    (lambda cm, C, D, T, S: cm.fit_ring_all_reduce([{"size": 1}, {"size": 2}], 2), ValueError,
     "rows must be measurements as course_lib.bandwidth returns them: dicts with 'size_bytes' and 'time_s'"),
    (lambda cm, C, D, T, S: cm.fit_collective([{"bytes": 1}], "all_gather", 2), ValueError, "dicts with 'size_bytes'"),
    (lambda cm, C, D, T, S: C.payload_bytes(torch.ones(3)), TypeError, "got one tensor: pass [tensor]"),
    (lambda cm, C, D, T, S: C.unpack_bits(C.pack_bits(torch.tensor([1, 2]), 4), 4, 10), ValueError,
     "numel must be an integer from 0 to 2 (1 bytes hold at most that many 4-bit values), got 10"),
    (lambda cm, C, D, T, S: C.unpack_bits(torch.zeros(1, dtype=torch.uint8), 0, 1), ValueError,
     "bits must be an integer from 1 to 8, got 0"),
    (lambda cm, C, D, T, S: _dgc_state(density=0), ValueError, "density is the fraction of entries sent"),
    (lambda cm, C, D, T, S: D.digits_tensors(test_fraction=0), ValueError, "test_fraction must be a finite number"),
    (lambda cm, C, D, T, S: D.digits_tensors(test_fraction=1), ValueError, "leaves no training data"),
    (lambda cm, C, D, T, S: D.digits_tensors(test_fraction=1.5), ValueError, "between 0 and 1, got 1.5"),
    (lambda cm, C, D, T, S: D.batch_slice(-1, 10, 100), ValueError, "step must be an integer >= 0, got -1"),
    (lambda cm, C, D, T, S: D.gradient_snapshots(2, lr=math.nan), ValueError,
     "lr must be a finite number > 0, got nan"),
    (lambda cm, C, D, T, S: D.gradient_snapshots(-1), ValueError, "steps must be an integer >= 0, got -1"),
    (lambda cm, C, D, T, S: T.median_seconds(3), TypeError, "fn must be a function to call with no arguments"),
    (lambda cm, C, D, T, S: T.median_seconds(lambda: None, warmup=-1), ValueError,
     "warmup must be an integer >= 0, got -1"),
    (lambda cm, C, D, T, S: S.resnet18_cifar_shapes(0), ValueError, "num_classes must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("call, kind, words", SWEEP, ids=[w[:40] for _, _, w in SWEEP])
def test_what_a_sweep_of_bad_input_found(call, kind, words):
    with pytest.raises(kind) as info:
        call(*_modules())
    assert words in str(info.value)


def test_the_edges_the_sweep_checks_still_work():
    cm, C, D, T, S = _modules()
    assert cm.bus_factor("all_reduce", 1) == 0.0 and len(D.digits_tensors(test_fraction=0.5)[2]) == 898
    assert D.batch_slice(0, 10, 100) == slice(0, 10) and T.median_seconds(lambda: None, warmup=0) >= 0
    assert C.unpack_bits(C.pack_bits(torch.tensor([1, 2, 3]), 4), 4, 3).tolist() == [1, 2, 3]
    assert len(S.resnet18_cifar_shapes(100)) == len(S.resnet18_cifar_shapes())


def _student_functions():
    from course_lib.notebooks import exercises

    return exercises


def _unimportable(x):  # stands for a function a student defined in a notebook cell
    return x


_unimportable.__module__ = "__main__"

FOUND_LATER = [  # a second sweep, of lowrank, accumulation, data_parallel, compression memory and the exercises
    (lambda: lowrank.power_step_p(M, torch.randn(5, 2)), ValueError, "M is (6, 4) torch.float32, Q (5, 2)"),
    (lambda: lowrank.power_step_qt(M, torch.randn(5, 2)), ValueError,
     "P^T @ M needs P^T's columns to be M's rows"),
    (lambda: lowrank.power_step_p(M, torch.randn(4, 2, dtype=torch.float64)), ValueError, "Q (4, 2) torch.float64"),
    (lambda: lowrank.relative_error(M, torch.randn(5, 2), torch.randn(4, 2)), ValueError,
     "P @ Q^T must have M's shape (6, 4): P is (5, 2), Q (4, 2)"),
    (lambda: lowrank.power_iteration(M, 2, iters="2"), ValueError, "iters must be an integer >= 1, got '2'"),
    (lambda: lowrank.power_iteration(M, 2, q=torch.randn(4, 2, dtype=torch.float64)), ValueError,
     "q must be (4, 2) torch.float32 like M, got (4, 2) torch.float64"),
    (lambda: lowrank.power_iteration(torch.ones(6, 4, dtype=torch.int64), 2), TypeError, "pass M.float()"),
    (lambda: lowrank.power_iteration_without_orthogonalization(M, 2, -1), ValueError,
     "iters must be an integer >= 1, got -1"),
    (lambda: lowrank.svd_error(torch.full((3, 3), math.nan), 1), ValueError, "M holds nan or inf"),
    (lambda: lowrank.track_error_feedback([M, torch.randn(5, 4)], 2), ValueError,
     "matrices must all have one shape (the error carried is the last one's): matrix 1 is (5, 4)"),
    (lambda: lowrank.time_methods([(0, 4)]), ValueError, "each of shapes must be a pair (n, m) of integers >= 1, "
                                                        "got (0, 4)"),
    (lambda: lowrank.time_methods([5]), ValueError, "each of shapes must be a pair (n, m) of integers >= 1, got 5"),
    (lambda: lowrank.time_methods([(3, 3)], rank=5), ValueError, "rank (for shape (3, 3)) must be an integer between "
                                                                 "1 and 3, got 5"),
    (lambda: lowrank.time_methods([(3, 3)], repeats=0), ValueError, "repeats must be an integer >= 1, got 0"),
    (lambda: accumulation.accumulate(torch.nn.Linear(3, 2), torch.nn.functional.cross_entropy, []), ValueError,
     "micro_batches must be a non-empty list of (x, y) pairs (e.g. from split), got []"),
    (lambda: accumulation.accumulate_naive(torch.nn.Linear(3, 2), torch.nn.functional.cross_entropy, []),
     ValueError, "micro_batches must be a non-empty list"),
    (lambda: accumulation.accumulate_tokens(accumulation.bigram_lm(), [], 5), ValueError,
     "micro_batches must be a non-empty list"),
    (lambda: accumulation.accumulate_tokens(accumulation.bigram_lm(), [accumulation.token_sequences(2)], 5,
                                            world_size=0), ValueError, "world_size must be an integer >= 1, got 0"),
    (lambda: accumulation.token_sequences(3, vocab=0), ValueError, "vocab must be an integer >= 1, got 0"),
    (lambda: accumulation.bigram_lm(vocab=0), ValueError, "vocab must be an integer >= 1, got 0"),
    (lambda: accumulation.optimizer_state_bytes("adam"), TypeError, "optimizer must be a torch.optim.Optimizer"),
]


@pytest.mark.parametrize("call, kind, words", FOUND_LATER, ids=[w[:40] for _, _, w in FOUND_LATER])
def test_what_a_second_sweep_found(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    assert words in str(info.value)


def test_data_parallel_compression_and_powersgd_refuse_what_they_used_to_accept():
    from course_lib import compressors as C
    from course_lib import data_parallel as dp
    from course_lib import memory as M
    from course_lib import powersgd

    for call, kind, words in (
        (lambda: dp.assign_buckets([4, 4], math.nan), ValueError, "cap_bytes must be a finite number > 0, got nan"),
        (lambda: dp.assign_buckets([-4, 4], 8), ValueError, "each of sizes_bytes must be a finite number >= 0, got -4"),
        (lambda: dp.exposed_communication([]), ValueError, "events hold no backward"),
        (lambda: dp.DataParallelBucket(torch.nn.Linear(2, 2), bucket_cap_mb=-1), ValueError,
         "bucket_cap_mb must be a finite number > 0, got -1"),  # refused before it asks for a process group
        (lambda: C.TopK(0.1).wire_bytes(-5), ValueError, "numel must be an integer >= 0, got -5"),
        (lambda: powersgd.PowerSGDState(None, warm_start="no"), TypeError,
         "warm_start must be True or False, got 'no'"),
        (lambda: powersgd.PowerSGDState(None).load_state_dict({"iter": 3}), ValueError,
         "state must be what PowerSGDState.state_dict() returned; it lacks ['error_dict', 'hyperparameters'"),
    ):
        with pytest.raises(kind) as info:
            call()
        assert words in str(info.value)
    memory = M.ErrorFeedback()
    memory.update("w", torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="the memory kept 3 numbers for key 'w', and now gets 4"):
        memory.compensate("w", torch.ones(4))
    # an empty tensor is sent as nothing (it used to fail in topk); one entry is always kept otherwise
    payload, ctx = C.TopK(0.1).compress(torch.zeros(0))
    assert C.TopK(0.1).decompress(payload, ctx).shape == (0,) and C.TopK(0.1).k(1) == 1
    assert dp.assign_buckets([4.0, 4.0, 1.5], 8) == [[0, 1], [2]]  # sizes computed as floats are fine
    assert dp.assign_buckets([], 8) == [] and dp.exposed_communication(
        [dp.Event("backward", "b", 0.0, 1.0)]) == 0.0  # no all-reduce: nothing exposed


@pytest.mark.parametrize("bad, kind, words", [
    (None, TypeError,
     "pass your function itself (ring_shift, not ring_shift(...), which is what it returns); got None"),
    (lambda t: t, ValueError, "this check, which runs your function in new processes, cannot send a lambda"),
    (_unimportable, ValueError, "cannot send '_unimportable': it is defined in __main__"),
])
def test_an_exercise_check_says_what_to_pass_before_starting_processes(bad, kind, words, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a notebook's: no file
    with pytest.raises(kind) as info:
        _student_functions().check_ring_shift(bad)
    assert words in str(info.value)


def test_an_exercise_check_on_one_process_refuses_a_value_for_a_function():
    with pytest.raises(TypeError, match=r"pass your function itself \(rank1_error, not rank1_error\(...\)"):
        _student_functions().check_rank1_error(0.5)


def test_terngrad_keeps_a_tensor_whose_entries_are_all_equal():
    from course_lib import compressors as C

    # Clipping at 2.5 standard deviations used to clip a tensor with no spread (one entry, or all entries
    # equal) to 0: every entry sent as 0. Its largest magnitude is then its scale, and each entry is sent.
    for t in (torch.tensor([0.7]), torch.full((6,), -0.3)):
        tern = C.TernGrad()
        assert torch.equal(tern.decompress(*tern.compress(t)), t)
    payload, ctx = C.TernGrad().compress(torch.zeros(0))
    assert C.TernGrad().decompress(payload, ctx).shape == (0,)
