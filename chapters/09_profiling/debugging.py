"""Debugging kernels without a GPU, and reading what the compiler made of them.

  (a) print() inside a kernel: works in the simulator and on a GPU; one thread prints
  (b) pdb in the simulator: a simulated kernel is Python, so breakpoint() stops in it
  (c) cuda.jit(debug=True, opt=False): on a GPU, a `raise` in a kernel reaches the
      host, with the thread and the source line; without it the thread just returns
  (d) lineinfo=True: the PTX gets .loc directives (source lines), which Nsight
      Compute's source view reads; the code itself does not change
  (e) registers, shared and local memory per thread, from the compiled kernel
  (f) the PTX (kernel.inspect_asm) and the SASS (kernel.inspect_sass, needs nvdisasm)
      of ch06's transpose_smem_padded: its loads, stores and barriers, counted

(d) to (f) need a GPU: the simulator compiles nothing. Sources: numba-cuda 0.30,
numba/cuda/decorators.py (the jit options) and dispatcher.py (what debug=True adds
to a launch); PTX ISA, "Instruction Set".

Run: python chapters/09_profiling/debugging.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator, jit, load_chapter_module
from common.checking import poisoned
from common.harness import run_script, script_parser

import math
import re
import subprocess
import sys

import numpy as np
from numba import cuda

transpose = load_chapter_module("06_memory", "transpose")

N = 256  # two blocks of 128 threads: enough to show one thread out of many
THREADS = 128


# (a) print(): the one debugging tool that runs unchanged on a GPU. Every thread that
# reaches it prints, so guard it to one thread (or one block).
@cuda.jit(cache=True)
def scale_with_print(x, out, alpha):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = alpha * x[i]
        if i == 0:
            print("thread", i, ": x[i] =", x[i], "out[i] =", out[i])


# (b) breakpoint(): simulator only (a GPU kernel cannot call into Python), guarded to one
# thread: the simulator runs one Python thread per CUDA thread.
@cuda.jit(cache=True)
def scale_with_breakpoint(x, out, alpha):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = alpha * x[i]
        if i == 3:
            breakpoint()


# (c) one kernel, compiled twice: a negative input is a bug the kernel reports.
def sqrt_elementwise(x, out):
    i = cuda.grid(1)
    if i < x.size:
        if x[i] < 0:
            raise ValueError("negative input to sqrt")
        out[i] = math.sqrt(x[i])


sqrt_fast = cuda.jit(sqrt_elementwise)  # neither is cache=True: options are not in the cache key
# debug=True: a kernel's exception is stored and raised on the host after the launch
# (numba-cuda reads an error flag after every launch: slower); NVVM -g debug info for
# cuda-gdb. opt=False: numba-cuda warns that debug with optimisation may crash.
sqrt_debug = jit(debug=True, opt=False)(sqrt_elementwise)

# (d)-(f): ch06's padded tile transpose, a(rows, cols) -> out(cols, rows), float32 C order.
TRANSPOSE_SIG = "void(float32[:, ::1], float32[:, ::1])"
# PTX mnemonics that move data or wait (PTX ISA: ld, st, bar/barrier); .nc and vector
# forms (ld.global.nc.v4.f32) count as their base instruction.
PTX_OPS = ("ld.global", "st.global", "ld.shared", "st.shared", "bar.sync")
SASS_OPS = ("LDG", "STG", "LDS", "STS", "BAR")


_PREDICATE = re.compile(r"^@!?%\w+\s+")


def count_ptx(ptx: str) -> dict[str, int]:
    """How many of each PTX_OPS instruction ``ptx`` holds, plus ``.loc`` (source-line
    directives) and ``.file``; ``barrier.sync`` counts as ``bar.sync``."""
    counts = dict.fromkeys(PTX_OPS, 0)
    counts[".loc"] = counts[".file"] = 0
    for line in ptx.splitlines():
        # "@%p1 ld.global.f32 ...": a predicated instruction is still one instruction
        body = _PREDICATE.sub("", line.strip())
        word = body.split(maxsplit=1)[0] if body else ""
        word = word.split("{", 1)[0]
        if word in (".loc", ".file"):
            counts[word] += 1
            continue
        word = word.replace("barrier.sync", "bar.sync")
        for op in PTX_OPS:
            if word == op or word.startswith(op + "."):
                counts[op] += 1
    return counts


def count_sass(sass: str) -> dict[str, int]:
    """How many of each SASS_OPS instruction (``LDG.E.128`` counts as LDG) ``sass`` holds."""
    counts = dict.fromkeys(SASS_OPS, 0)
    for op in SASS_OPS:
        counts[op] = len(re.findall(rf"\b{op}(?=[.\s])", sass))
    return counts


def _only(value):
    """A dispatcher's per-signature dict of one entry -> that entry; a value -> itself."""
    if isinstance(value, dict):
        if len(value) != 1:
            raise ValueError(f"expected one compiled signature, got {len(value)}")
        return next(iter(value.values()))
    return value


