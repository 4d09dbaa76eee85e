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
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import cpu_ms, device_peaks, readme_figures

from functools import partial

import numpy as np
from numba import cuda


def pairwise_dist_python(points, out):
    """The spec, by three nested loops: out[i, j] for the first out.shape[0] points i
    (out may hold fewer rows than there are points: the loops are slow)."""
    d = points.shape[1]
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            s = 0.0
            for k in range(d):
                diff = points[i, k] - points[j, k]
                s += diff * diff
            out[i, j] = s


def pairwise_dist_numpy(points, out):
    diff = points[:, None, :] - points[None, :, :]
    (diff * diff).sum(axis=-1, out=out)


# The two outer loops become the grid: thread (x=j, y=i) computes one d[i, j].
# Each thread reads 2D floats and does 3D FLOPs.
@cuda.jit(cache=True)
def pairwise_dist_naive(points, out):
    j, i = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        s = np.float32(0)
        for k in range(points.shape[1]):
            diff = points[i, k] - points[j, k]
            s += diff * diff
        out[i, j] = s


def pairwise_dist(points, out, block=(32, 8)):
    """Launch version 2 on points (N, D) -> out (N, N), float32 device arrays."""
    grid = (ceil_div(out.shape[1], block[0]), ceil_div(out.shape[0], block[1]))
    pairwise_dist_naive[grid, block](points, out)


def main(argv=None):
    args = script_parser(__doc__, "01_ecosystem").parse_args(argv)
    n, d = pick(gpu=(2048, 32), simulator=(20, 3))
    rng = np.random.default_rng(0)
    points_host = rng.standard_normal((n, d)).astype(np.float32)
    p64 = points_host.astype(np.float64)
    sq = (p64 * p64).sum(axis=1)
    reference = sq[:, None] + sq[None, :] - 2 * p64 @ p64.T  # float64: cancellation is harmless

    rows = min(n, 16)
    part = np.empty((rows, n), np.float64)
    python_ms = cpu_ms(partial(pairwise_dist_python, points_host, part), repeats=1) * n / rows
    check(part, reference[:rows], tol=1e-6, name="python loops")
    out_numpy = np.empty((n, n), np.float32)
    numpy_ms = cpu_ms(partial(pairwise_dist_numpy, points_host, out_numpy), repeats=1)
    check(out_numpy, reference, tol=1e-5, name="numpy")
    print(
        f"pairwise squared distances, {n} points in {d} dimensions; every version is checked "
        "against a float64 reference (rel. error <= 1e-5)"
    )
    print(f"  0 python loops : {python_ms:12.1f} ms (timed on {rows} rows, scaled)")
    print(f"  1 numpy        : {numpy_ms:12.1f} ms")

    peaks = device_peaks()
    results = run_versions(
        {"2 pairwise_dist_naive": pairwise_dist},
        (cuda.to_device(points_host),),
        reference,
        (n, n),
        np.float32,
        tol=1e-5,
        flops=3 * n * n * d,
        title="GPU kernel",
        peaks=peaks,
    )
    gpu = results[0]
    if gpu.measured:
        print(
            f"  the kernel is {python_ms / gpu.median_ms:,.0f}x faster than the Python loops "
            f"and {numpy_ms / gpu.median_ms:,.0f}x faster than NumPy"
        )
    else:
        print(readme_figures(__file__).format())
    save_results(
        results, args.out, "loop_to_kernel", n=n, d=d, python_ms=python_ms, numpy_ms=numpy_ms
    )
    return 0


if __name__ == "__main__":
    run_script(main)
