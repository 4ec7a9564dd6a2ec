"""Local SGD, post-local SGD and DiLoCo against the period H: 8 workers, iid and non-iid, chosen on validation.

Notebook 11 used to answer this with 2 workers on iid halves of each batch, 256 steps, every method at
a learning rate tuned at H = 16 on the test images, DiLoCo's outer step untuned, and 1 to 4 outer
steps at H >= 64. This script asks the same question on notebook 10's bench (``contest_at_scale.py``): 8 workers
(``course_lib.simulated``; ``course_lib.train``'s ``averaging`` runs, checked against notebook 11's
loop in tests/test_local_sgd.py), the digits MLP (hidden 64), a global batch of 128 (16 a worker),
iid shares or non-iid shards (Dirichlet(0.5) per class), 480 steps, so that H = 4, 8 and 16 average
120, 60 and 30 times; and every method tuned at every H on its own:

* "no communication" (each worker alone) and "DDP" (SGD; the gradients all-reduced every step): SGD
  with momentum 0 and 0.9 at three learning rates each (the same effective steps lr / (1 - momentum)
  0.3-3 as the contest); "DDP, AdamW": AdamW at three learning rates, DiLoCo's inner optimizer.
* "local SGD": the same SGD grid as DDP, the parameters averaged after every H steps.
* "post-local SGD" (Lin et al. 2020): DDP until the switch, local SGD after; the same SGD grid as
  DDP's, crossed with the switch: after 1/8, 1/4 or 1/2 of the steps (18 settings, at least as many
  as any other method's, so that its verdict is not a smaller arm's).
* "DiLoCo" (Douillard et al. 2023): AdamW inside at its three learning rates, crossed with the outer
  Nesterov step's learning rate 0.3, 0.7 (the paper's) or 1.0, momentum 0.9 (the paper's): nine
  settings, three for each optimizer's rate.
* "local AdamW (plain average)": DiLoCo's control, its outer step lr 1 without momentum, which sets
  the shared parameters to the ranks' mean: local SGD with AdamW inside, at AdamW's three rates.

Each setting runs with seeds 0 and 1 and is scored on the validation split (20% of the training
images); the best setting where no seed diverged is run with seeds 10, 11 and 12 and scored on the
test split (449 images, which chose nothing). Accuracy is the mean of the last three evaluations (steps
440, 460 and 480) of the ranks' mean model (rank 0's own model for "no communication").

Writes benchmarks/results/local_sgd_at_scale.json (committed) once both splits are done, with the
settings (``tests/test_local_sgd_at_scale.py`` checks the file against them), each sweep, the chosen
setting, the test accuracy of each reported seed and the bytes each worker hands to all-reduces per
step. Work done so far is kept in ``local_sgd_at_scale.<split>.partial.json`` beside it, so an
interrupted run goes on where it stopped, and the two splits can run at once in two processes.

    .venv/bin/python benchmarks/local_sgd_at_scale.py --split iid        # about 25 minutes on one core
    .venv/bin/python benchmarks/local_sgd_at_scale.py --split non-iid
"""

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from course_lib.simulated import simulate
from course_lib.train import TrainConfig, train_several

