"""The contest's step times on slow links made real, against the step-time model fitted without them.

Notebook 10 predicts, with a step-time model fitted on this machine's loopback (about 1 to 2 GB/s of
bus bandwidth), where each compressor starts to pay: below a few tenths of a GB/s, where the model
was never checked. This script checks it there. It creates a network namespace of its own (``ip
netns add``), brings its loopback up, and throttles it with a token-bucket filter (``tc qdisc
replace dev lo root tbf rate R burst 256kb latency 100ms``; ``netem`` is not needed); the contest's
2 gloo processes then run inside it (``ip netns exec``), so every byte they exchange goes through
the filter. The namespace is removed afterwards, whatever happens.

For every method of the contest (notebook 10, at the setting ``compression_contest.json`` chose) and
"no communication", at each rate and unthrottled, it trains 105 steps and times steps 46-105 (after
PowerSGD's and DGC's warm-ups), on each rank; a run's step time is the slower rank's median. Each
(rate, method) is run ``--repeats`` times, the rates interleaved, so that the machine's drift falls on
all of them alike: the median and the spread (min, max) over the repeats are kept.

The model is notebook 10's (``costmodel.predict_compressed_step_time``): compute (the "no
communication" run), encode/decode (measured in the hook), waiting (measured per method) and the
collectives at α and bus bandwidth. Everything but the link is fitted on the unthrottled runs only:
α and the loopback's bus bandwidth from a sweep of all-reduces and all-gathers (``bandwidth.sweep``),
the rest from the runs. At a throttled rate R the link's bus bandwidth is the smaller of the fitted
one and R / p: **one filter carries both directions of every rank's traffic** (a loopback has one
queue, unlike a full-duplex NIC with a link per direction per machine), so the p ranks of a ring,
each sending at once, share R, and each gets R / p.

That model lacks two terms, and the file carries a second prediction with both, each measured, not
fitted: **the in-step cost** (a collective inside a training step costs more than the benchmark's,
run alone after a barrier: notebook 10, section 2), each method's measured unthrottled step minus
the model's prediction there; and **the filter's token bucket**: tbf lets up to its burst (256 kB,
set here) through at the loopback's speed when the bucket is full, and the bucket refills at R while
the step is off the link, so a step whose traffic fits in what refilled is hardly throttled at all.
Per step: T = min(burst, R x the step's time off the link) bytes pass at the unthrottled speed and
the rest at R (``bucket_link_s``). The burst is this filter's; a network's switch buffers play a
like part, at other sizes.

Writes benchmarks/results/throttled_links.json (committed): the settings, the unthrottled fit, each
method's measured step times (median, min, max) and predicted one at each rate with their ratio, and
the break-even rate of each method against fp32 all-reduce and against bf16, measured (interpolated
between the rates, in log scale, where the sign of the difference changes) and predicted.

Needs Linux and root (network namespaces and ``tc``). Where they are not permitted (a laptop, macOS,
a container without CAP_NET_ADMIN), it says so in one line and exits with status 2; the notebooks
read the committed file.

    sudo .venv/bin/python benchmarks/throttled_links.py                 # about 10 minutes on 2 cores
    sudo .venv/bin/python benchmarks/throttled_links.py --repeats 1 --rates 1
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from course_lib import bandwidth, costmodel, powersgd
from course_lib.launch import spawn
from course_lib.train import TrainConfig, train_several

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "throttled_links.json"
CONTEST = ROOT / "benchmarks" / "results" / "compression_contest.json"
NAMESPACE = "course-throttled-links"
RATES_GBIT = (0.1, 1.0, 10.0)
BURST, LATENCY = "256kb", "100ms"
BURST_BYTES = 256 * 1024  # tc's "kb" is kilobytes of 1024
WORLD_SIZE, STEPS, TIMED_FROM = 2, 105, 45
SWEEP_SIZES = [2**k for k in range(10, 21)]  # 1 KB to 1 MB: the contest's payloads, 688 B to 340 kB
REFERENCES = ("fp32 all-reduce", "bf16")


class NotPermitted(RuntimeError):
    """Network namespaces or tc are not available here."""


def configs() -> dict[str, TrainConfig]:
    """The contest's methods at their chosen settings, and "no communication", for a timing run."""
    contest = json.loads(CONTEST.read_text())
    base = dataclasses.replace(TrainConfig(), **{**contest["base"], "steps": STEPS, "eval_every": STEPS})
    return {name: dataclasses.replace(base, **row["run"]) for name, row in contest["methods"].items()
            if not row["diverged"]}


# ------------------------------------------------------------------ inside the namespace (a child process)

