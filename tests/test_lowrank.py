import time

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

from course_lib import lowrank as L
from course_lib.notebooks import exercises as ex


def _decaying(n=120, m=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    s = 0.5 ** torch.arange(min(n, m), dtype=torch.float64)
    return U[:, : len(s)] @ torch.diag(s) @ V[:, : len(s)].T


@pytest.mark.parametrize("shape", [(50, 3), (4, 30, 5)])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space(shape):
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q = L.orthogonalize_(x.clone())
    eye = torch.eye(shape[-1], dtype=torch.float64).expand(*shape[:-2], -1, -1)
    torch.testing.assert_close(q.mT @ q, eye)
    # same span: projecting x onto span(q) changes nothing
    torch.testing.assert_close(q @ (q.mT @ x), x)


def test_orthogonalize_matches_torch_gram_schmidt_exactly():
    x = torch.randn(3, 40, 2, generator=torch.Generator().manual_seed(2))
    a, b = x.clone(), x.clone()
    _orthogonalize_gram_schmidt(a)
    L.orthogonalize_(b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_zero_column_stays_zero_without_nan(epsilon):
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(3))
    x[:, 1] = 0
    q = L.orthogonalize_(x, epsilon)
    assert not torch.isnan(q).any()
    assert torch.equal(q[:, 1], torch.zeros(10))
    assert abs(q[:, 0].norm().item() - 1) < 1e-6


def test_orthogonalize_rejects_bad_input():
    with pytest.raises(ValueError, match="epsilon"):
        L.orthogonalize_(torch.randn(4, 2), -1.0)
    with pytest.raises(ValueError, match="shape"):
        L.orthogonalize_(torch.randn(4))


def test_power_iteration_converges_to_the_svd_optimum():
    M = _decaying()
    P, Q = L.power_iteration(M, 3, iters=30, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(P.T @ P, torch.eye(3, dtype=torch.float64))
    assert L.relative_error(M, P, Q) == pytest.approx(L.svd_error(M, 3), rel=1e-6)
    # and the optimum is what the truncated SVD reconstructs
    U, s, Vh = torch.linalg.svd(M)
    best = U[:, :3] @ torch.diag(s[:3]) @ Vh[:3]
    assert L.svd_error(M, 3) == pytest.approx((torch.linalg.norm(M - best) / torch.linalg.norm(M)).item())


def test_warm_start_continues_where_the_last_step_stopped():
    M = _decaying()
    g = torch.Generator().manual_seed(0)
    P1, Q1 = L.power_iteration(M, 2, iters=1, generator=g)
    P5, Q5 = L.power_iteration(M, 2, iters=4, q=Q1)
    P5b, Q5b = L.power_iteration(M, 2, iters=5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(P5 @ Q5.T, P5b @ Q5b.T)
    warm = L.track_errors([M] * 10, 2)
    cold = L.track_errors([M] * 10, 2, warm_start=False)
    assert warm[-1] < cold[-1]
    assert warm[-1] == pytest.approx(L.svd_error(M, 2), rel=1e-3)


def test_batched_power_iteration_equals_one_by_one():
    Ms = torch.stack([_decaying(seed=s) for s in range(3)])
    q = torch.randn(3, 80, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    P, Q = L.power_iteration(Ms, 2, iters=2, q=q)
    for i in range(3):
        Pi, Qi = L.power_iteration(Ms[i], 2, iters=2, q=q[i])
        torch.testing.assert_close(P[i] @ Q[i].T, Pi @ Qi.T)


def test_without_orthogonalization_all_columns_collapse_to_the_top_vector():
    M = _decaying()
    X = L.power_iteration_without_orthogonalization(M, 3, iters=50, generator=torch.Generator().manual_seed(0))
    cos = (X.T @ X).abs()
    assert cos.min().item() > 0.999


def test_rank_and_q_errors():
    M = torch.randn(10, 6)
    with pytest.raises(ValueError, match="between 1 and min"):
        L.power_iteration(M, 0)
    with pytest.raises(ValueError, match="between 1 and min"):
        L.power_iteration(M, 7)
    with pytest.raises(ValueError, match=r"q must be \(6, 2\) torch.float32 like M, got \(10, 2\)"):
        L.power_iteration(M, 2, q=torch.randn(10, 2))


def test_compression_ratio_and_svd_error_edges():
    assert L.compression_ratio(1024, 1024, 2) == 256.0
    M = _decaying()
    assert L.svd_error(M, 80) == pytest.approx(0.0, abs=1e-12)
    s = 0.5 ** torch.arange(80, dtype=torch.float64)
    assert L.svd_error(M, 1) == pytest.approx((s[1:].square().sum() / s.square().sum()).sqrt().item())


def test_time_methods_reports_each_method():
    (row,) = L.time_methods([(64, 32)], rank=2, repeats=1)
    assert row["shape"] == (64, 32)
    assert all(row[k] > 0 for k in ("svd_s", "svd_lowrank_s", "power_step_s"))


def test_track_error_feedback_against_the_rule_written_out():
    # a drifting matrix; the reference loop orthogonalizes with torch's QR (Householder) and takes the
    # optimum from the truncated SVD rebuilt, other ways than power_step and svd_error
    base = _decaying(40, 30)
    drift = torch.randn(6, 40, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mats = [base + 0.05 * d for d in drift]
    errors, optima = L.track_error_feedback(mats, 2, warm_start=True, seed=0)
    Q = torch.randn(30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    e = torch.zeros_like(base)
    sent_total = torch.zeros_like(base)
    for M, err, best in zip(mats, errors, optima):
        C = M + e
        P = torch.linalg.qr(C @ Q).Q
        Q = C.T @ P
        sent = P @ Q.T
        assert err == pytest.approx((torch.linalg.norm(C - sent) / torch.linalg.norm(C)).item(), rel=1e-9)
        U, s, Vh = torch.linalg.svd(C)
        truncated = U[:, :2] @ torch.diag(s[:2]) @ Vh[:2]
        assert best == pytest.approx((torch.linalg.norm(C - truncated) / torch.linalg.norm(C)).item(), rel=1e-9)
        e = C - sent
        sent_total += sent
    # error feedback loses nothing: what was sent plus what is still kept is what came in
    torch.testing.assert_close(sent_total + e, sum(mats))
    # cold starts draw new noise each step: another sequence of compressed matrices, another result
    cold, _ = L.track_error_feedback(mats, 2, warm_start=False, seed=0)
    assert cold[0] == errors[0] and cold[1:] != errors[1:]


def test_exercise_checks(capsys):
    from solutions import nb06

    # check_stable_orthogonalize's reference is torch's QR; it refuses one pass of Gram-Schmidt (the
    # package's own orthogonalize_) on nearly dependent columns, and accepts a Householder answer
    assert ex.check_stable_orthogonalize(nb06.my_stable_orthogonalize)
    assert not ex.check_stable_orthogonalize(lambda X: L.orthogonalize_(X.clone()))
    assert "[FAIL]" in capsys.readouterr().out.splitlines()[-1]
    # check_rank1_error's reference runs the iteration; a formula that forgets the first product is by M fails
    assert ex.check_rank1_error(nb06.my_rank1_error)

    def exponent_2k(s, c, k):
        a = s ** (2 * k) * c
        return (1 - (a.square() / a.square().sum() * s.square()).sum() / s.square().sum()).sqrt().item()

    assert not ex.check_rank1_error(exponent_2k)
    assert "[FAIL]" in capsys.readouterr().out


def test_a_slow_call_is_timed_once_after_its_warm_up():
    from course_lib.utils.timing import median_seconds

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    assert median_seconds(slow, repeats=3, once_above_s=0.01) >= 0.02 and len(calls) == 2  # warm-up + one
    calls.clear()
    median_seconds(slow, repeats=3, once_above_s=1.0)
    assert len(calls) == 4  # below the limit: warm-up + 3
    calls.clear()
    median_seconds(slow, repeats=3)
    assert len(calls) == 4  # no limit
