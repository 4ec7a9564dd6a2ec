"""Notebook 04's exercises (DDP in practice): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

from course_lib import data_parallel
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
