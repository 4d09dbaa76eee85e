"""2-D and 3-D indexing: one thread an output element, for images and matrices.

version 1 rgb_to_gray_2d: a 2-D grid over an (H, W, 3) image; thread (x, y) -> pixel (row y, col x)
version 2 matmul_naive: a 2-D grid over C = A @ B; each thread loops over K (2K loads per 2K FLOPs)
version 3 batched_matmul_naive: a 3-D grid; the z-dimension picks the matrix in the batch

Run: python chapters/05_first_kernels/indexing_2d_3d.py [--out runs/05_first_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, pick
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import device_peaks, format_table, readme_figures

from functools import partial

import numpy as np
from numba import cuda

# ITU-R BT.601 luma weights, as float32 so the kernel stays in float32 (chapter 3).
GRAY_WEIGHTS = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def make_image(height, width, rng):
    """A generated (H, W, 3) float32 RGB image in [0, 1]: colour gradients plus noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = x / max(width - 1, 1)
    g = y / max(height - 1, 1)
    b = 0.5 + 0.5 * np.sin(x / 7.0) * np.cos(y / 5.0)
    img = np.stack([r, g, b], axis=-1) + 0.05 * rng.standard_normal((height, width, 3))
    return np.clip(img, 0, 1).astype(np.float32)


def rgb_to_gray_reference(img):
    """(H, W, 3) -> (H, W) luma, in float64."""
    return img.astype(np.float64) @ GRAY_WEIGHTS.astype(np.float64)


# version 1: x walks columns (the fastest-moving index in memory), y walks rows.
# Each thread reads 3 floats and writes 1: memory-bound, 16 bytes a pixel.
@cuda.jit(cache=True)
def rgb_to_gray_2d(img, weights, gray):
    col, row = cuda.grid(2)
    if row < gray.shape[0] and col < gray.shape[1]:
        gray[row, col] = (
            weights[0] * img[row, col, 0]
            + weights[1] * img[row, col, 1]
            + weights[2] * img[row, col, 2]
        )


# version 2: thread (col j, row i) computes C[i, j] = sum_k A[i, k] * B[k, j].
# Every thread reads a whole row of A and a column of B from global memory:
# 2 loads per FMA, no reuse (chapter 8 tiles this through shared memory).
@cuda.jit(cache=True)
def matmul_naive(a, b, c):
    j, i = cuda.grid(2)
    if i < c.shape[0] and j < c.shape[1]:
        acc = np.float32(0)
        for k in range(a.shape[1]):
            acc += a[i, k] * b[k, j]
        c[i, j] = acc


# version 3: the same, once per matrix of a batch; grid z = batch index, so one
# launch covers the whole batch instead of a Python loop of launches.
@cuda.jit(cache=True)
def batched_matmul_naive(a, b, c):
    j, i, z = cuda.grid(3)
    if z < c.shape[0] and i < c.shape[1] and j < c.shape[2]:
        acc = np.float32(0)
        for k in range(a.shape[2]):
            acc += a[z, i, k] * b[z, k, j]
        c[z, i, j] = acc


def grid_2d(rows, cols, block):
    """Blocks needed to cover (rows, cols) with ``block`` = (threads in x=cols, y=rows)."""
    return (ceil_div(cols, block[0]), ceil_div(rows, block[1]))


def rgb_to_gray(img, weights, gray, block=(32, 8)):
    """Launch version 1: img (H, W, 3), weights (3,) -> gray (H, W), float32 device arrays."""
    rgb_to_gray_2d[grid_2d(gray.shape[0], gray.shape[1], block), block](img, weights, gray)


def matmul(a, b, c, block=(16, 16)):
    """Launch version 2: c (M, N) = a (M, K) @ b (K, N), float32 device arrays."""
    matmul_naive[grid_2d(c.shape[0], c.shape[1], block), block](a, b, c)


def batched_matmul(a, b, c, block=(16, 16, 1)):
    """Launch version 3: c[z] = a[z] @ b[z] for a (B, M, K), b (B, K, N), c (B, M, N)."""
    batch, m, n = c.shape
    grid = (ceil_div(n, block[0]), ceil_div(m, block[1]), ceil_div(batch, block[2]))
    batched_matmul_naive[grid, block](a, b, c)


def main(argv=None):
    args = script_parser(__doc__, "05_first_kernels").parse_args(argv)
    rng = np.random.default_rng(0)
    peaks = device_peaks()
    results = []

    h, w = pick(gpu=(4096, 4096), simulator=(12, 20))
    img_host = make_image(h, w, rng)
    results += run_versions(
        {"1 rgb_to_gray_2d, block (32, 8)": rgb_to_gray},
        (cuda.to_device(img_host), cuda.to_device(GRAY_WEIGHTS)),
        rgb_to_gray_reference(img_host),
        (h, w),
        np.float32,
        tol=1e-6,
        nbytes=16 * h * w,
        peaks=peaks,
        print_table=False,
    )
    sizes = [f"RGB -> gray {h}x{w} image"]

    m, k, n = pick(gpu=(2048, 2048, 2048), simulator=(17, 9, 13))
    a_host = rng.standard_normal((m, k)).astype(np.float32)
    b_host = rng.standard_normal((k, n)).astype(np.float32)
    results += run_versions(
        {
            f"2 matmul_naive, block {block}": partial(matmul, block=block)
            for block in ((16, 16), (32, 8))
        },
        (cuda.to_device(a_host), cuda.to_device(b_host)),
        a_host.astype(np.float64) @ b_host,
        (m, n),
        np.float32,
        tol=1e-5,
        flops=2 * m * n * k,
        peaks=peaks,
        print_table=False,
    )
    sizes.append(f"matmul {m}x{k} @ {k}x{n}")

    batch, m, k, n = pick(gpu=(32, 512, 512, 512), simulator=(3, 7, 5, 9))
    a_host = rng.standard_normal((batch, m, k)).astype(np.float32)
    b_host = rng.standard_normal((batch, k, n)).astype(np.float32)
    results += run_versions(
        {"3 batched_matmul_naive, block (16, 16, 1)": batched_matmul},
        (cuda.to_device(a_host), cuda.to_device(b_host)),
        np.matmul(a_host.astype(np.float64), b_host),
        (batch, m, n),
        np.float32,
        tol=1e-5,
        flops=2 * batch * m * n * k,
        peaks=peaks,
        print_table=False,
    )
    sizes.append(f"batched matmul {batch} x ({m}x{k} @ {k}x{n})")
    print(format_table(results, title="; ".join(sizes)))
    print("every version checked against a float64 NumPy reference (rel. error <= 1e-5)")
    if not results[0].measured:
        print(readme_figures(__file__).format())
    save_results(results, args.out, "indexing_2d_3d")
    return 0


if __name__ == "__main__":
    run_script(main)
