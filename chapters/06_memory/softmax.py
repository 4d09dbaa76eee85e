"""Softmax over the rows of a float32 matrix: out[r, :] = exp(x[r, :] - m) / sum(...).

Versions:
  version 1 (softmax_naive): one thread a row, three passes (max, sum, write).
      Neighbouring threads read addresses a whole row apart: no coalescing.
  version 2 (softmax_block_row): one block a row; each pass is a coalesced
      strided loop over the row plus a shared-memory tree (reduction.py's
      block_reduce_max, then block_reduce_sum).
      3 reads + 1 write of the row (the re-reads mostly hit L2).
  version 3 (softmax_block_row_online): one block a row; the first pass keeps a
      running max m and a sum s rescaled whenever m grows (online softmax), the
      block combines the (m, s) pairs in one tree: 2 reads + 1 write.
  version 4 (softmax_block_row_registers): one block of ROW_THREADS threads a row,
      the row held in registers (ROW_VALUES = 16 values a thread, all loaded before
      any arithmetic), max and sum reduced on-chip in two barrier steps each
      (block_reduce_two_step): 1 read + 1 write, the minimum. Rows longer than ROW_THREADS * ROW_VALUES
      = 4096 fall back to version 3.

Source: M. Milakov and N. Gimelshein, "Online normalizer calculation for
softmax", arXiv:1805.02867 (2018).

Run: python chapters/06_memory/softmax.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick

import functools
import math

import numpy as np
from numba import cuda, float32

reduction = common.import_sibling(__file__, "reduction")
# the shared-memory trees of reduction.py (version 3), for a block of BLOCK threads here
block_reduce_max = reduction.block_reduce_max
block_reduce_sum = reduction.block_reduce_sum

BLOCK = 512  # threads per row; 4 rows in flight per SM keep re-read rows in L2
NAIVE_BLOCK = 128
ROW_THREADS = 256  # version 4: threads a row (512: 85% of copy, 256 or 128: 96%, H200)
ROW_VALUES = 16  # version 4: row values a thread keeps in registers
ROW_WARPS = ROW_THREADS // 32
MAX_REGISTER_COLS = ROW_THREADS * ROW_VALUES
ROW_SHARED = ROW_THREADS + 32  # one value a thread, then one a lane
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
NEG_INF = np.float32(-np.inf)


def softmax_cpu(x: np.ndarray) -> np.ndarray:
    """Row softmax in float64 (the max is subtracted first, so exp never overflows)."""
    z = x.astype(np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# version 1: a thread a row: 3 passes, each an uncoalesced walk along one row
@cuda.jit(cache=True)
def softmax_naive(x, out):
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    cols = x.shape[1]
    m = NEG_INF
    for j in range(cols):
        m = max(m, x[r, j])
    s = ZERO
    for j in range(cols):
        s += math.exp(x[r, j] - m)
    inv = ONE / s
    for j in range(cols):
        out[r, j] = math.exp(x[r, j] - m) * inv


@cuda.jit(device=True)
def write_row(x, out, r, m, inv):
    """out[r, j] = exp(x[r, j] - m) * inv for this thread's columns, 4 loads in flight."""
    cols = x.shape[1]
    j = cuda.threadIdx.x
    while j + 3 * BLOCK < cols:
        v0 = x[r, j]
        v1 = x[r, j + BLOCK]
        v2 = x[r, j + 2 * BLOCK]
        v3 = x[r, j + 3 * BLOCK]
        out[r, j] = math.exp(v0 - m) * inv
        out[r, j + BLOCK] = math.exp(v1 - m) * inv
        out[r, j + 2 * BLOCK] = math.exp(v2 - m) * inv
        out[r, j + 3 * BLOCK] = math.exp(v3 - m) * inv
        j += 4 * BLOCK
    while j < cols:
        out[r, j] = math.exp(x[r, j] - m) * inv
        j += BLOCK


# version 2: a block a row, three coalesced passes, shared-memory trees for max and sum
@cuda.jit  # not cached: calls reduction.py's device functions, whose edits numba's cache does not see
def softmax_block_row(x, out):
    s = cuda.shared.array(BLOCK, float32)
    r = cuda.blockIdx.x
    cols = x.shape[1]
    m = NEG_INF
    for j in range(cuda.threadIdx.x, cols, BLOCK):
        m = max(m, x[r, j])
    m = block_reduce_max(s, m)
    acc = ZERO
    for j in range(cuda.threadIdx.x, cols, BLOCK):
        acc += math.exp(x[r, j] - m)
    total = block_reduce_sum(s, acc)
    write_row(x, out, r, m, ONE / total)


