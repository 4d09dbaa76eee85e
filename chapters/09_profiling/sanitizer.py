"""compute-sanitizer: catch the bugs the tests missed, and prove the fix.

Four bugs, each with its fixed twin, and the sanitizer tool that finds it:

  oob                out-of-bounds write (ch05 fill_index_unchecked vs fill_index_checked)
                     on an exactly sized array                               memcheck
  race               a shared-memory read before the neighbour's write (ch06
                     shift_left_smem_no_barrier vs shift_left_smem)          racecheck
  uninit             out[i] += x[i] into a cuda.device_array nobody zeroed
                     (accumulate_into; fixed: the buffer is written first)   initcheck
  divergent-barrier  cuda.syncthreads() inside `if t < 16`, so half a warp waits
                     at it and the rest of the block goes on
                     (shift_left_barrier_in_branch vs shift_left_barrier_for_all)  synccheck

On a GPU with the CUDA toolkit, the script runs each target under its tool, then its
fixed twin, saves the logs (sanitizer_<tool>_<target>[_fixed].txt in --out), parses
them (:func:`parse_report`) and prints one table; then it runs each buggy target
plainly to show what the GPU does when nothing is watching. Without a GPU or without
compute-sanitizer, it prints the commands, parses the logs saved from the course's
GPU run (chapters/09_profiling/saved/) and shows what the simulator reports instead.

Run:  python chapters/09_profiling/sanitizer.py [--out DIR]
      python chapters/09_profiling/sanitizer.py --target oob [--fixed]   (one launch:
      what the sanitizer wraps)
Regenerate the saved logs on a GPU:
      python chapters/09_profiling/sanitizer.py --out chapters/09_profiling/saved
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import BarrierError, RaceError, ceil_div, is_simulator, pick
from common.checking import CheckError, check, poisoned, random_array
from common.harness import run_script, script_parser
from common.internal.exercises import import_sibling, load_chapter_module
from common.runtime import device_name

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numba import cuda, float32

kernel_names = import_sibling(__file__, "kernel_names")
out_of_bounds = load_chapter_module("05_first_kernels", "out_of_bounds")
shared_memory = load_chapter_module("06_memory", "shared_memory")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
SAVED = HERE / "saved"
BLOCK = shared_memory.BLOCK  # 128: ch06's tile holds one element per thread
N = 1000  # elements: 8 blocks of 128 threads, 24 of them past the end
PRINT_LIMIT = 5  # reports printed per run; the summary still counts them all
RUN_TIMEOUT_S = 180  # one sanitizer run (about 10-20 s; instrumented launches are slower)


# ---------------------------------------------------------------- the buggy kernels


# uninit, BROKEN on purpose: `out` is read before anything wrote it. A
# cuda.device_array is like np.empty: whatever the memory last held.
@cuda.jit
def accumulate_into(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] += x[i]


# divergent-barrier, BROKEN on purpose: ch06's shift_left_smem with its barrier
# indented under `if t < 16`, so 16 threads of the first warp wait at it while the
# other 16 go on and read the tile. CUDA requires a cuda.syncthreads() to be reached
# by every thread of the block or by none (CUDA C++ Programming Guide,
# "Synchronization Functions"); threads that have returned do not count.
@cuda.jit
def shift_left_barrier_in_branch(x, out):
    tile = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        tile[t] = x[i]
    if t < 16:
        cuda.syncthreads()
    if i < out.size:
        if t + 1 < BLOCK:
            out[i] = tile[t + 1]
        else:
            out[i] = x[i + 1]


# divergent-barrier, fixed: every thread reaches the barrier.
@cuda.jit
def shift_left_barrier_for_all(x, out):
    tile = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        tile[t] = x[i]
    cuda.syncthreads()
    if i < out.size:
        if t + 1 < BLOCK:
            out[i] = tile[t + 1]
        else:
            out[i] = x[i + 1]


def _python_function(kernel):
    """A dispatcher's Python function (GPU: py_func; simulator: fn)."""
    return getattr(kernel, "py_func", None) or kernel.fn


def _name(kernel) -> str:
    return _python_function(kernel).__name__


