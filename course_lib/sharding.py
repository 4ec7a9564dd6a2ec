"""Sharded data parallelism (ZeRO-1, 2 and 3, FSDP), from scratch: hold less, send the same.

Data parallelism's all-reduce *is* a reduce-scatter followed by an all-gather. Between the two, each
rank holds the fully reduced gradient of only its own 1/p of the parameters, so it can update only
that slice, and keep only that slice's optimizer state. ZeRO (Rajbhandari et al., SC 2020) takes
this one stage at a time:

* stage 1 (ZeRO-1): the optimizer state is sharded; gradients and parameters stay whole.
* stage 2 (ZeRO-2): the gradients are sharded too: each unit's gradient is reduce-scattered as soon as
  backward has produced it, and only this rank's slice is kept.
* stage 3 (ZeRO-3, FSDP): the parameters are sharded too: each unit's are all-gathered just before its
  forward, freed after it, gathered again before its backward.

Stages 1 and 2 send what DDP sends (a reduce-scatter plus an all-gather = one all-reduce); stage 3
gathers the parameters twice, 1.5 times DDP's bytes.

Two implementations, the simple one beside the real one:

* :class:`ShardedOptimizer`: ZeRO-1 as torch's ``ZeroRedundancyOptimizer`` (and Stanford CS336's
  sharded optimizer) does it. Whole parameters are dealt out to ranks; each rank's own optimizer
  steps its parameters, then each parameter is broadcast from the rank that owns it. Works with any
  optimizer; shards are as even as whole parameters allow.
* :class:`ShardedDataParallel`: the flat design of ZeRO and FSDP. Each unit's parameters are
  flattened into one vector padded to a multiple of p, of which rank r owns the r-th slice; the
  optimizer sees only the slices. Even shards; elementwise optimizers only (SGD, Adam, AdamW: each
  number's update depends on that number alone, so updating a slice is updating those numbers).

Both move their bytes with the course's own collectives (``collectives.ring_reduce_scatter``,
``ring_all_gather``, ``ring_all_reduce``, ``tree_broadcast``), which count what they send in
``collectives.sent``. The memory arithmetic, measured and on paper, is in :func:`memory_ledger` and
:func:`bytes_per_rank`.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from course_lib import collectives
from course_lib.accumulation import saved_activation_bytes
from course_lib.costmodel import collective_time
from course_lib.utils import checks

__all__ = ["OPTIMIZERS", "PRECISIONS", "bytes_per_rank", "communication_seconds", "storage_bytes", "memory_ledger",
           "ShardedOptimizer", "ShardedDataParallel"]

# Bytes per parameter kept by the optimizer, in fp32 training. Mixed precision adds a 4-byte fp32
# master copy of the parameters to the optimizer's state (the ZeRO paper's accounting: K = 12 for Adam).
OPTIMIZERS = {"sgd": 0, "momentum": 4, "adam": 8}
# Bytes per parameter of the parameters and the gradients themselves; extra optimizer bytes (the master copy)
PRECISIONS = {"fp32": (4, 0), "mixed": (2, 4)}


def bytes_per_rank(n_params: int, stage: int, world_size: int, optimizer: str = "adam", precision: str = "fp32",
                   tensors: int = 0, activation_bytes: int = 0, unit_sizes: list[int] | None = None) -> dict[str, int]:
    """What one rank holds, by category, for a model of ``n_params`` numbers under ZeRO ``stage`` (0 is DDP).

    A sharded category holds ``ceil(n_params / world_size)`` numbers, its slice of a vector padded to a
    multiple of the world size; with ``unit_sizes`` (the numbers in each unit, summing to ``n_params``),
    each unit is padded on its own, as :class:`ShardedDataParallel` does: the sum of
    ``ceil(size / world_size)``, and from stage 1 on, a category kept whole is the padded vectors.
    ``tensors``: how many tensors this rank's optimizer steps; torch's Adam keeps a 4-byte ``step``
    counter for each (SGD keeps none). ``activation_bytes`` are not sharded: each rank's activations
    belong to its own part of the batch.
    """
    checks.integer("n_params", n_params, 0)
    if unit_sizes is not None:
        checks.integers("unit_sizes", unit_sizes, 1)
        if sum(unit_sizes) != n_params:
            raise ValueError(f"unit_sizes must add up to n_params ({n_params:,}), got {sum(unit_sizes):,}")
    checks.integer("stage", stage, 0, 3)
    checks.integer("world_size", world_size, 1)
    checks.integer("tensors", tensors, 0)
    checks.integer("activation_bytes", activation_bytes, 0)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    value, master = PRECISIONS[precision]
    shard = sum(math.ceil(size / world_size) for size in (unit_sizes or [n_params]))
    # what a rank holds of a category it keeps whole: with units, from stage 1 on, their padded vectors
    whole = shard * world_size if unit_sizes is not None and stage else n_params

    def held(sharded_from: int) -> int:  # numbers held of a category that stage >= sharded_from shards
        return shard if stage >= sharded_from else whole

    counters = 4 * tensors if optimizer == "adam" else 0
    ledger = {"parameters": value * held(3), "gradients": value * held(2),
              "optimizer state": (OPTIMIZERS[optimizer] + master) * held(1) + counters,
              "activations": activation_bytes}
    ledger["total"] = sum(ledger.values())
    return ledger


def communication_seconds(n_params: int, stage: int, world_size: int, alpha_s: float, busbw_GBps: float,
                          bytes_per_number: int = 2, units: int = 1) -> float:
    """Seconds of communication per step on the ring model (``costmodel.collective_time``), the
    gradients and parameters cut into ``units`` equal units: an all-reduce of each unit's gradient
    (stage 0); a reduce-scatter of it and an all-gather of the parameters (stages 1, 2); and one more
    all-gather (stage 3). A reduce-scatter costs what an all-gather costs: the same chunks, the other
    way round."""
    checks.integer("n_params", n_params, 0)
    checks.integer("stage", stage, 0, 3)
    checks.integer("world_size", world_size, 1)  # stages 1-3 divide by it
    checks.integer("units", units, 1)
    checks.integer("bytes_per_number", bytes_per_number, 1)
    unit_bytes = bytes_per_number * n_params / units
    if stage == 0:
        return units * collective_time("all_reduce", unit_bytes, world_size, alpha_s, busbw_GBps)
    # collective_time's all-gather takes what each rank brings: its shard
    one = collective_time("all_gather", unit_bytes / world_size, world_size, alpha_s, busbw_GBps)
    return units * one * (3 if stage == 3 else 2)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: two views of one buffer count once, and a
    buffer whose storage has been freed (resized to 0) counts 0."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def memory_ledger(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  batch: torch.Tensor | None = None) -> dict[str, int]:
    """What this rank holds now, measured from the tensors themselves: the storages of the model's
    parameters (a :class:`ShardedDataParallel`'s gathered units too), of their gradients, and of the
    optimizer's state (a :class:`ShardedOptimizer`'s: this rank's own optimizer); with a ``batch``,
    the activations autograd saves in a forward pass of it (``accumulation.saved_activation_bytes``;
    a sharded model's forward gathers, so every rank must call it then)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        hint = " (a batch is passed as batch=...)" if isinstance(optimizer, torch.Tensor) else ""
        raise TypeError(f"memory_ledger's second argument is the optimizer{hint}; got {type(optimizer).__name__}")
    if batch is not None and not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch must be a tensor of inputs, got {type(batch).__name__}")
    params = list(model.parameters())
    if isinstance(model, ShardedDataParallel):
        params += [unit.full for unit in model.units]
    state = []
    if optimizer is not None:
        inner = optimizer.optim if isinstance(optimizer, ShardedOptimizer) else optimizer
        state = [t for s in inner.state.values() for t in s.values()
                 if torch.is_tensor(t)]
    ledger = {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
              "optimizer state": storage_bytes(state),
              "activations": 0 if batch is None else saved_activation_bytes(model, batch)}
    ledger["total"] = sum(ledger.values())
    return ledger


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1, the simple way, with the arguments of torch's ``ZeroRedundancyOptimizer``:
    ``ShardedOptimizer(params, optimizer_class, process_group=None, **defaults)``.

    Each parameter is given to one rank (the largest first, each to the rank holding the fewest numbers
    so far); this rank's optimizer (``self.optim``, as torch names it) is built over its own parameters
    only, one group for each of ``param_groups`` (empty where it owns none of a group's), so it keeps
    state for those alone. ``step()`` copies the hyperparameters of ``param_groups`` to it (so an LR
    scheduler, or ``param_groups[i]["lr"] = ...``, acts), steps it (``closure`` and keyword arguments
    passed on), copies its groups' keys back, then broadcasts every parameter from its owner. Gradients
    must already be averaged over ranks (use it with DDP, as torch's).

    A checkpoint as torch's: ``consolidate_state_dict(to=r)`` on every rank, then ``state_dict()`` on
    rank r (the whole state, numbered as a plain optimizer's over all parameters, so that a plain
    optimizer can load it too); ``load_state_dict`` on every rank keeps its own parameters' state.

    Left out of torch's class, by design: ``parameters_as_bucket_view`` (flat buffers to broadcast),
    ``overlap_with_ddp`` (the step inside DDP's hook) and ``Join`` (uneven inputs); asking for the
    first two raises. Sparse parameters are refused, as torch's refuses them; parameters of different
    dense dtypes (float32 beside float64) are accepted, where torch's refuses them (its flat buffers
    need one dtype; this class broadcasts each parameter on its own).
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be an optimizer class such as torch.optim.Adam (not an "
                            f"instance), got {optimizer_class!r}")
        for name, asked in (("parameters_as_bucket_view", parameters_as_bucket_view),
                            ("overlap_with_ddp", overlap_with_ddp)):
            if asked:
                raise NotImplementedError(
                    f"ShardedOptimizer leaves out {name}=True, a feature of torch's ZeroRedundancyOptimizer: "
                    f"use torch.distributed.optim.ZeroRedundancyOptimizer for it, or leave it False")
        self.process_group = process_group
        self.rank, self.world_size = _rank_size(process_group)
        self.optimizer_class, self.optim = optimizer_class, None
        self.owner: dict[torch.Tensor, int] = {}
        self.numbers = [0] * self.world_size  # numbers of parameters owned, by rank
        self._consolidated: dict | None = None  # the whole state, on the rank it was consolidated to
        super().__init__(params, defaults)  # calls add_param_group for each group
        self.optim = optimizer_class([self._own(group) for group in self.param_groups], **defaults)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)  # the keys it added

    def _own(self, group: dict) -> dict:
        """The group as this rank's optimizer holds it: its hyperparameters, this rank's parameters."""
        return {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        sparse = [tuple(p.shape) for p in group["params"] if p.is_sparse]
        if sparse:
            raise ValueError(f"ShardedOptimizer takes dense parameters only (as torch's ZeroRedundancyOptimizer), "
                             f"got sparse ones of shapes {sparse}")
        for p in sorted(group["params"], key=lambda p: -p.numel()):
            owner = min(range(self.world_size), key=lambda r: self.numbers[r])
            self.owner[p] = owner
            self.numbers[owner] += p.numel()
        if self.optim is not None:  # after the constructor: a group, empty or not, so that groups line up
            self.optim.add_param_group(self._own(group))
            _copy_hyperparameters(self.optim.param_groups[-1:], self.param_groups[-1:])

    def step(self, closure=None, **kwargs):
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._broadcast_parameters()
        return loss

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        # every rank walks the parameters in the same order, so the broadcasts match up
        for group in self.param_groups:
            for p in group["params"]:
                collectives.tree_broadcast(p.data, src=self.owner[p], group=self.process_group)

    def _indexed(self) -> list[torch.Tensor]:
        """Every parameter, in the order a state dict numbers them."""
        return [p for group in self.param_groups for p in group["params"]]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the state on rank ``to``, for its ``state_dict()``. Every rank
        must call it, as a collective."""
        checks.integer("to", to, 0, self.world_size - 1)
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        mine = {i: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in self.optim.state[p].items()}
                for i, p in enumerate(self._indexed()) if self.owner[p] == self.rank and p in self.optim.state}
        shares = [None] * self.world_size if self.rank == to else None
        dst = to if self.process_group is None else dist.get_global_rank(self.process_group, to)
        dist.gather_object(mine, shares, dst=dst, group=self.process_group)
        self._consolidated = {i: s for share in shares for i, s in share.items()} if self.rank == to else None

    def state_dict(self) -> dict:
        """The whole state as last consolidated on this rank: call ``consolidate_state_dict(to=...)`` on
        every rank first. Numbered as a plain optimizer's state dict over all the parameters."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ShardedOptimizer's state is spread over the ranks and was not consolidated on rank "
                f"{self.rank}: call consolidate_state_dict(to={self.rank}) on every rank first, then "
                f"state_dict() on rank {self.rank}")
        packed = super().state_dict()  # the groups, numbered; its own "state" holds nothing
        packed["state"] = dict(sorted(copy.deepcopy(self._consolidated).items()))
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` (or from a plain optimizer over the same parameter
        groups): this rank keeps its own parameters' state; every rank takes the hyperparameters."""
        if not (isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict):
            raise ValueError(f"state_dict must be an optimizer's state dict, with 'state' and 'param_groups' "
                             f"(from state_dict() after consolidate_state_dict); got "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}")
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"state_dict's parameter groups hold {[len(g['params']) for g in saved_groups]} "
                             f"parameters, this optimizer's {[len(g['params']) for g in self.param_groups]}: "
                             f"load a state dict saved from the same model and groups")
        index = {p: i for i, p in enumerate(self._indexed())}
        local_state, local_groups, n = {}, [], 0
        for saved, group in zip(saved_groups, self.optim.param_groups):
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": list(range(n, n + len(group["params"])))})
            for p in group["params"]:
                if index[p] in state_dict["state"]:
                    local_state[n] = copy.deepcopy(state_dict["state"][index[p]])
                n += 1
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """Every key but "params" of each group, from source's groups to target's, index for index."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})


class _Unit:
    """One unit's parameters as one flat vector: where each parameter sits in it, the whole vector
    (``full``, a leaf autograd differentiates into) and this rank's slice (``shard``, what the
    optimizer steps)."""

    def __init__(self, module: nn.Module, stage: int, group, prefix: str = ""):
        rank, world_size = _rank_size(group)
        self.module = module
        self.places = []  # (submodule, name, shape, offset, numel)
        self.names = []  # each parameter's name in the wrapped model
        flat = []
        offset = 0
        for sub_name, sub in module.named_modules(prefix=prefix):
            for name, p in list(sub.named_parameters(recurse=False)):
                self.places.append((sub, name, p.shape, offset, p.numel()))
                self.names.append(f"{sub_name}.{name}" if sub_name else name)
                flat.append(p.detach().reshape(-1))
                offset += p.numel()
                del sub._parameters[name]  # from now on a plain attribute: a view into `full`
        self.numel = offset
        self.shard_numel = math.ceil(offset / world_size) if stage else offset  # stage 0 pads nothing
        if not offset:
            raise ValueError(f"unit {type(module).__name__} has no parameters: name only modules that have some")
        padded = torch.cat(flat + [flat[0].new_zeros(self.shard_numel * (world_size if stage else 1) - offset)])
        collectives.tree_broadcast(padded, src=0, group=group)  # as DDP: every rank starts from rank 0's values
        # stage 0 shards nothing: this rank's "slice" is the whole vector
        self.chunk = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel) if stage else slice(None)
        if stage < 3:  # the whole vector is kept; the optimizer steps a view of this rank's slice
            self.full = padded.requires_grad_()
            self.shard = nn.Parameter(self.full.data[self.chunk])
        else:  # only the slice is kept; the whole vector has a storage only while in use
            self.shard = nn.Parameter(padded[self.chunk].clone())
            self.full = torch.empty_like(padded).requires_grad_()
            self.free()
        self.gathered_version = self.shard._version  # the shard's version the gathered vector holds
        self.pending: Future | None = None  # an all-gather issued ahead (prefetch)

    def free(self) -> None:
        # The storage object stays (autograd's saved views point at it); its bytes go.
        self.full.untyped_storage().resize_(0)

    def allocate(self) -> None:
        nbytes = self.full.numel() * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def set_views(self) -> None:
        for sub, name, shape, offset, numel in self.places:
            setattr(sub, name, self.full[offset:offset + numel].view(shape))


def _check_ranks_agree(module: nn.Module, units: list[nn.Module], prefixes: dict, group) -> None:
    """Every rank must wrap the same model the same way: each unit's parameters, their names, shapes and
    dtypes. Otherwise the flat vectors differ in length and the collectives fail deep inside, or,
    where the lengths happen to match, train different models without a word. Checked once, at
    construction, as torch's DDP checks its parameters' shapes across ranks."""
    mine = [(prefixes[id(u)] or "(the module)",
             [(name, tuple(p.shape), str(p.dtype)) for name, p in u.named_parameters()]) for u in units]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            here = dist.get_rank(group)
            raise ValueError(f"the ranks wrap different models: rank {here} has units {_describe(mine)}, rank {r} "
                             f"has {_describe(theirs)}. Every rank must build the same model and name the same "
                             f"units (torch's DDP refuses such ranks too).")


def _describe(layout) -> str:
    return "; ".join(f"{unit}: " + ", ".join(f"{n} {list(shape)} {dtype.replace('torch.', '')}"
                                           for n, shape, dtype in params) for unit, params in layout)


class ShardedDataParallel(nn.Module):
    """ZeRO ``stage`` 0 (plain data parallelism), 1, 2 or 3 over ``units`` of ``module`` (default:
    the whole module as one unit). ``model.parameters()`` are then the shards, one per unit: give
    them to an elementwise optimizer (``torch.optim.Adam(model.parameters())``) as FSDP2 has you do.

    The parameters are all-gathered into each unit before its forward (stages 1 and 2: only after
    the optimizer changed the shard; stage 3: every forward, and again before its backward, freed
    after each use). Each unit's gradient is averaged when backward has produced it: all-reduced
    (stage 0), or reduce-scattered, keeping the whole gradient (stage 1) or only this rank's slice
    (stages 2, 3). ``prefetch=True`` (stage 3) issues the next unit's all-gather on a second thread,
    with its own process group, before computing the current unit: the all-gather overlaps
    computation, as FSDP does on a second CUDA stream. ``events`` (when a list) receives
    ``(what, unit, start, end)`` with ``time.perf_counter`` times: "compute" (forward), "all-gather"
    (on the main thread), "reduce-scatter" (stage 0: "all-reduce"), "issue" (a prefetch handed to the
    second thread), "prefetched all-gather" (on it) and "wait" (the main thread waiting for one).
    """

    def __init__(self, module: nn.Module, stage: int, units: list[nn.Module] | None = None, group=None,
                 prefetch: bool = False, events: list | None = None):
        super().__init__()
        checks.integer("stage", stage, 0, 3)
        checks.boolean("prefetch", prefetch)
        if events is not None and not isinstance(events, list):
            raise TypeError(f"events is a list that receives (what, unit, start, end), or None; got "
                            f"{type(events).__name__}")
        if prefetch and stage != 3:
            raise ValueError(f"prefetch is for stage 3, whose parameters are gathered at every forward; "
                             f"got stage {stage}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if getattr(module, "_sharded_by", None) is not None:
            raise ValueError(f"{type(module).__name__} is already wrapped by a ShardedDataParallel (its parameters "
                             f"became that wrapper's shards): wrap a module once, and use the wrapper")
        if not any(True for _ in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters to shard")
        units = [module] if units is None else list(units)
        inside = {id(m) for m in module.modules()}
        if not units or any(id(u) not in inside for u in units):
            raise ValueError("units must be a non-empty list of submodules of module (e.g. its layers)")
        owned = [id(p) for u in units for p in u.parameters()]
        everything = [id(p) for p in module.parameters()]
        if len(owned) != len(set(owned)) or sorted(owned) != sorted(everything):
            raise ValueError("every parameter of module must belong to exactly one unit: units may not nest, "
                             "and a parameter outside every unit would not be synchronized")
        frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"ShardedDataParallel shards trainable parameters only, and {frozen} are frozen: "
                             f"train them too, or keep the frozen part outside the module you wrap")
        self.module, self.stage, self.group, self.prefetch, self.events = module, stage, group, prefetch, events
        self.rank, self.world_size = _rank_size(group)
        prefixes = {id(m): name for name, m in module.named_modules()}
        _check_ranks_agree(module, units, prefixes, group)
        self.units = [_Unit(u, stage, group, prefixes[id(u)]) for u in units]
        module._sharded_by = type(self).__name__  # a plain attribute: applied twice, the second is refused
        for i, unit in enumerate(self.units):
            self.register_parameter(f"shard_{i}", unit.shard)
            unit.module.register_forward_pre_hook(self._before_forward(i))
            unit.module.register_forward_hook(self._after_forward(i))
            unit.full.register_post_accumulate_grad_hook(self._after_backward(i))
        # all-gathers issued ahead run on their own thread, over their own process group (every rank
        # creates it, in the same order), so that they cannot interleave with the main thread's
        self._gather_group = dist.new_group(backend="gloo") if prefetch else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="all-gather") if prefetch else None
        self._lock = threading.Lock()
        for unit in self.units:
            if stage < 3:  # stage 3's views are made at each forward, once the vector has been gathered
                unit.set_views()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def gathered_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by its name in ``module`` (copies). Gathers what is sharded: every
        rank must call it, as every rank calls a collective."""
        out = {}
        for i, unit in enumerate(self.units):
            self._gather(i)
            for name, (_, _, shape, offset, numel) in zip(unit.names, unit.places):
                out[name] = unit.full.detach()[offset:offset + numel].view(shape).clone()
            if self.stage == 3:
                unit.free()
        return out

    def _note(self, what: str, i: int, start: float) -> None:
        if self.events is not None:
            with self._lock:
                self.events.append((what, i, start, time.perf_counter()))

    def _all_gather(self, i: int, group) -> None:
        unit = self.units[i]
        start = time.perf_counter()
        whole = unit.full.data  # written through .data: autograd's saved views must not see a new version
        whole[unit.chunk].copy_(unit.shard.detach())
        collectives.ring_all_gather(whole, group=group)
        self._note("all-gather" if group is self.group else "prefetched all-gather", i, start)

    def _gather(self, i: int) -> None:
        """Make unit i's whole vector current: wait for a prefetched all-gather, or run one now."""
        unit = self.units[i]
        if unit.pending is not None:
            start = time.perf_counter()
            unit.pending.result()
            unit.pending = None
            self._note("wait", i, start)
        elif self.stage == 3 or (self.stage > 0 and unit.shard._version != unit.gathered_version):
            unit.allocate()
            self._all_gather(i, self.group)
        unit.gathered_version = unit.shard._version

    def _issue(self, i: int) -> None:
        """Prefetch: start unit i's all-gather on the second thread, unless it is already gathered or under way."""
        if not self.prefetch or not 0 <= i < len(self.units) or self.units[i].pending is not None:
            return
        unit = self.units[i]
        unit.allocate()  # here, on the main thread: the storage must exist before anyone writes to it
        unit.pending = self._thread.submit(self._all_gather, i, self._gather_group)
        self._note("issue", i, time.perf_counter())

    def _before_forward(self, i: int):
        def hook(module, args):
            self._gather(i)
            self._issue(i + 1)
            self.units[i].set_views()
            self._started = time.perf_counter()
        return hook

    def _after_forward(self, i: int):
        def hook(module, args, output):
            self._note("compute", i, self._started)
            if self.stage == 3:
                self.units[i].free()
                if torch.is_tensor(output) and output.requires_grad:
                    output.register_hook(self._before_backward(i))
        return hook

    def _before_backward(self, i: int):
        def hook(grad):
            self._gather(i)
            self._issue(i - 1)
            return grad
        return hook

    def _after_backward(self, i: int):
        def hook(full: torch.Tensor):
            unit = self.units[i]
            start = time.perf_counter()
            grad = full.grad
            full.grad = None
            grad.div_(self.world_size)
            if self.stage == 0:
                mine = collectives.ring_all_reduce(grad, group=self.group)
            else:
                mine = collectives.ring_reduce_scatter(grad, group=self.group)
                # stage 1 keeps the whole gradient (its slice is a view of it); 2 and 3 keep the slice alone
                mine = mine if self.stage == 1 else mine.clone()
            unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
            self._note("reduce-scatter" if self.stage else "all-reduce", i, start)
            if self.stage == 3:
                unit.free()
        return hook
