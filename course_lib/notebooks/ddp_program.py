"""Notebook 04's programs: torch's DDP in plain sight, ranks under torchrun, groups and timeouts.

``ddp_program`` is a complete data-parallel program written only with torch: it joins the group
itself, wraps the model in ``DistributedDataParallel``, registers a communication hook, trains and
leaves. ``torch.multiprocessing.spawn`` starts it; ``course_lib.launch.spawn`` starts
``train_steps``, its middle part, in a group already joined. Run as a script under ``torchrun``
(``python -m course_lib.notebooks.ddp_program``), this module prints the ranks torchrun gave it.
``one_step_gradients`` and ``check_gradient`` test communication hooks: a hook is right when the
gradient it leaves after one backward is the whole batch's, computed in one process, to within
the rounding of the hook's precision. ``bucket_layouts`` shows the buckets DDP hands its hook.
"""

import datetime
import gc
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks
from course_lib.train import TrainConfig, make_hook
from course_lib.utils.digits import batch_slice, digits_tensors, mlp

__all__ = ["train_steps", "ddp_program", "fail_on_rank_one", "torch_bf16_refusal", "ddp_accepts_bf16_hook",
           "torch_fp16_wrapped_allreduce_hook", "one_step_gradients",
           "TOLERANCE", "relative_error", "check_gradient", "bucket_layouts", "subgroup_and_timeout", "print_ranks",
           "two_node_torchrun"]


