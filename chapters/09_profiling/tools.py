"""Chapter 09's plumbing: what the profiling scripts need and do not teach.

The scripts (sanitizer.py, torch_profile.py, nsight_compute.py, ...) show the
commands, the counters and the conclusions; this module runs and reads around them:

* where the reports of the course's GPU run are saved (:data:`SAVED_DIR`);
* running a command in its own process group under a time limit
  (:func:`run_command`, :func:`run_logged`, :func:`outcome_in_child`);
* compute-sanitizer: finding it (:func:`find_sanitizer`), reading its log
  (:func:`parse_report`) into a table (:func:`log_table`), and saying in one line
  what a launch did (:func:`describe_outcome`);
* torch.profiler: its events as (name, start, end) records (:func:`device_records`,
  :func:`host_records`), GPU time per kernel (:func:`kernel_table`), the GPU's
  idle time between kernels (:func:`launch_gaps`), the JSON written per
  configuration (:func:`write_profile`), named ranges (a ``record_function`` and an
  NVTX range) around each layer or stage (:class:`StageRanges`,
  :func:`instrument_numba_cnn`), one process per profiled configuration
  (:func:`run_apart`), and an exit that skips torch's crashing teardown
  (:func:`run_script_skipping_teardown`).

torch is imported only inside the functions that use it: sanitizer.py's child
processes run under compute-sanitizer and load only what they launch.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import BarrierError, RaceError, import_sibling
from common.harness import run_script
from common.runtime import torch_cuda_available
from common.timing import format_table

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
from numba.cuda.cudadrv.driver import CudaAPIError

short_kernel_name = import_sibling(__file__, "kernel_names").short_kernel_name

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
SAVED_DIR = HERE / "saved"  # the reports, logs and records of the course's GPU run


def python_name(kernel) -> str:
    """The Python name of a kernel's function (GPU dispatcher: py_func; simulator: fn)."""
    return (getattr(kernel, "py_func", None) or kernel.fn).__name__


def first_line(message: object, limit: int = 160) -> str:
    """The first line of ``message``, cut to ``limit`` characters."""
    text = str(message).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------- running a command


