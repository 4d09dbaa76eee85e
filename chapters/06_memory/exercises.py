"""Chapter 06 exercises: shared memory, barriers, atomics.

Each exercise is a host function whose docstring is the spec. The kernel stub sits
right above it: fill the lines marked ``# TODO``, then delete the
``raise NotImplementedError`` line in the host function (the launch below it is
written for you). Check your work with

    python -m pytest tests/test_ch06_memory.py -q

The checks are hostile: random data, sizes that do not divide the block, one
element, outputs surrounded by poison (a write past the end fails), threads
interleaved (a missing ``cuda.syncthreads`` shows). Solutions: solutions.py.

All inputs and outputs are Numba device arrays (``cuda.to_device``).
"""

# ruff: noqa: F841, B007  (stubs leave variables for the learner to use)
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div

import math  # noqa: F401  (6.10 needs math.exp)

import numpy as np
from numba import cuda, float32, int32  # noqa: F401

BLOCK = 64  # threads per block in every 1-D exercise (a power of two)
TILE = 16  # transpose tile edge
ROWS = 4  # transpose block is TILE x ROWS threads
NBINS = 16  # histogram bins (few bins: many threads collide)
RADIUS = 2  # stencil halo width
# shared array shapes must be compile-time constants (module-level ints), never
# `TILE + 1` computed inside a kernel: the GPU compiler refuses that
TILE_PADDED = TILE + 1  # transpose tile row: one spare column
HALO_BLOCK = BLOCK + 2 * RADIUS  # stencil tile: the block's slice plus both halos
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
ONE_I32 = np.int32(1)
NEG_INF = np.float32(-np.inf)


# ---------------------------------------------------------------- 6.1 shift left
@cuda.jit(cache=True)
def shift_left_kernel(x, out):
    tile = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        tile[t] = x[i]
    pass  # TODO: wait until every thread of the block has written its slot
    if i < out.size:
        out[i] = ZERO  # TODO: the right neighbour, from the tile (or x if it is in the next block)


def shift_left(x, out):
    """Exercise 6.1: ``out[i] = x[i + 1]`` through a shared-memory tile.

    x: float32 (n,), n >= 2. out: float32 (n - 1,). Launch: ceil(n / BLOCK) blocks of
    BLOCK threads. Each thread stores x[i] in ``tile[t]``, then reads ``tile[t + 1]``;
    the last thread of a block reads x[i + 1] from global memory instead.
    Raises ValueError if out does not have n - 1 elements.
    """
    raise NotImplementedError("Exercise 6.1: shift left through shared memory")
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    if out.size != x.size - 1:
        raise ValueError(f"out must have x.size - 1 = {x.size - 1} elements, got {out.size}")
    shift_left_kernel[ceil_div(x.size, BLOCK), BLOCK](x, out)


# ---------------------------------------------------------------- 6.2 block sums
@cuda.jit(cache=True)
def block_sums_kernel(x, out):
    s = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = ZERO  # TODO: x[i], or 0 for threads past the end
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        pass  # TODO: threads t < stride add s[t + stride] into s[t]; then a barrier
        stride //= 2
    if t == 0:
        out[cuda.blockIdx.x] = s[0]


def block_sums(x, out):
    """Exercise 6.2: the sum of each block's slice of x (a shared-memory tree).

    x: float32 (n,). out: float32 (ceil(n / BLOCK),): out[b] = sum(x[b*BLOCK:(b+1)*BLOCK]).
    Launch: one block of BLOCK threads per output. Use sequential addressing
    (Harris 2007, "Optimizing Parallel Reduction in CUDA", kernel 3).
    """
    raise NotImplementedError("Exercise 6.2: block-wide sum")
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    if out.size != ceil_div(x.size, BLOCK):
        raise ValueError(f"out must have ceil(n / BLOCK) = {ceil_div(x.size, BLOCK)} elements")
    block_sums_kernel[out.size, BLOCK](x, out)


# ---------------------------------------------------------------- 6.3 dot product
@cuda.jit(cache=True)
def dot_kernel(a, b, out):
    s = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    acc = ZERO
    pass  # TODO: grid-stride loop: acc += a[i] * b[i] for i, i + gridsize, ...
    s[t] = acc
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        pass  # TODO: add this block's total into out[0] -- other blocks do the same


def dot(a, b, out, blocks=4):
    """Exercise 6.3: ``out[0] = sum(a * b)``.

    a, b: float32 (n,). out: float32 (1,). Launch: ``blocks`` blocks of BLOCK threads,
    whatever n is (a grid-stride loop covers the rest). One atomic add per block.
    """
    raise NotImplementedError("Exercise 6.3: dot product, one atomic per block")
    a = require_device_array(a, "a", ndim=1, dtype=np.float32)
    b = require_device_array(b, "b", ndim=1, dtype=np.float32)
    if a.shape != b.shape or out.shape != (1,):
        raise ValueError(f"need a (n,), b (n,), out (1,); got {a.shape}, {b.shape}, {out.shape}")
    out.copy_to_device(np.zeros(1, np.float32))
    dot_kernel[blocks, BLOCK](a, b, out)