def measure(out_path: str, with_sweep: bool) -> None:
    """Train every config on 2 gloo processes; write each rank's timings (and, when asked, a sweep)."""
    runs = configs()
    per_rank = spawn(train_several, WORLD_SIZE, list(runs.values()), backend="gloo", timeout_s=1200)
    out = {"methods": {}}
    for i, name in enumerate(runs):
        ranks = [per_rank[r][i] for r in range(WORLD_SIZE)]
        first = ranks[0]
        out["methods"][name] = {
            "step_s": [statistics.median(o.step_time_s[TIMED_FROM:]) for o in ranks],
            "codec_s": [statistics.median(o.codec_s[TIMED_FROM:]) if o.codec_s else 0.0 for o in ranks],
            # the first rank at a collective waits for the other: |entry 0 - entry 1| / 2 per step, median
            "wait_s": statistics.median(abs(a - b) / 2 for a, b in zip(ranks[0].hook_enter_s[TIMED_FROM:],
                                                                        ranks[1].hook_enter_s[TIMED_FROM:])),
            "collectives": first.collectives_per_step(TIMED_FROM, STEPS)}
    if with_sweep:  # PowerSGD's computation, which its hook does not time apart: on one process, as notebook 10
        shapes = [tuple(p.shape) for p in per_rank[0][0].final_params]
        out["powersgd_codec_s"] = powersgd.encode_decode_seconds(shapes, runs["PowerSGD r=2"].matrix_approximation_rank)
        out["sweep"] = spawn(bandwidth.sweep, WORLD_SIZE, ("all_reduce", "all_gather"), SWEEP_SIZES, 20, 3,
                             backend="gloo")[0]
    Path(out_path).write_text(json.dumps(out))


# ------------------------------------------------------------------ the namespace, from outside

class Namespace:
    """``with Namespace() as ns``: a network namespace with its loopback up; removed on the way out."""

    def __init__(self, name: str = NAMESPACE):
        self.name = name

    def _ip(self, *args, check=True):
        return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)

    def __enter__(self):
        if sys.platform != "linux" or shutil.which("ip") is None or shutil.which("tc") is None:
            raise NotPermitted("needs Linux with iproute2 (ip, tc)")
        self._ip("netns", "del", self.name, check=False)  # left over from a run that was killed
        made = self._ip("netns", "add", self.name, check=False)
        if made.returncode:
            raise NotPermitted(f"cannot create a network namespace ({made.stderr.strip() or 'ip netns add failed'}): "
                               "run as root on Linux")
        try:
            self.run(["ip", "link", "set", "lo", "up"])
            self.throttle(RATES_GBIT[0])  # tc must work here too: find out now, not after the first runs
            self.throttle(None)
        except BaseException:
            self._ip("netns", "del", self.name, check=False)
            raise
        return self

    def __exit__(self, *exc):
        self._ip("netns", "del", self.name, check=False)
        return False

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(["ip", "netns", "exec", self.name, *command], capture_output=True, text=True, **kwargs)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} in namespace {self.name} failed ({done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        return done

    def throttle(self, gbit: float | None) -> None:
        """A token-bucket filter of ``gbit`` Gbit/s on the loopback; None: none."""
        if gbit is None:
            subprocess.run(["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", "lo", "root"],
                           capture_output=True)
            return
        try:
            self.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{gbit * 1000:g}mbit",
                      "burst", BURST, "latency", LATENCY])
        except RuntimeError as e:
            raise NotPermitted(f"tc cannot throttle the namespace's loopback ({str(e).splitlines()[-1]})") from e

    def measure(self, gbit: float | None, with_sweep: bool = False) -> dict:
        self.throttle(gbit)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.run([sys.executable, __file__, "--measure", f.name] + (["--sweep"] if with_sweep else []),
                     env=env, timeout=3600)
            return json.loads(Path(f.name).read_text())


# ------------------------------------------------------------------ the model and the results

def rate_key(gbit: float | None) -> str:
    return "unthrottled" if gbit is None else f"{gbit:g} Gbit/s"


def link(fit: dict, gbit: float | None) -> dict:
    """Each op's (alpha, bus bandwidth in GB/s): the fitted ones, the bandwidth capped at R / p (one
    filter, shared by every rank's traffic)."""
    if gbit is None:
        return {op: tuple(v) for op, v in fit.items()}
    return {op: (alpha, min(busbw, gbit / 8 / WORLD_SIZE)) for op, (alpha, busbw) in fit.items()}


def predict(method: dict, fit: dict, gbit: float | None) -> float:
    return costmodel.predict_compressed_step_time(
        compute_s=method["compute_s"], codec_s=method["codec_s"], wait_s=method["wait_s"] if method["collectives"]
        else 0.0, collectives=[tuple(c) for c in method["collectives"]], world_size=WORLD_SIZE, links=link(fit, gbit))


