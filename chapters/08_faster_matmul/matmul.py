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
version 11 autotuned: version 10 generated over a few tile shapes, fastest one kept
baseline   cuBLAS SGEMM through torch.matmul (TF32 off), measured in the same run

Run:   python chapters/08_faster_matmul/matmul.py [--sizes 1024,2048,4096] [--quick]
           [--only 9,10,11] [--tune-size N] [--out DIR]

Every version is checked against a float64 product on the same inputs (the
tolerance 1e-4 also proves TF32 is off: TF32 gives ~1e-3), then timed with
CUDA events. Kernels 6-11 come from factories (``make_*``) that close over the
tile sizes, so Numba sees them as compile-time constants: loops over them
unroll and ``cuda.local.array`` of that size can live in registers. The
designs follow Simon Boehm, "How to Optimize a CUDA Matmul Kernel for
cuBLAS-like Performance" (2022, siboehm.com/articles/22/CUDA-MMM) and
CUTLASS's thread-level tiling (NVIDIA, "CUTLASS: Fast Linear Algebra in CUDA
C++", 2017).
"""

import common  # noqa: F401, I001  (first: picks GPU or simulator before numba loads)
import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint64

from common.checking import CheckError, check, random_array
from common.harness import run_versions
from common.runtime import ceil_div, is_simulator, jit, pick
from common.timing import Timing, device_peaks, format_table, write_json

# The simulator refuses shared-memory alignment; on a GPU 16 bytes allows LDS.128.
SMEM_ALIGN = pick(gpu=16, simulator=None)

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
@cuda.jit
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
@cuda.jit
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

    @cuda.jit
    def matmul_smem_tiled(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        m, kk = a.shape
        n = b.shape[1]
        acc = float32(0.0)
        for k0 in range(0, kk, TILE):
            # Out-of-range cells are loaded as 0, so they add nothing below.
            a_tile[ty, tx] = a[row, k0 + tx] if row < m and k0 + tx < kk else float32(0.0)
            b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < kk and col < n else float32(0.0)
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


def make_matmul_blocktile_1d(BM, BN, BK, TM):
    """v6 factory: a block of (BM / TM) * BN threads computes a BM x BN tile of C;
    each thread TM outputs of one column. Per k, a thread loads one B value
    from shared memory and reuses it TM times: TM FMAs per (1 + TM) shared loads,
    against 1 FMA per 2 loads in v5. Needs BM * BK == BN * BK == threads."""
    THREADS = (BM // TM) * BN
    assert BM % TM == 0 and BM * BK == THREADS and BK * BN == THREADS, "inconsistent tile"

    @cuda.jit
    def matmul_blocktile_1d(a, b, c):
        a_tile = cuda.shared.array((BM, BK), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array(TM, float32)
        tid = cuda.threadIdx.x
        m, kk = a.shape
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
        for k0 in range(0, kk, BK):
            ok_a = row0 + ar < m and k0 + ac < kk
            a_tile[ar, ac] = a[row0 + ar, k0 + ac] if ok_a else float32(0.0)
            ok_b = k0 + br < kk and col0 + bc < n
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

    matmul_blocktile_1d.threads = THREADS
    matmul_blocktile_1d.tile = (BM, BN)
    return matmul_blocktile_1d


def make_matmul_blocktile_2d(BM, BN, BK, TM, TN):
    """v7 factory: (BM / TM) * (BN / TN) threads; each thread a TM x TN register
    tile. Per k a thread loads TM values of A and TN of B from shared memory
    and does TM * TN FMAs (an outer product): 64 FMAs per 16 loads for 8 x 8.
    Thread (tx, ty) owns rows ty + i * BM/TM and columns tx + j * BN/TN: strided
    so that the 32 threads of a warp read 32 consecutive B values (no bank
    conflict) and write C coalesced."""
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    assert BM % TM == 0 and BN % TN == 0, "tile must divide the block tile"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"

    @cuda.jit
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
        m, kk = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(0, kk, BK):
            for l in range(A_LOADS):
                idx = tid + l * THREADS
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < kk
                a_tile[r, q] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for l in range(B_LOADS):
                idx = tid + l * THREADS
                r, q = idx // BN, idx % BN
                ok = k0 + r < kk and col0 + q < n
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

    matmul_blocktile_2d.threads = THREADS
    matmul_blocktile_2d.tile = (BM, BN)
    return matmul_blocktile_2d


# --------------------------------------------------------------------------
# Version 8-9: transposed A tile, 4-wide fragments, double buffering
# --------------------------------------------------------------------------


def make_matmul_transposed_a(BM, BN, BK, TM, TN):
    """v8 factory: as v7, but the A tile is stored transposed (k-major, rows
    padded by 4 floats) so that a thread's TM values of A for one k sit next to
    each other, like its TN values of B. Thread (tx, ty) owns rows in groups
    of 4 consecutive rows (ty * 4 + g * BM / (TM / 4)), and columns likewise:
    each group of 4 is one 16-byte shared-memory load (LDS.128) when the
    compiler vectorises it, 4 loads instead of 16 per k for an 8 x 8 tile.
    The padding spreads the transposing stores over all 32 banks."""
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    A_LOADS, B_LOADS = BM * BK // THREADS, BK * BN // THREADS
    AP = BM + 4  # padded row length of the transposed A tile
    GA, GB = BM // (TM // 4), BN // (TN // 4)  # distance between 4-groups
    A_SIZE, B_SIZE = BK * AP, BK * BN  # shared array sizes must be plain constants
    assert TM % 4 == 0 and TN % 4 == 0, "fragments come in groups of 4"
    assert A_LOADS * THREADS == BM * BK and B_LOADS * THREADS == BK * BN, "uneven loads"

    @cuda.jit
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
        m, kk = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(0, kk, BK):
            for l in range(A_LOADS):
                idx = tid + l * THREADS
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < kk
                a_tile[q * AP + r] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for l in range(B_LOADS):
                idx = tid + l * THREADS
                r, q = idx // BN, idx % BN
                ok = k0 + r < kk and col0 + q < n
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

    matmul_transposed_a.threads = THREADS
    matmul_transposed_a.tile = (BM, BN)
    return matmul_transposed_a


def make_matmul_double_buffered(BM, BN, BK, TM, TN, MIN_BLOCKS=2):
    """v9 factory: v8 with two shared buffers. While the block computes on tile
    t, each thread already holds tile t + 1's values (loaded from global memory
    into registers before the compute, so the load latency hides behind
    BK * TM * TN FMAs); it stores them into the other buffer afterwards. One
    syncthreads per tile instead of two."""
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
    @jit(launch_bounds=(THREADS, MIN_BLOCKS))
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
        m, kk = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        # Prologue: tile 0 straight into buffer 0.
        for l in range(A_LOADS):
            idx = tid + l * THREADS
            r, q = idx // BK, idx % BK
            ok = row0 + r < m and q < kk
            a_tile[q * AP + r] = a[row0 + r, q] if ok else float32(0.0)
        for l in range(B_LOADS):
            idx = tid + l * THREADS
            r, q = idx // BN, idx % BN
            ok = r < kk and col0 + q < n
            b_tile[r * BN + q] = b[r, col0 + q] if ok else float32(0.0)
        cuda.syncthreads()
        tiles = (kk + BK - 1) // BK
        for t in range(tiles):
            cur = t & 1  # t % 2, written so the compiler sees it is >= 0
            k1 = (t + 1) * BK
            if t + 1 < tiles:  # issue the global loads of the next tile now
                for l in range(A_LOADS):
                    idx = tid + l * THREADS
                    r, q = idx // BK, idx % BK
                    ok = row0 + r < m and k1 + q < kk
                    a_next[l] = a[row0 + r, k1 + q] if ok else float32(0.0)
                for l in range(B_LOADS):
                    idx = tid + l * THREADS
                    r, q = idx // BN, idx % BN
                    ok = k1 + r < kk and col0 + q < n
                    b_next[l] = b[k1 + r, col0 + q] if ok else float32(0.0)
            a_base = cur * A_BUF + ty * 4
            b_base = cur * B_BUF + tx * 4
            # Two k per trip of the outer loop: the compiler unrolls the inner pair,
            # halving the loop and address overhead per FMA.
            for k2 in range(BK // 2):
                for kk2 in range(2):
                    k = 2 * k2 + kk2
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
                for l in range(A_LOADS):
                    idx = tid + l * THREADS
                    a_tile[uint64(nxt * A_BUF + (idx % BK) * AP + idx // BK)] = a_next[l]
                for l in range(B_LOADS):
                    b_tile[uint64(nxt * B_BUF + tid + l * THREADS)] = b_next[l]
            # The other buffer is complete, and nobody reads this one any more.
            cuda.syncthreads()
        for i in range(TM):
            row = row0 + (i // 4) * GA + ty * 4 + i % 4
            for j in range(TN):
                col = col0 + (j // 4) * GB + tx * 4 + j % 4
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    matmul_double_buffered.threads = THREADS
    matmul_double_buffered.launch_bounds = (THREADS, MIN_BLOCKS)
    matmul_double_buffered.tile = (BM, BN)
    return matmul_double_buffered


def make_matmul_unguarded(BM, BN, BK, TM, TN, MIN_BLOCKS=2):
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

    @jit(launch_bounds=(THREADS, MIN_BLOCKS))
    def matmul_unguarded(a, b, c, n, kk):
        # a: (M * K,), b: (K * N,), c: (M * N,) flat row-major views; n = N, kk = K.
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
        # Per-thread offsets, computed once: load l of a tile reads A's row
        # tid // BK + l * A_ROWS, a constant A_ROWS * K floats further on.
        a_src = (row0 + tid // BK) * kk + tid % BK
        b_src = (tid // BN) * n + col0 + tid % BN
        a_dst = (tid % BK) * AP + tid // BK  # transposed: a_tile[k * AP + row]
        a_step, b_step = A_ROWS * kk, B_ROWS * n
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for l in range(A_LOADS):
            a_tile[uint64(a_dst + l * A_ROWS)] = a[uint64(a_src + l * a_step)]
        for l in range(B_LOADS):
            b_tile[uint64(tid + l * THREADS)] = b[uint64(b_src + l * b_step)]
        cuda.syncthreads()
        tiles = kk // BK
        for t in range(tiles):
            cur = t & 1
            if t + 1 < tiles:  # the next tile's loads, in flight during the FMAs
                a_src += BK
                b_src += BK * n
                for l in range(A_LOADS):
                    a_next[l] = a[uint64(a_src + l * a_step)]
                for l in range(B_LOADS):
                    b_next[l] = b[uint64(b_src + l * b_step)]
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
                for l in range(A_LOADS):
                    a_tile[uint64(nxt * A_BUF + a_dst + l * A_ROWS)] = a_next[l]
                for l in range(B_LOADS):
                    b_tile[uint64(nxt * B_BUF + tid + l * THREADS)] = b_next[l]
            cuda.syncthreads()
        for i in range(TM):
            c_row = (row0 + (i // 4) * GA + ty * 4 + i % 4) * n + col0 + tx * 4
            for j in range(TN):
                c[uint64(c_row + (j // 4) * GB + j % 4)] = acc[i, j]

    matmul_unguarded.threads = THREADS
    matmul_unguarded.launch_bounds = (THREADS, MIN_BLOCKS)
    matmul_unguarded.tile = (BM, BN)
    matmul_unguarded.bk = BK
    return matmul_unguarded


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------


def check_operands(a, b, c):
    """Raise a clear error unless a (M, K), b (K, N), c (M, N) are 2-D float32 row-major."""
    for name, x in (("a", a), ("b", b), ("c", c)):
        if len(x.shape) != 2 or np.dtype(x.dtype) != np.float32:
            raise TypeError(
                f"{name} must be a 2-D float32 array, got shape {x.shape} dtype {x.dtype}; "
                "convert with np.ascontiguousarray(x, dtype=np.float32)"
            )
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous (row-major); copy it first")
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"shapes do not chain: a {a.shape} @ b {b.shape} -> c {c.shape}")


def launch_one_per_thread(kernel, a, b, c, block=(16, 16)):
    """v3/v4: one thread per output. v3 maps x to rows, v4 maps x to columns."""
    m, n = c.shape
    if kernel is matmul_naive:
        grid = (ceil_div(m, block[0]), ceil_div(n, block[1]))
    else:
        grid = (ceil_div(n, block[0]), ceil_div(m, block[1]))
    kernel[grid, block](a, b, c)


def launch_tiled(kernel, a, b, c):
    """v5: grid of TILE x TILE blocks over C."""
    tile = kernel.tile
    m, n = c.shape
    kernel[(ceil_div(n, tile), ceil_div(m, tile)), (tile, tile)](a, b, c)


def launch_blocktiled(kernel, a, b, c):
    """v6-v9 (and v10 on ragged sizes): one block of ``kernel.threads`` threads per BM x BN tile of C."""
    bm, bn = kernel.tile
    m, n = c.shape
    kernel[(ceil_div(n, bn), ceil_div(m, bm)), kernel.threads](a, b, c)


def launch_unguarded(kernel, a, b, c):
    """v10's fast kernel: one block per BM x BN tile, operands passed flat.
    Raises ValueError unless M, N, K are multiples of BM, BN, BK (it has no guards)."""
    bm, bn = kernel.tile
    m, n = c.shape
    kk = a.shape[1]
    if m % bm or n % bn or kk % kernel.bk:
        raise ValueError(f"the unguarded kernel needs M % {bm} == N % {bn} == K % {kernel.bk} "
                         f"== 0, got M={m} N={n} K={kk}; use make_matmul_fast (it falls back)")
    kernel[(n // bn, m // bm), kernel.threads](a.reshape(m * kk), b.reshape(kk * n),
                                                c.reshape(m * n), n, kk)


def make_matmul_fast(BM, BN, BK, TM, TN, MIN_BLOCKS=2):
    """v10: launch(a, b, c) for any M, N, K. Chooses at launch time: the
    unguarded v10 kernel when M, N, K are multiples of BM, BN, BK, else the
    guarded v9 kernel of the same shape (same arithmetic, edges checked).
    ``launch.kernels`` = (unguarded, guarded); ``launch.shape`` = the arguments."""
    fast = make_matmul_unguarded(BM, BN, BK, TM, TN, MIN_BLOCKS)
    edge = make_matmul_double_buffered(BM, BN, BK, TM, TN, MIN_BLOCKS)

    def launch(a, b, c):
        m, n = c.shape
        if m % BM == 0 and n % BN == 0 and a.shape[1] % BK == 0:
            launch_unguarded(fast, a, b, c)
        else:
            launch_blocktiled(edge, a, b, c)

    launch.kernels = (fast, edge)
    launch.shape = (BM, BN, BK, TM, TN, MIN_BLOCKS)
    return launch


def smem_tiled(tile):
    k = make_matmul_smem_tiled(tile)
    k.tile = tile
    return k


# Tile shapes per runtime: full size on a GPU; tiny in the simulator, which runs
# a Python thread per CUDA thread (same code, smaller constants).
TILE_5 = pick(gpu=32, simulator=4)
SHAPE_6 = pick(gpu=(64, 64, 8, 8), simulator=(8, 8, 2, 4))  # BM, BN, BK, TM
SHAPE_7 = pick(gpu=(128, 128, 8, 8, 8), simulator=(8, 8, 4, 2, 2))  # BM, BN, BK, TM, TN
SHAPE_8 = pick(gpu=(128, 128, 8, 8, 8), simulator=(16, 16, 4, 4, 4))

# Autotuner candidates for v10 (BM, BN, BK, TM, TN, MIN_BLOCKS): 256 threads,
# 8 x 8, 8 x 4, 4 x 8 or 4 x 4 register tiles, BK 8 or 16, 1 or 2 blocks per SM.
# All fit 48 KiB of shared memory and, checked with ptxas for sm_90, none
# spills registers (128 x 128 BK16 uses 127 of its 128 with 2 blocks per SM).
TUNE_SHAPES = pick(
    gpu=[
        (128, 128, 8, 8, 8, 2),
        (128, 128, 16, 8, 8, 2),
        (128, 128, 16, 8, 8, 1),
        (128, 64, 16, 8, 4, 2),
        (64, 128, 16, 4, 8, 2),
        (64, 64, 16, 4, 4, 2),
    ],
    simulator=[(16, 16, 4, 4, 4, 2), (16, 8, 8, 4, 4, 1)],
)


def gpu_versions():
    """name -> (launch(a, b, c), kernel or None), versions 3-9 in order."""
    v5 = smem_tiled(TILE_5)
    v6 = make_matmul_blocktile_1d(*SHAPE_6)
    v7 = make_matmul_blocktile_2d(*SHAPE_7)
    v8 = make_matmul_transposed_a(*SHAPE_8)
    v9 = make_matmul_double_buffered(*SHAPE_8)
    v10 = make_matmul_fast(*SHAPE_8)
    return {
        "3 naive (x -> row)": (lambda a, b, c: launch_one_per_thread(matmul_naive, a, b, c),
                               matmul_naive),
        "4 coalesced (x -> col)": (lambda a, b, c: launch_one_per_thread(matmul_coalesced, a, b, c),
                                   matmul_coalesced),
        f"5 smem tiled {TILE_5}x{TILE_5}": (lambda a, b, c: launch_tiled(v5, a, b, c), v5),
        "6 1D blocktile {}x{} BK{} TM{}".format(*SHAPE_6):
            (lambda a, b, c: launch_blocktiled(v6, a, b, c), v6),
        "7 2D blocktile {}x{} BK{} {}x{}".format(*SHAPE_7):
            (lambda a, b, c: launch_blocktiled(v7, a, b, c), v7),
        "8 transposed A {}x{} BK{} {}x{}".format(*SHAPE_8):
            (lambda a, b, c: launch_blocktiled(v8, a, b, c), v8),
        "9 double buffered {}x{} BK{} {}x{}".format(*SHAPE_8):
            (lambda a, b, c: launch_blocktiled(v9, a, b, c), v9),
        "10 unguarded fast path {}x{} BK{} {}x{}".format(*SHAPE_8): (v10, v10.kernels[0]),
    }


def matmul_best(a, b, c, launch=None):
    """C = A @ B with the tuned v10 (``make_matmul_fast(*TUNE_SHAPES[0])``
    unless ``launch`` is given, e.g. the one ``autotune`` returns).

    a: (M, K), b: (K, N), c: (M, N) float32 C-contiguous device arrays; any
    M, N, K >= 1 (ragged edges go to the guarded kernel). Raises TypeError /
    ValueError on bad operands.
    """
    check_operands(a, b, c)
    (launch or _default_best())(a, b, c)


_BEST = {}


def _default_best():
    if "k" not in _BEST:
        _BEST["k"] = make_matmul_fast(*TUNE_SHAPES[0])
    return _BEST["k"]


# --------------------------------------------------------------------------
# cuBLAS baseline (through torch), autotuner, compiler report
# --------------------------------------------------------------------------


def cublas_available():
    if is_simulator():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def cublas_matmul(a, b):
    """launch(c) running torch.matmul (cuBLAS SGEMM, TF32 off) on Numba device
    arrays a, b, c without a copy (torch.as_tensor reads __cuda_array_interface__).
    The torch views are made once, outside the timed call, so cuBLAS is not
    charged for wrapping."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    ta, tb = torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
    views = {}

    def launch(c):
        if id(c) not in views:
            views[id(c)] = (c, torch.as_tensor(c, device="cuda"))
        torch.matmul(ta, tb, out=views[id(c)][1])

    return launch


