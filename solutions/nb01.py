"""Notebook 01: gradient accumulation (the exercise is written in ``my_accumulation.py``)."""

import contextlib

import torch
import torch.distributed as dist

from course_lib.accumulation import token_losses


def ddp_token_step(model, micro_batches):
    # the global token count first: every token of every micro-batch of every rank
    n_tokens = torch.tensor([sum(len(s) - 1 for m in micro_batches for s in m)])
    dist.all_reduce(n_tokens)
    k, world_size = len(micro_batches), dist.get_world_size()
    for i, sequences in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            # DDP divides the sum over ranks by world_size: multiply it back
            (token_losses(model, sequences).sum() * world_size / n_tokens.item()).backward()
