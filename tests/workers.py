"""Worker functions for the tests: spawn sends functions by name, so they live in a module."""

import ctypes
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from course_lib.launch import report_progress


def report(rank, world_size, tag):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "tag": tag,
        "sum": t.item(),
        "env": {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "pid": os.getpid(),
    }


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError("rank one divides by zero")
    dist.barrier()  # the peer waits here for a rank that never comes
    return rank


def sleep_on_rank_zero(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def exit_hard_on_last_rank(rank, world_size):
    if rank == world_size - 1:
        os._exit(3)
    dist.barrier()
    return rank


def big_tensor(rank, world_size):
    return torch.full((1000, 1000), float(rank))


def count_up(rank, world_size, n):
    for _ in range(n):
        report_progress()
    return n


def how_started(rank, world_size):
    """The functions on this worker's stack, and the signal it gets when its parent dies (Linux)."""
    pdeathsig = None
    if sys.platform.startswith("linux"):
        sig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # 2 = PR_GET_PDEATHSIG
        pdeathsig = sig.value
    return {"stack": [(f.filename, f.name) for f in traceback.extract_stack()], "pdeathsig": pdeathsig}


def _write_pid(pid_dir, rank):
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def pid_then_fail_on_rank_one(rank, world_size, pid_dir):
    _write_pid(pid_dir, rank)
    dist.barrier()  # every pid is on disk before rank 1 fails
    if rank == 1:
        raise ValueError("rank one fails after writing its pid")
    time.sleep(600)  # the others would stay here long after the test, if nobody stopped them


def pid_then_interrupt_parent(rank, world_size, pid_dir, parent_pid):
    _write_pid(pid_dir, rank)
    dist.barrier()  # every pid is on disk before the parent is interrupted
    if rank == 0:
        # as Ctrl-C (or a notebook's interrupt) in the process that called spawn (a forked worker's
        # own parent is the fork server)
        os.kill(parent_pid, signal.SIGINT)
    time.sleep(600)


def pid_then_sleep(rank, world_size, pid_dir, seconds):
    _write_pid(pid_dir, rank)
    time.sleep(seconds)


def raise_unprintable_on_rank_one(rank, world_size):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("this exception cannot be turned into a message")

    if rank == 1:
        raise Unprintable()  # so the worker's own report fails, and start_processes' wrapper catches it
    time.sleep(600)
    return rank


def sigint_handler(rank, world_size):
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def train_a_little_start():
    torch.manual_seed(0)
    return torch.nn.utils.parameters_to_vector(torch.nn.Linear(8, 4).parameters()).detach()


def train_a_little(rank, world_size):
    """Three steps of DDP on rank-dependent data; what a start method could change, returned."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"params": torch.nn.utils.parameters_to_vector(model.parameters()).detach(),
            "threads": torch.get_num_threads(), "next_random": torch.rand(3),
            "default_dtype": str(torch.get_default_dtype())}


def environment(rank, world_size, names):
    return {name: os.environ.get(name) for name in names}


def debug_level(rank, world_size):
    return dist.get_debug_level().name


def ranks_joined_when_fn_starts(rank, world_size):
    """The ranks that launch's workers had recorded as joined (in the group's store) when fn started here."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False)
    return [r for r in range(world_size) if store.check([f"course_lib/joined/{r}"])]
