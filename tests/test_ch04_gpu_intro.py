"""Chapter 4: the typical GPU program and event timing; broken versions that must
fail the checks; the chapter scripts at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import CheckError, check, hostile_sizes, random_array
from common.exercises import implementations, load_chapter_module

import time

import numpy as np
import pytest
from numba import cuda

CHAPTER = "04_gpu_intro"


def check_gpu_roundtrip(fn, rng):
    for n in hostile_sizes(128, rng):
        x = random_array(n, rng=rng)
        x_before = x.copy()
        alpha = float(rng.uniform(-3, 3))
        got = fn(x, alpha)
        if not isinstance(got, np.ndarray):
            raise CheckError(f"gpu_roundtrip must return a NumPy array, got {type(got)}")
        if got.dtype != np.float32:
            raise CheckError(f"gpu_roundtrip must return float32, got {got.dtype}")
        check(got, alpha * x.astype(np.float64), tol=1e-6, name=f"gpu_roundtrip n={n}")
        if not np.array_equal(x, x_before):
            raise CheckError("gpu_roundtrip modified its input")


def check_time_with_events(time_fn, rng):
    calls = []
    n = 64
    x = cuda.to_device(random_array(n, rng=rng))
    out = cuda.device_array_like(x)
    sol = load_chapter_module(CHAPTER, "solutions")

    def fn():
        calls.append(1)
        sol.scale_kernel[1, 64](x, np.float32(2), out)

    times = time_fn(fn, repeats=4)
    if len(times) != 4 or len(calls) < 4:
        raise CheckError(f"expected 4 times from >= 4 calls, got {len(times)} from {len(calls)}")
    if not all(isinstance(t, float) for t in times):
        raise CheckError(f"times must be floats (ms), got {times}")


def check_times_a_slow_kernel(time_fn):
    """GPU only: a kernel of a few ms must measure a few ms, not the launch time."""
    script = load_chapter_module(CHAPTER, "timing_mistakes")
    n, iters = 1 << 22, 4096
    x = cuda.to_device(np.ones(n, np.float32))
    out = cuda.device_array_like(x)
    launch = lambda: script.heavy_fma[ceil_div(n, 256), 256](x, out, iters)
    launch()
    expected = script.event_ms(launch, 5)
    got = float(np.median(time_fn(launch, repeats=5)))
    if not 0.5 * expected < got < 2 * expected:
        raise CheckError(f"measured {got:.3f} ms for a kernel that takes {expected:.3f} ms")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_gpu_roundtrip(impl, rng):
    check_gpu_roundtrip(impl.gpu_roundtrip, rng)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_time_with_events(impl, rng):
    check_time_with_events(impl.time_with_events, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_time_with_events_on_gpu(impl):
    check_times_a_slow_kernel(impl.time_with_events)


def test_gpu_roundtrip_rejects_float64():
    sol = load_chapter_module(CHAPTER, "solutions")
    with pytest.raises(TypeError, match="float32"):
        sol.gpu_roundtrip(np.ones(4), 2.0)


# ------------------------------------------------------------------ broken versions must fail


def _roundtrip_forgets_copy_back(x_host, alpha, threads_per_block=128):
    sol = load_chapter_module(CHAPTER, "solutions")
    x = cuda.to_device(x_host)
    out = cuda.device_array_like(x)
    sol.scale_kernel[ceil_div(x.size, threads_per_block), threads_per_block](x, np.float32(alpha), out)
    return out  # a device array, not the host result


def _roundtrip_too_few_blocks(x_host, alpha, threads_per_block=128):
    sol = load_chapter_module(CHAPTER, "solutions")
    x = cuda.to_device(x_host)
    out = cuda.to_device(np.full_like(x_host, np.nan))
    sol.scale_kernel[x.size // threads_per_block or 1, threads_per_block](x, np.float32(alpha), out)
    return out.copy_to_host()


@pytest.mark.parametrize("broken", [_roundtrip_forgets_copy_back, _roundtrip_too_few_blocks])
def test_broken_roundtrip_fails(broken, rng):
    with pytest.raises(CheckError):
        check_gpu_roundtrip(broken, rng)


def _host_clock_no_sync(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


@pytest.mark.gpu
def test_host_clock_without_sync_fails_on_gpu():
    with pytest.raises(CheckError):
        check_times_a_slow_kernel(_host_clock_no_sync)


# ------------------------------------------------------------------ the chapter scripts


@pytest.mark.parametrize("script", ["timing_mistakes", "transfer_vs_compute"])
def test_script_main(script, tmp_path):
    assert load_chapter_module(CHAPTER, script).main(["--out", str(tmp_path)]) == 0


def test_transfer_plot_and_crossover(tmp_path):
    script = load_chapter_module(CHAPTER, "transfer_vs_compute")
    rows = [{"op": "poly_eval", "n": n, "cpu_ms": n / 1e3, "h2d_ms": 0.01 + n / 1e5,
             "kernel_ms": 0.005, "d2h_ms": 0.01 + n / 1e5} for n in (10, 100, 1000, 10000)]
    assert script.crossover(rows) == 100
    script.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
