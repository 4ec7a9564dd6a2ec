"""Data-parallel training on the digits with a choice of communication hook.

One worker, three ways to start it:

* from a notebook or a test: ``launch.spawn(ddp_train, world_size, config)``;
* from the command line on one machine: ``torchrun --nproc-per-node 2 -m course_lib.train --hook powersgd``;
* across machines: ``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d
  --rdzv-endpoint HOST:29400 -m course_lib.train --hook powersgd --rank 2`` on each node.

Every rank trains on its own slice of each global batch; the hook decides what crosses the network.
"""

import argparse
import io
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks, powersgd
from course_lib.digits import digits_tensors, mlp
from course_lib.launch import init_from_env, report_progress

__all__ = ["HOOKS", "make_hook", "ddp_train", "train_several", "bucket_layouts", "main"]

HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "torch_powersgd", "torch_batched_powersgd",
         "noop")


def make_hook(name: str, rank: int = 2, start_iter: int = 10, error_feedback: bool = True, warm_start: bool = True,
              seed: int = 0, process_group=None):
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``."""
    if name == "allreduce":
        return process_group, hooks.allreduce_hook
    if name == "fp16":
        return process_group, hooks.fp16_compress_hook
    if name == "bf16":
        return process_group, hooks.bf16_compress_hook
    if name == "noop":
        return None, hooks.noop_hook
    kwargs = dict(process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                  use_error_feedback=error_feedback, warm_start=warm_start, random_seed=seed)
    if name in ("powersgd", "batched_powersgd"):
        hook = powersgd.powerSGD_hook if name == "powersgd" else powersgd.batched_powerSGD_hook
        return powersgd.PowerSGDState(**kwargs), hook
    if name in ("torch_powersgd", "torch_batched_powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

        # torch's state logs a warning on every pickling, in every rank: noise in a notebook
        logging.getLogger(torch_psgd.__name__).setLevel(logging.ERROR)

        hook = torch_psgd.powerSGD_hook if name == "torch_powersgd" else torch_psgd.batched_powerSGD_hook
        return torch_psgd.PowerSGDState(**kwargs), hook
    raise ValueError(f"unknown hook {name!r}: use one of {HOOKS}")


def _device_for(rank: int) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ddp_train(rank: int, world_size: int, config: dict) -> dict:
    """Worker: train the digits MLP under DDP with ``config['hook']``; the curves and the bytes sent.

    ``config`` keys (all optional): hook, rank, start_iter, error_feedback, warm_start, steps,
    batch_size (global), lr, momentum, hidden, depth, n_in, bucket_cap_mb, seed, eval_every,
    record_params (parameters after every step, for comparisons), and resume_at: at that step,
    checkpoint model, optimizer and hook state with ``torch.save``, then continue with a *new* DDP
    model, optimizer and hook state loaded from it, as a restarted job would.
    """
    c = dict(hook="allreduce", rank=2, start_iter=10, error_feedback=True, warm_start=True, steps=100,
             batch_size=64, lr=0.1, momentum=0.0, hidden=64, depth=2, n_in=64, bucket_cap_mb=25, seed=0,
             eval_every=10, record_params=False, resume_at=None)
    unknown = set(config) - set(c)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(c)}")
    c.update(config)
    if c["batch_size"] % world_size:
        raise ValueError(f"batch_size {c['batch_size']} must be divisible by world_size {world_size}")
    device = _device_for(rank)
    x_train, y_train, x_test, y_test = (t.to(device) for t in digits_tensors(seed=0))
    if c["n_in"] != 64:  # wider inputs for benchmarks: the digits, tiled
        reps = -(-c["n_in"] // 64)
        x_train, x_test = x_train.repeat(1, reps)[:, : c["n_in"]], x_test.repeat(1, reps)[:, : c["n_in"]]

    def build(checkpoint=None):
        net = mlp(hidden=c["hidden"], depth=c["depth"], seed=c["seed"], n_in=c["n_in"]).to(device)
        if checkpoint is not None:
            net.load_state_dict(checkpoint["model"])
        model = DDP(net, bucket_cap_mb=c["bucket_cap_mb"])
        if checkpoint is None:
            state, hook = make_hook(c["hook"], c["rank"], c["start_iter"], c["error_feedback"], c["warm_start"],
                                    c["seed"])
        else:
            state, hook = checkpoint["hook_state"], make_hook(c["hook"])[1]
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=c["momentum"])
        if checkpoint is not None:
            opt.load_state_dict(checkpoint["optimizer"])
        return model, state, opt

    model, state, opt = build()
    per_rank = c["batch_size"] // world_size
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(c["seed"])).to(device)
    out = {"loss": [], "bytes": [], "test_step": [], "test_accuracy": [], "test_loss": [], "params": [],
           "step_time_s": [], "error_norm": []}
    hooks.traffic.reset()
    for step in range(c["steps"]):
        if step == c["resume_at"]:
            # The hook state is pickled whole, as torch's documentation shows for its PowerSGDState
            # (the process group is left out; torch.load needs weights_only=False for it).
            buf = io.BytesIO()
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "hook_state": state}, buf)
            del model, state, opt
            buf.seek(0)
            model, state, opt = build(torch.load(buf, weights_only=False))
        start = (step * c["batch_size"]) % (len(x_train) - c["batch_size"] + 1)
        idx = order[start + rank * per_rank : start + (rank + 1) * per_rank]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["step_time_s"].append(time.perf_counter() - t0)
        # the loss of the global batch: average over ranks (not counted as hook traffic)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        out["loss"].append(avg.item() / world_size)
        out["bytes"].append(hooks.traffic.bytes)
        errors = getattr(state, "error_dict", None)
        if errors is not None:  # the error-feedback memory (ours per parameter, torch's per bucket)
            out["error_norm"].append(sum(e.double().square().sum().item() for e in errors.values()) ** 0.5)
        if c["record_params"]:
            out["params"].append(torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu())
        report_progress()
        if (step + 1) % c["eval_every"] == 0 or step + 1 == c["steps"]:
            with torch.no_grad():
                logits = model.module(x_test)
                out["test_step"].append(step + 1)
                out["test_accuracy"].append((logits.argmax(1) == y_test).float().mean().item())
                out["test_loss"].append(nn.functional.cross_entropy(logits, y_test).item())
    out["final_params"] = [p.detach().cpu().clone() for p in model.module.parameters()]
    if hasattr(state, "compression_stats"):
        out["compression_stats"] = state.compression_stats()
    return out


def train_several(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """Worker: :func:`ddp_train` once per config, one after another in the same processes
    (starting processes costs seconds; a notebook experiment starts them once)."""
    return [ddp_train(rank, world_size, c) for c in configs]


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


def main(argv=None) -> None:
    """``torchrun ... -m course_lib.train --hook powersgd --rank 2``: train, print a summary on rank 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hook", choices=HOOKS, default="allreduce")
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD's matrix approximation rank")
    ap.add_argument("--start-iter", type=int, default=10, help="plain all-reduce before this step")
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args(argv)
    rank, world_size, _ = init_from_env(args.backend)
    try:
        out = ddp_train(rank, world_size, dict(hook=args.hook, rank=args.rank, start_iter=args.start_iter,
                                               error_feedback=not args.no_error_feedback, steps=args.steps,
                                               batch_size=args.batch_size, lr=args.lr, hidden=args.hidden))
        if rank == 0:
            print(f"hook={args.hook} world_size={world_size} backend={dist.get_backend()} steps={args.steps}")
            print(f"final train loss {out['loss'][-1]:.4f}, test accuracy {out['test_accuracy'][-1]:.4f}, "
                  f"gradient bytes sent per rank {out['bytes'][-1]}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
