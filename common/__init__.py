"""Helpers every chapter and the capstone share.

Import ``common`` before anything that imports numba: it picks the runtime
(GPU, or the CUDA simulator when there is no GPU) and numba reads that choice
once, at its own import.

What a learner uses, all importable from ``common``:

* :mod:`common.runtime` -- which runtime is active, ``pick``, ``ceil_div``,
  ``sm_count``, ``jit``.
* :mod:`common.checking` -- ``check`` against a float64 reference, ``poisoned``
  and ``guarded`` outputs, ``random_array``.
* :mod:`common.timing` -- ``benchmark`` with CUDA events, device peaks.
* :mod:`common.harness` -- ``run_versions``: check then time every version of
  an operation; the command line every chapter script shares.
* ``intentional_race`` -- marks a demo that races on purpose (the simulator's
  race detector reports any other race as a ``RaceError``).
* :mod:`common.errors` -- what the checks raise: ``CheckError`` (a wrong
  output), ``RaceError``, ``BarrierError`` (a ``cuda.syncthreads()`` that not
  every running thread of a block reaches: a barrier inside a branch),
  ``DeadlockError`` (a thread spinning on a flag nothing will write),
  ``LaunchConfigError`` (a launch a GPU refuses).
* ``python -m common.doctor`` -- is this machine able to run the course?
* ``python -m common.progress`` -- which exercises pass.

:mod:`common.internal` is the course's machinery (the simulator's extra checks,
the race detector, the exercise loader): nothing there is needed to follow it.

Import order: ``runtime`` first (it decides GPU or simulator before numba loads),
then ``errors``, which imports nothing; no module here imports one that imports
it back (``tests/test_common_imports.py`` checks). The simulator's checks are
installed at the end, once, when every module is loaded.
"""

# isort: off
from .runtime import RUNTIME, ceil_div, is_simulator, jit, pick, runtime_name, sm_count  # noqa: F401  (first)
from .errors import (  # noqa: F401
    BarrierError,
    CheckError,
    DeadlockError,
    LaunchConfigError,
    RaceError,
)
from .checking import check, guarded, poisoned, random_array, rel_error  # noqa: F401
from .timing import Timing, benchmark, device_peaks, format_table  # noqa: F401
from .harness import run_versions  # noqa: F401
from .internal.exercises import import_sibling, load_chapter_module  # noqa: F401
from .internal.racecheck import intentional_race  # noqa: F401
from .internal import simulator as _simulator
# isort: on

if is_simulator():
    _simulator.install()
