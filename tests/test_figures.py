import pytest
import torch

from course_lib.launch import spawn
from course_lib.notebooks.demos import ring_trace
from course_lib.notebooks.figures import build_all, ring_sends


def test_make_figures_draws_every_diagram(tmp_path):
    written = build_all(str(tmp_path))
    names = sorted(p.name for p in written)
    assert names == ["bucket_hook_future.png", "ddp_procedure.png", "powersgd_factorization.png", "ring_allreduce.png"]
    for p in written:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_ring_figure_arrows_follow_the_ring_schedule():
    # the arrows are read off the recorded states; the schedule they must match is the textbook's
    # (Thakur et al. 2005), written out here: in reduce-scatter step s rank r sends chunk r - s, in
    # all-gather step s chunk r + 1 - s, always to rank r + 1
    p = 4
    traces = spawn(ring_trace, p, backend="gloo")
    want = [sorted((r, (r + 1) % p, (r - s) % p) for r in range(p)) for s in range(p - 1)]
    want += [sorted((r, (r + 1) % p, (r + 1 - s) % p) for r in range(p)) for s in range(p - 1)]
    assert ring_sends(traces) == want
    # a trace in which a rank received nothing in some step is not a ring all-reduce: refused
    frozen = [list(t) for t in traces]
    frozen[2][3] = (frozen[2][3][0], frozen[2][3][1], frozen[2][2][2].clone())
    with pytest.raises(ValueError, match=r"rank 2 changed chunks \[\]"):
        ring_sends(frozen)
    assert torch.equal(traces[0][-1][2], torch.full((p,), 2.0**p - 1))
