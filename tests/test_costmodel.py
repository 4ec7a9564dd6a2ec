"""The cost model: arithmetic checked against formulas written out by hand."""

import pytest
import torch

from course_lib import costmodel as cm


def test_bus_factors_are_nccl_tests_definitions():
    assert cm.bus_factor("all_reduce", 4) == 1.5
    assert cm.bus_factor("all_gather", 4) == 0.75
    assert cm.bus_factor("reduce_scatter", 2) == 0.5
    assert cm.bus_factor("broadcast", 8) == cm.bus_factor("reduce", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        cm.bus_factor("allreduce", 2)


def test_alpha_beta_formulas():
    a, b, g = 1e-5, 1e-9, 1e-10
    n = 1e6
    assert cm.alpha_beta_time("ring_all_reduce", n, 4, a, b, g) == pytest.approx(6 * a + 1.5 * n * b + 0.75 * n * g)
    assert cm.alpha_beta_time("naive_all_reduce", n, 4, a, b, g) == pytest.approx(6 * (a + n * b) + 3 * n * g)
    assert cm.alpha_beta_time("tree_broadcast", n, 5, a, b) == pytest.approx(3 * (a + n * b))
    assert cm.alpha_beta_time("tree_reduce", n, 4, a, b, g) == pytest.approx(2 * (a + n * b + n * g))
    assert cm.alpha_beta_time("ring_all_reduce", n, 1, a, b) == 0.0
    # the ring's bandwidth term stays below 2 n beta however many ranks there are
    assert cm.alpha_beta_time("ring_all_reduce", n, 1000, 0.0, b) < 2 * n * b
    with pytest.raises(ValueError, match="unknown algorithm"):
        cm.alpha_beta_time("ring", n, 2, a, b)


def test_fit_recovers_alpha_and_beta():
    sizes = [2**k for k in range(12, 27, 2)]
    alpha, beta = 30e-6, 1 / 2e9
    noise = torch.Generator().manual_seed(0)
    times = [(alpha + s * beta) * (1 + 0.02 * torch.randn(1, generator=noise).item()) for s in sizes]
    fa, fb = cm.fit_alpha_beta(sizes, times)
    assert fa == pytest.approx(alpha, rel=0.1)
    assert fb == pytest.approx(beta, rel=0.05)


def _nccl_tests_rows(p, alpha, busbw, sizes):
    # what nccl-tests would print for a ring: time = 2(p-1) alpha + n / algbw, busbw = algbw * 2(p-1)/p
    rows = []
    for n in sizes:
        algbw = busbw / (2 * (p - 1) / p)
        rows.append({"size_bytes": n, "time_s": 2 * (p - 1) * alpha + n / (algbw * 1e9)})
    return rows


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_fit_ring_all_reduce_recovers_latency_and_bus_bandwidth(p):
    alpha, busbw = 20e-6, 5.0
    rows = _nccl_tests_rows(p, alpha, busbw, [4096 * 4**k for k in range(9)])
    a, b = cm.fit_ring_all_reduce(rows, p)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(busbw, rel=1e-6)
    # and the model gives the rows back
    for r in rows:
        assert cm.ring_all_reduce_time(r["size_bytes"], p, a, b) == pytest.approx(r["time_s"], rel=1e-6)


def test_the_ring_model_agrees_with_the_alpha_beta_formula():
    # busbw stands for the link's 1/beta: the two statements of the ring's cost are one
    for p in (2, 3, 4, 8):
        n, alpha, link_GBps = 64e6, 10e-6, 12.5
        assert cm.ring_all_reduce_time(n, p, alpha, link_GBps) == pytest.approx(
            cm.alpha_beta_time("ring_all_reduce", n, p, alpha, 1 / (link_GBps * 1e9)))
    assert cm.ring_all_reduce_time(1e9, 8, 0, 100.0) == pytest.approx(1.75 * 0.01)  # 2(p-1)/p = 1.75 at 8


def test_crossover_is_where_latency_equals_bandwidth():
    for p in (2, 3, 8):
        n = cm.ring_crossover_bytes(p, 20e-6, 5.0)
        assert n == pytest.approx(p * 20e-6 * 5e9)
        latency = cm.ring_all_reduce_time(0, p, 20e-6, 5.0)
        assert cm.ring_all_reduce_time(n, p, 20e-6, 5.0) == pytest.approx(2 * latency)


def test_predict_step_time():
    # p = 4: per all-reduce 2 * 3 alpha of latency; 1 GB at 10 GB/s busbw, times 2(p-1)/p = 1.5
    assert cm.predict_step_time(0.01, 1e9, 2, 4, 1e-5, 10.0) == pytest.approx(0.01 + 2 * 6 * 1e-5 + 0.15)
    assert cm.predict_step_time(0.01, 1e9, 2, 2, 1e-5, 10.0) == pytest.approx(0.01 + 2 * 2 * 1e-5 + 0.1)
    assert cm.predict_step_time(0.01, 0, 0, 4, 1e-5, 10.0) == pytest.approx(0.01)  # nothing sent
    assert cm.predict_step_time(0.01, 1e9, 2, 1, 1e-5, 10.0) == 0.01


def test_every_interconnect_says_where_its_number_comes_from():
    for name, ic in cm.INTERCONNECTS.items():
        assert ic.busbw_GBps > 0 and 0 < ic.latency_s < 1e-3 and ic.source
        if name.endswith("Gb/s Ethernet"):  # a line rate, in GB/s
            assert ic.busbw_GBps == float(name.split()[0]) / 8


def test_all_gather_time_grows_with_the_ranks_where_all_reduce_stays():
    n, alpha, busbw = 1_000_000, 10e-6, 10.0
    gather = [cm.collective_time("all_gather", n, p, alpha, busbw) for p in (2, 4, 8)]
    reduce = [cm.collective_time("all_reduce", n, p, 0.0, busbw) for p in (2, 4, 8)]
    assert gather == pytest.approx([alpha + n / 10e9, 3 * (alpha + n / 10e9), 7 * (alpha + n / 10e9)])
    assert reduce == pytest.approx([n / 10e9, 1.5 * n / 10e9, 1.75 * n / 10e9])  # 2(p-1)/p n: below 2 n at any p
    with pytest.raises(ValueError, match="all_gather"):
        cm.collective_time("broadcast", n, 2, alpha, busbw)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("p", [2, 4])
def test_fit_collective_recovers_alpha_and_busbw(op, p):
    alpha, busbw = 40e-6, 2.0
    # what course_lib.bandwidth reports: size_bytes is the whole buffer (p payloads for an all-gather)
    rows = [{"size_bytes": size, "time_s": cm.collective_time(op, size / p if op == "all_gather" else size,
                                                                     p, alpha, busbw)}
            for size in (2**12, 2**16, 2**20, 2**24)]
    got_alpha, got_busbw = cm.fit_collective(rows, op, p)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_busbw == pytest.approx(busbw, rel=1e-6)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_fit_residuals_are_measured_over_the_line(op):
    # rows written by hand from the formulas (not from collective_time): 3 ranks, alpha 50 us, 2 GB/s;
    # an all-gather's size_bytes is the whole buffer, 3 payloads of n / 3
    p, alpha, busbw = 3, 50e-6, 2.0
    sizes = [3 * 2**12, 3 * 2**20, 3 * 2**24]
    line = {"all_reduce": lambda n: 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / (busbw * 1e9),
            "all_gather": lambda n: (p - 1) * alpha + (p - 1) / p * n / (busbw * 1e9)}[op]
    factors = [1.0, 1.5, 0.8]  # the second size took half as long again as the line, the third less
    rows = [{"size_bytes": n, "time_s": f * line(n)} for n, f in zip(sizes, factors)]
    assert cm.fit_residuals(rows, op, p, alpha, busbw) == pytest.approx(factors, rel=1e-9)


def test_step_time_adds_compute_codec_and_unhidden_communication():
    links = {"all_reduce": (0.0, 1.0), "all_gather": (0.0, 1.0)}  # 1 GB/s, no latency
    t = cm.predict_compressed_step_time(0.010, 0.002, [("all_gather", 1e6)], 3, links)
    assert t == pytest.approx(0.010 + 0.002 + 2 * 1e-3)
    hidden = cm.predict_compressed_step_time(0.010, 0.0, [("all_reduce", 1e6)], 2, links, overlap_s=0.0005)
    assert hidden == pytest.approx(0.010 + 1e-3 - 0.0005)
    assert cm.predict_compressed_step_time(0.010, 0.0, [("all_reduce", 1e6)], 2, links, overlap_s=1) == 0.010
    waiting = cm.predict_compressed_step_time(0.010, 0.0, [("all_reduce", 1e6)], 2, links, wait_s=0.003)
    assert waiting == pytest.approx(0.010 + 0.003 + 1e-3)
    assert cm.predict_compressed_step_time(0.010, 0.002, [], 2, links, wait_s=0.003) == 0.012  # nothing sent


def test_break_even_bandwidth_is_where_the_predictions_cross():
    fp32 = {"compute_s": 0.002, "codec_s": 0.0, "collectives": [("all_reduce", 400_000)], "overlap_s": 0.0}
    topk = {"compute_s": 0.002, "codec_s": 0.001, "collectives": [("all_gather", 8_000)], "overlap_s": 0.0}
    b = cm.break_even_bandwidth(topk, fp32, 2, 1e-4)
    # at p = 2: 2 alpha + 400 kB / B = 1 ms + alpha + 8 kB / B, so B = 392 kB / 0.9 ms
    assert b == pytest.approx(392_000 / 0.9e-3 / 1e9, rel=1e-6)
    assert cm.break_even_bandwidth(fp32, fp32 | {"compute_s": 1.0}, 2, 1e-4) == float("inf")
    # nothing sent but 0.1 s of encoding: pays only where 2 alpha + 400 kB / B > 0.1 s
    silent = fp32 | {"codec_s": 0.1, "collectives": []}
    assert cm.break_even_bandwidth(silent, fp32, 2, 1e-4) == pytest.approx(400_000 / (0.1 - 2e-4) / 1e9, rel=1e-6)
    assert cm.break_even_bandwidth(fp32 | {"compute_s": 1.0}, fp32, 2, 1e-4) == 0.0
