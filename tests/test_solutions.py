"""Every instructor's answer in solutions/ passes its notebook's check, and the checks are not
pushovers: the unsolved stub is refused, and so is at least one typical wrong answer per check
(for the distributed ones, also right numbers got by what the exercise does not allow)."""

import math

import numpy as np
import pytest
import torch

from course_lib import costmodel as C
from course_lib import data_parallel as dp
from course_lib import lowrank as L
from course_lib.notebooks import exercises as ex
from solutions import nb00, nb01, nb02, nb03, nb04, nb05, nb06, nb07, nb08, nb09, nb11, nb12
from tests import exercise_answers as A
from tests.test_exercises import LOCAL_SGD_NEAR_MISSES, SHARDING_NEAR_MISSES

ANSWERS = [
    (ex.check_sum_of_squares, nb00.sum_of_squares),
    (ex.check_elementwise_max, nb00.elementwise_max),
    (ex.check_ddp_token_step, nb01.ddp_token_step),
    (ex.check_ring_shift, nb02.ring_shift),
    (ex.check_recursive_doubling, nb02.recursive_doubling_all_reduce),
    (ex.check_recursive_halving, nb02.recursive_halving_reduce_scatter),
    (ex.check_ddp_all_reduces, nb04.my_ddp_all_reduces),
    (ex.check_memory_hook, nb04.my_memory_hook),
    (ex.check_exposed_time, nb03.my_exposed_time),
    (ex.check_zero2_gradient, nb05.zero2_gradient),
    (ex.check_bytes_per_rank, nb05.my_zero_bytes),
    (ex.check_zero3_bytes_sent, nb05.my_bytes_sent),
    (ex.check_stable_orthogonalize, nb06.my_stable_orthogonalize),
    (ex.check_rank1_error, nb06.my_rank1_error),
    (ex.check_smallest_rank, nb06.my_smallest_rank),
    (ex.check_pq_singular_values, nb06.my_pq_singular_values),
    (ex.check_mean_and_own_buffer, nb07.my_mean_and_own_buffer),
    (ex.check_alternating_powersgd, nb07.my_alternating_powersgd),
    (ex.check_numbers_per_step, nb07.my_numbers_per_step),
    (ex.check_batched_hook, nb08.my_batched_hook),
    (ex.check_memory_per_rank, nb07.my_memory_per_rank),
    (ex.check_topk_average, nb09.topk_average),
    (ex.check_stochastic_rounding, nb09.my_stochastic_round),
    (ex.check_dgc_step, nb09.my_dgc_step),
    (ex.check_outer_step, nb11.my_outer_step),
    (ex.check_break_even_period, nb11.my_break_even),
    (ex.check_break_even_bandwidth, nb12.my_break_even_bandwidth),
    (ex.check_ring_fit, nb12.my_ring_fit),
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


DISTRIBUTED = (ex.check_sum_of_squares, ex.check_elementwise_max, ex.check_ddp_token_step, ex.check_ring_shift,
               ex.check_recursive_doubling, ex.check_recursive_halving, ex.check_topk_average, ex.check_batched_hook,
               ex.check_zero2_gradient, ex.check_memory_hook)


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


def _normalize_only(X):
    return X / X.norm(dim=0, keepdim=True)


def _classical_gram_schmidt(X):
    P = torch.zeros_like(X)
    for j in range(X.shape[1]):  # column j's projections all taken from the original column
        v = X[:, j] - P[:, :j] @ (P[:, :j].T @ X[:, j])
        P[:, j] = v / v.norm()
    return P


def _cholesky_qr(X):
    R = torch.linalg.cholesky(X.T @ X, upper=True)  # squares the condition number
    return torch.linalg.solve_triangular(R, X, upper=True, left=False)


def _scipy_qr(X):
    import scipy.linalg
    return torch.from_numpy(scipy.linalg.qr(X.numpy(), mode="economic")[0])


def _rank1_error_exponent_2k(s, c, k):
    a = s ** (2 * k) * c  # as if the first step multiplied by M Mᵀ, not by M
    w = a.square() / a.square().sum()
    return (1 - (w * s.square()).sum() / s.square().sum()).sqrt().item()


def _rank1_error_weighted_by_s(s, c, k):
    a = s ** (2 * k - 1) * c
    w = a.square() / a.square().sum()
    return (1 - (w * s).sum() / s.sum()).sqrt().item()  # singular values where their squares belong


def _rank1_error_converged(s, c, k):
    return (s[1:].square().sum() / s.square().sum()).sqrt().item()  # the SVD optimum: as if k were infinite


def _smallest_rank_unsquared(M, max_error):
    s = torch.linalg.svdvals(M.double())  # singular values summed, not their squares
    return next(r for r in range(1, len(s) + 1) if (s[r:].sum() / s.sum()).item() <= max_error)


def _alternating(grads, p0, q0, both=False, feedback=True, orthogonalize_out=False):
    """Notebook 07's alternating PowerSGD, wrong three ways (see the near misses)."""
    P, Q = p0.clone(), q0.clone()
    buffers = [torch.zeros_like(g) for g in grads[0]]
    out = []
    for t, step in enumerate(grads):
        corrected = [b + g for b, g in zip(buffers, step)] if feedback else list(step)
        if both:  # the layer-wise hook's step: P from the last Q, then Q from the new P, two all-reduces
            P = sum(c @ torch.linalg.qr(Q).Q for c in corrected) / len(corrected)
            P = torch.linalg.qr(P).Q
            Q = sum(c.T @ P for c in corrected) / len(corrected)
        elif t % 2 == 0:
            P = P if orthogonalize_out else torch.linalg.qr(P).Q
            Q = sum(c.T @ P for c in corrected) / len(corrected)
            Q = torch.linalg.qr(Q).Q if orthogonalize_out else Q
        else:
            Q = Q if orthogonalize_out else torch.linalg.qr(Q).Q
            P = sum(c @ Q for c in corrected) / len(corrected)
            P = torch.linalg.qr(P).Q if orthogonalize_out else P
        approx = P @ Q.T
        buffers = [c - approx for c in corrected]
        out.append(approx)
    return out


def _alternating_both_factors_each_step(grads, p0, q0):
    return _alternating(grads, p0, q0, both=True)


def _alternating_without_error_feedback(grads, p0, q0):
    return _alternating(grads, p0, q0, feedback=False)


def _alternating_orthogonalizing_the_average(grads, p0, q0):
    return _alternating(grads, p0, q0, orthogonalize_out=True)


def _ddp_all_reduces_without_the_first_bucket(sizes, cap_mb, steps, k, no_sync):
    # every synchronizing backward with the rebuilt buckets: DDP's first iteration forgotten
    rebuilt = nb04.my_ddp_all_reduces(sizes, cap_mb, 2, 1, False)[1:]
    return rebuilt * steps * (1 if no_sync else k)


def _ddp_all_reduces_cap_for_every_bucket(sizes, cap_mb, steps, k, no_sync):
    # bucket_cap_mb=None read as 25 MiB for every bucket: the 1 MiB first bucket forgotten
    return nb04.my_ddp_all_reduces(sizes, 25 if cap_mb is None else cap_mb, steps, k, no_sync)


def _round_to_nearest(x, levels, u):  # deterministic: the nearest level, biased
    norm = x.norm()
    return x if norm == 0 else torch.sign(x) * norm * (x.abs() / norm * levels).round() / levels


def _round_up_half_the_time(x, levels, u):  # on a neighbouring level, but up with probability 1/2
    norm = x.norm()
    return x if norm == 0 else torch.sign(x) * norm * ((x.abs() / norm * levels).floor() + (u < 0.5)) / levels


def _round_without_the_sign(x, levels, u):
    return nb09.my_stochastic_round(x, levels, u).abs()


def _exposed_without_queueing(ready, sizes, cap, p, alpha, busbw):
    # each bucket launched when its last gradient is ready, as if the one before it were always done
    ends = [ready[b[-1]] + C.ring_all_reduce_time(sum(sizes[i] for i in b), p, alpha, busbw)
            for b in dp.assign_buckets(sizes, cap)]
    return max(0.0, max(ends) - ready[-1])


def _exposed_as_if_nothing_overlapped(ready, sizes, cap, p, alpha, busbw):
    # every bucket's all-reduce counted, none hidden behind backward
    return sum(C.ring_all_reduce_time(sum(sizes[i] for i in b), p, alpha, busbw) for b in dp.assign_buckets(sizes, cap))


def _ring_fit_algbw(sizes, times, p):  # the slope's inverse taken as the bus bandwidth: that is algbw
    import statistics
    slope, intercept = statistics.linear_regression(sizes, times)
    return intercept / (2 * (p - 1)), 1 / slope / 1e9


def _ring_fit_intercept_as_alpha(sizes, times, p):  # the intercept taken as alpha: it is 2(p-1) alpha
    import statistics
    slope, intercept = statistics.linear_regression(sizes, times)
    return intercept, 2 * (p - 1) / p / slope / 1e9


def _break_even_nan_for_never(h, r, p, a):
    """The formula, with nan wherever the two never cross: the check wants inf (always faster) and 0 (never)."""
    fixed = h["compute_s"] - r["compute_s"] + (h["collectives"] - r["collectives"]) * 2 * (p - 1) * a
    extra = r["bytes"] - h["bytes"]
    crossing = 2 * (p - 1) / p * extra / fixed / 1e9 if fixed and extra else math.nan
    return crossing if crossing > 0 else math.nan


def _break_even_formula_where_never(h, r, p, a):
    """inf and the identical step handled, the formula everywhere else: a hook dearer in both compute and
    bytes gets a negative bandwidth instead of 0.0 (faster nowhere)."""
    fixed = h["compute_s"] - r["compute_s"] + (h["collectives"] - r["collectives"]) * 2 * (p - 1) * a
    saved = r["bytes"] - h["bytes"]
    if fixed <= 0 and saved >= 0 and (fixed, saved) != (0, 0):
        return math.inf
    if fixed >= 0 and saved == 0:
        return 0.0
    return 2 * (p - 1) / p * saved / fixed / 1e9


# answers a student might give, each wrong in one way the exercise is about; what the check says
def _buffers_compressed_per_worker(grads, compress):
    """Error feedback as on one worker, on each: every worker compresses its own corrected gradient."""
    errors = [torch.zeros_like(g) for g in grads[0]]
    for step in grads:
        corrected = [g + e for g, e in zip(step, errors)]
        errors = [c - compress(c) for c in corrected]
    return sum(errors) / len(errors), errors[0]


def _buffers_own_for_both(grads, compress):
    """Worker 0's buffer given as the mean too: what the old plot of rank 0's buffer showed."""
    _, own = nb07.my_mean_and_own_buffer(grads, compress)
    return own, own


def _buffers_last_step_only(grads, compress):
    """The buffers of the last step alone, as if nothing were carried over."""
    return nb07.my_mean_and_own_buffer(grads[-1:], compress)


def _numbers_per_step_vectors_never_compressed(shapes, r, rate):
    """The course's old count: every vector as it is, whatever min_compression_rate."""
    return sum(math.prod(s) if len(s) < 2 or (s[0] + math.prod(s[1:])) * min(s[0], math.prod(s[1:]), r) * rate
               >= math.prod(s) else (s[0] + math.prod(s[1:])) * min(s[0], math.prod(s[1:]), r) for s in shapes)


def _memory_error_of_compressed_only(shapes, r, rate, use_error_feedback, warm_start):
    """An error kept only for the tensors that are compressed (the averaged ones differ from this rank's too)."""
    total = 0
    for s in shapes:
        n, m = s[0], math.prod(s[1:])
        if (n + m) * min(n, m, r) * rate < n * m:
            total += (n * m if use_error_feedback else 0) + (m * min(n, m, r) if warm_start else 0)
    return total


def _memory_p_and_q(shapes, r, rate, use_error_feedback, warm_start):
    """P kept too: only Q is carried to the next step (warm start); P is recomputed from it."""
    total = sum(math.prod(s) for s in shapes) if use_error_feedback else 0
    for s in shapes:
        n, m = s[0], math.prod(s[1:])
        if warm_start and (n + m) * min(n, m, r) * rate < n * m:
            total += (n + m) * min(n, m, r)
    return total


def _memory_vectors_never_compressed(shapes, r, rate, use_error_feedback, warm_start):
    return nb07.my_memory_per_rank([s for s in shapes if len(s) > 1], r, rate, False, warm_start) + (
        sum(math.prod(s) for s in shapes) if use_error_feedback else 0)


NEAR_MISSES = [
    (ex.check_alternating_powersgd, _alternating_both_factors_each_step, "item 0"),
    (ex.check_alternating_powersgd, _alternating_without_error_feedback, "item 1"),
    (ex.check_alternating_powersgd, _alternating_orthogonalizing_the_average, "item 0"),
    (ex.check_ddp_all_reduces, _ddp_all_reduces_without_the_first_bucket, "case 0"),
    (ex.check_ddp_all_reduces, _ddp_all_reduces_cap_for_every_bucket, "case 0"),
    (ex.check_ddp_all_reduces,
     lambda sizes, cap, steps, k, no_sync: nb04.my_ddp_all_reduces(sizes, cap, steps, k, False),
     "case 1"),  # no_sync forgotten
    (ex.check_exposed_time, _exposed_without_queueing, "case 3"),
    (ex.check_exposed_time, _exposed_as_if_nothing_overlapped, "case 0"),
    (ex.check_stable_orthogonalize, _normalize_only, "key '‖PᵀP − I‖ ≤ 1e-12'"),
    (ex.check_stable_orthogonalize, lambda X: L.orthogonalize_(X.clone()), "case 2"),  # one pass of Gram-Schmidt
    (ex.check_stable_orthogonalize, _classical_gram_schmidt, "case 2"),
    (ex.check_stable_orthogonalize, _cholesky_qr, "case 2"),
    (ex.check_stable_orthogonalize, lambda X: torch.linalg.qr(X).Q, "torch.linalg.qr does the work"),
    (ex.check_stable_orthogonalize, lambda X: torch.linalg.svd(X, full_matrices=False).U, "torch.linalg.svd does"),
    (ex.check_stable_orthogonalize, lambda X: X.qr().Q, "Tensor.qr does the work"),
    (ex.check_stable_orthogonalize, lambda X: torch.from_numpy(np.linalg.qr(X.numpy())[0]), "numpy.linalg.qr does"),
    (ex.check_stable_orthogonalize, lambda X: torch.from_numpy(np.linalg.svd(X.numpy(), full_matrices=False)[0]),
     "numpy.linalg.svd does"),
    (ex.check_stable_orthogonalize, _scipy_qr, "scipy.linalg.qr does"),
    (ex.check_rank1_error, _rank1_error_exponent_2k, "expected"),
    (ex.check_rank1_error, _rank1_error_weighted_by_s, "expected"),
    (ex.check_rank1_error, _rank1_error_converged, "expected"),
    (ex.check_smallest_rank, lambda M, e: 1, "expected"),
    (ex.check_smallest_rank, _smallest_rank_unsquared, "expected"),
    (ex.check_smallest_rank, lambda M, e: next(r for r in range(1, min(M.shape) + 1) if L.svd_error(M, r) <= e),
     "lowrank.svd_error is refused"),  # the notebook's own calls, rank by rank
    # Q's column lengths: its columns are not orthogonal yet
    (ex.check_pq_singular_values, lambda P, Q: Q.norm(dim=0).sort(descending=True).values, "case 1"),
    (ex.check_pq_singular_values, lambda P, Q: torch.linalg.eigvalsh(Q.T @ Q).sqrt(), "case 1"),  # ascending
    (ex.check_pq_singular_values, lambda P, Q: torch.linalg.svdvals(P @ Q.T)[: P.shape[1]],
     "torch.linalg.svdvals is refused on a matrix larger than r x r"),
    (ex.check_pq_singular_values, lambda P, Q: torch.from_numpy(np.linalg.svd((P @ Q.T).numpy(), compute_uv=False)
                                                                 [: P.shape[1]].copy()), "numpy.linalg.svd is refused"),
    (ex.check_mean_and_own_buffer, _buffers_compressed_per_worker, "item 0"),
    (ex.check_mean_and_own_buffer, _buffers_own_for_both, "item 0"),
    (ex.check_mean_and_own_buffer, _buffers_last_step_only, "case 1"),
    (ex.check_numbers_per_step, lambda shapes, r, rate: sum((s[0] + (s[1] if len(s) > 1 else 0)) * r
                                                            for s in shapes), "expected"),
    (ex.check_numbers_per_step, _numbers_per_step_vectors_never_compressed, "case 5"),
    (ex.check_memory_per_rank, _memory_error_of_compressed_only, "expected"),
    (ex.check_memory_per_rank, _memory_p_and_q, "expected"),
    (ex.check_memory_per_rank, _memory_vectors_never_compressed, "case 5"),
    (ex.check_ring_fit, _ring_fit_algbw, "case 1"),  # the slope's inverse is algbw, not busbw, at p > 2
    (ex.check_ring_fit, _ring_fit_intercept_as_alpha, "case 0"),  # the intercept is 2(p-1) alpha
    (ex.check_break_even_bandwidth, lambda h, r, p, a: (r["bytes"] - h["bytes"]) / (
        h["compute_s"] - r["compute_s"]) / 1e9, "expected"),  # latency and the ring factor forgotten
    (ex.check_break_even_bandwidth, _break_even_nan_for_never, "case 3"),
    (ex.check_break_even_bandwidth, _break_even_formula_where_never, "case 6"),
    (ex.check_stochastic_rounding, _round_to_nearest, "biased"),
    (ex.check_stochastic_rounding, _round_up_half_the_time, "biased"),
    (ex.check_stochastic_rounding, _round_without_the_sign, "not one of its two neighbouring levels"),
    (ex.check_dgc_step, _dgc_without_masking, "values differ"),
]


@pytest.mark.parametrize("check, wrong, says", NEAR_MISSES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(NEAR_MISSES)])
def test_near_misses_fail(check, wrong, says, capsys):
    assert not check(wrong)
    out = capsys.readouterr().out
    assert "[FAIL]" in out and says in out, out


