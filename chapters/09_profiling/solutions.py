"""Chapter 09 solutions. Same functions as exercises.py, done; the tests check both."""

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
    if not 1 <= threads_per_block <= limits.max_threads_per_block:
        raise ValueError(f"threads_per_block out of range: {threads_per_block}")
    if not 1 <= registers_per_thread <= limits.max_registers_per_thread:
        raise ValueError(f"registers_per_thread out of range: {registers_per_thread}")
    if shared_bytes_per_block < 0:
        raise ValueError(f"shared_bytes_per_block must be >= 0, got {shared_bytes_per_block}")
    warps = ceil_div(threads_per_block, 32)
    unit = limits.register_allocation_unit
    warp_registers = ceil_div(registers_per_thread * 32, unit) * unit
    per_quarter = (limits.registers_per_sm // 4) // warp_registers
    shared = shared_bytes_per_block + limits.reserved_shared_per_block
    shared = ceil_div(shared, limits.shared_allocation_unit) * limits.shared_allocation_unit
    if shared > limits.shared_per_sm:
        raise ValueError(f"a block needs {shared} bytes of shared memory: it cannot launch")
    budgets = {
        "warps": limits.max_warps_per_sm // warps,
        "blocks": limits.max_blocks_per_sm,
        "registers": 4 * per_quarter // warps,
        "shared": limits.shared_per_sm // shared if shared else limits.max_blocks_per_sm,
    }
    limiter = min(budgets, key=budgets.get)
    blocks = budgets[limiter]
    return blocks, blocks * warps / limits.max_warps_per_sm, limiter


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
    if not records:
        raise ValueError("no kernel records")
    totals = defaultdict(float)
    for r in records:
        us = r["end_us"] - r["start_us"]
        if us < 0:
            raise ValueError(f"{r['name']} ends before it starts")
        totals[short_kernel_name(r["name"])] += us
    name = max(totals, key=totals.get)
    return name, totals[name] / sum(totals.values())


# ---------------------------------------------------------------- Exercise 9.3


def roofline_bound(flops, nbytes, seconds, peak_tflops, peak_gbps):
    """Exercise 9.3: (intensity, bound, fraction of roof) of one timed kernel.

    intensity = flops / nbytes (FLOP per byte); bound is "memory" when
    intensity * peak bandwidth < peak FLOP/s (left of the ridge), else
    "compute"; the roof there is min(peak FLOP/s, intensity * bandwidth) and the
    fraction is achieved FLOP/s over it. flops > 0, nbytes > 0, seconds > 0,
    peaks > 0 (TFLOP/s, GB/s); ValueError otherwise.
    """
    if min(flops, nbytes, seconds, peak_tflops, peak_gbps) <= 0:
        raise ValueError("flops, nbytes, seconds and the peaks must all be positive")
    intensity = flops / nbytes
    peak_flops, peak_bw = peak_tflops * 1e12, peak_gbps * 1e9
    roof = min(peak_flops, intensity * peak_bw)
    bound = "memory" if intensity * peak_bw < peak_flops else "compute"
    return intensity, bound, (flops / seconds) / roof


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
    if not 1 <= len(addresses) <= 32:
        raise ValueError(f"a warp has 1 to 32 active threads, got {len(addresses)} addresses")
    sectors = set()
    for a in addresses:
        if a < 0:
            raise ValueError(f"negative address {a}")
        sectors.update(range(a // sector_bytes, (a + access_bytes - 1) // sector_bytes + 1))
    return len(sectors)


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
    if not 1 <= len(word_indices) <= 32:
        raise ValueError(f"a warp has 1 to 32 active threads, got {len(word_indices)}")
    words_in_bank = defaultdict(set)
    for w in word_indices:
        if w < 0:
            raise ValueError(f"negative word index {w}")
        words_in_bank[w % banks].add(w)
    return max(len(words) for words in words_in_bank.values())


# ---------------------------------------------------------------- Exercise 9.6

_BLOCK_SUMS = {}


def make_block_sums(BLOCK):
    @cuda.jit(cache=True)
    def block_sums_kernel(x, out):
        s = cuda.shared.array(BLOCK, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * BLOCK + t
        s[t] = x[i] if i < x.size else float32(0.0)  # memcheck: the last block ran past x
        cuda.syncthreads()  # racecheck: every s[t] written before any is read
        stride = BLOCK // 2
        while stride > 0:
            if t < stride:
                s[t] += s[t + stride]
            cuda.syncthreads()  # racecheck: this level's sums done before the next reads them
            stride //= 2
        if t == 0:
            out[cuda.blockIdx.x] = s[0]

    return block_sums_kernel


def block_sums(x, out, threads_per_block=128):
    """Exercise 9.6: the fixed version of exercises.py's block_sums_flagged (its
    kernel is the TODOs of make_block_sums there).

    x: float32 (n,) device array, n >= 1; out: float32 (ceil(n /
    threads_per_block),) device array; out[b] = sum of x[b * T:(b + 1) * T]
    with T = threads_per_block, a power of two in 1..1024. One block per
    output, a shared-memory tree with a barrier after every level, loads past
    the end of x read as 0. TypeError/ValueError for bad arguments.
    """
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    t = threads_per_block
    if not (1 <= t <= 1024 and t & (t - 1) == 0):
        raise ValueError(f"threads_per_block must be a power of two in 1..1024, got {t}")
    if x.size < 1 or out.size != ceil_div(x.size, t):
        raise ValueError(
            f"need n >= 1 and out of size ceil(n / {t}); got n={x.size}, out {out.size}"
        )
    if t not in _BLOCK_SUMS:
        _BLOCK_SUMS[t] = make_block_sums(t)
    _BLOCK_SUMS[t][out.size, t](x, out)
