"""PyTorch's own tests, run against the course's drop-in classes in place of torch's.

The course's classes keep torch's names and signatures so that a student can swap one for the other.
This checks that claim with torch's own test bodies: each suite runs twice over gloo, once with
torch's classes and once with the course's in their place, and prints how many tests pass, fail and
are skipped each time, with every failure's test name and one-line reason (its exception's last line).

* ``zero``: torch's ``test/distributed/optim/test_zero_redundancy_optimizer.py``, with
  ``course_lib.sharding.ShardedOptimizer`` as ``ZeroRedundancyOptimizer``.
* ``averaging``: the model averaging and post-local SGD tests of
  ``torch.testing._internal.distributed.distributed_test`` (names with ``average``, ``averager`` or
  ``post_localSGD``; the module ships in the torch wheel), 2 gloo ranks, with ``course_lib.local_sgd``'s
  ``average_parameters``, ``PeriodicModelAverager``, ``PostLocalSGDState``, ``post_localSGD_hook`` and
  ``PostLocalSGDOptimizer``.
* ``hooks``: torch's ``test/distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py`` and the
  ``distributed_test`` tests of DDP hooks that use torch's default or PowerSGD hooks, with
  ``course_lib.powersgd``'s ``PowerSGDState``, ``powerSGD_hook``, ``batched_powerSGD_hook`` and
  ``course_lib.hooks``' default hooks.

How the course's classes get in: torch's harness starts each rank with ``spawn``, which imports the
test's module afresh, so a patch made in this process alone would be lost. So the script writes, in a
temporary folder, one small module per suite and side that calls :func:`prepare` when imported; that
runs torch's test file in the module's own namespace (or imports ``distributed_test`` and builds its
test class there, as torch's ``test_distributed_spawn.py`` does) and then rebinds torch's names to the
course's. Every rank imports that module again, and so gets the same classes. By default the ranks
are forked instead (``--start fork``: they inherit the modules, and the suites take 2 minutes instead
of 8 on 2 cores); ``--start spawn`` starts them as torch's harness does, with the same counts.

Most of these tests are written for GPUs: torch skips them unless each rank has its own GPU. With
``--gpu-tests cpu`` (the default with fewer than 2 GPUs) they run on the CPU instead, for torch's
classes and the course's alike: skips for want of GPUs are lifted, ``.cuda()`` and CUDA devices
become the CPU, and DDP drops ``device_ids``. Tests that need more than 2 ranks or GPUs stay skipped.
Torch's own column shows where this emulation cannot run a test. ``--gpu-tests torch`` runs them as
torch does (the default with 2 GPUs or more; skipped with fewer).

The two test files are not in the torch wheel. Save them, from the tag of your torch version, in one
folder (the script prints their exact addresses when they are missing), and install ``expecttest``,
which ``torch.testing._internal`` needs:
    pip install expecttest
    .venv/bin/python benchmarks/torch_tests.py --tests /path/to/folder [--suite zero|averaging|hooks]
About 2 minutes on 2 cores for the three suites, both sides (``--start spawn``: 8).
"""

import argparse
import contextlib
import functools
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORLD_SIZE = 2  # ranks in distributed_test's suites; torch's other files choose their own (2 on a CPU)


@dataclass(frozen=True)
class Suite:
    title: str
    files: tuple[str, ...]  # torch's test files, as paths in pytorch/pytorch
    select: str | None  # which tests of distributed_test the suite runs (a regular expression), if any
    # --gpu-tests cpu also lifts "needs NCCL" (requires_accelerator_dist_backend): test_ddp_hooks.py asks
    # for it of every test, its hooks being the same on gloo; ZeRO's tests that ask need NCCL indeed
    # (torch's class refuses overlap_with_ddp on gloo)
    lift_nccl: bool = False
    selected: str = ""  # the selection, in words


SUITES = {
    "zero": Suite("ZeRO", ("test/distributed/optim/test_zero_redundancy_optimizer.py",), None),
    "averaging": Suite("model averaging / post-local SGD", (), r"averag|post_?localsgd",
                       selected="distributed_test's tests named *average*, *averager*, *post_localSGD*"),
    "hooks": Suite("DDP communication hooks", ("test/distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py",),
                   r"hook", lift_nccl=True,
                   selected="distributed_test's tests named *hook* that call torch's default or PowerSGD hooks"),
}