def autotune(shapes, m, n, k, rng, repeats=10):
    """Build v10 for each (BM, BN, BK, TM, TN, MIN_BLOCKS) in ``shapes``, check
    it on an (m, k) @ (k, n) product, time it; return (fastest launch(a, b, c),
    its shape, table).

    In the simulator nothing is timed: every shape is still checked and the
    first one returned."""
    a_h = random_array((m, k), np.float32, rng)
    b_h = random_array((k, n), np.float32, rng)
    a, b = cuda.to_device(a_h), cuda.to_device(b_h)
    ref = matmul_reference(a_h, b_h)
    versions, kernels = {}, {}
    for shape in shapes:
        launch = make_matmul_fast(*shape)
        name = "BM{} BN{} BK{} TM{} TN{} minblocks{}".format(*shape)
        kernels[name] = (launch, shape)
        versions[name] = lambda out, launch=launch: launch(a, b, out)
    results = run_versions(versions, ref, (m, n), np.float32, tol=1e-4, flops=2 * m * n * k,
                           warmup=1, repeats=repeats,
                           title=f"autotune v10 tile shapes at {m}x{n}x{k}")
    if not results[0].measured:
        best = results[0]
    else:
        best = min(results, key=lambda r: r.median_ms)
    return kernels[best.name][0], kernels[best.name][1], results


