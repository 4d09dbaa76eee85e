"""Unified (managed) memory against explicit copies: 256 MiB onto the GPU, read once.

A managed array (cuda.managed_array) is one allocation that host code and kernels
both use through the same address; the driver moves its pages to whichever side
touches them (CUDA C++ Programming Guide, "Unified Memory Programming"). Every
version below ends the same way, with double_into reading the input once (out = 2 x,
out in device memory), and is checked against NumPy; they differ in where the input
starts and how it reaches the GPU:

version 1 device array: the input is in device memory already; the kernel alone (the floor)
version 2 to_device from pageable NumPy memory, then the kernel (section 6's copy)
version 3 to_device from pinned memory (cuda.pinned_array), then the kernel
version 4 managed, first touch: the pages are in host memory; the kernel's page faults move them
version 5 managed, prefetched: cuMemPrefetchAsync moves the pages to the GPU, then the kernel
version 6 managed, resident: the pages are on the GPU already; the kernel touches them again

Versions 4 and 5 must start every repetition with the pages in host memory, so
before each one the CPU writes the input into the managed array (untimed), as a
program whose host made the data would; each repetition is then timed alone
between two events. The others are timed by common.timing.benchmark. GB/s is input
bytes / time; "% of link" compares it with a pinned to_device alone (the host link's
practical rate), "% of copy" the device-resident versions with the GPU's own copy
bandwidth (their kernel reads and writes the array: 2 x its bytes).

Every managed allocation here is at most 1/16 of the GPU's free memory: managed
memory beyond what the GPU holds makes pages evict each other (thrashing), which
can stall a GPU for minutes.

Run: python chapters/04_gpu_intro/unified_memory.py [--out runs/04_gpu_intro]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import check, guarded
from common.harness import run_script, save_results, script_parser
from common.timing import Timing, benchmark, device_peaks, format_table, readme_figures

import statistics
from functools import partial

import numpy as np
from numba import cuda

MANAGED_BYTES = 256 << 20  # 256 MiB: large enough to time a transfer, tiny beside the GPU
TWO = np.float32(2.0)


# One thread an element: one load, one multiply, one store.
@cuda.jit(cache=True)
def double_into(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = TWO * x[i]


def launch_double(x, out, threads_per_block=256):
    """out = 2 x, float32 (n,) each: ``out`` a device array, ``x`` a device or a
    managed array (a kernel takes a managed array as it is: no copy is made)."""
    double_into[ceil_div(out.size, threads_per_block), threads_per_block](x, out)


def copy_then_double(host, staging, out):
    """Versions 2 and 3: copy ``host`` (pageable or pinned, float32 (n,)) into the device
    array ``staging``, then out = 2 staging."""
    cuda.to_device(host, to=staging)
    launch_double(staging, out)


# ---------------------------------------------------------------- prefetch


def prefetch_to_device(array):
    """Queue a move of a managed array's pages to the current GPU on the default stream.

    numba-cuda has no call for it, so this is the driver's ``cuMemPrefetchAsync``
    through ``cuda.bindings`` (CUDA Driver API, "Unified Addressing"). A no-op in the
    simulator, where a managed array is a NumPy array and nothing moves.

    Raises:
        RuntimeError: the driver refused (the message names its error, e.g. a GPU
            without concurrent managed access, as on Windows).
    """
    if is_simulator():
        return
    from cuda import bindings
    from cuda.bindings import driver

    major = int(bindings.__version__.split(".")[0])
    pointer = array.__cuda_array_interface__["data"][0]
    prefetch_call(driver, major, pointer, array.nbytes, cuda.get_current_device().id)


def prefetch_call(driver, major, pointer, nbytes, device_id):
    """``cuMemPrefetchAsync`` of ``nbytes`` at ``pointer`` to GPU ``device_id``, default
    stream, in either cuda-bindings major version. Both take the destination as a
    ``CUmemLocation`` plus flags; CUDA 13 calls it ``cuMemPrefetchAsync``, CUDA 12
    ``cuMemPrefetchAsync_v2`` (its ``cuMemPrefetchAsync`` takes a device ordinal).

    Raises:
        RuntimeError: the driver returned an error (its name in the message).
    """
    location = driver.CUmemLocation()
    location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = device_id
    call = driver.cuMemPrefetchAsync if major >= 13 else driver.cuMemPrefetchAsync_v2
    (err,) = call(driver.CUdeviceptr(pointer), nbytes, location, 0, driver.CUstream(0))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemPrefetchAsync failed: {getattr(err, 'name', err)}")


def prefetch_problem(managed):
    """None if :func:`prefetch_to_device` works on this GPU, else why not (one line)."""
    if is_simulator():
        return None
    if not cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
        return (
            "this GPU has no concurrent managed access (Windows, WSL, or before Pascal): "
            "the driver moves managed memory at each launch and refuses prefetches"
        )
    try:
        prefetch_to_device(managed)
        cuda.synchronize()
    except Exception as exc:  # the driver's error, or bindings without the call
        return f"cuMemPrefetchAsync through cuda.bindings failed ({exc})"
    return None


def prefetch_then_double(managed, out):
    """Version 5: prefetch the managed input to the GPU, then out = 2 managed."""
    prefetch_to_device(managed)
    launch_double(managed, out)


# ---------------------------------------------------------------- timing from host pages


def to_host_pages(managed, x_host):
    """Put ``managed``'s pages in host memory: the CPU writes ``x_host`` into it (pages
    on the GPU fault back; pages never touched are created on the host). The GPU must
    be idle first: a host access while a kernel runs is not allowed on every system."""
    cuda.synchronize()
    np.copyto(managed, x_host)


def time_from_host_pages(fn, managed, x_host, name, nbytes, repeats=5):
    """Time ``fn()`` ``repeats`` times, each starting with ``managed``'s pages in host
    memory (:func:`to_host_pages`, untimed) and timed alone between two CUDA events.

    common.timing.benchmark queues its calls back to back, so every call after the
    first would find the pages on the GPU already. One untimed call first (warm-up).
    Returns a :class:`Timing` (times in ms); in the simulator ``fn`` runs once and
    nothing is timed.
    """
    if is_simulator():
        to_host_pages(managed, x_host)
        fn()
        return Timing(name, nbytes=nbytes)
    times = []
    for _ in range(1 + repeats):
        to_host_pages(managed, x_host)
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = times[1:]
    return Timing(
        name,
        median_ms=statistics.median(times),
        p10_ms=float(np.percentile(times, 10)),
        p90_ms=float(np.percentile(times, 90)),
        repeats=repeats,
        nbytes=nbytes,
    )


# ---------------------------------------------------------------- run


def managed_array(n):
    """``cuda.managed_array(n, np.float32)``: float32 (n,) in managed memory, attached
    globally (any stream may use it). The simulator's ``numba.cuda`` has no
    ``managed_array``; its stand-in is a NumPy array, as here."""
    if is_simulator():
        return np.empty(n, np.float32)
    return cuda.managed_array(n, np.float32)


def managed_bytes():
    """Bytes of each array: MANAGED_BYTES, or 1/16 of the GPU's free memory if less."""
    if is_simulator():
        return 4 * 300
    free = cuda.current_context().get_memory_info().free
    return min(MANAGED_BYTES, free // 16) // 4 * 4


def check_and_time(name, launcher, reference, managed, x_host, from_host_pages, repeats=10):
    """Check ``launcher(out)`` against ``reference`` (float64 (n,)) in a poisoned
    float32 output inside guard cells (common.checking.guarded), then time it: one
    call at a time from host pages (versions that read ``managed`` first-hand,
    :func:`time_from_host_pages`), or by ``benchmark``.

    Returns:
        The :class:`Timing`, with ``extra["rel_error"]`` set.

    Raises:
        CheckError: the output is wrong, or a write landed outside it.
    """
    guard = guarded(reference.shape, np.float32)  # poisoned, inside poisoned guard cells
    out = guard.array
    if from_host_pages:
        to_host_pages(managed, x_host)
    launcher(out)
    err = check(out, reference, tol=0.0, name=name)
    guard.check_untouched(name)
    nbytes = 4 * reference.size
    if from_host_pages:
        t = time_from_host_pages(
            partial(launcher, out), managed, x_host, name, nbytes, repeats=max(1, repeats // 2)
        )
    else:
        t = benchmark(partial(launcher, out), name, nbytes=nbytes, repeats=repeats, peaks={})
    t.extra["rel_error"] = err
    return t


def run(n, rng, repeats=10):
    """Check every version at n float32, then time it.

    Returns (Timings, GB/s of a pinned to_device alone (None in the simulator), and
    None or why version 5 was left out).
    """
    nbytes = 4 * n
    x_host = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    reference = 2.0 * x_host.astype(np.float64)
    pinned = cuda.pinned_array(n, np.float32)
    pinned[:] = x_host
    x_dev = cuda.to_device(x_host)
    staging = cuda.device_array(n, np.float32)
    managed = managed_array(n)
    np.copyto(managed, x_host)
    no_prefetch = prefetch_problem(managed)

    versions = {  # name -> (launcher of out, starts from host pages)
        "1 device array, kernel only": (partial(launch_double, x_dev), False),
        "2 to_device from pageable + kernel": (partial(copy_then_double, x_host, staging), False),
        "3 to_device from pinned + kernel": (partial(copy_then_double, pinned, staging), False),
        "4 managed, first touch (faults)": (partial(launch_double, managed), True),
        "5 managed, prefetch + kernel": (partial(prefetch_then_double, managed), True),
        "6 managed, resident, kernel only": (partial(launch_double, managed), False),
    }
    if no_prefetch:
        del versions["5 managed, prefetch + kernel"]
        print(f"  version 5 left out: {no_prefetch}")
    results = [
        check_and_time(name, launcher, reference, managed, x_host, from_host_pages, repeats)
        for name, (launcher, from_host_pages) in versions.items()
    ]
    link = benchmark(partial(cuda.to_device, pinned, to=staging), "link", nbytes=nbytes, peaks={})
    return results, link.gbps, no_prefetch


def table(results, link_gbps, copy_gbps):
    """The GPU table: each version's time, GB/s and the share of the link or of copy."""
    rows = []
    for r in results:
        resident = r.name.startswith(("1 ", "6 "))
        rows.append(
            [
                r.name,
                f"{r.median_ms:.3f}",
                f"{r.p10_ms:.3f}-{r.p90_ms:.3f}",
                f"{r.gbps:,.1f}",
                "-" if resident else f"{100 * r.gbps / link_gbps:.0f}%",
                f"{100 * 2 * r.gbps / copy_gbps:.0f}%" if resident else "-",
            ]
        )
    return format_table(
        rows,
        header=["version", "median ms", "p10-p90 ms", "GB/s", "% of link", "% of copy"],
        align="<>>>>>",
    )


def main(argv=None):
    args = script_parser(__doc__, "04_gpu_intro").parse_args(argv)
    nbytes = managed_bytes()
    n = nbytes // 4
    rng = np.random.default_rng(0)
    size = f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"
    print(
        f"{n:,} float32 ({size}) read once by double_into; every version "
        "is checked against NumPy in float64 (exact: 2 x is exact in float32)"
    )
    results, link_gbps, no_prefetch = run(n, rng)
    if not results[0].measured:
        print(format_table(results))
        print(
            "simulator: a managed array is a NumPy array there; page faults, migration "
            "and prefetch exist only on a GPU, so these checks are all it shows"
        )
        print(readme_figures(__file__).format())
        save_results(results, args.out, "unified_memory", nbytes=nbytes)
        return 0
    peaks = device_peaks()
    print(
        f"  on {peaks['device']}; link: a pinned to_device alone moves {link_gbps:,.1f} GB/s; "
        f"copy: {peaks['copy_gbps']:,.0f} GB/s inside the GPU"
    )
    print(table(results, link_gbps, peaks["copy_gbps"]))
    save_results(
        results,
        args.out,
        "unified_memory",
        nbytes=nbytes,
        link_gbps=link_gbps,
        no_prefetch=no_prefetch,
    )
    return 0


if __name__ == "__main__":
    run_script(main)
