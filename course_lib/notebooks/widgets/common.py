"""What the explorers share: a figure as PNG bytes, and a slider above a table and a plot."""

import io

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib.utils import checks


def _png(fig) -> bytes:
    """``fig`` drawn as PNG bytes (for an ``ipywidgets.Image``), and closed so it is not also shown."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


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