def run_command(command: Sequence[str], timeout: float) -> tuple[str, str | None]:
    """Run a command from the repository root; return (stdout and stderr, problem).

    A run past ``timeout`` seconds is killed with its whole process group (the
    sanitizer's child Python too) and comes back with what it printed so far, and
    the problem "did not finish in N s (killed)"; otherwise the problem is None.
    """
    proc = subprocess.Popen(
        list(command),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return output, None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return output, f"did not finish in {timeout:.0f} s (killed)"


def run_logged(
    command: Sequence[str], shown: Sequence[str], device: str, path: Path, timeout: float
) -> Path:
    """Run ``command`` (:func:`run_command`) and write its output to ``path``, after
    a first line ``$ <shown>`` (the command as a reader would type it, which
    :func:`parse_report` reads the tool from) and a line naming the device."""
    output, problem = run_command(command, timeout)
    text = f"$ {shlex.join(shown)}\n# device: {device}\n{output}"
    if problem:
        text += f"# {problem}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def outcome_in_child(command: Sequence[str], timeout: float) -> str:
    """Run ``command`` (a script's ``--target`` run) in a child process and return
    what it printed after its last "outcome: " (else its first line): a launch
    failure or a hang cannot take this process with it."""
    output, problem = run_command(command, timeout)
    if problem:
        return f"the launch {problem}: a deadlock?"
    said = [line for line in output.splitlines() if line.startswith("outcome: ")]
    return said[-1][len("outcome: ") :] if said else first_line(output or "(no output)")


# ---------------------------------------------------------------- compute-sanitizer


def describe_outcome(launch: Callable[[], tuple[np.ndarray, np.ndarray]]) -> str:
    """Call ``launch`` (one launch; returns the output on the host and its float64
    reference) and say what happened, in one line: the error raised (the simulator's
    IndexError, RaceError or BarrierError; a launch a sanitizer stopped), or how many
    outputs differ from the reference by more than 1e-6 relative."""
    try:
        out, ref = launch()
    except (RaceError, BarrierError) as exc:  # the first clause names kernel, threads, lines
        return f"{type(exc).__name__}: {first_line(str(exc).split('; ')[0], 220)}"
    except IndexError as exc:
        return f"IndexError: {first_line(exc)}"
    except CudaAPIError as exc:
        return f"launch failed: {first_line(exc)}"
    wrong = int(np.count_nonzero(~np.isclose(out, ref, rtol=1e-6, atol=0)))
    if wrong == 0:
        return f"no error raised; all {out.size} outputs right"
    return f"no error raised; {wrong} of {out.size} outputs wrong"


def find_sanitizer() -> str | None:
    """Path of compute-sanitizer: on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


_PREFIX = re.compile(r"^=+ ?")  # every line compute-sanitizer prints starts "========= "
_NOT_FINDINGS = re.compile(
    r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
    r"Target application returned an error|Error: process didn't terminate successfully)"
)
_ERRORS = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors?$")
_NOT_PRINTED = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors? (?:were|was) not printed")
_RACECHECK = re.compile(
    r"^RACECHECK SUMMARY: ([\d,]+) hazards? displayed \(([\d,]+) errors?, ([\d,]+) warnings?\)"
)
_RACE = re.compile(r"^(?:error|warning): race reported between (\w+) access at (.+)$", re.I)
_RACE_AND = re.compile(r"^and (\w+) access at (.+?)(?: \[[\d,]+ hazards?\])?$")
_HAZARD = re.compile(
    r"^(?:error|warning): potential (\w+) hazard detected at __shared__ (0x[0-9a-f]+) "
    r"in block \((\d+), ?(\d+), ?(\d+)\)",
    re.I,
)
_THREAD_BLOCK = re.compile(
    r"thread \((\d+), ?(\d+), ?(\d+)\)(?: in block \((\d+), ?(\d+), ?(\d+)\))?"
)
_ADDRESS = re.compile(r"^Address (0x[0-9a-fA-F]+)")
_TOOL = re.compile(r"--tool[ =](\w+)")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


@dataclass
class Finding:
    """One report in a compute-sanitizer log.

    kind: its first line as printed ("Invalid __global__ write of size 4 bytes",
    "Race reported between Write access and Read access", "Program hit
    CUDA_ERROR_... on CUDA API call to ..."). kernel: short name
    (kernel_names.short_kernel_name) or None for API errors. thread, block: (x, y, z)
    or None (racecheck's default report names no thread). address: the faulting
    address, or None.
    """

    kind: str
    kernel: str | None = None
    thread: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    address: int | None = None

    def describe(self) -> str:
        if self.kernel is None and self.thread is None:
            return f"{self.kind} (not in a kernel)"
        where = [self.kernel or "kernel not named"]
        if self.thread:
            where.append("thread ({},{},{})".format(*self.thread))
        if self.block:
            where.append("block ({},{},{})".format(*self.block))
        return f"{self.kind}: {', '.join(where)}"


@dataclass
class SanitizerReport:
    """A parsed compute-sanitizer log.

    tool: "memcheck", "racecheck", "initcheck", "synccheck", or None when the log
    does not tell. findings: the reports printed (at most --print-limit of them).
    error_count: the errors the tool counted (its summary), printed or not;
    warning_count: racecheck's warnings (0 for the other tools); not_printed: the
    errors left out by --print-limit; app_failed: the tool saw the program exit
    with an error.
    """

    tool: str | None
    findings: list[Finding] = field(default_factory=list)
    error_count: int = 0
    warning_count: int = 0
    not_printed: int = 0
    app_failed: bool = False

    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None


def _kernel_at(location: str) -> str | None:
    """The kernel's short name from an ``at ...`` location; None for a bare address."""
    location = re.sub(r"\s+in\s+\S+:\d+$", "", location.strip())
    if not location or location.startswith("0x"):
        return None
    return short_kernel_name(location)


def _infer_tool(findings: list[Finding], racecheck_summary: bool) -> str | None:
    if racecheck_summary:
        return "racecheck"
    for f in findings:
        for pattern, tool in (
            ("race", "racecheck"),
            ("hazard", "racecheck"),
            ("barrier", "synccheck"),
            ("uninitialized", "initcheck"),
            ("invalid __", "memcheck"),
        ):
            if pattern in f.kind.lower():
                return tool
    return None


def parse_report(text: str, tool: str | None = None) -> SanitizerReport:
    """Parse a compute-sanitizer log (its stdout and stderr, the program's lines mixed in).

    tool: the --tool the log came from; when None, read from a ``$ compute-sanitizer
    --tool ...`` header line (:func:`run_logged` writes one) or guessed from the findings.

    The error count comes from ``ERROR SUMMARY: N errors`` or, for racecheck,
    ``RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)``.

    Raises:
        ValueError: no summary line: the run was cut short (a timeout, a crash) or
            the text is not a compute-sanitizer log.
    """
    findings: list[Finding] = []
    current: Finding | None = None
    errors = racecheck_errors = None
    warnings = not_printed = 0
    app_failed = False
    for raw in text.splitlines():
        if raw.startswith("$ ") and tool is None and "compute-sanitizer" in raw:
            m = _TOOL.search(raw)
            tool = m.group(1) if m else "memcheck"  # memcheck is the default tool
            continue
        if not raw.startswith("========="):
            continue  # the program's own output
        line = _PREFIX.sub("", raw, count=1)
        if not line.strip():
            continue
        body = line.strip()
        if not line.startswith(" "):  # a new report, or a summary
            current = None
            if m := _ERRORS.match(body):
                errors = _int(m.group(1))
            elif m := _NOT_PRINTED.match(body):
                not_printed = _int(m.group(1))
            elif m := _RACECHECK.match(body):
                racecheck_errors, warnings = _int(m.group(2)), _int(m.group(3))
            elif body.startswith("Target application returned an error"):
                app_failed = True
            elif not _NOT_FINDINGS.match(body):
                current = Finding(kind=body)
                if m := _RACE.match(body):
                    current.kind = f"Race reported between {m.group(1)} access"
                    current.kernel = _kernel_at(m.group(2))
                elif m := _HAZARD.match(body):
                    current.kind = f"Potential {m.group(1).upper()} hazard on __shared__"
                    current.address = int(m.group(2), 16)
                    current.block = tuple(int(v) for v in m.group(3, 4, 5))
                findings.append(current)
            continue
        if current is None:
            continue
        if m := _RACE_AND.match(body):
            current.kind += f" and {m.group(1)} access"
            if current.kernel is None:
                current.kernel = _kernel_at(m.group(2))
        elif body.startswith("at ") and current.kernel is None:
            current.kernel = _kernel_at(body[3:])
        elif (
            (m := _THREAD_BLOCK.search(body))
            and current.thread is None
            and (body.startswith("by thread") or "Thread" in body)
        ):
            current.thread = tuple(int(v) for v in m.group(1, 2, 3))
            if m.group(4) is not None:
                current.block = tuple(int(v) for v in m.group(4, 5, 6))
        elif (m := _ADDRESS.match(body)) and current.address is None:
            current.address = int(m.group(1), 16)
    if racecheck_errors is not None:
        count = racecheck_errors
    elif errors is not None:
        count = errors
    else:
        raise ValueError(
            "no 'ERROR SUMMARY' or 'RACECHECK SUMMARY' line: the run was cut short "
            "(a timeout or a crash) or this is not a compute-sanitizer log; rerun it "
            "with one launch of the kernel (--target) and a longer time limit"
        )
    if tool is None:
        tool = _infer_tool(findings, racecheck_errors is not None)
    return SanitizerReport(
        tool=tool,
        findings=findings,
        error_count=count,
        warning_count=warnings,
        not_printed=not_printed,
        app_failed=app_failed,
    )


def read_report(path: Path, tool: str) -> tuple[SanitizerReport | None, str]:
    """The log at ``path``, parsed: (report, ""), or (None, why not) for a missing
    log or one cut short."""
    if not path.is_file():
        return None, "no log"
    try:
        return parse_report(path.read_text(), tool), ""
    except ValueError:
        return None, "log has no summary (run cut short)"


def log_table(logs: Iterable[tuple[str, str, Path, Path]]) -> tuple[str, list[str]]:
    """A table of compute-sanitizer logs, one row a bug, from (bug, tool, log of the
    bug, log of its fixed twin): the errors the tool counted (and how many it did not
    print), the fixed twin's errors, the first finding. Also the lines that contradict
    the lesson: a bug the tool found nothing in, a fixed twin with errors."""
    rows, surprises = [], []
    for name, tool, bug_log, fixed_log in logs:
        report, why = read_report(bug_log, tool)
        fixed, fixed_why = read_report(fixed_log, tool)
        if report is None:
            errors, first = why, ""
        else:
            errors = str(report.error_count)
            if report.not_printed:
                errors += f" ({report.not_printed} not printed)"
            first = report.first.describe() if report.first else "(none)"
            if report.error_count == 0:
                surprises.append(f"{tool} found nothing in {name}")
        fixed_errors = fixed_why if fixed is None else str(fixed.error_count)
        if fixed is not None and fixed.error_count:
            surprises.append(f"{tool} found {fixed.error_count} errors in fixed {name}")
        rows.append([name, tool, errors, fixed_errors, first])
    header = ["bug", "tool", "errors", "fixed", "first finding (kind: kernel, thread, block)"]
    return format_table(rows, header=header), surprises


# ---------------------------------------------------------------- torch.profiler events

STEP_RANGE = "step"  # the range around the whole profiled train_step


class KernelRecord(NamedTuple):
    """One kernel or copy on the device (or one named range on the host): its name
    as the profiler prints it and its start and end in microseconds (any common origin)."""

    name: str
    start_us: float
    end_us: float


def kernel_records(records: Iterable[Sequence[Any]]) -> list[KernelRecord]:
    """(name, start_us, end_us) triples as KernelRecords, checked.

    Raises:
        ValueError: no records, or a record that ends before it starts or is not finite.
    """
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


def kernel_table(records: Iterable[Sequence[Any]]) -> list[KernelRow]:
    """GPU time per kernel, largest first.

    records: (name, start_us, end_us) triples (e.g. KernelRecord), one
    a launch. Launches are grouped by :func:`short_kernel_name`, so
    the specialisations of one Numba kernel (``conv2d_igemm`` made for two
    tile shapes) add up in one row. A row's percent is of the sum of every
    launch's duration (so the rows sum to 100). Ties are ordered by name.

    Raises:
        ValueError: no records, or a record that ends before it starts.
    """
    totals: dict[str, list[float]] = {}
    for r in kernel_records(records):
        totals.setdefault(short_kernel_name(r.name), []).append(r.end_us - r.start_us)
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
    records = kernel_records(("", s, e) for s, e in intervals)
    spans = sorted((r.start_us, r.end_us) for r in records)
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
    stage_ranges = [r for r in ranges if r.name != STEP_RANGE]
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


def device_records(events: Iterable[Any], exclude: Iterable[str] = ()) -> list[KernelRecord]:
    """The kernels and copies among torch.profiler's events (``prof.events()``).

    Device-side copies of our own ranges (torch adds one per record_function on
    the GPU timeline, "gpu_user_annotation") are left out, as are names in
    ``exclude``. Sorted by start.
    """
    from torch.autograd import DeviceType

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
    from torch.autograd import DeviceType

    wanted = set(names)
    out = [
        KernelRecord(e.name, float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CPU and e.name in wanted
    ]
    return sorted(out, key=lambda r: (r.start_us, r.end_us))


# ---------------------------------------------------------------- named ranges


def nvtx_available() -> bool:
    """NVTX ranges need a GPU and a torch built with CUDA (torch.cuda.nvtx)."""
    return torch_cuda_available()


class _Range:
    """One open range: a record_function (torch's trace) and, if ``nvtx``, an
    NVTX push/pop pair (Nsight Systems' timeline)."""

    def __init__(self, name: str, nvtx: bool) -> None:
        import torch
        from torch.profiler import record_function

        self.name, self.nvtx = name, nvtx
        self._rf = record_function(name)
        self._rf.__enter__()
        if nvtx:
            torch.cuda.nvtx.range_push(name)

    def close(self) -> None:
        if self.nvtx:
            import torch

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
    """Turns the ``on_stage`` callbacks of ``FastCNN.train_step`` into one range a stage.

    ``mark(name)`` comes *after* a stage's launches, so the range of stage k
    opens at mark k - 1 (the first at :meth:`stages`) and closes at mark k.
    The marks must arrive in the order of ``stages``: a range named after the
    wrong stage would mislabel every kernel after it.

    Usage::

        ranges = StageRanges(STAGES)
        with ranges.stages():
            model.train_step(x, y, lr, on_stage=ranges.mark)

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
                "fast_model.STAGES disagree; fix STAGES to the order the step marks"
            )
        self._close()
        self._next += 1
        if self._next < len(self.names):
            self._open = _Range(self.names[self._next], self.nvtx)


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


def instrument_numba_cnn(model: Any, nvtx: bool) -> Callable[[], None]:
    """Wraps each layer's forward and backward of a NumbaCNN ``model`` (this
    instance only) in a range "<layer> forward" / "<layer> backward".

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
                "in chapters/09_profiling/tools.py to the model's layers"
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


# ---------------------------------------------------------------- torch.profiler's crashes


def run_apart(script: str | Path, children: dict[str, list[str]]) -> int:
    """Run ``python script *argv`` once for each ``name: argv`` of ``children``, one
    after the other, each in a process of its own; returns 1 if any failed, else 0.

    Why: profiling several configurations in one process made the interpreter
    abort at exit on the H100 machine (torch 2.11's profiler with CUDA activity,
    after all output was written); one process each exits cleanly.
    """
    worst = 0
    for name, argv in children.items():
        code = subprocess.run([sys.executable, str(Path(script).resolve()), *argv]).returncode
        if code:  # negative: killed by a signal, which max() over codes would hide
            why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            print(f"profiling {name} failed: {why}", file=sys.stderr)
            worst = 1
    return worst


def run_script_skipping_teardown(main: Callable[[], int | None]) -> NoReturn:
    """:func:`common.harness.run_script`, then end the process without Python's teardown.

    torch 2.11's profiler, once it has recorded CUDA activity, frees memory twice
    while the interpreter tears down, and glibc aborts the process ("double free
    or corruption") after all output is written and closed. Ending the script
    without that teardown keeps its exit code main()'s.
    """
    try:
        run_script(main)
    except SystemExit as done:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(done.code if isinstance(done.code, int) else 1)
