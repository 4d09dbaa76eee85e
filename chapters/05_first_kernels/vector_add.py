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
from common.harness import run_versions
from common.timing import device_peaks, readme_figures, write_json

import argparse
import statistics
import sys
import time
from pathlib import Path

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
@cuda.jit
def vector_add_naive(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


# version 3: the grid is sized to the GPU (not to n) and each thread strides by the
# whole grid; the same kernel handles any n, and each launch costs the same few blocks.
@cuda.jit
def vector_add_grid_stride(a, b, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


# ---------------------------------------------------------------- launchers


def _check_inputs(a, b, out):
    for name, arr in (("a", a), ("b", b), ("out", out)):
        require_device_array(arr, name, ndim=1, dtype=np.float32)
    if not a.shape == b.shape == out.shape:
        raise ValueError(f"a, b, out must have one shape, got {a.shape}, {b.shape}, {out.shape}")


def add_naive(a, b, out, threads_per_block=256):
    """Launch version 2: ceil_div(n, threads_per_block) blocks. Arrays: float32 (n,) on device."""
    _check_inputs(a, b, out)
    vector_add_naive[ceil_div(out.size, threads_per_block), threads_per_block](a, b, out)


def add_grid_stride(a, b, out, blocks, threads_per_block=256):
    """Launch version 3 with a fixed grid of ``blocks`` blocks."""
    _check_inputs(a, b, out)
    vector_add_grid_stride[blocks, threads_per_block](a, b, out)


def sm_count():
    """Streaming multiprocessors on this GPU (a stand-in of 2 in the simulator)."""
    return 2 if is_simulator() else cuda.get_current_device().MULTIPROCESSOR_COUNT


def _cpu_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/05_first_kernels", help="folder for vector_add.json")
    parser.add_argument("--n", type=int, default=pick(gpu=1 << 26, simulator=1000))
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
    py_ms = _cpu_ms(lambda: vector_add_python(a_host[:m], b_host[:m], out_py), 1) * n / m
    check(out_py, reference[:m], tol=1e-6, name="python loop")
    out_np = np.empty(n, np.float32)
    np_ms = _cpu_ms(lambda: np.add(a_host, b_host, out=out_np), 5)
    check(out_np, reference, tol=1e-6, name="numpy")
    moved = f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes:,} bytes"
    print(f"vector add, n = {n:,} float32 ({moved} moved per call); every version is checked "
          "against the float64 reference (rel. error <= 1e-6)")
    print(f"  CPU python loop : {py_ms:10.2f} ms (timed on {m:,} elements, scaled)")
    print(f"  CPU numpy       : {np_ms:10.3f} ms  {nbytes / np_ms / 1e6:8.1f} GB/s")

    a, b = cuda.to_device(a_host), cuda.to_device(b_host)
    peaks = device_peaks()
    blocks = 8 * sm_count()  # enough resident blocks to keep every SM's memory pipe busy
    versions = {}
    for threads in (128, 256, 1024):
        versions[f"2 naive, block {threads}"] = (
            lambda out, t=threads: add_naive(a, b, out, threads_per_block=t))
    versions[f"3 grid-stride, {blocks}x256"] = lambda out: add_grid_stride(a, b, out, blocks)
    title = "vector add, kernels" + ("" if is_simulator() else f" on {peaks['device']}")
    results = run_versions(versions, reference, n, np.float32, tol=1e-6, nbytes=nbytes,
                           title=title, peaks=peaks)
    if results[0].measured:
        print(f"%copy: share of the device's copy bandwidth, {peaks['copy_gbps']:,.0f} GB/s "
              "(vector add's speed of light)")
    else:
        print(readme_figures(__file__).format())
    out_dir = Path(args.out)
    write_json(results, out_dir / "vector_add.json", device=peaks["device"], n=n,
               copy_gbps=peaks["copy_gbps"], cpu_python_ms=py_ms, cpu_numpy_ms=np_ms)
    print(f"wrote {out_dir / 'vector_add.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
