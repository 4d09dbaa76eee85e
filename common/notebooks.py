"""Run the course's notebooks: in the simulator (as CI does) or on a GPU (the committed outputs).

Every chapter folder holds ``notebook.ipynb``, and so does ``final_project/``.
The notebooks import the chapter's own modules, so they hold no second copy of
any kernel. They run unchanged on a GPU and in the simulator.

    python -m common.notebooks                  on a GPU: every notebook, run and saved in place
    python -m common.notebooks PATH [PATH ...]  on a GPU: only these
    python -m common.notebooks --check [PATH]   run without saving (the simulator without a GPU,
                                                or with --simulator); exit 1 on an error

The committed outputs are a GPU run's: its timings, tables and plots. Saving
therefore runs on the GPU or not at all: without one it refuses before running
anything (a simulator run times nothing and would overwrite them), and
``--simulator`` cannot be combined with saving. ``--check`` is the way to run
the notebooks without a GPU.

Saving keeps the outputs and drops what changes on every run without meaning
anything (each cell's execution timestamps, the kernel's version strings), so a
rerun's diff shows the figures that moved. The first code cell of every
notebook prints :func:`banner`, which names the GPU (or the simulator) the
outputs came from. Run this on the machine whose figures you want committed.

Execution: nbclient (the engine behind ``jupyter nbconvert --execute``), one
fresh kernel a notebook, with the notebook's folder as the working directory.
Checks that run many notebooks in a row in the simulator (the test suite) may
share one kernel between them (:class:`SharedKernel`); saving never does.
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

    from importlib.metadata import version

    # The installed versions, read from the packages' metadata: importing torch
    # only to print its version would cost a notebook that never uses it 2 s.
    versions = f"numba-cuda {version('numba-cuda')}, torch {version('torch')}"
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


NO_GPU_TO_SAVE = (
    "no NVIDIA GPU here (the CUDA driver reports none, or NUMBA_ENABLE_CUDASIM is set): "
    "saving would replace the committed outputs of a GPU run (its timings, tables and "
    "plots) with the simulator's, which time nothing, so nothing was run or saved. To "
    "check the notebooks without a GPU: python -m common.notebooks --check. To "
    "regenerate the outputs, run this on a machine with an NVIDIA GPU."
)


def gpu_present() -> bool:
    """True when the CUDA driver reports a GPU and the simulator is not forced."""
    from common.runtime import driver_gpu_count

    forced = os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip() not in ("", "0")
    return not forced and driver_gpu_count() > 0


def execute(path: Path, simulator: bool | None = None, timeout: int = CELL_TIMEOUT_S):
    """Run the notebook at ``path`` top to bottom in a fresh kernel; return it with outputs.

    simulator: True runs the kernel in the Numba CUDA simulator
    (NUMBA_ENABLE_CUDASIM=1); False runs it on the GPU (NUMBA_ENABLE_CUDASIM=0)
    and raises RuntimeError before starting when there is none; None leaves the
    choice to ``import common`` (the simulator without a GPU).
    Raises nbclient's CellExecutionError (the failing cell's source and
    traceback) on the first cell that raises, FileNotFoundError for a missing
    notebook.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    if simulator is False and not gpu_present():
        raise RuntimeError(f"cannot run {path} on a GPU: {NO_GPU_TO_SAVE}")
    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if simulator is not None:  # the kernel inherits the environment
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if simulator else "0"
    try:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    finally:
        if simulator is not None:
            if saved is None:
                os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
            else:
                os.environ["NUMBA_ENABLE_CUDASIM"] = saved
    return nb


# A code cell with this tag makes the same call as a test of the suite, named in the
# cell's ``checked_by`` metadata ("tests/FILE.py::TEST"): the suite's simulator checks
# (SharedKernel) skip it rather than run it twice; a GPU run, and --check, run it.
CHECKED_BY_A_TEST = "checked-by-a-test-in-the-simulator"


