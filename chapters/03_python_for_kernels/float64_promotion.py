"""How one Python float literal turns float32 kernel math into float64, and what it costs.

version 1 fma_chain_promoted: v = v * 0.999 + 0.001, bare literals: Numba types them float64,
          so every multiply-add runs in float64 and the result is rounded back on store
version 2 fma_chain_f32: the same with np.float32 constants: float32 all the way
version 3 exp_promoted: math.exp(x * 0.5): a float64 exp (a long software routine on a GPU)
version 4 exp_f32: math.exp(x * HALF) with HALF = np.float32(0.5): the float32 exp

Two pieces of evidence: the types Numba infers (shown with numba.njit on the CPU,
the same typing rules as the CUDA target) and, on a GPU, the time of each kernel and
the number of f64 instructions in its PTX. Numba typing rules: "Numba types:
numbers" in the Numba reference manual; GPU FP64:FP32 throughput ratios are in the
CUDA C++ Programming Guide, "Arithmetic Instructions".

Run: python chapters/03_python_for_kernels/float64_promotion.py [--out runs/03_python_for_kernels]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick, random_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.timing import device_peaks, format_table, readme_figures

import math
import re

import numba
import numpy as np
from numba import cuda

MUL, ADD, HALF = np.float32(0.999), np.float32(0.001), np.float32(0.5)


def step_promoted(v):
    return v * 0.999 + 0.001  # 0.999 is a Python float: float64


def step_f32(v):
    return v * MUL + ADD  # module-level np.float32 constants stay float32


def fma_chain_reference(x, iters, mul=MUL, add=ADD):
    """float64 result of ``iters`` steps v -> mul * v + add from v = x, elementwise.

    In closed form (a geometric series), v_n = mul**n * x + add * (1 - mul**n) / (1 - mul),
    so the check costs one pass over the array instead of ``iters``. mul and add may be
    scalars or arrays shaped like x (mul != 1). Chapters 4 and 5 check their FMA chains
    with it too.
    """
    mul, add = np.asarray(mul, np.float64), np.asarray(add, np.float64)
    mn = mul**iters
    return x.astype(np.float64) * mn + add * (1 - mn) / (1 - mul)


# version 1: bare literals; each of the ITERS steps is a float64 FMA.
@cuda.jit(cache=True)
def fma_chain_promoted(x, iters, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        for _ in range(iters):
            v = v * 0.999 + 0.001
        out[i] = v


# version 2: float32 constants; each step is one float32 FMA.
@cuda.jit  # not cached: chapter 04's timing_mistakes.py times its first call, the JIT compile
def fma_chain_f32(x, iters, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        for _ in range(iters):
            v = v * MUL + ADD
        out[i] = v


# version 3: x * 0.5 is float64, so math.exp picks the float64 exp.
@cuda.jit(cache=True)
def exp_promoted(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = math.exp(x[i] * 0.5)


# version 4: float32 in, float32 exp.
@cuda.jit(cache=True)
def exp_f32(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = math.exp(x[i] * HALF)


F64_PTX = re.compile(r"^\s*[a-z.]+\.f64\b", re.M)  # PTX instructions operating on float64


def typing_report():
    """Return [(function name, inferred return type)] for float32 input, via numba.njit."""
    rows = []
    for fn in (step_promoted, step_f32):
        jitted = numba.njit(fn)
        jitted(np.float32(1.0))
        sig = jitted.signatures[0]
        rows.append((fn.__name__, str(jitted.overloads[sig].signature.return_type)))
    return rows


def f64_instruction_count(kernel):
    """Number of float64 PTX instructions in a compiled kernel; None in the simulator."""
    if is_simulator():
        return None
    try:
        ptx_by_signature = kernel.inspect_asm()
    except Exception as exc:  # an API change must not hide the timings
        print(f"  (could not read PTX: {exc})")
        return None
    return sum(len(F64_PTX.findall(ptx)) for ptx in ptx_by_signature.values())


def main(argv=None):
    args = script_parser(__doc__, "03_python_for_kernels").parse_args(argv)

    print("types Numba infers for a float32 argument:")
    for name, ret in typing_report():
        print(f"  {name:<15} -> {ret}")

    n = pick(gpu=1 << 24, simulator=200)
    iters = pick(gpu=256, simulator=3)
    x_host = random_array(n, rng=np.random.default_rng(0), low=0.5, high=1.5)
    x = cuda.to_device(x_host)
    threads = 256
    grid = ceil_div(n, threads)
    peaks = device_peaks()

    # Each version is its kernel with its launch configuration: one thread an element.
    fma = run_versions(
        {
            "1 fma_chain_promoted": fma_chain_promoted[grid, threads],
            "2 fma_chain_f32": fma_chain_f32[grid, threads],
        },
        (x, iters),
        fma_chain_reference(x_host, iters),
        n,
        np.float32,
        tol=1e-5,
        flops=2 * iters * n,
        peaks=peaks,
        print_table=False,
    )
    exp = run_versions(
        {"3 exp_promoted": exp_promoted[grid, threads], "4 exp_f32": exp_f32[grid, threads]},
        (x,),
        np.exp(x_host.astype(np.float64) * 0.5),
        n,
        np.float32,
        tol=1e-6,
        nbytes=8 * n,
        peaks=peaks,
        print_table=False,
    )
    results = fma + exp
    print(
        format_table(
            results, title=f"float64 promotion, n = {n:,} ({iters} FMAs an element in versions 1-2)"
        )
    )
    print("every version checked against a float64 reference (rel. error <= 1e-5)")
    for r, kernel in zip(results, (fma_chain_promoted, fma_chain_f32, exp_promoted, exp_f32)):
        r.extra["f64_ptx_instructions"] = f64_instruction_count(kernel)
        if r.extra["f64_ptx_instructions"] is not None:
            print(f"  {r.name:<22} {r.extra['f64_ptx_instructions']:4d} f64 PTX instructions")
    if fma[0].measured:
        print(f"  FMA chain: promoted / float32 time = {fma[0].median_ms / fma[1].median_ms:.2f}x")
        print(f"  exp:       promoted / float32 time = {exp[0].median_ms / exp[1].median_ms:.2f}x")
    else:  # no PTX and no times in the simulator: show the GPU run's
        print(readme_figures(__file__).format())
    save_results(results, args.out, "float64_promotion", n=n, iters=iters, typing=typing_report())
    return 0


if __name__ == "__main__":
    run_script(main)
