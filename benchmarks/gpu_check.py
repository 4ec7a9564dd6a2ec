"""The GPU paths, run on a GPU: NCCL at world size 1, CUDA tensors over gloo, GPU timings.

Every stored notebook output comes from a CPU over gloo. This script runs, on a machine with one
NVIDIA GPU, what only such a machine can run, and writes what it saw to a JSON file that the
notebooks read (always labelled with the device it was measured on):

1. NCCL at world size 1 (one GPU cannot host two NCCL ranks): ``launch.spawn(..., backend="nccl")``
   and the workers' ``cuda:LOCAL_RANK``; ``init_from_env`` under ``torchrun --nproc-per-node 1``; the
   bandwidth sweep's NCCL branch; the DDP accumulation worker; DDP with torch's own
   ``bf16_compress_hook``; and in which order, on which thread, torch's layer-wise ``powerSGD_hook``
   issues its collectives with many buckets, on NCCL and, for contrast, on gloo.
2. CUDA tensors across 2 ranks on the one GPU over gloo: every course hook trains a CUDA model, the
   ranks' parameters identical and equal to the same run on the CPU; the course's PowerSGD against
   torch's; the sharded and local-SGD modules; the memory ledger against the CUDA allocator.
3. GPU timings side by side: full SVD, ``torch.svd_lowrank`` and one rank-2 power step at 1024²,
   4096² and on ResNet-18's layers (the PowerSGD paper: 673 ms for an SVD, 105 ms for a whole
   rank-2 step); each compressor's encode + decode; one training step's computation of notebook 12's
   model per hook; the kernels each hook launches per step (profiler) and the time of one launch.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json]
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run   # no GPU: gloo, CPU; to build/gpu_check_dry_run.json

Each section runs on its own; one that fails is recorded with its error and the rest go on. A
section's ``ok`` says that it ran to its end; inside it, each check that failed has its own ``ok:
false`` and error (torch's hook failing off NCCL is such a finding, not a failure of this script). The
file is rewritten after every section, so a run cut short keeps what it finished. ``--dry-run`` runs every
section on the CPU over gloo with small sizes: a check of this script on a machine without a GPU.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import compressors as C
from course_lib import local_sgd, powersgd, sharding
from course_lib.accumulation import ddp_accumulation_worker
from course_lib.bandwidth import sweep
from course_lib.launch import spawn, worker_device
from course_lib.lowrank import time_methods
from course_lib.train import TrainConfig, make_hook, train_several
from course_lib.utils.digits import batch_slice, digits_tensors, mlp
from course_lib.utils.shapes import resnet18_cifar_shapes
from course_lib.utils.timing import median_seconds

# notebook 12's model and run: an MLP 512 -> 1024 -> 1024 -> 10, 64 samples per worker, PowerSGD from the 6th step
BENCH = TrainConfig(n_in=512, hidden=1024, depth=2, lr=0.05, start_powerSGD_iter=5, eval_every=1000, steps=25,
                    batch_size=64)
BENCH_HOOKS = {"all-reduce": dict(hook="allreduce"), "fp16": dict(hook="fp16"),
               "PowerSGD r=1": dict(hook="powersgd", matrix_approximation_rank=1),
               "PowerSGD r=2": dict(hook="powersgd", matrix_approximation_rank=2),
               "PowerSGD r=4": dict(hook="powersgd", matrix_approximation_rank=4)}
# every other hook of the course, on the same model: its step's computation and its kernels (notebooks 08, 09)
OTHER_HOOKS = {"bf16": dict(hook="bf16"),
               "PowerSGD r=2, batched": dict(hook="batched_powersgd", matrix_approximation_rank=2),
               "PowerSGD r=2, ordered": dict(hook="ordered_powersgd", matrix_approximation_rank=2),
               "top-k 1%": dict(hook="topk", ratio=0.01), "random-k 1%": dict(hook="randomk", ratio=0.01),
               "threshold": dict(hook="threshold"), "QSGD": dict(hook="qsgd"), "signSGD": dict(hook="signsgd"),
               "TernGrad": dict(hook="terngrad"), "DGC 0.1%": dict(hook="dgc", ratio=0.001)}


# ---------------------------------------------------------------- workers (top level: spawn sends them by name)

def placement(rank, world_size):
    """Where a worker landed: backend, device, LOCAL_RANK, and an all-reduce on that device."""
    device = worker_device()
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    return {"backend": dist.get_backend(), "worker_device": str(device), "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
            "current_cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "all_reduce_device": str(x.device), "all_reduce_value": x[0].item()}


def ddp_bf16(rank, world_size, steps=5):
    """DDP with torch's own bf16_compress_hook (a CPU build refuses it), beside the plain all-reduce."""
    device = worker_device()
    x, y, _, _ = digits_tensors()
    out = {}
    for name in ("allreduce", "torch bf16_compress_hook"):
        model = DDP(mlp(seed=0).to(device), device_ids=[device] if device.type == "cuda" else None)
        if name != "allreduce":
            try:
                model.register_comm_hook(dist.group.WORLD, torch_default.bf16_compress_hook)
            except Exception as e:  # noqa: BLE001 -- what DDP says is the result
                out[name] = {"accepted": False, "error": f"{type(e).__name__}: {e}"[:400]}
                continue
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            rows = batch_slice(step, 64, len(x), rank, world_size)
            opt.zero_grad()
            loss = F.cross_entropy(model(x[rows].to(device)), y[rows].to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = {"accepted": True, "losses": losses,
                     "params": [p.detach().cpu().clone() for p in model.module.parameters()]}
    return out


def torch_powersgd_order(rank, world_size, device_kind="auto", steps=4):
    """Torch's layer-wise powerSGD_hook on many buckets: each all-reduce of the last step, in the order
    issued, with the thread that issued it and its size (numbers)."""
    device = worker_device(device_kind)
    log = []
    original = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        log.append((threading.current_thread().name, tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = logged  # torch's hook calls dist.all_reduce
    try:
        x, y, _, _ = digits_tensors()
        model = DDP(mlp(hidden=256, depth=2, seed=0).to(device), bucket_cap_mb=0.05,
                    device_ids=[device] if device.type == "cuda" else None)
        state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)

        def powerSGD_hook(state, bucket):  # torch's, noting when DDP hands it each bucket
            log.append((threading.current_thread().name, f"hook called with bucket {bucket.index()}"))
            return torch_psgd.powerSGD_hook(state, bucket)

        model.register_comm_hook(state, powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            log.clear()
            rows = batch_slice(step, 64, len(x), rank, world_size)
            opt.zero_grad()
            F.cross_entropy(model(x[rows].to(device)), y[rows].to(device)).backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        dist.all_reduce = original
    return {"backend": dist.get_backend(), "device": str(device), "last_step": list(log),
            "buckets": sum(1 for _, what in log if isinstance(what, str))}


def sharded_cuda(rank, world_size, device_kind, steps=3, hidden=256):
    """ZeRO stages 0-3 and ShardedOptimizer on this rank's device: parameters after ``steps`` steps, the
    memory ledger, and the CUDA allocator's own count beside it."""
    device = worker_device(device_kind)
    x, y, _, _ = digits_tensors()
    if device.type == "cuda":  # cuBLAS's workspace, allocated at the first matrix product: before any ledger
        F.cross_entropy(mlp(hidden=8, depth=1).to(device)(x[:8].to(device)), y[:8].to(device)).backward()
    out = {}
    for stage in (0, 1, 2, 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        model = mlp(hidden=hidden, depth=2, seed=0).to(device)
        units = [m for m in model if isinstance(m, torch.nn.Linear)]
        model = sharding.ShardedDataParallel(model, stage, units=units)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(steps):
            rows = batch_slice(step, 64, len(x), rank, world_size)
            xb, yb = x[rows].to(device), y[rows].to(device)
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        ledger = sharding.memory_ledger(model, opt)
        row = {"ledger": ledger, "params": {n: p.cpu() for n, p in model.gathered_parameters().items()}}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            row["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device) - before  # after the last step
            row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before  # since the model was built
        out[f"stage {stage}"] = row
        del model, opt
    # ZeRO-1 as torch's ZeroRedundancyOptimizer: the course's ShardedOptimizer under DDP
    model = DDP(mlp(hidden=hidden, depth=2, seed=0).to(device))
    opt = sharding.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    for step in range(steps):
        rows = batch_slice(step, 64, len(x), rank, world_size)
        opt.zero_grad()
        F.cross_entropy(model(x[rows].to(device)), y[rows].to(device)).backward()
        opt.step()
    out["ShardedOptimizer"] = {"params": {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}}
    return out


def local_sgd_cuda(rank, world_size, device_kind, steps=6):
    """The periodic averager and DiLoCo on this rank's device: parameters after training, and the
    mean the averager computed against the mean of every rank's parameters gathered to the CPU."""
    device = worker_device(device_kind)
    x, y, _, _ = digits_tensors()
    model = mlp(hidden=64, depth=2, seed=rank).to(device)  # different on each rank: the averager must join them
    F.cross_entropy(model(x[:8].to(device)), y[:8].to(device)).backward()  # every parameter has a gradient
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(before) for _ in range(world_size)]
    dist.all_gather(gathered, before)
    expected = torch.stack([g.cpu() for g in gathered]).mean(0)
    local_sgd.PeriodicModelAverager(period=1).average_parameters(model.parameters())
    averaged = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    out = {"averager_max_error": (averaged - expected).abs().max().item()}
    model = mlp(hidden=64, depth=2, seed=0).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = local_sgd.DiLoCo(model.parameters(), inner, period=3)
    for step in range(steps):
        rows = batch_slice(step, 64, len(x), rank, world_size)
        inner.zero_grad()
        F.cross_entropy(model(x[rows].to(device)), y[rows].to(device)).backward()
        diloco.step()
    out["diloco_params"] = [p.detach().cpu().clone() for p in model.parameters()]
    return out


def profile_steps(rank, world_size, configs, warm=10, profiled=3):
    """For each config, ``warm`` steps, then ``profiled`` steps under the profiler: CUDA kernels (and
    copies) per step, and aten operators dispatched per step (top-level ones, as the CPU sees them)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile
    device = worker_device()
    x, y, _, _ = digits_tensors()
    reps = -(-BENCH.n_in // 64)
    x = x.repeat(1, reps)[:, :BENCH.n_in].to(device)
    y = y.to(device)
    out = []
    for c in configs:
        model = DDP(mlp(hidden=c.hidden, depth=c.depth, seed=0, n_in=c.n_in).to(device), bucket_cap_mb=c.bucket_cap_mb,
                    device_ids=[device] if device.type == "cuda" else None)
        model.register_comm_hook(*make_hook(c))
        opt = torch.optim.SGD(model.parameters(), lr=c.lr)

        def step(i, c=c, model=model, opt=opt):
            rows = batch_slice(i, c.batch_size, len(x), rank, world_size)
            opt.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()

        for i in range(warm):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for i in range(warm, warm + profiled):
                step(i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        events = prof.events()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        top_aten = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
                    and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        names: dict[str, int] = {}
        for e in kernels:
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
        out.append({"kernels_per_step": len(kernels) / profiled, "aten_ops_per_step": len(top_aten) / profiled,
                    "top_kernels": sorted(names.items(), key=lambda kv: -kv[1])[:8]})
    return out


def resnet18_cifar(num_classes=10) -> torch.nn.Module:
    """The ResNet-18 whose shapes ``course_lib.utils.shapes.resnet18_cifar_shapes`` writes out (for
    timing its training step here; the check below compares the shapes)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64)
            cin = 64
            for stage, (cout, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
                setattr(self, f"layer{stage}", nn.Sequential(Block(cin, cout, stride), Block(cout, cout, 1)))
                cin = cout
            self.linear = nn.Linear(512, num_classes)

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
            return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))

    return ResNet18()


# ---------------------------------------------------------------- the checks

def _max_rel(a_list, b_list) -> float:
    return max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
               for a, b in zip(a_list, b_list))


def environment(device):
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "device": "cpu"}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"device": torch.cuda.get_device_name(device), "gpus": torch.cuda.device_count(),
                # PyTorch's defaults, left as they are: float32 matrix products in full float32, cuDNN's
                # convolutions in TF32 (the ResNet-18 step below)
                "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                "multiprocessors": p.multi_processor_count, "memory_GiB": round(p.total_memory / 2**30, 1),
                "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    return env


