"""Where the time of a training step goes, system level: torch.profiler on the capstone.

config naive  NumbaCNN: the naive kernels, launched layer by layer from Python
config fast   FastCNN, eager: the fast kernels (27 launches) launched from Python
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
Each layer (NumbaCNN) or stage (FastCNN, :data:`final_project.fast_model.STAGES`)
runs inside a ``torch.profiler.record_function`` range and an NVTX range of
its name, so the trace and Nsight Systems show which layer launched what.

From the profiler's device events this script builds its own tables: GPU
time per kernel (:func:`kernel_table`) and how much of the step the GPU sat
idle between kernels (:func:`launch_gaps`: the union of the kernels' device
intervals against their span). torch's own ``key_averages()`` table is printed
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

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
from common import import_sibling
from common.harness import run_script, script_parser
from common.runtime import device_name, is_simulator, pick, runtime_name

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from numba import cuda
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from final_project import train as ftrain
from final_project.fast_model import STAGES, FastCNN
from final_project.model import NetConfig, NumbaCNN

kernel_names = import_sibling(__file__, "kernel_names")

CHAPTER = "09_profiling"
CONFIGS = ("naive", "fast", "graph")
LR = 0.05
STEP = "step"  # the range around the whole profiled train_step
# NumbaCNN's layers in forward order (attribute names): each gets a "<name> forward"
# and a "<name> backward" range; the loss (``criterion``) is shown as "loss".
NUMBA_LAYERS = (
    "conv1",
    "bn1",
    "relu1",
    "pool1",
    "conv2",
    "bn2",
    "relu2",
    "pool2",
    "fc1",
    "relu3",
    "fc2",
    "criterion",
)
SGD_RANGE = "sgd update"


# --------------------------------------------------------------------------
# Tables over device intervals (pure functions: no GPU needed)
# --------------------------------------------------------------------------


class KernelRecord(NamedTuple):
    """One kernel or copy on the device: its name as the profiler prints it and
    its start and end in microseconds (any common origin)."""

    name: str
    start_us: float
    end_us: float


class KernelRow(NamedTuple):
    """A row of :func:`kernel_table`: a kernel's short name, its launches, GPU time
    in microseconds (total and per launch) and percent of all the GPU time."""

    name: str
    calls: int
    total_us: float
    mean_us: float
    percent: float


class GapStats(NamedTuple):
    """What :func:`launch_gaps` measures, in microseconds.

    busy_us: time at least one kernel ran (overlaps counted once); span_us: first
    start to last end; idle_us: span - busy; gaps: idle stretches between kernels;
    largest_gap_us: the longest of them (0 when there is none).
    """

    busy_us: float
    span_us: float
    idle_us: float
    gaps: int
    largest_gap_us: float

    @property
    def idle_percent(self) -> float:
        """Idle time in percent of the span (0 for a span of 0)."""
        return 100.0 * self.idle_us / self.span_us if self.span_us > 0 else 0.0


def _records(records: Iterable[Sequence[Any]]) -> list[KernelRecord]:
    out = [KernelRecord(str(r[0]), float(r[1]), float(r[2])) for r in records]
    if not out:
        raise ValueError(
            "no kernel records: the profiler saw no device activity (was the CUDA "
            "activity on, and did the step run inside the profile?)"
        )
    bad = [r for r in out if not (np.isfinite(r.start_us) and r.end_us >= r.start_us)]
    if bad:
        raise ValueError(
            f"{len(bad)} of {len(out)} records end before they start or are not finite, "
            f"e.g. {bad[0]}: pass (name, start_us, end_us)"
        )
    return out


def kernel_table(records: Iterable[Sequence[Any]]) -> list[KernelRow]:
    """GPU time per kernel, largest first.

    records: (name, start_us, end_us) triples (e.g. :class:`KernelRecord`), one
    a launch. Launches are grouped by :func:`kernel_names.short_kernel_name`, so
    the specialisations of one Numba kernel (``conv2d_igemm`` made for two
    tile shapes) add up in one row. A row's percent is of the sum of every
    launch's duration (so the rows sum to 100). Ties are ordered by name.

    Raises:
        ValueError: no records, or a record that ends before it starts.
    """
    totals: dict[str, list[float]] = {}
    for r in _records(records):
        totals.setdefault(kernel_names.short_kernel_name(r.name), []).append(r.end_us - r.start_us)
    grand = sum(sum(d) for d in totals.values())
    rows = [
        KernelRow(
            name,
            len(d),
            sum(d),
            sum(d) / len(d),
            100.0 * sum(d) / grand if grand > 0 else 100.0 / len(totals),
        )
        for name, d in totals.items()
    ]
    return sorted(rows, key=lambda row: (-row.total_us, row.name))


def launch_gaps(intervals: Iterable[Sequence[float]]) -> GapStats:
    """How busy the GPU was between the first kernel's start and the last one's end.

    intervals: (start_us, end_us) pairs, in any order. Overlapping intervals
    (kernels on several streams, a copy under a kernel) are merged first, so
    busy time never exceeds the span; intervals that touch leave no gap.

    Raises:
        ValueError: no intervals, or one that ends before it starts.
    """
    spans = sorted((r.start_us, r.end_us) for r in _records(("", s, e) for s, e in intervals))
    busy, gaps, largest = 0.0, 0, 0.0
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps += 1
            largest = max(largest, start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    # The last interval to start need not be the last to end (one kernel inside another).
    span = max(end for _, end in spans) - spans[0][0]
    return GapStats(busy, span, span - busy, gaps, largest)


def format_kernel_table(rows: Sequence[KernelRow], title: str, top: int = 10) -> str:
    """The first ``top`` rows of :func:`kernel_table` (or of a range table), and
    one line for the rest."""
    width = max([len(r.name) for r in rows[:top]] + [24])
    lines = [
        title,
        f"  {'name':<{width}} {'calls':>5} {'total us':>11} {'mean us':>10} {'%':>6}",
    ]
    for r in rows[:top]:
        lines.append(
            f"  {r.name:<{width}} {r.calls:>5} {r.total_us:>11.1f} {r.mean_us:>10.1f} "
            f"{r.percent:>6.1f}"
        )
    rest = rows[top:]
    if rest:
        lines.append(
            f"  ... {len(rest)} more: {sum(r.total_us for r in rest):.1f} us "
            f"({sum(r.percent for r in rest):.1f}%)"
        )
    return "\n".join(lines)


def gap_line(gaps: GapStats) -> str:
    """One line: the GPU's busy time against the step's span on the device."""
    return (
        f"GPU busy {gaps.busy_us:.1f} us of a {gaps.span_us:.1f} us step "
        f"({gaps.idle_percent:.1f}% idle between kernels; {gaps.gaps} gaps, "
        f"largest {gaps.largest_gap_us:.1f} us)"
    )


# --------------------------------------------------------------------------
# Named ranges: torch.profiler's record_function and NVTX together
# --------------------------------------------------------------------------


def nvtx_available() -> bool:
    """NVTX ranges need a GPU and a torch built with CUDA (torch.cuda.nvtx)."""
    return not is_simulator() and torch.cuda.is_available()


class _Range:
    """One open range: a record_function (torch's trace) and, if ``nvtx``, an
    NVTX push/pop pair (Nsight Systems' timeline)."""

    def __init__(self, name: str, nvtx: bool) -> None:
        self.name, self.nvtx = name, nvtx
        self._rf = record_function(name)
        self._rf.__enter__()
        if nvtx:
            torch.cuda.nvtx.range_push(name)

    def close(self) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._rf.__exit__(None, None, None)


@contextlib.contextmanager
def named_range(name: str, nvtx: bool) -> Iterator[None]:
    """A record_function range and (``nvtx``) an NVTX range around the block."""
    r = _Range(name, nvtx)
    try:
        yield
    finally:
        r.close()


class StageRanges:
    """Turns the ``mark(stage)`` callbacks of :meth:`FastCNN._step` into one range a stage.

    ``mark(name)`` comes *after* a stage's launches, so the range of stage k
    opens at mark k - 1 (the first at :meth:`stages`) and closes at mark k.
    The marks must arrive in the order of ``stages``: a range named after the
    wrong stage would mislabel every kernel after it.

    Usage::

        ranges = StageRanges(STAGES)
        with ranges.stages():
            model._step(n, lr, ranges.mark)

    Raises:
        RuntimeError: a mark out of order, a mark outside :meth:`stages`, or a
            step that ends before every stage was marked.
    """

    def __init__(self, stages: Sequence[str], nvtx: bool = False) -> None:
        if not stages:
            raise ValueError("StageRanges needs at least one stage name")
        self.names = tuple(stages)
        self.nvtx = nvtx
        self._next = 0
        self._open: _Range | None = None

    @contextlib.contextmanager
    def stages(self) -> Iterator[None]:
        """Opens the first stage's range; on exit checks every stage was marked."""
        if self._open is not None:
            raise RuntimeError("StageRanges.stages() entered twice: one step at a time")
        self._next = 0
        self._open = _Range(self.names[0], self.nvtx)
        try:
            yield
        except BaseException:
            self._close()
            raise
        if self._next != len(self.names):
            self._close()
            raise RuntimeError(
                f"the step ended after {self._next} of {len(self.names)} stage marks "
                f"(next expected: {self.names[self._next]!r}): the model's stages and "
                "the names given to StageRanges (fast_model.STAGES) disagree"
            )

    def _close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def mark(self, name: str) -> None:
        """Closes the current stage's range (it must be ``name``) and opens the next."""
        if self._open is None:
            raise RuntimeError(f"mark({name!r}) outside StageRanges.stages()")
        expected = self.names[self._next]
        if name != expected:
            self._close()
            raise RuntimeError(
                f"stage mark {name!r} arrived where {expected!r} was expected (mark "
                f"{self._next + 1} of {len(self.names)}): the model's launch order and "
                "fast_model.STAGES disagree; fix STAGES to the order _step marks"
            )
        self._close()
        self._next += 1
        if self._next < len(self.names):
            self._open = _Range(self.names[self._next], self.nvtx)


def _in_range(name: str, fn: Callable[..., Any], nvtx: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with named_range(name, nvtx):
            return fn(*args, **kwargs)

    return wrapper


def _then_open(name: str, fn: Callable[..., Any], nvtx: bool, holder: list) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        holder.append(_Range(name, nvtx))
        return result

    return wrapper


def instrument_numba_cnn(model: NumbaCNN, nvtx: bool) -> Callable[[], None]:
    """Wraps each layer's forward and backward of ``model`` (this instance only)
    in a range "<layer> forward" / "<layer> backward".

    ``train_step`` is ``loss_and_grads`` then the SGD update: the update's range
    ("sgd update") opens when ``loss_and_grads`` returns; call the returned
    function after ``train_step`` to close it.

    Raises:
        AttributeError: the model has no layer of that name (NUMBA_LAYERS is stale).
    """
    for attr in NUMBA_LAYERS:
        layer = getattr(model, attr, None)
        if layer is None or not hasattr(layer, "forward") or not hasattr(layer, "backward"):
            raise AttributeError(
                f"NumbaCNN has no layer {attr!r} with forward/backward: update NUMBA_LAYERS "
                "in torch_profile.py to the model's layers"
            )
        label = "loss" if attr == "criterion" else attr
        layer.forward = _in_range(f"{label} forward", layer.forward, nvtx)
        layer.backward = _in_range(f"{label} backward", layer.backward, nvtx)
    update: list[_Range] = []
    model.loss_and_grads = _then_open(SGD_RANGE, model.loss_and_grads, nvtx, update)

    def close_update() -> None:
        while update:
            update.pop().close()

    return close_update


def numba_range_names() -> list[str]:
    """Every range :func:`instrument_numba_cnn` opens, in forward-then-update order."""
    labels = ["loss" if a == "criterion" else a for a in NUMBA_LAYERS]
    return [f"{x} forward" for x in labels] + [f"{x} backward" for x in labels] + [SGD_RANGE]


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
    random float32 data (N, 1, H, W) and int32 labels, its ranges installed."""
    rng = np.random.default_rng(seed)
    x = cuda.to_device(rng.standard_normal((batch, 1, net.height, net.width)).astype(np.float32))
    y = cuda.to_device(rng.integers(0, net.num_classes, batch).astype(np.int32))
    if config == "naive":
        model = NumbaCNN(net, max_batch=batch, seed=seed)
        close_update = instrument_numba_cnn(model, nvtx)

        def naive_step() -> None:
            try:
                model.train_step(x, y, LR)
            finally:
                close_update()

        return Stepper(model, naive_step, tuple(numba_range_names()))
    if config not in ("fast", "graph"):
        raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")
    model = FastCNN(net, max_batch=batch, seed=seed, graph=config == "graph")
    if config == "fast":
        # train_step calls self._step(n, lr) with no mark callback; this instance's
        # _step passes one, so the profiled step is still train_step itself.
        stage_ranges = StageRanges(STAGES, nvtx)
        unmarked = model._step

        def marked_step(n: int, lr: float, mark: Any = None) -> None:
            with stage_ranges.stages():
                unmarked(n, lr, stage_ranges.mark)

        model._step = marked_step
        ranges: tuple[str, ...] = STAGES
    else:
        # A replayed graph runs without Python: no marks, only the step's range.
        ranges = ()

    def fast_step() -> None:
        model.train_step(x, y, LR)

    return Stepper(model, fast_step, ranges)


def _synchronize() -> None:
    cuda.synchronize()
    if torch.cuda.is_available() and not is_simulator():
        torch.cuda.synchronize()


def device_records(events: Iterable[Any], exclude: Iterable[str] = ()) -> list[KernelRecord]:
    """The kernels and copies among torch.profiler's events (``prof.events()``).

    Device-side copies of our own ranges (torch adds one per record_function on
    the GPU timeline, "gpu_user_annotation") are left out, as are names in
    ``exclude``. Sorted by start.
    """
    skip = set(exclude)
    out = [
        KernelRecord(e.name, float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name not in skip
    ]
    return sorted(out, key=lambda r: (r.start_us, r.end_us))


def host_records(events: Iterable[Any], names: Iterable[str]) -> list[KernelRecord]:
    """The CPU-side intervals of the ranges named ``names``, sorted by start."""
    wanted = set(names)
    out = [
        KernelRecord(e.name, float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CPU and e.name in wanted
    ]
    return sorted(out, key=lambda r: (r.start_us, r.end_us))


def profile_step(stepper: Stepper, warmup: int, cuda_activity: bool) -> Any:
    """``warmup`` untimed steps, then one step under torch.profiler inside a
    "step" range; returns the finished profile."""
    for _ in range(warmup):
        stepper.step()
    _synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda_activity else [])
    nvtx = nvtx_available()
    with profile(activities=activities) as prof:
        with named_range(STEP, nvtx):
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
    with named_range(STEP, True):
        stepper.step()
    _synchronize()
    ms = 1e3 * (time.perf_counter() - t0)
    cuda.profile_stop()
    return ms


def write_profile(
    path: Path,
    config: str,
    batch: int,
    kernels: Sequence[KernelRecord],
    ranges: Sequence[KernelRecord],
    **meta: Any,
) -> Path:
    """``torch_profile_kernels_<config>.json``: the device intervals ("kernels":
    [{name, start_us, end_us}], empty without CUDA activity), their table and
    gap statistics, the host ranges and their table."""
    stage_ranges = [r for r in ranges if r.name != STEP]
    data = {
        "config": config,
        "batch": batch,
        **meta,
        "kernels": [r._asdict() for r in kernels],
        "kernel_table": [r._asdict() for r in kernel_table(kernels)] if kernels else [],
        "gaps": launch_gaps((r.start_us, r.end_us) for r in kernels)._asdict() if kernels else None,
        "ranges": [r._asdict() for r in ranges],
        "range_table": [r._asdict() for r in kernel_table(stage_ranges)] if stage_ranges else [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def tiny_config() -> NetConfig:
    """The simulator's network: ``final_project.train.TINY`` (8x8, channels 2/4, hidden 16)."""
    t = ftrain.TINY
    return NetConfig(height=t.image_size, width=t.image_size, c1=t.c1, c2=t.c2, hidden=t.hidden)


def _config_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(CONFIGS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, CHAPTER)
    p.add_argument(
        "--batch",
        type=ftrain.positive_int,
        default=pick(gpu=256, simulator=2),
        help="images per step (default 256; simulator 2)",
    )
    p.add_argument(
        "--configs",
        type=_config_list,
        default=None,
        help="configurations, comma-separated (default naive,fast,graph; simulator naive,fast)",
    )
    p.add_argument(
        "--warmup",
        type=ftrain.positive_int,
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
    if args.nsys and not nvtx_available():
        p.error("--nsys needs a CUDA build of torch: its NVTX ranges come from torch.cuda.nvtx")
    if not sim and not args.nsys and len(configs) > 1:
        # One process a configuration: profiling several in one process made the
        # interpreter abort at exit on the H100 machine (torch 2.11's profiler
        # with CUDA activity, after all output was written); one each exits cleanly.
        worst = 0
        for k, name in enumerate(configs):
            child = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--configs",
                name,
                "--batch",
                str(args.batch),
                "--warmup",
                str(args.warmup),
                "--out",
                str(args.out),
            ]
            if k or args.no_torch_table:
                child.append("--no-torch-table")
            code = subprocess.run(child).returncode
            if code:  # negative: killed by a signal, which max() over codes would hide
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                print(f"profiling {name} failed: {why}", file=sys.stderr)
                worst = 1
        return worst
    net = tiny_config() if sim else NetConfig()
    cuda_activity = not sim and torch.cuda.is_available()
    nvtx = nvtx_available()
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

    torch_table_printed = args.no_torch_table
    for name in configs:
        stepper = make_stepper(name, net, args.batch, nvtx)
        prof = profile_step(stepper, args.warmup, cuda_activity)
        events = prof.events()
        ranges = host_records(events, (STEP, *stepper.ranges))
        kernels = device_records(events, exclude=(STEP, *stepper.ranges)) if cuda_activity else []
        step_ms = next((r.end_us - r.start_us for r in ranges if r.name == STEP), math.nan) / 1e3
        print(f"\n===== {name}: train_step took {step_ms:.3f} ms on the host")
        if kernels:
            print(
                format_kernel_table(
                    kernel_table(kernels),
                    f"GPU time per kernel ({len(kernels)} launches and copies)",
                )
            )
            print(gap_line(launch_gaps((r.start_us, r.end_us) for r in kernels)))
            if not torch_table_printed:
                print(f"\ntorch's own table for {name} (key_averages, by CUDA time):")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
                torch_table_printed = True
        stage_ranges = [r for r in ranges if r.name != STEP]
        if sim and stage_ranges:
            print(
                format_kernel_table(
                    kernel_table(stage_ranges),
                    "CPU time per range (the simulator runs each kernel's threads in it)",
                    top=len(stage_ranges),
                )
            )
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
        table = write_profile(
            out / f"torch_profile_kernels_{name}.json",
            name,
            args.batch,
            kernels,
            ranges,
            device=device_name(),
            runtime=runtime_name(),
            torch_version=torch.__version__,
            network=ftrain.describe_config(net),
            warmup=args.warmup,
        )
        print(f"wrote {trace} and {table}")
    print(
        "\nopen a trace_<config>.json in https://ui.perfetto.dev (Open trace file) or "
        "chrome://tracing (Load): one row a thread and, on a GPU, one a stream; the "
        "ranges above the kernels they launched"
    )
    return 0


if __name__ == "__main__":
    try:
        run_script(main)
    except SystemExit as done:
        # torch 2.11's profiler, once it has recorded CUDA activity, frees memory
        # twice while the interpreter tears down, and glibc aborts the process
        # ("double free or corruption") after all output is written and closed.
        # End the script without that teardown, so its exit code is main()'s.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(done.code if isinstance(done.code, int) else 1)
