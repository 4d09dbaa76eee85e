"""Which runtime runs our kernels: a real NVIDIA GPU, or Numba's CUDA simulator.

Importing ``common`` (which imports this module first) decides once per process:

* ``NUMBA_ENABLE_CUDASIM`` set by the user: respected as it is.
* unset, and the CUDA driver reports at least one device: the GPU.
* unset, and no usable GPU: the simulator is switched on *before* numba is
  imported (numba reads the variable once, at import), and one line says so.

The GPU probe talks to the driver library through ``ctypes`` (``cuInit`` and
``cuDeviceGetCount``, CUDA Driver API reference, section 6.3 and 6.5), so it
never imports numba and costs a few milliseconds.

Under the simulator, :mod:`common.internal.simulator` adds the checks a GPU
makes and the simulator does not (launch limits, constant shared-array shapes,
races); ``common`` installs them once all its modules are loaded. This module
imports no other module of the course, so any of them may import it. The
helpers here are the ones learners use:
:func:`pick`, :func:`ceil_div`, :func:`sm_count`, :func:`is_simulator`,
:func:`jit`, :func:`interleaved_threads`.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# A GPU's launch limits (compute capability 7.0 to 12.x: CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability"); the simulator
# enforces them too.
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
MAX_STATIC_SHARED_BYTES = 48 * 1024


def driver_gpu_count() -> int:
    """Number of CUDA devices the driver reports; 0 if no driver or it fails.

    Asks the driver (``libcuda``) directly, whatever runtime this process uses."""
    names = {
        "win32": ("nvcuda.dll",),
        "darwin": (),
    }.get(sys.platform, ("libcuda.so.1", "libcuda.so"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return count.value
        except AttributeError:
            return 0
    return 0


def _select() -> tuple[str, str]:
    """Set NUMBA_ENABLE_CUDASIM if needed; return (runtime, reason)."""
    env = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if env is not None and env.strip() not in ("", "0"):
        return "simulator", "NUMBA_ENABLE_CUDASIM is set"
    if env is not None and env.strip() == "0":
        return "gpu", "NUMBA_ENABLE_CUDASIM=0 is set"
    if driver_gpu_count() > 0:
        return "gpu", "the CUDA driver reports a GPU"
    if "numba" in sys.modules:
        # numba has read its configuration already; switching now would leave it
        # half on the GPU target. Say what to do instead of failing later.
        print(
            "common: no NVIDIA GPU found, and numba was imported before common, "
            "so the simulator cannot be switched on. Import common first, or set "
            "NUMBA_ENABLE_CUDASIM=1.",
            file=sys.stderr,
        )
        return "gpu", "numba imported before common; no GPU found"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # Said once per process, to a person at a terminal: not into logs, pipes or
    # pytest's output (tests import common too), and not above --help text.
    # `python -m common.doctor` always shows it (runtime.REASON).
    wants_help = any(a in ("-h", "--help") for a in sys.argv[1:])
    if sys.stderr.isatty() and "pytest" not in sys.modules and not wants_help:
        print(
            "common: no usable NVIDIA GPU found; kernels run in the Numba CUDA "
            "simulator (slow: problem sizes are reduced, not timed).",
            file=sys.stderr,
        )
    return "simulator", "no usable NVIDIA GPU found"


RUNTIME, REASON = _select()

if RUNTIME == "simulator":
    # Without a GPU, Triton (chapter 12) runs in its interpreter, which must be chosen
    # before Triton is first imported (its own tl.sum, tl.max ... are made then), and
    # torch.compile imports it: so here, with the rest of the runtime choice.
    TRITON_IMPORTED_TOO_EARLY = (
        "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    )
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    TRITON_IMPORTED_TOO_EARLY = False

# Numba warns "Grid size N will likely result in GPU under-utilization" on every
# small launch; the course launches small grids on purpose (tests, one-block
# demos) and measures occupancy where it matters, so the warning is off unless
# the user asks for it.
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def cache_dir(name: str) -> Path:
    """The course's cache folder for ``name`` (a dataset, measured peaks, compiled kernels):
    ``$XDG_CACHE_HOME/cuda-python-course/<name>``, ``~/.cache`` by default."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "cuda-python-course" / name


