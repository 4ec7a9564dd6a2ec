"""Start a group of worker processes that each join one process group, and get their results back.

Every multi-process notebook and test goes through :func:`spawn`. It exists because the usual recipe
(``mp.spawn`` with a fixed ``MASTER_PORT=12355``) fails in the ways a course cannot afford:

* a worker that raises leaves its peers blocked inside a collective, and the notebook hangs;
* two notebooks that run at once fight over the same fixed port;
* a function defined in a notebook cell cannot be sent to a spawned process, and the error that
  ``pickle`` gives does not say why.

How it works: the parent process hosts the rendezvous store itself (a ``TCPStore`` on a port the
operating system picks, so two spawns never collide) and starts the workers with
``torch.multiprocessing.start_processes``, the machinery that ``mp.spawn`` runs: ``_worker(rank, ...)``
in process ``rank``, and (on Linux) a SIGINT to every worker if the process that started it dies.
The start method (see :data:`START_METHOD`) is *forkserver* on Linux: a server process, started at
the first call, imports torch and course_lib once, and forks each worker from it (a process that has run
nothing but those imports: none of the caller's Python state), so a worker starts in milliseconds
instead of the seconds a new interpreter takes to import torch. Elsewhere it is *spawn* (a new
interpreter per worker), which is also what ``start_method="spawn"`` asks for. Either way the function
and its arguments are sent to the worker by pickling, and the worker's ``os.environ`` is this process's
at the call. (What torch reads from the environment once, when it is imported, the fork server read at
the first call: torch.distributed's debug level, ``TORCH_DISTRIBUTED_DEBUG``, is read again in each
worker; for any other such variable, set it before the first call or use the spawn start method.)
On top of it, spawn adds what start_processes lacks:

* the process group: each worker joins it through the parent's store before ``fn`` runs;
* results: every worker sends ``fn``'s return value (or its exception: type, message, traceback and
  the exception itself) back on a queue, and the values come back in rank order;
* blame: the first failure ends the group, and it is the cause that is reported, not the
  "connection closed" that it causes in the peers; a worker that dies without reporting (a crash,
  ``os._exit``, a signal) is named with its exit code;
* a timeout, after which the ranks still running are named, with where each was (its Python stack,
  dumped by the worker itself on a signal: see :func:`spawn`), and killed;
* no orphans: whatever ends the call (a failure, the timeout, Ctrl-C, or an error while the
  workers are being started, when start_processes raises without handing back the ones it had
  already started) every started worker is terminated, then killed; a worker whose caller is
  killed outright gets a SIGINT (start_processes has Linux send it when a spawned worker's parent
  dies; a forked worker's parent is the fork server, so it watches the caller itself);
* a progress bar, and a clear error for a function that cannot be sent to a new process.

For multi-node runs, start the same worker code with ``torchrun`` and call :func:`init_from_env`.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.multiprocessing import start_processes

from course_lib.utils.progress import progress_bar

__all__ = [
    "WorkerError",
    "spawn",
    "pick_backend",
    "init_from_env",
    "worker_device",
    "free_port",
    "retry_if_port_taken",
    "report_progress",
    "START_METHOD",
]

# The start method spawn uses when not told: forkserver where it is safe with the libraries torch uses
# (Linux; macOS's system libraries may crash in a forked child, which is why Python itself moved
# macOS to spawn), spawn elsewhere. Both give a worker nothing of the parent's Python state but
# what is sent to it; the tests run the same workers under both and compare their results.
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
START_METHODS = ("spawn", "forkserver")
# What the fork server imports before it forks anything: what every worker needs, once. torch._dynamo
# (with sympy, about 800 modules) is what DistributedDataParallel's first construction in a process
# imports: a second of CPU per worker, paid once here instead.
# (A module a student edits, such as a notebook's my_workers.py, is left out: each worker imports it
# afresh, as under spawn. course_lib itself is imported once per kernel, in the kernel as in the server.)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "course_lib.launch", "course_lib.collectives",
            "course_lib.data_parallel", "course_lib.utils.digits", "course_lib.notebooks.demos",
            "course_lib.notebooks.hook_runs", "course_lib.notebooks.sharding_runs",
            "course_lib.notebooks.local_sgd_runs", "course_lib.notebooks.exercises"]

# The signal that asks a worker for its Python stack (not on Windows, which has no SIGUSR1). faulthandler
# writes the stack from inside the signal handler, in C: a worker blocked in a collective, in C++ code that
# never returns to Python, still answers.
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_stack_file = None  # the worker's open file for it (kept open: faulthandler writes to its descriptor)

# How long a terminated worker gets to exit before it is killed.
_GRACE_S = 3.0

# More processes than this is almost surely a typo (10**6 for 10**2); spawn(max_world_size=None) allows it.
_DEFAULT_MAX_WORLD_SIZE = max(16, 8 * (os.cpu_count() or 1))


class WorkerError(RuntimeError):
    """A worker raised (or died). ``rank``, ``exc_type`` and ``worker_traceback`` say which and how.

    When the worker's exception could be pickled, it is also attached as ``__cause__``.
    """

    def __init__(self, rank: int, exc_type: str, message: str, worker_traceback: str = ""):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        text = f"rank {rank} failed with {exc_type}: {message}"
        if worker_traceback:
            text += f"\n\nTraceback in rank {rank}:\n{worker_traceback.rstrip()}"
        super().__init__(text)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for demos; spawn itself needs none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_was_taken(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:  # the error, and what caused it
        seen.add(id(exc))
        text = str(exc).lower()
        if "eaddrinuse" in text or "address already in use" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_if_port_taken(run, attempts: int = 3):
    """Return ``run()``; call it again, up to ``attempts`` calls in all, while it fails on a port already in use.

    A port :func:`free_port` found free can be taken before the process meant to listen on it binds it:
    on a busy machine other programs' connections (gloo's among them) take ports of the same range all
    the time. So ``run`` must choose its ports afresh each time it is called. Any other error, and the
    last attempt's, is raised as it is.
    """
    if not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an integer >= 1, got {attempts!r}")
    for attempt in range(attempts):
        try:
            return run()
        except Exception as exc:
            if attempt == attempts - 1 or not _port_was_taken(exc):
                raise


def pick_backend(world_size: int) -> str:
    """NCCL when there is one CUDA device per rank, else gloo (which runs on any CPU)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def worker_device(kind: str = "auto") -> torch.device:
    """The device this worker should compute on.

    ``"auto"``: ``cuda:LOCAL_RANK`` under NCCL, else the CPU. ``"cuda"``: this rank's GPU whatever the
    backend, ``cuda:(LOCAL_RANK mod the GPUs visible)``, so that gloo ranks can share one GPU (gloo
    moves CUDA tensors; NCCL refuses two ranks on one GPU). ``"cpu"``: the CPU (not under NCCL, which
    moves CUDA tensors only).
    """
    if kind not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {kind!r}")
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    if kind == "cpu":
        if nccl:
            raise ValueError("device='cpu' under the NCCL backend: NCCL moves CUDA tensors only. "
                             "Use device='auto' (or 'cuda'), or start the workers with backend='gloo'.")
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible (torch.cuda.is_available() is False): "
                             "use device='auto' or 'cpu'.")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cuda", local_rank) if nccl else torch.device("cpu")


