"""The package's shape: what depends on what is visible at the top of each module, no circles,
and the package docstring is a map of every module."""

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
    assert {"course_lib.launch", "course_lib.powersgd", "course_lib.support.exercises"} <= names
    assert len(names) >= 16 and "course_lib.support" in names


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
               "import course_lib.train, course_lib.support.hook_runs, course_lib.support.progress\n"
               "from course_lib.support.progress import progress_bar\n"
               "bar = progress_bar(total=2)\nbar.update(2)\nbar.close()\nprint('imported')\n")
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]
