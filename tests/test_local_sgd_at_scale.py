"""The committed local-SGD bench (benchmarks/local_sgd_at_scale.json): made with the script's settings,
each chosen setting the best of its sweep on the validation split, post-local SGD swept over the SGD
grid and the switch, the reported numbers their seeds' mean, and one run reproduces its row."""

import dataclasses
import json
import statistics

import pytest

from course_lib.simulated import simulate
from course_lib.train import train_several
from tests import benchmark_scripts

RESULTS = benchmark_scripts.results("local_sgd_at_scale")


def _benchmark():
    return benchmark_scripts.load("local_sgd_at_scale")


def test_the_file_was_made_with_the_scripts_settings():
    bench = _benchmark()
    assert RESULTS["settings"] == json.loads(json.dumps(bench.settings()))
    assert list(RESULTS["splits"]) == list(bench.SPLITS)
    for cells in RESULTS["splits"].values():
        assert list(cells) == [name for name, _, _ in bench.cells_to_run()]


def test_each_chosen_setting_is_the_validation_best_and_the_test_its_fresh_seeds():
    bench = _benchmark()
    for split, cells in RESULTS["splits"].items():
        for (name, fields, settings), cell in zip(bench.cells_to_run(), cells.values()):
            where = f"{split} {name}"
            assert cell["config"] == fields, where
            assert [row["setting"] for row in cell["sweep"].values()] == json.loads(json.dumps(settings)), where
            assert all(len(row["validation"]) == len(bench.CHOOSE_SEEDS) for row in cell["sweep"].values()), where
            assert cell["chosen"] == bench.choose(cell["sweep"]), where
            if cell["chosen"] is not None:
                assert len(cell["test"]) == len(bench.REPORT_SEEDS), where
                assert cell["test_mean"] == pytest.approx(statistics.mean(cell["test"]), abs=0.006), where


def test_the_bytes_are_one_all_reduce_of_the_parameters_per_period():
    ddp = RESULTS["splits"]["iid"]["DDP"]["bytes_per_step"]
    assert RESULTS["splits"]["iid"]["no communication"]["bytes_per_step"] == 0
    for period in _benchmark().PERIODS:
        for name in ("local SGD", "DiLoCo", "local AdamW (plain average)"):
            assert RESULTS["splits"]["iid"][f"{name}, H={period}"]["bytes_per_step"] == pytest.approx(ddp / period)


def test_one_run_reproduces_its_committed_row():
    """Local SGD at H = 16 on the non-iid shards, its chosen setting, the first reported seed: the test
    accuracy within 2 points (other CPUs round differently) and the exact bytes."""
    bench = _benchmark()
    cell = RESULTS["splits"]["non-iid"]["local SGD, H=16"]
    config = dataclasses.replace(bench.BASE, **bench.SPLITS["non-iid"], **cell["config"],
                                 **cell["sweep"][cell["chosen"]]["setting"], seed=bench.REPORT_SEEDS[0])
    out = simulate(train_several, bench.WORLD_SIZE, [config])[0][0]
    assert abs(bench.accuracy(out, "test") - cell["test"][0]) < 2.0, (bench.accuracy(out, "test"), cell["test"][0])
    assert out.bytes[-1] / config.steps == pytest.approx(cell["bytes_per_step"], abs=0.1)
