"""Matmul in Triton: tiles, GROUP_M swizzling, autotuning, and three precisions.

version 1  matmul_kernel, FP32 (input_precision="ieee"): a program computes a BLOCK_M x BLOCK_N
           tile of C, stepping BLOCK_K along K; tl.dot on FP32 inputs with FMA units only.
           @triton.autotune picks BLOCK_M/N/K, GROUP_M, warps and pipeline stages per size
version 2  the same kernel, TF32 (input_precision="tf32"): tl.dot on tensor cores, inputs
           cut to a 10-bit mantissa, FP32 accumulate
version 3  the same kernel on FP16 inputs: tensor cores, FP32 accumulate, FP16 output
baselines  chapter 08's best Numba SGEMM (version 10, FP32 only) and cuBLAS through
           torch.matmul in the same precision, measured in the same run

Run:   python chapters/12_triton/matmul.py [--sizes 1024,2048,4096] [--out DIR]

Where each wins, and why. In FP32 the work is FMAs on CUDA cores; Triton's tile loop and
chapter 08's hand-tiled Numba kernel do the same thing, and cuBLAS is ahead of both. TF32
and FP16 run on tensor cores (mma / wgmma instructions), with several times the FP32 FMA
rate; ``tl.dot`` emits them, and Numba cannot reach them without inline PTX: its
kernels stay in the FP32 table. Compiled for sm_90 (H100, Triton 3.9), the FP32 kernel's
PTX is fma.rn.f32 only (4096 of them for a 128 x 128 x 32 tile), the TF32 and FP16 ones
wgmma.mma_async only. The price is precision: TF32 and FP16 round the inputs to
11 significant bits, so the error grows from ~1e-7 to ~1e-4 of the result.

Every row is checked against a float64 product on the same inputs, with a tolerance
derived from its precision (``tolerance``), then timed with CUDA events. In the
simulator (Triton's interpreter, no GPU) there is no autotuning: one fixed config runs
small irregular shapes, FP32 (ieee) and FP16, and nothing is timed.

Sources: Triton tutorial 03, "Matrix Multiplication" (the GROUP_M ordering);
``tl.dot``'s ``input_precision`` argument (Triton 3.0 and later, in 3.6 and 3.9 alike);
error bounds from Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
sec. 3.1 (inner products) and sec. 2.2 (the rounding model).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, load_chapter_module
from common.checking import EPS32, check, rounding_tolerance
from common.harness import comma_names, positive_int, run_script, save_results, script_parser
from common.runtime import is_simulator, pick
from common.timing import benchmark, device_peaks, format_table, timed_call

import contextlib
from dataclasses import dataclass
from functools import partial

import numpy as np

triton_env = import_sibling(__file__, "triton_env")
vector_add = import_sibling(__file__, "vector_add")  # HOLD_MS, as the chapter times
triton, tl = triton_env.triton, triton_env.tl
# The kernel's compile-time parameters; a plain name so this file still imports (and
# main() can say what is missing) where Triton is not installed.
constexpr = tl.constexpr if tl is not None else None

CHAPTER = "12_triton"

# --------------------------------------------------------------------------
# The precisions: what tl.dot and cuBLAS are asked for, and the error each allows
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """One row group of the table.

    ``dtype``: the operands' torch dtype name; ``input_precision``: what ``tl.dot`` is
    told for FP32 operands (ignored for FP16); ``input_unit``: the relative error of
    one operand as the multiplier sees it (0: exact); ``output_unit``: the rounding of
    the stored result, relative (0: FP32 storage, counted with the accumulation).
    """

    name: str
    dtype: str
    input_precision: str
    input_unit: float
    output_unit: float


PRECISIONS = {
    "fp32": Precision("FP32", "float32", "ieee", 0.0, 0.0),
    # 10 stored mantissa bits: 2^-11 when rounded (cuBLAS), 2^-10 when truncated, which
    # tl.dot's docstring warns it may do; the bound takes the larger.
    "tf32": Precision("TF32", "float32", "tf32", 2.0**-10, 0.0),
    # The cast to FP16 rounds (2^-11); products and sums are FP32; C is stored as FP16.
    "fp16": Precision("FP16", "float16", "ieee", 2.0**-11, 2.0**-11),
}


def tolerance(ref, magnitude, k, precision):
    """Largest accepted ``||C - ref|| / ||ref||`` for a K-long product in ``precision``.

    ref: the float64 product (M, N); magnitude: ``|A| @ |B|`` in float64 (M, N).
    Each element is sum_k a_k b_k over K terms accumulated in FP32; Higham's bound
    (sec. 3.1, eq. 3.5) is |error| <= gamma_K |a|.|b|, gamma_K ~ K eps32 / 2: K roundings
    of eps32 / 2. Operands rounded to a unit u (TF32, FP16) make each product off by
    2u of |a_k b_k|; an FP16 output adds u of |c| <= u |a|.|b|. All are in units of
    |A| @ |B|, so they add up as ``roundings`` for :func:`common.checking.rounding_tolerance`.
    A wrong tile, a missing K step or a stale accumulator errs by O(|a|.|b|) and fails.
    """
    roundings = k / 2 + (2 * precision.input_unit + precision.output_unit) / EPS32
    return rounding_tolerance(ref, magnitude, roundings, tol=EPS32)


# --------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------


def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: constexpr,
    BLOCK_N: constexpr,
    BLOCK_K: constexpr,
    GROUP_M: constexpr,
    INPUT_PRECISION: constexpr,
):
    # GROUP_M swizzling: programs run in launch order, so walk C in column-strips of
    # GROUP_M tile rows instead of row by row. GROUP_M consecutive programs share one
    # tile column of B, and the A rows they read are reused across the strip: the
    # working set stays in L2 (tutorial 03 measures ~10% on an A100 from this alone).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be short
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # The whole tile of C lives in registers as one block value; per K step the
    # program reads BLOCK_K * (BLOCK_M + BLOCK_N) values for BLOCK_M * BLOCK_N *
    # BLOCK_K FMAs. Staging in shared memory, the double (num_stages) buffering that
    # chapter 08 wrote by hand, and the mma instructions are the compiler's.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Masked-out cells load as 0 and add nothing: ragged M, N and K edges.
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k0), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k0) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# Candidates of the autotuner (from tutorial 03's list, trimmed): the fastest is kept
# per (M, N, K) and operand dtype. Configs that do not fit shared memory (large FP32
# tiles with many stages) are skipped by the autotuner, not fatal.
AUTOTUNE_CONFIGS = (
    # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages
    (128, 256, 64, 8, 8, 3),
    (128, 256, 32, 8, 8, 3),
    (256, 128, 32, 8, 8, 3),
    (128, 128, 32, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 64, 32, 8, 4, 4),
    (64, 128, 32, 8, 4, 4),
    (64, 64, 32, 8, 4, 4),
)

# The interpreter (no GPU) cannot autotune: one config, the smallest tl.dot allows (16).
FIXED_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}

if triton is not None:
    matmul_kernel = triton.jit(_matmul_kernel)
    matmul_kernel_autotuned = triton.autotune(
        configs=[
            triton.Config(
                {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g},
                num_warps=w,
                num_stages=s,
            )
            for bm, bn, bk, g, w, s in AUTOTUNE_CONFIGS
        ],
        # Re-tuned per size and input precision (FP32 and TF32 share a dtype; the
        # operands' dtypes are part of the key already).
        key=["M", "N", "K", "INPUT_PRECISION"],
    )(matmul_kernel)


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------


def check_operands(a, b, c):
    """Raise a clear error unless a (M, K), b (K, N), c (M, N) are torch tensors that chain.

    a and b: float32 or float16, the same dtype; c: that dtype; all on one device (CUDA
    on a GPU; the CPU under Triton's interpreter), M, N, K >= 1. Raises TypeError (not a
    tensor, wrong dtype) or ValueError (rank, shapes, device, an empty dimension).
    """
    import torch

    for name, x in (("a", a), ("b", b), ("c", c)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.float16) or x.dtype != a.dtype:
            raise TypeError(f"{name} is {x.dtype}: a, b and c must all be float32 or all float16")
        if x.device != a.device:
            raise ValueError(f"{name} is on {x.device}, a on {a.device}: put them on one device")
    if a.shape[1] != b.shape[0] or tuple(c.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> c "
            f"{tuple(c.shape)}; need a (M, K), b (K, N), c (M, N)"
        )
    if min(a.shape[0], a.shape[1], b.shape[1]) < 1:
        raise ValueError(f"M, N, K must be >= 1, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if triton_env.INTERPRETED and a.device.type != "cpu":
        raise ValueError("Triton's interpreter runs on CPU tensors; got a CUDA tensor")
    if not triton_env.INTERPRETED and a.device.type != "cuda":
        raise ValueError(f"on a GPU, Triton needs CUDA tensors; a is on {a.device}")


def _grid(meta, m, n):
    # One program per BLOCK_M x BLOCK_N tile of C, in a 1-D grid (the swizzle orders it).
    return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def matmul(a, b, c, precision="fp32", *, config=None, kernel=None):
    """C = A @ B with the Triton kernel; a (M, K), b (K, N), c (M, N) torch tensors.

    precision: "fp32" (strict, no tensor cores), "tf32" (float32 operands on tensor
    cores) or "fp16" (float16 operands and output). config: dict of BLOCK_M, BLOCK_N,
    BLOCK_K, GROUP_M (and optional num_warps, num_stages) for the plain kernel; None:
    the autotuned kernel on a GPU, :data:`FIXED_CONFIG` in the interpreter. kernel: a
    replacement ``@triton.jit`` kernel with the same signature (tests pass broken
    copies). Raises as :func:`check_operands` does, and ValueError for an unknown
    precision or one that does not match the operands' dtype, before any launch.
    """
    triton_env.require()
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    check_operands(a, b, c)
    p = PRECISIONS[precision]
    if str(a.dtype) != f"torch.{p.dtype}":
        raise ValueError(f"precision {precision!r} needs {p.dtype} operands, got {a.dtype}")
    launch(a, b, c, p.input_precision, config=config, kernel=kernel)


def launch(a, b, c, input_precision, *, config=None, kernel=None):
    """Launch without checks (what the timed calls run): see :func:`matmul`."""
    m, k = a.shape
    n = b.shape[1]
    args = (a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride())
    if config is None and kernel is None and not triton_env.INTERPRETED:
        matmul_kernel_autotuned[lambda meta: _grid(meta, m, n)](
            *args, INPUT_PRECISION=input_precision
        )
        return
    config = dict(config or FIXED_CONFIG)
    kernel = kernel or matmul_kernel
    kernel[_grid(config, m, n)](*args, INPUT_PRECISION=input_precision, **config)


def best_config(precision="fp32"):
    """The autotuner's pick for the last size run in ``precision`` (a dict), or None."""
    p = PRECISIONS[precision]
    for key, cfg in reversed(list(getattr(matmul_kernel_autotuned, "cache", {}).items())):
        if p.input_precision in key and any(str(x).endswith(p.dtype) for x in key):
            return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return None