sys.path.insert(0, str(Path(__file__).parent))
from contest_at_scale import CHOOSE_SEEDS, GRID, REPORT_SEEDS, SPLITS, accuracy, choose  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "local_sgd_at_scale.json"
WORLD_SIZE = 8
BASE = TrainConfig(hidden=64, steps=480, batch_size=128, eval_every=20, validation_fraction=0.2)
PERIODS = (4, 8, 16)
SGD = [{"momentum": m, "lr": lr} for m, lrs in GRID.items() for lr in lrs]
ADAMW = [{"optimizer": "adamw", "lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
OUTER_LRS = (0.3, 0.7, 1.0)
SWITCHES = (BASE.steps // 8, BASE.steps // 4, BASE.steps // 2)

# name: (variant, the fields that differ from BASE, the settings swept)
EVERY_STEP = {
    "no communication": ("each worker alone (the noop hook), SGD", {"hook": "noop"}, SGD),
    "DDP": ("the gradients' fp32 all-reduce every step, SGD", {}, SGD),
    "DDP, AdamW": ("the gradients' fp32 all-reduce every step, AdamW", {}, ADAMW),
}
PERIODIC = {
    "local SGD": ("SGD on each worker, the parameters averaged every H steps", {"averaging": "local"}, SGD),
    "post-local SGD": ("DDP until the switch, then local SGD (the SGD grid crossed with the switch)",
                       {"averaging": "local"}, [{**s, "local_sgd_start": switch} for s in SGD for switch in SWITCHES]),
    "DiLoCo": ("AdamW inside; every H steps, Nesterov (momentum 0.9) on the mean pseudo-gradient",
               {"averaging": "diloco", "outer_momentum": 0.9},
               [{**inner, "outer_lr": outer} for inner in ADAMW for outer in OUTER_LRS]),
    "local AdamW (plain average)": ("DiLoCo's control: outer lr 1, no momentum (the ranks' mean)",
                                    {"averaging": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0}, ADAMW),
}


def key(setting: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:g}" if not isinstance(v, str) else v for k, v in setting.items())


def run_cell(split: str, fields: dict, settings: list[dict]) -> dict:
    """One method at one period on one split: the sweep on the validation split, then the chosen
    setting's fresh seeds on the test split."""
    base = dataclasses.replace(BASE, **SPLITS[split], **fields)
    runs = [dataclasses.replace(base, **s, seed=seed) for s in settings for seed in CHOOSE_SEEDS]
    results = iter(simulate(train_several, WORLD_SIZE, runs, timeout_s=6 * 3600)[0])
    sweep = {}
    for s in settings:
        outs = [next(results) for _ in CHOOSE_SEEDS]
        sweep[key(s)] = {"setting": s, "validation": [accuracy(o, "validation") for o in outs],
                         "diverged": any(o.diverged_at is not None for o in outs)}
    chosen = choose(sweep)
    cell = {"config": fields, "sweep": sweep, "chosen": chosen}
    if chosen is not None:
        s = sweep[chosen]["setting"]
        outs = simulate(train_several, WORLD_SIZE, [dataclasses.replace(base, **s, seed=seed) for seed in REPORT_SEEDS],
                        timeout_s=6 * 3600)[0]
        test = [accuracy(o, "test") for o in outs]
        cell.update(test=test, test_mean=round(statistics.mean(test), 2), test_sd=round(statistics.stdev(test), 2),
                    diverged_seeds=sum(o.diverged_at is not None for o in outs),
                    bytes_per_step=round(outs[0].bytes[-1] / BASE.steps, 1))
    return cell


def cells_to_run():
    """(cell key, fields, settings) in the order they run."""
    for name, (_, fields, settings) in EVERY_STEP.items():
        yield name, fields, settings
    for period in PERIODS:
        for name, (_, fields, settings) in PERIODIC.items():
            yield f"{name}, H={period}", {**fields, "period": period}, settings


def settings() -> dict:
    """What the results depend on, recorded in the file (the test compares it with this script's)."""
    return {"world_size": WORLD_SIZE,
            "base": {f.name: getattr(BASE, f.name) for f in dataclasses.fields(BASE)
                     if getattr(BASE, f.name) != f.default},
            "splits": SPLITS, "periods": list(PERIODS), "choose_seeds": list(CHOOSE_SEEDS),
            "report_seeds": list(REPORT_SEEDS), "switches": list(SWITCHES),
            "methods": {name: {"variant": v, "config": f, "settings": s}
                        for name, (v, f, s) in {**EVERY_STEP, **PERIODIC}.items()}}


def partial_file(split: str) -> Path:
    return RESULTS.with_name(f"local_sgd_at_scale.{split}.partial.json")


def run(split: str) -> dict:
    """Every cell on one split, resuming from its partial file."""
    path = partial_file(split)
    partial = json.loads(path.read_text()) if path.exists() else {}
    if partial.get("settings") != json.loads(json.dumps(settings())):
        partial = {"settings": settings(), "cells": {}}
    for name, fields, sweep in cells_to_run():
        if name in partial["cells"]:
            continue
        start = time.perf_counter()
        cell = run_cell(split, fields, sweep)
        cell["seconds"] = round(time.perf_counter() - start, 1)
        partial["cells"][name] = cell
        path.write_text(json.dumps(partial, indent=1) + "\n")
        print(f"{split:8s} {name:36s} {describe(cell)}  ({cell['seconds']:.0f} s)", flush=True)
    return partial["cells"]


def describe(cell: dict) -> str:
    if cell["chosen"] is None:
        return "diverged at every setting"
    return f"{cell['chosen']:38s} test {cell['test_mean']:5.1f} ± {cell['test_sd']:4.1f}"


def main(splits) -> dict | None:
    """Runs the given splits; returns the results once every split's cells are done (else None)."""
    done = {split: run(split) for split in splits}
    for split in SPLITS:
        if split not in done and partial_file(split).exists():
            done[split] = json.loads(partial_file(split).read_text())["cells"]
    names = [name for name, _, _ in cells_to_run()]
    if set(done) != set(SPLITS) or any(set(cells) != set(names) for cells in done.values()):
        return None
    return {"settings": settings(), "splits": {split: {n: done[split][n] for n in names} for split in SPLITS},
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=list(SPLITS), help="only this split (the other can run beside it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = main((args.split,) if args.split else tuple(SPLITS))
    if result is not None:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {RESULTS}")
    else:
        print("the other split is not done yet: its process writes the results when it ends")
