"""Run ``make test``'s phases, some side by side, and print how long each took.

    python3 tests/phases.py install lint "unit:2 nbval:1 nbval-other-cpu browser"

Each argument is a step; the make targets named in one step run at the same time (on 2 cores the
unit tests, the two nbval runs and the browser test spend much of their time waiting on each
other's processes, so together they finish sooner than one after another). ``TARGET:N`` runs a
target in a session of its own at niceness N. Side by side the step lasts as long as its longest
target, so a target that would finish early should yield the CPU to the others. Linux shares the CPU
between sessions first (autogroup scheduling, where enabled) and each notebook kernel is a session of
its own, so a nice process in the shared session yields only to its neighbours there: the target's
own session gets the niceness too (/proc/self/autogroup). Niceness changes when a process gets the
CPU, not what it computes. A target's output goes to
``build/logs/TARGET.log`` and is printed whole when it ends, so that outputs never interleave. Every
step runs even when one before it failed (except after a failed install: nothing can run then); the
table at the end says which failed, and the exit status is 1 if any did. A target whose tests were
all skipped (the browser test without chromium) is marked SKIPPED in the table and in its last
line, with pytest's reason: a skipped phase is not a passed one.

Standard library only: it runs before the virtual environment exists (the install phase builds it).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "logs"


def run_step(targets: list[str]) -> list[tuple[str, float, int]]:
    """Start ``make TARGET`` for every target at once; wait for all; print each log as it ends."""
    LOGS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if len(targets) > 1:
        # Side by side, a process computing on every core (a notebook's kernel, with torch's threads)
        # shares them with the others. OpenMP's threads then spin while they wait for each other, and
        # a spinning thread holds a core the thread it waits for needs: notebook 06 took 71 s instead
        # of 33 beside another run, 42 s with passive waiting. Passive waiting changes how a thread
        # waits, not the threads or the work each does: the same numbers come out.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    running = {}
    niceness = {}
    for spec in targets:
        target, _, nice = spec.partition(":")
        niceness[target] = int(nice or 0)
        log = open(LOGS / f"{target}.log", "w")
        proc = subprocess.Popen(["make", "--no-print-directory", target], cwd=ROOT, stdout=log, env=env,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_yielding(niceness[target]) if niceness[target] else None)
        running[target] = (proc, log, time.monotonic())
    if len(targets) > 1:
        shown = ", ".join(f"{t} (nice {n})" if n else t for t, n in niceness.items())
        print(f"== {shown}: side by side (OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}); each log is "
              f"printed when it ends", flush=True)
    done = []
    try:
        _wait(running, done)
    except KeyboardInterrupt:  # a target in a session of its own does not get the terminal's Ctrl-C: pass it on
        for target, (proc, _, _) in running.items():
            if niceness[target] and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, _, _ in running.values():
            proc.wait()
        raise
    return done


def _yielding(niceness: int):
    """What the child runs before make: a session of its own, at ``niceness``, the session too."""
    def set_up():
        os.setsid()
        os.nice(niceness)
        try:  # Linux with autogroup scheduling; elsewhere the process niceness alone
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(niceness))
        except OSError:
            pass
    return set_up


def _wait(running: dict, done: list) -> None:
    """Wait for the targets in ``running``; print each one's log as it ends; record it in ``done``."""
    while running:
        for target, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            seconds = time.monotonic() - start
            log.close()
            del running[target]
            print(f"== {target} ({'passed' if proc.returncode == 0 else 'FAILED'}, {seconds:.0f} s)", flush=True)
            sys.stdout.write((LOGS / f"{target}.log").read_text(errors="replace"))
            sys.stdout.flush()
            done.append((target, seconds, proc.returncode))
        time.sleep(0.5)


def skipped(log: str) -> str | None:
    """Why a target that passed ran no test, from its pytest log: the reasons of ``-rs`` (or the
    summary line), where its summary counts skipped tests and none that passed. A skipped target is
    not a passed one, and the table says so."""
    summaries = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", log, flags=re.M)
    if not summaries or "skipped" not in summaries[-1] or "passed" in summaries[-1]:
        return None
    reasons = sorted(set(re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", log, flags=re.M)))
    return "; ".join(reasons) or summaries[-1]


def _status(target: str, code: int) -> str:
    if code != 0:
        return "FAILED"
    log = LOGS / f"{target}.log"
    why = skipped(log.read_text(errors="replace")) if log.exists() else None
    return f"SKIPPED: {why}" if why else "passed"


def main(steps: list[str]) -> int:
    start = time.monotonic()
    rows = []  # (step, target, seconds, status)
    for step in steps:
        step_start = time.monotonic()
        finished = run_step(step.split())
        step_s = time.monotonic() - step_start
        rows += [(step, target, seconds, code) for target, seconds, code in sorted(finished)]
        if len(finished) > 1:
            rows.append((step, "(together)", step_s, max(code for _, _, code in finished)))
        if step == "install" and finished[0][2] != 0:
            break
    total = time.monotonic() - start
    print("\nwhere make test's time went (wall-clock seconds; targets of one step ran side by side):")
    statuses = [(target, seconds, code, "FAILED" if code else "passed") if target == "(together)"
                else (target, seconds, code, _status(target, code)) for _, target, seconds, code in rows]
    for target, seconds, _, status in statuses:
        print(f"  {target:17} {seconds:6.0f} s  {status}")
    failed = [target for target, _, code, _ in statuses if code != 0 and target != "(together)"]
    skips = [target for target, _, _, status in statuses if status.startswith("SKIPPED")]
    verdict = "FAILED: " + " ".join(failed) if failed else "passed"
    if skips:
        verdict += f", but SKIPPED (ran no test): {' '.join(skips)}"
    print(f"  {'total':17} {total:6.0f} s  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
