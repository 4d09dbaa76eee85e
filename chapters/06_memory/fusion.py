"""Kernel fusion: out = sigmoid(a + b * c), float32, elementwise.

Versions:
  version 1 (unfused): three kernels, t1 = b * c, t2 = a + t1, out = sigmoid(t2),
      the way an eager framework runs the expression: 8 arrays of traffic
      (read 2, write 1; read 2, write 1; read 1, write 1) and 3 launches.
  version 2 (sigmoid_fma_fused): one kernel, one element a thread: 4 arrays of
      traffic (read a, b, c; write out), the minimum.
  version 3 (sigmoid_fma_fused_grid_stride): one kernel, a grid-stride loop with
      4 elements in flight per thread and a grid of a few waves.

Run: python chapters/06_memory/fusion.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick

import math

import numpy as np
from numba import cuda

launch = common.import_sibling(__file__, "launch")

BLOCK = 256
ONE = np.float32(1.0)


def sigmoid_fma_cpu(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """sigmoid(a + b * c) in float64."""
    z = a.astype(np.float64) + b.astype(np.float64) * c
    return 1.0 / (1.0 + np.exp(-z))


@cuda.jit(device=True)
def sigmoid(z):
    return ONE / (ONE + math.exp(-z))


# version 1: three single-operation kernels; each intermediate goes to global memory
@cuda.jit(cache=True)
def mul_kernel(b, c, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = b[i] * c[i]


@cuda.jit(cache=True)
def add_kernel(a, t, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + t[i]


@cuda.jit(cache=True)
def sigmoid_kernel(z, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = sigmoid(z[i])


# version 2: one pass, intermediates stay in registers: 16 bytes an element
@cuda.jit(cache=True)
def sigmoid_fma_fused(a, b, c, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = sigmoid(a[i] + b[i] * c[i])


# version 3: fused, grid-stride with 4 elements (12 loads) in flight per thread
@cuda.jit(cache=True)
def sigmoid_fma_fused_grid_stride(a, b, c, out):
    n = out.size
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    while i + 3 * stride < n:
        z0 = a[i] + b[i] * c[i]
        z1 = a[i + stride] + b[i + stride] * c[i + stride]
        z2 = a[i + 2 * stride] + b[i + 2 * stride] * c[i + 2 * stride]
        z3 = a[i + 3 * stride] + b[i + 3 * stride] * c[i + 3 * stride]
        out[i] = sigmoid(z0)
        out[i + stride] = sigmoid(z1)
        out[i + 2 * stride] = sigmoid(z2)
        out[i + 3 * stride] = sigmoid(z3)
        i += 4 * stride
    while i < n:
        out[i] = sigmoid(a[i] + b[i] * c[i])
        i += stride


def _vectors(a, b, c, out):
    """``a``, ``b``, ``c``, ``out`` as float32 device arrays of one shape (n,).

    Raises:
        TypeError: not float32 device arrays.
        ValueError: not 1-D, or not of one length.
    """
    arrays = [
        require_device_array(v, name, ndim=1, dtype=np.float32)
        for v, name in zip((a, b, c, out), ("a", "b", "c", "out"))
    ]
    if len({v.size for v in arrays}) != 1:
        raise ValueError(f"a, b, c, out must have one length, got {[v.size for v in arrays]}")
    return arrays


def unfused(a, b, c, out) -> None:
    """Version 1: three launches through two scratch arrays. ``a``, ``b``, ``c``
    float32 (n,) -> ``out`` float32 (n,), every launcher here; errors: :func:`_vectors`."""
    a, b, c, out = _vectors(a, b, c, out)
    n = out.size
    t1 = launch.scratch(n, np.float32, "fusion t1")
    t2 = launch.scratch(n, np.float32, "fusion t2")
    blocks = ceil_div(n, BLOCK)
    mul_kernel[blocks, BLOCK](b, c, t1)
    add_kernel[blocks, BLOCK](a, t1, t2)
    sigmoid_kernel[blocks, BLOCK](t2, out)


def fused(a, b, c, out) -> None:
    """Version 2: one launch, one thread an element."""
    a, b, c, out = _vectors(a, b, c, out)
    sigmoid_fma_fused[ceil_div(out.size, BLOCK), BLOCK](a, b, c, out)


def fused_grid_stride(a, b, c, out) -> None:
    """Version 3: one launch, a few waves of blocks, 4 elements a thread per step."""
    a, b, c, out = _vectors(a, b, c, out)
    blocks = launch.grid_stride_blocks(out.size, BLOCK, per_thread=4, waves=4)
    sigmoid_fma_fused_grid_stride[blocks, BLOCK](a, b, c, out)


def run(n: int | None = None) -> list:
    """Check and time the versions on n elements a vector (default 2**26 on a GPU: four
    256 MiB arrays). ``nbytes`` = 16 n, the fused minimum, for every version."""
    n = n or pick(gpu=1 << 26, simulator=3 * BLOCK + 7)
    rng = np.random.default_rng(7)
    hosts = [random_array(n, np.float32, rng) for _ in range(3)]
    a, b, c = (cuda.to_device(h) for h in hosts)
    results = run_versions(
        {
            "fusion v1 unfused (3 kernels)": unfused,
            "fusion v2 fused": fused,
            "fusion v3 fused grid-stride": fused_grid_stride,
        },
        (a, b, c),
        reference=sigmoid_fma_cpu(*hosts),
        out_shape=n,
        tol=1e-6,
        nbytes=16 * n,
        title=f"sigmoid(a + b * c), n = {n} ({16 * n / 2**20:.0f} MiB minimum traffic)",
        warmup=2,
        repeats=10,
    )
    for r in results:
        r.extra["bytes_moved"] = (32 if "unfused" in r.name else 16) * n
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "fusion")


if __name__ == "__main__":
    run_script(main)
