"""Counting with many threads: a plain `+=` loses updates, cuda.atomic.add does not.

version 1 count_above_plain: every thread whose element passes does counter[0] += 1
          (read, add, write: two threads that read the same old value both write old + 1)
version 2 count_above_atomic: cuda.atomic.add(counter, 0, 1), a read-modify-write the
          memory system performs as one indivisible step (CUDA C++ Programming Guide,
          "Atomic Functions")

On a GPU version 1 is wrong on every run. In the simulator the race detector
(chapter 06) reports version 1's race on every launch; the counting runs that show
the lost updates are marked as intentional races, and run inside
common.runtime.interleaved_threads() so that simulated threads switch often.

Run: python chapters/05_first_kernels/atomics_counter.py [--out runs/05_first_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import RaceError, ceil_div, intentional_race, is_simulator, pick
from common.harness import run_script, save_results, script_parser
from common.runtime import interleaved_threads
from common.timing import benchmark, device_peaks, format_table, readme_figures

import sys
from functools import partial

import numpy as np
from numba import cuda


# version 1: a data race. The barrier lines up every thread of the block (as a warp is
# lined up on a GPU) so that, in the simulator too, many threads reach the += at once.
@cuda.jit(cache=True)
def count_above_plain(x, threshold, counter):
    i = cuda.grid(1)
    cuda.syncthreads()
    if i < x.size and x[i] > threshold:
        counter[0] += 1


# version 2: the same with an atomic add; all passing threads serialize on one address.
@cuda.jit(cache=True)
def count_above_atomic(x, threshold, counter):
    i = cuda.grid(1)
    cuda.syncthreads()
    if i < x.size and x[i] > threshold:
        cuda.atomic.add(counter, 0, 1)


def count(kernel, x, threshold, threads_per_block=256):
    """Run ``kernel`` on device array x (float32 (n,)); return the int count."""
    counter = cuda.to_device(np.zeros(1, dtype=np.int32))
    kernel[ceil_div(x.size, threads_per_block), threads_per_block](
        x, np.float32(threshold), counter
    )
    return int(counter.copy_to_host()[0])


def main(argv=None):
    args = script_parser(__doc__, "05_first_kernels").parse_args(argv)
    n = pick(gpu=1 << 24, simulator=512)
    runs = pick(gpu=5, simulator=3)  # the simulator's interleaved runs take ~1 s each
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal(n).astype(np.float32)
    threshold = 0.0
    expected = int((x_host > threshold).sum())
    x = cuda.to_device(x_host)
    print(
        f"count of x > {threshold:g} over n = {n:,} normal samples; right answer {expected:,} "
        "(NumPy's count)"
    )
    print(
        "version 1 races on purpose: counter[0] += 1 is a read, an add and a write, so two\n"
        "  threads that read the same old value both write old + 1, and a count is lost"
    )
    print(
        "on a GPU expect version 1 wrong in every run, with most updates lost; the simulator\n"
        "  switches between its Python threads only every microsecond, so it loses fewer, and\n"
        "  a run can come out right by chance"
    )
    if is_simulator():
        try:
            count(count_above_plain, x, threshold)
            print("  the simulator's race detector missed version 1", file=sys.stderr)
            return 1
        except RaceError as e:
            print(f"the simulator's race detector on version 1:\n  {e}")
    with interleaved_threads():
        with intentional_race("version 1 is the lost-update demonstration"):
            plain = [count(count_above_plain, x, threshold) for _ in range(runs)]
        atomic = [count(count_above_atomic, x, threshold) for _ in range(runs)]
    wrong = sum(c != expected for c in plain)
    print(
        f"  1 plain +=        : {', '.join(f'{c:,}' for c in plain)}  "
        f"(wrong in {wrong} of {runs} runs)"
    )
    if any(c != expected for c in atomic):
        print(f"  2 cuda.atomic.add : {', '.join(f'{c:,}' for c in atomic)}")
        print("FAILED: the atomic count is wrong", file=sys.stderr)
        return 1
    print(f"  2 cuda.atomic.add : {expected:,} in every run  OK")
    if wrong == 0:
        print("  (the race did not show this time; it is still a bug)")

    peaks = device_peaks()
    results = []
    if is_simulator():  # nothing to time here: the racing launches above are the demo
        print(readme_figures(__file__).format())
    else:
        counter = cuda.to_device(np.zeros(1, dtype=np.int32))
        grid, block = ceil_div(n, 256), 256
        results = [
            benchmark(
                partial(kernel[grid, block], x, np.float32(threshold), counter),
                name,
                nbytes=4 * n,
                peaks=peaks,
            )
            for name, kernel in (
                ("1 plain += (wrong)", count_above_plain),
                ("2 cuda.atomic.add", count_above_atomic),
            )
        ]
        print(format_table(results, title="cost of the atomic (half the threads hit one address)"))
    save_results(
        results,
        args.out,
        "atomics_counter",
        n=n,
        plain_counts=plain,
        atomic_counts=atomic,
        expected=expected,
    )
    return 0


if __name__ == "__main__":
    run_script(main)
