"""Triton for this chapter: on a GPU as installed; without one, in its interpreter.

Import it from a chapter script as ``triton_env = import_sibling(__file__, "triton_env")``
and use ``triton_env.triton`` / ``triton_env.tl``. Without a GPU (the course's simulator
mode) ``common.runtime`` has set ``TRITON_INTERPRET=1`` before Triton is imported, so ``@triton.jit``
kernels run on the CPU with NumPy, one program instance at a time: slow, so tests keep
shapes small; no autotuning, no bfloat16, nothing timed. Where Triton is not installed
(it ships wheels for Linux x86-64 only), :data:`MISSING` says so in one line, scripts print
it and exit 0, and the tests skip with it.

Versions: the GPU machine's torch 2.11 pins Triton 3.6; a CPU-only install gets the newest
(3.9 when this chapter was written). The chapter's kernels use only what both have.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime
from common.runtime import is_simulator

import os

if is_simulator():
    # common.runtime sets TRITON_INTERPRET=1 in the simulator; a process that imported
    # Triton before common (or set the variable otherwise) cannot run the kernels.
    if runtime.TRITON_IMPORTED_TOO_EARLY or os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton was imported before chapter 12 could switch it to its interpreter "
            "(no GPU here; torch.compile imports Triton), so its kernels cannot run. "
            "Import the chapter's modules first in a fresh process or kernel (restart "
            "it), or set TRITON_INTERPRET=1 in the environment before starting it."
        )

try:
    import triton
    import triton.language as tl
except ImportError:  # not installed, or no wheel for this platform
    triton = tl = None
    MISSING = (
        "Triton is not installed: pip install -e '.[triton]' (wheels exist for Linux "
        "x86-64 only); chapter 12's kernels need it"
    )
else:
    MISSING = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
VERSION = None if triton is None else triton.__version__


def require() -> None:
    """Raise RuntimeError with :data:`MISSING` where Triton is not installed."""
    if MISSING:
        raise RuntimeError(MISSING)
