"""GEMM on tensor cores from Numba: C = A @ B with mma.sync and wgmma in TF32, BF16, FP16.

version 1  mma_warp_tile: one warp a 16 x 8 tile of C; each lane reads its fragment
           registers straight from global memory, converts them and issues one mma.sync
           per K-step (the mechanism: 8 or 16 K a 16 x 8 mma, 2048 or 4096 flops an
           instruction where an FFMA does 2)
version 2  mma_block_tile: a BM x BN block tile staged in shared memory as registers'
           words (converted once, on the way in); each warp a WM x WN warp tile of
           (WM / 16) x (WN / 8) mma fragments, so one A fragment serves WN / 8 mmas and
           one B fragment WM / 16; padded rows (fragment reads without bank conflicts);
           the next K-slice loaded into registers while this one is multiplied (double
           buffer, one syncthreads a slice); edges guarded on load and store
version 3  wgmma_block_tile (Hopper only, common/wgmma.py): two warpgroups a 128 x BN
           block tile; each issues wgmma.mma_async on 128-byte-swizzled shared memory
           through matrix descriptors (64 x BN x 8 or 16 a call, asynchronous), fed by
           a cp.async pipeline of 3-4 stages, one syncthreads a K-slice. TF32 reads
           float32 as stored (the tensor cores truncate); BF16 / FP16 take operands
           stored in that format (converted once, untimed, as cuBLAS's are); B as
           (K, N) (copied 4 bytes at a time to its transposed place, or transposed by
           chapter 06's kernel on every call) or stored transposed, (N, K)
baselines  cuBLAS in the same precision (torch.matmul: TF32 allowed on float32 tensors,
           or BF16 / FP16 tensors, FP32 accumulate) and chapter 12's Triton kernel
           (TF32, FP16) where Triton runs, measured in the same run

Run:   python chapters/08_faster_matmul/tensor_cores.py [--sizes 1024,2048,4096] [--quick]
           [--precisions tf32,bf16,f16] [--out DIR]

Every version takes the chapter's operands, float32 A (M, K) and B (K, N) row-major,
and writes float32 C. Versions 1 and 2: TF32 rounds each value to a 10-bit mantissa (``cvt.rna``), BF16
and FP16 round pairs of neighbouring k into one 32-bit register (``cvt.rn.*x2``).
Converting on the way into shared memory keeps one input format for the three
precisions and the same operands as matmul.py; the price is 4 bytes a value read from
global memory where stored BF16 would read 2, which version 2's 128 x 128 tile reuses
enough to stay compute-bound. The instructions come from ``common/tensor_cores.py``
(Numba intrinsics with inline PTX; sm_80 or newer, checked before any launch).
Version 3 (``WgmmaLauncher``) converts what cp.async cannot (B transposed, BF16 / FP16
bits) once per operand pair, before timing; its instructions come from
``common/wgmma.py`` (compute capability 9.0 only; on other GPUs and in the simulator
the table has versions 1 and 2).

Every version is checked against the float64 product with a tolerance derived from its
precision (``tolerance``), then timed with CUDA events next to cuBLAS. In the
simulator the tiles are small (version 2: 32 x 16 blocks of two warps) and nothing is
timed. The design follows CUTLASS's warp-level mma tiling (NVIDIA, "CUTLASS: Fast
Linear Algebra in CUDA C++", 2017) and the PTX ISA's "Warp-level Matrix
Multiply-Accumulate Instructions".
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, load_chapter_module
from common import tensor_cores as tc
from common import wgmma as wg
from common.checking import EPS32, rounding_tolerance
from common.harness import comma_names, run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, is_simulator, jit, pick
from common.timing import device_peaks, format_table

from dataclasses import dataclass
from functools import partial

import numpy as np
from numba import cuda, float32, uint32

mm = import_sibling(__file__, "matmul")  # operands, checks and the float64 reference
tools = import_sibling(__file__, "matmul_tools")
ch06 = load_chapter_module("06_memory", "transpose")  # version 3's transposes of B

CHAPTER = "08_faster_matmul"
PRECISIONS = ("tf32", "bf16", "f16")
NAMES = {"tf32": "TF32", "bf16": "BF16", "f16": "FP16"}


@dataclass(frozen=True)
class TcTile:
    """Version 2's tiles. A block computes a ``bm x bn`` tile of C, stepping along K
    by ``kw`` registers' words (``kw`` K values in TF32, ``2 kw`` in BF16/FP16);
    each warp computes a ``wm x wn`` warp tile of it, (wm / 16) x (wn / 8) mma
    fragments. ``min_blocks``: blocks per SM for ``launch_bounds``."""

    bm: int
    bn: int
    kw: int
    wm: int
    wn: int
    min_blocks: int = 1

    @property
    def threads(self) -> int:
        """Threads per block: 32 a warp tile."""
        return 32 * (self.bm // self.wm) * (self.bn // self.wn)

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn} KW{self.kw} warp {self.wm}x{self.wn}"


# 8 warps of 64 x 32 (4 x 4 fragments: 64 accumulators a thread), 37 KiB of shared
# memory; one block an SM lets the compiler use up to 255 registers a thread.
# Simulator: two warps of one 16 x 16 warp tile each (1 x 2 fragments).
TILE = pick(gpu=TcTile(128, 128, 16, 64, 32), simulator=TcTile(32, 16, 8, 16, 16))


# --------------------------------------------------------------------------
# Reference and tolerance
# --------------------------------------------------------------------------


def tolerance(a, b, ref, input_unit):
    """Largest accepted ``||C - ref|| / ||ref||`` for A (M, K) @ B (K, N) (float32
    NumPy) against the float64 ``ref``, with inputs rounded to ``input_unit``
    (:data:`common.tensor_cores.UNIT_ROUNDOFF`: 2^-11 TF32 and FP16, 2^-8 BF16).

    Each product of two rounded inputs is off by at most (2u + u^2) |a_k b_k|; the
    FP32 accumulation by at most K roundings of one FP32 ulp (eps32, not eps32 / 2:
    the tensor cores' adder need not round to nearest) of a partial sum
    <= sum |a_k b_k|. Both are in units of |A| @ |B|, which is what
    :func:`common.checking.rounding_tolerance` takes (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., sec. 3.1). A wrong fragment, a
    lost K-step or swapped halves of a register err by O(|A| @ |B|) and fail.
    """
    k = a.shape[1]
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    roundings = (2 * input_unit + input_unit**2) / EPS32 + k
    return rounding_tolerance(ref, magnitude, roundings, tol=0.0)


def mma_gemm_model(a, b, precision):
    """What versions 1 and 2 compute, in NumPy, bit for bit as the simulator runs
    them: inputs rounded as the kernels round them, then one mma per K-step of 8
    (TF32) or 16 (BF16/FP16) values in order, each rounding its sum once to
    float32 (:func:`common.tensor_cores.mma_words_reference`). a (M, K), b (K, N)
    float32; returns (M, N) float32."""
    _, per_word, step = tc.PRECISIONS[precision]
    m, k = a.shape
    k_pad = ceil_div(k, step) * step
    a_p = np.zeros((m, k_pad), np.float32)
    b_p = np.zeros((k_pad, b.shape[1]), np.float32)
    a_p[:, :k], b_p[:k] = a, b
    if precision == "tf32":
        a_r, b_r = (tc.tf32_value(tc.round_tf32_bits(x)) for x in (a_p, b_p))
    elif precision == "bf16":
        a_r, b_r = (tc.bf16_value(tc.round_bf16_bits(x)) for x in (a_p, b_p))
    else:
        a_r, b_r = (tc.f16_value(tc.round_f16_bits(x)) for x in (a_p, b_p))
    d = np.zeros((m, b.shape[1]), np.float32)
    for k0 in range(0, k_pad, step):
        part = a_r[:, k0 : k0 + step].astype(np.float64) @ b_r[k0 : k0 + step].astype(np.float64)
        d = (part + d).astype(np.float32)
    return d


# --------------------------------------------------------------------------
# Registers' words: one TF32 value, or two BF16 / FP16 values of neighbouring k
# --------------------------------------------------------------------------


def make_word_loads(precision):
    """(a_word, b_word): device functions returning the uint32 register word
    ``w`` of row ``row`` of A, and of column ``col`` of B, read from float32
    global memory and converted; values past the edges count as 0."""
    if precision == "tf32":
        to_tf32 = tc.to_tf32

        @jit(device=True, forceinline=True)
        def a_word(a, row, w):
            if row < a.shape[0] and w < a.shape[1]:
                return to_tf32(a[row, w])
            return uint32(0)

        @jit(device=True, forceinline=True)
        def b_word(b, w, col):
            if w < b.shape[0] and col < b.shape[1]:
                return to_tf32(b[w, col])
            return uint32(0)

        return a_word, b_word

    pack = tc.pack_bf16x2 if precision == "bf16" else tc.pack_f16x2

    @jit(device=True, forceinline=True)
    def a_pair(a, row, w):
        lo = float32(0.0)
        hi = float32(0.0)
        if row < a.shape[0]:
            if 2 * w < a.shape[1]:
                lo = a[row, 2 * w]
            if 2 * w + 1 < a.shape[1]:
                hi = a[row, 2 * w + 1]
        return pack(lo, hi)

    @jit(device=True, forceinline=True)
    def b_pair(b, w, col):
        lo = float32(0.0)
        hi = float32(0.0)
        if col < b.shape[1]:
            if 2 * w < b.shape[0]:
                lo = b[2 * w, col]
            if 2 * w + 1 < b.shape[0]:
                hi = b[2 * w + 1, col]
        return pack(lo, hi)

    return a_pair, b_pair


def make_staging(precision):
    """(value_at, to_word): version 2's loads, split in two. ``value_at(x, i, j)`` is
    x[i, j] as float32, 0 past the edges, read from a clamped index so that the load
    always happens: a thread's loads of a slice then go out back to back, where a
    guarded load is a branch and a conversion right behind it waits for the load
    before the next one can start. ``to_word(lo, hi)`` converts when the values go
    into shared memory, after the slice's mmas: TF32 rounds ``lo`` (``hi`` unused),
    BF16 / FP16 pack the pair (k even, k odd) into one register."""
    if precision == "tf32":
        convert = tc.to_tf32

        @jit(device=True, forceinline=True)
        def to_word(lo, hi):
            return convert(lo)

    else:
        pack = tc.pack_bf16x2 if precision == "bf16" else tc.pack_f16x2

        @jit(device=True, forceinline=True)
        def to_word(lo, hi):
            return pack(lo, hi)

    @jit(device=True, forceinline=True)
    def value_at(x, i, j):
        m, n = x.shape
        v = x[min(i, m - 1), min(j, n - 1)]
        if i < m and j < n:
            return v
        return float32(0.0)

    return value_at, to_word


# --------------------------------------------------------------------------
# Version 1: one warp, one 16 x 8 tile, fragments from global memory
# --------------------------------------------------------------------------


def make_mma_warp_tile(precision):
    """v1 factory: a kernel ``(a, b, c)``, one warp (32 threads) a 16 x 8 tile of C,
    grid (ceil(N / 8), ceil(M / 16)); ``precision`` "tf32", "bf16" or "f16".
    Each lane loads its 6 registers a K-step (4 of A, 2 of B: 8 or 16 K values of
    a 16 x 8 tile) from global memory: every value of A is read N / 8 times and
    every value of B M / 16 times, so this is memory-bound, the mechanism only."""
    mma, per_word, _ = tc.PRECISIONS[precision]
    a_word, b_word = make_word_loads(precision)

    @cuda.jit  # not cached: uses common/tensor_cores.py, unseen by the cache key
    def mma_warp_tile(a, b, c):
        lane = cuda.threadIdx.x & 31
        g, t = lane // 4, lane % 4  # PTX's groupID and threadID_in_group
        row = cuda.blockIdx.y * 16 + g
        col = cuda.blockIdx.x * 8 + g
        words = (a.shape[1] + per_word - 1) // per_word
        d0 = d1 = d2 = d3 = float32(0.0)
        for w0 in range(0, words, 8):  # one mma a step of 8 words (8 or 16 K)
            d0, d1, d2, d3 = mma(
                a_word(a, row, w0 + t),
                a_word(a, row + 8, w0 + t),
                a_word(a, row, w0 + t + 4),
                a_word(a, row + 8, w0 + t + 4),
                b_word(b, w0 + t, col),
                b_word(b, w0 + t + 4, col),
                d0,
                d1,
                d2,
                d3,
            )
        # Lane (g, t) holds C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1].
        m, n = c.shape
        out_col = cuda.blockIdx.x * 8 + 2 * t
        if row < m and out_col < n:
            c[row, out_col] = d0
        if row < m and out_col + 1 < n:
            c[row, out_col + 1] = d1
        if row + 8 < m and out_col < n:
            c[row + 8, out_col] = d2
        if row + 8 < m and out_col + 1 < n:
            c[row + 8, out_col + 1] = d3

    return mma_warp_tile


# --------------------------------------------------------------------------
# Version 2: block tile in shared memory, warp tiles of several fragments
# --------------------------------------------------------------------------


def make_mma_block_tile(precision, tile):
    """v2 factory: a kernel ``(a, b, c)`` for ``tile`` (a TcTile), one block of
    ``tile.threads`` threads a ``tile.bm x tile.bn`` tile of C.

    Shared memory holds words: A as ``bm`` rows of ``kw`` words (row stride
    kw + 4: lane (g, t) reads word g * stride + t, 32 different banks), B as
    ``kw`` rows of ``bn`` words (stride bn + 8: lane (g, t) reads t * stride + g,
    32 banks again), two buffers each. Per K-step of 8 words a warp loads
    4 * WM / 16 words of A and 2 * WN / 8 of B a lane, for (WM / 16) * (WN / 8)
    mmas: 16 mmas for 24 shared loads at 64 x 32."""
    mma, per_word, _ = tc.PRECISIONS[precision]
    value_at, to_word = make_staging(precision)
    BM, BN, KW, WM, WN = tile.bm, tile.bn, tile.kw, tile.wm, tile.wn
    FM, FN = WM // 16, WN // 8
    WARPS_N = BN // WN
    THREADS = tile.threads
    PW = per_word  # K values a register word holds: 1 (TF32) or 2 (BF16, FP16)
    SA, SB = KW + 4, BN + 8  # padded row strides (words)
    A_BUF, B_BUF = BM * SA, KW * SB
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    A_LOADS, B_LOADS = BM * KW // THREADS, KW * BN // THREADS
    assert BM % WM == 0 and BN % WN == 0 and WM % 16 == 0 and WN % 8 == 0 and KW % 8 == 0
    assert A_LOADS * THREADS == BM * KW and B_LOADS * THREADS == KW * BN, "uneven loads"
    assert 4 * (A_SIZE + B_SIZE) <= 48 * 1024, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, tile.min_blocks))  # not cached: see above
    def mma_block_tile(a, b, c):
        a_tile = cuda.shared.array(A_SIZE, uint32)
        b_tile = cuda.shared.array(B_SIZE, uint32)
        acc = cuda.local.array((FM, FN, 4), float32)
        a_frag = cuda.local.array((FM, 4), uint32)
        b_frag = cuda.local.array((FN, 2), uint32)
        a_next = cuda.local.array((A_LOADS, 2), float32)  # a slice's values, unconverted
        b_next = cuda.local.array((B_LOADS, 2), float32)
        tid = cuda.threadIdx.x & 1023  # & 1023: provably >= 0, no wraparound code
        lane, warp = tid & 31, tid // 32
        g, t = lane // 4, lane % 4
        wr0 = (warp // WARPS_N) * WM  # the warp tile's first row and column in the block
        wc0 = (warp % WARPS_N) * WN
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(FM):
            for j in range(FN):
                for q in range(4):
                    acc[i, j, q] = 0.0
        words = (a.shape[1] + PW - 1) // PW
        slices = (words + KW - 1) // KW
        # Word idx of a slice: A row idx // KW, word idx % KW (consecutive threads walk
        # a row's words: coalesced along K); B word row idx // BN, column idx % BN
        # (consecutive threads walk a row's columns). Slice 0 now, into buffer 0.
        for load in range(A_LOADS):
            idx = tid + load * THREADS
            for h in range(PW):
                a_next[load, h] = value_at(a, row0 + idx // KW, (idx % KW) * PW + h)
        for load in range(B_LOADS):
            idx = tid + load * THREADS
            for h in range(PW):
                b_next[load, h] = value_at(b, (idx // BN) * PW + h, col0 + idx % BN)
        for load in range(A_LOADS):
            idx = tid + load * THREADS
            a_tile[(idx // KW) * SA + idx % KW] = to_word(a_next[load, 0], a_next[load, PW - 1])
        for load in range(B_LOADS):
            idx = tid + load * THREADS
            b_tile[(idx // BN) * SB + idx % BN] = to_word(b_next[load, 0], b_next[load, PW - 1])
        cuda.syncthreads()
        for s in range(slices):
            cur = s & 1
            k_next = (s + 1) * KW * PW  # the next slice's first K
            if s + 1 < slices:  # its global loads now: they land while this slice's mmas run
                for load in range(A_LOADS):
                    idx = tid + load * THREADS
                    for h in range(PW):
                        a_next[load, h] = value_at(
                            a, row0 + idx // KW, k_next + (idx % KW) * PW + h
                        )
                for load in range(B_LOADS):
                    idx = tid + load * THREADS
                    for h in range(PW):
                        b_next[load, h] = value_at(
                            b, k_next + (idx // BN) * PW + h, col0 + idx % BN
                        )
            a_base = cur * A_BUF + (wr0 + g) * SA + t
            b_base = cur * B_BUF + t * SB + wc0 + g
            for step in range(KW // 8):
                for i in range(FM):
                    p = a_base + i * 16 * SA + step * 8
                    a_frag[i, 0] = a_tile[p]
                    a_frag[i, 1] = a_tile[p + 8 * SA]
                    a_frag[i, 2] = a_tile[p + 4]
                    a_frag[i, 3] = a_tile[p + 8 * SA + 4]
                for j in range(FN):
                    p = b_base + step * 8 * SB + j * 8
                    b_frag[j, 0] = b_tile[p]
                    b_frag[j, 1] = b_tile[p + 4 * SB]
                for i in range(FM):
                    for j in range(FN):
                        d = mma(
                            a_frag[i, 0],
                            a_frag[i, 1],
                            a_frag[i, 2],
                            a_frag[i, 3],
                            b_frag[j, 0],
                            b_frag[j, 1],
                            acc[i, j, 0],
                            acc[i, j, 1],
                            acc[i, j, 2],
                            acc[i, j, 3],
                        )
                        acc[i, j, 0] = d[0]
                        acc[i, j, 1] = d[1]
                        acc[i, j, 2] = d[2]
                        acc[i, j, 3] = d[3]
            if s + 1 < slices:  # converted now, after the mmas, into the other buffer
                nxt = 1 - cur
                for load in range(A_LOADS):
                    idx = tid + load * THREADS
                    a_tile[nxt * A_BUF + (idx // KW) * SA + idx % KW] = to_word(
                        a_next[load, 0], a_next[load, PW - 1]
                    )
                for load in range(B_LOADS):
                    idx = tid + load * THREADS
                    b_tile[nxt * B_BUF + (idx // BN) * SB + idx % BN] = to_word(
                        b_next[load, 0], b_next[load, PW - 1]
                    )
            # The other buffer is complete, and nobody reads this one any more.
            cuda.syncthreads()
        m, n = c.shape
        for i in range(FM):
            row = row0 + wr0 + i * 16 + g
            for j in range(FN):
                col = col0 + wc0 + j * 8 + 2 * t
                for half in range(2):
                    r = row + 8 * half
                    if r < m:
                        if col < n:
                            c[r, col] = acc[i, j, 2 * half]
                        if col + 1 < n:
                            c[r, col + 1] = acc[i, j, 2 * half + 1]

    return mma_block_tile


# --------------------------------------------------------------------------
# Version 3 (Hopper): warpgroup MMA on swizzled shared memory, cp.async pipeline
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class WgTile:
    """Version 3's shape: a block (two warpgroups, 256 threads) computes a 128 x ``bn``
    tile of C in K-slices of 32 registers' words (one 128-byte swizzled row a tile
    row: 32 TF32 or 64 BF16 / FP16 values), ``stages`` slices in shared memory at
    once. ``b_layout``: "kn" for B as (K, N) (TF32 only: each value copied to its
    transposed place), "kn-t" for B as (K, N) transposed by a separate kernel on every
    call (chapter 06's tiled transpose; TF32 only, timed with the product), "nk" for
    B given transposed, (N, K), as a linear layer's
    weight is stored."""

    bn: int = 128
    stages: int = 4
    b_layout: str = "kn"
    blocks: int = 1  # blocks an SM, for launch_bounds (2: at most 128 registers a thread)

    def __str__(self) -> str:
        more = f" {self.blocks} blocks/SM" if self.blocks > 1 else ""
        return f"128x{self.bn} {self.stages} stages B {self.b_layout}{more}"


WG_BM, WG_KW, WG_THREADS = 128, wg.ROW_WORDS, 256
WG_TILES = (
    WgTile(128, 4, "kn"),
    WgTile(256, 4, "kn-t"),
    WgTile(128, 3, "nk", 2),
    WgTile(256, 4, "nk"),
)


def wgmma_shared_bytes(tile):
    """Dynamic shared memory of version 3: ``tile.stages`` slices of A (128 rows) and
    B (``tile.bn`` rows) of 128 bytes, plus 1 KiB to align the tiles to 1024 bytes."""
    return tile.stages * (WG_BM + tile.bn) * wg.ROW_BYTES + wg.ATOM_BYTES


def make_wgmma_block_tile(precision, tile, wide=True):
    """v3 factory (Hopper only): a kernel ``(a, b, c)`` computing C = A @ B, 256 threads
    (two warpgroups) a 128 x ``tile.bn`` tile of C, launched with
    ``wgmma_shared_bytes(tile)`` of dynamic shared memory.

    Operands: TF32: a float32 (M, K), b float32 (K, N) ("kn") or (N, K) ("nk", and
    "kn-t", whose launcher transposes B first); the
    tensor cores read each float32's upper 19 bits (truncation to TF32, as cuBLAS's
    TF32 mode). BF16 / FP16: a and b uint16 bit patterns, (M, K) and (N, K) ("nk"
    only), K even (register words of two values). c float32 (M, N).

    Copies: ``cp.async`` (global memory straight to shared memory, zeros past the
    edges; 16 bytes a copy with ``wide``, which needs every row of A and of B "nk"
    16-byte aligned, else 4) keeps ``stages - 2`` slices in flight while one is being
    multiplied and the previous one may still be read by the tensor cores. A's 32
    consecutive threads take one row's 32 words (coalesced; the swizzle spreads a
    row over all 32 banks); B "kn": 8 consecutive columns x 4 words (32-byte
    segments of 4 rows of B; 32 banks again). Per slice each warpgroup issues 4
    wgmmas (64 x bn x 32 words) on its 64 rows of A and all of B, then the
    copies of the slice ``stages - 2`` ahead go into the stage two slices back,
    which the wait at the end of the previous slice and the barrier at the top of
    this one have freed: one syncthreads a slice."""
    per_word, _ = wg.PRECISIONS[precision]
    if tile.b_layout not in ("kn", "kn-t", "nk") or (per_word == 2 and tile.b_layout != "nk"):
        raise ValueError(
            f"version 3 in {precision} takes B as 'nk' (TF32 also 'kn', 'kn-t'), got {tile}"
        )
    BN, PW, STAGES, THREADS = tile.bn, per_word, tile.stages, WG_THREADS
    NK = tile.b_layout != "kn"  # "kn-t": the launcher transposes B first
    WIDE = wide
    A_BYTES = WG_BM * wg.ROW_BYTES
    STAGE_BYTES = (WG_BM + BN) * wg.ROW_BYTES
    assert wg.ROW_BYTES // wg.K_STEP_BYTES == 4  # the 4 wgmmas of a slice below
    REGS = BN // 2
    (
        mma,
        zeros,
        shared_address,
        make_descriptor,
        fence_proxy_async,
        wgmma_fence,
        wgmma_commit,
        wgmma_wait0,
        wgmma_wait1,
        store_accumulators,
        cp_async_4,
        cp_async_16,
        cp_async_commit,
        cp_async_wait,
    ) = wg.pipeline_intrinsics(precision, BN, STAGES)
    swizzle = jit(device=True, forceinline=True)(wg.swizzle_offset)
    assert STAGES >= 3

    @jit(device=True, forceinline=True)
    def copy_rows_wide(x, dst, w0, r0, rows, tid, off):
        """16-byte copies of rows r0 .. r0 + rows - 1 of x (K-major, each row's words
        16-byte aligned), words w0 .. w0 + 31: thread tid takes chunk tid % 8 (4 words)
        of rows tid // 8 + 32 i, so 8 threads fill one 128-byte row (8 different
        16-byte bank groups after the swizzle) and a warp reads 4 whole rows."""
        n_rows, k = x.shape
        kw = k // PW
        w = w0 + 4 * (tid & 7)
        left = min(kw - w, 4)
        for i in range(rows // 32):
            r = r0 + (tid >> 3) + 32 * i
            ok = r < n_rows and left > 0
            cp_async_16(
                dst + off + uint32(4096 * i),
                x,
                (r * k + w * PW) if ok else 0,
                uint32(4 * left) if ok else uint32(0),
            )

    @jit(device=True, forceinline=True)
    def copy_slice(a, b, stage, w0, row0, col0, tid):
        """Start the copies of K-slice w0 .. w0 + 31 (words) into shared byte address stage."""
        m, k = a.shape
        kw = k // PW
        # this thread's shared byte offsets: 16-byte chunk tid % 8 of row tid // 8,
        # word tid % 32 of row tid // 32, word tid // 8 of row (column of B) tid % 8
        a_off = uint32(4 * swizzle(tid >> 3, 4 * (tid & 7)))
        a_off4 = uint32(4 * swizzle(tid >> 5, tid & 31))
        b_off = uint32(4 * swizzle(tid & 7, tid >> 3))
        if WIDE:
            copy_rows_wide(a, stage, w0, row0, WG_BM, tid, a_off)
            if NK:
                copy_rows_wide(b, stage + uint32(A_BYTES), w0, col0, BN, tid, a_off)
                return
        w = w0 + (tid & 31)
        if not WIDE:
            for load in range(WG_BM // 8):
                r = row0 + (tid >> 5) + 8 * load
                ok = r < m and w < kw
                cp_async_4(
                    stage + a_off4 + uint32(1024 * load),
                    a,
                    (r * k + w * PW) if ok else 0,
                    uint32(4) if ok else uint32(0),
                )
        if NK:
            n_rows = b.shape[0]
            for load in range(BN // 8):
                r = col0 + (tid >> 5) + 8 * load
                ok = r < n_rows and w < kw
                cp_async_4(
                    stage + uint32(A_BYTES) + a_off4 + uint32(1024 * load),
                    b,
                    (r * k + w * PW) if ok else 0,
                    uint32(4) if ok else uint32(0),
                )
        else:
            kb, n = b.shape
            wb = w0 + (tid >> 3)
            for load in range(BN // 8):
                col = col0 + (tid & 7) + 8 * load
                ok = col < n and wb < kb
                cp_async_4(
                    stage + uint32(A_BYTES) + b_off + uint32(1024 * load),
                    b,
                    (wb * n + col) if ok else 0,
                    uint32(4) if ok else uint32(0),
                )

    @jit(launch_bounds=(THREADS, tile.blocks))  # not cached: instructions from common/wgmma.py
    def wgmma_block_tile(a, b, c):
        smem = cuda.shared.array(0, uint32)
        out = cuda.local.array(REGS, float32)
        tid = cuda.threadIdx.x & 1023
        warp, lane = tid // 32, tid & 31
        group = warp // 4  # warpgroup: rows 64 * group .. + 63 of the block tile
        row0 = cuda.blockIdx.y * WG_BM
        col0 = cuda.blockIdx.x * BN
        base = shared_address(smem)
        tiles = base + ((uint32(1024) - (base & uint32(1023))) & uint32(1023))
        slices = (a.shape[1] // PW + WG_KW - 1) // WG_KW
        for s in range(STAGES - 2):
            if s < slices:
                copy_slice(a, b, tiles + uint32(s * STAGE_BYTES), s * WG_KW, row0, col0, tid)
            cp_async_commit()
        acc = zeros()
        for s in range(slices):
            cp_async_wait()  # this thread's copies of slice s have landed
            fence_proxy_async()  # ... visible to the tensor cores
            cuda.syncthreads()  # everyone's; and slice s - 2's wgmmas are done
            stage = tiles + uint32((s % STAGES) * STAGE_BYTES)
            a_desc = stage + uint32(group * 64 * wg.ROW_BYTES)
            b_desc = stage + uint32(A_BYTES)
            wgmma_fence()
            # The slice's 4 K-steps (32 bytes of each 128-byte row apiece), written out:
            # in a loop NVVM may keep the accumulators' tuple in a stack slot.
            acc = mma(acc, make_descriptor(a_desc), make_descriptor(b_desc))
            acc = mma(
                acc, make_descriptor(a_desc + uint32(32)), make_descriptor(b_desc + uint32(32))
            )
            acc = mma(
                acc, make_descriptor(a_desc + uint32(64)), make_descriptor(b_desc + uint32(64))
            )
            acc = mma(
                acc, make_descriptor(a_desc + uint32(96)), make_descriptor(b_desc + uint32(96))
            )
            wgmma_commit()
            ahead = s + STAGES - 2
            if ahead < slices:
                stage = tiles + uint32((ahead % STAGES) * STAGE_BYTES)
                copy_slice(a, b, stage, ahead * WG_KW, row0, col0, tid)
            cp_async_commit()
            wgmma_wait1()  # slice s - 1's wgmmas are done: its stage is free after the next barrier
        wgmma_wait0()
        store_accumulators(acc, out)
        m, n = c.shape
        g, t = lane // 4, lane % 4
        row = row0 + group * 64 + (warp & 3) * 16 + g
        for j in range(BN // 8):
            col = col0 + j * 8 + 2 * t
            for half in range(2):
                r = row + 8 * half
                if r < m:
                    if col < n:
                        c[r, col] = out[4 * j + 2 * half]
                    if col + 1 < n:
                        c[r, col + 1] = out[4 * j + 2 * half + 1]

    return wgmma_block_tile


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------


def launch_warp_tile(kernel, a, b, c):
    """v1: one warp a 16 x 8 tile of C; ``kernel`` from ``make_mma_warp_tile``."""
    m, n = c.shape
    kernel[(ceil_div(n, 8), ceil_div(m, 16)), 32](a, b, c)


def launch_block_tile(kernel, tile, a, b, c):
    """v2: one block of ``tile.threads`` a ``tile.bm x tile.bn`` tile of C;
    ``kernel`` from ``make_mma_block_tile(precision, tile)``."""
    m, n = c.shape
    kernel[(ceil_div(n, tile.bn), ceil_div(m, tile.bm)), tile.threads](a, b, c)


class WgmmaLauncher:
    """Version 3 as a launcher ``(a, b, c)`` on the chapter's operands (float32 A
    (M, K), B (K, N)): TF32 with B "kn" launches on them directly; "kn-t" transposes
    B into a kept buffer on every call (timed with the product); otherwise the
    operands are first converted once, on the GPU, and kept (keyed by the arrays'
    identity, as the cuBLAS baseline keeps its BF16 copies): B transposed to
    (N, K), BF16 / FP16 rounded to nearest even and stored as uint16 bits, K padded
    with zeros to a multiple of 8 (rows of whole 16-byte chunks). Later calls run the kernel alone."""

    def __init__(self, precision, tile):
        self.precision, self.tile = precision, tile
        # 16-byte copies where every row of A (and of B "nk") starts 16-byte aligned,
        # 4-byte copies elsewhere; both kernels are built now, compiled at first use.
        self.kernels = {
            wide: make_wgmma_block_tile(precision, tile, wide) for wide in (True, False)
        }
        self.nbytes = wgmma_shared_bytes(tile)
        # the last operand pair and its conversion: (id(a), id(b)) -> (a, b, a', b');
        # one entry, so a launcher reused across sizes keeps no earlier operands alive
        self._operands = {}
        self._bt = None  # "kn-t": the transposed B, kept between calls

    def _transposed(self, b):
        """B (K, N) transposed into a kept (N, K) buffer by chapter 06's fastest
        transpose (shared-memory tiles, unsigned indices)."""
        shape = (b.shape[1], b.shape[0])
        if self._bt is None or self._bt.shape != shape:
            self._bt = cuda.device_array(shape, np.float32)
        ch06.transpose(ch06.transpose_smem_unsigned, b, self._bt)
        return self._bt

    def _convert(self, a, b):
        key = (id(a), id(b))
        if key not in self._operands:
            self._operands.clear()
            self._operands[key] = (a, b) + convert_operands(
                a, b, self.precision, self.tile.b_layout
            )
        return self._operands[key][2:]

    def __call__(self, a, b, c):
        if self.tile.b_layout == "kn-t":  # every call, timed with the product
            b = self._transposed(b)
        elif self.precision != "tf32" or self.tile.b_layout != "kn":
            a, b = self._convert(a, b)
        wide = (a.shape[1] * a.dtype.itemsize) % 16 == 0
        kernel = self.kernels[wide]
        wg.allow_dynamic_shared_memory(kernel, (a, b, c), self.nbytes)
        m, n = c.shape
        grid = (ceil_div(n, self.tile.bn), ceil_div(m, WG_BM))
        kernel[grid, WG_THREADS, 0, self.nbytes](a, b, c)


@cuda.jit  # not cached: its cvt instructions come from common/tensor_cores.py
def _to_half_bits(x, out, transpose, bf16):
    """out[i, j] = the BF16 or FP16 bits of x[i, j] (x[j, i] when transpose); zero past x."""
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        r, q = (j, i) if transpose else (i, j)
        v = float32(0.0)
        if r < x.shape[0] and q < x.shape[1]:
            v = x[r, q]
        word = tc.pack_bf16x2(v, v) if bf16 else tc.pack_f16x2(v, v)
        out[i, j] = word & 0xFFFF


def convert_operands(a, b, precision, b_layout):
    """Version 3's operands from float32 device arrays A (M, K), B (K, N): TF32 "nk":
    (A, B transposed); BF16 / FP16: (A, B transposed) as uint16 bits, K padded with
    zeros to a multiple of 8."""
    m, k = a.shape
    n = b.shape[1]
    if precision == "tf32":
        bt = cuda.device_array((n, k), np.float32)
        ch06.transpose(ch06.transpose_smem_unsigned, b, bt)
        return a, bt
    k2 = ceil_div(k, 8) * 8  # rows of 16 bytes: version 3's 16-byte copies
    a16 = cuda.device_array((m, k2), np.uint16)
    bt16 = cuda.device_array((n, k2), np.uint16)
    bf16 = precision == "bf16"
    _to_half_bits[(ceil_div(m, 16), ceil_div(k2, 16)), (16, 16)](a, a16, False, bf16)
    _to_half_bits[(ceil_div(n, 16), ceil_div(k2, 16)), (16, 16)](b, bt16, True, bf16)
    return a16, bt16


@dataclass(frozen=True)
class Version:
    """One row: ``launcher(a, b, c)`` writes A @ B into c in ``precision``."""

    number: int
    name: str
    precision: str
    launcher: object
    truncates: bool = False  # TF32 inputs truncated by the hardware, not rounded

    @property
    def input_unit(self) -> float:
        """Largest relative error of an input's conversion: the unit roundoff of the
        precision, twice it when the tensor cores truncate float32 to TF32."""
        return tc.UNIT_ROUNDOFF[self.precision] * (2 if self.truncates else 1)

    @property
    def label(self) -> str:
        return f"{self.number} {self.name} {NAMES[self.precision]}"


def versions(precision, tile=TILE):
    """Versions 1 and 2 in ``precision`` ("tf32", "bf16" or "f16"); a list of Version."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    v1 = make_mma_warp_tile(precision)
    v2 = make_mma_block_tile(precision, tile)
    out = [
        Version(1, "mma warp tile 16x8", precision, partial(launch_warp_tile, v1)),
        Version(2, f"mma block tile {tile}", precision, partial(launch_block_tile, v2, tile)),
    ]
    if has_wgmma():
        for wt in WG_TILES:
            if precision == "tf32" or wt.b_layout == "nk":
                launcher = WgmmaLauncher(precision, wt)
                out.append(Version(3, f"wgmma {wt}", precision, launcher, precision == "tf32"))
    return out


