"""Shared memory and cuda.syncthreads: shift-left-by-one, out[i] = x[i + 1].

Versions:
  version 1 (shift_left_global): every thread reads x[i + 1] from global memory.
  version 2 (shift_left_smem_no_barrier): stage the block's slice in shared memory,
      then read the neighbour's slot -- WITHOUT a barrier: a race, wrong results.
  version 3 (shift_left_smem): the same with cuda.syncthreads() between the
      writes and the reads: right.

Run: python chapters/06_memory/shared_memory.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import RaceError, intentional_race
from common.checking import poisoned, random_array, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, interleaved_threads, is_simulator, pick

import functools

import numpy as np
from numba import cuda, float32

BLOCK = 128  # threads per block; the shared tile holds one element per thread


def shift_left_cpu(x: np.ndarray) -> np.ndarray:
    """out[i] = x[i + 1] for i < len(x) - 1, in float64."""
    return x[1:].astype(np.float64)


# version 1: one global read per output; neighbours' reads overlap, the cache absorbs it
@cuda.jit(cache=True)
def shift_left_global(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i + 1]


# version 2: BROKEN on purpose -- thread t reads tile[t + 1] before thread t + 1 may
# have written it; nothing orders the two threads
@cuda.jit(cache=True)
def shift_left_smem_no_barrier(x, out):
    tile = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        tile[t] = x[i]
    if i < out.size:
        if t + 1 < BLOCK:
            out[i] = tile[t + 1]
        else:
            out[i] = x[i + 1]  # the last thread's neighbour lives in the next block


# version 3: the barrier makes every write to the tile visible before any read
@cuda.jit(cache=True)
def shift_left_smem(x, out):
    tile = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        tile[t] = x[i]
    cuda.syncthreads()  # every thread of the block waits here until all arrive
    if i < out.size:
        if t + 1 < BLOCK:
            out[i] = tile[t + 1]
        else:
            out[i] = x[i + 1]


def shift_left(kernel, x, out) -> None:
    """Launch a shift-left kernel: ``x`` float32 (n,), ``out`` float32 (n - 1,).

    Raises:
        TypeError: ``x`` or ``out`` not a float32 device array.
        ValueError: not 1-D, or ``out`` is not one shorter than ``x``.
    """
    x = require_device_array(x, "x", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    if out.size != x.size - 1:
        raise ValueError(f"out must have x.size - 1 = {x.size - 1} elements, got {out.size}")
    kernel[ceil_div(x.size, BLOCK), BLOCK](x, out)


def shared_memory_sizes() -> dict:
    """Shared memory per block and per SM in bytes (GPU), from the device attributes."""
    if is_simulator():
        return {"per_block": 48 * 1024, "per_sm": None, "note": "simulator: course limit"}
    dev = cuda.get_current_device()
    return {
        "per_block": getattr(dev, "MAX_SHARED_MEMORY_PER_BLOCK", None),
        "per_block_optin": getattr(dev, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", None),
        "per_sm": getattr(dev, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", None),
    }


def race_demo(n: int | None = None, trials: int = 5) -> list[int]:
    """Run version 2 (no barrier) ``trials`` times on fresh data.

    Returns the number of wrong outputs in each run (a list of ``trials`` ints;
    a run went wrong where it is > 0).

    Where the race can show: the 32 threads of a warp execute in step, so a thread
    reading its neighbour's slot in the SAME warp gets the stored value. Only the
    last thread of each warp reads a slot written by ANOTHER warp (thread 31 reads
    slot 32), and that read is stale only if the other warp is behind, e.g. its
    global load came back later. With ``BLOCK`` = 128 (4 warps) there are 3 such
    reads per block, so a GPU needs many blocks in flight, whose loads return at
    different times, to show it: the default n is 2**22 on a GPU (32768 blocks),
    a few blocks in the simulator (which interleaves threads, so any read can be
    early).
    """
    n = n or pick(gpu=1 << 22, simulator=2 * BLOCK + 3)
    rng = np.random.default_rng(0)
    wrong = []
    for _ in range(trials):
        x_host = random_array(n, np.float32, rng)
        out = poisoned(n - 1)
        with interleaved_threads(), intentional_race("version 2 is this script's race demo"):
            shift_left(shift_left_smem_no_barrier, cuda.to_device(x_host), out)
        wrong.append(int(np.count_nonzero(out.copy_to_host() != x_host[1:])))
    return wrong


def race_report() -> str:
    """The simulator race detector's report on version 2 (common/racecheck.py)."""
    x = cuda.to_device(random_array(BLOCK + 1, np.float32, np.random.default_rng(2)))
    try:
        shift_left(shift_left_smem_no_barrier, x, poisoned(BLOCK))
    except RaceError as e:
        return str(e)
    raise AssertionError("the race detector missed version 2's missing barrier")


def run(n: int | None = None) -> list:
    """Check and time versions 1 and 3; show version 2 going wrong. Returns Timings."""
    n = n or pick(gpu=1 << 26, simulator=3 * BLOCK + 7)
    sizes = shared_memory_sizes()
    print(f"shared memory: {sizes}")
    x_host = random_array(n, np.float32, np.random.default_rng(1))
    x = cuda.to_device(x_host)
    results = run_versions(
        {
            "shift-left global": functools.partial(shift_left, shift_left_global),
            "shift-left smem + syncthreads": functools.partial(shift_left, shift_left_smem),
        },
        (x,),
        reference=shift_left_cpu(x_host),
        out_shape=n - 1,
        tol=0.0,
        nbytes=2 * 4 * (n - 1),
        title=f"shift left by one, n = {n}",
    )
    if is_simulator():
        print(f"version 2 in the simulator's race detector:\n  {race_report()}")
    trials = 5
    wrong = race_demo(trials=trials)
    runs_wrong = sum(w > 0 for w in wrong)
    print(
        f"shift-left smem WITHOUT syncthreads ({common.runtime_name()}, "
        f"{BLOCK}-thread blocks): wrong in {runs_wrong} of {trials} runs; "
        f"wrong outputs per run: {wrong}"
    )
    if runs_wrong == 0:
        print(
            "  (no run went wrong this time, yet the race is still there: it shows only "
            "when one warp reads a slot before another warp has written it)"
        )
    return results


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "shared_memory")


if __name__ == "__main__":
    run_script(main)
