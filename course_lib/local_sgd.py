"""Communicate less often: local SGD, post-local SGD and DiLoCo, from scratch.

Data parallelism averages *gradients* at every step. Local SGD lets every rank step on its own
data and averages the *parameters* only every H steps: one all-reduce of the parameters per H
steps, 1/H of the bytes (Stich, "Local SGD converges fast and communicates little", ICLR 2019).

* :class:`PeriodicModelAverager`: the averager, a drop-in for torch's
  ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``: call
  ``average_parameters(params)`` after every optimizer step; it averages on the steps
  ``warmup_steps, warmup_steps + period, ...`` and counts ``step``.
* Post-local SGD (Lin, Stich, Patel & Jaggi, "Don't use large mini-batches, use local SGD", ICLR
  2020): plain data parallelism for the first steps, where local steps hurt most, then local SGD.
  :class:`PostLocalSGDState` and :func:`post_localSGD_hook` (DDP averages gradients globally until
  ``start_localSGD_iter``, then not at all, or within a subgroup) with the averager wrapped around
  the optimizer by :class:`PostLocalSGDOptimizer`, as torch's three pieces of the same names.
* :class:`DiLoCo` (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
  Models", 2023): H steps of an inner optimizer (AdamW) on each rank, then the *pseudo-gradient*
  Δ = θ_start − θ_local, averaged over ranks, is handed to an outer optimizer (SGD with Nesterov
  momentum, lr 0.7, momentum 0.9 in the paper) that updates the shared parameters θ_start.

Parameters are averaged with the course's ``collectives.ring_all_reduce`` on one flat vector, which
counts its bytes in ``collectives.sent``. Gradients under post-local SGD's warm-up travel in DDP's
hook with torch's all-reduce, as torch's hook does (counted in ``hooks.traffic``).
"""

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib import collectives, hooks
from course_lib.utils import checks

__all__ = ["average_parameters", "PeriodicModelAverager", "PostLocalSGDState", "post_localSGD_hook",
           "PostLocalSGDOptimizer", "DiLoCo"]


def _tensors(params, with_grad_only: bool) -> list[torch.Tensor]:
    """The parameters in ``params`` (parameters, or an optimizer's parameter groups); with
    ``with_grad_only``, those that have a gradient (a frozen layer is the same on every rank)."""
    if isinstance(params, torch.Tensor):  # iterating it would give its rows, which are not parameters
        raise TypeError("params must be an iterable of parameters (e.g. model.parameters()) or of parameter "
                        "groups, not one tensor: pass [p]")
    out = []
    for item in params:
        if isinstance(item, torch.Tensor):
            group = [item]
        elif isinstance(item, dict) and "params" in item:
            group = item["params"]
        else:
            raise TypeError(f"params must be parameters or parameter groups (dicts with 'params'), "
                            f"got an item of type {type(item).__name__}")
        out += [p for p in group if p.grad is not None or not with_grad_only]
    return out


@torch.no_grad()
def average_parameters(params, process_group=None, with_grad_only: bool = False) -> None:
    """Replace each parameter by its mean over the ranks: one ring all-reduce of all of them, flat.

    Every parameter given is averaged, as by torch's ``model_averaging.utils.average_parameters``;
    ``with_grad_only`` skips those without a gradient, as torch's averagers do. A rank outside
    ``process_group`` returns at once, as it does from torch's collectives."""
    tensors = _tensors(params, with_grad_only)
    if process_group is not None and dist.get_rank(process_group) < 0:
        return
    if not tensors:
        return
    flat = torch.cat([p.reshape(-1) for p in tensors])
    flat /= dist.get_world_size(process_group)  # divided first, then summed: as torch's averager
    collectives.ring_all_reduce(flat, group=process_group)
    offset = 0
    for p in tensors:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


class PeriodicModelAverager:
    """Average the parameters every ``period`` steps once ``warmup_steps`` steps have passed.

    ``average_parameters(params)`` is called after every optimizer step; it averages when
    ``step >= warmup_steps`` and ``(step - warmup_steps) % period == 0``, then adds 1 to ``step``.
    Parameters without a gradient are left alone, as torch's averager leaves them.
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group=None):
        self.period = checks.integer("period", period, 1)
        self.warmup_steps = checks.integer("warmup_steps", warmup_steps, 0)
        self.process_group = process_group
        self.step = 0

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:  # set by load_state_dict from a checkpoint: a count of steps
        self._step = checks.integer("the averager's step", value, 0)

    def averages_next(self) -> bool:
        """Whether the next call of ``average_parameters`` averages (the schedule, in one place)."""
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Iterable) -> None:
        if self.averages_next():
            average_parameters(params, self.process_group, with_grad_only=True)
        self.step += 1


class PostLocalSGDState:
    """The hook's state: gradients all-reduced over ``process_group`` (None: every rank) for the
    first ``start_localSGD_iter`` iterations, then over ``subgroup`` unless
    ``post_local_gradient_allreduce`` is False. One difference from torch's: ``subgroup=None`` means
    no gradient all-reduce after the warm-up (each rank on its own), where torch's builds subgroups
    of the ranks of each machine (``dist.new_subgroups()``, sized by the machine's GPUs)."""

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group, subgroup, start_localSGD_iter: int, post_local_gradient_allreduce: bool = True):
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = checks.integer("start_localSGD_iter", start_localSGD_iter, 0)
        self.post_local_gradient_allreduce = checks.boolean("post_local_gradient_allreduce",
                                                            post_local_gradient_allreduce)
        self.iter = 0