# The course's names for torch's keyword arguments, where they differ (a shim renames them, and says so)
ALIASES = {"optimizer_class": "optimizer_cls", "process_group": "group"}
# Failures of the machinery, not of a test: such a test is run once more
FLAKY = re.compile(r"connectFullMesh|Connection closed by peer|Connection reset by peer|Address already in use")


# ---------------------------------------------------------------- in every process of a suite's run

def prepare(suite_name: str, side: str, tests_dir: str, gpu_tests: str, start: str, namespace: dict) -> None:
    """Fill ``namespace`` (a generated module's) with a suite's test classes, torch's or the course's
    classes in them. Runs in pytest's process and again in every rank's."""
    suite = SUITES[suite_name]
    import torch.testing._internal.common_distributed as cd  # noqa: F401 (before the tests bind its names)

    if gpu_tests == "cpu":
        _gpu_tests_on_cpu(suite.lift_nccl)
    if start == "fork":
        _fork_ranks()
    for path in suite.files:
        source = saved_file(Path(tests_dir), path)
        exec(compile(source.read_text(), str(source), "exec"), namespace)
    if suite.select:
        _distributed_test_class(suite.select, suite_name, namespace)
    if gpu_tests == "cpu" and "gpus_for_rank" in namespace:  # test_ddp_hooks.py: one "GPU" per rank
        namespace["gpus_for_rank"] = lambda world_size: [[rank] for rank in range(world_size)]
    if side == "course":
        _swap(suite_name, namespace)


def _lifted(decorator, needed=lambda *args, **kwargs: True):
    """``decorator`` (one of torch's skips, or a factory of them) made a no-op where ``needed``."""
    @functools.wraps(decorator)
    def factory(*args, **kwargs):
        if args and callable(args[0]) and not kwargs:  # used bare: @skip_if_no_gpu
            return args[0]
        return (lambda f: f) if needed(*args, **kwargs) else decorator(*args, **kwargs)
    return factory


def _gpu_tests_on_cpu(lift_nccl: bool) -> None:
    """Run tests written for one GPU per rank on the CPU: lift the skips for want of GPUs (up to
    WORLD_SIZE of them), turn CUDA devices into the CPU, and let DDP take a CPU module whatever its
    ``device_ids``. Torch's module attributes are changed, before the tests import them."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.common_distributed as cd
    from torch.overrides import TorchFunctionMode

    if getattr(cd, "_course_on_cpu", False):
        return
    cd._course_on_cpu = True
    cd.skip_if_no_gpu = _lifted(cd.skip_if_no_gpu)
    cd.skip_if_lt_x_gpu = _lifted(cd.skip_if_lt_x_gpu, lambda x, **kwargs: x <= WORLD_SIZE)
    if lift_nccl:
        cd.requires_accelerator_dist_backend = _lifted(cd.requires_accelerator_dist_backend)
    cd.init_multigpu_helper = lambda world_size, backend: {rank: [rank] for rank in range(world_size)}

    def on_gpu(device) -> bool:
        return (isinstance(device, int) and not isinstance(device, bool)) or \
            (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda")

    class CudaIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if on_gpu(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func in (torch.Tensor.to, torch._C._nn._parse_to):  # Tensor.to(0), Module.to(0)
                args = tuple("cpu" if on_gpu(a) else a for a in args)
            return func(*args, **kwargs)

    CudaIsCpu().__enter__()  # for the rest of this process
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.cuda.set_device = lambda device: None
    new_group = dist.new_group

    @functools.wraps(new_group)
    def gloo_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return new_group(*args, **kwargs)

    dist.new_group = gloo_group
    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def cpu_ddp_init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        ddp_init(self, module, None, None, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel.__init__ = cpu_ddp_init


def _fork_ranks() -> None:
    """Start ranks with fork instead of spawn: they inherit this process's modules (torch's, the test
    module, the course's classes in it), so start in a fraction of the time."""
    import torch.multiprocessing
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    MultiProcessTestCase._spawn_processes = lambda self: self._start_processes(
        torch.multiprocessing.get_context("fork").Process)


