import matplotlib.pyplot as plt
import pytest
import torch

from course_lib import lowrank
from course_lib.notebooks.widgets import bandwidth_explorer, hopper_gray, rank_explorer


def _matrices():
    g = torch.Generator().manual_seed(0)
    return {"low": torch.randn(40, 3, generator=g) @ torch.randn(3, 30, generator=g),
            "tall": torch.randn(20, 5, generator=g)}


def test_slider_changes_the_numbers_shown():
    w = rank_explorer(_matrices(), rank=1)
    assert w.rank.description == "rank" and w.rank.min == 1 and w.rank.max == 30
    before = w.text.value
    assert "relative error" in before and "SVD optimum" in before and "compression 17.1x" in before
    w.rank.value = 3
    after = w.text.value
    assert after != before
    assert "rank 3: relative error 0.000" in after  # the matrix has rank 3
    assert "compression 5.7x" in after


def test_dropdown_switches_matrix_and_clips_the_rank():
    w = rank_explorer(_matrices(), rank=20)
    w.matrix.value = "tall"
    assert w.rank.max == 5 and w.rank.value == 5
    assert "rank 5: relative error 0.000" in w.text.value


def _truncated_svd_error(M, r):
    """The best rank-r relative error, another way than lowrank.svd_error: the truncated SVD rebuilt."""
    M = M.double()
    U, s, Vh = torch.linalg.svd(M, full_matrices=False)
    return (torch.linalg.norm(M - U[:, :r] @ torch.diag(s[:r]) @ Vh[:r]) / torch.linalg.norm(M)).item()


def test_numbers_agree_with_lowrank():
    m = _matrices()
    w = rank_explorer(m, rank=2, iters=4, seed=0)
    s = w.numbers()
    M = m["low"].double()
    P, Q = lowrank.power_iteration(M, 2, 4, generator=torch.Generator().manual_seed(0))
    assert abs(s["relative error"] - ((M - P @ Q.T).square().sum() / M.square().sum()).sqrt().item()) < 1e-12
    assert s["svd optimum"] == pytest.approx(_truncated_svd_error(M, 2), abs=1e-9)


def test_hopper_is_bundled_and_grey():
    img = hopper_gray()
    assert img.shape == (600, 512) and 0 <= img.min() and img.max() <= 1


def test_picture_is_redrawn_when_the_rank_moves():
    w = rank_explorer(_matrices(), rank=1)
    first = w.plot.value
    assert first[:4] == b"\x89PNG"
    w.rank.value = 2
    assert w.plot.value != first


def test_the_residual_panel_shows_what_the_error_measures():
    m = _matrices()
    w = rank_explorer(m, rank=2, iters=4, seed=0)
    s = w.numbers()
    M = m["low"].double()
    torch.testing.assert_close(s["residual"], M - s["reconstruction"])
    assert (s["residual"].norm() / M.norm()).item() == pytest.approx(s["relative error"], rel=1e-12)
    fig = w.figure(s)
    try:
        titles = [ax.get_title() for ax in fig.axes]
        assert titles[:3] == ["original M", "P Q^T, rank 2", "residual M - P Q^T, same scale as M\n(norm "
                              f"{s['relative error']:.3f} of M's)"]
        original, _, residual = (ax.get_images()[0] for ax in fig.axes[:3])
        torch.testing.assert_close(torch.as_tensor(residual.get_array().data), s["residual"])
        # on the original's colour scale, so its size against M's shows, with a colour bar saying so
        assert residual.get_clim() == original.get_clim() and residual.get_clim()[0] < 0
        assert residual.colorbar is not None
        assert len(fig.axes) == 5  # the three pictures, the error curve and the colour bar
    finally:
        plt.close(fig)


def test_the_photograph_residual_spans_its_grey_range():
    img = hopper_gray()[::4, ::4]
    w = rank_explorer({"photo in grey": img}, rank=3)
    fig = w.figure()
    try:
        original, _, residual = (ax.get_images()[0] for ax in fig.axes[:3])
        lo, hi = original.get_clim()
        assert (lo, hi) == (img.min().item(), img.max().item())
        assert residual.get_clim() == pytest.approx((-(hi - lo) / 2, (hi - lo) / 2))
    finally:
        plt.close(fig)


