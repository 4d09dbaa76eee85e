"""Launch sizing shared by the chapter 06 scripts.

* :func:`grid_stride_blocks` -- blocks for a grid-stride loop: a few full waves of
  the SMs, never more blocks than the data needs.
* :func:`scratch` -- device buffers reused between calls, so timed launchers do
  not pay for ``cudaMalloc`` inside the measurement.
* :func:`zeroed_counter` -- the atomic ticket counter of the last-block kernels.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import ceil_div, sm_count

from typing import Any

import numpy as np
from numba import cuda

# A GPU SM holds at most 2048 resident threads (H100/H200, compute capability 9.0),
# so 8 blocks of 256 threads fill it: one "wave" of the grid.
BLOCKS_PER_SM_256 = 8


def grid_stride_blocks(n: int, threads: int, per_thread: int = 4, waves: int = 1) -> int:
    """Blocks of ``threads`` threads for a grid-stride loop over ``n`` items.

    ``waves`` full waves of the SMs (8 blocks of 256 threads per SM fill one,
    scaled for other block sizes), but no more blocks than needed for each
    thread to get ``per_thread`` items: small inputs get small grids.
    """
    per_sm = max(1, BLOCKS_PER_SM_256 * 256 // threads)
    full = sm_count() * per_sm * waves
    return max(1, min(full, ceil_div(n, threads * per_thread)))


_SCRATCH: dict[tuple[Any, ...], Any] = {}


def scratch(shape: int | tuple[int, ...], dtype: Any, tag: str = "") -> Any:
    """A device array of ``shape``/``dtype`` allocated once per (shape, dtype, tag)
    and reused: its contents are whatever the last user left there."""
    key = (shape, np.dtype(dtype).str, tag)
    if key not in _SCRATCH:
        _SCRATCH[key] = cuda.device_array(shape, dtype=dtype)
    return _SCRATCH[key]


def zeroed_counter(tag: str) -> Any:
    """A one-element int32 device counter, zero on creation (kernels that use it
    must leave it at zero when they finish)."""
    key = ((1,), "counter", tag)
    if key not in _SCRATCH:
        _SCRATCH[key] = cuda.to_device(np.zeros(1, dtype=np.int32))
    return _SCRATCH[key]
