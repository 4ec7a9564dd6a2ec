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
from course_lib.digits import digits_tensors, mlp
from course_lib.exercises import check

__all__ = [
    "split",
    "accumulate_naive",
    "accumulate",
    "train",
    "saved_activation_bytes",
    "ddp_accumulation_worker",
    "graph_lines",
    "snapshot",
    "plot_graph_states",
    "micro_batch_loss",
    "check_accumulate",
    "check_micro_batch_loss",
]


def split(x: torch.Tensor, y: torch.Tensor, sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into micro-batches of the given sizes (an int k means k near-equal parts)."""
    if isinstance(sizes, int):
        return list(zip(x.tensor_split(sizes), y.tensor_split(sizes)))
    if sum(sizes) != len(x):
        raise ValueError(f"micro-batch sizes {list(sizes)} add up to {sum(sizes)}, not the batch size {len(x)}")
    return list(zip(x.split(list(sizes)), y.split(list(sizes))))


def accumulate_naive(model: nn.Module, loss_fn, micro_batches) -> float:
    """The textbook loop: each micro-batch's *mean* loss divided by k.

    Right when all micro-batches have the same size; slightly wrong otherwise, because a sample in
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
    model = mlp(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc=f"B={batch_size}, k={k}", leave=False)
    for step in steps_iter:
        start = (step * batch_size) % (len(x_train) - batch_size + 1)
        idx = order[start : start + batch_size]
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
    x_train, y_train, _, _ = digits_tensors()
    per_rank = global_batch // world_size
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    for use_no_sync in (False, True):
        model = DDP(mlp(seed=seed))
        # DDP's own behaviour, through the course's hook, which counts every all-reduce it issues
        model.register_comm_hook(None, hooks.allreduce_hook)
        hooks.traffic.reset()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            start = step * global_batch + rank * per_rank
            xb, yb = x_train[start : start + per_rank], y_train[start : start + per_rank]
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
            "params": [p.detach().clone() for p in model.module.parameters()],
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


def plot_graph_states(states: dict[str, dict]):
    """Draw the graph x -> (w, b) -> y -> loss once per moment, with the values autograd holds.

    ``states`` maps a title ("after backward", ...) to a :func:`snapshot`.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(states), figsize=(4.2 * len(states), 3.2))
    nodes = {"x": (0.1, 0.75), "w": (0.1, 0.45), "b": (0.1, 0.15), "y = w·x + b": (0.5, 0.45), "loss": (0.85, 0.45)}
    for ax, (title, s) in zip(axes, states.items()):
        for (a, b) in [("x", "y = w·x + b"), ("w", "y = w·x + b"), ("b", "y = w·x + b"), ("y = w·x + b", "loss")]:
            ax.annotate("", xy=nodes[b], xytext=nodes[a],
                        arrowprops=dict(arrowstyle="->", color="grey", shrinkA=18, shrinkB=24))
        for name, (px, py) in nodes.items():
            label = name
            color = "whitesmoke"
            if name in ("w", "b"):
                grad = s[f"{name}.grad"]
                label = f"{name} = {s[name]}\n.grad = {grad}"
                color = "lightyellow" if grad is None else "lightgreen"
            ax.text(px, py, label, ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="round", facecolor=color, edgecolor="grey"))
        ax.set_title(title)
        ax.set_xlim(-0.15, 1.0)
        ax.set_ylim(0, 0.9)
        ax.axis("off")
    fig.suptitle("The graph at three moments (green: .grad holds a gradient; yellow: .grad is None)", fontsize=10)
    fig.tight_layout()
    return fig


# --- exercises --------------------------------------------------------------------------------

def _grads_after(accumulate_fn, sizes) -> list[torch.Tensor]:
    x_train, y_train, _, _ = digits_tensors()
    n = 48 if isinstance(sizes, int) else sum(sizes)
    model = mlp(seed=1)
    accumulate_fn(model, nn.CrossEntropyLoss(), split(x_train[:n], y_train[:n], sizes))
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def check_accumulate(student_fn) -> bool:
    """Exercise: ``student_fn(model, loss_fn, micro_batches)`` leaves the large batch's gradient in ``.grad``.

    Checked on 48 digits split in 4 equal parts, then in unequal parts [30, 10, 5, 3].
    """
    return check(lambda s: _grads_after(student_fn, s), lambda s: _grads_after(accumulate, s),
                 [(4,), ([30, 10, 5, 3],)], name=getattr(student_fn, "__name__", "accumulate"))


def micro_batch_loss(logits: torch.Tensor, y: torch.Tensor, n_total: int) -> torch.Tensor:
    """One micro-batch's share of the large batch's mean cross-entropy (the reference answer)."""
    return nn.functional.cross_entropy(logits, y, reduction="sum") / n_total


def check_micro_batch_loss(student_fn) -> bool:
    """Exercise: ``student_fn(logits, y, n_total)`` so that the micro-batch losses sum to the batch's mean loss."""
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(n, 10, generator=g), torch.randint(0, 10, (n,), generator=g), total)
             for n, total in [(30, 48), (3, 48), (16, 16)]]
    return check(student_fn, micro_batch_loss, cases, name=getattr(student_fn, "__name__", "micro_batch_loss"))
