"""Every instructor's answer in solutions/ passes its notebook's check, and the checks are not
pushovers: the unsolved stub is refused."""

import math

import pytest
import torch

from course_lib.support import exercises as ex
from solutions import nb00, nb01, nb02, nb03, nb04, nb05, nb06, nb07

ANSWERS = [
    (ex.check_sum_of_squares, nb00.sum_of_squares),
    (ex.check_elementwise_max, nb00.elementwise_max),
    (ex.check_accumulate, nb01.my_accumulate),
    (ex.check_micro_batch_loss, nb01.my_micro_batch_loss),
    (ex.check_combine_gradients, nb01.my_combine_gradients),
    (ex.check_count_all_reduces, nb01.my_count_all_reduces),
    (ex.check_reduce_scatter, nb02.reduce_scatter),
    (ex.check_ring_shift, nb02.ring_shift),
    (ex.check_halving_doubling, nb02.halving_doubling_all_reduce),
    (ex.check_ddp_buckets, nb03.my_ddp_buckets),
    (ex.check_sync_time, nb03.my_sync_time),
    (ex.check_orthogonalize, nb04.my_orthogonalize),
    (ex.check_power_step, nb04.my_power_step),
    (ex.check_smallest_rank, nb04.my_smallest_rank),
    (ex.check_largest_worth_rank, nb04.my_largest_worth_rank),
    (ex.check_should_compress, nb05.my_should_compress),
    (ex.check_error_feedback_step, nb05.my_error_feedback_step),
    (ex.check_numbers_per_step, nb05.my_numbers_per_step),
    (ex.check_topk_allgather_bytes, nb06.my_topk_allgather_bytes),
    (ex.check_random_k, nb06.my_random_k),
    (ex.check_dgc_step, nb06.my_dgc_step),
    (ex.check_break_even_bandwidth, nb07.my_break_even_bandwidth),
    (ex.check_all_gather_busbw, nb07.my_all_gather_busbw),
]


@pytest.mark.parametrize("check, answer", ANSWERS, ids=[a.__name__ for _, a in ANSWERS])
def test_the_answer_passes(check, answer, capsys):
    assert check(answer), capsys.readouterr().out
    assert "[PASS]" in capsys.readouterr().out


def test_every_check_has_an_answer():
    checks = {name for name in ex.__all__ if name.startswith("check_") and name != "check_distributed"}
    assert checks == {check.__name__ for check, _ in ANSWERS}


def _stub(*args):
    raise NotImplementedError


@pytest.mark.parametrize("check", [c for c, _ in ANSWERS if c not in (
    ex.check_sum_of_squares, ex.check_elementwise_max, ex.check_reduce_scatter, ex.check_ring_shift,
    ex.check_halving_doubling)], ids=lambda c: c.__name__)
def test_a_stub_is_not_yet(check, capsys):
    assert not check(_stub)
    assert "[not yet]" in capsys.readouterr().out


def test_near_misses_fail(capsys):
    # answers a student might give, each wrong in one way the exercise is about
    assert not ex.check_combine_gradients(lambda grads, sizes: [sum(g[i] for g in grads) / len(grads)
                                                                 for i in range(len(grads[0]))])  # unweighted
    assert not ex.check_count_all_reduces(lambda steps, k, buckets, no_sync: steps * k)  # buckets forgotten
    assert not ex.check_smallest_rank(lambda M, e: 1)
    assert not ex.check_largest_worth_rank(lambda n, m, rate: int(n * m / ((n + m) * rate)))  # off by one
    assert not ex.check_numbers_per_step(lambda shapes, r, rate: sum((s[0] + (s[1] if len(s) > 1 else 0)) * r
                                                                     for s in shapes))
    assert not ex.check_all_gather_busbw(lambda size, t, p: size / t / 1e9)  # algbw, not busbw
    assert not ex.check_break_even_bandwidth(lambda h, r, p, a: (r["bytes"] - h["bytes"]) / (
        h["compute_s"] - r["compute_s"]) / 1e9)  # latency and the ring factor forgotten
    assert not ex.check_topk_allgather_bytes(lambda n, r, p: p * max(1, math.ceil(r * n)) * 8)  # its own counted
    assert not ex.check_random_k(lambda x, idx: torch.zeros_like(x).index_copy(0, idx, x[idx]))  # not rescaled
    assert not ex.check_dgc_step(_dgc_without_masking)
    assert capsys.readouterr().out.count("[FAIL]") == 10


def _dgc_without_masking(g, u, v, momentum, k):
    u = momentum * u + g
    v = v + u
    chosen = v.abs().topk(k).indices
    sent = torch.zeros_like(v)
    sent[chosen] = v[chosen]
    return sent, u, v - sent
