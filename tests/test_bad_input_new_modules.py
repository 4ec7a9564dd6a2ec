"""Bad input, second sweep (the modules added after the first: sharding, local_sgd, compressors, memory,
exchange, compression, costmodel's period functions): a clear error before any state changes or any
collective starts, NaN or infinity in a setting refused rather than taken as "off", byte counts exact
for every dtype, and ranks that disagree stopped at construction. The mistakes are a user's: the
examples of the issue, and others of each kind."""

import math
import warnings

import pytest
import torch
from torch import nn

from course_lib import accumulation, compression, costmodel, exchange, local_sgd, memory, sharding
from course_lib import compressors as C
from course_lib.launch import spawn
from tests import bad_input_workers as W

NAN, INF = math.nan, math.inf


def _param(n=3):
    return nn.Parameter(torch.ones(n))


def _diloco(params, inner_params, **kwargs):
    return local_sgd.DiLoCo(params, torch.optim.SGD(inner_params, lr=0.1), 2, **kwargs)


SHARED = _param()

BAD = [
    # (call, the exception, words the message must contain)
    # a byte count of an impossible tensor
    (lambda: C.QSGD(4).wire_bytes(-100), ValueError, "numel must be an integer >= 0, got -100"),
    (lambda: C.FP16().wire_bytes(2.5), ValueError, "numel must be an integer >= 0, got 2.5"),
    (lambda: C.SignSGD().wire_bytes(True), ValueError, "numel must be an integer >= 0, got True"),
    (lambda: C.TernGrad().wire_bytes(-1), ValueError, "numel must be an integer >= 0, got -1"),
    (lambda: C.RandomK(0.5).wire_bytes(10.0), ValueError, "numel must be an integer >= 0, got 10.0"),
    (lambda: C.Threshold(0.1).wire_bytes(10, kept=11), ValueError, "kept must be an integer between 0 and 10"),
    (lambda: C.TopK(0.5).wire_bytes(10, torch.int32), ValueError, "a floating torch dtype"),
    (lambda: C.TopK(0.5).wire_bytes(10, "bfloat16"), ValueError, "a floating torch dtype"),
    (lambda: C.PerTensor(C.QSGD(4), [3, 2]).wire_bytes(-5), ValueError, "numel must be an integer >= 0, got -5"),
    # a setting that would silently switch something off (NaN, infinity) or is not what it looks like
    (lambda: memory.DGCMemory(clip_norm=NAN), ValueError, "clip_norm (a gradient norm, or None for no clipping) "
                                                          "must be a finite number > 0, got nan"),
    (lambda: memory.DGCMemory(clip_norm=INF), ValueError, "must be a finite number > 0, got inf"),
    (lambda: memory.DGCMemory(momentum=NAN), ValueError, "momentum (in [0, 1), e.g. 0.9) must be a finite number"),
    (lambda: memory.DGCMemory(momentum=1.0), ValueError, "momentum must be in [0, 1)"),
    (lambda: memory.DGCMemory(masking="no"), TypeError, "masking must be True or False, got 'no'"),
    (lambda: memory.DGCMemory(clip_norm=1.0, world_size=0), ValueError, "world_size must be an integer >= 1, got 0"),
    (lambda: C.DensityWarmUp(0.01, warmup_steps=NAN), ValueError, "warmup_steps must be an integer >= 0, got nan"),
    (lambda: C.DensityWarmUp(0.01, warmup_steps=10.5), ValueError, "warmup_steps must be an integer >= 0"),
    (lambda: C.DensityWarmUp(0.01, stages=INF), ValueError, "stages must be an integer >= 1, got inf"),
    (lambda: C.DensityWarmUp(0.01, 100)(-1), ValueError, "step must be an integer >= 0, got -1"),
    (lambda: C.QSGD(4, bucket_size=NAN), ValueError, "bucket_size is a number of entries"),
    (lambda: C.QSGD(4, bucket_size=12.5), ValueError, "bucket_size is a number of entries"),
    (lambda: C.TernGrad(clip_sigma=NAN), ValueError, "clip_sigma is a number of standard deviations"),
    (lambda: C.TernGrad(clip_sigma=INF), ValueError, "clip_sigma is a number of standard deviations"),
    (lambda: C.TopK(INF), ValueError, "0 < ratio <= 1"),
    (lambda: C.TopK("0.1"), ValueError, "0 < ratio <= 1"),
    (lambda: C.RandomK(0.5, scaled="yes"), TypeError, "scaled must be True or False"),
    (lambda: C.PerTensor(C.QSGD(4), [3, -1]), ValueError, "each of numels must be an integer >= 0, got -1"),
    (lambda: C.PerTensor(C.QSGD, [3]), TypeError, "inner is the compressor applied to each piece"),
    (lambda: compression.dgc_state(density=NAN), ValueError, "0 < density <= 1"),
    (lambda: compression.dgc_state(0.01, warmup_steps=NAN), ValueError, "warmup_steps must be an integer >= 0"),
    (lambda: compression.CompressionState(C.TopK(0.01), density=0.05), TypeError,
     "density is a function of the step"),
    # state that would vanish: a layout that does not cover the tensor, a sent tensor of another shape
    (lambda: memory.ErrorFeedback().update(((0, 3), (1, 2)), torch.ones(4), torch.zeros(4)), ValueError,
     "the layout ((0, 3), (1, 2)) holds 5 numbers and the tensor 4"),
    (lambda: memory.DGCMemory(momentum=0.5).update(((0, 2),), torch.ones(4), torch.zeros(4)), ValueError,
     "holds 2 numbers and the tensor 4"),
    (lambda: memory.ErrorFeedback().update("g", torch.ones(4), torch.zeros(1)), ValueError,
     "got shapes (4,) and (1,)"),
    # inputs that are not what they look like
    (lambda: local_sgd.average_parameters(_param()), TypeError, "not one tensor: pass [p]"),
    (lambda: local_sgd.PeriodicModelAverager(2).average_parameters(_param()), TypeError, "not one tensor"),
    (lambda: _diloco([_param()], [_param()]), ValueError,
     "inner must step the parameters DiLoCo averages: it holds 1 tensor(s) not in params"),
    (lambda: _diloco([SHARED, _param()], [SHARED]), ValueError, "1 of params are missing from it"),
    (lambda: _diloco(SHARED, [SHARED]), TypeError, "not one tensor: pass [p]"),
    (lambda: _diloco([SHARED], [SHARED], compress="half"), TypeError, "compress is a function from a tensor"),
    (lambda: _diloco([SHARED], [SHARED], compress=lambda t: t.tolist()), TypeError,
     "compress must return a floating tensor of its input's shape"),
    (lambda: _diloco([SHARED], [SHARED], nesterov="yes"), TypeError, "nesterov must be True or False"),
    (lambda: local_sgd.PostLocalSGDOptimizer(torch.optim.SGD, 4), TypeError,
     "optim must be a torch.optim.Optimizer built over the model's parameters"),
    (lambda: local_sgd.PostLocalSGDOptimizer(torch.optim.SGD([SHARED], lr=0.1), 4), TypeError,
     "averager must be a model averager such as PeriodicModelAverager(period=4), got 4"),
    (lambda: sharding.memory_ledger(nn.Linear(2, 2), torch.ones(3, 2)), TypeError,
     "memory_ledger's second argument is the optimizer (a batch is passed as batch=...)"),
    (lambda: sharding.memory_ledger(nn.Linear(2, 2), batch=[[1.0, 2.0]]), TypeError, "batch must be a tensor"),
    (lambda: sharding.ShardedDataParallel(nn.ReLU(), 1), ValueError, "ReLU has no parameters to shard"),
    (lambda: accumulation.accumulate(nn.Linear(3, 2), nn.functional.cross_entropy,
                                     [(torch.ones(2, 3), torch.zeros(2, dtype=torch.long)),
                                      (torch.ones(0, 3), torch.zeros(0, dtype=torch.long))]),
     ValueError, "micro-batch 1 is empty (0 targets)"),
    (lambda: accumulation.accumulate_naive(nn.Linear(3, 2), nn.functional.cross_entropy,
                                           [(torch.ones(0, 3), torch.zeros(0, dtype=torch.long))]),
     ValueError, "micro-batch 0 is empty (0 targets)"),
    # division by a world size of 0
    (lambda: sharding.communication_seconds(1000, 1, 0, 1e-5, 10.0), ValueError,
     "world_size must be an integer >= 1, got 0"),
    (lambda: sharding.communication_seconds(1000, 3, 0, 1e-5, 10.0), ValueError, "world_size must be an integer"),
    (lambda: sharding.communication_seconds(-1, 0, 2, 1e-5, 10.0), ValueError, "n_params must be an integer >= 0"),
    # a search that could not end: the reference a rounding step above the computation
    (lambda: costmodel.break_even_period(1.0, 4e6, math.nextafter(1.0, 2.0), 2, 1e-5, 10.0), ValueError,
     "is within rounding of compute_s"),
    # other instances of the same kinds, found by trying each entry point as a user would
    (lambda: memory.ParameterKeys().layout(_param()), TypeError, "not one tensor: pass [p]"),
    (lambda: exchange.combine(C.FP16(), [[torch.ones(2)]], None, 0), ValueError,
     "world_size must be an integer >= 1, got 0"),
    (lambda: exchange.exchange(C.FP16(), torch.ones(2)), TypeError, "payload is a list of tensors"),
    (lambda: sharding.ShardedDataParallel(nn.Linear(2, 2), 1, events={}), TypeError,
     "events is a list that receives (what, unit, start, end)"),
]


