"""The simulator's race detector (common/racecheck.py): every racy kernel of the test
suite is reported on every run, with the race named; the legitimate patterns of the
course (barriers, atomics, the last-block ticket) never are; numba-cuda's own
simulator tests stay green with the course's runtime and the detector on."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError
from common.internal import racecheck
from common.internal.racecheck import RaceError, intentional_race
from common.internal.simulator import LaunchConfigError
from common.runtime import interleaved_threads, is_simulator

import contextlib
import functools
import importlib
import inspect
import os
import re
import tempfile
import unittest
from pathlib import Path

import numpy as np
import pytest
import test_ch05_first_kernels as ch05
import test_ch06_memory as ch06
import test_ch08_matmul as ch08
import test_checker_catches_bugs as bugs
from numba import cuda, float32, int32

pytestmark = pytest.mark.skipif(
    not is_simulator() or not racecheck.ENABLED,
    reason="the race detector runs in the simulator (on a GPU: compute-sanitizer "
    "--tool racecheck, chapter 06's notes)",
)

# Every run must report the race: detection may not depend on luck. The suite runs
# each racy kernel RUNS times; COURSE_RACE_RUNS=20 makes it twenty.
RUNS = int(os.environ.get("COURSE_RACE_RUNS", "5"))
B = ch06.BLOCK


def _dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def _ints(n, high, seed=0):
    return _dev(np.random.default_rng(seed).integers(0, high, n).astype(np.int32))


def _floats(*shape, seed=0):
    return _dev(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _zeros(*shape, dtype=np.float32):
    return _dev(np.zeros(shape, dtype))


@cuda.jit
def dot_no_load_barrier(a, b, out):
    # Reduction-style exercise (6.3) with the barrier after the shared store missing.
    s = cuda.shared.array(B, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = a[i] * b[i] if i < a.size else float32(0.0)
    stride = B // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        cuda.atomic.add(out, 0, s[0])


@cuda.jit
def softmax_row_max_no_barrier(x, out):
    # Softmax-style (6.10): the row maximum read by every thread before the tree is done.
    s = cuda.shared.array(B, float32)
    t = cuda.threadIdx.x
    s[t] = x[cuda.blockIdx.x, t]
    cuda.syncthreads()
    stride = B // 2
    while stride > 0:
        if t < stride:
            s[t] = max(s[t], s[t + stride])
        cuda.syncthreads()
        stride //= 2
    row_max = s[0]  # no barrier before s is reused below
    s[t] = x[cuda.blockIdx.x, t] - row_max
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = s[t]


@functools.cache
def _ch08_tiled_without_sync():
    """Chapter 08's tiled matmul (4x4 tiles) with its barriers removed."""
    folder = Path(tempfile.mkdtemp(prefix="racecheck-ch08-"))
    factory = ch08.mutant(folder, ch08.sol.make_tiled_kernel, ("cuda.syncthreads()", "pass"))
    return factory(4)


