# ruff: noqa: F841, B007  (stubs: the TODO lines will use these names)
"""Chapter 13 exercises: the arithmetic and the kernels of data parallelism.

Each exercise is a function whose docstring is the spec: write it, then delete its
``raise NotImplementedError`` line. Check your work with

    python -m pytest tests/test_ch13_exercises.py -q

13.1 collective_bandwidth       algbw and busbw of one timed collective, as nccl-tests defines them
13.2 shard_rows                  a rank's rows of a global batch
13.3 ring_schedule               which chunk a rank sends and receives at each ring step
13.4 ring_all_reduce_in_process  the whole ring over N device arrays in one process, the add a kernel
13.5 sgd_after_all_reduce        the update after a summed all-reduce: lr / N folded in, in float32

Everything runs in one process (no torch.distributed): N ranks are N device
arrays, a message is a device-to-device copy. The tests use N = 1 to 5, lengths
that N does not divide, fresh random data, and check that your 13.3 drives your
13.4 (a ring step off by one sums the wrong chunks). Given, from solutions.py:
``chunk_bounds(n, N)`` (the chunks' (start, stop)) and THREADS.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import require_device_array

import numpy as np
from numba import cuda

solutions = import_sibling(__file__, "solutions")
chunk_bounds = solutions.chunk_bounds  # chunk_bounds(n, N) -> [(start, stop)] of N chunks
THREADS = solutions.THREADS


# ---------------------------------------------------------------- 13.1
def collective_bandwidth(collective: str, nbytes: int, seconds: float, world: int):
    """Exercise 13.1: (algbw, busbw) in GB/s (1e9 bytes/s) of one collective call.

    collective: "all-reduce", "all-gather", "reduce-scatter", "broadcast" or
    "reduce"; nbytes: S, the size nccl-tests counts (all-reduce, broadcast,
    reduce: the buffer; all-gather: the gathered output, N x each input;
    reduce-scatter: the input, N x each output); seconds: one call's time;
    world: N ranks. algbw = S / t. busbw = algbw x the collective's bus factor,
    the fraction of S that crosses each GPU's link in the ring algorithm:
    2 (N-1)/N for all-reduce (a reduce-scatter, then an all-gather), (N-1)/N for
    all-gather and reduce-scatter, 1 for broadcast and reduce (nccl-tests,
    doc/PERFORMANCE.md). N = 1 moves nothing between GPUs: busbw 0 for the first
    three (their factors are 0 there). Check the arguments before any arithmetic.
    Example: all-reduce of 1 GiB in 6.5 ms on 2 GPUs: algbw 165, busbw 165 GB/s.

    Raises:
        ValueError: an unknown collective, nbytes < 0, seconds <= 0 or world < 1.
    """
    raise NotImplementedError("Exercise 13.1: collective_bandwidth")


# ---------------------------------------------------------------- 13.2
def shard_rows(batch: int, rank: int, world: int) -> slice:
    """Exercise 13.2: rank ``rank``'s rows of a global batch of ``batch`` images.

    ``slice(rank * s, (rank + 1) * s)`` with s = batch / world: contiguous shards
    in rank order, so the N shards concatenated are the global batch, each row
    in exactly one shard, every shard the same size (each rank's loss is the
    mean over its shard, and the mean of N equal-sized means is the global
    batch's mean).

    Raises:
        ValueError: world < 1; world does not divide batch (the message says to
            choose a batch size world divides); rank outside 0..world-1.
    """
    raise NotImplementedError("Exercise 13.2: shard_rows")


# ---------------------------------------------------------------- 13.3
def ring_schedule(rank: int, world: int) -> list[tuple[str, int, int]]:
    """Exercise 13.3: the 2 (N-1) steps of ``rank``'s ring all-reduce.

    Each step is (phase, chunk sent to rank + 1, chunk received from rank - 1),
    phase "reduce-scatter" for the first N-1 steps and "all-gather" for the
    last N-1. Reduce-scatter: at step s send chunk (r - s) mod N (your own at
    s = 0, after that the one you just added into) and receive (r - s - 1) mod N,
    which you add in; after N-1 steps chunk (r + 1) mod N holds every rank's
    share. All-gather: pass the finished chunks on: send (r + 1 - s) mod N,
    receive (r - s) mod N. What rank r receives at a step is what rank r - 1
    sends. N = 2, rank 0: [("reduce-scatter", 0, 1), ("all-gather", 1, 0)].
    """
    raise NotImplementedError("Exercise 13.3: ring_schedule")


# ---------------------------------------------------------------- 13.4
@cuda.jit(cache=True)
def accumulate(dst, src):
    i = cuda.grid(1)
    pass  # TODO: inside dst, dst[i] += src[i]


def ring_all_reduce_in_process(buffers, schedule=None) -> None:
    """Exercise 13.4: sum N float32 device arrays in place with the ring, in one process.

    buffers: a list of N >= 1 float32 1-D device arrays of the same length n
    (buffer r plays rank r); each ends holding the element-wise sum of all N.
    Follow ``schedule(r, N)`` (default: your ring_schedule) step by step: at
    each step every rank r receives chunk ``recv`` (bounds: chunk_bounds(n, N))
    from rank r - 1's buffer, which there is what r - 1 sends at that step.
    Reduce-scatter: copy it into a scratch device array
    (``scratch[:m].copy_to_device(incoming)``), then add it into buffer r's
    chunk with ``accumulate`` (one thread an element); all-gather: copy it into
    buffer r's chunk. Ranks may go one after another within a step: a rank
    writes only the chunk it receives, never the one it sends. Skip empty chunks
    (n < N).

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
    raise NotImplementedError("Exercise 13.4: the steps, then delete this line")
    for step in range(2 * (world - 1)):
        for r in range(world):
            pass  # TODO: this rank's (phase, recv) at this step; receive, and add or copy


# ---------------------------------------------------------------- 13.5
@cuda.jit(cache=True)
def sgd_folded(params, grad_sum, step):
    i = cuda.grid(1)
    pass  # TODO: inside params, params[i] -= step * grad_sum[i]


def sgd_after_all_reduce(params, grad_sum, lr: float, world: int) -> None:
    """Exercise 13.5: ``params -= (lr / world) * grad_sum``, in place, in float32.

    params, grad_sum: float32 1-D device arrays of one length; grad_sum holds
    the all-reduced SUM over ``world`` ranks of each rank's gradient of its
    shard's mean loss, so the global batch's gradient is grad_sum / world. Fold
    the 1/world into the step size on the host, once, instead of a pass that
    divides the gradients: one launch of ``sgd_folded``, a thread an element.
    A Python float passed to a kernel is float64 there: pass np.float32(...).

    Raises:
        TypeError: not float32 device arrays. ValueError: lengths differ, world < 1,
        lr not a finite number > 0.
    """
    params = require_device_array(params, "params", 1, np.float32)
    grad_sum = require_device_array(grad_sum, "grad_sum", 1, np.float32)
    if params.size != grad_sum.size:
        raise ValueError(f"params has {params.size} elements, grad_sum {grad_sum.size}")
    raise NotImplementedError("Exercise 13.5: the checks of world and lr, and the launch")
