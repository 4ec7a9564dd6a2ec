"""course_lib.sharding on real gloo processes: against one process on the whole batch, torch's DDP,
ZeroRedundancyOptimizer and FSDP2's fully_shard; its memory against its own arithmetic."""

import math

import pytest
import torch

from course_lib import sharding
from course_lib.launch import spawn
from course_lib.utils.digits import mlp
from tests import sharding_workers as W


def _close(a: dict, b: dict, atol=1e-6, msg=""):
    assert a.keys() == b.keys(), msg
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=f"{msg} {name}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_reduce_scatter_and_all_gather_match_torch_and_send_p_minus_1_chunks(world_size):
    for rank, rows in enumerate(spawn(W.new_collectives, world_size, backend="gloo")):
        for row in rows:
            n, chunks = row["n"], [len(c) for c in torch.empty(row["n"]).tensor_split(world_size)]
            torch.testing.assert_close(row["chunk"], row["want"], msg=f"rank {rank}, length {n}")
            torch.testing.assert_close(row["gathered"], row["want_gathered"], rtol=0, atol=0)
            assert row["is_view"] and row["in_place"]
            # a reduce-scatter sends every chunk but its own, an all-gather every chunk but the next rank's
            assert row["rs_sent"] == 8 * (n - chunks[rank]), (n, rank)
            assert row["ag_sent"] == 8 * (n - chunks[(rank + 1) % world_size]), (n, rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_optimizer_matches_adam_and_torch_zero_redundancy_optimizer(world_size):
    adam = spawn(W.sharded_optimizer, world_size, "adam", backend="gloo")
    torch_zero = spawn(W.sharded_optimizer, world_size, "torch", backend="gloo")
    ours = spawn(W.sharded_optimizer, world_size, "course", backend="gloo")
    for rank in range(world_size):
        for step in range(3):
            _close(ours[rank]["params"][step], adam[rank]["params"][step], msg=f"rank {rank} step {step}")
            _close(torch_zero[rank]["params"][step], adam[rank]["params"][step], msg=f"torch, rank {rank}")
        # the frozen layer never moved; the others did
        first, last = W.Uneven().state_dict(), ours[rank]["params"][-1]
        assert torch.equal(last["frozen.weight"], first["frozen.weight"])
        assert not torch.equal(last["a.weight"], first["a.weight"])
    # each rank keeps Adam's state for its own parameters only: together, every parameter once
    numbers = [out["state_numbers"] for out in ours]
    trainable = sum(p.numel() for p in W.Uneven().parameters() if p.requires_grad)
    assert sum(numbers) == trainable and max(numbers) < trainable
    assert all(n > 0 for n in numbers)


@pytest.mark.parametrize("kind", ["course", "torch"])
def test_a_checkpoint_with_an_lr_scheduler_resumes_as_plain_adam(kind):
    # StepLR halves the LR at every step: the local optimizer must see it. The checkpoint, consolidated on
    # rank 0, is plain Adam's state dict, and training resumed from it ends where plain Adam's does.
    adam = spawn(W.checkpoint_with_scheduler, 3, "adam", backend="gloo")
    sharded = spawn(W.checkpoint_with_scheduler, 3, kind, backend="gloo")
    want, got = adam[0]["saved"], sharded[0]["saved"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and len(got["state"]) == 7  # the frozen layer has none
    for index in want["state"]:
        _close(got["state"][index], want["state"][index], msg=f"state of parameter {index}")
    for rank in range(3):
        assert sharded[rank]["lrs"] == adam[rank]["lrs"] == [2 * W.LR / 16, W.LR / 16]
        _close(sharded[rank]["params"], adam[rank]["params"], msg=f"rank {rank}")


def test_sharded_optimizer_has_zero_redundancy_optimizers_interface():
    first, second = spawn(W.sharded_optimizer_api, 2, backend="gloo")
    for out in (first, second):
        assert out["adam_keys_visible"], "the keys the local optimizer adds to its groups are visible"
        assert out["moved_under_lr_0"] == 0.0, "LambdaLR set every lr to 0: no parameter may move"
        assert out["lrs_in_local_groups"] == [0.0, 0.0]
        assert "consolidate_state_dict(to=" in out["unconsolidated"]
        # an empty local group where this rank owns none of the new group: groups line up index for index
        assert out["group_sizes"][0] == [2, 7, 1]
        assert out["group_sizes"][1][-1] == (1 if out["owns_extra"] else 0)
        assert len(out["group_sizes"][1]) == 3 and out["extra_lr_local"] == 0.5
        assert out["kwargs_seen"] == [{}, {"scale": 0.5}] and out["closure_loss"] == 1.5
        assert "dense" in out["sparse"]
    assert first["owns_extra"] != second["owns_extra"]
    # rank 0 holds every trained parameter's state: all but the frozen layer's two (numbered 5 and 6:
    # the second group is scale, norm's two, frozen's two, b's two)
    assert first["consolidated_keys"] == [0, 1, 2, 3, 4, 7, 8]
    assert "not consolidated on rank 1" in second["consolidated_keys"]


@pytest.mark.parametrize("option", ["parameters_as_bucket_view", "overlap_with_ddp"])
def test_the_features_left_out_of_zero_redundancy_optimizer_are_refused_by_name(option):
    with pytest.raises(NotImplementedError, match=f"leaves out {option}=True"):
        sharding.ShardedOptimizer(mlp().parameters(), torch.optim.Adam, **{option: True})


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_stage_trains_as_one_process_on_the_whole_batch(world_size):
    want = W.reference_training(world_size)
    runs = spawn(W.every_stage, world_size, backend="gloo")
    for i, (stage, prefetch) in enumerate(W.STAGES):
        outs = [runs[rank][i] for rank in range(world_size)]
        for rank, out in enumerate(outs):
            _close(out["params"], want, atol=1e-6, msg=f"stage {stage} prefetch {prefetch} rank {rank}")
            # the ranks agree exactly: one result, all-gathered
            _close(out["params"], outs[0]["params"], atol=0, msg=f"stage {stage} rank {rank} vs 0")


def test_stage_3_matches_torch_fully_shard():
    fsdp = spawn(W.sharded_training, 2, 3, False, 3, 32, "fsdp", backend="gloo")
    ours = spawn(W.sharded_training, 2, 3, False, backend="gloo")
    for rank in range(2):
        _close(ours[rank]["params"], fsdp[rank]["params"], atol=1e-6, msg=f"rank {rank}")
    # ours gathers twice and reduce-scatters once: 3 (p - 1)/p of the 3466 fp32 numbers; torch's own
    # collectives are not the course's, so they count nothing
    assert ours[0]["sent"] == [3 * 4 * 3466 // 2] * 3 and fsdp[0]["sent"] == [0] * 3


def _units_numel(hidden=32):
    return [sum(p.numel() for p in layer.parameters()) for layer in W._units(mlp(hidden=hidden, depth=2))]


def test_ledger_equals_the_arithmetic_and_bytes_sent_are_ddps_or_one_and_a_half_times():
    units, world_size = _units_numel(), 2
    assert all(n % world_size == 0 for n in units)  # so that no padding blurs the equality
    n = sum(units)
    ddp = spawn(W.ddp_ledger, world_size, backend="gloo")[0]
    assert ddp == sharding.bytes_per_rank(n, 0, world_size, tensors=6)  # torch's DDP: a step counter per tensor
    ring = 4 * n * 2 * (world_size - 1) // world_size  # a ring all-reduce of the fp32 gradients
    runs = spawn(W.every_stage, world_size, backend="gloo")
    for i, (stage, prefetch) in enumerate(W.STAGES):
        for out in (run[i] for run in runs):
            for ledger in out["ledger"]:
                assert ledger == sharding.bytes_per_rank(n, stage, world_size, tensors=len(units)), stage
            # stages 1 and 2 gather the updated parameters at the next forward: none before the first
            want = [ring] * 3 if stage == 0 else [ring // 2, ring, ring] if stage < 3 else [3 * ring // 2] * 3
            assert out["sent"] == want, (stage, prefetch, out["sent"])


def test_ledger_with_each_unit_padded_is_the_arithmetic_with_unit_sizes():
    units, world_size = _units_numel(), 3
    assert any(n % world_size for n in units)
    runs = spawn(W.every_stage, world_size, [(stage, False) for stage in range(4)], 1, backend="gloo")[0]
    for stage, run in enumerate(runs):
        ledger = run["ledger"][0]
        held = sum(math.ceil(n / world_size) for n in units)
        assert ledger == sharding.bytes_per_rank(sum(units), stage, world_size, tensors=len(units), unit_sizes=units)
        assert ledger["optimizer state"] == (8 * held if stage else 8 * sum(units)) + 4 * len(units)
        # padding the whole model once instead would miss the padding of the vectors kept whole
        if stage in (1, 2):
            assert ledger != sharding.bytes_per_rank(sum(units), stage, world_size, tensors=len(units))


def test_fsdp2_in_bf16_gathers_each_unit_at_half_the_bytes_and_keeps_fp32_shards():
    from course_lib.notebooks import sharding_runs

    units = [sum(p.numel() for p in layer.parameters())
             for layer in sharding_runs.layers(sharding_runs.notebook_model())]
    shard = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in sharding_runs.notebook_model().parameters())
    for rank, out in enumerate(spawn(sharding_runs.mixed_precision_units, 2, backend="gloo", timeout_s=120)):
        fp32, bf16 = out["float32"], out["bf16 params"]
        assert (fp32["gathered_dtype"], bf16["gathered_dtype"]) == ("float32", "bfloat16")
        assert fp32["largest_gathered_bytes"] == 4 * max(units) and bf16["largest_gathered_bytes"] == 2 * max(units)
        # the shards Adam steps, and the gradients, stay float32 in both (rank 0 holds the larger half of odd rows)
        assert fp32["shard_dtype"] == bf16["shard_dtype"] == fp32["grad_dtype"] == bf16["grad_dtype"] == "float32"
        assert fp32["shard_bytes"] == bf16["shard_bytes"]
        if rank == 0:
            assert fp32["shard_bytes"] == 4 * shard


def test_stage_3_gathers_before_each_use_and_prefetch_issues_the_next_gather_before_computing():
    runs = spawn(W.every_stage, 2, [(3, False), (3, True)], 1, backend="gloo")[0]
    for prefetch, run in zip((False, True), runs):
        events = run["events"]
        gathers = sorted((start, unit) for what, unit, start, _ in events if what.endswith("all-gather"))
        computes = {unit: (start, end) for what, unit, start, end in events if what == "compute"}
        issued = {}
        for what, unit, start, _ in events:
            if what == "issue":
                issued.setdefault(unit, start)  # the forward's (the backward issues again)
        # forward: units 0, 1, 2; backward: 2, 1, 0
        assert [unit for _, unit in gathers] == [0, 1, 2, 2, 1, 0]
        if prefetch:  # units 1 and 2 were handed to the second thread before the unit ahead of them computed
            assert all(issued[unit] < computes[unit - 1][0] for unit in (1, 2)), (issued, computes)
            assert sorted(unit for what, unit, *_ in events if what == "wait") == [0, 1, 1, 2]
            assert sorted(unit for what, unit, *_ in events if what == "prefetched all-gather") == [0, 1, 1, 2]
        else:  # each gathered only once the unit ahead of it had computed
            assert not issued
            assert all(start >= computes[unit - 1][1] for start, unit in gathers[1:3])


def test_bytes_per_rank_reproduces_the_zero_papers_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, Adam in mixed precision (K = 12), 64 GPUs
    totals = [sharding.bytes_per_rank(7_500_000_000, s, 64, "adam", "mixed")["total"] / 1e9 for s in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("call, message", [
    (lambda: sharding.bytes_per_rank(10, 4, 2), "stage"),
    (lambda: sharding.bytes_per_rank(10, 1, 0), "world_size"),
    (lambda: sharding.bytes_per_rank(10, 1, 2, optimizer="lamb"), "optimizer must be one of"),
    (lambda: sharding.bytes_per_rank(10, 1, 2, precision="bf16"), "precision must be one of"),
    (lambda: sharding.bytes_per_rank(10, 1, 2, unit_sizes=[4, 5]), "add up to n_params"),
    (lambda: sharding.bytes_per_rank(10, 1, 2, unit_sizes=[10, 0]), "unit_sizes"),
    (lambda: sharding.ShardedDataParallel(mlp(), 5), "stage"),
    (lambda: sharding.ShardedDataParallel(mlp(), 1, prefetch=True), "prefetch is for stage 3"),
    (lambda: sharding.ShardedDataParallel(mlp(), 3, units=[torch.nn.Linear(2, 2)]), "submodules of module"),
    (lambda: sharding.ShardedDataParallel(mlp(), 3, units=[mlp()[0]]), "submodules of module"),
    (lambda: (m := mlp(), sharding.ShardedDataParallel(m, 3, units=[m, m[0]])), "exactly one unit"),
    (lambda: (m := mlp(), sharding.ShardedDataParallel(m, 3, units=[m[0]])), "exactly one unit"),
    (lambda: (m := mlp(), m[0].requires_grad_(False), sharding.ShardedDataParallel(m, 2)), "frozen"),
    (lambda: sharding.ShardedOptimizer(mlp().parameters(), torch.optim.Adam(mlp().parameters())), "class"),
])
def test_bad_input_is_refused_with_a_clear_message(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
