"""Memory is a flat array: row-major layout, strides, views vs copies, and why A.T is not free.

part 1 (NumPy) flat index arithmetic i * ncols + j, strides, views vs copies, contiguity
part 2 (NumPy) integer widths: int32 index arithmetic that overflows for a large matrix
version 1 copy_2d on a row-major array: neighbouring threads read neighbouring addresses
version 2 copy_2d on A.T (a strided view): the same kernel; neighbouring threads read
          addresses ncols * 4 bytes apart, so each warp touches 32 different 32-byte sectors

Run: python chapters/03_python_for_kernels/memory_layout.py [--out runs/03_python_for_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, pick
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import device_peaks, readme_figures

from functools import partial

import numpy as np
from numba import cuda


def show_flat_layout():
    """Print how a 3x4 float32 matrix sits in memory and what its strides mean."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    print("a = np.arange(12).reshape(3, 4), float32:")
    print(a)
    print(f"  in memory (row-major, C order): {' '.join(f'{v:.0f}' for v in a.ravel(order='K'))}")
    print(f"  a.strides = {a.strides} bytes: +16 to go down a row, +4 to go right")
    i, j = 2, 1
    print(
        f"  a[{i}, {j}] = {a[i, j]:.0f} sits at flat position i * ncols + j = "
        f"{i} * 4 + {j} = {i * 4 + j}"
    )
    t = a.T
    print(f"  a.T.strides = {t.strides}: the same memory, strides swapped (a view, no copy)")
    print(
        f"  a.T is C-contiguous: {t.flags['C_CONTIGUOUS']}; shares memory with a: "
        f"{np.shares_memory(a, t)}"
    )
    s = a[:, ::2]
    print(f"  a[:, ::2].strides = {s.strides}: a view that skips every other column")
    c = np.ascontiguousarray(t)
    print(f"  np.ascontiguousarray(a.T).strides = {c.strides}: a copy, rows laid out again")


def show_int_overflow():
    """Print an int32 flat index that wraps around for a 50_000 x 50_000 matrix."""
    i, j, ncols = np.int32(49_999), np.int32(49_999), np.int32(50_000)
    with np.errstate(over="ignore"):
        wrapped = i * ncols + j
    exact = int(i) * int(ncols) + int(j)
    print(f"flat index of the last element of a 50,000 x 50,000 matrix: {exact:,}")
    print(f"  in int32 arithmetic: {int(wrapped):,} (wrapped past 2**31 - 1 = {2**31 - 1:,})")
    print("  Python ints never overflow; NumPy and kernel integers do (int32, int64).")


# The same kernel for both layouts: thread (x=col, y=row) copies src[row, col].
# Cost: 4 bytes read + 4 written a thread; whether a warp's 32 reads fall in four
# 32-byte sectors (one 128-byte line) or in 32 sectors depends only on src's strides.
@cuda.jit(cache=True)
def copy_2d(src, dst):
    col, row = cuda.grid(2)
    if row < dst.shape[0] and col < dst.shape[1]:
        dst[row, col] = src[row, col]


def main(argv=None):
    args = script_parser(__doc__, "03_python_for_kernels").parse_args(argv)
    show_flat_layout()
    print()
    show_int_overflow()
    print()

    n = pick(gpu=8192, simulator=24)
    rng = np.random.default_rng(0)
    a_host = rng.standard_normal((n, n + 3)).astype(np.float32)
    at_view = a_host.T  # (n + 3, n), strides (4, 4 * (n + 3))
    src_contiguous = cuda.to_device(np.ascontiguousarray(at_view))
    src_strided = cuda.to_device(at_view)  # keeps the swapped strides on the device
    print(
        f"device copies of A.T: contiguous strides {src_contiguous.strides}, "
        f"view strides {src_strided.strides}"
    )
    block = (32, 8)
    rows, cols = at_view.shape
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    peaks = device_peaks()
    # The versions differ only in their source: the same launch, bound to each.
    results = run_versions(
        {
            "1 copy_2d, row-major source": partial(copy_2d[grid, block], src_contiguous),
            "2 copy_2d, A.T view source": partial(copy_2d[grid, block], src_strided),
        },
        (),
        at_view.astype(np.float64),
        at_view.shape,
        np.float32,
        tol=0,
        nbytes=2 * 4 * at_view.size,
        title=f"reading A.T in a kernel ({rows}x{cols} float32)",
        peaks=peaks,
    )
    print(
        "both versions checked against A.T (exact): same values, only the memory order "
        "of the reads differs"
    )
    if results[0].measured:
        print(f"  the strided read is {results[1].median_ms / results[0].median_ms:.1f}x slower")
    else:
        print(readme_figures(__file__).format())
    save_results(results, args.out, "memory_layout", n=n)
    return 0


if __name__ == "__main__":
    run_script(main)