def _distributed_test_class(select: str, suite_name: str, namespace: dict) -> None:
    """distributed_test's test class, as torch's test_distributed_spawn.py builds it, keeping the
    tests whose names match ``select`` (the hooks suite: those that call torch's default or
    PowerSGD hooks)."""
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawnGLOO(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    def wanted(name: str) -> bool:
        if not re.search(select, name, re.IGNORECASE):
            return False
        return suite_name != "hooks" or re.search(
            r"\b(default|powerSGD)\.", inspect.getsource(getattr(TestDistBackendWithSpawnGLOO, name))) is not None

    # spawned ranks find the class by its module and name, as they find any test class
    TestDistBackendWithSpawnGLOO.__module__ = namespace["__name__"]
    TestDistBackendWithSpawnGLOO.__qualname__ = TestDistBackendWithSpawnGLOO.__name__
    # the tests to run (pytest_collection_modifyitems deselects the others)
    TestDistBackendWithSpawnGLOO.selected = {name for name in dir(TestDistBackendWithSpawnGLOO)
                                             if name.startswith("test_") and wanted(name)}
    namespace["TestDistBackendWithSpawnGLOO"] = TestDistBackendWithSpawnGLOO


# What takes the place of what: torch's object, the course's (as "module:name")
_HOOKS, _AVERAGING = "torch.distributed.algorithms.ddp_comm_hooks.", "torch.distributed.algorithms.model_averaging."
PAIRS = {
    "zero": [("torch.distributed.optim:ZeroRedundancyOptimizer", "course_lib.sharding:ShardedOptimizer")],
    "averaging": [(_AVERAGING + "utils:average_parameters", "course_lib.local_sgd:average_parameters"),
                  (_AVERAGING + "averagers:PeriodicModelAverager", "course_lib.local_sgd:PeriodicModelAverager"),
                  (_HOOKS + "post_localSGD_hook:PostLocalSGDState", "course_lib.local_sgd:PostLocalSGDState"),
                  (_HOOKS + "post_localSGD_hook:post_localSGD_hook", "course_lib.local_sgd:post_localSGD_hook"),
                  ("torch.distributed.optim.post_localSGD_optimizer:PostLocalSGDOptimizer",
                   "course_lib.local_sgd:PostLocalSGDOptimizer")],
    "hooks": [(_HOOKS + f"powerSGD_hook:{name}", f"course_lib.powersgd:{name}")
              for name in ("PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook")]
    + [(_HOOKS + f"default_hooks:{name}", f"course_lib.hooks:{name}")
       for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper",
                    "bf16_compress_wrapper")]
    + [(_HOOKS + "debugging_hooks:noop_hook", "course_lib.hooks:noop_hook")],
}


def _lookup(name: str):
    module, _, attr = name.partition(":")
    module = importlib.import_module(module)
    return module, getattr(module, attr, None)


def adapted(torch_object, course_object):
    """``course_object`` itself, or where it names one of torch's keyword arguments otherwise
    (ALIASES), a thin shim that renames it; and the renames, for the output."""
    theirs = inspect.signature(torch_object).parameters
    ours = inspect.signature(course_object).parameters
    renames = {t: c for t, c in ALIASES.items() if t in theirs and t not in ours and c in ours}
    if not renames:
        return course_object, {}

    def renamed(kwargs):
        return {renames.get(k, k): v for k, v in kwargs.items()}

    if isinstance(course_object, type):
        shim = type(course_object.__name__, (course_object,), {"__init__": lambda self, *args, **kwargs:
                                                               course_object.__init__(self, *args, **renamed(kwargs))})
    else:
        shim = functools.wraps(course_object)(lambda *args, **kwargs: course_object(*args, **renamed(kwargs)))
    return shim, renames


