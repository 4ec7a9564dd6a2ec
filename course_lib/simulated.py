"""Many workers on one machine: p logical ranks as threads of one process, over an in-process group.

Real processes stop being practical past a few on 2 cores, and a method's verdict can depend on p
(an all-gather grows with it, an all-reduce does not). :func:`simulate` runs ``fn(rank, world_size,
*args)`` as :func:`course_lib.launch.spawn` does, but each rank is a thread, and the process group
is torch's own in-process one (``torch.testing._internal.distributed.multi_threaded_pg``, the
"threaded" backend torch's tests use): an all-reduce sums the ranks' tensors in memory, an
all-gather copies them. Everything above the transport is unchanged: DDP and its communication hooks,
the compressors, the error memories, local SGD, DiLoCo, the course's ring collectives (for which
this module adds ``send`` and ``recv``, which the threaded group lacks). The same worker function
runs either way, so a simulated run can be checked against real gloo processes
(``tests/test_simulated.py``).

What differs from processes: the threads share one interpreter, so a worker must not rely on
process-wide state of its own (``os.environ``, ``torch.manual_seed`` without a generator: the
course's workers seed generators of their own); all ranks' computation runs on the cores of one
process, so wall-clock times mean nothing; the sums are done in rank order, which can differ from
gloo's in the last bit.

One rank computes at a time: a rank holds a baton (a lock) from its start to its next collective or
receive, lets it go while it waits there, and takes it back after. Without it, 64 threads contend for
Python's lock at every small torch operation (each lets it go and must queue to get it back), and a
step of a compression hook took seconds; with it, the wait for Python's lock is gone and p ranks cost
about p times one rank's work. What is computed does not depend on the order in which ranks run.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.testing._internal.distributed import multi_threaded_pg as threaded

from course_lib import collectives, hooks
from course_lib.launch import WorkerError
from course_lib.utils.per_rank import set_simulated_rank

__all__ = ["simulate", "BACKEND"]

BACKEND = "course_simulated"
_ONE_AT_A_TIME = threading.Lock()  # the threaded group's world is process-wide: one simulation at a time
_BATON = threading.Lock()  # held by the one rank that computes (module docstring)
_torch_join = threaded.Collective.join


def _join_without_baton(self, rank, data):
    """torch's ``Collective.join`` (every rank of the group arrives, then one copies the data around),
    with the baton let go while this rank waits for the others."""
    _BATON.release()
    try:
        return _torch_join(self, rank, data)
    finally:
        _BATON.acquire()


class _ReceiveWork(dist.Work):
    """A receive still waiting for its send: ``wait`` lets the baton go until the message has arrived."""

    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        _BATON.release()
        try:
            self._future.wait()
        finally:
            _BATON.acquire()
        return True

    def is_completed(self):
        return self._future.done()

    def get_future(self):
        return self._future


def _done(result=None):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _InProcessGroup(threaded.ProcessLocalGroup):
    """torch's threaded process group, with point-to-point messages: a send hands a copy of its tensors
    to the matching receive (same group, source, destination and tag), posted before or after it."""

    _lock = threading.Lock()
    _sent = defaultdict(queue.SimpleQueue)  # key -> copies sent, not yet received
    _posted = defaultdict(queue.SimpleQueue)  # key -> (tensors, future) of receives waiting for a send

    @classmethod
    def reset(cls):  # the collectives' state lives on torch's class, whose methods name it
        threaded.ProcessLocalGroup.reset()
        with cls._lock:
            cls._sent.clear()
            cls._posted.clear()

    def _key(self, src: int, dst: int, tag: int):
        return (self.pg_name, src, dst, tag)

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 (torch's argument names)
        copies = [t.detach().clone() for t in tensors]
        key = self._key(self._rank, dstRank, tag)
        with self._lock:
            waiting = self._posted[key]
            if waiting.empty():
                self._sent[key].put(copies)
                return _done()
            targets, future = waiting.get()
        for target, copy in zip(targets, copies):
            target.detach().copy_(copy)
        future.set_result(None)
        return _done()

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        key = self._key(srcRank, self._rank, tag)
        with self._lock:
            arrived = self._sent[key]
            if arrived.empty():
                future = Future()
                self._posted[key].put((tensors, future))
                return _ReceiveWork(future)
            copies = arrived.get()
        for target, copy in zip(tensors, copies):
            target.detach().copy_(copy)
        return _done()

    def getBackendName(self):  # noqa: N802
        return BACKEND


def _create_group(prefix_store, rank, world_size, timeout):
    group = _InProcessGroup(rank, world_size)
    dist.distributed_c10d._store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return group


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])


def simulate(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` logical ranks, each a thread with the default
    process group initialized (backend :data:`BACKEND`); their return values, by rank.

    A rank that raises stops the others (their collectives return at once) and :class:`WorkerError`
    names it, with its traceback, as ``spawn`` does. A simulation still running after ``timeout_s``
    raises ``TimeoutError`` (its threads cannot be killed, and are left to end on their own).
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function of (rank, world_size, ...), got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not _ONE_AT_A_TIME.acquire(timeout=timeout_s):
        raise TimeoutError("another simulation is still running in this process")
    results, failures = [None] * world_size, {}
    store = dist.HashStore()

    def run(rank: int):
        set_simulated_rank(rank)  # this rank's own counters (hooks.traffic, collectives.sent)
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store)
            with _BATON:  # the store's barrier above waits without it
                results[rank] = fn(rank, world_size, *args)
        except SystemExit:  # the group stopped this rank because another one failed
            pass
        except BaseException as e:  # noqa: BLE001 (reported with its rank below)
            failures[rank] = (type(e).__name__, str(e), traceback.format_exc())
            threaded.ProcessLocalGroup.exception_handle(e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    excepthook = sys.excepthook  # init_process_group wraps it (a rank prefix), once per rank: put back after
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    threaded.Collective.join = _join_without_baton
    _InProcessGroup.reset()
    for counter in (hooks.traffic, collectives.sent):
        counter.forget_simulated_ranks()
    try:
        threads = [threading.Thread(target=run, args=(rank,), name=f"rank {rank}", daemon=True)
                   for rank in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        stuck = [rank for rank, t in enumerate(threads) if t.is_alive()]
        if failures:
            rank = min(failures)
            raise WorkerError(rank, *failures[rank])
        if stuck:
            threaded.ProcessLocalGroup.exception_handle(None)
            raise TimeoutError(f"simulate timed out after {timeout_s:g} s; rank(s) {stuck} were still running. "
                               f"Raise timeout_s if the work is just slow.")
        return results
    finally:
        sys.excepthook = excepthook
        threaded._uninstall_threaded_pg()
        threaded.Collective.join = _torch_join
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _InProcessGroup.reset()
        _ONE_AT_A_TIME.release()
