"""The compression contest of notebook 10, each method at its best: a sweep of momentum and learning
rate chosen on a validation split, then fresh seeds scored on the test split.

Every method trains the same model (the digits MLP, hidden 256, 150 steps of 64 on 2 gloo ranks,
each an iid half of every batch) over the same grid: momentum 0.9 at three rates, and momentum 0
(plain SGD, as Stich et al.'s and Karimireddy et al.'s error-feedback algorithms are written) at
four larger ones. DGC keeps its momentum in the hook (swept over the same 0.9 and 0) and trains with
the optimizer's at 0; "no communication" (each rank alone on its half: the noop hook) is swept like
the others. Seven settings each (random-k and signSGD at smaller rates with momentum 0.9, random-k
x100 ten times smaller in both arms, where first sweeps found the best lower). Each setting is run
with seeds 0 and 1 and scored on a validation split (20% of the training images, the same for every
seed); a setting at which a seed diverged (a loss that is not finite) is out; of the others the best
mean validation accuracy (the mean of the last five evaluations, steps 130-150) is the method's
choice. The choice is then run with three fresh seeds (10, 11, 12) and scored on the test split (449
images), which chose nothing. A method with no setting left is marked diverged. Each method runs as
its paper runs it (the ``variant`` column): QSGD, signSGD and TernGrad scale each parameter's
gradient on its own.

Writes benchmarks/results/compression_contest.json (committed): the sweep (validation accuracy of
each seed), the chosen setting and the exact fields it trains with (``run``), the test accuracy of
each reported seed with their mean and standard deviation, the steps to the target accuracy, the
bytes per step (exact) and this machine's step time. Notebooks 09 and 10 read the chosen settings
and rerun the reported seeds; tests/test_compression_contest.py checks that each choice is its
sweep's best on validation and that one run reproduces its row.

    .venv/bin/python benchmarks/compression_contest.py            # the whole sweep (about 5 minutes on 2 cores)
    .venv/bin/python benchmarks/compression_contest.py "DGC 0.1%" # one method again, after a change to its
                                                                  # code: its row replaced in the committed file
"""

import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from course_lib.launch import spawn
from course_lib.train import TrainConfig, train_several

RESULTS = Path(__file__).parent / "results" / "compression_contest.json"
BASE = TrainConfig(hidden=256, steps=150, lr=0.1, momentum=0.9, eval_every=5, validation_fraction=0.2)
CHOOSE_SEEDS = (0, 1)  # the sweep, scored on the validation split
REPORT_SEEDS = (10, 11, 12)  # the chosen setting, scored on the test split
LRS = (0.03, 0.1, 0.3)  # with momentum 0.9, around all-reduce's 0.1 (lower where a first sweep found best lower)
LRS_PLAIN = (0.1, 0.3, 1.0, 3.0)  # with momentum 0: steps lr / (1 - momentum) like the above's, and past them
BOTH = {0.9: LRS, 0.0: LRS_PLAIN}
TARGET = 0.9  # the test accuracy that "time to accuracy" is measured to

