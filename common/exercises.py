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

``impl.scaled_add`` raising ``NotImplementedError`` turns into a pytest skip
("not attempted yet"), so a fresh clone passes and a learner sees which of
their own exercises pass.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
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


class Implementation:
    """One set of exercise answers: a chapter's ``solutions`` or ``exercises`` module.

    Attribute access returns the module's function wrapped so that
    ``NotImplementedError`` becomes ``pytest.skip("not attempted yet")``.
    """

    def __init__(self, chapter: str, which: str) -> None:
        self.chapter = chapter
        self.which = which
        self.module = load_chapter_module(chapter, which)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except NotImplementedError:
                import pytest

                pytest.skip(f"{self.chapter}.{name}: {NOT_ATTEMPTED}")

        return wrapper

    def __repr__(self) -> str:
        return f"<{self.which} of {self.chapter}>"


def implementations(chapter: str) -> list[Any]:
    """pytest params: the chapter's ``solutions`` (id "solution") and ``exercises`` (id "learner")."""
    import pytest

    return [
        pytest.param(Implementation(chapter, "solutions"), id=SOLUTION_ID),
        pytest.param(Implementation(chapter, "exercises"), id=LEARNER_ID),
    ]
