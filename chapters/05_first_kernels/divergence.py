"""Branch divergence: what an if/else costs when threads of one warp disagree.

version 1 branch_by_group with group = 32 (or more): whole warps take the same branch
version 2 branch_by_group with group < 32: each warp holds threads of both branches,
          so the warp runs path A with the B threads masked off, then path B: ~2x the time

Each element runs ITERS dependent FMAs on one of two paths (A or B, by (i // group) % 2).
The work per element is the same for every group size; only the warp mix changes.
Source: CUDA C++ Programming Guide, "SIMT Architecture" (divergence serializes paths).

Run: python chapters/05_first_kernels/divergence.py [--out runs/05_first_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, load_chapter_module, pick, random_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import device_peaks, format_table, readme_figures

import numpy as np
from numba import cuda

# fma_chain_reference(x, iters, mul, add): the float64 result of an FMA chain (chapter 3)
float64_promotion = load_chapter_module("03_python_for_kernels", "float64_promotion")

WARP = 32
A_MUL, A_ADD = np.float32(0.999), np.float32(0.001)
B_MUL, B_ADD = np.float32(0.998), np.float32(0.002)


def reference(x, group, iters):
    """float64 result of the kernel: path A for even groups, path B for odd ones."""
    path_a = (np.arange(x.size) // group) % 2 == 0
    mul = np.where(path_a, np.float64(A_MUL), np.float64(B_MUL))
    add = np.where(path_a, np.float64(A_ADD), np.float64(B_ADD))
    return float64_promotion.fma_chain_reference(x, iters, mul, add)


# Both paths do ITERS FMAs; a warp whose threads disagree runs both, one after the other.
@cuda.jit(cache=True)
def branch_by_group(x, group, iters, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        if (i // group) % 2 == 0:
            for _ in range(iters):
                v = v * A_MUL + A_ADD
        else:
            for _ in range(iters):
                v = v * B_MUL + B_ADD
        out[i] = v


def main(argv=None):
    args = script_parser(__doc__, "05_first_kernels").parse_args(argv)
    n = pick(gpu=1 << 22, simulator=96)
    iters = pick(gpu=1024, simulator=4)
    threads = 256
    x_host = random_array(n, rng=np.random.default_rng(0), low=0.5, high=1.5)
    x = cuda.to_device(x_host)
    peaks = device_peaks()
    results = []
    for group in (1, 2, 8, 16, 32, 64):  # one run_versions a group: each has its reference
        where = "diverged" if group < WARP else "warp-uniform"
        results += run_versions(
            {f"group {group:>2} ({where})": branch_by_group[ceil_div(n, threads), threads]},
            (x, group, iters),
            reference(x_host, group, iters),
            n,
            np.float32,
            tol=1e-5,
            flops=2 * iters * n,
            peaks=peaks,
            print_table=False,
        )
    print(format_table(results, title=f"branch divergence: n = {n:,}, {iters} FMAs an element"))
    print("every version checked against a float64 reference (rel. error <= 1e-5)")
    uniform = results[4]  # group 32: one path a warp
    if uniform.measured:
        for r in results:
            print(f"  {r.name:<26} {r.median_ms / uniform.median_ms:5.2f}x the warp-uniform time")
    else:
        print(readme_figures(__file__).format())
    save_results(results, args.out, "divergence", n=n, iters=iters)
    return 0


if __name__ == "__main__":
    run_script(main)
