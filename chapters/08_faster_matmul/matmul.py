"""SGEMM C = A @ B (FP32, row-major), from three Python loops to most of cuBLAS.

version 1  matmul_python_loops: the definition, three nested Python loops (tiny sizes only)
version 2  NumPy: A @ B on the CPU (calls an optimised CPU BLAS)
version 3  matmul_naive: one thread an output; threadIdx.x walks rows, so loads are not coalesced
version 4  matmul_coalesced: the same, but threadIdx.x walks columns: a warp reads one row of B
version 5  matmul_smem_tiled: TILE x TILE tiles of A and B staged in shared memory
version 6  matmul_blocktile_1d: each thread computes TM outputs of one column (BM x BN block tile)
version 7  matmul_blocktile_2d: each thread computes a TM x TN register tile (outer products)
version 8  matmul_transposed_a: A tile stored transposed in shared memory, 4-wide register fragments
version 9  matmul_double_buffered: the next tile is loaded into registers while this one is used
version 10 matmul_unguarded: when M, N, K are multiples of the tiles, v9 without bounds
           checks, flat operands, constant-stride addresses (chosen at launch; v9 otherwise)
version 11 autotuned: version 10 built for a few tile shapes, the fastest one kept
version 12 matmul_warptiled: v10 with warp tiles (each warp a 64x32 sub-tile, lanes 8x4 over it)
version 13 split-K: v12 with K split over gridDim.z when the tiles make under one wave of
           blocks; partials in a workspace, summed in a fixed order (matmul_splitk_reduce)
version 14 chosen by shape: block tile and split-K picked per (M, N, K) and SM count
           (choose_schedule): 128x128, 128x64 or 64x64, and 1-16 splits
baseline   cuBLAS SGEMM through torch.matmul (TF32 off), measured in the same run

Run:   python chapters/08_faster_matmul/matmul.py [--sizes 1024,2048,4096x4096x256] [--quick]
           [--only 11,12,13,14] [--tune-size N] [--out DIR]

Every version is checked against a float64 product on the same inputs (the
tolerance 1e-4 also proves TF32 is off: TF32 gives ~1e-3), then timed with
CUDA events. Kernels 6-10 come from factories (``make_*``) that close over a
``Tile`` (block tile, K-slice, register tile), so Numba sees its sizes as
compile-time constants: loops over them unroll and ``cuda.local.array`` of
that size can live in registers (12-14 likewise, from a ``WarpTile``). The
launchers take the same ``Tile``, so a kernel and its launch cannot disagree. Versions 7-10 repeat most of the
previous version's code on purpose: diff version N against N + 1 to see the
one idea it adds. The designs follow Simon Boehm, "How to Optimize a CUDA
Matmul Kernel for cuBLAS-like Performance" (2022,
siboehm.com/articles/22/CUDA-MMM) and CUTLASS's thread-level tiling (NVIDIA,
"CUTLASS: Fast Linear Algebra in CUDA C++", 2017). The tooling around the
kernels (cuBLAS baseline, picking the fastest tile, compiler report, tables,
plot) is in ``matmul_tools.py``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.checking import check, random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, is_simulator, jit, pick, sm_count
from common.timing import Timing, cpu_ms, device_peaks

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from typing import Any

import numpy as np
from numba import cuda, float32, uint64

tools = import_sibling(__file__, "matmul_tools")

CHAPTER = "08_faster_matmul"

# Largest accepted ||C - ref|| / ||ref|| against the float64 product: FP32
# rounding over K terms stays well below it, and TF32 (~1e-3) does not.
TOL = 1e-4

# The simulator refuses shared-memory alignment; on a GPU 16 bytes allows LDS.128.
SMEM_ALIGN = pick(gpu=16, simulator=None)


@dataclass(frozen=True)
class Tile:
    """The tile shape a kernel factory (versions 6-10) builds for, and its launch uses.

    A block computes a ``bm x bn`` tile of C, stepping along K by ``bk``
    (a ``(bm, bk)`` tile of A and a ``(bk, bn)`` tile of B in shared memory
    per step); each thread computes a ``tm x tn`` register tile of it.
    ``min_blocks``: blocks per SM that versions 9-10 ask the compiler to fit
    (``launch_bounds``), which caps their registers per thread.
    """

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int = 1
    min_blocks: int = 2

    @property
    def threads(self) -> int:
        """Threads per block (1-D blocks): one per register tile."""
        return (self.bm // self.tm) * (self.bn // self.tn)

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn} BK{self.bk} {self.tm}x{self.tn}"


# --------------------------------------------------------------------------
# References: the definition, and NumPy
# --------------------------------------------------------------------------


def matmul_python_loops(a, b):
    """C[i, j] = sum_k A[i, k] * B[k, j]. a: (M, K), b: (K, N) NumPy; returns (M, N) float64."""
    m, k = a.shape
    n = b.shape[1]
    c = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            s = 0.0
            for p in range(k):
                s += float(a[i, p]) * float(b[p, j])
            c[i, j] = s
    return c


def matmul_reference(a, b):
    """The float64 product every version is checked against."""
    return a.astype(np.float64) @ b.astype(np.float64)


# --------------------------------------------------------------------------
# Version 3-5: one thread one output
# --------------------------------------------------------------------------


# v3: 2K loads per 2K flops; threadIdx.x -> row, so the 32 threads of a warp
# read 32 different rows of A (32 cache lines) and write C with a stride of N.
@cuda.jit(cache=True)
def matmul_naive(a, b, c):
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    col = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    if row < c.shape[0] and col < c.shape[1]:
        acc = float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


# v4: same work; threadIdx.x -> column, so a warp reads one A value (broadcast)
# and 32 consecutive B values (one 128-byte line) per k: coalesced.
@cuda.jit(cache=True)
def matmul_coalesced(a, b, c):
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    if row < c.shape[0] and col < c.shape[1]:
        acc = float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


def make_matmul_smem_tiled(TILE):
    """v5 factory: TILE x TILE threads; each tile of A and B is read from global
    memory once per block and TILE times from shared memory: 2/TILE global loads
    per FMA (arithmetic intensity TILE/4 FLOP per byte)."""

    @cuda.jit(cache=True)
    def matmul_smem_tiled(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        m, k_total = a.shape
        n = b.shape[1]
        acc = float32(0.0)
        for k0 in range(0, k_total, TILE):
            # Out-of-range cells are loaded as 0, so they add nothing below.
            a_tile[ty, tx] = a[row, k0 + tx] if row < m and k0 + tx < k_total else float32(0.0)
            b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < k_total and col < n else float32(0.0)
            cuda.syncthreads()  # the tile is complete before anyone reads it
            for k in range(TILE):
                acc += a_tile[ty, k] * b_tile[k, tx]
            cuda.syncthreads()  # everyone is done reading before it is overwritten
        if row < m and col < n:
            c[row, col] = acc

    return matmul_smem_tiled


# --------------------------------------------------------------------------
# Version 6-7: each thread several outputs (block tiling)
# --------------------------------------------------------------------------


def make_matmul_blocktile_1d(tile):
    """v6 factory: a block of (BM / TM) * BN threads computes a BM x BN tile of C;
    each thread TM outputs of one column. Per k, a thread loads one B value
    from shared memory and reuses it TM times: TM FMAs per (1 + TM) shared loads,
    against 1 FMA per 2 loads in v5. Needs BM * BK == BN * BK == threads."""
    BM, BN, BK, TM = tile.bm, tile.bn, tile.bk, tile.tm
    THREADS = tile.threads  # (BM / TM) * BN
    assert tile.tn == 1 and BM % TM == 0, "one column per thread, TM rows"
    assert BM * BK == THREADS and BK * BN == THREADS, "one A and one B load per thread"

    @cuda.jit(cache=True)
    def matmul_blocktile_1d(a, b, c):
        a_tile = cuda.shared.array((BM, BK), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array(TM, float32)
        tid = cuda.threadIdx.x
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        tcol = tid % BN
        trow = (tid // BN) * TM
        # One load of A and one of B per thread per tile, consecutive threads on
        # consecutive addresses.
        ar, ac = tid // BK, tid % BK
        br, bc = tid // BN, tid % BN
        for i in range(TM):
            acc[i] = 0.0
        for k0 in range(0, k_total, BK):
            ok_a = row0 + ar < m and k0 + ac < k_total
            a_tile[ar, ac] = a[row0 + ar, k0 + ac] if ok_a else float32(0.0)
            ok_b = k0 + br < k_total and col0 + bc < n
            b_tile[br, bc] = b[k0 + br, col0 + bc] if ok_b else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                bv = b_tile[k, tcol]
                for i in range(TM):
                    acc[i] += a_tile[trow + i, k] * bv
            cuda.syncthreads()
        for i in range(TM):
            if row0 + trow + i < m and col0 + tcol < n:
                c[row0 + trow + i, col0 + tcol] = acc[i]

    return matmul_blocktile_1d


def make_matmul_blocktile_2d(tile):
    """v7 factory: (BM / TM) * (BN / TN) threads; each thread a TM x TN register
    tile. Per k a thread loads TM values of A and TN of B from shared memory
    and does TM * TN FMAs (an outer product): 64 FMAs per 16 loads for 8 x 8.
    Thread (tx, ty) owns rows ty + i * BM/TM and columns tx + j * BN/TN: strided
    so that the 32 threads of a warp read 32 consecutive B values (no bank
    conflict) and write C coalesced."""
    BM, BN, BK, TM, TN = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    assert BM % TM == 0 and BN % TN == 0, "tile must divide the block tile"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"

    @cuda.jit(cache=True)
    def matmul_blocktile_2d(a, b, c):
        a_tile = cuda.shared.array((BM, BK), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        # `& 1023` tells the compiler tid >= 0, so every index below is provably
        # non-negative and Numba's negative-index wraparound code folds away.
        tid = cuda.threadIdx.x & 1023
        tx, ty = tid % TX, tid // TX
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(0, k_total, BK):
            for load in range(A_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < k_total
                a_tile[r, q] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for load in range(B_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BN, idx % BN
                ok = k0 + r < k_total and col0 + q < n
                b_tile[r, q] = b[k0 + r, col0 + q] if ok else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                for i in range(TM):
                    a_frag[i] = a_tile[ty + i * TY, k]
                for j in range(TN):
                    b_frag[j] = b_tile[k, tx + j * TX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
            cuda.syncthreads()
        for i in range(TM):
            row = row0 + ty + i * TY
            for j in range(TN):
                col = col0 + tx + j * TX
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    return matmul_blocktile_2d


# --------------------------------------------------------------------------
# Version 8-9: transposed A tile, 4-wide fragments, double buffering
# --------------------------------------------------------------------------


def make_matmul_transposed_a(tile):
    """v8 factory: as v7, but the A tile is stored transposed (k-major, rows
    padded by 4 floats) so that a thread's TM values of A for one k sit next to
    each other, like its TN values of B. Thread (tx, ty) owns rows in groups
    of 4 consecutive rows (ty * 4 + g * BM / (TM / 4)), and columns likewise:
    each group of 4 is one 16-byte shared-memory load (LDS.128) when the
    compiler vectorises it, 4 loads instead of 16 per k for an 8 x 8 tile.
    The padding spreads the transposing stores over all 32 banks."""
    BM, BN, BK, TM, TN = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    AP = BM + 4  # padded row length of the transposed A tile
    GA, GB = BM // (TM // 4), BN // (TN // 4)  # distance between 4-groups
    A_SIZE, B_SIZE = BK * AP, BK * BN  # shared array sizes must be plain constants
    assert TM % 4 == 0 and TN % 4 == 0, "fragments come in groups of 4"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"

    @cuda.jit(cache=True)
    def matmul_transposed_a(a, b, c):
        # 16-byte alignment lets the compiler turn 4 neighbouring loads into one LDS.128.
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)  # [k * AP + row]
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)  # [k * BN + col]
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        # `& 1023` tells the compiler tid >= 0, so every index below is provably
        # non-negative and Numba's negative-index wraparound code folds away.
        tid = cuda.threadIdx.x & 1023
        tx, ty = tid % TX, tid // TX
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(0, k_total, BK):
            for load in range(A_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < k_total
                a_tile[q * AP + r] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for load in range(B_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BN, idx % BN
                ok = k0 + r < k_total and col0 + q < n
                b_tile[r * BN + q] = b[k0 + r, col0 + q] if ok else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                # uint64: an unsigned index skips Numba's negative-index fix-up
                # (a compare and add per load), and the 4 loads of a group then
                # sit at base + 0, 4, 8, 12 bytes: one vector load.
                for i in range(TM):
                    a_frag[i] = a_tile[uint64(k * AP + (i // 4) * GA + ty * 4 + i % 4)]
                for j in range(TN):
                    b_frag[j] = b_tile[uint64(k * BN + (j // 4) * GB + tx * 4 + j % 4)]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
            cuda.syncthreads()
        for i in range(TM):
            row = row0 + (i // 4) * GA + ty * 4 + i % 4
            for j in range(TN):
                col = col0 + (j // 4) * GB + tx * 4 + j % 4
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    return matmul_transposed_a


def make_matmul_double_buffered(tile):
    """v9 factory: v8 with two shared buffers. While the block computes on tile
    t, each thread already holds tile t + 1's values (loaded from global memory
    into registers before the compute, so the load latency hides behind
    BK * TM * TN FMAs); it stores them into the other buffer afterwards. One
    syncthreads per tile instead of two."""
    BM, BN, BK, TM, TN, MIN_BLOCKS = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn, tile.min_blocks
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    AP = BM + 4
    GA, GB = BM // (TM // 4), BN // (TN // 4)
    A_BUF, B_BUF = BK * AP, BK * BN
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    assert TM % 4 == 0 and TN % 4 == 0, "fragments come in groups of 4"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"
    assert 4 * 2 * (A_BUF + B_BUF) <= 48 * 1024, "shared memory over 48 KiB"

    # launch_bounds: at most THREADS per block and at least MIN_BLOCKS blocks per
    # SM, so the compiler keeps to 65536 / (MIN_BLOCKS * THREADS) registers
    # (128 for 256 threads and 2 blocks): occupancy chosen, not left to chance.
    @jit(launch_bounds=(THREADS, MIN_BLOCKS))  # not cached: launch_bounds is not in the cache key
    def matmul_double_buffered(a, b, c):
        # 16-byte alignment lets the compiler turn 4 neighbouring loads into one LDS.128.
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        # `& 1023` tells the compiler tid >= 0, so every index below is provably
        # non-negative and Numba's negative-index wraparound code folds away.
        tid = cuda.threadIdx.x & 1023
        tx, ty = tid % TX, tid // TX
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        # Prologue: tile 0 straight into buffer 0.
        for load in range(A_LOADS):
            idx = tid + load * THREADS
            r, q = idx // BK, idx % BK
            ok = row0 + r < m and q < k_total
            a_tile[q * AP + r] = a[row0 + r, q] if ok else float32(0.0)
        for load in range(B_LOADS):
            idx = tid + load * THREADS
            r, q = idx // BN, idx % BN
            ok = r < k_total and col0 + q < n
            b_tile[r * BN + q] = b[r, col0 + q] if ok else float32(0.0)
        cuda.syncthreads()
        tiles = (k_total + BK - 1) // BK
        for t in range(tiles):
            cur = t & 1  # t % 2, written so the compiler sees it is >= 0
            k_next = (t + 1) * BK
            if t + 1 < tiles:  # issue the global loads of the next tile now
                for load in range(A_LOADS):
                    idx = tid + load * THREADS
                    r, q = idx // BK, idx % BK
                    ok = row0 + r < m and k_next + q < k_total
                    a_next[load] = a[row0 + r, k_next + q] if ok else float32(0.0)
                for load in range(B_LOADS):
                    idx = tid + load * THREADS
                    r, q = idx // BN, idx % BN
                    ok = k_next + r < k_total and col0 + q < n
                    b_next[load] = b[k_next + r, col0 + q] if ok else float32(0.0)
            a_base = cur * A_BUF + ty * 4
            b_base = cur * B_BUF + tx * 4
            # Two k per trip of the outer loop: the compiler unrolls the inner pair,
            # halving the loop and address overhead per FMA.
            for k_pair in range(BK // 2):
                for k1 in range(2):
                    k = 2 * k_pair + k1
                    a_k = a_base + k * AP
                    b_k = b_base + k * BN
                    for i in range(TM):
                        a_frag[i] = a_tile[uint64(a_k + (i // 4) * GA + i % 4)]
                    for j in range(TN):
                        b_frag[j] = b_tile[uint64(b_k + (j // 4) * GB + j % 4)]
                    for i in range(TM):
                        for j in range(TN):
                            acc[i, j] += a_frag[i] * b_frag[j]
            if t + 1 < tiles:
                nxt = 1 - cur
                for load in range(A_LOADS):
                    idx = tid + load * THREADS
                    a_tile[uint64(nxt * A_BUF + (idx % BK) * AP + idx // BK)] = a_next[load]
                for load in range(B_LOADS):
                    b_tile[uint64(nxt * B_BUF + tid + load * THREADS)] = b_next[load]
            # The other buffer is complete, and nobody reads this one any more.
            cuda.syncthreads()
        for i in range(TM):
            row = row0 + (i // 4) * GA + ty * 4 + i % 4
            for j in range(TN):
                col = col0 + (j // 4) * GB + tx * 4 + j % 4
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    return matmul_double_buffered


def make_matmul_unguarded(tile):
    """v10 factory: v9 for sizes that are multiples of the tiles
    (M % BM == N % BN == K % BK == 0, as 4096 is), launched by
    ``launch_unguarded``, which refuses other sizes. With no edge to guard:

    - the global loads lose their bounds checks, and A, B, C are passed flat
      (1-D) so each address is a per-thread offset computed once before the k
      loop plus a constant stride (one add per load instead of ~15 PTX
      instructions of guards, 64-bit row * stride products and fix-ups);
    - the k loop is a ``while`` over a plain counter doing two k per trip
      (Numba's ``range`` loop keeps a 64-bit count-down: ~6 more instructions
      a trip), and shared addresses are ``base + k * AP + constant``, so the
      compiler still proves 16-byte alignment and emits LDS.128.

    Per 128 x 128 x 8 tile ptxas (sm_90) then emits 512 FFMA and ~140 other
    instructions, against ~425 other for v9: 78% of issue slots do FMAs, not 55%."""
    BM, BN, BK, TM, TN, MIN_BLOCKS = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn, tile.min_blocks
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    A_ROWS, B_ROWS = THREADS // BK, THREADS // BN  # tile rows one load step covers
    AP = BM + 4
    GA, GB = BM // (TM // 4), BN // (TN // 4)
    A_BUF, B_BUF = BK * AP, BK * BN
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    assert TM % 4 == 0 and TN % 4 == 0 and BK % 2 == 0, "fragments of 4, k in pairs"
    assert THREADS % BK == 0 and THREADS % BN == 0, "a load step must cover whole rows"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"
    assert 4 * 2 * (A_BUF + B_BUF) <= 48 * 1024, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS))  # not cached: launch_bounds is not in the cache key
    def matmul_unguarded(a, b, c, n, k_total):
        # a: (M * K,), b: (K * N,) flat row-major views; c: (S * M * N,), S = gridDim.z
        # (split-K, section 13; S = 1 before it); n = N, k_total = K.
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        tid = cuda.threadIdx.x & 1023
        tx, ty = tid % TX, tid // TX
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        # Split-K (section 13): layer z of a grid of S layers sums K tiles
        # [z T / S, (z + 1) T / S) into the z-th M x N slab of c. S = 1 until then.
        splits = cuda.gridDim.z
        z = cuda.blockIdx.z
        tiles = (z + 1) * (k_total // BK) // splits - z * (k_total // BK) // splits
        k0 = (z * (k_total // BK) // splits) * BK
        slab = z * (c.shape[0] // splits)
        # Per-thread offsets, computed once: load number `load` of a tile reads
        # A's row tid // BK + load * A_ROWS, a constant A_ROWS * K floats further on.
        a_src = (row0 + tid // BK) * k_total + k0 + tid % BK
        b_src = (k0 + tid // BN) * n + col0 + tid % BN
        a_dst = (tid % BK) * AP + tid // BK  # transposed: a_tile[k * AP + row]
        a_step, b_step = A_ROWS * k_total, B_ROWS * n
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for load in range(A_LOADS):
            a_tile[uint64(a_dst + load * A_ROWS)] = a[uint64(a_src + load * a_step)]
        for load in range(B_LOADS):
            b_tile[uint64(tid + load * THREADS)] = b[uint64(b_src + load * b_step)]
        cuda.syncthreads()
        for t in range(tiles):
            cur = t & 1
            if t + 1 < tiles:  # the next tile's loads, in flight during the FMAs
                a_src += BK
                b_src += BK * n
                for load in range(A_LOADS):
                    a_next[load] = a[uint64(a_src + load * a_step)]
                for load in range(B_LOADS):
                    b_next[load] = b[uint64(b_src + load * b_step)]
            a_base = cur * A_BUF + ty * 4
            b_base = cur * B_BUF + tx * 4
            k = 0
            while k < BK:
                for k1 in range(2):  # unrolled: two k per trip
                    a_k = a_base + (k + k1) * AP
                    b_k = b_base + (k + k1) * BN
                    for i in range(TM):
                        a_frag[i] = a_tile[uint64(a_k + (i // 4) * GA + i % 4)]
                    for j in range(TN):
                        b_frag[j] = b_tile[uint64(b_k + (j // 4) * GB + j % 4)]
                    for i in range(TM):
                        for j in range(TN):
                            acc[i, j] += a_frag[i] * b_frag[j]
                k += 2
            if t + 1 < tiles:
                nxt = 1 - cur
                for load in range(A_LOADS):
                    a_tile[uint64(nxt * A_BUF + a_dst + load * A_ROWS)] = a_next[load]
                for load in range(B_LOADS):
                    b_tile[uint64(nxt * B_BUF + tid + load * THREADS)] = b_next[load]
            cuda.syncthreads()
        for i in range(TM):
            c_row = slab + (row0 + (i // 4) * GA + ty * 4 + i % 4) * n + col0 + tx * 4
            for j in range(TN):
                c[uint64(c_row + (j // 4) * GB + j % 4)] = acc[i, j]

    return matmul_unguarded


# --------------------------------------------------------------------------
# Version 12-14: warp tiles, split-K, and a schedule chosen by shape
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class WarpTile(Tile):
    """A Tile for versions 12-14: the block tile is cut into warp tiles.

    Warp w of the block owns a ``wm x wn`` sub-tile of the ``bm x bn`` block
    tile (the warp tile); its 32 lanes are laid out (wm / tm) x (wn / tn)
    over it, each owning a ``tm x tn`` register tile in groups of 4 x 4, so
    (wm / tm) * (wn / tn) must be 32. ``ku``: k steps per trip of the
    unguarded kernel's inner loop (unrolled by the compiler).
    """

    wm: int = 64
    wn: int = 32
    ku: int = 2

    def __str__(self) -> str:
        ku = f" ku{self.ku}" if self.ku != 2 else ""
        return f"{super().__str__()} warp {self.wm}x{self.wn}{ku}"


WARP = 32  # lanes a warp tile is laid out over (a hardware warp)


def _warp_layout(tile):
    """(WARPS_N, LANES_N, GA, GB) of a WarpTile, after checking that it tiles:
    warps across the block tile's columns, lanes across a warp tile's columns,
    and the distances between a lane's 4-row and 4-column groups."""
    bm, bn, wm, wn, tm, tn = tile.bm, tile.bn, tile.wm, tile.wn, tile.tm, tile.tn
    assert tm % 4 == 0 and tn % 4 == 0, "fragments come in groups of 4"
    assert bm % wm == 0 and bn % wn == 0, "warp tiles must cut the block tile"
    assert (wm // tm) * (wn // tn) == WARP, "a warp tile must hold 32 register tiles"
    assert (bm // wm) * (bn // wn) * WARP == tile.threads, "one warp per warp tile"
    return bn // wn, wn // tn, wm // (tm // 4), wn // (tn // 4)


def make_matmul_warptiled(tile):
    """v12 factory: v10's unguarded kernel with warp tiles, and K split over gridDim.z.

    Warp tiling (Boehm's kernel 10; CUTLASS's warp-level tile): in v10 the 32
    lanes of a warp are 2 rows x 16 columns of threads spread over the whole
    block tile, so per k a warp reads 4 distinct 4-float A groups and 32 B
    groups (36 x 16 bytes) from shared memory. Here warp w owns a WM x WN
    sub-tile and its lanes are laid out (WM / TM) x (WN / TN) = 8 x 4 over it
    (for 64 x 32 and 8 x 8): per k the warp reads 16 A groups and 8 B groups
    (24 x 16 bytes) for the same 2048 FMAs. Lanes of one row read one A
    address (a broadcast), and the groups one load reads are consecutive
    16-byte words: no bank conflict.

    Split-K: the blocks of grid layer z = blockIdx.z (of S = gridDim.z) sum
    only K tiles [z * T // S, (z + 1) * T // S) of the T = K / BK, and write
    their partial C to ``out[z * M * N:]``; ``matmul_splitk_reduce`` adds the
    S partials. With S = 1, ``out`` is C. Needs M % BM == N % BN == K % BK == 0
    and 1 <= S <= T (``launch_warptiled`` checks)."""
    BM, BN, BK, TM, TN, MIN_BLOCKS = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn, tile.min_blocks
    WM, KU = tile.wm, tile.ku
    WARPS_N, LANES_N, GA, GB = _warp_layout(tile)
    THREADS = tile.threads
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    A_ROWS, B_ROWS = THREADS // BK, THREADS // BN  # tile rows one load step covers
    WN = tile.wn
    AP = BM + 4
    A_BUF, B_BUF = BK * AP, BK * BN
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    assert BK % KU == 0, "the k loop takes KU k per trip"
    assert THREADS % BK == 0 and THREADS % BN == 0, "a load step must cover whole rows"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"
    assert 4 * (A_SIZE + B_SIZE) <= 48 * 1024, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS))  # not cached: launch_bounds is not in the cache key
    def matmul_warptiled(a, b, out, m, n, k_total):
        # a: (M * K,), b: (K * N,) flat row-major views; out: (S * M * N,), split z's
        # partial C (all of C when S = 1) at z * M * N.
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        tid = cuda.threadIdx.x & 1023
        warp, lane = tid // WARP, tid % WARP
        # The warp's WM x WN sub-tile, and this lane's first 4 x 4 group inside it.
        row_t = (warp // WARPS_N) * WM + (lane // LANES_N) * 4
        col_t = (warp % WARPS_N) * WN + (lane % LANES_N) * 4
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        # Split-K: this layer of the grid sums K tiles [t0, t0 + tiles).
        z = cuda.blockIdx.z
        splits = cuda.gridDim.z
        k_tiles = k_total // BK
        t0 = z * k_tiles // splits
        tiles = (z + 1) * k_tiles // splits - t0
        a_src = (row0 + tid // BK) * k_total + t0 * BK + tid % BK
        b_src = (t0 * BK + tid // BN) * n + col0 + tid % BN
        a_dst = (tid % BK) * AP + tid // BK  # transposed: a_tile[k * AP + row]
        a_step, b_step = A_ROWS * k_total, B_ROWS * n
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for load in range(A_LOADS):
            a_tile[uint64(a_dst + load * A_ROWS)] = a[uint64(a_src + load * a_step)]
        for load in range(B_LOADS):
            b_tile[uint64(tid + load * THREADS)] = b[uint64(b_src + load * b_step)]
        cuda.syncthreads()
        for t in range(tiles):
            cur = t & 1
            if t + 1 < tiles:  # the next tile's loads, in flight during the FMAs
                a_src += BK
                b_src += BK * n
                for load in range(A_LOADS):
                    a_next[load] = a[uint64(a_src + load * a_step)]
                for load in range(B_LOADS):
                    b_next[load] = b[uint64(b_src + load * b_step)]
            a_base = cur * A_BUF + row_t
            b_base = cur * B_BUF + col_t
            k = 0
            while k < BK:
                for k1 in range(KU):  # unrolled: KU k per trip
                    a_k = a_base + (k + k1) * AP
                    b_k = b_base + (k + k1) * BN
                    for i in range(TM):
                        a_frag[i] = a_tile[uint64(a_k + (i // 4) * GA + i % 4)]
                    for j in range(TN):
                        b_frag[j] = b_tile[uint64(b_k + (j // 4) * GB + j % 4)]
                    for i in range(TM):
                        for j in range(TN):
                            acc[i, j] += a_frag[i] * b_frag[j]
                k += KU
            if t + 1 < tiles:
                nxt = 1 - cur
                for load in range(A_LOADS):
                    a_tile[uint64(nxt * A_BUF + a_dst + load * A_ROWS)] = a_next[load]
                for load in range(B_LOADS):
                    b_tile[uint64(nxt * B_BUF + tid + load * THREADS)] = b_next[load]
            cuda.syncthreads()
        c_base = z * m * n + (row0 + row_t) * n + col0 + col_t
        for i in range(TM):
            c_row = c_base + ((i // 4) * GA + i % 4) * n
            for j in range(TN):
                out[uint64(c_row + (j // 4) * GB + j % 4)] = acc[i, j]

    return matmul_warptiled


def make_matmul_warptiled_guarded(tile):
    """v12-14 for sizes the tiles do not divide: v8's guarded, single-buffered
    k loop with v12's warp tiles and split-K layers.

    a (M, K), b (K, N) 2-D; out (S, M, N), split z's partial C in out[z] (C
    itself, reshaped to (1, M, N), when S = 1). Split z sums K tiles
    [z * T // S, (z + 1) * T // S) of the T = ceil(K / BK); its loads are
    split at whole tiles, so only the last split's last tile meets the edge
    of K. Needs 1 <= S <= T (``launch_warptiled`` checks)."""
    BM, BN, BK, TM, TN, MIN_BLOCKS = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn, tile.min_blocks
    WM, WN = tile.wm, tile.wn
    WARPS_N, LANES_N, GA, GB = _warp_layout(tile)
    THREADS = tile.threads
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    AP = BM + 4
    A_SIZE, B_SIZE = BK * AP, BK * BN
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS))  # not cached: launch_bounds is not in the cache key
    def matmul_warptiled_guarded(a, b, out):
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)  # [k * AP + row]
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)  # [k * BN + col]
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        tid = cuda.threadIdx.x & 1023
        warp, lane = tid // WARP, tid % WARP
        row_t = (warp // WARPS_N) * WM + (lane // LANES_N) * 4
        col_t = (warp % WARPS_N) * WN + (lane % LANES_N) * 4
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        z = cuda.blockIdx.z
        splits = cuda.gridDim.z
        k_tiles = (k_total + BK - 1) // BK
        k_begin = (z * k_tiles // splits) * BK
        k_end = ((z + 1) * k_tiles // splits) * BK
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(k_begin, k_end, BK):
            for load in range(A_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < k_total
                a_tile[q * AP + r] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for load in range(B_LOADS):
                idx = tid + load * THREADS
                r, q = idx // BN, idx % BN
                ok = k0 + r < k_total and col0 + q < n
                b_tile[r * BN + q] = b[k0 + r, col0 + q] if ok else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                for i in range(TM):
                    a_frag[i] = a_tile[uint64(k * AP + row_t + (i // 4) * GA + i % 4)]
                for j in range(TN):
                    b_frag[j] = b_tile[uint64(k * BN + col_t + (j // 4) * GB + j % 4)]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
            cuda.syncthreads()
        for i in range(TM):
            row = row0 + row_t + (i // 4) * GA + i % 4
            for j in range(TN):
                col = col0 + col_t + (j // 4) * GB + j % 4
                if row < m and col < n:
                    out[z, row, col] = acc[i, j]

    return matmul_warptiled_guarded


# v13-14: one thread per element of C adds the S partials in the order
# s = 0, 1, ..., S - 1, the same in every run: no atomics, so the result is
# bit-reproducible. Reads S * M * N floats and writes M * N: memory-bound, the
# price of split-K, small next to the product when K is long.
#
# Why TOL still holds: a K-term float32 dot product errs by at most about
# (K - 1) * u * sum_k |a_ik * b_kj| (u = eps32 / 2; Higham, *Accuracy and
# Stability of Numerical Algorithms*, sec. 3.1). Split-K sums S runs of at
# most ceil(K / S) terms, then their S partials: at most ceil(K / S) - 1 + S - 1
# roundings on each term's path, which is <= K - 1 for every 1 <= S <= K. The
# bound, and the tolerance chosen under it, do not grow.
@cuda.jit(cache=True)
def matmul_splitk_reduce(partials, c, size, splits):
    # partials: (S * size,) flat, split s at s * size; c: (size,) flat.
    i = cuda.grid(1)
    if i < size:
        acc = partials[i]
        for s in range(1, splits):
            acc += partials[s * size + i]
        c[i] = acc


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------


def check_operands(a, b, c):
    """Return a (M, K), b (K, N), c (M, N) as Numba device arrays, or raise a clear error.

    Each must be a 2-D float32 C-contiguous (row-major) device array (a CUDA
    torch tensor is wrapped without a copy), and the shapes must chain.
    Raises TypeError (a host array, not on the GPU, not float32) or ValueError
    (not 2-D, not row-major, shapes that do not chain). ``matmul_best`` and the
    exercises' launchers call it; the launchers below do not, so a timing
    counts the launch only.
    """
    a = require_device_array(a, "a", ndim=2, dtype=np.float32)
    b = require_device_array(b, "b", ndim=2, dtype=np.float32)
    c = require_device_array(c, "c", ndim=2, dtype=np.float32)
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not x.is_c_contiguous():
            raise ValueError(
                f"{name} must be C-contiguous (row-major): pass "
                f"cuda.to_device(np.ascontiguousarray({name}))"
            )
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"shapes do not chain: a {a.shape} @ b {b.shape} -> c {c.shape}; "
            "need a (M, K), b (K, N), c (M, N)"
        )
    return a, b, c


def launch_one_per_thread(kernel, a, b, c, block=(16, 16)):
    """v3/v4: one thread per output, blocks of ``block`` threads. v3 maps x to
    rows, v4 maps x to columns, so the grid is laid out the same way."""
    m, n = c.shape
    if kernel is matmul_naive:
        grid = (ceil_div(m, block[0]), ceil_div(n, block[1]))
    else:
        grid = (ceil_div(n, block[0]), ceil_div(m, block[1]))
    kernel[grid, block](a, b, c)


def launch_smem_tiled(kernel, tile_size, a, b, c):
    """v5: a grid of tile_size x tile_size blocks over C; ``kernel`` is
    ``make_matmul_smem_tiled(tile_size)``."""
    m, n = c.shape
    kernel[(ceil_div(n, tile_size), ceil_div(m, tile_size)), (tile_size, tile_size)](a, b, c)


def launch_blocktiled(kernel, tile, a, b, c):
    """v6-v9 (and v10 on ragged sizes): one block of ``tile.threads`` threads
    per ``tile.bm x tile.bn`` tile of C; ``kernel`` was made for ``tile``."""
    m, n = c.shape
    kernel[(ceil_div(n, tile.bn), ceil_div(m, tile.bm)), tile.threads](a, b, c)


def launch_unguarded(kernel, tile, a, b, c):
    """v10's fast kernel (``make_matmul_unguarded(tile)``): one block per
    ``tile.bm x tile.bn`` tile of C, operands passed flat. Raises ValueError
    unless M, N, K are multiples of tile.bm, tile.bn, tile.bk (it has no guards)."""
    m, n = c.shape
    k_total = a.shape[1]
    if m % tile.bm or n % tile.bn or k_total % tile.bk:
        raise ValueError(
            f"the unguarded kernel needs M % {tile.bm} == N % {tile.bn} == "
            f"K % {tile.bk} == 0, got M={m} N={n} K={k_total}; use launch_fast "
            "(it falls back to version 9)"
        )
    kernel[(n // tile.bn, m // tile.bm), tile.threads](
        a.reshape(m * k_total), b.reshape(k_total * n), c.reshape(m * n), n, k_total
    )


def launch_fast(unguarded, guarded, tile, a, b, c):
    """v10 for any M, N, K: ``unguarded`` (``make_matmul_unguarded(tile)``) when
    M, N, K are multiples of the tile, else ``guarded``
    (``make_matmul_double_buffered(tile)``: the same arithmetic, edges checked)."""
    m, n = c.shape
    if m % tile.bm == 0 and n % tile.bn == 0 and a.shape[1] % tile.bk == 0:
        launch_unguarded(unguarded, tile, a, b, c)
    else:
        launch_blocktiled(guarded, tile, a, b, c)


class SplitKWorkspace:
    """The float32 buffer where split-K writes its S partial C tiles (S * M * N
    floats), kept between calls: allocating it on every call would cost more
    host time than a small product. Grows to the largest size asked for."""

    def __init__(self):
        self.buffer = None

    def partials(self, splits, m, n):
        """A flat (splits * m * n,) float32 device array (a view of the buffer)."""
        size = splits * m * n
        if self.buffer is None or self.buffer.size < size:
            self.buffer = cuda.device_array(size, np.float32)
        return self.buffer[:size]


@cache
def warptiled_kernels(tile):
    """(unguarded, guarded) kernels of versions 12-14 for ``tile``, made once."""
    return make_matmul_warptiled(tile), make_matmul_warptiled_guarded(tile)


REDUCE_THREADS = 256


def add_split_partials(partials, c, splits):
    """c (M, N) = the sum of the ``splits`` slabs of ``partials`` (flat, S * M * N),
    in the order 0, 1, ..., S - 1 (``matmul_splitk_reduce``); nothing when S = 1,
    where the product was written into c directly."""
    if splits > 1:
        size = c.shape[0] * c.shape[1]
        matmul_splitk_reduce[ceil_div(size, REDUCE_THREADS), REDUCE_THREADS](
            partials, c.reshape(size), size, splits
        )


def launch_warptiled(tile, splits, workspace, a, b, c):
    """v12-14: C = A @ B on a (ceil(N / BN), ceil(M / BM), splits) grid.

    a (M, K), b (K, N), c (M, N) float32 row-major device arrays; ``tile`` a
    WarpTile; ``splits`` (S) the number of K ranges summed by separate blocks
    (1: no split-K); ``workspace`` a SplitKWorkspace, used when S > 1, after
    which ``matmul_splitk_reduce`` adds the S partials into c in a fixed order.
    The unguarded kernel runs when M, N, K are multiples of BM, BN, BK, the
    guarded one otherwise. Raises ValueError unless 1 <= S <= ceil(K / BK)
    (a split with no K tile to sum would only add a pass over C; the shape
    heuristic ``choose_schedule`` never asks for one).
    """
    m, n = c.shape
    k_total = a.shape[1]
    k_tiles = ceil_div(k_total, tile.bk)
    if not 1 <= splits <= k_tiles:
        raise ValueError(
            f"splits must be between 1 and the number of K tiles ceil(K / BK) = "
            f"ceil({k_total} / {tile.bk}) = {k_tiles}, got {splits}"
        )
    fast, guarded = warptiled_kernels(tile)
    grid = (ceil_div(n, tile.bn), ceil_div(m, tile.bm), splits)
    out = c.reshape(m * n) if splits == 1 else workspace.partials(splits, m, n)
    if m % tile.bm == 0 and n % tile.bn == 0 and k_total % tile.bk == 0:
        fast[grid, tile.threads](a.reshape(m * k_total), b.reshape(k_total * n), out, m, n, k_total)
    else:
        guarded[grid, tile.threads](a, b, out.reshape(splits, m, n))
    add_split_partials(out, c, splits)


# --------------------------------------------------------------------------
# The versions, in order
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One GPU version of the table: its number, what it does, how to launch it.

    ``launcher(a, b, c)`` writes A @ B into c (device arrays as
    ``check_operands`` accepts them); ``kernels`` are the Numba kernels it
    launches (for the compiler report); ``tile`` is the Tile they were built
    for (None for versions 3-5).
    """

    number: int
    name: str
    launcher: Callable[..., None]
    kernels: tuple[Any, ...]
    tile: Tile | None = None

    @property
    def label(self) -> str:
        """The row name in the tables and the JSON, e.g. ``"7 2D blocktile 128x128 BK8 8x8"``."""
        return f"{self.number} {self.name}"


def make_matmul_fast(tile):
    """Version 10 for ``tile``: its launcher runs the unguarded kernel when
    M, N, K are multiples of the tile, and version 9 of the same tile otherwise,
    so any M, N, K >= 1 works. ``kernels`` = (unguarded, guarded)."""
    unguarded = make_matmul_unguarded(tile)
    guarded = make_matmul_double_buffered(tile)
    return Version(
        10,
        f"unguarded fast path {tile}",
        partial(launch_fast, unguarded, guarded, tile),
        (unguarded, guarded),
        tile,
    )


# Tile shapes per runtime: full size on a GPU; tiny in the simulator, which runs
# a Python thread per CUDA thread (same code, smaller constants).
TILE_5 = pick(gpu=32, simulator=4)
SHAPE_6 = pick(gpu=Tile(64, 64, 8, 8), simulator=Tile(8, 8, 2, 4))
SHAPE_7 = pick(gpu=Tile(128, 128, 8, 8, 8), simulator=Tile(8, 8, 4, 2, 2))
SHAPE_8 = pick(gpu=Tile(128, 128, 8, 8, 8), simulator=Tile(16, 16, 4, 4, 4))

# Version 11's candidates: 256 threads, 8 x 8, 8 x 4, 4 x 8 or 4 x 4 register
# tiles, BK 8 or 16, 1 or 2 blocks per SM. All fit 48 KiB of shared memory and,
# checked with ptxas for sm_90, none spills registers (128 x 128 BK16 uses 127
# of its 128 with 2 blocks per SM).
TUNE_SHAPES = pick(
    gpu=[
        Tile(128, 128, 8, 8, 8, 2),
        Tile(128, 128, 16, 8, 8, 2),
        Tile(128, 128, 16, 8, 8, 1),
        Tile(128, 64, 16, 8, 4, 2),
        Tile(64, 128, 16, 4, 8, 2),
        Tile(64, 64, 16, 4, 4, 2),
    ],
    simulator=[Tile(16, 16, 4, 4, 4, 2), Tile(16, 8, 8, 4, 4, 1)],
)


def gpu_versions():
    """Versions 3-10, in order, at this runtime's tile shapes (a list of Version)."""
    v5 = make_matmul_smem_tiled(TILE_5)
    v6 = make_matmul_blocktile_1d(SHAPE_6)
    v7 = make_matmul_blocktile_2d(SHAPE_7)
    v8 = make_matmul_transposed_a(SHAPE_8)
    v9 = make_matmul_double_buffered(SHAPE_8)
    return [
        Version(
            3, "naive (x -> row)", partial(launch_one_per_thread, matmul_naive), (matmul_naive,)
        ),
        Version(
            4,
            "coalesced (x -> col)",
            partial(launch_one_per_thread, matmul_coalesced),
            (matmul_coalesced,),
        ),
        Version(5, f"smem tiled {TILE_5}x{TILE_5}", partial(launch_smem_tiled, v5, TILE_5), (v5,)),
        Version(
            6,
            f"1D blocktile {SHAPE_6.bm}x{SHAPE_6.bn} BK{SHAPE_6.bk} TM{SHAPE_6.tm}",
            partial(launch_blocktiled, v6, SHAPE_6),
            (v6,),
            SHAPE_6,
        ),
        Version(
            7, f"2D blocktile {SHAPE_7}", partial(launch_blocktiled, v7, SHAPE_7), (v7,), SHAPE_7
        ),
        Version(
            8, f"transposed A {SHAPE_8}", partial(launch_blocktiled, v8, SHAPE_8), (v8,), SHAPE_8
        ),
        Version(
            9, f"double buffered {SHAPE_8}", partial(launch_blocktiled, v9, SHAPE_8), (v9,), SHAPE_8
        ),
        make_matmul_fast(SHAPE_8),
    ]


def autotune(tiles, size, rng, repeats):
    """Version 11: version 10 built for each Tile in ``tiles``, each checked and
    timed on one (M, N, K) = ``size`` product. Returns (the fastest, as Version
    11; the list of Timing). In the simulator nothing is timed: every tile is
    still checked and the first one kept."""
    m, n, k = size
    a_h, b_h, a, b = random_operands(m, n, k, rng)
    candidates = {f"{t} mb{t.min_blocks}": make_matmul_fast(t) for t in tiles}
    best, results = tools.fastest(
        {name: v.launcher for name, v in candidates.items()},
        (a, b),
        matmul_reference(a_h, b_h),
        (m, n),
        tol=TOL,
        flops=2 * m * n * k,
        repeats=repeats,
        title=f"autotune v10 tile shapes at {m}x{n}x{k}",
    )
    return replace(candidates[best], number=11, name=f"autotuned v10 {best}"), results


def matmul_best(a, b, c):
    """C = A @ B with version 10 at the first of TUNE_SHAPES, operands checked.

    a: (M, K), b: (K, N), c: (M, N) float32 C-contiguous device arrays; any
    M, N, K >= 1 (ragged edges go to the guarded kernel). Raises TypeError /
    ValueError on bad operands (see ``check_operands``).
    """
    a, b, c = check_operands(a, b, c)
    _best_version().launcher(a, b, c)


@cache
def _best_version():
    return make_matmul_fast(TUNE_SHAPES[0])


# Versions 12-14's tiles, largest first: 256 threads in 8 warps on a GPU, each
# warp tile 32 register tiles. 128 x 128 x 16 with 8 x 8 is version 11's pick
# (see the README's results); 128 x 64 and 64 x 64 make 2x and 4x the blocks.
# The simulator's are tiny (it runs a Python thread per CUDA thread) but keep
# two lane layouts (8 x 4, 4 x 8) and a block of 2 warps.
GPU_SCHEDULE_TILES = (
    WarpTile(128, 128, 16, 8, 8, 2, wm=64, wn=32),
    WarpTile(128, 64, 16, 8, 4, 2, wm=32, wn=32),
    WarpTile(64, 64, 16, 4, 4, 2, wm=32, wn=16),
)
SCHEDULE_TILES = pick(
    gpu=GPU_SCHEDULE_TILES,
    simulator=(
        WarpTile(32, 32, 4, 4, 4, 2, wm=32, wn=16),
        WarpTile(32, 16, 4, 4, 4, 2, wm=32, wn=16),
    ),
)

# The shape heuristic's constants (see choose_schedule).
FILL = 0.9  # a schedule must give at least this fraction of one wave of blocks
MIN_K_TILES = 4  # each split sums at least this many BK-deep K tiles
MAX_SPLITS = 16  # caps the split-K workspace at 16 * M * N floats


@cache
def choose_schedule(m, n, k, sm_count, tiles=SCHEDULE_TILES):
    """(tile, splits) for an (M, N, K) SGEMM on a GPU of ``sm_count`` SMs.

    A pure function of its arguments (tested as one). A **wave** is the
    blocks the GPU runs at once, ``sm_count * tile.min_blocks`` (the blocks
    per SM that ``launch_bounds`` asks the compiler to fit). Under one wave
    SMs idle for the whole run; past a few waves the last, partial wave
    (**wave quantization**) costs little. So, trying ``tiles`` largest first
    (a larger tile does more FMAs per shared and global load):

    1. a tile giving at least FILL of a wave of blocks is taken, unsplit;
    2. else K is split into S = min(wave // blocks, K tiles // MIN_K_TILES,
       MAX_SPLITS) ranges (split-K: S times the blocks, each summing at least
       MIN_K_TILES tiles of K, at most one wave so no partial second one), and
       taken if that fills FILL of a wave;
    3. else the next smaller tile is tried; the smallest is taken with its S.

    So a large tile with split-K is preferred to a smaller tile: it keeps its
    FMAs per load, and pays one extra pass over S * M * N floats. The
    alternative that removes quantization too, stream-K (Osama et al.,
    "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix
    Multiplication on the GPU", 2023), splits K unevenly across one wave.

    Args:
        m, n, k: the product's sizes, >= 1.
        sm_count: SMs of the GPU (``common.runtime.sm_count()``: asked of the
            device; the simulator's stand-in is 2).
        tiles: WarpTiles, largest first.

    Raises:
        ValueError: a size or sm_count < 1, or no tiles.
    """
    if min(m, n, k, sm_count) < 1 or not tiles:
        raise ValueError(f"need M, N, K, sm_count >= 1 and a tile, got {m, n, k, sm_count}")
    for tile in tiles:
        wave = sm_count * tile.min_blocks
        blocks = ceil_div(m, tile.bm) * ceil_div(n, tile.bn)
        if blocks >= FILL * wave:
            return tile, 1
        k_tiles = ceil_div(k, tile.bk)
        splits = max(1, min(wave // blocks, k_tiles // MIN_K_TILES, MAX_SPLITS))
        if blocks * splits >= FILL * wave:
            return tile, splits
    return tile, splits


class ShapeDispatch:
    """Versions 13-14's launcher ``(a, b, c)``: (tile, splits) from
    ``choose_schedule`` for each call's shape and this GPU's SM count (asked
    once); one split-K workspace kept throughout.

    ``fast``: version 11 (a Version), whose tile then stands first among the
    candidates: when the schedule picks it and M, N, K divide it, its unguarded
    kernel runs on the split (``launch_fast_split``); every other schedule runs
    on the warp-tiled kernels (``launch_warptiled``), ragged sizes on the
    guarded one at the same split."""

    def __init__(self, tiles, fast=None):
        self.fast = fast
        self.tiles = tuple(tiles) if fast is None else (fast.tile, *tuple(tiles)[1:])
        self.warp_tiles = tuple(tiles)
        self.sm_count = sm_count()
        self.workspace = SplitKWorkspace()

    def schedule(self, m, n, k):
        """The (tile, splits) a (M, N, K) product runs with."""
        return choose_schedule(m, n, k, self.sm_count, self.tiles)

    def __call__(self, a, b, c):
        m, n = c.shape
        k = a.shape[1]
        tile, splits = self.schedule(m, n, k)
        if self.fast is not None and tile == self.fast.tile:
            if m % tile.bm == 0 and n % tile.bn == 0 and k % tile.bk == 0:
                launch_fast_split(self.fast.kernels[0], tile, splits, self.workspace, a, b, c)
                return
            tile = self.warp_tiles[0]
            splits = min(splits, ceil_div(k, tile.bk))
        launch_warptiled(tile, splits, self.workspace, a, b, c)


def launch_fast_split(kernel, tile, splits, workspace, a, b, c):
    """Version 10's unguarded kernel (``make_matmul_unguarded(tile)``) on a
    (N / BN, M / BM, ``splits``) grid: layer z sums its share of the K tiles
    into the z-th slab of ``workspace``, then ``matmul_splitk_reduce`` adds the
    slabs into c in a fixed order (no workspace when splits == 1). M, N, K must
    be multiples of the tile (no guards); 1 <= splits <= K / BK."""
    m, n = c.shape
    k_total = a.shape[1]
    if m % tile.bm or n % tile.bn or k_total % tile.bk or not 1 <= splits <= k_total // tile.bk:
        raise ValueError(
            f"launch_fast_split needs M % {tile.bm} == N % {tile.bn} == K % {tile.bk} == 0 "
            f"and 1 <= splits <= K / {tile.bk}; got M={m} N={n} K={k_total} splits={splits}"
        )
    out = c.reshape(m * n) if splits == 1 else workspace.partials(splits, m, n)
    kernel[(n // tile.bn, m // tile.bm, splits), tile.threads](
        a.reshape(m * k_total), b.reshape(k_total * n), out, n, k_total
    )
    add_split_partials(out, c, splits)


def schedule_versions(tuned=None):
    """Versions 12-14 (a list of Version): 12 the warp-tiled kernel at
    SCHEDULE_TILES[0], unsplit; 13 split-K by shape on one tile; 14 tile and
    split-K by shape. With ``tuned`` (version 11), 13 and 14 run version 11's
    kernel and tile where the shape divides it (``ShapeDispatch``); without,
    SCHEDULE_TILES[0]'s warp-tiled kernels. ``kernels`` lists what each may launch."""
    big = SCHEDULE_TILES[0]
    fast, guarded = warptiled_kernels(big)
    every = tuple(kern for t in SCHEDULE_TILES for kern in warptiled_kernels(t))
    first = (fast, guarded) if tuned is None else (tuned.kernels[0], guarded)
    split_tile = big if tuned is None else tuned.tile
    return [
        Version(
            12,
            f"warp-tiled {big}",
            partial(launch_warptiled, big, 1, None),
            (fast, guarded),
            big,
        ),
        Version(
            13,
            f"split-K by shape {split_tile}",
            ShapeDispatch((big,), tuned),
            (*first, matmul_splitk_reduce),
            split_tile,
        ),
        Version(
            14,
            "chosen by shape (tile + split-K)",
            ShapeDispatch(SCHEDULE_TILES, tuned),
            (*first, *every, matmul_splitk_reduce),
        ),
    ]


# --------------------------------------------------------------------------
# main: check every version, then time it, next to cuBLAS
# --------------------------------------------------------------------------


def random_operands(m, n, k, rng):
    """(a_h, b_h, a, b): random float32 A (M, K) and B (K, N), on the host and the device."""
    a_h = random_array((m, k), np.float32, rng)
    b_h = random_array((k, n), np.float32, rng)
    return a_h, b_h, cuda.to_device(a_h), cuda.to_device(b_h)


# GPU time only: the timed calls queue behind a 20 ms hold, so split-K's two Numba
# launches (tens of microseconds of host time each) are not timed at 1024^3, where
# the kernels run for about as long; cuBLAS is timed the same way.
HOLD_MS = pick(gpu=20, simulator=0)


def run_size(size, versions, with_cublas, rng, peaks, quick):
    """Check and time versions 1-2, each of ``versions``, then cuBLAS (if
    ``with_cublas``) at one (M, N, K) = ``size``; returns a list of Timing."""
    m, n, k = size
    a_h, b_h, a, b = random_operands(m, n, k, rng)
    ref = matmul_reference(a_h, b_h)
    flops, nbytes = 2 * m * n * k, 4 * (m * k + k * n + m * n)
    results = []
    if m * n * k <= pick(gpu=64**3, simulator=40**3):
        check(matmul_python_loops(a_h, b_h), ref, tol=TOL, name="1 Python loops")
        results.append(Timing(name="1 Python loops (CPU, checked, not timed)"))
    if m * n * k <= 2048**3:
        check(a_h @ b_h, ref, tol=TOL, name="2 NumPy")
        results.append(
            Timing(
                name="2 NumPy (CPU, host clock)",
                median_ms=cpu_ms(partial(np.matmul, a_h, b_h)),
                flops=flops,
                repeats=3,
                peak_tflops=peaks.get("sgemm_tflops"),
            )
        )
    # One thread an output takes seconds a call from 2048 on: 1 warm-up, 3 timed runs.
    timed = [(v.label, v.launcher, v.number in (3, 4) and m * n * k >= 2048**3) for v in versions]
    if with_cublas:
        timed.append((tools.CUBLAS, tools.CublasSgemm(), False))
    for label, launcher, slow in timed:
        warmup, repeats = (1, 3) if slow or quick else (3, 20)
        results += run_versions(
            {label: launcher},
            (a, b),
            ref,
            (m, n),
            np.float32,
            tol=TOL,
            flops=flops,
            nbytes=nbytes,
            warmup=warmup,
            repeats=repeats,
            peaks=peaks,
            print_table=False,
            hold_ms=HOLD_MS,
        )
    return results


def main(argv=None):
    parser = script_parser(__doc__, CHAPTER)
    parser.add_argument(
        "--sizes",
        type=tools.parse_sizes,
        default=None,
        help="comma list of N (square) or MxNxK; default 1024,2048,4096,"
        "4096x4096x256,256x4096x4096 on a GPU (the last two: small K, small M), "
        "33x20x17,8x12x64 in the simulator",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one size (1024), 2 tile shapes for version 11, few repeats",
    )
    parser.add_argument(
        "--tune-size",
        type=int,
        default=None,
        help="square size version 11 picks its tile at (default: the largest "
        "of --sizes, at most 4096; 1024 with --quick)",
    )
    parser.add_argument(
        "--only",
        type=tools.parse_numbers,
        default=None,
        help="comma list of GPU versions (3-14) to run, e.g. 11,12,13,14; "
        "default all (versions 1-2 and cuBLAS always run)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    default_sizes = pick(
        gpu="1024" if args.quick else "1024,2048,4096,4096x4096x256,256x4096x4096",
        simulator="33x20x17,8x12x64",
    )
    sizes = args.sizes or tools.parse_sizes(default_sizes)
    peaks = device_peaks()
    device = peaks.get("device", "?")
    with_cublas = tools.cublas_available()
    print(
        f"device: {device}; cuBLAS {'available' if with_cublas else 'NOT available'}"
        + (" (simulator: correctness only)" if is_simulator() else "")
    )
    print(
        f"every version is checked against the float64 product (relative error <= {TOL}), "
        "then timed"
    )

    versions = [v for v in gpu_versions() if args.only is None or v.number in args.only]
    tuned_tile, tune_results = None, []
    if args.only is None or 11 in args.only:
        largest = max(min(max(s), 4096) for s in sizes)
        ts = args.tune_size or pick(gpu=1024 if args.quick else largest, simulator=None)
        # simulator: 32 x 16 x 24 divides both of its tile shapes
        tune_size = (ts, ts, ts) if ts else (32, 16, 24)
        tuned, tune_results = autotune(
            TUNE_SHAPES[:2] if args.quick else TUNE_SHAPES,
            tune_size,
            rng,
            repeats=5 if args.quick else 10,
        )
        tuned_tile = asdict(tuned.tile)
        print(f"autotuner picked {tuned.tile} mb{tuned.tile.min_blocks}")
        versions.append(tuned)
    tuned_v = next((v for v in versions if v.number == 11), None)
    versions += [
        v for v in schedule_versions(tuned_v) if args.only is None or v.number in args.only
    ]
    schedules = {}
    for v in versions:
        if v.number == 14:
            print(f"version 14's schedule on {v.launcher.sm_count} SMs (choose_schedule):")
            for m, n, k in sizes:
                tile, splits = v.launcher.schedule(m, n, k)
                schedules[f"{m}x{n}x{k}"] = {"tile": str(tile), "splits": splits}
                print(f"  {m}x{n}x{k}: tile {tile}, splits {splits}")

    all_results = {}
    for size in sizes:
        results = run_size(size, versions, with_cublas, rng, peaks, args.quick)
        tools.add_fraction_of_cublas(results)
        tools.print_results(size, results)
        all_results[size] = results

    # what the register tiles of versions 8-11 became (nothing in the simulator)
    # (versions 12-14 share kernels: each is reported once, under its first version)
    kernels = {
        id(kern): (kern, v.label) for v in versions[::-1] if v.number >= 8 for kern in v.kernels
    }
    reports = [tools.compiler_report(kern, label) for kern, label in list(kernels.values())[::-1]]
    tools.print_compiler_reports(reports)

    for size, results in all_results.items():
        for r in results:
            r.extra["size"] = list(size)
    flat = [r for results in all_results.values() for r in results]
    save_results(
        flat + tune_results,
        args.out,
        "matmul",
        tuned_tile=tuned_tile,
        schedules=schedules,
        compiler=[r for r in reports if r],
        sgemm_peak_tflops=peaks.get("sgemm_tflops"),
    )
    png = tools.plot(all_results, args.out / "matmul.png", device)
    if png:
        print(f"wrote {png}")
    tools.print_best_fraction(all_results)
    return 0


if __name__ == "__main__":
    run_script(main)
