"""Chapter 13 exercises, solved (read a function only once you have written yours).

13.1 collective_bandwidth       algbw and busbw of one timed collective, as nccl-tests defines them
13.2 shard_rows                  a rank's rows of a global batch (the capstone's, final_project/distributed.py)
13.3 ring_schedule               which chunk a rank sends and receives at each ring step (ring_allreduce.py's)
13.4 ring_all_reduce_in_process  the whole ring over N device arrays in one process, the add a kernel
13.5 sgd_after_all_reduce        the update after a summed all-reduce: lr / N folded in, in float32
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import require_device_array

import numpy as np
from numba import cuda

from final_project.distributed import shard_rows  # noqa: F401  (Exercise 13.2, the capstone's)

ring = import_sibling(__file__, "ring_allreduce")
ring_schedule = ring.ring_schedule  # Exercise 13.3: the chapter's own
chunk_bounds = ring.chunk_bounds
THREADS = 256

# collective -> (S: the bytes nccl-tests counts, from the per-rank buffer; bus factor from N)
BUS_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


# ---------------------------------------------------------------- 13.1
def collective_bandwidth(collective: str, nbytes: int, seconds: float, world: int):
    """Exercise 13.1: (algbw, busbw) in GB/s (1e9 bytes/s) of one collective call.

    collective: "all-reduce", "all-gather", "reduce-scatter", "broadcast" or
    "reduce"; nbytes: S, the size nccl-tests counts (all-reduce, broadcast,
    reduce: the buffer; all-gather: the gathered output, N x each input;
    reduce-scatter: the input, N x each output); seconds: one call's time;
    world: N ranks. algbw = S / t. busbw = algbw x the collective's bus factor:
    2 (N-1)/N for all-reduce, (N-1)/N for all-gather and reduce-scatter, 1 for
    broadcast and reduce (nccl-tests, doc/PERFORMANCE.md). N = 1 moves nothing
    between GPUs: busbw 0 for the first three.

    Raises:
        ValueError: an unknown collective, nbytes < 0, seconds <= 0 or world < 1.
    """
    if collective not in BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; one of {sorted(BUS_FACTORS)}")
    if nbytes < 0 or not seconds > 0 or world < 1:
        raise ValueError(
            f"need nbytes >= 0, seconds > 0 and world >= 1; got {nbytes}, {seconds}, {world}"
        )
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * BUS_FACTORS[collective](world)


# ---------------------------------------------------------------- 13.4
@cuda.jit(cache=True)
def accumulate(dst, src):
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] += src[i]


def ring_all_reduce_in_process(buffers, schedule=None) -> None:
    """Exercise 13.4: sum N float32 device arrays in place with the ring, in one process.

    buffers: a list of N >= 1 float32 1-D device arrays of the same length n
    (buffer r plays rank r); each ends holding the element-wise sum of all N.
    Follow ``schedule(r, N)`` (your 13.3; default the chapter's ring_schedule)
    step by step: at each step every rank r receives chunk ``recv`` (bounds:
    chunk_bounds(n, N)) from rank r - 1's buffer, which there is what r - 1
    sends at that step. Reduce-scatter: copy it into a scratch device array,
    then add it into buffer r's chunk with ``accumulate`` (one thread an
    element); all-gather: copy it into buffer r's chunk. Ranks may go one after
    another within a step: a rank writes only the chunk it receives, never the
    one it sends.

    Raises:
        TypeError: a buffer that is not a float32 device array.
        ValueError: no buffers, or lengths that differ.
    """
    schedule = schedule or ring_schedule
    if not buffers:
        raise ValueError("need at least one buffer")
    buffers = [
        require_device_array(b, f"buffers[{r}]", 1, np.float32) for r, b in enumerate(buffers)
    ]
    n, world = buffers[0].size, len(buffers)
    if any(b.size != n for b in buffers):
        raise ValueError(f"every buffer must have the same length, got {[b.size for b in buffers]}")
    bounds = chunk_bounds(n, world)
    scratch = cuda.device_array(max(1, ceil_div(n, world)), np.float32)
    plans = [schedule(r, world) for r in range(world)]
    for step in range(2 * (world - 1)):
        for r in range(world):
            phase, _, recv = plans[r][step]
            lo, hi = bounds[recv]
            if hi == lo:
                continue
            incoming = buffers[(r - 1) % world][lo:hi]
            if phase == "reduce-scatter":
                scratch[: hi - lo].copy_to_device(incoming)
                accumulate[ceil_div(hi - lo, THREADS), THREADS](
                    buffers[r][lo:hi], scratch[: hi - lo]
                )
            else:
                buffers[r][lo:hi].copy_to_device(incoming)


# ---------------------------------------------------------------- 13.5
@cuda.jit(cache=True)
def sgd_folded(params, grad_sum, step):
    i = cuda.grid(1)
    if i < params.size:
        params[i] -= step * grad_sum[i]


def sgd_after_all_reduce(params, grad_sum, lr: float, world: int) -> None:
    """Exercise 13.5: ``params -= (lr / world) * grad_sum``, in place, in float32.

    params, grad_sum: float32 1-D device arrays of one length; grad_sum holds
    the all-reduced SUM over ``world`` ranks of each rank's gradient of its
    shard's mean loss, so the global batch's gradient is grad_sum / world. Fold
    the 1/world into the step size on the host, once (np.float32(lr / world)),
    instead of a pass that divides the gradients: one launch, a thread an element.
    A Python float passed to the kernel is float64 there: pass a float32.

    Raises:
        TypeError: not float32 device arrays. ValueError: lengths differ, world < 1,
        lr not a finite number > 0.
    """
    params = require_device_array(params, "params", 1, np.float32)
    grad_sum = require_device_array(grad_sum, "grad_sum", 1, np.float32)
    if params.size != grad_sum.size:
        raise ValueError(f"params has {params.size} elements, grad_sum {grad_sum.size}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not (lr > 0 and np.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr}")
    sgd_folded[ceil_div(params.size, THREADS), THREADS](params, grad_sum, np.float32(lr / world))
