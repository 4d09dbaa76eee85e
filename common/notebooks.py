"""Run the course's notebooks: in the simulator (as CI does) or on a GPU (the committed outputs).

Every chapter folder holds ``notebook.ipynb``, and so does ``final_project/``.
The notebooks import the chapter's own modules, so they hold no second copy of
any kernel. They run unchanged on a GPU and in the simulator.

    python -m common.notebooks                  every notebook, run and saved in place
    python -m common.notebooks PATH [PATH ...]  only these
    python -m common.notebooks --check [PATH]   run without saving; exit 1 on an error

Saving keeps the outputs and drops what changes on every run without meaning
anything (each cell's execution timestamps, the kernel's version strings), so a
rerun's diff shows the figures that moved. The first code cell of every
notebook prints :func:`banner`, which names the GPU (or the simulator) the
outputs came from. On a GPU, run this on the machine whose figures you want
committed. The simulator's outputs are not committed: it times nothing.

Execution: nbclient (the engine behind ``jupyter nbconvert --execute``), one
fresh kernel a notebook, with the notebook's folder as the working directory.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 900  # one cell; the capstone's training cell is the longest


def notebook_paths() -> list[Path]:
    """Every course notebook, in course order: chapters 01.., then the capstone."""
    chapters = sorted((ROOT / "chapters").glob("*/notebook.ipynb"))
    return chapters + [ROOT / "final_project" / "notebook.ipynb"]


def banner() -> str:
    """One line naming where the notebook ran: the GPU and library versions, or the simulator."""
    import common
    from common.runtime import device_name

    import numba_cuda
    import torch

    versions = f"numba-cuda {numba_cuda.__version__}, torch {torch.__version__}"
    if common.is_simulator():
        return (
            "Ran in the Numba CUDA simulator (no GPU): every kernel runs and is checked, "
            f"nothing is timed ({versions})"
        )
    return f"Ran on an {device_name()} ({versions})"


def strip_volatile(nb) -> None:
    """Drop per-run metadata in place: cell execution timestamps and the kernel's
    language_info version (the outputs and execution counts stay)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
    nb.metadata.pop("widgets", None)
    nb.metadata.get("language_info", {}).pop("version", None)


def execute(path: Path, simulator: bool | None = None, timeout: int = CELL_TIMEOUT_S):
    """Run the notebook at ``path`` top to bottom in a fresh kernel; return it with outputs.

    simulator: True forces the Numba CUDA simulator in the kernel
    (NUMBA_ENABLE_CUDASIM=1), None leaves the choice to ``import common``.
    Raises nbclient's CellExecutionError (the failing cell's source and
    traceback) on the first cell that raises, FileNotFoundError for a missing
    notebook.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # the kernel inherits the environment
    try:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    finally:
        if simulator:
            if saved is None:
                os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
            else:
                os.environ["NUMBA_ENABLE_CUDASIM"] = saved
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: all)")
    parser.add_argument("--check", action="store_true", help="run without saving")
    parser.add_argument(
        "--simulator", action="store_true", help="force the simulator (NUMBA_ENABLE_CUDASIM=1)"
    )
    args = parser.parse_args(argv)
    import nbformat
    from nbclient.exceptions import CellExecutionError

    paths = args.paths or notebook_paths()
    failed = 0
    for path in paths:
        start = time.perf_counter()
        try:
            nb = execute(path, simulator=args.simulator or None)
        except (CellExecutionError, FileNotFoundError) as exc:
            failed += 1
            print(f"FAIL  {path}: {exc}", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        if not args.check:
            strip_volatile(nb)
            nbformat.write(nb, path)
        print(f"ok    {path}  {seconds:6.1f} s{'' if args.check else '  (saved)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
