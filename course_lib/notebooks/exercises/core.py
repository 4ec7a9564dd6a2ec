"""What every notebook's exercise checks share: :func:`check` runs the student's function and the
reference on the same inputs and prints the first case that differs; :func:`check_distributed` runs
both in real gloo processes and holds them to :class:`Rules` (only send and recv, one collective, log2 p
messages); ``_run_student`` starts a student's worker and reports a crash; ``_refusing`` makes a
function the exercise forbids raise :class:`NotAllowed`."""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import pickle
import sys
import threading
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib import (
    collectives,
)
from course_lib.launch import WorkerError, _check_picklable_by_reference, spawn


def compare(expected, got, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """``None`` when ``got`` matches ``expected`` (tensors, numbers, sequences, dicts); else why not."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
            diff = (got - expected).abs().max().item()
            return f"values differ (largest difference {diff:.3g})"
        return None
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, (int, float)):
            return f"expected a number, got {type(got).__name__}"
        if math.isnan(expected) and math.isnan(got):
            return None  # both say "never"
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            shown = f"{expected:.6g}", f"{got:.6g}"
            if shown[0] == shown[1]:  # they differ beyond 6 digits: show every digit
                shown = repr(expected), repr(got)
            return f"expected {shown[0]}, got {shown[1]}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"expected a sequence of {len(expected)} items, got {_short(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = compare(e, g, rtol, atol)
            if why:
                return f"item {i}: {why}"
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"expected keys {sorted(expected)}, got {_short(got)}"
        for k in expected:
            why = compare(expected[k], got[k], rtol, atol)
            if why:
                return f"key {k!r}: {why}"
        return None
    if got != expected:
        return f"expected {_short(expected)}, got {_short(got)}"
    return None


def _short(x, limit: int = 80) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(args) -> str:
    return "(" + ", ".join(_short(a, 40) for a in args) + ")"


class NotAllowed(RuntimeError):
    """A student's function called what its exercise does not allow."""


def _codes(functions) -> dict:
    """``{code object: its name}`` of each function, and of each method of each class, in ``functions``."""
    codes = {}
    for f in functions:
        members = [m for m in vars(f).values()] if inspect.isclass(f) else [f]
        for m in members:
            m = getattr(m, "__func__", m)  # a staticmethod or classmethod: the function inside
            code = getattr(m, "__code__", None)
            if code is not None:
                codes[code] = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
    return codes


class refused_calls:
    """Inside ``with refused_calls(functions, who, why):``, a call of any of ``functions`` (functions, or
    classes: every method), however it was reached (imported by another name, a copy of the module,
    a bound method), raises :class:`NotAllowed`: the course's own answer to an exercise is refused by
    the check that asks for it. It watches Python calls through ``sys.setprofile`` (this thread only)
    and compares code objects, so only these functions are refused, and what they would call is not.
    A callback chained with ``Future.then`` while the watch is on runs later on another thread (a
    communication hook's, on gloo's): it is watched there too.
    """

    def __init__(self, functions, who: str, why: str):
        self.codes, self.who, self.why = _codes(functions), who, why

    def _watch(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            raise NotAllowed(f"{self.who} may not call {self.codes[frame.f_code]}: {self.why}")

    def _again(self) -> refused_calls:  # the same watch, for another thread (each keeps its own profile)
        again = object.__new__(refused_calls)
        again.codes, again.who, again.why = self.codes, self.who, self.why
        return again

    def __enter__(self):
        self._before = sys.getprofile()
        if self.codes:
            sys.setprofile(self._watch)
            _watch_then(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._before)
        if self.codes:
            _unwatch_then(self)
        return False


# Future.then, while a refused_calls is on (on any thread): the callback is run inside the same watch.
# torch's futures are one pybind class whose `then` is looked up on the class, so it is replaced there
# and put back when the last watch ends.
_THEN = {"watches": [], "original": None}
_THEN_LOCK = threading.Lock()


def _watch_then(watch: refused_calls) -> None:
    with _THEN_LOCK:
        if not _THEN["watches"]:
            original = _THEN["original"] = torch._C.Future.then

            def then(future, callback):
                with _THEN_LOCK:
                    current = _THEN["watches"][-1] if _THEN["watches"] else None
                if current is None:
                    return original(future, callback)

                def watched(done):
                    with current._again():
                        return callback(done)
                return original(future, watched)

            torch._C.Future.then = then
        _THEN["watches"].append(watch)


def _unwatch_then(watch: refused_calls) -> None:
    with _THEN_LOCK:
        _THEN["watches"].remove(watch)
        if not _THEN["watches"]:
            torch._C.Future.then = _THEN["original"]


_COURSE_ANSWER = "it computes this exercise's answer; write it yourself (the check compares yours with it)"


def resolve(names) -> list:
    """The functions or classes named ``"module:qualname"`` (a form that pickles, for a worker to resolve)."""
    found = []
    for name in names:
        module, _, qualname = name.partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        found.append(obj)
    return found


def check(student, reference, cases, *, name: str | None = None, rtol: float = 1e-5,
          atol: float = 1e-6, refuse=()) -> bool:
    """Run ``student(*args)`` and ``reference(*args)`` for each ``args`` in ``cases``; print a verdict.

    When both return ``None`` (functions that work in place), the arguments they modified are
    compared instead. Returns ``True`` when every case passes. While ``student`` runs, calling
    ``reference`` or any of ``refuse`` (the course's functions that compute the answer: functions or
    classes) raises :class:`NotAllowed` (see :class:`refused_calls`): the check fails.
    """
    name = name or _name(student, "your_function")
    _name(student, name)
    cases = list(cases)
    for i, args in enumerate(cases):
        if not isinstance(args, tuple):
            args = (args,)
        mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
        expected = reference(*theirs)
        try:
            with refused_calls((reference, *refuse), name, _COURSE_ANSWER):
                got = student(*mine)
        except NotImplementedError:
            print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, then run this again.")
            return False
        except NotAllowed as e:
            print(f"[FAIL] {name}, case {i} {_describe(args)}: {e}")
            return False
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"[FAIL] {name}, case {i} {_describe(args)}: raised {type(e).__name__}: {e} "
                  f"(line {where.lineno})")
            return False
        if expected is None and got is None:
            expected, got = theirs, mine
        why = compare(expected, got, rtol, atol)
        if why:
            print(f"[FAIL] {name}, case {i} {_describe(args)}: {why}")
            return False
    print(f"[PASS] {name}: all {len(cases)} cases match the reference.")
    return True


@dataclass(frozen=True)
class Rules:
    """What a distributed exercise allows besides the right answer, checked in the worker.

    ``point_to_point_only``: every collective is refused the moment it is called (barrier, which
    moves no data, excepted); ``collectives``: how many collectives each rank must call;
    ``sends``: world size -> how many messages each rank must send; ``sent_below_input``: each rank
    must send fewer numbers than its input holds (a reduce-scatter that never sends the whole
    tensor); ``sent_numbers``: a top-level function ``(input_numbers, rank, world_size) -> int``, how
    many numbers each rank must send in all; ``refused``: functions refused the moment they are
    called, by the name a student calls (``"dist.all_reduce"``, also caught when imported by name, as
    it ends in ``ProcessGroup.allreduce``; ``"collectives.ring_all_reduce"``, any function of
    ``course_lib.collectives``); ``refused_functions``: the course's functions (or classes) that compute
    the answer, as ``"module:qualname"``, refused however the student reaches them (see
    :class:`refused_calls`; the reference is always refused); ``contributed_at_most``: a top-level
    function ``(input_numbers, rank, world_size) -> int``, the most numbers each rank may hand to
    collectives in all (what it all-gathers, all-reduces, broadcasts from itself). ``why`` ends the
    message when a count is off or a function refused.
    """

    point_to_point_only: bool = False
    collectives: int | None = None
    sends: dict | None = None
    sent_below_input: bool = False
    sent_numbers: object = None
    refused: tuple = ()
    refused_functions: tuple = ()
    contributed_at_most: object = None
    why: str = ""

    def broken(self, used: dict, world_size: int) -> str | None:
        """Why ``used`` (what one rank called) breaks these rules, or ``None``."""
        if self.collectives is not None and len(used["collectives"]) != self.collectives:
            called = ", ".join(used["collectives"]) or "none"
            return f"called {len(used['collectives'])} collectives ({called}); {self.why}"
        if self.sends is not None and used["sends"] != self.sends[world_size]:
            return f"sent {used['sends']} messages; {self.why}"
        if self.sent_below_input and used["numbers_sent"] >= used["input_numbers"]:
            return f"sent {used['numbers_sent']} numbers of a {used['input_numbers']}-number input; {self.why}"
        if self.sent_numbers is not None:
            want = self.sent_numbers(used["input_numbers"], used["rank"], world_size)
            if used["numbers_sent"] != want:
                return f"sent {used['numbers_sent']} numbers, not {want}; {self.why}"
        if self.contributed_at_most is not None:
            most = self.contributed_at_most(used["input_numbers"], used["rank"], world_size)
            if used["contributed"] > most:
                return f"handed {used['contributed']} numbers to collectives, more than {most}; {self.why}"
        return None


POINT_TO_POINT = "dist.send, dist.recv, dist.isend and dist.irecv (or dist.batch_isend_irecv)"
# torch.distributed's collectives by the names a student calls, and the ProcessGroup methods they end
# in: watching the methods too catches `from torch.distributed import all_reduce`, imported before
# the watch began. barrier moves no data and is not watched.
_COLLECTIVE_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "_all_gather_base", "gather",
    "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single",
)
# the ProcessGroup methods whose name is not the function's (for a refusal by the function's name)
_FUNCTION_OF_METHOD = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
                       "allgather": "all_gather", "allgather_coalesced": "all_gather_coalesced",
                       "_allgather_base": "_all_gather_base", "alltoall": "all_to_all"}
