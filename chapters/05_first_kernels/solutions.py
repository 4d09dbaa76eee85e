"""Chapter 5 exercises, solved. Same functions as exercises.py; tests check both.

Run the checks: python -m pytest tests/test_ch05_first_kernels.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import require_device_array

import numpy as np
from numba import cuda

# ---------------------------------------------------------------- 5.1 scaled add


@cuda.jit(cache=True)
def scaled_add_kernel(alpha, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = alpha * x[i] + y[i]


def scaled_add(alpha, x, y, out, threads_per_block=128):
    """Exercise 5.1: ``out = alpha * x + y`` (SAXPY, BLAS level 1).

    Args:
        alpha: Python float, converted to float32.
        x, y, out: float32 device arrays of shape (n,), n >= 1.
        threads_per_block: block size; launch ceil_div(n, threads_per_block) blocks,
            one thread an element, so threads past n must do nothing.

    Raises:
        TypeError / ValueError: non-device arrays, wrong dtype, mismatched shapes.
    """
    for name, arr in (("x", x), ("y", y), ("out", out)):
        require_device_array(arr, name, 1, np.float32)
    if not x.shape == y.shape == out.shape:
        raise ValueError(f"x, y, out shapes differ: {x.shape}, {y.shape}, {out.shape}")
    blocks = ceil_div(out.size, threads_per_block)
    scaled_add_kernel[blocks, threads_per_block](np.float32(alpha), x, y, out)


# ---------------------------------------------------------------- 5.2 2D map


@cuda.jit(cache=True)
def map_2d_kernel(x, out):
    c, r = cuda.grid(2)  # x-dimension -> column: neighbouring threads touch neighbouring memory
    if r < out.shape[0] and c < out.shape[1]:
        # float32 throughout: an int (2, c - r) mixed with a float32 is a float64 in Numba
        out[r, c] = np.float32(2) * x[r, c] + np.float32(c - r)


def map_2d(x, out, block=(16, 16)):
    """Exercise 5.2: ``out[r, c] = 2 * x[r, c] + c - r`` for a 2-D float32 array.

    Compute in float32: in a kernel an int (``2``, ``c - r``) times or plus a float32
    is a float64, so write ``np.float32(2)`` and ``np.float32(c - r)``.

    Args:
        x, out: float32 device arrays of shape (rows, cols), any sizes >= 1.
        block: (threads in x, threads in y); thread x-index walks columns, y-index rows.
            Grid: (ceil_div(cols, block[0]), ceil_div(rows, block[1])).

    Raises:
        TypeError / ValueError: wrong dtype, dimensions or mismatched shapes.
    """
    require_device_array(x, "x", 2, np.float32)
    require_device_array(out, "out", 2, np.float32)
    if x.shape != out.shape:
        raise ValueError(f"x and out shapes differ: {x.shape} vs {out.shape}")
    rows, cols = out.shape
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    map_2d_kernel[grid, block](x, out)


# ---------------------------------------------------------------- 5.3 broadcast


@cuda.jit(cache=True)
def broadcast_add_kernel(x, row, col, out):
    c, r = cuda.grid(2)
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = x[r, c] + row[c] + col[r]


def broadcast_add(x, row, col, out, block=(16, 16)):
    """Exercise 5.3: ``out = x + row[None, :] + col[:, None]`` (NumPy broadcasting, by hand).

    Args:
        x, out: float32 device arrays (rows, cols).
        row: float32 device array (cols,), added to every row.
        col: float32 device array (rows,), added to every column.
        block: as in :func:`map_2d`.

    Raises:
        TypeError / ValueError: wrong dtypes or shapes.
    """
    require_device_array(x, "x", 2, np.float32)
    require_device_array(out, "out", 2, np.float32)
    require_device_array(row, "row", 1, np.float32)
    require_device_array(col, "col", 1, np.float32)
    rows, cols = x.shape
    if out.shape != x.shape or row.shape != (cols,) or col.shape != (rows,):
        raise ValueError(
            f"need out {x.shape}, row ({cols},), col ({rows},); "
            f"got {out.shape}, {row.shape}, {col.shape}"
        )
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    broadcast_add_kernel[grid, block](x, row, col, out)


# ---------------------------------------------------------------- 5.4 clamp


@cuda.jit(cache=True)
def clamp_grid_stride_kernel(x, lo, hi, out):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out.size, stride):
        out[i] = min(max(x[i], lo), hi)


def clamp(x, lo, hi, out, blocks=2, threads_per_block=64):
    """Exercise 5.4: ``out = np.clip(x, lo, hi)`` with a grid-stride loop.

    The grid is fixed (``blocks`` x ``threads_per_block``) whatever n is, so each
    thread handles elements start, start + gridsize, start + 2 * gridsize, ...

    Args:
        x, out: float32 device arrays (n,).
        lo, hi: Python floats, lo <= hi, converted to float32.

    Raises:
        TypeError / ValueError: wrong arrays, or lo > hi.
    """
    require_device_array(x, "x", 1, np.float32)
    require_device_array(out, "out", 1, np.float32)
    if x.shape != out.shape:
        raise ValueError(f"x and out shapes differ: {x.shape} vs {out.shape}")
    if lo > hi:
        raise ValueError(f"need lo <= hi, got lo={lo}, hi={hi}")
    clamp_grid_stride_kernel[blocks, threads_per_block](x, np.float32(lo), np.float32(hi), out)


# ---------------------------------------------------------------- 5.5 batched matmul


@cuda.jit(cache=True)
def batched_matmul_kernel(a, b, out):
    j, i, z = cuda.grid(3)  # column, row, batch
    if z < out.shape[0] and i < out.shape[1] and j < out.shape[2]:
        acc = np.float32(0)
        for k in range(a.shape[2]):
            acc += a[z, i, k] * b[z, k, j]
        out[z, i, j] = acc


def batched_matmul(a, b, out, block=(8, 8, 2)):
    """Exercise 5.5: ``out[z] = a[z] @ b[z]`` for every batch index z.

    Args:
        a: float32 device array (batch, M, K); b: (batch, K, N); out: (batch, M, N).
        block: threads in (x: columns N, y: rows M, z: batch); grid covers all three.

    Raises:
        TypeError / ValueError: wrong dtypes, or shapes that do not chain.
    """
    for name, arr in (("a", a), ("b", b), ("out", out)):
        require_device_array(arr, name, 3, np.float32)
    batch, m, k = a.shape
    if b.shape[:2] != (batch, k) or out.shape != (batch, m, b.shape[2]):
        raise ValueError(f"shapes do not chain: a {a.shape}, b {b.shape}, out {out.shape}")
    n = b.shape[2]
    grid = (ceil_div(n, block[0]), ceil_div(m, block[1]), ceil_div(batch, block[2]))
    batched_matmul_kernel[grid, block](a, b, out)


# ---------------------------------------------------------------- 5.6 counting with atomics


@cuda.jit(cache=True)
def count_above_kernel(x, threshold, counter):
    i = cuda.grid(1)
    if i < x.size and x[i] > threshold:
        cuda.atomic.add(counter, 0, 1)


def count_above(x, threshold, threads_per_block=128):
    """Exercise 5.6: the number of elements of ``x`` greater than ``threshold``.

    Every thread whose element passes adds 1 to one int32 counter in global
    memory, with ``cuda.atomic.add`` (a plain ``+=`` loses updates when threads race).

    Args:
        x: float32 device array (n,).
        threshold: Python float.

    Returns:
        int, equal to ``int((x > threshold).sum())``.
    """
    require_device_array(x, "x", 1, np.float32)
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    blocks = ceil_div(x.size, threads_per_block)
    count_above_kernel[blocks, threads_per_block](x, np.float32(threshold), counter)
    return int(counter.copy_to_host()[0])
