"""common/ has no import circle, and works whichever of its modules is imported first.

The circle this guards against: ``runtime`` installed the simulator's checks at
its end, ``internal.simulator`` imported ``checking`` (for ``CheckError``),
``checking`` imported ``runtime``, and ``simulator`` reached ``racecheck`` (which
imported ``checking``) through imports inside functions. It worked only in the
order ``common/__init__`` happened to use. Now the errors live in
``common/errors.py``, which imports nothing of the course, and ``common`` installs
the simulator's checks once, after every import.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import errors
from common.internal import racecheck, simulator
from common.internal.exercises import REPO_ROOT

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = REPO_ROOT / "common"
ERRORS = ("CheckError", "RaceError", "BarrierError", "LaunchConfigError")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _course_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(COMMON.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(course module imported, inside a function?) for every import in ``path``.

    ``from . import x`` names the submodule ``x`` when there is one, else the
    package itself (a name taken from a package's ``__init__``). A package that
    is only the parent of an imported module is not counted: Python has it in
    ``sys.modules`` before any of its modules runs.
    """
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append((alias.name, in_function))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.append((target, in_function))
                elif base in modules:
                    found.append((base, in_function))
        inside = in_function or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _graph(with_function_level: bool) -> dict[str, set[str]]:
    modules = _course_modules()
    return {
        name: {
            target
            for target, in_function in _imports(path, modules)
            if target != name and (with_function_level or not in_function)
        }
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


@pytest.mark.parametrize("with_function_level", [False, True], ids=["module-level", "all"])
def test_common_imports_form_no_circle(with_function_level):
    # Fails on the old code with common.runtime -> common.internal.simulator ->
    # common.checking -> common.runtime (and, counting imports inside functions,
    # simulator -> racecheck -> checking -> runtime -> simulator).
    graph = _graph(with_function_level)
    assert "common.runtime" in graph and graph["common"]  # the walk found the package
    circle = _cycle(graph)
    assert circle is None, "import circle in common/: " + " -> ".join(circle)


def test_errors_module_imports_only_the_standard_library():
    tree = ast.parse((COMMON / "errors.py").read_text())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if not (isinstance(node, ast.ImportFrom) and node.level)
    }
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, "common/errors.py must not import the course"
    top = {name.split(".")[0] for name in imported}
    assert top <= set(sys.stdlib_module_names), f"not stdlib: {top - sys.stdlib_module_names}"


def test_each_error_is_defined_once_in_common_errors():
    # One class each: the other modules re-export it, so `except common.CheckError`
    # catches what common.checking raises, and RaceError is a CheckError.
    defined = {
        name: [
            path.relative_to(REPO_ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.name in ERRORS
        ]
        for name, path in _course_modules().items()
    }
    where = {m: found for m, found in defined.items() if found}
    assert where == {"common.errors": ["common/errors.py"] * len(ERRORS)}, where
    from common import checking

    for name in ERRORS:
        assert getattr(common, name) is getattr(errors, name)
    assert checking.CheckError is errors.CheckError
    assert racecheck.RaceError is errors.RaceError
    assert simulator.BarrierError is errors.BarrierError
    assert simulator.LaunchConfigError is errors.LaunchConfigError
    assert issubclass(errors.RaceError, errors.CheckError)
    assert issubclass(errors.BarrierError, errors.CheckError)


_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
import common

def patched(module, cls, flag):
    mod = sys.modules.get(module)
    return bool(mod and getattr(getattr(mod, cls), flag, False))

print(json.dumps({
    "runtime": common.runtime_name(),
    "simulator_checks": patched("numba.cuda.simulator.kernel", "FakeCUDAKernel", "_course_checks"),
    "race_detector": patched(
        "numba.cuda.simulator.cudadrv.devicearray", "FakeWithinKernelCUDAArray", "_course_racecheck"
    ),
}))
"""


# The modules of the old circle and the one that breaks it, each imported first;
# and once with numba's GPU target, where the simulator's checks must stay out of
# numba (the imports are the same in both runtimes, only the install differs).
@pytest.mark.parametrize(
    "module,cudasim",
    [
        ("common.errors", "1"),
        ("common.runtime", "1"),
        ("common.checking", "1"),
        ("common.internal.racecheck", "1"),
        ("common.internal.simulator", "1"),
        ("common.internal.simulator", "0"),
    ],
)
def test_any_common_module_imports_first_in_a_fresh_interpreter(module, cudasim):
    # NUMBA_ENABLE_CUDASIM=0 loads numba's GPU target even without a GPU: nothing
    # is launched, so the import works here.
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": cudasim}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout.strip().splitlines()[-1])
    simulated = cudasim == "1"
    assert state == {
        "runtime": "simulator" if simulated else "gpu",
        "simulator_checks": simulated,
        "race_detector": simulated,
    }
