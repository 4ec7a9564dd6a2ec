"""The bandwidth sliders: per-step methods against each other (``bandwidth_explorer``, notebook 12;
``compression_explorer``, notebook 10) and local SGD's period (``period_explorer``, notebook 11)."""


import ipywidgets as widgets
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from course_lib.costmodel import (
    break_even_bandwidth,
    break_even_period,
    periodic_step_time,
    predict_compressed_step_time,
    predict_step_time,
    ring_all_reduce_time,
)
from course_lib.notebooks.widgets.common import _png, _slider_table_plot
from course_lib.utils import checks


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
