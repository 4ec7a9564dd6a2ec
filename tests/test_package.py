"""The package's shape: what depends on what is visible at the top of each module, no circles, no
import from a lower floor to a higher one, and the package docstring is a map of every module."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import course_lib

ROOT = Path(course_lib.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="course_lib."):
        path = ROOT.joinpath(*info.name.split(".")[1:])
        path = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        out[info.name] = ast.parse(path.read_text())
    return out


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        # `from course_lib import hooks` imports the module course_lib.hooks
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def test_the_map_is_walked():
    names = set(_modules())
    assert {"course_lib.launch", "course_lib.powersgd", "course_lib.notebooks.exercises.nb05"} <= names
    assert len(names) >= 16 and {"course_lib.utils", "course_lib.notebooks"} <= names


def test_no_import_inside_a_function():
    found = []
    for name, tree in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{name}.{fn.name}: {m}" for node in ast.walk(fn) for m in _imported(node)]
    assert found == []


def test_no_two_modules_import_each_other():
    modules = _modules()
    graph = {name: {m for node in ast.walk(tree) for m in _imported(node) if m in modules and m != name}
             for name, tree in modules.items()}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    circles = [name for name in graph if reaches(name, name)]
    assert circles == []
    assert "course_lib.costmodel" in graph["course_lib.bandwidth"]  # the walk sees real edges


def _floor(module: str) -> int:
    """0: the utilities at the ground (course_lib.utils); 1: the algorithms; 2: what the notebooks use."""
    parts = module.split(".")
    return 0 if parts[1:2] == ["utils"] else 2 if parts[1:2] == ["notebooks"] else 1


def _upward(modules: dict[str, ast.Module]) -> list[str]:
    """Every import of a course_lib module from a lower floor than its own, as "importer -> imported"."""
    return [f"{name} -> {m}" for name, tree in modules.items() for node in ast.walk(tree) for m in _imported(node)
            if m in modules and _floor(m) > _floor(name)]


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    modules = _modules()
    assert _upward(modules) == []
    # the check sees a planted one, whichever floor it runs up from
    planted = dict(modules)
    planted["course_lib.utils.checks"] = ast.parse("from course_lib import collectives")
    planted["course_lib.sharding"] = ast.parse("from course_lib.notebooks.widgets import memory_calculator")
    assert sorted(_upward(planted)) == ["course_lib.sharding -> course_lib.notebooks.widgets",
                                        "course_lib.utils.checks -> course_lib.collectives"]
    # and the floors are populated: utilities below, algorithms that use them, notebooks' material on top
    assert {_floor(name) for name in modules} == {0, 1, 2}


def test_the_package_docstring_names_every_module():
    doc = course_lib.__doc__
    missing = [name for name in _modules() if name != "course_lib" and f"``{name.split('.', 1)[1]}``" not in doc]
    assert missing == []


def test_the_training_script_needs_no_jupyter():
    # torchrun -m course_lib.train on a GPU machine without Jupyter (as benchmarks/gpu_check.py ran):
    # importing the package's training side must not need IPython or ipywidgets
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in ('IPython', 'ipywidgets', 'ipykernel'):\n"
               "            raise ImportError('no ' + name + ' here')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import course_lib.train, course_lib.notebooks.hook_runs, course_lib.utils.progress\n"
               "from course_lib.utils.progress import progress_bar\n"
               "bar = progress_bar(total=2)\nbar.update(2)\nbar.close()\nprint('imported')\n")
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]
