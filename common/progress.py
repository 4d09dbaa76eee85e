"""Which of your exercises pass: ``python -m common.progress [CHAPTER ...]``

Runs the exercise checks against your ``exercises.py`` files only (the tests'
"learner" half; the "solution" half is for the course's own CI) and prints,
chapter by chapter, each exercise by its number and name, as the chapter README
lists them: ``pass``, ``FAIL`` (with the symptom and the exact command that
shows the details), ``not attempted`` (with the line of the
``raise NotImplementedError`` still in the way) or ``pending`` (written, but
checked together with an exercise that is not done yet). An exercise passes
only when every check that runs it passes. A chapter whose ``exercises.py``
does not load gets the file, line and error; the other chapters are checked
as usual. CHAPTER is a number (``5``, ``05``) or a folder name
(``05_first_kernels``); without one, every chapter is checked.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import re
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from . import runtime  # noqa: F401  (first: picks GPU or simulator before numba loads)
from .internal import exercises
from .internal.exercises import (
    LEARNER_ID,
    Implementation,
    Use,
    exercise_numbers,
    number_key,
    pending_raise,
    record_uses,
)

TESTS_DIR = exercises.REPO_ROOT / "tests"

# Labels, in the order a learner should act on them.
LOAD_ERROR, FAIL, NOT_ATTEMPTED, PENDING, SKIPPED, NEEDS_GPU, PASS = (
    "not checked",
    "FAIL",
    "not attempted",
    "pending",
    "skipped",
    "needs a GPU",
    "pass",
)
_PRIORITY = [LOAD_ERROR, FAIL, NOT_ATTEMPTED, PENDING, SKIPPED, PASS, NEEDS_GPU]


@dataclass
class TestRun:
    """One learner test: what it touched and how it ended."""

    nodeid: str
    chapter: str
    names: set[str]  # impl.<name> in the test's own source
    uses: list[Use] = field(default_factory=list)
    outcome: str = ""  # pass, FAIL, skipped, needs a GPU
    message: str = ""  # the failure's or skip's one-line reason
    seed: int | None = None


def _names_in_source(function: object, argname: str) -> set[str]:
    """Every ``<argname>.<name>`` in a test function's source (empty if unreadable)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == argname
    }


def _one_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        text = crash.message
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = str(report.longrepr[-1])
    else:
        text = str(report.longrepr or "")
    text = text.removeprefix("Skipped: ").removeprefix("Failed: ")
    # "common.checking.CheckError: ..." -> "CheckError: ..."
    return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", text)


class _Collector:
    """pytest plugin: every learner test, the exercise functions it used, its outcome."""

    def __init__(self) -> None:
        self.runs: dict[str, TestRun] = {}
        self.collect_errors: list[str] = []
        self._uses: list[Use] | None = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            last = str(report.longrepr).strip().splitlines()
            self.collect_errors.append(f"{report.nodeid}: {last[-1] if last else 'error'}")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        keep = []
        for item in items:
            callspec = getattr(item, "callspec", None)
            params = callspec.params.items() if callspec else []
            impls = [
                (arg, v)
                for arg, v in params
                if isinstance(v, Implementation) and v.which == "exercises"
            ]
            if impls:
                arg, impl = impls[0]
                names = _names_in_source(getattr(item, "function", None), arg)
                self.runs[item.nodeid] = TestRun(item.nodeid, impl.chapter, names)
                keep.append(item)
        items[:] = keep

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        with record_uses() as uses:
            self._uses = uses
            try:
                return (yield)
            finally:
                self._uses = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        run = self.runs.get(report.nodeid)
        if run is None:
            return
        if self._uses is not None:
            run.uses = self._uses
        for key, value in report.user_properties:
            if key == "seed":
                run.seed = int(value)
        if report.passed:
            if report.when == "call":
                run.outcome = PASS
            return
        if run.outcome in (FAIL, SKIPPED, NEEDS_GPU):
            return  # the first failure or skip is the one that matters
        if report.skipped:
            reason = _one_line(report)
            run.outcome = NEEDS_GPU if "GPU" in reason else SKIPPED
        else:
            run.outcome = FAIL
        run.message = _one_line(report)


