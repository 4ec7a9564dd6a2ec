"""Workers for tests/test_compression.py (spawn sends functions by name, so they live in a module)."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import compression, hooks, memory
from course_lib import compressors as C

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
    """One backward through DDP with compression_hook (no memory yet: the first step). Returned beside
    it, for the test to build its reference from first principles: every rank's plain local gradient
    (computed without DDP, gathered with a plain all_gather) and, for the 16-bit casts, the gradient
    torch's own ``fp16_compress_hook`` / ``bf16_compress_hook`` give on the same step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    net = nn.Linear(20, 10)
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank))
    local = copy.deepcopy(net)
    local(x).square().mean().backward()
    flat = torch.cat([p.grad.flatten() for p in local.parameters()])  # one bucket, in parameter order
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)

    model = DDP(copy.deepcopy(net))
    # the bucket whole (per tensor: per_tensor_against_a_reference); what is checked here is the exchange
    model.register_comm_hook(compression.CompressionState(COMPRESSORS[name](), per_tensor=False),
                             compression.compression_hook)
    torch.manual_seed(100 + rank)  # the ranks' own random streams differ: shared draws must come from the seed
    hooks.traffic.reset()
    model(x).square().mean().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    out = {"got": got, "everyone": everyone, "bytes": hooks.traffic.bytes}
    if name in ("fp16", "bf16"):
        torch_hook = getattr(default_hooks, f"{name}_compress_hook")

        def under_another_name(state, bucket):  # DDP refuses the bf16 hook by name off NCCL; gloo runs it
            return torch_hook(state, bucket)

        theirs = DDP(copy.deepcopy(net))
        theirs.register_comm_hook(None, under_another_name)
        theirs(x).square().mean().backward()
        out["torch_hook"] = torch.cat([p.grad.flatten() for p in theirs.parameters()])
    return out


def train_and_compare_ranks(rank, world_size, names, steps=6):
    """A few SGD steps of a two-layer net with each compressor (error feedback where the state's
    default gives it), with small buckets; each rank's final parameters, flat."""
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), bucket_cap_mb=0.001)
        model.register_comm_hook(compression.CompressionState(COMPRESSORS[name]()), compression.compression_hook)
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
        state = compression.CompressionState(C.TopK(state_kwargs["topk"]), memory=memory.ErrorFeedback())
    else:
        state = compression.dgc_state(**state_kwargs)
    model.register_comm_hook(state, compression.compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    trajectory = []
    for step in range(steps):
        x, y = dgc_batch(step, rank)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return {"trajectory": trajectory, "iteration": state.iteration, "codec_s": state.codec_s}


# --- compression per tensor, checked against each paper's formula written out by hand -----------------

def _sign_ref(g, u):  # signSGD with one scale per tensor: its mean magnitude
    return torch.where(g >= 0, 1.0, -1.0) * g.abs().mean()


def _terngrad_ref(g, u):  # TernGrad: clip to 2.5 population standard deviations, then ±max or 0 at random
    c = 2.5 * torch.std(g, unbiased=False)
    g = g.clamp(-c.item(), c.item())
    s = g.abs().max()
    return torch.where(u < g.abs() / s, torch.sign(g) * s, torch.zeros_like(g))


def _qsgd_ref(g, u, levels=15, bucket=128):  # QSGD: a norm per 128 entries, levels rounded at random
    out = torch.empty_like(g)
    for start in range(0, g.numel(), bucket):
        x, r = g[start: start + bucket], u[start: start + bucket]
        norm = torch.linalg.vector_norm(x)
        out[start: start + bucket] = norm * torch.sign(x) * torch.floor(x.abs() / norm * levels + r) / levels
    return out


PER_TENSOR = {
    "sign": (lambda: C.SignSGD(), _sign_ref),
    "sign_majority": (lambda: C.SignSGD("majority"), _sign_ref),
    "terngrad": (lambda: C.TernGrad(), _terngrad_ref),
    "qsgd": (lambda: C.QSGD(15), _qsgd_ref),
}


def per_tensor_against_a_reference(rank, world_size, name):
    """One backward of a two-layer net (four tensors of different scales, one bucket) through the
    hook, per tensor (the default) and with one scale for the whole bucket; beside the reference:
    each rank's gradient of each parameter compressed by the formula above, with the uniform numbers
    a generator of the compressor's seed gives, parameter after parameter, then averaged (majority
    vote: the sign of the summed signs times the mean of the ranks' scales)."""
    make, formula = PER_TENSOR[name]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[2].bias.mul_(30)  # a bias far larger than the weights: one shared scale would misfit it
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank))
    local = copy.deepcopy(net)
    (local(x) * torch.arange(1.0, 5.0)).square().mean().backward()
    numels = [p.numel() for p in local.parameters()]
    grads = [p.grad.flatten().clone() for p in local.parameters()]
    gathered = [[torch.empty_like(g) for _ in range(world_size)] for g in grads]
    for out, g in zip(gathered, grads):
        dist.all_gather(out, g)
    everyone = [[gathered[i][r] for i in range(len(grads))] for r in range(world_size)]
    per_rank = []
    for grads in everyone:
        gen = torch.Generator().manual_seed(0)  # the compressor's default seed; draws in parameter order
        per_rank.append([formula(g, torch.rand(g.shape, generator=gen)) for g in grads])
    if name == "sign_majority":
        parts = [torch.sign(sum(torch.sign(p[i]) for p in per_rank)) * sum(p[i].abs() for p in per_rank) / world_size
                 for i in range(len(numels))]
    else:
        parts = [sum(p[i] for p in per_rank) / world_size for i in range(len(numels))]
    reference = torch.cat(parts)

    got = {}
    for per_tensor in (True, False):
        model = DDP(copy.deepcopy(net))
        model.register_comm_hook(compression.CompressionState(make(), per_tensor=per_tensor),
                                 compression.compression_hook)
        hooks.traffic.reset()
        (model(x) * torch.arange(1.0, 5.0)).square().mean().backward()
        got[per_tensor] = (torch.cat([p.grad.flatten() for p in model.parameters()]), hooks.traffic.bytes)
    return {"per_tensor": got[True][0], "whole": got[False][0], "reference": reference, "bytes": got[True][1],
            "numels": numels}


def bytes_on_the_wire(rank, world_size, names, dtype, n):
    """For each compressor: the bytes this rank handed the counted collectives to exchange one tensor
    of ``n`` entries of ``dtype`` (summed over ops, from ``hooks.traffic.by_op``), what ``wire_bytes``
    promises for it, and the bytes of the sizes a variable-size payload gathers first (one int64)."""
    from course_lib import exchange

    out = {}
    for name in names:
        compressor = COMPRESSORS[name]()
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)  # the same on both ranks
        payload, ctx = compressor.compress(x)
        hooks.traffic.reset()
        exchange.communicate(compressor, payload, ctx, communicator="all_reduce" if compressor.summable
                             else "all_gather")
        counted = sum(b for _, b in hooks.traffic.by_op.values())
        kept = [len(payload[0])] if compressor.variable_size else []
        out[name] = (counted, compressor.wire_bytes(n, *kept, dtype=dtype), 8 if compressor.variable_size else 0)
    return out