# Each racy kernel of the suite, with a tiny launch and what the report must name:
# (kernel name, array, kind of memory). The shapes are the smallest that race.
RACY = {
    "ch05 count_above: counter[0] += 1": (
        lambda: ch05._count_above_plain_increment[2, 32](
            _floats(64), np.float32(-10.0), _zeros(1, dtype=np.int32)
        ),
        "_count_above_plain_increment",
        "counter[0]",
        "global",
    ),
    "ch06 shift_left: no barrier after the load": (
        lambda: ch06.shift_left_no_barrier[1, B](_floats(B + 1), _zeros(B)),
        "shift_left_no_barrier",
        "tile[",
        "shared",
    ),
    "ch06 block_sums: no barrier between tree levels": (
        lambda: ch06.block_sums_no_barrier[1, B](_floats(B), _zeros(1)),
        "block_sums_no_barrier",
        "s[",
        "shared",
    ),
    "ch06 dot: out[0] += from every block": (
        lambda: ch06.dot_plain_add[3, B](_floats(3 * B), _floats(3 * B, seed=1), _zeros(1)),
        "dot_plain_add",
        "out[0]",
        "global",
    ),
    "reduction-style dot: no barrier after the shared store": (
        lambda: dot_no_load_barrier[2, B](_floats(2 * B), _floats(2 * B, seed=1), _zeros(1)),
        "dot_no_load_barrier",
        "s[",
        "shared",
    ),
    "softmax-style row max: shared array reused without a barrier": (
        lambda: softmax_row_max_no_barrier[2, B](_floats(2, B), _zeros(2, B)),
        "softmax_row_max_no_barrier",
        "s[0]",
        "shared",
    ),
    "ch06 argmax: no barriers": (
        lambda: ch06.argmax_no_barrier[1, B](_floats(B), _zeros(1), _zeros(1, dtype=np.int32)),
        "argmax_no_barrier",
        "s",
        "shared",
    ),
    "ch06 transpose: no barrier between store and load": (
        lambda: ch06.transpose_no_barrier[(1, 1), (ch06.TILE, ch06.ROWS)](
            _floats(ch06.TILE, ch06.TILE), _zeros(ch06.TILE, ch06.TILE)
        ),
        "transpose_no_barrier",
        "tile[",
        "shared",
    ),
    "ch06 histogram: bins[x[i]] += 1": (
        lambda: ch06.histogram_plain_add[1, B](
            _ints(B, ch06.NBINS), _zeros(ch06.NBINS, dtype=np.int32)
        ),
        "histogram_plain_add",
        "bins[",
        "global",
    ),
    "ch06 histogram: h[x[i]] += 1 in shared memory": (
        lambda: ch06.histogram_private_plain_add[1, B](
            _ints(B, ch06.NBINS), _zeros(ch06.NBINS, dtype=np.int32)
        ),
        "histogram_private_plain_add",
        "h[",
        "shared",
    ),
    "ch06 scan: no barrier after the load": (
        lambda: ch06.block_scan_no_load_barrier[1, B](
            _ints(B, 9), _zeros(B, dtype=np.int32), _zeros(1, dtype=np.int32)
        ),
        "block_scan_no_load_barrier",
        "s[",
        "shared",
    ),
    "ch06 scan: no barrier between read and write": (
        lambda: ch06.block_scan_one_barrier[1, B](
            _ints(B, 9), _zeros(B, dtype=np.int32), _zeros(1, dtype=np.int32)
        ),
        "block_scan_one_barrier",
        "s[",
        "shared",
    ),
    "ch08 tiled matmul: no syncthreads": (
        lambda: _ch08_tiled_without_sync()[(1, 1), (4, 4)](
            _floats(4, 8), _floats(8, 4, seed=1), _zeros(4, 4)
        ),
        "matmul_tiled",
        "_tile[",
        "shared",
    ),
    "checker: tiled matmul without barriers": (
        lambda: bugs.matmul_tiled_no_sync[(1, 1), (bugs.TILE, bugs.TILE)](
            _floats(bugs.TILE, 2 * bugs.TILE),
            _floats(2 * bugs.TILE, bugs.TILE, seed=1),
            _zeros(bugs.TILE, bugs.TILE),
        ),
        "kernel",
        "s",
        "shared",
    ),
    "checker: counts[keys[i]] += 1": (
        lambda: bugs.count_plain[2, 16](_ints(64, 4), _zeros(4, dtype=np.int32)),
        "count_plain",
        "counts[",
        "global",
    ),
}


