"""Many dependent steps: one launch a step, or one launch for all of them.

Jacobi relaxation of a rod with fixed ends, float32, S sweeps:
    x_{k+1}[i] = 0.5 x_k[i] + 0.25 (x_k[i-1] + x_k[i+1]),   x[0] and x[n-1] fixed
Sweep k + 1 reads what other threads wrote in sweep k, so between two sweeps every
thread of the grid must wait for every other: a grid-wide barrier. CUDA C++ could
move the loop over sweeps onto the GPU with dynamic parallelism (a parent kernel
launching a child grid a sweep); numba-cuda cannot launch a kernel from a kernel.
What replaces it:

version 0 is NumPy (CPU): S vectorized sweeps; in float64, the reference
version 1 is jacobi_sweep launched S times from Python: the end of a launch is the barrier
version 2 is jacobi_sweeps_one_block: one launch of one block that loops over the sweeps;
          cuda.syncthreads() is the barrier, and one SM does all the work
version 3 is jacobi_sweeps_grid_sync: one cooperative launch of a persistent grid (only as
          many blocks as fit on the GPU at once) that grid-strides over the rod each sweep;
          cuda.cg.this_grid().sync() is the barrier

A sweep reads and writes n float32 (8 n bytes; the neighbours come from cache). Two
sizes: a short rod of many sweeps (each sweep is a few microseconds of work, so a
launch a sweep pays mostly for launches) and a long rod (each sweep streams 128 MiB).

Run: python chapters/05_first_kernels/grid_sync.py [--out runs/05_first_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, pick
from common.checking import check, require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import cpu_ms, device_peaks, format_table, readme_figures

from functools import partial

import numpy as np
from numba import cuda
from numba.cuda import float32, int64

HALF, QUARTER = np.float32(0.5), np.float32(0.25)

# ---------------------------------------------------------------- CPU reference


def jacobi_cpu(x, sweeps):
    """``sweeps`` Jacobi sweeps of ``x`` (1-D, any float dtype; computed in its dtype),
    ends fixed: the spec every kernel below must reproduce."""
    x = x.copy()
    for _ in range(sweeps):
        x[1:-1] = HALF * x[1:-1] + QUARTER * (x[:-2] + x[2:])  # right side built before the write
    return x


# ---------------------------------------------------------------- kernels


# One point of one sweep; the ends are copied, so a buffer a sweep writes is complete.
@cuda.jit(device=True)
def jacobi_point(src, dst, i):
    if i == 0 or i == dst.size - 1:
        dst[i] = src[i]
    else:
        dst[i] = HALF * src[i] + QUARTER * (src[i - 1] + src[i + 1])


# Sweep k of S reads the buffer sweep k - 1 wrote and writes the other one: x0 is only
# read, and the buffers alternate so that the last sweep writes `out`.
@cuda.jit(device=True)
def sweep_buffers(x0, tmp, out, k, sweeps):
    dst = out if (sweeps - 1 - k) % 2 == 0 else tmp
    src = out if (sweeps - k) % 2 == 0 else tmp
    if k == 0:
        src = x0
    return src, dst


# version 1: one sweep a launch, a thread a point; the host loops over the sweeps.
@cuda.jit(cache=True)
def jacobi_sweep(src, dst):
    i = cuda.grid(1)
    if i < dst.size:
        jacobi_point(src, dst, i)


# version 2: one block does every sweep, each thread a point every blockDim.x;
# a block barrier between sweeps is cheap, but one SM of the GPU works.
@cuda.jit(cache=True)
def jacobi_sweeps_one_block(x0, tmp, out, sweeps):
    for k in range(sweeps):
        src, dst = sweep_buffers(x0, tmp, out, k, sweeps)
        for i in range(cuda.threadIdx.x, dst.size, cuda.blockDim.x):
            jacobi_point(src, dst, i)
        cuda.syncthreads()


# version 3: a persistent grid does every sweep, each thread a point every gridsize;
# grid.sync() waits for every thread of the grid. numba-cuda sees this_grid() and
# launches the kernel cooperatively, which needs every block resident at once.
# Compiled for one signature up front (contiguous float32 arrays; sweeps int64, the
# type of a Python int), so that the launcher can ask the compiled kernel how many
# blocks fit (max_cooperative_grid_blocks) before its first launch.
GRID_SYNC_SIGNATURE = (float32[::1], float32[::1], float32[::1], int64)


@cuda.jit(GRID_SYNC_SIGNATURE, cache=True)
def jacobi_sweeps_grid_sync(x0, tmp, out, sweeps):
    grid = cuda.cg.this_grid()
    for k in range(sweeps):
        src, dst = sweep_buffers(x0, tmp, out, k, sweeps)
        for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
            jacobi_point(src, dst, i)
        grid.sync()


# ---------------------------------------------------------------- launchers


def _checked(x0, tmp, out, sweeps):
    x0 = require_device_array(x0, "x0", ndim=1, dtype=np.float32)
    tmp = require_device_array(tmp, "tmp", ndim=1, dtype=np.float32)
    out = require_device_array(out, "out", ndim=1, dtype=np.float32)
    if not x0.shape == tmp.shape == out.shape:
        raise ValueError(
            f"x0, tmp, out must have one shape, got {x0.shape}, {tmp.shape}, {out.shape}"
        )
    if sweeps < 1:
        raise ValueError(f"sweeps must be >= 1, got {sweeps}")
    return x0, tmp, out


def relax_launches(x0, tmp, sweeps, out, threads_per_block=256):
    """Version 1: ``sweeps`` launches of :func:`jacobi_sweep`, ceil_div(n,
    threads_per_block) blocks each.

    Args:
        x0: float32 device array (n,), the rod before the first sweep (only read).
        tmp: float32 device array (n,), scratch (overwritten).
        sweeps: number of sweeps, >= 1.
        out: float32 device array (n,), the rod after the last sweep.

    Raises:
        TypeError / ValueError: host arrays, wrong dtype or rank, shapes that
            differ, or sweeps < 1.
    """
    x0, tmp, out = _checked(x0, tmp, out, sweeps)
    blocks = ceil_div(out.size, threads_per_block)
    src = x0
    for k in range(sweeps):
        dst = out if (sweeps - 1 - k) % 2 == 0 else tmp
        jacobi_sweep[blocks, threads_per_block](src, dst)
        src = dst


def relax_one_block(x0, tmp, sweeps, out, threads_per_block=1024):
    """Version 2: one launch of :func:`jacobi_sweeps_one_block` on one block.
    Arguments and errors as :func:`relax_launches`."""
    x0, tmp, out = _checked(x0, tmp, out, sweeps)
    jacobi_sweeps_one_block[1, threads_per_block](x0, tmp, out, sweeps)


def cooperative_blocks(threads_per_block):
    """The most blocks of ``threads_per_block`` threads that :func:`jacobi_sweeps_grid_sync`
    can have resident on this GPU at once (blocks an SM x SMs; 1 in the simulator,
    which runs one block at a time). A cooperative launch of more blocks fails:
    the blocks that do not fit would wait for a grid barrier that the resident
    ones cannot pass. (numba-cuda, "Cooperative Groups".)"""
    overload = jacobi_sweeps_grid_sync.overloads[GRID_SYNC_SIGNATURE]
    return overload.max_cooperative_grid_blocks(threads_per_block)


def relax_grid_sync(x0, tmp, sweeps, out, threads_per_block=256):
    """Version 3: one cooperative launch of :func:`jacobi_sweeps_grid_sync` on
    min(:func:`cooperative_blocks`, ceil_div(n, threads_per_block)) blocks.
    Arguments and errors as :func:`relax_launches`."""
    x0, tmp, out = _checked(x0, tmp, out, sweeps)
    blocks = min(cooperative_blocks(threads_per_block), ceil_div(out.size, threads_per_block))
    jacobi_sweeps_grid_sync[blocks, threads_per_block](x0, tmp, out, sweeps)


VERSIONS = {
    "1 a launch a sweep": relax_launches,
    "2 one block, syncthreads": relax_one_block,
    "3 persistent grid, grid.sync": relax_grid_sync,
}


def run(n, sweeps, rng):
    """Check every version against the float64 reference at (n, sweeps), then time it.

    Returns (CPU NumPy ms in float32, Timings); a Timing's ``nbytes`` is 8 n sweeps.
    """
    x_host = rng.uniform(0.0, 1.0, n).astype(np.float32)
    reference = jacobi_cpu(x_host.astype(np.float64), sweeps)
    np_ms = cpu_ms(partial(jacobi_cpu, x_host, sweeps), repeats=1)
    check(jacobi_cpu(x_host, sweeps), reference, tol=1e-5, name="numpy float32")
    results = run_versions(
        VERSIONS,
        (cuda.to_device(x_host), cuda.device_array(n, np.float32), sweeps),
        reference,
        n,
        np.float32,
        tol=1e-5,
        nbytes=8 * n * sweeps,
        warmup=2,
        repeats=10,
        print_table=False,
    )
    for r in results:
        r.extra.update(n=n, sweeps=sweeps)
    return np_ms, results


def table_rows(n, sweeps, np_ms, timed):
    """Rows of the GPU table for one size: NumPy, then each version."""
    rows = [["0 NumPy (CPU, float32)", f"{n:,}", sweeps, f"{np_ms:.3f}", "-", "-", "-"]]
    for r in timed:
        rows.append(
            [
                r.name,
                f"{n:,}",
                sweeps,
                f"{r.median_ms:.3f}",
                f"{1e3 * r.median_ms / sweeps:.2f}",
                f"{r.gbps:,.0f}",
                f"{100 * r.fraction_of_copy_peak:.1f}%",
            ]
        )
    return rows


def main(argv=None):
    args = script_parser(__doc__, "05_first_kernels").parse_args(argv)
    sizes = pick(gpu=[(1 << 14, 1000), (1 << 24, 10)], simulator=[(70, 3)])
    rng = np.random.default_rng(0)
    peaks = device_peaks()
    print(
        "Jacobi sweeps of a float32 rod; every version is checked against the float64 "
        "NumPy reference (rel. error <= 1e-5)"
    )
    results, rows, cpu = [], [], {}
    for n, sweeps in sizes:
        np_ms, timed = run(n, sweeps, rng)
        results += timed
        if timed[0].measured:
            rows += table_rows(n, sweeps, np_ms, timed)
        cpu[f"n={n} sweeps={sweeps}"] = np_ms
    if not results[0].measured:
        print(format_table(results, title=f"n = {sizes[0][0]}, {sizes[0][1]} sweeps"))
        print(
            "simulator: blocks run one after another there, so a grid barrier can only "
            "join one block: version 3 ran on max_cooperative_grid_blocks = 1 block"
        )
        print(readme_figures(__file__).format())
    else:
        print(
            format_table(
                rows,
                title=f"on {peaks['device']}; %copy: share of its {peaks['copy_gbps']:,.0f} GB/s",
                header=["version", "n", "sweeps", "ms", "us a sweep", "GB/s", "%copy"],
                align="<>>>>>>",
            )
        )
        most = cooperative_blocks(256)
        grids = ", ".join(f"{min(most, ceil_div(n, 256))} at n = {n:,}" for n, _ in sizes)
        print(f"  version 3's grid, in blocks of 256: {grids} (at most {most} fit at once)")
    save_results(results, args.out, "grid_sync", cpu_numpy_ms=cpu)
    return 0


if __name__ == "__main__":
    run_script(main)
