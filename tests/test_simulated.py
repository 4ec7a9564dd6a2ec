"""Simulated ranks (threads of one process, an in-process group) against real gloo processes.

The methods are the same code either way; only the transport changes. So a simulated run must equal a
real one: every method of notebook 10's contest, PowerSGD layer-wise and batched, local SGD,
post-local SGD and DiLoCo, at p = 2, 3 and 4. The sums differ only in their order (the threaded group
adds the ranks' tensors in rank order, gloo's ring in another), which float32 absorbs to 1e-6; a
16-bit all-reduce keeps the order's rounding, so fp16 and bf16 are held to their own unit roundoff.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives, hooks, simulated
from course_lib.launch import WorkerError, spawn
from course_lib.notebooks import local_sgd_runs
from course_lib.simulated import simulate
from course_lib.train import TrainConfig, train_several

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compression_contest  # noqa: E402 (the contest's methods, as its script defines them)

# the largest relative difference of a parameter allowed: float32 sums, or the 16-bit all-reduce's rounding
# DiLoCo's inner AdamW divides each gradient entry by its own running size, so the last bits in which
# two orders of summing the averaged pseudo-gradient differ (the simulated mean adds the ranks in
# order, the course's ring chunk by chunk around the ring) grow over the steps after it: 1.8e-6 was
# measured at 4 ranks on an AMD EPYC, where the plain SGD methods stay under 1e-6
TOLERANCE = {"fp16": 2.0**-11, "bf16": 2.0**-8, "diloco": 1e-5}


def _contest_configs() -> list[TrainConfig]:
    """Each method of the contest at one of its settings, 4 steps of a batch that 2, 3 and 4 divide (its
    compression from step 2, where it waits for a warm-up), and the batched PowerSGD hook, local SGD,
    post-local SGD and DiLoCo beside them."""
    configs = []
    for name, (_, fields, grid) in compression_contest.METHODS.items():
        momentum = max(grid)
        configs.append(dataclasses.replace(
            compression_contest.config(name, grid[momentum][0], 0, momentum), hidden=32, steps=4, batch_size=48,
            eval_every=1000, start_powerSGD_iter=2, warmup_steps=2 if "warmup_steps" in fields else 0))
    configs.append(dataclasses.replace(configs[0], hook="batched_powersgd", matrix_approximation_rank=2,
                                       start_powerSGD_iter=2))
    # and course_lib.train's runs that communicate less often (benchmarks/local_sgd_at_scale.py's)
    less_often = TrainConfig(hidden=32, steps=4, batch_size=48, eval_every=1, period=2)  # scored between averages too
    configs += [dataclasses.replace(less_often, averaging="local", momentum=0.9),
                dataclasses.replace(less_often, averaging="local", local_sgd_start=1, momentum=0.9),
                dataclasses.replace(less_often, averaging="diloco", optimizer="adamw", lr=3e-3)]
    return configs


def _relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _compare_contest(world_size: int, simulated_runs, real_runs, configs) -> list[str]:
    wrong = []
    for i, c in enumerate(configs):
        for rank in range(world_size):
            sim, real = simulated_runs[rank][i], real_runs[rank][i]
            off = _relative_difference(sim.final_params, real.final_params)
            allowed = TOLERANCE.get(c.hook, 1e-6)
            # local SGD and DiLoCo score the ranks' mean: the same to an image (of 449) at most
            if max((abs(a - b) for a, b in zip(sim.test_accuracy, real.test_accuracy)), default=0) > 1.5 / 449:
                wrong.append(f"{c.hook}, {c.averaging} on rank {rank}: test accuracy {sim.test_accuracy} against "
                             f"{real.test_accuracy}")
            if off > allowed:
                wrong.append(f"{c.hook} (ratio {c.ratio}) on rank {rank}: parameters {off:.1e} apart, "
                             f"more than {allowed:.0e}")
            if (sim.bytes, sim.collectives) != (real.bytes, real.collectives):
                wrong.append(f"{c.hook} on rank {rank}: counted {sim.bytes} bytes in {sim.collectives} collectives, "
                             f"against {real.bytes} in {real.collectives}")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_contest_method_simulated_equals_real_gloo_processes(world_size):
    configs = _contest_configs()
    simulated_runs = simulate(train_several, world_size, configs)
    real_runs = spawn(train_several, world_size, configs, backend="gloo", timeout_s=300)
    assert not _compare_contest(world_size, simulated_runs, real_runs, configs)


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_sgd_post_local_and_diloco_simulated_equal_real_gloo_processes(world_size):
    configs = [dict(method=method, period=2, lr=lr, steps=6, warmup=2 if method == "post-local" else 0)
               for method, lr in (("ddp", 0.1), ("local", 0.1), ("post-local", 0.1), ("diloco", 0.003))]
    configs.append(dict(method="diloco", period=2, lr=0.003, steps=6, fp16=True))
    simulated_runs = simulate(local_sgd_runs.sweep, world_size, configs)
    real_runs = spawn(local_sgd_runs.sweep, world_size, configs, backend="gloo", timeout_s=300)
    for rank in range(world_size):
        for config, sim, real in zip(configs, simulated_runs[rank], real_runs[rank]):
            allowed = TOLERANCE["fp16"] if config.get("fp16") else TOLERANCE["diloco"] if config["method"] == "diloco" \
                else 1e-6
            assert _relative_difference([sim["params"]], [real["params"]]) <= allowed, config
            assert sim["sent_per_step"] == real["sent_per_step"], config  # the course's ring, counted per rank
        # the DiLoCo bound still tells a 16-bit pseudo-gradient from a 32-bit one, run for run
        diloco32, diloco16 = (run["params"] for run in real_runs[rank][-2:])
        assert _relative_difference([diloco16], [diloco32]) > 10 * TOLERANCE["diloco"]


def test_a_transport_that_averages_instead_of_summing_is_caught(monkeypatch):
    # the comparison above can fail: an all-reduce that returns the mean moves every method's parameters
    configs = [_contest_configs()[list(compression_contest.METHODS).index("fp32 all-reduce")]]  # one that sends
    real_runs = spawn(train_several, 2, configs, backend="gloo", timeout_s=120)
    summing = simulated._InProcessGroup.allreduce

    def averaging(self, tensor_list, *opts):
        work = summing(self, tensor_list, *opts)
        for t in tensor_list:
            t.div_(self.size())
        return work

    monkeypatch.setattr(simulated._InProcessGroup, "allreduce", averaging)
    assert _compare_contest(2, simulate(train_several, 2, configs), real_runs, configs)


def _messages(rank: int, world_size: int) -> dict:
    t = torch.arange(6.0) * (rank + 1)
    ring = collectives.ring_all_reduce(t.clone())  # send and recv, posted in both orders around the ring
    everyone = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(everyone, torch.full((2,), float(rank)))
    hooks.traffic.reset()
    hooks.all_reduce_counted(torch.ones(3))
    hooks.traffic.bytes += rank  # a write of this rank's, seen by this rank only
    return {"ring": ring, "gathered": torch.stack(everyone), "counted": hooks.traffic.bytes,
            "sent": collectives.sent.bytes}


@pytest.mark.parametrize("world_size", [1, 2, 5, 16])
def test_point_to_point_collectives_and_counters_per_rank(world_size):
    results = simulate(_messages, world_size)
    total = sum(range(1, world_size + 1))
    for rank, out in enumerate(results):
        assert torch.equal(out["ring"], torch.arange(6.0) * total)
        assert torch.equal(out["gathered"], torch.arange(float(world_size)).repeat_interleave(2).view(-1, 2))
        assert out["counted"] == 12 + rank
    if world_size == 2:  # each rank counts what it sent itself, as a process of its own does
        assert [out["sent"] for out in results] == [out["sent"] for out in spawn(_messages, 2, backend="gloo")]


def _fails_on_rank_2(rank: int, world_size: int):
    if rank == 2:
        raise ValueError("rank 2 went wrong")
    dist.barrier()  # the others wait for rank 2, which never comes: the simulation must stop them
    return rank


def test_a_rank_that_raises_is_named_and_the_others_stop():
    excepthook = sys.excepthook
    with pytest.raises(WorkerError) as caught:
        simulate(_fails_on_rank_2, 4, timeout_s=60)
    assert caught.value.rank == 2 and "rank 2 went wrong" in str(caught.value)
    assert sys.excepthook is excepthook  # init_process_group's rank prefix does not outlive the simulation
    assert simulate(lambda rank, world_size: rank * world_size, 3) == [0, 3, 6]  # and the next one runs


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        simulate(_messages, 0)
    with pytest.raises(TypeError, match="fn must be a function"):
        simulate("train", 2)


def test_a_dirichlet_split_with_a_validation_set_simulated_equals_real_gloo_processes():
    configs = [TrainConfig(hidden=32, steps=4, batch_size=48, lr=0.1, split="dirichlet", dirichlet_alpha=0.3,
                           validation_fraction=0.2, eval_every=2, hook=hook) for hook in ("allreduce", "noop")]
    simulated_runs = simulate(train_several, 3, configs)
    real_runs = spawn(train_several, 3, configs, backend="gloo", timeout_s=120)
    assert not _compare_contest(3, simulated_runs, real_runs, configs)
    for rank in range(3):
        for sim, real in zip(simulated_runs[rank], real_runs[rank]):
            assert sim.validation_accuracy == real.validation_accuracy and len(sim.validation_accuracy) == 2
