"""Each compressor's encode + decode time against the time to all-reduce the uncompressed gradient.

Compression pays only if what it saves on the wire exceeds what it costs to compute (Agarwal et al.,
MLSys 2022). This prints both, side by side in one run, for a gradient of N float32 numbers: the
median time of ``compress`` + ``decompress`` (one process), and the median time of a gloo
all-reduce of the whole gradient between 2 processes on this machine, with each compressor's bytes
on the wire. Ratios above 1 mean the encoding alone costs more than sending everything here.
    .venv/bin/python benchmarks/compressors.py [numel]
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from course_lib import compressors as C
from course_lib import powersgd
from course_lib.launch import spawn
from course_lib.utils.timing import median_seconds


def all_reduce_seconds(rank, world_size, numel, repeats=20):
    x = torch.randn(numel)
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    torch.set_num_threads(1)  # as each of the 2 gloo workers computes
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    reduce_s = spawn(all_reduce_seconds, 2, numel, backend="gloo")[0]
    side = int(numel ** 0.5)
    matrix = grad[: side * side].view(side, side)
    state = powersgd.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    rows = []
    for c in (C.FP16(), C.BF16(), C.TopK(0.01), C.RandomK(0.01), C.Threshold(2.5), C.QSGD(15), C.SignSGD(),
              C.TernGrad()):
        payload, _ = c.compress(grad)
        seconds = median_seconds(lambda c=c: c.decompress(*c.compress(grad)), repeats=7)
        rows.append((repr(c), seconds, C.payload_bytes(payload)))
    seconds = median_seconds(lambda: powersgd.compress_on_one_process(state, [matrix.clone()]), repeats=7)
    rows.append((f"PowerSGD rank 2 ({side}x{side})", seconds, 4 * 2 * 2 * side))
    print(f"gradient of {numel:,} float32 ({4 * numel / 1e6:.1f} MB); gloo all-reduce between 2 processes: "
          f"{reduce_s * 1e3:.2f} ms (median)")
    print(f"{'compressor':28s} {'bytes on the wire':>18s} {'encode+decode ms':>17s} {'/ all-reduce':>13s}")
    for name, seconds, nbytes in rows:
        print(f"{name:28s} {nbytes:18,d} {seconds * 1e3:17.2f} {seconds / reduce_s:12.2f}x")


if __name__ == "__main__":
    main()
