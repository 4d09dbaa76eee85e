"""Chapter 06 exercises, solved. Same functions as exercises.py; read those first.

Check yours with: python -m pytest tests/test_ch06_memory.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div

import math

import numpy as np
from numba import cuda, float32, int32

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
    cuda.syncthreads()
    if i < out.size:
        out[i] = tile[t + 1] if t + 1 < BLOCK else x[i + 1]


def shift_left(x, out):
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
    s[t] = x[i] if i < x.size else ZERO
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        out[cuda.blockIdx.x] = s[0]


def block_sums(x, out):
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
    while i < a.size:
        acc += a[i] * b[i]
        i += cuda.gridsize(1)
    s[t] = acc
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        cuda.atomic.add(out, 0, s[0])


def dot(a, b, out, blocks=4):
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
            v, j = sv[t + stride], si[t + stride]
            if v > sv[t] or (v == sv[t] and j < si[t]):
                sv[t] = v
                si[t] = j
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        block_val[cuda.blockIdx.x] = sv[0]
        block_idx[cuda.blockIdx.x] = si[0]


def argmax(x):
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
        if y + k < a.shape[0] and x < a.shape[1]:
            tile[ty + k, tx] = a[y + k, x]
    cuda.syncthreads()
    x = cuda.blockIdx.y * TILE + tx
    y = cuda.blockIdx.x * TILE + ty
    for k in range(0, TILE, ROWS):
        if y + k < out.shape[0] and x < out.shape[1]:
            out[y + k, x] = tile[tx, ty + k]


def transpose_tiled(a, out):
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
        cuda.atomic.add(bins, x[i], ONE_I32)
        i += cuda.gridsize(1)


def histogram_global(x, bins, blocks=2):
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
    if t < NBINS:
        h[t] = 0
    cuda.syncthreads()
    i = cuda.grid(1)
    while i < x.size:
        cuda.atomic.add(h, x[i], ONE_I32)
        i += cuda.gridsize(1)
    cuda.syncthreads()
    if t < NBINS:
        cuda.atomic.add(bins, t, h[t])


def histogram_privatised(x, bins, blocks=2):
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
        v = s[t - offset] if t >= offset else 0
        cuda.syncthreads()
        s[t] += v
        cuda.syncthreads()
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
        left = i - RADIUS
        tile[t] = x[left] if 0 <= left < x.size else ZERO
        right = i + BLOCK
        tile[t + BLOCK + RADIUS] = x[right] if right < x.size else ZERO
    cuda.syncthreads()
    if i < out.size:
        acc = ZERO
        for k in range(2 * RADIUS + 1):
            acc += w[k] * tile[t + k]
        out[i] = acc


def stencil_1d(x, w, out):
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
    s[t] = m
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            s[t] = max(s[t], s[t + stride])
        cuda.syncthreads()
        stride //= 2
    m = s[0]
    cuda.syncthreads()
    acc = ZERO
    for j in range(t, cols, BLOCK):
        acc += math.exp(x[r, j] - m)
    s[t] = acc
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    inv = ONE / s[0]
    for j in range(t, cols, BLOCK):
        out[r, j] = math.exp(x[r, j] - m) * inv


def softmax_rows(x, out):
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
            aggregates[tile] = total
            cuda.threadfence()
            cuda.atomic.exch(flags, tile, FLAG_AGGREGATE)
            j = tile - 1
            while j >= 0:
                f = cuda.atomic.add(flags, j, 0)
                if f == FLAG_NONE:
                    continue  # not published yet: read it again
                cuda.threadfence()
                if f == FLAG_PREFIX:
                    exclusive += prefixes[j]
                    break
                exclusive += aggregates[j]
                j -= 1
        prefixes[tile] = exclusive + total
        cuda.threadfence()
        cuda.atomic.exch(flags, tile, FLAG_PREFIX)
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