# --------------------------------------------------------------------------
# Baselines: chapter 08's best Numba SGEMM, cuBLAS through torch
# --------------------------------------------------------------------------

NUMBA = "numba ch08 v11 SGEMM"
CUBLAS = "torch cuBLAS"


ch08 = load_chapter_module("08_faster_matmul", "matmul")
# Chapter 08's best: version 11, which is version 10 with the tile shape its autotuner
# picked on the H100 (TUNE_SHAPES[1]: 128 x 128 block tiles, BK 16, 8 x 8 a thread, two
# blocks an SM), taken as it is rather than searched for again here.
NUMBA_SGEMM = ch08.make_matmul_fast(ch08.TUNE_SHAPES[1])


def numba_sgemm():
    """:data:`NUMBA_SGEMM` as a launcher ``(a, b, c)`` on torch tensors (wrapped, not
    copied, on a GPU; copied in the simulator, whose device arrays live on the host).
    FP32 only."""
    import torch
    from numba import cuda

    views = {}  # id -> (tensor, Numba view): made once, so timed calls do not wrap

    def view(x):
        if id(x) not in views:
            arr = cuda.to_device(x.numpy()) if is_simulator() else cuda.as_cuda_array(x)
            views[id(x)] = (x, arr)
        return views[id(x)][1]

    def sgemm(a, b, c):
        NUMBA_SGEMM.launcher(view(a), view(b), view(c))
        if is_simulator():  # the simulator's device array is a copy: bring C back
            c.copy_(torch.from_numpy(view(c).copy_to_host()))

    return sgemm


