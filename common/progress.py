"""Which of your exercises pass: ``python -m common.progress [CHAPTER ...]``

Runs the exercise tests against your ``exercises.py`` files only (the tests'
"learner" half; the "solution" half is for the course's own CI) and prints,
chapter by chapter, each exercise as ``pass``, ``FAIL`` or ``not attempted``.
CHAPTER is a number (``5``, ``05``) or a folder name (``05_first_kernels``);
without one, every chapter is checked.

For the failure details of one exercise, run the test it names, e.g.
``pytest tests/test_ch05_first_kernels.py -k "scaled_add and learner"``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections import defaultdict

import pytest

from . import runtime  # noqa: F401  (picks GPU or simulator before numba loads)
from .exercises import CHAPTERS_DIR, LEARNER_ID, NOT_ATTEMPTED, REPO_ROOT, Implementation


class _Collector:
    """pytest plugin: the outcome of every test run against a learner's exercises."""

    def __init__(self) -> None:
        # chapter -> exercise -> list of outcomes over its parametrisations
        self.outcomes: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        self.chapter_of: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        keep = []
        for item in items:
            callspec = getattr(item, "callspec", None)
            impls = [v for v in (callspec.params.values() if callspec else [])
                     if isinstance(v, Implementation) and v.which == "exercises"]
            if impls:
                self.chapter_of[item.nodeid] = impls[0].chapter
                keep.append(item)
        items[:] = keep

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        chapter = self.chapter_of.get(report.nodeid)
        if chapter is None:
            return
        name = report.nodeid.split("::")[-1].split("[")[0].removeprefix("test_")
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
                if NOT_ATTEMPTED in reason:
                    outcome = "not attempted"
                elif "GPU" in reason:
                    outcome = "needs a GPU"
                else:
                    outcome = "skipped"
            else:
                outcome = "pass" if report.passed else "FAIL"
            self.outcomes[chapter][name].append(outcome)


def _summarise(results: list[str]) -> str:
    if "FAIL" in results:
        return "FAIL"
    if all(r == "pass" for r in results):
        return "pass"
    if all(r == "not attempted" for r in results):
        return "not attempted"
    if "pass" in results:
        return "pass"
    return results[0]


def _test_files(selected: list[str]) -> list[str]:
    tests = REPO_ROOT / "tests"
    if not selected:
        return [str(tests)]
    files = []
    for sel in selected:
        num = sel.split("_")[0]
        if not num.isdigit():
            raise SystemExit(f"unknown chapter {sel!r}: give its number, e.g. 5 or 05_first_kernels")
        found = sorted(tests.glob(f"test_ch{int(num):02d}_*.py"))
        if not found:
            have = ", ".join(sorted(p.name for p in CHAPTERS_DIR.iterdir() if p.is_dir()))
            raise SystemExit(f"no exercise tests for chapter {sel!r}; chapters: {have}")
        files += [str(p) for p in found]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter numbers or folder names (default: all)")
    args = parser.parse_args(argv)
    collector = _Collector()
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        pytest.main(
            [*_test_files(args.chapters), "-q", "--tb=no", "-p", "no:cacheprovider",
             "-k", LEARNER_ID, "-p", "no:xdist"],
            plugins=[collector],
        )
    if not collector.outcomes:
        print("no exercise tests found")
        return 1
    counts: dict[str, int] = defaultdict(int)
    for chapter in sorted(collector.outcomes):
        print(chapter)
        for name, results in collector.outcomes[chapter].items():
            status = _summarise(results)
            counts[status] += 1
            print(f"  {status:<14} {name}")
    total = sum(counts.values())
    print(f"\n{counts['pass']} of {total} exercises pass, {counts['FAIL']} fail, "
          f"{counts['not attempted']} not attempted yet")
    if counts["FAIL"]:
        print('details: pytest tests/test_chNN_<topic>.py -k "<exercise> and learner"')
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
