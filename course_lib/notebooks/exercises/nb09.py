"""Notebook 09's exercises (compression): each ``check_*`` holds the inputs and the reference answer."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib import (
    compressors,
    memory,
)
from course_lib.notebooks.exercises.core import (
    _COURSE_ANSWER,
    NotAllowed,
    Rules,
    _describe,
    _name,
    _short,
    check,
    check_distributed,
    refused_calls,
)


def topk_inputs(rank: int, world_size: int):
    """Each rank's input for notebook 09's top-k exercise: its own gradient (40 entries, alike enough
    across ranks that some of their largest entries share indices and others do not) and k = 6."""
    shared = torch.randn(40, generator=torch.Generator().manual_seed(299))
    return (shared + 0.5 * torch.randn(40, generator=torch.Generator().manual_seed(300 + rank)), 6)


def topk_average_expected(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """The mean over ranks of each rank's top-k, another way than ``compressors.TopK``: every rank's
    whole tensor all-gathered, each kept at its k largest magnitudes found by a full sort."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    out = torch.zeros_like(tensor)
    for t in everyone:
        keep = t.abs().argsort(descending=True)[:k]
        out[keep] += t[keep]
    return out / len(everyone)


def check_topk_average(student_fn) -> bool:
    """``student_fn(tensor, k)`` in a ``.py`` file: on every rank, the mean over the ranks of each
    rank's top-k of its ``tensor`` (its k entries of largest magnitude, zeros elsewhere), exchanged as
    values and indices; checked on 2 and 3 gloo ranks against ``topk_average_expected``."""
    return check_distributed(student_fn, topk_average_expected, topk_inputs, name=_name(student_fn, "topk_average"),
                             rules=TOPK_RULES)


def two_k(input_numbers: int, rank: int, world_size: int) -> int:
    """What top-k may hand to the collectives from each rank: k values and k indices (k = 6 here)."""
    return 2 * 6


# The lesson: top-k sends k values and k indices, not the tensor (which all-gathering whole would send)
TOPK_RULES = Rules(contributed_at_most=two_k,
                   refused_functions=("course_lib.compressors:TopK", "course_lib.exchange:exchange"),
                   why="top-k sends each rank's k values and their k indices (2k = 12 numbers here), not its "
                       "whole tensor")


def _stochastic_round(x: torch.Tensor, levels: int, u: torch.Tensor) -> torch.Tensor:
    """QSGD's rounding with one norm for all of ``x`` (``compressors.QSGD``'s rule, bucket_size=None)."""
    norm = x.norm()
    if norm == 0:
        return torch.zeros_like(x)
    a = x.abs() / norm * levels
    low = a.floor()
    return torch.sign(x) * norm * (low + (u < a - low).to(x.dtype)) / levels


def check_stochastic_rounding(student_fn, draws: int = 2000) -> bool:
    """``student_fn(x, levels, u)``: each entry of flat ``x`` rounded to one of the levels
    ``norm * sign(x) * l / levels`` (l = 0 ... levels, norm = ||x||) next to it, down or up as decided by
    the uniform draw ``u`` (one per entry, in [0, 1)), so that the result is unbiased.

    Checked two ways, not against one formula (``u < fraction`` and ``u >= 1 - fraction`` are both
    right): in every one of ``draws`` draws each entry is one of its two neighbouring levels, with x's
    sign; and the mean over the draws is x, within 5 standard errors of the rounding's own spread."""
    name = _name(student_fn, "stochastic_round")
    gen = torch.Generator().manual_seed(8)
    cases = [(torch.randn(12, generator=gen), 15), (1e-3 * torch.randn(7, generator=gen), 3),
             (torch.tensor([0.0, 3.0, -4.0, 0.5]), 1), (torch.zeros(5), 15)]
    for i, (x, levels) in enumerate(cases):
        norm = x.norm()
        a = x.abs() / norm * levels if norm > 0 else torch.zeros_like(x)
        step = (norm / levels).item()
        low, high = torch.sign(x) * a.floor() * step, torch.sign(x) * a.ceil() * step
        fraction = (a - a.floor()).double()
        total = torch.zeros_like(x, dtype=torch.float64)
        for _ in range(draws):
            u = torch.rand(x.shape, generator=gen)
            try:
                with refused_calls((_stochastic_round, compressors.QSGD), name, _COURSE_ANSWER):
                    got = student_fn(x.clone(), levels, u.clone())
            except NotImplementedError:
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
                return False
            except NotAllowed as e:
                print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: {e}")
                return False
            except Exception as e:
                print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: raised {type(e).__name__}: {e}")
                return False
            if not isinstance(got, torch.Tensor) or got.shape != x.shape:
                print(f"[FAIL] {name}, case {i}: expected a tensor of shape {tuple(x.shape)}, got {_short(got)}")
                return False
            on_level = torch.isclose(got, low, rtol=1e-5, atol=1e-9) | torch.isclose(got, high, rtol=1e-5, atol=1e-9)
            if not bool(on_level.all()):
                j = int((~on_level).nonzero()[0])
                print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: entry {j} is {got[j].item():.6g}, not one "
                      f"of its two neighbouring levels {low[j].item():.6g} and {high[j].item():.6g}")
                return False
            total += got.double()
        mean = total / draws
        tolerance = 5 * step * (fraction * (1 - fraction)).sqrt() / math.sqrt(draws) + 1e-6 * step
        biased = (mean - x.double()).abs() > tolerance
        if bool(biased.any()):
            j = int(biased.nonzero()[0])
            print(f"[FAIL] {name}, case {i} {_describe((x, levels))}: biased: entry {j} is {x[j].item():.6g}, but its "
                  f"mean over {draws} draws of u is {mean[j].item():.6g} (the levels each side are "
                  f"{low[j].item():.6g} and {high[j].item():.6g}: round up with the right probability)")
            return False
    print(f"[PASS] {name}: every entry on a neighbouring level, and unbiased over {draws} draws, "
          f"in all {len(cases)} cases.")
    return True


def _dgc_step(g, u, v, momentum, k):
    """The package's own DGC memory (``memory.DGCMemory``: momentum correction, masking) around a top-k."""
    dgc = memory.DGCMemory(momentum, masking=True)
    dgc.velocity["g"], dgc.memory["g"] = u.clone(), v.clone()  # the state the case starts from
    corrected = dgc.compensate("g", g)
    chosen = torch.topk(corrected.abs(), k).indices
    sent = torch.zeros_like(corrected)
    sent[chosen] = corrected[chosen]
    dgc.update("g", corrected, sent)
    return sent, dgc.velocity["g"], dgc.memory["g"]


def check_dgc_step(student_fn) -> bool:
    """``student_fn(g, u, v, momentum, k)``: one DGC step on one rank with momentum correction and
    momentum-factor masking: ``(sent, u, v)`` after it (the new velocity and accumulation)."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n, k, m in ((8, 2, 0.9), (100, 5, 0.9), (50, 1, 0.0), (20, 20, 0.5)):
        cases.append((torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                      torch.randn(n, generator=gen), m, k))
    return check(student_fn, _dgc_step, cases, name=_name(student_fn, "dgc_step"), refuse=(memory.DGCMemory,))
