"""Workers for tests/test_bad_input_new_modules.py: mistakes that need ranks (spawn sends functions by
name, so they live in a module). Each returns what the rank saw: the error's type and message, or what
it computed."""

import torch
from torch import nn

from course_lib import accumulation, compression, sharding
from course_lib import compressors as C


def _error(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as e:  # the test reads the type and the message
        return type(e).__name__, str(e)
    return None


def models_that_differ(rank, world_size, stage, what):
    """Each rank wraps its own model; ``what`` says how rank 1's differs from rank 0's."""
    torch.manual_seed(0)
    if what == "shapes":  # as many numbers (12) on both ranks, in other shapes
        model = nn.Sequential(nn.Linear(6, 2, bias=False) if rank == 0 else nn.Linear(4, 3, bias=False))
    elif what == "dtype":
        model = nn.Sequential(nn.Linear(4, 3)).to(torch.float64 if rank == 1 else torch.float32)
    elif what == "units":
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        return _error(lambda: sharding.ShardedDataParallel(model, stage, units=list(model) if rank else None))
    else:  # the same model: it builds
        model = nn.Sequential(nn.Linear(4, 3))
    return _error(lambda: sharding.ShardedDataParallel(model, stage))


def wrapped_twice(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 3))
    sharding.ShardedDataParallel(model, 1)
    return _error(lambda: sharding.ShardedDataParallel(model, 1))


def sharded_optimizer_state_bytes(rank, world_size):
    """This rank's share of Adam's state in a ShardedOptimizer, measured two ways."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = sharding.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)  # all of the state, on one optimizer
    model(torch.randn(4, 8)).square().mean().backward()
    plain.step()
    return accumulation.optimizer_state_bytes(opt), accumulation.optimizer_state_bytes(plain)


def density_that_is_not_a_ratio(rank, world_size):
    """A density function that returns 2 (a percentage, say): refused in the first step, on every rank,
    before any collective."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(4, 2))
    state = compression.CompressionState(C.TopK(0.5), density=lambda step: 2)
    model.register_comm_hook(state, compression.compression_hook)
    return _error(lambda: model(torch.randn(3, 4)).sum().backward())


def sharded_optimizer_bad_state_dict(rank, world_size):
    model = nn.Linear(4, 2)
    opt = sharding.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    error = _error(lambda: opt.load_state_dict(model.state_dict()))  # the model's, by mistake
    return error is not None and error[0] == "ValueError" and "'state' and 'param_groups'" in error[1]
