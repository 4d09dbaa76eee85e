"""Histogram: counts of float32 values in [0, 1) over NBINS = 256 equal bins.

Versions (int32 counts):
  version 1 (histogram_global_atomic): one global atomic per element. Many
      threads hitting the same bin serialise: slow on skewed data.
  version 2 (histogram_smem_atomic): a private histogram per block in shared
      memory (shared atomics are cheap and contend only within the block),
      a grid-stride loop with 4 elements in flight per thread, then one global
      atomic per bin per block to merge.
  version 3 (histogram_smem_last_block): version 2, but each block writes its
      private histogram to a row of `partial` and the last block to finish adds
      the rows: no global atomics on the bins, no zeroing launch, one launch.
  version 4 (histogram_smem_wide): version 2 with UNROLL = 16 loads in flight per
      thread, all issued before the first shared atomic. COPIES sub-histograms per
      block (warp w adds into copy w % COPIES) are there to try: 8 per-warp copies
      measured slower than 1 on an H200 (uniform data), so COPIES = 1.

Both are run on uniform data (contention only by chance) and on skewed data
(x = u ** 8: about half of all values land in bin 0).

Source: N. Wilt, "The CUDA Handbook" (2013), ch. 12 (privatised histograms);
Kirk & Hwu, "Programming Massively Parallel Processors" (4th ed.), ch. 9.

Run: python chapters/06_memory/histogram.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick
from common.timing import format_table

import numpy as np
from numba import cuda, float32, int32

launch = common.import_sibling(__file__, "launch")

NBINS = 256
BLOCK = 256  # threads per block; equal to NBINS so each thread owns one bin when merging
NBINS_F = np.float32(NBINS)
ONE = np.int32(1)
UNROLL = 16  # version 4: loads in flight per thread
COPIES = 1  # version 4: sub-histograms per block (8 = one a warp: measured slower)
WIDE_BINS = NBINS * COPIES


def histogram_cpu(x: np.ndarray) -> np.ndarray:
    """Counts per bin, int32 (NBINS,); bin = floor(x * NBINS), clamped to [0, NBINS)."""
    b = np.clip(np.floor(x.astype(np.float64) * NBINS), 0, NBINS - 1).astype(np.int64)
    return np.bincount(b, minlength=NBINS).astype(np.int32)


@cuda.jit(device=True)
def bin_of(v):
    b = int32(v * NBINS_F)  # exact: multiplying by a power of two only shifts the exponent
    return min(max(b, 0), NBINS - 1)


# version 1: one global atomic per element; same-bin atomics serialise in L2
@cuda.jit(cache=True)
def histogram_global_atomic(x, bins):
    i = cuda.grid(1)
    if i < x.size:
        cuda.atomic.add(bins, bin_of(x[i]), ONE)


@cuda.jit(device=True)
def block_histogram(x, h):
    """Zero the shared histogram ``h``, add this block's grid-stride share of ``x``."""
    t = cuda.threadIdx.x
    for b in range(t, NBINS, BLOCK):
        h[b] = 0
    cuda.syncthreads()  # all bins zeroed before anyone adds
    n = x.size
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    while i + 3 * stride < n:  # 4 independent loads in flight, then 4 shared atomics
        v0 = x[i]
        v1 = x[i + stride]
        v2 = x[i + 2 * stride]
        v3 = x[i + 3 * stride]
        cuda.atomic.add(h, bin_of(v0), ONE)
        cuda.atomic.add(h, bin_of(v1), ONE)
        cuda.atomic.add(h, bin_of(v2), ONE)
        cuda.atomic.add(h, bin_of(v3), ONE)
        i += 4 * stride
    while i < n:
        cuda.atomic.add(h, bin_of(x[i]), ONE)
        i += stride
    cuda.syncthreads()  # all adds done before the histogram is read


# version 2: private shared-memory histogram, merged with NBINS global atomics per block
@cuda.jit(cache=True)
def histogram_smem_atomic(x, bins):
    h = cuda.shared.array(NBINS, int32)
    block_histogram(x, h)
    for b in range(cuda.threadIdx.x, NBINS, BLOCK):
        if h[b] != 0:
            cuda.atomic.add(bins, b, h[b])


# version 3: private histograms written as rows of `partial`; the last block sums them
@cuda.jit(cache=True)
def histogram_smem_last_block(x, partial, counter, bins):
    h = cuda.shared.array(NBINS, int32)
    last = cuda.shared.array(1, int32)
    block_histogram(x, h)
    t = cuda.threadIdx.x
    for b in range(t, NBINS, BLOCK):
        partial[cuda.blockIdx.x, b] = h[b]
    cuda.threadfence()  # rows visible everywhere before this block takes its ticket
    cuda.syncthreads()
    if t == 0:
        ticket = cuda.atomic.add(counter, 0, 1)
        last[0] = 1 if ticket == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0]:
        for b in range(t, NBINS, BLOCK):
            acc = 0
            for j in range(cuda.gridDim.x):  # threads read one row together: coalesced
                acc += partial[j, b]
            bins[b] = acc
        if t == 0:
            counter[0] = 0


