"""Prefix sum (inclusive scan) of an int32 vector: out[i] = x[0] + ... + x[i].

Versions (each scans one chunk per block, writes the chunk's total to `sums`;
the launcher scans `sums` the same way, recursively, and adds each chunk's
offset: scan-then-propagate):
  version 1 (scan_hillis_steele): BLOCK elements a block; log2(BLOCK) steps,
      step k adds the value 2**k to the left: O(n log n) additions, simple.
  version 2 (scan_blelloch): 2 * BLOCK elements a block; an up-sweep builds
      partial sums in a tree, a down-sweep pushes prefixes back down: O(n)
      additions (work-efficient), twice the elements a thread.

Source: Hillis & Steele, "Data parallel algorithms", CACM 29(12), 1986;
G. Blelloch, "Prefix sums and their applications", CMU-CS-90-190 (1990);
M. Harris, S. Sengupta, J. Owens, GPU Gems 3, ch. 39 (2007).

Run: python chapters/06_memory/scan.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick

import functools

import numpy as np
from numba import cuda, int32

launch = common.import_sibling(__file__, "launch")

BLOCK = 256  # threads per block (a power of two: both trees halve evenly)
# Blelloch: elements a block. A module-level int because a shared array's shape must
# be a compile-time constant: `2 * BLOCK` written inside a kernel is a runtime int64
CHUNK = 2 * BLOCK


def scan_cpu(x: np.ndarray) -> np.ndarray:
    """Inclusive prefix sum, int64 -> cast to int32 (the inputs keep it in range)."""
    return np.cumsum(x, dtype=np.int64).astype(np.int32)


# version 1: Hillis-Steele: read the neighbour 2**k to the left, barrier, add, barrier
@cuda.jit
def scan_hillis_steele(x, out, sums):
    s = cuda.shared.array(BLOCK, int32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = x[i] if i < x.size else 0
    cuda.syncthreads()
    offset = 1
    while offset < BLOCK:
        v = s[t - offset] if t >= offset else 0
        cuda.syncthreads()  # everyone has read before anyone overwrites
        s[t] += v
        cuda.syncthreads()  # everyone has written before the next read
        offset *= 2
    if i < out.size:
        out[i] = s[t]
    if t == BLOCK - 1:
        sums[cuda.blockIdx.x] = s[t]


# version 2: Blelloch: work-efficient exclusive scan of 2 * BLOCK elements, then + x
@cuda.jit
def scan_blelloch(x, out, sums):
    s = cuda.shared.array(CHUNK, int32)
    t = cuda.threadIdx.x
    base = cuda.blockIdx.x * CHUNK
    i0 = base + t
    i1 = base + t + BLOCK
    x0 = x[i0] if i0 < x.size else 0
    x1 = x[i1] if i1 < x.size else 0
    s[t] = x0
    s[t + BLOCK] = x1
    offset = 1
    d = BLOCK
    while d > 0:  # up-sweep: s[last of each pair-group] += s[last of the left group]
        cuda.syncthreads()
        if t < d:
            a = offset * (2 * t + 1) - 1
            b = offset * (2 * t + 2) - 1
            s[b] += s[a]
        offset *= 2
        d //= 2
    if t == 0:
        sums[cuda.blockIdx.x] = s[CHUNK - 1]
        s[CHUNK - 1] = 0
    d = 1
    while d < CHUNK:  # down-sweep: swap-and-add turns the tree into prefixes
        offset //= 2
        cuda.syncthreads()
        if t < d:
            a = offset * (2 * t + 1) - 1
            b = offset * (2 * t + 2) - 1
            left = s[a]
            s[a] = s[b]
            s[b] += left
        d *= 2
    cuda.syncthreads()
    if i0 < out.size:
        out[i0] = s[t] + x0  # exclusive + own element = inclusive
    if i1 < out.size:
        out[i1] = s[t + BLOCK] + x1


# propagate: chunk b > 0 adds the inclusive scan of the chunk totals up to b - 1
@cuda.jit
def add_chunk_offsets(out, scanned_sums, chunk):
    i = cuda.grid(1)
    if i < out.size:
        b = i // chunk
        if b > 0:
            out[i] += scanned_sums[b - 1]


def scan(kernel, x, out, level: int = 0) -> None:
    """Inclusive scan of ``x`` int32 (n,) into ``out`` int32 (n,) with ``kernel``
    (:func:`scan_hillis_steele` or :func:`scan_blelloch`), any n >= 1.

    Raises:
        TypeError: not int32 device arrays.
        ValueError: not 1-D arrays of one length.
    """
    x = require_device_array(x, "x", ndim=1, dtype=np.int32)
    out = require_device_array(out, "out", ndim=1, dtype=np.int32)
    if out.shape != x.shape:
        raise ValueError(f"x and out must have one length, got {x.shape} and {out.shape}")
    chunk = CHUNK if kernel is scan_blelloch else BLOCK
    blocks = ceil_div(x.size, chunk)
    sums = launch.scratch(blocks, np.int32, f"scan sums {level}")
    kernel[blocks, BLOCK](x, out, sums)
    if blocks > 1:
        scanned = launch.scratch(blocks, np.int32, f"scan scanned {level}")
        scan(kernel, sums, scanned, level + 1)
        add_chunk_offsets[ceil_div(x.size, BLOCK), BLOCK](out, scanned, chunk)


def run(n: int | None = None) -> list:
    """Check and time both versions (default n = 2**26 int32, 256 MiB, on a GPU).
    ``nbytes`` = 8 n: read the input once, write the output once."""
    n = n or pick(gpu=1 << 26, simulator=2 * BLOCK + 9)
    x_host = np.random.default_rng(8).integers(-100, 101, n).astype(np.int32)
    x = cuda.to_device(x_host)
    return run_versions(
        {
            "scan v1 Hillis-Steele": functools.partial(scan, scan_hillis_steele),
            "scan v2 Blelloch": functools.partial(scan, scan_blelloch),
        },
        (x,),
        reference=scan_cpu(x_host),
        out_shape=n,
        out_dtype=np.int32,
        nbytes=8 * n,
        title=f"inclusive scan of {n} int32",
        warmup=2,
        repeats=10,
    )


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "scan")


if __name__ == "__main__":
    run_script(main)
