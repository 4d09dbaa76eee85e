"""Stencils (convolutions) with a halo: 1-D and 2-D, float32, zero outside the input.

  1-D: out[i] = sum_k w[k] * x[i + k - R], R = RADIUS = 3 (7 taps).
  2-D: out[y, x] = sum_{dy, dx} w[dy, dx] * img[y + dy - R2, x + dx - R2], R2 = 2 (5x5).

Versions:
  version 1 (stencil_1d_naive / conv2d_naive): every thread reads its 2R + 1
      (or (2 R2 + 1)**2) inputs from global memory: each input is loaded 2R + 1
      times (the cache catches most of it).
  version 2 (stencil_1d_smem / conv2d_smem): a block loads its tile plus a halo
      of R cells on each side into shared memory once, then every thread reads
      its taps from there: one global load per input (plus the halo).

Source: Kirk & Hwu, "Programming Massively Parallel Processors" (4th ed.), ch. 7-8.

Run: python chapters/06_memory/stencil.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick
from common.timing import format_table

import functools

import numpy as np
from numba import cuda, float32

BLOCK = 256  # 1-D: threads per block = outputs per block
RADIUS = 3  # 1-D halo width
TILE = 16  # 2-D: outputs per block along each axis (16 x 16 threads)
R2 = 2  # 2-D halo width
# shared array shapes must be compile-time constants, so the haloed tile sizes are
# module-level ints (`BLOCK + 2 * RADIUS` inside a kernel would be a runtime int64)
HALO_BLOCK = BLOCK + 2 * RADIUS  # 1-D: a block's inputs plus both halos
HALO_TILE = TILE + 2 * R2  # 2-D: edge of the haloed tile
ZERO = np.float32(0.0)


def stencil_1d_cpu(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """1-D stencil in float64, zero padding."""
    xp = np.pad(x.astype(np.float64), RADIUS)
    return sum(w[k] * xp[k : k + x.size] for k in range(2 * RADIUS + 1))


def conv2d_cpu(img: np.ndarray, w: np.ndarray) -> np.ndarray:
    """2-D 'same' correlation in float64, zero padding."""
    h, wd = img.shape
    p = np.pad(img.astype(np.float64), R2)
    return sum(
        w[dy, dx] * p[dy : dy + h, dx : dx + wd]
        for dy in range(2 * R2 + 1)
        for dx in range(2 * R2 + 1)
    )


# version 1 (1-D): 2R + 1 global loads an output
@cuda.jit(cache=True)
def stencil_1d_naive(x, w, out):
    i = cuda.grid(1)
    if i < out.size:
        acc = ZERO
        for k in range(2 * RADIUS + 1):
            j = i + k - RADIUS
            if 0 <= j < x.size:
                acc += w[k] * x[j]
        out[i] = acc


# version 2 (1-D): tile + halo in shared memory: one global load an input
@cuda.jit(cache=True)
def stencil_1d_smem(x, w, out):
    tile = cuda.shared.array(HALO_BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    tile[t + RADIUS] = x[i] if i < x.size else ZERO
    if t < RADIUS:  # the first R threads also fetch the left and right halos
        left = i - RADIUS
        tile[t] = x[left] if left >= 0 and left < x.size else ZERO
        right = i + BLOCK
        tile[t + BLOCK + RADIUS] = x[right] if right < x.size else ZERO
    cuda.syncthreads()  # halos come from other threads
    if i < out.size:
        acc = ZERO
        for k in range(2 * RADIUS + 1):
            acc += w[k] * tile[t + k]
        out[i] = acc


# version 1 (2-D): (2 R2 + 1)**2 global loads an output
@cuda.jit(cache=True)
def conv2d_naive(img, w, out):
    x, y = cuda.grid(2)
    h = img.shape[0]
    wd = img.shape[1]
    if y < h and x < wd:
        acc = ZERO
        for dy in range(2 * R2 + 1):
            for dx in range(2 * R2 + 1):
                yy = y + dy - R2
                xx = x + dx - R2
                if 0 <= yy < h and 0 <= xx < wd:
                    acc += w[dy, dx] * img[yy, xx]
        out[y, x] = acc


# version 2 (2-D): a (TILE + 2 R2)^2 tile in shared memory, loaded in TILE-strided sweeps
@cuda.jit(cache=True)
def conv2d_smem(img, w, out):
    tile = cuda.shared.array((HALO_TILE, HALO_TILE), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    x0 = cuda.blockIdx.x * TILE - R2  # top-left corner of the haloed tile
    y0 = cuda.blockIdx.y * TILE - R2
    h = img.shape[0]
    wd = img.shape[1]
    for yy in range(ty, HALO_TILE, TILE):
        for xx in range(tx, HALO_TILE, TILE):
            gy = y0 + yy
            gx = x0 + xx
            inside = 0 <= gy < h and 0 <= gx < wd
            tile[yy, xx] = img[gy, gx] if inside else ZERO
    cuda.syncthreads()
    y = cuda.blockIdx.y * TILE + ty
    x = cuda.blockIdx.x * TILE + tx
    if y < h and x < wd:
        acc = ZERO
        for dy in range(2 * R2 + 1):
            for dx in range(2 * R2 + 1):
                acc += w[dy, dx] * tile[ty + dy, tx + dx]
        out[y, x] = acc


def stencil_1d(kernel, x, w, out) -> None:
    """``x`` float32 (n,), ``w`` float32 (2 RADIUS + 1,) -> ``out`` float32 (n,).

    Raises:
        TypeError: not float32 device arrays.
        ValueError: the wrong shapes.
    """
    x, w, out = (
        require_device_array(a, name, ndim=1, dtype=np.float32)
        for a, name in zip((x, w, out), ("x", "w", "out"))
    )
    if out.shape != x.shape or w.shape != (2 * RADIUS + 1,):
        raise ValueError(
            f"need x (n,), out (n,), w ({2 * RADIUS + 1},); got {x.shape}, {out.shape}, {w.shape}"
        )
    kernel[ceil_div(x.size, BLOCK), BLOCK](x, w, out)


def conv2d(kernel, img, w, out) -> None:
    """``img`` float32 (h, w), ``w`` float32 (2 R2 + 1, 2 R2 + 1) -> ``out`` (h, w).

    Raises:
        TypeError: not float32 device arrays.
        ValueError: the wrong shapes.
    """
    img, w, out = (
        require_device_array(a, name, ndim=2, dtype=np.float32)
        for a, name in zip((img, w, out), ("img", "w", "out"))
    )
    k = 2 * R2 + 1
    if out.shape != img.shape or w.shape != (k, k):
        raise ValueError(
            f"need img (h, w), out (h, w), w ({k}, {k}); got {img.shape}, {out.shape}, {w.shape}"
        )
    grid = (ceil_div(img.shape[1], TILE), ceil_div(img.shape[0], TILE))
    kernel[grid, (TILE, TILE)](img, w, out)


def run(n: int | None = None, shape: tuple[int, int] | None = None) -> list:
    """Check and time both stencils (defaults on a GPU: n = 2**26, 8192 x 8192;
    256 MiB each). ``nbytes`` = 8 per element (read once, write once)."""
    n = n or pick(gpu=1 << 26, simulator=BLOCK + 5)
    h, wd = shape or pick(gpu=(8192, 8192), simulator=(21, 19))
    rng = np.random.default_rng(9)
    x_host = random_array(n, np.float32, rng)
    w1_host = random_array(2 * RADIUS + 1, np.float32, rng)
    img_host = random_array((h, wd), np.float32, rng)
    w2_host = random_array((2 * R2 + 1, 2 * R2 + 1), np.float32, rng)
    x, w1, img, w2 = (cuda.to_device(a) for a in (x_host, w1_host, img_host, w2_host))
    results = run_versions(
        {
            "stencil 1d v1 naive": functools.partial(stencil_1d, stencil_1d_naive),
            "stencil 1d v2 smem halo": functools.partial(stencil_1d, stencil_1d_smem),
        },
        (x, w1),
        reference=stencil_1d_cpu(x_host, w1_host),
        out_shape=n,
        tol=1e-5,
        nbytes=8 * n,
        print_table=False,
        warmup=2,
        repeats=10,
    )
    results += run_versions(
        {
            "conv2d 5x5 v1 naive": functools.partial(conv2d, conv2d_naive),
            "conv2d 5x5 v2 smem halo": functools.partial(conv2d, conv2d_smem),
        },
        (img, w2),
        reference=conv2d_cpu(img_host, w2_host),
        out_shape=(h, wd),
        tol=1e-5,
        nbytes=8 * h * wd,
        print_table=False,
        warmup=2,
        repeats=10,
    )
    print(format_table(results, title=f"stencils: 1-D n = {n}, 2-D {h} x {wd}"))
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "stencil")


if __name__ == "__main__":
    run_script(main)
