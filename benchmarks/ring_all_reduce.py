"""Bus bandwidth of the course's ring all-reduce against gloo's built-in all_reduce, side by side.

Goal (issue: notebook 02): at 16 MB, ring_all_reduce reaches at least 0.8x the bus bandwidth of
dist.all_reduce for world sizes 2 and 3. Both are measured in the same processes, alternating.
    .venv/bin/python benchmarks/ring_all_reduce.py
"""

import statistics
import sys

from course_lib.bandwidth import measure_collective
from course_lib.collectives import naive_all_reduce, ring_all_reduce
from course_lib.launch import spawn

SIZE = 16 * 2**20


def worker(rank, world_size, rounds):
    rows = []
    for _ in range(rounds):  # alternate, so that a noisy moment hits both
        for name, fn in (("gloo", None), ("ring", ring_all_reduce), ("naive", naive_all_reduce)):
            (row,) = measure_collective("all_reduce", [SIZE], iters=5, warmup=1, fn=fn)
            rows.append((name, row["busbw_GBps"]))
    return rows


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(f"all-reduce of {SIZE // 2**20} MB float32, gloo on the CPU, median of 5 after 1 warm-up, {rounds} rounds\n")
    for world_size in (2, 3):
        rows = spawn(worker, world_size, rounds, backend="gloo", timeout_s=600)[0]
        best = {name: max(bw for n, bw in rows if n == name) for name in ("gloo", "ring", "naive")}
        med = {name: statistics.median(bw for n, bw in rows if n == name) for name in best}
        print(f"world size {world_size}: busbw gloo {best['gloo']:.2f} GB/s, ring {best['ring']:.2f} GB/s, "
              f"naive {best['naive']:.2f} GB/s (best of {rounds})")
        print(f"  ring / gloo = {best['ring'] / best['gloo']:.2f} (best)  {med['ring'] / med['gloo']:.2f} (median)"
              f"   naive / gloo = {best['naive'] / best['gloo']:.2f}")


if __name__ == "__main__":
    main()
