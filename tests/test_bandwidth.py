"""Measurement in real gloo processes."""

import math

import pytest

from course_lib import bandwidth as bw
from course_lib.costmodel import bus_factor
from course_lib.launch import spawn
from tests import collective_workers as W


@pytest.mark.parametrize("world_size", [2, 3])
def test_measure_collective_on_gloo(world_size):
    per_rank = spawn(W.measure_all_ops, world_size, backend="gloo")
    assert per_rank[0] == per_rank[-1]  # the slowest rank's time is agreed on by all
    for op, rows in per_rank[0].items():
        want = [4096, 65536]
        if op in ("all_gather", "reduce_scatter"):  # rounded down to n equal shards
            want = [s // (4 * world_size) * 4 * world_size for s in want]
        assert [r["size_bytes"] for r in rows] == want
        for r in rows:
            assert r["time_s"] > 0
            assert math.isclose(r["algbw_GBps"], r["size_bytes"] / r["time_s"] / 1e9)
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * bus_factor(op, world_size))


def test_ping_pong_times_grow_with_size():
    rows = spawn(bw.ping_pong, 2, [4096, 32 * 2**20], 3, backend="gloo")[0]
    assert [n for n, _ in rows] == [4096, 32 * 2**20]
    assert rows[1][1] > rows[0][1] > 0


def test_sweep_worker_on_gloo():
    out = spawn(bw.sweep, 2, ("all_reduce", "broadcast"), [4096, 65536], 2, backend="gloo")[0]
    assert out["backend"] == "gloo" and out["device"] == "cpu" and out["world_size"] == 2
    assert [r["size_bytes"] for r in out["all_reduce"]] == [4096, 65536]
