"""The course's diagrams, drawn by code so they can be regenerated: ``make figures`` writes ``img/``.

``python -m course_lib.notebooks.figures [FOLDER]`` draws:

* ``ddp_procedure.png``: broadcast the parameters, forward/backward on each worker's batch,
  all-reduce the gradients, identical updates;
* ``bucket_hook_future.png``: how DDP hands gradient buckets to a communication hook;
* ``powersgd_factorization.png``: M ~ P Q^T, and what each costs to send;
* ``ring_allreduce.png``: a ring all-reduce on 4 processes, recorded from the algorithm itself: at each
  step, the chunk every rank sends to its right neighbour.

It also draws plots of a notebook's own results: ``plot_graph_states`` (notebook 01: the autograd
graph at each moment of a step), ``plot_ring_trace`` (what ``ring_allreduce.png`` draws, from any traced run) and
``plot_timeline`` (notebook 03: backward and all-reduces of one step, per rank, per wrapper),
``plot_alpha_beta_fit`` (notebook 02: a fit of time = alpha + n beta against its points, and their
ratio) and ``plot_busbw`` (notebook 02: bus bandwidth against message size, measured and modelled).
"""

import math
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import FancyBboxPatch, Patch

from course_lib.launch import spawn
from course_lib.notebooks.demos import ring_trace

__all__ = ["ddp_procedure", "bucket_hook_future", "powersgd_factorization", "ring_allreduce", "ring_sends",
           "plot_ring_trace", "plot_graph_states", "plot_timeline", "plot_alpha_beta_fit", "plot_busbw", "build_all"]

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
        _box(axes[2], 0.62, y, 0.34, 0.16, "ḡ = (g0+g1+g2)/3", COLORS["avg"], 7)
        _box(axes[3], 0.05, y, 0.9, 0.16, "θ ← θ − lr · ḡ", COLORS["param"])
    _box(axes[0], 0.02, 0.72, 0.3, 0.16, "θ (rank 0)", COLORS["param"])
    for y in ys:
        _arrow(axes[0], (0.32, 0.8), (0.55, y + 0.08))
    for y in ys:
        _arrow(axes[2], (0.35, y + 0.08), (0.62, y + 0.08))
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
    _box(ax, 6.3, 2.4, 2.6, 1.0, "hook(state, bucket)\nstarts the collective:\nall-reduce, or fp16 all-reduce",
         COLORS["hook"])
    _box(ax, 9.5, 2.5, 2.3, 0.8, "Future[Tensor]\n= averaged bucket", COLORS["avg"])
    _box(ax, 3.0, 0.4, 5.9, 0.9, "DDP waits for every bucket's future, copies the results into .grad", COLORS["box"])
    _box(ax, 9.5, 0.4, 2.3, 0.9, "optimizer.step()", COLORS["param"])
    _arrow(ax, (2.4, 3.05), (3.0, 3.2), "ready")
    _arrow(ax, (2.4, 2.9), (3.0, 2.3))
    _arrow(ax, (5.2, 3.2), (6.3, 3.0))
    _arrow(ax, (5.2, 2.3), (6.3, 2.7))
    ax.text(5.72, 2.8, "in bucket\norder", fontsize=7, ha="center", va="center")
    _arrow(ax, (8.9, 2.9), (9.5, 2.9), "returns")
    _arrow(ax, (10.6, 2.5), (7.6, 1.3))
    _arrow(ax, (8.9, 0.85), (9.5, 0.85))
    ax.text(0.1, 1.65, "the hook returns at once: bucket 0's all-reduce runs while\n"
            "backward goes on computing bucket 1's gradients",
            fontsize=8, style="italic", va="center")
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

def ring_sends(traces: list) -> list[list[tuple[int, int, int]]]:
    """Who sent which chunk to whom at each step of a traced ring all-reduce, read off the trace.

    ``traces[rank]`` is :func:`course_lib.notebooks.demos.ring_trace`'s list of states. The chunk a
    step changed on a rank is the one it received; it came from the left neighbour, which sends the
    chunk of the same index. Returns, per step, ``(sender, receiver, chunk)`` for every sender.
    """
    p = len(traces)
    sends = []
    for step in range(1, len(traces[0])):
        row = []
        for receiver in range(p):
            before, after = traces[receiver][step - 1][2], traces[receiver][step][2]
            changed = [c for c in range(p) if before[c] != after[c]]
            if len(changed) != 1:
                raise ValueError(f"step {step}: rank {receiver} changed chunks {changed}, not exactly one")
            row.append(((receiver - 1) % p, receiver, changed[0]))
        sends.append(sorted(row))
    return sends


