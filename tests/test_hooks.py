import pytest
import torch
from torch import nn

from course_lib.launch import spawn
from course_lib.train import TrainConfig, TrainingInParts, train_several
from course_lib.utils.digits import digits_tensors, mlp
from tests import ddp_workers as W

STEPS, BATCH = 6, 64


def _reference_params(steps=STEPS, batch=BATCH, lr=0.1):
    """One process, plain SGD on each whole global batch, as ddp_train slices them."""
    x_train, y_train, _, _ = digits_tensors(seed=0)
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        start = (step * batch) % (len(x_train) - batch + 1)
        idx = order[start : start + batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _run(hook_names, world_size=2):
    configs = [TrainConfig(hook=h, steps=STEPS, batch_size=BATCH, eval_every=STEPS) for h in hook_names]
    return spawn(train_several, world_size, configs, backend="gloo")


def _close(a, b, rtol, atol):
    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def test_default_hooks_against_a_single_process_reference():
    names = ["allreduce", "fp16", "bf16", "noop"]
    out = _run(names)
    ref = _reference_params()
    res = {n: [o[i] for o in out] for i, n in enumerate(names)}
    n_params = sum(p.numel() for p in ref)
    # allreduce: what DDP does; equal to one process on the whole batch
    assert _close(res["allreduce"][0].final_params, ref, 1e-5, 1e-6)
    assert res["allreduce"][0].bytes[-1] == STEPS * n_params * 4
    # fp16 / bf16: half the bytes, close to the reference, identical on both ranks
    for name, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
        r0, r1 = res[name]
        assert r0.bytes[-1] == STEPS * n_params * 2
        assert _close(r0.final_params, ref, tol, tol)
        assert not _close(r0.final_params, ref, 1e-7, 0)  # really compressed
        assert all(torch.equal(a, b) for a, b in zip(r0.final_params, r1.final_params))
    # noop: nothing sent, and the ranks drift apart
    r0, r1 = res["noop"]
    assert r0.bytes[-1] == 0
    assert not _close(r0.final_params, r1.final_params, 1e-4, 1e-6)


def test_seed_usages_work_on_gloo_and_wrapper_equals_hook():
    out = spawn(W.seed_usages, 2, backend="gloo")
    for r in out:
        for a, b in zip(r["hook"], r["wrapper"]):
            assert torch.equal(a, b)
        for a, b in zip(r["fp16_hook"], r["fp16_wrapper"]):
            assert torch.equal(a, b)
        # fp16 keeps more mantissa than bf16: the two really are different casts
        assert any(not torch.equal(a, b) for a, b in zip(r["hook"], r["fp16_hook"]))
    # both ranks hold the same averaged gradient
    for a, b in zip(out[0]["hook"], out[1]["hook"]):
        assert torch.equal(a, b)


def test_training_in_parts_gives_what_one_spawn_gives():
    configs = [TrainConfig(hook=h, steps=s, batch_size=BATCH, eval_every=2, seed=seed, matrix_approximation_rank=1,
                           start_powerSGD_iter=2)
               for h, s, seed in (("allreduce", 4, 0), ("powersgd", 6, 1), ("fp16", 2, 2), ("powersgd", 4, 3))]
    whole = spawn(train_several, 2, configs, backend="gloo")
    parts = TrainingInParts(configs, 3, backend="gloo")
    assert [len(p) for p in parts.parts] == [2, 1, 1] and [c for p in parts.parts for c in p] == configs
    with pytest.raises(RuntimeError, match=r"part\(s\) \[0, 1, 2\] not trained yet"):
        _ = parts.done
    for k in (2, 0, 1, 1):  # in any order, one part again
        parts.run(k)
    done = parts.done
    assert len(done) == 2 and [len(d) for d in done] == [4, 4]
    for rank in range(2):
        for a, b in zip(done[rank], whole[rank]):
            assert a.loss == b.loss and a.test_accuracy == b.test_accuracy
            assert all(torch.equal(x, y) for x, y in zip(a.final_params, b.final_params))
    # and a wrong join (parts out of order) would not pass the comparison above
    assert done[0][0].loss != whole[0][1].loss


@pytest.mark.parametrize("configs, parts, message", [
    ([], 1, "non-empty list of TrainConfig"),
    (["allreduce"], 1, "non-empty list of TrainConfig"),
    ([TrainConfig()], 0, "parts must be an integer from 1 to len"),
    ([TrainConfig()], 2, "parts must be an integer from 1 to len"),
    ([TrainConfig()], 1.0, "parts must be an integer"),
])
def test_training_in_parts_refuses_bad_input(configs, parts, message):
    with pytest.raises(ValueError, match=message):
        TrainingInParts(configs, parts)


def test_training_in_parts_refuses_a_part_that_does_not_exist():
    parts = TrainingInParts([TrainConfig(steps=2), TrainConfig(steps=2)], 2)
    for bad in (2, -1, "0", True):
        with pytest.raises(ValueError, match="part must be an integer from 0 to 1"):
            parts.run(bad)
