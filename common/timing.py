"""One timing harness for every chapter: CUDA events, warm-up, median of many runs.

Why events and not ``time.perf_counter``: a kernel launch returns to Python
before the GPU has done the work, so a host clock around a launch measures the
launch, not the kernel. An event is a timestamp the GPU writes into its own
stream when it gets there (CUDA C++ Programming Guide, "Events"); the time
between two events is the time the GPU spent on what lies between them.

The first call of a kernel compiles it (Numba's JIT, then the driver's PTX
compiler), which takes 0.1-2 s. It is timed apart and reported as
``first_call_ms``; warm-up calls follow, then ``repeats`` timed calls queued
back to back (each between its own pair of events, one synchronize at the end,
so host launch overhead overlaps GPU work), of which we report the median
(robust to the odd slow run) and the 10th-90th percentile spread.

Rates are derived from what the caller says the operation must do: ``nbytes``
(the fewest bytes it must move through device memory: each input read once,
each output written once) and ``flops``. They are compared with the device's
measured peaks (:func:`device_peaks`): a large device-to-device copy for
bandwidth, cuBLAS FP32 SGEMM (through torch, TF32 off) for arithmetic.

Under the simulator nothing is timed: the simulator runs every CUDA thread as
Python code, so its "timings" say nothing about a GPU. The harness still runs
the function once, so the code path is exercised, and a script shows instead
the figures its chapter README holds from a GPU run (:func:`readme_figures`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .runtime import cache_dir, device_name, is_simulator

SIMULATOR_NOTE = "simulator: not timed; timings need a GPU"


@dataclass
class Timing:
    """What one benchmark measured. Times in ms, rates in GB/s and TFLOP/s."""

    name: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    first_call_ms: float | None = None
    repeats: int = 0
    nbytes: int | None = None
    flops: int | None = None
    peak_gbps: float | None = None
    peak_tflops: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return self.median_ms is not None

    @property
    def gbps(self) -> float | None:
        """Achieved bandwidth in GB/s (1e9 bytes/s) from ``nbytes``."""
        if not self.measured or not self.nbytes:
            return None
        return self.nbytes / (self.median_ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float | None:
        """Achieved arithmetic rate in TFLOP/s from ``flops``."""
        if not self.measured or not self.flops:
            return None
        return self.flops / (self.median_ms * 1e-3) / 1e12

    @property
    def fraction_of_copy_peak(self) -> float | None:
        if self.gbps is None or not self.peak_gbps:
            return None
        return self.gbps / self.peak_gbps

    @property
    def fraction_of_sgemm_peak(self) -> float | None:
        if self.tflops is None or not self.peak_tflops:
            return None
        return self.tflops / self.peak_tflops

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            gbps=self.gbps,
            tflops=self.tflops,
            fraction_of_copy_peak=self.fraction_of_copy_peak,
            fraction_of_sgemm_peak=self.fraction_of_sgemm_peak,
        )
        return d


def cpu_ms(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls, for CPU code
    (a Python loop, NumPy) timed beside the kernels. No warm-up: call it once
    yourself first where the first call pays for something (an import, a cache)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _synchronize() -> None:
    from numba import cuda

    cuda.synchronize()


def timed_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), milliseconds)`` of one call, wall clock, with the device synchronized
    before and after: on a kernel's first call, its compile time plus its run (what
    :func:`benchmark` reports as ``first_call_ms``). In the simulator the time is
    the simulator's and means nothing."""
    _synchronize()
    t0 = time.perf_counter()
    value = fn()
    _synchronize()
    return value, (time.perf_counter() - t0) * 1e3