def test_bandwidth_slider_changes_predictions():
    hooks = {"all-reduce": {"compute_s": 0.005, "bytes": 6_000_000, "collectives": 1},
             "PowerSGD r=2": {"compute_s": 0.012, "bytes": 45_000, "collectives": 2}}
    w = bandwidth_explorer(hooks, world_size=2, alpha_s=10e-6, busbw=0.125)
    assert w.bandwidth.description == "GB/s"
    slow = w.predictions()
    assert slow["PowerSGD r=2"] < slow["all-reduce"]  # a slow link: compression wins
    before = w.text.value
    assert "speed-up vs all-reduce" in before and "1.00x" in before
    w.bandwidth.value = 100.0
    assert w.text.value != before
    fast = w.predictions()
    assert fast["PowerSGD r=2"] > fast["all-reduce"]  # a fast link: its computation costs more


def test_the_curve_is_the_svd_optimum_at_every_rank():
    m = _matrices()
    w = rank_explorer(m, rank=2)
    ranks, best = w._svd_curve("low")
    assert ranks == list(range(1, 31))
    for r in (1, 2, 3, 10):
        assert best[r - 1] == pytest.approx(_truncated_svd_error(m["low"], r), abs=1e-9)


def test_compression_slider_moves_the_verdict():
    from course_lib.notebooks.widgets import compression_explorer
    fp32 = {"compute_s": 0.002, "codec_s": 0.0, "collectives": [("all_reduce", 400_000)], "overlap_s": 0.0}
    topk = {"compute_s": 0.002, "codec_s": 0.001, "collectives": [("all_gather", 8_000)], "overlap_s": 0.0}
    w = compression_explorer({"fp32 all-reduce": fp32, "top-k": topk}, world_size=2, alpha_s=1e-4, busbw=0.05)
    slow = w.predictions()
    assert slow["top-k"] < slow["fp32 all-reduce"]
    assert "0.436 GB/s" in w.text.value and "pays below" in w.text.value
    before, picture = w.text.value, w.plot.value
    w.bandwidth.value = 10.0
    fast = w.predictions()
    assert fast["top-k"] > fast["fp32 all-reduce"] and w.text.value != before and w.plot.value != picture
    with pytest.raises(ValueError, match="reference"):
        compression_explorer({"top-k": topk}, world_size=2, alpha_s=1e-4)


# The ZeRO memory calculator (notebook 05)

def _calculator(**kwargs):
    from course_lib.notebooks.widgets import memory_calculator
    return memory_calculator(**kwargs)


def _total_gb_shown(w):
    """The total row's GB cell, as the student reads it."""
    import re
    return re.search(r"<b>total</b>.*?<b>([\d.]+)</b></td></tr></table>", w.text.value).group(1)


def test_memory_calculator_shows_the_bytes_of_each_category():
    from course_lib import sharding
    w = _calculator(n_params=1_234_567, world_size=4, stage=1, optimizer="adam", precision="fp32", tensors=6,
                    activation_bytes=3_000_000)
    assert w.text.value.startswith("<b>bytes per rank</b>")
    ledger = w.ledger()
    # worked out by hand: fp32 parameters and gradients whole, Adam's m and v for a quarter (rounded up)
    # of the parameters, six 4-byte step counters
    assert ledger == {"parameters": 4 * 1_234_567, "gradients": 4 * 1_234_567,
                      "optimizer state": 8 * 308_642 + 24, "activations": 3_000_000,
                      "total": 8 * 1_234_567 + 8 * 308_642 + 24 + 3_000_000}
    assert ledger == sharding.bytes_per_rank(1_234_567, 1, 4, "adam", "fp32", 6, 3_000_000)
    for name, value in ledger.items():
        assert f"{value:,}" in w.text.value, name
    assert "6 tensors" in w.text.value and "K = 8" in w.text.value
    assert w.tensors == 6 and w.settings()["n_params"] == 1_234_567


def test_moving_each_memory_control_changes_the_numbers_shown():
    from course_lib import sharding
    w = _calculator(n_params=10**6, world_size=2, stage=0, optimizer="adam", precision="fp32", tensors=4)
    expected = dict(n_params=10**6, stage=0, world_size=2, optimizer="adam", precision="fp32", tensors=4,
                    activation_bytes=0)
    moves = [(w.stage, 3, "stage", 3), (w.world_size, 16, "world_size", 16), (w.model_size, 1e9, "n_params", 10**9),
             (w.optimizer, "momentum", "optimizer", "momentum"), (w.precision, "mixed", "precision", "mixed"),
             (w.activations, 50.0, "activation_bytes", 50_000_000), (w.stage, 2, "stage", 2)]
    for control, value, key, meant in moves:
        text, picture, ledger = w.text.value, w.plot.value, w.ledger()
        control.value = value
        expected[key] = meant
        assert w.settings() == expected, key
        assert w.ledger() == sharding.bytes_per_rank(**expected), key
        # (mixed precision moves bytes from the parameters and gradients to the optimizer's master copy:
        # the total of model states stays 16 bytes a parameter with Adam, as the ZeRO paper counts)
        assert w.ledger() != ledger and w.text.value != text and w.plot.value != picture, key
        assert all(f"<td>{name}</td><td style='text-align:right'>{n:,}</td>" in w.text.value
                   for name, n in w.ledger().items() if name != "total"), key


