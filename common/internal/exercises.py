"""Loading chapter code, and running exercise checks on both the solution and yours.

Chapter folders are named ``NN_topic`` (``05_first_kernels``), which is not a
valid Python identifier, and scripts run as ``python chapters/NN_topic/x.py``.
So chapter files are loaded by path, under a unique module name
(``chapters.05_first_kernels.x``), never by ``import``:

    >>> va = load_chapter_module("05_first_kernels", "vector_add")

A chapter file that needs a sibling does ``sibling = import_sibling(__file__, "name")``.

Every exercise is a plain Python function in ``exercises.py`` that raises
``NotImplementedError`` until the learner writes it; ``solutions.py`` holds the
same functions, written. Tests check both through :func:`implementations`:

    @pytest.mark.parametrize("impl", implementations("05_first_kernels"))
    def test_scaled_add(impl):
        check_scaled_add(impl.scaled_add)

``impl.scaled_add`` raising ``NotImplementedError`` from ``exercises.py`` turns
into a pytest skip ("not attempted yet", with the line of the ``raise``), so a
fresh clone passes and a learner sees which of their own exercises pass. The
module is loaded at the first use, not at collection: an ``exercises.py`` that
does not load (a syntax error) fails its own chapter's learner tests with the
file, line and error, and every other test still runs.

Each exercise is numbered in its docstring ("Exercise 5.1: ..."), as in the
chapter README; :func:`exercise_numbers` reads those numbers, and
:func:`record_uses` tells ``python -m common.progress`` which exercise
functions a test called and how each call ended.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAPTERS_DIR = REPO_ROOT / "chapters"
NOT_ATTEMPTED = "not attempted yet"
LEARNER_ID = "learner"
SOLUTION_ID = "solution"


def chapter_dir(chapter: str) -> Path:
    """Path of ``chapters/<chapter>``; raises FileNotFoundError naming the ones that exist."""
    path = CHAPTERS_DIR / chapter
    if not path.is_dir():
        have = sorted(p.name for p in CHAPTERS_DIR.iterdir() if p.is_dir())
        raise FileNotFoundError(f"no chapter {chapter!r}; chapters are: {', '.join(have)}")
    return path


def _load_path(path: Path, module_name: str) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_chapter_module(chapter: str, name: str) -> ModuleType:
    """Load ``chapters/<chapter>/<name>.py`` as module ``chapters.<chapter>.<name>``."""
    return _load_path(chapter_dir(chapter) / f"{name}.py", f"chapters.{chapter}.{name}")


def import_sibling(file: str, name: str) -> ModuleType:
    """From a chapter file, load another file of the same chapter: ``import_sibling(__file__, "x")``."""
    here = Path(file).resolve().parent
    return _load_path(here / f"{name}.py", f"chapters.{here.name}.{name}")


def _relative(path: Path) -> str:
    """``path`` as the learner types it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _same_file(a: str | Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def describe_load_error(path: Path, exc: BaseException) -> str:
    """``"chapters/05_first_kernels/exercises.py:40: SyntaxError: ..."`` and the line itself.

    For a module that failed to load: the line of ``path`` at fault (the
    syntax error, or the statement that raised while the module ran).
    """
    rel = _relative(path)
    if isinstance(exc, SyntaxError) and exc.filename and _same_file(exc.filename, path):
        where, text = f"{rel}:{exc.lineno}", exc.text
        message = f"{type(exc).__name__}: {exc.msg}"
    else:
        frames = [
            f for f in traceback.extract_tb(exc.__traceback__) if _same_file(f.filename, path)
        ]
        where = f"{rel}:{frames[-1].lineno}" if frames else rel
        text = frames[-1].line if frames else None
        message = f"{type(exc).__name__}: {exc}"
    out = f"{where}: {message}"
    if text and text.strip():
        out += f"\n    {text.strip()}"
    return out


def _enclosing_function(path: Path, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and (best is None or node.lineno > best.lineno)
        ):
            best = node
    return best


def _raise_hint(path: Path, line: int) -> str:
    where = f"{_relative(path)}:{line}"
    fn = _enclosing_function(path, line)
    body = list(fn.body) if fn is not None else []
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0].value, "value", None), str)
    ):
        body = body[1:]  # the docstring
    # Code above the raise is the learner's; code below it can be the stub's own
    # template (a launch line to complete), so only code above means "written".
    written = [s for s in body if not isinstance(s, ast.Pass) and (s.end_lineno or s.lineno) < line]
    if written:
        return (
            f"{where} still raises NotImplementedError: delete that line once your code is written"
        )
    return f"{where} raises NotImplementedError: replace that line with your code"


