"""Vector add, out[i] = a[i] + b[i] for float32 vectors of n elements, four ways.

version 0 is a Python loop (CPU): the spec; timed on a slice and scaled up
version 1 is NumPy (CPU): one vectorized call
version 2 is vector_add_naive: one thread an element, with a bounds check; run at several block sizes
version 3 is vector_add_grid_stride: a fixed grid (a few blocks per SM) loops over the array

Vector add does 1 FLOP per 12 bytes moved, so its speed of light is the device's
memory bandwidth: we report GB/s as a fraction of a device-to-device copy.

Run: python chapters/05_first_kernels/vector_add.py [--out runs/05_first_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick
from common.checking import check, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import sm_count
from common.timing import cpu_ms, device_peaks, readme_figures

from functools import partial

import numpy as np
from numba import cuda

# ---------------------------------------------------------------- CPU reference


def vector_add_python(a, b, out):
    """The spec, one element at a time: what every kernel below must reproduce."""
    for i in range(len(a)):
        out[i] = a[i] + b[i]


# ---------------------------------------------------------------- kernels


# version 2: thread i handles element i; the grid is rounded up to whole blocks,
# so threads past n must do nothing. Each thread: 2 loads, 1 add, 1 store.
@cuda.jit(cache=True)
def vector_add_naive(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


# version 3: the grid is sized to the GPU (not to n) and each thread strides by the
# whole grid; the same kernel handles any n, and each launch costs the same few blocks.
@cuda.jit(cache=True)
def vector_add_grid_stride(a, b, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


# ---------------------------------------------------------------- launchers


def add_naive(a, b, out, threads_per_block=256):
    """Launch version 2: ceil_div(n, threads_per_block) blocks of threads_per_block.

    Args:
        a, b, out: float32 device arrays (n,).

    Raises:
        TypeError / ValueError: host arrays, wrong dtype or rank (from
            require_device_array), or shapes that differ.
    """
    a = require_device_array(a, "a", ndim=1, dtype=np.float32)
    b = require_device_array(b, "b", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    if not a.shape == b.shape == out.shape:
        raise ValueError(f"a, b, out must have one shape, got {a.shape}, {b.shape}, {out.shape}")
    vector_add_naive[ceil_div(out.size, threads_per_block), threads_per_block](a, b, out)


def add_grid_stride(a, b, out, blocks, threads_per_block=256):
    """Launch version 3 with a fixed grid of ``blocks`` blocks; arrays and errors as
    :func:`add_naive`."""
    a = require_device_array(a, "a", ndim=1, dtype=np.float32)
    b = require_device_array(b, "b", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    if not a.shape == b.shape == out.shape:
        raise ValueError(f"a, b, out must have one shape, got {a.shape}, {b.shape}, {out.shape}")
    vector_add_grid_stride[blocks, threads_per_block](a, b, out)


def main(argv=None):
    parser = script_parser(__doc__, "05_first_kernels")
    parser.add_argument(
        "--n", type=int, default=pick(gpu=1 << 26, simulator=1000), help="elements a vector"
    )
    args = parser.parse_args(argv)
    n = args.n
    rng = np.random.default_rng(0)
    a_host = rng.standard_normal(n).astype(np.float32)
    b_host = rng.standard_normal(n).astype(np.float32)
    reference = a_host.astype(np.float64) + b_host
    nbytes = 3 * 4 * n  # read a and b, write out: the fewest bytes vector add can move

    # CPU versions: the Python loop runs on a slice (it would take minutes on all of n).
    m = min(n, 200_000)
    out_py = np.empty(m, np.float32)
    py_ms = cpu_ms(partial(vector_add_python, a_host[:m], b_host[:m], out_py), repeats=1) * n / m
    check(out_py, reference[:m], tol=1e-6, name="python loop")
    out_np = np.empty(n, np.float32)
    np_ms = cpu_ms(partial(np.add, a_host, b_host, out=out_np), repeats=5)
    check(out_np, reference, tol=1e-6, name="numpy")
    moved = f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes:,} bytes"
    print(
        f"vector add, n = {n:,} float32 ({moved} moved per call); every version is checked "
        "against the float64 reference (rel. error <= 1e-6)"
    )
    print(f"  CPU python loop : {py_ms:10.2f} ms (timed on {m:,} elements, scaled)")
    print(f"  CPU numpy       : {np_ms:10.3f} ms  {nbytes / np_ms / 1e6:8.1f} GB/s")

    peaks = device_peaks()
    blocks = 8 * sm_count()  # enough resident blocks to keep every SM's memory pipe busy
    versions = {
        f"2 naive, block {threads}": partial(add_naive, threads_per_block=threads)
        for threads in (128, 256, 1024)
    }
    versions[f"3 grid-stride, {blocks}x256"] = partial(add_grid_stride, blocks=blocks)
    title = "vector add, kernels" + ("" if is_simulator() else f" on {peaks['device']}")
    results = run_versions(
        versions,
        (cuda.to_device(a_host), cuda.to_device(b_host)),
        reference,
        n,
        np.float32,
        tol=1e-6,
        nbytes=nbytes,
        title=title,
        peaks=peaks,
    )
    if results[0].measured:
        print(
            f"%copy: share of the device's copy bandwidth, {peaks['copy_gbps']:,.0f} GB/s "
            "(vector add's speed of light)"
        )
    else:
        print(readme_figures(__file__).format())
    save_results(results, args.out, "vector_add", n=n, cpu_python_ms=py_ms, cpu_numpy_ms=np_ms)
    return 0


if __name__ == "__main__":
    run_script(main)
