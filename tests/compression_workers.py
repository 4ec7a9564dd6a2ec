"""Workers for tests/test_compression.py (spawn sends functions by name, so they live in a module)."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import compression as C
from course_lib import hooks

COMPRESSORS = {
    "topk": lambda: C.TopK(0.1),
    "randomk": lambda: C.RandomK(0.2, seed=7),
    "threshold": lambda: C.Threshold(0.05),
    "qsgd": lambda: C.QSGD(4),
    "sign": lambda: C.SignSGD(),
    "sign_majority": lambda: C.SignSGD("majority"),
    "terngrad": lambda: C.TernGrad(),
    "fp16": lambda: C.FP16(),
    "bf16": lambda: C.BF16(),
}


def one_step_against_a_reference(rank, world_size, name):
    """One backward through DDP with compression_hook (no memory yet: the first step), beside a
    reference computed without the hook: every rank's plain local gradient, gathered with a plain
    all_gather, each compressed by a fresh compressor of the same seed, decompressed and averaged."""
    torch.manual_seed(0)
    net = nn.Linear(20, 10)
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank))
    local = copy.deepcopy(net)
    local(x).square().mean().backward()
    flat = torch.cat([p.grad.flatten() for p in local.parameters()])  # one bucket, in parameter order
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)

    make = COMPRESSORS[name]
    compressor = make()
    payloads = [make().compress(g) for g in everyone]
    if name == "sign_majority":
        votes = sum(compressor.signs(p, ctx) for p, ctx in payloads)
        reference = sum(p[0] for p, _ in payloads) / world_size * torch.sign(votes)
    else:
        reference = sum(compressor.decompress(p, ctx) for p, ctx in payloads) / world_size

    model = DDP(net)
    model.register_comm_hook(C.CompressionState(compressor), C.compression_hook)
    hooks.traffic.reset()
    model(x).square().mean().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    kept = [p[0].numel() for p, _ in payloads]
    return {"got": got, "reference": reference, "bytes": hooks.traffic.bytes, "kept": kept, "numel": flat.numel()}


def train_and_compare_ranks(rank, world_size, names, steps=6):
    """A few SGD steps of a two-layer net with each compressor (error feedback where the state's
    default gives it), with small buckets; each rank's final parameters, flat."""
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), bucket_cap_mb=0.001)
        model.register_comm_hook(C.CompressionState(COMPRESSORS[name]()), C.compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
        out[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return out


def dgc_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def dgc_batch(step, rank):
    """The inputs of one rank at one step (the test's reference draws the same)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train_dgc(rank, world_size, steps, lr, state_kwargs):
    """SGD (momentum 0: DGC's momentum lives in the hook) through DDP with dgc_state (or, with
    ``state_kwargs={"topk": ratio}``, plain top-k with ErrorFeedback); the flat parameters after every step."""
    model = DDP(dgc_net())
    if "topk" in state_kwargs:
        state = C.CompressionState(C.TopK(state_kwargs["topk"]), memory=C.ErrorFeedback())
    else:
        state = C.dgc_state(**state_kwargs)
    model.register_comm_hook(state, C.compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    trajectory = []
    for step in range(steps):
        x, y = dgc_batch(step, rank)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return {"trajectory": trajectory, "iteration": state.iteration, "codec_s": state.codec_s}