def has_wgmma():
    """True on a Hopper GPU (version 3 runs), False elsewhere and in the simulator."""
    return wg.has_wgmma()


_BEST = {}


def tc_matmul(a, b, c, precision="tf32"):
    """C = A @ B on tensor cores with version 2, operands checked first.

    a: (M, K), b: (K, N), c: (M, N) float32 C-contiguous device arrays, any
    M, N, K >= 1; precision "tf32", "bf16" or "f16" (inputs rounded to it,
    FP32 accumulate and output). Raises TypeError / ValueError on bad operands
    (as ``matmul.check_operands``), ValueError on an unknown precision and
    RuntimeError on a GPU older than compute capability 8.0, before any launch.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    a, b, c = mm.check_operands(a, b, c)
    tc.require_tensor_cores()
    if precision not in _BEST:
        _BEST[precision] = versions(precision)[1]
    _BEST[precision].launcher(a, b, c)


# --------------------------------------------------------------------------
# Baselines in the same precision: cuBLAS and Triton through torch
# --------------------------------------------------------------------------


class CublasSamePrecision:
    """A launcher ``(a, b, c)`` running cuBLAS through torch.matmul in ``precision``
    on Numba device arrays: float32 with TF32 allowed, or the operands converted
    once (untimed) to BF16 / FP16 tensors with an output of the same dtype, FP32
    accumulate. The first call also copies that output into ``c`` for the check;
    the timed calls run the product alone. ``b_layout`` "nk": B is first copied
    transposed, (N, K) (untimed, as version 3's "nk" tiles get it), and cuBLAS
    multiplies by its transpose view."""

    def __init__(self, precision, b_layout="kn"):
        import torch

        self._torch = torch
        self.precision = precision
        self.b_layout = b_layout
        self._dtype = {"tf32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[
            precision
        ]
        self._views = {}  # id(array) -> (array, its torch view in the operand dtype)
        self._checked = set()

    def _view(self, x):
        if id(x) not in self._views:
            t = self._torch.as_tensor(x, device="cuda")
            self._views[id(x)] = (x, t if self._dtype is t.dtype else t.to(self._dtype))
        return self._views[id(x)][1]

    def __call__(self, a, b, c):
        flags = self._torch.backends.cuda.matmul
        flags.allow_tf32 = self.precision == "tf32"
        flags.allow_bf16_reduced_precision_reduction = False
        flags.allow_fp16_reduced_precision_reduction = False
        out = self._view(c)
        b_view = self._view(b)
        if self.b_layout == "nk":
            key = ("nk", id(b))
            if key not in self._views:
                self._views[key] = (b, b_view.t().contiguous())
            b_view = self._views[key][1].t()
        self._torch.matmul(self._view(a), b_view, out=out)
        if out.dtype != self._torch.float32 and id(c) not in self._checked:
            self._checked.add(id(c))
            self._torch.as_tensor(c, device="cuda").copy_(out)


def triton_launcher(precision):
    """Chapter 12's Triton matmul as a launcher ``(a, b, c)`` in ``precision``
    ("tf32" or "f16"; FP16 output copied into c on the first call), or None where
    Triton does not run (not installed, the simulator) or has no such precision."""
    if is_simulator() or precision not in ("tf32", "f16"):
        return None
    try:
        from common import load_chapter_module

        ch12 = load_chapter_module("12_triton", "matmul")
        ch12.triton_env.require()
    except Exception:  # noqa: BLE001  (no Triton: the row is left out, as the header says)
        return None
    import torch

    dtype = torch.float32 if precision == "tf32" else torch.float16
    name = "tf32" if precision == "tf32" else "fp16"
    views, checked = {}, set()

    def view(x):
        if id(x) not in views:
            views[id(x)] = (x, torch.as_tensor(x, device="cuda").to(dtype))
        return views[id(x)][1]

    def launch(a, b, c):
        out = view(c)
        ch12.launch(view(a), view(b), out, ch12.PRECISIONS[name].input_precision)
        if out.dtype != torch.float32 and id(c) not in checked:
            checked.add(id(c))
            torch.as_tensor(c, device="cuda").copy_(out)

    return launch


def cublas_label(precision, b_layout="kn"):
    more = ", B as N x K" if b_layout == "nk" else ""
    return f"cuBLAS {NAMES[precision]} (torch{more})"


# --------------------------------------------------------------------------
# main: check every version, then time it, next to cuBLAS
# --------------------------------------------------------------------------


def run_size(size, precision, rng, peaks, quick, with_cublas, chosen=None):
    """Check and time ``chosen`` (a list of Version in ``precision``; default
    ``versions(precision)``) and the baselines at one (M, N, K); returns a list of
    Timing with ``extra["fraction_of_cublas"]``. Pass the same list for every size:
    each call of ``versions`` builds new kernels, compiled again at first use."""
    m, n, k = size
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    ref = mm.matmul_reference(a_h, b_h)
    # cuBLAS and Triton may truncate TF32 inputs (2^-10) instead of rounding them.
    theirs = tolerance(a_h, b_h, ref, 2 * tc.UNIT_ROUNDOFF[precision])
    rows = [
        (v.label, v.launcher, tolerance(a_h, b_h, ref, v.input_unit))
        for v in (chosen or versions(precision))
    ]
    if with_cublas:
        rows.append((cublas_label(precision), CublasSamePrecision(precision), theirs))
        if has_wgmma():  # version 3's "nk" tiles get B transposed: so does cuBLAS here
            rows.append(
                (cublas_label(precision, "nk"), CublasSamePrecision(precision, "nk"), theirs)
            )
        triton = triton_launcher(precision)
        if triton is not None:
            rows.append((f"Triton {NAMES[precision]} (chapter 12)", triton, theirs))
    warmup, repeats = (1, 5) if quick else (3, 20)
    results = []
    tolerances = {}
    for label, launcher, tol in rows:
        tolerances[label] = tol
        results += run_versions(
            {label: launcher},
            (a, b),
            ref,
            (m, n),
            np.float32,
            tol=tol,
            flops=2 * m * n * k,
            nbytes=4 * (m * k + k * n + m * n),
            warmup=warmup,
            repeats=repeats,
            peaks=peaks,
            print_table=False,
            hold_ms=mm.HOLD_MS,  # GPU time, as matmul.py ("kn-t" is two launches a call)
        )
    # against the faster of cuBLAS's two layouts (one where only one was timed)
    cublas = [r.tflops for r in results if r.name.startswith(cublas_label(precision)[:-1])]
    base = max(cublas) if cublas else None
    for r in results:
        r.extra["precision"] = precision
        r.extra["size"] = list(size)
        r.extra["tolerance"] = tolerances[r.name]
        if base and r.tflops:
            r.extra["fraction_of_cublas"] = r.tflops / base
    return results


def main(argv=None):
    parser = script_parser(__doc__, CHAPTER)
    parser.add_argument(
        "--sizes",
        type=tools.parse_sizes,
        default=None,
        help="comma list of N (square) or MxNxK; default 1024,2048,4096 on a GPU, "
        "37x21x19 in the simulator",
    )
    parser.add_argument("--quick", action="store_true", help="one size (1024), few repeats")
    parser.add_argument(
        "--precisions",
        type=comma_names(PRECISIONS),
        default=list(PRECISIONS),
        help="comma list of tf32, bf16, f16 (default all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = parser.parse_args(argv)

    tc.require_tensor_cores()
    rng = np.random.default_rng(args.seed)
    default_sizes = pick(gpu="1024" if args.quick else "1024,2048,4096", simulator="37x21x19")
    sizes = args.sizes or tools.parse_sizes(default_sizes)
    peaks = device_peaks()
    with_cublas = tools.cublas_available()
    print(
        f"device: {peaks.get('device', '?')}; cuBLAS {'available' if with_cublas else 'NOT available'}"
        + (" (simulator: correctness only)" if is_simulator() else "")
    )
    print(
        "every version is checked against the float64 product, with a tolerance derived "
        "from its precision, then timed"
    )
    if not has_wgmma():
        print("version 3 (wgmma) needs a Hopper GPU (compute capability 9.0): not run here")
    built = {p: versions(p) for p in args.precisions}  # kernels compiled once, all sizes
    flat = []
    for size in sizes:
        for precision in args.precisions:
            results = run_size(
                size, precision, rng, peaks, args.quick, with_cublas, built[precision]
            )
            m, n, k = size
            print(
                format_table(
                    results, title=f"GEMM {m}x{n}x{k}, {NAMES[precision]} in, FP32 accumulate"
                )
            )
            for r in results:
                f = r.extra.get("fraction_of_cublas")
                if f is not None:
                    print(f"    {r.name:<52} {r.tflops:8.2f} TFLOP/s  {100 * f:6.1f} % of cuBLAS")
            flat += results
    save_results(flat, args.out, "tensor_cores", tile=str(TILE))
    return 0


if __name__ == "__main__":
    run_script(main)
