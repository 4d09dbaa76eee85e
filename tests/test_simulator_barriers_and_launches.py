"""The simulator holds kernels to a GPU's rules on barriers and launches.

* Every thread of a block that has not returned must reach the same
  ``cuda.syncthreads()``. Numba's simulator waits at a barrier for whichever
  threads are still running, so a barrier inside a branch (``if t < stride:
  ... cuda.syncthreads()``) passed there, while on a GPU it is undefined
  behaviour (compute-sanitizer's synccheck reports it). The course's simulator
  reports it on every run, naming the kernel, the barrier's line and a thread
  that skipped it; an early ``return`` before the barrier stays legal. Both of
  its block runners are held to this: threads taking turns between barriers
  (kernels rewritten as generators, the usual one) and one OS thread per CUDA
  thread (kernels whose source cannot be read).
* A launch configuration Numba refuses is refused in Numba's words (a learner
  searches for them), followed by the course's hint; an empty ``forall`` runs
  nothing, as in Numba.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.internal import simulator
from common.internal.simulator import BarrierError, LaunchConfigError
from common.runtime import is_simulator

import importlib

import numpy as np
import pytest
from mutants import mutant
from numba import cuda, float32

sim_only = pytest.mark.skipif(not is_simulator(), reason="checks of the simulator itself")
reduction = importlib.import_module("chapters.06_memory.reduction")

SHARED = 64  # shared slots: the block sizes below are at most this


@cuda.jit
def tree_sum_barrier_in_branch(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
            cuda.syncthreads()  # BUG: threads t >= stride never arrive
        stride //= 2
    if t == 0:
        out[0] = s[0]


@cuda.jit
def tree_sum(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        out[0] = s[0]


@cuda.jit
def barrier_in_each_branch(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    if t % 2 == 0:
        cuda.syncthreads()  # BUG: two barriers; a GPU matches neither to the other
    else:
        cuda.syncthreads()
    out[t] = s[cuda.blockDim.x - 1 - t]


@cuda.jit
def guarded_barrier(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    if t < x.size:
        s[t] = x[t]
        cuda.syncthreads()  # BUG: the padding threads skip it
        out[t] = s[x.size - 1 - t]


@cuda.jit
def early_return(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    if t >= x.size:
        return  # before any barrier: an exited thread no longer counts
    s[t] = x[t]
    cuda.syncthreads()
    out[t] = s[x.size - 1 - t]


@cuda.jit
def return_after_the_barrier(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    if t < x.size:
        s[t] = x[t]
        cuda.syncthreads()  # BUG: the padding threads skip it, then return below
        out[t] = s[x.size - 1 - t]
    return


@cuda.jit
def return_inside_the_loop(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    for k in range(3):
        s[t] = x[t] + k
        cuda.syncthreads()
        out[t] = s[cuda.blockDim.x - 1 - t]
        if k == 1 and t >= x.size:
            return  # between this round's two barriers
        cuda.syncthreads()


@cuda.jit(device=True)
def _swap_through_shared(s, v):
    t = cuda.threadIdx.x
    s[t] = v
    cuda.syncthreads()
    w = s[cuda.blockDim.x - 1 - t]
    cuda.syncthreads()
    return w


@cuda.jit
def barrier_in_a_device_function(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    out[t] = _swap_through_shared(s, x[t])


@cuda.jit
def votes_in_block(x, counts, alls, anys):
    t = cuda.threadIdx.x
    counts[t] = cuda.syncthreads_count(x[t] > 0)
    alls[t] = cuda.syncthreads_and(x[t] > -1.5)
    anys[t] = cuda.syncthreads_or(x[t] > 1.5)


@cuda.jit
def fails_after_a_barrier(x, out):
    s = cuda.shared.array(SHARED, float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncthreads()
    out[t] = s[t] + x[t + 3]  # threads t >= len(x) - 3 read past x's end


def _input(n, rng):
    return rng.standard_normal(n).astype(np.float32)


@pytest.fixture(params=["turns", "threads"])
def runner(request, monkeypatch):
    """Each block runner of the simulator: "turns" (the kernel as a generator, all
    threads in one OS thread) and "threads" (one OS thread per CUDA thread, for
    kernels whose source cannot be read)."""
    if request.param == "threads":
        monkeypatch.setattr(simulator, "_turns_version", lambda fn, kernel: None)
    return request.param


@sim_only
@pytest.mark.parametrize("threads", [2, 8, 33, 64])
def test_barrier_inside_a_branch_is_reported_every_run(threads, rng, runner):
    x = _input(threads, rng)
    for _ in range(3):  # every run, not by luck of the thread schedule
        with pytest.raises(BarrierError) as err:
            tree_sum_barrier_in_branch[1, threads](x, np.full(1, np.nan, np.float32))
        message = str(err.value)
        line = tree_sum_barrier_in_branch.py_func.__code__.co_firstlineno + 10
        assert "tree_sum_barrier_in_branch" in message
        assert f"test_simulator_barriers_and_launches.py:{line}" in message
        assert "never reached the barrier" in message and "guard the work" in message
        # the first thread that skipped it: the one that stopped at stride 1 (t = 1)
        assert "thread (1,0,0) never reached" in message


@sim_only
def test_two_barriers_in_two_branches_are_reported(rng, runner):
    x = _input(8, rng)
    with pytest.raises(BarrierError, match=r"wait at different barriers \(.*:\d+ and .*:\d+\)"):
        barrier_in_each_branch[1, 8](x, np.full(8, np.nan, np.float32))


@sim_only
@pytest.mark.parametrize(
    "kernel", [guarded_barrier, return_after_the_barrier], ids=lambda k: k.__name__
)
def test_padding_threads_that_skip_a_barrier_are_reported(kernel, rng, runner):
    x = _input(5, rng)
    with pytest.raises(BarrierError, match=r"thread \(5,0,0\) never reached the barrier"):
        kernel[1, 8](x, np.full(8, np.nan, np.float32))


@sim_only
def test_a_course_kernel_with_its_barrier_moved_into_the_branch_fails(rng, runner):
    """Chapter 06's interleaved tree with the barrier indented into the `if`: the
    sums still come out right in the simulator, and the race detector sees no race
    (each step's reader passed the barrier after the writer), so only the barrier
    check can catch it."""
    broken = mutant(
        reduction.reduce_sum_tree_interleaved,
        (
            "            s[t] += s[t + stride]\n        cuda.syncthreads()",
            "            s[t] += s[t + stride]\n            cuda.syncthreads()",
        ),
    )
    n = reduction.BLOCK + 3
    x = _input(n, rng)
    partial = np.full(2, np.nan, np.float32)
    with pytest.raises(BarrierError, match="reduce_sum_tree_interleaved"):
        broken[2, reduction.BLOCK](x, partial)
    reduction.reduce_sum_tree_interleaved[2, reduction.BLOCK](x, partial)  # the real one
    np.testing.assert_allclose(partial.sum(), x.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 8, 64])
def test_correct_barriers_pass(threads, rng, runner):
    x = _input(threads, rng)
    out = np.full(1, np.nan, np.float32)
    tree_sum[1, threads](x, out)
    np.testing.assert_allclose(out[0], x.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)

    out = np.full(threads, np.nan, np.float32)
    barrier_in_a_device_function[1, threads](x, out)
    np.testing.assert_array_equal(out, x[::-1])

    counts, alls, anys = (np.full(threads, -1, np.int32) for _ in range(3))
    x[0] = 2.0  # one vote each way for syncthreads_or and syncthreads_and, whatever the draw
    votes_in_block[1, threads](x, counts, alls, anys)
    assert (counts == np.count_nonzero(x > 0)).all()
    assert (anys == 1).all() and (alls == int((x > -1.5).all())).all()
    x[-1] = -2.0
    votes_in_block[1, threads](x, counts, alls, anys)
    assert (alls == 0).all() and (anys == int((x > 1.5).any())).all()


@sim_only
def test_an_error_names_a_failing_thread(rng, runner):
    # Threads 5, 6 and 7 read past x; taking turns, the first of them fails first.
    x = _input(8, rng)
    who = "5" if runner == "turns" else "[567]"
    with pytest.raises(IndexError, match=rf"tid=\[{who}, 0, 0\] ctaid=\[0, 0, 0\]: index"):
        fails_after_a_barrier[1, 8](x, np.full(8, np.nan, np.float32))


@sim_only
def test_a_failed_block_leaves_no_module_swapped(tmp_path, monkeypatch, rng, runner):
    """A device function of another module runs with the simulator's fake `cuda`
    in that module's globals; a block that fails while the other threads wait in
    it must put the real one back (else host code of that module breaks later)."""
    (tmp_path / "barrier_helpers.py").write_text(
        "from numba import cuda\n"
        "\n"
        "\n"
        "@cuda.jit(device=True)\n"
        "def sync_then_read(x, i):\n"
        "    cuda.syncthreads()\n"
        "    return x[i]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers = importlib.import_module("barrier_helpers")

    @cuda.jit
    def reads_past_the_end(x, out):
        t = cuda.threadIdx.x
        out[t] = helpers.sync_then_read(x, t + 3)

    with pytest.raises(IndexError, match="out of bounds") as err:
        reads_past_the_end[1, 8](_input(8, rng), np.full(8, np.nan, np.float32))
    assert err.value.__traceback__ is not None  # still held, with its frames
    assert helpers.cuda is cuda


@sim_only
def test_course_kernels_take_turns():
    """The fast runner is the one the course's kernels get (a fallback to threads
    would pass every test above, only slower)."""
    for kernel in (tree_sum, barrier_in_a_device_function, votes_in_block):
        assert simulator._turns_version(kernel.py_func, kernel=True) is not None, kernel
    assert simulator._turns_version(reduction.reduce_sum_tree_interleaved.py_func, kernel=True)


@sim_only
def test_a_kernel_without_source_runs_on_threads_and_is_checked(rng):
    source = (
        "def sourceless(x, out):\n"
        "    t = cuda.threadIdx.x\n"
        "    if t % 2 == 0:\n"
        "        cuda.syncthreads()\n"
        "    else:\n"
        "        cuda.syncthreads()\n"
        "    out[t] = x[t]\n"
    )
    scope = {"cuda": cuda}
    exec(compile(source, "<no file>", "exec"), scope)  # no linecache entry: no source
    kernel = cuda.jit(scope["sourceless"])
    assert simulator._turns_version(kernel.py_func, kernel=True) is None
    with pytest.raises(BarrierError, match="wait at different barriers"):
        kernel[1, 8](_input(8, rng), np.full(8, np.nan, np.float32))


def test_an_early_return_before_the_barrier_is_legal(rng, runner):
    x = _input(5, rng)
    out = np.full(8, np.nan, np.float32)
    early_return[1, 8](x, out)
    np.testing.assert_array_equal(out[:5], x[::-1])
    assert np.isnan(out[5:]).all()


def test_a_return_between_two_rounds_of_a_loop_is_legal(rng, runner):
    # Threads t >= 5 return between round 1's two barriers: they exit before the
    # second one, which the others then pass without them, as on a GPU.
    x = _input(5, rng)
    out = np.full(8, np.nan, np.float32)
    xs = np.concatenate([x, np.zeros(3, np.float32)])
    return_inside_the_loop[1, 8](xs, out)
    assert not np.isnan(out).any()


# ------------------------------------------------------------------ launches


@cuda.jit
def _fill(out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 1.0


LAUNCH_HINT = "the course: launch as kernel[blocks_per_grid, threads_per_block]"


@sim_only
@pytest.mark.parametrize(
    "config,error,numba_words",
    [
        ((2.0, 32), TypeError, "griddim must be a sequence of integers, got [2.0]"),
        ((2, 32.0), TypeError, "blockdim must be a sequence of integers, got [32.0]"),
        (
            ((1, 1, 1, 1), 32),
            ValueError,
            "griddim must be a sequence of 1, 2 or 3 integers, got [1, 1, 1, 1]",
        ),
        (
            (1, (2, 2, 2, 2)),
            ValueError,
            "blockdim must be a sequence of 1, 2 or 3 integers, got [2, 2, 2, 2]",
        ),
        ((None, 32), ValueError, "Kernel launch configuration was not specified"),
    ],
)
def test_bad_launch_configurations_fail_in_numbas_words_then_the_courses(
    config, error, numba_words
):
    with pytest.raises(error) as err:
        _fill[config](np.full(4, np.nan, np.float32))
    message = str(err.value)
    assert message.startswith(numba_words.split("\n")[0]) or numba_words in message
    assert message.index(numba_words) < message.index(LAUNCH_HINT)


@sim_only
def test_a_launch_without_a_block_size_is_refused():
    with pytest.raises(ValueError, match="must specify at least the griddim and blockdim"):
        _fill[4](np.full(4, np.nan, np.float32))


def test_numpy_integers_are_launch_dimensions_as_in_numba():
    out = np.full(5, np.nan, np.float32)
    _fill[np.int64(2), np.int32(4)](out)
    assert (out == 1.0).all()


def test_an_empty_forall_runs_nothing_as_in_numba():
    out = np.full(3, np.nan, np.float32)
    _fill.forall(0)(out)
    assert np.isnan(out).all()
    _fill.forall(3)(out)
    assert (out == 1.0).all()


@sim_only
def test_an_empty_grid_is_refused_as_a_gpu_refuses_it():
    with pytest.raises(LaunchConfigError, match="CUDA_ERROR_INVALID_VALUE"):
        _fill[0, 32](np.full(3, np.nan, np.float32))


@cuda.jit
def read_shape_and_size(a, out):
    out[0], out[1] = a.shape
    out[2] = a.size
    out[3] = a.shape[-1]  # CUDA Python's shapes refuse negative indices


@sim_only
def test_array_shape_and_size_in_a_kernel_are_numbas():
    # common.internal.simulator makes them properties of the in-kernel array
    # (Numba's simulator reached them through two __getattr__ hops): the same
    # values, and a negative shape index is still an error, as on a GPU.
    out = cuda.to_device(np.zeros(4, np.int64))
    with pytest.raises(IndexError, match="out of range"):
        read_shape_and_size[1, 1](cuda.to_device(np.zeros((3, 5), np.float32)), out)
    np.testing.assert_array_equal(out.copy_to_host()[:3], [3, 5, 15])
