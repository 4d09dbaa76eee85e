"""Where the time of a training step goes, system level: torch.profiler on the capstone.

config naive  NumbaCNN: the naive kernels, launched layer by layer from Python
config fast   FastCNN, eager: the fast kernels (28 launches) launched from Python
config graph  FastCNN, graph=True: the same launches captured once, replayed as one
              CUDA graph a step (GPU only: the simulator has no graphs)

Run:   python chapters/09_profiling/torch_profile.py [--batch 256] [--configs naive,fast,graph]
           [--warmup 3] [--out DIR]
       nsys profile --trace=cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop
           --cuda-graph-trace=node --stats=true -o step
           python chapters/09_profiling/torch_profile.py --nsys

For each configuration, after ``--warmup`` untimed steps (the first compiles
every kernel; with graphs it also captures), one training step runs under
``torch.profiler.profile(activities=[CPU, CUDA])``. torch.profiler sees our
kernels although Numba launches them through the driver API, not through
torch: it reads CUPTI, which records every kernel and copy of the process.
Each layer (NumbaCNN) or stage (FastCNN: ``train_step(..., on_stage=...)`` marks
the end of each of :data:`final_project.fast_model.STAGES`) runs inside a
``torch.profiler.record_function`` range and an NVTX range of its name, so the
trace and Nsight Systems show which layer launched what.

From the profiler's device events the script builds its own tables: GPU time
per kernel (``kernel_table``) and how much of the step the GPU sat idle between
kernels (``launch_gaps``: the union of the kernels' device intervals against
their span; both in tools.py). torch's own ``key_averages()`` table is printed
once to compare. Written to ``--out``: ``trace_<config>.json`` (open it in
ui.perfetto.dev or chrome://tracing) and ``torch_profile_kernels_<config>.json``
(the device intervals and the tables).

In the simulator the kernels run on the CPU as Python threads: there is no
device activity to record, so only CPU time is profiled, at the tiny size of
``final_project.train`` (8x8 images, channels 2/4, hidden 16, batch 2), and
the per-range CPU table stands in for the kernel table.

``--nsys`` runs the same ranges without torch.profiler, between
``cuProfilerStart``/``cuProfilerStop`` (``cuda.profile_start``/``stop``) around
the profiled step: Nsight Systems and torch.profiler both subscribe to CUPTI,
and CUPTI takes one subscriber at a time.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.harness import comma_names, positive_int, script_parser
from common.runtime import device_name, is_simulator, pick, runtime_name
from common.timing import format_table

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from numba import cuda
from torch.profiler import ProfilerActivity, profile

from final_project import train as ftrain
from final_project.fast_model import STAGES, FastCNN
from final_project.model import NetConfig, NumbaCNN

tools = import_sibling(__file__, "tools")
workloads = import_sibling(__file__, "workloads")

CHAPTER = "09_profiling"
CONFIGS = ("naive", "fast", "graph")
LR = 0.05


# --------------------------------------------------------------------------
# Tables over device intervals (pure functions: no GPU needed)
# --------------------------------------------------------------------------


def format_kernel_table(rows: Sequence[tools.KernelRow], title: str, top: int = 10) -> str:
    """The first ``top`` rows of ``tools.kernel_table`` (or of a range table), and
    one line for the rest."""
    cells = [
        [r.name, r.calls, f"{r.total_us:.1f}", f"{r.mean_us:.1f}", f"{r.percent:.1f}"]
        for r in rows[:top]
    ]
    header = ["name", "calls", "total us", "mean us", "%"]
    table = format_table(cells, title, header=header, align="<>>>>")
    rest = rows[top:]
    if rest:
        table += (
            f"\n  ... {len(rest)} more: {sum(r.total_us for r in rest):.1f} us "
            f"({sum(r.percent for r in rest):.1f}%)"
        )
    return table


def gap_line(gaps: tools.GapStats) -> str:
    """One line: the GPU's busy time against the step's span on the device."""
    return (
        f"GPU busy {gaps.busy_us:.1f} us of a {gaps.span_us:.1f} us step "
        f"({gaps.idle_percent:.1f}% idle between kernels; {gaps.gaps} gaps, "
        f"largest {gaps.largest_gap_us:.1f} us)"
    )


# --------------------------------------------------------------------------
# Profiling one step
# --------------------------------------------------------------------------


class Stepper(NamedTuple):
    """A model ready to step: ``step()`` runs one train_step inside its ranges
    (no host synchronisation); ``ranges`` names every range but the step's."""

    model: Any
    step: Callable[[], None]
    ranges: tuple[str, ...]


