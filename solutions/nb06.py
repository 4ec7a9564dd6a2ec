"""Notebook 06: PowerSGD."""

import math


def my_should_compress(n, m, r, min_compression_rate):
    return (n + m) * r * min_compression_rate < n * m


def my_error_feedback_step(grad, error, compress):
    corrected = grad + error
    sent = compress(corrected)
    return sent, corrected - sent


def my_numbers_per_step(shapes, r, min_compression_rate):
    total = 0
    for shape in shapes:
        if len(shape) == 1:  # a bias: sent as it is
            total += shape[0]
            continue
        n, m = shape[0], math.prod(shape[1:])  # a matrix: rows x everything else
        rank = min(n, m, r)
        compressed = (n + m) * rank
        total += compressed if compressed * min_compression_rate < n * m else n * m
    return total