def swaps(suite_name: str):
    """(torch's module, torch's object, the course's object or its shim, the shim's renames, names) for each
    pair of the suite whose course side exists."""
    out = []
    for torch_name, course_name in PAIRS[suite_name]:
        module, theirs = _lookup(torch_name)
        _, ours = _lookup(course_name)
        if ours is not None:
            out.append((module, theirs, *adapted(theirs, ours), torch_name, course_name))
    return out


def _swap(suite_name: str, namespace: dict) -> None:
    """Rebind torch's objects to the course's: names bound to them in the test file's namespace and in
    distributed_test's, and torch's modules that distributed_test holds (by a copy of each, with the
    course's objects in it)."""
    pairs = swaps(suite_name)
    spaces = [namespace]
    if SUITES[suite_name].select:
        from torch.testing._internal.distributed import distributed_test
        spaces.append(vars(distributed_test))
    for space in spaces:
        for key, value in list(space.items()):
            for _, theirs, ours, *_ in pairs:
                if value is theirs:
                    space[key] = ours
            held = {torch_name.partition(":")[2]: ours
                    for module, _, ours, _, torch_name, _ in pairs if value is module}
            if held:
                space[key] = _overlay(value, held)
    if suite_name == "hooks" and "register_ddp_comm_hook" in namespace:
        namespace["register_ddp_comm_hook"] = _course_register_ddp_comm_hook


def _overlay(module: types.ModuleType, names: dict) -> types.ModuleType:
    """A copy of ``module`` with ``names`` (the course's) in place of torch's."""
    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(vars(module))
    copy.__dict__.update(names)
    return copy


# torch's DDPCommHookType members whose hook takes the process group as its state, and the course's
# hook for each (the others, PowerSGD's among them, stay torch's: test_ddp_hooks.py uses these alone)
COURSE_HOOKS = {"ALLREDUCE": "course_lib.hooks:allreduce_hook", "FP16_COMPRESS": "course_lib.hooks:fp16_compress_hook",
                "NOOP": "course_lib.hooks:noop_hook"}


def _course_register_ddp_comm_hook(comm_hook_type, model, state=None):
    """torch's register_ddp_comm_hook registers torch's hook for each DDPCommHookType; this, the
    course's where it has one (a shim: test_ddp_hooks.py names hooks by that enum alone)."""
    from torch.distributed.algorithms.ddp_comm_hooks import register_ddp_comm_hook
    hook = _lookup(COURSE_HOOKS[comm_hook_type.name])[1] if comm_hook_type.name in COURSE_HOOKS else None
    if hook is None:
        return register_ddp_comm_hook(comm_hook_type, model, state)
    model.register_comm_hook(state, hook)


# ---------------------------------------------------------------- pytest plugin (-p torch_tests)

def pytest_collection_modifyitems(config, items) -> None:
    """Keep, of distributed_test's class, the tests the suite selected."""
    keep = [item for item in items if item.name in getattr(item.cls, "selected", {item.name})]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_runtest_logreport(report) -> None:
    """Write each test's outcome, as it comes, to the file named by TORCH_TESTS_RESULTS: a run stopped
    at its time limit keeps what it had."""
    path = os.environ.get("TORCH_TESTS_RESULTS")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    if report.outcome == "skipped":
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        why = why.removeprefix("Skipped: ")
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        why = one_line(crash.message if crash is not None else report.longreprtext)
        if report.when != "call":
            why = f"(in {report.when}) {why}"
    else:
        why = ""
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid.split("::", 1)[1].replace("::", "."),
                            "outcome": report.outcome, "why": why, "seconds": round(report.duration, 1)}) + "\n")


def one_line(message: str) -> str:
    """The exception's last line: of the rank's traceback where a rank failed (torch's harness puts it
    inside its own message), with the largest difference where tensors were compared."""
    inner = re.search(r"exited with error code -?\d+ and exception:\n(.*?)(?:\n\nTo execute this test|\Z)",
                      message, re.S)
    lines = (inner.group(1) if inner else message).strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1:] if frames else lines
    exception = next((line for line in after if line and not line.startswith(" ")), lines[0] if lines else "")
    if exception.startswith("Timing out after"):
        exception = "RuntimeError: " + exception
    exception = re.sub(r"^(RuntimeError: Got the following error when running the callback: )+",
                       "(in a future's callback) ", exception)
    difference = next((line.strip() for line in lines if line.strip().startswith("Greatest absolute")), "")
    text = f"{exception} ({difference})" if difference else exception
    return text if len(text) <= 240 else text[:237] + "..."


