"""Why a kernel is slow: Nsight Compute's counters on three slow/fast pairs.

``ncu`` (Nsight Compute) replays each kernel launch many times, reading a few
hardware counters each pass, and reports per kernel what limited it. This
script profiles the pairs of workloads.py (transpose v1/v2/v3, histogram v1/v2,
matmul v3/v4/v5/v10) and prints, side by side, the counters that explain each
gap:

* duration, DRAM throughput (% of peak) and bytes moved: is it memory-bound?
* global sectors per request: 4 is a coalesced warp of float32 (128 bytes =
  four 32-byte sectors), 32 is every thread in its own sector;
* shared-memory bank conflicts (extra wavefronts, loads and stores);
* achieved occupancy, and the stall reason warps spent most cycles on.

How it runs ncu (``--profile-from-start off`` plus ``cuda.profile_start()``
around one launch of each kernel, so compilation and checks stay out)::

    ncu --csv --page details --print-kernel-base function --clock-control none \\
        --profile-from-start off --log-file runs/09_profiling/ncu_transpose.csv \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --metrics <the metrics in METRICS> \\
        python chapters/09_profiling/nsight_compute.py --target transpose

``--clock-control none`` keeps the GPU's own clocks, so durations match CUDA
event timings; ncu's default locks them to base clocks (slower, steadier).
``--log-file`` keeps ncu's CSV apart from the program's own output. Where ncu
is not on the PATH (the simulator, a machine without the CUDA toolkit), the
script prints these commands and reads the reports saved from a GPU run
(saved/ncu_<pair>.csv) instead.

Run: python chapters/09_profiling/nsight_compute.py [--pairs transpose,matmul]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, is_simulator
from common.harness import run_script, save_results, script_parser
from common.timing import format_table

import csv
import io
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numba import cuda

from final_project.fast_model import FastCNN

short_kernel_name = import_sibling(__file__, "kernel_names").short_kernel_name
tools = import_sibling(__file__, "tools")
workloads = import_sibling(__file__, "workloads")

PAIRS = ("transpose", "histogram", "matmul")
# "capstone": one training step of the capstone's fast kernels at workloads.CAPSTONE_BATCH
TARGETS = (*PAIRS, "capstone")
HELPER_KERNELS = {"fill_int"}  # the histogram launchers' zeroing kernel: not under study

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "smsp__inst_executed.sum",
    # one metric per stall reason: cycles a warp spends stalled on it per instruction issued
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
)
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


@dataclass
class NcuKernel:
    """One profiled launch of an ncu details report.

    id: ncu's launch number; name: the kernel's short name (kernel_names.py);
    block, grid: (x, y, z); metrics: metric name -> (value as printed, unit).
    Section metrics are keyed by their display name ("Duration",
    "Theoretical Occupancy"), command-line metrics by their raw name.
    """

    id: int
    name: str
    block: tuple[int, int, int]
    grid: tuple[int, int, int]
    metrics: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def block_threads(self) -> int:
        x, y, z = self.block
        return x * y * z

    def value(self, metric: str) -> float:
        """A metric as a number ("1,234.5" -> 1234.5). Raises KeyError naming the
        metrics present if it was not collected, ValueError if not numeric."""
        if metric not in self.metrics:
            raise KeyError(
                f"{metric!r} not in ncu's report for {self.name} (launch {self.id}); "
                f"collected: {sorted(self.metrics)[:8]}..."
            )
        text = self.metrics[metric][0].replace(",", "")
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{metric} of {self.name} is {text!r}, not a number") from None

    def stalls(self) -> dict[str, float]:
        """Cycles per issued instruction spent in each stall reason ("long_scoreboard": 13.2)."""
        out = {}
        for name in self.metrics:
            m = _STALL.fullmatch(name)
            if m:
                out[m.group(1)] = self.value(name)
        return out


def _triple(text: str) -> tuple[int, int, int]:
    x, y, z = (int(v) for v in text.strip("()").split(","))
    return x, y, z


def parse_ncu_csv(text: str) -> list[NcuKernel]:
    """The kernels of an ``ncu --csv --page details`` report, in profiling order.

    Lines that are not CSV records (``==PROF==`` messages, the program's own
    output when ``--log-file`` was not used) are skipped; the rule rows (ncu's
    advice, with an empty metric name) too. Raises ValueError if the text holds
    no report header, or the header lacks a column this parser needs.
    """
    records = [line for line in text.splitlines(keepends=True) if line.startswith('"')]
    if not records or not records[0].startswith('"ID"'):
        raise ValueError("no ncu CSV header found: was the report made with --csv --page details?")
    reader = csv.DictReader(io.StringIO("".join(records)))
    need = {
        "ID",
        "Kernel Name",
        "Block Size",
        "Grid Size",
        "Metric Name",
        "Metric Unit",
        "Metric Value",
    }
    missing = need - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"ncu CSV lacks columns {sorted(missing)}: use --page details")
    kernels: dict[int, NcuKernel] = {}
    for row in reader:
        if row["ID"] == "ID":  # a second report's header
            continue
        kid = int(row["ID"])
        k = kernels.get(kid)
        if k is None:
            k = kernels[kid] = NcuKernel(
                kid,
                short_kernel_name(row["Kernel Name"]),
                _triple(row["Block Size"]),
                _triple(row["Grid Size"]),
            )
        if row["Metric Name"]:
            k.metrics[row["Metric Name"]] = (row["Metric Value"], row["Metric Unit"])
    return list(kernels.values())


def _ratio(k: NcuKernel, num: str, den: str) -> float | None:
    d = k.value(den)
    return k.value(num) / d if d else None


def summary(k: NcuKernel) -> dict[str, Any]:
    """The figures this chapter reads off one kernel (times in us, rates in GB/s)."""
    us = k.value("Duration") / 1e3 if k.metrics["Duration"][1] == "ns" else k.value("Duration")
    if k.metrics["Duration"][1] not in ("ns", "us"):
        raise ValueError(f"unexpected Duration unit {k.metrics['Duration'][1]!r}")
    dram = k.value("dram__bytes_read.sum") + k.value("dram__bytes_write.sum")
    stalls = {r: v for r, v in k.stalls().items() if r != "selected"}
    top = max(stalls, key=stalls.get) if stalls else None
    return {
        "kernel": k.name,
        "us": us,
        "dram_pct": k.value("DRAM Throughput"),
        "dram_gbps": dram / (us * 1e-6) / 1e9,
        "sectors_per_ld": _ratio(
            k,
            "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
            "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
        ),
        "sectors_per_st": _ratio(
            k,
            "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
            "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
        ),
        "bank_conflicts": int(
            k.value("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
            + k.value("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")
        ),
        "achieved_occupancy_pct": k.value("Achieved Occupancy"),
        "theoretical_occupancy_pct": k.value("Theoretical Occupancy"),
        "registers": int(k.value("Registers Per Thread")),
        "top_stall": top,
        "top_stall_cycles": stalls.get(top) if top else None,
        "cycles_per_instruction": k.value("Warp Cycles Per Issued Instruction"),
    }


def format_summary(rows: list[dict[str, Any]], title: str | None = None) -> str:
    """The rows of :func:`summary` as a table, one kernel a line."""

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    cells = [
        [
            r["kernel"],
            f"{r['us']:.1f}",
            f"{r['dram_pct']:.1f}",
            f"{r['dram_gbps']:.0f}",
            f(r["sectors_per_ld"], ".1f"),
            f(r["sectors_per_st"], ".1f"),
            f"{r['bank_conflicts']:,}",
            f"{r['achieved_occupancy_pct']:.1f}",
            r["registers"],
            f"{r['top_stall']} ({f(r['top_stall_cycles'], '.1f')} of "
            f"{r['cycles_per_instruction']:.1f})",
        ]
        for r in rows
    ]
    header = ["kernel", "us", "DRAM%", "GB/s", "sec/ld", "sec/st", "bank confl.", "occ%", "regs"]
    header.append("top stall (cycles/instr)")
    return format_table(cells, title, header=header, align="<>>>>>>>><")


def ncu_command(log_file: Path, program: list[str]) -> list[str]:
    """The ncu command line that profiles ``python *program`` into ``log_file``."""
    cmd = [
        "ncu",
        "--csv",
        "--page",
        "details",
        "--print-kernel-base",
        "function",
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "--log-file",
        str(log_file),
    ]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += ["--metrics", ",".join(METRICS)]
    return cmd + [sys.executable, *program]


def profile_or_saved(log: Path, program: list[str], say_skip: bool = True) -> tuple[str, str]:
    """Run ncu on ``python *program`` into ``log`` where ncu and a GPU are here;
    else print the command (when ``say_skip``) and read ``saved/<log's name>``,
    the report of the course's GPU run. Returns (report text, where it came from).

    Raises RuntimeError, with ncu's output, if ncu fails.
    """
    cmd = ncu_command(log, program)
    if shutil.which("ncu") is not None and not is_simulator():
        print(f"$ {' '.join(cmd[:12])} ... {' '.join(program[1:])}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"ncu failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        return log.read_text(), f"this run ({log})"
    if say_skip:
        why = "the simulator runs no GPU code" if is_simulator() else "ncu is not on the PATH"
        print(f"skipped running ncu: {why}. On a GPU machine this script runs:\n  " + " ".join(cmd))
    return (tools.SAVED_DIR / log.name).read_text(), f"saved/{log.name}"


def _capstone_step() -> None:
    """One eager training step of the capstone's FastCNN at workloads.CAPSTONE_BATCH
    in the profiled range (a first step compiles every kernel)."""
    net, batch = workloads.capstone_net(), workloads.CAPSTONE_BATCH
    images, labels = workloads.capstone_inputs(net, batch)
    x, y = cuda.to_device(images), cuda.to_device(labels)
    model = FastCNN(net, max_batch=batch, seed=0, graph=False)
    model.train_step(x, y, 0.01)
    cuda.synchronize()
    cuda.profile_start()
    model.train_step(x, y, 0.01)
    cuda.synchronize()
    cuda.profile_stop()


def run_target(pair: str) -> None:
    """What ncu wraps: check every kernel of ``pair``, then launch each once
    between cuda.profile_start() and cuda.profile_stop()."""
    if pair == "capstone":
        _capstone_step()
        return
    runs = workloads.kernel_runs((pair,))
    for run in runs:
        run.run()  # compiles
        run.check()
    cuda.synchronize()
    cuda.profile_start()
    for run in runs:
        run.run()
    cuda.synchronize()
    cuda.profile_stop()


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    parser.add_argument(
        "--pairs", default=",".join(TARGETS), help="comma-separated, of " + ", ".join(TARGETS)
    )
    parser.add_argument(
        "--target", choices=TARGETS, help="(what ncu runs) launch one pair's kernels once"
    )
    args = parser.parse_args(argv)
    if args.target:
        run_target(args.target)
        return 0
    pairs = [p for p in args.pairs.split(",") if p]
    bad = set(pairs) - set(TARGETS)
    if bad:
        parser.error(f"unknown pair(s) {sorted(bad)}; choose from {', '.join(TARGETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for pair in pairs:
        text, source = profile_or_saved(
            args.out / f"ncu_{pair}.csv",
            [str(Path(__file__).resolve()), "--target", pair],
            say_skip=pair == pairs[0],
        )
        kernels = [k for k in parse_ncu_csv(text) if k.name not in HELPER_KERNELS]
        rows = [summary(k) for k in kernels]
        results[pair] = rows
        print(format_summary(rows, f"\n{pair}: from {source}"))
    save_results(
        [{"pair": pair, **row} for pair, rows in results.items() for row in rows],
        args.out,
        "nsight_compute",
    )
    return 0


if __name__ == "__main__":
    run_script(main)
