"""Notebook 01: gradient accumulation."""

from torch import nn


def my_accumulate(model, loss_fn, micro_batches):
    n_total = sum(len(y) for _, y in micro_batches)
    model.zero_grad()
    for x, y in micro_batches:
        # each micro-batch's mean loss, weighted by its share of the examples
        (loss_fn(model(x), y) * len(y) / n_total).backward()


def my_micro_batch_loss(logits, y, n_total):
    return nn.functional.cross_entropy(logits, y, reduction="sum") / n_total


def my_combine_gradients(grads, sizes):
    n_total = sum(sizes)
    return [sum(g[i] * n / n_total for g, n in zip(grads, sizes)) for i in range(len(grads[0]))]


def my_count_all_reduces(steps, k, buckets, no_sync):
    # no_sync around the first k - 1 micro-batches: one all-reduce per bucket per step, else k
    return steps * buckets * (1 if no_sync else k)
