"""Chapter 5: hostile checks for the exercises, broken kernels that must fail
them, and the chapter scripts run at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick
from common.checking import (
    CheckError,
    check,
    guarded,
    hostile_sizes,
    random_array,
    rounding_tolerance,
)
from common.internal import racecheck
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches
from common.internal.racecheck import RaceError

import numpy as np
import pytest
from numba import cuda

CHAPTER = "05_first_kernels"
# A wrong kernel either raises IndexError (simulator, out of bounds) or leaves a wrong output.
FAILS = (CheckError, IndexError)


def _dev(a):
    return cuda.to_device(a)


def _dev_with_junk_after(a, junk=1e30, count=256):
    """A device view of ``a`` followed, in the same allocation, by ``junk``: a kernel
    reading past the end gets a visibly wrong value on a GPU too (the simulator
    raises IndexError)."""
    return cuda.to_device(np.concatenate([a, np.full(count, junk, a.dtype)]))[: a.size]


def _shapes_2d(rng):
    # Non-square, not multiples of a 16x16 block, single row/column and single element.
    return [
        (1, 1),
        (1, 17),
        (19, 1),
        (17, 5),
        (5, 33),
        tuple(int(v) for v in rng.integers(2, 40, 2)),
    ]


# ------------------------------------------------------------------ check functions


def check_scaled_add(fn, rng):
    with float32_pure_launches():  # alpha must reach the kernel as a float32
        for threads in (32, 128):
            for n in hostile_sizes(threads, rng) + [2 * threads]:  # and an exact multiple
                x, y = random_array(n, rng=rng), random_array(n, rng=rng)
                alpha = float(rng.uniform(-3, 3))
                out = guarded(n)
                fn(alpha, _dev(x), _dev(y), out.array, threads_per_block=threads)
                ref = alpha * x.astype(np.float64) + y
                # float32 alpha, product and sum: up to 3 eps32 (|alpha x| + |y|) an
                # element, more than 1e-6 relative where they nearly cancel (n = 1).
                terms = np.abs(alpha * x.astype(np.float64)) + np.abs(y)
                tol = rounding_tolerance(ref, terms, 3, 1e-6)
                check(out.array, ref, tol=tol, name=f"scaled_add n={n} block={threads}")
                out.check_untouched(f"scaled_add n={n} block={threads}")


def check_map_2d(fn, rng):
    with float32_pure_launches():
        for block in ((16, 16), (32, 4), (4, 8)):
            for shape in _shapes_2d(rng):
                x = random_array(shape, rng=rng)
                out = guarded(shape)
                fn(_dev(x), out.array, block=block)
                r, c = np.indices(shape)
                check(out.array, 2.0 * x + c - r, tol=1e-6, name=f"map_2d {shape} block={block}")
                out.check_untouched(f"map_2d {shape}")


def check_broadcast_add(fn, rng):
    # Non-square blocks: a kernel using blockDim.x where it means blockDim.y (rows)
    # is right whenever the two are equal.
    with float32_pure_launches():
        for block in ((8, 8), (8, 2), (2, 16)):
            for shape in _shapes_2d(rng) + [(16, 8)]:  # exact multiples of every block
                x = random_array(shape, rng=rng)
                row, col = random_array(shape[1], rng=rng), random_array(shape[0], rng=rng)
                out = guarded(shape)
                fn(_dev(x), _dev(row), _dev(col), out.array, block=block)
                ref = x.astype(np.float64) + row[None, :] + col[:, None]
                # Two float32 additions round by up to 2 eps32 (|x| + |row| + |col|) an
                # element: more than 1e-6 relative where the terms nearly cancel (a
                # 1x1 output, now and then). A wrong index is off by O(1).
                terms = np.abs(x.astype(np.float64)) + np.abs(row)[None, :] + np.abs(col)[:, None]
                tol = rounding_tolerance(ref, terms, 2, 1e-6)
                check(out.array, ref, tol=tol, name=f"broadcast_add {shape} block={block}")
                out.check_untouched(f"broadcast_add {shape}")


def check_clamp(fn, rng):
    # Fixed grids much smaller than n: only a grid-stride loop covers everything.
    with float32_pure_launches():
        for blocks, threads in ((1, 32), (2, 64), (3, 32)):
            for n in (1, blocks * threads - 1, 2 * blocks * threads, 5 * blocks * threads + 3):
                x = random_array(n, rng=rng) * 3
                lo, hi = sorted(float(v) for v in rng.uniform(-2, 2, 2))
                out = guarded(n)
                fn(
                    _dev_with_junk_after(x),
                    lo,
                    hi,
                    out.array,
                    blocks=blocks,
                    threads_per_block=threads,
                )
                ref = np.clip(x, np.float32(lo), np.float32(hi))
                check(out.array, ref, tol=0, name=f"clamp n={n} grid={blocks}x{threads}")
                out.check_untouched(f"clamp n={n}")


def check_batched_matmul(fn, rng):
    dims = [(1, 1, 1, 1), (3, 5, 7, 9), (2, 9, 4, 3), tuple(int(v) for v in rng.integers(1, 10, 4))]
    # (4, 4, 2) has blockDim.x == blockDim.y: a kernel that takes one for the other
    # is right there; the other two blocks are not square.
    with float32_pure_launches():
        for block in ((4, 4, 2), (4, 2, 3), (2, 8, 1)):
            for batch, m, k, n in dims:
                a = random_array((batch, m, k), rng=rng)
                b = random_array((batch, k, n), rng=rng)
                out = guarded((batch, m, n))
                fn(_dev(a), _dev(b), out.array, block=block)
                ref = np.matmul(a.astype(np.float64), b)
                check(
                    out.array,
                    ref,
                    tol=1e-5,
                    name=f"batched_matmul {(batch, m, k, n)} block={block}",
                )
                out.check_untouched("batched_matmul")


def check_count_above(fn, rng, runs=2):
    # The threshold is one of the values itself in every other run (a tie: `>` counts
    # it, `>=` does not), and junk past the end of x is above any threshold, so a
    # thread reading past the end counts one too many on a GPU. A lost update (a plain
    # +=) is reported by the simulator's race detector on the first launch; on a GPU
    # it loses counts in practically every launch of 128 threads or more.
    with float32_pure_launches():
        for n in (1, 127, 128, 300):
            for run in range(runs):
                x = random_array(n, rng=rng)
                x[rng.integers(n, size=max(n // 8, 1))] = x[0]  # several ties with x[0]
                threshold = float(x[0]) if run % 2 == 0 else float(rng.uniform(-1, 0.5))
                got = fn(_dev_with_junk_after(x), threshold, threads_per_block=128)
                expected = int((x > np.float32(threshold)).sum())
                check(
                    np.int64(got),
                    np.int64(expected),
                    name=f"count_above n={n} threshold={threshold!r} (elements equal to "
                    "the threshold are not above it)",
                )


# ------------------------------------------------------------------ the exercises

# exercise function -> its check; each runs on solutions.py and on exercises.py
# (select one with -k, e.g. -k "scaled_add and learner").
CHECKS = {
    "scaled_add": check_scaled_add,
    "map_2d": check_map_2d,
    "broadcast_add": check_broadcast_add,
    "clamp": check_clamp,
    "batched_matmul": check_batched_matmul,
    "count_above": check_count_above,
}


@pytest.mark.parametrize("impl", implementations(CHAPTER))
@pytest.mark.parametrize("exercise", CHECKS)
def test_exercise(exercise, impl, rng):
    CHECKS[exercise](getattr(impl, exercise), rng)


def test_launchers_reject_bad_inputs():
    sol = load_chapter_module(CHAPTER, "solutions")
    x = _dev(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="host .NumPy. array; copy it to the GPU"):
        sol.scaled_add(1.0, np.ones(8, np.float32), x, x)
    with pytest.raises(TypeError, match="float32"):
        sol.scaled_add(1.0, _dev(np.ones(8, np.float64)), x, x)
    with pytest.raises(ValueError, match="shapes differ"):
        sol.scaled_add(1.0, _dev(np.ones(7, np.float32)), x, x)
    with pytest.raises(ValueError, match="chain"):
        a = _dev(np.ones((2, 3, 4), np.float32))
        sol.batched_matmul(a, a, _dev(np.ones((2, 3, 4), np.float32)))
    with pytest.raises(ValueError, match="lo <= hi"):
        sol.clamp(x, 1.0, -1.0, x)


# ------------------------------------------------------------------ broken kernels must fail

# Each broken kernel is a right one (solutions.py, indexing_2d_3d.py) copied with one
# line made wrong on purpose, as its comment says: the checks above must catch each.


@cuda.jit
def _scaled_add_no_bounds_check(alpha, x, y, out):
    i = cuda.grid(1)
    out[i] = alpha * x[i] + y[i]


def _broken_scaled_add(alpha, x, y, out, threads_per_block=128):
    blocks = ceil_div(out.size, threads_per_block)
    _scaled_add_no_bounds_check[blocks, threads_per_block](np.float32(alpha), x, y, out)


@cuda.jit
def _map_2d_rows_cols_swapped(x, out):
    r, c = cuda.grid(2)  # wrong: grid x walks columns in the launcher
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = np.float32(2) * x[r, c] + np.float32(c - r)


def _broken_map_2d(x, out, block=(16, 16)):
    rows, cols = out.shape
    _map_2d_rows_cols_swapped[(ceil_div(cols, block[0]), ceil_div(rows, block[1])), block](x, out)


@cuda.jit
def _broadcast_add_vectors_swapped(x, row, col, out):
    c, r = cuda.grid(2)
    if r < out.shape[0] and c < out.shape[1] and r < row.size and c < col.size:
        out[r, c] = x[r, c] + row[r] + col[c]


def _broken_broadcast_add(x, row, col, out, block=(16, 16)):
    rows, cols = out.shape
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    _broadcast_add_vectors_swapped[grid, block](x, row, col, out)


@cuda.jit
def _clamp_one_pass(x, lo, hi, out):
    i = cuda.grid(1)  # no grid-stride loop: elements past the grid are never written
    if i < out.size:
        out[i] = min(max(x[i], lo), hi)


def _broken_clamp(x, lo, hi, out, blocks=2, threads_per_block=64):
    _clamp_one_pass[blocks, threads_per_block](x, np.float32(lo), np.float32(hi), out)


@cuda.jit
def _batched_matmul_first_batch_only(a, b, out):
    j, i, z = cuda.grid(3)
    if z < out.shape[0] and i < out.shape[1] and j < out.shape[2]:
        acc = np.float32(0)
        for k in range(a.shape[2]):
            acc += a[0, i, k] * b[0, k, j]  # wrong: ignores the batch index
        out[z, i, j] = acc


def _broken_batched_matmul(a, b, out, block=(8, 8, 2)):
    batch, m, _ = a.shape
    n = b.shape[2]
    grid = (ceil_div(n, block[0]), ceil_div(m, block[1]), ceil_div(batch, block[2]))
    _batched_matmul_first_batch_only[grid, block](a, b, out)


@cuda.jit
def _count_above_plain_increment(x, threshold, counter):
    i = cuda.grid(1)
    # The barrier lines every thread of the block up, as a warp is on a GPU; in the
    # simulator it keeps them all alive at once so their read-modify-writes overlap.
    cuda.syncthreads()
    if i < x.size and x[i] > threshold:
        counter[0] += 1  # wrong: read, add, write by many threads at once loses updates


def _broken_count_above(x, threshold, threads_per_block=128):
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    blocks = ceil_div(x.size, threads_per_block)
    _count_above_plain_increment[blocks, threads_per_block](x, np.float32(threshold), counter)
    return int(counter.copy_to_host()[0])


def _broken_scaled_add_python_float(alpha, x, y, out, threads_per_block=128):
    sol = load_chapter_module(CHAPTER, "solutions")
    blocks = ceil_div(out.size, threads_per_block)
    # alpha stays a Python float: the kernel computes alpha * x in float64. The
    # simulator stores the same float32 values; only the float64 check sees it.
    sol.scaled_add_kernel[blocks, threads_per_block](alpha, x, y, out)


@cuda.jit
def _broadcast_add_block_dim_x_for_rows(x, row, col, out):
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.y  # wrong: blockDim.y
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = x[r, c] + row[c] + col[r]


def _broken_broadcast_add_block_dim(x, row, col, out, block=(16, 16)):
    rows, cols = out.shape
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    _broadcast_add_block_dim_x_for_rows[grid, block](x, row, col, out)


@cuda.jit
def _batched_matmul_block_dim_x_for_rows(a, b, out):
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.y  # wrong: blockDim.y
    z = cuda.blockIdx.z * cuda.blockDim.z + cuda.threadIdx.z
    if z < out.shape[0] and i < out.shape[1] and j < out.shape[2]:
        acc = np.float32(0)
        for k in range(a.shape[2]):
            acc += a[z, i, k] * b[z, k, j]
        out[z, i, j] = acc


def _broken_batched_matmul_block_dim(a, b, out, block=(8, 8, 2)):
    batch, m, _ = a.shape
    grid = (ceil_div(b.shape[2], block[0]), ceil_div(m, block[1]), ceil_div(batch, block[2]))
    _batched_matmul_block_dim_x_for_rows[grid, block](a, b, out)


@cuda.jit
def _count_at_least(x, threshold, counter):
    i = cuda.grid(1)
    if i < x.size and x[i] >= threshold:  # wrong: counts values equal to the threshold
        cuda.atomic.add(counter, 0, 1)


def _broken_count_above_ties(x, threshold, threads_per_block=128):
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    _count_at_least[ceil_div(x.size, threads_per_block), threads_per_block](
        x, np.float32(threshold), counter
    )
    return int(counter.copy_to_host()[0])


@cuda.jit
def _count_above_no_bounds_check(x, threshold, counter):
    i = cuda.grid(1)
    if x[i] > threshold:  # threads past the end read past the end of x
        cuda.atomic.add(counter, 0, 1)


def _broken_count_above_no_bounds(x, threshold, threads_per_block=128):
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    _count_above_no_bounds_check[ceil_div(x.size, threads_per_block), threads_per_block](
        x, np.float32(threshold), counter
    )
    return int(counter.copy_to_host()[0])


@pytest.mark.parametrize(
    "check_fn, broken",
    [
        (check_scaled_add, _broken_scaled_add),
        (check_scaled_add, _broken_scaled_add_python_float),
        (check_map_2d, _broken_map_2d),
        (check_broadcast_add, _broken_broadcast_add),
        (check_broadcast_add, _broken_broadcast_add_block_dim),
        (check_clamp, _broken_clamp),
        (check_batched_matmul, _broken_batched_matmul),
        (check_batched_matmul, _broken_batched_matmul_block_dim),
        (check_count_above, _broken_count_above_ties),
        (check_count_above, _broken_count_above_no_bounds),
    ],
    ids=[
        "no-bounds-check",
        "python-float-alpha",
        "rows-cols-swapped",
        "vectors-swapped",
        "broadcast-blockdim-x-for-rows",
        "no-grid-stride",
        "batch-ignored",
        "matmul-blockdim-x-for-rows",
        "count-ties-with-ge",
        "count-reads-past-end",
    ],
)
def test_broken_kernels_fail(check_fn, broken, rng):
    with pytest.raises(FAILS):
        check_fn(broken, rng)


def test_plain_increment_loses_counts(rng):
    # Simulator: the race detector names the race on the first launch. GPU: the counts
    # come out low (checked over several launches, though one nearly always suffices).
    with pytest.raises(RaceError if is_simulator() and racecheck.ENABLED else CheckError):
        check_count_above(_broken_count_above, rng, runs=pick(gpu=3, simulator=1))


# ------------------------------------------------------------------ the chapter scripts


def test_hello_threads_main():
    # the other scripts run (once) in tests/test_scripts_simulator_output.py
    assert load_chapter_module(CHAPTER, "hello_threads").main([]) == 0


def test_out_of_bounds_demo_detects_the_overrun():
    oob = load_chapter_module(CHAPTER, "out_of_bounds")
    outcome = oob.launch_without_bounds_check(n=100, threads_per_block=64)
    if is_simulator():
        assert outcome.startswith("IndexError")
    else:  # 128 threads for 100 elements: 28 stray writes land in the guard cells
        assert outcome.startswith("no error raised; 28 guard cells written"), outcome