def post_localSGD_hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket over every rank during the warm-up (counting an
    iteration at each step's last bucket), afterwards over ``state.subgroup`` or not at all."""
    grad = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return hooks.allreduce_fut(state.process_group, grad)
    if not state.post_local_gradient_allreduce or state.subgroup is None:
        return hooks.completed_future(grad)
    return hooks.allreduce_fut(state.subgroup, grad)


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """The local optimizer ``optim`` followed, at every step, by ``averager.average_parameters``."""

    def __init__(self, optim: torch.optim.Optimizer, averager: PeriodicModelAverager):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer built over the model's parameters (e.g. "
                            f"torch.optim.SGD(model.parameters(), lr=0.1)), got {optim!r:.80}")
        if not callable(getattr(averager, "average_parameters", None)):
            raise TypeError(f"averager must be a model averager such as PeriodicModelAverager(period=4), "
                            f"got {averager!r:.80}")
        self.optim, self.averager = optim, averager
        self.param_groups = optim.param_groups
        self.defaults = optim.defaults

    @property
    def state(self):
        return self.optim.state

    def step(self, closure: Callable | None = None):
        loss = self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def averages_next(self) -> bool:
        """Whether the next ``step`` ends with an average of the parameters (the averager's schedule)."""
        return self.averager.averages_next()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {**self.optim.state_dict(), "step": self.averager.step}

    def load_state_dict(self, state_dict: dict) -> None:
        """The local optimizer's state, and the averager's step; without a ``"step"`` (a plain
        optimizer's state dict), a warning, and the averager starts again at step 0, as torch's."""
        state_dict = dict(state_dict)
        if "step" not in state_dict:
            warnings.warn("Loaded state dict does not contain a step counter for an averager. "
                          "Setting step counter to 0.", stacklevel=2)
        self.averager.step = state_dict.pop("step", 0)
        self.optim.load_state_dict(state_dict)


def _check_compress(compress, param: torch.Tensor) -> None:
    """``compress`` must turn a flat float tensor into one of the same length (e.g. ``torch.Tensor.half``):
    tried once on a copy of one entry, at construction, rather than at the first outer step, after H
    inner steps have changed the parameters."""
    if not callable(compress):
        raise TypeError(f"compress is a function from a tensor to the tensor to send, e.g. torch.Tensor.half "
                        f"(or None), got {compress!r}")
    probe = param.detach().reshape(-1)[:1].clone()
    out = compress(probe)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == probe.shape):
        raise TypeError(f"compress must return a floating tensor of its input's shape (e.g. torch.Tensor.half); "
                        f"on a tensor of shape {tuple(probe.shape)} it returned {out!r:.80}")


class DiLoCo:
    """DiLoCo around a model's ``params``: ``step()`` after every backward.

    Every call steps the ``inner`` optimizer (built by the caller over ``params``, e.g. AdamW); every
    ``period`` calls, the outer step: the pseudo-gradient Δ = θ_start − θ (what H inner steps moved
    the parameters by, reversed) is averaged over the ranks (optionally sent as ``compress`` makes it,
    e.g. ``torch.Tensor.half``: the all-reduce then runs in 16 bits, and the mean is cast back), set
    as the gradient of the shared copy θ_start, and ``outer_cls`` (default: SGD with Nesterov
    momentum, ``outer_lr`` 0.7, ``outer_momentum`` 0.9, the paper's) steps it; the model restarts
    from θ_start. The inner optimizer's state stays on each rank, as in the paper.
    """

    def __init__(self, params, inner: torch.optim.Optimizer, period: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, group=None,
                 compress: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of parameters (e.g. model.parameters()), not one tensor: "
                            "pass [p]")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo needs parameters to train: params held none that requires grad")
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer (e.g. torch.optim.AdamW(model.parameters())), "
                            f"got {type(inner).__name__}")
        inner_params = [p for g in inner.param_groups for p in g["params"]]
        mine = {id(p) for p in self.params}
        if {id(p) for p in inner_params} != mine:
            stray = sum(id(p) not in mine for p in inner_params)
            missed = len(mine - {id(p) for p in inner_params})
            raise ValueError(f"inner must step the parameters DiLoCo averages: it holds {stray} tensor(s) not in "
                             f"params, and {missed} of params are missing from it. Build both over the same "
                             f"model: DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), ...)")
        self.inner, self.group, self.compress = inner, group, compress
        self.period = checks.integer("period", period, 1)
        checks.number("outer_lr", outer_lr, 0, low_open=True)
        checks.number("outer_momentum", outer_momentum, 0, 1)
        checks.boolean("nesterov", nesterov)
        if compress is not None:
            _check_compress(compress, self.params[0])
        self.shared = [p.detach().clone() for p in self.params]  # θ_start: the same on every rank
        for t in self.shared:
            t.requires_grad_(True)
        self.outer = torch.optim.SGD(self.shared, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.inner_steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``: DiLoCo is called where an optimizer would be."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def averages_next(self) -> bool:
        """Whether the next ``step`` ends with the outer step (an all-reduce of the pseudo-gradient)."""
        return (self.inner_steps + 1) % self.period == 0

    @torch.no_grad()
    def step(self) -> bool:
        """One inner step; the outer step too when ``period`` inner steps have passed. Returns
        whether the ranks communicated."""
        outer = self.averages_next()
        self.inner.step()
        self.inner_steps += 1
        if not outer:
            return False
        delta = torch.cat([(s - p).reshape(-1) for s, p in zip(self.shared, self.params)])
        sent = delta if self.compress is None else self.compress(delta)
        sent /= dist.get_world_size(self.group)  # divided first, as torch's 16-bit hooks: no overflow in the sum
        collectives.ring_all_reduce(sent, group=self.group)
        delta = sent.to(delta.dtype)
        offset = 0
        for s in self.shared:
            s.grad = delta[offset:offset + s.numel()].view_as(s).clone()
            offset += s.numel()
        self.outer.step()
        for s, p in zip(self.shared, self.params):
            p.copy_(s)
        return True
