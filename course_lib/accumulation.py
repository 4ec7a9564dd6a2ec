"""Gradient accumulation: k small backward passes that add up to one large one.

``loss.backward()`` does not *set* ``.grad``, it *adds* to it. So k micro-batches, each loss
scaled so the k losses sum to the large batch's loss, leave in ``.grad`` exactly the gradient of
the large batch, while only one micro-batch's activations are alive at a time. This module holds
the accumulation step (the naive, buggy version beside the right one), a measurement of activation
memory, and a DDP experiment that counts all-reduces (through ``course_lib.hooks``) so that
``no_sync`` can be seen to save k - 1 of every k.
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import hooks
from course_lib.launch import worker_device
from course_lib.support import checks
from course_lib.support.digits import batch_slice, digits_tensors, mlp
from course_lib.support.progress import progress_bar

__all__ = [
    "split",
    "accumulate_naive",
    "accumulate",
    "train",
    "saved_activation_bytes",
    "ddp_accumulation_worker",
    "graph_lines",
    "snapshot",
    "micro_batch_loss",
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


def accumulate_naive(model: nn.Module, loss_fn, micro_batches) -> float:
    """The textbook loop: each micro-batch's *mean* loss divided by k.

    Right when all micro-batches have the same size; wrong otherwise, because a sample in
    a small micro-batch then weighs more than one in a large micro-batch.
    """
    k = len(micro_batches)
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
    n_total = sum(len(y) for _, y in micro_batches)
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * (len(y) / n_total)
        loss.backward()
        total += loss.item()
    return total


def train(batch_size: int, k: int, steps: int, lr: float = 0.1, seed: int = 0, progress: bool = False):
    """SGD on the digits with batches of ``batch_size`` made of ``k`` micro-batches; the loss per step.

    ``train(B, 1, ...)`` and ``train(B, 4, ...)`` see the same samples in the same order, so their
    curves coincide: accumulation changes the memory needed, not the maths.
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
    its backward. Parameters (which exist anyway) are left out, and a tensor saved by two
    operations (a ReLU's output is also the next Linear's input) is counted once.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages:
            # the tensor's own bytes, not its storage's: a saved input may be a slice of a dataset
            seen[ptr] = max(seen.get(ptr, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def ddp_accumulation_worker(rank: int, world_size: int, k: int, steps: int, global_batch: int,
                            lr: float = 0.1, seed: int = 0) -> dict:
    """Train the digits MLP under DDP with k micro-batches per step, with and without ``no_sync``.

    Each rank takes its own slice of every global batch. Returns, for both runs, the final
    parameters and the all-reduces issued, so that the caller can check both runs agree with
    each other and with one process that trains on the whole global batch.
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
        # DDP's own behaviour, through the course's hook, which counts every all-reduce it issues
        model.register_comm_hook(None, hooks.allreduce_hook)
        hooks.traffic.reset()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            batch = batch_slice(step, global_batch, len(x_train), rank, world_size)
            xb, yb = x_train[batch], y_train[batch]
            opt.zero_grad()
            micro = split(xb, yb, k)
            for i, (x, y) in enumerate(micro):
                last = i == len(micro) - 1
                if use_no_sync and not last:
                    # forward *and* backward inside no_sync: DDP decides whether to all-reduce when
                    # the forward pass runs, and skips it for every backward inside this block.
                    with model.no_sync():
                        (loss_fn(model(x), y) / k).backward()
                else:
                    (loss_fn(model(x), y) / k).backward()
            opt.step()
        out["no_sync" if use_no_sync else "sync"] = {
            "all_reduces": hooks.traffic.collectives,
            "bytes": hooks.traffic.bytes,
            "params": [p.detach().cpu().clone() for p in model.module.parameters()],
        }
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


def micro_batch_loss(logits: torch.Tensor, y: torch.Tensor, n_total: int) -> torch.Tensor:
    """One micro-batch's share of the large batch's mean cross-entropy (the reference answer)."""
    checks.integer("n_total (the large batch's size)", n_total, len(y))
    return nn.functional.cross_entropy(logits, y, reduction="sum") / n_total