def train_steps(rank: int, world_size: int, steps: int = 20) -> dict:
    """Worker (in a joined group): DDP on the digits MLP, a hook registered, ``steps`` SGD steps."""
    # one node: the rank is also the local rank, the GPU to take (on several nodes: LOCAL_RANK)
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = mlp(seed=rank).to(device)  # a different init on every rank: DDP broadcasts rank 0's
    ddp_model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)
    ddp_model.register_comm_hook(ddp_model.process_group, hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    x, y, _, _ = (t.to(device) for t in digits_tensors(seed=0))
    for step in range(steps):
        rows = batch_slice(step, 64, len(x), rank, world_size)  # this rank's half of the global batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp_model(x[rows]), y[rows])
        loss.backward()  # DDP's hooks all-reduce the gradients during backward
        opt.step()
    return {"rank": rank, "loss": loss.item(), "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def ddp_program(rank: int, world_size: int, out_dir: str) -> None:
    """The whole program, for ``torch.multiprocessing.spawn(ddp_program, args=(world_size, out_dir),
    nprocs=world_size)``: mp.spawn passes the process index as ``rank`` and returns nothing, so each
    rank saves its result to a file."""
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"  # one GPU per process, or CPUs
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before the first collective: NCCL binds to the current device
    # The ranks meet through a file that none of them has to host. With tcp://127.0.0.1:PORT, rank 0
    # listens on a port chosen beforehand, and until it does, another program can take that port or
    # (on Linux) a rank's connection attempt can connect to itself.
    rendezvous = "file://" + os.path.join(out_dir, "rendezvous")
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size)
    result = train_steps(rank, world_size)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    gc.collect()  # free the DDP model (a reference cycle) while the group lives: at exit, gloo can abort
    dist.barrier()
    dist.destroy_process_group()


def fail_on_rank_one(rank: int, world_size: int) -> None:
    """For ``torch.multiprocessing.spawn``: rank 1 raises, the others wait a little."""
    if rank == 1:
        raise ValueError("rank 1 found a bad batch")
    time.sleep(2)


def torch_bf16_refusal(rank: int, world_size: int) -> str:
    """Worker: what DDP says when torch's own ``bf16_compress_hook`` is registered on a CPU build."""
    ddp_model = DDP(mlp(seed=0))
    try:
        ddp_model.register_comm_hook(ddp_model.process_group, default_hooks.bf16_compress_hook)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def ddp_accepts_bf16_hook() -> bool:
    """Whether DDP's ``register_comm_hook`` accepts torch's ``bf16_compress_hook`` on this torch build:
    the test of ``DistributedDataParallel._check_comm_hook``, mirrored. It asks how torch was built
    (CUDA or ROCm, with NCCL 2.10 or later; or XPU with XCCL), not which backend the group uses."""
    cuda_supported = torch.version.cuda is not None or torch.version.hip is not None
    try:
        nccl_supported = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except Exception:  # a build without NCCL may have no torch.cuda.nccl to ask
        nccl_supported = False
    xccl_available = getattr(dist, "is_xccl_available", lambda: False)
    xpu_xccl_supported = dist.is_available() and xccl_available() and hasattr(torch, "xpu") and torch.xpu.is_available()
    return bool((cuda_supported and nccl_supported) or xpu_xccl_supported)


def torch_fp16_wrapped_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_wrapper(allreduce_hook)``, as a module-level function so that it can be
    handed to worker processes (the wrapper returns a closure, which cannot be pickled)."""
    return default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)(state, bucket)


def one_step_gradients(rank: int, world_size: int, hooks_to_run: dict, hidden: int = 64, batch_size: int = 64,
                       seed: int = 0) -> dict:
    """Worker: for each ``name: hook`` of ``hooks_to_run``, a new DDP model (the same init on every
    rank) with that hook registered, one backward on this rank's share of a global batch, and the
    gradient DDP leaves in ``.grad`` (flat). A hook is a function ``hook(process_group, bucket)``,
    registered with the default group as its state, or a ``course_lib.train.TrainConfig`` (its
    ``make_hook`` builds the state). A hook DDP refuses to register gives the refusal's message
    (a string) instead of a gradient.

    ``"reference"`` is the gradient of the mean loss of the whole global batch, computed in this
    one process without DDP and without any communication: the average of the ranks' gradients
    that every correct hook must deliver, up to rounding.
    """
    x, y, _, _ = digits_tensors(seed=0)
    everything = slice(0, batch_size)  # rank r's share is the r-th piece of it (batch_slice, step 0)
    model = mlp(hidden=hidden, seed=seed)
    nn.functional.cross_entropy(model(x[everything]), y[everything]).backward()
    out = {"reference": torch.cat([p.grad.flatten() for p in model.parameters()])}
    mine = batch_slice(0, batch_size, len(x), rank, world_size)
    for name, hook in hooks_to_run.items():
        ddp_model = DDP(mlp(hidden=hidden, seed=seed))
        try:
            if isinstance(hook, TrainConfig):
                ddp_model.register_comm_hook(*make_hook(hook))
            else:
                ddp_model.register_comm_hook(None, hook)
        except Exception as e:  # torch's bf16 hook on a CPU build, for one
            out[name] = f"{type(e).__name__}: {e}"
            continue
        nn.functional.cross_entropy(ddp_model(x[mine]), y[mine]).backward()
        out[name] = torch.cat([p.grad.flatten() for p in ddp_model.parameters()])
    return out


# How far a hook's averaged gradient may be from the reference, relative to its norm, set by the
# dtype the hook communicates in. A 16-bit hook rounds twice (the cast of each rank's gradient and
# the sum), by at most the unit roundoff u each (2**-11 for float16, 2**-8 for bfloat16): 4u leaves
# room. float32 rounds the ranks' and the whole batch's sums in different orders: 1e-6 (about 16u);
# measured: about 1e-7. A lossy hook (PowerSGD) has no tolerance of this kind: it fails by design.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||``, in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check_gradient(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``got`` is ``reference`` to within ``TOLERANCE[dtype]`` (relative, in norm)."""
    return relative_error(got, reference) <= TOLERANCE[dtype]


def bucket_layouts(rank: int, world_size: int, hidden: int = 512, bucket_cap_mb: float = 1.0,
                   iterations: int = 2) -> list[dict]:
    """Worker: the buckets DDP hands its hook in the first ``iterations`` iterations of a new model."""
    x, y, _, _ = digits_tensors(seed=0)
    model = DDP(mlp(hidden=hidden, seed=0), bucket_cap_mb=bucket_cap_mb)
    log = hooks.BucketLog()
    model.register_comm_hook(log, hooks.logging_allreduce_hook)
    for it in range(iterations):
        before = len(log.calls)
        nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
        for call in log.calls[before:]:
            call["iteration"] = it
    return log.calls


def subgroup_and_timeout(rank: int, world_size: int, timeout_s: float = 2.0) -> dict:
    """Worker (3 or more ranks): an all-reduce in the subgroup {0, 1} only; then a collective in a group
    with a ``timeout_s`` timeout that rank 0 enters and rank 1 never does."""
    pair = dist.new_group([0, 1])  # every rank calls new_group, members or not
    t = torch.tensor([10.0**rank])  # 1, 10, 100, ...: a sum says who took part
    if rank in (0, 1):
        dist.all_reduce(t, group=pair)
    out = {"rank": rank, "after_subgroup_all_reduce": t.item()}
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=short)  # rank 1 never joins this one
            out["timeout"] = "no error"
        except RuntimeError as e:
            out["timeout_elapsed_s"] = time.monotonic() - start
            out["timeout"] = f"{type(e).__name__} after {out['timeout_elapsed_s']:.1f} s: {str(e).splitlines()[0]}"
    dist.barrier()  # rank 1 waits here, in the default group, meanwhile
    return out


