"""benchmarks/throttled_links.py: its committed results follow from what they record, its model shares one
filter among the ranks, and where it cannot make a namespace it says so in one line and exits 2."""

import math
import os
import subprocess
import sys

import pytest

from course_lib.notebooks import throttled_links as reader
from tests import benchmark_scripts

RESULTS = benchmark_scripts.results("throttled_links")


def _benchmark():
    return benchmark_scripts.load("throttled_links")


def test_the_file_covers_three_rates_and_every_contest_method():
    bench = _benchmark()
    assert len(RESULTS["settings"]["rates_gbit"]) >= 3
    assert {k: v for k, v in RESULTS["settings"].items() if k not in ("rates_gbit", "repeats")} == \
        {k: v for k, v in bench.settings().items() if k != "rates_gbit"}
    assert list(RESULTS["methods"]) == list(bench.configs())
    keys = ["unthrottled"] + [bench.rate_key(g) for g in RESULTS["settings"]["rates_gbit"]]
    for name, m in RESULTS["methods"].items():
        assert list(m["measured"]) == list(m["predicted"]) == keys, name
        for k in keys:
            t = m["measured"][k]
            assert t["min_s"] <= t["median_s"] <= t["max_s"], (name, k)


def test_each_prediction_is_the_model_on_the_recorded_fit_and_each_ratio_its_quotient():
    bench = _benchmark()
    for name, m in RESULTS["methods"].items():
        for k, predicted in m["predicted"].items():
            gbit = None if k == "unthrottled" else float(k.split()[0])
            assert bench.predict(m["model"], RESULTS["fit"], gbit) == pytest.approx(predicted, rel=1e-9), (name, k)
            assert m["ratio"][k] == pytest.approx(predicted / m["measured"][k]["median_s"], rel=1e-9)


def test_the_second_prediction_is_the_model_with_its_measured_terms_and_the_bucket():
    bench = _benchmark()
    for name, m in RESULTS["methods"].items():
        assert m["model"]["unthrottled_s"] == m["measured"]["unthrottled"]["median_s"], name
        for k, predicted in m["predicted_with_measured_terms"].items():
            gbit = None if k == "unthrottled" else float(k.split()[0])
            assert bench.predict_measured_terms(m["model"], RESULTS["fit"], gbit) == pytest.approx(predicted, rel=1e-9)
            assert m["ratio_with_measured_terms"][k] == pytest.approx(predicted / m["measured"][k]["median_s"])
    for name, refs in RESULTS["break_even"].items():
        for ref, b in refs.items():
            assert b["predicted_with_measured_terms_gbit"] == pytest.approx(bench.break_even_gbit(
                RESULTS["methods"][name]["model"], RESULTS["methods"][ref]["model"], RESULTS["fit"]), rel=1e-9)


def test_the_token_bucket_against_a_hand_computation():
    bench = _benchmark()
    assert bench.WORLD_SIZE == 2
    fit = {"all_reduce": (0.0, 1.0), "all_gather": (0.0, 0.5)}  # GB/s
    method = {"collectives": [("all_reduce", 1e6)]}  # each rank sends 2(p-1)/p x 1e6 = 1e6 bytes, the filter 2e6
    assert bench.bucket_link_s(method, fit, None, 0.0) == pytest.approx(1e-3)  # 1e6 B at 1 GB/s
    # 8 Gbit/s = 1e9 B/s; 1e-4 s off the link refills 1e5 B: 1e5 of 2e6 at the loopback's speed, the rest at R
    assert bench.bucket_link_s(method, fit, 8.0, 1e-4) == pytest.approx(1e-3 * 1e5 / 2e6 + 1.9e6 / 1e9)
    # a long pause fills the bucket only up to its burst
    assert bench.bucket_link_s(method, fit, 8.0, 1.0) == pytest.approx(
        1e-3 * bench.BURST_BYTES / 2e6 + (2e6 - bench.BURST_BYTES) / 1e9)
    # traffic within the tokens is not throttled at all; an all-gather sends (p - 1) n per rank
    small = {"collectives": [("all_gather", 1e4)]}
    assert bench.bucket_link_s(small, fit, 0.1, 1.0) == bench.bucket_link_s(small, fit, None, 0.0) == \
        pytest.approx(1e4 / 0.5e9)
    assert bench.bucket_link_s({"collectives": []}, fit, 0.1, 0.0) == 0.0