@contextlib.contextmanager
def cublas_precision(precision):
    """torch.matmul in ``precision``: TF32 allowed only for "tf32", and FP16 products
    reduced in FP32 (torch's default lets cuBLAS reduce split-K partials in FP16,
    outside the FP32-accumulate bound of :func:`tolerance`)."""
    import torch

    flags = torch.backends.cuda.matmul
    old = flags.allow_tf32, flags.allow_fp16_reduced_precision_reduction
    flags.allow_tf32 = precision == "tf32"
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_tf32, flags.allow_fp16_reduced_precision_reduction = old


def cublas(a, b, c):
    """torch.matmul(a, b, out=c): cuBLAS on a GPU (precision set by :func:`cublas_precision`)."""
    import torch

    torch.matmul(a, b, out=c)


# --------------------------------------------------------------------------
# Check, then time, every row of one size
# --------------------------------------------------------------------------


def operands(m, n, k, dtype, generator, device):
    """Random A (M, K) and B (K, N) in ``dtype`` on ``device``, and the float64 product of
    exactly those values and ``|A| @ |B|`` (numpy): the reference and the error's scale."""
    import torch

    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    a64, b64 = a.double().numpy(), b.double().numpy()
    return a.to(device), b.to(device), a64 @ b64, np.abs(a64) @ np.abs(b64)


