"""Timing a kernel: four common mistakes and the fix, each with its number.

mistake 1 time the first call: it includes Numba's JIT compile (Python -> PTX -> SASS)
mistake 2 host clock around the launch only: a launch returns before the GPU has run it
mistake 3 time the transfers with the kernel: cuda.to_device / copy_to_host dominate
fix     a CUDA events around the launch, after a warm-up (what common.timing.benchmark does)
fix     b host clock with cuda.synchronize() after the launch: right, plus launch overhead

The kernel is heavy_fma: ITERS dependent float32 FMAs an element, a few ms on a GPU.
Source: CUDA C++ Programming Guide, "Asynchronous Concurrent Execution" and "Events".

Run: python chapters/04_gpu_intro/timing_mistakes.py [--out runs/04_gpu_intro]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick
from common.checking import check
from common.timing import SIMULATOR_NOTE, readme_figures

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

MUL, ADD = np.float32(0.999), np.float32(0.001)


# ITERS dependent FMAs an element: compute-bound, so its time barely depends on memory.
@cuda.jit
def heavy_fma(x, out, iters):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        for _ in range(iters):
            v = v * MUL + ADD
        out[i] = v


def reference(x, iters):
    """float64 result of heavy_fma, in closed form: v -> m*v + a applied n times is
    m**n * v + a * (1 - m**n) / (1 - m) (a geometric series), so the check costs
    one pass instead of ITERS passes over the array."""
    m, a = np.float64(MUL), np.float64(ADD)
    mn = m**iters
    return x.astype(np.float64) * mn + a * (1 - mn) / (1 - m)


def host_ms(fn, repeats, sync):
    """Median host-clock time of fn() in ms; cuda.synchronize() before stopping if sync."""
    times = []
    for _ in range(repeats):
        cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    cuda.synchronize()
    return statistics.median(times)


def event_ms(fn, repeats):
    """Median GPU time of fn() in ms, between two CUDA events."""
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(n, iters, repeats=20):
    """Check heavy_fma, then run every way of timing it.

    Returns (relative error of the output against :func:`reference`, {label: ms});
    the dict is empty in the simulator.
    """
    rng = np.random.default_rng(0)
    x_host = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x = cuda.to_device(x_host)
    out = cuda.device_array_like(x)
    threads = 256
    grid = ceil_div(n, threads)
    launch = lambda: heavy_fma[grid, threads](x, out, iters)

    cuda.synchronize()
    t0 = time.perf_counter()
    launch()  # the first call compiles
    cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    err = check(out, reference(x_host, iters), tol=1e-5, name="heavy_fma")
    if is_simulator():
        return err, {}

    def with_transfers():
        xd = cuda.to_device(x_host)
        od = cuda.device_array_like(xd)
        heavy_fma[grid, threads](xd, od, iters)
        od.copy_to_host()

    for _ in range(3):
        launch()  # warm-up: clocks ramp up, caches and the launch path are primed
    return err, {
        "mistake 1: first call (includes JIT compile)": first_ms,
        "mistake 2: host clock, no synchronize": host_ms(launch, repeats, sync=False),
        "mistake 3: host clock, transfers included": host_ms(with_transfers, 5, sync=True),
        "fix a: CUDA events, after warm-up": event_ms(launch, repeats),
        "fix b: host clock + cuda.synchronize()": host_ms(launch, repeats, sync=True),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/04_gpu_intro", help="folder for timing_mistakes.json")
    args = parser.parse_args(argv)
    n = pick(gpu=1 << 24, simulator=64)
    iters = pick(gpu=2048, simulator=3)
    print(f"heavy_fma: n = {n:,} float32, {iters} FMAs an element")
    err, results = measure(n, iters)
    print(f"  output checked against the float64 closed form (a geometric series): "
          f"rel. error {err:.2g} (tolerance 1e-5)")
    if not results:
        print(f"  ({SIMULATOR_NOTE})")
        print(readme_figures(__file__).format())
    else:
        right = results["fix a: CUDA events, after warm-up"]
        for label, ms in results.items():
            print(f"  {label:<46} {ms:10.3f} ms  ({ms / right:8.2f}x the event time)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "timing_mistakes.json").write_text(
        json.dumps({"n": n, "iters": iters, "ms": results}, indent=2))
    print(f"wrote {out_dir / 'timing_mistakes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
