"""Gradient accumulation: k small backward passes that add up to one large one.

``loss.backward()`` does not *set* ``.grad``, it *adds* to it. So k micro-batches, each loss
scaled so the k losses sum to the large batch's loss, leave in ``.grad`` exactly the gradient of
the large batch, while only one micro-batch's activations are alive at a time. This module holds
the accumulation step (the naive, buggy version beside the right one), a measurement of activation
memory, and two DDP experiments: one that counts the all-reduces DDP issues (with the profiler,
which sees every collective), so that ``no_sync`` can be seen to save k - 1 of every k, and one
where micro-batches and ranks hold different numbers of tokens, so that the loss must be divided by
the *global* token count.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.launch import worker_device
from course_lib.utils import checks
from course_lib.utils.digits import batch_slice, digits_tensors, mlp
from course_lib.utils.progress import progress_bar

__all__ = [
    "split",
    "accumulate_naive",
    "accumulate",
    "train_with_accumulation",
    "saved_activation_bytes",
    "optimizer_state_bytes",
    "ddp_accumulate",
    "ddp_accumulation_worker",
    "global_batch_size",
    "scaled_lr",
    "token_sequences",
    "bigram_lm",
    "token_losses",
    "accumulate_tokens_naive",
    "accumulate_tokens",
    "ddp_token_worker",
    "graph_lines",
    "snapshot",
]


def split(x: torch.Tensor, y: torch.Tensor, sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into micro-batches of the given sizes (an int k means k near-equal parts)."""
    # An empty micro-batch has a mean loss of NaN, which the weighted sum would carry into .grad.
    if isinstance(sizes, int):
        checks.integer("k (the number of micro-batches)", sizes, 1, len(x))
        return list(zip(x.tensor_split(sizes), y.tensor_split(sizes)))
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"micro-batch sizes must be integers >= 1, got {list(sizes)}")
    if sum(sizes) != len(x):
        raise ValueError(f"micro-batch sizes {list(sizes)} add up to {sum(sizes)}, not the batch size {len(x)}")
    return list(zip(x.split(list(sizes)), y.split(list(sizes))))


def _checked(micro_batches) -> list:
    """``micro_batches`` if it is a non-empty list: none at all would leave ``.grad`` untouched and report 0."""
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError(f"micro_batches must be a non-empty list of (x, y) pairs (e.g. from split), "
                         f"got {micro_batches!r:.60}")
    return micro_batches


def _checked_pairs(micro_batches) -> list:
    """``micro_batches`` if it is a non-empty list of (x, y) pairs, none empty."""
    for i, pair in enumerate(_checked(micro_batches)):
        if len(pair) != 2:
            raise ValueError(f"micro_batches must be (x, y) pairs; item {i} has {len(pair)} items")
        if len(pair[1]) == 0:  # its mean loss would be 0/0, NaN, and so would every gradient
            raise ValueError(f"micro-batch {i} is empty (0 targets): each needs at least one (split refuses "
                             f"empty micro-batches for this reason)")
    return micro_batches


def accumulate_naive(model: nn.Module, loss_fn, micro_batches) -> float:
    """The textbook loop: each micro-batch's *mean* loss divided by k.

    Right when all micro-batches have the same size; wrong otherwise, because a sample in
    a small micro-batch then weighs more than one in a large micro-batch.
    """
    k = len(_checked_pairs(micro_batches))
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) / k
        loss.backward()
        total += loss.item()
    return total


def accumulate(model: nn.Module, loss_fn, micro_batches) -> float:
    """Accumulate the gradient of the whole batch's mean loss into ``.grad``, any micro-batch sizes.

    Each micro-batch's mean loss is weighted by its share of the samples, ``n_i / N``, so every
    sample weighs ``1 / N`` as in the large batch. Returns the large batch's loss.
    """
    n_total = sum(len(y) for _, y in _checked_pairs(micro_batches))
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * (len(y) / n_total)
        loss.backward()
        total += loss.item()
    return total