# ---------------------------------------------------------------- 6.4 max with index
@cuda.jit(cache=True)
def argmax_kernel(x, block_val, block_idx):
    sv = cuda.shared.array(BLOCK, float32)
    si = cuda.shared.array(BLOCK, int32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    sv[t] = x[i] if i < x.size else NEG_INF
    si[t] = i if i < x.size else x.size
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            pass  # TODO: keep the larger of (sv[t], si[t]) and (sv[t+stride], si[t+stride]);
            # on equal values keep the smaller index
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        block_val[cuda.blockIdx.x] = sv[0]
        block_idx[cuda.blockIdx.x] = si[0]


def argmax(x):
    """Exercise 6.4: the maximum of x and the index of its FIRST occurrence.

    x: float32 (n,), n >= 1, finite. Returns (value: float, index: int).
    The kernel reduces (value, index) pairs per block; the host picks among the
    ceil(n / BLOCK) block results.
    """
    raise NotImplementedError("Exercise 6.4: max with index")
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    if x.size == 0:
        raise ValueError("x is empty: it has no maximum")
    blocks = ceil_div(x.size, BLOCK)
    vals = cuda.device_array(blocks, np.float32)
    idxs = cuda.device_array(blocks, np.int32)
    argmax_kernel[blocks, BLOCK](x, vals, idxs)
    v, j = vals.copy_to_host(), idxs.copy_to_host()
    best = int(np.argmax(v))  # first block holding the max: blocks are in index order
    return float(v[best]), int(j[best])


# ---------------------------------------------------------------- 6.5 tiled transpose
@cuda.jit(cache=True)
def transpose_kernel(a, out):
    tile = cuda.shared.array((TILE, TILE_PADDED), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    x = cuda.blockIdx.x * TILE + tx
    y = cuda.blockIdx.y * TILE + ty
    for k in range(0, TILE, ROWS):
        pass  # TODO: if (y + k, x) is inside a, tile[ty + k, tx] = a[y + k, x]
    cuda.syncthreads()
    x = cuda.blockIdx.y * TILE + tx
    y = cuda.blockIdx.x * TILE + ty
    for k in range(0, TILE, ROWS):
        pass  # TODO: if (y + k, x) is inside out, out[y + k, x] = tile[tx, ty + k]


def transpose_tiled(a, out):
    """Exercise 6.5: ``out = a.T`` through a padded TILE x (TILE + 1) shared tile.

    a: float32 (rows, cols). out: float32 (cols, rows). Launch: a grid of
    (ceil(cols / TILE), ceil(rows / TILE)) blocks of (TILE, ROWS) threads; each
    thread moves TILE / ROWS elements. Both global reads and writes coalesced.
    """
    raise NotImplementedError("Exercise 6.5: tiled transpose")
    a = require_device_array(a, "a", ndim=2, dtype=np.float32)
    if tuple(out.shape) != a.shape[::-1]:
        raise ValueError(f"out must have shape (cols, rows) = {a.shape[::-1]}, got {out.shape}")
    grid = (ceil_div(a.shape[1], TILE), ceil_div(a.shape[0], TILE))
    transpose_kernel[grid, (TILE, ROWS)](a, out)


# ---------------------------------------------------------------- 6.6 histogram, global atomics
@cuda.jit(cache=True)
def histogram_global_kernel(x, bins):
    i = cuda.grid(1)
    while i < x.size:
        pass  # TODO: count x[i] in bins -- many threads may hit the same bin at once
        i += cuda.gridsize(1)


def histogram_global(x, bins, blocks=2):
    """Exercise 6.6: ``bins[k] = count of k in x`` with one global atomic per element.

    x: int32 (n,) with values in [0, NBINS). bins: int32 (NBINS,), zeroed here.
    Launch: ``blocks`` blocks of BLOCK threads and a grid-stride loop.
    """
    raise NotImplementedError("Exercise 6.6: histogram with global atomics")
    bins = require_device_array(bins, "bins", ndim=1, dtype=np.int32)
    if bins.size != NBINS:
        raise ValueError(f"bins must have shape ({NBINS},), got {bins.shape}")
    bins.copy_to_device(np.zeros(NBINS, np.int32))
    histogram_global_kernel[blocks, BLOCK](x, bins)


# ---------------------------------------------------------------- 6.7 histogram, privatised
@cuda.jit(cache=True)
def histogram_private_kernel(x, bins):
    h = cuda.shared.array(NBINS, int32)
    t = cuda.threadIdx.x
    pass  # TODO: zero the block's private histogram h, then a barrier
    i = cuda.grid(1)
    while i < x.size:
        pass  # TODO: count x[i] in h (shared memory: still several threads per bin)
        i += cuda.gridsize(1)
    pass  # TODO: a barrier, then merge: threads t < NBINS add h[t] into bins[t]


def histogram_privatised(x, bins, blocks=2):
    """Exercise 6.7: the histogram of 6.6 with a private shared-memory histogram per
    block, merged into ``bins`` with one global atomic per bin per block.

    Same shapes, dtypes and launch as 6.6 (BLOCK >= NBINS).
    Source: Kirk & Hwu, "Programming Massively Parallel Processors", ch. 9.
    """
    raise NotImplementedError("Exercise 6.7: privatised histogram")
    bins = require_device_array(bins, "bins", ndim=1, dtype=np.int32)
    if bins.size != NBINS:
        raise ValueError(f"bins must have shape ({NBINS},), got {bins.shape}")
    bins.copy_to_device(np.zeros(NBINS, np.int32))
    histogram_private_kernel[blocks, BLOCK](x, bins)


# ---------------------------------------------------------------- 6.8 inclusive scan
@cuda.jit(cache=True)
def block_scan_kernel(x, out, sums):
    s = cuda.shared.array(BLOCK, int32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = x[i] if i < x.size else 0
    cuda.syncthreads()
    offset = 1
    while offset < BLOCK:
        pass  # TODO (Hillis-Steele): v = s[t - offset] (0 if t < offset); barrier;
        # s[t] += v; barrier
        offset *= 2
    if i < out.size:
        out[i] = s[t]
    if t == BLOCK - 1:
        sums[cuda.blockIdx.x] = s[t]


@cuda.jit(cache=True)
def add_offsets_kernel(out, scanned_sums):
    i = cuda.grid(1)
    if i < out.size and cuda.blockIdx.x > 0:
        out[i] += scanned_sums[cuda.blockIdx.x - 1]


def scan_inclusive(x, out):
    """Exercise 6.8: ``out[i] = x[0] + ... + x[i]`` (int32), any length n >= 1.

    Fill the block scan (Hillis & Steele 1986); the launcher, written, scans the
    block totals recursively and adds them back (scan-then-propagate).
    """
    raise NotImplementedError("Exercise 6.8: block scan")
    x = require_device_array(x, "x", ndim=1, dtype=np.int32)
    out = require_device_array(out, "out", ndim=1, dtype=np.int32)
    if out.shape != x.shape:
        raise ValueError(f"x and out must have one length, got {x.shape} and {out.shape}")
    blocks = ceil_div(x.size, BLOCK)
    sums = cuda.device_array(blocks, np.int32)
    block_scan_kernel[blocks, BLOCK](x, out, sums)
    if blocks > 1:
        scanned = cuda.device_array(blocks, np.int32)
        scan_inclusive(sums, scanned)
        add_offsets_kernel[blocks, BLOCK](out, scanned)


# ---------------------------------------------------------------- 6.9 1-D stencil with halo
@cuda.jit(cache=True)
def stencil_kernel(x, w, out):
    tile = cuda.shared.array(HALO_BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    tile[t + RADIUS] = x[i] if i < x.size else ZERO
    if t < RADIUS:
        pass  # TODO: load the left halo x[i - RADIUS] into tile[t] and the right halo
        # x[i + BLOCK] into tile[t + BLOCK + RADIUS] (0 outside x)
    pass  # TODO: barrier
    if i < out.size:
        acc = ZERO
        for k in range(2 * RADIUS + 1):
            acc += w[k] * tile[t + k]
        out[i] = acc


def stencil_1d(x, w, out):
    """Exercise 6.9: ``out[i] = sum_k w[k] * x[i + k - RADIUS]``, x = 0 outside [0, n).

    x: float32 (n,). w: float32 (2 RADIUS + 1,). out: float32 (n,). Launch:
    ceil(n / BLOCK) blocks of BLOCK threads; a block loads its slice and a halo of
    RADIUS cells on each side into shared memory once.
    """
    raise NotImplementedError("Exercise 6.9: 1-D stencil with halo")
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    if out.shape != x.shape or w.shape != (2 * RADIUS + 1,):
        raise ValueError(
            f"need x (n,), out (n,), w ({2 * RADIUS + 1},); got {x.shape}, {out.shape}, {w.shape}"
        )
    stencil_kernel[ceil_div(x.size, BLOCK), BLOCK](x, w, out)


# ---------------------------------------------------------------- 6.10 row softmax
@cuda.jit(cache=True)
def softmax_kernel(x, out):
    s = cuda.shared.array(BLOCK, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    cols = x.shape[1]
    m = NEG_INF
    for j in range(t, cols, BLOCK):
        m = max(m, x[r, j])
    pass  # TODO: block max of m through s (tree + barriers); every thread reads s[0];
    # a barrier before s is reused
    acc = ZERO
    for j in range(t, cols, BLOCK):
        acc += math.exp(x[r, j] - m)
    pass  # TODO: block sum of acc through s
    inv = ONE  # TODO: 1 / (the row's sum)
    for j in range(t, cols, BLOCK):
        out[r, j] = math.exp(x[r, j] - m) * inv


def softmax_rows(x, out):
    """Exercise 6.10: softmax of each row, one block of BLOCK threads a row.

    x: float32 (rows, cols), out: the same shape. out[r] = exp(x[r] - max) / sum.
    """
    raise NotImplementedError("Exercise 6.10: row softmax")
    x = require_device_array(x, "x", ndim=2, dtype=np.float32)
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {x.shape}, got {out.shape}")
    softmax_kernel[x.shape[0], BLOCK](x, out)


# ---------------------------------------------------------------- 6.11 single-pass scan
FLAG_NONE, FLAG_AGGREGATE, FLAG_PREFIX = 0, 1, 2


@cuda.jit(cache=True)
def lookback_scan_kernel(x, out, flags, aggregates, prefixes, ticket):
    s = cuda.shared.array(BLOCK, int32)
    state = cuda.shared.array(2, int32)  # [0] tile, [1] exclusive prefix
    t = cuda.threadIdx.x
    if t == 0:
        state[0] = cuda.atomic.add(ticket, 0, 1)
    cuda.syncthreads()
    tile = state[0]
    i = tile * BLOCK + t
    s[t] = x[i] if i < x.size else 0
    offset = 1
    while offset < BLOCK:  # Hillis-Steele over the tile
        cuda.syncthreads()
        v = s[t - offset] if t >= offset else 0
        cuda.syncthreads()
        s[t] += v
        offset *= 2
    cuda.syncthreads()
    if t == 0:
        total = s[BLOCK - 1]
        exclusive = 0
        if tile > 0:
            pass  # TODO publish the aggregate: aggregates[tile] = total; cuda.threadfence();
            # then the flag, with an atomic: cuda.atomic.exch(flags, tile, FLAG_AGGREGATE)
            pass  # TODO look back from j = tile - 1: read flags[j] with an atomic
            # (cuda.atomic.add(flags, j, 0)); FLAG_NONE: read it again; else
            # cuda.threadfence(), then FLAG_PREFIX: add prefixes[j] and stop,
            # FLAG_AGGREGATE: add aggregates[j] and go on with j - 1
        pass  # TODO publish the inclusive prefix: prefixes[tile] = exclusive + total;
        # cuda.threadfence(); cuda.atomic.exch(flags, tile, FLAG_PREFIX)
        state[1] = exclusive
    cuda.syncthreads()
    if i < out.size:
        out[i] = s[t] + state[1]


@cuda.jit(cache=True)
def reset_status_kernel(flags, ticket):
    i = cuda.grid(1)
    if i < flags.size:
        flags[i] = FLAG_NONE
    if i == 0:
        ticket[0] = 0


def scan_lookback(x, out):
    """Exercise 6.11: ``out[i] = x[0] + ... + x[i]`` (int32, wrapping) in ONE launch,
    any length n >= 1: a single-pass scan with decoupled look-back (Merrill &
    Garland 2016; README section 5).

    A block takes tile ``ticket`` (an atomic counter: tiles go out in the order
    blocks start) of BLOCK elements and scans it. Thread 0 then fills the TODOs:
    publish the tile's total as its aggregate (value, ``cuda.threadfence()``,
    flag), walk back over the tiles before it adding aggregates until one has
    published its inclusive prefix, then publish its own inclusive prefix the same
    way. Read flags with an atomic, and fence between reading a flag and its value.
    The launcher, written, zeroes the status and launches one block a tile.

    The checks also run your kernel on one tile whose predecessors are left
    mid-flight (some with only an aggregate), and the race detector reports a
    value published without its fence.
    """
    raise NotImplementedError("Exercise 6.11: decoupled look-back")
    x = require_device_array(x, "x", ndim=1, dtype=np.int32)
    out = require_device_array(out, "out", ndim=1, dtype=np.int32)
    if out.shape != x.shape:
        raise ValueError(f"x and out must have one length, got {x.shape} and {out.shape}")
    tiles = ceil_div(x.size, BLOCK)
    flags = cuda.device_array(tiles, np.int32)
    aggregates = cuda.device_array(tiles, np.int32)
    prefixes = cuda.device_array(tiles, np.int32)
    ticket = cuda.device_array(1, np.int32)
    reset_status_kernel[ceil_div(tiles, BLOCK), BLOCK](flags, ticket)
    lookback_scan_kernel[tiles, BLOCK](x, out, flags, aggregates, prefixes, ticket)
