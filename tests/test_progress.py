"""Tests of ``python -m common.progress`` and of how exercises are loaded and run.

Every test here builds a small course of its own under tmp_path (a chapter or
two of plain-Python exercises, their solutions and their tests) and points the
loaders at it, so nothing depends on the state of the learner's own files.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import progress
from common.internal import exercises
from common.internal.exercises import REPO_ROOT, Implementation

import re
import subprocess
import sys
import textwrap

import pytest

STUBS = '''\
def add_one(x):
    """Exercise 98.1: x + 1, for an int x; TypeError for anything else."""
    raise NotImplementedError("Exercise 98.1: add_one")


def double(x):
    """Exercise 98.2: 2 x."""
    raise NotImplementedError("Exercise 98.2: double")


def triple(x):
    """Exercise 98.3: 3 x."""
    raise NotImplementedError("Exercise 98.3: triple")
'''

SOLUTIONS = '''\
def add_one(x):
    """Exercise 98.1: x + 1, for an int x; TypeError for anything else."""
    if not isinstance(x, int):
        raise TypeError("x must be an int")
    return x + 1


def double(x):
    """Exercise 98.2: 2 x."""
    return 2 * x


def triple(x):
    """Exercise 98.3: 3 x."""
    return 3 * x
'''

# Two checks for 98.1 (one named after no exercise), one check for 98.2 and 98.3 together.
TESTS = """\
import pytest

from common.internal.exercises import implementations

CHAPTER = "{chapter}"


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_add_one(impl):
    assert impl.add_one(1) == 2


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_refuses_strings(impl):
    with pytest.raises(TypeError):
        impl.add_one("1")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_pair(impl):
    assert impl.double(3) == 6
    assert impl.triple(3) == 9