def test_every_check_refuses_a_near_miss():
    refused = {c.__name__ for c, _, _ in NEAR_MISSES + DISTRIBUTED_NEAR_MISSES + SHARDING_NEAR_MISSES
               + LOCAL_SGD_NEAR_MISSES}
    assert refused == {check.__name__ for check, _ in ANSWERS}


def test_other_stable_orthogonalizations_pass_and_torch_is_given_back(capsys):
    # Gram-Schmidt twice ("twice is enough") and Householder with the other signs are right too
    assert ex.check_stable_orthogonalize(lambda X: L.orthogonalize_(L.orthogonalize_(X.clone())))
    assert ex.check_stable_orthogonalize(lambda X: -nb06.my_stable_orthogonalize(X))
    assert capsys.readouterr().out.count("[PASS]") == 2
    # the refused factorizations are restored afterwards, even after a refusal
    before = (torch.linalg.qr, torch.linalg.svd, torch.Tensor.qr, np.linalg.qr, np.linalg.svd)
    assert not ex.check_stable_orthogonalize(lambda X: torch.linalg.qr(X).Q)
    assert not ex.check_stable_orthogonalize(lambda X: torch.from_numpy(np.linalg.qr(X.numpy())[0]))
    assert (torch.linalg.qr, torch.linalg.svd, torch.Tensor.qr, np.linalg.qr, np.linalg.svd) == before