def _check_picklable_by_reference(fn, who: str = "spawn") -> None:
    # The spawn start method sends a function to a new interpreter by *name*
    # (module + qualified name); the child imports the module and looks the name up. A lambda,
    # a nested function, or a function defined in a notebook cell (module ``__main__``, which the
    # child cannot import) has no such name.
    if not callable(fn):
        raise ValueError(f"{who} needs a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    where = (
        "Define it at the top level of a .py module that Python can import (for example in "
        "course_lib, or in a file next to the notebook) and import it from there."
    )
    if "<lambda>" in qualname:
        raise ValueError(f"{who} cannot send a lambda to a new process. {where}")
    if "<locals>" in qualname:
        raise ValueError(f"{who} cannot send the nested function {qualname!r} to a new process. {where}")
    main_is_a_file = getattr(sys.modules.get("__main__"), "__file__", None) is not None
    if module is None or (module in ("__main__", "__mp_main__") and not main_is_a_file):
        # (A script run with `python script.py` is fine: spawn re-imports it from its file,
        # provided its top-level code sits under `if __name__ == "__main__":`.)
        raise ValueError(
            f"{who} cannot send {qualname or fn!r}: it is defined in __main__ (a notebook cell, the "
            f"interactive interpreter or `python -c`), which a spawned process cannot import. {where}"
        )


