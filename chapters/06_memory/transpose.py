"""Coalescing and matrix transpose: out[j, i] = a[i, j], float32, row-major.

Versions (all launch blocks of TILE x ROWS = 32 x 8 threads, one per TILE x TILE tile,
each thread handling TILE / ROWS = 4 rows, so 4 loads are in flight per thread):
  version 0 (copy_2d): a plain copy with the same launch -- the speed of light
      for any kernel that reads and writes every element once.
  version 1 (transpose_naive): reads coalesced, writes strided by a whole row:
      each warp's 32 stores touch 32 different 32-byte sectors.
  version 2 (transpose_smem): stage a tile in shared memory, so both the global
      read and the global write are coalesced; the column read of the tile hits one
      bank 32 times (a 32-way bank conflict).
  version 3 (transpose_smem_padded): a TILE x (TILE + 1) tile: the extra column
      shifts each row by one bank, so a column read touches 32 different banks.
  version 4 (transpose_smem_unsigned): version 3 with unsigned (uint64) indices and
      `threadIdx & 31`: Numba emits no negative-index wraparound code. Tile edge BIG
      (32; 64 x 65 tiles with 32 elements a thread measured the same on an H200).
  version 0w (copy_2d_loads_first): the copy with version 4's launch and indices,
      every load issued before the first store (version 0 stores each element
      before loading the next: one load in flight): the speed of light for v4.

Source: M. Harris, "An Efficient Matrix Transpose in CUDA C/C++", NVIDIA
developer blog (2013).

Run: python chapters/06_memory/transpose.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick
from common.timing import format_table

import functools

import numpy as np
from numba import cuda, float32, uint64

TILE = 32  # tile edge: one warp spans a tile row, so a tile row is one 128-byte line
ROWS = 8  # threads per block along y; each thread copies TILE // ROWS rows
# shared array shapes must be compile-time constants: a module-level int, not
# `TILE + 1` computed inside the kernel (Numba types that as a runtime int64)
TILE_PADDED = TILE + 1  # one spare column: a tile column spans all 32 banks
BIG = 32  # version 4's tile edge (64 measured the same on an H200, with 32 x 4 threads)
BIG_PADDED = BIG + 1
BIG_COLS = BIG // TILE  # columns a thread handles (32 apart)
BIG_ROWS = BIG // ROWS  # rows a thread handles (8 apart)
BIG_PER_THREAD = BIG_COLS * BIG_ROWS  # elements a thread


def transpose_cpu(a: np.ndarray) -> np.ndarray:
    """The transpose in float64, shape (cols, rows)."""
    return a.T.astype(np.float64)


# version 0: copy, same launch and same bytes as a transpose: the bar to reach
@cuda.jit(cache=True)
def copy_2d(a, out):
    x = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    y0 = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    for k in range(0, TILE, ROWS):
        y = y0 + k
        if y < a.shape[0] and x < a.shape[1]:
            out[y, x] = a[y, x]


# version 1: reads coalesced (x runs along a row of a), writes strided by a row of out
@cuda.jit(cache=True)
def transpose_naive(a, out):
    x = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    y0 = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    for k in range(0, TILE, ROWS):
        y = y0 + k
        if y < a.shape[0] and x < a.shape[1]:
            out[x, y] = a[y, x]


# version 2: shared-memory tile: global reads and writes both coalesced; reading a
# tile column is a 32-way bank conflict (tile[tx, .] strides by 32 words = one bank)
@cuda.jit(cache=True)
def transpose_smem(a, out):
    tile = cuda.shared.array((TILE, TILE), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    x = cuda.blockIdx.x * TILE + tx
    y = cuda.blockIdx.y * TILE + ty
    for k in range(0, TILE, ROWS):
        if y + k < a.shape[0] and x < a.shape[1]:
            tile[ty + k, tx] = a[y + k, x]
    cuda.syncthreads()  # the tile is read along columns: other threads wrote them
    x = cuda.blockIdx.y * TILE + tx  # out's column = a's row
    y = cuda.blockIdx.x * TILE + ty
    for k in range(0, TILE, ROWS):
        if y + k < out.shape[0] and x < out.shape[1]:
            out[y + k, x] = tile[tx, ty + k]


# version 3: version 2 with a padded TILE x (TILE + 1) tile: no bank conflicts
@cuda.jit(cache=True)
def transpose_smem_padded(a, out):
    tile = cuda.shared.array((TILE, TILE_PADDED), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    x = cuda.blockIdx.x * TILE + tx
    y = cuda.blockIdx.y * TILE + ty
    for k in range(0, TILE, ROWS):
        if y + k < a.shape[0] and x < a.shape[1]:
            tile[ty + k, tx] = a[y + k, x]
    cuda.syncthreads()
    x = cuda.blockIdx.y * TILE + tx
    y = cuda.blockIdx.x * TILE + ty
    for k in range(0, TILE, ROWS):
        if y + k < out.shape[0] and x < out.shape[1]:
            out[y + k, x] = tile[tx, ty + k]


# version 0w: copy with version 4's launch; all BIG_PER_THREAD loads go to registers
# before the first store (a store to `out` could alias `a`, so the compiler cannot
# hoist a later load above it: version 0 has one load in flight per thread)
@cuda.jit(cache=True)
def copy_2d_loads_first(a, out):
    v = cuda.local.array(BIG_PER_THREAD, float32)  # constant index after unrolling: registers
    rows = a.shape[0]
    cols = a.shape[1]
    x0 = cuda.blockIdx.x * BIG + (cuda.threadIdx.x & 31)  # `&`: provably >= 0
    y0 = cuda.blockIdx.y * BIG + (cuda.threadIdx.y & 7)
    for k in range(BIG_ROWS):
        for c in range(BIG_COLS):
            y = y0 + k * ROWS
            x = x0 + c * TILE
            if y < rows and x < cols:
                v[k * BIG_COLS + c] = a[uint64(y), uint64(x)]  # unsigned: no wraparound fix-up
    for k in range(BIG_ROWS):
        for c in range(BIG_COLS):
            y = y0 + k * ROWS
            x = x0 + c * TILE
            if y < rows and x < cols:
                out[uint64(y), uint64(x)] = v[k * BIG_COLS + c]


# version 4: version 3 with unsigned indices: same loads, stores and barrier, but no
# compare-and-select per index for Python's negative indexing (a[-1]); the tile is
# BIG x (BIG + 1), so a tile column still spans all 32 banks
@cuda.jit(cache=True)
def transpose_smem_unsigned(a, out):
    tile = cuda.shared.array((BIG, BIG_PADDED), float32)
    rows = a.shape[0]
    cols = a.shape[1]
    tx = cuda.threadIdx.x & 31
    ty = cuda.threadIdx.y & 7
    x0 = cuda.blockIdx.x * BIG + tx
    y0 = cuda.blockIdx.y * BIG + ty
    for k in range(BIG_ROWS):
        for c in range(BIG_COLS):
            y = y0 + k * ROWS
            x = x0 + c * TILE
            if y < rows and x < cols:
                tile[uint64(ty + k * ROWS), uint64(tx + c * TILE)] = a[uint64(y), uint64(x)]
    cuda.syncthreads()
    x0 = cuda.blockIdx.y * BIG + tx  # out's column = a's row
    y0 = cuda.blockIdx.x * BIG + ty
    for k in range(BIG_ROWS):
        for c in range(BIG_COLS):
            y = y0 + k * ROWS
            x = x0 + c * TILE
            if y < cols and x < rows:
                out[uint64(y), uint64(x)] = tile[uint64(tx + c * TILE), uint64(ty + k * ROWS)]


def transpose(kernel, a, out) -> None:
    """Launch ``kernel`` on ``a`` (rows, cols) float32 into ``out`` (cols, rows)
    (or (rows, cols) for :func:`copy_2d`).

    Raises:
        TypeError: ``a`` or ``out`` not a float32 device array.
        ValueError: not 2-D, or ``out`` has the wrong shape.
    """
    a = require_device_array(a, "a", ndim=2, dtype=np.float32)
    out = require_device_array(out, "out", ndim=2, dtype=np.float32)
    want = a.shape if kernel in (copy_2d, copy_2d_loads_first) else a.shape[::-1]
    if tuple(out.shape) != tuple(want):
        raise ValueError(f"out must have shape {want}, got {out.shape}")
    edge = BIG if kernel in (copy_2d_loads_first, transpose_smem_unsigned) else TILE
    grid = (ceil_div(a.shape[1], edge), ceil_div(a.shape[0], edge))
    kernel[grid, (TILE, ROWS)](a, out)


def run(shape: tuple[int, int] | None = None) -> list:
    """Check and time every version at ``shape`` (default 8192 x 16384 on a GPU,
    512 MiB). Returns Timings whose ``nbytes`` is 2 * 4 * rows * cols."""
    rows, cols = shape or pick(gpu=(8192, 16384), simulator=(37, 70))  # ragged: 70 = 2 * 32 + 6
    a_host = random_array((rows, cols), np.float32, np.random.default_rng(2))
    a = cuda.to_device(a_host)
    nbytes = 2 * 4 * rows * cols
    title = f"transpose {rows} x {cols} float32 ({4 * rows * cols / 2**20:.0f} MiB)"
    results = run_versions(
        {
            "transpose v0 copy (speed of light)": functools.partial(transpose, copy_2d),
            "transpose v0w copy, loads first, unsigned": functools.partial(
                transpose, copy_2d_loads_first
            ),
        },
        (a,),
        reference=a_host.astype(np.float64),
        out_shape=(rows, cols),
        tol=0.0,
        nbytes=nbytes,
        title=title,
        print_table=False,
    )
    results += run_versions(
        {
            "transpose v1 naive": functools.partial(transpose, transpose_naive),
            "transpose v2 smem tile": functools.partial(transpose, transpose_smem),
            "transpose v3 smem tile 32x33": functools.partial(transpose, transpose_smem_padded),
            "transpose v4 smem tile 32x33, unsigned": functools.partial(
                transpose, transpose_smem_unsigned
            ),
        },
        (a,),
        reference=transpose_cpu(a_host),
        out_shape=(cols, rows),
        tol=0.0,
        nbytes=nbytes,
        title=title,
        print_table=False,
    )
    print(format_table(results, title=title))
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "transpose")


if __name__ == "__main__":
    run_script(main)
