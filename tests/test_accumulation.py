import pytest
import torch
from torch import nn

from course_lib import accumulation as acc
from course_lib.launch import spawn
from course_lib.support import exercises as ex
from course_lib.support.digits import digits_tensors, mlp


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _batch(n=48, seed=0):
    x, y, _, _ = digits_tensors()
    return x[:n], y[:n]


def _full_batch_grads(x, y, seed=1):
    model = mlp(seed=seed)
    nn.CrossEntropyLoss()(model(x), y).backward()
    return _grads(model)


def test_equal_micro_batches_give_the_large_batch_gradient():
    x, y = _batch()
    want = _full_batch_grads(x, y)
    for fn in (acc.accumulate, acc.accumulate_naive):
        model = mlp(seed=1)
        fn(model, nn.CrossEntropyLoss(), acc.split(x, y, 4))
        for g, w in zip(_grads(model), want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_forgetting_to_divide_is_k_times_too_large():
    x, y = _batch()
    want = _full_batch_grads(x, y)
    model = mlp(seed=1)
    for xb, yb in acc.split(x, y, 4):
        nn.CrossEntropyLoss()(model(xb), yb).backward()
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, 4 * w, rtol=1e-5, atol=1e-6)


def test_unequal_micro_batches_naive_is_wrong_and_weighted_is_right():
    x, y = _batch()
    want = _full_batch_grads(x, y)
    sizes = [30, 10, 5, 3]
    naive, fixed = mlp(seed=1), mlp(seed=1)
    acc.accumulate_naive(naive, nn.CrossEntropyLoss(), acc.split(x, y, sizes))
    acc.accumulate(fixed, nn.CrossEntropyLoss(), acc.split(x, y, sizes))
    for g, w in zip(_grads(fixed), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    rel = max(((g - w).norm() / w.norm()).item() for g, w in zip(_grads(naive), want))
    assert rel > 0.01


def test_split_checks_sizes():
    x, y = _batch(10)
    with pytest.raises(ValueError, match="add up to 9"):
        acc.split(x, y, [4, 5])


def test_training_curves_coincide():
    a = acc.train(64, 1, steps=20)
    b = acc.train(64, 4, steps=20)
    assert max(abs(u - v) for u, v in zip(a, b)) < 1e-4
    assert a[-1] < a[0]


def test_saved_activation_bytes_matches_hand_count():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    for batch in (8, 100):
        # first Linear saves its input (batch x 64); ReLU saves its output (batch x 32), which the
        # second Linear also saves as its input; weights are parameters and not counted
        assert acc.saved_activation_bytes(model, torch.randn(batch, 64)) == 4 * batch * (64 + 32)


def test_ddp_no_sync_cuts_all_reduces_and_matches_single_process():
    k, steps, global_batch = 4, 3, 32
    out = spawn(acc.ddp_accumulation_worker, 2, k, steps, global_batch, backend="gloo")
    for rank_out in out:
        assert rank_out["sync"]["all_reduces"] == k * steps  # one bucket: one all-reduce per backward
        assert rank_out["no_sync"]["all_reduces"] == steps
        for a, b in zip(rank_out["sync"]["params"], rank_out["no_sync"]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(out[0]["no_sync"]["params"], out[1]["no_sync"]["params"]):
        assert torch.equal(a, b)
    # reference: one process, plain SGD on each whole global batch
    x_train, y_train, _, _ = digits_tensors()
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        sl = slice(step * global_batch, (step + 1) * global_batch)
        nn.CrossEntropyLoss()(model(x_train[sl]), y_train[sl]).backward()
        opt.step()
    for a, b in zip(out[0]["no_sync"]["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_exercise_checks_accept_the_reference_and_reject_the_classic_bugs(capsys):
    # the checks' references are computed another way: autograd on the whole batch at once, and the
    # cross-entropy written out with log_softmax
    assert ex.check_accumulate(acc.accumulate)
    assert not ex.check_accumulate(acc.accumulate_naive)  # fails on the unequal split
    assert "case 1" in capsys.readouterr().out
    assert ex.check_micro_batch_loss(acc.micro_batch_loss)
    assert not ex.check_micro_batch_loss(lambda logits, y, n: nn.functional.cross_entropy(logits, y))


def test_graph_lines_end_in_accumulate_grad():
    layer = nn.Linear(2, 1)
    loss = (layer(torch.ones(1, 2)) - 1).pow(2).sum()
    lines = acc.graph_lines(loss)
    assert lines[0] == "SumBackward0"
    assert sum("AccumulateGrad" in line for line in lines) == 2


def test_saved_activation_bytes_counts_a_slice_not_its_whole_dataset():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    data = torch.randn(1000, 64)
    assert acc.saved_activation_bytes(model, data[:8]) == 4 * 8 * (64 + 32)
