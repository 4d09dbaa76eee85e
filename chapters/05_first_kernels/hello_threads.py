"""Hello, threads: who am I inside a kernel?

version 1 hello_threads prints threadIdx / blockIdx / blockDim / gridDim from every thread
version 2 global_index_1d writes cuda.grid(1) = blockIdx.x * blockDim.x + threadIdx.x per thread
version 3 global_index_2d writes (row, col) from cuda.grid(2) for a 2-D grid of 2-D blocks

Run: python chapters/05_first_kernels/hello_threads.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import check, poisoned
from common.harness import run_script

import argparse
import sys

import numpy as np
from numba import cuda


# Every thread runs the same code; only these built-in coordinates tell them apart.
@cuda.jit(cache=True)
def hello_threads():
    print(
        "block",
        cuda.blockIdx.x,
        "of",
        cuda.gridDim.x,
        "| thread",
        cuda.threadIdx.x,
        "of",
        cuda.blockDim.x,
        "| global index",
        cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x,
    )


# cuda.grid(1) is the one-liner for blockIdx.x * blockDim.x + threadIdx.x.
@cuda.jit(cache=True)
def global_index_1d(out):
    i = cuda.grid(1)
    if i < out.size:  # the last block may stick out past the array
        out[i] = i


# cuda.grid(2) returns (x, y); we let x walk columns so neighbouring threads write
# neighbouring addresses (chapter 6 measures why that matters).
@cuda.jit(cache=True)
def global_index_2d(rows_out, cols_out):
    col, row = cuda.grid(2)
    if row < rows_out.shape[0] and col < rows_out.shape[1]:
        rows_out[row, col] = row
        cols_out[row, col] = col


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help

    print("hello_threads[2, 4]: 2 blocks of 4 threads (lines may come in any order)")
    hello_threads[2, 4]()
    cuda.synchronize()  # kernel printf output is flushed when the GPU is done
    sys.stdout.flush()

    n, threads = 10, 4
    out = poisoned(n, np.int32)
    global_index_1d[ceil_div(n, threads), threads](out)
    check(out, np.arange(n, dtype=np.int32), name="global_index_1d")
    print(
        f"global_index_1d: {ceil_div(n, threads)} blocks x {threads} threads cover "
        f"{n} elements: {' '.join(map(str, out.copy_to_host()))}  OK"
    )

    rows, cols, block = 5, 7, (4, 2)
    r_out, c_out = poisoned((rows, cols), np.int32), poisoned((rows, cols), np.int32)
    grid = (ceil_div(cols, block[0]), ceil_div(rows, block[1]))
    global_index_2d[grid, block](r_out, c_out)
    r_ref, c_ref = np.indices((rows, cols), dtype=np.int32)
    check(r_out, r_ref, name="row index")
    check(c_out, c_ref, name="column index")
    print(f"global_index_2d: grid {grid} of blocks {block} covers a {rows}x{cols} array  OK")
    print(f"row index of each element:\n{r_out.copy_to_host()}")
    return 0


if __name__ == "__main__":
    run_script(main)