def run_size(size, precisions, generator, *, repeats=20, peaks=None):
    """Check and time the Triton kernel, Numba (FP32 only) and cuBLAS at one (M, N, K),
    each precision in turn; returns a list of Timing (``extra``: precision, size, rel_error,
    tolerance, fraction_of_cublas, kernel)."""
    import torch

    m, n, k = size
    device = "cpu" if triton_env.INTERPRETED else "cuda"
    results = []
    for name in precisions:
        p = PRECISIONS[name]
        dtype = getattr(torch, p.dtype)
        a, b, ref, magnitude = operands(m, n, k, dtype, generator, device)
        tol = tolerance(ref, magnitude, k, p)
        rows = {f"triton {p.name}": partial(launch, input_precision=p.input_precision)}
        if name == "fp32":
            rows[NUMBA] = numba_sgemm()
        if not triton_env.INTERPRETED:
            rows[f"{CUBLAS} {p.name}"] = cublas
        group = []
        with cublas_precision(name):
            for label, launcher in rows.items():
                c = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                # the first call at this shape: compile, and the autotuner's search
                _, first_ms = timed_call(partial(launcher, a, b, c))
                err = check(c, ref, tol=tol, name=f"{label} {m}x{n}x{k}")
                t = benchmark(
                    partial(launcher, a, b, c),
                    label,
                    flops=2 * m * n * k,
                    nbytes=a.element_size() * (m * k + k * n + m * n),
                    repeats=repeats,
                    peaks=peaks,
                    first_call_ms=first_ms,
                    hold_ms=vector_add.HOLD_MS,
                )
                t.extra.update(precision=p.name, size=[m, n, k], rel_error=err, tolerance=tol)
                t.extra["kernel"] = (
                    [k.py_func.__name__ for k in NUMBA_SGEMM.kernels]
                    if label == NUMBA
                    else "matmul_kernel"
                    if label.startswith("triton")
                    else None
                )
                group.append(t)
        cub = next((t.tflops for t in group if t.name.startswith(CUBLAS)), None)
        for t in group:
            t.extra["fraction_of_cublas"] = t.tflops / cub if cub and t.tflops else None
        results += group
    return results