def compiler_report(kernel, label):
    """Registers per thread, local memory (spills), shared memory, and what the
    PTX of the kernel contains: FMAs, shared loads (scalar and 4-wide), local
    loads. Returns a dict; {} in the simulator (nothing is compiled there)."""
    if is_simulator() or not kernel.overloads:
        return {}
    sig = next(iter(kernel.overloads))
    report = {"kernel": label}
    # The compiled kernel for one signature; the same numbers as
    # kernel.get_regs_per_thread() / get_local_mem_per_thread() /
    # get_shared_mem_per_block() give for a kernel with one signature.
    compiled = kernel.overloads[sig]
    for key, attr in (("registers_per_thread", "regs_per_thread"),
                      ("local_bytes_per_thread", "local_mem_per_thread"),
                      ("shared_bytes_per_block", "shared_mem_per_block")):
        try:
            report[key] = getattr(compiled, attr)
        except Exception as exc:  # noqa: BLE001  (a driver query; report, don't fail)
            report[key] = f"n/a ({type(exc).__name__})"
    ptx = kernel.inspect_asm(sig)
    report["ptx_fma_f32"] = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    report["ptx_ld_shared_f32"] = len(re.findall(r"\bld\.shared\.f32\b", ptx))
    report["ptx_ld_shared_v4"] = len(re.findall(r"\bld\.shared\.v4\.f32\b", ptx))
    report["ptx_ld_shared_v2"] = len(re.findall(r"\bld\.shared\.v2\.f32\b", ptx))
    report["ptx_ld_local"] = len(re.findall(r"\bld\.local\b", ptx))
    report["ptx_st_local"] = len(re.findall(r"\bst\.local\b", ptx))
    lines = [ln.strip() for ln in ptx.splitlines()
             if "fma.rn.f32" in ln or "ld.shared" in ln]
    report["ptx_inner_loop_sample"] = lines[:12]
    return report


