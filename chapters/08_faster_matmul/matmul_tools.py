"""Tooling around matmul.py: the cuBLAS baseline, picking the fastest candidate,
the compiler report, the result tables and plot, and the command-line parsers.

No kernel lives here: read ``matmul.py`` for the chapter. It loads this file
with ``import_sibling(__file__, "matmul_tools")``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.harness import run_versions
from common.runtime import is_simulator, torch_cuda_available
from common.timing import format_table

import argparse
import json
import re

CUBLAS = "cuBLAS SGEMM (torch, TF32 off)"


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_sizes(text):
    """'1024,2048' -> [(1024, 1024, 1024), ...]; 'MxNxK' entries are rectangular.
    Raises argparse.ArgumentTypeError for anything else."""
    sizes = []
    for item in text.split(","):
        try:
            parts = [int(p) for p in item.lower().split("x")]
        except ValueError:
            parts = []
        if len(parts) == 1:
            parts *= 3
        if len(parts) != 3 or min(parts) < 1:
            raise argparse.ArgumentTypeError(
                f"bad size {item!r}: use N or MxNxK with positive integers"
            )
        sizes.append(tuple(parts))
    return sizes


def parse_numbers(text):
    """'9,10,11' -> {9, 10, 11}. Raises argparse.ArgumentTypeError for anything else."""
    try:
        return {int(p) for p in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad list {text!r}: use version numbers separated by commas, e.g. 9,10,11"
        ) from None


# --------------------------------------------------------------------------
# cuBLAS baseline (through torch)
# --------------------------------------------------------------------------


def cublas_available():
    """True on a GPU with a CUDA build of torch installed."""
    return torch_cuda_available()


class CublasSgemm:
    """A launcher ``(a, b, c)`` running torch.matmul (cuBLAS SGEMM, TF32 off) on
    Numba device arrays without a copy (torch.as_tensor reads
    ``__cuda_array_interface__``). Each array's torch view is made on its
    first call and kept, so the timed calls charge cuBLAS for the product,
    not for wrapping."""

    def __init__(self):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        self._torch = torch
        # id(array) -> (array, its torch view); holding the array keeps its id unique.
        self._views = {}

    def _view(self, x):
        if id(x) not in self._views:
            self._views[id(x)] = (x, self._torch.as_tensor(x, device="cuda"))
        return self._views[id(x)][1]

    def __call__(self, a, b, c):
        self._torch.matmul(self._view(a), self._view(b), out=self._view(c))


# --------------------------------------------------------------------------
# Autotuning: keep the fastest of several checked candidates
# --------------------------------------------------------------------------


def fastest(candidates, args, reference, out_shape, *, tol, flops, repeats, title):
    """Check and time every ``launcher(*args, out)`` of ``candidates`` (name ->
    launcher) against ``reference`` (within ``tol``); returns (the fastest
    one's name, the list of Timing). In the simulator nothing is timed: every
    candidate is still checked and the first one is returned.
    Raises CheckError for a wrong candidate."""
    results = run_versions(
        candidates,
        args,
        reference,
        out_shape,
        tol=tol,
        flops=flops,
        warmup=1,
        repeats=repeats,
        title=title,
    )
    timed = [r for r in results if r.measured]
    best = min(timed, key=lambda r: r.median_ms) if timed else results[0]
    return best.name, results


# --------------------------------------------------------------------------
# Compiler report: registers, spills, shared memory, what the PTX contains
# --------------------------------------------------------------------------


def compiler_report(kernel, label):
    """Registers per thread, local memory (spills), shared memory, and what the
    PTX of the compiled ``kernel`` contains: FMAs, shared loads (scalar and
    4-wide), local loads. Returns a dict; {} in the simulator (nothing is
    compiled there) or for a kernel that was never launched."""
    if is_simulator() or not kernel.overloads:
        return {}
    sig = next(iter(kernel.overloads))
    report = {"kernel": f"{label} [{kernel.py_func.__name__}]"}
    # The compiled kernel for one signature; the same numbers as
    # kernel.get_regs_per_thread() / get_local_mem_per_thread() /
    # get_shared_mem_per_block() give for a kernel with one signature.
    compiled = kernel.overloads[sig]
    for key, attr in (
        ("registers_per_thread", "regs_per_thread"),
        ("local_bytes_per_thread", "local_mem_per_thread"),
        ("shared_bytes_per_block", "shared_mem_per_block"),
    ):
        try:
            report[key] = getattr(compiled, attr)
        except Exception as exc:  # noqa: BLE001  (a driver query; report, don't fail)
            report[key] = f"n/a ({type(exc).__name__})"
    ptx = kernel.inspect_asm(sig)
    report["ptx_fma_f32"] = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    report["ptx_ld_shared_f32"] = len(re.findall(r"\bld\.shared\.f32\b", ptx))
    report["ptx_ld_shared_v4"] = len(re.findall(r"\bld\.shared\.v4\.f32\b", ptx))
    report["ptx_ld_shared_v2"] = len(re.findall(r"\bld\.shared\.v2\.f32\b", ptx))
    report["ptx_ld_local"] = len(re.findall(r"\bld\.local\b", ptx))
    report["ptx_st_local"] = len(re.findall(r"\bst\.local\b", ptx))
    lines = [ln.strip() for ln in ptx.splitlines() if "fma.rn.f32" in ln or "ld.shared" in ln]
    report["ptx_inner_loop_sample"] = lines[:12]
    return report


def print_compiler_reports(reports):
    """Print the non-empty reports of :func:`compiler_report`."""
    reports = [r for r in reports if r]
    if not reports:
        return
    print("compiler report (what the register tiles became):")
    for report in reports:
        print(
            f"  {report['kernel']}: {report['registers_per_thread']} registers/thread, "
            f"{report['local_bytes_per_thread']} B local memory/thread (spills if > 0), "
            f"{report['shared_bytes_per_block']} B shared/block"
        )
        print(
            f"    PTX: {report['ptx_fma_f32']} fma.rn.f32, {report['ptx_ld_shared_f32']} "
            f"ld.shared.f32, {report['ptx_ld_shared_v4']} ld.shared.v4.f32, "
            f"{report['ptx_ld_local']} ld.local / {report['ptx_st_local']} st.local"
        )
        for ln in report["ptx_inner_loop_sample"][:6]:
            print(f"      {ln}")


# --------------------------------------------------------------------------
# Tables and plot
# --------------------------------------------------------------------------


def add_fraction_of_cublas(results):
    """Set ``extra["fraction_of_cublas"]`` on every timed result, against the
    cuBLAS row of the same size; nothing without one."""
    cublas = next((r.tflops for r in results if r.name == CUBLAS), None)
    if not cublas:
        return
    for r in results:
        r.extra["fraction_of_cublas"] = r.tflops / cublas if r.tflops else None


def print_results(size, results):
    """The table of one (M, N, K), then each version's % of cuBLAS."""
    m, n, k = size
    print(format_table(results, title=f"SGEMM {m}x{n}x{k} (FP32, row-major)"))
    if any("fraction_of_cublas" in r.extra for r in results):
        print("  % of cuBLAS measured in this run:")
        for r in results:
            f = r.extra.get("fraction_of_cublas")
            if f is not None:
                print(f"    {r.name:<44} {r.tflops:7.2f} TFLOP/s  {100 * f:6.1f} %")


def print_best_fraction(all_results):
    """Print {size: [best version, % of cuBLAS]} for the hand-written kernels."""
    best = {}
    for size, results in all_results.items():
        ours = [r for r in results if r.extra.get("fraction_of_cublas") and r.name != CUBLAS]
        if ours:
            b = max(ours, key=lambda r: r.extra["fraction_of_cublas"])
            best["x".join(map(str, size))] = [b.name, round(100 * b.extra["fraction_of_cublas"], 1)]
    if best:
        print("best hand-written kernel vs cuBLAS: " + json.dumps(best))


def plot(all_results, path, device):
    """Grouped bars: TFLOP/s per version per size (``all_results``: size -> list
    of Timing), saved as PNG to ``path``; returns the path, or None without
    matplotlib or without timings (the simulator)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(all_results)
    names = []
    for results in all_results.values():
        for r in results:
            if r.tflops is not None and r.name not in names:
                names.append(r.name)
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(len(sizes), 1)
    for s_i, size in enumerate(sizes):
        by_name = {r.name: r.tflops for r in all_results[size]}
        xs = [i + s_i * width for i in range(len(names))]
        ax.bar(xs, [by_name.get(nm) or 0 for nm in names], width, label="x".join(map(str, size)))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels(
        [nm.split(" (")[0][:28] for nm in names], rotation=35, ha="right", fontsize=8
    )
    ax.set_ylabel("TFLOP/s (FP32)")
    ax.set_yscale("log")
    ax.set_title(f"SGEMM versions vs cuBLAS on {device}")
    ax.legend(title="M x N x K")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
