"""What torch.compile writes: inductor's Triton kernel for BN + ReLU + max-pool.

The capstone's twin (final_project/torch_twin.py) runs, after each convolution,
``F.max_pool2d(F.relu(bn(z)), 2)``. torch.compile (inductor) fuses the three into one
generated Triton kernel; the capstone fuses them into one hand-written Numba kernel
(final_project/fast_layers.py, ``bn_relu_maxpool_forward_kernel``). This script

1  compiles the twin's ``bn1`` + ReLU + pool (evaluation mode: BN from the running
   statistics) and captures the code inductor generates, with
   ``torch._inductor.utils.run_and_get_code`` (what ``TORCH_LOGS=output_code`` prints);
2  pulls the ``@triton.jit`` kernels out of it and prints each, every line that has
   a counterpart in the Numba kernel annotated with it;
3  checks eager, compiled and Numba against a float64 evaluation, then times them.

Run:   python chapters/12_triton/inductor.py [--batch N] [--out DIR]

On a CPU, inductor writes C++ (OpenMP loops with at::vec), not Triton: without a GPU
the script says so and stops (exit 0).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import check, rounding_tolerance
from common.harness import positive_int, run_script, save_results, script_parser
from common.runtime import torch_cuda_available
from common.timing import benchmark, device_peaks, format_table, timed_call

import inspect
import re
import time
from dataclasses import dataclass
from functools import partial

from final_project import fast_layers

NEEDS_GPU = (
    "SKIPPED: inductor writes C++ for CPU tensors, not Triton; "
    "this script needs a GPU (torch with CUDA)"
)

# --------------------------------------------------------------------------
# Capturing and reading the generated code
# --------------------------------------------------------------------------

# Inductor's output module defines each kernel as
#   name = async_compile.triton('name', '''<Triton source>''', device_str='cuda')
# or, for the CPU, name = async_compile.cpp_pybinding([...], r'''<C++ source>''').
_KERNEL_DEF = re.compile(
    r"^(?P<name>\w+) = async_compile\.(?P<kind>triton|cpp_pybinding|cpp)\((?P<args>.*?)"
    r"r?'''(?P<source>.*?)'''",
    re.S | re.M,
)


@dataclass
class GeneratedKernel:
    """One kernel of inductor's output: its name, language ("triton" or "c++") and
    source (for Triton, from ``@triton.jit`` on: the decorators inductor adds above it
    carry its autotuning hints, not its arithmetic)."""

    name: str
    language: str
    source: str


def generated_kernels(code):
    """The kernels in one module of inductor's output code (a str), in order.

    Returns a list of GeneratedKernel; [] for code with none (a graph of library calls
    only). Reads the ``async_compile.triton(...)`` / ``async_compile.cpp_pybinding(...)``
    definitions of torch 2.x's output code."""
    kernels = []
    for m in _KERNEL_DEF.finditer(code):
        source = m["source"]
        if m["kind"] == "triton":
            at = source.find("@triton.jit")
            source = source[at:] if at >= 0 else source
            kernels.append(GeneratedKernel(m["name"], "triton", source.strip("\n")))
        else:
            kernels.append(GeneratedKernel(m["name"], "c++", source.strip("\n")))
    return kernels


def capture(fn, *args):
    """Run the torch.compile'd ``fn(*args)`` once, compiling it; returns (its result,
    the list of GeneratedKernel it generated, the wall time of compile + call in ms)."""
    from torch._inductor.utils import run_and_get_code

    t0 = time.perf_counter()
    result, codes = run_and_get_code(fn, *args)
    ms = (time.perf_counter() - t0) * 1e3
    return result, [k for code in codes for k in generated_kernels(code)], ms


