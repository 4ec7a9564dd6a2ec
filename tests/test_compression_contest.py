"""The committed compression contest (benchmarks/results/compression_contest.json): every method had the
same budget, each chosen setting (momentum and learning rate) is its sweep's best on the validation
split, the reported accuracies are the fresh seeds' on the test split, one run reproduces its row, and
notebooks 09 and 10 use it."""

import json
import statistics
from pathlib import Path

import pytest

from course_lib import costmodel
from course_lib.launch import spawn
from course_lib.train import train_several
from tests import benchmark_scripts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = benchmark_scripts.results("compression_contest")


def _benchmark():
    return benchmark_scripts.load("compression_contest")


def test_each_chosen_rate_is_the_best_of_its_sweep_on_validation():
    bench = _benchmark()
    assert list(RESULTS["methods"]) == list(bench.METHODS)
    assert RESULTS["choose_seeds"] == list(bench.CHOOSE_SEEDS) and RESULTS["report_seeds"] == list(bench.REPORT_SEEDS)
    assert not set(bench.CHOOSE_SEEDS) & set(bench.REPORT_SEEDS), "the reported seeds must be fresh"
    assert RESULTS["base"]["validation_fraction"] > 0, "settings must be chosen on a validation split"
    for name, row in RESULTS["methods"].items():
        assert row["config"] == bench.METHODS[name][1], f"{name}: the committed table is of another variant"
        grid = {(m, lr) for m, lrs in bench.METHODS[name][2].items() for lr in lrs}
        assert {(r["momentum"], r["lr"]) for r in row["sweep"].values()} == grid, f"{name}: another grid"
        finite = {(r["momentum"], r["lr"]): statistics.mean(r["validation"])
                  for r in row["sweep"].values() if not r["diverged"]}
        if not finite:
            assert row["diverged"] and row["best_lr"] is None
            continue
        assert (row["best_momentum"], row["best_lr"]) == max(finite, key=finite.get), name
        assert row["run"] == bench.fields(name, row["best_momentum"], row["best_lr"]), name
        assert len(row["test"]) == len(bench.REPORT_SEEDS), name
        assert row["accuracy_mean"] == pytest.approx(statistics.mean(row["test"]), abs=0.01), name


def test_every_method_had_the_same_budget():
    """Seven settings each, momentum 0.9 and 0 (DGC's in its hook), "no communication" included."""
    bench = _benchmark()
    assert "no communication" in bench.METHODS
    for name, (_, _, grid) in bench.METHODS.items():
        assert sorted(grid) == [0.0, 0.9] and [len(grid[0.9]), len(grid[0.0])] == [3, 4], name
    dgc = bench.config("DGC 0.1%", 0.1, 0, 0.9)
    assert (dgc.dgc_momentum, dgc.momentum) == (0.9, 0.0)


def test_the_choice_refuses_a_rate_where_a_seed_diverged():
    bench = _benchmark()
    sweep = {"0.1": {"validation": [90.0, 91.0], "diverged": False},
             "0.3": {"validation": [97.0, 97.0], "diverged": True}}
    assert bench.choose(sweep) == "0.1"
    assert bench.choose({"0.3": sweep["0.3"]}) is None


def test_one_run_reproduces_its_committed_row():
    """QSGD 4-bit at its chosen rate: seed 0's validation accuracy in the sweep, the first reported
    seed's test accuracy, and the exact bytes of the committed row."""
    bench = _benchmark()
    row = RESULTS["methods"]["QSGD 4-bit"]
    m, lr = row["best_momentum"], row["best_lr"]
    configs = [bench.config("QSGD 4-bit", lr, seed, m) for seed in (bench.CHOOSE_SEEDS[0], bench.REPORT_SEEDS[0])]
    chose, reported = spawn(train_several, 2, configs, backend="gloo", timeout_s=120)[0]
    assert abs(bench.accuracy(chose, "validation") - row["sweep"][bench.key(m, lr)]["validation"][0]) < 2.0
    assert abs(bench.accuracy(reported) - row["test"][0]) < 2.0, (bench.accuracy(reported), row["test"][0])
    assert reported.bytes[-1] / configs[1].steps == pytest.approx(row["bytes_per_step"], abs=0.1)


def test_notebook_10_trains_each_method_at_its_chosen_rate():
    nb = json.loads((ROOT / "notebooks" / "10_does_compression_pay.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "compression_contest.json" in code and '**row["run"]' in code and '"report_seeds"' in code


def test_time_to_accuracy_break_even_against_a_direct_formula():
    # alpha = 0, two ranks: an all-reduce of N bytes takes N / B seconds (bus factor 1 at p = 2)
    method = {"compute_s": 1e-3, "codec_s": 1e-3, "collectives": [("all_reduce", 1e5)]}
    reference = {"compute_s": 1e-3, "codec_s": 0.0, "collectives": [("all_reduce", 1e6)]}
    # per step: 2e-3 + 1e5/B  vs  1e-3 + 1e6/B: equal at B = 9e5 / 1e-3 = 0.9 GB/s
    assert costmodel.break_even_bandwidth(method, reference, 2, 0.0) == pytest.approx(0.9, rel=1e-6)
    # twice the steps: 2 (2e-3 + 1e5/B) = 1e-3 + 1e6/B  ->  B = 8e5 / 3e-3 bytes/s
    assert costmodel.break_even_bandwidth(method, reference, 2, 0.0, 2.0, 1.0) == pytest.approx(8e5 / 3e-3 / 1e9,
                                                                                                 rel=1e-6)


def test_a_rerun_replaces_only_its_own_rows():
    bench = _benchmark()
    committed = {"base": {"hidden": 256}, "machine": {"processor": "before"},
                 "methods": {name: {"by": "before"} for name in bench.METHODS}}
    rerun = {"base": {"hidden": 256}, "machine": {"processor": "after"}, "methods": {"DGC 0.1%": {"by": "rerun"}}}
    out = bench.merge(committed, rerun)
    assert list(out["methods"]) == list(bench.METHODS)
    assert [row["by"] for row in out["methods"].values()].count("rerun") == 1
    assert out["methods"]["DGC 0.1%"]["by"] == "rerun" and out["machine"]["processor"] == "before"
    assert out["machine"]["rerun"]["DGC 0.1%"]["processor"] == "after"
    assert committed["methods"]["DGC 0.1%"]["by"] == "before"  # the committed table itself is left as it was
    with pytest.raises(ValueError, match="base configuration"):
        bench.merge(committed, {**rerun, "base": {"hidden": 64}})
    with pytest.raises(ValueError, match="cannot merge"):
        bench.merge(committed, {**rerun, "methods": {"a method of another script": {}}})
