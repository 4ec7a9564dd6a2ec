"""Notebook 12: when does compression pay?"""

import math
import statistics


def my_break_even_bandwidth(hook, reference, world_size, alpha_s):
    # step = compute + c * 2(p-1) alpha + 2(p-1)/p * bytes / (busbw * 1e9): equal when
    # (difference in compute and latency) = 2(p-1)/p * (difference in bytes) / (busbw * 1e9)
    factor = 2 * (world_size - 1) / world_size
    fixed = (hook["compute_s"] - reference["compute_s"]
             + (hook["collectives"] - reference["collectives"]) * 2 * (world_size - 1) * alpha_s)
    saved_bytes = reference["bytes"] - hook["bytes"]
    if fixed < 0 and saved_bytes >= 0 or fixed == 0 and saved_bytes > 0:
        return math.inf  # no dearer at any bandwidth, and cheaper at some: faster everywhere
    if fixed >= 0 and saved_bytes <= 0:
        return 0.0  # no cheaper at any bandwidth: faster nowhere
    return factor * saved_bytes / fixed / 1e9  # (fixed < 0, saved_bytes < 0, faster only above, is not asked)


def my_ring_fit(sizes_bytes, times_s, world_size):
    # a ring all-reduce takes 2(p-1) alpha + 2(p-1)/p * n / busbw: a straight line in n whose intercept
    # is 2(p-1) alpha and whose slope is 1/algbw = 2(p-1)/p / busbw (busbw = algbw x 2(p-1)/p)
    slope, intercept = statistics.linear_regression(sizes_bytes, times_s)
    factor = 2 * (world_size - 1) / world_size
    return intercept / (2 * (world_size - 1)), factor / slope / 1e9