# What a line of inductor's Triton does, in the terms of our Numba kernel. Matched in
# order, first hit wins; the left side is a regular expression on the stripped line.
ANNOTATIONS = (
    (
        r"tl\.program_id",
        "program id * XBLOCK: blockIdx.x * blockDim.x (a program is a block)",
    ),
    (
        r"tl\.arange",
        "XBLOCK lanes of one program: Numba's one thread each (q in _this_window)",
    ),
    (r"xmask = ", "the tail guard: `if q >= channels * plane_out: return`"),
    (
        r"^x\d+ = .*(//|%)",
        "decode the flat index into (n, c, ph, pw): _this_window's divisions",
    ),
    (
        r"tl\.load\(.*\(2\*|tl\.load\(.*\+ 2",
        "one of the 2x2 window's reads: Numba's z[n, c, 2*ph + k // 2, 2*pw + k % 2]",
    ),
    (
        # indexed by the channel (kept in cache: evict_last), not by the element
        r"tl\.load\(.*evict_last",
        "a per-channel parameter (mean, var, gamma, beta): Numba reads scale[c], shift[c]",
    ),
    (r"tl\.load", "an element of the input: Numba's z[n, c, ...] in the window loop"),
    (
        r"sqrt",
        "1/sqrt(var + eps) for every element: Numba computes scale[c] once per channel "
        "(bn_eval_scale_shift) and reads it",
    ),
    (r"tl\.full\(\[1\], 0", "the 0 of ReLU: float32(0.0)"),
    (
        r"maximum\(|tl\.maximum",
        "max(): the ReLU (against 0) or the pool (against the window's best so far)",
    ),
    (
        r"tl\.where|> tmp|< tmp",
        "which window value is largest: Numba's `if v > best: best_k = k` (the argmax)",
    ),
    (r"tl\.store", "the write: pooled[n, c, ph, pw] (or the argmax, as int8)"),
)

# The store of a kernel that does not pool writes a whole intermediate (the BN + ReLU
# output) to memory for the next kernel to read back: the round trip fusion removes.
STORE_WITHOUT_POOL = (
    "writes the whole BN + ReLU output for the next kernel to read back: "
    "our fused kernel keeps it in registers"
)


def annotate(source, width=60):
    """``source`` (Triton) with an annotation after each line that has a Numba
    counterpart (``ANNOTATIONS``); returns the text."""
    out = []
    pools = "max_pool" in source  # (Inductor names a kernel after the ops it fused)
    for line in source.splitlines():
        note = next((n for pat, n in ANNOTATIONS if re.search(pat, line.strip())), None)
        if note and "tl.store" in line and not pools:
            note = STORE_WITHOUT_POOL
        if note and line.strip() and not line.strip().startswith(("def ", "@", "#")):
            out.append(f"{line:<{width}}  # <- {note}")
        else:
            out.append(line)
    return "\n".join(out)


# --------------------------------------------------------------------------
# The three versions: eager, compiled, our fused Numba kernel
# --------------------------------------------------------------------------


def twin_bn_relu_pool(batch, seed=0):
    """The capstone twin's first BN + ReLU + pool on CUDA, evaluation mode, with random
    running statistics and affine parameters; returns (fn, z): ``fn(z)`` = pooled
    (N, C1, H/2, W/2) for the conv1 output z (N, C1, H, W) float32."""
    import torch
    import torch.nn.functional as F

    from final_project.model import NetConfig
    from final_project.torch_twin import TorchCNN

    config = NetConfig()
    g = torch.Generator().manual_seed(seed)
    twin = TorchCNN(config).eval()
    bn = twin.bn1
    c = config.c1
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(c, generator=g))
        bn.bias.copy_(torch.randn(c, generator=g))
    bn = bn.cuda()
    z = torch.randn(batch, c, config.height, config.width, generator=g).cuda()

    def bn_relu_pool(x):
        return F.max_pool2d(F.relu(bn(x)), 2)

    bn_relu_pool.bn = bn
    return bn_relu_pool, z


# What numba_fused launches (the summary counts their lines).
NUMBA_KERNELS = (fast_layers.bn_eval_scale_shift_kernel, fast_layers.bn_relu_maxpool_forward_kernel)


def numba_fused(bn):
    """Our path for ``bn``: bn_eval_scale_shift (thread per channel) then the fused
    bn_relu_maxpool_forward (thread per pooled output), as a launcher ``(z, pooled)``
    on torch CUDA tensors (Numba views, made once)."""
    import torch
    from numba import cuda

    c = bn.num_features
    params = [cuda.as_cuda_array(t.detach()) for t in (bn.weight, bn.bias)]
    stats = [cuda.as_cuda_array(t) for t in (bn.running_mean, bn.running_var)]
    scale, shift = cuda.device_array(c, "f4"), cuda.device_array(c, "f4")
    views, argmax = {}, {}

    def launch(z, pooled):
        if id(z) not in views:
            views[id(z)] = (z, pooled, cuda.as_cuda_array(z), cuda.as_cuda_array(pooled))
            argmax[id(z)] = cuda.as_cuda_array(
                torch.empty(pooled.shape, dtype=torch.int8, device="cuda")
            )
        _, _, zv, pv = views[id(z)]
        fast_layers.bn_eval_scale_shift(*params, *stats, bn.eps, scale, shift)
        fast_layers.bn_relu_maxpool_forward(zv, scale, shift, pv, argmax[id(z)])

    return launch