def _short(hint: str, chapter: str) -> str:
    """``chapters/05_first_kernels/exercises.py:36 ...`` -> ``exercises.py:36 ...``."""
    return re.sub(rf"\S*chapters/{re.escape(chapter)}/(?=exercises\.py)", "", hint)


def _command(run: TestRun) -> str:
    seed = f" --seed {run.seed}" if run.seed is not None else ""
    return f'python -m pytest "{run.nodeid}"{seed}'


@dataclass
class Exercise:
    number: str
    name: str
    verdicts: list[tuple[str, str]] = field(default_factory=list)  # (label, note)

    def label(self) -> str:
        found = {label for label, _ in self.verdicts}
        if not found:
            return "no check"
        if found == {PASS, NEEDS_GPU}:
            return PASS
        return next(label for label in _PRIORITY if label in found)

    def notes(self) -> list[str]:
        label = self.label()
        notes = list(dict.fromkeys(note for lab, note in self.verdicts if lab == label and note))
        if label == PASS and any(lab == NEEDS_GPU for lab, _ in self.verdicts):
            notes.append("its GPU-only check did not run here")
        return notes


def _judge(run: TestRun, exercises_of: dict[str, Exercise]) -> None:
    """Give each exercise the test touched a verdict from this one test."""
    number = {name: ex.number for name, ex in exercises_of.items()}
    called = {u.name for u in run.uses if u.event == "call"}
    path = exercises.CHAPTERS_DIR / run.chapter / "exercises.py"

    def unchecked(name: str, why: str) -> tuple[str, str]:
        # Not called before the test stopped: unwritten if a raise is still in it.
        hint = None if name in called else pending_raise(path, name)
        return (NOT_ATTEMPTED, hint) if hint else (PENDING, why)

    touched = {u.name for u in run.uses if u.event == "access"} | run.names
    touched = {name for name in touched if name in number}
    if not touched:  # a check that names no numbered exercise: list it by its test
        test = run.nodeid.split("::")[-1].split("[")[0].removeprefix("test_")
        exercises_of.setdefault(test, Exercise("", test))
        touched = {test}
        number[test] = test
    verdict: dict[str, tuple[str, str]] = {}
    load_errors = [u.detail for u in run.uses if u.event == "load error"]
    if load_errors:
        verdict = {name: (LOAD_ERROR, load_errors[0]) for name in touched}
    elif run.outcome == FAIL:
        errors = [u.name for u in run.uses if u.event == "error" and u.name in touched]
        calls = [u.name for u in run.uses if u.event == "call" and u.name in touched]
        # The exercise that raised, or else the last one called before the check failed.
        culprit = errors[-1] if errors else (calls[-1] if calls else None)
        note = f"{run.message}\ndetails: {_command(run)}"
        for name in touched:
            if culprit is None or name == culprit:
                verdict[name] = (FAIL, note)
            else:
                verdict[name] = unchecked(
                    name, f"checked together with {number[culprit]}, which fails"
                )
    elif run.outcome == SKIPPED and any(u.event == "not attempted" for u in run.uses):
        missing = [u for u in run.uses if u.event == "not attempted" and u.name in touched]
        for use in missing:
            verdict[use.name] = (NOT_ATTEMPTED, use.detail)
        for name in touched - {u.name for u in missing}:
            waits = ", ".join(sorted({number[u.name] for u in missing}, key=number_key))
            verdict[name] = unchecked(name, f"checked together with {waits}, not attempted yet")
    elif run.outcome in (PASS, NEEDS_GPU):
        verdict = {name: (run.outcome, "") for name in touched}
    else:
        verdict = {name: (SKIPPED, run.message) for name in touched}
    for name, (label, note) in verdict.items():
        exercises_of[name].verdicts.append((label, note))


