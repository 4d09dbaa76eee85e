"""Out-of-bounds writes: the simulator stops you, a GPU does not.

version 1 fill_index_unchecked: no bounds check; the threads past n write past the end
version 2 fill_index_checked: `if i < out.size` keeps the extra threads idle

The output lives inside a larger buffer of poisoned guard cells (common.checking.guarded),
so on a GPU the stray writes land in our own guard cells, never in unrelated memory,
and we can count them. To find such bugs on a GPU, run under NVIDIA's
compute-sanitizer (`compute-sanitizer python script.py`, Compute Sanitizer docs, memcheck).

Run: python chapters/05_first_kernels/out_of_bounds.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import CheckError, check, guarded, poison_value
from common.harness import run_script
from common.timing import readme_figures

import argparse
import sys

import numpy as np
from numba import cuda


# version 1: every thread writes, including the ones past the end of the array.
@cuda.jit(cache=True)
def fill_index_unchecked(out):
    i = cuda.grid(1)
    out[i] = i


# version 2: the bounds check; costs one compare a thread.
@cuda.jit(cache=True)
def fill_index_checked(out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = i


def launch_without_bounds_check(n=1000, threads_per_block=128):
    """Launch version 1 over a guarded output of n float32; return what happened, in words.

    Returns "IndexError: ..." in the simulator, "... guard cells written ..." on a GPU.

    Raises:
        ValueError: more than 64 threads (the guard width) would write past the end.
    """
    extra = ceil_div(n, threads_per_block) * threads_per_block - n
    if extra > 64:
        raise ValueError(
            f"{extra} stray threads would overrun the 64 guard cells; "
            "pick n and threads_per_block with fewer"
        )
    g = guarded(n, np.float32)
    try:
        fill_index_unchecked[ceil_div(n, threads_per_block), threads_per_block](g.array)
        cuda.synchronize()
    except IndexError as exc:  # the simulator checks every index, like NumPy
        return f"IndexError: {exc}"
    try:
        g.check_untouched("fill_index_unchecked")
    except CheckError:
        after = g.outside_values()[64:]  # the 64 guard cells after the output
        poison = np.float32(poison_value(np.float32))
        # Compare bit patterns: any value the kernel wrote, even a NaN, differs.
        written = int(np.sum(after.view(np.uint32) != poison.view(np.uint32)))
        return (
            f"no error raised; {written} guard cells written past the end "
            "(silent corruption: on a GPU these would be someone else's data)"
        )
    return "no error and no guard cells written (unexpected)"


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help
    n, threads = 1000, 128
    print(
        f"fill_index_unchecked, n = {n}, {ceil_div(n, threads)} blocks of {threads} "
        f"= {ceil_div(n, threads) * threads} threads ({'simulator' if is_simulator() else 'GPU'}):"
    )
    outcome = launch_without_bounds_check(n, threads)
    print(f"  {outcome}")
    expected = "IndexError" if is_simulator() else "no error raised; "
    if not outcome.startswith(expected) or outcome.startswith("no error raised; 0 "):
        print(f"expected {expected!r} here", file=sys.stderr)
        return 1

    g = guarded(n, np.float32)
    fill_index_checked[ceil_div(n, threads), threads](g.array)
    check(g.array, np.arange(n, dtype=np.float64), name="fill_index_checked")
    g.check_untouched("fill_index_checked")
    print("fill_index_checked: output right, guard cells untouched  OK")
    if is_simulator():  # show what the same launch does where nothing checks the index
        print(readme_figures(__file__).format())
    return 0


if __name__ == "__main__":
    run_script(main)