def _validate_backend(backend: str, world_size: int) -> str:
    if backend == "auto":
        return pick_backend(world_size)
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but "
                f"{gpus} GPU(s) are visible. Use backend='gloo' (runs on the CPU), "
                f"backend='auto', or a smaller world_size."
            )
        return backend
    if backend in ("gloo", "mpi"):
        return backend
    raise ValueError(
        f"unknown backend {backend!r}: use 'auto', 'gloo', 'nccl' or 'mpi' (mpi needs a torch built with MPI)"
    )


_progress_queue = None  # set in each worker: where report_progress() sends its counts


def report_progress(n: int = 1) -> None:
    """Inside a worker started by :func:`spawn`: rank 0 has done ``n`` more units of work.

    The parent shows them on a progress bar when ``spawn(..., progress=TOTAL)`` asked for one;
    elsewhere (other ranks, torchrun, plain calls) this does nothing.
    """
    if _progress_queue is not None and os.environ.get("RANK") == "0":
        _progress_queue.put(("progress", 0, time.time(), n))


def _watch_caller(pid: int) -> None:
    """SIGINT this worker when process ``pid`` (the caller of spawn) ends, as PR_SET_PDEATHSIG does for a
    worker whose parent is the caller.

    A forked worker's parent is the fork server, and the fork server outlives a caller that is killed
    (each worker it forked holds the caller's end of the pipe whose closing would tell it to exit), so
    the signal the kernel sends at a parent's death would never come. The worker watches the caller
    itself: a thread waits on a pidfd, which becomes readable when the caller has ended (Linux 5.3+).
    """
    def interrupt():
        os.kill(os.getpid(), signal.SIGINT)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        interrupt()
        return
    except (AttributeError, OSError):  # no pidfd here: look every half second (a caller that has died
        # but not yet been reaped by its own parent still answers, so this can come late)
        def poll():
            while True:
                time.sleep(0.5)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return interrupt()
        threading.Thread(target=poll, daemon=True, name="course_lib-watch-caller").start()
        return

    def wait():
        select.select([fd], [], [])
        interrupt()

    threading.Thread(target=wait, daemon=True, name="course_lib-watch-caller").start()


