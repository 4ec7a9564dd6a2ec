"""Interactive explorers for the notebooks (ipywidgets).

``rank_explorer`` puts a rank slider on a low-rank approximation: pick a matrix (a real gradient,
a random matrix, a photograph), move the slider, and see the reconstruction, what it leaves out
(the residual, on the original's colour scale), its error, the best
error any rank-r approximation could have (the SVD's), and how much smaller P and Q are than M.
``memory_calculator`` shows what one rank holds under DDP and ZeRO stages 1 to 3 (notebook 04).
``period_explorer`` slides the bandwidth and the period H of local SGD, which all-reduces once every H
steps, against per-step methods (notebook 09).
"""

import io
import math
from decimal import ROUND_HALF_UP, Decimal

import ipywidgets as widgets
import matplotlib.cbook as cbook
import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import FuncFormatter

from course_lib import lowrank, sharding
from course_lib.costmodel import (
    break_even_bandwidth,
    break_even_period,
    periodic_step_time,
    predict_compressed_step_time,
    predict_step_time,
    ring_all_reduce_time,
)
from course_lib.support import checks
from course_lib.support.digits import gradient_snapshots

__all__ = ["hopper_gray", "default_matrices", "rank_explorer", "bandwidth_explorer", "compression_explorer",
           "memory_calculator", "period_explorer"]


def _png(fig) -> bytes:
    """``fig`` drawn as PNG bytes (for an ``ipywidgets.Image``), and closed so it is not also shown."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def hopper_gray() -> torch.Tensor:
    """matplotlib's bundled photograph of Grace Hopper, in grey, as a float32 (600 x 512) matrix."""
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        rgb = torch.tensor(plt.imread(f), dtype=torch.float32) / 255.0
    return rgb @ torch.tensor([0.299, 0.587, 0.114])


def default_matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    """The matrices notebook 05 talks about: its real gradient (the digits MLP's 256 x 256 hidden
    layer at step 40), its random matrix of the same shape, and the grey photograph."""
    grad = gradient_snapshots(40, seed=seed)[-1]["2.weight"]
    return {
        "gradient of a hidden layer, step 40 (256 x 256)": grad,
        "random Gaussian matrix (256 x 256)": torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)),
        "grace_hopper.jpg in grey (600 x 512)": hopper_gray(),
    }