# Kernels declared with cache=True (the capstone's and the chapters') are compiled once
# and kept on disk, here unless NUMBA_CACHE_DIR says otherwise (numba reads it at
# import). Numba recompiles where the kernel's source file, the GPU's compute
# capability or numba-cuda's version changed (not another file the kernel uses);
# deleting the folder clears it.
os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir("numba")))
KERNEL_CACHE_DIR = Path(os.environ["NUMBA_CACHE_DIR"])


def is_simulator() -> bool:
    """True when kernels run in Numba's CUDA simulator rather than on a GPU."""
    return RUNTIME == "simulator"


def torch_cuda_available() -> bool:
    """True on a GPU (not the simulator) with a CUDA build of torch that sees it:
    where the course races its kernels against cuBLAS, cuDNN and cuFFT through
    torch. False in the simulator (torch is not imported then) and where torch is
    not installed."""
    if is_simulator():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def runtime_name() -> str:
    """``"gpu"`` or ``"simulator"``."""
    return RUNTIME


def pick(gpu: T, simulator: T) -> T:
    """Return ``gpu`` on a real GPU and ``simulator`` in the simulator.

    Used to size problems: ``n = pick(gpu=1 << 26, simulator=1000)``. The
    simulator runs every CUDA thread as Python code, so a problem that takes a
    millisecond on a GPU can take hours there.
    """
    return simulator if is_simulator() else gpu


# --------------------------------------------------------------------------
# jit: one kernel definition for both runtimes
# --------------------------------------------------------------------------

from numba import cuda  # noqa: E402  (must follow the runtime choice above)

_SIM_JIT_OPTIONS: frozenset[str] | None = None


def _accepted_options() -> frozenset[str]:
    global _SIM_JIT_OPTIONS
    if _SIM_JIT_OPTIONS is None:
        _SIM_JIT_OPTIONS = frozenset(inspect.signature(cuda.jit).parameters)
    return _SIM_JIT_OPTIONS


def jit(func_or_sig: Any = None, **options: Any) -> Any:
    """``numba.cuda.jit`` that also works in the simulator.

    On a GPU it is ``cuda.jit`` unchanged. In the simulator it drops the options
    the simulator's ``jit`` rejects with a TypeError (``lineinfo``,
    ``max_registers``, ``launch_bounds``, ``forceinline``, ``lto``, ...), which
    only steer code generation and cannot change results.

    Use exactly as ``cuda.jit``: ``@jit``, ``@jit(lineinfo=True)``,
    ``@jit("void(float32[:])", fastmath=True)``.
    """
    if is_simulator():
        accepted = _accepted_options()
        options = {k: v for k, v in options.items() if k in accepted}
    if func_or_sig is None:
        return cuda.jit(**options)
    return cuda.jit(func_or_sig, **options)


def device_name() -> str:
    """The GPU's name (``"NVIDIA H100 80GB HBM3"``), or ``"simulator"``."""
    if is_simulator():
        return "simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def sm_count() -> int:
    """Streaming multiprocessors on the current GPU; 2 in the simulator, which
    keeps grids sized "a few blocks per SM" tiny there."""
    if is_simulator():
        return 2
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b for positive ints: blocks needed to cover a items."""
    if b <= 0:
        raise ValueError(f"ceil_div divisor must be positive, got {b}")
    return -(-a // b)


_interleave_depth = 0
_interleave_lock = threading.Lock()


@contextlib.contextmanager
def interleaved_threads() -> Iterator[None]:
    """While active, the simulator switches its CUDA threads every microsecond.

    Python's default switch interval (5 ms) lets each simulated thread run long
    stretches alone, which hides races that lose updates (a `+=` that needed
    ``cuda.atomic.add``): chapter 05's counter demo runs inside this to show
    them. Blocks also keep the simulator's one OS thread per CUDA thread here.
    No effect on a GPU.
    """
    global _interleave_depth
    with _interleave_lock:
        _interleave_depth += 1
    try:
        yield
    finally:
        with _interleave_lock:
            _interleave_depth -= 1


def interleaving() -> bool:
    """True inside :func:`interleaved_threads` (read by the simulator's block runners)."""
    return _interleave_depth > 0