@pytest.mark.parametrize("call, kind, words", BAD, ids=[w[:48] for _, _, w in BAD])
def test_a_mistake_gets_a_clear_error(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    assert words in str(info.value)


def test_a_memory_refuses_before_it_changes():
    feedback = memory.ErrorFeedback()
    feedback.update(((0, 2), (1, 2)), torch.ones(4), torch.zeros(4))
    kept = {k: v.clone() for k, v in feedback.memory.items()}
    with pytest.raises(ValueError):
        feedback.update(((0, 2), (1, 3)), torch.full((4,), 5.0), torch.zeros(4))
    assert {k: v.tolist() for k, v in feedback.memory.items()} == {k: v.tolist() for k, v in kept.items()}


def test_the_edges_still_work():
    # empty tensors and the smallest settings compress and count
    assert C.RandomK(0.5, scaled=True).compress(torch.ones(0))[0][0].numel() == 0
    payload, ctx = C.RandomK(0.5, scaled=True).compress(torch.ones(0))
    assert C.RandomK(0.5, scaled=True).decompress(payload, ctx).shape == (0,)
    assert C.TopK(0.5).wire_bytes(0) == 0 and C.FP16().wire_bytes(0, torch.bfloat16) == 0
    assert C.DensityWarmUp(0.01, warmup_steps=0)(0) == 0.01
    assert memory.DGCMemory(momentum=0.0, clip_norm=1e-3, world_size=1).clip_norm == 1e-3
    assert C.TernGrad(clip_sigma=1).clip_sigma == 1 and C.QSGD(4, bucket_size=None).bucket_size is None
    # a reference clearly above the computation still finds its period, as before
    assert costmodel.break_even_period(1e-3, 4e6, 2e-3, 2, 1e-5, 10.0) >= 1
    assert sharding.communication_seconds(1000, 3, 1, 1e-5, 10.0) == 0.0


def test_post_local_sgd_loads_a_plain_optimizers_state_as_torch_does():
    # torch's PostLocalSGDOptimizer: a state dict without "step" warns and starts the averager at 0
    p = _param()
    opt = local_sgd.PostLocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), local_sgd.PeriodicModelAverager(4))
    opt.averager.step = 50
    with pytest.warns(UserWarning, match="does not contain a step counter"):
        opt.load_state_dict(torch.optim.SGD([p], lr=0.1).state_dict())
    assert opt.averager.step == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict({**opt.state_dict(), "step": 7})
    assert opt.averager.step == 7
    with pytest.raises(ValueError, match="the averager's step must be an integer >= 0, got -3"):
        opt.load_state_dict({**opt.state_dict(), "step": -3})


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("what", ["shapes", "dtype", "units"])
def test_ranks_that_wrap_different_models_are_stopped_at_construction(stage, what):
    # as torch's DDP refuses them: every rank says so, with every rank's layout, before any broadcast
    errors = spawn(W.models_that_differ, 2, stage, what)
    for error in errors:
        assert error is not None and error[0] == "ValueError", error
        assert "the ranks wrap different models" in error[1]
    if what == "shapes":
        assert "weight [2, 6] float32" in errors[0][1] and "weight [3, 4] float32" in errors[0][1]
    if what == "dtype":
        assert "float64" in errors[0][1] and "float32" in errors[0][1]


def test_the_same_model_on_every_rank_still_builds():
    assert spawn(W.models_that_differ, 2, 1, "none") == [None, None]


def test_a_module_wrapped_twice_is_refused():
    for kind, message in spawn(W.wrapped_twice, 2):
        assert kind == "ValueError" and "already wrapped by a ShardedDataParallel" in message


def test_a_sharded_optimizers_state_bytes_are_its_ranks_share():
    shares = spawn(W.sharded_optimizer_state_bytes, 2)
    whole = shares[0][1]  # a plain Adam's state over the whole model
    assert all(0 < share < whole for share, _ in shares)  # each rank keeps a part (it was counted as 0)
    assert sum(share for share, _ in shares) == whole


def test_a_density_that_is_not_a_ratio_is_refused_in_the_hook_on_every_rank():
    for error in spawn(W.density_that_is_not_a_ratio, 2):
        assert error is not None and "state.density(0) must be a ratio: 0 < ratio <= 1, got 2" in error[1]



def test_a_sharded_optimizer_refuses_a_state_dict_that_is_not_one():
    assert spawn(W.sharded_optimizer_bad_state_dict, 2) == [True, True]
