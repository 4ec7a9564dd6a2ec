"""Workers for test_concurrent_messages: bandwidth.time_with_cpu and bandwidth.concurrent_messages,
watched from outside (known durations, logged sends and receives, corrupted payloads)."""


import torch
import torch.distributed as dist

from course_lib import bandwidth as bw


def known_durations(rank, world_size, d, cpu_s):
    """time_with_cpu of two runs whose costs are known, on a fake clock. Sleeping: rank r takes (r + 1) d,
    five times longer in the first timed run (the warm-up 20 d), and no CPU. Spinning: every rank
    spends ``cpu_s`` seconds of wall time and of its own CPU time."""
    from tests.fake_clock import fake_clock

    calls = []
    with fake_clock() as clock:
        def sleep(_):
            k = len(calls) - 1  # -1: the warm-up
            calls.append(k)
            clock.spend(20 * d if k < 0 else (rank + 1) * d * (5 if k == 0 else 1))

        def spin(_):
            clock.spend(cpu_s, cpu_s)

        slept = bw.time_with_cpu(sleep, torch.zeros(1), iters=3, warmup=1)
        spun = bw.time_with_cpu(spin, torch.zeros(1), iters=3, warmup=1)
    return slept, spun, len(calls)


def logged_messages(rank, world_size, senders, numel, corrupt=False):
    """concurrent_messages with dist.isend / dist.irecv wrapped: every peer this rank sent to or
    received from, with the message's length. ``corrupt``: every message carries zeros instead of
    the sender's data, which the worker's #wrong column must count."""
    log = []
    real_isend, real_irecv = dist.isend, dist.irecv

    def isend(tensor, dst, *args, **kwargs):
        log.append(("send", dst, tensor.numel()))
        return real_isend(torch.zeros_like(tensor) if corrupt else tensor, dst, *args, **kwargs)

    def irecv(tensor, src, *args, **kwargs):
        log.append(("recv", src, tensor.numel()))
        return real_irecv(tensor, src, *args, **kwargs)

    dist.isend, dist.irecv = isend, irecv
    try:
        rows = bw.concurrent_messages(rank, world_size, [numel * 4], senders, iters=2)
    finally:
        dist.isend, dist.irecv = real_isend, real_irecv
    return rows, log
