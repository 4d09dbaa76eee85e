# ruff: noqa: F841, B007  (stubs: the TODO lines will use these names)
"""Chapter 08 exercises: a tiled matmul, a register-tiled inner loop, arithmetic intensity.

Fill the lines marked TODO, delete the `raise NotImplementedError` line of the
launcher, and run `python -m pytest tests/test_ch08_matmul.py -q`. The tests
use sizes that are not multiples of the tile and check every element; a
missing bounds check or a missing cuda.syncthreads() fails them.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling

from numba import cuda, float32

_CACHE = {}


# The chapter script's operand check: 2-D float32 row-major device arrays whose
# shapes chain (a (M, K), b (K, N), c (M, N)); TypeError or ValueError otherwise.
check_operands = import_sibling(__file__, "matmul").check_operands


# ---------------------------------------------------------------- Exercise 8.1
# (matmul.py's version 5, written by you)


def make_tiled_kernel(TILE):
    @cuda.jit(cache=True)
    def matmul_tiled(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        m, k_total = a.shape
        n = b.shape[1]
        acc = float32(0.0)
        for k0 in range(0, k_total, TILE):
            # TODO: a_tile[ty, tx] = A[row, k0 + tx], or 0 outside A
            # TODO: b_tile[ty, tx] = B[k0 + ty, col], or 0 outside B
            # TODO: wait until the whole tile is loaded
            for k in range(TILE):
                acc += 0.0  # TODO: a_tile row ty times b_tile column tx
            # TODO: wait until everyone is done with the tile
        if row < m and col < n:
            c[row, col] = acc

    return matmul_tiled


def matmul_tiled(a, b, c, tile=16):
    """Exercise 8.1: C = A @ B with TILE x TILE tiles staged in shared memory.

    a: (M, K), b: (K, N), c: (M, N) float32 device arrays, any sizes >= 1.
    Launch: blocks of (tile, tile) threads, grid (ceil(N / tile), ceil(M / tile)),
    thread (x, y) of block (bx, by) owns C[by * tile + y, bx * tile + x].
    Out-of-range tile cells are loaded as 0; syncthreads after loading a tile
    and again before overwriting it. Raises TypeError/ValueError on bad operands.
    """
    raise NotImplementedError("Exercise 8.1: fill the TODOs in make_tiled_kernel")
    a, b, c = check_operands(a, b, c)
    key = ("tiled", tile)
    if key not in _CACHE:
        _CACHE[key] = make_tiled_kernel(tile)
    m, n = c.shape
    _CACHE[key][(ceil_div(n, tile), ceil_div(m, tile)), (tile, tile)](a, b, c)


# ---------------------------------------------------------------- Exercise 8.2
# (version 7's register tile, without its strided thread layout)


def make_register_tile_kernel(BM, BN, BK, TM, TN):
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY

    @cuda.jit(cache=True)
    def matmul_register_tile(a, b, c):
        a_tile = cuda.shared.array((BM, BK), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        tid = cuda.threadIdx.x
        tx, ty = tid % TX, tid // TX
        m, k_total = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for k0 in range(0, k_total, BK):
            for idx in range(tid, BM * BK, THREADS):
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < k_total
                a_tile[r, q] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for idx in range(tid, BK * BN, THREADS):
                r, q = idx // BN, idx % BN
                ok = k0 + r < k_total and col0 + q < n
                b_tile[r, q] = b[k0 + r, col0 + q] if ok else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                for i in range(TM):
                    a_frag[i] = 0.0  # TODO: this thread's row i of the A tile, column k
                for j in range(TN):
                    b_frag[j] = 0.0  # TODO: row k of the B tile, this thread's column j
                for i in range(TM):
                    for j in range(TN):
                        pass  # TODO: accumulate the outer product into acc[i, j]
            cuda.syncthreads()
        for i in range(TM):
            for j in range(TN):
                row, col = row0 + ty * TM + i, col0 + tx * TN + j
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    return matmul_register_tile


def matmul_register_tile(a, b, c, bm=16, bn=16, bk=4, tm=4, tn=4):
    """Exercise 8.2: C = A @ B, each thread a tm x tn register tile (outer products).

    a: (M, K), b: (K, N), c: (M, N) float32 device arrays, any sizes >= 1.
    A block of (bm // tm) * (bn // tn) threads (1-D) computes the bm x bn tile
    of C at block (bx, by) = (column tile, row tile); thread t has
    tx = t % (bn // tn), ty = t // (bn // tn) and owns rows ty * tm .. + tm and
    columns tx * tn .. + tn of that tile. Per BK-slice: all threads load the
    (bm, bk) A tile and (bk, bn) B tile into shared memory (0 outside the
    matrices), sync, then for each k load tm values of A and tn of B into
    registers and do tm * tn FMAs. Raises ValueError if tm, tn do not divide bm, bn.
    """
    raise NotImplementedError("Exercise 8.2: fill the TODOs in make_register_tile_kernel")
    a, b, c = check_operands(a, b, c)
    if bm % tm or bn % tn:
        raise ValueError(f"tm={tm} must divide bm={bm} and tn={tn} must divide bn={bn}")
    key = ("regtile", bm, bn, bk, tm, tn)
    if key not in _CACHE:
        _CACHE[key] = make_register_tile_kernel(bm, bn, bk, tm, tn)
    m, n = c.shape
    threads = (bm // tm) * (bn // tn)
    _CACHE[key][(ceil_div(n, bn), ceil_div(m, bm)), threads](a, b, c)


# ---------------------------------------------------------------- Exercise 8.3


def arithmetic_intensity(bm, bn, bk):
    """Exercise 8.3: FLOP per byte of global memory traffic of one block-tiled SGEMM step.

    One block computes a bm x bn tile of C; per K-slice of width bk it loads a
    (bm, bk) tile of A and a (bk, bn) tile of B (float32: 4 bytes each) and does
    bm * bn * bk FMAs (2 FLOP each). Returns FLOP / byte as a float; the tile of
    C itself is ignored (written once at the end). E.g. 32 x 32 x 32 -> 8.0.
    Raises ValueError for a size < 1.
    """
    raise NotImplementedError("Exercise 8.3: FLOP / byte of one K-slice")
