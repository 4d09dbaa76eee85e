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
them (``tools.parse_report``) and prints one table; then it runs each buggy target
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
from common import import_sibling, load_chapter_module
from common.checking import CheckError, check, poisoned, random_array
from common.harness import run_script, script_parser
from common.runtime import ceil_div, device_name, is_simulator, pick
from common.timing import format_table

import functools
import re
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import cuda, float32

tools = import_sibling(__file__, "tools")
out_of_bounds = load_chapter_module("05_first_kernels", "out_of_bounds")
shared_memory = load_chapter_module("06_memory", "shared_memory")

BLOCK = shared_memory.BLOCK  # 128: ch06's tile holds one element per thread
N = 1000  # elements: 8 blocks of 128 threads, 24 of them past the end
PRINT_LIMIT = 5  # reports printed per run; the summary still counts them all
RUN_TIMEOUT_S = 180  # one sanitizer run (instrumented launches are slower)


# ---------------------------------------------------------------- the buggy kernels


# uninit, BROKEN on purpose: `out` is read before anything wrote it. A
# cuda.device_array is like np.empty: whatever the memory last held.
@cuda.jit(cache=True)
def accumulate_into(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] += x[i]


# divergent-barrier, BROKEN on purpose: ch06's shift_left_smem with its barrier
# indented under `if t < 16`, so 16 threads of the first warp wait at it while the
# other 16 go on and read the tile. CUDA requires a cuda.syncthreads() to be reached
# by every thread of the block or by none (CUDA C++ Programming Guide,
# "Synchronization Functions"); threads that have returned do not count.
@cuda.jit  # not cached: BLOCK is chapter 06's, whose edits numba's cache does not see
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
@cuda.jit  # not cached: BLOCK is chapter 06's, whose edits numba's cache does not see
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


@dataclass(frozen=True)
class Target:
    """One bug: the tool that finds it, the buggy and fixed kernels, what it is."""

    name: str
    tool: str
    bug: object
    fixed: object
    what: str

    def kernel(self, fixed: bool = False) -> str:
        """The Python name of the buggy kernel, or (``fixed``) of its fixed twin."""
        return tools.python_name(self.fixed if fixed else self.bug)


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


def outcome(target: str, fixed: bool = False) -> str:
    """Run one target once (:func:`launch`) and say what happened, in one line:
    the error raised, or how many outputs are wrong (tools.describe_outcome)."""
    return tools.describe_outcome(functools.partial(launch, target, fixed))


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
    kernel = t.kernel(fixed)
    script = Path(__file__).resolve().relative_to(tools.REPO_ROOT)
    command = shlex.split(
        f"compute-sanitizer --tool {t.tool} --report-api-errors no --print-limit {PRINT_LIMIT} "
        f"--kernel-name kns={kernel}"
    )
    return [*command, python, str(script), "--target", target] + (["--fixed"] if fixed else [])


def run_sanitizer(sanitizer: str, target: str, fixed: bool, out: Path) -> Path:
    """Run one target under its tool (``sanitizer``: the compute-sanitizer to run);
    write the log to ``out`` (tools.run_logged) and return its path."""
    command = sanitizer_command(target, fixed, python=sys.executable)
    command[0] = sanitizer
    shown = sanitizer_command(target, fixed)
    path = out / log_name(target, fixed)
    return tools.run_logged(command, shown, device_name(), path, RUN_TIMEOUT_S)


def gpu_view(target: str) -> str:
    """What the GPU does with a buggy target when nothing is watching: one plain run
    in a child process (a launch failure or a hang cannot take this one with it)."""
    return tools.outcome_in_child(
        [sys.executable, str(Path(__file__).resolve()), "--target", target], 60
    )


# ---------------------------------------------------------------- the script


def sanitizer_table(folder: Path) -> tuple[str, list[str]]:
    """The table of every target's logs in ``folder`` (tools.log_table), and the
    lines that contradict the lesson (a bug with no error, a fixed twin with errors)."""
    return tools.log_table(
        (name, t.tool, folder / log_name(name), folder / log_name(name, fixed=True))
        for name, t in TARGETS.items()
    )


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    parser.add_argument("--target", choices=list(TARGETS), help="run one target once and exit")
    parser.add_argument("--fixed", action="store_true", help="with --target: the fixed twin")
    args = parser.parse_args(argv)
    if args.fixed and not args.target:
        parser.error("--fixed needs --target")
    if args.target:  # what the sanitizer wraps: one launch, one line saying what happened
        kernel = TARGETS[args.target].kernel(args.fixed)
        print(f"target {args.target}{' fixed' if args.fixed else ''} ({kernel}) on {device_name()}")
        print(f"outcome: {outcome(args.target, args.fixed)}", flush=True)
        return 0

    sanitizer = None if is_simulator() else tools.find_sanitizer()
    saved = tools.SAVED_DIR.relative_to(tools.REPO_ROOT)
    if sanitizer is None:
        print("compute-sanitizer would run, from the repository root:")
        for name in TARGETS:
            for fixed in (False, True):
                print(f"  {shlex.join(sanitizer_command(name, fixed))}")
        where = "we are in the simulator" if is_simulator() else "compute-sanitizer not on PATH"
        print(
            f"skipped: {where} (it ships with the CUDA toolkit; the GPU run's logs are in {saved}/)"
        )
        folder, label = tools.SAVED_DIR, f"logs saved from the GPU run in {saved}/"
    else:
        print(f"compute-sanitizer: {sanitizer}")
        for name in TARGETS:
            for fixed in (False, True):
                path = run_sanitizer(sanitizer, name, fixed, args.out)
                print(f"  {shlex.join(sanitizer_command(name, fixed))}\n    -> {path}")
        folder, label = args.out, f"this run, {device_name()}"
    table, surprises = sanitizer_table(folder)
    print(f"\ncompute-sanitizer ({label}):\n{table}")

    side = "the simulator" if is_simulator() else f"the GPU ({device_name()}), plainly"
    rows = []
    for name, t in TARGETS.items():
        said = simulator_view(name) if is_simulator() else gpu_view(name)
        rows.append([name, t.what, said])
    header = ["bug", "what", "what happens"]
    print(format_table(rows, f"\nthe same bugs without a sanitizer, on {side}:", header=header))

    for name in TARGETS:  # and every fixed twin computes the right answer
        out, ref = launch(name, fixed=True)
        check(out, ref, tol=0.0, name=f"{name} fixed ({TARGETS[name].kernel(fixed=True)})")
    print(f"fixed versions: outputs right on the {common.runtime_name()}  OK")
    if surprises and folder is not tools.SAVED_DIR:
        print("unexpected: " + "; ".join(surprises), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