def _attempt(out: dict, key: str, fn) -> None:
    """``out[key] = fn()``, or what it raised: one check's failure does not hide the others' results."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 -- recorded
        out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800]}


def nccl_world_one(backend, quick):
    """Section 1: NCCL (gloo in a dry run) at world size 1."""
    out = {}
    _attempt(out, "placement", lambda: spawn(placement, 1, backend=backend, timeout_s=120)[0])
    _attempt(out, "torchrun", lambda: _torchrun(backend))
    _attempt(out, "sweep", lambda: _sweep(backend, quick))
    _attempt(out, "accumulation", lambda: _accumulation(backend))
    _attempt(out, "torch_bf16_compress_hook", lambda: _bf16(backend))
    order = {}
    _attempt(order, backend, lambda: spawn(torch_powersgd_order, 1, backend=backend, timeout_s=120)[0])
    if backend == "nccl":  # the same tensors on gloo, for contrast; and on the CPU, with a GPU visible
        _attempt(order, "gloo, CUDA tensors",  # hung in an earlier run: 60 s is ample for 4 steps
                 lambda: spawn(torch_powersgd_order, 1, "cuda", backend="gloo", timeout_s=60)[0])
        _attempt(order, "gloo, CPU tensors",
                 lambda: spawn(torch_powersgd_order, 1, "cpu", backend="gloo", timeout_s=120)[0])
    out["torch_powersgd_order"] = order
    return out


def _torchrun(backend):
    # init_from_env under torchrun, through the course's training script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "course_lib.train", "--hook", "powersgd", "--matrix-approximation-rank", "2", "--steps", "30",
           "--start-powerSGD-iter", "5", "--eval-every", "30"]
    if backend == "gloo":
        cmd += ["--backend", "gloo"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    return {"command": " ".join(cmd[1:]), "returncode": run.returncode,
            "stdout": run.stdout.strip()[-600:], "stderr_tail": run.stderr.strip()[-600:]}


def _sweep(backend, quick):
    sizes = [4096 * 4**k for k in range(5 if quick else 9)]
    res = spawn(sweep, 1, ("all_reduce", "broadcast"), sizes, 20, 5, "nccl-tests", backend=backend, timeout_s=300)[0]
    kept = {k: res[k] for k in ("backend", "device", "world_size", "all_reduce", "broadcast")}
    return {"note": "world size 1: nothing moves; time_s is the cost of a call, and algbw (bytes / time) is no "
                    "bandwidth here", **kept}


def _accumulation(backend):
    acc = spawn(ddp_accumulation_worker, 1, 4, 2, 64, backend=backend, timeout_s=120)[0]
    return {
        "all_reduces_per_step": {k: [len(s) for s in acc[k]["all_reduces"]] for k in ("sync", "no_sync")},
        "all_reduce_bytes_first_step": {k: acc[k]["all_reduces"][0] for k in ("sync", "no_sync")},
        "sync_vs_no_sync_max_rel": _max_rel(acc["no_sync"]["params"], acc["sync"]["params"])}


def _bf16(backend):
    bf16 = spawn(ddp_bf16, 1, backend=backend, timeout_s=120)[0]
    hooked = bf16["torch bf16_compress_hook"]
    out = {k: v for k, v in hooked.items() if k != "params"}
    if hooked["accepted"]:
        out["max_rel_vs_allreduce"] = _max_rel(hooked["params"], bf16["allreduce"]["params"])
    return out


HOOK_CASES = {
    "allreduce": dict(hook="allreduce"), "fp16": dict(hook="fp16"), "bf16": dict(hook="bf16"),
    "powersgd": dict(hook="powersgd"), "powersgd + fp16 wrapper": dict(hook="powersgd", compress_wrapper="fp16"),
    "powersgd + bf16 wrapper": dict(hook="powersgd", compress_wrapper="bf16"),
    "batched_powersgd": dict(hook="batched_powersgd"),
    "ordered_powersgd, several buckets": dict(hook="ordered_powersgd", bucket_cap_mb=0.05),
    "topk": dict(hook="topk"), "randomk": dict(hook="randomk"), "threshold": dict(hook="threshold"),
    "qsgd": dict(hook="qsgd"), "signsgd": dict(hook="signsgd", lr=0.01), "terngrad": dict(hook="terngrad"),
    "dgc": dict(hook="dgc"),
}


def cuda_over_gloo(device_kind, quick):
    """Section 2: 2 gloo ranks on the one GPU, CUDA tensors."""
    base = TrainConfig(steps=12, start_powerSGD_iter=3, hidden=128, eval_every=100, lr=0.1, batch_size=64)
    out = {"hooks": {}}
    cases = dict(list(HOOK_CASES.items())[:4]) if quick else HOOK_CASES
    for name, fields in cases.items():
        cfg = replace(base, **fields)
        row = {}
        try:
            ranks = spawn(train_several, 2, [replace(cfg, device=device_kind), replace(cfg, device="cpu")],
                          backend="gloo", timeout_s=120)
            (gpu0, cpu0), (gpu1, _) = ranks
            row = {"ok": True, "final_loss": gpu0.loss[-1], "finite": all(math.isfinite(v) for v in gpu0.loss),
                   "ranks_identical": all(torch.equal(a, b) for a, b in zip(gpu0.final_params, gpu1.final_params)),
                   "max_rel_vs_cpu": _max_rel(gpu0.final_params, cpu0.final_params),
                   "bytes_equal_cpu": gpu0.bytes[-1] == cpu0.bytes[-1], "bytes": gpu0.bytes[-1]}
        except Exception as e:  # noqa: BLE001 -- recorded: this hook failed on this device
            row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
        out["hooks"][name] = row
    # the course's PowerSGD against torch's, on CUDA, one bucket (where torch's runs), every step's parameters
    cfg = replace(base, hook="powersgd", record_params=True, device=device_kind)
    mine, theirs = spawn(train_several, 2, [cfg, replace(cfg, hook="torch_powersgd")], backend="gloo",
                         timeout_s=120)[0]
    out["course_vs_torch_powersgd"] = {
        "steps": len(mine.params), "max_rel": _max_rel(mine.params, theirs.params),
        "compressed": mine.compression_stats[0] > 2}
    try:
        gpu = spawn(sharded_cuda, 2, device_kind, backend="gloo", timeout_s=180)
        cpu = spawn(sharded_cuda, 2, "cpu", backend="gloo", timeout_s=180)
        out["sharding"] = {}
        for key in gpu[0]:
            names = list(gpu[0][key]["params"])
            mine, other = gpu[0][key]["params"], gpu[1][key]["params"]
            row = {"ranks_identical": all(torch.equal(mine[n], other[n]) for n in names),
                   "max_rel_vs_cpu": _max_rel([gpu[0][key]["params"][n] for n in names],
                                              [cpu[0][key]["params"][n] for n in names])}
            for k in ("ledger", "cuda_allocated_bytes", "cuda_peak_bytes"):
                if k in gpu[0][key]:
                    row[k] = gpu[0][key][k]
            out["sharding"][key] = row
    except Exception as e:  # noqa: BLE001
        out["sharding"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
    try:
        gpu = spawn(local_sgd_cuda, 2, device_kind, backend="gloo", timeout_s=120)
        cpu = spawn(local_sgd_cuda, 2, "cpu", backend="gloo", timeout_s=120)
        out["local_sgd"] = {
            "averager_max_error": max(g["averager_max_error"] for g in gpu),
            "diloco_ranks_identical": all(torch.equal(a, b)
                                          for a, b in zip(gpu[0]["diloco_params"], gpu[1]["diloco_params"])),
            "diloco_max_rel_vs_cpu": _max_rel(gpu[0]["diloco_params"], cpu[0]["diloco_params"])}
    except Exception as e:  # noqa: BLE001
        out["local_sgd"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
    return out


def _matrices(shapes):
    return [(s[0], math.prod(s[1:])) for s in shapes if len(s) > 1]


def timings(device, quick):
    """Section 3a-b: the SVD against power iteration, and each compressor's encode + decode."""
    out = {}
    square = [(256, 256), (512, 512)] if quick else [(1024, 1024), (4096, 4096)]
    out["square"] = time_methods(square, rank=2, repeats=5, device=device)
    # ResNet-18's layers (for CIFAR-10, as the PowerSGD paper trains it), every matrix once
    g = torch.Generator().manual_seed(0)
    shapes = [s for _, s in resnet18_cifar_shapes()]
    mats = [torch.randn(n, m, generator=g).to(device) for n, m in _matrices(shapes)]
    if quick:
        mats = mats[:4]
    rn = {"matrices": len(mats), "numbers": sum(M.numel() for M in mats), "what": "random matrices of its shapes"}
    rn["svd_s"] = median_seconds(lambda: [torch.linalg.svd(M, full_matrices=False) for M in mats], 3,
                                 once_above_s=1.0, device=device)
    rn["svd_lowrank_s"] = median_seconds(lambda: [torch.svd_lowrank(M, q=2, niter=2) for M in mats], 5, device=device)
    for batched in (False, True):
        state = powersgd.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2,
                                       batch_tensors_with_same_shape=batched)
        grads = [M.clone() for M in mats]
        key = "powersgd_step_batched_s" if batched else "powersgd_step_s"
        rn[key] = median_seconds(lambda state=state, grads=grads: powersgd.compress_on_one_process(state, grads), 10,
                                 warmup=2, device=device)
    out["resnet18"] = rn
    # each compressor, per tensor as the hooks compress, on notebook 12's model's gradient
    numels = [p.numel() for p in mlp(hidden=1024, depth=2, n_in=512).parameters()]
    grad = torch.randn(sum(numels), generator=g).to(device)
    rows = []
    for inner in (C.FP16(), C.BF16(), C.TopK(0.01), C.RandomK(0.01), C.QSGD(15), C.SignSGD(), C.TernGrad()):
        c = C.PerTensor(inner, numels) if not inner.variable_size else inner
        try:
            seconds = median_seconds(lambda c=c: c.decompress(*c.compress(grad)), 20, warmup=3, device=device)
            rows.append({"compressor": repr(inner), "encode_decode_s": seconds})
        except Exception as e:  # noqa: BLE001
            rows.append({"compressor": repr(inner), "error": f"{type(e).__name__}: {e}"[:300]})
    mats = [torch.randn(p.shape, generator=g).to(device) for p in mlp(hidden=1024, depth=2, n_in=512).parameters()]
    for r in (1, 2, 4):
        state = powersgd.PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2)
        grads = [M.clone() for M in mats]
        seconds = median_seconds(lambda state=state, grads=grads: powersgd.compress_on_one_process(state, grads), 20,
                                 warmup=3, device=device)
        rows.append({"compressor": f"PowerSGD rank {r} (without error feedback)", "encode_decode_s": seconds})
    out["codecs"] = {"numel": sum(numels), "per_tensor": True, "rows": rows}
    # one training step of that ResNet-18 on 128 CIFAR-sized images (fp32, SGD with momentum), one worker
    try:
        net = resnet18_cifar().to(device)
        shapes_ok = [(n, tuple(p.shape)) for n, p in net.named_parameters()] == resnet18_cifar_shapes()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        batch = 16 if quick else 128
        images = torch.randn(batch, 3, 32, 32, generator=g).to(device)
        labels = torch.arange(batch).remainder(10).to(device)

        def train_step():
            opt.zero_grad()
            F.cross_entropy(net(images), labels).backward()
            opt.step()

        out["resnet18_step"] = {"batch": batch, "shapes_match_course_lib": shapes_ok,
                                "seconds": median_seconds(train_step, 3 if quick else 20, warmup=3, device=device)}
    except Exception as e:  # noqa: BLE001
        out["resnet18_step"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    # one kernel launch: a tiny in-place add, 2000 times back to back
    x = torch.zeros(1, device=device)
    out["launch_s"] = median_seconds(lambda: [x.add_(1) for _ in range(2000)], 5, device=device) / 2000
    return out


def training_step(backend, quick):
    """Section 3c: one training step's computation of notebook 12's model per hook, on one worker (its
    all-reduces then move nothing), three rounds, hooks taking turns; and the kernels each launches."""
    bench = replace(BENCH, steps=12) if quick else BENCH
    rounds = 1 if quick else 3
    every = BENCH_HOOKS | OTHER_HOOKS
    configs = [replace(bench, **h) for _ in range(rounds) for h in every.values()]
    runs = spawn(train_several, 1, configs, backend=backend, timeout_s=300)[0]
    out = {}
    for i, name in enumerate(every):
        mine = runs[i :: len(every)]
        sent = mine[0].collectives_per_step(8, bench.steps)
        out[name] = {"compute_s": statistics.median(statistics.median(r.step_time_s[8:]) for r in mine),
                     "rounds_s": [statistics.median(r.step_time_s[8:]) for r in mine],
                     "collectives": len(sent), "bytes": round(sum(b for _, b in sent))}
    profiled = spawn(profile_steps, 1, [replace(bench, **h) for h in every.values()], backend=backend,
                     timeout_s=300)[0]
    for name, prof in zip(every, profiled):
        out[name] |= prof
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="where the results go (default: benchmarks/results/gpu_check.json; in a dry "
                                   "run, build/gpu_check_dry_run.json, so that it never replaces a GPU's results)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: every section on the CPU over gloo, small sizes")
    args = ap.parse_args(argv)
    if args.out is None:
        here = os.path.dirname(os.path.abspath(__file__))
        args.out = (os.path.join(here, "..", "build", "gpu_check_dry_run.json") if args.dry_run
                    else os.path.join(here, "results", "gpu_check.json"))
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible: this script checks the GPU paths. Use --dry-run to check the script on a CPU.")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    backend, device_kind = ("gloo", "cpu") if args.dry_run else ("nccl", "cuda")
    results = {"what": "benchmarks/gpu_check.py: the GPU paths run on a GPU (issue 46)", "dry_run": args.dry_run,
               "environment": environment(device), "sections": {}}
    sections = {"1 NCCL, world size 1": lambda: nccl_world_one(backend, args.dry_run),
                "2 CUDA tensors over gloo, 2 ranks": lambda: cuda_over_gloo(device_kind, args.dry_run),
                "3 timings": lambda: timings(device, args.dry_run),
                "3 training step": lambda: training_step(backend, args.dry_run)}
    for name, run in sections.items():
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results["sections"][name] = {"ok": True, **run()}
        except Exception as e:  # noqa: BLE001 -- recorded, and the other sections still run
            traceback.print_exc()
            results["sections"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000],
                                         "traceback": traceback.format_exc()[-2000:]}
        results["sections"][name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"   {results['sections'][name]['seconds']} s, ok={results['sections'][name]['ok']}", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    print(json.dumps(results, indent=1, default=str)[:20000])


if __name__ == "__main__":
    main()
