"""The rank slider on a low-rank approximation (notebook 06): ``rank_explorer``."""


import ipywidgets as widgets
import matplotlib.cbook as cbook
import matplotlib.pyplot as plt
import torch

from course_lib import lowrank
from course_lib.notebooks.widgets.common import _png
from course_lib.utils import checks
from course_lib.utils.digits import gradient_snapshots


def hopper_gray() -> torch.Tensor:
    """matplotlib's bundled photograph of Grace Hopper, in grey, as a float32 (600 x 512) matrix."""
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        rgb = torch.tensor(plt.imread(f), dtype=torch.float32) / 255.0
    return rgb @ torch.tensor([0.299, 0.587, 0.114])


def default_matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    """The matrices notebook 06 talks about: its real gradient (the digits MLP's 256 x 256 hidden
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