@dataclass(frozen=True)
class Target:
    """One bug: the tool that finds it, the buggy and fixed kernels, what it is."""

    name: str
    tool: str
    bug: object
    fixed: object
    what: str

    @property
    def kernel(self) -> str:
        return _name(self.bug)

    @property
    def fixed_kernel(self) -> str:
        return _name(self.fixed)


TARGETS = {
    t.name: t
    for t in (
        Target(
            "oob",
            "memcheck",
            out_of_bounds.fill_index_unchecked,
            out_of_bounds.fill_index_checked,
            "out-of-bounds write",
        ),
        Target(
            "race",
            "racecheck",
            shared_memory.shift_left_smem_no_barrier,
            shared_memory.shift_left_smem,
            "shared-memory race",
        ),
        Target("uninit", "initcheck", accumulate_into, accumulate_into, "uninitialised read"),
        Target(
            "divergent-barrier",
            "synccheck",
            shift_left_barrier_in_branch,
            shift_left_barrier_for_all,
            "barrier in a branch",
        ),
    )
}


def _race_size() -> int:
    # One launch, enough blocks on a GPU that a late warp can show the race (it
    # depends on timing there); two blocks in the simulator, whose race detector
    # finds it from the accesses alone.
    return pick(gpu=512 * BLOCK + 1, simulator=BLOCK + 1)


