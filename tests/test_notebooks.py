"""The course's notebooks: each runs top to bottom in the simulator, imports its chapter
instead of copying kernels, and is linked from its README."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import notebooks

import json
import re

import nbformat
import pytest

PATHS = notebooks.notebook_paths()
IDS = [p.parent.name for p in PATHS]


def test_every_chapter_and_the_capstone_has_a_notebook():
    folders = sorted(p for p in (notebooks.ROOT / "chapters").iterdir() if p.is_dir())
    missing = [f.name for f in folders if not (f / "notebook.ipynb").is_file()]
    missing += [] if PATHS[-1].is_file() else ["final_project"]
    assert not missing, f"no notebook.ipynb in {missing}"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_notebook_runs_clean_in_the_simulator(path):
    # nbclient raises CellExecutionError (the cell's source and traceback) on any error
    nb = notebooks.execute(path, simulator=True)
    printed = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "Ran in the Numba CUDA simulator" in printed, "the banner cell did not print"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_notebook_opens_with_the_course_cells_and_copies_no_kernel(path):
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
def test_committed_notebook_holds_no_simulator_output(path):
    # Committed outputs come from a GPU run (python -m common.notebooks there);
    # the simulator times nothing, so its outputs must never be saved.
    text = path.read_text()
    assert "Ran in the Numba CUDA simulator" not in text


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_readme_links_its_notebook(path):
    readme = (path.parent / "README.md").read_text()
    assert "(notebook.ipynb)" in readme, (
        f"{path.parent.name}/README.md does not link notebook.ipynb"
    )
    top = (notebooks.ROOT / "README.md").read_text()
    assert str(path.relative_to(notebooks.ROOT)) in top, f"README.md does not link {path}"


def test_strip_volatile_keeps_outputs_and_drops_timestamps():
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
