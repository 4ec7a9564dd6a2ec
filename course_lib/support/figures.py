"""The course's diagrams, drawn by code so they can be regenerated: ``make figures`` writes ``img/``.

``python -m course_lib.support.figures [FOLDER]`` draws:

* ``ddp_procedure.png``: broadcast the parameters, forward/backward on each worker's batch,
  all-reduce the gradients, identical updates;
* ``bucket_hook_future.png``: how DDP hands gradient buckets to a communication hook;
* ``powersgd_factorization.png``: M ~ P Q^T, and what each costs to send;
* ``ring_allreduce.png``: a ring all-reduce on 4 processes, recorded from the algorithm itself.

It also draws plots of a notebook's own results: ``plot_graph_states`` (notebook 01: the autograd
graph at three moments), ``plot_ring_trace`` (notebook 02: a ring all-reduce traced live) and
``plot_timeline`` (notebook 03: backward and all-reduces of one step, per rank, per wrapper).
"""

import sys
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

from course_lib.launch import spawn
from course_lib.support.demos import ring_trace

__all__ = ["ddp_procedure", "bucket_hook_future", "powersgd_factorization", "ring_allreduce", "plot_ring_trace",
           "plot_graph_states", "plot_timeline", "build_all"]

COLORS = {"param": "#9ecae1", "grad": "#fdae6b", "avg": "#a1d99b", "box": "#f0f0f0", "hook": "#fdd0a2"}


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="#555555"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, text=None, color="#333333"):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=color, lw=1.2))
    if text:
        lift = 0.03 * (ax.get_ylim()[1] - ax.get_ylim()[0])
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + lift, text, ha="center", fontsize=7)


def ddp_procedure():
    """Four steps of data-parallel training on three workers."""
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    titles = ["1. broadcast parameters\n(once, from rank 0)", "2. forward + backward\n(each on its own batch)",
              "3. all-reduce gradients\n(average over workers)", "4. optimizer step\n(identical everywhere)"]
    for ax, title in zip(axes, titles):
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")
        ax.set_title(title, fontsize=9)
    ys = [0.72, 0.42, 0.12]
    for i, y in enumerate(ys):
        _box(axes[0], 0.55, y, 0.38, 0.16, f"rank {i}: θ", COLORS["param"])
        _box(axes[1], 0.05, y, 0.42, 0.16, f"batch {i} → loss", COLORS["box"])
        _box(axes[1], 0.58, y, 0.38, 0.16, f"g{i} = ∇loss{i}", COLORS["grad"])
        _arrow(axes[1], (0.47, y + 0.08), (0.58, y + 0.08))
        _box(axes[2], 0.05, y, 0.3, 0.16, f"g{i}", COLORS["grad"])
        _box(axes[2], 0.62, y, 0.34, 0.16, "(g0+g1+g2)/3", COLORS["avg"], 7)
        _box(axes[3], 0.05, y, 0.9, 0.16, "θ ← θ − lr · ḡ", COLORS["param"])
    _box(axes[0], 0.02, 0.72, 0.3, 0.16, "θ (rank 0)", COLORS["param"])
    for y in ys:
        _arrow(axes[0], (0.32, 0.8), (0.55, y + 0.08))
    for y in ys:
        _arrow(axes[2], (0.35, y + 0.08), (0.62, y + 0.08))
    axes[2].text(0.48, 0.02, "ring: every rank sends 2(p−1)/p of g", ha="center", fontsize=7)
    fig.tight_layout()
    return fig


