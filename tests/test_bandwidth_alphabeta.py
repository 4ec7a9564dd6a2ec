import math

import pytest
import torch

from course_lib import alphabeta as ab
from course_lib import bandwidth as bw
from course_lib.launch import spawn
from tests import collective_workers as W


def test_bus_factors_are_nccl_tests_definitions():
    assert bw.bus_factor("all_reduce", 4) == 1.5
    assert bw.bus_factor("all_gather", 4) == 0.75
    assert bw.bus_factor("reduce_scatter", 2) == 0.5
    assert bw.bus_factor("broadcast", 8) == bw.bus_factor("reduce", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bw.bus_factor("allreduce", 2)


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
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * bw.bus_factor(op, world_size))


def test_alpha_beta_formulas():
    a, b, g = 1e-5, 1e-9, 1e-10
    n = 1e6
    assert ab.alpha_beta_time("ring_all_reduce", n, 4, a, b, g) == pytest.approx(6 * a + 1.5 * n * b + 0.75 * n * g)
    assert ab.alpha_beta_time("naive_all_reduce", n, 4, a, b, g) == pytest.approx(6 * (a + n * b) + 3 * n * g)
    assert ab.alpha_beta_time("tree_broadcast", n, 5, a, b) == pytest.approx(3 * (a + n * b))
    assert ab.alpha_beta_time("tree_reduce", n, 4, a, b, g) == pytest.approx(2 * (a + n * b + n * g))
    assert ab.alpha_beta_time("ring_all_reduce", n, 1, a, b) == 0.0
    # the ring's bandwidth term stays below 2 n beta however many ranks there are
    assert ab.alpha_beta_time("ring_all_reduce", n, 1000, 0.0, b) < 2 * n * b
    with pytest.raises(ValueError, match="unknown algorithm"):
        ab.alpha_beta_time("ring", n, 2, a, b)


def test_fit_recovers_alpha_and_beta():
    sizes = [2**k for k in range(12, 27, 2)]
    alpha, beta = 30e-6, 1 / 2e9
    noise = torch.Generator().manual_seed(0)
    times = [(alpha + s * beta) * (1 + 0.02 * torch.randn(1, generator=noise).item()) for s in sizes]
    fa, fb = ab.fit_alpha_beta(sizes, times)
    assert fa == pytest.approx(alpha, rel=0.1)
    assert fb == pytest.approx(beta, rel=0.05)


def test_ping_pong_times_grow_with_size():
    rows = spawn(ab.ping_pong, 2, [4096, 32 * 2**20], 3, backend="gloo")[0]
    assert [n for n, _ in rows] == [4096, 32 * 2**20]
    assert rows[1][1] > rows[0][1] > 0


def test_sweep_worker_on_gloo():
    out = spawn(bw.sweep, 2, ("all_reduce", "broadcast"), [4096, 65536], 2, backend="gloo")[0]
    assert out["backend"] == "gloo" and out["device"] == "cpu" and out["world_size"] == 2
    assert [r["size_bytes"] for r in out["all_reduce"]] == [4096, 65536]


def test_fit_ring_all_reduce_recovers_latency_and_bus_bandwidth():
    p, alpha, busbw = 4, 20e-6, 5.0
    sizes = [4096 * 4**k for k in range(9)]
    rows = [{"size_bytes": n, "time_s": 2 * (p - 1) * alpha + n / (busbw * 1e9)} for n in sizes]
    a, b = bw.fit_ring_all_reduce(rows, p)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(busbw, rel=1e-6)


def test_predict_step_time():
    assert bw.predict_step_time(0.01, 1e9, 2, 4, 10.0, 1e-5) == pytest.approx(0.01 + 2 * 6 * 1e-5 + 0.1)
    assert bw.predict_step_time(0.01, 1e9, 2, 1, 10.0, 1e-5) == 0.01