def benchmark(
    fn: Callable[[], Any],
    name: str,
    *,
    nbytes: int | None = None,
    flops: int | None = None,
    warmup: int = 3,
    repeats: int = 20,
    peaks: dict[str, Any] | None = None,
    hold_ms: int = 0,
    first_call_ms: float | None = None,
) -> Timing:
    """Time ``fn()`` on the GPU with CUDA events.

    Args:
        fn: runs the operation once (launches kernels or torch ops; need not
            synchronize). Called ``1 + warmup + repeats`` times.
        name: label for tables.
        nbytes: fewest bytes the operation must move through device memory.
        flops: floating-point operations it performs (an FMA counts as 2).
        warmup: untimed calls after the first (compiling) call.
        repeats: timed calls; the median and 10th/90th percentiles are kept.
        peaks: the dict from :func:`device_peaks`; measured once if omitted and
            a rate is asked for.
        hold_ms: if > 0, :func:`hold_stream` keeps the GPU busy this long
            before the timed calls, so the host queues them all first and the
            times are GPU time only. Needed when a call is about as short as
            its launch from Python (tens of microseconds); make it longer than
            queueing ``repeats`` calls takes.
        first_call_ms: the caller's own measurement of ``fn``'s first call in
            this process (:func:`timed_call` on the checked call that compiled
            it), reported instead of this function's first call, which is then
            no longer the one that compiles.

    Returns:
        A :class:`Timing`. In the simulator, ``fn`` runs once and the Timing
        holds no times (``measured`` is False).

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0 or hold_ms < 0:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, hold_ms >= 0; got {repeats}, {warmup}, {hold_ms}"
        )
    result = Timing(name=name, nbytes=nbytes, flops=flops)
    if is_simulator():
        fn()
        return result

    from numba import cuda

    _synchronize()
    t0 = time.perf_counter()
    fn()
    _synchronize()
    result.first_call_ms = (time.perf_counter() - t0) * 1e3
    if first_call_ms is not None:
        result.first_call_ms = first_call_ms
    # Calls are queued back to back, each between its own pair of events, with
    # one synchronize at the end (as triton.testing.do_bench does). While the
    # GPU works on call i the host is already launching call i+1, so the ~20 us
    # a Numba launch costs on the host is hidden whenever a call takes longer
    # than that; synchronizing after every call would add it to every time.
    for _ in range(warmup):
        fn()
    starts = [cuda.event() for _ in range(repeats)]
    ends = [cuda.event() for _ in range(repeats)]
    if hold_ms:
        hold_stream(hold_ms)
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    ends[-1].synchronize()
    times = [start.elapsed_time(end) for start, end in zip(starts, ends)]
    result.median_ms = statistics.median(times)
    result.p10_ms = float(np.percentile(times, 10))
    result.p90_ms = float(np.percentile(times, 90))
    result.repeats = repeats
    if nbytes or flops:
        peaks = peaks if peaks is not None else device_peaks()
        result.peak_gbps = peaks.get("copy_gbps")
        result.peak_tflops = peaks.get("sgemm_tflops")
    return result


def hold_stream(ms: int, stream: Any = 0) -> None:
    """Launch one thread that sleeps ``ms`` milliseconds on ``stream`` (GPU only).

    Work the host queues behind it waits, so events recorded between queued
    launches measure the GPU's time, not the host's launch cost.
    """
    _hold_stream_kernel()[1, 1, stream](int(ms))


@functools.cache
def _hold_stream_kernel() -> Any:
    from numba import cuda

    @cuda.jit
    def hold(ms):
        for _ in range(ms):
            cuda.nanosleep(1000000)

    return hold


# --------------------------------------------------------------------------
# Device peaks, measured once per device and cached
# --------------------------------------------------------------------------


# Bump when the way peaks are measured changes, so cached figures are re-measured.
PEAKS_METHOD = 2


def _cache_path() -> Path:
    return cache_dir("peaks.json")


def _device_key() -> str:
    from numba import cuda

    uuid = getattr(cuda.get_current_device(), "uuid", "")
    return f"{device_name()} {uuid}".strip()


def measure_copy_gbps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written.

    The copy engine path (``cuMemcpyDtoD``, what Numba's ``copy_to_device``
    uses) and torch's copy kernel can differ by 20% on the same card; the
    faster of the two is the device's practical ceiling, so both are measured
    when torch with CUDA is there, and the larger is returned.
    """
    from numba import cuda

    n = nbytes // 4
    src = cuda.to_device(np.arange(n, dtype=np.float32))
    dst = cuda.device_array_like(src)
    t = benchmark(lambda: dst.copy_to_device(src), "copy", repeats=repeats, peaks={})
    best = t.median_ms
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.arange(n, dtype=torch.float32, device="cuda")
            b = torch.empty_like(a)
            best = min(
                best, benchmark(lambda: b.copy_(a), "copy", repeats=repeats, peaks={}).median_ms
            )
    except ImportError:
        pass
    return 2 * n * 4 / (best * 1e-3) / 1e9


