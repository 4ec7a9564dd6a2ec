"""course_lib.launch.spawn with real gloo processes on the CPU."""

import multiprocessing as mp
import sys
import threading
import time

import pytest
import torch

from course_lib import launch
from tests import workers


def _no_children_left():
    # active_children() also reaps finished ones; anything left is still running.
    return mp.active_children() == []


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_returns_in_rank_order(world_size):
    out = launch.spawn(workers.report, world_size, "hello", backend="gloo")
    assert [o["rank"] for o in out] == list(range(world_size))
    assert [o["dist_rank"] for o in out] == list(range(world_size))
    assert all(o["dist_world"] == world_size and o["tag"] == "hello" for o in out)
    # the all-reduce really ran across processes: 0 + 1 + ... + (n - 1)
    assert all(o["sum"] == world_size * (world_size - 1) / 2 for o in out)
    assert len({o["pid"] for o in out}) == world_size
    env = out[-1]["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["RANK"] == env["LOCAL_RANK"] == str(world_size - 1)
    assert env["WORLD_SIZE"] == str(world_size)
    assert env["MASTER_PORT"] not in ("12355", "29500")
    assert _no_children_left()


def test_tensor_results_survive_worker_exit():
    out = launch.spawn(workers.big_tensor, 2, backend="gloo")
    assert torch.equal(out[1], torch.ones(1000, 1000))


def test_raising_rank_is_named_while_peer_waits_in_barrier():
    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(workers.raise_on_rank_one, 2, backend="gloo", timeout_s=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert "rank 1" in str(err)
    assert "ZeroDivisionError" in str(err) and "rank one divides by zero" in str(err)
    assert err.rank == 1 and err.exc_type == "ZeroDivisionError"
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert elapsed < 30, f"took {elapsed:.1f} s: the failure should be reported within seconds"
    assert _no_children_left()


def test_worker_that_dies_without_raising_is_named():
    with pytest.raises(launch.WorkerError, match="rank 2.*exited with code 3"):
        launch.spawn(workers.exit_hard_on_last_rank, 3, backend="gloo", timeout_s=60)
    assert _no_children_left()


def test_timeout_names_the_ranks_still_running():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        launch.spawn(workers.sleep_on_rank_zero, 2, 600, backend="gloo", timeout_s=15)
    assert _no_children_left()


def test_two_concurrent_spawns_do_not_collide():
    results, errors = {}, []

    def run(tag):
        try:
            results[tag] = launch.spawn(workers.report, 2, tag, backend="gloo")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [o["tag"] for o in results["a"]] == ["a", "a"]
    assert [o["tag"] for o in results["b"]] == ["b", "b"]
    assert results["a"][0]["env"]["MASTER_PORT"] != results["b"][0]["env"]["MASTER_PORT"]


@pytest.mark.parametrize("world_size", [0, -1, 1.5])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch.spawn(workers.report, world_size, "x")


def test_nccl_without_enough_gpus():
    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match="backend='gloo'"):
        launch.spawn(workers.report, n, "x", backend="nccl")


def test_lambda_and_main_functions_are_refused_with_advice():
    with pytest.raises(ValueError, match="lambda.*top level of a .py module"):
        launch.spawn(lambda rank, world_size: rank, 2)

    def nested(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="nested"):
        launch.spawn(nested, 2)



def test_function_from_a_notebook_main_is_refused(monkeypatch):
    import types

    def in_main(rank, world_size):
        return rank

    in_main.__module__ = "__main__"
    in_main.__qualname__ = "in_main"
    # a notebook kernel's __main__ has no __file__ a new process could import
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(ValueError, match="__main__.*notebook cell"):
        launch.spawn(in_main, 2)


def test_pick_backend_matches_gpu_count():
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert launch.pick_backend(2) == expected


def test_init_from_env_explains_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        launch.init_from_env()


def test_rendezvous_demo_meets_through_tcp_file_and_env(tmp_path):
    methods = [f"tcp://127.0.0.1:{launch.free_port()}", f"file://{tmp_path}/rendezvous", "env://"]
    out = launch.spawn(launch.rendezvous_demo, 2, methods, launch.free_port(), backend="gloo")
    for rank, rows in enumerate(out):
        assert [r["method"] for r in rows] == ["tcp", "file", "env"]
        assert all(r["rank"] == rank and r["sum"] == 3.0 for r in rows)


def test_progress_bar_counts_rank_zero_reports(capsys):
    out = launch.spawn(workers.count_up, 2, 5, backend="gloo", progress=5, desc="counting")
    assert out == [5, 5]
    err = capsys.readouterr().err
    assert "counting" in err and "5/5" in err
