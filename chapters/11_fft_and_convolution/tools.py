"""Chapter 11's plumbing around convolution.py: what the script needs and does not teach.

convolution.py shows the kernels, their launchers, the float64 reference, the
tolerances, the measurement loop and the conclusions; this module reads and prints
around them:

* which algorithm cuDNN ran: one call captured under torch.profiler
  (:func:`cudnn_pick`, through chapter 09's tools) and its kernel names classified
  (:func:`classify_cudnn_kernels`, :data:`CUDNN_KERNEL_PATTERNS`);
* the crossover as a table (:func:`crossover_table`, on ``common.timing.format_table``)
  and as a plot (:func:`plot_crossover`).

No kernel lives here. convolution.py loads it with ``import_sibling(__file__, "tools")``;
torch and matplotlib are imported only inside the functions that use them.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import load_chapter_module
from common.timing import format_table

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------
# cuDNN's pick, read from the kernels it ran
# --------------------------------------------------------------------------


# Which cuDNN algorithm a call ran, from the names of its kernels, as they appear in
# nvprof / Nsight Systems / torch.profiler listings. The first class (in this order)
# that any kernel of the call matches wins: an FFT algorithm also runs a complex GEMM
# (cgemm) for the pointwise products, and non-fused Winograd an sgemm, so the transform
# kernels decide. FFT: fft2d_r2c_32x32, fft2d_c2r_16x16, flip_filter, cuFFT's
# regular_fft / vector_fft; Winograd: maxwell_scudnn_winograd_128x128_...,
# winogradForwardData4x4; IMPLICIT_GEMM: cudnn::detail::implicit_convolve_sgemm<...>;
# IMPLICIT_PRECOMP_GEMM: volta_scudnn_128x64_relu_interior_nn_v1,
# sm90_xmma_fprop_implicit_gemm_..., CUTLASS's ImplicitGemmConvolution; GEMM:
# explicit_convolve_sgemm, im2col4d_kernel, then *sgemm*; direct:
# conv2d_grouped_direct_kernel. Only the raw names are certain: they are printed too.
CUDNN_KERNEL_PATTERNS = (
    (r"fft|flip_filter", "FFT"),
    (r"winograd", "Winograd"),
    (r"implicit_convolve_sgemm", "implicit GEMM"),
    (r"scudnn|xmma|fprop|implicit_?gemm", "implicit precomp GEMM"),
    (r"explicit_convolve_sgemm|im2col", "GEMM (explicit im2col)"),
    (r"direct_kernel|conv2d_c1_k1", "direct"),
    (r"gemm|gemv", "GEMM"),
)
# Kernels around the algorithm: layout transposes, offset tables, scaling, torch's own
# element-wise kernels (the zero-padded copy of an even-K "same" input), copies.
CUDNN_HELPER_PATTERN = (
    r"^void at::native|nchwToNhwc|nhwcToNchw|cubeTranspose|computeOffsets|computeBOffsets"
    r"|scalePackedTensor|op_tensor|redzone|memset|memcpy"
)


def classify_cudnn_kernels(names: Sequence[str]) -> str:
    """The cuDNN algorithm the kernel ``names`` of one conv2d call show: the first class
    of :data:`CUDNN_KERNEL_PATTERNS` that a kernel matches, ignoring helpers
    (:data:`CUDNN_HELPER_PATTERN`); "other" if no kernel matches, "none" if there are
    only helpers (or no kernels)."""
    names = [n for n in names if not re.search(CUDNN_HELPER_PATTERN, n, re.IGNORECASE)]
    for pattern, label in CUDNN_KERNEL_PATTERNS:
        if any(re.search(pattern, n, re.IGNORECASE) for n in names):
            return label
    return "other" if names else "none"


def cudnn_pick(conv: Any, x, w) -> tuple[str, list[str]]:
    """(algorithm, kernel names) of one ``conv.forward(x, w)`` call (``conv``: a
    convolution.py ``CudnnConv``), run under torch.profiler with CUDA activity (after
    an unprofiled call: with benchmark on, that is when cuDNN times its candidates).
    GPU only."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof_tools = load_chapter_module("09_profiling", "tools")
    conv.forward(x, w)
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle"
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            conv.forward(x, w)
            torch.cuda.synchronize()
    names = list(dict.fromkeys(r.name for r in prof_tools.device_records(prof.events())))
    return classify_cudnn_kernels(names), names


