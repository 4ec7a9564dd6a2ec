from course_lib.support.figures import build_all


def test_make_figures_draws_every_diagram(tmp_path):
    written = build_all(str(tmp_path))
    names = sorted(p.name for p in written)
    assert names == ["bucket_hook_future.png", "ddp_procedure.png", "powersgd_factorization.png", "ring_allreduce.png"]
    for p in written:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
