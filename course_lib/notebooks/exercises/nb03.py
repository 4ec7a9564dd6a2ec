"""Notebook 03's exercises (data parallelism): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

from course_lib import (
    costmodel,
    data_parallel,
)
from course_lib.notebooks.exercises.core import _name, check


def ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    """The payload in bytes of every all-reduce torch's DDP issues, in order, for ``steps`` optimizer
    steps of ``k`` micro-batches each (``no_sync`` around the first k - 1 of each step or not), when
    backward produces gradients of ``sizes_bytes`` in that order. The first backward that
    synchronizes sends one bucket of every gradient; DDP then rebuilds its buckets in the order the
    gradients arrived, the first closed at 1 MiB when ``bucket_cap_mb`` is None (not given, 25 MiB
    for the others), else every one at ``bucket_cap_mb``. Checked against DDP itself in
    tests/test_data_parallel.py."""
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap
    first = data_parallel.assign_buckets(sizes_bytes, first_cap)[0]
    rest = data_parallel.assign_buckets(sizes_bytes[len(first):], cap) if len(first) < len(sizes_bytes) else []
    rebuilt = [sum(sizes_bytes[i] for i in first)] + [sum(sizes_bytes[len(first) + i] for i in b) for b in rest]
    sent = []
    for _ in range(steps):
        for micro in range(k):
            if no_sync and micro < k - 1:
                continue  # inside no_sync: backward only accumulates
            sent += rebuilt if sent else [sum(sizes_bytes)]
    return sent


def check_ddp_all_reduces(student_fn) -> bool:
    """``student_fn(sizes_bytes, bucket_cap_mb, steps, k, no_sync)``: the payload of every all-reduce
    DDP issues, in bytes, in order (see :func:`ddp_all_reduces`)."""
    mlp_sizes = [40, 20480, 2048, 1048576, 2048, 1048576, 2048, 1048576, 2048, 131072]  # hidden 512, depth 4
    cases = [(mlp_sizes, None, 2, 1, False), (mlp_sizes, 1, 3, 4, True), (mlp_sizes, 1, 2, 3, False),
             (mlp_sizes, 25, 2, 2, False), ([2**20] * 3 + [10], 0.5, 2, 2, True),
             ([300_000, 600_000, 900_000], None, 1, 1, False), ([4, 4, 4], 1e-5, 2, 1, False)]
    return check(student_fn, ddp_all_reduces, cases, name=_name(student_fn, "ddp_all_reduces"))


def exposed_time(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    """Seconds of communication left after backward, by the α-β model, for the bucketed wrapper: the
    buckets of ``data_parallel.assign_buckets`` (gradients of ``sizes_bytes`` ready at ``ready_s``,
    both in backward's order), each all-reduced once its last gradient is ready and the bucket
    before it is done, one at a time; the end of the last minus the last gradient's time."""
    end = 0.0
    for bucket in data_parallel.assign_buckets(sizes_bytes, cap_bytes):
        start = max(end, max(ready_s[i] for i in bucket))
        end = start + costmodel.ring_all_reduce_time(sum(sizes_bytes[i] for i in bucket), world_size, alpha_s,
                                                     busbw_GBps)
    return max(0.0, end - max(ready_s))


def check_exposed_time(student_fn) -> bool:
    """``student_fn(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps)``: the seconds of
    all-reduce left after the last gradient is ready (see :func:`exposed_time`)."""
    mlp_sizes = [40, 20480, 2048, 1048576, 2048, 1048576, 2048, 1048576, 2048, 131072]  # hidden 512, depth 4
    even = [2e-4 * (i + 1) for i in range(len(mlp_sizes))]  # a 2 ms backward
    cases = [(even, mlp_sizes, 2**20, 8, 5e-6, 100.0), (even, mlp_sizes, 1024, 8, 5e-6, 100.0),
             (even, mlp_sizes, 25 * 2**20, 2, 50e-6, 1.0), (even, mlp_sizes, 2**20, 2, 100e-6, 0.5),
             ([0.001, 0.002, 0.010], [4e6, 4e6, 4e6], 4e6, 4, 1e-5, 10.0)]
    return check(student_fn, exposed_time, cases, name=_name(student_fn, "exposed_time"), rtol=1e-9, atol=1e-15)