def plot_ring_trace(traces: list):
    """One panel per step of a traced ring all-reduce: each rank's chunks after the step, and an
    arrow from every rank to its right neighbour naming the chunk it sent in that step.

    Rank r contributes 2**r to every chunk (:func:`course_lib.notebooks.demos.ring_trace`), so a
    chunk's value lists, in binary, the ranks whose data it holds.
    """
    p = len(traces)
    sends = [[]] + ring_sends(traces)
    steps = len(traces[0])
    ncols = (steps + 1) // 2
    fig, axes = plt.subplots(2, ncols, figsize=(4.8 * ncols, 9.6))
    cmap = plt.get_cmap("viridis", p + 1)
    w, h = 0.62, 0.32  # one chunk's box
    radius = 2.1
    centre = [(radius * math.sin(2 * math.pi * r / p), radius * math.cos(2 * math.pi * r / p)) for r in range(p)]
    for ax in axes.flat:
        ax.axis("off")
    for i, ax in enumerate(axes.flat[:steps]):
        phase, step, _ = traces[0][i]
        received = {dst: c for _, dst, c in sends[i]}
        for rank, (cx, cy) in enumerate(centre):
            x0 = cx - p * w / 2
            for c, v in enumerate(traces[rank][i][2].tolist()):
                members = [r for r in range(p) if int(v) >> r & 1]
                edge = ("#d62728", 2.6) if received.get(rank) == c else ("white", 0.5)
                ax.add_patch(plt.Rectangle((x0 + c * w, cy - h / 2), w * 0.94, h, facecolor=cmap(len(members)),
                                           edgecolor=edge[0], linewidth=edge[1]))
                label = f"all {p}" if len(members) == p else "+".join(map(str, members))
                ax.text(x0 + c * w + w * 0.47, cy, label, ha="center", va="center",
                        fontsize=7, color="white" if len(members) < p else "black")
                ax.text(x0 + c * w + w * 0.47, cy - h / 2 - 0.06, f"c{c}", ha="center", va="top", fontsize=6,
                        color="#555555")
            ax.text(cx, cy + h / 2 + 0.06, f"rank {rank}", ha="center", va="bottom", fontsize=9, weight="bold")
        for src, dst, c in sends[i]:
            (x1, y1), (x2, y2) = centre[src], centre[dst]
            ax.annotate("", xy=(x1 + 0.72 * (x2 - x1), y1 + 0.72 * (y2 - y1)),
                        xytext=(x1 + 0.28 * (x2 - x1), y1 + 0.28 * (y2 - y1)),
                        arrowprops=dict(arrowstyle="-|>", color="#d62728", lw=1.6, connectionstyle="arc3,rad=-0.2"))
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2
            norm = math.hypot(mx, my) or 1.0
            ax.text(mx + 0.5 * mx / norm, my + 0.5 * my / norm, f"sends c{c}", ha="center", va="center",
                    fontsize=8, color="#d62728")
        title = "start: rank r holds its own data (r)" if phase == "start" else f"{phase}, step {step + 1}"
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-radius - p * w / 2 - 0.1, radius + p * w / 2 + 0.1)
        ax.set_ylim(-radius - 0.6, radius + 0.6)
        ax.set_aspect("equal")
    legend = axes.flat[steps] if steps < axes.size else None
    if legend is not None:
        legend.text(0.02, 0.5,
                    f"{p} ranks in a ring, each tensor cut into {p} chunks (c0 … c{p - 1}).\n\n"
                    f"Each box lists the ranks whose data the chunk holds\n"
                    f"(yellow, \"all {p}\": the chunk is complete).\n"
                    f"Red arrow: what each rank sends to its right\nneighbour in that step; "
                    f"red edge: the chunk\nthat rank received (added to its own in\nreduce-scatter, "
                    f"copied in all-gather).\n\n"
                    f"After {p - 1} reduce-scatter steps rank r owns the\ncomplete chunk (r + 1) mod {p}; "
                    f"{p - 1} all-gather\nsteps pass the complete chunks on.\n"
                    f"Every rank sends 2({p}−1) chunks of n/{p}.",
                    transform=legend.transAxes, va="center", fontsize=8.5)
    fig.suptitle("Ring all-reduce, recorded from course_lib.collectives.ring_all_reduce on "
                 f"{p} gloo processes", fontsize=11)
    fig.tight_layout()
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
    # the two shades of each colour only tell neighbouring bars apart: one legend entry per colour
    shades = [tuple(Patch(color=c) for c in pair) for pair in (("#6baed6", "#2171b5"), ("#fd8d3c", "#d94801"))]
    fig.legend(shades, ["backward: a gradient accumulated (the two shades alternate from bar to bar)",
                        "an all-reduce (the two shades alternate from bar to bar)"],
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, fontsize=8, loc="lower center", ncol=2,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def plot_alpha_beta_fit(fits: dict):
    """Each fit of ``time = alpha + n beta`` against the points it was fitted to: ``fits`` maps a label
    to ``(sizes in bytes, times in seconds, (alpha_s, beta_s_per_byte))``. Left, the times and the
    fitted lines (dashed), log-log; right, measured / fitted at each size, where a line that misses
    shows (1 is a perfect fit)."""
    fig, (ax, res) = plt.subplots(1, 2, figsize=(12, 4))
    for (label, (sizes, times, (alpha, beta))), color in zip(fits.items(), ("C0", "C1", "C2", "C3")):
        fitted = [alpha + n * beta for n in sizes]
        ax.loglog(sizes, times, "o", color=color, label=f"{label}: measured")
        ax.loglog(sizes, fitted, "--", color=color,
                  label=f"fit: α = {alpha * 1e6:.0f} µs, 1/β = {1 / beta / 1e9:.2f} GB/s")
        res.semilogx(sizes, [t / f for t, f in zip(times, fitted)], "o-", color=color, label=label)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("one-way time (s)")
    ax.legend(fontsize=8)
    res.axhline(1.0, color="k", lw=0.8)
    res.set_xlabel("message size (bytes)")
    res.set_ylabel("measured / fitted")
    res.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_busbw(measured: dict, *modelled: dict):
    """Bus bandwidth (GB/s, nccl-tests' busbw) against message size per rank, log x: ``measured`` maps
    a label to ``(sizes, busbw)`` drawn as points joined by a line; each dict of ``modelled`` the same,
    dashed, then dotted, the i-th curve of each in the colour of the i-th measured one. Small
    messages are latency-bound (busbw grows with the size), large ones flat."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, (label, (sizes, busbw)) in enumerate(measured.items()):
        ax.semilogx(sizes, busbw, "o-", color=f"C{i}", label=f"{label}: measured")
    for style, curves in zip(("--", ":", "-."), modelled):
        for i, (label, (sizes, busbw)) in enumerate(curves.items()):
            ax.semilogx(sizes, busbw, style, color=f"C{i}", label=label)
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


_SHARD_COLORS = {"compute": "#6baed6", "all-gather": "#d94801", "prefetched all-gather": "#fd8d3c",
                 "reduce-scatter": "#31a354", "wait": "#bdbdbd"}


def plot_shard_timeline(runs: dict):
    """One ZeRO-3 step without and with prefetch (``sharding_runs.prefetch_runs``' rank 0): the main
    thread (forward compute, all-gathers it runs itself, waits for prefetched ones, reduce-scatters)
    above the second thread (prefetched all-gathers), in ms from the step's start."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, prefetch in zip(axes, (False, True)):
        events = runs[prefetch]["events"]
        t0 = min(start for _, _, start, _ in events)
        for what, unit, start, end in events:
            if what == "issue":
                continue
            lane = 0 if what == "prefetched all-gather" else 1
            ax.broken_barh([((start - t0) * 1e3, max((end - start) * 1e3, 0.05))], (lane + 0.1, 0.8),
                           color=_SHARD_COLORS[what])
            if what != "wait":
                ax.text((start - t0) * 1e3, lane + 0.5, f" {unit}", va="center", fontsize=7)
        ax.set_yticks([0.5, 1.5], ["second thread", "main thread"], fontsize=8)
        ax.set_title(f"{'with' if prefetch else 'without'} prefetch: one step of ZeRO-3 on rank 0 "
                     f"(numbers: the unit)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time since the step's first event (ms)")
    fig.legend([Patch(color=c) for c in _SHARD_COLORS.values()],
               ["forward of a unit", "all-gather (main thread)", "all-gather (second thread)", "reduce-scatter",
                "main thread waiting for a prefetched all-gather"], fontsize=8, loc="lower center", ncol=3,
               frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
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
    fig.suptitle(f"The graph at {len(states)} moments (green: .grad holds a gradient; yellow: .grad is None)",
                 fontsize=10)
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
