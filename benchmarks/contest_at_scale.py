"""The compression contest at 2, 8 and 64 workers, on iid and non-iid shards, chosen on a validation split.

The contest of notebook 10's first section (``compression_contest.py``) runs 2 gloo workers on one
model. This one asks the same question where the answer can depend on the number of workers: p
workers (``course_lib.simulated``: p ranks as threads, the methods' own code, only the transport in
memory; ``tests/test_simulated.py`` checks it against gloo processes), a global batch that stays 128
as p grows (each worker's share shrinks to 2 at p = 64, so a worker alone learns from a small
batch), and two ways of dealing the data: iid (each worker a share of every batch) and non-iid (each
worker a shard of its own, its classes' shares drawn from Dirichlet(0.5)).

Every method gets the same budget: momentum 0 and 0.9 (DGC: its in-hook momentum, the optimizer's
at 0), three learning rates each, spanning the same effective step lr / (1 - momentum) of 0.3 to 3
in both (random-k x100, with 100 times the variance, ten times smaller), chosen on a validation split
(20% of the training images, the same for every seed) by the mean of seeds 0 and 1; a setting where
the loss stops being finite on either seed is out. The chosen
setting is then run with three fresh seeds (10, 11, 12) and scored on the test split (449 images),
which chose nothing. Accuracy is the mean of the last three evaluations (steps 130, 140, 150).
"no communication" (each worker trains alone: the ``noop`` hook) and "DDP" (the fp32 all-reduce)
are rows like the others, so every table has both.

Writes benchmarks/results/contest_at_scale.json (committed), one world size at a time, merged into
what is there: the settings (so that ``tests/test_contest_at_scale.py`` can check that the file is
what this script's settings produce), each sweep, the chosen setting, the test accuracy of each
reported seed, and the bytes each worker sent per step (exact; ``by_op``: collectives and bytes per
step by collective, all-reduce or all-gather, averaged over the run). Work done so far is kept in
``contest_at_scale.p<p>.<split>.partial.json`` beside it, so an interrupted run goes on where it stopped (and
world sizes, or the two splits of one, can run in separate processes at once: ``--split iid`` and
``--split non-iid``; a second process on the same split with ``--from-end`` takes the methods last
first, and each skips what the other has written).

    .venv/bin/python benchmarks/contest_at_scale.py 2 8     # a few minutes each on 2 cores
    .venv/bin/python benchmarks/contest_at_scale.py 64      # hours: every rank of 64 computes in one process
    .venv/bin/python benchmarks/contest_at_scale.py 2 8 --rerun "DGC 0.1%"   # one method again, after a fix
"""

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from course_lib.simulated import simulate
from course_lib.train import TrainConfig, train_several

RESULTS = Path(__file__).parent / "results" / "contest_at_scale.json"
BASE = TrainConfig(hidden=64, steps=150, batch_size=128, eval_every=10, validation_fraction=0.2)
WORLD_SIZES = (2, 8, 64)
SPLITS = {"iid": {"split": "iid"}, "non-iid": {"split": "dirichlet", "dirichlet_alpha": 0.5}}
CHOOSE_SEEDS = (0, 1)  # the sweep, scored on the validation split
REPORT_SEEDS = (10, 11, 12)  # the chosen setting, scored on the test split
SCORED = 3  # evaluations averaged: the last three
GRID = {0.9: (0.03, 0.1, 0.3), 0.0: (0.3, 1.0, 3.0)}  # the same steps lr / (1 - momentum) in both arms
SMALL = {0.9: (0.003, 0.01, 0.03), 0.0: (0.03, 0.1, 0.3)}  # for random-k x100: 100x the variance

