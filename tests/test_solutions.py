"""Every instructor's answer in solutions/ passes its notebook's check, and the checks are not
pushovers: the unsolved stub is refused, and so is at least one typical wrong answer per check
(for the distributed ones, also right numbers got by what the exercise does not allow)."""

import math

import pytest
import torch
from torch import nn

from course_lib import lowrank as L
from course_lib.support import exercises as ex
from solutions import nb00, nb01, nb02, nb03, nb05, nb06, nb08, nb10
from tests import exercise_answers as A

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
    (ex.check_orthogonalize, nb05.my_orthogonalize),
    (ex.check_power_step, nb05.my_power_step),
    (ex.check_smallest_rank, nb05.my_smallest_rank),
    (ex.check_largest_worth_rank, nb05.my_largest_worth_rank),
    (ex.check_should_compress, nb06.my_should_compress),
    (ex.check_error_feedback_step, nb06.my_error_feedback_step),
    (ex.check_numbers_per_step, nb06.my_numbers_per_step),
    (ex.check_topk_allgather_bytes, nb08.my_topk_allgather_bytes),
    (ex.check_random_k, nb08.my_random_k),
    (ex.check_dgc_step, nb08.my_dgc_step),
    (ex.check_break_even_bandwidth, nb10.my_break_even_bandwidth),
    (ex.check_all_gather_busbw, nb10.my_all_gather_busbw),
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


DISTRIBUTED = (ex.check_sum_of_squares, ex.check_elementwise_max, ex.check_reduce_scatter, ex.check_ring_shift,
               ex.check_halving_doubling)


@pytest.mark.parametrize("check", [c for c, _ in ANSWERS], ids=lambda c: c.__name__)
def test_a_stub_is_not_yet(check, capsys):
    assert not check(A.todo if check in DISTRIBUTED else _stub)  # a worker's function must live in a module
    assert "[not yet]" in capsys.readouterr().out


def _dgc_without_masking(g, u, v, momentum, k):
    u = momentum * u + g
    v = v + u
    chosen = v.abs().topk(k).indices
    sent = torch.zeros_like(v)
    sent[chosen] = v[chosen]
    return sent, u, v - sent


def _accumulate_by_k(model, loss_fn, micro_batches):
    for x, y in micro_batches:  # each mean loss divided by k: right for equal sizes only
        (loss_fn(model(x), y) / len(micro_batches)).backward()


def _normalize_only(m):
    m /= m.norm(dim=-2, keepdim=True)


def _gram_schmidt_with_nan(m):
    m = m if m.dim() == 3 else m.unsqueeze(0)
    for i in range(m.shape[2]):
        col = m[:, :, i : i + 1]
        col /= col.norm(dim=1, keepdim=True)  # a zero column becomes NaN
        rest = m[:, :, i + 1 :]
        rest -= (col * rest).sum(dim=1, keepdim=True) * col


def _orthogonalize_a_copy(m):
    return L.orthogonalize_(m.clone())  # right numbers, but not in place


def _power_step_unnormalized(M, Q):
    P = M @ Q
    return P, M.T @ P


def _power_step_normalized_not_orthogonal(M, Q):
    P = M @ Q
    P = P / P.norm(dim=0)
    return P, M.T @ P


def _power_step_wrong_subspace(M, Q):
    P = L.orthogonalize_(M @ Q.flip(0))  # orthonormal, but the columns of another product
    return P, M.T @ P


def _power_step_q_from_the_unorthogonalized_p(M, Q):
    X = M @ Q
    return L.orthogonalize_(X.clone()), M.T @ X


def _smallest_rank_unsquared(M, max_error):
    s = torch.linalg.svdvals(M.double())  # singular values summed, not their squares
    return next(r for r in range(1, len(s) + 1) if (s[r:].sum() / s.sum()).item() <= max_error)


def _break_even_without_the_never_case(h, r, p, a):
    fixed = h["compute_s"] - r["compute_s"] + (h["collectives"] - r["collectives"]) * 2 * (p - 1) * a
    extra = r["bytes"] - h["bytes"]
    return math.nan if fixed == 0 or extra == 0 else 2 * (p - 1) / p * extra / fixed / 1e9  # negative: "never"


