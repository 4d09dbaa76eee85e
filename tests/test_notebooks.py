"""The course's notebooks: each runs top to bottom in the simulator, imports its chapter
instead of copying kernels, and is linked from its README."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import notebooks

import json
import re
from pathlib import Path

import pytest

# nbformat is imported by the tests that use it, not here: importing it (jsonschema's
# format grammars) costs 2-3 s of each pytest process's collection.
PATHS = notebooks.notebook_paths()
IDS = [p.parent.name for p in PATHS]


def test_every_chapter_and_the_capstone_has_a_notebook():
    folders = sorted(p for p in (notebooks.ROOT / "chapters").iterdir() if p.is_dir())
    missing = [f.name for f in folders if not (f / "notebook.ipynb").is_file()]
    missing += [] if PATHS[-1].is_file() else ["final_project"]
    assert not missing, f"no notebook.ipynb in {missing}"


SHOWS_THE_RACE_DETECTOR = {"05_first_kernels", "06_memory"}  # cells that expect its reports


@pytest.fixture(scope="module")
def shared_kernel():
    """One kernel for the notebooks of a worker (each notebook's own kernel start and
    imports cost about 5 s of CPU, more than most of them run). The race detector is
    on for the notebooks that show it at work and off for the others, a fifth faster
    (the chapters' own tests race-check the same kernels). The capstone notebook
    trains 12 steps here instead of its simulator default of 32 (the cells are the
    same; CI's time is not)."""
    env = {"COURSE_RACECHECK": "1", "CAPSTONE_ARGS": "--sample --epochs 1 --max-steps 12"}
    with notebooks.SharedKernel(env=env) as kernel:
        yield kernel


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_notebook_runs_clean_in_the_simulator(path, shared_kernel):
    # nbclient raises CellExecutionError (the cell's source and traceback) on any error
    nb = shared_kernel.run(path, race_detector=path.parent.name in SHOWS_THE_RACE_DETECTOR)
    printed = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "Ran in the Numba CUDA simulator" in printed, "the banner cell did not print"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_notebook_opens_with_the_course_cells_and_copies_no_kernel(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    first, second = nb.cells[0], nb.cells[1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "pip install" in first.source, "the first cell says how to install the course"
    assert second.cell_type == "code" and second.source.startswith("import common")
    assert "print(common.notebooks.banner())" in second.source
    for cell in nb.cells:
        if cell.cell_type == "code":
            # one source of truth: kernels live in the chapter's modules
            assert not re.search(r"@cuda\.jit|cuda\.jit\(", cell.source), cell.source[:200]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_a_cell_skipped_in_the_simulator_makes_its_tests_call(path):
    """A cell tagged CHECKED_BY_A_TEST is skipped by the simulator check above, so the
    test its ``checked_by`` names must exist and make the cell's calls itself."""
    import ast

    import nbformat

    for cell in nbformat.read(path, as_version=4).cells:
        if notebooks.CHECKED_BY_A_TEST not in cell.metadata.get("tags", []):
            continue
        where = cell.metadata.get("checked_by", "")
        file, _, name = where.partition("::")
        assert file and name, f"{path.parent.name}: a tagged cell names no test ({where!r})"
        tree = ast.parse((notebooks.ROOT / file).read_text())
        tests = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert name in tests, f"{where}: no such test"
        called = {
            ast.unparse(node.func).rsplit(".", 1)[-1]
            + ast.unparse(node)[len(ast.unparse(node.func)) :]
            for node in ast.walk(tests[name])
            if isinstance(node, ast.Call)
        }
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                call = node.func.attr + ast.unparse(node)[len(ast.unparse(node.func)) :]
                assert call in called, f"{where} does not call {call} as the cell does"


# glibc's last words when a process corrupts its heap (torch's profiler did, at exit)
GLIBC_ABORT = re.compile(r"free\(\): invalid pointer|double free or corruption[^\n]*")
GPU_BANNER = re.compile(r"^Ran on an? (NVIDIA .+) \(numba-cuda [\d.]+, torch \S+\)$")


def committed_run_problems(nb) -> list[str]:
    """What is wrong with ``nb``'s outputs as a committed GPU run: every code cell ran once,
    top to bottom in one kernel, without an error, and the banner names an NVIDIA GPU."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    problems = []
    counts = [c.execution_count for c in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"execution counts {counts}: not one top-to-bottom run of every cell")
    errors = [o.ename for c in code for o in c.outputs if o.output_type == "error"]
    if errors:
        problems.append(f"error outputs: {errors}")
    streams = "".join(o.get("text", "") for c in code for o in c.outputs)
    aborts = sorted(set(GLIBC_ABORT.findall(streams)))
    if aborts:
        problems.append(f"a process aborted under a cell: {aborts}")
    banner = "".join(o.get("text", "") for o in code[0].outputs if o.output_type == "stream")
    if not GPU_BANNER.match(banner.strip()):
        problems.append(f"the banner cell printed {banner.strip()!r}, not the GPU's name")
    return problems


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_committed_outputs_come_from_a_gpu_run_that_names_the_gpu(path):
    # Committed outputs come from one GPU run (`python -m common.notebooks` there);
    # the simulator times nothing, so its outputs must never be saved.
    import nbformat

    problems = committed_run_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.relative_to(notebooks.ROOT)}: " + "; ".join(problems)


def test_committed_run_check_refuses_simulator_partial_and_failed_runs():
    import nbformat

    def run(banner: str, counts=(1, 2), error: bool = False):
        nb = nbformat.v4.new_notebook()
        cells = [nbformat.v4.new_code_cell("print(banner())"), nbformat.v4.new_code_cell("x")]
        cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=banner + "\n")]
        for cell, count in zip(cells, counts):
            cell.execution_count = count
        if error:
            cells[1].outputs = [
                nbformat.v4.new_output("error", ename="ValueError", evalue="x", traceback=[])
            ]
        nb.cells = [nbformat.v4.new_markdown_cell("# t"), *cells]
        return committed_run_problems(nb)

    gpu = "Ran on an NVIDIA H100 80GB HBM3 (numba-cuda 0.30.4, torch 2.11.0+cu130)"
    assert run(gpu) == []
    sim = "Ran in the Numba CUDA simulator (no GPU): every kernel runs and is checked"
    assert "not the GPU's name" in run(sim)[0]
    assert "not the GPU's name" in run("")[0]
    assert "top-to-bottom" in run(gpu, counts=(1, None))[0]
    assert "top-to-bottom" in run(gpu, counts=(2, 1))[0]
    assert "ValueError" in run(gpu, error=True)[0]
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x", execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=gpu + "\n"),
        nbformat.v4.new_output("stream", name="stderr", text="double free or corruption (!prev)\n"),
    ]
    nb.cells = [cell]
    aborted = committed_run_problems(nb)
    assert aborted and "aborted" in aborted[0]


def test_banner_names_the_gpu_on_a_gpu(monkeypatch):
    # The GPU branch of banner() never runs in the simulator; pin what it prints
    # to the pattern the committed-outputs test reads.
    import common.runtime

    monkeypatch.setattr(common, "is_simulator", lambda: False)
    monkeypatch.setattr(common.runtime, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    line = notebooks.banner()
    assert GPU_BANNER.match(line), line
    assert GPU_BANNER.match(line).group(1) == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_readme_links_its_notebook(path):
    readme = (path.parent / "README.md").read_text()
    assert "(notebook.ipynb)" in readme, (
        f"{path.parent.name}/README.md does not link notebook.ipynb"
    )
    top = (notebooks.ROOT / "README.md").read_text()
    assert str(path.relative_to(notebooks.ROOT)) in top, f"README.md does not link {path}"


def test_strip_volatile_keeps_outputs_and_drops_timestamps():
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    cell.metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    nb.cells = [cell]
    nb.metadata["language_info"] = {"name": "python", "version": "3.12.3"}
    notebooks.strip_volatile(nb)
    saved = json.loads(nbformat.writes(nb))
    assert "execution" not in saved["cells"][0]["metadata"]
    assert "".join(saved["cells"][0]["outputs"][0]["text"]) == "1\n"
    assert saved["cells"][0]["execution_count"] == 1
    assert saved["metadata"]["language_info"] == {"name": "python"}


def test_a_failing_cell_fails_the_run(tmp_path):
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise ValueError('planted')")]
    path = tmp_path / "notebook.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="planted"):
        notebooks.execute(path, simulator=True)
    assert notebooks.main(["--check", str(path)]) == 1
    with pytest.raises(FileNotFoundError, match="no notebook"):
        notebooks.execute(tmp_path / "missing.ipynb")


def test_saving_without_a_gpu_refuses_before_running_anything(tmp_path, monkeypatch, capsys):
    """The documented regenerate command must never put simulator outputs (no
    timings, no speed plots) over a GPU run's committed ones."""
    path = tmp_path / "notebook.ipynb"
    committed = PATHS[0].read_bytes()
    path.write_bytes(committed)
    monkeypatch.setattr(notebooks, "gpu_present", lambda: False)
    ran = []
    monkeypatch.setattr(notebooks, "execute", lambda *a, **k: ran.append(a))
    assert notebooks.main([str(path)]) == 2
    assert not ran and path.read_bytes() == committed
    message = capsys.readouterr().err
    assert "no NVIDIA GPU" in message and "--check" in message
    with pytest.raises(SystemExit):  # the simulator is never a saving run
        notebooks.main(["--simulator", str(path)])
    assert path.read_bytes() == committed


def test_a_shared_kernel_clears_names_and_switches_the_race_detector(tmp_path, shared_kernel):
    """A notebook that uses a name only an earlier notebook defined must fail, as it
    would in a fresh kernel; each runs in its own folder; the race detector is on or
    off as asked."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    racy = (
        "import common\nimport numpy as np\nfrom numba import cuda\n"
        "@cuda.jit\ndef racy(a):\n    a[0] += 1\n"
        "a = cuda.to_device(np.zeros(1, np.float32))\nracy[1, 4](a)\nprint('ran')"
    )
    folders = {}
    for name, source in (
        ("a", "import os\nleft_over = 1\nprint(os.getcwd())"),
        ("b", "import os\nprint(os.getcwd())\nprint(left_over)"),
        ("racy", racy),
    ):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(source)]
        nbformat.write(nb, folders[name] / "notebook.ipynb")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)  # a path relative to here still finds its folder
        ran = shared_kernel.run(Path("a") / "notebook.ipynb")
    assert ran.cells[0].outputs[0]["text"].strip() == str(folders["a"])
    assert len(ran.cells) == 1  # the namespace reset is not left in the notebook
    with pytest.raises(CellExecutionError, match="left_over"):
        shared_kernel.run(folders["b"] / "notebook.ipynb")
    with pytest.raises(CellExecutionError, match="RaceError"):
        shared_kernel.run(folders["racy"] / "notebook.ipynb", race_detector=True)
    ran = shared_kernel.run(folders["racy"] / "notebook.ipynb", race_detector=False)
    assert ran.cells[0].outputs[0]["text"].strip() == "ran"


def test_simulator_false_means_the_gpu(tmp_path, monkeypatch):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(1)")]
    path = tmp_path / "notebook.ipynb"
    nbformat.write(nb, path)
    monkeypatch.setattr(notebooks, "gpu_present", lambda: False)
    with pytest.raises(RuntimeError, match="cannot run .* on a GPU"):
        notebooks.execute(path, simulator=False)


def test_a_forced_simulator_is_no_gpu(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert not notebooks.gpu_present()