# name: (variant, the fields that differ from BASE, {momentum: learning rates})
METHODS = {
    "no communication": ("each rank alone on its half of every batch (the noop hook)", {"hook": "noop"}, BOTH),
    "fp32 all-reduce": ("baseline, float32", {}, BOTH),
    "fp16": ("baseline, float16 all-reduce", {"hook": "fp16"}, BOTH),
    "bf16": ("bfloat16 all-reduce", {"hook": "bf16"}, BOTH),
    "top-k 1%": ("k largest of the bucket, error feedback", {"hook": "topk", "ratio": 0.01}, BOTH),
    "random-k 1%": ("Stich et al. 2018: unscaled, error feedback, shared seed",
                    {"hook": "randomk", "ratio": 0.01}, {0.9: (0.01, 0.03, 0.1), 0.0: LRS_PLAIN}),
    "random-k 1%, x100": ("unbiased (x numel/k), no memory: 100x the variance, smaller steps",
                          {"hook": "randomk", "ratio": 0.01, "randomk_scaled": True},
                          {0.9: (0.003, 0.01, 0.03), 0.0: (0.01, 0.03, 0.1, 0.3)}),
    "threshold 0.01": ("|g| >= 0.01, error feedback", {"hook": "threshold", "threshold": 0.01}, BOTH),
    "QSGD 4-bit": ("15 levels (4 bits + sign), a norm per 128, per tensor, no memory",
                   {"hook": "qsgd", "levels": 15, "qsgd_bucket": 128}, BOTH),
    "signSGD": ("EF-signSGD: mean magnitude per tensor, error feedback", {"hook": "signsgd"},
                {0.9: (0.003, 0.01, 0.03), 0.0: LRS_PLAIN}),
    "TernGrad": ("per tensor, clipped at 2.5 sd, no memory", {"hook": "terngrad", "terngrad_clip": 2.5}, BOTH),
    "PowerSGD r=2": ("rank 2, error feedback, warm start, from step 15",
                     {"hook": "powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 15}, BOTH),
    "top-k 0.1%": ("k largest of the bucket, error feedback", {"hook": "topk", "ratio": 0.001},
                   BOTH),
    "DGC 0.1%": ("top-k 0.1% + momentum correction in the hook (its momentum swept), masking, clipping 1.0 "
                 "(of the averaged gradient: each worker's at 1.0 x sqrt(p), the paper's rule), warm-up 40 steps",
                 {"hook": "dgc", "ratio": 0.001, "clip_norm": 1.0, "warmup_steps": 40}, BOTH),
}


def fields(name: str, momentum: float, lr: float) -> dict:
    """The fields of one setting that differ from BASE. DGC keeps its momentum in the hook, so the
    sweep's momentum is ``dgc_momentum`` there and the optimizer's is 0."""
    out = {**METHODS[name][1], "lr": lr}
    out.update(dgc_momentum=momentum, momentum=0.0) if out.get("hook") == "dgc" else out.update(momentum=momentum)
    return out


def config(name: str, lr: float, seed: int, momentum: float) -> TrainConfig:
    return dataclasses.replace(BASE, **fields(name, momentum, lr), seed=seed)


def key(momentum: float, lr: float) -> str:
    """The sweep's key for one setting, e.g. ``momentum 0.9, lr 0.1``."""
    return f"momentum {momentum:g}, lr {lr:g}"


def accuracy(result, which: str = "test") -> float:
    """Accuracy (%) on the ``"test"`` or ``"validation"`` split, the mean of the last five evaluations;
    nan for a run that diverged (training stops at the first loss that is not finite, so its last
    evaluations would be from before)."""
    scores = result.validation_accuracy if which == "validation" else result.test_accuracy
    if result.diverged_at is not None or len(scores) < 5:
        return math.nan
    return 100 * statistics.mean(scores[-5:])


def diverged(result) -> bool:
    return not all(math.isfinite(v) for v in result.loss)


def steps_to(result, target: float = TARGET):
    """The first evaluated step at or above the target accuracy (None: never)."""
    return next((s for s, a in zip(result.test_step, result.test_accuracy) if a >= target), None)


def choose(sweep: dict) -> str | None:
    """The key of the setting of best mean validation accuracy among those where no seed diverged."""
    ok = {k: row for k, row in sweep.items() if not row["diverged"]}
    return max(ok, key=lambda k: statistics.mean(ok[k]["validation"])) if ok else None


def main(names=None) -> dict:
    names = list(METHODS) if names is None else names
    settings = {name: [(m, lr) for m, lrs in METHODS[name][2].items() for lr in lrs] for name in names}
    runs = [(name, m, lr, seed) for name in names for m, lr in settings[name] for seed in CHOOSE_SEEDS]
    start = time.perf_counter()
    results = spawn(train_several, 2, [config(n, lr, s, m) for n, m, lr, s in runs], backend="gloo",
                    timeout_s=3600)[0]
    by_run = dict(zip(runs, results))
    table, chosen = {}, {}
    for name in names:
        sweep = {}
        for m, lr in settings[name]:
            outs = [by_run[(name, m, lr, s)] for s in CHOOSE_SEEDS]
            sweep[key(m, lr)] = {"momentum": m, "lr": lr,
                                 "validation": [round(accuracy(o, "validation"), 2) for o in outs],
                                 "diverged": any(diverged(o) for o in outs)}
        best = choose(sweep)
        variant, fields_, grid = METHODS[name]
        table[name] = {"variant": variant, "config": fields_, "grid": {str(m): list(lrs) for m, lrs in grid.items()},
                       "sweep": sweep, "diverged": best is None,
                       "best_momentum": None if best is None else sweep[best]["momentum"],
                       "best_lr": None if best is None else sweep[best]["lr"]}
        if best is not None:
            chosen[name] = (sweep[best]["momentum"], sweep[best]["lr"])
            table[name]["run"] = fields(name, *chosen[name])
    reported = [(name, seed) for name in chosen for seed in REPORT_SEEDS]
    results = spawn(train_several, 2, [config(n, chosen[n][1], s, chosen[n][0]) for n, s in reported],
                    backend="gloo", timeout_s=3600)[0]
    seconds = time.perf_counter() - start
    by_report = dict(zip(reported, results))
    for name in chosen:
        outs = [by_report[(name, s)] for s in REPORT_SEEDS]
        accs = [round(accuracy(o), 2) for o in outs]
        reached = [steps_to(o) for o in outs]
        step_s = statistics.mean(statistics.median(o.step_time_s[20:]) for o in outs)
        table[name].update(test=accs, accuracy_mean=round(statistics.mean(accs), 2),
                           accuracy_sd=round(statistics.stdev(accs), 2), steps_to_target=reached,
                           step_ms=round(1e3 * step_s, 3),
                           time_to_target_s=(round(statistics.mean(reached) * step_s, 3) if all(reached) else None),
                           bytes_per_step=round(outs[0].bytes[-1] / BASE.steps, 1))
    noop = [by_report[("no communication", s)] for s in REPORT_SEEDS] if "no communication" in chosen else []
    return {"base": {f.name: getattr(BASE, f.name) for f in dataclasses.fields(BASE)
                     if getattr(BASE, f.name) != f.default or f.name in ("hidden", "steps", "lr", "momentum")},
            "choose_seeds": list(CHOOSE_SEEDS), "report_seeds": list(REPORT_SEEDS), "target_accuracy": TARGET,
            "world_size": 2,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine(), "sweep_seconds": round(seconds, 1),
                        "compute_ms_no_communication": (round(1e3 * statistics.mean(
                            statistics.median(o.step_time_s[20:]) for o in noop), 3) if noop else None)},
            "methods": table}


def print_table(out: dict) -> None:
    print(f"{'':18s} {'momentum':>8s} {'best lr':>7s} {'accuracy (%)':>13s} {'to 90%':>8s} {'step ms':>8s} "
          f"{'bytes/step':>10s}  variant")
    for name, row in out["methods"].items():
        if row["diverged"]:
            print(f"{name:18s} {'diverged at every setting':>49s}  {row['variant']}")
            continue
        t = f"{row['time_to_target_s']:.2f} s" if row["time_to_target_s"] is not None else "never"
        print(f"{name:18s} {row['best_momentum']:8g} {row['best_lr']:7g} {row['accuracy_mean']:6.1f} ± "
              f"{row['accuracy_sd']:4.1f} {t:>8s} "
              f"{row['step_ms']:8.2f} {row['bytes_per_step']:10.0f}  {row['variant']}")


def merge(committed: dict, rerun: dict) -> dict:
    """The committed results with the rerun methods' rows replaced (after a change to their code); the
    machine records which rows were run again, and where."""
    bad = [name for name in rerun["methods"] if name not in METHODS]
    if bad or rerun["base"] != committed["base"]:
        raise ValueError(f"cannot merge {bad or 'a run with another base configuration'} into {RESULTS.name}")
    out = json.loads(json.dumps(committed))
    out["methods"] = {name: rerun["methods"].get(name, row) for name, row in committed["methods"].items()}
    out["machine"]["rerun"] = {**committed["machine"].get("rerun", {}),
                               **{name: {**rerun["machine"], "date": time.strftime("%Y-%m-%d")}
                                  for name in rerun["methods"]}}
    return out


if __name__ == "__main__":
    out = main(sys.argv[1:] or None)
    print_table(out)
    if len(out["methods"]) < len(METHODS) and RESULTS.exists():  # some methods run again: their rows replaced
        out = merge(json.loads(RESULTS.read_text()), out)
    if len(out["methods"]) == len(METHODS):
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {RESULTS}")
