"""Reduction: the sum (and the max) of a float32 vector.

Versions (sum; BLOCK = 256 threads per block):
  version 1 (reduce_sum_atomic): one atomic add per element, all on one address:
      the additions serialise.
  version 2 (reduce_sum_tree_interleaved): a tree in shared memory, interleaved
      addressing (t % (2 * stride) == 0): half the threads of every warp idle.
      Each block writes a partial sum; the launcher re-runs it on the partials.
  version 3 (reduce_sum_tree_sequential): sequential addressing (t < stride):
      the active threads are contiguous, whole warps retire. This tree is the
      device function block_reduce_sum (block_reduce_max for the max), which
      every later version, and softmax.py, calls.
  version 4 (reduce_sum_first_add): each thread adds two elements while loading:
      half the blocks, no thread idle at the first step.
  version 5 (reduce_sum_grid_stride_atomic): a grid-stride loop with 4 independent
      register accumulators per thread (4 loads in flight), one tree per block,
      one atomic per block. Fast; the order of the atomics varies: not deterministic.
  version 6 (reduce_sum_two_pass_last_block): version 5, but each block writes its
      partial and the last block to finish (an atomic ticket) adds the partials
      in a fixed order: deterministic, one launch.
  max (reduce_max_grid_stride_atomic): version 5's structure with cuda.atomic.max.

Source: M. Harris, "Optimizing Parallel Reduction in CUDA" (NVIDIA, 2007);
the last-block pattern is the CUDA sample threadFenceReduction.

Run: python chapters/06_memory/reduction.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick
from common.timing import format_table

import functools

import numpy as np
from numba import cuda, float32, int32

launch = common.import_sibling(__file__, "launch")

BLOCK = 256  # threads per block; a power of two, so the tree halves evenly
ZERO = np.float32(0.0)
NEG_INF = np.float32(-np.inf)


def reduce_sum_cpu(x: np.ndarray) -> np.ndarray:
    """sum(x) in float64, shape (1,)."""
    return np.array([x.astype(np.float64).sum()])


# version 1: one atomic per element on one address: n serialised read-modify-writes
@cuda.jit(cache=True)
def reduce_sum_atomic(x, out):
    i = cuda.grid(1)
    if i < x.size:
        cuda.atomic.add(out, 0, x[i])


# version 2: shared-memory tree, interleaved addressing: log2(BLOCK) steps, a barrier
# each; the modulo leaves active threads scattered across warps (divergence)
@cuda.jit(cache=True)
def reduce_sum_tree_interleaved(x, partial):
    s = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = x[i] if i < x.size else ZERO
    cuda.syncthreads()
    stride = 1
    while stride < BLOCK:
        if t % (2 * stride) == 0:
            s[t] += s[t + stride]
        cuda.syncthreads()  # step k + 1 reads what step k wrote
        stride *= 2
    if t == 0:
        partial[cuda.blockIdx.x] = s[0]


# version 3's tree, sequential addressing: threads 0..stride-1 work, the other warps
# retire. A device function, so every later kernel (and softmax.py) reuses it.
@cuda.jit(device=True)
def block_reduce_sum(s, v):
    """Sum of ``v`` over a block of ``s.size`` threads (a power of two), returned to
    every thread, through the float32 shared array ``s`` (one slot a thread).
    Every thread of the block must call it; it ends with a barrier, so ``s`` can
    be reused at once."""
    t = cuda.threadIdx.x
    s[t] = v
    cuda.syncthreads()
    stride = s.size // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()  # step k + 1 reads what step k wrote
        stride //= 2
    total = s[0]
    cuda.syncthreads()  # everyone has read s[0] before anyone writes s again
    return total


@cuda.jit(device=True)
def block_reduce_max(s, v):
    """Max of ``v`` over a block of ``s.size`` threads: :func:`block_reduce_sum`'s
    tree with ``max`` for ``+``; same contract."""
    t = cuda.threadIdx.x
    s[t] = v
    cuda.syncthreads()
    stride = s.size // 2
    while stride > 0:
        if t < stride:
            s[t] = max(s[t], s[t + stride])
        cuda.syncthreads()
        stride //= 2
    total = s[0]
    cuda.syncthreads()
    return total


# version 3: version 2 with sequential addressing (block_reduce_sum): whole warps retire
@cuda.jit(cache=True)
def reduce_sum_tree_sequential(x, partial):
    s = cuda.shared.array(BLOCK, float32)
    i = cuda.grid(1)
    total = block_reduce_sum(s, x[i] if i < x.size else ZERO)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


# version 4: first add during load: a block covers 2 * BLOCK elements
@cuda.jit(cache=True)
def reduce_sum_first_add(x, partial):
    s = cuda.shared.array(BLOCK, float32)
    i = cuda.blockIdx.x * (2 * BLOCK) + cuda.threadIdx.x
    v = x[i] if i < x.size else ZERO
    if i + BLOCK < x.size:
        v += x[i + BLOCK]
    total = block_reduce_sum(s, v)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit(device=True)
def thread_sum(x):
    """This thread's grid-stride share of sum(x): 4 independent accumulators keep 4
    coalesced loads in flight per thread (bandwidth needs bytes in flight)."""
    n = x.size
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    a0 = ZERO
    a1 = ZERO
    a2 = ZERO
    a3 = ZERO
    while i + 3 * stride < n:
        a0 += x[i]
        a1 += x[i + stride]
        a2 += x[i + 2 * stride]
        a3 += x[i + 3 * stride]
        i += 4 * stride
    while i < n:
        a0 += x[i]
        i += stride
    return (a0 + a1) + (a2 + a3)


# version 5: many elements per thread in registers, one tree per block, one atomic
# per block: n loads, grid-size atomics
@cuda.jit(cache=True)
def reduce_sum_grid_stride_atomic(x, out):
    s = cuda.shared.array(BLOCK, float32)
    total = block_reduce_sum(s, thread_sum(x))
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(out, 0, total)


# version 6: like version 5, but partials are summed in block order by the last block
# to finish: same bytes, one launch, the same bits every run
@cuda.jit(cache=True)
def reduce_sum_two_pass_last_block(x, partial, counter, out):
    s = cuda.shared.array(BLOCK, float32)
    last = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    total = block_reduce_sum(s, thread_sum(x))
    if t == 0:
        partial[cuda.blockIdx.x] = total
        cuda.threadfence()  # the partial is visible to all blocks before the ticket
        ticket = cuda.atomic.add(counter, 0, 1)
        last[0] = 1 if ticket == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0]:
        acc = ZERO
        for j in range(t, cuda.gridDim.x, BLOCK):  # fixed order: deterministic
            acc += partial[j]
        total = block_reduce_sum(s, acc)  # s is free: the first tree ended with a barrier
        if t == 0:
            out[0] = total
            counter[0] = 0  # ready for the next launch


# max: version 5's structure; the atomic is cuda.atomic.max
@cuda.jit(cache=True)
def reduce_max_grid_stride_atomic(x, out):
    s = cuda.shared.array(BLOCK, float32)
    n = x.size
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    m0 = NEG_INF
    m1 = NEG_INF
    while i + stride < n:
        m0 = max(m0, x[i])
        m1 = max(m1, x[i + stride])
        i += 2 * stride
    if i < n:
        m0 = max(m0, x[i])
    m = block_reduce_max(s, max(m0, m1))
    if cuda.threadIdx.x == 0:
        cuda.atomic.max(out, 0, m)


@cuda.jit(cache=True)
def fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


def _vector_and_scalar(x, out):
    """``x`` float32 (n,), n >= 1, and ``out`` float32 (1,) as device arrays.

    Raises:
        TypeError: not device arrays, or not float32.
        ValueError: not 1-D, ``x`` empty, or ``out`` not of one element.
    """
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    if x.size == 0:
        raise ValueError("the reduction of an empty array is undefined here")
    if out.size != 1:
        raise ValueError(f"out must have shape (1,), got {out.shape}")
    return x, out


def reduce_atomic(x, out) -> None:
    """Version 1 launcher: ``x`` float32 (n,) -> ``out`` float32 (1,); the errors of
    :func:`_vector_and_scalar` (every launcher here)."""
    x, out = _vector_and_scalar(x, out)
    fill[1, 32](out, ZERO)
    reduce_sum_atomic[ceil_div(x.size, BLOCK), BLOCK](x, out)


def reduce_multipass(kernel, x, out) -> None:
    """Versions 2-4: launch ``kernel`` on x, then on its partial sums, until one is left."""
    x, out = _vector_and_scalar(x, out)
    per_block = 2 * BLOCK if kernel is reduce_sum_first_add else BLOCK
    cur = x
    level = 0
    while True:
        blocks = ceil_div(cur.size, per_block)
        dst = out if blocks == 1 else launch.scratch(blocks, np.float32, f"reduce{level}")
        kernel[blocks, BLOCK](cur, dst)
        if blocks == 1:
            return
        cur = dst
        level += 1


def reduce_grid_stride_atomic(x, out) -> None:
    """Version 5 launcher (two launches: zero ``out``, then reduce)."""
    x, out = _vector_and_scalar(x, out)
    fill[1, 32](out, ZERO)
    blocks = launch.grid_stride_blocks(x.size, BLOCK)
    reduce_sum_grid_stride_atomic[blocks, BLOCK](x, out)


def reduce_two_pass(x, out) -> None:
    """Version 6 launcher: one launch, deterministic."""
    x, out = _vector_and_scalar(x, out)
    blocks = launch.grid_stride_blocks(x.size, BLOCK)
    partial = launch.scratch(blocks, np.float32, "two-pass")
    counter = launch.zeroed_counter("reduce two-pass")
    reduce_sum_two_pass_last_block[blocks, BLOCK](x, partial, counter, out)


def reduce_max(x, out) -> None:
    """max(x) into ``out`` (1,) float32 (two launches: fill with -inf, reduce)."""
    x, out = _vector_and_scalar(x, out)
    fill[1, 32](out, NEG_INF)
    blocks = launch.grid_stride_blocks(x.size, BLOCK, per_thread=2)
    reduce_max_grid_stride_atomic[blocks, BLOCK](x, out)


SUM_VERSIONS = {
    "reduce v1 atomic per element": reduce_atomic,
    "reduce v2 tree interleaved": functools.partial(reduce_multipass, reduce_sum_tree_interleaved),
    "reduce v3 tree sequential": functools.partial(reduce_multipass, reduce_sum_tree_sequential),
    "reduce v4 first add during load": functools.partial(reduce_multipass, reduce_sum_first_add),
    "reduce v5 grid-stride, atomic/block": reduce_grid_stride_atomic,
    "reduce v6 two-pass, last block": reduce_two_pass,
}


def determinism_demo(n: int, runs: int = 5) -> dict:
    """Sum the same uniform [0, 1) float32 data ``runs`` times with versions 5 and 6;
    return how many distinct results each gave (float addition is not associative,
    so a varying atomic order can change the last bits)."""
    x = cuda.to_device(np.random.default_rng(3).random(n, dtype=np.float32))
    distinct = {}
    for name, fn in [
        ("v5 atomic/block", reduce_grid_stride_atomic),
        ("v6 two-pass", reduce_two_pass),
    ]:
        seen = set()
        for _ in range(runs):
            out = cuda.device_array(1, np.float32)
            fn(x, out)
            seen.add(out.copy_to_host()[0].item())
        distinct[name] = len(seen)
    return distinct


def run(n: int | None = None) -> list:
    """Check and time every version on n float32 values (default 2**28 = 1 GiB on a
    GPU). The data are whole numbers in [-8, 8], so every summation order is exact
    and all versions must match the float64 sum exactly."""
    n = n or pick(gpu=1 << 28, simulator=BLOCK + 7)
    rng = np.random.default_rng(4)
    x_host = rng.integers(-8, 9, n, dtype=np.int8).astype(np.float32)
    x_host[rng.integers(n)] = 9.0  # a unique maximum somewhere: max must see every element
    x = cuda.to_device(x_host)
    title = f"reduction of {n} float32 ({4 * n / 2**20:.0f} MiB)"
    # Both tables: one output value, exact (whole numbers), the same timing settings.
    settings = dict(out_shape=1, tol=0.0, nbytes=4 * n, print_table=False, warmup=2, repeats=10)
    results = run_versions(SUM_VERSIONS, (x,), reference=reduce_sum_cpu(x_host), **settings)
    results += run_versions(
        {"reduce max grid-stride, atomic/block": reduce_max},
        (x,),
        reference=np.array([9.0]),
        **settings,
    )
    print(format_table(results, title=title))
    demo = determinism_demo(pick(gpu=1 << 24, simulator=BLOCK + 5), runs=pick(gpu=5, simulator=2))
    print(f"distinct results over repeated runs on random floats: {demo}")
    for r in results:
        r.extra["distinct_results"] = demo.get(
            {
                "reduce v5 grid-stride, atomic/block": "v5 atomic/block",
                "reduce v6 two-pass, last block": "v6 two-pass",
            }.get(r.name, "")
        )
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "reduction")


if __name__ == "__main__":
    run_script(main)