def _sent(op: str, nbytes: float) -> float:
    """Bytes one rank sends in one collective (the bandwidth term of ``costmodel.collective_time``:
    2(p-1)/p n for an all-reduce, (p-1) n for an all-gather)."""
    return nbytes * (costmodel.bus_factor(op, WORLD_SIZE) if op == "all_reduce" else WORLD_SIZE - 1)


def wire_bytes(collectives: list) -> float:
    """Bytes one rank sends in the step's collectives; the filter carries p times this."""
    return sum(_sent(op, n) for op, n in collectives)


def bucket_link_s(method: dict, fit: dict, gbit: float | None, off_link_s: float) -> float:
    """Seconds a step's bytes spend on the link through a token bucket of BURST_BYTES at ``gbit``: the
    tokens refilled while the step was off the link (at most the burst) pass at the fitted speed, the
    rest at R. Unthrottled (None): the model's bandwidth terms as they are."""
    sent = wire_bytes(method["collectives"])
    if not sent:
        return 0.0
    fitted = sum(_sent(op, n) / (fit[op][1] * 1e9) for op, n in method["collectives"])  # each rank at its op's busbw
    if gbit is None:
        return fitted
    rate = gbit * 1e9 / 8  # bytes per second through the one filter, all ranks together
    tokens = min(BURST_BYTES, rate * off_link_s)
    through = WORLD_SIZE * sent
    return fitted * min(through, tokens) / through + max(0.0, through - tokens) / rate


def predict_measured_terms(method: dict, fit: dict, gbit: float | None) -> float:
    """The model with the two terms it lacks, each measured: the method's unthrottled step as measured
    (``method["unthrottled_s"]``, which holds the in-step cost), less its bytes' unthrottled time, plus
    their time through the token bucket at ``gbit``."""
    base = method["unthrottled_s"] - bucket_link_s(method, fit, None, 0.0)
    return base + bucket_link_s(method, fit, gbit, base)


def break_even_gbit(method: dict, reference: dict, fit: dict, low: float = 1e-3, high: float = 1e3) -> float:
    """The rate (Gbit/s) below which ``method`` steps faster than ``reference`` by
    :func:`predict_measured_terms`: inf if it is faster at every rate from ``low`` to ``high``, 0.0 if at
    none (bisection in log rate, as ``costmodel.break_even_bandwidth``)."""
    def gap(gbit):
        return predict_measured_terms(method, fit, gbit) - predict_measured_terms(reference, fit, gbit)
    return costmodel.below_which(gap, low, high)


def crossing(rates: list[float], gaps: list[float]) -> float | None:
    """The rate (Gbit/s) where ``gaps`` (method minus reference, at increasing ``rates``) turns from
    negative to positive, interpolated linearly in log rate; None if it never does inside the range."""
    for (r0, g0), (r1, g1) in zip(zip(rates, gaps), zip(rates[1:], gaps[1:])):
        if g0 < 0 <= g1:
            return math.exp(math.log(r0) + (math.log(r1) - math.log(r0)) * (-g0) / (g1 - g0))
    return None


