"""The training script as a user runs it: under torchrun, 2 CPU processes."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from course_lib import compression, hooks, powersgd
from course_lib.launch import WorkerError, spawn, worker_device
from course_lib.train import COMPRESSION_HOOKS, TrainConfig, _argument_parser, ddp_train, make_hook, train_several


@pytest.mark.parametrize("hook", ["powersgd", "allreduce"])
def test_torchrun_two_cpu_processes(hook):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "course_lib.train", "--hook", hook, "--steps", "30", "--start-powerSGD-iter", "5",
           "--matrix-approximation-rank", "2", "--backend", "gloo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"hook={hook} world_size=2 backend=gloo steps=30" in proc.stdout
    assert "test accuracy" in proc.stdout


def test_bad_config_and_hook_names():
    with pytest.raises(ValueError, match="unknown hook"):
        TrainConfig(hook="power")
    with pytest.raises(TypeError, match="stepz"):
        TrainConfig(stepz=3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="threads must be >= 1 or None"):
        TrainConfig(threads=0)
    # the old dict of options is refused with what to write instead
    with pytest.raises(WorkerError, match="ddp_train takes a TrainConfig"):
        spawn(ddp_train, 1, {"steps": 3}, backend="gloo")


def test_the_powersgd_rank_has_one_name_from_the_command_line_to_the_state():
    args = ["--hook", "powersgd", "--matrix-approximation-rank", "3", "--start-powerSGD-iter", "7",
            "--no-use-error-feedback"]
    config = TrainConfig(**{k: v for k, v in vars(_argument_parser().parse_args(args)).items() if k != "backend"})
    assert config == TrainConfig(hook="powersgd", matrix_approximation_rank=3, start_powerSGD_iter=7,
                                 use_error_feedback=False)
    state, hook = make_hook(config)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.use_error_feedback) == (3, 7, False)
    assert hook is powersgd.powerSGD_hook
    assert make_hook(TrainConfig(hook="allreduce"))[1] is hooks.allreduce_hook


def test_the_script_explains_itself_without_torchrun():
    proc = subprocess.run([sys.executable, "-m", "course_lib.train"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "torchrun --nproc-per-node N" in proc.stderr


def test_threads_sets_the_workers_compute_threads():
    configs = [TrainConfig(steps=2, eval_every=2, threads=1), TrainConfig(steps=2, eval_every=2, threads=2)]
    one, two = spawn(train_several, 1, configs, backend="gloo")[0]
    assert (one.threads, two.threads) == (1, 2)


def test_every_powersgdstate_argument_goes_from_the_command_line_to_the_state():
    args = ["--hook", "powersgd", "--min-compression-rate", "5", "--orthogonalization-epsilon", "1e-8",
            "--batch-tensors-with-same-shape", "--compression-stats-logging-frequency", "7", "--seed", "3"]
    config = TrainConfig(**{k: v for k, v in vars(_argument_parser().parse_args(args)).items() if k != "backend"})
    state, _ = make_hook(config)
    assert (state.min_compression_rate, state.orthogonalization_epsilon, state.batch_tensors_with_same_shape,
            state.compression_stats_logging_frequency) == (5, 1e-8, True, 7)
    # random_seed is the run's seed: the state's generator starts where RandomState(3) does
    assert state.rng.randint(1_000_000_000) == np.random.RandomState(3).randint(1_000_000_000)
    with pytest.raises(ValueError, match="hook_group must be 'world' or 'self'"):
        TrainConfig(hook_group="node")


def test_dgc_flags_reach_its_state_and_momentum_is_not_applied_twice():
    args = ["--hook", "dgc", "--ratio", "0.001", "--dgc-momentum", "0.8", "--clip-norm", "2.5",
            "--no-momentum-masking", "--warmup-steps", "40"]
    config = TrainConfig(**{k: v for k, v in vars(_argument_parser().parse_args(args)).items() if k != "backend"})
    state, hook = make_hook(config)
    assert hook is compression.compression_hook
    assert (state.memory.momentum, state.memory.clip_norm, state.memory.masking) == (0.8, 2.5, False)
    assert state.density(0) == 0.25 and state.density(40) == 0.001 and state.communicator == "all_gather"
    with pytest.raises(ValueError, match="momentum=0"):
        TrainConfig(hook="dgc", momentum=0.9)
    with pytest.raises(ValueError, match="memory must be"):
        TrainConfig(hook="topk", memory="ef")


def test_every_compression_hook_trains_and_keeps_the_ranks_identical():
    configs = [TrainConfig(hook=h, steps=4, eval_every=4, momentum=0.0 if h == "dgc" else 0.9)
               for h in COMPRESSION_HOOKS]
    outs = spawn(train_several, 2, configs, backend="gloo", timeout_s=240)
    for config, r0, r1 in zip(configs, *outs):
        for a, b in zip(r0.final_params, r1.final_params):
            assert np.array_equal(a.numpy(), b.numpy()), config.hook
        assert r0.bytes[-1] > 0 and len(r0.codec_s) == 4 and all(t > 0 for t in r0.codec_s), config.hook
        sent = sum(nbytes for _, nbytes in r0.by_op[-1].values())
        assert sent == r0.bytes[-1], config.hook  # every byte counted under its op


def test_training_stops_at_the_first_loss_that_is_not_finite():
    out = spawn(ddp_train, 2, TrainConfig(steps=40, lr=1e20, eval_every=10), backend="gloo")
    for r in out:  # the first step's loss is finite; the second is nan after a step of size 1e20
        assert r.diverged_at == 1 and len(r.loss) == len(r.bytes) == 2 and r.test_accuracy == []
        assert np.isfinite(r.loss[0]) and not np.isfinite(r.loss[1])
    healthy = spawn(ddp_train, 2, TrainConfig(steps=5, eval_every=5), backend="gloo")[0]
    assert healthy.diverged_at is None and len(healthy.loss) == 5


def test_the_script_exits_1_and_says_to_lower_the_rate_when_training_diverges():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "course_lib.train", "--steps", "40", "--lr", "1e20", "--backend", "gloo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stdout
    assert "training diverged: the loss was nan at step 1" in proc.stderr
    assert "Lower --lr (it was 1e+20)" in proc.stderr


def test_help_lists_the_flags_in_trainconfigs_groups():
    sections, title = {}, None
    for line in _argument_parser().format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
        elif title and line.startswith("  --"):
            sections.setdefault(title, []).append(line.split()[0].rstrip(","))
    assert sections["options"] == ["--backend"]  # (and -h): every field's flag is in a group
    flags = [flag for title, group in sections.items() if title != "options" for flag in group]
    assert flags == ["--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)]
    assert sections["the model and data"] == ["--hidden", "--depth", "--n-in"]
    assert sections["communication: the hook and its buckets"] == ["--hook", "--compress-wrapper", "--hook-group",
                                                                  "--bucket-cap-mb"]
    assert sections["PowerSGD's arguments (torch's names)"][:2] == ["--matrix-approximation-rank",
                                                                    "--start-powerSGD-iter"]
    assert "--ratio" in sections["the compressors' arguments"]
    assert sections["what is recorded"] == ["--eval-every", "--record-params", "--record-error-memory"]


def test_the_device_is_checked_with_a_message_that_says_what_to_do():
    with pytest.raises(ValueError, match="device must be 'auto', 'cuda' or 'cpu', got 'gpu'"):
        TrainConfig(device="gpu")
    if not torch.cuda.is_available():  # this machine: no GPU to put the workers on
        with pytest.raises(ValueError, match="no CUDA GPU is visible.*use device='auto' or 'cpu'"):
            TrainConfig(device="cuda")
    with pytest.raises(ValueError, match="device must be 'auto', 'cuda' or 'cpu'"):
        worker_device("gpu")
    assert worker_device("cpu") == torch.device("cpu") == worker_device()  # no process group: the CPU
