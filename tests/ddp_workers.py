"""DDP workers for the hook tests (spawn sends functions by name, so they live in a module)."""

import copy
import pickle
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks, powersgd
from course_lib.lowrank import orthogonalize_
from course_lib.train import TrainConfig, ddp_train
from course_lib.utils.digits import mlp


def seed_usages(rank, world_size):
    """The usages from torch's documentation, written exactly so."""
    out = {}
    usages = {
        "hook": hooks.bf16_compress_hook,
        "wrapper": hooks.bf16_compress_wrapper(hooks.allreduce_hook),
        "fp16_hook": hooks.fp16_compress_hook,
        "fp16_wrapper": hooks.fp16_compress_wrapper(hooks.allreduce_hook),
    }
    for name, hook in usages.items():
        ddp_model = DDP(mlp(seed=0))
        ddp_model.register_comm_hook(ddp_model.process_group, hook)
        x = torch.full((4, 64), float(rank + 1))
        ddp_model(x).sum().backward()
        out[name] = [p.grad.clone() for p in ddp_model.parameters()]
    return out


def nan_on_rank_one(rank, world_size):
    model = DDP(mlp(seed=0))
    state = powersgd.PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    for step in range(4):
        model.zero_grad()
        loss = model(torch.ones(4, 64)).sum()
        if step == 3 and rank == 1:
            loss = loss * float("nan")
        loss.backward()
    return state.iter


def one_compressed_step(rank, world_size, rank_r):
    """Bytes the hook sends on a compressed step, and the layer shapes to check them against."""
    model = DDP(mlp(hidden=64, seed=0))
    state = powersgd.PowerSGDState(matrix_approximation_rank=rank_r, start_powerSGD_iter=2)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    sent = []
    for _ in range(3):
        hooks.traffic.reset()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        sent.append(hooks.traffic.snapshot())
    return {"sent": sent, "shapes": [tuple(p.shape) for p in model.parameters()], "stats": state.compression_stats()}


def batched_and_torch_batched(rank, world_size):
    cfg = TrainConfig(steps=12, start_powerSGD_iter=3, matrix_approximation_rank=2, hidden=128, bucket_cap_mb=0.05,
                      lr=0.3)
    ours = ddp_train(rank, world_size, replace(cfg, hook="batched_powersgd"))
    try:
        ddp_train(rank, world_size, replace(cfg, hook="torch_batched_powersgd"))
        theirs = "ran"
    except Exception as e:  # torch's batched hook: AssertionError in _orthogonalize
        theirs = type(e).__name__
        dist.barrier()
    return ours, theirs


def hook_against_error_feedback_step(rank, world_size):
    """A warm-started compressed step of powerSGD_hook on one weight matrix, beside
    error feedback and PowerSGD's compression written out here with plain ``@``."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 12, bias=False))
    state = powersgd.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=0)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):  # iterations 0-1 all-reduce, 2 starts PowerSGD from fresh noise, 3 is warm
        x = torch.randn(8, 16, generator=g)  # each rank its own data: different gradients
        local = copy.deepcopy(model.module)
        local(x).square().sum().backward()
        error, q = state.error_dict.get(0), state.q_memory_dict.get(0)
        error, q = (None, None) if error is None else (error.clone(), q.clone())
        model.zero_grad()
        model(x).square().sum().backward()

    def compress(m):
        q0 = orthogonalize_(q.clone())
        p = m @ q0
        dist.all_reduce(p)
        orthogonalize_(p)
        qt = p.T @ m
        dist.all_reduce(qt)
        return p @ (qt / world_size)

    # error feedback written out (not powersgd.error_feedback_step): add what was left out, send, keep the rest
    corrected = local.weight.grad + error.view(12, 16)
    sent = compress(corrected)
    new_error = corrected - sent
    return {"hook_sent": model.module.weight.grad.clone(), "hook_error": state.error_dict[0].view(12, 16).clone(),
            "sent": sent, "error": new_error}


def compressed_step_counts(rank, world_size, settings):
    """For each ``(hook module, r, min_compression_rate, use_error_feedback, warm_start)``: a small
    conv net (a 4-d weight, a matrix, two vectors) in one bucket, two all-reduced steps, then one
    compressed step. What the step sent (``hooks.traffic``, the course's hook only), the state's
    compression statistics, and the numbers its memory keeps afterwards."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    out = []
    for which, r, rate, error_feedback, warm_start in settings:
        module = powersgd if which == "course" else torch_psgd
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Conv2d(3, 6, 3), nn.Flatten(), nn.Linear(96, 10)))
        state = module.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                     min_compression_rate=rate, use_error_feedback=error_feedback,
                                     warm_start=warm_start)
        model.register_comm_hook(state, module.powerSGD_hook)
        x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            hooks.traffic.reset()
            model.zero_grad()
            model(x).square().sum().backward()
        memory = sum(t.numel() for d in (state.error_dict, state.q_memory_dict) for t in d.values())
        p_memory = sum(t.numel() for t in getattr(state, "p_memory_dict", {}).values())  # torch's P buffers
        out.append({"shapes": [tuple(p.shape) for p in model.parameters()], "sent": hooks.traffic.snapshot(),
                    "stats": tuple(state.compression_stats()[1:]), "memory": memory, "p_memory": p_memory})
    return out


