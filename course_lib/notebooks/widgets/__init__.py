"""Interactive explorers for the notebooks (ipywidgets).

``rank_explorer`` puts a rank slider on a low-rank approximation: pick a matrix (a real gradient,
a random matrix, a photograph), move the slider, and see the reconstruction, what it leaves out
(the residual, on the original's colour scale), its error, the best
error any rank-r approximation could have (the SVD's), and how much smaller P and Q are than M.
``memory_calculator`` shows what one rank holds under DDP and ZeRO stages 1 to 3 (notebook 05).
``period_explorer`` slides the bandwidth and the period H of local SGD, which all-reduces once every H
steps, against per-step methods (notebook 11).
"""

from course_lib.notebooks.widgets.links import bandwidth_explorer, compression_explorer, period_explorer
from course_lib.notebooks.widgets.low_rank import default_matrices, hopper_gray, rank_explorer
from course_lib.notebooks.widgets.zero_memory import MemoryCalculator, memory_calculator

__all__ = ["hopper_gray", "default_matrices", "rank_explorer", "bandwidth_explorer", "compression_explorer",
           "memory_calculator", "MemoryCalculator", "period_explorer"]