def print_compiler_report(report):
    if not report:
        return
    print(f"  {report['kernel']}: {report['registers_per_thread']} registers/thread, "
          f"{report['local_bytes_per_thread']} B local memory/thread (spills if > 0), "
          f"{report['shared_bytes_per_block']} B shared/block")
    print(f"    PTX: {report['ptx_fma_f32']} fma.rn.f32, {report['ptx_ld_shared_f32']} "
          f"ld.shared.f32, {report['ptx_ld_shared_v4']} ld.shared.v4.f32, "
          f"{report['ptx_ld_local']} ld.local / {report['ptx_st_local']} st.local")
    for ln in report["ptx_inner_loop_sample"][:6]:
        print(f"      {ln}")


# --------------------------------------------------------------------------
# main: check every version, time it next to cuBLAS, plot
# --------------------------------------------------------------------------


def parse_sizes(text):
    """'1024,2048' -> [(1024, 1024, 1024), ...]; 'MxNxK' entries are rectangular."""
    sizes = []
    for item in text.split(","):
        parts = [int(p) for p in item.lower().split("x")]
        if len(parts) == 1:
            parts *= 3
        if len(parts) != 3 or min(parts) < 1:
            raise SystemExit(f"bad size {item!r}: use N or MxNxK with positive ints")
        sizes.append(tuple(parts))
    return sizes