def print_size(size, results):
    """The table of one size, then % of cuBLAS in the same precision and the error."""
    m, n, k = size
    print(format_table(results, title=f"matmul {m}x{n}x{k} (row-major)"))
    lines = []
    for t in results:
        frac = t.extra.get("fraction_of_cublas")
        pct = "-" if frac is None else f"{100 * frac:.0f}% of cuBLAS {t.extra['precision']}"
        lines.append([t.name, pct, f"{t.extra['rel_error']:.1e}", f"{t.extra['tolerance']:.1e}"])
    print(
        format_table(
            lines, header=["version", "same precision", "rel. error", "tolerance"], align="<<>>"
        )
    )


def where_each_wins(all_results):
    """Lines that say, per size, the fastest row in each precision and the tensor-core
    speed-up (cuBLAS or Triton TF32 over the best FP32 row)."""
    lines = []
    for size, results in all_results.items():
        timed = [t for t in results if t.measured]
        if not timed:
            continue
        best = {}
        for t in timed:
            p = t.extra["precision"]
            if p not in best or t.tflops > best[p].tflops:
                best[p] = t
        parts = [f"{p}: {t.name} {t.tflops:.1f} TFLOP/s" for p, t in best.items()]
        if "FP32" in best and "TF32" in best:
            parts.append(f"TF32/FP32 {best['TF32'].tflops / best['FP32'].tflops:.1f}x")
        lines.append(f"  {'x'.join(map(str, size))}: " + "; ".join(parts))
    return lines


def run(sizes=None, precisions=None, *, repeats=20, seed=0):
    """Every row at every size (default 1024, 2048, 4096 on a GPU; 33x47x29 and 1x1x1 in
    the interpreter); returns the list of Timing. The summary script calls this."""
    import torch

    triton_env.require()
    sizes = sizes or pick(
        gpu=[(1024,) * 3, (2048,) * 3, (4096,) * 3], simulator=[(33, 47, 29), (1, 1, 1)]
    )
    precisions = precisions or pick(gpu=list(PRECISIONS), simulator=["fp32", "fp16"])
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        raise ValueError(f"unknown precisions {sorted(unknown)}; use {sorted(PRECISIONS)}")
    generator = torch.Generator().manual_seed(seed)
    peaks = device_peaks()
    all_results = {}
    for size in sizes:
        all_results[tuple(size)] = run_size(
            size, precisions, generator, repeats=repeats, peaks=peaks
        )
        print_size(size, all_results[tuple(size)])
    wins = where_each_wins(all_results)
    if wins:
        print("fastest per precision (tensor cores: TF32, FP16; Numba has no way to them):")
        print("\n".join(wins))
    if not triton_env.INTERPRETED:
        for name in precisions:
            print(f"autotuner's pick at the last size, {name}: {best_config(name)}")
    return [t for results in all_results.values() for t in results]


def main(argv=None):
    parser = script_parser(__doc__, CHAPTER)
    parser.add_argument(
        "--sizes",
        type=load_chapter_module("08_faster_matmul", "matmul_tools").parse_sizes,
        default=None,
        help="comma list of N or MxNxK (default 1024,2048,4096; 33x47x29,1x1x1 interpreted)",
    )
    parser.add_argument(
        "--precisions",
        type=comma_names(tuple(PRECISIONS), lambda p: p.strip().lower()),
        default=None,
        help="comma list of fp32, tf32, fp16 (default all; fp32,fp16 interpreted)",
    )
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls per row")
    args = parser.parse_args(argv)
    if triton_env.MISSING:
        print(f"SKIPPED: {triton_env.MISSING}")
        return 0
    print(
        f"Triton {triton_env.VERSION}"
        + (" (interpreter: one fixed config, nothing timed)" if triton_env.INTERPRETED else "")
    )
    results = run(args.sizes, args.precisions, repeats=args.repeats)
    save_results(results, args.out, "matmul", triton=triton_env.VERSION)
    return 0


if __name__ == "__main__":
    run_script(main)