# A racy kernel can read shared memory nobody wrote yet (inf * 0 is NaN): expected.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", list(RACY))
def test_every_racy_kernel_is_reported_every_time(name):
    launch, kernel, array, memory = RACY[name]
    for run in range(RUNS):
        # Every other run with simulated threads switching every microsecond: the
        # verdict may not depend on how the threads happened to interleave.
        switching = interleaved_threads() if run % 2 else contextlib.nullcontext()
        with pytest.raises(RaceError) as info, switching:
            launch()
            cuda.synchronize()
        message = str(info.value)
        assert f"race in kernel {kernel}" in message and f"({memory} memory)" in message, message
        assert array in message, message
        # Both threads and the source line are named, and what usually fixes it.
        assert re.search(r"threads? \(\d+,\d+,\d+\)", message), message
        assert re.search(r"\.py:\d+", message), message
        assert (
            "cuda.atomic.add" in message or "cuda.syncthreads()" in message or "launch" in message
        ), message


def test_report_names_kernel_array_element_threads_and_line():
    @cuda.jit
    def histogram_lost_update(x, h_out):
        h = cuda.shared.array(4, int32)
        t = cuda.threadIdx.x
        if t < 4:
            h[t] = 0
        cuda.syncthreads()
        h[x[t]] += 1
        cuda.syncthreads()
        if t < 4:
            h_out[t] = h[t]

    x = np.array([0, 1, 3, 2, 1, 0, 2, 3], np.int32)  # each bin gets two threads
    with pytest.raises(RaceError) as info:
        histogram_lost_update[1, 8](_dev(x), _zeros(4, dtype=np.int32))
    message = str(info.value)
    m = re.search(
        r"threads \((\d),0,0\) and \((\d),0,0\) of block \(0,0,0\) both updated "
        r"h\[(\d)\] without an atomic between two barriers \(test_racecheck\.py:(\d+)\)",
        message,
    )
    assert m, message
    a, b, bin_ = int(m.group(1)), int(m.group(2)), int(m.group(3))
    assert x[a] == x[b] == bin_ and a != b
    assert "cuda.atomic.add" in message


# ----------------------------------------------------------- legitimate patterns


@cuda.jit
def _tree_sum(x, out):
    s = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    s[t] = x[cuda.grid(1)]
    cuda.syncthreads()
    stride = 16
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        cuda.atomic.add(out, 0, s[0])


@cuda.jit
def _flag_store(x, found):
    # Many threads store the same value to one element: benign, and not reported.
    if x[cuda.grid(1)] > 0:
        found[0] = 1


@cuda.jit
def _last_block_sum(x, partial, counter, out):
    # Chapter 06's last-block patterns in small: every thread publishes a row of
    # partials with a threadfence, a barrier, then thread 0 takes the ticket; the last
    # block reads every row. (test_ch06_scripts runs the chapter's own versions.)
    s_last = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    partial[cuda.blockIdx.x, t] = x[cuda.grid(1)]
    cuda.threadfence()
    cuda.syncthreads()
    if t == 0:
        ticket = cuda.atomic.add(counter, 0, 1)
        s_last[0] = 1 if ticket == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if s_last[0]:
        acc = float32(0.0)
        for b in range(cuda.gridDim.x):
            acc += partial[b, t]
        out[t] = acc
        if t == 0:
            counter[0] = 0  # ready for the next launch


def test_correct_patterns_are_not_reported():
    grid = 3
    n = grid * 32
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    for switching in (contextlib.nullcontext(), interleaved_threads()):
        with switching:
            out = _zeros(1)
            _tree_sum[grid, 32](_dev(x), out)
            assert abs(out.copy_to_host()[0] - x.sum(dtype=np.float64)) < 1e-3
            found = _zeros(1, dtype=np.int32)
            _flag_store[grid, 32](_dev(x), found)
            assert found.copy_to_host()[0] == 1
            sums = _zeros(32)
            _last_block_sum[grid, 32](_dev(x), _zeros(grid, 32), _zeros(1, dtype=np.int32), sums)
            np.testing.assert_allclose(sums.copy_to_host(), x.reshape(grid, 32).sum(0), rtol=1e-5)


