"""Telling two methods apart over a few seeds: the gap between their means, its standard error, and a
verdict that is given only two standard errors or more from the line it is about.

Two standard errors is a rule of thumb from the normal distribution (with three seeds a t-test would
ask for about 2.8), and the standard error takes the two methods' runs as independent, though the
course's methods share seeds (the same initialization and batch order): a paired one would use each
seed's difference (`paired`). Notebooks 10 and 11 read their results with it.
"""

import math
import statistics

WITHIN, BEYOND, UNDECIDED = "within", "beyond", "undecided"


def difference(mean_a: float, sd_a: float, mean_b: float, sd_b: float, seeds: int) -> tuple[float, float]:
    """``mean_a - mean_b`` and the standard error of that difference, each mean over ``seeds`` runs
    with standard deviation ``sd_a`` or ``sd_b``."""
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 2:
        raise ValueError(f"seeds is the number of runs behind each mean, at least 2 for a standard deviation; "
                         f"got {seeds!r}")
    if not (sd_a >= 0 and sd_b >= 0):
        raise ValueError(f"standard deviations are >= 0; got {sd_a!r} and {sd_b!r}")
    return mean_a - mean_b, math.sqrt((sd_a ** 2 + sd_b ** 2) / seeds)


def paired(a, b) -> tuple[float, float]:
    """The mean of ``a[i] - b[i]`` and its standard error, for runs paired by seed (the same
    initialization and batches): what the seeds share cancels, and only their differences count."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired runs come in two lists of the same length, at least 2; got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    return statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))


def verdict(gap: float, se: float, limit: float, signed: bool = False) -> str:
    """``"within"`` if |gap| lies two standard errors or more below ``limit``, ``"beyond"`` if two or
    more above it, else ``"undecided"``. With ``limit=0``, ``"beyond"`` says the two differ.

    ``signed=True`` asks about one direction only, the gap itself rather than its size (e.g. "at most
    2 points behind", with the gap counted as points behind): a gap far on the other side is "within"."""
    if not (se >= 0 and limit >= 0):
        raise ValueError(f"se and limit are >= 0; got se={se!r}, limit={limit!r}")
    size = gap if signed else abs(gap)
    if size < limit - 2 * se:
        return WITHIN
    if size > limit + 2 * se:
        return BEYOND
    return UNDECIDED