def pending_raise(path: Path, name: str) -> str | None:
    """The hint of :func:`not_attempted_hint` for top-level function ``name`` of
    ``path`` if its body still holds a ``raise NotImplementedError``, else None.

    For an exercise a test did not get to call: read, not run.
    """
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            for sub in ast.walk(node):
                exc = getattr(sub, "exc", None)
                target = exc.func if isinstance(exc, ast.Call) else exc
                if (
                    isinstance(sub, ast.Raise)
                    and isinstance(target, ast.Name)
                    and target.id == "NotImplementedError"
                ):
                    return _raise_hint(path, sub.lineno)
    return None


def not_attempted_hint(path: Path, exc: NotImplementedError) -> str | None:
    """Where ``path`` raised ``exc`` and what to do about it; None if it was raised elsewhere.

    A ``NotImplementedError`` from inside Numba or a library is a real error,
    not an unwritten exercise, so only a ``raise`` in ``path`` itself counts.
    When the function around that ``raise`` holds other code (the learner's,
    or the launch the stub keeps below the ``raise``), the way forward is to
    delete the line; when it holds nothing else, to replace it.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not _same_file(frames[-1].filename, path):
        return None
    return _raise_hint(path, frames[-1].lineno or 0)


# ---------------------------------------------------------------- which exercise is which

_NUMBER = re.compile(r"\bExercise (\d+\.\d+[a-z]?)\b")
_TOP_DEF = re.compile(r"(?:async\s+)?def\s+(\w+)\s*\(")


def exercise_numbers(chapter: str) -> dict[str, str]:
    """``{function name: exercise number}`` for a chapter, e.g. ``{"scaled_add": "5.1"}``.

    The number is the first ``Exercise N.M`` (``3.1a``, ``6.10``) inside a
    top-level function of ``solutions.py`` (the course's copy, which learners
    do not edit) or, for the functions it does not number, of ``exercises.py``:
    its docstring or its ``raise NotImplementedError("Exercise N.M: ...")``.
    The files are read as text, so one with a syntax error still gives its
    numbers. Missing files give no numbers.
    """
    numbers: dict[str, str] = {}
    for which in ("exercises", "solutions"):  # solutions last: its numbers win
        path = CHAPTERS_DIR / chapter / f"{which}.py"
        try:
            text = path.read_text()
        except OSError:
            continue
        found: dict[str, str] = {}
        current = None
        for line in text.splitlines():
            if line and not line[0].isspace():
                match = _TOP_DEF.match(line)
                # A decorator belongs to the def below it, and a ")" closes the
                # argument list of a def split over lines; any other top-level
                # line (a comment, an assignment) ends the function above.
                keep = line.startswith(("@", ")"))
                current = match.group(1) if match else (current if keep else None)
                continue
            number = _NUMBER.search(line)
            if current and number and current not in found:
                found[current] = number.group(1)
        numbers.update(found)
    return numbers


def number_key(number: str) -> tuple[int, int, str]:
    """Sort key: ``6.2`` before ``6.10``, ``3.1a`` before ``3.1b``."""
    match = re.fullmatch(r"(\d+)\.(\d+)([a-z]*)", number)
    if match is None:
        return (10**9, 10**9, number)
    return (int(match.group(1)), int(match.group(2)), match.group(3))


# ---------------------------------------------------------------- running exercises


@dataclass
class Use:
    """One use of an exercise function during a test, as :func:`record_uses` sees it.

    ``event`` is one of: ``"access"`` (the test took ``impl.name``), ``"call"``,
    ``"return"``, ``"error"`` (the call raised; ``detail`` is the exception),
    ``"not attempted"`` (it raised ``NotImplementedError`` from ``exercises.py``;
    ``detail`` says on which line and what to do) and ``"load error"`` (the
    module did not load; ``detail`` names the file, line and error).
    """

    chapter: str
    which: str
    name: str
    event: str
    detail: str = ""


_recording: list[Use] | None = None


@contextlib.contextmanager
def record_uses() -> Iterator[list[Use]]:
    """Collect, in order, every :class:`Use` of an :class:`Implementation` in the block."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