"""


@pytest.fixture
def course(tmp_path, monkeypatch):
    """``make(chapter, exercises_text)``: a fake chapter and its tests under tmp_path."""
    chapters, tests = tmp_path / "chapters", tmp_path / "tests"
    tests.mkdir()
    monkeypatch.setattr(exercises, "CHAPTERS_DIR", chapters)
    monkeypatch.setattr(progress, "TESTS_DIR", tests)
    monkeypatch.setattr(sys, "path", list(sys.path))  # pytest.main prepends test folders
    made = []

    def make(chapter, text=STUBS):
        folder = chapters / chapter
        folder.mkdir(parents=True, exist_ok=True)
        number = f"Exercise {int(chapter[:2])}."  # each chapter numbers its own exercises
        (folder / "exercises.py").write_text(textwrap.dedent(text).replace("Exercise 98.", number))
        (folder / "solutions.py").write_text(SOLUTIONS.replace("Exercise 98.", number))
        (tests / f"test_ch{chapter[:2]}_demo.py").write_text(TESTS.format(chapter=chapter))
        made.append(chapter)
        return folder

    yield make
    for name in list(sys.modules):  # the next fake course reuses these names
        if name.startswith("test_ch") or any(name.startswith(f"chapters.{c}.") for c in made):
            del sys.modules[name]


def _progress(capsys, *chapters):
    rc = progress.main(list(chapters))
    return rc, capsys.readouterr().out


def _line(out, number):
    lines = [
        line for line in out.splitlines() if re.match(rf"\s+\S.*?\s{re.escape(number)} ", line)
    ]
    assert len(lines) == 1, f"exercise {number} listed {len(lines)} times in:\n{out}"
    return lines[0]


def test_lists_exercises_by_number_and_name(course, capsys):
    course("98_demo")
    rc, out = _progress(capsys, "98")
    assert rc == 0, out
    assert re.search(
        r"not attempted\s+98\.1 add_one: exercises\.py:3 raises NotImplementedError: "
        r"replace that line with your code",
        out,
    ), out
    assert "98.2 double" in _line(out, "98.2") and "98.3 triple" in _line(out, "98.3")
    # Test names are not exercises: three exercises, whatever the number of tests.
    assert "refuses_strings" not in out and " pair" not in out
    assert "0 of 3 exercises pass, 0 fail, 3 not attempted yet" in out


def test_an_exercise_passes_only_if_every_check_of_it_passes(course, capsys):
    course(
        "98_demo",
        STUBS.replace('raise NotImplementedError("Exercise 98.1: add_one")', "return int(x) + 1"),
    )
    rc, out = _progress(capsys, "98")
    assert rc == 1, out
    line = _line(out, "98.1")
    assert line.split()[0] == "FAIL", out
    # The symptom, then the exact command that shows the failing check.
    assert "TypeError" in out
    assert 'details: python -m pytest "' in out and "test_refuses_strings[learner]" in out
    assert "0 of 3 exercises pass, 1 fails" in out


def test_a_written_exercise_passes(course, capsys):
    course("98_demo", SOLUTIONS)
    rc, out = _progress(capsys, "98")
    assert rc == 0, out
    for number in ("98.1", "98.2", "98.3"):
        assert _line(out, number).split()[0] == "pass"
    assert "3 of 3 exercises pass" in out


def test_a_check_failing_after_the_call_fails_the_exercise(course, capsys):
    # A fixture that fails in teardown (as a race detector does) fails the exercise.
    course("98_demo", SOLUTIONS)
    tests = progress.TESTS_DIR / "test_ch98_demo.py"
    tests.write_text(
        tests.read_text()
        + textwrap.dedent("""

        @pytest.fixture
        def strict():
            yield
            raise AssertionError("two threads wrote out[3]")


        @pytest.mark.parametrize("impl", implementations(CHAPTER))
        def test_add_one_strictly(impl, strict):
            assert impl.add_one(2) == 3
        """)
    )
    rc, out = _progress(capsys, "98")
    assert rc == 1, out
    assert _line(out, "98.1").split()[0] == "FAIL" and "two threads wrote out[3]" in out
    assert "2 of 3 exercises pass" in out


def test_an_exercise_checked_with_an_unwritten_one_is_pending(course, capsys):
    course(
        "98_demo",
        STUBS.replace('raise NotImplementedError("Exercise 98.2: double")', "return 2 * x"),
    )
    rc, out = _progress(capsys, "98")
    assert rc == 0, out
    assert "pending        98.2 double: checked together with 98.3, not attempted yet" in out
    assert _line(out, "98.3").split()[:2] == ["not", "attempted"]


def test_names_the_raise_left_in_a_written_function(course, capsys):
    written = STUBS.replace(
        '    raise NotImplementedError("Exercise 98.3: triple")',
        '    y = 3 * x\n    raise NotImplementedError("Exercise 98.3: triple")\n    return y',
    )
    folder = course("98_demo", written)
    line_no = (
        folder.joinpath("exercises.py")
        .read_text()
        .splitlines()
        .index('    raise NotImplementedError("Exercise 98.3: triple")')
        + 1
    )
    rc, out = _progress(capsys, "98")
    assert (
        f"exercises.py:{line_no} still raises NotImplementedError: delete that line once "
        "your code is written"
    ) in _line(out, "98.3"), out


def test_an_untouched_stub_with_template_code_after_its_raise_is_not_called_written(course, capsys):
    # A launcher stub can carry template code below its raise (a launch to complete):
    # that is the stub's, not the learner's, so the hint is "replace", not "delete".
    template = STUBS.replace(
        '    raise NotImplementedError("Exercise 98.3: triple")',
        '    raise NotImplementedError("Exercise 98.3: triple")\n    y = 3 * x\n    return y',
    )
    course("98_demo", template)
    rc, out = _progress(capsys, "98")
    assert "raises NotImplementedError: replace that line with your code" in _line(out, "98.3"), out


def test_a_syntax_error_is_reported_and_other_chapters_still_run(course, capsys):
    course("98_demo", SOLUTIONS)
    course(
        "97_demo", STUBS.replace('raise NotImplementedError("Exercise 98.2: double")', "return 2 *")
    )
    rc, out = _progress(capsys)
    assert rc == 1, out
    assert re.search(r"chapters/97_demo/exercises\.py:8: SyntaxError: .*\n\s+return 2 \*\n", out), (
        out
    )
    for number in ("97.1", "97.2", "97.3"):
        assert _line(out, number).split()[:2] == ["not", "checked"], out
    assert "3 of 6 exercises pass" in out  # chapter 98 is checked as usual
    assert "3 not checked" in out


def test_pytest_collects_every_chapter_when_one_exercises_file_is_broken(course, tmp_path):
    course("98_demo", SOLUTIONS)
    course("97_demo", "def add_one(x):\n    return x +\n")

    class Outcomes:
        def __init__(self):
            self.by_id = {}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or not report.passed:
                self.by_id[report.nodeid.split("/")[-1]] = (report.outcome, str(report.longrepr))

    seen = Outcomes()
    pytest.main(
        [str(tmp_path / "tests"), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"], plugins=[seen]
    )
    results = seen.by_id
    assert results["test_ch98_demo.py::test_add_one[learner]"][0] == "passed"
    assert results["test_ch97_demo.py::test_add_one[solution]"][0] == "passed"
    outcome, text = results["test_ch97_demo.py::test_add_one[learner]"]
    assert outcome == "failed"
    assert re.search(r"97_demo/exercises\.py:2: SyntaxError", text), text
    assert "return x +" in text


def test_not_implemented_error_from_elsewhere_is_a_failure(course):
    folder = course(
        "98_demo",
        "from common.internal.exercises import import_sibling\n"
        "lib = import_sibling(__file__, 'lib')\n\n\n"
        "def add_one(x):\n    return lib.add(x, 1)\n",
    )
    (folder / "lib.py").write_text("def add(x, y):\n    raise NotImplementedError('no add here')\n")
    impl = Implementation("98_demo", "exercises")
    with pytest.raises(NotImplementedError, match="no add here"):
        impl.add_one(1)  # a real error, not a skip: the raise is not in exercises.py


def test_skip_message_names_the_line_of_the_raise(course):
    course("98_demo")
    with pytest.raises(
        pytest.skip.Exception, match=r"not attempted yet: .*exercises\.py:13 raises"
    ):
        Implementation("98_demo", "exercises").triple(1)


def test_exercise_numbers_come_from_docstrings_even_of_a_broken_file(course):
    course("98_demo", STUBS + "\ndef broken(:\n")
    (exercises.CHAPTERS_DIR / "98_demo" / "solutions.py").unlink()
    numbers = exercises.exercise_numbers("98_demo")
    assert numbers == {"add_one": "98.1", "double": "98.2", "triple": "98.3"}
    # a def whose arguments span lines (as ruff format writes a long one) keeps its number
    course("98_demo", STUBS + '\n\ndef long_args(\n    a, b\n):\n    """Exercise 98.4: ..."""\n')
    (exercises.CHAPTERS_DIR / "98_demo" / "solutions.py").unlink()
    assert exercises.exercise_numbers("98_demo")["long_args"] == "98.4"
    assert sorted(["6.10", "6.2", "3.1b", "3.1a"], key=exercises.number_key) == [
        "3.1a",
        "3.1b",
        "6.2",
        "6.10",
    ]


def test_progress_on_the_real_course_lists_exercises_by_number():
    # Whatever the state of the learner's chapter 1: every exercise once, by number.
    out = subprocess.run(
        [sys.executable, "-m", "common.progress", "1"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    for name, number in exercises.exercise_numbers("01_ecosystem").items():
        assert _line(out.stdout, number).split(f"{number} ")[1].startswith(name), out.stdout
    assert re.search(r"\d+ of 3 exercises pass", out.stdout), out.stdout + out.stderr
    assert out.returncode == (1 if "FAIL" in out.stdout else 0), out.stdout + out.stderr


def test_progress_rejects_unknown_chapter():
    out = subprocess.run(
        [sys.executable, "-m", "common.progress", "99"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert out.returncode != 0 and "chapter" in (out.stdout + out.stderr)