def report(runs: list[TestRun], out=None) -> dict[str, int]:
    """Print each chapter's exercises and their state; return the count of each label."""
    out = out or sys.stdout
    counts: dict[str, int] = defaultdict(int)
    by_chapter: dict[str, list[TestRun]] = defaultdict(list)
    for run in runs:
        by_chapter[run.chapter].append(run)
    for chapter in sorted(by_chapter):
        numbers = exercise_numbers(chapter)
        exercises_of = {name: Exercise(num, name) for name, num in numbers.items()}
        for run in by_chapter[chapter]:
            _judge(run, exercises_of)
        print(chapter, file=out)
        listed = sorted(exercises_of.values(), key=lambda e: (number_key(e.number), e.name))
        load_errors = {note for ex in listed for lab, note in ex.verdicts if lab == LOAD_ERROR}
        for note in sorted(load_errors):
            print(textwrap.indent(note, "  "), file=out)
            print(
                "  fix this first: none of this chapter's exercises can be checked "
                "until exercises.py loads",
                file=out,
            )
        for ex in listed:
            label = ex.label()
            counts[label] += 1
            if label == LOAD_ERROR:
                print(f"  {label:<14} {ex.number} {ex.name}".rstrip(), file=out)
                continue
            notes = [_short(n, chapter) for n in ex.notes()]
            title = f"{ex.number} {ex.name}".strip()
            if label in (NOT_ATTEMPTED, PENDING) and len(notes) == 1:
                print(f"  {label:<14} {title}: {notes[0]}", file=out)
                continue
            print(f"  {label:<14} {title}", file=out)
            for note in notes:
                print(textwrap.indent(note, " " * 17), file=out)
    return counts


def _test_files(selected: list[str]) -> list[str]:
    if not selected:
        return sorted(str(p) for p in TESTS_DIR.glob("test_ch[0-9][0-9]_*.py"))
    files = []
    for sel in selected:
        num = sel.split("_")[0]
        if not num.isdigit():
            raise SystemExit(
                f"unknown chapter {sel!r}: give its number, e.g. 5 or 05_first_kernels"
            )
        found = sorted(TESTS_DIR.glob(f"test_ch{int(num):02d}_*.py"))
        if not found:
            have = ", ".join(sorted(p.name for p in exercises.CHAPTERS_DIR.iterdir() if p.is_dir()))
            raise SystemExit(f"no exercise tests for chapter {sel!r}; chapters: {have}")
        files += [str(p) for p in found]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "chapters", nargs="*", help="chapter numbers or folder names (default: all)"
    )
    args = parser.parse_args(argv)
    collector = _Collector()
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        pytest.main(
            [
                *_test_files(args.chapters),
                "-q",
                "--tb=no",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:xdist",
                # (its full garbage collection at the end costs a second in a big
                # process, such as the test suite's, and it reports nothing here)
                "-p",
                "no:unraisableexception",
                "-k",
                LEARNER_ID,
                "--continue-on-collection-errors",
            ],
            plugins=[collector],
        )
    for error in collector.collect_errors:
        print(f"could not load the checks in {error}")
    if not collector.runs:
        print("no exercise tests found")
        return 1
    counts = report(list(collector.runs.values()))
    total = sum(counts.values())
    parts = [
        f"{counts[FAIL]} fail" if counts[FAIL] != 1 else "1 fails",
        f"{counts[NOT_ATTEMPTED]} not attempted yet",
    ]
    for label in (PENDING, LOAD_ERROR, SKIPPED, NEEDS_GPU):
        if counts[label]:
            parts.append(f"{counts[label]} {label}")
    print(f"\n{counts[PASS]} of {total} exercises pass, " + ", ".join(parts))
    if counts[FAIL]:
        print(
            "run the command under a failing exercise for its details; "
            "--seed replays the same random inputs"
        )
    failed = counts[FAIL] or counts[LOAD_ERROR] or collector.collect_errors
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