class Implementation:
    """One set of exercise answers: a chapter's ``solutions`` or ``exercises`` module.

    Attribute access returns the module's function wrapped so that a
    ``NotImplementedError`` raised in the module becomes
    ``pytest.skip("not attempted yet: <file>:<line> ...")``. The module is
    loaded at the first attribute access; if it does not load, the test fails
    with the file, line and error (``pytest.fail``), and only that test.

    Raises:
        FileNotFoundError: at construction, if the chapter does not exist.
    """

    def __init__(self, chapter: str, which: str) -> None:
        self.chapter = chapter
        self.which = which
        self.path = chapter_dir(chapter) / f"{which}.py"
        self._module: ModuleType | None = None
        self._load_error: str | None = None

    def _use(self, name: str, event: str, detail: str = "") -> None:
        if _recording is not None:
            _recording.append(Use(self.chapter, self.which, name, event, detail))

    @property
    def module(self) -> ModuleType:
        """The loaded module; fails the running test if it does not load."""
        __tracebackhide__ = True
        if self._module is None and self._load_error is None:
            try:
                self._module = load_chapter_module(self.chapter, self.which)
            except Exception as exc:  # a learner's file can raise anything while it loads
                self._load_error = describe_load_error(self.path, exc)
        if self._module is None:
            import pytest

            self._use("", "load error", self._load_error or "")
            pytest.fail(
                f"{self._load_error}\n{_relative(self.path)} does not load, so none of "
                "its functions can be checked; fix the line above first",
                pytrace=False,
            )
        return self._module

    def __getattr__(self, name: str) -> Callable[..., Any]:
        __tracebackhide__ = True
        if name.startswith("__") or name in ("chapter", "which", "path", "_module", "_load_error"):
            raise AttributeError(name)  # copy/pickle probes, or __init__ not run
        self._use(name, "access")
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            self._use(name, "call")
            try:
                result = fn(*args, **kwargs)
            except NotImplementedError as exc:
                hint = not_attempted_hint(self.path, exc)
                if hint is None:
                    self._use(name, "error", f"NotImplementedError: {exc}")
                    raise
                self._use(name, "not attempted", hint)
                import pytest

                pytest.skip(f"{self.chapter}.{name}: {NOT_ATTEMPTED}: {hint}")
            except Exception as exc:
                self._use(name, "error", f"{type(exc).__name__}: {exc}")
                raise
            self._use(name, "return")
            return result

        return wrapper

    def __repr__(self) -> str:
        return f"<{self.which} of {self.chapter}>"


def implementations(chapter: str) -> list[Any]:
    """pytest params: the chapter's ``solutions`` (id "solution") and ``exercises`` (id "learner").

    Neither file is loaded here (see :class:`Implementation`): collecting the
    tests never runs a learner's code.
    """
    import pytest

    return [
        pytest.param(Implementation(chapter, "solutions"), id=SOLUTION_ID),
        pytest.param(Implementation(chapter, "exercises"), id=LEARNER_ID),
    ]