class RankExplorer(widgets.VBox):
    """The widget :func:`rank_explorer` returns: ``.rank`` (IntSlider), ``.matrix`` (Dropdown),
    ``.text`` (HTML with the numbers) and ``.plot`` (an Image: the original, P Q^T, the residual
    M - P Q^T with its colour bar, and the error curve, rendered to PNG in the kernel, so they need
    no output capture and look the same in every front end)."""

    def __init__(self, matrices: dict[str, torch.Tensor], rank: int = 4, max_rank: int = 64, iters: int = 4,
                 seed: int = 0):
        if not matrices:
            raise ValueError("rank_explorer needs at least one matrix")
        checks.integer("max_rank", max_rank, 1)
        checks.integer("iters", iters, 1)
        self.matrices = {name: m.double() for name, m in matrices.items()}
        first = next(iter(self.matrices))
        # the slider would clip a rank outside its range and show another one without a word
        checks.integer(f"rank (for {first!r}, whose limit is min(max_rank, n, m))", rank, 1,
                       min(max_rank, *self.matrices[first].shape))
        self.iters, self.seed, self.max_rank = iters, seed, max_rank
        self._curves: dict[str, tuple] = {}
        first = next(iter(self.matrices))
        self.rank = widgets.IntSlider(value=rank, min=1, max=self._limit(first), description="rank",
                                      continuous_update=False)
        self.matrix = widgets.Dropdown(options=list(self.matrices), value=first, description="matrix",
                                       layout=widgets.Layout(width="420px"))
        self.text = widgets.HTML()
        self.plot = widgets.Image(format="png")
        super().__init__([widgets.HBox([self.matrix, self.rank]), self.text, self.plot])
        self.rank.observe(self._update, names="value")
        self.matrix.observe(self._on_matrix, names="value")
        self._update()

    def _limit(self, name: str) -> int:
        return min(self.max_rank, *self.matrices[name].shape)

    def _on_matrix(self, change=None):
        self.rank.max = self._limit(self.matrix.value)  # clips .value, which may redraw once
        self._update()

    def numbers(self) -> dict:
        """The current state: relative error of power iteration, the SVD optimum, the compression."""
        M = self.matrices[self.matrix.value]
        r = self.rank.value
        P, Q = lowrank.power_iteration(M, r, self.iters, generator=torch.Generator().manual_seed(self.seed))
        return {
            "rank": r,
            "relative error": lowrank.relative_error(M, P, Q),
            "svd optimum": lowrank.svd_error(M, r),
            "compression": lowrank.compression_ratio(*M.shape, r),
            "reconstruction": P @ Q.mT,
            "residual": M - P @ Q.mT,
        }

    def _update(self, change=None):
        s = self.numbers()
        self.text.value = (
            f"rank {s['rank']}: relative error {s['relative error']:.3f} "
            f"(power iteration, {self.iters} iterations) | SVD optimum {s['svd optimum']:.3f} | "
            f"compression {s['compression']:.1f}x"
        )
        self.plot.value = _png(self.figure(s))

    def figure(self, s: dict | None = None):
        """The picture for the state ``s`` (default: the current one): the original, P Q^T, the
        residual M - P Q^T with a colour bar, and the error against rank."""
        s = self.numbers() if s is None else s
        M = self.matrices[self.matrix.value]
        fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), width_ratios=[1, 1, 1.2, 1.3], layout="constrained")
        grey = "grey" in self.matrix.value
        # Signed matrices in red and blue, white at zero, saturated at the 90th percentile of |M|: a
        # gradient's few large entries would otherwise leave the rest of the picture white.
        v = torch.quantile(M.abs().flatten()[:: max(1, M.numel() // 100_000)], 0.9).item() or 1.0
        lo, hi = M.min().item(), M.max().item()
        scale = dict(cmap="gray", vmin=lo, vmax=hi) if grey else dict(cmap="RdBu_r", vmin=-v, vmax=v)
        for ax, img, title in ((axes[0], M, "original M"), (axes[1], s["reconstruction"], f"P Q^T, rank {s['rank']}")):
            ax.imshow(img.numpy(), **scale)
            ax.set_title(title)
            ax.axis("off")
        # The residual on the original's scale (a grey picture's residual is signed: red and blue over
        # the same width as the picture's grey levels), so that its size against M's shows.
        half = (hi - lo) / 2 or 1.0 if grey else v
        im = axes[2].imshow(s["residual"].numpy(), cmap="RdBu_r", vmin=-half, vmax=half)
        # the scale in the title, not as the bar's label, which would run into the next panel's axis label
        axes[2].set_title(f"residual M - P Q^T, {'grey levels' if grey else 'same scale as M'}\n"
                          f"(norm {s['relative error']:.3f} of M's)")
        axes[2].axis("off")
        fig.colorbar(im, ax=axes[2], fraction=0.046, pad=0.02)
        # the best error at every rank, and where this rank and power iteration stand on it
        ranks, best = self._svd_curve(self.matrix.value)
        ax = axes[3]
        ax.plot(ranks, best, color="grey", label="SVD optimum")
        ax.axvline(s["rank"], color="black", lw=0.8)
        ax.plot([s["rank"]], [s["relative error"]], "o", color="tab:red", label=f"power iteration ({self.iters} it.)")
        ax.set(xlabel="rank r", ylabel="relative error", title="Error against rank", ylim=(0, 1.05))
        ax.legend(fontsize=8)
        return fig

    def _svd_curve(self, name: str):
        if name not in self._curves:  # one SVD per matrix, however often the slider moves
            energy = torch.linalg.svdvals(self.matrices[name]).square()
            left = energy.flip(0).cumsum(0).flip(0)  # left[r] = the energy beyond the first r values
            ranks = list(range(1, self._limit(name) + 1))
            self._curves[name] = (ranks, [(left[r] / left[0]).sqrt().item() if r < len(left) else 0.0
                                          for r in ranks])
        return self._curves[name]


def rank_explorer(matrices: dict[str, torch.Tensor] | None = None, rank: int = 4, max_rank: int = 64,
                  iters: int = 4, seed: int = 0) -> RankExplorer:
    """A rank slider (1 up to ``max_rank`` or the matrix's limit) over a dropdown of matrices.

    Moving it recomputes a rank-r power-iteration approximation (``iters`` steps from a fixed
    seed, so the same rank always shows the same numbers) and redraws it beside the original, with
    the residual M - P Q^T on the original's colour scale.
    """
    return RankExplorer(matrices if matrices is not None else default_matrices(), rank, max_rank, iters, seed)


def _slider_table_plot(box: widgets.VBox, busbw: float, min_exponent: float, max_exponent: float,
                       extra: tuple = (), **slider) -> None:
    # An explorer's parts: a GB/s slider on a log scale (beside the ``extra`` controls, if any), an
    # HTML table and a picture, redrawn by box._update whenever a control moves (and once now).
    # ``slider``: the GB/s slider's description, style and layout, if not the plain "GB/s".
    # The slider would clip a value outside its range and show another one without a word.
    checks.number("busbw (GB/s, the slider's start)", busbw, 10**min_exponent, 10**max_exponent)
    checks.integer("world_size", box.world_size, 1)
    checks.number("alpha_s", box.alpha_s, 0)
    box.bandwidth = widgets.FloatLogSlider(value=busbw, base=10, min=min_exponent, max=max_exponent, step=0.05,
                                           continuous_update=False, **{"description": "GB/s", **slider})
    box.text = widgets.HTML()
    box.plot = widgets.Image(format="png")
    controls = widgets.HBox([box.bandwidth, *extra]) if extra else box.bandwidth
    widgets.VBox.__init__(box, [controls, box.text, box.plot])
    for control in (box.bandwidth, *extra):
        control.observe(box._update, names="value")
    box._update()


class BandwidthExplorer(widgets.VBox):
    """A bus-bandwidth slider over the predicted step time of each hook: ``.bandwidth`` (a
    FloatLogSlider in GB/s), ``.text`` (HTML table) and ``.plot`` (PNG)."""

    def __init__(self, hooks: dict[str, dict], world_size: int, alpha_s: float = 10e-6, busbw: float = 1.25,
                 compute_label: str = ""):
        if "all-reduce" not in hooks:
            raise ValueError("hooks must contain an 'all-reduce' entry: speed-ups are relative to it")
        self.hooks, self.world_size, self.alpha_s = hooks, world_size, alpha_s
        self.compute_label = compute_label  # whose computation compute_s is, shown with the table
        self._predict = predict_step_time
        _slider_table_plot(self, busbw, min_exponent=-1, max_exponent=3)

    def predictions(self, busbw: float | None = None) -> dict[str, float]:
        busbw = self.bandwidth.value if busbw is None else busbw
        return {name: self._predict(h["compute_s"], h["bytes"], h["collectives"], self.world_size, self.alpha_s,
                                    busbw) for name, h in self.hooks.items()}

    def _update(self, change=None):
        pred = self.predictions()
        base = pred["all-reduce"]
        rows = "".join(f"<tr><td>{n}</td><td>{t * 1e3:.2f} ms</td><td>{base / t:.2f}x</td></tr>"
                       for n, t in pred.items())
        self.text.value = (f"<b>bus bandwidth {self.bandwidth.value:.3g} GB/s</b>, "
                           f"latency {self.alpha_s * 1e6:.0f} µs, "
                           f"{self.world_size} workers"
                           + (f", computation: {self.compute_label}" if self.compute_label else "")
                           + "<table><tr><th>hook</th><th>step time</th>"
                           f"<th>speed-up vs all-reduce</th></tr>{rows}</table>")
        fig, ax = plt.subplots(figsize=(6, 2.6))
        names = list(pred)
        ax.barh(names, [pred[n] * 1e3 for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("predicted step time (ms)")
        ax.set_title(f"At {self.bandwidth.value:.3g} GB/s")
        self.plot.value = _png(fig)


def bandwidth_explorer(hooks: dict[str, dict], world_size: int, alpha_s: float = 10e-6,
                       busbw: float = 1.25, compute_label: str = "") -> BandwidthExplorer:
    """Slide the interconnect's bus bandwidth; see each hook's predicted step time and speed-up.

    ``hooks`` maps a name to ``{"compute_s": ..., "bytes": ..., "collectives": ...}`` per step
    (measured), one of them named "all-reduce". ``compute_label`` says whose computation
    ``compute_s`` is (a machine's own: a what-if keeps it, whatever link the slider picks).
    """
    return BandwidthExplorer(hooks, world_size, alpha_s, busbw, compute_label)


class CompressionExplorer(widgets.VBox):
    """A link-bandwidth slider over each method's predicted step time (compute, encode + decode,
    communication not hidden), or, given ``steps`` (each method's steps to a target accuracy), its
    predicted time to that accuracy: ``.bandwidth`` (GB/s, log scale), ``.text`` (HTML table) and ``.plot``."""

    def __init__(self, methods: dict[str, dict], world_size: int, alpha_s: float, busbw: float = 1.25,
                 reference: str = "fp32 all-reduce", steps: dict[str, float] | None = None):
        if reference not in methods:
            raise ValueError(f"methods must contain the reference {reference!r}: speed-ups are relative to it")
        if steps is not None and set(steps) != set(methods):
            raise ValueError("steps must give the steps to the target of every method, and of no other")
        self.methods, self.world_size, self.alpha_s, self.reference = methods, world_size, alpha_s, reference
        self.steps = steps
        self.break_even = {name: break_even_bandwidth(m, methods[reference], world_size, alpha_s,
                                                      *((steps[name], steps[reference]) if steps else ()))
                           for name, m in methods.items() if name != reference}
        _slider_table_plot(self, busbw, min_exponent=-2, max_exponent=2)

    def predictions(self, busbw: float | None = None) -> dict[str, float]:
        """Seconds per step, or to the target accuracy when ``steps`` was given."""
        busbw = self.bandwidth.value if busbw is None else busbw
        links = {"all_reduce": (self.alpha_s, busbw), "all_gather": (self.alpha_s, busbw)}
        return {name: (self.steps[name] if self.steps else 1)
                * predict_compressed_step_time(world_size=self.world_size, links=links, **m)
                for name, m in self.methods.items()}

    @property
    def _what(self) -> str:
        return "time to the target accuracy" if self.steps else "step time"

    def _update(self, change=None):
        pred = self.predictions()
        base = pred[self.reference]
        rows = "".join(f"<tr><td>{n}</td><td>{t * 1e3:.2f} ms</td><td>{base / t:.2f}x</td>"
                       f"<td>{_gbps(self.break_even.get(n))}</td></tr>" for n, t in pred.items())
        self.text.value = (f"<b>link {self.bandwidth.value:.3g} GB/s</b> ({8 * self.bandwidth.value:.3g} Gbit/s), "
                           f"latency {self.alpha_s * 1e6:.0f} µs, {self.world_size} workers"
                           f"<table><tr><th>method</th><th>{self._what}</th><th>speed-up vs {self.reference}</th>"
                           f"<th>pays below</th></tr>{rows}</table>")
        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = list(pred)
        ax.barh(names, [pred[n] * 1e3 for n in names],
                color=["tab:green" if pred[n] < base else "tab:gray" for n in names])
        ax.axvline(base * 1e3, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel(f"predicted {self._what} (ms); green: faster than " + self.reference)
        ax.set_title(f"At {self.bandwidth.value:.3g} GB/s")
        self.plot.value = _png(fig)


def _gbps(value) -> str:
    if value is None:
        return "(reference)"
    if value == 0:
        return "never"
    if value == float("inf"):
        return "always"
    return f"{value:.3g} GB/s"


def compression_explorer(methods: dict[str, dict], world_size: int, alpha_s: float, busbw: float = 1.25,
                         reference: str = "fp32 all-reduce", steps: dict[str, float] | None = None
                         ) -> CompressionExplorer:
    """Slide the link bandwidth; see each method's predicted step time, its speed-up over
    ``reference`` and the bandwidth below which it pays (:func:`course_lib.costmodel.break_even_bandwidth`).

    ``methods`` maps a name to the keyword arguments of
    :func:`~course_lib.costmodel.predict_compressed_step_time` (compute_s, codec_s, collectives, overlap_s).
    """
    return CompressionExplorer(methods, world_size, alpha_s, busbw, reference, steps)


# The memory calculator's choices, in words a student reads beside the controls
_OPTIMIZER_LABELS = {"sgd": "SGD (keeps no state)", "momentum": "SGD with momentum (4 bytes a parameter)",
                     "adam": "Adam (8 bytes a parameter: m and v)"}
_PRECISION_LABELS = {"fp32": "fp32", "mixed": "mixed (fp16 + fp32 master)"}
_STAGE_LABELS = ["0 (DDP)", "1", "2", "3"]
_STAGE_SHARDS = ["nothing sharded: plain DDP", "optimizer state sharded (ZeRO-1)",
                 "optimizer state and gradients sharded (ZeRO-2)",
                 "optimizer state, gradients and parameters sharded (ZeRO-3, FSDP)"]
_CATEGORIES = ["parameters", "gradients", "optimizer state", "activations"]
_CATEGORY_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:gray"]
_MAX_PARAMS, _MAX_WORLD, _MAX_ACTIVATION_BYTES = 10**12, 1024, 10**13


def _amount(n: int, size: int = 10**9) -> str:
    """Bytes ``n`` in units of ``size`` bytes (default GB, 10^9 bytes, as the ZeRO paper): to 0.1, halves
    rounded up as the paper rounds (1.875 GB is 1.9), or two significant digits below 0.1 (0.00064)."""
    if n >= size // 10:
        return str((Decimal(n) / size).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))
    return f"{n / size:.{1 - math.floor(math.log10(n / size))}f}" if n else "0"


def _unit(n: int) -> tuple[int, str]:
    """The largest of TB, GB, MB, kB and bytes that ``n`` bytes has at least one of (powers of 1000)."""
    return next(((size, name) for size, name in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))
                 if n >= size), (1, "bytes"))


def _count(n: int) -> str:
    """``n`` in words a reader says: 7.5 billion, 125 million, 40.1 thousand."""
    for size, name in ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (10**3, "thousand")):
        if n >= size:
            return f"{n / size:.3g} {name}"
    return str(n)


class MemoryCalculator(widgets.VBox):
    """What one rank holds under DDP and ZeRO stages 1 to 3: :func:`course_lib.sharding.bytes_per_rank`
    behind controls. ``.model_size`` (FloatLogSlider, parameters), ``.optimizer`` and ``.precision``
    (Dropdowns), ``.stage`` (ToggleButtons, 0 to 3), ``.world_size`` (SelectionSlider, 1 to 1024 ranks),
    ``.activations`` (BoundedFloatText, MB per rank); ``.tensors`` (a fixed int); ``.text`` (HTML, starting
    "<b>bytes per rank</b>", a table in bytes and GB) and ``.plot`` (PNG: the four stages side by side,
    the current one outlined). ``.ledger()`` returns the numbers shown.

    The exact ``n_params`` and ``activation_bytes`` given are used as long as their controls still show
    them (a float slider could not hold a 13-digit count exactly); once moved, the controls' values count.
    """

    def __init__(self, n_params: int, world_size: int = 2, stage: int = 0, optimizer: str = "adam",
                 precision: str = "fp32", tensors: int = 0, activation_bytes: int = 0):
        # the controls would clip a value outside their ranges and show another one without a word
        checks.integer("n_params", n_params, 1, _MAX_PARAMS)
        checks.integer("world_size", world_size, 1, _MAX_WORLD)
        checks.integer("activation_bytes", activation_bytes, 0, _MAX_ACTIVATION_BYTES)
        sharding.bytes_per_rank(n_params, stage, world_size, optimizer, precision, tensors, activation_bytes)
        self._n_params, self._activation_bytes, self.tensors = int(n_params), int(activation_bytes), int(tensors)
        style = {"description_width": "170px"}
        self.model_size = widgets.FloatLogSlider(
            value=n_params, base=10, min=min(3, math.floor(math.log10(n_params))), max=12, step=0.1,
            readout_format=".3s", description="model size (parameters)", continuous_update=False, style=style,
            layout=widgets.Layout(width="460px"))
        # powers of two, and the world size given if it is not one
        ranks = sorted({2**k for k in range(11)} | {world_size})
        self.world_size = widgets.SelectionSlider(options=ranks, value=world_size, description="ranks (world size)",
                                                  continuous_update=False, style=style,
                                                  layout=widgets.Layout(width="460px"))
        self.optimizer = widgets.Dropdown(options=[(_OPTIMIZER_LABELS.get(k, k), k) for k in sharding.OPTIMIZERS],
                                          value=optimizer, description="optimizer", style=style,
                                          layout=widgets.Layout(width="460px"))
        self.precision = widgets.Dropdown(options=[(_PRECISION_LABELS.get(k, k), k) for k in sharding.PRECISIONS],
                                          value=precision, description="precision", style=style,
                                          layout=widgets.Layout(width="460px"))
        self.stage = widgets.ToggleButtons(options=list(zip(_STAGE_LABELS, range(4))), value=stage,
                                           description="ZeRO stage", tooltips=_STAGE_SHARDS,
                                           style={**style, "button_width": "80px"})
        self.stage.add_class("widget-inline-hbox")  # its description beside the buttons, as the others' are
        self.activations = widgets.BoundedFloatText(value=activation_bytes / 1e6, min=0,
                                                    max=_MAX_ACTIVATION_BYTES / 1e6, step=100,
                                                    description="activations (MB per rank)", style=style,
                                                    layout=widgets.Layout(width="330px"))
        self.text = widgets.HTML()
        self.plot = widgets.Image(format="png")
        super().__init__([widgets.HBox([self.model_size, self.world_size]),
                          widgets.HBox([self.optimizer, self.precision]),
                          widgets.HBox([self.stage, self.activations]), self.text, self.plot])
        for control in (self.model_size, self.world_size, self.optimizer, self.precision, self.stage,
                        self.activations):
            control.observe(self._update, names="value")
        self._update()

    def settings(self) -> dict:
        """The keyword arguments of :func:`course_lib.sharding.bytes_per_rank` that the controls show."""
        shown = self.model_size.value
        n_params = self._n_params if shown == float(self._n_params) else max(1, round(shown))
        mb = self.activations.value
        activation_bytes = self._activation_bytes if mb == self._activation_bytes / 1e6 else round(mb * 1e6)
        return {"n_params": n_params, "stage": self.stage.value, "world_size": self.world_size.value,
                "optimizer": self.optimizer.value, "precision": self.precision.value, "tensors": self.tensors,
                "activation_bytes": activation_bytes}

    def ledger(self, stage: int | None = None) -> dict[str, int]:
        """Bytes per rank by category and in total, as shown (or at another ``stage``, as the picture shows it)."""
        s = self.settings()
        if stage is not None:
            s["stage"] = stage
        return sharding.bytes_per_rank(**s)

    def _update(self, change=None):
        s = self.settings()
        ledger = self.ledger()
        value, master = sharding.PRECISIONS[s["precision"]]
        k = sharding.OPTIMIZERS[s["optimizer"]] + master
        counter = ("Adam keeps a 4-byte step counter for each" if s["optimizer"] == "adam"
                   else f"{s['optimizer']} keeps no step counter")
        rows = "".join(f"<tr><td>{name}</td><td style='text-align:right'>{ledger[name]:,}</td>"
                       f"<td style='text-align:right'>{_amount(ledger[name])}</td></tr>" for name in _CATEGORIES)
        rows += (f"<tr><td><b>total</b></td><td style='text-align:right'><b>{ledger['total']:,}</b></td>"
                 f"<td style='text-align:right'><b>{_amount(ledger['total'])}</b></td></tr>")
        self.text.value = (
            f"<b>bytes per rank</b>: stage {s['stage']}, {_STAGE_SHARDS[s['stage']]}; {s['world_size']} "
            f"rank{'s' if s['world_size'] != 1 else ''}; "
            f"{s['n_params']:,} parameters, {_OPTIMIZER_LABELS.get(s['optimizer'], s['optimizer'])}, "
            f"{_PRECISION_LABELS.get(s['precision'], s['precision'])}<br>"
            f"per parameter: {value} bytes of parameters, {value} of gradients, K = {k} of optimizer state"
            + (" (with the fp32 master copy)" if master else "")
            + f"; step counters: {s['tensors']} tensors stepped per rank ({counter})"
            "<table><tr><th>category</th><th>bytes</th><th>GB (10<sup>9</sup> bytes)</th></tr>"
            f"{rows}</table>")
        self.plot.value = _png(self.figure())

    def figure(self):
        """The four stages side by side for the current settings, stacked by category, the current one outlined."""
        s = self.settings()
        ledgers = [self.ledger(stage) for stage in range(4)]
        size, unit = _unit(max(ledger["total"] for ledger in ledgers))
        labels = ["stage 0 (DDP)", "stage 1", "stage 2", "stage 3 (FSDP)"]
        fig, ax = plt.subplots(figsize=(7.5, 3))
        left = [0.0] * 4
        for name, colour in zip(_CATEGORIES, _CATEGORY_COLOURS):
            widths = [ledger[name] / size for ledger in ledgers]
            ax.barh(labels, widths, left=left, color=colour, label=name)
            left = [a + b for a, b in zip(left, widths)]
        current = s["stage"]
        ax.barh([labels[current]], [left[current]], fill=False, edgecolor="black", linewidth=2.5)
        for i, ledger in enumerate(ledgers):
            ax.text(left[i], i, f" {_amount(ledger['total'], size)} {unit}", va="center",
                    fontweight="bold" if i == current else None)
        ax.get_yticklabels()[current].set_fontweight("bold")
        ax.invert_yaxis()
        ax.set_xlim(0, max(left) * 1.25 or 1)
        ax.set_xlabel(f"memory per rank ({unit}{', 1 GB = 10^9 bytes' if unit == 'GB' else ''})")
        optimizer = {"sgd": "SGD", "momentum": "SGD with momentum", "adam": "Adam"}.get(s["optimizer"], s["optimizer"])
        ax.set_title(f"Per rank: {_count(s['n_params'])} parameters, {optimizer}, {s['precision']} precision, "
                     f"{s['world_size']} rank{'s' if s['world_size'] != 1 else ''}\n"
                     f"(outlined: the stage chosen, {current})")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig


def memory_calculator(n_params: int, world_size: int = 2, stage: int = 0, optimizer: str = "adam",
                      precision: str = "fp32", tensors: int = 0, activation_bytes: int = 0) -> MemoryCalculator:
    """Pick a model size, an optimizer, a precision, a ZeRO stage (0 is DDP), the number of ranks and the
    activations; see the bytes one rank holds, by category (:func:`course_lib.sharding.bytes_per_rank`), and
    all four stages side by side.

    ``tensors``: how many tensors each rank's optimizer steps (torch's Adam keeps a 4-byte step counter
    for each), fixed. The model-size slider spans 10^3 to 10^12 parameters (lower when ``n_params`` is).
    """
    return MemoryCalculator(n_params, world_size, stage, optimizer, precision, tensors, activation_bytes)


# The period explorer (notebook 09): local SGD all-reduces once every H steps
_PERIODS = [2**k for k in range(11)]  # the period slider's stops: 1, 2, 4, ..., 1024 steps
_REFERENCE_KEYS = {"compute_s", "codec_s", "collectives"}  # predict_compressed_step_time's, besides the optional
_REFERENCE_OPTIONAL = {"overlap_s", "wait_s"}
_REFERENCE_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                      "tab:cyan"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _rate(x: float) -> str:
    """A bandwidth's number: three significant digits, and whole from 100 up (1000, not 1e+03)."""
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _reference(name, reference, world_size: int, alpha_s: float):
    """A reference checked: a step time in seconds (a float), or predict_compressed_step_time's keyword arguments."""
    if not isinstance(reference, dict):
        return checks.number(f"references[{name!r}] (a step time in seconds, or a dict)", reference, 0,
                             low_open=True)
    keys = set(reference)
    if not _REFERENCE_KEYS <= keys or not keys <= _REFERENCE_KEYS | _REFERENCE_OPTIONAL:
        raise ValueError(f"references[{name!r}] must give predict_compressed_step_time's compute_s, codec_s and "
                         f"collectives (and optionally overlap_s, wait_s), got the keys {sorted(keys)}")
    try:
        ops = [op for op, _ in reference["collectives"]]
    except (TypeError, ValueError):
        ops = None
    if ops is None or not set(ops) <= {"all_reduce", "all_gather"}:
        raise ValueError(f"references[{name!r}]['collectives'] must be a list of (op, nbytes), op 'all_reduce' or "
                         f"'all_gather', got {reference['collectives']!r}")
    links = {"all_reduce": (alpha_s, 1.0), "all_gather": (alpha_s, 1.0)}
    try:  # its numbers, checked once here rather than at the first move of a slider
        predict_compressed_step_time(world_size=world_size, links=links, **reference)
    except ValueError as e:
        raise ValueError(f"references[{name!r}]: {e}") from None
    return dict(reference)


class PeriodExplorer(widgets.VBox):
    """Local SGD's predicted step time (one all-reduce every H steps, :func:`course_lib.costmodel.periodic_step_time`)
    against per-step methods: ``.bandwidth`` (FloatLogSlider, bus bandwidth in GB/s, 0.01 to 1000), ``.period``
    (SelectionSlider, H in steps: powers of two from 1 to 1024, and the ``period`` given), ``.text`` (HTML starting
    "<b>communicate every H steps</b>", H the slider's, then a table: each reference's step time, local SGD's,
    local SGD's speed-up over it and the break-even H) and ``.plot`` (PNG: step time against H).
    ``.predictions()`` returns the numbers shown. The box has the CSS class ``period-explorer``."""

    def __init__(self, compute_s: float, nbytes: float, world_size: int, alpha_s: float,
                 references: dict[str, float] | dict[str, dict], busbw: float = 1.25, period: int = 8,
                 compute_label: str = ""):
        checks.number("compute_s (seconds of computation a step)", compute_s, 0, low_open=True)
        checks.number("nbytes (bytes all-reduced every H steps)", nbytes, 0)
        checks.integer("world_size", world_size, 1)
        checks.number("alpha_s", alpha_s, 0)
        # the slider would clip a period outside its range and show another one without a word
        checks.integer("period (H, the period slider's start)", period, 1, _PERIODS[-1])
        if not isinstance(references, dict) or not references:
            raise ValueError("references must be a non-empty dict: a name -> a step time in seconds, or the keyword "
                             f"arguments of predict_compressed_step_time, got {references!r}")
        if not isinstance(compute_label, str):
            raise ValueError(f"compute_label must be a string, got {compute_label!r}")
        self.compute_s, self.nbytes, self.world_size, self.alpha_s = compute_s, nbytes, world_size, alpha_s
        self.compute_label = compute_label  # whose computation compute_s is, shown with the table
        self.references = {name: _reference(name, r, world_size, alpha_s) for name, r in references.items()}
        style = {"description_width": "160px"}
        self.period = widgets.SelectionSlider(options=sorted(set(_PERIODS) | {period}), value=period,
                                              description="period H (steps)", continuous_update=False, style=style,
                                              layout=widgets.Layout(width="460px"))
        _slider_table_plot(self, busbw, min_exponent=-2, max_exponent=3, extra=(self.period,),
                           description="bus bandwidth (GB/s)", style=style, layout=widgets.Layout(width="460px"))
        self.add_class("period-explorer")

    def _links(self, busbw: float) -> dict:
        return {"all_reduce": (self.alpha_s, busbw), "all_gather": (self.alpha_s, busbw)}

    def predictions(self, busbw: float | None = None, period: int | None = None) -> dict:
        """The numbers shown (at another bus bandwidth or period if given): ``busbw_GBps``, ``period``,
        ``all_reduce_s`` (one all-reduce of ``nbytes``), ``local_sgd_s`` (seconds per step, on average) and
        ``references``: for each, ``step_s``, ``speed_up`` (its step time over local SGD's) and
        ``break_even_period`` (the smallest H at which local SGD steps faster; ``inf``: none)."""
        busbw = self.bandwidth.value if busbw is None else busbw
        period = self.period.value if period is None else checks.integer("period", period, 1)
        link = (self.world_size, self.alpha_s, busbw)
        local = periodic_step_time(self.compute_s, self.nbytes, period, *link)
        references = {}
        for name, r in self.references.items():
            step = r if isinstance(r, float) else predict_compressed_step_time(
                world_size=self.world_size, links=self._links(busbw), **r)
            references[name] = {"step_s": step, "speed_up": step / local,
                                "break_even_period": break_even_period(self.compute_s, self.nbytes, step, *link)}
        return {"busbw_GBps": busbw, "period": period, "all_reduce_s": ring_all_reduce_time(self.nbytes, *link),
                "local_sgd_s": local, "references": references}

    def _update(self, change=None):
        p = self.predictions()
        h = p["period"]
        rows = "".join(
            f"<tr><td>{name}</td><td>{_ms(r['step_s'])}</td><td>{_ms(p['local_sgd_s'])}</td>"
            f"<td>{r['speed_up']:.2f}x</td>"
            f"<td>{'never' if r['break_even_period'] == float('inf') else int(r['break_even_period'])}</td></tr>"
            for name, r in p["references"].items())
        self.text.value = (
            f"<b>communicate every {h} step{'s' if h != 1 else ''}</b>: local SGD {_ms(p['local_sgd_s'])} a step "
            f"(one all-reduce of {self.nbytes / 1e6:.3g} MB, {_ms(p['all_reduce_s'])}, shared by {h} "
            f"step{'s' if h != 1 else ''}); bus bandwidth {_rate(p['busbw_GBps'])} GB/s "
            f"({_rate(8 * p['busbw_GBps'])} Gbit/s), latency {self.alpha_s * 1e6:.0f} µs, {self.world_size} workers"
            + (f", computation: {self.compute_label}" if self.compute_label else "")
            + "<table><tr><th>reference (every step)</th><th>its step time</th><th>local SGD, H = "
            f"{h}</th><th>speed-up of local SGD</th><th>break-even H (smallest that beats it)</th></tr>"
            f"{rows}</table>")
        self.plot.value = _png(self.figure(p))

    def figure(self, p: dict | None = None):
        """Step time against H (1 to 1024, log scales) at the current bandwidth: local SGD's curve, each
        reference as a horizontal line (a hollow circle where local SGD overtakes it), computation alone as the
        floor, and the slider's H marked."""
        p = self.predictions() if p is None else p
        link = (self.world_size, self.alpha_s, p["busbw_GBps"])
        periods = range(1, _PERIODS[-1] + 1)
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        ax.plot(periods, [periodic_step_time(self.compute_s, self.nbytes, h, *link) * 1e3 for h in periods],
                color="black", label="local SGD (all-reduce every H steps)")
        ax.axhline(self.compute_s * 1e3, color="grey", ls=":", label="computation alone (the floor)")
        for i, (name, r) in enumerate(p["references"].items()):
            colour = _REFERENCE_COLOURS[i % len(_REFERENCE_COLOURS)]
            h = r["break_even_period"]
            ax.axhline(r["step_s"] * 1e3, color=colour, ls="--",
                       label=f"{name} ({'never overtaken' if h == float('inf') else f'overtaken at H = {int(h)}'})")
            if h <= periods[-1]:
                ax.plot([h], [periodic_step_time(self.compute_s, self.nbytes, int(h), *link) * 1e3], "o",
                        color=colour, mfc="none")
        ax.axvline(p["period"], color="tab:red", lw=0.8)
        ax.plot([p["period"]], [p["local_sgd_s"] * 1e3], "o", color="tab:red",
                label=f"H = {p['period']}: {_ms(p['local_sgd_s'])} a step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_format(FuncFormatter(lambda value, _: f"{value:g}"))  # 60 and 0.9, not 6 x 10^1 and 9e-01
        ax.set_xlim(1, periods[-1])
        ax.set_xticks(_PERIODS[::2], [str(h) for h in _PERIODS[::2]])
        ax.set(xlabel="period H (steps between all-reduces, log scale)",
               ylabel="predicted step time (ms, log scale)",
               title=f"Step time against the period H at {_rate(p['busbw_GBps'])} GB/s, {self.world_size} workers")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig


def period_explorer(compute_s: float, nbytes: float, world_size: int, alpha_s: float,
                    references: dict[str, float] | dict[str, dict], busbw: float = 1.25, period: int = 8,
                    compute_label: str = "") -> PeriodExplorer:
    """Slide the bus bandwidth and local SGD's period H; see its predicted step time (one ring all-reduce of
    ``nbytes`` every H steps, :func:`course_lib.costmodel.periodic_step_time`) against per-step methods, its
    speed-up over each and the smallest H that beats each (:func:`course_lib.costmodel.break_even_period`).

    ``references`` maps a name to the keyword arguments of
    :func:`~course_lib.costmodel.predict_compressed_step_time` (compute_s, codec_s, collectives, overlap_s),
    evaluated at the slider's bandwidth on one link of latency ``alpha_s`` for both collectives, or to a
    step time in seconds (measured: the same at every bandwidth). ``compute_label`` says whose computation
    ``compute_s`` is.
    """
    return PeriodExplorer(compute_s, nbytes, world_size, alpha_s, references, busbw, period, compute_label)
