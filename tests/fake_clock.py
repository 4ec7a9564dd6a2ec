"""A clock for tests of timing code: ``time.perf_counter`` and ``time.process_time`` read it, and only
the test's own work moves it. A measurement of known durations is then exact on any machine, under
any load: such a test checks the arithmetic of a timing function (mean or median, which rank, what
is timed), never how fast anything ran. Timings themselves live in ``benchmarks/``."""

import contextlib
import time


class FakeClock:
    def __init__(self):
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def spend(self, wall_s: float, cpu_s: float = 0.0) -> None:
        """What work that takes ``wall_s`` seconds and ``cpu_s`` seconds of this process's CPU shows."""
        self.wall_s += wall_s
        self.cpu_s += cpu_s


@contextlib.contextmanager
def fake_clock():
    clock = FakeClock()
    saved = time.perf_counter, time.process_time
    time.perf_counter, time.process_time = (lambda: clock.wall_s), (lambda: clock.cpu_s)
    try:
        yield clock
    finally:
        time.perf_counter, time.process_time = saved
