"""Chapter 2: device-limit exercises, broken versions that must fail, and the
device_query script at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime
from common.checking import CheckError
from common.internal.exercises import implementations, load_chapter_module

import pytest
from numba import cuda

CHAPTER = "02_setup"


def true_limit():
    if runtime.is_simulator():
        return runtime.MAX_THREADS_PER_BLOCK
    return int(cuda.get_current_device().MAX_THREADS_PER_BLOCK)


def check_max_threads(fn):
    got = fn()
    if got != true_limit() or not isinstance(got, int):
        raise CheckError(f"max_threads_per_block() = {got!r}, expected {true_limit()}")


def check_launch_config(fn, rng):
    limit = true_limit()
    for threads in (1, 32, 96, limit):
        for n in (1, threads - 1, threads, threads + 1, int(rng.integers(1, 10**7))):
            if n < 1:
                continue
            blocks, t = fn(n, threads)
            if t != threads or blocks * threads < n or (blocks - 1) * threads >= n:
                raise CheckError(
                    f"launch_config({n}, {threads}) = {(blocks, t)}: "
                    "must cover n with the fewest blocks"
                )
    for n, threads in ((10, limit + 1), (10, 0), (0, 32)):
        try:
            fn(n, threads)
        except ValueError:
            continue
        raise CheckError(f"launch_config({n}, {threads}) must raise ValueError")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_max_threads_per_block(impl):
    check_max_threads(impl.max_threads_per_block)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_launch_config(impl, rng):
    check_launch_config(impl.launch_config, rng)


def test_broken_versions_fail(rng):
    with pytest.raises(CheckError):
        check_max_threads(lambda: 512)  # a guess, not the device's value
    with pytest.raises(CheckError):  # floor division: leaves the tail uncovered
        check_launch_config(lambda n, t: (n // t, t), rng)
    with pytest.raises(CheckError):  # no limit check
        check_launch_config(lambda n, t: (-(-n // t), t), rng)


def test_device_query_main(tmp_path):
    assert load_chapter_module(CHAPTER, "device_query").main(["--out", str(tmp_path)]) == 0


def test_device_query_explains_every_simulator_limit():
    dq = load_chapter_module(CHAPTER, "device_query")
    explained = {key for key, _, _ in dq.EXPLAINED}
    assert set(dq.simulator_limits()) <= explained