# version 3: online max and sum in one pass (2 reads + 1 write of the row)
@cuda.jit(cache=True)
def softmax_block_row_online(x, out):
    sm = cuda.shared.array(BLOCK, float32)
    ss = cuda.shared.array(BLOCK, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    cols = x.shape[1]
    m = NEG_INF
    s = ZERO
    j = t
    while j + 3 * BLOCK < cols:
        v0 = x[r, j]
        v1 = x[r, j + BLOCK]
        v2 = x[r, j + 2 * BLOCK]
        v3 = x[r, j + 3 * BLOCK]
        m_new = max(max(m, max(v0, v1)), max(v2, v3))
        s = (
            s * math.exp(m - m_new)
            + (math.exp(v0 - m_new) + math.exp(v1 - m_new))
            + (math.exp(v2 - m_new) + math.exp(v3 - m_new))
        )
        m = m_new
        j += 4 * BLOCK
    while j < cols:
        v = x[r, j]
        m_new = max(m, v)
        s = s * math.exp(m - m_new) + math.exp(v - m_new)
        m = m_new
        j += BLOCK
    # combine the threads' (m, s) pairs: s_ab = s_a e^(m_a - m) + s_b e^(m_b - m)
    sm[t] = m
    ss[t] = s
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if t < stride:
            ma = sm[t]
            mb = sm[t + stride]
            mm = max(ma, mb)
            if mm != NEG_INF:  # a thread with no columns holds (-inf, 0)
                ss[t] = ss[t] * math.exp(ma - mm) + ss[t + stride] * math.exp(mb - mm)
            sm[t] = mm
        cuda.syncthreads()
        stride //= 2
    write_row(x, out, r, sm[0], ONE / ss[0])


@cuda.jit(device=True)
def block_reduce_two_step(s, v, is_max):
    """Max (``is_max``) or sum of ``v`` over a ROW_THREADS block, to every thread, in
    two barrier steps: 32 threads each combine ROW_WARPS values, then every thread
    combines those 32 (same address in a warp: a broadcast, no bank conflict).
    Version 4's own tree: 2 barrier steps where reduction.py's binary tree
    (block_reduce_max, block_reduce_sum) takes log2(ROW_THREADS) = 8."""
    t = cuda.threadIdx.x
    s[t] = v
    cuda.syncthreads()
    if t < 32:
        acc = s[t]
        for w in range(1, ROW_WARPS):  # s[t + 32 w]: 32 threads, 32 banks
            acc = max(acc, s[t + 32 * w]) if is_max else acc + s[t + 32 * w]
        s[ROW_THREADS + t] = acc
    cuda.syncthreads()
    acc = s[ROW_THREADS]
    for i in range(1, 32):
        acc = max(acc, s[ROW_THREADS + i]) if is_max else acc + s[ROW_THREADS + i]
    cuda.syncthreads()  # everyone has read s before it is reused
    return acc


# version 4: the row lives in registers between the reductions: 1 read + 1 write of
# the row (8 bytes an element), ROW_VALUES loads in flight per thread, 6 barriers a row
@cuda.jit(cache=True)
def softmax_block_row_registers(x, out):
    s = cuda.shared.array(ROW_SHARED, float32)
    v = cuda.local.array(ROW_VALUES, float32)  # constant indices after unrolling: registers
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x & 1023  # `&`: provably >= 0, no wraparound code on indices
    cols = x.shape[1]
    for k in range(ROW_VALUES):  # all loads first: ROW_VALUES in flight
        j = t + k * ROW_THREADS
        v[k] = x[r, j] if j < cols else NEG_INF
    m = v[0]
    for k in range(1, ROW_VALUES):
        m = max(m, v[k])
    m = block_reduce_two_step(s, m, True)
    acc = ZERO
    for k in range(ROW_VALUES):
        v[k] = math.exp(v[k] - m)  # exp(-inf) = 0 for the padding
        acc += v[k]
    inv = ONE / block_reduce_two_step(s, acc, False)
    for k in range(ROW_VALUES):
        j = t + k * ROW_THREADS
        if j < cols:
            out[r, j] = v[k] * inv


def softmax(kernel, x, out) -> None:
    """Row softmax of ``x`` float32 (rows, cols) into ``out`` of the same shape.

    ``softmax_block_row_registers`` handles rows of up to MAX_REGISTER_COLS = 4096
    columns; longer rows run ``softmax_block_row_online`` instead.

    Raises:
        TypeError: ``x`` or ``out`` not a float32 device array.
        ValueError: not 2-D, or ``out`` has another shape.
    """
    x = require_device_array(x, "x", ndim=2, dtype=np.float32)
    out = require_device_array(out, "out", ndim=2, dtype=np.float32)
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have shape {x.shape}, got {out.shape}")
    if kernel is softmax_block_row_registers and x.shape[1] > MAX_REGISTER_COLS:
        kernel = softmax_block_row_online  # the row does not fit in the block's registers
    if kernel is softmax_naive:
        kernel[ceil_div(x.shape[0], NAIVE_BLOCK), NAIVE_BLOCK](x, out)
    elif kernel is softmax_block_row_registers:
        kernel[x.shape[0], ROW_THREADS](x, out)
    else:
        kernel[x.shape[0], BLOCK](x, out)


def run(shape: tuple[int, int] | None = None) -> list:
    """Check and time every version (default 32768 rows x 4096 cols, 512 MiB, on a
    GPU). ``nbytes`` = 2 * 4 * rows * cols: read the input once, write the output."""
    rows, cols = shape or pick(gpu=(32768, 4096), simulator=(2, 4 * BLOCK + 37))
    x_host = random_array((rows, cols), np.float32, np.random.default_rng(6), -8.0, 8.0)
    x = cuda.to_device(x_host)
    versions = {
        "softmax v1 naive (thread a row)": softmax_naive,
        "softmax v2 block a row, 3 passes": softmax_block_row,
        "softmax v3 block a row, online": softmax_block_row_online,
        "softmax v4 block a row, row in registers": softmax_block_row_registers,
    }
    return run_versions(
        {name: functools.partial(softmax, kernel) for name, kernel in versions.items()},
        (x,),
        reference=softmax_cpu(x_host),
        out_shape=(rows, cols),
        tol=1e-5,
        nbytes=2 * 4 * rows * cols,
        warmup=2,
        repeats=10,
        title=f"softmax {rows} x {cols} float32 ({4 * rows * cols / 2**20:.0f} MiB)",
    )


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "softmax")


if __name__ == "__main__":
    run_script(main)