@cuda.jit
def _last_block_without_fence(x, partial, counter, out):
    t = cuda.threadIdx.x
    if t == 0:
        partial[cuda.blockIdx.x] = x[cuda.blockIdx.x]
        ticket = cuda.atomic.add(counter, 0, 1)  # no threadfence before the ticket
        if ticket == cuda.gridDim.x - 1:
            acc = float32(0.0)
            for j in range(cuda.gridDim.x):
                acc += partial[j]
            out[0] = acc


def test_last_block_without_threadfence_is_reported():
    # Without the fence the partials need not be visible to the last block.
    with pytest.raises(RaceError, match="partial"):
        _last_block_without_fence[3, 1](_floats(3), _zeros(3), _zeros(1, dtype=np.int32), _zeros(1))


def test_intentional_race_is_not_reported():
    counter = _zeros(1, dtype=np.int32)
    with intentional_race("chapter 05 shows what a lost update does"):
        ch05._count_above_plain_increment[1, 32](_floats(32), np.float32(-10.0), counter)
    assert 1 <= counter.copy_to_host()[0] <= 32
    with pytest.raises(ValueError):
        with intentional_race(""):
            pass


def test_race_error_is_a_check_error():
    # Every `pytest.raises(CheckError)` of a broken kernel also accepts a reported race.
    assert issubclass(RaceError, CheckError)


# ---------------------------------------------- shared-array shapes in device functions


@cuda.jit(device=True)
def _stage(x, shape):
    s = cuda.shared.array(shape, float32)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncthreads()
    return s[(t + 1) % 4]


@cuda.jit
def _stage_literal(x, out):
    out[cuda.threadIdx.x] = _stage(x, (4,))  # a literal tuple: constant on a GPU too


@cuda.jit
def _stage_runtime(x, out, n):
    out[cuda.threadIdx.x] = _stage(x, n)  # a launch argument: a GPU cannot compile this


def test_device_function_shape_is_judged_at_the_call_site():
    x = np.arange(4, dtype=np.float32)
    out = _zeros(4)
    _stage_literal[1, 4](_dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(x, -1))
    with pytest.raises(LaunchConfigError, match="`n` is a kernel argument"):
        _stage_runtime[1, 4](_dev(x), out, 4)


# ------------------------------------------------ numba-cuda's own simulator tests


def _numba_suites() -> list[str]:
    import pkgutil

    import numba.cuda.tests.cudapy as cudapy

    # test_print and test_random take a minute between them in subprocesses and
    # CPU-compiled generators, and launch nothing the others do not.
    slow = {"test_print", "test_random"}
    names = (m.name for m in pkgutil.iter_modules(cudapy.__path__))
    return sorted(n for n in names if n.startswith("test_") and n not in slow)


# What numba-cuda's own simulator tests are allowed to see differently under the
# course's runtime, and why. Anything else that fails is a course check refusing
# valid Numba, or the course missing what Numba does.
COURSE_DIFFERS = {
    "test_array_alignment.TestCudasimUnsupportedAlignment.test_local_unsupported": (
        "the course accepts alignment= for local arrays (it only steers code generation)"
    ),
    "test_array_alignment.TestCudasimUnsupportedAlignment.test_shared_unsupported": (
        "the course accepts alignment= for shared arrays (it only steers code generation)"
    ),
    "test_exception.TestException.test_raise_causing_warp_diverge": (
        "its kernel `problematic` really races (`y[0] += 1` from every thread): "
        "the race detector reports it"
    ),
}
# Fails in numba-cuda's plain simulator too (not the course's doing).
NUMBA_FAILS_ALONE = {"test_typeinfer.test_partial_typing_error"}


