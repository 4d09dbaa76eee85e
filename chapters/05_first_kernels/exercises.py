"""Chapter 5 exercises: your first kernels. Fill each kernel's TODO lines, then
delete the ``raise NotImplementedError`` line in its launcher.

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
    # TODO: the global index of this thread (cuda.grid)
    # TODO: threads past the end do nothing; the others write alpha * x + y
    pass


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
    raise NotImplementedError(
        "Exercise 5.1: write scaled_add's kernel above, then delete this line"
    )
    for name, arr in (("x", x), ("y", y), ("out", out)):
        require_device_array(arr, name, 1, np.float32)
    if not x.shape == y.shape == out.shape:
        raise ValueError(f"x, y, out shapes differ: {x.shape}, {y.shape}, {out.shape}")
    blocks = ceil_div(out.size, threads_per_block)
    scaled_add_kernel[blocks, threads_per_block](np.float32(alpha), x, y, out)


# ---------------------------------------------------------------- 5.2 2D map


@cuda.jit(cache=True)
def map_2d_kernel(x, out):
    # TODO: column and row of this thread (x walks columns)
    # TODO: guard both dimensions, then write out[r, c]
    pass


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
    raise NotImplementedError("Exercise 5.2: write map_2d's kernel above, then delete this line")
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
    # TODO: column and row of this thread, guarded
    # TODO: row is indexed by the column, col by the row
    pass


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
    raise NotImplementedError(
        "Exercise 5.3: write broadcast_add's kernel above, then delete this line"
    )
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
    # TODO: start at this thread's global index, step by the whole grid (cuda.gridsize)
    # TODO: clamp each element to [lo, hi]
    pass


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
    raise NotImplementedError("Exercise 5.4: write clamp's kernel above, then delete this line")
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
    # TODO: column, row and batch index of this thread (cuda.grid(3))
    # TODO: guard all three; sum a[z, i, k] * b[z, k, j] over k in a float32 accumulator
    pass


def batched_matmul(a, b, out, block=(8, 8, 2)):
    """Exercise 5.5: ``out[z] = a[z] @ b[z]`` for every batch index z.

    Args:
        a: float32 device array (batch, M, K); b: (batch, K, N); out: (batch, M, N).
        block: threads in (x: columns N, y: rows M, z: batch); grid covers all three.

    Raises:
        TypeError / ValueError: wrong dtypes, or shapes that do not chain.
    """
    raise NotImplementedError(
        "Exercise 5.5: write batched_matmul's kernel above, then delete this line"
    )
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
    # TODO: guarded global index; if x[i] > threshold add 1 to counter[0] atomically
    pass


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
    raise NotImplementedError(
        "Exercise 5.6: write count_above's kernel above, then delete this line"
    )
    require_device_array(x, "x", 1, np.float32)
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    blocks = ceil_div(x.size, threads_per_block)
    count_above_kernel[blocks, threads_per_block](x, np.float32(threshold), counter)
    return int(counter.copy_to_host()[0])
