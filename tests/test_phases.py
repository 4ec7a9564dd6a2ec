"""make test's runner (tests/phases.py): a target asked to yield runs in a session of its own, nicer."""

import os
import subprocess
import sys

import pytest

from tests import phases


@pytest.mark.skipif(not hasattr(os, "setsid"), reason="POSIX sessions")
def test_a_yielding_target_gets_a_session_and_niceness_of_its_own():
    code = ("import os; print(os.getsid(0) == os.getpid(), os.nice(0)); "
            "print(open('/proc/self/autogroup').read() if os.path.exists('/proc/self/autogroup') else '')")
    here = os.nice(0)
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=phases._yielding(4), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == f"True {here + 4}"
    if out[1:] and out[1]:  # Linux with autogroup scheduling: the session shares the CPU at that niceness
        assert out[1].endswith("nice 4")


def test_a_target_that_ran_no_test_is_reported_skipped_not_passed():
    log = ("SKIPPED [2] tests/test_browser.py:61: no chromium on PATH: `apt-get install chromium`\n"
           "2 skipped in 0.52s\n")
    assert phases.skipped(log) == "no chromium on PATH: `apt-get install chromium`"
    assert phases.skipped("=== 3 passed, 1 skipped in 2.10s ===\n") is None  # some ran
    assert phases.skipped("12 passed in 40.00s\n") is None
    assert phases.skipped("2 skipped in 0.1s\n") == "2 skipped"  # no -rs reasons: the summary itself
