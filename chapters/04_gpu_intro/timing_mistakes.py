"""Timing a kernel: four common mistakes and the fix, each with its number.

mistake 1 time the first call: it includes Numba's JIT compile (Python -> PTX -> SASS)
mistake 2 host clock around the launch only: a launch returns before the GPU has run it
mistake 3 time the transfers with the kernel: cuda.to_device / copy_to_host dominate
fix     a CUDA events around the launch, after a warm-up (what common.timing.benchmark does)
fix     b host clock with cuda.synchronize() after the launch: right, plus launch overhead

The kernel is heavy_fma, chapter 3's fma_chain_f32: ITERS dependent float32 FMAs an
element, a few ms on a GPU. Source: CUDA C++ Programming Guide, "Asynchronous Concurrent Execution" and "Events".

Run: python chapters/04_gpu_intro/timing_mistakes.py [--out runs/04_gpu_intro]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, load_chapter_module, pick, random_array
from common.checking import check
from common.harness import run_script, save_results, script_parser
from common.timing import SIMULATOR_NOTE, Timing, benchmark, readme_figures

import statistics
import time
from functools import partial

import numpy as np
from numba import cuda

float64_promotion = load_chapter_module("03_python_for_kernels", "float64_promotion")
# heavy_fma(x, iters, out): ITERS dependent FMAs an element: compute-bound, so its time
# barely depends on memory. fma_chain_reference(x, iters) is its float64 result.
heavy_fma = float64_promotion.fma_chain_f32


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


def measure(n, iters, repeats=20):
    """Check heavy_fma, then run every way of timing it.

    Returns (relative error of the output against its float64 closed form,
    {label: ms}); the dict is empty in the simulator.
    """
    x_host = random_array(n, rng=np.random.default_rng(0), low=0.5, high=1.5)
    x = cuda.to_device(x_host)
    out = cuda.device_array_like(x)
    threads = 256
    grid = ceil_div(n, threads)
    launch = partial(heavy_fma[grid, threads], x, iters, out)

    cuda.synchronize()
    t0 = time.perf_counter()
    launch()  # the first call compiles
    cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    err = check(
        out, float64_promotion.fma_chain_reference(x_host, iters), tol=1e-5, name="heavy_fma"
    )
    if is_simulator():
        return err, {}

    def with_transfers():
        xd = cuda.to_device(x_host)
        od = cuda.device_array_like(xd)
        heavy_fma[grid, threads](xd, iters, od)
        od.copy_to_host()

    for _ in range(3):
        launch()  # warm-up: clocks ramp up, caches and the launch path are primed
    return err, {
        "mistake 1: first call (includes JIT compile)": first_ms,
        "mistake 2: host clock, no synchronize": host_ms(launch, repeats, sync=False),
        "mistake 3: host clock, transfers included": host_ms(with_transfers, 5, sync=True),
        # the course's benchmark: CUDA events around each call, after a warm-up
        "fix a: CUDA events, after warm-up": benchmark(launch, "fix a", repeats=repeats).median_ms,
        "fix b: host clock + cuda.synchronize()": host_ms(launch, repeats, sync=True),
    }


def main(argv=None):
    args = script_parser(__doc__, "04_gpu_intro").parse_args(argv)
    n = pick(gpu=1 << 24, simulator=64)
    iters = pick(gpu=2048, simulator=3)
    print(f"heavy_fma: n = {n:,} float32, {iters} FMAs an element")
    err, results = measure(n, iters)
    print(
        f"  output checked against the float64 closed form (a geometric series): "
        f"rel. error {err:.2g} (tolerance 1e-5)"
    )
    if not results:
        print(f"  ({SIMULATOR_NOTE})")
        print(readme_figures(__file__).format())
    else:
        right = results["fix a: CUDA events, after warm-up"]
        for label, ms in results.items():
            print(f"  {label:<46} {ms:10.3f} ms  ({ms / right:8.2f}x the event time)")
    save_results(
        [Timing(label, median_ms=ms) for label, ms in results.items()],
        args.out,
        "timing_mistakes",
        n=n,
        iters=iters,
    )
    return 0


if __name__ == "__main__":
    run_script(main)
