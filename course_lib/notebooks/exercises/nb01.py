"""Notebook 01's exercises (gradient accumulation): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import (
    accumulation,
)
from course_lib.notebooks.exercises.core import _COURSE_ANSWER, _name, _run_student, compare, refused_calls

_TOKEN_EXERCISE = dict(sequences_per_micro_batch=2, k=3)


def _token_step_worker(rank: int, world_size: int, student_fn) -> dict:
    """The student's DDP step on this rank's share of unequal-length sequences, and what it did.

    The reference, another way: one model (no DDP) and autograd on the mean loss over every token of
    every rank's sequences at once. The profiler records each all-reduce the step runs (its number
    of elements), and a forward pre-hook the number of tokens each forward pass saw.
    """
    c = _TOKEN_EXERCISE
    per_rank = c["sequences_per_micro_batch"] * c["k"]
    sequences = accumulation.token_sequences(per_rank * world_size, seed=world_size)
    ref = accumulation.bigram_lm()
    accumulation.token_losses(ref, sequences).mean().backward()
    share = sequences[rank * per_rank:(rank + 1) * per_rank]
    micro = [share[i::c["k"]] for i in range(c["k"])]
    model = DDP(accumulation.bigram_lm())
    forwards: list[int] = []
    model.module.register_forward_pre_hook(lambda _module, args: forwards.append(args[0].numel()))
    with accumulation._quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof, \
            refused_calls((accumulation.accumulate_tokens,), _name(student_fn, "ddp_token_step"), _COURSE_ANSWER):
        student_fn(model, micro)
    all_reduces = [sum(torch.Size(s).numel() for s in e.input_shapes) for e in prof.events()
                   if e.name.endswith(":all_reduce") and not e.name.startswith("c10d")]
    return {
        "want": [p.grad.clone() for p in ref.parameters()],
        "got": [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.module.parameters()],
        "tokens": [sum(len(s) - 1 for s in m) for m in micro],
        "forwards": forwards,
        "all_reduces": all_reduces,
        "gradient_numbers": sum(p.numel() for p in ref.parameters()),
    }


def check_ddp_token_step(student_fn) -> bool:
    """``student_fn(model, micro_batches)`` in a ``.py`` file: one accumulation step under DDP on
    sequences of unequal lengths. ``model`` is a DDP-wrapped ``accumulation.bigram_lm()``,
    ``micro_batches`` this rank's k lists of token sequences. After it, every rank's ``.grad`` must
    hold the gradient of the mean loss over *all* tokens of all ranks (checked on 2 and 3 gloo ranks
    against autograd on the whole batch in one process), with one forward and backward per
    micro-batch and the gradient all-reduced once (``no_sync`` around the first k - 1)."""
    name = _name(student_fn, "ddp_token_step", in_processes=True)
    k = _TOKEN_EXERCISE["k"]
    for world_size in (2, 3):
        results = _run_student(_token_step_worker, world_size, student_fn, name)
        if results is None:
            return False
        for rank, r in enumerate(results):
            where = f"[FAIL] {name}, world size {world_size}, rank {rank} (tokens per micro-batch {r['tokens']})"
            if r["forwards"] != r["tokens"]:
                print(f"{where}: the forward passes saw {r['forwards']} tokens; the exercise asks for one "
                      f"forward and backward per micro-batch.")
                return False
            why = compare(r["want"], r["got"], rtol=1e-9, atol=1e-12)
            if why:
                print(f"{where}: .grad is not the gradient of the mean loss over every rank's tokens: {why}")
                return False
            syncs = sum(n == r["gradient_numbers"] for n in r["all_reduces"])
            if syncs != 1:
                print(f"{where}: DDP all-reduced the gradient {syncs} times in the step; with no_sync around "
                      f"the first k − 1 = {k - 1} micro-batches it does so once, after the last.")
                return False
    print(f"[PASS] {name}: the whole batch's gradient on every rank, world sizes 2 and 3, "
          f"one gradient all-reduce per step.")
    return True