_GROUP_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single", "all_gather_single_coalesced",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single",
)
_MISSING = object()


class _Watch:
    """Around a student's call, in the worker: counts the collectives called and the messages sent,
    and refuses collectives at once under ``point_to_point_only``. Everything is put back on exit,
    so the reference (run before) and the process group's teardown (after) use torch as it is."""

    def __init__(self, rules: Rules, name: str):
        self.rules, self.name = rules, name
        self.collectives: list[str] = []
        self.sends = 0
        self.numbers_sent = 0
        self.contributed = 0  # numbers handed to collectives (see _contributed)
        self._depth = 0  # > 0 inside a watched function: what it calls in turn is not counted again
        self._saved: list = []

    def _refuse(self, what: str):
        raise NotAllowed(f"{self.name} may use only {POINT_TO_POINT}; it called {what}")

    def _refuse_named(self, what: str, called: str | None = None):
        if what in self.rules.refused:
            raise NotAllowed(f"{self.name} may not call {called or what}: {self.rules.why}")

    def _refusing(self, what: str):
        def refused(*args, **kwargs):
            self._refuse_named(what)
        return refused

    def _replace(self, owner, attr: str, new) -> None:
        self._saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, new)

    def _function(self, name: str, original):
        def watched(*args, **kwargs):
            if self._depth == 0:
                self.contributed += _contributed(name, args, kwargs)
            if self.rules.point_to_point_only:
                self._refuse(f"dist.{name}")
            self._refuse_named(f"dist.{name}")
            if self._depth == 0:
                self.collectives.append(name)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return watched

    def _method(self, name: str, original):
        def watched(group, *args, **kwargs):
            if self._depth == 0:  # called directly, or through a name imported before the watch
                if name == "send":  # dist.send and dist.isend both end here
                    self.sends += 1
                    tensors = args[0] if args else kwargs.get("tensors", [])
                    self.numbers_sent += sum(t.numel() for t in ([tensors] if torch.is_tensor(tensors) else tensors))
                else:
                    if self.rules.point_to_point_only:
                        self._refuse(f"a collective (ProcessGroup.{name})")
                    function = f"dist.{_FUNCTION_OF_METHOD.get(name, name)}"
                    # reached without dist.<function> (imported before the watch): count its input here
                    if name in ("allgather", "_allgather_base", "allgather_coalesced", "all_gather_single", "gather"):
                        self.contributed += _numel(args[1] if len(args) > 1 else None)
                    elif name in ("allreduce", "reduce", "allreduce_coalesced"):
                        self.contributed += _numel(args[0] if args else None)
                    self._refuse_named(function, f"{function} (ProcessGroup.{name})")
                    self.collectives.append(name)
            return original(group, *args, **kwargs)
        return watched

    def __enter__(self):
        for name in _COLLECTIVE_FUNCTIONS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            watched = self._function(name, original)
            self._replace(c10d, name, watched)  # what torch's own functions call by name
            if getattr(dist, name, None) is original:
                self._replace(dist, name, watched)  # what a student calls as dist.all_reduce
        for name in _GROUP_COLLECTIVES + ("send",):
            if hasattr(dist.ProcessGroup, name):
                self._replace(dist.ProcessGroup, name, self._method(name, getattr(dist.ProcessGroup, name)))
        for what in self.rules.refused:
            module, _, attr = what.partition(".")
            if module == "collectives":
                self._replace(collectives, attr, self._refusing(what))
            elif module != "dist":
                raise ValueError(f"Rules.refused names dist.* and collectives.* functions, got {what!r}")
        return self

    def __exit__(self, *exc):
        for owner, attr, saved in reversed(self._saved):
            if saved is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, saved)
        self._saved.clear()
        return False

    def used(self) -> dict:
        return {"collectives": list(self.collectives), "sends": self.sends, "numbers_sent": self.numbers_sent,
                "contributed": self.contributed}