def launch(target: str, fixed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Run one target once; return (output copied to the host, float64 reference).

    oob: float32 (1000,) written by 8 blocks of 128 threads, into an allocation of
    exactly 1000 elements (so memcheck sees the 24 stray writes); reference arange.
    race, divergent-barrier: ch06's shift-left, out (n - 1,) = x[1:], float32.
    uninit: out (1000,) += x (1000,), float32, into a fresh cuda.device_array (the
    bug) or a zero-filled array (the fix); reference x.

    Raises whatever the runtime raises: IndexError (oob, simulator), RaceError
    (race, simulator), BarrierError (divergent-barrier, simulator), numba's
    CudaAPIError when a sanitizer stops a launch.
    ValueError for an unknown target.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    t = TARGETS[target]
    kernel = t.fixed if fixed else t.bug
    rng = np.random.default_rng()
    if target == "oob":
        # poisoned(): NaN-filled, exactly N elements: no guard cells in the same
        # allocation (ch05's guarded() has them, and memcheck cannot see writes there)
        out = poisoned(N)
        kernel[ceil_div(N, 128), 128](out)
        cuda.synchronize()
        return out.copy_to_host(), np.arange(N, dtype=np.float64)
    if target == "uninit":
        x_host = random_array(N, np.float32, rng)
        if fixed:
            out = cuda.to_device(np.zeros(N, np.float32))  # a copy initialises it
        else:
            out = cuda.device_array(N, np.float32)
        kernel[ceil_div(N, 128), 128](cuda.to_device(x_host), out)
        cuda.synchronize()
        return out.copy_to_host(), x_host.astype(np.float64)
    n = _race_size() if target == "race" else N
    x_host = random_array(n, np.float32, rng)
    out = poisoned(n - 1)
    shared_memory.shift_left(kernel, cuda.to_device(x_host), out)
    cuda.synchronize()
    return out.copy_to_host(), shared_memory.shift_left_cpu(x_host)


def _first_line(message: str, limit: int = 160) -> str:
    line = str(message).strip().splitlines()[0] if str(message).strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def outcome(target: str, fixed: bool = False) -> str:
    """Run one target once (:func:`launch`) and say what happened, in one line:
    the error raised, or how many outputs are wrong."""
    from numba.cuda.cudadrv.driver import CudaAPIError

    try:
        out, ref = launch(target, fixed)
    except (RaceError, BarrierError) as exc:  # the first clause names kernel, threads, lines
        return f"{type(exc).__name__}: {_first_line(str(exc).split('; ')[0], 220)}"
    except IndexError as exc:
        return f"IndexError: {_first_line(exc)}"
    except CudaAPIError as exc:
        return f"launch failed: {_first_line(exc)}"
    wrong = int(np.count_nonzero(~np.isclose(out, ref, rtol=1e-6, atol=0)))
    if wrong == 0:
        return f"no error raised; all {out.size} outputs right"
    return f"no error raised; {wrong} of {out.size} outputs wrong"


def poison_defence() -> str:
    """What the course does against uninitialised reads where no tool sees them:
    the uninit kernel run on a NaN-poisoned buffer, then check(); returns the
    check's message (the NaNs it counts). Raises AssertionError if check passed."""
    x_host = random_array(N, np.float32, np.random.default_rng())
    out = poisoned(N)  # stands for memory nobody wrote: NaN, not whatever was there
    accumulate_into[ceil_div(N, 128), 128](cuda.to_device(x_host), out)
    try:
        check(out, x_host.astype(np.float64), name="accumulate_into")
    except CheckError as exc:
        return str(exc)
    raise AssertionError("check() passed an output computed from poisoned memory")


def simulator_view(target: str) -> str:
    """What the course's simulator says about a buggy target, in one line."""
    if target == "uninit":
        with warnings.catch_warnings():  # the garbage may hold NaN or inf bit patterns
            warnings.simplefilter("ignore", RuntimeWarning)
            said = outcome(target)
        if said.startswith("no error raised; all"):
            said += " this time (the memory happened to hold zeros)"
        nan = re.search(r"\d+ of \d+ elements are NaN[^;]*", poison_defence())
        return (
            f"{said}; nothing says why (a device_array here is NumPy's empty()); "
            f"the course's defence, a NaN-poisoned buffer and check(): "
            f"{nan.group() if nan else 'check failed'}"
        )
    # The other three, divergent-barrier included: the course's checks name the
    # kernel, the threads and the lines (IndexError, RaceError, BarrierError).
    return outcome(target)


# ---------------------------------------------------------------- reading the logs

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
    return kernel_names.short_kernel_name(location)


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
    --tool ...`` header line (this script writes one) or guessed from the findings.

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


# ---------------------------------------------------------------- running the tools


def log_name(target: str, fixed: bool = False) -> str:
    """``sanitizer_<tool>_<target>[_fixed].txt``: where a run's log is saved."""
    return f"sanitizer_{TARGETS[target].tool}_{target}{'_fixed' if fixed else ''}.txt"


def sanitizer_command(target: str, fixed: bool = False, python: str = "python") -> list[str]:
    """The compute-sanitizer command line for one target (run from the repository root).

    --report-api-errors no: leave out CUDA API calls that return an error code (the
    CUDA Python bindings probe the driver with cuGetProcAddress at start-up: tens of
    harmless "errors" otherwise). --kernel-name kns=NAME: check only kernels whose
    mangled name contains NAME (Numba's mangled names contain the Python name).
    """
    t = TARGETS[target]
    kernel = t.fixed_kernel if fixed else t.kernel
    command = [
        "compute-sanitizer",
        "--tool",
        t.tool,
        "--report-api-errors",
        "no",
        "--print-limit",
        str(PRINT_LIMIT),
        "--kernel-name",
        f"kns={kernel}",
        python,
        str(Path(__file__).resolve().relative_to(REPO_ROOT)),
        "--target",
        target,
    ]
    return command + (["--fixed"] if fixed else [])


def find_sanitizer() -> str | None:
    """Path of compute-sanitizer: on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


def _run(command: list[str], timeout: float) -> tuple[str, str | None]:
    """Run a command from the repository root; return (stdout and stderr, problem).

    A run past ``timeout`` seconds is killed with its whole process group (the
    sanitizer's child Python too) and comes back with what it printed so far.
    """
    proc = subprocess.Popen(
        command,
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


def run_sanitizer(sanitizer: str, target: str, fixed: bool, out: Path) -> Path:
    """Run one target under its tool, write the log to ``out``; return its path.

    The log's first line is the command (``$ compute-sanitizer ...``), which
    :func:`parse_report` reads the tool from.
    """
    command = sanitizer_command(target, fixed, python=sys.executable)
    command[0] = sanitizer
    output, problem = _run(command, RUN_TIMEOUT_S)
    shown = sanitizer_command(target, fixed)
    text = f"$ {shlex.join(shown)}\n# device: {device_name()}\n{output}"
    if problem:
        text += f"# {problem}\n"
    path = out / log_name(target, fixed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def gpu_view(target: str) -> str:
    """What the GPU does with a buggy target when nothing is watching: one plain run
    in a child process (a launch failure or a hang cannot take this one with it)."""
    script = str(Path(__file__).resolve())
    output, problem = _run([sys.executable, script, "--target", target], 60)
    if problem:
        return f"the launch {problem}: a deadlock?"
    said = [line for line in output.splitlines() if line.startswith("outcome: ")]
    return said[-1][len("outcome: ") :] if said else _first_line(output or "(no output)")


# ---------------------------------------------------------------- the script


def _read(path: Path, tool: str) -> tuple[SanitizerReport | None, str]:
    """(report, "") or (None, why not)."""
    if not path.is_file():
        return None, "no log"
    try:
        return parse_report(path.read_text(), tool), ""
    except ValueError:
        return None, "log has no summary (run cut short)"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def sanitizer_table(folder: Path) -> tuple[str, list[str]]:
    """The table of every target's log in ``folder``; and the lines that contradict
    the lesson (a buggy target with no error, a fixed one with errors)."""
    rows, surprises = [], []
    for name, t in TARGETS.items():
        report, why = _read(folder / log_name(name), t.tool)
        fixed, fixed_why = _read(folder / log_name(name, fixed=True), t.tool)
        if report is None:
            errors, first = why, ""
        else:
            errors = str(report.error_count)
            if report.not_printed:
                errors += f" ({report.not_printed} not printed)"
            first = report.first.describe() if report.first else "(none)"
            if report.error_count == 0:
                surprises.append(f"{t.tool} found nothing in {name}")
        fixed_errors = fixed_why if fixed is None else str(fixed.error_count)
        if fixed is not None and fixed.error_count:
            surprises.append(f"{t.tool} found {fixed.error_count} errors in fixed {name}")
        rows.append([name, t.tool, errors, fixed_errors, first])
    header = ["bug", "tool", "errors", "fixed", "first finding (kind: kernel, thread, block)"]
    return _table(rows, header), surprises


def run_target_main(target: str, fixed: bool) -> int:
    """--target: one launch, and one line saying what happened."""
    t = TARGETS[target]
    kernel = t.fixed_kernel if fixed else t.kernel
    print(f"target {target}{' fixed' if fixed else ''} ({kernel}) on {device_name()}")
    print(f"outcome: {outcome(target, fixed)}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    parser.add_argument("--target", choices=list(TARGETS), help="run one target once and exit")
    parser.add_argument("--fixed", action="store_true", help="with --target: the fixed twin")
    args = parser.parse_args(argv)
    if args.fixed and not args.target:
        parser.error("--fixed needs --target")
    if args.target:
        return run_target_main(args.target, args.fixed)

    sanitizer = None if is_simulator() else find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer would run, from the repository root:")
        for name in TARGETS:
            for fixed in (False, True):
                print(f"  {shlex.join(sanitizer_command(name, fixed))}")
        where = "we are in the simulator" if is_simulator() else "compute-sanitizer not on PATH"
        print(
            f"skipped: {where} (it ships with the CUDA toolkit; the GPU run's logs are "
            f"in {SAVED.relative_to(REPO_ROOT)}/)"
        )
        folder, label = SAVED, f"logs saved from the GPU run in {SAVED.relative_to(REPO_ROOT)}/"
    else:
        print(f"compute-sanitizer: {sanitizer}")
        for name in TARGETS:
            for fixed in (False, True):
                path = run_sanitizer(sanitizer, name, fixed, args.out)
                print(f"  {shlex.join(sanitizer_command(name, fixed))}\n    -> {path}")
        folder, label = args.out, f"this run, {device_name()}"
    table, surprises = sanitizer_table(folder)
    print(f"\ncompute-sanitizer ({label}):")
    print(table)

    side = "the simulator" if is_simulator() else f"the GPU ({device_name()}), plainly"
    print(f"\nthe same bugs without a sanitizer, on {side}:")
    rows = []
    for name, t in TARGETS.items():
        said = simulator_view(name) if is_simulator() else gpu_view(name)
        rows.append([name, t.what, said])
    print(_table(rows, ["bug", "what", "what happens"]))

    for name in TARGETS:  # and every fixed twin computes the right answer
        out, ref = launch(name, fixed=True)
        check(out, ref, tol=0.0, name=f"{name} fixed ({TARGETS[name].fixed_kernel})")
    print(f"fixed versions: outputs right on the {common.runtime_name()}  OK")
    if surprises and folder is not SAVED:
        print("unexpected: " + "; ".join(surprises), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
