"""Chapter 4: the typical GPU program and event timing; broken versions that must
fail the checks; the chapter scripts at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import CheckError, Guarded, check, hostile_sizes, poison_value, random_array
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches
from common.timing import benchmark

import contextlib
import functools
import time

import numpy as np
import pytest
from numba import cuda

CHAPTER = "04_gpu_intro"


@contextlib.contextmanager
def guarded_allocations():
    """Every device array made inside (cuda.to_device, device_array, device_array_like)
    is a view inside a poisoned buffer (as common.checking.guarded); on leaving, each
    buffer's guard cells must be untouched. For functions that allocate their own
    outputs: a write past the end raises IndexError in the simulator but is silent
    on a GPU, where only the guard cells show it."""
    made = []
    real = cuda.to_device, cuda.device_array, cuda.device_array_like

    def device_array(shape, dtype=np.float32, *args, **kwargs):
        # common.checking.guarded, built on the real cuda.to_device (it calls
        # cuda.to_device itself, which is replaced here)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n, pad = int(np.prod(shape)), 64
        buf = real[0](np.full(n + 2 * pad, poison_value(dtype), dtype=dtype))
        view = buf[pad : pad + n]
        g = Guarded(
            array=view if len(shape) == 1 else view.reshape(shape),
            _buffer=buf,
            _start=pad,
            _stop=pad + n,
        )
        made.append(g)
        return g.array

    def to_device(host, *args, **kwargs):
        host = np.asarray(host)
        out = device_array(host.shape, host.dtype)
        out.copy_to_device(np.ascontiguousarray(host))
        return out

    def device_array_like(a, *args, **kwargs):
        return device_array(a.shape, a.dtype)

    cuda.to_device, cuda.device_array, cuda.device_array_like = (
        to_device,
        device_array,
        device_array_like,
    )
    try:
        yield made
    finally:
        cuda.to_device, cuda.device_array, cuda.device_array_like = real
    for g in made:
        g.check_untouched("an array allocated inside the function")


def check_gpu_roundtrip(fn, rng):
    # Exact multiples of the block too: a grid of n // block + 1 blocks is one too
    # many only there.
    for n in hostile_sizes(128, rng) + [128, 256]:
        x = random_array(n, rng=rng)
        x_before = x.copy()
        alpha = float(rng.uniform(-3, 3))
        with (
            float32_pure_launches(),
            guarded_allocations(),
        ):  # alpha must reach the kernel as float32
            got = fn(x, alpha)
        if not isinstance(got, np.ndarray):
            raise CheckError(f"gpu_roundtrip must return a NumPy array, got {type(got)}")
        if got.dtype != np.float32:
            raise CheckError(f"gpu_roundtrip must return float32, got {got.dtype}")
        check(got, alpha * x.astype(np.float64), tol=1e-6, name=f"gpu_roundtrip n={n}")
        if not np.array_equal(x, x_before):
            raise CheckError("gpu_roundtrip modified its input")


class _EventLog:
    """Stand-ins for cuda.event, cuda.synchronize and cuda.event_elapsed_time that
    log, in order, every call of the timed function, event record, synchronize and
    elapsed-time read; each read returns a distinct time (ms) so the check can tell
    that what the function returns are those reads."""

    def __init__(self):
        self.log = []
        self.readings = []

    def event(self, *args, **kwargs):
        return _FakeEvent(self)

    def synchronize(self):
        self.log.append(("device-sync",))

    def elapsed(self, start, end):
        self.log.append(("elapsed", start, end))
        ms = 1.0 + 0.125 * len(self.readings)
        self.readings.append(ms)
        return ms


class _FakeEvent:
    def __init__(self, owner):
        self.owner = owner

    def record(self, stream=0):
        self.owner.log.append(("record", self))

    def synchronize(self):
        self.owner.log.append(("sync", self))

    def wait(self, stream=0):
        pass  # orders a stream after the event; the host does not wait

    def query(self):
        return True

    def elapsed_time(self, end):
        return self.owner.elapsed(self, end)


def check_time_with_events(time_fn, rng, repeats=4):
    """The first call (which compiles) is not timed; every time read comes after its
    end event was synchronized; each of the ``repeats`` calls is timed between two
    recorded events; the times returned are the elapsed-time reads."""
    events = _EventLog()
    n = 64
    x = cuda.to_device(random_array(n, rng=rng))
    out = cuda.device_array_like(x)
    sol = load_chapter_module(CHAPTER, "solutions")

    def fn():
        events.log.append(("call",))
        sol.scale_kernel[1, 64](x, np.float32(2), out)

    real = cuda.event, cuda.synchronize
    real_elapsed = getattr(cuda, "event_elapsed_time", None)  # not in the simulator
    cuda.event, cuda.synchronize = events.event, events.synchronize
    cuda.event_elapsed_time = events.elapsed
    try:
        times = time_fn(fn, repeats=repeats)
    finally:
        cuda.event, cuda.synchronize = real
        if real_elapsed is None:
            del cuda.event_elapsed_time
        else:
            cuda.event_elapsed_time = real_elapsed
    log = events.log
    calls = [k for k, entry in enumerate(log) if entry[0] == "call"]
    if len(times) != repeats:
        raise CheckError(f"expected {repeats} times, got {len(times)}")
    if [float(t) for t in times] != events.readings or not all(isinstance(t, float) for t in times):
        raise CheckError(
            f"the times returned ({times}) are not the events' elapsed times "
            f"({events.readings}): read each one with start.elapsed_time(end)"
        )
    timed = set()
    for k, entry in enumerate(log):
        if entry[0] != "elapsed":
            continue
        start, end = entry[1], entry[2]
        recs = {
            e: max((j for j in range(k) if log[j] == ("record", e)), default=None)
            for e in (start, end)
        }
        if None in recs.values() or recs[start] > recs[end]:
            raise CheckError(
                "elapsed_time read between events that were not both recorded, start before end"
            )
        synced = any(log[j] in (("sync", end), ("device-sync",)) for j in range(recs[end] + 1, k))
        if not synced:
            raise CheckError(
                "elapsed_time was read before the end event was waited for: call "
                "end.synchronize() after end.record() (the launch is asynchronous; on a GPU "
                "the read fails or the kernel is still running)"
            )
        timed |= {c for c in calls if recs[start] < c < recs[end]}
    if calls and calls[0] in timed:
        raise CheckError(
            "the first call of fn is timed: it includes the JIT compile (hundreds of ms). "
            "Call fn() once before timing"
        )
    if len(timed) < repeats:
        raise CheckError(f"{len(timed)} calls timed between events, expected {repeats}")


def check_times_a_slow_kernel(time_fn):
    """GPU only: a kernel of a few ms must measure a few ms, not the launch time."""
    script = load_chapter_module(CHAPTER, "timing_mistakes")
    n, iters = 1 << 22, 4096
    x = cuda.to_device(np.ones(n, np.float32))
    out = cuda.device_array_like(x)
    launch = functools.partial(script.heavy_fma[ceil_div(n, 256), 256], x, iters, out)
    expected = benchmark(launch, "heavy_fma", repeats=5).median_ms  # the course's event timer
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
    sol.scale_kernel[ceil_div(x.size, threads_per_block), threads_per_block](
        x, np.float32(alpha), out
    )
    return out  # a device array, not the host result


def _roundtrip_too_few_blocks(x_host, alpha, threads_per_block=128):
    sol = load_chapter_module(CHAPTER, "solutions")
    x = cuda.to_device(x_host)
    out = cuda.to_device(np.full_like(x_host, np.nan))
    sol.scale_kernel[x.size // threads_per_block or 1, threads_per_block](x, np.float32(alpha), out)
    return out.copy_to_host()


def _roundtrip_python_float_alpha(x_host, alpha, threads_per_block=128):
    sol = load_chapter_module(CHAPTER, "solutions")
    x = cuda.to_device(x_host)
    out = cuda.device_array_like(x)
    # alpha stays a Python float: the kernel multiplies in float64 (right values here)
    sol.scale_kernel[ceil_div(x.size, threads_per_block), threads_per_block](x, alpha, out)
    return out.copy_to_host()


@cuda.jit
def _scale_no_bounds_check(x, alpha, out):
    i = cuda.grid(1)
    out[i] = alpha * x[i % x.size]  # threads past the end write past the end of out


def _roundtrip_no_bounds_check(x_host, alpha, threads_per_block=128):
    x = cuda.to_device(x_host)
    out = cuda.device_array_like(x)
    _scale_no_bounds_check[ceil_div(x.size, threads_per_block), threads_per_block](
        x, np.float32(alpha), out
    )
    return out.copy_to_host()


@pytest.mark.parametrize(
    "broken",
    [_roundtrip_forgets_copy_back, _roundtrip_too_few_blocks, _roundtrip_python_float_alpha],
)
def test_broken_roundtrip_fails(broken, rng):
    with pytest.raises(CheckError):
        check_gpu_roundtrip(broken, rng)


def test_roundtrip_writing_past_the_end_fails(rng):
    # The simulator raises IndexError; on a GPU the guard cells around the
    # allocation show the stray writes.
    with pytest.raises((CheckError, IndexError)):
        check_gpu_roundtrip(_roundtrip_no_bounds_check, rng)


def test_guarded_allocations_see_a_write_past_the_end():
    # Without the simulator's IndexError: a write into the padding, as a GPU makes it.
    with pytest.raises(CheckError, match="outside"):
        with guarded_allocations() as made:
            cuda.device_array(5, np.float32)
            buf = made[0]._buffer
            buf[made[0]._stop] = 1.0  # the first guard cell past the end


def _host_clock_no_sync(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _time_without_warmup(fn, repeats=10):
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(repeats):  # the first timed call includes the compile
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _time_without_sync(fn, repeats=10):
    fn()
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        times.append(start.elapsed_time(end))  # end not reached yet on a GPU
    return times


def _time_all_calls_between_two_events(fn, repeats=10):
    fn()
    start, end = cuda.event(), cuda.event()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return [start.elapsed_time(end) / repeats] * repeats  # one average, not each call


@pytest.mark.parametrize(
    "broken",
    [
        _time_without_warmup,
        _time_without_sync,
        _time_all_calls_between_two_events,
        _host_clock_no_sync,
    ],
)
def test_broken_timing_fails(broken, rng):
    with pytest.raises(CheckError):
        check_time_with_events(broken, rng)


@pytest.mark.gpu
def test_host_clock_without_sync_fails_on_gpu():
    with pytest.raises(CheckError):
        check_times_a_slow_kernel(_host_clock_no_sync)


# ------------------------------------------------------------------ the chapter scripts


# The chapter's scripts run once, in tests/test_scripts_simulator_output.py.


def test_transfer_plot_and_crossover(tmp_path):
    script = load_chapter_module(CHAPTER, "transfer_vs_compute")
    rows = [
        {
            "op": "poly_eval",
            "n": n,
            "cpu_ms": n / 1e3,
            "h2d_ms": 0.01 + n / 1e5,
            "kernel_ms": 0.005,
            "d2h_ms": 0.01 + n / 1e5,
        }
        for n in (10, 100, 1000, 10000)
    ]
    assert script.crossover(rows) == 100
    script.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
