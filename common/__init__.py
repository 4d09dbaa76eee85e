"""Helpers every chapter and the capstone share.

Import ``common`` before anything that imports numba: it picks the runtime
(GPU, or the CUDA simulator when there is no GPU) and numba reads that choice
once, at its own import.

* :mod:`common.runtime` -- which runtime is active, ``jit``, ``pick``, ``ceil_div``.
* :mod:`common.timing` -- CUDA-event benchmarks and device peaks.
* :mod:`common.checking` -- relative error against float64, poisoned outputs.
* :mod:`common.exercises` -- loading chapter files, checking exercises.
* ``python -m common.doctor`` -- is this machine able to run the course?
* ``python -m common.progress`` -- which exercises pass.
"""

# isort: off
from .runtime import RUNTIME, ceil_div, is_simulator, jit, pick, runtime_name  # noqa: F401  (first)
from .checking import CheckError, check, guarded, poisoned, random_array, rel_error  # noqa: F401
from .timing import Timing, benchmark, device_peaks, format_table  # noqa: F401
from .exercises import import_sibling, load_chapter_module  # noqa: F401
# isort: on
