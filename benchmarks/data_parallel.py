"""Step time of the four data-parallel wrappers of course_lib.data_parallel and torch's DDP, the
communication each leaves exposed after backward, and the bucketed wrapper's step time against its cap.

Goal (issue: notebook 03): the bucketed wrapper's step is at most 0.9x the naive one's, on 2 gloo
processes, for a model where communication is a sizeable part of the step (the digits MLP with
hidden layers of 512: 3.3 MB of gradients in 10 tensors). The flat wrapper (one all-reduce after
backward) and the cap sweep tell "fewer messages" apart from "overlap with backward". All kinds take
turns step by step in the same processes (one compute thread each); each figure is a median over
the steps of both ranks.
    .venv/bin/python benchmarks/data_parallel.py [steps]
"""

import statistics
import sys

from course_lib.data_parallel import step_times
from course_lib.launch import spawn

WRAPPERS = ("naive", "flat", "overlap", "bucket")
CAPS = (0.001, 0.01, 0.1, 1.0, 2.0, 25.0)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    print(f"2 gloo processes, MLP 64-512x4-10, global batch 64, {steps} steps each, medians")
    kinds = WRAPPERS + ("ddp",) + tuple(f"bucket:{cap:g}" for cap in CAPS)
    outs = spawn(step_times, 2, kinds, steps, 512, 4, 64, 1.0, backend="gloo", timeout_s=600)

    def ms(kind, key):
        return 1e3 * statistics.median(v for out in outs for v in out[kind][key])

    print(f"\n{'kind':8s} {'all-reduces':>11s} {'step ms':>8s} {'backward':>9s} {'in flight':>10s} {'exposed':>8s}"
          "   (bucket_cap_mb=1)")
    for kind in WRAPPERS:
        print(f"{kind:8s} {outs[0][kind]['traffic']['collectives']:11d} {ms(kind, 'step_s'):8.1f} "
              f"{ms(kind, 'backward_s'):9.1f} {ms(kind, 'comm_s'):10.1f} {ms(kind, 'exposed_s'):8.1f}")
    print(f"{'ddp':8s} {'':11s} {ms('ddp', 'step_s'):8.1f}")
    step = {kind: ms(kind, "step_s") for kind in WRAPPERS + ("ddp",)}
    print(f"\n  flat / naive    = {step['flat'] / step['naive']:.2f} (fewer messages, no overlap)")
    print(f"  overlap / naive = {step['overlap'] / step['naive']:.2f} (overlap, as many messages)")
    print(f"  bucket / naive  = {step['bucket'] / step['naive']:.2f} (goal <= 0.9)")
    print(f"  bucket / flat   = {step['bucket'] / step['flat']:.2f} (overlap, given few messages)")
    print(f"  bucket / torch DDP = {step['bucket'] / step['ddp']:.2f}")
    print(f"\n{'bucket_cap_mb':>13s} {'buckets':>7s} {'step ms':>8s} {'exposed':>8s}")
    for cap in CAPS:
        kind = f"bucket:{cap:g}"
        print(f"{cap:13g} {outs[0][kind]['traffic']['collectives']:7d} {ms(kind, 'step_s'):8.1f} "
              f"{ms(kind, 'exposed_s'):8.1f}")


if __name__ == "__main__":
    main()