class SharedKernel:
    """One Jupyter kernel for simulator checks of several notebooks in a row.

    Starting a kernel and importing torch, Numba and the course in it costs about
    5 s of CPU a notebook, more than most notebooks' own cells take in the
    simulator. Here the kernel starts once (on the first :meth:`run`) with
    ``NUMBA_ENABLE_CUDASIM=1`` and ``env``; before each notebook its namespace is
    cleared (``%reset -f``: a name one notebook defined or imported is gone for the
    next), its open figures closed and its working directory set to the notebook's
    folder; what survives the reset is then frozen (``gc.freeze()``), so that the
    next reset's full collection, and those during the cells, skip the imported
    modules (a notebook's set-up took 0.65 s, 0.25 s with them frozen). What stays
    is what a fresh kernel would import again: the modules in ``sys.modules``,
    with any state a notebook left in them. Hence checks only:
    the committed outputs always come from :func:`execute`, a fresh kernel each.
    Cells tagged :data:`CHECKED_BY_A_TEST` are skipped.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {}), "NUMBA_ENABLE_CUDASIM": "1"}
        self.km = None

    def run(self, path: Path, timeout: int = CELL_TIMEOUT_S, race_detector: bool | None = None):
        """Run the notebook at ``path`` in this kernel; return it with outputs.
        ``race_detector``: switch the simulator's race detector on or off for this
        notebook (None: as the kernel started, ``COURSE_RACECHECK``).
        Raises as :func:`execute` does."""
        import nbformat
        from jupyter_client.manager import KernelManager
        from nbclient import NotebookClient

        path = Path(path).resolve()  # (the kernel's working directory moves)
        if not path.is_file():
            raise FileNotFoundError(f"no notebook at {path}")
        nb = nbformat.read(path, as_version=4)
        if self.km is None:
            self.km = KernelManager(kernel_name="python3")
            self.km.start_kernel(env=self.env, cwd=str(path.parent))
        prologue = nbformat.v4.new_code_cell(
            "%reset -f\n"
            "import gc as _gc, os as _os, sys as _sys\n"
            "_gc.freeze()\n"
            "if 'matplotlib.pyplot' in _sys.modules:\n"
            "    _sys.modules['matplotlib.pyplot'].close('all')\n"
            f"_os.chdir({str(path.parent)!r})\n"
            "del _gc, _os, _sys"
            + (
                ""
                if race_detector is None
                else "\nimport common.internal.racecheck as _rc\n"
                f"_rc.ENABLED = {bool(race_detector)}\n"
                "del _rc"
            )
        )
        nb.cells.insert(0, prologue)
        try:
            NotebookClient(
                nb,
                km=self.km,
                timeout=timeout,
                kernel_name="python3",
                skip_cells_with_tag=CHECKED_BY_A_TEST,
            ).execute()
        finally:
            nb.cells.remove(prologue)
        return nb

    def close(self) -> None:
        """Shut the kernel down (if it was started)."""
        if self.km is not None:
            self.km.shutdown_kernel(now=True)
            self.km = None

    def __enter__(self) -> "SharedKernel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: all)")
    parser.add_argument(
        "--check", action="store_true", help="run without saving (works without a GPU)"
    )
    parser.add_argument(
        "--simulator",
        action="store_true",
        help="with --check: force the simulator (NUMBA_ENABLE_CUDASIM=1)",
    )
    args = parser.parse_args(argv)
    if args.simulator and not args.check:
        parser.error(
            "--simulator needs --check: a simulator run is never saved (the committed "
            "outputs are a GPU run's timings and plots)"
        )
    if not args.check and not gpu_present():
        print(f"common.notebooks: {NO_GPU_TO_SAVE}", file=sys.stderr)
        return 2
    import nbformat
    from nbclient.exceptions import CellExecutionError

    paths = args.paths or notebook_paths()
    # Saving: on the GPU only. Checking: the simulator if asked, else what `common` picks.
    simulator = False if not args.check else (True if args.simulator else None)
    failed = 0
    for path in paths:
        start = time.perf_counter()
        try:
            nb = execute(path, simulator=simulator)
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
