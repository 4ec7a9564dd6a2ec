"""Notebook 10: when does compression pay?"""

import math


def my_break_even_bandwidth(hook, reference, world_size, alpha_s):
    # step = compute + c * 2(p-1) alpha + 2(p-1)/p * bytes / (busbw * 1e9): equal when
    # (difference in compute and latency) = 2(p-1)/p * (difference in bytes) / (busbw * 1e9)
    factor = 2 * (world_size - 1) / world_size
    fixed = (hook["compute_s"] - reference["compute_s"]
             + (hook["collectives"] - reference["collectives"]) * 2 * (world_size - 1) * alpha_s)
    extra_bytes = reference["bytes"] - hook["bytes"]
    if fixed == 0 or extra_bytes == 0 or (fixed > 0) != (extra_bytes > 0):
        return math.nan
    return factor * extra_bytes / fixed / 1e9


def my_all_gather_busbw(size_bytes, time_s, world_size):
    return size_bytes / time_s / 1e9 * (world_size - 1) / world_size
