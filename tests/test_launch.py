"""course_lib.launch.spawn with real gloo processes on the CPU."""

import errno
import inspect
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from multiprocessing import forkserver
from pathlib import Path

import pytest
import torch

from course_lib import launch
from course_lib.notebooks import demos
from tests import workers

REPO = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")
# Where the start methods differ (who the worker's parent is, what it inherits), the tests run under each one
# this system offers; elsewhere under the default (forkserver on Linux)
both_start_methods = pytest.mark.parametrize(
    "start_method", [m for m in launch.START_METHODS if m in mp.get_all_start_methods()])


def _spawned_children():
    """Pids of the running workers that this process started (Linux): with the spawn start method, or
    through its fork server."""
    # Independent of multiprocessing's own bookkeeping, which only knows the processes it was
    # handed back: a spawned worker's command line is `python -c "from multiprocessing.spawn import
    # spawn_main; ..."` (the resource tracker's is not); a forked one is a child of the fork server.
    found = set()
    if not os.path.isdir("/proc"):
        return found
    server = forkserver._forkserver._forkserver_pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if state != "Z" and ((int(ppid) == os.getpid() and b"spawn_main" in cmdline) or int(ppid) == server):
            found.add(int(entry))
    return found


def _no_children_left():
    # active_children() also reaps finished ones; anything left is still running.
    return mp.active_children() == [] and not _spawned_children()