# ---------------------------------------------------------------- the script

def saved_file(folder: Path, path: str) -> Path:
    """A torch test file saved in ``folder``, by its name alone or under its path in the repository."""
    for candidate in (folder / Path(path).name, folder / path):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(path)


def torch_tag() -> str:
    import torch
    return "v" + re.match(r"\d+\.\d+\.\d+", torch.__version__).group(0)


def missing_files(folder: Path | None, suites) -> list[str]:
    missing = []
    for name in suites:
        for path in SUITES[name].files:
            try:
                if folder is None:
                    raise FileNotFoundError(path)
                saved_file(folder, path)
            except FileNotFoundError:
                missing.append(path)
    return missing


def run_side(suite_name: str, side: str, args, work: Path, only: list[str] | None = None) -> list[dict]:
    """One pytest run of a suite, torch's side or the course's, in its own process; its results."""
    module = f"{suite_name}_{side}"
    (work / f"{module}.py").write_text(
        f"# Generated by benchmarks/torch_tests.py: the {suite_name} suite with {side}'s classes\n"
        f"import torch_tests\n\n"
        f"torch_tests.prepare({suite_name!r}, {side!r}, {str(args.tests)!r}, {args.gpu_tests!r}, "
        f"{args.start!r}, globals())\n")
    results = work / f"{module}{'_again' if only else ''}.jsonl"
    temp = work / f"{module}_temp"
    (temp / "barrier").mkdir(parents=True, exist_ok=True)  # as torch's test_distributed_spawn.py asks
    path = [str(HERE), str(work), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "TORCH_TESTS_RESULTS": str(results), "BACKEND": "gloo", "WORLD_SIZE": str(WORLD_SIZE),
           "TEMP_DIR": str(temp), "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
           "PYTORCH_PRINT_REPRO_ON_FAILURE": "0", "OMP_NUM_THREADS": "1"}
    targets = [f"{module}.py::{t.replace('.', '::')}" for t in only] if only else [f"{module}.py"]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "torch_tests", "-q",
               "--rootdir", str(work), "-o", "addopts=", "-W", "ignore::DeprecationWarning", *targets]
    with open(work / f"{module}.log", "a") as log:
        process = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout=args.suite_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest and the ranks it started
            process.wait()
    outcomes = {}
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            if outcomes.get(r["test"], {}).get("outcome") != "failed":  # a failure in teardown stays
                outcomes[r["test"]] = r
    if process.returncode not in (0, 1) and not outcomes:
        outcomes["(pytest)"] = {"test": "(pytest)", "outcome": "failed", "seconds": 0,
                                "why": f"pytest exited with {process.returncode}: see {work / module}.log"}
    return list(outcomes.values())


def run_suite(suite_name: str, args, work: Path) -> dict[str, list[dict]]:
    sides = {}
    for side in ("torch", "course"):
        start = time.perf_counter()
        results = run_side(suite_name, side, args, work)
        again = [r["test"] for r in results if r["outcome"] == "failed" and FLAKY.search(r["why"])]
        if again:  # a rank lost its connection: once more, on its own
            retried = {r["test"]: r for r in run_side(suite_name, side, args, work, only=again)}
            for r in results:
                if r["test"] in retried:
                    r.update(retried[r["test"]], retried=True)
        sides[side] = results
        sides[side + "_s"] = time.perf_counter() - start
    return sides