def summarize(unthrottled: list[dict], throttled: dict[float, list[dict]]) -> dict:
    fits = [{op: costmodel.fit_collective(run["sweep"][op], op, WORLD_SIZE) for op in ("all_reduce", "all_gather")}
            for run in unthrottled]
    fit = {op: [statistics.median(f[op][0] for f in fits), statistics.median(f[op][1] for f in fits)]
           for op in ("all_reduce", "all_gather")}
    names = list(unthrottled[0]["methods"])
    compute_s = statistics.median(max(run["methods"]["no communication"]["step_s"]) for run in unthrottled)
    methods = {}
    for name in names:
        rows = [run["methods"][name] for run in unthrottled]
        codec_s = (statistics.median(run["powersgd_codec_s"] for run in unthrottled) if name.startswith("PowerSGD")
                   else statistics.median(statistics.mean(r["codec_s"]) for r in rows))
        model = {"compute_s": compute_s, "codec_s": codec_s,
                 "wait_s": statistics.median(r["wait_s"] for r in rows), "collectives": rows[0]["collectives"],
                 "unthrottled_s": statistics.median(max(r["step_s"]) for r in rows)}
        measured, predicted, ratio, with_terms = {}, {}, {}, {}
        for gbit, runs in [(None, unthrottled), *throttled.items()]:
            steps = [max(run["methods"][name]["step_s"]) for run in runs]  # the slower rank, per repeat
            key = rate_key(gbit)
            measured[key] = {"median_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps)}
            predicted[key] = predict(model, fit, gbit)
            ratio[key] = predicted[key] / measured[key]["median_s"]
            with_terms[key] = predict_measured_terms(model, fit, gbit)
        methods[name] = {"model": model, "measured": measured, "predicted": predicted, "ratio": ratio,
                         "predicted_with_measured_terms": with_terms,
                         "ratio_with_measured_terms": {k: with_terms[k] / measured[k]["median_s"] for k in measured}}
    rates = sorted(throttled)
    keys = [rate_key(g) for g in rates]
    break_even = {}
    for name in names:
        for ref in REFERENCES:
            if name == ref or name == "no communication":
                continue
            gaps = [methods[name]["measured"][k]["median_s"] - methods[ref]["measured"][k]["median_s"] for k in keys]
            method, reference = ({k: v for k, v in methods[n]["model"].items() if k not in ("wait_s", "unthrottled_s")}
                                 for n in (name, ref))
            method["collectives"] = [tuple(c) for c in method["collectives"]]
            reference["collectives"] = [tuple(c) for c in reference["collectives"]]
            busbw = costmodel.break_even_bandwidth(method, reference, WORLD_SIZE, fit["all_reduce"][0])
            predicted = busbw * 8 * WORLD_SIZE if math.isfinite(busbw) else busbw  # back to the filter's Gbit/s
            break_even.setdefault(name, {})[ref] = {"measured_gbit": crossing(rates, gaps),
                                                    "predicted_gbit": predicted,
                                                    "predicted_with_measured_terms_gbit": break_even_gbit(
                                                        methods[name]["model"], methods[ref]["model"], fit),
                                                    "faster_at": [k for k, g in zip(keys, gaps) if g < 0]}
    return {"fit": fit, "compute_s": compute_s, "methods": methods, "break_even": break_even}


def settings() -> dict:
    return {"world_size": WORLD_SIZE, "rates_gbit": list(RATES_GBIT), "burst": BURST, "burst_bytes": BURST_BYTES,
            "latency": LATENCY,
            "steps": STEPS, "timed_from": TIMED_FROM, "sweep_sizes": SWEEP_SIZES,
            "contest": str(CONTEST.relative_to(ROOT))}


def main(rates, repeats: int) -> dict:
    unthrottled, throttled = [], {gbit: [] for gbit in rates}
    with Namespace() as ns:
        for repeat in range(repeats):
            unthrottled.append(ns.measure(None, with_sweep=True))
            print(f"repeat {repeat + 1}/{repeats}: unthrottled", flush=True)
            for gbit in rates:
                throttled[gbit].append(ns.measure(gbit))
                print(f"repeat {repeat + 1}/{repeats}: {gbit:g} Gbit/s", flush=True)
    # the raw timings, kept where a failure below would otherwise lose minutes of measurement
    raw = Path(tempfile.gettempdir(), "throttled_links.raw.json")
    raw.write_text(json.dumps([unthrottled, list(throttled.items())]))
    return {"settings": dict(settings(), rates_gbit=list(rates), repeats=repeats),
            **summarize(unthrottled, throttled),
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()}}


def print_table(out: dict) -> None:
    keys = ["unthrottled"] + [rate_key(g) for g in out["settings"]["rates_gbit"]]
    print(f"{'':18s}" + "".join(f"{k:>36s}" for k in keys))
    print(f"{'':18s}" + "".join(f"{'measured ms (min-max)  pred  ratio  +terms':>36s}" for _ in keys))
    for name, m in out["methods"].items():
        cells = [f"{1e3 * m['measured'][k]['median_s']:7.2f} ({1e3 * m['measured'][k]['min_s']:.1f}-"
                 f"{1e3 * m['measured'][k]['max_s']:.1f}) {1e3 * m['predicted'][k]:6.2f} {m['ratio'][k]:5.2f}"
                 f" {m['ratio_with_measured_terms'][k]:5.2f}" for k in keys]
        print(f"{name:18s}" + "".join(f"{c:>36s}" for c in cells))
    for label, field in (("the model", "ratio"), ("with the measured terms", "ratio_with_measured_terms")):
        print(f"mean |predicted / measured - 1|, {label}: " + ", ".join(
            f"{k} {statistics.mean(abs(m[field][k] - 1) for m in out['methods'].values()):.0%}" for k in keys))
    print("\nbreak-even rate (Gbit/s) below which the method steps faster, measured | the model | with the terms:")
    for name, refs in out["break_even"].items():
        print(f"  {name:18s}" + "  ".join(
            f"vs {ref}: {b['measured_gbit'] or '-'!s:>8.8} | {b['predicted_gbit']:.3g} | "
            f"{b['predicted_with_measured_terms_gbit']:.3g}" for ref, b in refs.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES_GBIT), help="Gbit/s")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child inside the namespace: where to write
    parser.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.sweep)
        sys.exit(0)
    try:
        result = main(sorted(args.rates), args.repeats)
    except NotPermitted as e:
        print(f"throttled_links: {e}; the notebooks read the committed {RESULTS.relative_to(ROOT)}", file=sys.stderr)
        sys.exit(2)
    print_table(result)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")