def run_size(m, n, k, versions, tuned, rng, peaks, quick):
    """Check and time every version at one (M, N, K); returns a list of Timing."""
    a_h = random_array((m, k), np.float32, rng)
    b_h = random_array((k, n), np.float32, rng)
    ref = matmul_reference(a_h, b_h)
    a, b = cuda.to_device(a_h), cuda.to_device(b_h)
    flops = 2 * m * n * k
    nbytes = 4 * (m * k + k * n + m * n)
    results = []

    if m * n * k <= pick(gpu=64**3, simulator=40**3):
        out = matmul_python_loops(a_h, b_h)
        check(out, ref, tol=1e-4, name="1 Python loops")
        results.append(Timing(name="1 Python loops (CPU, checked, not timed)"))
    if m * n * k <= 2048**3:
        out = a_h @ b_h
        check(out, ref, tol=1e-4, name="2 NumPy")
        import time

        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            a_h @ b_h
        ms = (time.perf_counter() - t0) / reps * 1e3
        results.append(Timing(name="2 NumPy (CPU, host clock)", median_ms=ms, flops=flops,
                              repeats=reps, peak_tflops=peaks.get("sgemm_tflops")))

    def one(name, fn, slow=False):
        # Slow versions (seconds at 4096) get 1 warm-up and 3 timed runs.
        warmup, repeats = (1, 3) if slow or quick else (3, 20)
        r = run_versions({name: fn}, ref, (m, n), np.float32, tol=1e-4, flops=flops,
                         nbytes=nbytes, warmup=warmup, repeats=repeats, peaks=peaks,
                         print_table=False)
        results.extend(r)

    for name, (launch, _) in versions.items():
        slow = name.startswith(("3", "4")) and m * n * k >= 2048**3
        one(name, lambda out, launch=launch: launch(a, b, out), slow=slow)
    launch, shape = tuned
    one("11 autotuned v10 {}x{} BK{} {}x{} mb{}".format(*shape),
        lambda out: launch(a, b, out))
    if cublas_available():
        one("cuBLAS SGEMM (torch, TF32 off)", cublas_matmul(a, b))
        cub = results[-1].tflops
        for r in results:
            r.extra["fraction_of_cublas"] = (r.tflops / cub) if (r.tflops and cub) else None
    return results