# the distributed exercises: wrong numbers, and right numbers by what the exercise does not allow
DISTRIBUTED_NEAR_MISSES = [
    (ex.check_sum_of_squares, A.sum_without_squaring, "values differ"),
    (ex.check_sum_of_squares, A.sum_of_squares_without_communicating, "called 0 collectives"),
    (ex.check_sum_of_squares, A.sum_of_squares_in_two_collectives, "called 2 collectives (reduce, broadcast)"),
    (ex.check_elementwise_max, A.elementwise_sum, "values differ"),
    (ex.check_ddp_token_step, A.ddp_token_step_by_rank_count, "values differ"),
    (ex.check_ddp_token_step, A.ddp_token_step_without_world_size, "values differ"),
    (ex.check_ddp_token_step, A.ddp_token_step_naive, "values differ"),
    (ex.check_ddp_token_step, A.ddp_token_step_without_no_sync, "all-reduced the gradient 3 times"),
    (ex.check_ddp_token_step, A.ddp_token_step_in_one_backward, "one forward and backward per micro-batch"),
    (ex.check_ring_shift, A.ring_shift_by_all_gather, "it called dist.all_gather"),
    (ex.check_ring_shift, A.ring_shift_the_wrong_way, "values differ"),
    (ex.check_recursive_doubling, A.recursive_doubling_by_all_reduce, "it called dist.all_reduce"),
    (ex.check_recursive_doubling, A.recursive_doubling_by_ring, "sent 2 messages; recursive doubling"),
    (ex.check_recursive_halving, A.reduce_scatter_by_all_reduce, "it called dist.all_reduce"),
    (ex.check_recursive_halving, A.reduce_scatter_by_imported_all_reduce,
     "called a collective (ProcessGroup.allreduce)"),
    (ex.check_recursive_halving, A.reduce_scatter_by_reduce_scatter, "it called dist.reduce_scatter"),
    (ex.check_recursive_halving, A.reduce_scatter_ring_owner, "expected shape (5,), got (4,)"),
    (ex.check_recursive_halving, A.reduce_scatter_by_ring, "sent 3 messages; recursive halving"),
    (ex.check_recursive_halving, A.reduce_scatter_by_recursive_doubling, "sent 9 numbers of a 9-number input"),
    (ex.check_recursive_halving, A.recursive_halving_keeping_the_partners_half, "expected shape (5,), got (4,)"),
    (ex.check_recursive_halving, A.recursive_halving_with_padded_chunks, "sent 5 numbers, not 4"),
    (ex.check_topk_average, A.topk_average_by_all_reduce, "values differ"),
    (ex.check_topk_average, A.topk_of_the_average, "values differ"),
    (ex.check_topk_average, A.topk_average_overwriting, "values differ"),
    (ex.check_memory_hook, A.memory_hook_keyed_by_bucket_index, "is not the sum of its averaged gradients"),
    (ex.check_memory_hook, A.memory_hook_keyed_by_position, "is not the sum of its averaged gradients"),
    (ex.check_memory_hook, A.memory_hook_before_averaging, "is not the sum of its averaged gradients"),
    (ex.check_memory_hook, A.memory_hook_keyed_by_name_string, "has no entry for parameter"),
    (ex.check_memory_hook, A.memory_hook_without_dividing, "is not the average over the ranks"),
    (ex.check_memory_hook, A.memory_hook_without_communicating, "is not the average over the ranks"),
    (ex.check_batched_hook, A.batched_hook_without_error_feedback, "is error feedback missing?"),
    (ex.check_batched_hook, A.batched_hook_without_dividing, "is not a projection of the ranks' mean corrected"),
    (ex.check_batched_hook, A.batched_hook_dividing_q_twice, "is not a projection of the ranks' mean corrected"),
    (ex.check_batched_hook, A.batched_hook_normalizing_p, "is not a projection of the ranks' mean corrected"),
    (ex.check_batched_hook, A.batched_hook_with_its_own_q, "rank 1's gradient differs from rank 0's"),
    (ex.check_batched_hook, A.batched_hook_two_columns, "a near-square matrix at rank 2 needs at most"),
    (ex.check_batched_hook, A.batched_hook_layer_by_layer, "a near-square matrix at rank 2 needs at most"),
    (ex.check_batched_hook, A.batched_hook_round_robin, "is not of rank 2 or less"),
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
    (ex.check_recursive_doubling, A.recursive_doubling_by_blocking_send_recv),
    (ex.check_batched_hook, A.batched_hook_without_warm_start),  # a fresh Q at every step: slower, still right
    (ex.check_batched_hook, A.batched_hook_with_q_of_its_own_draw),  # P sums M_i Q_i: still the average, projected
    (ex.check_batched_hook, A.batched_hook_with_its_own_error),  # EF-SGD's per-rank memory: the same mean
]


@pytest.mark.parametrize("check, answer", OTHER_RIGHT_ANSWERS, ids=[a.__name__ for _, a in OTHER_RIGHT_ANSWERS])
def test_other_right_answers_pass(check, answer, capsys):
    assert check(answer), capsys.readouterr().out


def test_the_memory_hook_exercise_meets_a_bucket_rebuild():
    # what makes the exercise a design question: the same parameters sit in other buckets after iteration 0
    from course_lib.launch import spawn
    from course_lib.notebooks.exercises import nb04 as exercises_nb04

    out = spawn(exercises_nb04._memory_hook_worker, 2, nb04.my_memory_hook, backend="gloo", timeout_s=60)[0]
    first = [params for call, index, params in out["buckets"] if call == 0]
    later = {tuple(params) for call, index, params in out["buckets"] if call > 0}
    assert first == [[0, 1, 2, 3, 4, 5]] and later == {(5, 4, 3, 2), (1, 0)}
