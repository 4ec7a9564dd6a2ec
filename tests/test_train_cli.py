"""The training script as a user runs it: under torchrun, 2 CPU processes."""

import subprocess
import sys

import pytest

from course_lib.launch import spawn
from course_lib.train import ddp_train, make_hook


@pytest.mark.parametrize("hook", ["powersgd", "allreduce"])
def test_torchrun_two_cpu_processes(hook):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "course_lib.train", "--hook", hook, "--steps", "30", "--start-iter", "5", "--backend", "gloo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"hook={hook} world_size=2 backend=gloo steps=30" in proc.stdout
    assert "test accuracy" in proc.stdout


def test_bad_config_and_hook_names():
    with pytest.raises(ValueError, match="unknown hook"):
        make_hook("power")
    with pytest.raises(Exception, match="unknown config keys"):
        spawn(ddp_train, 1, {"stepz": 3}, backend="gloo")


def test_the_script_explains_itself_without_torchrun():
    proc = subprocess.run([sys.executable, "-m", "course_lib.train"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "torchrun --nproc-per-node N" in proc.stderr
