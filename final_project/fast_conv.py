"""Fast convolution kernels for the capstone CNN: implicit GEMM, a direct kernel, split-K.

The naive kernels (``final_project/kernels.py``) give each thread one output and
read every operand from global memory: 2 loads per FMA. Here the convolution
is a matrix product whose operand tiles are staged in shared memory and whose
outputs are register tiles, as in chapter 08 (versions 7-10), except that the
im2col matrix is never written out: each tile is gathered from the image on
the fly (implicit GEMM; NVIDIA CUTLASS, "Implicit GEMM Convolution",
docs/implicit_gemm_convolution.md; Chetlur et al. 2014, "cuDNN: Efficient
Primitives for Deep Learning", section 3).

    conv2d_igemm (forward)      block = BM x BN tile of out as the (N*Ho*Wo) x Co GEMM,
                                thread = TM x TN register tile: per K-tile each thread
                                gathers BM*BK/THREADS im2col values (zero outside the
                                image) and ~BK*BN/THREADS weights into shared memory,
                                then per k reads TM + TN values for TM*TN FMAs
                                (8 x 8: four LDS.128 per 64 FMAs). Epilogue: + bias,
                                out, and the block's per-channel batchnorm sums
    conv2d_igemm (grad input)   the same kernel on dout with the flipped kernel:
                                GEMM (N*H*W) x Ci x (Co*K*K), padding K - 1 - pad;
                                weights by channel runs (a thread loads whole kernel
                                rows through one pointer: ~2 instructions a load)
    conv2d_direct               for tiny Ci (conv1): thread = TP pixels x TC channels;
                                the block's weights in shared memory, each x value read
                                once per thread and used for TC FMAs, out written
                                coalesced (a warp = 32 consecutive pixels); same epilogue
    conv2d_grad_weight_igemm    GEMM Co x (Ci*K*K + 1) x (N*Ho*Wo), split-K: block =
                                BM x BN tile of one chunk of the batch's pixels, thread =
                                TM x TN register tile; the extra column of ones gives
                                db; writes a float32 partial per chunk, which the linear
                                layers' reduction (fast_layers.splitk_reduce_weight_bias)
                                sums in float64 in a fixed order into dw and db
    block_channel_sums          (device function of the forward kernels) a block's
                                per-channel sums: float32 over a thread's <= 8 pixels,
                                taken around the thread's first output (shifted_sums),
                                float64 across the threads, in a fixed two-level order

GEMM view (stride 1, zero padding ``pad``, NCHW x OIHW as in kernels.py):

    forward      out[m, co] = sum_k A[m, k] B[k, co],  m = (n, oh, ow), k = (ci, kh, kw),
                 A[m, k] = x[n, ci, oh + kh - pad, ow + kw - pad] (0 outside), B = w
    grad input   dx = the same with x -> dout, w[co, ci, kh, kw] -> w[ci, co, K-1-kh, K-1-kw]
                 and pad -> K - 1 - pad (a full correlation with the flipped kernel)
    grad weight  dw[co, (ci, kh, kw)] = sum_m dout[m, co] A[m, (ci, kh, kw)]; db = sum_m dout

Choices that matter for speed, and why:

* The K loop of the implicit GEMMs walks (channel block, kernel-row block)
  tiles: a K-tile is CB input channels x KR kernel rows x K columns (BK = CB KR K).
  Each thread gathers a fixed im2col row (its output pixel, decoded once, before
  the loop) and fixed channel slots, so the (kh, kw) of every load is a
  compile-time constant: no division in the K loop, and the padding test is a
  bit of a per-thread column mask and one row compare per kernel row.
* Tiles are double-buffered through registers (chapter 08, version 9): the
  next tile's global loads are issued before this tile's FMAs, one
  ``syncthreads`` per tile.
* Register tiles come in groups of 4 consecutive rows/columns so a fragment is
  one 16-byte shared load (LDS.128), as in chapter 08, version 8.
* Batch-long sums are split: the forward kernels write per-block batchnorm sums
  (float64) instead of one channel total, and the weight gradient sums chunks
  of at most ``max_chunk`` pixels in float32 and adds the chunks in float64 in a
  fixed order. No atomics: every result is the same bit for bit, run to run.
* Launchers take device arrays (C-contiguous), never allocate and never
  synchronize, so a training step's launches can be captured in a CUDA graph.
  Tile shapes are factory arguments (compile-time constants); the launchers
  pick GPU or simulator tiles (``pick``) and accept ``tiles=`` to override.

Run the checks: ``python -m pytest tests/test_final_project_fast_conv.py -q``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div, jit, pick, sm_count

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64

from final_project import fast_layers

# The simulator refuses shared-memory alignment; on a GPU 16 bytes allows LDS.128.
SMEM_ALIGN = pick(gpu=16, simulator=None)
SMEM_LIMIT = 48 * 1024  # static shared memory per block
# Largest K the launchers take: the GPU tiles' smallest K-tile (one kernel row
# of R channels) and the direct kernel's staged weights (one channel's K x K for
# 32 output channels) must fit in 48 KiB of shared memory.
MAX_KERNEL_SIZE = 15


# ---------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IgemmTiles:
    """Tile shape of the implicit-GEMM convolution (forward and grad input).

    bm x bn: block tile (GEMM rows = output pixels, columns = output channels);
    tm x tn: register tile per thread, (bm/tm)(bn/tn) threads, a multiple of bm;
    bk: target depth of a K-tile (the K-tile is CB channels x KR kernel rows x K,
    chosen by :func:`igemm_k_tile`); min_blocks: launch bound (blocks per SM)."""

    bm: int
    bn: int
    tm: int
    tn: int
    bk: int
    min_blocks: int = 2

    def __post_init__(self):
        if (
            self.bm % self.tm
            or self.bn % self.tn
            or self.bm % 4
            or self.bn % 4
            or self.threads % self.bm
            or self.bk < 1
        ):
            raise ValueError(
                f"{self}: tm, tn must divide bm, bn (multiples of 4), and the "
                "(bm/tm)(bn/tn) threads must be a multiple of bm"
            )

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


@dataclass(frozen=True)
class DirectTiles:
    """Tile shape of the direct convolution: txp x tyc threads, each tp pixels
    (stride txp, so a warp writes consecutive pixels) x tc consecutive channels;
    ci_chunk input channels of weights staged in shared memory at a time."""

    txp: int
    tp: int
    tyc: int
    tc: int
    ci_chunk: int
    min_blocks: int = 2

    def __post_init__(self):
        if min(self.txp, self.tp, self.tyc, self.tc, self.ci_chunk) < 1:
            raise ValueError(f"{self}: every size must be >= 1")

    @property
    def threads(self) -> int:
        return self.txp * self.tyc


@dataclass(frozen=True)
class GradWeightTiles:
    """Tile shape and split-K policy of the weight gradient.

    bm x bn block tile of the Co x (Ci*K*K + 1) GEMM, bk pixels per K-tile, tm x tn
    register tile; the batch's N*Ho*Wo pixels are cut into S chunks of at most
    max_chunk (float32 sums stay short), at least min_chunk where the batch
    allows, and enough chunks that the grid has about blocks_per_sm blocks per
    SM of the device the launch runs on (:func:`common.runtime.sm_count`)."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    max_chunk: int
    min_chunk: int
    blocks_per_sm: int
    min_blocks: int = 2

    def __post_init__(self):
        threads = (self.bm // self.tm) * (self.bn // self.tn)
        if (
            self.bm % self.tm
            or self.bn % self.tn
            or threads % self.bk
            or self.bm % (threads // self.bk or 1)
            or self.bn % (threads // self.bk or 1)
            or threads < self.bk
            or not 1 <= self.min_chunk <= self.max_chunk
        ):
            raise ValueError(
                f"{self}: tm, tn must divide bm, bn; the threads must be a "
                "multiple of bk whose quotient divides bm and bn; "
                "1 <= min_chunk <= max_chunk"
            )

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


# GPU (measured on an H100 against 8 x 4 tiles of 256 threads and other
# shapes): 128 x 64 block tiles of 128 threads, 8 x 8 register tiles (64 FMAs
# per four LDS.128), K-tiles of 18 = 2 channels x 3 x 3 taps, three blocks an
# SM (168 registers): 26 TFLOP/s for conv2 at N = 1024. Co <= 32 (conv1, or the
# grad input's Ci = 32): 128 x 32 tiles of 128 threads, 8 x 4, four blocks an
# SM. Grids of fewer 128-row tiles than IGEMM_SMALL_GRID_PER_SM per SM (conv2 at
# N = 64: 98 blocks for an H100's 132 SMs) use 64-row tiles, so more SMs get work.
GPU_IGEMM_TILES = IgemmTiles(128, 64, 8, 8, 18, min_blocks=3)
GPU_IGEMM_TILES_NARROW = IgemmTiles(128, 32, 8, 4, 18, min_blocks=4)
GPU_IGEMM_TILES_SMALL_M = IgemmTiles(64, 64, 8, 4, 18)
GPU_IGEMM_TILES_SMALL_M_NARROW = IgemmTiles(64, 32, 4, 4, 18, min_blocks=4)
# Grad input with Ci <= 32 (conv2's dx): K-tiles of 36 = 4 channels x 3 x 3, so
# the 4 weight-load slots of 128 threads over 32 columns each get whole channels
# (make_conv2d_igemm's channel runs); faster than K-tiles of 18 for conv2 at large
# batches (README, "Version by version", version 7).
GPU_IGEMM_TILES_DGRAD_NARROW = IgemmTiles(128, 32, 8, 4, 36, min_blocks=4)
# Simulator: every CUDA thread runs as Python code, so 8-thread blocks; K-tiles of 6
# also exercise partial kernel-row blocks (3 x 3 kernel rows in blocks of 2).
SIM_IGEMM_TILES = IgemmTiles(8, 4, 2, 2, 6)
IGEMM_TILES = pick(gpu=GPU_IGEMM_TILES, simulator=SIM_IGEMM_TILES)
IGEMM_TILES_NARROW = pick(gpu=GPU_IGEMM_TILES_NARROW, simulator=SIM_IGEMM_TILES)
IGEMM_TILES_SMALL_M = pick(gpu=GPU_IGEMM_TILES_SMALL_M, simulator=SIM_IGEMM_TILES)
IGEMM_TILES_SMALL_M_NARROW = pick(gpu=GPU_IGEMM_TILES_SMALL_M_NARROW, simulator=SIM_IGEMM_TILES)
IGEMM_TILES_DGRAD_NARROW = pick(gpu=GPU_IGEMM_TILES_DGRAD_NARROW, simulator=SIM_IGEMM_TILES)
IGEMM_SMALL_GRID_PER_SM = 2

# GPU: 256 pixels x 32 channels a block (128 threads, 8 pixels x 8 channels a
# thread): each x value is loaded by the 4 channel-group warps once and used
# for 8 FMAs, and a warp writes 32 consecutive pixels of one channel. Four
# blocks an SM (128 registers, 64 bytes spilled) measured faster than three
# without spills: 0.113 against 0.137 ms for conv1 at N = 1024 on an H100.
GPU_DIRECT_TILES = DirectTiles(32, 8, 4, 8, 4, min_blocks=4)
SIM_DIRECT_TILES = DirectTiles(4, 2, 2, 2, 2)
DIRECT_TILES = pick(gpu=GPU_DIRECT_TILES, simulator=SIM_DIRECT_TILES)

# GPU: 64 x 64 tiles of 128 threads (8 x 4 register tiles), 16 pixels a K-tile;
# conv1's 32 x 10 gradient gets 32 x 16 tiles of one warp. Chunks of at most
# 2048 pixels (float32 sums that short lose under 1e-5) and at least 256 (each
# block writes a whole Co x 64 partial tile: shorter chunks write more partials
# than they read inputs); within that, about 4 blocks an SM (8 for the
# one-warp tiles): on an H100 (132 SMs) conv2 at N = 64, 256, 1024 gives S = 49,
# 105, 106 chunks, 245 to 530 blocks.
GPU_GRAD_WEIGHT_TILES = GradWeightTiles(
    64, 64, 16, 8, 4, max_chunk=2048, min_chunk=256, blocks_per_sm=4
)
GPU_GRAD_WEIGHT_TILES_SMALL = GradWeightTiles(
    32, 16, 16, 4, 4, max_chunk=2048, min_chunk=256, blocks_per_sm=8
)
SIM_GRAD_WEIGHT_TILES = GradWeightTiles(4, 4, 4, 2, 2, max_chunk=8, min_chunk=4, blocks_per_sm=2)
GRAD_WEIGHT_TILES = pick(gpu=GPU_GRAD_WEIGHT_TILES, simulator=SIM_GRAD_WEIGHT_TILES)
GRAD_WEIGHT_TILES_SMALL = pick(gpu=GPU_GRAD_WEIGHT_TILES_SMALL, simulator=SIM_GRAD_WEIGHT_TILES)

# Column-table markers of the weight-gradient kernel (a kernel row so far off
# the image that the bounds test fails): the ones column (db) and padding columns.
_ONES_ROW = -(1 << 20)
_NO_ROW = 1 << 20


def igemm_tiles(m_total: int, gemm_n: int, forward: bool = True) -> IgemmTiles:
    """Default tiles for an implicit-GEMM conv with ``m_total`` = N*Ho*Wo rows
    and ``gemm_n`` output channels on the current device; ``forward=False``:
    the grad input (GEMM columns = Ci). ``bm`` depends on m_total and the SM
    count alone, so the number of bn_partials rows does not depend on the
    channel count."""
    small = ceil_div(m_total, IGEMM_TILES.bm) < IGEMM_SMALL_GRID_PER_SM * sm_count()
    if gemm_n <= 32:
        if small:
            return IGEMM_TILES_SMALL_M_NARROW
        return IGEMM_TILES_NARROW if forward else IGEMM_TILES_DGRAD_NARROW
    return IGEMM_TILES_SMALL_M if small else IGEMM_TILES


def igemm_k_tile(tiles: IgemmTiles, k: int) -> tuple[int, int]:
    """(CB, KR): a K-tile is CB input channels x KR kernel rows x k columns.

    CB is a multiple of R = threads / bm (the threads that share an im2col row
    each take CB / R channels). Whole kernels (KR = k) when R k^2 <= bk, else as
    many kernel rows as fit in bk."""
    r = tiles.threads // tiles.bm
    if r * k * k <= tiles.bk:
        return r * max(1, tiles.bk // (r * k * k)), k
    return r, max(1, min(k, tiles.bk // (r * k)))


# ---------------------------------------------------------------------------
# Batchnorm partial sums of a block (shared by the forward kernels)
# ---------------------------------------------------------------------------


@jit(device=True, inline=True)
def shifted_sums(count, shift, s1, s2):
    """(sum x, sum x^2) in float64 of ``count`` values x from their float32 sums
    around ``shift``: s1 = sum (x - shift), s2 = sum (x - shift)^2.

    Why shifted: a channel whose |mean| is R times its std has sum x^2 about
    (R^2 + 1) n var, so each float32 rounding of an x^2 or of the running sum
    moves var = E[x^2] - E[x]^2 by up to R^2 eps32 / 2 of var: 1e-4, the
    capstone's whole tolerance, at R = 40. With ``shift`` one of the values,
    x - shift is of the size of the spread and the float32 sums lose only
    eps32 of that (the "shifted data" algorithm: Chan, Golub and LeVeque,
    "Algorithms for computing the sample variance", The American Statistician
    37(3), 1983). The products with ``shift`` below are exact in float64
    (24-bit float32 factors, count < 32): only two float64 roundings are added.
    """
    k = float64(shift)
    t1 = float64(s1)
    return count * k + t1, (count * k) * k + 2.0 * k * t1 + float64(s2)


def make_block_channel_sums(ROWS, WIDTH, THREADS):
    """Factory: device function writing one block's row of ``bn_partials``.

    The caller fills ``red`` (float64, 2 * ROWS * WIDTH: [q][row][channel], q = 0
    sums, 1 sums of squares; one row per thread row) and calls
    ``block_channel_sums(red, red2, bn_partials, p, col0, c_out, tid)``, which
    writes bn_partials[p, q, col0 + c] = sum over rows, for c < c_out - col0.
    Two levels, all threads busy in the first: 2 * WIDTH * G threads each add
    ROWS / G rows, then 2 * WIDTH threads add the G group sums, always in the
    same order (deterministic). ``.sizes`` = (len(red), len(red2))."""
    G = 1  # row groups: the most that keep 2 * WIDTH * G <= THREADS and divide ROWS
    for g in range(1, ROWS + 1):
        if ROWS % g == 0 and 2 * WIDTH * g <= THREADS:
            G = g
    ROWS_G = ROWS // G

    @jit(device=True)
    def block_channel_sums(red, red2, bn_partials, p, col0, c_out, tid):
        cuda.syncthreads()  # red is complete
        for u in range(tid, 2 * WIDTH * G, THREADS):
            qc = u // G
            g = u - qc * G
            q = qc // WIDTH
            c = qc - q * WIDTH
            total = 0.0
            for r in range(ROWS_G):
                total += red[uint64((q * ROWS + g * ROWS_G + r) * WIDTH + c)]
            red2[u] = total
        cuda.syncthreads()
        for u in range(tid, 2 * WIDTH, THREADS):
            total = 0.0
            for g in range(G):
                total += red2[u * G + g]
            q = u // WIDTH
            c = u - q * WIDTH
            if col0 + c < c_out:
                bn_partials[p, q, col0 + c] = total

    block_channel_sums.sizes = (2 * ROWS * WIDTH, 2 * WIDTH * G)
    return block_channel_sums


# ---------------------------------------------------------------------------
# Implicit GEMM: forward and grad input
# ---------------------------------------------------------------------------


def make_conv2d_igemm(BM, BN, TM, TN, KSIZE, CB, KR, FORWARD, MIN_BLOCKS=2):
    """Factory: the implicit-GEMM convolution kernel for one tile shape and kernel size.

    FORWARD=True: out = conv(x, w) + b and per-block batchnorm sums.
    FORWARD=False: the input gradient (x is dout, w is read flipped and
    transposed, no bias, no sums). Threads: (BM / TM) * (BN / TN), a multiple of
    BM. Kernel arguments: (x, w, b, out, bn_partials, batch, c_in, height,
    width, c_out, h_out, w_out, pad, k_tiles), all arrays flat except
    bn_partials (P, 2, c_out); k_tiles = ceil(c_in / CB) * ceil(K / KR).

    Each thread gathers the im2col row ``tid % BM`` of the block's tile (its
    pixel decoded once) for channels ``tid // BM + R * cc``: KR * K taps with
    compile-time (kh, kw) a channel, ``CB / R * KR * K`` loads a K-tile."""
    TXM, TXN = BM // TM, BN // TN
    THREADS = TXM * TXN
    R = THREADS // BM  # threads sharing one im2col row in the gather
    CBR = CB // R  # channel slots a thread gathers per K-tile
    KK2 = KSIZE * KSIZE
    NRB = ceil_div(KSIZE, KR)  # kernel-row blocks per channel block
    ROW_K = KR * KSIZE  # K-tile entries per channel
    BK = CB * ROW_K
    A_LOADS = CBR * ROW_K
    B_ITEMS = BK * BN
    B_LOADS = ceil_div(B_ITEMS, THREADS)
    B_EVEN = B_ITEMS % THREADS == 0
    # Grad input: weight loads by channel runs where the tile allows. Thread
    # (part, n) loads the ROW_K consecutive weights of column n (w[co, n, K-1-kh0.., ..],
    # read backwards) for channel slots part + KSPLIT*s: one pointer a tile and
    # compile-time offsets, ~2 instructions a load instead of ~25 (sm_90 SASS).
    # A warp's lanes read 32 columns 36 bytes apart. Not the forward: there a
    # column is a row of w, Ci*K*K floats long, so each lane would touch another
    # line (32 L1 wavefronts a load); measured slower on an H100.
    KSPLIT = THREADS // BN if THREADS % BN == 0 else 0
    B_RUNS = not FORWARD and KSPLIT > 0 and CB % KSPLIT == 0
    B_SLOTS = CB // KSPLIT if B_RUNS else 0
    GM, GN = min(TM, 4), min(TN, 4)  # fragment groups (one LDS.128 each when 4)
    GA, GB = TXM * GM, TXN * GN  # distance between a thread's groups
    AP = BM  # a_tile[k * AP + m]: the gather stores consecutive m: no conflicts
    BNP = BN + 4  # b_tile[k * BNP + n]: k-fast stores, padded against bank conflicts
    A_BUF, B_BUF = BK * AP, BK * BNP
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    block_sums = make_block_channel_sums(TXM, BN, THREADS)
    RED, RED2 = block_sums.sizes
    UNROLL = 2 if BK % 2 == 0 else 1
    assert BM % TM == 0 and BN % TN == 0, "register tile must divide the block tile"
    assert TM % GM == 0 and TN % GN == 0 and BM % 4 == 0 and BN % 4 == 0
    assert THREADS % BM == 0 and CB % R == 0, "the gather needs whole im2col rows per thread"
    assert 1 <= KR <= KSIZE
    smem = 4 * (A_SIZE + B_SIZE) + (8 * (RED + RED2) if FORWARD else 0)
    assert smem <= SMEM_LIMIT, f"{smem} bytes of shared memory; use a smaller bk"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS), cache=True)
    def conv2d_igemm(
        x, w, b, out, bn_partials, batch, c_in, height, width, c_out, h_out, w_out, pad, k_tiles
    ):
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        # `& 1023` tells the compiler tid >= 0 (no negative-index fix-ups below).
        tid = cuda.threadIdx.x & 1023
        tm = tid % TXM  # threads along M are the fast index: a warp spans pixels
        tn = tid // TXM
        row0 = cuda.blockIdx.x * BM
        col0 = cuda.blockIdx.y * BN
        hw = height * width
        ohw = h_out * w_out
        m_total = batch * ohw
        if FORWARD:
            s_n, s_c = c_in * KK2, KK2  # w[co, ci, kh, kw]: out channel n, reduced c
        else:
            s_n, s_c = KK2, c_out * KK2  # w[co, ci, ...] with co reduced, ci the output

        # The gather's im2col row: decoded once, outside the K loop.
        m_ld = tid % BM
        q0 = tid // BM
        m = row0 + m_ld
        img = m // ohw
        p = m - img * ohw
        oh = p // w_out
        ow = p - oh * w_out
        ih0 = oh - pad
        iw0 = ow - pad
        x_row = (img * c_in + q0) * hw + ih0 * width + iw0  # may be < 0: read only if valid
        colmask = 0  # bit kw: column ow + kw - pad is inside the image (0 past m_total)
        if m < m_total:
            for kw in range(KSIZE):
                if iw0 + kw >= 0 and iw0 + kw < width:
                    colmask |= 1 << kw
        a_dst = q0 * ROW_K * AP + m_ld
        b_part = tid // BN if B_RUNS else 0  # weight-load slot of this thread
        b_col = tid - b_part * BN
        b_ok = col0 + b_col < c_out
        b_dst = b_part * ROW_K * BNP + b_col
        w_col = (col0 + b_col) * s_n + b_part * s_c + KK2 - 1

        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        # Iteration t: store tile t (held in registers) into buffer t % 2, sync,
        # issue the global loads of tile t + 1, then the FMAs of tile t. The
        # buffer written at t was last read at t - 2, before the sync of t - 1.
        for t in range(-1, k_tiles):
            cur = t & 1
            if t >= 0:
                for cc in range(CBR):
                    for e in range(ROW_K):
                        a_tile[uint64(cur * A_BUF + a_dst + (cc * R * ROW_K + e) * AP)] = a_next[
                            cc * ROW_K + e
                        ]
                if B_RUNS:
                    for sl in range(B_SLOTS):
                        for e in range(ROW_K):
                            b_tile[
                                uint64(cur * B_BUF + b_dst + (sl * KSPLIT * ROW_K + e) * BNP)
                            ] = b_next[sl * ROW_K + e]
                else:
                    for load in range(B_LOADS):
                        idx = tid + load * THREADS
                        if B_EVEN or idx < B_ITEMS:
                            b_tile[uint64(cur * B_BUF + (idx % BK) * BNP + idx // BK)] = b_next[
                                load
                            ]
                cuda.syncthreads()
            if t + 1 < k_tiles:
                tt = t + 1
                ci0 = (tt // NRB) * CB
                kh0 = (tt % NRB) * KR
                base = x_row + ci0 * hw + kh0 * width
                for cc in range(CBR):
                    ch_ok = ci0 + q0 + cc * R < c_in
                    for r in range(KR):
                        ih = ih0 + kh0 + r
                        row_ok = ch_ok and kh0 + r < KSIZE and ih >= 0 and ih < height
                        rbase = base + cc * R * hw + r * width
                        for kw in range(KSIZE):
                            v = float32(0.0)
                            if row_ok and (colmask >> kw) & 1:
                                v = x[uint64(rbase + kw)]
                            a_next[(cc * KR + r) * KSIZE + kw] = v
                if B_RUNS:
                    w_at = w_col + ci0 * s_c - kh0 * KSIZE
                    for sl in range(B_SLOTS):
                        c_ok = b_ok and ci0 + b_part + sl * KSPLIT < c_in
                        for e in range(ROW_K):
                            v = float32(0.0)
                            if c_ok and (NRB == 1 or kh0 + e // KSIZE < KSIZE):
                                v = w[uint64(w_at + sl * KSPLIT * s_c - e)]
                            b_next[sl * ROW_K + e] = v
                for load in range(0 if B_RUNS else B_LOADS):
                    idx = tid + load * THREADS
                    nl = idx // BK  # k fastest: a warp reads runs of w[co, ci0:, kh0:, :]
                    kl = idx % BK
                    co = col0 + nl
                    ci = ci0 + kl // ROW_K
                    kh = kh0 + (kl // KSIZE) % KR
                    tap = kh * KSIZE + kl % KSIZE
                    if not FORWARD:
                        tap = KK2 - 1 - tap
                    v = float32(0.0)
                    if (B_EVEN or idx < B_ITEMS) and co < c_out and ci < c_in and kh < KSIZE:
                        v = w[uint64(co * s_n + ci * s_c + tap)]
                    b_next[load] = v
            if t >= 0:
                a_base = cur * A_BUF + tm * GM
                b_base = cur * B_BUF + tn * GN
                k = 0
                while k < BK:
                    for k1 in range(UNROLL):  # unrolled: UNROLL k per trip
                        a_k = a_base + (k + k1) * AP
                        b_k = b_base + (k + k1) * BNP
                        for i in range(TM):
                            a_frag[i] = a_tile[uint64(a_k + (i // GM) * GA + i % GM)]
                        for j in range(TN):
                            b_frag[j] = b_tile[uint64(b_k + (j // GN) * GB + j % GN)]
                        for i in range(TM):
                            for j in range(TN):
                                acc[i, j] += a_frag[i] * b_frag[j]
                    k += UNROLL

        # Epilogue: (+ bias), write out, and (forward) this thread's channel sums
        # over its TM rows, in float32 (keeps the float64 pipe, half rate or
        # less, out of the per-element work) around the thread's first output
        # (see shifted_sums: no cancellation when a channel's |mean| >> std).
        bias = cuda.local.array(TN, float32)
        shift = cuda.local.array(TN, float32)
        s1 = cuda.local.array(TN, float32)
        s2 = cuda.local.array(TN, float32)
        for j in range(TN):
            co = col0 + (j // GN) * GB + tn * GN + j % GN
            bias[j] = b[co] if FORWARD and co < c_out else float32(0.0)
            shift[j] = acc[0, j] + bias[j]  # row 0 is the thread's first (0 if none valid)
            s1[j] = 0.0
            s2[j] = 0.0
        rows = 0  # this thread's rows inside the batch
        for g in range(TM // GM):
            m = row0 + g * GA + tm * GM
            img = m // ohw  # one division per group of GM consecutive rows
            p = m - img * ohw
            for i2 in range(GM):
                if m < m_total:
                    rows += 1
                    o_row = img * c_out * ohw + p
                    for j in range(TN):
                        co = col0 + (j // GN) * GB + tn * GN + j % GN
                        if co < c_out:
                            v = acc[g * GM + i2, j] + bias[j]
                            out[uint64(o_row + co * ohw)] = v
                            if FORWARD:
                                d = v - shift[j]
                                s1[j] += d
                                s2[j] += d * d
                m += 1
                p += 1
                if p == ohw:
                    p = 0
                    img += 1
        if FORWARD:
            # Block sums per channel: each thread row's sums in shared memory,
            # added up in a fixed order (float64).
            red = cuda.shared.array(RED, float64)
            red2 = cuda.shared.array(RED2, float64)
            for j in range(TN):
                c = (j // GN) * GB + tn * GN + j % GN
                sum1, sum2 = shifted_sums(rows, shift[j], s1[j], s2[j])
                red[tm * BN + c] = sum1
                red[(TXM + tm) * BN + c] = sum2
            block_sums(red, red2, bn_partials, cuda.blockIdx.x, col0, c_out, tid)

    conv2d_igemm.threads = THREADS
    conv2d_igemm.tile = (BM, BN)
    conv2d_igemm.k_tile = (CB, KR)
    conv2d_igemm.launch_bounds = (THREADS, MIN_BLOCKS)
    return conv2d_igemm


_KERNELS: dict = {}


def _igemm_kernel(tiles: IgemmTiles, k: int, forward: bool):
    key = ("igemm", tiles, k, forward)
    if key not in _KERNELS:
        cb, kr = igemm_k_tile(tiles, k)
        _KERNELS[key] = make_conv2d_igemm(
            tiles.bm, tiles.bn, tiles.tm, tiles.tn, k, cb, kr, forward, tiles.min_blocks
        )
    return _KERNELS[key]


def _flat(a):
    return a.reshape(a.size)


def _require_conv_arrays(x, w, out, what):
    for a, name in ((x, what[0]), (w, what[1]), (out, what[2])):
        require_device_array(a, name, 4, np.float32)
        if not a.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous; copy it first")
    if w.shape[2] != w.shape[3]:
        raise ValueError(f"the kernel must be square, got w {w.shape}")
    if not 1 <= w.shape[2] <= MAX_KERNEL_SIZE:
        raise ValueError(f"kernel size must be 1..{MAX_KERNEL_SIZE}, got {w.shape[2]}")


def _out_hw(h: int, w: int, k: int, pad: int) -> tuple[int, int]:
    return h + 2 * pad - k + 1, w + 2 * pad - k + 1


def _check_forward(x, w, b, pad, out):
    _require_conv_arrays(x, w, out, ("x", "w", "out"))
    require_device_array(b, "b", 1, np.float32)
    n, c_in, h, wd = x.shape
    c_out, c_in_w, k, _ = w.shape
    if c_in_w != c_in or b.shape != (c_out,):
        raise ValueError(f"x {x.shape}, w {w.shape}, b {b.shape} do not match")
    h_out, w_out = _out_hw(h, wd, k, pad)
    if pad < 0 or h_out < 1 or w_out < 1 or out.shape != (n, c_out, h_out, w_out):
        raise ValueError(
            f"out must be {(n, c_out, h_out, w_out)} for x {x.shape}, "
            f"w {w.shape}, pad {pad}; got {out.shape}"
        )


def _check_partials(a, shape, dtype, name):
    require_device_array(a, name, len(shape), dtype)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)}, got {a.shape} "
            "(allocate it with the matching *_partial_rows / *_shape helper)"
        )


def conv2d_forward_igemm_partial_rows(
    n: int, h_out: int, w_out: int, tiles: IgemmTiles | None = None
) -> int:
    """P, the number of row blocks of the forward implicit GEMM: ceil(N*Ho*Wo / BM).
    ``bn_partials`` has shape (P, 2, Co)."""
    m_total = n * h_out * w_out
    return ceil_div(m_total, (tiles or igemm_tiles(m_total, 64)).bm)


def conv2d_forward_igemm(
    x, w, b, pad: int, out, bn_partials, tiles: IgemmTiles | None = None, stream=0
) -> None:
    """out (N, Co, Ho, Wo) = conv(x (N, Ci, H, W), w (Co, Ci, K, K)) + b (Co,), and
    the batchnorm partial sums of out, by implicit GEMM.

    Ho = H + 2 pad - K + 1 (stride 1, zero padding). x, w, b, out: float32
    C-contiguous device arrays. bn_partials: float64 device array (P, 2, Co),
    P = ``conv2d_forward_igemm_partial_rows(N, Ho, Wo)``; row p is the p-th block
    of BM consecutive output pixels (n, oh, ow) in NCHW order:
    bn_partials[p, 0, c] = sum of out[.., c, ..] over those pixels,
    bn_partials[p, 1, c] = sum of squares; every entry is written. Sum over p
    for the batch statistics. ``tiles``: override the default tile shape.

    GEMM_M = N*Ho*Wo, GEMM_N = Co, GEMM_K = Ci*K*K; the im2col tiles are gathered
    into shared memory on the fly (CUTLASS "Implicit GEMM Convolution";
    Chetlur et al. 2014, cuDNN, section 3). Never synchronizes or allocates.

    Raises:
        TypeError: an operand is not a device array or has the wrong dtype.
        ValueError: shapes do not match, not C-contiguous, K not square or > 15.
    """
    _check_forward(x, w, b, pad, out)
    n, c_in, h, wd = x.shape
    c_out, _, k, _ = w.shape
    h_out, w_out = out.shape[2], out.shape[3]
    m_total = n * h_out * w_out
    tiles = tiles or igemm_tiles(m_total, c_out)
    rows = ceil_div(m_total, tiles.bm)
    _check_partials(bn_partials, (rows, 2, c_out), np.float64, "bn_partials")
    kern = _igemm_kernel(tiles, k, True)
    cb, kr = kern.k_tile
    launch_conv2d_igemm(
        kern, x, w, b, pad, out, bn_partials, ceil_div(c_in, cb) * ceil_div(k, kr), stream
    )


def launch_conv2d_igemm(
    kernel, x, w, b, pad: int, out, bn_partials, k_tiles: int, stream=0
) -> None:
    """Launch a kernel from :func:`make_conv2d_igemm` (forward) over ``k_tiles``
    K-tiles; no checks. For tests that run a kernel the public launchers would
    not choose, e.g. one stopped short of the last K-tile."""
    n, c_in, h, wd = x.shape
    c_out = w.shape[0]
    h_out, w_out = out.shape[2], out.shape[3]
    bm, bn = kernel.tile
    kernel[(ceil_div(n * h_out * w_out, bm), ceil_div(c_out, bn)), kernel.threads, stream](
        _flat(x),
        _flat(w),
        b,
        _flat(out),
        bn_partials,
        n,
        c_in,
        h,
        wd,
        c_out,
        h_out,
        w_out,
        pad,
        k_tiles,
    )


def conv2d_grad_input_igemm(
    dout, w, pad: int, dx, tiles: IgemmTiles | None = None, stream=0
) -> None:
    """dx (N, Ci, H, W) = d loss / d x from dout (N, Co, Ho, Wo) and w (Co, Ci, K, K),
    by implicit GEMM.

    dx[n, ci, ih, iw] = sum_{co, kh, kw} dout[n, co, ih + pad - kh, iw + pad - kw]
    w[co, ci, kh, kw] (terms outside dout are 0): a convolution of dout with the
    kernel flipped in space and transposed in channels, padding K - 1 - pad.
    GEMM_M = N*H*W, GEMM_N = Ci, GEMM_K = Co*K*K. float32 C-contiguous device
    arrays; writes every element of dx. Never synchronizes or allocates.
    (CUTLASS "Implicit GEMM Convolution", Dgrad; Chetlur et al. 2014.)

    Raises:
        TypeError: an operand is not a float32 device array.
        ValueError: shapes do not match, not C-contiguous, K not square or > 15.
    """
    _require_conv_arrays(dout, w, dx, ("dout", "w", "dx"))
    n, c_out, h_out, w_out = dout.shape
    _, c_in, k, _ = w.shape
    h, wd = dx.shape[2], dx.shape[3]
    if (
        w.shape[0] != c_out
        or dx.shape[:2] != (n, c_in)
        or pad < 0
        or _out_hw(h, wd, k, pad) != (h_out, w_out)
    ):
        raise ValueError(f"dout {dout.shape}, w {w.shape}, dx {dx.shape}, pad {pad} do not match")
    m_total = n * h * wd
    tiles = tiles or igemm_tiles(m_total, c_in, forward=False)
    kern = _igemm_kernel(tiles, k, False)
    cb, kr = kern.k_tile
    k_tiles = ceil_div(c_out, cb) * ceil_div(k, kr)
    # The GEMM's "input" is dout (c_out channels), its output dx (c_in channels);
    # w stands in for the unused bias and dx (3-D view) for the unused partials.
    kern[(ceil_div(m_total, tiles.bm), ceil_div(c_in, tiles.bn)), kern.threads, stream](
        _flat(dout),
        _flat(w),
        _flat(w),
        _flat(dx),
        dx.reshape(n * c_in, h, wd),
        n,
        c_out,
        h_out,
        w_out,
        c_in,
        h,
        wd,
        k - 1 - pad,
        k_tiles,
    )


# ---------------------------------------------------------------------------
# Direct convolution (tiny Ci)
# ---------------------------------------------------------------------------


def make_conv2d_direct(TXP, TP, TYC, TC, KSIZE, CI_CHUNK, MIN_BLOCKS=2):
    """Factory: direct convolution, thread = TP pixels x TC channels.

    Block = TXP * TP consecutive output pixels x TYC * TC channels; thread
    (tp, tc) = tid % TXP, tid // TXP owns pixels tp + i * TXP (a warp writes 32
    consecutive pixels of a channel) and channels tc * TC + j. Weights for
    CI_CHUNK input channels at a time sit in shared memory (read as TC-wide
    broadcasts); each x value is one predicated global load used for TC FMAs.
    Kernel arguments: (x, w, b, out, bn_partials, batch, c_in, height, width,
    c_out, h_out, w_out, pad), arrays flat except bn_partials (P, 2, c_out)."""
    THREADS = TXP * TYC
    BP, BC = TXP * TP, TYC * TC
    KK2 = KSIZE * KSIZE
    TAP_MASK = KK2 <= 62  # one bit a tap; else a row mask and a column mask
    W_SIZE = CI_CHUNK * KK2 * BC
    block_sums = make_block_channel_sums(TXP, BC, THREADS)
    RED, RED2 = block_sums.sizes
    assert KSIZE <= 31, "row and column masks share one int64"
    assert 4 * W_SIZE + 8 * (RED + RED2) <= SMEM_LIMIT, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS), cache=True)
    def conv2d_direct(
        x, w, b, out, bn_partials, batch, c_in, height, width, c_out, h_out, w_out, pad
    ):
        w_s = cuda.shared.array(W_SIZE, float32, alignment=SMEM_ALIGN)
        red = cuda.shared.array(RED, float64)
        red2 = cuda.shared.array(RED2, float64)
        acc = cuda.local.array((TP, TC), float32)
        x_off = cuda.local.array(TP, int64)
        x_mask = cuda.local.array(TP, int64)
        wf = cuda.local.array(TC, float32)
        tid = cuda.threadIdx.x & 1023
        tp = tid % TXP
        tc = tid // TXP
        row0 = cuda.blockIdx.x * BP
        col0 = cuda.blockIdx.y * BC
        hw = height * width
        ohw = h_out * w_out
        m_total = batch * ohw
        # Per pixel, once: its window's offset into x and which taps fall inside
        # the image. Pixel i + 1 is TXP = dn*ohw + dh*w_out + dw further on:
        # decoded with carries, not divisions (an int64 division is ~70 instructions).
        dn = TXP // ohw
        dh = (TXP - dn * ohw) // w_out
        dw = TXP - dn * ohw - dh * w_out
        m = row0 + tp
        img = m // ohw
        oh = (m - img * ohw) // w_out
        ow = m - img * ohw - oh * w_out
        for i in range(TP):
            x_off[i] = img * c_in * hw + (oh - pad) * width + (ow - pad)
            rows = 0
            cols = 0
            for tap in range(KSIZE):
                if oh - pad + tap >= 0 and oh - pad + tap < height:
                    rows |= 1 << tap
                if ow - pad + tap >= 0 and ow - pad + tap < width:
                    cols |= 1 << tap
            mask = rows | (cols << 32)
            if TAP_MASK:  # bit kh * K + kw
                mask = 0
                for kh in range(KSIZE):
                    if (rows >> kh) & 1:
                        mask |= cols << (kh * KSIZE)
            x_mask[i] = mask if m < m_total else 0
            for j in range(TC):
                acc[i, j] = 0.0
            m += TXP
            ow += dw
            oh += dh
            img += dn
            if ow >= w_out:
                ow -= w_out
                oh += 1
            if oh >= h_out:
                oh -= h_out
                img += 1
        for ci0 in range(0, c_in, CI_CHUNK):
            cuda.syncthreads()  # everyone is done with the previous chunk's weights
            for idx in range(tid, W_SIZE, THREADS):  # w_s[(ci_l * KK2 + tap) * BC + c]
                c = idx % BC
                rest = idx // BC
                ci = ci0 + rest // KK2
                co = col0 + c
                v = float32(0.0)
                if co < c_out and ci < c_in:
                    v = w[uint64((co * c_in + ci) * KK2 + rest % KK2)]
                w_s[idx] = v
            cuda.syncthreads()
            for ci_l in range(CI_CHUNK):
                ci = ci0 + ci_l
                if ci < c_in:
                    x_ci = ci * hw
                    for kh in range(KSIZE):
                        for kw in range(KSIZE):
                            w_at = (ci_l * KK2 + kh * KSIZE + kw) * BC + tc * TC
                            for j in range(TC):
                                wf[j] = w_s[uint64(w_at + j)]
                            for i in range(TP):
                                mk = x_mask[i]
                                if TAP_MASK:
                                    inside = (mk >> (kh * KSIZE + kw)) & 1
                                else:
                                    inside = (mk >> kh) & (mk >> (32 + kw)) & 1
                                # A predicated load, not a load of a safe address then a
                                # select: measured, that keeps more values live (192
                                # registers instead of 168) and runs slower.
                                v = float32(0.0)
                                if inside:
                                    v = x[uint64(x_off[i] + x_ci + kh * width + kw)]
                                for j in range(TC):
                                    acc[i, j] += v * wf[j]
        # Epilogue: + bias, coalesced writes, per-thread channel sums over the TP
        # pixels (float32, around the thread's first output: see shifted_sums),
        # then float64 across the block.
        s1 = cuda.local.array(TC, float32)
        s2 = cuda.local.array(TC, float32)
        bias = cuda.local.array(TC, float32)
        shift = cuda.local.array(TC, float32)
        for j in range(TC):
            s1[j] = 0.0
            s2[j] = 0.0
            co = col0 + tc * TC + j
            bias[j] = b[co] if co < c_out else float32(0.0)
            shift[j] = acc[0, j] + bias[j]  # pixel 0 is the thread's first (0 if none valid)
        rows = 0  # this thread's pixels inside the batch
        m = row0 + tp
        img = m // ohw
        p = m - img * ohw
        dp = TXP - dn * ohw
        for i in range(TP):
            if m < m_total:
                rows += 1
                o_row = (img * c_out + col0 + tc * TC) * ohw + p
                for j in range(TC):
                    if col0 + tc * TC + j < c_out:
                        v = acc[i, j] + bias[j]
                        out[uint64(o_row + j * ohw)] = v
                        d = v - shift[j]
                        s1[j] += d
                        s2[j] += d * d
            m += TXP
            p += dp
            img += dn
            if p >= ohw:
                p -= ohw
                img += 1
        for j in range(TC):
            sum1, sum2 = shifted_sums(rows, shift[j], s1[j], s2[j])
            red[tp * BC + tc * TC + j] = sum1
            red[(TXP + tp) * BC + tc * TC + j] = sum2
        block_sums(red, red2, bn_partials, cuda.blockIdx.x, col0, c_out, tid)

    conv2d_direct.threads = THREADS
    conv2d_direct.tile = (BP, BC)
    conv2d_direct.launch_bounds = (THREADS, MIN_BLOCKS)
    return conv2d_direct


def direct_ci_chunk(tiles: DirectTiles, k: int) -> int:
    """Input channels of weights the direct kernel stages at a time: ``tiles.ci_chunk``,
    fewer for large K so they stay within 16 KiB (at least one channel)."""
    return max(1, min(tiles.ci_chunk, 4096 // (k * k * tiles.tyc * tiles.tc)))


def _direct_kernel(tiles: DirectTiles, k: int):
    key = ("direct", tiles, k)
    if key not in _KERNELS:
        _KERNELS[key] = make_conv2d_direct(
            tiles.txp, tiles.tp, tiles.tyc, tiles.tc, k, direct_ci_chunk(tiles, k), tiles.min_blocks
        )
    return _KERNELS[key]


def conv2d_forward_direct_partial_rows(
    n: int, h_out: int, w_out: int, c_out: int, tiles: DirectTiles | None = None
) -> int:
    """P, the number of pixel blocks of the direct forward kernel:
    ceil(N*Ho*Wo / (txp * tp)). ``bn_partials`` has shape (P, 2, Co)."""
    tiles = tiles or DIRECT_TILES
    return ceil_div(n * h_out * w_out, tiles.txp * tiles.tp)


def conv2d_forward_direct(
    x, w, b, pad: int, out, bn_partials, tiles: DirectTiles | None = None, stream=0
) -> None:
    """out (N, Co, Ho, Wo) = conv(x (N, Ci, H, W), w (Co, Ci, K, K)) + b (Co,) and
    the batchnorm partial sums, by a direct kernel for small Ci (conv1: Ci = 1).

    Same arrays and the same ``bn_partials`` contract as
    :func:`conv2d_forward_igemm`, with P = ``conv2d_forward_direct_partial_rows(N,
    Ho, Wo, Co)`` blocks of consecutive output pixels. Correct for any Ci (the
    weights are staged a few input channels at a time), fast when Ci * K * K is
    small: each thread computes TP pixels x TC channels, reading each input
    value once for TC FMAs (Goodfellow et al., "Deep Learning", section 9.5;
    the cuDNN paper's "direct" algorithm, Chetlur et al. 2014, section 2).
    Never synchronizes or allocates.

    Raises:
        TypeError: an operand is not a device array or has the wrong dtype.
        ValueError: shapes do not match, not C-contiguous, K not square or > 15.
    """
    _check_forward(x, w, b, pad, out)
    n, c_in, h, wd = x.shape
    c_out, _, k, _ = w.shape
    h_out, w_out = out.shape[2], out.shape[3]
    tiles = tiles or DIRECT_TILES
    rows = conv2d_forward_direct_partial_rows(n, h_out, w_out, c_out, tiles)
    _check_partials(bn_partials, (rows, 2, c_out), np.float64, "bn_partials")
    kern = _direct_kernel(tiles, k)
    kern[(rows, ceil_div(c_out, tiles.tyc * tiles.tc)), kern.threads, stream](
        _flat(x), _flat(w), b, _flat(out), bn_partials, n, c_in, h, wd, c_out, h_out, w_out, pad
    )


# ---------------------------------------------------------------------------
# Weight gradient: implicit GEMM with split-K, then a fixed-order float64 reduction
# ---------------------------------------------------------------------------


def make_conv2d_grad_weight_igemm(BM, BN, BK, TM, TN, MIN_BLOCKS=2):
    """Factory: one chunk of the weight-gradient GEMM per block (split-K).

    GEMM rows = output channels co, columns j = (ci, kh, kw) plus one column of
    ones (its sum is db), K = the chunk's pixels m = (n, oh, ow). Thread
    mapping for the loads: pixel ``tid % BK`` of the K-tile (its (n, oh, ow)
    decoded once, then advanced with carries, no division), rows/columns
    ``tid // BK + load * RA``; a column's (ci, kh, kw) comes from a per-block
    table in shared memory. Compute as the forward kernel (TM x TN register
    tiles, LDS.128 fragments, register double buffering). Kernel arguments:
    (dout, x, partials, batch, c_in, height, width, c_out, h_out, w_out, ksize,
    pad, chunk), arrays flat; writes partials[s, co, j] for every co < c_out,
    j <= Ci*K*K of chunk s = blockIdx.y (0 for an empty chunk)."""
    TXM, TXN = BM // TM, BN // TN
    THREADS = TXM * TXN
    RA = THREADS // BK  # tile rows (and columns) one load step covers
    A_LOADS, B_LOADS = BM // RA, BN // RA
    GM, GN = min(TM, 4), min(TN, 4)
    GA, GB = TXM * GM, TXN * GN
    AP, BNP = BM + 4, BN + 4  # pixel-fast stores, padded against bank conflicts
    A_BUF, B_BUF = BK * AP, BK * BNP
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF
    UNROLL = 2 if BK % 2 == 0 else 1
    assert BM % TM == 0 and BN % TN == 0 and TM % GM == 0 and TN % GN == 0
    assert THREADS % BK == 0 and BM % RA == 0 and BN % RA == 0, "uneven loads"
    assert 4 * (A_SIZE + B_SIZE + 3 * BN) <= SMEM_LIMIT, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS), cache=True)
    def conv2d_grad_weight_igemm(
        dout, x, partials, batch, c_in, height, width, c_out, h_out, w_out, ksize, pad, chunk
    ):
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)  # [m * AP + co]
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)  # [m * BNP + j]
        tab_off = cuda.shared.array(BN, int32)  # column j: offset ci*H*W + kh*W + kw
        tab_kh = cuda.shared.array(BN, int32)
        tab_kw = cuda.shared.array(BN, int32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        tid = cuda.threadIdx.x & 1023
        tm = tid % TXM
        tn = tid // TXM
        col0 = cuda.blockIdx.x * BN
        chunk_id = cuda.blockIdx.y
        row0 = cuda.blockIdx.z * BM
        kk2 = ksize * ksize
        n_cols = c_in * kk2 + 1
        hw = height * width
        ohw = h_out * w_out
        m_total = batch * ohw
        m_begin = chunk_id * chunk
        m_end = min(m_begin + chunk, m_total)
        k_tiles = (m_end - m_begin + BK - 1) // BK if m_end > m_begin else 0

        for jl in range(tid, BN, THREADS):
            j = col0 + jl
            off, kh, kw = 0, _NO_ROW, 0
            if j < n_cols - 1:
                ci = j // kk2
                tap = j - ci * kk2
                kh = tap // ksize
                kw = tap - kh * ksize
                off = ci * hw + kh * width + kw
            elif j == n_cols - 1:
                kh = _ONES_ROW
            tab_off[jl] = off
            tab_kh[jl] = kh
            tab_kw[jl] = kw
        cuda.syncthreads()

        # The load pixel: decoded once, then advanced by BK = dn*ohw + dh*w_out + dw.
        mq = tid % BK
        q0 = tid // BK
        m = m_begin + mq
        img = m // ohw
        p = m - img * ohw
        oh = p // w_out
        ow = p - oh * w_out
        dn = BK // ohw
        dp = BK - dn * ohw
        dh = dp // w_out
        dw = dp - dh * w_out

        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for t in range(-1, k_tiles):
            cur = t & 1
            if t >= 0:
                for load in range(A_LOADS):
                    a_tile[uint64(cur * A_BUF + mq * AP + q0 + load * RA)] = a_next[load]
                for load in range(B_LOADS):
                    b_tile[uint64(cur * B_BUF + mq * BNP + q0 + load * RA)] = b_next[load]
                cuda.syncthreads()
            if t + 1 < k_tiles:
                m_ok = m < m_end
                d_at = (img * c_out + row0 + q0) * ohw + oh * w_out + ow
                for load in range(A_LOADS):
                    v = float32(0.0)
                    if m_ok and row0 + q0 + load * RA < c_out:
                        v = dout[uint64(d_at + load * RA * ohw)]
                    a_next[load] = v
                x_at = img * c_in * hw + (oh - pad) * width + (ow - pad)
                for load in range(B_LOADS):
                    jl = q0 + load * RA
                    ih = oh - pad + tab_kh[jl]
                    iw = ow - pad + tab_kw[jl]
                    v = float32(0.0)
                    if m_ok:
                        if ih >= 0 and ih < height and iw >= 0 and iw < width:
                            v = x[uint64(x_at + tab_off[jl])]
                        elif tab_kh[jl] == _ONES_ROW:
                            v = float32(1.0)
                    b_next[load] = v
                m += BK
                ow += dw
                oh += dh
                img += dn
                if ow >= w_out:
                    ow -= w_out
                    oh += 1
                if oh >= h_out:
                    oh -= h_out
                    img += 1
            if t >= 0:
                a_base = cur * A_BUF + tm * GM
                b_base = cur * B_BUF + tn * GN
                k = 0
                while k < BK:
                    for k1 in range(UNROLL):
                        a_k = a_base + (k + k1) * AP
                        b_k = b_base + (k + k1) * BNP
                        for i in range(TM):
                            a_frag[i] = a_tile[uint64(a_k + (i // GM) * GA + i % GM)]
                        for j in range(TN):
                            b_frag[j] = b_tile[uint64(b_k + (j // GN) * GB + j % GN)]
                        for i in range(TM):
                            for j in range(TN):
                                acc[i, j] += a_frag[i] * b_frag[j]
                    k += UNROLL

        for i in range(TM):
            co = row0 + (i // GM) * GA + tm * GM + i % GM
            for j in range(TN):
                jj = col0 + (j // GN) * GB + tn * GN + j % GN
                if co < c_out and jj < n_cols:
                    partials[uint64((chunk_id * c_out + co) * n_cols + jj)] = acc[i, j]

    conv2d_grad_weight_igemm.threads = THREADS
    conv2d_grad_weight_igemm.tile = (BM, BN)
    conv2d_grad_weight_igemm.bk = BK
    conv2d_grad_weight_igemm.launch_bounds = (THREADS, MIN_BLOCKS)
    return conv2d_grad_weight_igemm


def grad_weight_tiles(c_out: int, n_cols: int) -> GradWeightTiles:
    """Default weight-gradient tiles for a Co x n_cols (= Ci*K*K + 1) gradient."""
    if c_out <= GRAD_WEIGHT_TILES_SMALL.bm and n_cols <= GRAD_WEIGHT_TILES_SMALL.bn:
        return GRAD_WEIGHT_TILES_SMALL
    return GRAD_WEIGHT_TILES


def grad_weight_split(
    m_total: int, c_out: int, n_cols: int, tiles: GradWeightTiles
) -> tuple[int, int]:
    """(S, chunk): the N*Ho*Wo pixels cut into S chunks of ``chunk`` pixels (a
    multiple of bk; the last chunk may be shorter). S is the larger of what keeps
    chunks <= max_chunk and what gives about blocks_per_sm blocks per SM of the
    current device, but no more chunks than keep them >= min_chunk where that
    is the tighter bound."""
    bk = tiles.bk
    k_tiles = ceil_div(m_total, bk)
    blocks_per_chunk = ceil_div(c_out, tiles.bm) * ceil_div(n_cols, tiles.bn)
    target_blocks = tiles.blocks_per_sm * sm_count()
    want = max(
        ceil_div(m_total, tiles.max_chunk),
        min(ceil_div(target_blocks, blocks_per_chunk), ceil_div(m_total, tiles.min_chunk)),
    )
    s = max(1, min(want, k_tiles, 65535))
    chunk = ceil_div(k_tiles, s) * bk
    return ceil_div(m_total, chunk), chunk


def conv2d_grad_weight_igemm_partials_shape(
    n: int,
    h_out: int,
    w_out: int,
    c_out: int,
    c_in: int,
    k: int,
    tiles: GradWeightTiles | None = None,
) -> tuple[int, int, int]:
    """(S, Co, Ci*K*K + 1): shape of the float32 split-K partials buffer of
    :func:`conv2d_grad_weight_igemm` for dout (n, c_out, h_out, w_out)."""
    n_cols = c_in * k * k + 1
    tiles = tiles or grad_weight_tiles(c_out, n_cols)
    s, _ = grad_weight_split(n * h_out * w_out, c_out, n_cols, tiles)
    return s, c_out, n_cols


def _grad_weight_kernel(tiles: GradWeightTiles):
    key = ("grad_weight", tiles)
    if key not in _KERNELS:
        _KERNELS[key] = make_conv2d_grad_weight_igemm(
            tiles.bm, tiles.bn, tiles.bk, tiles.tm, tiles.tn, tiles.min_blocks
        )
    return _KERNELS[key]


def conv2d_grad_weight_igemm(
    dout, x, pad: int, dw, db, partials, tiles: GradWeightTiles | None = None, stream=0
) -> None:
    """dw (Co, Ci, K, K) = d loss / d w and db (Co,) = dout summed over (n, oh, ow),
    from dout (N, Co, Ho, Wo) and the layer input x (N, Ci, H, W): implicit GEMM
    with split-K.

    GEMM_M = Co, GEMM_N = Ci*K*K + 1 (the last column is ones: db), GEMM_K =
    N*Ho*Wo cut into S chunks. Kernel 1: each block sums its chunk's K-tiles in
    float32 into partials[s, co, j] (float32 device array of shape
    ``conv2d_grad_weight_igemm_partials_shape(N, Ho, Wo, Co, Ci, K)``; scratch,
    fully overwritten). Kernel 2, the linear layers' reduction
    (:func:`final_project.fast_layers.splitk_reduce_weight_bias`): sums the S
    partials of each (co, j) in float64 in a fixed order and writes dw and db
    (float32), so the result is the same bit for bit on every run. Never
    synchronizes or allocates. (Split-K: CUTLASS
    "Efficient GEMM in CUDA", parallelized reductions; implicit GEMM Wgrad:
    CUTLASS "Implicit GEMM Convolution".)

    Raises:
        TypeError: an operand is not a device array or has the wrong dtype.
        ValueError: shapes do not match, not C-contiguous, K not square or > 15,
            or ``partials`` has the wrong shape.
    """
    _require_conv_arrays(x, dw, dout, ("x", "dw", "dout"))
    require_device_array(db, "db", 1, np.float32)
    n, c_in, h, wd = x.shape
    c_out, _, k, _ = dw.shape
    h_out, w_out = _out_hw(h, wd, k, pad)
    if (
        dw.shape[1] != c_in
        or db.shape != (c_out,)
        or pad < 0
        or dout.shape != (n, c_out, h_out, w_out)
    ):
        raise ValueError(
            f"dout {dout.shape}, x {x.shape}, dw {dw.shape}, db {db.shape}, pad {pad} do not match"
        )
    n_cols = c_in * k * k + 1
    m_total = n * h_out * w_out
    tiles = tiles or grad_weight_tiles(c_out, n_cols)
    s_count, chunk = grad_weight_split(m_total, c_out, n_cols, tiles)
    _check_partials(partials, (s_count, c_out, n_cols), np.float32, "partials")
    launch_conv2d_grad_weight_igemm(
        _grad_weight_kernel(tiles), dout, x, pad, dw, db, partials, chunk, s_count, stream
    )


def launch_conv2d_grad_weight_igemm(
    kernel, dout, x, pad: int, dw, db, partials, chunk: int, s_count: int, stream=0
) -> None:
    """Launch a kernel from :func:`make_conv2d_grad_weight_igemm` over chunks of
    ``chunk`` pixels, then the reduction over the first ``s_count`` partials; no
    checks. For tests that run what the public launcher would not, e.g. a
    reduction that drops the last chunk."""
    n, c_in, h, wd = x.shape
    c_out, _, k, _ = dw.shape
    h_out, w_out = dout.shape[2], dout.shape[3]
    n_cols = c_in * k * k + 1
    bm, bn = kernel.tile
    kernel[(ceil_div(n_cols, bn), partials.shape[0], ceil_div(c_out, bm)), kernel.threads, stream](
        _flat(dout), _flat(x), _flat(partials), n, c_in, h, wd, c_out, h_out, w_out, k, pad, chunk
    )
    fast_layers.splitk_reduce_weight_bias(partials, s_count, dw, db, stream)