def run(batch=512, *, repeats=20, show_code=True):
    """Capture, print, check and time (see the module docstring); returns the list of
    Timing ([] without a GPU, after printing :data:`NEEDS_GPU`)."""
    import torch
    import torch.nn.functional as F

    if not torch_cuda_available():
        print(NEEDS_GPU)
        return []
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")

    fn, z = twin_bn_relu_pool(batch)
    bn = fn.bn
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    with torch.no_grad():
        _, kernels, compile_ms = capture(compiled, z)
    triton_kernels = [k for k in kernels if k.language == "triton"]
    print(
        f"inductor generated {len(kernels)} kernel(s), {len(triton_kernels)} in Triton, "
        f"in {compile_ms:.0f} ms (compile + first call)"
    )
    if show_code:
        for k in triton_kernels:
            print(f"\n--- {k.name} (generated; annotated against the Numba kernel) ---")
            print(annotate(k.source))
        numba_src = inspect.getsource(fast_layers.bn_relu_maxpool_forward_kernel.py_func)
        print("\n--- final_project/fast_layers.py: our fused kernel ---")
        print(numba_src)

    ref = F.max_pool2d(
        F.relu(
            F.batch_norm(
                z.double(),
                bn.running_mean.double(),
                bn.running_var.double(),
                bn.weight.double(),
                bn.bias.double(),
                False,
                0.0,
                bn.eps,
            )
        ),
        2,
    )
    n, c, h, w = z.shape
    pooled_shape = (n, c, h // 2, w // 2)
    # (z - mean) * s + beta or z * s + (beta - mean * s), s = gamma / sqrt(var + eps):
    # about 4 float32 roundings of terms of size |z s| + |mean s| + |beta| either way
    s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).double()[:, None, None]
    terms = (z.double() * s).abs() + (bn.running_mean.double()[:, None, None] * s).abs()
    magnitude = F.max_pool2d(terms + bn.bias.double()[:, None, None].abs(), 2)
    tol = rounding_tolerance(ref, magnitude, 4, 1e-6)
    numba_launch = numba_fused(bn)
    # name -> (write into out, for the check; the call that is timed). torch's versions
    # are timed as they run in the twin (output allocated by torch's caching
    # allocator), not with an extra copy into ``out``.
    versions = {
        "torch eager": (lambda out: out.copy_(fn(z)), lambda out: fn(z)),
        "torch.compile (inductor Triton)": (
            lambda out: out.copy_(compiled(z)),
            lambda out: compiled(z),
        ),
        "numba fused (final_project)": (
            lambda out: numba_launch(z, out),
            lambda out: numba_launch(z, out),
        ),
    }
    peaks = device_peaks()
    results = []
    with torch.no_grad():
        for name, (checked, timed) in versions.items():
            out = torch.full(pooled_shape, float("nan"), device="cuda")
            _, first_ms = timed_call(partial(checked, out))
            err = check(out, ref, tol=tol, name=name)
            # What the fused op must move: read z once, write pooled once.
            nbytes = 4 * (z.numel() + out.numel())
            timing = benchmark(
                lambda timed=timed, out=out: timed(out),
                name,
                nbytes=nbytes,
                repeats=repeats,
                peaks=peaks,
                # a call is tens of microseconds, about its launch cost from Python
                # (dynamo's guards, eager's three ops): queue them all behind a hold
                hold_ms=50,
                first_call_ms=first_ms,
            )
            timing.extra.update(rel_error=err, batch=batch)
            if name.startswith("torch.compile"):
                timing.first_call_ms = compile_ms
                timing.extra["kernel"] = [k.name for k in triton_kernels]
                timing.extra["kernel_source"] = "\n\n".join(k.source for k in triton_kernels)
            elif name.startswith("numba"):
                timing.extra["kernel"] = [k.py_func.__name__ for k in NUMBA_KERNELS]
            results.append(timing)
    print(
        format_table(results, title=f"BN (eval) + ReLU + 2x2 max-pool, z {tuple(z.shape)} float32")
    )
    print(
        "the Numba path also writes the argmax (int8, for the backward) and launches "
        "twice (scale/shift, then the fused kernel); eager launches one kernel per op"
    )
    return results


def main(argv=None):
    parser = script_parser(__doc__, "12_triton")
    parser.add_argument("--batch", type=positive_int, default=512, help="images in z (default 512)")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls per version")
    args = parser.parse_args(argv)
    results = run(args.batch, repeats=args.repeats)
    if results:
        save_results(results, args.out, "inductor")
    return 0


if __name__ == "__main__":
    run_script(main)
