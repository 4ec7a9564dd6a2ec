import pytest
import torch
from torch import nn

from course_lib import accumulation as acc
from course_lib.launch import spawn
from course_lib.utils.digits import digits_tensors, mlp


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
    a = acc.train_with_accumulation(64, 1, steps=20)
    b = acc.train_with_accumulation(64, 4, steps=20)
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
    grad_bytes = 4 * sum(p.numel() for p in mlp(seed=0).parameters())
    for rank_out in out:
        # the profiler saw every all-reduce DDP issued, each carrying the whole (small) gradient
        assert rank_out["sync"]["all_reduces"] == [[grad_bytes] * k] * steps
        assert rank_out["no_sync"]["all_reduces"] == [[grad_bytes]] * steps
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


def test_all_reduce_counter_sees_only_all_reduces():
    # what the worker counts, on one process: a gloo group of 1 still runs (and records) the collective
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with acc._quiet_stderr(), torch.profiler.profile(record_shapes=True) as prof:
            dist.all_reduce(torch.ones(3, 5))
            dist.broadcast(torch.ones(7), 0)
            dist.all_reduce(torch.ones(2))
        assert acc._all_reduces(prof.events()) == [4 * 15, 4 * 2]
    finally:
        dist.destroy_process_group()


def _token_reference_grads(sequences):
    """The full batch's gradient, the cross-entropy written out: -log softmax at the target, mean over tokens."""
    model = acc.bigram_lm()
    inputs = torch.cat([s[:-1] for s in sequences])
    targets = torch.cat([s[1:] for s in sequences])
    log_p = torch.log_softmax(model(inputs), dim=1)
    (-log_p[torch.arange(len(targets)), targets].sum() / len(targets)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _relative_error(grads, want):
    got = torch.cat([g.flatten() for g in grads])
    return ((got - want).norm() / want.norm()).item()


def test_token_accumulation_matches_the_full_batch_and_the_naive_loop_does_not():
    sequences = acc.token_sequences(12, seed=3)
    micro = [sequences[:2], sequences[2:7], sequences[7:]]
    assert len({sum(len(s) - 1 for s in m) for m in micro}) == 3  # the micro-batches' token counts differ
    want = _token_reference_grads(sequences)
    fixed, naive = acc.bigram_lm(), acc.bigram_lm()
    acc.accumulate_tokens(fixed, micro, sum(len(s) - 1 for s in sequences))
    acc.accumulate_tokens_naive(naive, micro)
    assert _relative_error([p.grad for p in fixed.parameters()], want) < 1e-12
    assert _relative_error([p.grad for p in naive.parameters()], want) > 0.01


def test_token_sequences_have_unequal_lengths_and_stay_in_the_vocabulary():
    seqs = acc.token_sequences(20, vocab=7, min_len=3, max_len=9, seed=1)
    assert all(3 <= len(s) <= 9 and 0 <= int(s.min()) and int(s.max()) < 7 for s in seqs)
    assert len({len(s) for s in seqs}) > 1
    assert all(torch.equal(a, b) for a, b in zip(seqs, acc.token_sequences(20, vocab=7, min_len=3, max_len=9, seed=1)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_tokens_need_the_global_count(world_size):
    k, n = 2, 12
    out = spawn(acc.ddp_token_worker, world_size, n, k, backend="gloo")
    want = _token_reference_grads(acc.token_sequences(n))
    per_rank = [sum(r["tokens"]) for r in out]
    assert len(set(per_rank)) > 1 and all(r["global_tokens"] == sum(per_rank) for r in out)
    assert _relative_error(out[0]["global count"], want) < 1e-12
    assert _relative_error(out[0]["rank count"], want) > 1e-3  # right per rank, wrong across ranks
    assert _relative_error(out[0]["naive"], want) > 1e-3
    for r in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["global count"], out[0]["global count"]))


def test_optimizer_state_bytes_counts_adams_two_copies():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    adam = torch.optim.Adam(model.parameters())
    assert acc.optimizer_state_bytes(adam) == 0  # no state before the first step
    model(torch.randn(4, 10)).sum().backward()
    adam.step()
    steps_bytes = sum(s["step"].numel() * s["step"].element_size() for s in adam.state.values())
    assert acc.optimizer_state_bytes(adam) == 2 * n_bytes + steps_bytes
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.step()
    assert acc.optimizer_state_bytes(sgd) == 0  # plain SGD keeps nothing


def test_global_batch_and_linear_scaling_with_warmup():
    assert acc.global_batch_size(32, 4, 8) == 1024
    assert acc.scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)  # Goyal et al.'s 8k batch
    assert acc.scaled_lr(0.1, 256, 1024, step=0, warmup_steps=100) == pytest.approx(0.1)
    assert acc.scaled_lr(0.1, 256, 1024, step=50, warmup_steps=100) == pytest.approx(0.25)
    assert acc.scaled_lr(0.1, 256, 1024, step=100, warmup_steps=100) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        acc.global_batch_size(0, 4, 8)


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
