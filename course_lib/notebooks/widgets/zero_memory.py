"""What one rank holds under DDP and ZeRO stages 1 to 3 (notebook 05): ``memory_calculator``."""

import math
from decimal import ROUND_HALF_UP, Decimal

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib import sharding
from course_lib.notebooks.widgets.common import _png
from course_lib.utils import checks

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


# The period explorer (notebook 11): local SGD all-reduces once every H steps