def _running(pid):
    """Whether process ``pid`` exists and is not a zombie (which has finished, unreaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _read_pids(pid_dir):
    texts = [path.read_text() for path in Path(pid_dir).glob("rank*.pid")]
    return [int(t) for t in texts if t.isdigit()]  # a file being written may still be empty


def _wait_for(condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


class _PicklesOnly:
    """An argument that can be pickled ``times`` times, then raises ``error``.

    spawn pickles the arguments once for each process it starts, so ranks 0 .. times-1 start and
    starting the next one fails, as when Ctrl-C, or an OS out of processes or file descriptors,
    interrupts start_processes half way. (The workers get a string in its place.)
    """

    def __init__(self, times, error):
        self.times, self.error, self.pickled = times, error, 0

    def __reduce__(self):
        if self.pickled == self.times:
            raise self.error
        self.pickled += 1
        return (str, ("stand-in",))


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


def test_both_start_methods_give_the_same_results():
    # A few steps of DDP training, the thread count and the generator's state: bit for bit the same
    # whether the worker is a new interpreter or a fork of the server
    spawned, forked = (launch.spawn(workers.train_a_little, 2, backend="gloo", start_method=m)
                       for m in ("spawn", "forkserver"))
    for a, b in zip(spawned, forked):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key
    assert not torch.equal(spawned[0]["params"], workers.train_a_little_start())  # it trained
    assert _no_children_left()


@both_start_methods
def test_workers_get_the_environment_as_it_is_at_the_call(monkeypatch, start_method):
    launch.spawn(workers.report, 2, "start the fork server", backend="gloo", start_method=start_method)
    monkeypatch.setenv("COURSE_LIB_TEST_VARIABLE", "set after the first call")
    monkeypatch.delenv("COURSE_LIB_TEST_GONE", raising=False)
    out = launch.spawn(workers.environment, 2, ["COURSE_LIB_TEST_VARIABLE", "COURSE_LIB_TEST_GONE"], backend="gloo",
                       start_method=start_method)
    assert out == [{"COURSE_LIB_TEST_VARIABLE": "set after the first call", "COURSE_LIB_TEST_GONE": None}] * 2
    # torch.distributed reads its debug level when it is imported (in the fork server, at the first call)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    levels = launch.spawn(workers.debug_level, 2, backend="gloo", start_method=start_method)
    assert levels == ["DETAIL", "DETAIL"]


def test_an_unknown_start_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown start_method 'fork'.*'spawn', 'forkserver'"):
        launch.spawn(workers.report, 2, "x", backend="gloo", start_method="fork")


def test_tensor_results_survive_worker_exit():
    out = launch.spawn(workers.big_tensor, 2, backend="gloo")
    assert torch.equal(out[1], torch.ones(1000, 1000))


def test_raising_rank_is_named_while_peer_waits_in_barrier():
    # WorkerError, not the TimeoutError that a hang would end in after timeout_s
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(workers.raise_on_rank_one, 2, backend="gloo", timeout_s=60)
    err = info.value
    assert "rank 1" in str(err)
    assert "ZeroDivisionError" in str(err) and "rank one divides by zero" in str(err)
    assert err.rank == 1 and err.exc_type == "ZeroDivisionError"
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert _no_children_left()


def test_worker_that_dies_without_raising_is_named():
    with pytest.raises(launch.WorkerError, match="rank 2.*exited with code 3"):
        launch.spawn(workers.exit_hard_on_last_rank, 3, backend="gloo", timeout_s=60)
    assert _no_children_left()


def test_timeout_names_the_ranks_still_running():
    launch.spawn(workers.report, 2, "the fork server started", backend="gloo")  # so rank 1 has time to finish
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        launch.spawn(workers.sleep_on_rank_zero, 2, 600, backend="gloo", timeout_s=6)
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


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch.spawn(workers.report, world_size, "x")


def test_a_world_size_far_above_the_cores_is_refused_before_any_process_starts(monkeypatch):
    started = []
    monkeypatch.setattr(launch, "_start_workers", lambda *a: started.append(a))
    with pytest.raises(ValueError, match=r"world_size=1000000 .*max_world_size=None"):
        launch.spawn(workers.report, 10**6, "x", backend="gloo")
    assert started == []
    # the default cap leaves the course's own sizes alone, and the cap is the caller's to change
    assert launch._DEFAULT_MAX_WORLD_SIZE >= 16
    with pytest.raises(ValueError, match="max_world_size=1"):
        launch.spawn(workers.report, 2, "x", backend="gloo", max_world_size=1)
    monkeypatch.undo()
    out = launch.spawn(workers.report, 2, "x", backend="gloo", max_world_size=None)
    assert [o["rank"] for o in out] == [0, 1]


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), "60"])
def test_bad_timeout(timeout_s):
    with pytest.raises(ValueError, match=f"timeout_s must be a positive number of seconds, got {timeout_s!r}"):
        launch.spawn(workers.report, 2, "x", timeout_s=timeout_s)


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
    def meet():
        methods = [f"tcp://127.0.0.1:{launch.free_port()}", f"file://{tempfile.mkdtemp(dir=tmp_path)}/rdzv", "env://"]
        return launch.spawn(demos.rendezvous_demo, 2, methods, launch.free_port(), backend="gloo")

    out = launch.retry_if_port_taken(meet)
    for rank, rows in enumerate(out):
        assert [r["method"] for r in rows] == ["tcp", "file", "env"]
        assert all(r["rank"] == rank and r["sum"] == 3.0 for r in rows)


def test_progress_bar_counts_rank_zero_reports(capsys):
    out = launch.spawn(workers.count_up, 2, 5, backend="gloo", progress=5, desc="counting")
    assert out == [5, 5]
    err = capsys.readouterr().err
    assert "counting" in err and "5/5" in err


def test_fn_starts_on_no_rank_before_every_rank_has_joined():
    # Without the wait, a rank whose fn returns at once closed its sockets while a slower peer was
    # still connecting, and the peer's init failed ("Connection closed by peer", under load).
    for world_size in (2, 4):
        assert launch.spawn(workers.ranks_joined_when_fn_starts, world_size) == [list(range(world_size))] * world_size


def test_workers_are_started_by_torch_start_processes():
    out = launch.spawn(workers.how_started, 2, backend="gloo")
    wrapper = (inspect.getsourcefile(torch.multiprocessing.start_processes), "_wrap")
    worker = (inspect.getsourcefile(launch), "_worker")
    for rank in out:
        # start_processes' wrapper called launch._worker, which called fn
        assert wrapper in rank["stack"] and worker in rank["stack"]
        assert rank["stack"].index(wrapper) < rank["stack"].index(worker)
        if sys.platform.startswith("linux"):
            assert rank["pdeathsig"] == signal.SIGINT  # what the wrapper asks of the kernel
    assert _no_children_left()


@linux_only
@both_start_methods
def test_workers_exit_when_the_parent_process_is_killed(tmp_path, start_method):
    # No finally of spawn's runs when its process is SIGKILLed (by the user, or the out-of-memory
    # killer): it is the SIGINT that start_processes has Linux send at the parent's death (spawn), or
    # that the worker sends itself when it sees the caller end (forkserver: its parent is the server).
    code = (
        "from course_lib import launch; from tests import workers; "
        f"launch.spawn(workers.pid_then_sleep, 2, {str(tmp_path)!r}, 600, backend='gloo', timeout_s=600, "
        f"start_method={start_method!r})"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        assert _wait_for(lambda: len(_read_pids(tmp_path)) == 2, 120), "the workers did not start"
        pids = _read_pids(tmp_path)
        assert all(_running(pid) for pid in pids)
        parent.kill()
        parent.wait()
        assert _wait_for(lambda: not any(_running(pid) for pid in pids), 30), f"workers {pids} outlived their parent"
    finally:
        parent.kill()
        parent.wait()
        for pid in _read_pids(tmp_path):  # so that a failure here leaves nothing running either
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@linux_only
def test_no_orphans_after_a_worker_fails(tmp_path):
    with pytest.raises(launch.WorkerError, match="rank 1.*rank one fails"):
        launch.spawn(workers.pid_then_fail_on_rank_one, 3, str(tmp_path), backend="gloo", timeout_s=60)
    pids = _read_pids(tmp_path)
    assert len(pids) == 3
    assert not any(_running(pid) for pid in pids)
    assert _no_children_left()


@linux_only
@both_start_methods
def test_no_orphans_after_ctrl_c_in_the_parent(tmp_path, start_method):
    # Ctrl-C reaches Python as KeyboardInterrupt only where SIGINT is not ignored: pytest run as a
    # background job of a script starts with it ignored. Take Python's own handler for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in_the_parent(tmp_path, start_method)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_in_the_parent(tmp_path, start_method):
    with pytest.raises(KeyboardInterrupt):
        launch.spawn(workers.pid_then_interrupt_parent, 2, str(tmp_path), os.getpid(), backend="gloo", timeout_s=60,
                     start_method=start_method)
    pids = _read_pids(tmp_path)
    assert len(pids) == 2
    assert not any(_running(pid) for pid in pids)
    assert _no_children_left()


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), OSError(errno.EMFILE, "Too many open files")], ids=["ctrl-c", "emfile"]
)
def test_ranks_already_started_are_stopped_when_starting_the_next_fails(error):
    arg = _PicklesOnly(2, error)
    with pytest.raises(type(error)):
        launch.spawn(workers.report, 3, arg, backend="gloo", timeout_s=60)
    assert arg.pickled == 2  # ranks 0 and 1 got their arguments and were started; rank 2 was not
    assert _no_children_left()


def test_an_argument_that_cannot_be_pickled_gives_the_pickle_error():
    # Nothing has started when rank 0's arguments fail to pickle; stopping must not trip over that.
    with pytest.raises(TypeError, match="pickle"):
        launch.spawn(workers.report, 2, threading.Lock(), backend="gloo")
    assert _no_children_left()


def test_stop_passes_over_a_process_that_never_started():
    launch._stop([mp.get_context("spawn").Process(target=print)])


def test_worker_whose_report_fails_is_named_with_the_traceback_start_processes_kept():
    with pytest.raises(launch.WorkerError, match="rank 1.*exited with code 1") as info:
        launch.spawn(workers.raise_unprintable_on_rank_one, 2, backend="gloo", timeout_s=60)
    tb = info.value.worker_traceback
    assert "raise Unprintable()" in tb and "cannot be turned into a message" in tb
    assert _no_children_left()


def test_an_unknown_backend_names_every_known_one():
    with pytest.raises(ValueError, match="'auto', 'gloo', 'nccl' or 'mpi'"):
        launch.spawn(workers.report, 2, "unused", backend="glo")


@linux_only
def test_workers_answer_sigint_even_when_their_parent_ignores_it():
    # A shell script's background job starts with SIGINT ignored, and its children inherit that: the
    # SIGINT the kernel sends a worker at its parent's death would then be ignored, and it would live on.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert launch.spawn(workers.sigint_handler, 2, backend="gloo") == [True, True]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_retry_if_port_taken_retries_a_taken_port_only():
    calls = []

    def taken_twice():
        calls.append(1)
        if len(calls) < 3:
            raise launch.WorkerError(0, "DistNetworkError", "port: 1, code: -98, name: EADDRINUSE")
        return "met"

    assert launch.retry_if_port_taken(taken_twice) == "met" and len(calls) == 3
    calls.clear()
    with pytest.raises(launch.WorkerError, match="EADDRINUSE"):  # the last attempt's error, as it was
        launch.retry_if_port_taken(taken_twice, attempts=2)
    assert len(calls) == 2

    def taken_underneath():  # the port error as the cause of another
        calls.append(1)
        try:
            raise OSError(98, "Address already in use")
        except OSError as exc:
            raise RuntimeError("torchrun exited with codes [1, 1]") from exc

    calls.clear()
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.retry_if_port_taken(taken_underneath)
    assert len(calls) == 3

    def other_error():
        calls.append(1)
        raise ValueError("rank 1 found a bad batch")

    calls.clear()
    with pytest.raises(ValueError, match="bad batch"):  # not a port: no second try
        launch.retry_if_port_taken(other_error)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="attempts"):
        launch.retry_if_port_taken(other_error, attempts=0)