def report(suite_name: str, sides: dict) -> None:
    suite = SUITES[suite_name]
    sources = [Path(f).name for f in suite.files] + ([suite.selected] if suite.selected else [])
    print(f"\n=== {suite.title}: {' + '.join(sources)}")
    for _, _, _, renames, torch_name, course_name in swaps(suite_name):
        shim = "; shim: " + ", ".join(f"{t}= passed as {c}=" for t, c in renames.items()) if renames else ""
        print(f"    {torch_name.replace(':', '.')} -> {course_name.replace(':', '.')}{shim}")
    if suite_name == "hooks":
        print("    shim: test_ddp_hooks.py registers hooks by torch's DDPCommHookType; the course's hook is "
              "registered where it has one (" + ", ".join(COURSE_HOOKS) + "), torch's otherwise")
    print(f"    {'classes':10s} {'tests':>6s} {'passed':>7s} {'failed':>7s} {'skipped':>8s} {'seconds':>8s}")
    for side in ("torch", "course"):
        counts = Counter(r["outcome"] for r in sides[side])
        print(f"    {side:10s} {len(sides[side]):6d} {counts['passed']:7d} {counts['failed']:7d} "
              f"{counts['skipped']:8d} {sides[side + '_s']:8.0f}")
    torch_outcome = {r["test"]: r["outcome"] for r in sides["torch"]}
    for side in ("course", "torch"):
        failed = sorted((r for r in sides[side] if r["outcome"] == "failed"), key=lambda r: r["test"])
        if failed:
            print(f"  failing with {side}'s classes:")
        for r in failed:
            notes = ["torch's fails too"] if side == "course" and torch_outcome.get(r["test"]) == "failed" else []
            notes += ["failed twice"] if r.get("retried") else []
            print(f"    {r['test']}: {r['why']}{' [' + '; '.join(notes) + ']' if notes else ''}")
        retried = [r["test"] for r in sides[side] if r.get("retried") and r["outcome"] != "failed"]
        if retried:
            print(f"  passed at a second try with {side}'s (a rank lost its connection): {', '.join(retried)}")
    skips = Counter(r["why"] for r in sides["course"] if r["outcome"] == "skipped")
    if skips:
        print("  skipped with the course's classes (and torch's, unless counted otherwise above):")
        for why, n in skips.most_common():
            print(f"    {n:3d} x {why}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="the folder where torch's test files were saved (the script "
                        "prints their addresses when they are missing)")
    parser.add_argument("--suite", choices=sorted(SUITES), action="append",
                        help="run only this suite (may be given more than once)")
    parser.add_argument("--gpu-tests", choices=("cpu", "torch"),
                        help="tests written for GPUs: run them on the CPU (the default with fewer than 2 GPUs), "
                             "or as torch does (on the GPUs; skipped without them)")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="how ranks start: fork (the default, faster), or spawn, as torch's harness does")
    parser.add_argument("--timeout", type=int, default=120, help="seconds a test may run (torch's harness)")
    parser.add_argument("--suite-timeout", type=int, default=1800, help="seconds one side of a suite may run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, generated modules)")
    args = parser.parse_args()
    suites = args.suite or list(SUITES)

    if importlib.util.find_spec("expecttest") is None:
        print("torch.testing._internal needs the package expecttest: pip install expecttest", file=sys.stderr)
        sys.exit(2)
    missing = missing_files(args.tests, suites)
    if missing:
        tag = torch_tag()
        print(f"torch's test files are not in the torch wheel. Save these (for torch {tag}) in one folder "
              f"and pass it as --tests:", file=sys.stderr)
        for path in missing:
            print(f"  https://raw.githubusercontent.com/pytorch/pytorch/{tag}/{path}", file=sys.stderr)
        sys.exit(2)
    if args.tests is not None:
        args.tests = args.tests.resolve()

    import torch
    gpus = torch.cuda.device_count()
    args.gpu_tests = args.gpu_tests or ("cpu" if gpus < WORLD_SIZE else "torch")
    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs, {gpus} GPUs; tests written for GPUs: "
          f"{'run on the CPU' if args.gpu_tests == 'cpu' else 'as torch runs them'}; ranks start by "
          f"{args.start}; {args.timeout} s per test")
    work = Path(tempfile.mkdtemp(prefix="torch_tests_"))
    try:
        for name in suites:
            sides = run_suite(name, args, work)
            report(name, sides)
    finally:
        if args.keep:
            print(f"\nlogs and generated modules: {work}")
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)


if __name__ == "__main__":
    main()
