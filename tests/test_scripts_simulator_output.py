"""What the chapter 01-05 scripts print: what they checked, and, in the simulator, the
GPU figures their chapter README holds (with the GPU's name) instead of bare names.

Each script runs once (the module-scoped ``printed``); every test reads that output.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator
from common.internal.exercises import REPO_ROOT, load_chapter_module
from common.timing import SIMULATOR_NOTE, Timing, format_table, readme_figures

import contextlib
import io
import re

import pytest

# script -> the words that say what its kernels were checked against
SCRIPTS = {
    ("01_ecosystem", "loop_to_kernel"): "is checked against a float64 reference",
    ("03_python_for_kernels", "float64_promotion"): "checked against a float64 reference",
    ("03_python_for_kernels", "memory_layout"): "checked against A.T (exact)",
    ("04_gpu_intro", "timing_mistakes"): "checked against the float64 closed form",
    ("04_gpu_intro", "transfer_vs_compute"): "checked against NumPy in float64",
    ("04_gpu_intro", "unified_memory"): "is checked against NumPy in float64",
    ("05_first_kernels", "vector_add"): "is checked against the float64 reference",
    ("05_first_kernels", "indexing_2d_3d"): "checked against a float64 NumPy reference",
    ("05_first_kernels", "divergence"): "checked against a float64 reference",
    ("05_first_kernels", "atomics_counter"): "right answer",
    ("05_first_kernels", "out_of_bounds"): "output right, guard cells untouched",
    ("05_first_kernels", "grid_sync"): "checked against the float64 NumPy reference",
}
IDS = [script for _, script in SCRIPTS]


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """printed(chapter, script) -> what main() printed to stdout; main() runs once a script
    (a script that fails raises its error to every test that asks for it)."""
    runs = {}

    def get(chapter, script):
        if (chapter, script) not in runs:
            out = io.StringIO()
            try:
                argv = ["--out", str(tmp_path_factory.mktemp(script))]
                if script == "out_of_bounds":  # it writes no results, so it takes no --out
                    argv = []
                with contextlib.redirect_stdout(out):
                    rc = load_chapter_module(chapter, script).main(argv)
                runs[chapter, script] = (rc, out.getvalue(), None)
            except Exception as exc:  # noqa: BLE001  (re-raised below, for every test)
                runs[chapter, script] = (None, out.getvalue(), exc)
        rc, text, exc = runs[chapter, script]
        if exc is not None:
            raise exc
        assert rc == 0, text
        return text

    return get


by_script = pytest.mark.parametrize("chapter, script", list(SCRIPTS), ids=IDS)


def readme_table(chapter, script):
    """(caption, rows of cells) after the script's gpu-figures marker, read without
    common.timing, so a parser that dropped rows or cells would fail these tests."""
    lines = (REPO_ROOT / "chapters" / chapter / "README.md").read_text().splitlines()
    start = lines.index(f"<!-- gpu-figures: {script}.py -->")
    caption, rows = [], []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([c.strip().replace("`", "") for c in line.strip("|").split("|")])
        elif rows:
            break
        elif line.strip():
            caption.append(line)
    return " ".join(caption), [r for r in rows if not set("".join(r)) <= set("-: ")]


@by_script
def test_script_says_what_it_checked(printed, chapter, script):
    out = printed(chapter, script)
    assert SCRIPTS[chapter, script] in out, out


@pytest.mark.skipif(not is_simulator(), reason="on a GPU the scripts print their own timings")
@by_script
def test_simulator_shows_the_readme_gpu_figures(printed, chapter, script):
    out = printed(chapter, script)
    caption, rows = readme_table(chapter, script)
    gpu = re.match(r"Measured on an? (NVIDIA [\w ]+?)\s*[,(:]", caption)
    assert gpu, caption
    assert f"measured on an {gpu[1]}" in out or f"measured on a {gpu[1]}" in out, out
    assert f"chapters/{chapter}/README.md" in out
    for row in rows:
        for cell in row:
            assert cell in out, f"README cell {cell!r} not printed:\n{out}"


@pytest.mark.skipif(not is_simulator(), reason="the simulator's note")
@by_script
def test_simulator_output_says_things_once(printed, chapter, script):
    out = printed(chapter, script)
    assert out.count(SIMULATOR_NOTE) <= 1, out
    assert out.count("GPU figures from") == 1, out
    assert "on simulator" not in out  # the runtime is not a device name
    if script != "out_of_bounds":  # its line quotes the simulator's IndexError verbatim
        assert not re.search(r"\[(-?[\d.]+, ){2,}", out), f"a Python list printed raw:\n{out}"


def test_atomics_demo_says_the_race_is_on_purpose(printed):
    out = printed("05_first_kernels", "atomics_counter")
    assert "version 1 races on purpose" in out
    assert "on a GPU expect version 1 wrong in every run" in out
    assert "the simulator" in out and "come out right by chance" in out


@pytest.mark.parametrize(
    "chapter", ["01_ecosystem", "03_python_for_kernels", "04_gpu_intro", "05_first_kernels"]
)
def test_every_timed_script_has_readme_figures(chapter):
    for path in sorted((REPO_ROOT / "chapters" / chapter).glob("*.py")):
        if path.stem in ("exercises", "solutions"):
            continue
        if re.search(r"\b(benchmark|run_versions)\b", path.read_text()):
            figures = readme_figures(path)
            assert figures.gpu.startswith("NVIDIA ") and figures.rows, path
            assert (chapter, path.stem) in SCRIPTS, f"{path.name} times kernels: add it to SCRIPTS"


def test_readme_figures_errors_say_what_to_do(tmp_path):
    script = tmp_path / "demo.py"
    (tmp_path / "README.md").write_text("# demo\n\nno figures here\n")
    with pytest.raises(LookupError, match=r"<!-- gpu-figures: demo.py -->.*Measured on"):
        readme_figures(script)
    (tmp_path / "README.md").write_text(
        "<!-- gpu-figures: demo.py -->\nMeasured somewhere:\n\n| a |\n|---|\n| 1 |\n"
    )
    with pytest.raises(LookupError, match=r"README.md:1: .*'Measured on an NVIDIA <GPU>'"):
        readme_figures(script)
    (tmp_path / "README.md").write_text(
        "<!-- gpu-figures: demo.py -->\n"
        "Measured on an NVIDIA H100 (n = 3):\n\n"
        "| a | b |\n|---|---|\n| `x` | 1.5 |\n| y | 2 |\n\nafter\n"
    )
    figures = readme_figures(script)
    assert (figures.gpu, figures.header, figures.rows) == (
        "NVIDIA H100",
        ["a", "b"],
        [["x", "1.5"], ["y", "2"]],
    )
    text = figures.format()
    assert " ".join(text.split()).startswith(
        f"GPU figures from {tmp_path / 'README.md'}: measured on an NVIDIA H100 (n = 3): a b x 1.5"
    )
    table = [line.split() for line in text.splitlines()[-3:]]
    assert table == [["a", "b"], ["x", "1.5"], ["y", "2"]]


def test_unmeasured_table_shows_each_versions_error():
    checked = [
        Timing("1 naive", extra={"rel_error": 2.5e-8}),
        Timing("2 tiled", extra={"rel_error": 0.0}),
    ]
    lines = format_table(checked, title="T").splitlines()
    assert lines[0] == "T" and SIMULATOR_NOTE in lines[1] and "rel. error" in lines[1]
    assert lines[2].split() == ["1", "naive", "2.5e-08"] and lines[3].split() == ["2", "tiled", "0"]
    bare = format_table([Timing("1 naive")]).splitlines()
    assert bare == [f"  ({SIMULATOR_NOTE})", "  1 naive"]