def test_the_break_even_with_the_measured_terms_is_where_the_two_predictions_cross():
    bench = _benchmark()
    fit = {"all_reduce": (0.0, 1.0), "all_gather": (0.0, 1.0)}
    fast_big = {"collectives": [("all_reduce", 1e7)], "unthrottled_s": 0.011}  # 10 ms of bytes unthrottled
    slow_small = {"collectives": [("all_reduce", 1e4)], "unthrottled_s": 0.020}
    b = bench.break_even_gbit(slow_small, fast_big, fit)
    assert 1e-3 < b < 1e3
    for gbit, sign in ((b / 1.01, -1), (b * 1.01, 1)):
        gap = (bench.predict_measured_terms(slow_small, fit, gbit) - bench.predict_measured_terms(fast_big, fit, gbit))
        assert math.copysign(1, gap) == sign
    assert bench.break_even_gbit(fast_big, fast_big, fit) == 0.0  # never faster than itself
    assert bench.break_even_gbit(dict(slow_small, unthrottled_s=0.001), fast_big, fit) == math.inf


def test_each_measured_break_even_is_where_the_measured_times_cross():
    bench = _benchmark()
    rates = RESULTS["settings"]["rates_gbit"]
    for name, refs in RESULTS["break_even"].items():
        for ref, b in refs.items():
            gaps = [RESULTS["methods"][name]["measured"][bench.rate_key(g)]["median_s"]
                    - RESULTS["methods"][ref]["measured"][bench.rate_key(g)]["median_s"] for g in rates]
            assert b["measured_gbit"] == bench.crossing(rates, gaps), (name, ref)


def test_the_ranks_share_one_filter_and_a_crossing_is_interpolated_in_log_rate():
    bench = _benchmark()
    fit = {"all_reduce": (1e-4, 2.0), "all_gather": (2e-4, 0.7)}
    assert bench.link(fit, None) == fit
    assert bench.link(fit, 1.0) == {"all_reduce": (1e-4, 1.0 / 8 / bench.WORLD_SIZE),
                                    "all_gather": (2e-4, 1.0 / 8 / bench.WORLD_SIZE)}
    assert bench.link(fit, 100.0)["all_reduce"] == (1e-4, 2.0)  # faster than the loopback: the loopback's
    assert bench.crossing([0.1, 1.0, 10.0], [-1.0, -0.5, 0.5]) == pytest.approx(math.sqrt(10))
    assert bench.crossing([0.1, 1.0], [0.5, 1.0]) is None and bench.crossing([0.1, 1.0], [-1.0, -0.5]) is None


def test_without_namespaces_it_says_so_in_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no ip, no tc
    done = subprocess.run([sys.executable, str(benchmark_scripts.ROOT / "benchmarks" / "throttled_links.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    assert "ip, tc" in done.stderr and "throttled_links.json" in done.stderr


def test_the_notebooks_reader_shows_what_the_file_records(capsys):
    r = reader.load()
    assert reader.rates(r) == [f"{g:g} Gbit/s" for g in r["settings"]["rates_gbit"]] + ["unthrottled"]
    for k in reader.rates(r):
        for prediction, field in (("model", "predicted"), ("with measured terms", "predicted_with_measured_terms")):
            direct = [abs(m[field][k] / m["measured"][k]["median_s"] - 1) for m in r["methods"].values()]
            assert reader.mean_error(r, k, prediction) == pytest.approx(sum(direct) / len(direct))
    reader.print_steps(r)
    reader.print_break_evens(r)
    out = capsys.readouterr().out
    assert all(name in out for name in r["methods"])
    with pytest.raises(FileNotFoundError, match="throttled_links.py"):
        reader.load(benchmark_scripts.ROOT / "no such file.json")
