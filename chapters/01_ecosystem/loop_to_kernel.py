"""Why write kernels: a nested Python loop, made fast.

Pairwise squared distances between N points in D dimensions: d[i, j] = sum_k (p[i,k] - p[j,k])**2.

version 0 is three nested Python loops (CPU): the spec; timed on a few rows and scaled up
version 1 is NumPy broadcasting (CPU): builds an N x N x D temporary
version 2 is pairwise_dist_naive: one GPU thread an output d[i, j], a loop over D

Run: python chapters/01_ecosystem/loop_to_kernel.py [--out runs/01_ecosystem]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, pick
from common.checking import check
from common.harness import run_versions
from common.timing import device_peaks, readme_figures, write_json

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda


def pairwise_dist_python(points, rows):
    """The spec: rows [0, rows) of the distance matrix, by three nested loops."""
    n, d = points.shape
    out = np.empty((rows, n), np.float64)
    for i in range(rows):
        for j in range(n):
            s = 0.0
            for k in range(d):
                diff = points[i, k] - points[j, k]
                s += diff * diff
            out[i, j] = s
    return out


def pairwise_dist_numpy(points):
    diff = points[:, None, :] - points[None, :, :]
    return (diff * diff).sum(axis=-1)


# The two outer loops become the grid: thread (x=j, y=i) computes one d[i, j].
# Each thread reads 2D floats and does 3D FLOPs.
@cuda.jit
def pairwise_dist_naive(points, out):
    j, i = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        s = np.float32(0)
        for k in range(points.shape[1]):
            diff = points[i, k] - points[j, k]
            s += diff * diff
        out[i, j] = s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/01_ecosystem", help="folder for loop_to_kernel.json")
    args = parser.parse_args(argv)
    n, d = pick(gpu=(2048, 32), simulator=(20, 3))
    rng = np.random.default_rng(0)
    points_host = rng.standard_normal((n, d)).astype(np.float32)
    p64 = points_host.astype(np.float64)
    sq = (p64 * p64).sum(axis=1)
    reference = sq[:, None] + sq[None, :] - 2 * p64 @ p64.T  # float64: cancellation is harmless

    rows = min(n, 16)
    t0 = time.perf_counter()
    part = pairwise_dist_python(points_host, rows)
    python_ms = (time.perf_counter() - t0) * 1e3 * n / rows
    check(part, reference[:rows], tol=1e-6, name="python loops")
    t0 = time.perf_counter()
    check(pairwise_dist_numpy(points_host), reference, tol=1e-5, name="numpy")
    numpy_ms = (time.perf_counter() - t0) * 1e3
    print(f"pairwise squared distances, {n} points in {d} dimensions; every version is checked "
          "against a float64 reference (rel. error <= 1e-5)")
    print(f"  0 python loops : {python_ms:12.1f} ms (timed on {rows} rows, scaled)")
    print(f"  1 numpy        : {numpy_ms:12.1f} ms")

    points = cuda.to_device(points_host)
    block = (32, 8)
    grid = (ceil_div(n, block[0]), ceil_div(n, block[1]))
    peaks = device_peaks()
    results = run_versions(
        {"2 pairwise_dist_naive": lambda out: pairwise_dist_naive[grid, block](points, out)},
        reference, (n, n), np.float32, tol=1e-5, flops=3 * n * n * d,
        title="GPU kernel", peaks=peaks)
    gpu = results[0]
    if gpu.measured:
        print(f"  the kernel is {python_ms / gpu.median_ms:,.0f}x faster than the Python loops "
              f"and {numpy_ms / gpu.median_ms:,.0f}x faster than NumPy")
    else:
        print(readme_figures(__file__).format())
    out = Path(args.out)
    write_json(results, out / "loop_to_kernel.json", device=peaks["device"], n=n, d=d,
               python_ms=python_ms, numpy_ms=numpy_ms)
    print(f"wrote {out / 'loop_to_kernel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
