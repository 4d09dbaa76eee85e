"""Chapter 5, grid_sync.py: each way of running many dependent Jacobi sweeps against the
NumPy reference, with hostile inputs (one element, both ends only, sizes that do not
divide the block, odd and even sweep counts, outputs and scratch NaN-poisoned inside
guard cells, the input left as it was), and the broken versions each check exists to
fail: no grid barrier, no block barrier, no bounds check, the ends never written, the
result left in the scratch buffer, a cooperative grid larger than fits.

The script's main() runs in tests/test_scripts_simulator_output.py."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick
from common.checking import CheckError, check, guarded
from common.internal.exercises import load_chapter_module

from functools import partial

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

script = load_chapter_module("05_first_kernels", "grid_sync")

THREADS = 32
# one element, both ends only, a block -1 and +1, several blocks and a remainder
SIZES = [1, 2, THREADS - 1, THREADS + 1, 3 * THREADS + 7] + pick(gpu=[100_003], simulator=[])
SWEEPS = [1, 2, 5]  # one sweep (x0 -> out), and both parities of the ping-pong

VERSIONS = {
    "1 a launch a sweep": partial(script.relax_launches, threads_per_block=THREADS),
    "2 one block": partial(script.relax_one_block, threads_per_block=THREADS),
    "3 grid sync": partial(script.relax_grid_sync, threads_per_block=THREADS),
}


def check_relax(relax, rng, sizes=SIZES, sweeps_list=SWEEPS):
    """``relax(x0, tmp, sweeps, out)`` must leave jacobi_cpu's answer in ``out``, write
    nothing outside ``out`` and ``tmp``, and leave ``x0`` as it was."""
    for n in sizes:
        x_host = rng.uniform(0.0, 1.0, n).astype(np.float32)
        for sweeps in sweeps_list:
            x0 = cuda.to_device(x_host)
            tmp, out = guarded(n), guarded(n)
            relax(x0, tmp.array, sweeps, out.array)
            name = f"n={n}, {sweeps} sweeps"
            check(out.array, script.jacobi_cpu(x_host.astype(np.float64), sweeps), 1e-5, name)
            out.check_untouched(f"out, {name}")
            tmp.check_untouched(f"tmp, {name}")
            if not np.array_equal(x0.copy_to_host(), x_host):
                raise CheckError(f"{name}: x0 was written; it must only be read")


@pytest.mark.parametrize("version", list(VERSIONS))
def test_every_version_matches_numpy(version, rng):
    check_relax(VERSIONS[version], rng)


def test_script_versions_at_their_default_blocks(rng):
    # the launch shapes main() uses (256 and 1024 threads): one block in the simulator
    for relax in script.VERSIONS.values():
        check_relax(relax, rng, sizes=[3, 300], sweeps_list=[2, 3])


def test_cooperative_grid_fits_the_gpu():
    most = script.cooperative_blocks(THREADS)
    # the simulator runs one block at a time, so only a one-block grid can meet at a barrier
    assert (most == 1) if is_simulator() else (most >= common.sm_count())


def test_launchers_reject_bad_inputs():
    x0 = cuda.to_device(np.ones(8, np.float32))
    tmp, out = cuda.device_array(8, np.float32), cuda.device_array(8, np.float32)
    for relax in script.VERSIONS.values():
        with pytest.raises(ValueError, match="sweeps must be >= 1"):
            relax(x0, tmp, 0, out)
        with pytest.raises(TypeError, match="host"):
            relax(np.ones(8, np.float32), tmp, 1, out)
        with pytest.raises(ValueError, match="one shape"):
            relax(x0, cuda.device_array(9, np.float32), 1, out)
        with pytest.raises(TypeError, match="float32"):
            relax(x0, tmp, 1, cuda.device_array(8, np.float64))


# ------------------------------------------------------------------ broken versions must fail


def _no_grid_barrier():
    # threads of the next sweep read neighbours the last sweep has not written yet
    return mutant(script.jacobi_sweeps_grid_sync, ("        grid.sync()\n", ""))


def _no_block_barrier():
    return mutant(script.jacobi_sweeps_one_block, ("        cuda.syncthreads()\n", ""))


def _no_bounds_check():
    return mutant(
        script.jacobi_sweep,
        (
            "    if i < dst.size:\n        jacobi_point(src, dst, i)",
            "    jacobi_point(src, dst, i)",
        ),
    )


def _ends_never_written():
    # the interior only: the ends of tmp and out keep their poison
    return mutant(
        script.jacobi_sweep,
        ("    if i < dst.size:", "    if 0 < i < dst.size - 1:"),
    )


# A missing barrier shows on a GPU only when threads drift apart: a short rod of many
# sweeps (a thread's share of a sweep is a few loads) lets blocks and warps run sweeps
# apart, and a few trials give it the chance. The simulator's race detector reports the
# race on the launch that has it, every time.
RACE_TRIALS = 3


def fails_with_a_race(relax, rng, n_gpu):
    if is_simulator():
        check_relax(relax, rng)
        return
    for _ in range(RACE_TRIALS):
        check_relax(relax, rng, sizes=[n_gpu], sweeps_list=[1000])


def test_grid_sync_kernel_without_the_barrier_fails(monkeypatch, rng):
    monkeypatch.setattr(script, "jacobi_sweeps_grid_sync", _no_grid_barrier())
    n = THREADS * script.cooperative_blocks(THREADS)  # a point a thread, every block resident
    with pytest.raises(CheckError):
        fails_with_a_race(VERSIONS["3 grid sync"], rng, n_gpu=n)


def test_one_block_kernel_without_the_barrier_fails(monkeypatch, rng):
    monkeypatch.setattr(script, "jacobi_sweeps_one_block", _no_block_barrier())
    # on a GPU 1024 threads, a point each: 32 warps that drift apart while they wait for
    # their loads (the 32 threads of one warp would not)
    relax = partial(script.relax_one_block, threads_per_block=pick(gpu=1024, simulator=THREADS))
    with pytest.raises(CheckError):
        fails_with_a_race(relax, rng, n_gpu=1024)


@pytest.mark.parametrize(
    "broken, fails_with",
    [(_no_bounds_check, (CheckError, IndexError)), (_ends_never_written, CheckError)],
    ids=["no bounds check", "ends never written"],
)
def test_broken_sweep_kernel_fails(monkeypatch, rng, broken, fails_with):
    # the script's own launcher, with the broken kernel in the real one's place; on a GPU
    # the writes past the end land in the guard cells, the unwritten ends stay NaN
    monkeypatch.setattr(script, "jacobi_sweep", broken())
    with pytest.raises(fails_with):
        check_relax(VERSIONS["1 a launch a sweep"], rng)


def _result_left_in_tmp(x0, tmp, sweeps, out):
    script.relax_grid_sync(x0, out, sweeps, tmp, threads_per_block=THREADS)


def _grid_larger_than_fits(x0, tmp, sweeps, out):
    # a block a THREADS elements, whatever max_cooperative_grid_blocks says
    script.jacobi_sweeps_grid_sync[ceil_div(out.size, THREADS), THREADS](x0, tmp, out, sweeps)


def test_result_left_in_scratch_fails(rng):
    with pytest.raises(CheckError, match="NaN"):
        check_relax(_result_left_in_tmp, rng)


def test_grid_larger_than_fits_fails(rng):
    # four times the blocks that fit at once: the simulator, which runs blocks one after
    # another, computes a wrong answer; on a GPU the cooperative launch is refused before
    # it starts, by a ValueError naming the grid and the blocks that fit (numba-cuda
    # 0.30.4 and its CUDA 13 packages on the H100), or by the driver
    fit = script.cooperative_blocks(THREADS)
    n = 4 * THREADS * fit + 5
    if is_simulator():
        with pytest.raises(CheckError):
            check_relax(_grid_larger_than_fits, rng, sizes=[n], sweeps_list=[3])
        return
    with pytest.raises(Exception) as failure:
        check_relax(_grid_larger_than_fits, rng, sizes=[n], sweeps_list=[3])
    refused = f"The specified grid size ({ceil_div(n, THREADS)} * 1 * 1) exceeds the limit ({fit})"
    assert (
        type(failure.value) is ValueError and str(failure.value).rstrip(".") == refused
    ) or "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE" in str(failure.value), repr(failure.value)


@pytest.mark.gpu
def test_a_kernel_cannot_launch_a_kernel():
    # what the chapter says: no dynamic parallelism in numba-cuda (the simulator, which
    # runs kernels as Python, would run this)
    from numba.core.errors import TypingError

    @cuda.jit
    def child(x):
        x[0] = 1.0

    @cuda.jit
    def parent(x):
        child[1, 1](x)

    with pytest.raises(TypingError, match="CUDADispatcher"):
        parent[1, 1](cuda.device_array(1, np.float32))