def mean_error_recorded(rank, world_size):
    """A short PowerSGD run of ``ddp_train``, with the hook's state caught on the way out: the
    recorded error norms, and this rank's final error buffers, to average in the test."""
    import course_lib.train as T

    caught = {}
    make_hook = T.make_hook

    def catching(config, process_group=None):
        state, hook = make_hook(config, process_group)
        caught["state"] = state
        return state, hook

    T.make_hook = catching
    try:
        cfg = TrainConfig(hook="powersgd", steps=10, start_powerSGD_iter=3, matrix_approximation_rank=1, hidden=32,
                          lr=0.1, seed=1, record_error_memory=True)
        out = ddp_train(rank, world_size, cfg)
    finally:
        T.make_hook = make_hook
    errors = caught["state"].error_dict
    # the same run, not asked to record the memory
    unrecorded = ddp_train(rank, world_size, replace(cfg, record_error_memory=False))
    return {"result": out, "errors": {k: errors[k].clone() for k in errors}, "unrecorded": unrecorded}


def error_identity(rank, world_size, steps=6):
    """The course's hook on one weight matrix, each rank its own data, the weights fixed: after each
    step, this rank's gradient before the hook (computed on a copy) and its error buffer."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 12, bias=False))
    state = powersgd.PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    g = torch.Generator().manual_seed(rank)
    grads, errors = [], []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        local = copy.deepcopy(model.module)
        local(x).square().sum().backward()
        grads.append(local.weight.grad.clone())
        model.zero_grad()
        model(x).square().sum().backward()
        errors.append(state.error_dict[0].view(12, 16).clone() if 0 in state.error_dict else torch.zeros(12, 16))
    return {"grads": grads, "errors": errors}


def torch_hook_on_cpu_with_a_gpu_visible(rank, world_size):
    """torch's layer-wise PowerSGD hook on CPU tensors where ``torch.cuda.is_available()`` says True, as
    on a machine with a GPU: the losses of a few compressed steps."""
    torch.cuda.is_available = lambda: True
    cfg = TrainConfig(hook="torch_powersgd", steps=6, start_powerSGD_iter=2, hidden=32, eval_every=100)
    return ddp_train(rank, world_size, cfg).loss


def pickled_powersgd_state(rank, world_size):
    """A PowerSGDState over a subgroup, pickled and unpickled: which group the copy has."""
    pair = dist.new_group([0, 1])
    state = powersgd.PowerSGDState(process_group=pair, start_powerSGD_iter=2)
    copy_ = pickle.loads(pickle.dumps(state))
    return {"default": copy_.process_group is dist.group.WORLD, "size": copy_.process_group.size()}