def _numel(x) -> int:
    if torch.is_tensor(x):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(item) for item in x)
    return 0


def _contributed(name: str, args, kwargs) -> int:
    """How many numbers a call of ``dist.<name>`` hands over from this rank: the input of an all-gather
    or gather, the tensor of an all-reduce or reduce, a broadcast's tensor on its source; an object
    (``all_gather_object``) counts its pickled bytes / 4. Other collectives count nothing here."""
    if name in ("all_gather", "all_gather_into_tensor", "_all_gather_base", "gather", "all_gather_coalesced"):
        return _numel(args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor")))
    if name in ("all_reduce", "reduce", "all_reduce_coalesced"):
        return _numel(args[0] if args else kwargs.get("tensor", kwargs.get("tensors")))
    if name == "broadcast":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return _numel(args[0] if args else kwargs.get("tensor")) if src == dist.get_rank() else 0
    if name in ("all_gather_object", "gather_object"):
        obj = args[1] if len(args) > 1 else kwargs.get("obj")
        return len(pickle.dumps(obj)) // 4
    return 0


def _input_numbers(args) -> int:
    """How many numbers the tensor arguments hold: each tensor argument, and each tensor in a list or
    tuple argument (a unit's gradients); other arguments count nothing."""
    total = 0
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            total += t.numel() if torch.is_tensor(t) else 0
    return total


def _run_both(rank, world_size, student, reference, make_inputs, rules=None, name="your function"):
    args = make_inputs(rank, world_size)
    expected = reference(*copy.deepcopy(args))
    rules = rules or Rules()
    with _Watch(rules, name) as watch, \
            refused_calls([reference, *resolve(rules.refused_functions)], name, _COURSE_ANSWER):
        got = student(*copy.deepcopy(args))
    used = watch.used() | {"input_numbers": _input_numbers(args), "rank": rank}
    return args, expected, got, used


def check_distributed(student, reference, make_inputs, world_sizes=(2, 3), *, name: str | None = None,
                      timeout_s: float = 20.0, rtol: float = 1e-5, atol: float = 1e-6,
                      rules: Rules | None = None) -> bool:
    """Like :func:`check`, for functions that communicate: both run in real gloo processes.

    ``student`` and ``reference`` are top-level functions of importable modules (a student's lives
    in a ``.py`` file written from the notebook); ``make_inputs(rank, world_size)`` returns each
    rank's arguments. The reference runs first, then the student's function, on copies; ``rules``
    (see :class:`Rules`) says what the student's may call.
    """
    name = name or _name(student, "your_function")
    _name(student, name, in_processes=True)
    for world_size in world_sizes:
        try:
            results = spawn(_run_both, world_size, student, reference, make_inputs, rules, name,
                            backend="gloo", timeout_s=timeout_s)
        except WorkerError as e:
            if e.exc_type == "NotImplementedError":
                print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, "
                      f"save the file, then run this again.")
            elif e.exc_type == "NotAllowed":
                print(f"[FAIL] {name}, world size {world_size}, rank {e.rank}: {e.message}")
            else:
                print(f"[FAIL] {name}, world size {world_size}: rank {e.rank} raised {e.exc_type}: {e.message}")
            return False
        except TimeoutError:
            print(f"[FAIL] {name}, world size {world_size}: no answer after {timeout_s:g} s. A deadlock? "
                  f"Check that every send is matched by a receive that the peer can reach.")
            return False
        for rank, (args, expected, got, used) in enumerate(results):
            why = compare(expected, got, rtol, atol) or (rules.broken(used, world_size) if rules else None)
            if why:
                print(f"[FAIL] {name}, world size {world_size}, rank {rank}, input {_describe(args)}: {why}")
                return False
    print(f"[PASS] {name}: matches the reference on world sizes {', '.join(map(str, world_sizes))}.")
    return True


