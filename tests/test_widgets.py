import matplotlib.pyplot as plt
import pytest
import torch

from course_lib import lowrank
from course_lib.support.widgets import bandwidth_explorer, hopper_gray, rank_explorer


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
    from course_lib.support.widgets import compression_explorer
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
