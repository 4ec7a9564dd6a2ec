"""Notebook 03's exercises (data parallelism from scratch): each ``check_*`` holds the inputs and the
reference answer."""

from __future__ import annotations

from course_lib import costmodel, data_parallel
from course_lib.notebooks.exercises.core import _name, check


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