def test_memory_calculator_reproduces_the_zero_papers_figure_1():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, mixed-precision Adam (K = 12), 64 GPUs:
    # 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per GPU for the baseline (DDP) and the three stages
    w = _calculator(n_params=1000)
    w.model_size.value = 7.5e9
    w.world_size.value = 64
    w.precision.value = "mixed"
    w.optimizer.value = "adam"
    assert "K = 12" in w.text.value
    paper = ["120.0", "31.4", "16.6", "1.9"]
    totals = []
    for stage, gb in enumerate(paper):
        w.stage.value = stage
        totals.append(w.ledger()["total"])
        assert abs(totals[-1] / 1e9 - float(gb)) <= 0.05, stage
        assert _total_gb_shown(w) == gb, stage
    assert totals == [16 * 7_500_000_000, 4 * 7_500_000_000 + 12 * 117_187_500, 2 * 7_500_000_000 + 14 * 117_187_500,
                      16 * 117_187_500]
    assert totals[0] > totals[1] > totals[2] > totals[3]  # each stage shards one more category


def test_memory_calculator_keeps_the_exact_counts_until_moved():
    w = _calculator(n_params=123_456_789, world_size=3, stage=3, activation_bytes=7_654_321)
    assert w.model_size.value == 123_456_789 and w.world_size.value == 3
    assert w.ledger()["parameters"] == 4 * 41_152_263 and w.ledger()["activations"] == 7_654_321
    w.model_size.value = 2e5
    w.activations.value = 1.5
    assert w.settings()["n_params"] == 200_000 and w.ledger()["activations"] == 1_500_000


def test_memory_calculator_picture_stacks_each_stage():
    w = _calculator(n_params=5_000_000, world_size=8, stage=2, optimizer="adam", precision="mixed",
                    activation_bytes=10_000_000)
    fig = w.figure()
    try:
        ax = fig.axes[0]
        assert ax.get_xlabel() == "memory per rank (MB)"
        assert "5 million parameters" in ax.get_title() and "8 ranks" in ax.get_title()
        for name, bars in zip(["parameters", "gradients", "optimizer state", "activations"], ax.containers):
            assert bars.get_label() == name
            for stage, bar in enumerate(bars):
                assert bar.get_width() * 1e6 == pytest.approx(w.ledger(stage)[name]), (name, stage)
        outline = ax.containers[4][0]  # the chosen stage, outlined
        assert outline.get_y() == ax.containers[0][2].get_y() and not outline.get_fill()
        assert [t.get_text() for t in ax.texts] == [f" {w.ledger(s)['total'] / 1e6:.1f} MB" for s in range(4)]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_params=0), "n_params"), (dict(n_params=10**13), "n_params"), (dict(n_params=1.5e9), "n_params"),
    (dict(n_params=10**6, world_size=0), "world_size"), (dict(n_params=10**6, world_size=2048), "world_size"),
    (dict(n_params=10**6, stage=4), "stage"), (dict(n_params=10**6, optimizer="lamb"), "optimizer"),
    (dict(n_params=10**6, precision="bf16"), "precision"), (dict(n_params=10**6, tensors=-1), "tensors"),
    (dict(n_params=10**6, activation_bytes=-1), "activation_bytes"),
])
def test_memory_calculator_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _calculator(**kwargs)


# The period explorer (notebook 11): local SGD all-reduces once every H steps

_LOCAL = dict(compute_s=0.02, nbytes=44_000_000, world_size=8, alpha_s=1e-5)
_DDP = {"compute_s": 0.02, "codec_s": 0.0, "collectives": [("all_reduce", 44_000_000)], "overlap_s": 0.0}
_TOPK = {"compute_s": 0.02, "codec_s": 0.004, "collectives": [("all_gather", 440_000)]}


def _periods(**kwargs):
    from course_lib.notebooks.widgets import period_explorer
    return period_explorer(**{**_LOCAL, "references": {"fp32 all-reduce (DDP)": _DDP, "top-k 1%": _TOPK,
                                                       "measured, 50 ms": 0.05}, **kwargs})


