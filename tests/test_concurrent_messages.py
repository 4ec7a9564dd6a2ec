"""bandwidth.time_with_cpu and bandwidth.concurrent_messages, in real gloo processes (notebook 02's
test of whether ranks on one machine have a link each)."""

from collections import Counter

import pytest

from course_lib.launch import spawn
from tests import concurrency_workers as W


def test_time_with_cpu_is_the_median_slowest_wall_time_and_the_cpu_of_every_rank():
    # On a fake clock (exact on any machine): rank r takes (r + 1) d per timed run (5 (r + 1) d in the
    # first), so the median of the slowest rank's times is 3 d on 3 ranks; the mean over runs would be
    # 7 d, the maximum 15 d, rank 0's median d. Sleeping costs no CPU, so CPU time that counted wall
    # time would fail. Spinning costs cpu_s of CPU time on each rank: 3 cpu_s in all (rank 0's alone
    # would be 1/3).
    d, cpu_s, p = 0.02, 0.05, 3
    per_rank = spawn(W.known_durations, p, d, cpu_s, backend="gloo")
    assert all(r == per_rank[0] for r in per_rank)  # every rank returns the same numbers
    (slept_s, slept_cpu), (spun_s, spun_cpu), calls = per_rank[0]
    assert calls == 4  # the warm-up and 3 timed runs
    assert slept_s == pytest.approx(p * d, rel=1e-12) and slept_cpu == 0
    assert spun_cpu == pytest.approx(p * cpu_s, rel=1e-12) and spun_s == pytest.approx(cpu_s, rel=1e-12)


@pytest.mark.parametrize(("world_size", "senders"), [(2, 1), (2, 2), (3, 2), (3, 3)])
def test_concurrent_messages_go_to_the_right_neighbour(world_size, senders):
    numel, runs = 1000, 1 + 2 + 1  # a warm-up, 2 timed runs, the untimed check
    per_rank = spawn(W.logged_messages, world_size, senders, numel, backend="gloo")
    for rank, (rows, log) in enumerate(per_rank):
        assert rows == per_rank[0][0]
        want = Counter()  # the pattern written out: rank r < senders sends to r + 1, mod p
        if rank < senders:
            want[("send", (rank + 1) % world_size, numel)] = runs
        if (rank - 1) % world_size < senders:
            want[("recv", (rank - 1) % world_size, numel)] = runs
        assert Counter(log) == want
    (row,) = per_rank[0][0]
    assert row["size_bytes"] == 4 * numel and row["messages"] == senders and row["wrong"] == 0
    assert row["time_s"] > 0 and row["cores_busy"] == pytest.approx(row["cpu_s"] / row["time_s"])


def test_concurrent_messages_count_corrupted_elements():
    # Every message carries zeros: each of the 2 receivers (ranks 1 and 2) finds all numel elements wrong.
    numel = 1000
    rows, _ = spawn(W.logged_messages, 3, 2, numel, True, backend="gloo")[0]
    assert rows[0]["wrong"] == 2 * numel


def test_concurrent_messages_rejects_impossible_patterns():
    from course_lib.bandwidth import concurrent_messages

    with pytest.raises(ValueError):
        concurrent_messages(0, 2, [4096], senders=3)
