"""Step time of the course's PowerSGD hook against torch's, same model, same bucket layout.

Goal (issue: notebook 07): the course hook's step is at most 1.0x torch's, on 2 gloo processes
with an MLP 512 -> 1024 -> 1024 -> 10 and bucket_cap_mb=100 (one bucket, where torch's hook runs).
Both hooks are run alternately in the same processes; each figure is the median step time after
PowerSGD has started. Also shows torch's hook on many small buckets (bucket_cap_mb=1) failing,
and the course's running.
    .venv/bin/python benchmarks/powersgd_step.py [rounds]
"""

import statistics
import sys
from dataclasses import replace

from course_lib.launch import WorkerError, spawn
from course_lib.train import TrainConfig, ddp_train

MODEL = TrainConfig(n_in=512, hidden=1024, depth=2, batch_size=128, lr=0.05, start_powerSGD_iter=5, eval_every=1000)


def worker(rank, world_size, rounds, steps, r):
    times = {"torch_powersgd": [], "powersgd": []}
    for _ in range(rounds):
        for hook in times:
            out = ddp_train(rank, world_size, replace(MODEL, hook=hook, steps=steps, matrix_approximation_rank=r,
                                                      bucket_cap_mb=100))
            times[hook].append(statistics.median(out.step_time_s[MODEL.start_powerSGD_iter + 2 :]))
    return times


def many_buckets(rank, world_size, hook):
    out = ddp_train(rank, world_size, replace(MODEL, hook=hook, steps=15, matrix_approximation_rank=2, bucket_cap_mb=1))
    return out.loss[-1]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print("2 gloo processes, MLP 512-1024-1024-10, batch 128, bucket_cap_mb=100, median step time after start")
    for r in (1, 2, 4):
        t = spawn(worker, 2, rounds, 30, r, backend="gloo", timeout_s=600)[0]
        ours, theirs = statistics.median(t["powersgd"]), statistics.median(t["torch_powersgd"])
        print(f"  matrix_approximation_rank {r}: course {ours * 1e3:6.2f} ms, torch {theirs * 1e3:6.2f} ms, "
              f"course / torch = {ours / theirs:.2f} (goal <= 1.0; per round: "
              + ", ".join(f"{a / b:.2f}" for a, b in zip(t["powersgd"], t["torch_powersgd"])) + ")")
    print("\nbucket_cap_mb=1 (many buckets), rank 2, 15 steps:")
    for hook in ("torch_powersgd", "powersgd"):
        for attempt in range(2):
            try:
                loss = spawn(many_buckets, 2, hook, backend="gloo", timeout_s=90)[0]
                print(f"  {hook:15s} run {attempt + 1}: finished, loss {loss:.3f}")
            except (WorkerError, TimeoutError) as e:
                print(f"  {hook:15s} run {attempt + 1}: FAILED - {str(e).splitlines()[0][:110]}")


if __name__ == "__main__":
    main()