# answers a student might give, each wrong in one way the exercise is about; what the check says
NEAR_MISSES = [
    (ex.check_accumulate, _accumulate_by_k, "case 1"),
    (ex.check_micro_batch_loss, lambda logits, y, n: nn.functional.cross_entropy(logits, y), "values differ"),
    (ex.check_combine_gradients, lambda grads, sizes: [sum(g[i] for g in grads) / len(grads)
                                                       for i in range(len(grads[0]))], "values differ"),  # unweighted
    (ex.check_count_all_reduces, lambda steps, k, buckets, no_sync: steps * k, "expected"),  # buckets forgotten
    (ex.check_ddp_buckets, lambda sizes, first, cap: [list(range(len(sizes)))], "expected"),
    (ex.check_sync_time, lambda sizes, cap, p, a, bw: nb03.my_sync_time(sizes, cap, p, 0.0, bw), "expected"),
    (ex.check_orthogonalize, _normalize_only, "values differ"),
    (ex.check_orthogonalize, _gram_schmidt_with_nan, "case 3"),  # the zero column
    (ex.check_orthogonalize, _orthogonalize_a_copy, "values differ"),
    (ex.check_power_step, _power_step_unnormalized, "key 'PᵀP'"),
    (ex.check_power_step, _power_step_normalized_not_orthogonal, "key 'PᵀP'"),
    (ex.check_power_step, _power_step_wrong_subspace, "key 'P Pᵀ'"),
    (ex.check_power_step, _power_step_q_from_the_unorthogonalized_p, "key 'P Q_newᵀ'"),
    (ex.check_power_step, lambda M, Q: nb05.my_power_step(M, Q)[0], "a pair of tensors"),
    (ex.check_smallest_rank, lambda M, e: 1, "expected"),
    (ex.check_smallest_rank, _smallest_rank_unsquared, "expected"),
    (ex.check_largest_worth_rank, lambda n, m, rate: int(n * m / ((n + m) * rate)), "expected"),  # off by one
    (ex.check_should_compress, lambda n, m, r, rate: (n + m) * r * rate <= n * m, "expected False, got True"),
    (ex.check_error_feedback_step, lambda g, e, compress: (compress(g + e), g - compress(g + e)), "item 1"),
    (ex.check_numbers_per_step, lambda shapes, r, rate: sum((s[0] + (s[1] if len(s) > 1 else 0)) * r
                                                            for s in shapes), "expected"),
    (ex.check_all_gather_busbw, lambda size, t, p: size / t / 1e9, "expected"),  # algbw, not busbw
    (ex.check_break_even_bandwidth, lambda h, r, p, a: (r["bytes"] - h["bytes"]) / (
        h["compute_s"] - r["compute_s"]) / 1e9, "expected"),  # latency and the ring factor forgotten
    (ex.check_break_even_bandwidth, _break_even_without_the_never_case, "case 4"),
    (ex.check_topk_allgather_bytes, lambda n, r, p: p * max(1, math.ceil(r * n)) * 8, "expected"),  # its own counted
    (ex.check_random_k, lambda x, idx: torch.zeros_like(x).index_copy(0, idx, x[idx]), "values differ"),  # not rescaled
    (ex.check_dgc_step, _dgc_without_masking, "values differ"),
]


@pytest.mark.parametrize("check, wrong, says", NEAR_MISSES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(NEAR_MISSES)])
def test_near_misses_fail(check, wrong, says, capsys):
    assert not check(wrong)
    out = capsys.readouterr().out
    assert "[FAIL]" in out and says in out, out


def test_every_check_refuses_a_near_miss():
    refused = {c.__name__ for c, _, _ in NEAR_MISSES} | {c.__name__ for c, _, _ in DISTRIBUTED_NEAR_MISSES}
    assert refused == {check.__name__ for check, _ in ANSWERS}


def test_a_right_answer_with_other_signs_passes_the_power_step(capsys):
    # torch.linalg.qr (Householder) gives P's columns signs of its own; any sign is right
    def by_qr(M, Q):
        P = torch.linalg.qr(M @ Q).Q
        return P, M.T @ P

    def flipped(M, Q):
        P, Q_new = nb05.my_power_step(M, Q)
        return -P, -Q_new

    assert ex.check_power_step(by_qr) and ex.check_power_step(flipped)
    assert capsys.readouterr().out.count("[PASS]") == 2


# the distributed exercises: wrong numbers, and right numbers by what the exercise does not allow
DISTRIBUTED_NEAR_MISSES = [
    (ex.check_sum_of_squares, A.sum_without_squaring, "values differ"),
    (ex.check_sum_of_squares, A.sum_of_squares_without_communicating, "called 0 collectives"),
    (ex.check_sum_of_squares, A.sum_of_squares_in_two_collectives, "called 2 collectives (reduce, broadcast)"),
    (ex.check_elementwise_max, A.elementwise_sum, "values differ"),
    (ex.check_reduce_scatter, A.reduce_scatter_by_all_reduce, "it called dist.all_reduce"),
    (ex.check_reduce_scatter, A.reduce_scatter_by_imported_all_reduce, "called a collective (ProcessGroup.allreduce)"),
    (ex.check_reduce_scatter, A.reduce_scatter_by_reduce_scatter, "it called dist.reduce_scatter"),
    (ex.check_reduce_scatter, A.reduce_scatter_ring_owner, "expected shape (3,), got (2,)"),
    (ex.check_ring_shift, A.ring_shift_by_all_gather, "it called dist.all_gather"),
    (ex.check_ring_shift, A.ring_shift_the_wrong_way, "values differ"),
    (ex.check_halving_doubling, A.halving_doubling_by_all_reduce, "it called dist.all_reduce"),
    (ex.check_halving_doubling, A.halving_doubling_by_ring, "sent 2 messages; recursive doubling"),
]


@pytest.mark.parametrize("check, wrong, says", DISTRIBUTED_NEAR_MISSES,
                         ids=[w.__name__ for _, w, _ in DISTRIBUTED_NEAR_MISSES])
def test_distributed_near_misses_fail(check, wrong, says, capsys):
    assert not check(wrong)
    out = capsys.readouterr().out
    assert "[FAIL]" in out and says in out, out


# right answers written in other styles than solutions/: the rules must not refuse them
OTHER_RIGHT_ANSWERS = [
    (ex.check_sum_of_squares, A.sum_of_squares_by_imported_all_reduce),  # still one collective
    (ex.check_ring_shift, A.ring_shift_by_batch_isend_irecv),
    (ex.check_halving_doubling, A.halving_doubling_by_blocking_send_recv),
]


@pytest.mark.parametrize("check, answer", OTHER_RIGHT_ANSWERS, ids=[a.__name__ for _, a in OTHER_RIGHT_ANSWERS])
def test_other_right_answers_pass(check, answer, capsys):
    assert check(answer), capsys.readouterr().out
