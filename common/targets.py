"""Do the course's kernels fit the GPUs learners have? ``python -m common.targets``

The course is measured on an H100 (compute capability 9.0); learners run it on a
free notebook's T4 (7.5), a desktop RTX 30xx/40xx (8.6/8.9) or an A100 (8.0).
This module holds those GPUs' limits as data (:data:`ARCHS`, from NVIDIA's
tables) and checks every kernel the course launches against each of them:

1. **collect**: run the test suite on the GPU with this module as a pytest
   plugin (``-p common.targets``); every launch records the compiled kernel
   (its argument types are the launch's), its block and its dynamic shared
   memory. The GPU run matters: the fast capstone picks GPU tiles there
   (``pick(gpu=..., simulator=...)``), not the simulator's 8-thread ones.
2. **compile** each recorded kernel for 7.5, 8.0, 8.6, 8.9 and 9.0: the same
   LLVM IR numba-cuda launched, through NVVM for that architecture (to LTO-IR
   for a kernel numba-cuda links with LTO, its default where nvJitLink is
   installed, else to PTX: ``CUDACodeLibrary._link_all``), then nvJitLink to a
   cubin with ptxas's verbose report (registers, stack frame, spills: what
   ``ptxas -v`` prints) and its cache off (a link nvJitLink has cached, on a
   machine with a driver, returns the cubin without running ptxas, so without
   a report); the static shared memory is what the PTX declares. No GPU of
   those architectures is needed.
3. **check** each against :data:`ARCHS` with the largest block it was launched
   with (:func:`check_kernel`): threads per block, registers per block
   (registers x threads, allocated per warp in units of 256), static + dynamic
   shared memory per block, and what a launch bound asks of an SM.
4. **cover**: every kernel defined in ``chapters/``, ``final_project/`` and
   ``common/`` (read from the source: functions under ``cuda.jit``/``jit``
   without ``device=True``) is either in the table or listed as never
   launched by the tests that ran, so "every kernel" can be checked.

Run on a GPU machine (numba-cuda with its CUDA toolkit wheels, e.g.
``pip install -e ".[cu13,dev]"``)::

    python -m common.targets                    # the whole test suite (tests/)
    python -m common.targets -- tests/test_final_project_fast_conv.py   # a part
    python -m common.targets --limits           # the table of limits only (anywhere)

It prints one row per compiled kernel (registers per thread on each
architecture), then each problem and note, then the coverage; it exits 1 if a
kernel breaks a limit or does not compile for one of the architectures, 2 if
it could not run (no GPU, no launch recorded). In the simulator only
``--limits`` works; ``tests/test_targets.py`` checks there what needs no
compiler (the limits as data, the checks themselves, the capstone's launch
shapes).

Sources of the figures: CUDA C++ Programming Guide, "Compute Capabilities",
table "Technical Specifications per Compute Capability", and the same figures
as code in NVIDIA CCCL ``libcudacxx/include/cuda/__device/arch_traits.h``
(``arch_traits<arch_id::sm_75>()`` ...); SM counts from NVIDIA's architecture
whitepapers (Turing, Ampere GA100 and GA102, Ada, Hopper) and product datasheets.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import runtime
from .timing import format_table

REPO_ROOT = Path(__file__).resolve().parents[1]
COURSE_DIRS = ("chapters", "final_project", "common")

KIB = 1024


# ---------------------------------------------------------------------------
# The GPUs, as data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """Per-block and per-SM limits of one compute capability (bytes, registers, threads).

    ``static_shared_per_block`` is the most a kernel may declare
    (``cuda.shared.array``) and the most a launch may use without opting in;
    ``optin_shared_per_block`` is the most a block may use after the kernel sets
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` (numba-cuda 0.30 never
    does, so the course's limit is ``static_shared_per_block`` everywhere);
    ``reserved_shared_per_block`` is what the driver takes per resident block
    out of ``shared_per_sm`` (8.0 and newer).
    """

    cc: tuple[int, int]
    family: str
    examples: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    shared_per_sm: int
    optin_shared_per_block: int
    reserved_shared_per_block: int
    max_threads_per_block: int = 1024
    max_registers_per_thread: int = 255
    registers_per_block: int = 64 * KIB
    registers_per_sm: int = 64 * KIB
    register_allocation_unit: int = 256  # registers, per warp
    static_shared_per_block: int = 48 * KIB
    warp_size: int = 32

    @property
    def name(self) -> str:
        return f"{self.cc[0]}.{self.cc[1]}"

    @property
    def sm(self) -> str:
        """The architecture name the compilers take: ``sm_75``."""
        return f"sm_{self.cc[0]}{self.cc[1]}"


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability";
# CCCL arch_traits.h (arch_traits<arch_id::sm_75>() ... <arch_id::sm_90>()).
# Common to all five: 1024 threads and 64 K registers a block, 255 a thread,
# 64 K registers an SM, 48 KiB of static shared memory a block.
ARCHS: dict[tuple[int, int], Arch] = {
    a.cc: a
    for a in (
        Arch((7, 5), "Turing", "T4, RTX 20xx, GTX 16xx", 1024, 16, 64 * KIB, 64 * KIB, 0),
        Arch((8, 0), "Ampere (GA100)", "A100, A30", 2048, 32, 164 * KIB, 163 * KIB, KIB),
        Arch((8, 6), "Ampere (GA10x)", "RTX 30xx, A10, A40", 1536, 16, 100 * KIB, 99 * KIB, KIB),
        Arch((8, 9), "Ada", "RTX 40xx, L4, L40S", 1536, 24, 100 * KIB, 99 * KIB, KIB),
        Arch((9, 0), "Hopper", "H100, H200", 2048, 32, 228 * KIB, 227 * KIB, KIB),
    )
}
TARGETS: tuple[tuple[int, int], ...] = tuple(ARCHS)


@dataclass(frozen=True)
class GPU:
    """A card learners use: its compute capability and SM count."""

    name: str
    cc: tuple[int, int]
    sms: int


# SM counts: NVIDIA Turing, Ampere (GA100, GA102), Ada and Hopper architecture
# whitepapers; T4, A10, L4 and RTX datasheets (CUDA cores / 64 or / 128 per SM).
TYPICAL_GPUS: tuple[GPU, ...] = (
    GPU("Tesla T4 (Colab, Kaggle)", (7, 5), 40),
    GPU("GeForce RTX 2080 Ti", (7, 5), 68),
    GPU("A100", (8, 0), 108),
    GPU("GeForce RTX 3060", (8, 6), 28),
    GPU("GeForce RTX 3090", (8, 6), 82),
    GPU("A10", (8, 6), 72),
    GPU("L4", (8, 9), 58),
    GPU("GeForce RTX 4090", (8, 9), 128),
    GPU("H100 SXM", (9, 0), 132),
)


@dataclass(frozen=True)
class Feature:
    """Something the course uses that needs compute capability ``min_cc`` or newer."""

    name: str
    min_cc: tuple[int, int]
    used_by: str
    without: str


# The course's minimum: the oldest architecture that CUDA 13 (numba-cuda[cu13])
# compiles for and PyTorch's CUDA 12.8 and 13.0 wheels ship kernels for (CUDA 13.0
# release notes, "Deprecated Architectures": Maxwell, Pascal and Volta removed;
# PyTorch RELEASE.md, "PyTorch CUDA Support Matrix"). python -m common.targets
# checks that every kernel of the course compiles for it.
MIN_CC: tuple[int, int] = (7, 5)

# What the course uses that not every GPU has, oldest first. The course's own
# kernels are FP32 only: no FP16/BF16 arithmetic, no tensor-core instructions, no
# asynchronous copies, so BF16 (8.0), cp.async (8.0) and clusters/TMA (9.0) are
# not listed.
FEATURES: tuple[Feature, ...] = (
    Feature(
        "torch.compile's Triton back end",
        (7, 0),
        "chapter 10's compile_and_graphs.py and fused_ops.py",
        "torch.compile refuses the GPU (Triton needs 7.0)",
    ),
    Feature(
        "CUDA 13 and PyTorch's CUDA 12.8/13.0 wheels",
        MIN_CC,
        "every chapter",
        "numba-cuda[cu13] cannot compile for it and torch carries no kernels for it "
        "('no kernel image is available for execution on the device')",
    ),
    Feature(
        "TF32 tensor cores",
        (8, 0),
        "chapter 07's cublas.py version 2 and final_project/compare.py --torch-tf32",
        "torch's TF32 switch does nothing there: both runs are FP32, so neither TF32's "
        "speed-up nor its ~1e-3 error shows",
    ),
)


def capability_report(cc: tuple[int, int]) -> tuple[list[str], list[str]]:
    """What a GPU of compute capability ``cc`` lacks of what the course uses.

    Returns (below_minimum, missing): one line each for the features it lacks,
    split into those that put it below :data:`MIN_CC` (the course does not
    support it as installed) and those that only change what a chapter shows.
    """
    below, missing = [], []
    for f in FEATURES:
        if tuple(cc) < f.min_cc:
            line = f"{f.name} ({f.min_cc[0]}.{f.min_cc[1]}+, used by {f.used_by}): {f.without}"
            (below if f.min_cc <= MIN_CC else missing).append(line)
    return below, missing


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """One kernel on one architecture: what ptxas gives it a thread (registers,
    stack frame and spills, bytes) and the static shared memory it declares a
    block (bytes)."""

    registers: int
    static_shared: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def registers_per_block(threads: int, registers: int, arch: Arch) -> int:
    """Registers a block of ``threads`` takes: whole warps, each rounded up to the
    allocation unit (CUDA Occupancy Calculator, ``cuda_occupancy.h``)."""
    warps = -(-threads // arch.warp_size)
    per_warp = -(-registers * arch.warp_size // arch.register_allocation_unit)
    return warps * per_warp * arch.register_allocation_unit


def max_threads_for(registers: int, arch: Arch) -> int:
    """The largest block (whole warps) whose registers fit ``arch``'s per-block file."""
    per_warp = registers_per_block(arch.warp_size, max(registers, 1), arch)
    return min(arch.max_threads_per_block, arch.registers_per_block // per_warp * arch.warp_size)


_BUDGET_TEXT = {
    "threads": "{a.max_threads_per_sm} an SM",
    "blocks": "{a.max_blocks_per_sm} an SM",
    "registers": "{a.registers_per_sm:,} an SM, {u.registers} a thread",
    "shared memory": "{a.shared_per_sm:,} B an SM",
}


def resident_blocks(usage: Usage, threads: int, dynamic_shared: int, arch: Arch) -> dict[str, int]:
    """Blocks an SM holds by each budget (threads, blocks, registers, shared memory).

    The simple form: the register file taken as one pool and shared memory
    without its allocation unit; chapter 09's ``occupancy.py`` is the full
    calculator (CUDA Occupancy Calculator, ``cuda_occupancy.h``).
    """
    warps = -(-threads // arch.warp_size)
    shared = usage.static_shared + dynamic_shared + arch.reserved_shared_per_block
    return {
        "threads": arch.max_threads_per_sm // (warps * arch.warp_size),
        "blocks": arch.max_blocks_per_sm,
        "registers": arch.registers_per_sm
        // max(1, registers_per_block(threads, usage.registers, arch)),
        "shared memory": arch.shared_per_sm // shared if shared else arch.max_blocks_per_sm,
    }


def check_kernel(
    usage: Usage,
    threads: int,
    dynamic_shared: int,
    arch: Arch,
    launch_bounds: Sequence[int] | int | None = None,
) -> tuple[list[str], list[str]]:
    """Problems (a launch fails) and notes (it runs, slower than on the H100) of a
    kernel with ``usage`` launched with blocks of ``threads`` threads and
    ``dynamic_shared`` bytes of dynamic shared memory on ``arch``.

    ``launch_bounds``: the kernel's ``launch_bounds=`` option (max threads per
    block, min blocks per SM), if any.
    """
    problems: list[str] = []
    notes: list[str] = []
    if threads > arch.max_threads_per_block:
        problems.append(f"{threads} threads per block > {arch.max_threads_per_block}")
    bounds = (launch_bounds,) if isinstance(launch_bounds, int) else tuple(launch_bounds or ())
    if bounds and threads > bounds[0]:
        problems.append(f"launched with {threads} threads, its launch bound allows {bounds[0]}")
    if usage.registers > arch.max_registers_per_thread:
        problems.append(f"{usage.registers} registers per thread > {arch.max_registers_per_thread}")
    regs = registers_per_block(threads, usage.registers, arch)
    if regs > arch.registers_per_block:
        problems.append(
            f"{threads} threads x {usage.registers} registers = {regs:,} registers a block "
            f"(whole warps, in units of {arch.register_allocation_unit}) > "
            f"{arch.registers_per_block:,}: the launch fails (too many resources requested); "
            f"at most {max_threads_for(usage.registers, arch)} threads"
        )
    shared = usage.static_shared + dynamic_shared
    if shared > arch.static_shared_per_block:
        problems.append(
            f"{shared:,} B of shared memory a block ({usage.static_shared:,} static + "
            f"{dynamic_shared:,} dynamic) > {arch.static_shared_per_block // KIB} KiB "
            f"(more needs the opt-in attribute, up to {arch.optin_shared_per_block // KIB} KiB "
            "here, which numba-cuda 0.30 does not set)"
        )
    elif shared + arch.reserved_shared_per_block > arch.shared_per_sm:
        problems.append(f"{shared:,} B of shared memory a block > the SM's {arch.shared_per_sm:,}")
    if len(bounds) > 1 and bounds[1] > 1 and not problems:
        budgets = resident_blocks(usage, threads, dynamic_shared, arch)
        limiter = min(budgets, key=budgets.__getitem__)
        if budgets[limiter] < bounds[1]:
            notes.append(
                f"its launch bound asks for {bounds[1]} blocks an SM; {budgets[limiter]} fit "
                f"there ({limiter}: " + _BUDGET_TEXT[limiter].format(a=arch, u=usage) + ")"
            )
    return problems, notes


# ---------------------------------------------------------------------------
# Compiling for an architecture (numba-cuda's GPU target; no GPU needed)
# ---------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_LINKED = re.compile(r"Function properties for '([^']+)':")
_LINKED_USED = re.compile(r"used (\d+) registers")
# A static shared array in PTX: ".shared .align 16 .b8 name[18432];" (".visible" at
# module scope); ".extern .shared" is dynamic shared memory, sized at launch.
_SHARED = re.compile(
    r"^\s*(?:\.visible\s+|\.weak\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.([a-z]+(\d+))\s+"
    r"[\w$.]+((?:\[\d+\])*)\s*;",
    re.MULTILINE,
)


class LogFormatError(ValueError):
    """The linker's verbose log does not describe the kernel as expected."""


def parse_link_log(log: str, entry: str) -> Usage:
    """Registers, stack frame and spills of kernel ``entry`` from nvJitLink's verbose log.

    ptxas's block ("Compiling entry function 'NAME' for 'sm_75'", then "N bytes
    stack frame, N bytes spill stores, N bytes spill loads" and "Used N
    registers, ..."), and, where the linker finished the kernel, its summary
    ("Function properties for 'NAME':" then "used N registers, ..."), which wins.
    Shared memory is not read from here: the linker's figure for sm_90 includes
    the 1 KiB a block the system reserves, ptxas's is absent when the linker
    places the arrays; :func:`declared_shared` reads the PTX instead.

    Raises:
        LogFormatError: no ptxas block for ``entry`` (a log of another format).
    """
    lines = log.splitlines()
    found = False
    registers = frame = stores = loads = 0
    for i, line in enumerate(lines):
        m = _ENTRY.search(line)
        if m and m.group(1) == entry:
            found = True
            for follow in lines[i + 1 :]:
                if _ENTRY.search(follow) or "Compile time" in follow:
                    break
                if f := _FRAME.search(follow):
                    frame, stores, loads = map(int, f.groups())
                if u := _USED.search(follow):
                    registers = int(u.group(1))
        m = _LINKED.search(line)
        if m and m.group(1) == entry and i + 1 < len(lines):
            if u := _LINKED_USED.search(lines[i + 1]):
                registers = int(u.group(1))
    if not found:
        text = " | ".join(line.strip() for line in lines if line.strip(" \x00"))
        why = (
            "ptxas did not run: a link served from nvJitLink's cache (link with -no-cache)"
            if not any(_ENTRY.search(line) for line in lines)
            else "ptxas reported other functions"
        )
        raise LogFormatError(
            f"no ptxas report of {entry[:60]}... in the linker's log ({why}); "
            f"the log: {text[:300]!r}"
        )
    return Usage(registers, 0, frame, stores, loads)


def declared_shared(ptx: str) -> int:
    """Bytes of static shared memory a PTX module declares (``cuda.shared.array``s),
    each array at its alignment: what the 48 KiB a block limit counts (ptxas
    refuses more: "uses too much shared data (0xcb20 bytes, 0xc000 max)")."""
    total = 0
    for align, _, bits, dims in _SHARED.findall(ptx):
        count = 1
        for d in re.findall(r"\d+", dims):
            count *= int(d)
        a = int(align or 1)
        total = -(-total // a) * a + count * int(bits) // 8
    return total


def reporting_linker(library: Any, cc: tuple[int, int]) -> Any:
    """numba-cuda's linker for ``library`` on ``cc``, as numba-cuda would make it
    (its register cap, LTO or not), with ptxas's report on and nvJitLink's cache off.

    ``verbose`` is ``ptxas -v``. ``no_cache`` (``-no-cache``): on a machine with
    a driver nvJitLink keeps the cubins it linked (the driver's JIT cache, on
    disk, shared by every process), and a link it has seen before returns the
    cubin without running ptxas, so the log has no report of the kernel:
    ``info : 8 bytes gmem`` and nothing else (NVIDIA/cuda-python issue 950).
    """
    from numba.cuda.cudadrv import driver

    class ReportingLinker(driver._Linker):
        def _get_linker_options(self, ptx: bool) -> Any:
            options = super()._get_linker_options(ptx)
            options.verbose = True  # ptxas -v
            options.no_cache = True  # ptxas runs every time, so it reports every time
            return options

    return ReportingLinker(max_registers=library._max_registers, cc=cc, lto=library._lto)


def compile_usage(library: Any, entry: str, cc: tuple[int, int]) -> Usage:
    """Compile a numba-cuda kernel's code library for ``cc`` and read its usage.

    ``library``: a compiled kernel's ``CUDACodeLibrary`` (``kernel.library`` of
    an overload, GPU runtime only); its LLVM IR goes through NVVM for ``cc``
    (to LTO-IR if the kernel links with LTO), then nvJitLink links it (with
    cudadevrt and any linked files, as numba-cuda does) by :func:`reporting_linker`.
    Needs NVVM and nvJitLink, not a GPU.

    Raises:
        numba-cuda's errors when NVVM or the linker refuses the code (for
        example "uses too much shared data"); LogFormatError.
    """
    linker = reporting_linker(library, cc)
    library._link_all(linker, cc)
    linker.complete()
    usage = parse_link_log(linker.info_log, entry)
    shared = sum(declared_shared(ptx) for ptx in library.get_asm_strs(cc=cc))
    return dataclasses.replace(usage, static_shared=shared)


# ---------------------------------------------------------------------------
# Which kernels the course defines (read from the source)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelDef:
    """A kernel defined in the course's source: file (relative to the repo), the
    Python qualified name its function gets, and the line of its ``def``."""

    file: str
    qualname: str
    line: int


def _is_jit(expr: ast.expr, bare_jit: bool) -> bool:
    if isinstance(expr, ast.Attribute):
        return (
            expr.attr == "jit"
            and isinstance(expr.value, ast.Name)
            and expr.value.id
            in (
                "cuda",
                "runtime",
                "common",
            )
        )
    return bare_jit and isinstance(expr, ast.Name) and expr.id == "jit"


def _jit_kind(expr: ast.expr, bare_jit: bool) -> str | None:
    """ "kernel", "device" or None for a decorator or the callee of ``cuda.jit(...)(f)``."""
    if _is_jit(expr, bare_jit):
        return "kernel"
    if isinstance(expr, ast.Call) and _is_jit(expr.func, bare_jit):
        for kw in expr.keywords:
            if kw.arg == "device" and not (
                isinstance(kw.value, ast.Constant) and kw.value.value is False
            ):
                return "device"
        return "kernel"
    return None


def _imports_cuda_jit(tree: ast.Module) -> bool:
    """Does the module bind the bare name ``jit`` to a CUDA jit (the course's or numba's)?"""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in (
            "common",
            "common.runtime",
            "numba.cuda",
        ):
            if any(a.name == "jit" and a.asname in (None, "jit") for a in node.names):
                return True
    return False


def kernel_definitions(path: Path, root: Path = REPO_ROOT) -> list[KernelDef]:
    """Every kernel defined in the Python file ``path``: functions decorated with
    ``cuda.jit``/``jit`` without ``device=True`` (nested ones, as kernel
    factories make, included) and functions passed to ``cuda.jit(...)(f)``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bare_jit = _imports_cuda_jit(tree)
    rel = path.resolve().relative_to(root).as_posix()
    found: dict[str, KernelDef] = {}
    defs: dict[str, tuple[str, int]] = {}
    wrapped: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                defs.setdefault(child.name, (qualname, child.lineno))
                kinds = {_jit_kind(d, bare_jit) for d in child.decorator_list}
                if "kernel" in kinds and "device" not in kinds:
                    found[qualname] = KernelDef(rel, qualname, child.lineno)
                visit(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                # cuda.jit(f) and cuda.jit(sig, lineinfo=True)(f) make f a kernel
                if isinstance(child, ast.Call) and _jit_kind(child.func, bare_jit) == "kernel":
                    wrapped.update(a.id for a in child.args if isinstance(a, ast.Name))
                visit(child, prefix)

    visit(tree, "")
    for name in wrapped:
        if name in defs:
            qualname, line = defs[name]
            found.setdefault(qualname, KernelDef(rel, qualname, line))
    return sorted(found.values(), key=lambda k: k.line)


def course_files(root: Path = REPO_ROOT) -> list[Path]:
    """The course's Python files: chapters, capstone and common (not the tests)."""
    return sorted(p for d in COURSE_DIRS for p in (root / d).rglob("*.py"))


def course_kernels(root: Path = REPO_ROOT) -> list[KernelDef]:
    return [k for p in course_files(root) for k in kernel_definitions(p, root)]


# ---------------------------------------------------------------------------
# Recording launches (GPU: the compiled kernels; simulator: the launch shapes)
# ---------------------------------------------------------------------------


@dataclass
class Launched:
    """One compiled kernel (GPU) or kernel function (simulator) and its launches."""

    kernel: Any
    py_func: Any
    blocks: set[tuple[int, int, int]] = field(default_factory=set)
    max_dynamic_shared: int = 0
    count: int = 0

    @property
    def max_threads(self) -> int:
        return max((x * y * z for x, y, z in self.blocks), default=0)


def _dim3(d: Any) -> tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(int(v) for v in d)
    return (d + (1, 1))[:3]  # type: ignore[return-value]


@contextlib.contextmanager
def recording_launches() -> Iterator[dict[int, Launched]]:
    """Record every kernel launch inside the block, keyed by the kernel's id.

    On a GPU the key is the compiled overload (numba-cuda's ``_Kernel``: one per
    argument types), whose ``library`` :func:`compile_usage` compiles; in the
    simulator it is the kernel function, and only the launch shapes are known.
    """
    launched: dict[int, Launched] = {}

    def record(kernel: Any, py_func: Any, block: Any, shared: int) -> None:
        rec = launched.get(id(kernel))
        if rec is None:
            rec = launched[id(kernel)] = Launched(kernel, py_func)
        rec.blocks.add(_dim3(block))
        rec.max_dynamic_shared = max(rec.max_dynamic_shared, int(shared or 0))
        rec.count += 1

    if runtime.is_simulator():
        from numba.cuda.simulator import kernel as sim_kernel

        # The launch configuration, kernel[grid, block, stream, shared]: device
        # functions never pass here, and the simulator's own checks run first.
        cls, attr = sim_kernel.FakeCUDAKernel, "__getitem__"
        inner = cls.__getitem__

        def wrapper(self: Any, configuration: Any) -> Any:
            configured = inner(self, configuration)
            record(self.fn, self.fn, self.block_dim, self.dynshared_size)
            return configured
    else:
        from numba.cuda.dispatcher import _Kernel

        cls, attr = _Kernel, "launch"
        inner = _Kernel.launch

        def wrapper(self: Any, args: Any, griddim: Any, blockdim: Any, *rest: Any, **kw: Any):
            py_func = getattr(self, "py_func", None)  # absent from a kernel loaded from cache
            if py_func is not None:
                shared = rest[1] if len(rest) > 1 else kw.get("sharedmem", 0)
                record(self, py_func, blockdim, shared)
            return inner(self, args, griddim, blockdim, *rest, **kw)

    setattr(cls, attr, wrapper)
    try:
        yield launched
    finally:
        setattr(cls, attr, inner)


def _factory_parameters(py_func: Any) -> tuple[str, ...] | None:
    """Parameter names of the kernel factory that made ``py_func`` (``make_x(TILE)``
    for ``make_x.<locals>.kernel``), or None for a kernel defined at module level."""
    if ".<locals>." not in py_func.__qualname__:
        return None
    outer: Any = py_func.__globals__
    for part in py_func.__qualname__.split(".<locals>.")[0].split("."):
        outer = outer.get(part) if isinstance(outer, dict) else getattr(outer, part, None)
    code = getattr(outer, "__code__", None)
    if code is None:
        return None
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def _closure_text(py_func: Any) -> str:
    """A kernel factory's arguments as the kernel sees them (``TILE=32``): what
    tells its kernels apart. Other captured constants are left out."""
    params = _factory_parameters(py_func)
    parts = []
    for name, cell in zip(py_func.__code__.co_freevars, py_func.__closure__ or ()):
        if params is not None and name not in params:
            continue
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, (bool, int, float, str)) or (
            isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value)
        ):
            parts.append(f"{name}={value!r}")
        elif hasattr(value, "dtype") and not hasattr(value, "shape"):  # a numba or numpy type
            parts.append(f"{name}={value}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a tile shape
            values = ", ".join(repr(getattr(value, f.name)) for f in dataclasses.fields(value))
            parts.append(f"{name}={type(value).__name__}({values})")
    return ", ".join(parts)


def _short_types(argtypes: Iterable[Any]) -> str:
    """``array(float32, 2d, C)`` -> ``f32[2d,C]``: argument types in a table cell."""
    out = []
    for t in argtypes:
        s = str(t)
        m = re.fullmatch(r"array\((\w+), (\d)d, (\w)\)", s)
        if m:
            dt, nd, layout = m.groups()
            s = f"{dt}[{nd}d,{layout}]"
        s = re.sub(r"float(\d+)", r"f\1", s)
        s = re.sub(r"uint(\d+)", r"u\1", s)
        s = re.sub(r"(?<![u\w])int(\d+)", r"i\1", s)
        out.append(s)
    return ", ".join(out)


def _relative(file: str) -> str | None:
    try:
        return Path(file).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return None


def launch_record(rec: Launched) -> dict[str, Any]:
    """A JSON-able summary of one recorded kernel (GPU): which kernel, how launched."""
    kernel, py = rec.kernel, rec.py_func
    lib = kernel.library
    closure = _closure_text(py)
    bounds = getattr(kernel, "launch_bounds", None)
    identity = "\n".join(
        (
            py.__code__.co_filename,
            py.__qualname__,
            closure,
            str(tuple(kernel.argument_types)),
            repr(sorted(lib._nvvm_options.items())),
            repr(lib._max_registers),
            repr(bounds),
        )
    )
    return {
        "key": hashlib.sha1(identity.encode()).hexdigest()[:20],
        "file": _relative(py.__code__.co_filename) or py.__code__.co_filename,
        "qualname": py.__qualname__,
        "closure": closure,
        "args": _short_types(kernel.argument_types),
        "launch_bounds": list(bounds) if isinstance(bounds, tuple) else bounds,
        "blocks": sorted(rec.blocks),
        "max_dynamic_shared": rec.max_dynamic_shared,
        "launches": rec.count,
    }


def compile_record(rec: Launched, ccs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Usage (or the compiler's refusal) of one recorded kernel on each of ``ccs``."""
    out: dict[str, Any] = {}
    for cc in ccs:
        try:
            out[f"{cc[0]}.{cc[1]}"] = asdict(
                compile_usage(rec.kernel.library, rec.kernel.entry_name, cc)
            )
        except Exception as exc:  # noqa: BLE001  (every refusal is a finding, reported)
            text = " ".join(str(exc).split()).replace(rec.kernel.entry_name, rec.py_func.__name__)
            m = re.search(r"error\s*:\s*(.*?)(?: ERROR \d+:|$)", text)
            out[f"{cc[0]}.{cc[1]}"] = {
                "error": f"{type(exc).__name__}: {(m.group(1) if m else text)[:300]}"
            }
    return out


# ---------------------------------------------------------------------------
# The pytest plugin: python -m pytest -p common.targets --targets-out DIR
# ---------------------------------------------------------------------------

_session: dict[str, Any] = {}


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--targets-out",
        default=None,
        help="(common.targets) record every kernel launch and write, per process, its "
        "launches and its usage compiled for each target architecture into this folder",
    )


def pytest_configure(config: Any) -> None:
    out = config.getoption("--targets-out", default=None)
    if not out or runtime.is_simulator():
        return
    stack = contextlib.ExitStack()
    _session.update(out=Path(out), stack=stack, launched=stack.enter_context(recording_launches()))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if "stack" not in _session:
        return
    _session["stack"].close()  # stop recording
    out: Path = _session["out"]
    out.mkdir(parents=True, exist_ok=True)
    ccs = [
        tuple(int(v) for v in s.split("."))
        for s in os.environ.get("COURSE_TARGETS", "").split(",")
        if s
    ] or list(TARGETS)
    records = []
    for rec in _session["launched"].values():
        if _relative(rec.py_func.__code__.co_filename) is None:
            continue  # a kernel of a library (numba's own), not the course's
        try:
            records.append((rec, launch_record(rec)))
        except Exception:  # noqa: BLE001  (a kernel without a library: nothing to compile)
            continue
    tag = f"{os.getpid()}"
    (out / f"launches-{tag}.json").write_text(json.dumps([r for _, r in records]))
    # Workers share the folder: the first to claim a kernel compiles it.
    for rec, summary in records:
        try:
            fd = os.open(out / f"claim-{summary['key']}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        usage = compile_record(rec, ccs)
        tmp = out / f"usage-{summary['key']}.{tag}.tmp"
        tmp.write_text(json.dumps(usage))
        tmp.replace(out / f"usage-{summary['key']}.json")


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclass
class Row:
    """One compiled kernel: where, how launched, and its usage per architecture."""

    file: str
    qualname: str
    closure: str
    args: str
    launch_bounds: Any
    max_threads: int
    max_dynamic_shared: int
    usage: dict[str, dict[str, Any]]

    @property
    def name(self) -> str:
        short = self.qualname.replace(".<locals>.", ".")
        return f"{self.file}:{short}" + (f" [{self.closure}]" if self.closure else "")


def load_rows(folder: Path) -> list[Row]:
    """Merge the plugin's per-process files: launches joined on the kernel's key."""
    merged: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("launches-*.json")):
        for r in json.loads(path.read_text()):
            m = merged.setdefault(r["key"], {**r, "blocks": []})
            m["blocks"] = sorted({tuple(b) for b in m["blocks"]} | {tuple(b) for b in r["blocks"]})
            m["max_dynamic_shared"] = max(m["max_dynamic_shared"], r["max_dynamic_shared"])
    rows = []
    for key, m in merged.items():
        usage_path = folder / f"usage-{key}.json"
        usage = json.loads(usage_path.read_text()) if usage_path.exists() else {}
        rows.append(
            Row(
                m["file"],
                m["qualname"],
                m["closure"],
                m["args"],
                m["launch_bounds"],
                max((x * y * z for x, y, z in m["blocks"]), default=0),
                m["max_dynamic_shared"],
                usage,
            )
        )
    return sorted(rows, key=lambda r: (r.file, r.qualname, r.closure, r.args))


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_rows(
    rows: Sequence[Row], ccs: Sequence[tuple[int, int]]
) -> tuple[list[list[str]], Findings]:
    """Table cells (one list per row) and every problem and note, each naming its
    kernel and architecture."""
    found = Findings()
    cells = []
    for row in rows:
        regs, static, spills = [], set(), []
        for cc in ccs:
            arch = ARCHS[cc]
            u = row.usage.get(arch.name)
            where = f"{row.name} ({row.args}) on {arch.name}"
            if u is None:
                regs.append("?")
                found.problems.append(f"{where}: not compiled (its process died?)")
                continue
            if "error" in u:
                regs.append("FAIL")
                found.problems.append(f"{where}: does not compile: {u['error']}")
                continue
            usage = Usage(**u)
            static.add(usage.static_shared)
            problems, notes = check_kernel(
                usage, row.max_threads, row.max_dynamic_shared, arch, row.launch_bounds
            )
            if usage.spill_stores or usage.spill_loads:
                spills.append(f"{arch.name} {usage.spill_stores}/{usage.spill_loads}")
            mark = "!" if problems else ("s" if usage.spill_stores or usage.spill_loads else "")
            regs.append(f"{usage.registers}{mark}")
            found.problems += [f"{where}: {p}" for p in problems]
            found.notes += [f"{row.name} on {arch.name}: {n}" for n in notes]
        if spills:
            found.notes.append(
                f"{row.name}: spills (bytes stored/loaded a thread) on " + ", ".join(spills)
            )
        smem = "/".join(f"{s:,}" for s in sorted(static)) or "?"
        bound = row.launch_bounds
        bound = "x".join(map(str, bound)) if isinstance(bound, list) else str(bound or "-")
        cells.append(
            [row.name, str(row.max_threads), bound, f"{row.max_dynamic_shared:,}", smem, *regs]
            + [row.args]
        )
    return cells, found


def coverage(rows: Sequence[Row], defined: Sequence[KernelDef]) -> list[str]:
    """One line per course file: how many of its kernels were compiled, and the others."""
    seen = {(r.file, r.qualname) for r in rows}
    by_file: dict[str, list[KernelDef]] = {}
    for k in defined:
        by_file.setdefault(k.file, []).append(k)
    lines = []
    for file, kernels in sorted(by_file.items()):
        missing = [k for k in kernels if (k.file, k.qualname) not in seen]
        done = len(kernels) - len(missing)
        text = f"  {file}: {done} of {len(kernels)}"
        if missing:
            text += "; never launched: " + ", ".join(
                k.qualname.replace(".<locals>.", ".") for k in missing
            )
        lines.append(text)
    return lines


def limits_table(ccs: Sequence[tuple[int, int]] = TARGETS) -> str:
    """The per-architecture limits the check uses, one column per compute capability."""
    archs = [ARCHS[cc] for cc in ccs]
    rows = [
        ["architecture", *(a.family for a in archs)],
        ["examples", *(a.examples for a in archs)],
        ["threads a block", *(str(a.max_threads_per_block) for a in archs)],
        ["registers a thread", *(str(a.max_registers_per_thread) for a in archs)],
        [
            "registers a block / an SM",
            *(f"{a.registers_per_block // KIB}K/{a.registers_per_sm // KIB}K" for a in archs),
        ],
        ["shared a block, static (KiB)", *(str(a.static_shared_per_block // KIB) for a in archs)],
        ["shared a block, opt-in (KiB)", *(str(a.optin_shared_per_block // KIB) for a in archs)],
        ["shared an SM (KiB)", *(str(a.shared_per_sm // KIB) for a in archs)],
        ["threads an SM", *(str(a.max_threads_per_sm) for a in archs)],
        ["blocks an SM", *(str(a.max_blocks_per_sm) for a in archs)],
    ]
    header = ["compute capability", *(a.name for a in archs)]
    table = format_table(rows, header=header, align="<" + ">" * len(archs))
    gpus = ", ".join(f"{g.name} {g.cc[0]}.{g.cc[1]} ({g.sms} SMs)" for g in TYPICAL_GPUS)
    return f"{table}\n  cards: {gpus}"


def report(
    rows: Sequence[Row], defined: Sequence[KernelDef], ccs: Sequence[tuple[int, int]]
) -> tuple[str, int]:
    """The printed report and the exit status (0 fits everywhere, 1 a problem)."""
    cells, found = check_rows(rows, ccs)
    header = ["kernel [factory arguments]", "block", "bound", "dyn. smem B", "static smem B"]
    header += [f"regs {ARCHS[cc].name}" for cc in ccs] + ["argument types"]
    parts = [
        f"{len(rows)} compiled kernels x {len(ccs)} architectures: registers a thread "
        "(s: spills, !: breaks a limit, FAIL: does not compile), the largest block and "
        "dynamic shared memory the tests launched it with",
        format_table(cells, header=header, align="<" + ">" * (len(header) - 2) + "<"),
        "",
    ]
    if found.problems:
        parts.append(f"PROBLEMS ({len(found.problems)}): a launch like the tests' fails there")
        parts += [f"  {p}" for p in found.problems]
    if found.notes:
        notes = list(dict.fromkeys(found.notes))
        parts.append(f"notes ({len(notes)}): runs, but not as the tuning on the H100 assumed")
        parts += [f"  {n}" for n in notes]
    cover = coverage(rows, [k for k in defined if not k.file.endswith("/exercises.py")])
    never = sum(1 for line in cover if "never launched" in line)
    parts.append(
        f"coverage: kernels defined in {', '.join(COURSE_DIRS)} and compiled here "
        "(exercises.py left out: its kernels are the learner's; solutions.py has the course's)"
    )
    parts += cover
    verdict = (
        f"verdict: every compiled kernel fits {', '.join(ARCHS[c].name for c in ccs)}"
        if not found.problems
        else f"verdict: {len(found.problems)} problem(s) above"
    )
    if never:
        verdict += f" ({never} file(s) have kernels the tests that ran never launched)"
    parts.append(verdict)
    return "\n".join(parts), (1 if found.problems else 0)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m common.targets",
        description="Compile every kernel the tests launch for compute capability 7.5, 8.0, "
        "8.6, 8.9 and 9.0 and check it against each one's limits (GPU machine).",
        epilog="Arguments after -- go to pytest (default: tests -q, with -n 8 when "
        "pytest-xdist is installed).",
    )
    parser.add_argument("--limits", action="store_true", help="print the table of limits and stop")
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the per-process records in this folder"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="report from --out's records, run no tests"
    )
    parser.add_argument(
        "--cc", default=",".join(ARCHS[c].name for c in TARGETS), help="compute capabilities"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    ccs = [tuple(int(v) for v in s.split(".")) for s in args.cc.split(",")]
    unknown = [c for c in ccs if c not in ARCHS]
    if unknown:
        parser.error(f"no limits for {unknown}; known: {', '.join(a.name for a in ARCHS.values())}")
    if args.limits:
        print(limits_table(ccs))
        return 0
    if args.report_only and args.out is None:
        parser.error("--report-only needs --out DIR")
    if runtime.is_simulator() and not args.report_only:
        print(limits_table(ccs))
        print(
            "\nthe compile check needs a GPU: it records the kernels the tests launch there "
            "(the simulator compiles nothing, and the capstone picks other tiles there); "
            "the simulator's share is tests/test_targets.py"
        )
        return 2
    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="targets-")))
        if not args.report_only:
            for stale in (*out.glob("launches-*"), *out.glob("usage-*"), *out.glob("claim-*")):
                stale.unlink()  # a folder kept from an earlier run
            if not pytest_args:
                pytest_args = ["tests", "-q"]
                with contextlib.suppress(ImportError):
                    import xdist  # noqa: F401

                    pytest_args += ["-n", str(min(8, os.cpu_count() or 1))]
            command = [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "common.targets",
                f"--targets-out={out}",
                *pytest_args,
            ]
            print("collect:", shlex.join(["python", *command[1:]]), flush=True)
            started = time.perf_counter()
            env = dict(os.environ, COURSE_TARGETS=args.cc)
            tests = subprocess.run(command, cwd=REPO_ROOT, env=env)
            print(
                f"tests and compiles took {time.perf_counter() - started:.0f} s "
                f"(pytest exit status {tests.returncode}: failing tests only mean fewer launches "
                "recorded)\n",
                flush=True,
            )
        every = load_rows(out)
        rows = [r for r in every if r.file.split("/")[0] in COURSE_DIRS]
        if len(rows) < len(every):
            print(f"({len(every) - len(rows)} kernels of the tests themselves are left out)")
        if not rows:
            print("no kernel launch was recorded: did the tests run on the GPU?")
            return 2
        text, status = report(rows, course_kernels(), ccs)
        print(text)
        return status


if __name__ == "__main__":
    sys.exit(main())