def train_with_accumulation(batch_size: int, k: int, steps: int, lr: float = 0.1, seed: int = 0,
                            progress: bool = False):
    """SGD on the digits with batches of ``batch_size`` made of ``k`` micro-batches; the loss per step.

    ``train_with_accumulation(B, 1, ...)`` and ``train_with_accumulation(B, 4, ...)`` see the same
    samples in the same order, so their curves coincide: accumulation changes the memory needed, not
    the maths.
    """
    x_train, y_train, _, _ = digits_tensors()
    checks.integer("batch_size", batch_size, 1, len(x_train))
    checks.integer("k", k, 1, batch_size)  # at least one sample per micro-batch
    checks.integer("steps", steps, 0)
    checks.number("lr", lr, 0, low_open=True)
    model = mlp(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    losses = []
    steps_iter = range(steps)
    if progress:
        steps_iter = progress_bar(steps_iter, desc=f"B={batch_size}, k={k}")
    for step in steps_iter:
        idx = order[batch_slice(step, batch_size, len(x_train))]
        opt.zero_grad()
        losses.append(accumulate(model, loss_fn, split(x_train[idx], y_train[idx], k)))
        opt.step()
    return losses


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes that autograd keeps alive between forward and backward for one forward pass of ``x``.

    Measured, not estimated: ``saved_tensors_hooks`` sees every tensor that an operation saves for
    its backward. Parameters (which exist anyway) are left out, and so are views of any leaf that
    autograd differentiates into (a sharded model's gathered parameters); a tensor saved by two
    operations (a ReLU's output is also the next Linear's input) is counted once.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        of_a_leaf = t.requires_grad and (t.is_leaf or (t._base is not None and t._base.is_leaf))
        if ptr not in param_storages and not of_a_leaf:
            # the tensor's own bytes, not its storage's: a saved input may be a slice of a dataset
            seen[ptr] = max(seen.get(ptr, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps between steps (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``).

    Measured from ``optimizer.state``, which is empty until the first ``step``: call it after one. A
    sharded optimizer (``sharding.ShardedOptimizer``, torch's ``ZeroRedundancyOptimizer``) keeps its state
    in the optimizer over this rank's parameters, ``optimizer.optim``: this rank's share is counted.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (e.g. torch.optim.Adam(model.parameters())), "
                        f"got {type(optimizer).__name__}")
    if isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):  # its own .state stays empty
        optimizer = optimizer.optim
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


@contextlib.contextmanager
def _quiet_stderr():
    """Send this process's stderr (file descriptor 2) to /dev/null for the block.

    torch's profiler writes a line to stderr each time it starts and stops; in a worker those lines
    would land in the notebook under the cell, with a time stamp that differs at every run (gloo's logs
    of a failed collective too: notebook 04).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _all_reduces(events) -> list[int]:
    """Payload in bytes of each all-reduce the backend ran (``gloo:all_reduce``, ``nccl:all_reduce``), in order."""
    # The backend's own event, one per collective, not the dispatcher's ``c10d::allreduce_`` above it.
    return [4 * sum(torch.Size(s).numel() for s in e.input_shapes)  # float32 gradients: 4 bytes each
            for e in events if e.name.endswith(":all_reduce") and not e.name.startswith("c10d")]


def ddp_accumulate(model: DDP, loss_fn, micro_batches, no_sync: bool = True) -> None:
    """One step's backward passes under DDP: k equal micro-batches, each mean loss divided by k.

    With ``no_sync`` the first k - 1 forward and backward passes run inside ``model.no_sync()``, so
    their gradients only add up in this rank's ``.grad``; the last backward, outside it, all-reduces
    the sum. (``contextlib.nullcontext()`` is a ``with`` block that does nothing.)
    """
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        skip_sync = no_sync and i < k - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = loss_fn(model(x), y) / k  # the forward inside the block too (torch's no_sync docs)
            loss.backward()


def ddp_accumulation_worker(rank: int, world_size: int, k: int, steps: int, global_batch: int,
                            lr: float = 0.1, seed: int = 0) -> dict:
    """Train the digits MLP under DDP with k micro-batches per step, with and without ``no_sync``.

    Each rank takes its own slice of every global batch. The profiler records every all-reduce the
    process runs, whoever starts it (here DDP, from C++), with the shape of what it reduces. Returns,
    for both runs, the all-reduces of each step (their payloads in bytes) and the final parameters,
    so that the caller can check both runs agree with each other and with one process that trains
    on the whole global batch.
    """
    if global_batch % (world_size * k):
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size * k = {world_size * k}")
    device = worker_device()  # cuda:LOCAL_RANK under NCCL, else the CPU
    x_train, y_train, _, _ = digits_tensors()
    x_train, y_train = x_train.to(device), y_train.to(device)
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    for use_no_sync in (False, True):
        model = DDP(mlp(seed=seed).to(device), device_ids=[device] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        per_step = []
        for step in range(steps):
            batch = batch_slice(step, global_batch, len(x_train), rank, world_size)
            xb, yb = x_train[batch], y_train[batch]
            opt.zero_grad()
            micro = split(xb, yb, k)
            with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                         record_shapes=True) as prof:
                ddp_accumulate(model, loss_fn, micro, no_sync=use_no_sync)
            per_step.append(_all_reduces(prof.events()))
            opt.step()
        out["no_sync" if use_no_sync else "sync"] = {
            "all_reduces": per_step,
            "params": [p.detach().cpu().clone() for p in model.module.parameters()],
        }
    return out


def global_batch_size(micro_batch: int, k: int, world_size: int) -> int:
    """Samples behind one optimizer step: micro-batch x accumulation steps x ranks."""
    for name, value in (("micro_batch", micro_batch), ("k", k), ("world_size", world_size)):
        checks.integer(name, value, 1)
    return micro_batch * k * world_size


def scaled_lr(base_lr: float, base_batch: int, batch: int, step: int | None = None, warmup_steps: int = 0) -> float:
    """The linear scaling rule with gradual warm-up (Goyal et al. 2017, arXiv 1706.02677).

    A batch ``batch / base_batch`` times larger gets a learning rate that many times larger; during
    the first ``warmup_steps`` steps the rate climbs linearly from ``base_lr`` to that target.
    """
    checks.number("base_lr", base_lr, 0, low_open=True)
    checks.integer("base_batch", base_batch, 1)
    checks.integer("batch", batch, 1)
    checks.integer("warmup_steps", warmup_steps, 0)
    if step is not None:
        checks.integer("step", step, 0)
    target = base_lr * batch / base_batch
    if step is None or step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps


def token_sequences(n: int, vocab: int = 16, min_len: int = 2, max_len: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """``n`` token sequences of random lengths: a stand-in for sentences, whose lengths differ.

    Each is a walk ``t_{i+1} = (t_i + s) mod vocab`` with a random stride s of 1 or 2, so the next
    token is worth predicting. A sequence of length L gives L - 1 (input, target) pairs: its tokens.
    """
    checks.integer("n", n, 1)
    checks.integer("min_len", min_len, 2)
    checks.integer("max_len", max_len, min_len)
    checks.integer("vocab", vocab, 1)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start = torch.randint(vocab, (1,), generator=g)
        steps = torch.randint(1, 3, (length - 1,), generator=g)
        out.append(torch.cat([start, start + steps.cumsum(0)]) % vocab)
    return out


def bigram_lm(vocab: int = 16, dim: int = 8, seed: int = 0, dtype=torch.float64) -> nn.Sequential:
    """The smallest language model: embed the current token, predict the next (float64 by default,
    so that two ways of summing the same gradient agree to ~1e-15 and any real difference shows)."""
    checks.integer("vocab", vocab, 1), checks.integer("dim", dim, 1)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, vocab)).to(dtype)


def token_losses(model: nn.Module, sequences) -> torch.Tensor:
    """Next-token cross-entropy of every token of ``sequences``, one number per token (no reduction)."""
    inputs = torch.cat([s[:-1] for s in sequences])
    targets = torch.cat([s[1:] for s in sequences])
    return nn.functional.cross_entropy(model(inputs), targets, reduction="none")


def _sync_only_last(model: nn.Module, i: int, k: int):
    """Under DDP, ``no_sync()`` for micro-batches 0 .. k-2 (forward and backward); otherwise nothing."""
    return model.no_sync() if isinstance(model, DDP) and i < k - 1 else contextlib.nullcontext()


def accumulate_tokens_naive(model: nn.Module, micro_batches) -> None:
    """Each micro-batch's *mean* loss over its tokens, divided by k: the 2024 bug.

    A token in a micro-batch with few tokens weighs more than one in a micro-batch with many;
    under DDP, averaging the ranks' gradients repeats the mistake across ranks.
    """
    k = len(_checked(micro_batches))
    for i, sequences in enumerate(micro_batches):
        with _sync_only_last(model, i, k):
            (token_losses(model, sequences).mean() / k).backward()


def accumulate_tokens(model: nn.Module, micro_batches, n_tokens: int, world_size: int = 1) -> None:
    """Accumulate the gradient of the mean loss over ``n_tokens`` tokens: sum the losses, divide by the count.

    ``n_tokens`` is the *global* count: every token of every micro-batch, of every rank under DDP.
    DDP averages the ranks' gradients (it divides their sum by ``world_size``), so each rank
    multiplies by ``world_size`` to leave the plain sum over all tokens divided by ``n_tokens``.
    """
    checks.integer("n_tokens", n_tokens, 1)
    checks.integer("world_size", world_size, 1)
    k = len(_checked(micro_batches))
    for i, sequences in enumerate(micro_batches):
        with _sync_only_last(model, i, k):
            (token_losses(model, sequences).sum() * world_size / n_tokens).backward()


def ddp_token_worker(rank: int, world_size: int, n_sequences: int, k: int, seed: int = 0) -> dict:
    """One accumulation step under DDP on sequences of unequal lengths, three ways.

    The ``n_sequences`` sequences are cut into ``world_size`` consecutive shares, and each share into
    k consecutive micro-batches, so micro-batches and ranks hold different numbers of tokens.
    ``"naive"`` divides each micro-batch's mean by k; ``"rank count"`` divides the summed losses by
    the rank's own token count (right on one process, wrong across ranks); ``"global count"`` divides
    by the count of all ranks, all-reduced first (one more all-reduce per step, of one number).
    Returns the gradients each way left (the same on every rank: DDP averaged them) and this rank's
    tokens per micro-batch.
    """
    if n_sequences % (world_size * k):
        raise ValueError(f"n_sequences={n_sequences} must be divisible by world_size * k = {world_size * k}")
    device = worker_device()  # cuda:LOCAL_RANK under NCCL, else the CPU
    per_rank, per_micro = n_sequences // world_size, n_sequences // (world_size * k)
    share = [s.to(device) for s in token_sequences(n_sequences, seed=seed)[rank * per_rank:(rank + 1) * per_rank]]
    micro = [share[i * per_micro:(i + 1) * per_micro] for i in range(k)]
    tokens = [sum(len(s) - 1 for s in m) for m in micro]
    n_tokens = torch.tensor([sum(tokens)], device=device)
    dist.all_reduce(n_tokens)  # the global count: every token of every rank
    out = {"tokens": tokens, "global_tokens": int(n_tokens)}
    for way in ("naive", "rank count", "global count"):
        model = DDP(bigram_lm(seed=seed).to(device), device_ids=[device] if device.type == "cuda" else None)
        if way == "naive":
            accumulate_tokens_naive(model, micro)
        elif way == "rank count":
            accumulate_tokens(model, micro, sum(tokens))
        else:
            accumulate_tokens(model, micro, int(n_tokens), world_size)
        out[way] = [p.grad.detach().cpu().clone() for p in model.module.parameters()]
    return out


def graph_lines(tensor: torch.Tensor) -> list[str]:
    """The autograd graph behind ``tensor``, one node per line, walked from the output back.

    ``AccumulateGrad`` nodes are the leaves: they are where ``backward`` *adds* into ``.grad``.
    """
    lines: list[str] = []

    def walk(fn, depth):
        if fn is None:
            return
        name = type(fn).__name__
        if name == "AccumulateGrad":
            name += f" -> .grad of a {tuple(fn.variable.shape)} parameter"
        lines.append("  " * depth + name)
        for nxt, _ in fn.next_functions:
            walk(nxt, depth + 1)

    walk(tensor.grad_fn, 0)
    return lines


def snapshot(layer: nn.Linear) -> dict:
    """Weight, bias and their ``.grad`` (``None`` when cleared) of a tiny ``nn.Linear(2, 1)``."""
    def values(t):
        return None if t is None else [round(v, 4) for v in t.detach().flatten().tolist()]

    return {"w": values(layer.weight), "w.grad": values(layer.weight.grad),
            "b": values(layer.bias), "b.grad": values(layer.bias.grad)}