def _run_suite(suite: str) -> dict[str, str]:
    """Run numba-cuda's ``numba.cuda.tests.cudapy.<suite>`` as the course runs kernels;
    return {test id: last line of its failure}."""
    try:
        module = importlib.import_module(f"numba.cuda.tests.cudapy.{suite}")
    except unittest.SkipTest:
        return {}
    except BaseException as e:  # a module-level pytest.importorskip raises pytest's Skipped
        if type(e).__name__ == "Skipped" or isinstance(e, ImportError):
            return {}
        raise

    def plain(f):
        def run():
            try:
                f()
            except BaseException as e:  # pytest.skip() inside, in a plain unittest run
                if type(e).__name__ == "Skipped":
                    raise unittest.SkipTest(str(e)) from None
                raise

        run.__name__ = f.__name__
        return run

    tests = list(_flatten(unittest.defaultTestLoader.loadTestsFromModule(module)))
    # Some of its modules hold plain pytest-style functions instead of TestCases.
    tests += [
        unittest.FunctionTestCase(plain(f))
        for name, f in vars(module).items()
        if name.startswith("test") and inspect.isfunction(f) and not inspect.signature(f).parameters
    ]
    result = unittest.TextTestRunner(stream=_Null(), verbosity=0).run(unittest.TestSuite(tests))
    failed = {}
    for test, tb in result.errors + result.failures:
        name = test.id().removeprefix("numba.cuda.tests.cudapy.")
        if isinstance(test, unittest.FunctionTestCase):
            name = f"{suite}.{test._testFunc.__name__}"
        failed[name] = tb.strip().splitlines()[-1]
    return failed


@pytest.mark.parametrize("suite", _numba_suites())
def test_numba_cuda_simulator_suite_passes_under_the_course_runtime(suite):
    """Code nobody here wrote: neither the launch checks, the barrier check nor the
    race detector may refuse valid Numba (device functions, literal shapes passed
    down, atomics, cooperative groups), and what Numba does the course does too
    (its launch errors, an empty forall, debug=True's floating-point traps)."""
    pytest.importorskip(
        "filecheck", reason="numba-cuda's test helpers need `filecheck` (pip install -e '.[dev]')"
    )
    failed = _run_suite(suite)
    expected = {t for t in COURSE_DIFFERS if t.startswith(f"{suite}.")}
    allowed = COURSE_DIFFERS.keys() | NUMBA_FAILS_ALONE
    unexpected = {t: why for t, why in failed.items() if t not in allowed}
    assert not unexpected, "\n".join(f"{t}: {why}" for t, why in unexpected.items())
    assert expected <= set(failed), f"the course no longer differs here: {expected - set(failed)}"


def _flatten(tests):
    for t in tests:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


@cuda.jit
def _wait_for_flag(flags, out):
    # block b waits for block b - 1's flag; nobody ever sets block 0's
    b = cuda.blockIdx.x
    if cuda.threadIdx.x == 0 and b > 0:
        while cuda.atomic.add(flags, b - 1, 0) == 0:
            pass
        out[b] = 1
    if cuda.threadIdx.x == 0 and b > 0:
        cuda.atomic.exch(flags, b, 1)


@cuda.jit
def _ticket_in_a_loop(ticket, out):
    # many atomics on one element in a row, each changing it: not a spin
    if cuda.threadIdx.x == 0:
        for _ in range(racecheck.SPIN_LIMIT + 5):
            cuda.atomic.add(ticket, 0, 1)
        out[0] = 1


def test_a_spin_on_a_flag_nobody_writes_is_a_deadlock_error():
    flags = cuda.to_device(np.zeros(3, np.int32))
    out = cuda.to_device(np.zeros(3, np.int32))
    with pytest.raises(
        common.DeadlockError, match=r"block \(1,0,0\).*element \[0\].*never published"
    ):
        _wait_for_flag[3, 4](flags, out)
    assert isinstance(common.DeadlockError("x"), CheckError)


def test_atomics_that_change_the_element_are_not_a_spin():
    ticket = cuda.to_device(np.zeros(1, np.int32))
    out = cuda.to_device(np.zeros(1, np.int32))
    _ticket_in_a_loop[1, 2](ticket, out)
    assert ticket.copy_to_host()[0] == racecheck.SPIN_LIMIT + 5