def demo_print() -> None:
    """(a) One thread prints from inside a kernel."""
    print("(a) print() inside a kernel, guarded by `if i == 0`:")
    x = cuda.to_device(np.arange(N, dtype=np.float32) + 1)
    out = poisoned(N)
    sys.stdout.flush()  # a GPU's printf goes to the C stdout when the kernel finishes
    scale_with_print[N // THREADS, THREADS](x, out, np.float32(2))
    cuda.synchronize()  # on a GPU, the kernel's lines appear here, at the synchronize
    sys.stdout.flush()


def demo_breakpoint() -> dict:
    """(b) Run scale_with_breakpoint in the simulator with breakpoint() routed to a hook
    that records the stopped thread's variables instead of opening pdb (this script
    must not wait for input). Returns what the hook saw."""
    print("(b) pdb in the simulator:")
    print(
        "    put `if i == 3: breakpoint()` in the kernel and run with NUMBA_ENABLE_CUDASIM=1:\n"
        "    the simulated thread 3 stops at a (Pdb) prompt; `p i, x[i]`, `p cuda.threadIdx.x`,\n"
        "    `n` steps, `c` continues. Without the guard, all threads stop in turn."
    )
    if not is_simulator():
        print("    (simulator only: on a GPU a kernel cannot call Python; cuda-gdb, see (c))")
        return {}
    seen: dict = {}

    def hook(*args, **kwargs) -> None:
        frame = sys._getframe(1)  # the kernel's frame, where breakpoint() was called
        local = frame.f_locals
        seen.update(
            i=local["i"],
            x_i=float(local["x"][local["i"]]),
            out_i=float(local["out"][local["i"]]),
            thread=int(cuda.threadIdx.x),
            block=int(cuda.blockIdx.x),
        )

    x = cuda.to_device(np.arange(N, dtype=np.float32) + 1)
    out = poisoned(N)
    saved_hook = sys.breakpointhook
    sys.breakpointhook = hook
    try:
        scale_with_breakpoint[N // THREADS, THREADS](x, out, np.float32(2))
    finally:
        sys.breakpointhook = saved_hook
    print(
        f"    here breakpoint() called a recording hook instead of pdb: it stopped in thread "
        f"{seen['thread']} of block {seen['block']} with i = {seen['i']}, x[i] = {seen['x_i']}, "
        f"out[i] = {seen['out_i']}"
    )
    return seen


def demo_debug() -> int:
    """(c) A raise inside a kernel, compiled with and without debug=True. Returns 1 when
    a GPU does something other than what numba-cuda's source says it does."""
    print("(c) cuda.jit(debug=True, opt=False):")
    x_host = np.linspace(1, 4, N, dtype=np.float32)
    bad = 37
    x_host[bad] = -1.0
    x = cuda.to_device(x_host)
    results = {}
    for name, kernel in (("debug=False", sqrt_fast), ("debug=True, opt=False", sqrt_debug)):
        out = poisoned(N)
        try:
            kernel[N // THREADS, THREADS](x, out)
            cuda.synchronize()
            got = out.copy_to_host()[bad]
            results[name] = None
            print(f"    {name}: no error; out[{bad}] = {got} (thread {bad} returned early)")
        except ValueError as exc:
            results[name] = str(exc)
            print(f"    {name}: ValueError: {exc}")
    if is_simulator():
        print("    the simulator runs the kernel as Python: every raise reaches you, debug or not")
        return 0
    if results["debug=False"] is not None or results["debug=True, opt=False"] is None:
        print("    unexpected: numba-cuda raises a kernel's exception only with debug=True")
        return 1
    debug_ptx = _only(sqrt_debug.inspect_asm())
    fast_ptx = _only(sqrt_fast.inspect_asm())
    print(
        "    debug=True also emits debug information for cuda-gdb: "
        f"{count_ptx(debug_ptx)['.loc']} .loc lines and "
        f"{'a' if '.debug_info' in debug_ptx else 'no'} .debug_info section in its PTX "
        f"(debug=False: {count_ptx(fast_ptx)['.loc']} and "
        f"{'a' if '.debug_info' in fast_ptx else 'no'})"
    )
    return 0


def compiled_transposes():
    """ch06 transpose_smem_padded compiled for this GPU twice: (plain, lineinfo=True)."""
    py_func = transpose.transpose_smem_padded.py_func
    return (
        cuda.jit(TRANSPOSE_SIG)(py_func),  # not cache=True: options are not in numba's cache key
        cuda.jit(TRANSPOSE_SIG, lineinfo=True)(py_func),
    )


def demo_compiled() -> None:
    """(d)-(f): lineinfo, resources, PTX and SASS of transpose_smem_padded."""
    if is_simulator():
        print(
            "(d)-(f) lineinfo, registers, PTX, SASS: skipped: the simulator compiles "
            "nothing (run this on a GPU)"
        )
        return
    plain, with_lines = compiled_transposes()
    ptx = _only(plain.inspect_asm())
    ptx_lines = _only(with_lines.inspect_asm())
    counts, counts_lines = count_ptx(ptx), count_ptx(ptx_lines)
    print("(d) lineinfo=True, transpose_smem_padded:")
    print(
        f"    .loc lines: {counts['.loc']} without, {counts_lines['.loc']} with; "
        f".file lines: {counts['.file']} without, {counts_lines['.file']} with"
    )
    regs = _only(plain.get_regs_per_thread())
    regs_lines = _only(with_lines.get_regs_per_thread())
    same = "same code" if regs == regs_lines else "different register counts"
    print(f"    registers per thread: {regs} without, {regs_lines} with ({same})")
    shared = _only(plain.get_shared_mem_per_block())
    local = _only(plain.get_local_mem_per_thread())
    tile_bytes = transpose.TILE * transpose.TILE_PADDED * 4
    print("(e) resources of transpose_smem_padded:")
    print(
        f"    {regs} registers a thread, {shared} bytes of shared memory a block "
        f"(the {transpose.TILE} x {transpose.TILE_PADDED} float32 tile is {tile_bytes}), "
        f"{local} bytes of local memory a thread"
    )
    print("(f) PTX (kernel.inspect_asm()): " + ", ".join(f"{op} {counts[op]}" for op in PTX_OPS))
    shown = [
        line.strip()
        for line in ptx.splitlines()
        if any(
            _PREDICATE.sub("", line.strip()).startswith(op) for op in PTX_OPS + ("barrier.sync",)
        )
    ]
    for line in shown[:8]:
        print(f"    {line}")
    try:
        sass = _only(plain.inspect_sass())
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # no nvdisasm
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"    SASS: skipped: {reason}")
        return
    sass_counts = count_sass(sass)
    print(
        "    SASS (kernel.inspect_sass(), nvdisasm): "
        + ", ".join(f"{op} {sass_counts[op]}" for op in SASS_OPS)
    )


def main(argv=None) -> int:
    script_parser(__doc__, "09_profiling").parse_args(argv)  # --help; writes nothing
    demo_print()
    demo_breakpoint()
    code = demo_debug()
    demo_compiled()
    return code


if __name__ == "__main__":
    run_script(main)