def print_results(size, results):
    m, n, k = size
    print(format_table(results, title=f"SGEMM {m}x{n}x{k} (FP32, row-major)"))
    if any("fraction_of_cublas" in r.extra for r in results):
        print("  % of cuBLAS measured in this run:")
        for r in results:
            f = r.extra.get("fraction_of_cublas")
            if f is not None:
                print(f"    {r.name:<44} {r.tflops:7.2f} TFLOP/s  {100 * f:6.1f} %")


def plot(all_results, path, device):
    """Grouped bars: TFLOP/s per version per size; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(all_results)
    names = []
    for res in all_results.values():
        for r in res:
            if r.tflops is not None and r.name not in names:
                names.append(r.name)
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(len(sizes), 1)
    for s_i, size in enumerate(sizes):
        by_name = {r.name: r.tflops for r in all_results[size]}
        xs = [i + s_i * width for i in range(len(names))]
        ax.bar(xs, [by_name.get(nm) or 0 for nm in names], width,
               label="x".join(map(str, size)))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([nm.split(" (")[0][:28] for nm in names], rotation=35, ha="right",
                       fontsize=8)
    ax.set_ylabel("TFLOP/s (FP32)")
    ax.set_yscale("log")
    ax.set_title(f"SGEMM versions vs cuBLAS on {device}")
    ax.legend(title="M x N x K")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None,
                        help="comma list of N (square) or MxNxK; default 1024,2048,4096 "
                             "on a GPU, 33x20x17 in the simulator")
    parser.add_argument("--quick", action="store_true",
                        help="one size (1024), 2 tile shapes, few repeats")
    parser.add_argument("--tune-size", type=int, default=None,
                        help="square size the autotuner times at (default: the largest of "
                             "--sizes, at most 4096; 1024 with --quick)")
    parser.add_argument("--only", default=None,
                        help="comma list of version numbers to run, e.g. 9,10,11 (default all)")
    parser.add_argument("--out", default="runs/08_faster_matmul", help="folder for JSON and PNG")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    default_sizes = pick(gpu="1024" if args.quick else "1024,2048,4096", simulator="33x20x17")
    sizes = parse_sizes(args.sizes or default_sizes)
    peaks = device_peaks()
    device = peaks.get("device", "?")
    print(f"device: {device}; cuBLAS {'available' if cublas_available() else 'NOT available'}"
          + (" (simulator: correctness only)" if is_simulator() else ""))

    only = set(args.only.split(",")) if args.only else None
    shapes = TUNE_SHAPES[:2] if args.quick else TUNE_SHAPES
    largest = max(min(max(s), 4096) for s in sizes)
    ts = args.tune_size or pick(gpu=1024 if args.quick else largest, simulator=None)
    tm, tn, tk = (ts, ts, ts) if ts else (32, 16, 24)  # simulator: divides both tile shapes
    launch, shape, tune_results = autotune(shapes, tm, tn, tk, rng,
                                           repeats=5 if args.quick else 10)
    print("autotuner picked BM{} BN{} BK{} TM{} TN{} minblocks{}".format(*shape))

    versions = {name: v for name, v in gpu_versions().items()
                if only is None or name.split()[0] in only}
    all_results = {}
    for size in sizes:
        res = run_size(*size, versions, (launch, shape), rng, peaks, args.quick)
        print_results(size, res)
        all_results[size] = res

    print("compiler report (what the register tiles became):")
    reports = []
    for name, (_, k) in list(versions.items())[-3:]:
        reports.append(compiler_report(k, name))
        print_compiler_report(reports[-1])
    for kern, what in zip(launch.kernels, ("unguarded", "guarded")):
        reports.append(compiler_report(kern, f"11 autotuned ({what} kernel)"))
        print_compiler_report(reports[-1])

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flat = [r for res in all_results.values() for r in res]
    for size, res in all_results.items():
        for r in res:
            r.extra["size"] = list(size)
    write_json(flat + tune_results, out / "matmul.json", device=device,
               runtime="simulator" if is_simulator() else "gpu",
               tuned_shape=list(shape), compiler=reports,
               sgemm_peak_tflops=peaks.get("sgemm_tflops"))
    png = plot(all_results, out / "matmul.png", device)
    print(f"wrote {out / 'matmul.json'}" + (f" and {png}" if png else ""))
    best = _best_fraction(all_results)
    if best:
        print("best hand-written kernel vs cuBLAS: " + json.dumps(best))
    return all_results


def _best_fraction(all_results):
    """{size: (best version, % of cuBLAS)} for the kernels of this file."""
    out = {}
    for size, res in all_results.items():
        ours = [r for r in res if r.extra.get("fraction_of_cublas") and "cuBLAS" not in r.name]
        if ours:
            b = max(ours, key=lambda r: r.extra["fraction_of_cublas"])
            out["x".join(map(str, size))] = [b.name, round(100 * b.extra["fraction_of_cublas"], 1)]
    return out


if __name__ == "__main__":
    try:
        main()
    except CheckError as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