def make_stepper(config: str, net: NetConfig, batch: int, nvtx: bool, seed: int = 0) -> Stepper:
    """The model of ``config`` ("naive", "fast", "graph") at ``batch`` images of
    random float32 data (N, 1, H, W) and int32 labels, its ranges installed
    (a range a layer, tools.instrument_numba_cnn; a range a stage, tools.StageRanges)."""
    images, labels = workloads.capstone_inputs(net, batch, seed)
    x, y = cuda.to_device(images), cuda.to_device(labels)
    if config == "naive":
        model = NumbaCNN(net, max_batch=batch, seed=seed)
        close_update = tools.instrument_numba_cnn(model, nvtx)

        def naive_step() -> None:
            try:
                model.train_step(x, y, LR)
            finally:
                close_update()

        return Stepper(model, naive_step, tuple(tools.numba_range_names()))
    if config not in ("fast", "graph"):
        raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")
    model = FastCNN(net, max_batch=batch, seed=seed, graph=config == "graph")
    if config == "graph":
        # A replayed graph runs without Python: no marks, only the step's range.
        return Stepper(model, lambda: model.train_step(x, y, LR), ())
    # on_stage is called right after each stage's launches: it closes that stage's
    # range and opens the next one's
    stage_ranges = tools.StageRanges(STAGES, nvtx)

    def fast_step() -> None:
        with stage_ranges.stages():
            model.train_step(x, y, LR, on_stage=stage_ranges.mark)

    return Stepper(model, fast_step, STAGES)


def _synchronize() -> None:
    cuda.synchronize()
    if torch.cuda.is_available() and not is_simulator():
        torch.cuda.synchronize()


def profile_step(stepper: Stepper, warmup: int, cuda_activity: bool) -> Any:
    """``warmup`` untimed steps, then one step under torch.profiler inside a
    "step" range; returns the finished profile."""
    for _ in range(warmup):
        stepper.step()
    _synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda_activity else [])
    with profile(activities=activities) as prof:
        with tools.named_range(tools.STEP_RANGE, tools.nvtx_available()):
            stepper.step()
        # inside the profile: kernels still running at its end would be lost
        _synchronize()
    return prof


