"""Chapter 4, unified_memory.py: every version reads the input right at hostile sizes;
the prefetch speaks both cuda-bindings versions' signatures; the first-touch timing
really starts every timed call from host pages; managed allocations stay far below
the GPU's free memory; and the broken versions the checks exist to fail: no bounds
check, a copy forgotten, a first-touch timer that lets the pages stay on the GPU.

The script's main() runs in tests/test_scripts_simulator_output.py."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, hostile_sizes, poisoned
from common.internal.exercises import load_chapter_module

import types
from functools import partial

import numpy as np
import pytest
from mutants import mutant

script = load_chapter_module("04_gpu_intro", "unified_memory")


def _inputs(n, rng):
    x_host = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    managed = script.managed_array(n)
    np.copyto(managed, x_host)
    return x_host, managed


def test_double_into_reads_a_managed_array(rng):
    for n in hostile_sizes(256, rng):
        x_host, managed = _inputs(n, rng)
        out = guarded(n)
        script.launch_double(managed, out.array)
        check(out.array, 2.0 * x_host.astype(np.float64), tol=0.0, name=f"n={n}")
        out.check_untouched(f"n={n}")


@pytest.mark.parametrize("n", [1, 255, 257])
def test_every_version_is_checked(n, rng):
    results, _, _ = script.run(n, rng, repeats=2)
    assert [r.name[0] for r in results] == list("123456")
    assert all(r.extra["rel_error"] == 0 for r in results)


# ------------------------------------------------------------------ prefetch


class _FakeDriver:
    """The parts of cuda.bindings.driver that prefetch_call uses; each call is logged."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
    CUmemLocation = types.SimpleNamespace

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def _call(self, name, *args):
        self.calls.append((name, args))
        return (self.result,)

    def cuMemPrefetchAsync(self, *args):
        return self._call("cuMemPrefetchAsync", *args)

    def cuMemPrefetchAsync_v2(self, *args):
        return self._call("cuMemPrefetchAsync_v2", *args)

    @staticmethod
    def CUstream(handle):
        return ("stream", handle)

    @staticmethod
    def CUdeviceptr(pointer):
        return ("pointer", pointer)


@pytest.mark.parametrize(
    "major, called",
    [(13, "cuMemPrefetchAsync"), (12, "cuMemPrefetchAsync_v2")],
    ids=["CUDA 13", "CUDA 12"],
)
def test_prefetch_speaks_each_bindings_version(major, called):
    # both take (pointer, bytes, CUmemLocation, flags, stream); CUDA 12's plain
    # cuMemPrefetchAsync takes a device ordinal instead, and must not be called
    driver = _FakeDriver()
    script.prefetch_call(driver, major, 4096, 1 << 20, 3)
    [(name, args)] = driver.calls
    assert name == called
    pointer, nbytes, location, flags, stream = args
    assert (pointer, nbytes, flags, stream) == (("pointer", 4096), 1 << 20, 0, ("stream", 0))
    assert (location.type, location.id) == ("device", 3)


def test_prefetch_error_names_the_driver_error():
    error = types.SimpleNamespace(name="CUDA_ERROR_INVALID_DEVICE")
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_DEVICE"):
        script.prefetch_call(_FakeDriver(result=error), 13, 4096, 4096, 0)


# ------------------------------------------------------------------ timing from host pages


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream=0):
        self.log.append("record")

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1.0


def check_every_timed_call_starts_from_host_pages(timer, monkeypatch, repeats=3):
    """``timer(fn, managed, x_host, name, nbytes, repeats)`` with the GPU path taken
    (events faked): every call, timed or not, must follow a to_host_pages, and each
    timed one sit alone between its own two recorded events."""
    log = []
    monkeypatch.setattr(script, "is_simulator", lambda: False)
    monkeypatch.setattr(script, "to_host_pages", lambda managed, x_host: log.append("host pages"))
    monkeypatch.setattr(script.cuda, "event", lambda *a, **k: _Event(log), raising=False)
    t = timer(lambda: log.append("call"), None, None, "v4", 4, repeats=repeats)
    calls = [k for k, entry in enumerate(log) if entry == "call"]
    for k in calls:
        before = [entry for entry in log[:k] if entry != "record"]
        if not before or before[-1] != "host pages":
            raise CheckError(f"a call without the pages put back in host memory first: {log}")
    timed = [k for k in calls if log[k - 1] == "record" and log[k + 1 : k + 2] == ["record"]]
    if len(timed) < repeats:
        raise CheckError(f"{len(timed)} calls between their own events, expected {repeats}")
    if t.repeats != repeats or t.median_ms != 1.0:
        raise CheckError(f"the Timing does not hold the {repeats} event times: {t}")


def test_first_touch_timing_starts_from_host_pages(monkeypatch):
    check_every_timed_call_starts_from_host_pages(script.time_from_host_pages, monkeypatch)


def _time_with_pages_put_back_once(fn, managed, x_host, name, nbytes, repeats=5):
    # as benchmark would: after the first call the pages are on the GPU already
    script.to_host_pages(managed, x_host)
    for _ in range(repeats + 1):
        start, end = script.cuda.event(), script.cuda.event()
        start.record()
        fn()
        end.record()
    return script.Timing(name, median_ms=1.0, repeats=repeats, nbytes=nbytes)


def test_timer_that_puts_pages_back_once_fails(monkeypatch):
    with pytest.raises(CheckError, match="host pages"):
        check_every_timed_call_starts_from_host_pages(_time_with_pages_put_back_once, monkeypatch)


@pytest.mark.parametrize("free_gib, expected_mib", [(80, 256), (1, 64)])
def test_managed_allocation_stays_far_below_free_memory(monkeypatch, free_gib, expected_mib):
    context = types.SimpleNamespace(
        get_memory_info=lambda: types.SimpleNamespace(free=free_gib << 30, total=80 << 30)
    )
    monkeypatch.setattr(script, "is_simulator", lambda: False)
    monkeypatch.setattr(script.cuda, "current_context", lambda: context, raising=False)
    assert script.managed_bytes() == expected_mib << 20


# ------------------------------------------------------------------ broken versions must fail


def _check_version(launcher, rng, from_host_pages=False, n=250):
    # n = 250: the last block's 6 spare threads stay inside the 64 guard cells on a GPU
    x_host, managed = _inputs(n, rng)
    script.check_and_time(
        "broken",
        partial(launcher, managed) if from_host_pages else launcher,
        2.0 * x_host.astype(np.float64),
        managed,
        x_host,
        from_host_pages,
        repeats=2,
    )


def test_kernel_without_bounds_check_fails(monkeypatch, rng):
    broken = mutant(
        script.double_into,
        ("    if i < out.size:\n        out[i] = TWO * x[i]", "    out[i] = TWO * x[i]"),
    )
    monkeypatch.setattr(script, "double_into", broken)
    with pytest.raises((CheckError, IndexError)):
        _check_version(script.launch_double, rng, from_host_pages=True)


def test_version_that_forgets_the_copy_fails(rng):
    staging = poisoned(257, np.float32)  # never copied into
    x_host = rng.uniform(-1.0, 1.0, 257).astype(np.float32)

    def kernel_without_copy(out):
        script.launch_double(staging, out)

    with pytest.raises(CheckError):
        script.check_and_time(
            "no copy", kernel_without_copy, 2.0 * x_host.astype(np.float64), None, x_host, False
        )