def print_ranks() -> None:
    """Under torchrun: print this process's ranks as torchrun set them, after one all-reduce in the group."""
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    line = " ".join(f"{n}={os.environ[n]}" for n in names) + f" all_reduce(1)={total.item():g}\n"
    os.write(1, line.encode())  # one write: the processes of a node share one stdout
    dist.destroy_process_group()


def two_node_torchrun(port: int, nproc_per_node: int = 2, timeout_s: float = 120.0) -> tuple[list[str], list[str]]:
    """Start two ``torchrun`` "nodes" on this machine, meeting at a c10d rendezvous on 127.0.0.1:``port``,
    each running :func:`print_ranks` in ``nproc_per_node`` processes. Returns node 0's command (node 1's
    differs only in ``is_host=0``) and the lines the processes printed, sorted by RANK.

    Node 0 is told to host the rendezvous's store (``--rdzv-conf is_host=1``): left to guess, each node on
    this machine would try to, and a node whose port another program had taken would quietly connect to
    that program instead and wait. Told, it fails at once, with the port error in the RuntimeError raised
    here (see :func:`course_lib.launch.retry_if_port_taken`). If either node fails, the other is stopped."""
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                 str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "two_nodes", "--rdzv-conf", f"is_host={int(node == 0)}",
                 "-m", "course_lib.notebooks.ddp_program"] for node in range(2)]
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(os.path.join(logs, f"node{i}.out"), "w"), open(os.path.join(logs, f"node{i}.err"), "w"))
                 for i in range(2)]
        nodes = [subprocess.Popen(command, stdout=out, stderr=err, text=True)
                 for command, (out, err) in zip(commands, files)]
        deadline = time.monotonic() + timeout_s
        try:
            while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
                if any(node.poll() for node in nodes):  # one failed: the other would wait for it in vain
                    break
                time.sleep(0.1)
        finally:
            codes = [node.poll() for node in nodes]
            for node in nodes:
                node.kill()
                node.wait()
            for out, err in files:
                out.close()
                err.close()
        texts = [[open(os.path.join(logs, f"node{i}.{kind}")).read() for kind in ("out", "err")] for i in range(2)]
    if any(codes):
        taken = [f"node {i}: the port was taken (EADDRINUSE)"
                 for i, (_, err) in enumerate(texts) if "EADDRINUSE" in err]
        errors = "\n".join(taken + [err[-2000:] for _, err in texts])
        raise RuntimeError(f"torchrun exited with codes {codes} (None: still running, stopped); its output:\n{errors}")
    if None in codes:
        raise RuntimeError(f"torchrun had not finished after {timeout_s:g} s and was stopped")
    lines = [line for out, _ in texts for line in out.splitlines() if line.startswith("RANK=")]
    return commands[0], sorted(lines, key=lambda line: int(line.split()[0].split("=")[1]))


if __name__ == "__main__":
    print_ranks()