def _worker(rank, fn, world_size, port, backend, timeout_s, args, results, environ, caller, stack_paths):
    # start_processes calls this as _worker(i, *args) in process i: the process index is the rank.
    # The environment is the caller's at the call: a forked worker would otherwise have the fork
    # server's, from the first call (a variable set in a notebook since then would be missing), and
    # torch.distributed's debug level, which it read from it when the server imported it.
    os.environ.clear()
    os.environ.update(environ)
    dist.set_debug_level_from_env()
    # A worker gets SIGINT when its caller dies: from the kernel when its parent is the caller
    # (start_processes asks for that), from _watch_caller when it is the fork server. A parent that
    # ignores SIGINT (a background job of a shell script does) passes the ignoring on, and the worker
    # would outlive it: each worker takes Python's own handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.getppid() != caller:  # forked by the fork server, not started by the caller
        _watch_caller(caller)
    if stack_paths is not None:
        global _stack_file
        _stack_file = open(stack_paths[rank], "w")
        faulthandler.register(_STACK_SIGNAL, file=_stack_file, all_threads=True)
    global _progress_queue
    _progress_queue = results
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        if backend != "nccl" and "OMP_NUM_THREADS" not in os.environ:
            # cores // p threads each (torchrun goes further and sets 1): p processes that each use every
            # core fight over them. On 2 cores, 2 processes with 2 compute threads each made a Python
            # ring all-reduce 2x slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        # The workers' own collective timeout is longer than spawn's, so that a hang is reported
        # by the parent (naming every stuck rank) rather than by whichever rank times out first.
        timeout = datetime.timedelta(seconds=timeout_s + 30)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
        )
        # Every rank waits here until all have joined. gloo counts a connection made once its own side
        # is up, so a rank whose fn returned at once could close its sockets while a slower peer was
        # still finishing the other side, and that peer's init failed ("Connection closed by peer":
        # 2 spawns in 150 of a function that returns at once, on a busy machine).
        store.set(f"course_lib/joined/{rank}", "1")
        store.wait([f"course_lib/joined/{r}" for r in range(world_size)])
        value = fn(rank, world_size, *args)
        # Pickle to bytes here, so tensors are copied rather than shared through file
        # descriptors that vanish when this process exits.
        results.put(("ok", rank, time.time(), pickle.dumps(value)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        # Report *before* tearing the group down: closing this rank's connections makes its
        # peers fail too, and the parent should hear about the cause before the consequences.
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:
            exc_bytes = None
        report = (type(exc).__name__, str(exc), traceback.format_exc(), exc_bytes)
        results.put(("error", rank, time.time(), report))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dumps(procs, ranks: list[int], stack_paths: list[str] | None, wait_s: float = 2.0) -> dict[int, str]:
    """Ask each worker of ``ranks`` still alive for its Python stacks; ``{rank: faulthandler's dump of
    every thread}`` for those that answered within ``wait_s`` seconds."""
    if stack_paths is None:
        return {}
    asked = []
    for r in ranks:
        p = procs[r] if r < len(procs) else None
        if p is not None and p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, _STACK_SIGNAL)
                asked.append(r)
            except OSError:  # it exited meanwhile
                pass
    deadline, texts = time.monotonic() + wait_s, {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        for r in list(asked):
            with open(stack_paths[r]) as fh:
                text = fh.read()
            if "in _worker" in text:  # the main thread's stack is written through to its last frame
                texts[r] = text
                asked.remove(r)
    return texts


def _main_thread_stack(dump: str) -> str:
    """Of faulthandler's dump of every thread, the block of the thread that runs ``_worker`` (the main
    one), from its most recent call down to ``fn``; paths shortened to the package they are in."""
    for block in dump.strip().split("\n\n"):
        frames = [line.strip() for line in block.splitlines()[1:]]
        if any(f.endswith(" in _worker") for f in frames):
            frames = frames[: next(i for i, f in enumerate(frames) if f.endswith(" in _worker"))]
            return "\n".join(_short_path(f) for f in frames)
    return dump.strip()


def _short_path(frame: str) -> str:
    """``File "/…/site-packages/torch/x.py", line 3 in f`` -> ``torch/x.py, line 3 in f``."""
    if not frame.startswith('File "'):
        return frame
    path, _, rest = frame[len('File "'):].partition('"')
    for anchor in ("site-packages/", "dist-packages/"):
        if anchor in path:
            path = path.rsplit(anchor, 1)[1]
            break
    else:
        parts = path.replace(os.sep, "/").split("/")
        # from the course's own package, or else from the last of its folders (a notebook's my_*.py)
        at = [i for i, part in enumerate(parts) if part == "course_lib"] or \
             [i for i, part in enumerate(parts) if part in ("tests", "notebooks", "benchmarks", "solutions")][-1:]
        if at:
            path = "/".join(parts[at[-1]:])
    return path + rest


def _noop() -> None:
    pass


def _context(start_method: str | None):
    """The multiprocessing context for ``start_method`` (None: :data:`START_METHOD`), its fork server told
    what to import first."""
    start_method = START_METHOD if start_method is None else start_method
    if start_method not in START_METHODS:
        raise ValueError(f"unknown start_method {start_method!r}: use one of {START_METHODS} (or None, "
                         f"for {START_METHOD!r} on this system)")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method {start_method!r} is not available on {sys.platform}: use 'spawn'")
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Read when the server starts (at the first forkserver call in this process); no effect after.
        context.set_forkserver_preload(_PRELOAD)
        # Have the server ready before any worker is asked of it. A worker is handed to the server
        # before its pid comes back, and at the first call that takes the whole import of torch: a
        # Ctrl-C in that wait would leave a worker that the server forks later and nobody stops. A
        # process that does nothing takes that wait instead (milliseconds once the server is up).
        warm = context.Process(target=_noop, daemon=True)
        warm.start()
        warm.join()
    return context


def _stop(procs) -> None:
    """Terminate the workers, give them ``_GRACE_S`` seconds to exit, then kill those still running."""
    # A process that never started has no pid, nothing to stop, and joining it raises.
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    try:
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        # Even when a second Ctrl-C cuts the grace period short.
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# Held while a spawn call starts its workers, so that the processes that appear meanwhile are that
# call's (see _start_workers). Starting takes milliseconds; the workers then run in parallel.
_start_lock = threading.Lock()


def _start_workers(procs: list, error_files: list, world_size: int, worker_args: tuple,
                   start_method: str) -> None:
    """Start ``_worker(rank, *worker_args)`` for each rank; append the processes to ``procs``.

    start_processes starts the processes one after another. When starting one fails (Ctrl-C, an
    argument that cannot be pickled, the OS out of processes or file descriptors), it raises, and
    the processes it had already started keep running with no handle to them in the exception.
    They are the children that appeared while it ran (spawn calls in other threads wait for the
    lock; only a process that other code started in the same milliseconds would be taken for one),
    so those go into ``procs`` too, for the caller's ``finally`` to stop. Filling the
    caller's list rather than returning one leaves no moment at which started workers are in
    nobody's hands. ``error_files`` gets start_processes' traceback file for each rank.
    """
    with _start_lock:
        before = set(multiprocessing.active_children())
        try:
            context = start_processes(
                _worker, args=worker_args, nprocs=world_size, join=False, daemon=True, start_method=start_method
            )
            procs.extend(context.processes)
            error_files.extend(context.error_files)
        except BaseException:
            procs.extend(p for p in multiprocessing.active_children() if p not in before and p not in procs)
            raise


def _exit_report(rank: int, process, error_file: str | None) -> WorkerError:
    """The WorkerError for a worker that died without reporting a result or an exception."""
    code = process.exitcode
    how = f"exited with code {code}"
    if code is not None and code < 0:
        try:
            how += f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    # _worker reports every exception of fn itself. One that escapes it (the report itself failed)
    # is caught by start_processes' wrapper, which writes its traceback to this file and exits with 1.
    tb = ""
    if error_file is not None and os.path.exists(error_file):
        try:
            with open(error_file, "rb") as fh:
                tb = pickle.load(fh)
        except Exception:
            tb = ""
    hint = "" if tb else "; its stderr (the terminal that started Python or Jupyter) may say why"
    if code == -signal.SIGABRT:
        hint += (". gloo aborts a process that receives a message of another length than it expected: if ranks "
                 "may pass tensors of different shapes to a collective, set TORCH_DISTRIBUTED_DEBUG=DETAIL "
                 "to have the course's collectives check that the ranks agree")
    return WorkerError(rank, "ProcessExited", f"the process (pid {process.pid}) {how} without reporting{hint}", tb)


def _raise_first_failure(procs, results, values, errors, window_s: float = 1.0, error_files=()):
    """Raise a WorkerError for the failure that came first.

    When one rank fails, its peers usually fail a moment later ("Connection closed by peer"):
    those are consequences. Collect reports for a short window, then blame a rank that died
    without reporting (a crash), else the earliest exception.
    """
    end = time.monotonic() + window_s
    while time.monotonic() < end and len(values) + len(errors) < len(procs):
        try:
            status, rank, stamp, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "progress":
            continue
        if status == "ok":
            values[rank] = pickle.loads(payload)
        else:
            errors[rank] = (stamp, payload)
    silent = [r for r, p in enumerate(procs) if r not in values and r not in errors and not p.is_alive()]
    if silent:
        rank = silent[0]
        raise _exit_report(rank, procs[rank], error_files[rank] if rank < len(error_files) else None)
    if not errors:
        return  # a false alarm: the "dead" rank had finished and its result was still in flight
    rank = min(errors, key=lambda r: errors[r][0])
    exc_type, message, tb, exc_bytes = errors[rank][1]
    cause = None
    if exc_bytes is not None:
        try:
            cause = pickle.loads(exc_bytes)
        except Exception:
            cause = None
    raise WorkerError(rank, exc_type, message, tb) from cause


def spawn(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 120.0,
          progress: int | None = None, desc: str | None = None,
          max_world_size: int | None = _DEFAULT_MAX_WORLD_SIZE, start_method: str | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return their results.

    Each process has the default process group initialized (``dist.get_rank()`` works inside
    ``fn``) and destroyed when ``fn`` returns. Results come back in rank order.

    ``fn`` must be a top-level function of an importable module: both start methods send the
    function to the new process by module and name, so a function defined in a notebook cell
    or a lambda cannot be sent. Those get a ``ValueError`` saying where to put it.

    ``start_method``: ``"forkserver"`` (the default on Linux, :data:`START_METHOD`) forks each worker
    from a server process that imported torch and course_lib once, at the first call; ``"spawn"``
    (the default elsewhere) starts a new interpreter per worker, which imports them itself. Neither
    shares the parent's Python state, CUDA included, and the worker's ``os.environ`` is the parent's
    at the call either way (see the module's docstring for what torch reads only at import).

    CPU workers get ``os.cpu_count() // world_size`` compute threads each (at least 1;
    ``torchrun``, by contrast, sets ``OMP_NUM_THREADS=1``), unless ``OMP_NUM_THREADS`` is set.

    ``backend="auto"`` picks NCCL when ``torch.cuda.device_count() >= world_size`` and gloo
    otherwise (see :func:`pick_backend`); NCCL workers compute on ``cuda:rank``.

    Failures never hang: if a worker raises or dies, the others are terminated and a
    :class:`WorkerError` names the rank and carries its exception type, message and traceback.
    If the group has not finished ``timeout_s`` seconds after the call (starting the workers
    included), every worker is killed and a ``TimeoutError`` names the ranks still running and says
    where each was: before killing them, spawn sends each a SIGUSR1, on which it writes its Python stack
    (``faulthandler``; not on Windows), and the error's message ends with each rank's stack, from the
    most recent call down to ``fn`` (``error.stacks``: ``{rank: stack}``; ``error.dumps``: every thread's).

    ``world_size`` above ``max_world_size`` (default: 8 per core, at least 16) is refused with a
    ``ValueError``; pass ``max_world_size=None`` to start that many processes anyway.

    ``progress=TOTAL`` shows a ``tqdm`` progress bar (``desc`` its label) that the workers advance
    with :func:`report_progress`.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if max_world_size is not None and world_size > max_world_size:
        raise ValueError(
            f"world_size={world_size} processes on a machine with {os.cpu_count()} cores: more than "
            f"max_world_size={max_world_size}, which spawn refuses so that a typo does not start "
            f"thousands of processes. Pass max_world_size=None (or a larger number) to start them anyway."
        )
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    _check_picklable_by_reference(fn)
    backend = _validate_backend(backend, world_size)
    context = _context(start_method)

    # The store lives in this process, on a port the OS chose: no fixed port, no race between
    # picking a free port and binding it, and each spawn call gets its own.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )
    # A queue of the workers' own context: its locks have names that the new processes can open.
    results = context.Queue()
    procs: list = []  # filled by _start_workers as the workers start, stopped in `finally`
    error_files: list = []
    values: dict[int, object] = {}
    bar = None
    if progress:
        bar = progress_bar(total=progress, desc=desc or getattr(fn, "__name__", "workers"))
    deadline = time.monotonic() + timeout_s  # starting the workers counts: importing torch takes seconds each
    stack_paths = None  # where each worker writes its stack when asked (at the timeout)
    try:
        if _STACK_SIGNAL is not None:
            stack_paths = []
            for r in range(world_size):
                fd, path = tempfile.mkstemp(prefix=f"course_lib_rank{r}_", suffix=".stack")
                os.close(fd)
                stack_paths.append(path)
        _start_workers(procs, error_files, world_size,
                       (fn, world_size, store.port, backend, timeout_s, args, results, dict(os.environ), os.getpid(),
                        stack_paths),
                       context.get_start_method())
        # Wait on our own queue rather than in ProcessContext.join: join watches only exit codes
        # (our workers report failures on the queue and exit with 0), and a worker whose result is
        # still in the queue's pipe cannot exit until someone reads it.
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in values]
                dumps = _dumps(procs, running, stack_paths)
                stacks = {r: _main_thread_stack(d) for r, d in dumps.items()}
                where = "".join(f"\n\nrank {r} was in (most recent call first):\n{stacks[r]}" for r in sorted(stacks))
                error = TimeoutError(
                    f"spawn timed out after {timeout_s:g} s; rank(s) {running} were still running "
                    f"and have been killed. Raise timeout_s if the work is just slow.{where}"
                )
                error.stacks = stacks  # {rank: its main thread's Python stack at the timeout}
                error.dumps = dumps  # {rank: every thread's, as faulthandler wrote them}
                raise error
            try:
                status, rank, stamp, payload = results.get(timeout=min(0.2, remaining))
            except queue.Empty:
                if any(r not in values and not p.is_alive() for r, p in enumerate(procs)):
                    _raise_first_failure(procs, results, values, {}, error_files=error_files)
                continue
            if status == "progress":
                if bar is not None:
                    bar.update(payload)
            elif status == "ok":
                values[rank] = pickle.loads(payload)
            else:
                _raise_first_failure(procs, results, values, {rank: (stamp, payload)}, error_files=error_files)
    finally:
        if bar is not None:
            bar.close()
        _stop(procs)
        results.close()
        results.join_thread()
        del store
        # Nothing in torch removes the traceback files that start_processes' wrapper writes.
        for path in error_files + (stack_paths or []):
            if os.path.exists(path):
                os.remove(path)
    return [values[r] for r in range(world_size)]


def init_from_env(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment.

    ``torchrun --nproc-per-node N script.py`` (and ``--nnodes``/``--rdzv-endpoint`` across
    machines) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; this reads them,
    initializes with the ``env://`` rendezvous and returns ``(rank, world_size, device)``. Call
    ``torch.distributed.destroy_process_group()`` when done. With ``backend="auto"``, NCCL is used
    when this node has a GPU for each of its local ranks.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"init_from_env needs the variables torchrun sets; missing {missing}. Start the script "
            f"with `torchrun --nproc-per-node N script.py`, or use course_lib.launch.spawn."
        )
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend == "auto":
        backend = pick_backend(local_world)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size(), device