def _row(w, name):
    """A reference's row of the table, as the student reads it: its five cells."""
    import re
    return re.search(rf"<tr><td>{re.escape(name)}</td>" + "<td>([^<]*)</td>" * 4 + "</tr>", w.text.value).groups()


def test_period_explorer_shows_the_cost_models_numbers():
    from course_lib.costmodel import (
        break_even_period,
        periodic_step_time,
        predict_compressed_step_time,
        ring_all_reduce_time,
    )
    w = _periods(busbw=0.5, period=16, compute_label="one GPU's")
    assert "GB/s" in w.bandwidth.description and w.period.description == "period H (steps)"
    assert (w.bandwidth.min, w.bandwidth.max) == (-2, 3) and (w.period.options[0], w.period.options[-1]) == (1, 1024)
    assert w.text.value.startswith("<b>communicate every 16 steps</b>")
    assert "0.5 GB/s (4 Gbit/s)" in w.text.value and "computation: one GPU's" in w.text.value
    p = w.predictions()
    local = periodic_step_time(0.02, 44_000_000, 16, 8, 1e-5, 0.5)
    assert p["busbw_GBps"] == 0.5 and p["period"] == 16 and p["local_sgd_s"] == local
    assert p["all_reduce_s"] == ring_all_reduce_time(44_000_000, 8, 1e-5, 0.5)
    links = {"all_reduce": (1e-5, 0.5), "all_gather": (1e-5, 0.5)}
    steps = {"fp32 all-reduce (DDP)": predict_compressed_step_time(world_size=8, links=links, **_DDP),
             "top-k 1%": predict_compressed_step_time(world_size=8, links=links, **_TOPK), "measured, 50 ms": 0.05}
    for name, step in steps.items():
        r = p["references"][name]
        assert r["step_s"] == step and r["speed_up"] == step / local, name
        assert r["break_even_period"] == break_even_period(0.02, 44_000_000, step, 8, 1e-5, 0.5), name
        assert _row(w, name) == (f"{step * 1e3:,.3f} ms", f"{local * 1e3:,.3f} ms", f"{step / local:.2f}x",
                                 str(int(r["break_even_period"]))), name
    # at another bandwidth and period without moving the sliders
    assert w.predictions(busbw=10.0, period=3)["local_sgd_s"] == periodic_step_time(0.02, 44_000_000, 3, 8, 1e-5, 10.0)
    w.bandwidth.value = 1000.0  # whole numbers from 100 GB/s up, not 1e+03
    assert "bus bandwidth 1000 GB/s (8000 Gbit/s)" in w.text.value and "1000 GB/s" in w.figure().axes[0].get_title()
    plt.close("all")


def test_moving_each_period_control_changes_the_text_and_picture():
    w = _periods(busbw=1.25, period=8)
    moves = [(w.period, 64, "period"), (w.bandwidth, 12.5, "busbw_GBps"), (w.period, 2, "period"),
             (w.bandwidth, 0.05, "busbw_GBps")]
    for control, value, key in moves:
        text, picture, before = w.text.value, w.plot.value, w.predictions()
        control.value = value
        after = w.predictions()
        assert after[key] == value and w.text.value != text and w.plot.value != picture, key
        assert w.text.value.startswith(f"<b>communicate every {after['period']} steps</b>"), key
        assert f"{after['local_sgd_s'] * 1e3:,.3f} ms" in w.text.value, key
        # a longer period, or a faster link, gives a shorter local SGD step; and the other way round
        grows = (value > before[key])
        assert (after["local_sgd_s"] < before["local_sgd_s"]) == grows, key
        if key == "busbw_GBps":  # the per-step references move with the link too; the measured one does not
            assert (after["references"]["top-k 1%"]["step_s"] < before["references"]["top-k 1%"]["step_s"]) == grows
            assert after["references"]["measured, 50 ms"]["step_s"] == 0.05


@pytest.mark.parametrize("busbw", [0.01, 0.037, 0.125, 0.5, 1.25, 3.3, 12.5, 47.0, 100.0, 370.0, 1000.0])
def test_the_break_even_period_shown_is_the_smallest_that_beats_the_reference(busbw):
    from course_lib.costmodel import periodic_step_time
    w = _periods(busbw=busbw)
    for name, r in w.predictions()["references"].items():
        shown = _row(w, name)[3]
        if shown == "never":
            assert r["step_s"] <= 0.02, name
            continue
        h = int(shown)
        assert h == r["break_even_period"], name
        # H steps faster than the reference; H - 1 does not (at H - 1 = 0 there is nothing to check)
        assert periodic_step_time(0.02, 44_000_000, h, 8, 1e-5, busbw) < r["step_s"], (name, h)
        assert h == 1 or periodic_step_time(0.02, 44_000_000, h - 1, 8, 1e-5, busbw) >= r["step_s"], (name, h)