def nsys_step(stepper: Stepper, warmup: int) -> float:
    """For Nsight Systems: ``warmup`` steps, then one step inside its NVTX ranges
    between cuProfilerStart and cuProfilerStop. Returns the step's host ms."""
    for _ in range(warmup):
        stepper.step()
    _synchronize()
    cuda.profile_start()
    t0 = time.perf_counter()
    with tools.named_range(tools.STEP_RANGE, True):
        stepper.step()
    _synchronize()
    ms = 1e3 * (time.perf_counter() - t0)
    cuda.profile_stop()
    return ms


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, CHAPTER)
    p.add_argument(
        "--batch",
        type=positive_int,
        default=pick(gpu=256, simulator=2),
        help="images per step (default 256; simulator 2)",
    )
    p.add_argument(
        "--configs",
        type=comma_names(tuple(CONFIGS)),
        default=None,
        help="configurations, comma-separated (default naive,fast,graph; simulator naive,fast)",
    )
    p.add_argument(
        "--warmup",
        type=positive_int,
        default=pick(gpu=3, simulator=1),
        help="untimed steps before the profiled one (default 3; simulator 1): the first compiles",
    )
    p.add_argument(
        "--nsys",
        action="store_true",
        help="no torch.profiler: NVTX ranges and cuProfilerStart/Stop around the step, "
        "for nsys --capture-range=cudaProfilerApi (GPU only)",
    )
    p.add_argument("--no-torch-table", action="store_true", help="skip torch's own summary table")
    args = p.parse_args(argv)
    sim = is_simulator()
    configs = args.configs or (["naive", "fast"] if sim else list(CONFIGS))
    if sim and "graph" in configs:
        p.error("--configs graph needs a GPU: the simulator has no CUDA graphs")
    if sim and args.nsys:
        p.error("--nsys needs a GPU: Nsight Systems traces GPU activity")
    if args.nsys and not tools.nvtx_available():
        p.error("--nsys needs a CUDA build of torch: its NVTX ranges come from torch.cuda.nvtx")
    if not sim and not args.nsys and len(configs) > 1:  # one process each: tools.run_apart
        shared = ["--batch", str(args.batch), "--warmup", str(args.warmup), "--out", str(args.out)]
        quiet = ["--no-torch-table"]
        children = {
            name: ["--configs", name, *shared, *(quiet if k or args.no_torch_table else [])]
            for k, name in enumerate(configs)
        }
        return tools.run_apart(__file__, children)
    net = workloads.capstone_net()
    cuda_activity = not sim and torch.cuda.is_available()
    nvtx = tools.nvtx_available()
    out = Path(args.out)
    if sim:
        print(
            f"simulator: the tiny network ({ftrain.describe_config(net)}), batch {args.batch}, "
            f"{args.warmup} warm-up step(s); CPU activity only"
        )
    else:
        print(
            f"GPU: {device_name()}; full network ({ftrain.describe_config(net)}), batch "
            f"{args.batch}, {args.warmup} warm-up steps; torch {torch.__version__}"
        )
        if not cuda_activity:
            print(
                "torch has no CUDA here (a CPU build?): profiling CPU activity only; "
                "install a CUDA build of torch for the kernel tables"
            )
    if args.nsys:
        for name in configs:
            ms = nsys_step(make_stepper(name, net, args.batch, nvtx), args.warmup)
            print(f"{name}: one step inside cuProfilerStart/Stop, {ms:.2f} ms on the host")
        print("nsys writes its report (-o NAME) and, with --stats=true, its summary tables")
        return 0

    meta = {"device": device_name(), "runtime": runtime_name(), "warmup": args.warmup}
    meta |= {"torch_version": torch.__version__, "network": ftrain.describe_config(net)}
    step = tools.STEP_RANGE
    torch_table_printed = args.no_torch_table
    for name in configs:
        stepper = make_stepper(name, net, args.batch, nvtx)
        prof = profile_step(stepper, args.warmup, cuda_activity)
        events, named = prof.events(), (step, *stepper.ranges)
        ranges = tools.host_records(events, named)
        kernels = tools.device_records(events, exclude=named) if cuda_activity else []
        step_ms = next((r.end_us - r.start_us for r in ranges if r.name == step), math.nan) / 1e3
        print(f"\n===== {name}: train_step took {step_ms:.3f} ms on the host")
        if kernels:
            title = f"GPU time per kernel ({len(kernels)} launches and copies)"
            print(format_kernel_table(tools.kernel_table(kernels), title))
            print(gap_line(tools.launch_gaps((r.start_us, r.end_us) for r in kernels)))
            if not torch_table_printed:
                print(f"\ntorch's own table for {name} (key_averages, by CUDA time):")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
                torch_table_printed = True
        stage_ranges = [r for r in ranges if r.name != step]
        if sim and stage_ranges:
            title = "CPU time per range (the simulator runs each kernel's threads in it)"
            rows = tools.kernel_table(stage_ranges)
            print(format_kernel_table(rows, title, top=len(rows)))
        if not kernels:
            why = (
                "the simulator runs kernels on the CPU, so there are no device events"
                if sim
                else "no device events were recorded (torch without CUDA?)"
            )
            print(f"GPU part skipped: {why}; run on a GPU for the kernel table and launch gaps")
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace))
        path = out / f"torch_profile_kernels_{name}.json"
        table = tools.write_profile(path, name, args.batch, kernels, ranges, **meta)
        print(f"wrote {trace} and {table}")
    print(
        "\nopen a trace_<config>.json in https://ui.perfetto.dev (Open trace file) or "
        "chrome://tracing (Load): one row a thread and, on a GPU, one a stream; the "
        "ranges above the kernels they launched"
    )
    return 0


if __name__ == "__main__":
    tools.run_script_skipping_teardown(main)
