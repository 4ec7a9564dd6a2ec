"""Every exercise check refuses the course's own answer: each check is handed the function of
``course_lib`` (or of its own module) that computes what the exercise asks, called as a student would
call it (``tests/course_answers.py``), and must fail saying why. The answers pass through the check's
own comparison otherwise: ``tests/test_solutions.py`` runs the instructors' answers, written out,
through the same checks."""

import pytest
import torch

from course_lib import costmodel, lowrank, memory, powersgd, sharding
from course_lib.notebooks import exercises as ex
from course_lib.notebooks.exercises import nb03, nb04, nb05, nb06, nb07
from tests import course_answers as answers

# (check, the course's answer, what the check's message must say)
REFUSED = "may not call"
ONE_PROCESS = [
    ("check_exposed_time", lambda *a: nb03.exposed_time(*a), REFUSED),
    ("check_ddp_all_reduces", lambda *a: nb04.ddp_all_reduces(*a), REFUSED),
    ("check_bytes_per_rank", lambda n, stage, p: sharding.bytes_per_rank(n, stage, p), "sharding.bytes_per_rank"),
    ("check_zero3_bytes_sent", lambda *a: nb05.zero_bytes_sent(*a), REFUSED),
    ("check_stable_orthogonalize", lambda X: torch.linalg.qr(X).Q, "torch.linalg.qr"),
    ("check_rank1_error", lambda s, c, k: nb06._rank1_error_measured(s, c, k), REFUSED),
    ("check_rank1_error", lambda s, c, k: _the_check_s_simulation_copied(s, c, k), "torch.linalg.qr"),
    ("check_rank1_error", lambda s, c, k: _power_iteration_on_diag(s, c, k), "lowrank.power_iteration"),
    ("check_smallest_rank",
     lambda M, e: next(r for r in range(1, min(M.shape) + 1) if lowrank.svd_error(M, r) <= e), "lowrank.svd_error"),
    ("check_pq_singular_values", lambda P, Q: torch.linalg.svdvals(P @ Q.T)[: P.shape[1]].double(), "svdvals"),
    ("check_mean_and_own_buffer", lambda grads, compress: nb07._mean_and_own_buffer(grads, compress), REFUSED),
    ("check_numbers_per_step", lambda shapes, r, rate: powersgd.numbers_per_step(shapes, r, rate), REFUSED),
    ("check_memory_per_rank", lambda *a: nb07._memory_per_rank(*a), REFUSED),
    ("check_alternating_powersgd", lambda *a: nb07._alternating(*a), REFUSED),
    ("check_stochastic_rounding", lambda x, levels, u: ex.nb09._stochastic_round(x, levels, u), REFUSED),
    ("check_dgc_step", lambda g, u, v, m, k: ex.nb09._dgc_step(g, u, v, m, k), REFUSED),
    ("check_outer_step", lambda *a: _torch_outer_step(*a), "torch.optim.SGD"),
    ("check_break_even_period", lambda *a: costmodel.break_even_period(*a), "costmodel.break_even_period"),
    ("check_break_even_bandwidth", lambda *a: costmodel.break_even_bandwidth(*a), REFUSED),
    ("check_ring_fit", lambda sizes, times, p: costmodel.fit_ring_all_reduce(
        [{"bytes": n, "time_s": t} for n, t in zip(sizes, times)], p), REFUSED),
]
IN_PROCESSES = [
    ("check_sum_of_squares", answers.sum_of_squares, REFUSED),
    ("check_elementwise_max", answers.elementwise_max, REFUSED),
    ("check_ddp_token_step", answers.ddp_token_step, "accumulate_tokens"),
    ("check_ring_shift", answers.ring_shift, "course_lib.collectives."),
    ("check_recursive_doubling", answers.recursive_doubling, "may"),
    ("check_recursive_halving", answers.recursive_halving, "may"),
    ("check_recursive_halving", answers.recursive_halving_by_ring, "collectives.ring_reduce_scatter"),
    ("check_zero2_gradient", answers.zero2_gradient, "may not"),
    ("check_topk_average", answers.topk_average, REFUSED),
    ("check_topk_average", answers.topk_average_of_whole_tensors, "top-k sends"),
    ("check_batched_hook", answers.batched_powersgd_hook, "batched_powerSGD_hook"),
    ("check_memory_hook", answers.memory_hook_by_parameter_keys, "memory.ParameterKeys"),
    ("check_memory_hook", answers.memory_hook_by_parameter_keys_in_the_callback, "memory.ParameterKeys"),
]