# name: (variant, the fields that differ from BASE, {momentum: learning rates})
METHODS = {
    "no communication": ("each worker alone on its own batch (the noop hook)", {"hook": "noop"}, GRID),
    "DDP": ("fp32 all-reduce", {"hook": "allreduce"}, GRID),
    "fp16": ("float16 all-reduce", {"hook": "fp16"}, GRID),
    "bf16": ("bfloat16 all-reduce", {"hook": "bf16"}, GRID),
    "top-k 1%": ("k largest of the bucket, error feedback", {"hook": "topk", "ratio": 0.01}, GRID),
    "top-k 0.1%": ("k largest of the bucket, error feedback", {"hook": "topk", "ratio": 0.001}, GRID),
    "random-k 1%": ("Stich et al. 2018: unscaled, error feedback, shared seed", {"hook": "randomk", "ratio": 0.01},
                    GRID),
    "random-k 1%, x100": ("unbiased (x numel/k), no memory", {"hook": "randomk", "ratio": 0.01,
                                                               "randomk_scaled": True}, SMALL),
    "threshold 0.01": ("|g| >= 0.01, error feedback", {"hook": "threshold", "threshold": 0.01}, GRID),
    "QSGD 4-bit": ("15 levels, a norm per 128, per tensor, no memory", {"hook": "qsgd", "levels": 15,
                                                                        "qsgd_bucket": 128}, GRID),
    "signSGD": ("EF-signSGD: mean magnitude per tensor, error feedback", {"hook": "signsgd"}, GRID),
    "TernGrad": ("per tensor, clipped at 2.5 sd, no memory", {"hook": "terngrad", "terngrad_clip": 2.5}, GRID),
    "PowerSGD r=2": ("layer by layer, error feedback, warm start, from step 10",
                     {"hook": "powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 10}, GRID),
    "batched PowerSGD r=2": ("the whole bucket as one square matrix, error feedback, warm start, from step 10",
                             {"hook": "batched_powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
                             GRID),
    "DGC 0.1%": ("top-k 0.1% + momentum correction in the hook (its momentum swept), masking, clipping 1.0 "
                 "(of the averaged gradient: each worker's at 1.0 x sqrt(p), the paper's rule), warm-up 40 steps",
                 {"hook": "dgc", "ratio": 0.001, "clip_norm": 1.0, "warmup_steps": 40}, GRID),
}


def config(name: str, split: str, momentum: float, lr: float, seed: int) -> TrainConfig:
    """One run. DGC keeps its momentum in the hook, so the sweep's momentum is ``dgc_momentum`` there."""
    fields = {**METHODS[name][1], **SPLITS[split], "lr": lr, "seed": seed}
    fields.update(dgc_momentum=momentum, momentum=0.0) if fields["hook"] == "dgc" else fields.update(momentum=momentum)
    return dataclasses.replace(BASE, **fields)


def key(momentum: float, lr: float) -> str:
    return f"momentum {momentum:g}, lr {lr:g}"


def accuracy(result, which: str) -> float:
    """Accuracy (%) on the ``"validation"`` or ``"test"`` split, the mean of the last evaluations; nan
    for a run that diverged (it stopped training at its first loss that was not finite)."""
    scores = result.validation_accuracy if which == "validation" else result.test_accuracy
    if result.diverged_at is not None or len(scores) < SCORED:
        return math.nan
    return round(100 * statistics.mean(scores[-SCORED:]), 2)


def choose(sweep: dict) -> str | None:
    """The key of the setting of best mean validation accuracy among those where no seed diverged."""
    ok = {k: row for k, row in sweep.items() if not row["diverged"]}
    return max(ok, key=lambda k: statistics.mean(ok[k]["validation"])) if ok else None


def run_cell(world_size: int, split: str, name: str) -> dict:
    """One method at one p on one split: the sweep on the validation split, then the chosen setting's
    fresh seeds on the test split."""
    variant, fields, grid = METHODS[name]
    settings = [(m, lr) for m, lrs in grid.items() for lr in lrs]
    runs = [config(name, split, m, lr, s) for m, lr in settings for s in CHOOSE_SEEDS]
    results = iter(simulate(train_several, world_size, runs, timeout_s=6 * 3600)[0])
    sweep = {}
    for m, lr in settings:
        outs = [next(results) for _ in CHOOSE_SEEDS]
        sweep[key(m, lr)] = {"momentum": m, "lr": lr, "validation": [accuracy(o, "validation") for o in outs],
                             "diverged": any(o.diverged_at is not None for o in outs)}
    chosen = choose(sweep)
    cell = {"variant": variant, "config": fields, "sweep": sweep, "chosen": chosen}
    if chosen is not None:
        m, lr = sweep[chosen]["momentum"], sweep[chosen]["lr"]
        outs = simulate(train_several, world_size, [config(name, split, m, lr, s) for s in REPORT_SEEDS],
                        timeout_s=6 * 3600)[0]
        test = [accuracy(o, "test") for o in outs]
        cell.update(test=test, test_mean=round(statistics.mean(test), 2),
                    test_sd=round(statistics.stdev(test), 2) if len(test) > 1 else 0.0,
                    diverged_seeds=sum(o.diverged_at is not None for o in outs),
                    bytes_per_step=round(outs[0].bytes[-1] / BASE.steps, 1),
                    by_op={op: [round(n / BASE.steps, 3), round(b / BASE.steps, 1)]
                           for op, (n, b) in outs[0].by_op[-1].items()})
    return cell


def settings() -> dict:
    """What the results depend on, recorded in the file (the test compares it with this script's)."""
    return {"base": {f.name: getattr(BASE, f.name) for f in dataclasses.fields(BASE)
                     if getattr(BASE, f.name) != f.default},
            "splits": SPLITS, "choose_seeds": list(CHOOSE_SEEDS), "report_seeds": list(REPORT_SEEDS),
            "scored_evaluations": SCORED,
            "methods": {name: {"variant": v, "config": f, "grid": {str(m): list(lrs) for m, lrs in g.items()}}
                        for name, (v, f, g) in METHODS.items()}}


def partial_file(world_size: int, split: str) -> Path:
    return RESULTS.with_name(f"contest_at_scale.p{world_size}.{split}.partial.json")


def _load_partial(path: Path) -> dict:
    partial = json.loads(path.read_text()) if path.exists() else {}
    return partial if partial.get("settings") == settings() else {"settings": settings(), "cells": {}}


def prepare_rerun(world_size: int, split: str, names) -> None:
    """Before running ``names`` again at one p and split (after a change to their code): the partial
    file keeps every other method's cell, or takes it from the results file, and loses those of
    ``names``; the other cells must have been made with this script's settings for their methods.
    One process per split (a second one's fresh cells would be dropped)."""
    def others(s: dict) -> dict:  # the settings, the rerun methods left out
        return {**s, "methods": {k: v for k, v in s["methods"].items() if k not in names}}
    path, cells = partial_file(world_size, split), {}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if results and others(results["settings"]) == others(settings()) and str(world_size) in results["world_sizes"]:
        cells = {f"{world_size} {split} {name}": cell
                 for name, cell in results["world_sizes"][str(world_size)][split].items()}
    partial = json.loads(path.read_text()) if path.exists() else {}
    if partial and others(partial["settings"]) == others(settings()):
        cells.update(partial["cells"])
    kept = {k: cell for k, cell in cells.items() if k.split(" ", 2)[2] not in names}
    path.write_text(json.dumps({"settings": settings(), "cells": kept}, indent=1) + "\n")


def run(world_size: int, split: str, from_end: bool = False) -> dict:
    """Every method at one world size on one split, resuming from its partial file; the cells by method.

    The file is read again before each cell and before each write, so two processes can share a split,
    one from each end of the list (``from_end``): each skips what the other has finished and adds its
    own cells to the file without dropping the other's."""
    p, path = world_size, partial_file(world_size, split)
    for name in (list(METHODS)[::-1] if from_end else METHODS):
        cell_key = f"{p} {split} {name}"
        if cell_key in _load_partial(path)["cells"]:
            continue
        start = time.perf_counter()
        cell = run_cell(p, split, name)
        cell["seconds"] = round(time.perf_counter() - start, 1)
        partial = _load_partial(path)  # what the other process may have added meanwhile
        partial["cells"][cell_key] = cell
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(partial, indent=1) + "\n")
        tmp.replace(path)
        print(f"p={p:3d} {split:8s} {name:22s} {describe(cell)}  ({cell['seconds']:.0f} s)", flush=True)
    cells = _load_partial(path)["cells"]
    return {name: cells[f"{p} {split} {name}"] for name in METHODS}


def finished(world_size: int, split: str) -> dict | None:
    """The cells of a split another process ran, if it has run every method (else None)."""
    path = partial_file(world_size, split)
    partial = json.loads(path.read_text()) if path.exists() else {}
    keys = [f"{world_size} {split} {name}" for name in METHODS]
    if partial.get("settings") != settings() or not all(k in partial["cells"] for k in keys):
        return None
    return {name: partial["cells"][k] for name, k in zip(METHODS, keys)}


def main(world_sizes, splits=tuple(SPLITS), from_end: bool = False) -> dict:
    """Runs the given splits; writes a world size into the results once both of its splits are done."""
    cells = {p: {split: run(p, split, from_end) for split in splits} for p in world_sizes}
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if out.get("settings") != settings():
        out = {"settings": settings(), "world_sizes": {}}
    for p in world_sizes:
        done = {split: cells[p].get(split) or finished(p, split) for split in SPLITS}
        if all(done.values()):
            out["world_sizes"][str(p)] = done
    out["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                      "processor": platform.processor() or platform.machine()}
    return out


def describe(cell: dict) -> str:
    if cell["chosen"] is None:
        return "diverged at every setting"
    return f"{cell['chosen']:24s} test {cell['test_mean']:5.1f} ± {cell['test_sd']:4.1f}"


def print_table(out: dict) -> None:
    for p, splits in sorted(out["world_sizes"].items(), key=lambda kv: int(kv[0])):
        for split, cells in splits.items():
            print(f"\np = {p}, {split} (chosen on the validation split, seeds {list(CHOOSE_SEEDS)}; test: seeds "
                  f"{list(REPORT_SEEDS)})")
            for name, cell in cells.items():
                print(f"  {name:22s} {describe(cell)}  {cell.get('bytes_per_step', 0):9.0f} B/step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("world_sizes", type=int, nargs="*", default=list(WORLD_SIZES))
    parser.add_argument("--split", choices=list(SPLITS), help="only this split (the other can run beside it)")
    parser.add_argument("--from-end", action="store_true",
                        help="take the methods last first: a second process on the same split meets the first")
    parser.add_argument("--rerun", action="append", choices=list(METHODS), default=[], metavar="METHOD",
                        help="run this method's cells again (after a change to its code), keeping the others'")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for p in args.world_sizes if args.rerun else ():
        for split in (args.split,) if args.split else SPLITS:
            prepare_rerun(p, split, args.rerun)
    result = main(args.world_sizes, (args.split,) if args.split else tuple(SPLITS), args.from_end)
    print_table(result)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")
