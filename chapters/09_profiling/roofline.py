"""The roofline: every kernel's FLOP/s against its arithmetic intensity and the device's roofs.

A kernel doing F floating-point operations while moving B bytes through
device memory has arithmetic intensity I = F / B (FLOP per byte). In time t it
reaches F / t FLOP/s, and it can reach at most

    attainable(I) = min(peak FLOP/s, I * peak bytes/s)

(Williams, Waterman and Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 2009). Left of the ridge
I = peak FLOP/s / peak bytes/s the bandwidth roof binds (memory-bound), right of
it the arithmetic roof. How close a kernel sits under its roof says how much is
left to win; which roof it sits under says what to change.

The roofs here are the device's *measured* peaks (common.timing.device_peaks:
a device-to-device copy and cuBLAS SGEMM with TF32 off), not the datasheet's.
B counts each input read once and each output written once (the fewest bytes);
caches can make a kernel move fewer from DRAM, a poor access pattern many more
(Nsight Compute's dram__bytes says which, nsight_compute.py).

Points: the chapter's workloads (matmul v3/v4/v5/v10; the transposes and
histograms move bytes only and are listed by bandwidth) and every stage of the
capstone's fast training step at batch 1024 (final_project.compare's stage
table). On a GPU it measures them and writes roofline.json and roofline.png;
in the simulator it redraws the figure from the GPU run saved in
saved/roofline_h100.json.

Run: python chapters/09_profiling/roofline.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import benchmark, device_peaks, import_sibling, is_simulator
from common.harness import run_script, script_parser
from common.runtime import device_name
from common.timing import format_table

import json
from pathlib import Path
from typing import Any

import numpy as np

tools = import_sibling(__file__, "tools")
workloads = import_sibling(__file__, "workloads")
SAVED_POINTS = tools.SAVED_DIR / "roofline_h100.json"  # the points of the course's GPU run


def attainable_flops(intensity: float, peak_flops: float, peak_bytes_per_s: float) -> float:
    """min(peak_flops, intensity * peak_bytes_per_s), in FLOP/s. Raises
    ValueError for a negative intensity or non-positive peaks."""
    if intensity < 0 or peak_flops <= 0 or peak_bytes_per_s <= 0:
        raise ValueError(
            f"need intensity >= 0 and positive peaks, got {intensity}, {peak_flops}, {peak_bytes_per_s}"
        )
    return min(peak_flops, intensity * peak_bytes_per_s)


def roofline_point(
    name: str, flops: int, nbytes: int, seconds: float, peaks: dict
) -> dict[str, Any]:
    """Where one timed kernel sits: intensity (FLOP/byte), achieved TFLOP/s and
    GB/s, the attainable TFLOP/s at its intensity, which roof binds there
    ("memory" left of the ridge, "compute" right of it) and the fraction of that
    roof reached. peaks: {"sgemm_tflops", "copy_gbps"}. A kernel with no FLOPs
    gets intensity 0 and is judged by bandwidth alone (fraction of copy)."""
    if seconds <= 0 or nbytes <= 0 or flops < 0:
        raise ValueError(f"{name}: need seconds > 0, nbytes > 0, flops >= 0")
    peak_flops = peaks["sgemm_tflops"] * 1e12
    peak_bw = peaks["copy_gbps"] * 1e9
    intensity = flops / nbytes
    achieved = flops / seconds
    bandwidth = nbytes / seconds
    roof = attainable_flops(intensity, peak_flops, peak_bw)
    memory_bound = intensity * peak_bw < peak_flops
    return {
        "name": name,
        "flops": flops,
        "nbytes": nbytes,
        "us": seconds * 1e6,
        "intensity": intensity,
        "tflops": achieved / 1e12,
        "gbps": bandwidth / 1e9,
        "attainable_tflops": roof / 1e12,
        "bound": "memory" if memory_bound else "compute",
        "fraction_of_roof": (achieved / roof) if flops else bandwidth / peak_bw,
    }


def measure() -> dict[str, Any]:
    """Time the workloads and the capstone's stages on this GPU; returns
    {"device", "peaks", "kernels": [{name, flops, nbytes, us}]}."""
    peaks = device_peaks()
    kernels = []
    for run in workloads.kernel_runs():
        run.run()
        run.check()
        # hold_ms: queue the launches behind a sleeping kernel, so a launch's host
        # cost (the histogram's two launches, say) is not timed as GPU time
        t = benchmark(run.run, run.label, repeats=20, peaks=peaks, hold_ms=50)
        kernels.append(
            {"name": run.label, "flops": run.flops, "nbytes": run.nbytes, "us": t.median_ms * 1e3}
        )
    from final_project import compare  # GPU only: it loads torch

    net, batch = workloads.capstone_net(), workloads.CAPSTONE_BATCH
    images, labels = workloads.capstone_inputs(net, batch)
    rows = compare.stage_breakdown(net, images, labels, batch, 0.01, 0, 20, peaks)
    work = compare.stage_work(net, batch)
    for r in rows:
        flops, nbytes = work[r["stage"]]
        if nbytes:  # the statistics stages are folded into the convolutions
            kernels.append(
                {
                    "name": f"capstone {r['stage']}",
                    "flops": flops,
                    "nbytes": nbytes,
                    "us": r["ms"] * 1e3,
                }
            )
    return {
        "device": device_name(),
        "peaks": {k: peaks[k] for k in ("copy_gbps", "sgemm_tflops")},
        "kernels": kernels,
    }


def points(measured: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        roofline_point(k["name"], k["flops"], k["nbytes"], k["us"] * 1e-6, measured["peaks"])
        for k in measured["kernels"]
    ]


def format_points(rows: list[dict[str, Any]]) -> str:
    """The points of :func:`points` as a table, by arithmetic intensity."""
    cells = [
        [
            r["name"],
            f"{r['us']:.1f}",
            f"{r['intensity']:.2f}",
            f"{r['tflops']:.2f}" if r["flops"] else "-",
            f"{r['gbps']:.0f}",
            r["bound"],
            f"{100 * r['fraction_of_roof']:.1f}",
        ]
        for r in sorted(rows, key=lambda r: r["intensity"])
    ]
    header = ["kernel", "us", "FLOP/B", "TFLOP/s", "GB/s", "bound", "% of roof"]
    return format_table(cells, header=header, align="<>>>>>>")


def plot(rows: list[dict[str, Any]], peaks: dict, device: str, path: Path) -> None:
    """Log-log roofline with the kernels that do arithmetic; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak_flops, peak_bw = peaks["sgemm_tflops"] * 1e12, peaks["copy_gbps"] * 1e9
    ridge = peak_flops / peak_bw
    xs = np.logspace(-2, 3, 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(xs, [attainable_flops(x, peak_flops, peak_bw) / 1e12 for x in xs], "k-", lw=2)
    ax.axvline(ridge, color="0.7", ls=":", lw=1)
    ax.text(ridge * 1.1, peaks["sgemm_tflops"] * 0.2, f"ridge {ridge:.1f} FLOP/B", color="0.4")
    ax.text(
        0.012,
        peaks["sgemm_tflops"] * 1.15,
        f"SGEMM {peaks['sgemm_tflops']:.0f} TFLOP/s, copy {peaks['copy_gbps']:.0f} GB/s (measured)",
    )
    for r in rows:
        if not r["flops"]:
            continue
        capstone = r["name"].startswith("capstone")
        ax.loglog(
            r["intensity"],
            r["tflops"],
            "o" if capstone else "s",
            color="tab:blue" if capstone else "tab:orange",
            ms=6,
        )
        ax.annotate(
            r["name"].replace("capstone ", "").replace("matmul ", "mm ")[:24],
            (r["intensity"], r["tflops"]),
            fontsize=7,
            xytext=(4, -3),
            textcoords="offset points",
        )
    ax.set_xlabel("arithmetic intensity (FLOP / byte, fewest bytes)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(
        f"Roofline, {device}: capstone stages at batch {workloads.CAPSTONE_BATCH} (circles), "
        "chapter 08 matmuls (squares)",
        fontsize=9,
    )
    ax.set_ylim(1e-3, peaks["sgemm_tflops"] * 3)
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    args = parser.parse_args(argv)
    if is_simulator():
        measured = json.loads(SAVED_POINTS.read_text())
        print(
            f"simulator: nothing to time; the points of a GPU run ({measured['device']}), "
            f"from {SAVED_POINTS.name}"
        )
    else:
        measured = measure()
    rows = points(measured)
    peaks = measured["peaks"]
    print(
        f"roofs: {peaks['sgemm_tflops']:.1f} TFLOP/s (SGEMM), {peaks['copy_gbps']:.0f} GB/s "
        f"(copy); ridge {peaks['sgemm_tflops'] * 1e3 / peaks['copy_gbps']:.1f} FLOP/byte"
    )
    print(format_points(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps(measured, indent=2))
    plot(rows, peaks, measured["device"], args.out / "roofline.png")
    print(f"wrote {args.out / 'roofline.json'} and {args.out / 'roofline.png'}")
    return 0


if __name__ == "__main__":
    run_script(main)
