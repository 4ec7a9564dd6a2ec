"""Step time of the three data-parallel wrappers of course_lib.data_parallel, and torch's DDP.

Goal (issue: notebook 03): the bucketed wrapper's step is at most 0.9x the naive one's, on 2 gloo
processes, for a model where communication is a sizeable part of the step (the digits MLP with
hidden layers of 512: 3.3 MB of gradients in 10 tensors). All four take turns step by step in the
same processes (one compute thread each); each figure is a median over the steps.
    .venv/bin/python benchmarks/data_parallel.py [steps]
"""

import statistics
import sys

from course_lib.data_parallel import step_times
from course_lib.launch import spawn

KINDS = ("naive", "overlap", "bucket", "ddp")


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    print(f"2 gloo processes, MLP 64-512x4-10, global batch 64, {steps} steps each, median step time")
    for cap in (25.0, 1.0):
        out = spawn(step_times, 2, KINDS, steps, 512, 4, 64, cap, backend="gloo", timeout_s=600)[0]
        med = {kind: statistics.median(out[kind]["step_s"]) for kind in KINDS}
        counts = {kind: out[kind]["traffic"]["collectives"] for kind in KINDS if kind != "ddp"}
        print(f"\nbucket_cap_mb={cap:g}: " + ", ".join(f"{k} {med[k] * 1e3:.1f} ms" for k in KINDS)
              + f"  (all-reduces per step: {counts})")
        print(f"  overlap / naive = {med['overlap'] / med['naive']:.2f}")
        print(f"  bucket / naive  = {med['bucket'] / med['naive']:.2f} (goal <= 0.9)")
        print(f"  bucket / torch DDP = {med['bucket'] / med['ddp']:.2f}")


if __name__ == "__main__":
    main()