def test_plain_averaging_every_step_is_no_faster_than_ddp():
    # H = 1 is DDP's own all-reduce each step: equal, not faster, so the first period that beats it is 2
    w = _periods(busbw=1.25, period=1)
    p = w.predictions()
    assert p["local_sgd_s"] == p["references"]["fp32 all-reduce (DDP)"]["step_s"]
    assert _row(w, "fp32 all-reduce (DDP)")[2:] == ("1.00x", "2")
    assert w.text.value.startswith("<b>communicate every 1 step</b>")


def test_a_reference_no_slower_than_computing_alone_is_never_beaten():
    from course_lib.notebooks.widgets import period_explorer
    no_comm = {"compute_s": 0.02, "codec_s": 0.0, "collectives": []}  # computation alone: equal at best
    w = period_explorer(**_LOCAL, references={"no communication": no_comm, "a faster GPU": 0.015,
                                              "fp32 all-reduce (DDP)": _DDP}, busbw=0.01, period=1024)
    p = w.predictions()
    for name in ("no communication", "a faster GPU"):
        assert p["references"][name]["break_even_period"] == float("inf"), name
        assert _row(w, name)[3] == "never", name
        assert p["local_sgd_s"] > p["references"][name]["step_s"], name
    assert _row(w, "fp32 all-reduce (DDP)")[3] == "2"
    fig = w.figure()
    try:
        labels = [line.get_label() for line in fig.axes[0].get_lines()]
        assert "no communication (never overtaken)" in labels and "fp32 all-reduce (DDP) (overtaken at H = 2)" in labels
    finally:
        plt.close(fig)


def test_period_explorer_picture_is_the_curve_and_the_references():
    from course_lib.costmodel import periodic_step_time
    w = _periods(busbw=0.05, period=32)
    p = w.predictions()
    fig = w.figure()
    try:
        ax = fig.axes[0]
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log" and ax.get_xlim() == (1, 1024)
        assert ax.get_xlabel().startswith("period H (steps") and ax.get_ylabel().startswith("predicted step time (ms")
        assert "0.05 GB/s" in ax.get_title()
        lines = {line.get_label(): line for line in ax.get_lines()}
        curve = lines["local SGD (all-reduce every H steps)"]
        assert list(curve.get_xdata()) == list(range(1, 1025))
        assert list(curve.get_ydata()) == pytest.approx(
            [periodic_step_time(0.02, 44_000_000, h, 8, 1e-5, 0.05) * 1e3 for h in range(1, 1025)])
        for name, r in p["references"].items():
            flat = lines[f"{name} (overtaken at H = {int(r['break_even_period'])})"]
            assert list(flat.get_ydata()) == pytest.approx([r["step_s"] * 1e3] * 2), name
        marked = lines[f"H = 32: {p['local_sgd_s'] * 1e3:,.3f} ms a step"]
        assert (list(marked.get_xdata()), list(marked.get_ydata())) == ([32], [pytest.approx(p["local_sgd_s"] * 1e3)])
    finally:
        plt.close(fig)


@pytest.mark.parametrize("kwargs, message", [
    (dict(compute_s=0.0), "compute_s"), (dict(compute_s=float("nan")), "compute_s"), (dict(nbytes=-1), "nbytes"),
    (dict(world_size=0), "world_size"), (dict(world_size=2.0), "world_size"), (dict(alpha_s=-1e-6), "alpha_s"),
    (dict(busbw=0.001), "busbw"), (dict(busbw=2000.0), "busbw"), (dict(period=0), "period"),
    (dict(period=2048), "period"), (dict(period=8.0), "period"), (dict(references={}), "references"),
    (dict(references={"x": -0.01}), r"references\['x'\]"), (dict(references={"x": {"compute_s": 0.02}}), "codec_s"),
    (dict(references={"x": {**_DDP, "busbw": 1.0}}), "busbw"),
    (dict(references={"x": {**_DDP, "collectives": [("broadcast", 10)]}}), "all_gather"),
    (dict(references={"x": {**_DDP, "codec_s": -1.0}}), r"references\['x'\]: codec_s"),
    (dict(compute_label=3), "compute_label"),
])
def test_period_explorer_rejects_bad_arguments(kwargs, message):
    from course_lib.notebooks.widgets import period_explorer
    args = {**_LOCAL, "references": {"fp32 all-reduce (DDP)": _DDP}, **kwargs}
    with pytest.raises(ValueError, match=message):
        period_explorer(**args)
