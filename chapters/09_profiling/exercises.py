# ruff: noqa: F401, F841, B007  (stubs: the imports and TODO names are for your code)
"""Chapter 09 exercises: occupancy, a profile's bottleneck, the roofline, coalescing,
bank conflicts, and a kernel the sanitizer flags.

Write each function from its docstring (delete its `raise NotImplementedError`
line), then run `python -m pytest tests/test_ch09_profiling.py -q`. Exercises
9.1 to 9.5 are plain Python: the arithmetic behind what ncu and torch.profiler
print. 9.6 is a kernel: `block_sums_flagged` below is what compute-sanitizer
flags (saved/sanitizer_*.txt show the same two bugs on other kernels); write
`block_sums` without them. The tests run it at sizes that are not multiples of
the block, under the simulator's bounds checks and race detector.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import require_device_array

from collections import defaultdict

import numpy as np
from numba import cuda, float32

occupancy = import_sibling(__file__, "occupancy")
short_kernel_name = import_sibling(__file__, "kernel_names").short_kernel_name
SMLimits = occupancy.SMLimits
H100 = occupancy.KNOWN_LIMITS[(9, 0)]


# ---------------------------------------------------------------- Exercise 9.1


def theoretical_occupancy(
    threads_per_block, registers_per_thread, shared_bytes_per_block, limits=H100
):
    """Exercise 9.1: (blocks per SM, occupancy 0..1, limiter) of a launch.

    threads_per_block: 1..limits.max_threads_per_block; registers_per_thread:
    1..limits.max_registers_per_thread; shared_bytes_per_block: static +
    dynamic shared memory, bytes, >= 0; limits: an occupancy.SMLimits.
    A block takes ceil(threads_per_block / 32) warps: the SM allocates whole
    warps, however few threads the last one holds. The four budgets of
    occupancy.py's docstring give blocks per SM each: "warps", "blocks",
    "registers" (warp registers rounded up to limits.register_allocation_unit,
    whole warps per quarter of the register file), "shared" (the block's bytes
    plus limits.reserved_shared_per_block, which the system keeps per block,
    rounded up to limits.shared_allocation_unit); limiter is the name of the
    smallest (the first in that order on a tie). occupancy = blocks * warps per block /
    limits.max_warps_per_sm. Raises ValueError for values out of range.
    """
    raise NotImplementedError("Exercise 9.1: write theoretical_occupancy")


# ---------------------------------------------------------------- Exercise 9.2


def bottleneck_kernel(records):
    """Exercise 9.2: (kernel, share) of the kernel with the most GPU time in a profile.

    records: a list of {"name", "start_us", "end_us"}, one per kernel launch,
    as torch_profile.py saves them (names as the profiler prints them). Launches
    are grouped by short_kernel_name(name), and a group's times add up: one
    kernel compiled for several argument types (float32 and float64 arrays, say)
    prints several names, differing in the ABI tag and the signature, and is
    one kernel here. Returns the short name of the group with the most time and
    its fraction (0..1) of the summed time of all launches.
    Raises ValueError for an empty list or a launch that ends before it starts.
    """
    raise NotImplementedError("Exercise 9.2: write bottleneck_kernel")


# ---------------------------------------------------------------- Exercise 9.3


def roofline_bound(flops, nbytes, seconds, peak_tflops, peak_gbps):
    """Exercise 9.3: (intensity, bound, fraction of roof) of one timed kernel.

    intensity = flops / nbytes (FLOP per byte); bound is "memory" when
    intensity * peak bandwidth < peak FLOP/s (left of the ridge), else
    "compute"; the roof there is min(peak FLOP/s, intensity * bandwidth) and the
    fraction is achieved FLOP/s over it. flops > 0, nbytes > 0, seconds > 0,
    peaks > 0 (TFLOP/s, GB/s); ValueError otherwise.
    """
    raise NotImplementedError("Exercise 9.3: write roofline_bound")


# ---------------------------------------------------------------- Exercise 9.4


def sectors_per_request(addresses, sector_bytes=32, access_bytes=4):
    """Exercise 9.4: how many sectors one warp-wide load or store touches.

    addresses: the byte address each active thread of the warp accesses (1 to
    32 of them, ints >= 0), each ``access_bytes`` wide. Memory moves in
    ``sector_bytes`` sectors: the answer is the number of distinct sectors any
    accessed byte falls in (4 for 32 consecutive float32 from an aligned
    address; 32 for float32 128 bytes apart). ValueError for 0 or more than
    32 addresses, or a negative one.
    """
    raise NotImplementedError("Exercise 9.4: write sectors_per_request")


# ---------------------------------------------------------------- Exercise 9.5


def bank_conflict_ways(word_indices, banks=32):
    """Exercise 9.5: the n of an n-way shared-memory bank conflict.

    word_indices: the 4-byte word of shared memory each active thread of one
    warp reads (1 to 32 ints >= 0). Word w lives in bank w % banks; a bank
    serves one distinct word per cycle, and threads reading the same word get
    it in one go (a broadcast). Returns the largest number of distinct words
    any bank must serve: 1 means no conflict, 32 the worst. ValueError for 0 or
    more than 32 indices, or a negative one.
    """
    raise NotImplementedError("Exercise 9.5: write bank_conflict_ways")


# ---------------------------------------------------------------- Exercise 9.6

_BLOCK_SUMS = {}


# What compute-sanitizer flags in this kernel, launched on n = 1000 with 128
# threads a block (8 blocks: 1024 threads):
#   memcheck:  "Invalid __global__ read of size 4 bytes ... by thread (104,0,0) in
#              block (7,0,0)": threads 1000..1023 read past the end of x;
#   racecheck: shared-memory hazards between the writes of s[t] and the reads of
#              s[t + stride]: no barrier orders them.
def make_block_sums_flagged(BLOCK):
    @cuda.jit(cache=True)
    def block_sums_flagged(x, out):
        s = cuda.shared.array(BLOCK, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * BLOCK + t
        s[t] = x[i]
        stride = BLOCK // 2
        while stride > 0:
            if t < stride:
                s[t] += s[t + stride]
            stride //= 2
        if t == 0:
            out[cuda.blockIdx.x] = s[0]

    return block_sums_flagged


def make_block_sums(BLOCK):
    @cuda.jit(cache=True)
    def block_sums_kernel(x, out):
        s = cuda.shared.array(BLOCK, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * BLOCK + t
        # TODO: s[t] = x[i], or 0 past the end of x
        # TODO: a barrier
        stride = BLOCK // 2
        while stride > 0:
            if t < stride:
                s[t] += s[t + stride]
            # TODO: a barrier
            stride //= 2
        if t == 0:
            out[cuda.blockIdx.x] = s[0]

    return block_sums_kernel


def block_sums(x, out, threads_per_block=128):
    """Exercise 9.6: the fixed version of block_sums_flagged (above).

    x: float32 (n,) device array, n >= 1; out: float32 (ceil(n /
    threads_per_block),) device array; out[b] = sum of x[b * T:(b + 1) * T]
    with T = threads_per_block, a power of two in 1..1024. One block per
    output, a shared-memory tree with a barrier after every level, loads past
    the end of x read as 0. TypeError/ValueError for bad arguments.
    """
    raise NotImplementedError("Exercise 9.6: write block_sums")