def _the_check_s_simulation_copied(s, c, k):
    """What the issue found: the check's own simulation, copied into the answer."""
    g = torch.Generator().manual_seed(7)
    n = len(s)
    U = torch.linalg.qr(torch.randn(n + 3, n, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    M = U @ torch.diag(s.double()) @ V.T
    P, Q = lowrank.power_iteration(M, 1, k, q=(V @ c.double()).unsqueeze(1))
    return lowrank.relative_error(M, P, Q)


def _power_iteration_on_diag(s, c, k):
    M = torch.diag(s.double())
    P, Q = lowrank.power_iteration(M, 1, k, q=c.double().unsqueeze(1))
    return lowrank.relative_error(M, P, Q)


def _torch_outer_step(shared, locals_, momentum, lr=0.7, mu=0.9):
    """DiLoCo's outer step by torch's own Nesterov SGD, as the check's reference runs it."""
    params = [s.clone().requires_grad_(False) for s in shared]
    opt = torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=True)
    for p, s, *ranks in zip(params, shared, *locals_):
        p.grad = s - torch.stack(ranks).mean(0)
    opt.step()
    return params, [opt.state[p]["momentum_buffer"] for p in params]


@pytest.mark.parametrize("check, answer, says", ONE_PROCESS + IN_PROCESSES,
                         ids=[f"{c}-{getattr(a, '__name__', 'lambda')}" for c, a, _ in ONE_PROCESS + IN_PROCESSES])
def test_the_check_refuses_the_course_s_own_answer(check, answer, says, capsys):
    assert getattr(ex, check)(answer) is False
    out = capsys.readouterr().out
    assert out.startswith("[FAIL]") and says in out, out


def test_every_check_is_in_the_table():
    checks = {name for name in dir(ex) if name.startswith("check_") and name != "check_distributed"}
    assert checks == {c for c, _, _ in ONE_PROCESS + IN_PROCESSES}


def test_a_helper_the_exercise_allows_is_not_refused(capsys):
    # exercise 1 of notebook 03 may use costmodel.ring_all_reduce_time and data_parallel.assign_buckets
    from solutions.nb03 import my_exposed_time
    assert ex.check_exposed_time(my_exposed_time)

    def with_the_course_helpers(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
        from course_lib import data_parallel
        end = 0.0
        for bucket in data_parallel.assign_buckets(sizes_bytes, cap_bytes):
            start = max(end, max(ready_s[i] for i in bucket))
            end = start + costmodel.ring_all_reduce_time(sum(sizes_bytes[i] for i in bucket), world_size, alpha_s,
                                                         busbw_GBps)
        return max(0.0, end - max(ready_s))

    assert ex.check_exposed_time(with_the_course_helpers)
    assert "[PASS]" in capsys.readouterr().out
    assert memory.ErrorFeedback().compensate("a", torch.ones(2)).tolist() == [1.0, 1.0]  # put back after the checks


def test_a_callback_chained_while_watched_is_watched_on_the_thread_that_runs_it():
    # a hook's `fut.then(callback)`: the callback runs when the collective completes, often on gloo's
    # thread, after the hook (and its watch on this thread) has returned
    import threading

    from course_lib.notebooks.exercises.core import refused_calls

    pending = torch.futures.Future()
    with refused_calls([sharding.bytes_per_rank], "a hook", "refused"):
        chained = pending.then(lambda done: sharding.bytes_per_rank(10, 1, 2))
    other = threading.Thread(target=pending.set_result, args=(None,))
    other.start()
    other.join()
    with pytest.raises(Exception, match="may not call"):
        chained.wait()
    # and once every watch has ended, `then` is torch's own again
    from course_lib.notebooks.exercises import core
    assert torch._C.Future.then is core._THEN["original"] and not core._THEN["watches"]