def measure_sgemm_tflops(n: int = 4096, repeats: int = 10) -> float | None:
    """cuBLAS FP32 SGEMM rate (TF32 off) through torch; None if torch has no CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(n, n, device="cuda", generator=g)
        b = torch.randn(n, n, device="cuda", generator=g)
        c = torch.empty(n, n, device="cuda")
        t = benchmark(lambda: torch.matmul(a, b, out=c), "sgemm", repeats=repeats, peaks={})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def device_peaks(refresh: bool = False) -> dict[str, Any]:
    """The device's measured peaks: ``{"device", "copy_gbps", "sgemm_tflops"}``.

    Measured the first time on each device (about a second) and cached in
    ``~/.cache/cuda-python-course/peaks.json``; ``refresh=True`` measures again.
    In the simulator returns ``{"device": "simulator"}`` with no rates.
    """
    if is_simulator():
        return {"device": "simulator", "copy_gbps": None, "sgemm_tflops": None}
    key = _device_key()
    path = _cache_path()
    cache: dict[str, Any] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    if not refresh and cache.get(key, {}).get("method") == PEAKS_METHOD:
        return cache[key]
    peaks = {
        "method": PEAKS_METHOD,
        "device": key.split(" GPU-")[0],
        "copy_gbps": measure_copy_gbps(),
        "sgemm_tflops": measure_sgemm_tflops(),
    }
    cache[key] = peaks
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return peaks


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _aligned(
    rows: Sequence[Sequence[str]], align: str, sep: str, least: Sequence[int]
) -> list[str]:
    """Rows of cells as lines indented by two spaces, each column as wide as its widest
    cell (and at least ``least[c]``), aligned left ("<") or right (">") by ``align``."""
    widths = [
        max([len(row[c]) for row in rows] + [least[c] if c < len(least) else 0])
        for c in range(len(align))
    ]
    return [
        (
            "  " + sep.join(format(cell, f"{a}{w}") for cell, a, w in zip(row, align, widths))
        ).rstrip()
        for row in rows
    ]


def format_table(
    rows: Sequence[Timing] | Sequence[Sequence[Any]],
    title: str | None = None,
    *,
    header: Sequence[str] | None = None,
    align: str | None = None,
) -> str:
    """A plain-text table for printing: the course's one table printer.

    Without ``header``, ``rows`` are Timings, one row per version: median,
    p10-p90 spread, GB/s and % of copy bandwidth, TFLOP/s and % of SGEMM, first
    call (in the simulator, which times nothing: each version's relative error,
    where its check recorded one).

    With ``header``, ``rows`` are rows of cells (each printed with ``str``), one
    cell per header name; ``align`` holds one character per column, "<" (left)
    or ">" (right), e.g. "<>>" for a name and two numbers (default: all left).

    The title (if any) heads the table; every other line is indented by two
    spaces, and each column is as wide as its widest cell (the Timing columns at
    least as wide as the course's transcripts show them).

    Raises:
        ValueError: ``align`` or a row whose length is not the header's, or an
            ``align`` character other than "<" and ">".
    """
    lines = [title] if title else []
    if header is not None:
        align = align or "<" * len(header)
        cells = [[str(c) for c in row] for row in rows]
        if len(align) != len(header) or set(align) - set("<>"):
            raise ValueError(f"align {align!r}: one '<' or '>' per column of {list(header)}")
        for row in cells:
            if len(row) != len(header):
                raise ValueError(f"row {row} has {len(row)} cells for {len(header)} columns")
        lines += _aligned([[str(h) for h in header], *cells], align, "  ", ())
        return "\n".join(lines)
    results = rows
    if results and not any(r.measured for r in results):
        # Nothing was timed; what the simulator did establish is each version's check.
        errors = [r.extra.get("rel_error") for r in results]
        if any(e is None for e in errors):
            lines.append(f"  ({SIMULATOR_NOTE})")
            lines.extend(f"  {r.name}" for r in results)
            return "\n".join(lines)
        table = [["version", "rel. error"]] + [
            [r.name, f"{e:.2g}"] for r, e in zip(results, errors)
        ]
        table = _aligned(table, "<>", " ", (34, 10))
        table[0] += f"  ({SIMULATOR_NOTE})"
        return "\n".join(lines + table)
    table = [
        ["version", "median ms", "p10-p90 ms", "GB/s", "%copy", "TFLOP/s", "%SGEMM", "1st call ms"]
    ]
    for r in results:
        spread = "-" if r.p10_ms is None else f"{r.p10_ms:.4g}-{r.p90_ms:.4g}"
        pct_copy = r.fraction_of_copy_peak
        pct_mm = r.fraction_of_sgemm_peak
        table.append(
            [
                r.name,
                _fmt(r.median_ms, ".4g"),
                spread,
                _fmt(r.gbps, ".1f"),
                _fmt(pct_copy and 100 * pct_copy, ".1f"),
                _fmt(r.tflops, ".2f"),
                _fmt(pct_mm and 100 * pct_mm, ".1f"),
                _fmt(r.first_call_ms, ".0f"),
            ]
        )
    # at least the widths the course's READMEs and transcripts show
    return "\n".join(lines + _aligned(table, "<>>>>>>>", " ", (34, 10, 17, 8, 6, 8, 7, 11)))


def write_json(
    results: Iterable[Timing | dict[str, Any]], path: str | os.PathLike[str], **meta: Any
) -> None:
    """Write results (Timings, or plain dicts of JSON values) and metadata (e.g.
    ``device=...``) as JSON for plots and notes."""
    payload = {
        "meta": meta,
        "results": [r.as_dict() if isinstance(r, Timing) else r for r in results],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


# --------------------------------------------------------------------------
# Figures measured on a GPU, as the chapter README shows them
# --------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]

# In a chapter README, this line stands right before the "Measured on an NVIDIA ..."
# paragraph that heads a script's table of GPU figures; the script prints that table
# in the simulator, so the README is the one place the figures live.
FIGURES_MARKER = re.compile(r"^<!-- gpu-figures: (?P<script>[\w.]+) -->\s*$")
_MEASURED_ON = re.compile(r"^Measured on an? (?P<gpu>NVIDIA [\w ]+?)\s*[,(:]")
_MARKDOWN = re.compile(r"`|\*\*")


@dataclass
class ReadmeFigures:
    """One table of GPU figures from a chapter README, markdown stripped.

    ``readme`` is the README's path relative to the repository, ``gpu`` the GPU
    the figures were measured on ("NVIDIA H100 80GB HBM3"), ``caption`` the
    paragraph that heads the table (what was measured, at which sizes), ``header``
    and ``rows`` the table's cells.
    """

    readme: str
    gpu: str
    caption: str
    header: list[str]
    rows: list[list[str]]

    def format(self) -> str:
        """The caption (wrapped at 100 columns), then the table, for printing.

        Raises:
            ValueError: a row whose length is not the header's (see :func:`format_table`).
        """
        caption = self.caption[0].lower() + self.caption[1:]
        title = textwrap.wrap(
            f"GPU figures from {self.readme}: {caption}",
            width=100,
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
        return format_table(self.rows, "\n".join(title), header=self.header)


def readme_figures(script: str | os.PathLike[str]) -> ReadmeFigures:
    """The GPU figures that the README beside ``script`` holds for it.

    Args:
        script: path of a chapter script (pass ``__file__``); its folder's
            README.md must have a line ``<!-- gpu-figures: NAME.py -->`` right
            before a paragraph starting "Measured on an NVIDIA <GPU>", followed
            by a markdown table.

    Raises:
        LookupError: no such marker, or it is not followed by a "Measured on"
            paragraph and a table (the message names the README and line).
    """
    path = Path(script).resolve()
    readme = path.parent / "README.md"
    try:
        shown = str(readme.relative_to(REPO_ROOT))
    except ValueError:
        shown = str(readme)
    lines = readme.read_text().splitlines() if readme.exists() else []
    start = next(
        (
            i
            for i, line in enumerate(lines)
            if (m := FIGURES_MARKER.match(line)) and m["script"] == path.name
        ),
        None,
    )
    if start is None:
        raise LookupError(
            f"{shown}: no line '<!-- gpu-figures: {path.name} -->'; put one right "
            "before the 'Measured on an NVIDIA ...' paragraph of its table"
        )
    i = start + 1
    caption = []
    while i < len(lines) and lines[i].strip() and not lines[i].startswith("|"):
        caption.append(lines[i].strip())
        i += 1
    text = _MARKDOWN.sub("", " ".join(caption))
    measured_on = _MEASURED_ON.match(text)
    while i < len(lines) and not lines[i].strip():
        i += 1
    table = []
    while i < len(lines) and lines[i].startswith("|"):
        table.append([_MARKDOWN.sub("", c).strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    if measured_on is None or len(table) < 3 or any(len(r) != len(table[0]) for r in table):
        raise LookupError(
            f"{shown}:{start + 1}: the gpu-figures marker must be followed by a "
            "paragraph starting 'Measured on an NVIDIA <GPU>' and a markdown table"
        )
    return ReadmeFigures(
        readme=shown, gpu=measured_on["gpu"], caption=text, header=table[0], rows=table[2:]
    )