def _name(student_fn, default: str, in_processes: bool = False) -> str:
    """The student's function's name, once it is known to be a function (and, for a check that runs
    it in new processes, one they can import by name)."""
    if not callable(student_fn):
        raise TypeError(f"pass your function itself ({default}, not {default}(...), which is what it returns); "
                        f"got {_short(student_fn)}")
    if in_processes:
        _check_picklable_by_reference(student_fn, who="this check, which runs your function in new processes,")
    return getattr(student_fn, "__name__", default)


def _run_student(worker, world_size: int, student_fn, name: str, timeout_s: float = 60) -> list | None:
    """``spawn(worker, world_size, student_fn)`` on gloo; the results, or ``None`` after printing why not
    (not written yet, a rank that raised, or no answer: a deadlock)."""
    try:
        return spawn(worker, world_size, student_fn, backend="gloo", timeout_s=timeout_s)
    except WorkerError as e:
        if e.exc_type == "NotImplementedError":
            print(f"[not yet] {name}: replace the `raise NotImplementedError` with your code, save the file, "
                  f"then run this again.")
        elif e.exc_type == "NotAllowed":
            print(f"[FAIL] {name}, world size {world_size}, rank {e.rank}: {e.message}")
        else:
            print(f"[FAIL] {name}, world size {world_size}: rank {e.rank} raised {e.exc_type}: {e.message}")
    except TimeoutError:
        print(f"[FAIL] {name}, world size {world_size}: no answer after {timeout_s:g} s. A deadlock? Every rank "
              f"must call the same collectives in the same order.")
    return None


try:
    import scipy.linalg as _scipy_linalg
except ImportError:  # scipy is optional: nothing of it to refuse then
    _scipy_linalg = None

_WHERE = {torch.linalg: "torch.linalg", torch: "torch", torch.Tensor: "Tensor", np.linalg: "numpy.linalg",
          _scipy_linalg: "scipy.linalg"}


def _refusing(student_fn, refused, why, allowed=lambda *args, **kwargs: False):
    """``student_fn`` with each ``(owner, attr)`` of ``refused`` replaced while it runs by a function
    that raises NotAllowed (``why`` ends the message) unless ``allowed(*args, **kwargs)``; every
    original is put back afterwards, even after a refusal."""
    def run(*args):
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr in refused]

        def refuse(name, original):
            def refused_fn(*a, **kw):
                if allowed(*a, **kw):
                    return original(*a, **kw)
                raise NotAllowed(f"{name} {why}")
            return refused_fn

        for owner, attr, original in saved:
            setattr(owner, attr, refuse(f"{_WHERE.get(owner, getattr(owner, '__name__', owner))}.{attr}", original))
        try:
            return student_fn(*args)
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)
    return run