# version 4: UNROLL loads in flight per thread, then UNROLL shared atomics into this
# warp's sub-histogram; n loads, n shared atomics, NBINS global atomics per block
@cuda.jit(cache=True)
def histogram_smem_wide(x, bins):
    h = cuda.shared.array(WIDE_BINS, int32)
    v = cuda.local.array(UNROLL, float32)  # constant indices after unrolling: registers
    t = cuda.threadIdx.x & 1023  # `&`: provably >= 0, no wraparound code on indices
    for b in range(t, WIDE_BINS, BLOCK):
        h[b] = 0
    cuda.syncthreads()
    base = ((t >> 5) % COPIES) * NBINS  # this warp's sub-histogram
    n = x.size
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    while i + (UNROLL - 1) * stride < n:
        for k in range(UNROLL):
            v[k] = x[i + k * stride]
        for k in range(UNROLL):
            cuda.atomic.add(h, base + bin_of(v[k]), ONE)
        i += UNROLL * stride
    while i < n:
        cuda.atomic.add(h, base + bin_of(x[i]), ONE)
        i += stride
    cuda.syncthreads()
    for b in range(t, NBINS, BLOCK):
        acc = 0
        for c in range(COPIES):
            acc += h[c * NBINS + b]
        if acc != 0:
            cuda.atomic.add(bins, b, acc)


@cuda.jit(cache=True)
def fill_int(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


def _values_and_bins(x, bins):
    """``x`` float32 (n,) and ``bins`` int32 (NBINS,) as device arrays.

    Raises:
        TypeError: not device arrays, or the wrong dtypes.
        ValueError: not 1-D, or ``bins`` not NBINS long.
    """
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    bins = require_device_array(bins, "bins", ndim=1, dtype=np.int32)
    if bins.size != NBINS:
        raise ValueError(f"bins must have shape ({NBINS},), got {bins.shape}")
    return x, bins


def histogram_v1(x, bins) -> None:
    """Version 1: ``x`` float32 (n,) in [0, 1) -> ``bins`` int32 (NBINS,), every
    launcher here; errors: :func:`_values_and_bins`."""
    x, bins = _values_and_bins(x, bins)
    fill_int[1, NBINS](bins, 0)
    histogram_global_atomic[max(1, ceil_div(x.size, BLOCK)), BLOCK](x, bins)


def histogram_v2(x, bins) -> None:
    """Version 2 (two launches: zero the bins, then count)."""
    x, bins = _values_and_bins(x, bins)
    fill_int[1, NBINS](bins, 0)
    histogram_smem_atomic[launch.grid_stride_blocks(x.size, BLOCK, per_thread=16), BLOCK](x, bins)


def histogram_v3(x, bins) -> None:
    """Version 3 (one launch)."""
    x, bins = _values_and_bins(x, bins)
    blocks = launch.grid_stride_blocks(x.size, BLOCK, per_thread=16)
    partial = launch.scratch((blocks, NBINS), np.int32, "histogram")
    counter = launch.zeroed_counter("histogram")
    histogram_smem_last_block[blocks, BLOCK](x, partial, counter, bins)


def histogram_v4(x, bins) -> None:
    """Version 4 (two launches: zero the bins, then count)."""
    x, bins = _values_and_bins(x, bins)
    fill_int[1, NBINS](bins, 0)
    blocks = launch.grid_stride_blocks(x.size, BLOCK, per_thread=4 * UNROLL)
    histogram_smem_wide[blocks, BLOCK](x, bins)


VERSIONS = {
    "v1 global atomics": histogram_v1,
    "v2 smem private + atomics": histogram_v2,
    "v3 smem private, last block": histogram_v3,
    "v4 smem, 16 loads/thread": histogram_v4,
}


def run(n: int | None = None) -> list:
    """Check and time every version on uniform and on skewed data (default
    n = 2**28 float32 = 1 GiB on a GPU). ``nbytes`` = 4 n (the input, read once)."""
    n = n or pick(gpu=1 << 28, simulator=BLOCK + 7)
    rng = np.random.default_rng(5)
    u = rng.random(n, dtype=np.float32)
    results = []
    for data_name, host in [("uniform", u), ("skewed", u**8)]:
        x = cuda.to_device(host)
        results += run_versions(
            {f"histogram {name} ({data_name})": fn for name, fn in VERSIONS.items()},
            (x,),
            reference=histogram_cpu(host),
            out_shape=NBINS,
            out_dtype=np.int32,
            nbytes=4 * n,
            print_table=False,
            warmup=2,
            repeats=10,
        )
    print(format_table(results, title=f"histogram of {n} float32 into {NBINS} bins"))
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "histogram")


if __name__ == "__main__":
    run_script(main)
