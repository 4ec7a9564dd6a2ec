"""Step time of ordered_powerSGD_hook against the blocking powerSGD_hook and torch's hook.

Goal (issue: notebook 07): the ordered hook's step is at most 0.9x the blocking hook's, on 2 gloo
processes, for a model whose backward is long compared with the hook's communication (an MLP
512 -> 1024 x 4 -> 10 on batches of 512, rank 2, buckets of 4 MB: several buckets, so that the
first ones can be communicated while backward computes the rest). torch's hook is timed where it
runs (one bucket, bucket_cap_mb=100), beside the two course hooks on that one bucket. The hooks take
turns in the same processes, a run of 30 steps each per round; each figure is the median step
time after PowerSGD has started.
    .venv/bin/python benchmarks/ordered_powersgd.py [rounds]
"""

import statistics
import sys
from dataclasses import replace

from course_lib.launch import spawn
from course_lib.train import TrainConfig, ddp_train

MODEL = TrainConfig(n_in=512, hidden=1024, depth=4, batch_size=512, lr=0.02, start_powerSGD_iter=5,
                    matrix_approximation_rank=2, steps=30, eval_every=1000)


def worker(rank, world_size, rounds, bucket_cap_mb, hooks):
    times = {hook: [] for hook in hooks}
    for _ in range(rounds):
        for hook in hooks:
            out = ddp_train(rank, world_size, replace(MODEL, hook=hook, bucket_cap_mb=bucket_cap_mb))
            times[hook].append(statistics.median(out.step_time_s[MODEL.start_powerSGD_iter + 2 :]))
    return times


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print("2 gloo processes, MLP 512-1024x4-10, batch 512, rank 2; median step time after PowerSGD starts")
    for cap, hooks in ((4.0, ("powersgd", "ordered_powersgd")),
                       (100.0, ("powersgd", "ordered_powersgd", "torch_powersgd"))):
        t = spawn(worker, 2, rounds, cap, hooks, backend="gloo", timeout_s=600)[0]
        med = {hook: statistics.median(v) for hook, v in t.items()}
        print(f"\nbucket_cap_mb={cap:g}: " + ", ".join(f"{h} {m * 1e3:.1f} ms" for h, m in med.items()))
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(t["ordered_powersgd"], t["powersgd"]))
        print(f"  ordered / blocking = {med['ordered_powersgd'] / med['powersgd']:.2f} (goal <= 0.9; per round: "
              f"{per_round})")
        if "torch_powersgd" in med:
            print(f"  ordered / torch    = {med['ordered_powersgd'] / med['torch_powersgd']:.2f}")
            print(f"  blocking / torch   = {med['powersgd'] / med['torch_powersgd']:.2f}")


if __name__ == "__main__":
    main()