def bucket_hook_future():
    """Backward fills buckets; each full bucket goes through the hook; DDP waits on the futures."""
    fig, ax = plt.subplots(figsize=(12, 3.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 4)
    ax.axis("off")
    _box(ax, 0.1, 2.6, 2.3, 0.9, "loss.backward()\ngradients appear\nlast layer first", COLORS["box"])
    _box(ax, 3.0, 2.9, 2.2, 0.6, "bucket 0: layer 3, 2", COLORS["grad"])
    _box(ax, 3.0, 2.0, 2.2, 0.6, "bucket 1: layer 1", COLORS["grad"])
    _box(ax, 6.0, 2.4, 2.6, 1.0, "hook(state, bucket)\nstarts the collective:\nall-reduce, fp16, PowerSGD",
         COLORS["hook"])
    _box(ax, 9.3, 2.5, 2.5, 0.8, "Future[Tensor]\n= averaged bucket", COLORS["avg"])
    _box(ax, 3.0, 0.4, 5.6, 0.9, "DDP waits for every bucket's future, copies the results into .grad", COLORS["box"])
    _box(ax, 9.3, 0.4, 2.5, 0.9, "optimizer.step()", COLORS["param"])
    _arrow(ax, (2.4, 3.05), (3.0, 3.2), "ready")
    _arrow(ax, (2.4, 2.9), (3.0, 2.3))
    _arrow(ax, (5.2, 3.2), (6.0, 3.0), "in bucket order")
    _arrow(ax, (5.2, 2.3), (6.0, 2.7))
    _arrow(ax, (8.6, 2.9), (9.3, 2.9), "returns")
    _arrow(ax, (10.5, 2.5), (7.5, 1.3))
    _arrow(ax, (8.6, 0.85), (9.3, 0.85))
    ax.text(0.1, 1.65, "a hook that returns at once (all-reduce, fp16) lets bucket 0's communication overlap the\n"
            "backward pass of bucket 1; the course's PowerSGD hook waits for its all-reduces, so it does not",
            fontsize=7, style="italic", va="center")
    fig.tight_layout()
    return fig


def powersgd_factorization(n: int = 8, m: int = 6, r: int = 2):
    """M (n x m) is sent as P (n x r) and Q (m x r): (n + m) r numbers instead of n m."""
    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.set_xlim(0, 20)
    ax.set_ylim(-1.5, n + 1)
    ax.axis("off")
    ax.add_patch(plt.Rectangle((0, 0), m, n, facecolor=COLORS["grad"], edgecolor="black"))
    ax.text(m / 2, n / 2, "M\nn × m", ha="center", va="center", fontsize=12)
    ax.text(m + 1, n / 2, "≈", fontsize=22, va="center")
    ax.add_patch(plt.Rectangle((m + 2.5, 0), r, n, facecolor=COLORS["param"], edgecolor="black"))
    ax.text(m + 2.5 + r / 2, n / 2, "P\nn×r", ha="center", va="center", fontsize=10)
    ax.text(m + 3.2 + r, n / 2, "×", fontsize=18, va="center")
    ax.add_patch(plt.Rectangle((m + 4.5 + r, n - r), m, r, facecolor=COLORS["avg"], edgecolor="black"))
    ax.text(m + 4.5 + r + m / 2, n - r / 2, "Qᵀ  r × m", ha="center", va="center", fontsize=10)
    ax.text(10, -0.9, f"all-reduce sends n·m numbers; PowerSGD sends (n + m)·r: for a 1024 × 1024 layer at "
            f"rank 2, {1024 * 1024 // (2048 * 2)}× fewer", ha="center", fontsize=9)
    ax.text(m + 4.5 + r, n - r - 1.5, "P = M Q,  all-reduce P, orthogonalize\nQ = Mᵀ P,  all-reduce Q, average",
            fontsize=9, va="top")
    return fig


def ring_allreduce():
    """The ring all-reduce's real states on 4 gloo processes (this starts processes)."""
    return plot_ring_trace(spawn(ring_trace, 4, backend="gloo"))


# --- figures drawn from a notebook's own results --------------------------------------------------

def plot_ring_trace(traces: list):
    """Draw which ranks' data each chunk holds on each rank after each step of the ring all-reduce."""
    p = len(traces)
    steps = len(traces[0])
    fig, axes = plt.subplots(steps, 1, figsize=(1.1 * p * p + 1.5, 0.75 * steps + 0.6))
    cmap = plt.get_cmap("viridis", p + 1)
    for row, ax in enumerate(axes):
        phase, step, _ = traces[0][row]
        for rank in range(p):
            values = traces[rank][row][2].tolist()
            for c, v in enumerate(values):
                members = [r for r in range(p) if int(v) >> r & 1]
                x = rank * (p + 1) + c
                ax.add_patch(plt.Rectangle((x, 0), 0.95, 0.9, color=cmap(len(members))))
                ax.text(x + 0.47, 0.45, "+".join(map(str, members)), ha="center", va="center", fontsize=7,
                        color="white" if len(members) < p else "black")
        label = "start" if phase == "start" else f"{phase}\nstep {step + 1}"
        ax.text(-0.4, 0.45, label, ha="right", va="center", fontsize=8)
        ax.set_xlim(-0.2, p * (p + 1))
        ax.set_ylim(0, 1)
        ax.axis("off")
    for rank in range(p):
        axes[0].text(rank * (p + 1) + p / 2, 1.15, f"rank {rank}: chunks 0..{p - 1}", ha="center", fontsize=9)
    fig.suptitle("Ring all-reduce, recorded from the algorithm: each box lists the ranks whose data a chunk holds",
                 fontsize=10, y=1.0)
    fig.subplots_adjust(left=0.16, hspace=0.15)
    return fig


def plot_timeline(outs: list[dict], kinds: tuple = ("naive", "bucket")):
    """One step of each wrapper in ``kinds``, per rank: when autograd produced each gradient (top lane)
    and when each all-reduce ran (bottom lane), in ms from the step's start.

    ``outs`` is what :func:`course_lib.data_parallel.step_times` returned, one dict per rank.
    """
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 1.6 * len(outs) * len(kinds) / 2 + 1), sharex=True,
                             squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        ticks, labels = [], []
        for rank, out in enumerate(outs):
            t0, y = out[kind]["step_start_s"], 3 * (len(outs) - 1 - rank)
            for i, event in enumerate(e for e in out[kind]["events"] if e.kind == "backward"):
                ax.broken_barh([((event.start_s - t0) * 1e3, (event.end_s - event.start_s) * 1e3)], (y + 1.1, 0.8),
                               color=("#6baed6", "#2171b5")[i % 2])
            for i, event in enumerate(e for e in out[kind]["events"] if e.kind == "all_reduce"):
                ax.broken_barh([((event.start_s - t0) * 1e3, (event.end_s - event.start_s) * 1e3)], (y + 0.1, 0.8),
                               color=("#fd8d3c", "#d94801")[i % 2])
            ticks += [y + 1.5, y + 0.5]
            labels += [f"rank {rank} backward", f"rank {rank} all-reduce"]
        ax.set_yticks(ticks, labels, fontsize=8)
        ax.set_title(f"{kind}: backward (blue, one bar per gradient) and all-reduces (orange, one bar each)",
                     fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the step started (ms)")
    fig.tight_layout()
    return fig


def plot_graph_states(states: dict[str, dict]):
    """Draw the graph x -> (w, b) -> y -> loss once per moment, with the values autograd holds.

    ``states`` maps a title ("after backward", ...) to a :func:`snapshot`.
    """
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


def build_all(folder: str = "img") -> list[Path]:
    """Draw every figure into ``folder``; returns the files written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in [("ddp_procedure", ddp_procedure), ("bucket_hook_future", bucket_hook_future),
                       ("powersgd_factorization", powersgd_factorization), ("ring_allreduce", ring_allreduce)]:
        fig = make()
        path = out / f"{name}.png"
        fig.savefig(path, bbox_inches="tight", dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in build_all(sys.argv[1] if len(sys.argv) > 1 else "img"):
        print("wrote", path)