# --------------------------------------------------------------------------
# The crossover: table and plot
# --------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _cell(row: dict[str, Any], label: str) -> str:
    """ms; "ok" for checked but not timed (the simulator); "skip" for not run."""
    if label in row["skipped"]:
        return "skip"
    return "ok" if row["ms"].get(label, 0) is None else _ms(row["ms"].get(label))


def _cudnn_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The cuDNN settings the rows timed (benchmark off, then on), in the order timed."""
    return list(dict.fromkeys(lab for r in rows for lab in r.get("cudnn", {})))


def crossover_table(rows: Sequence[dict[str, Any]], title: str, versions: Sequence[str]) -> str:
    """One line per K: ms of each of the ``versions`` (their labels, in order) and of
    cuDNN (with what it picked); "skip" for a version that does not apply (reasons
    below the table), "ok" for one checked but not timed (the simulator)."""
    cudnn = _cudnn_labels(rows)
    table = []
    for r in rows:
        cells = [str(r["k"])] + [_cell(r, lab) for lab in versions]
        for lab in cudnn:
            c = r["cudnn"][lab]
            cells.append(f"{_ms(c['ms'])} ({c['algorithm']})")
        table.append(cells)
    header = ["K"] + [lab.split(" (")[0] for lab in versions] + cudnn
    text = format_table(
        table, title, header=header, align=">" * (1 + len(versions)) + "<" * len(cudnn)
    )
    # One note a version: the K it skipped, and the reason at the smallest of them
    # (the reasons differ only in their numbers).
    skipped: dict[str, list[tuple[int, str]]] = {}
    for r in sorted(rows, key=lambda r: r["k"]):
        for lab, why in r["skipped"].items():
            skipped.setdefault(lab, []).append((r["k"], why))
    notes = [
        f"  skipped {lab} at K = {', '.join(str(k) for k, _ in ks)}: {ks[0][1]}"
        for lab, ks in sorted(
            skipped.items(),
            key=lambda item: (
                list(versions).index(item[0]) if item[0] in versions else len(versions)
            ),
        )
    ]
    return "\n".join([text, *notes])


# cuDNN's pick, as a marker on its line
_PICK_MARKERS = {
    "FFT": "s",
    "Winograd": "^",
    "implicit GEMM": "o",
    "implicit precomp GEMM": "D",
    "GEMM (explicit im2col)": "v",
    "GEMM": "P",
    "direct": "X",
    "other": "*",
}


def plot_crossover(
    rows: Sequence[dict[str, Any]], path: Path, device: str, versions: Sequence[str]
) -> Path | None:
    """ms against K (log-log), one line per version (``versions``: their labels, in
    order) and per cuDNN setting, cuDNN's points marked by the algorithm it ran; saved
    as PNG. In the simulator (no timings) the figure says so. Returns the path, or
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    cudnn = _cudnn_labels(rows)
    drawn = False
    for lab in [*versions, *cudnn]:
        pts = [(r["k"], r["ms"].get(lab)) for r in rows if r["ms"].get(lab) is not None]
        if not pts:
            continue
        drawn = True
        style = "--" if lab in cudnn else "-"
        ax.plot(*zip(*pts), style, label=lab, linewidth=1.5)
        if lab in cudnn:
            for r in rows:
                c = r.get("cudnn", {}).get(lab)
                if c and c["ms"] is not None:
                    ax.plot(r["k"], c["ms"], _PICK_MARKERS.get(c["algorithm"], "*"), color="k")
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ks = [r["k"] for r in rows]
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        picked = {c["algorithm"] for r in rows for c in r.get("cudnn", {}).values()}
        for alg in sorted(picked):
            marker = _PICK_MARKERS.get(alg, "*")
            ax.plot([], [], marker, color="k", linestyle="none", label=f"cuDNN ran: {alg}")
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "simulator: not timed; timings need a GPU", ha="center", va="center")
    shape = "x".join(map(str, rows[0]["x"])) if rows else "?"
    ax.set_xlabel("kernel size K")
    ax.set_ylabel("ms per convolution")
    ax.set_title(f"2-D convolution, x {shape}, 'same' padding, on {device}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
