"""The checker must fail wrong kernels, not only pass right ones.

Three classic bugs, each in a kernel that is otherwise right, each shown
failing the same checks the exercises use:

* no bounds check: threads past the end of the data write anyway;
* no ``cuda.syncthreads()`` in a tiled matmul: a thread reads a tile entry
  before the thread that loads it has written it (or after the next tile
  overwrote it);
* a plain ``+=`` on a shared counter where ``cuda.atomic.add`` is needed:
  concurrent read-modify-writes lose updates.

In the simulator the races show because tests/conftest.py makes simulated
threads switch every microsecond; on a GPU they show because thousands of
threads really do run at once.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array
from common.runtime import ceil_div, pick

import numpy as np
import pytest
from numba import cuda

TILE = 8  # small tiles keep the simulator fast; the bug does not depend on size


@cuda.jit
def scale_no_bounds(x, out):
    i = cuda.grid(1)
    out[i] = 2 * x[i % x.size]  # BUG: no `if i < out.size`


@cuda.jit
def scale_ok(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 2 * x[i]


def check_scale(kernel, n, rng):
    x = random_array(n, rng=rng)
    g = guarded(n)
    kernel[ceil_div(n, 32), 32](x, g.array)
    cuda.synchronize()
    g.check_untouched()
    check(g.array, 2 * x.astype(np.float64))


def _matmul_tiled(with_barriers):
    @cuda.jit
    def kernel(a, b, c):
        sa = cuda.shared.array((TILE, TILE), dtype=np.float32)
        sb = cuda.shared.array((TILE, TILE), dtype=np.float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        acc = np.float32(0.0)
        for t in range(ceil_div_dev(a.shape[1], TILE)):
            k = t * TILE
            sa[ty, tx] = a[row, k + tx] if row < a.shape[0] and k + tx < a.shape[1] else 0
            sb[ty, tx] = b[k + ty, col] if k + ty < b.shape[0] and col < b.shape[1] else 0
            if with_barriers:
                cuda.syncthreads()
            for j in range(TILE):
                acc += sa[ty, j] * sb[j, tx]
            if with_barriers:
                cuda.syncthreads()
        if row < c.shape[0] and col < c.shape[1]:
            c[row, col] = acc

    return kernel


@cuda.jit(device=True)
def ceil_div_dev(a, b):
    return (a + b - 1) // b


matmul_tiled_ok = _matmul_tiled(True)
matmul_tiled_no_sync = _matmul_tiled(False)


def check_matmul(kernel, m, k, n, rng):
    a, b = random_array((m, k), rng=rng), random_array((k, n), rng=rng)
    g = guarded((m, n))
    kernel[(ceil_div(n, TILE), ceil_div(m, TILE)), (TILE, TILE)](a, b, g.array)
    cuda.synchronize()
    g.check_untouched()
    check(g.array, a.astype(np.float64) @ b, tol=1e-5)


# Grid-stride loops: each thread counts many keys, so in the simulator threads
# overlap in time long enough for their read-modify-writes to interleave.
@cuda.jit
def count_plain(keys, counts):
    for i in range(cuda.grid(1), keys.size, cuda.gridsize(1)):
        counts[keys[i]] += 1  # BUG: read-modify-write races with other threads


@cuda.jit
def count_atomic(keys, counts):
    for i in range(cuda.grid(1), keys.size, cuda.gridsize(1)):
        cuda.atomic.add(counts, keys[i], 1)


def check_histogram(kernel, n, bins, rng, trials=3):
    # A race loses updates only when two threads collide, so a check of a
    # race-prone kernel runs it several times on fresh data.
    for _ in range(trials):
        keys = rng.integers(0, bins, n).astype(np.int32)
        counts = cuda.to_device(np.zeros(bins, np.int32))  # counts start at zero by definition
        kernel[pick(gpu=1024, simulator=2), 128](keys, counts)
        check(counts, np.bincount(keys, minlength=bins))


# -- the correct kernels pass ...


def test_correct_kernels_pass(rng):
    check_scale(scale_ok, 77, rng)
    check_matmul(matmul_tiled_ok, 13, 19, 11, rng)
    check_histogram(count_atomic, pick(gpu=1 << 22, simulator=16384), 4, rng)


# -- ... and each broken one fails the same check


def test_missing_bounds_check_fails(rng):
    with pytest.raises((CheckError, IndexError)):
        check_scale(scale_no_bounds, 77, rng)


def test_missing_syncthreads_in_tiled_matmul_fails(rng):
    m, k, n = pick(gpu=(512, 1024, 512), simulator=(13, 43, 11))
    with pytest.raises(CheckError):
        check_matmul(matmul_tiled_no_sync, m, k, n, rng)


def test_plain_increment_instead_of_atomic_fails(rng):
    # Few bins and many threads: many threads hit the same counter at once.
    with pytest.raises(CheckError):
        check_histogram(count_plain, pick(gpu=1 << 22, simulator=16384), 4, rng)
