"""The GPUs learners have (common/targets.py) and what the doctor says about them.

What needs no compiler runs here in the simulator: the limits as data (against
NVIDIA's figures, the runtime's launch checks and chapter 09's occupancy table),
each check against the wrong launch it exists to catch, the reading of ptxas's
report, the kernel finder, the launch recorder, the capstone's GPU tile shapes,
and the doctor's message for a GPU of 6.1, 7.5 and 9.0. The compile check
itself (``python -m common.targets``) runs on a GPU machine; one test compiles a
small kernel for every target wherever NVVM and nvJitLink are installed.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import doctor, runtime, targets
from common.internal.exercises import REPO_ROOT, load_chapter_module
from common.runtime import is_simulator
from common.targets import ARCHS, KIB, MIN_CC, TARGETS, Usage, check_kernel

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda

sim_only = pytest.mark.skipif(not is_simulator(), reason="simulator behaviour")


# ---------------------------------------------------------------- limits as data


def test_targets_are_the_gpus_learners_have():
    assert TARGETS == ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
    assert MIN_CC == min(TARGETS)
    assert {g.cc for g in targets.TYPICAL_GPUS} == set(TARGETS)
    t4 = next(g for g in targets.TYPICAL_GPUS if "T4" in g.name)
    assert (t4.cc, t4.sms) == ((7, 5), 40)


@pytest.mark.parametrize(
    "cc, optin_kib, per_sm_kib, threads_sm, blocks_sm",
    [
        ((7, 5), 64, 64, 1024, 16),
        ((8, 0), 163, 164, 2048, 32),
        ((8, 6), 99, 100, 1536, 16),
        ((8, 9), 99, 100, 1536, 24),
        ((9, 0), 227, 228, 2048, 32),
    ],
)
def test_limits_are_nvidias(cc, optin_kib, per_sm_kib, threads_sm, blocks_sm):
    # CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
    a = ARCHS[cc]
    assert (a.optin_shared_per_block, a.shared_per_sm) == (optin_kib * KIB, per_sm_kib * KIB)
    assert (a.max_threads_per_sm, a.max_blocks_per_sm) == (threads_sm, blocks_sm)
    assert a.optin_shared_per_block == a.shared_per_sm - a.reserved_shared_per_block
    assert a.reserved_shared_per_block == (KIB if cc >= (8, 0) else 0)
    assert (a.max_threads_per_block, a.max_registers_per_thread) == (1024, 255)
    assert a.registers_per_block == a.registers_per_sm == 65536
    assert a.static_shared_per_block == 48 * KIB <= a.optin_shared_per_block
    assert a.sm == f"sm_{cc[0]}{cc[1]}"


def test_limits_agree_with_the_runtimes_launch_checks():
    # The simulator refuses what a GPU refuses: the same figures on every target.
    for a in ARCHS.values():
        assert a.max_threads_per_block == runtime.MAX_THREADS_PER_BLOCK
        assert a.static_shared_per_block == runtime.MAX_STATIC_SHARED_BYTES


def test_limits_agree_with_chapter_09_occupancy():
    # Two tables of the same figures must not drift apart.
    occupancy = load_chapter_module("09_profiling", "occupancy")
    for cc, known in occupancy.KNOWN_LIMITS.items():
        if cc not in ARCHS:
            continue
        a = ARCHS[cc]
        assert (known.max_threads_per_sm, known.max_blocks_per_sm) == (
            a.max_threads_per_sm,
            a.max_blocks_per_sm,
        ), cc
        assert known.shared_per_sm == a.shared_per_sm, cc
        assert known.reserved_shared_per_block == a.reserved_shared_per_block, cc
        assert known.registers_per_sm == a.registers_per_sm, cc
        assert known.register_allocation_unit == a.register_allocation_unit, cc


def test_limits_table_prints_every_target():
    text = targets.limits_table()
    for a in ARCHS.values():
        assert a.name in text and a.family in text
    assert "Tesla T4" in text and "(40 SMs)" in text


# ---------------------------------------------------------------- the checks


def test_registers_are_allocated_per_warp_in_units_of_256():
    a = ARCHS[(7, 5)]
    assert targets.registers_per_block(1024, 64, a) == 65536  # exactly the file
    assert targets.registers_per_block(1024, 65, a) == 32 * 2304  # 65 x 32 -> 2304
    assert targets.registers_per_block(33, 10, a) == 2 * 512  # 2 warps, 320 -> 512
    assert targets.max_threads_for(64, a) == 1024
    assert targets.max_threads_for(65, a) == 896  # 65536 // 2304 = 28 warps
    assert targets.max_threads_for(255, a) == 256


def test_a_kernel_within_every_limit_has_no_problem():
    for a in ARCHS.values():
        problems, notes = check_kernel(Usage(64, 16 * KIB), 256, 8 * KIB, a)
        assert (problems, notes) == ([], [])


@pytest.mark.parametrize(
    "usage, threads, dynamic, bounds, match",
    [
        # 1024 threads of a 65-register kernel: fits none of them (launch fails)
        (Usage(65), 1024, 0, None, r"1024 threads x 65 registers = 73,728 .* at most 896 threads"),
        (Usage(16), 2048, 0, None, r"2048 threads per block > 1024"),
        # static + dynamic over 48 KiB: numba-cuda never opts in to more
        (Usage(32, 40 * KIB), 128, 16 * KIB, None, r"57,344 B of shared memory .* opt-in"),
        (Usage(32), 512, 0, (256, 2), r"launched with 512 threads, its launch bound allows 256"),
    ],
)
def test_each_check_catches_the_launch_that_fails(usage, threads, dynamic, bounds, match):
    for a in ARCHS.values():
        problems, _ = check_kernel(usage, threads, dynamic, a, bounds)
        assert len(problems) == 1 and pytest.importorskip("re").search(match, problems[0]), (
            a.name,
            problems,
        )


def test_launch_bound_beyond_an_smaller_sm_is_a_note_naming_the_budget():
    # Tuned on an H100 for 5 blocks of 256 threads an SM: a T4 holds 1024 threads.
    usage = Usage(48)
    _, notes = check_kernel(usage, 256, 0, ARCHS[(7, 5)], (256, 5))
    assert notes == ["its launch bound asks for 5 blocks an SM; 4 fit there (threads: 1024 an SM)"]
    assert check_kernel(usage, 256, 0, ARCHS[(9, 0)], (256, 5)) == ([], [])
    # 45 KiB of shared memory a block, 3 blocks asked: 1 on a T4, 2 on an RTX 30/40.
    big = Usage(168, 45 * KIB)
    fits = {}
    for cc, a in ARCHS.items():
        problems, notes = check_kernel(big, 128, 0, a, (128, 3))
        assert not problems
        fits[cc] = notes
    assert "1 fit there (shared memory: 65,536 B an SM)" in fits[(7, 5)][0]
    assert "2 fit there (shared memory" in fits[(8, 6)][0] and fits[(8, 9)] == fits[(8, 6)]
    assert fits[(8, 0)] == fits[(9, 0)] == []


def test_resident_blocks_per_budget():
    a = ARCHS[(7, 5)]
    budgets = targets.resident_blocks(Usage(168, 45 * KIB), 128, 0, a)
    assert budgets == {"threads": 8, "blocks": 16, "registers": 3, "shared memory": 1}


# ---------------------------------------------------------------- ptxas's report

PTXAS_ONLY = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN4demo6kernelE' for 'sm_75'
ptxas info    : Function properties for _ZN4demo6kernelE
ptxas         .     608 bytes stack frame, 528 bytes spill stores, 532 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 608 bytes cumulative stack size, 1024 bytes smem, 464 bytes cmem[0]
ptxas info    : Compile time = 436.126 ms
"""

LINKER_PLACES_SHARED = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN4demo5otherE' for 'sm_89'
ptxas info    : Function properties for _ZN4demo5otherE
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN4demo6kernelE' for 'sm_89'
ptxas info    : Function properties for _ZN4demo6kernelE
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 14 registers, used 1 barriers, 464 bytes cmem[0]
ptxas info    : Compile time = 4.855 ms
info    : 8 bytes gmem
info    : Function properties for '_ZN4demo6kernelE':
info    : used 14 registers, used 1 barriers, 0 stack, 2048 bytes smem, 464 bytes cmem[0], 0 bytes lmem
info    : Function properties for '_ZN4demo5otherE':
info    : used 40 registers, used 0 barriers, 0 stack, 0 bytes smem, 380 bytes cmem[0], 0 bytes lmem
"""


def test_parse_link_log_reads_ptxas_and_the_linkers_summary():
    assert targets.parse_link_log(PTXAS_ONLY, "_ZN4demo6kernelE") == Usage(64, 0, 608, 528, 532)
    assert targets.parse_link_log(LINKER_PLACES_SHARED, "_ZN4demo6kernelE") == Usage(14)
    assert targets.parse_link_log(LINKER_PLACES_SHARED, "_ZN4demo5otherE") == Usage(40)
    with pytest.raises(targets.LogFormatError):
        targets.parse_link_log(PTXAS_ONLY, "_ZN4demo5otherE")


# nvJitLink 13.5 linking the LTO-IR of final_project/kernels.py:relu_forward_naive
# for sm_90 (numba-cuda links with LTO by default where nvJitLink is installed):
# ptxas's block only, no linker summary, and a NUL at the end.
RELU = (
    "_ZN13final_project7kernels18relu_forward_naiveB2v1B104cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W"
    "3Cw6igA9duC0hkwnNGiHEkYkrqQBFBTDEwCyQe21eqwcFW3UoDGjzpQEsgzrtUEAA_3d_3dE5ArrayIfLi1E1C7"
    "mutable7alignedE5ArrayIfLi1E1C7mutable7alignedE"
)
LTO_LINK = (
    "INFO: NVVM70 LTOIR Container created (3700 bytes)\n"
    "ptxas info    : 0 bytes gmem\n"
    f"ptxas info    : Compiling entry function '{RELU}' for 'sm_90'\n"
    f"ptxas info    : Function properties for {RELU}\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 12 registers, used 0 barriers\n"
    "ptxas info    : Compile time = 5.750 ms\n\x00"
)
# The same link served from nvJitLink's cache (the driver's JIT cache, on a GPU
# machine): ptxas does not run, so nothing names the kernel (the shape reported
# in NVIDIA/cuda-python issue 950). The H100 run of issue 22 got this for 21
# kernels linked before on that machine; common.targets now links with -no-cache.
CACHED_LINK = "INFO: NVVM70 LTOIR Container created (3700 bytes)\ninfo    : 8 bytes gmem\n\x00"


def test_parse_link_log_reads_an_lto_link_and_says_when_ptxas_did_not_run():
    assert targets.parse_link_log(LTO_LINK, RELU) == Usage(12)
    with pytest.raises(targets.LogFormatError, match=r"ptxas did not run: .*cache.*8 bytes gmem"):
        targets.parse_link_log(CACHED_LINK, RELU)
    with pytest.raises(targets.LogFormatError, match="ptxas reported other functions"):
        targets.parse_link_log(LTO_LINK, "_ZN4demo5otherE")


def test_declared_shared_counts_static_arrays_at_their_alignment():
    ptx = (
        ".visible .shared .align 4 .b8 _cudapy_smem_1[1024];\n"
        ".extern .shared .align 16 .b8 _cudapy_dynshared[];\n"
        ".visible .entry k(\n{\n"
        "\t.shared .align 16 .b8 _cudapy_smem_2[18];\n"
        "\t.shared .align 8 .f64 _cudapy_smem_3[4][2];\n"
        "\tst.shared.f32 \t[%rd19], %f1;\n"
    )
    # 1024, then 18 at 1024 (16-aligned), then 64 at 1048 (8-aligned): 1112
    assert targets.declared_shared(ptx) == 1112
    assert targets.declared_shared(".extern .shared .align 16 .b8 dyn[];") == 0


# ---------------------------------------------------------------- which kernels


def test_kernel_definitions_finds_kernels_not_device_functions(tmp_path):
    src = tmp_path / "demo.py"
    src.write_text(
        textwrap.dedent(
            """\
            from numba import cuda
            from common.runtime import jit

            @cuda.jit
            def plain(x):
                pass

            @jit(launch_bounds=(128, 2))
            def bounded(x):
                pass

            @cuda.jit(device=True)
            def helper(x):
                return x

            @cuda.jit("void(float32[:])", device=True, inline=True)
            def typed_helper(x):
                pass

            def wrapped(x):
                pass

            wrapped_kernel = cuda.jit(wrapped)
            helper2 = cuda.jit(device=True)(plain)

            def make(TILE):
                @cuda.jit
                def tiled(x):
                    pass
                return tiled

            class Holder:
                @staticmethod
                @cuda.jit
                def method(x):
                    pass
            """
        )
    )
    found = [(k.qualname, k.line) for k in targets.kernel_definitions(src, tmp_path)]
    assert found == [
        ("plain", 5),
        ("bounded", 9),
        ("wrapped", 20),
        ("make.<locals>.tiled", 28),
        ("Holder.method", 35),
    ]


def test_a_bare_jit_from_numba_is_not_a_kernel(tmp_path):
    src = tmp_path / "cpu.py"
    src.write_text("from numba import jit\n\n@jit\ndef on_cpu(x):\n    return x\n")
    assert targets.kernel_definitions(src, tmp_path) == []


def test_course_kernels_include_chapter_and_capstone_kernels():
    found = {(k.file, k.qualname) for k in targets.course_kernels()}
    assert ("chapters/06_memory/reduction.py", "reduce_sum_atomic") in found
    assert ("chapters/06_memory/reduction.py", "block_reduce_sum") not in found  # device
    assert ("final_project/fast_conv.py", "make_conv2d_igemm.<locals>.conv2d_igemm") in found
    assert ("chapters/08_faster_matmul/matmul.py", "matmul_naive") in found
    assert not any(f.startswith("tests/") for f, _ in found)


# ---------------------------------------------------------------- recording launches


@cuda.jit
def _fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


@sim_only
def test_recording_keeps_every_block_shape_and_the_largest_dynamic_shared():
    out = cuda.to_device(np.zeros(64, np.float32))
    with targets.recording_launches() as launched:
        _fill[1, 64](out, np.float32(1))
        _fill[4, (8, 2), 0, 256](out, np.float32(2))
        _fill[1, 64](out, np.float32(3))
    (rec,) = launched.values()
    assert rec.py_func is _fill.py_func
    assert rec.blocks == {(64, 1, 1), (8, 2, 1)} and rec.max_threads == 64
    assert (rec.max_dynamic_shared, rec.count) == (256, 3)
    _fill[1, 64](out, np.float32(4))  # recording stopped
    assert rec.count == 3


@pytest.mark.gpu
def test_recorded_gpu_launch_compiles_for_every_target():
    # What the plugin does at the end of a GPU test session, on one kernel.
    out = cuda.to_device(np.zeros(300, np.float32))
    with targets.recording_launches() as launched:
        _fill[3, 128](out, np.float32(1))
    (rec,) = launched.values()
    summary = targets.launch_record(rec)
    assert summary["qualname"] == "_fill" and summary["blocks"] == [(128, 1, 1)]
    usage = targets.compile_record(rec, TARGETS)
    for a in ARCHS.values():
        u = Usage(**usage[a.name])
        assert 1 <= u.registers <= 64 and u.static_shared == 0, (a.name, usage)
        assert check_kernel(u, 128, 0, a) == ([], [])


@sim_only
def test_launched_chapter_kernels_are_found_by_the_finder_and_fit_every_target():
    # The finder and the recorder must name a kernel the same way, or the
    # coverage report calls a checked kernel unchecked.
    reduction = load_chapter_module("06_memory", "reduction")
    x = cuda.to_device(np.arange(1, 301, dtype=np.float32))
    out = cuda.to_device(np.zeros(1, np.float32))
    with targets.recording_launches() as launched:
        reduction.reduce_atomic(x, out)
        reduction.reduce_two_pass(x, out)
    defined = {(k.file, k.qualname) for k in targets.course_kernels()}
    names = set()
    for rec in launched.values():
        code = rec.py_func.__code__
        names.add((targets._relative(code.co_filename), rec.py_func.__qualname__))
        for a in ARCHS.values():
            problems, _ = check_kernel(Usage(1), rec.max_threads, rec.max_dynamic_shared, a)
            assert problems == []
    assert names <= defined and len(names) >= 3


def _gpu_tile_configs():
    fast_conv = pytest.importorskip("final_project.fast_conv")
    configs = {
        name: value
        for name, value in vars(fast_conv).items()
        if name.startswith("GPU_") and isinstance(getattr(value, "threads", None), int)
    }
    assert configs, "no GPU_* tile shape in final_project/fast_conv.py"
    return configs


def test_capstone_gpu_tiles_launch_on_every_target():
    # The launch-shape choices made for the H100 (GPU_*_TILES, picked on a GPU):
    # whole warps, at most 1024 threads, a launch bound every SM can honour in
    # blocks; the blocks a smaller SM holds at once are notes, not failures.
    for name, tiles in _gpu_tile_configs().items():
        assert tiles.threads % 32 == 0, f"{name}: {tiles.threads} threads is not whole warps"
        for a in ARCHS.values():
            problems, notes = check_kernel(
                Usage(32), tiles.threads, 0, a, (tiles.threads, tiles.min_blocks)
            )
            assert problems == [], (name, a.name, problems)
            assert tiles.min_blocks <= a.max_blocks_per_sm, (name, a.name)
            assert tiles.threads * tiles.min_blocks <= a.max_threads_per_sm or notes, name


# ---------------------------------------------------------------- the report


def _write_records(folder, key, blocks, usage, dynamic=0, bounds=None):
    record = {
        "key": key,
        "file": "chapters/99_demo/demo.py",
        "qualname": f"kernel_{key}",
        "closure": "",
        "args": "f32[1d,C]",
        "launch_bounds": bounds,
        "blocks": blocks,
        "max_dynamic_shared": dynamic,
        "launches": 1,
    }
    with open(folder / f"launches-{key}-{len(blocks)}.json", "w") as f:
        json.dump([record], f)
    if usage is not None:
        (folder / f"usage-{key}.json").write_text(json.dumps(usage))


def test_report_merges_processes_and_names_each_problem(tmp_path):
    fits = {a.name: dataclasses.asdict(Usage(32, 4096)) for a in ARCHS.values()}
    _write_records(tmp_path, "ok", [[256, 1, 1]], fits)
    # the same kernel seen by another process with a larger block
    _write_records(tmp_path, "ok", [[128, 1, 1], [512, 1, 1]], None)
    heavy = dict(fits, **{"7.5": dataclasses.asdict(Usage(72, 4096, 16, 8, 8))})
    _write_records(tmp_path, "heavy", [[1024, 1, 1]], heavy)
    broken = dict(fits, **{"8.6": {"error": "nvJitLinkError: uses too much shared data"}})
    _write_records(tmp_path, "broken", [[64, 1, 1]], broken)
    _write_records(tmp_path, "lost", [[64, 1, 1]], None)
    rows = {r.qualname: r for r in targets.load_rows(tmp_path)}
    assert rows["kernel_ok"].max_threads == 512
    text, status = targets.report(list(rows.values()), [], TARGETS)
    assert status == 1
    assert "kernel_heavy (f32[1d,C]) on 7.5: 1024 threads x 72 registers" in text
    assert "kernel_heavy: spills (bytes stored/loaded a thread) on 7.5 8/8" in text
    assert "kernel_broken (f32[1d,C]) on 8.6: does not compile: nvJitLinkError" in text
    assert "kernel_lost (f32[1d,C]) on 7.5: not compiled" in text
    assert "kernel_ok" not in text.split("PROBLEMS")[1].split("notes")[0]
    clean = [rows["kernel_ok"]]
    text, status = targets.report(clean, [], TARGETS)
    assert status == 0 and "verdict: every compiled kernel fits 7.5, 8.0, 8.6, 8.9, 9.0" in text


def test_coverage_lists_kernels_never_launched():
    rows = targets.load_rows  # (only the names matter below)
    del rows
    defined = [
        targets.KernelDef("chapters/99_demo/demo.py", "a", 1),
        targets.KernelDef("chapters/99_demo/demo.py", "make.<locals>.b", 5),
    ]
    row = targets.Row("chapters/99_demo/demo.py", "a", "", "", None, 32, 0, {})
    assert targets.coverage([row], defined) == [
        "  chapters/99_demo/demo.py: 1 of 2; never launched: make.b"
    ]


@sim_only
def test_command_in_the_simulator_prints_the_limits_and_says_it_needs_a_gpu(capsys):
    assert targets.main([]) == 2
    out = capsys.readouterr().out
    assert "shared an SM (KiB)" in out and "needs a GPU" in out
    assert targets.main(["--limits", "--cc", "7.5,9.0"]) == 0
    assert "8.6" not in capsys.readouterr().out.splitlines()[0]


# ---------------------------------------------------------------- compiling (toolkit needed)

COMPILE_EVERY_TARGET = """
import os, sys, json
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
try:
    from cuda import pathfinder
    for lib in ("nvvm", "nvrtc", "nvJitLink"):
        pathfinder.load_nvidia_dynamic_lib(lib)
except Exception as exc:
    print("SKIP", type(exc).__name__, str(exc).splitlines()[0][:200])
    sys.exit(0)
import common
from common import targets
import numba
from numba import cuda, float32
from numba.cuda import compiler

def tile_copy(a, out):
    s = cuda.shared.array(256, float32)
    i = cuda.grid(1)
    s[cuda.threadIdx.x] = a[i]
    cuda.syncthreads()
    out[i] = s[255 - cuda.threadIdx.x]

def too_much_shared(a):
    s = cuda.shared.array(13000, float32)
    s[cuda.threadIdx.x] = a[0]
    cuda.syncthreads()
    a[cuda.threadIdx.x] = s[12999 - cuda.threadIdx.x]

def usage(lib, cc):
    try:
        return list(targets.compile_usage(lib, lib._entry_name, cc).__dict__.values())
    except Exception as exc:
        return type(exc).__name__ + ": " + " ".join(str(exc).split())[-300:]

out = {}
for fn, sig in ((tile_copy, (float32[::1], float32[::1])), (too_much_shared, (float32[::1],))):
    lib, _ = compiler._compile_pyfunc_with_fixup(fn, sig, device=False, abi="numba", cc=(7, 5))
    for cc in targets.TARGETS:
        out[f"{fn.__name__} {cc[0]}.{cc[1]}"] = usage(lib, cc)

# Two capstone kernels that failed on the H100, compiled as a launch compiles them
# (numba-cuda's _Kernel: LTO, numba-cuda's default where nvJitLink is installed),
# each linked twice: on a machine with a driver, nvJitLink serves the second link
# of the same code from its cache unless told -no-cache, and ptxas reports nothing.
from numba.core import types
from numba.cuda.compiler import compile_cuda, kernel_fixup
from final_project import kernels
for name, sig in (
    ("relu_forward_naive", (float32[::1], float32[::1])),
    ("sgd_update_naive", (float32[::1], float32[::1], numba.float64)),
):
    cres = compile_cuda(getattr(kernels, name).py_func, types.void, sig, cc=(7, 5), lto=True,
                        nvvm_options={"fastmath": False, "opt": 3})
    lib = cres.library
    lib._entry_name = cres.fndesc.llvm_func_name
    kernel_fixup(lib.get_function(lib._entry_name), False)
    for cc in targets.TARGETS:
        out[f"{name} {cc[0]}.{cc[1]}"] = [lib._lto, usage(lib, cc), usage(lib, cc)]
options = targets.reporting_linker(lib, (9, 0))._get_linker_options(ptx=False)
out["options"] = [options.verbose, options.no_cache]
print(json.dumps(out))
"""


def test_compile_for_every_target_without_such_a_gpu():
    """NVVM + nvJitLink compile for 7.5 to 9.0 on any machine; ptxas's report is read,
    for a PTX link and for an LTO link (a launched kernel's, by default) done twice.
    Skipped where the CUDA toolkit wheels are absent (CI's simulator machine)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_EVERY_TARGET],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.startswith("SKIP"):
        pytest.skip(f"no CUDA toolkit libraries here: {run.stdout.strip()}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for a in ARCHS.values():
        registers, static_shared, *_ = got[f"tile_copy {a.name}"]
        assert 1 <= registers <= 255 and static_shared == 1024, (a.name, got)
        assert "too much shared data" in got[f"too_much_shared {a.name}"], got
        for name in ("relu_forward_naive", "sgd_update_naive"):
            lto, first, again = got[f"{name} {a.name}"]
            assert lto and isinstance(first, list) and first == again, (name, a.name, got)
            registers, static_shared, frame, stores, loads = first
            assert 1 <= registers <= 64 and static_shared == frame == stores == loads == 0, first
    assert got["options"] == [True, True]  # ptxas -v, nvJitLink -no-cache


# ---------------------------------------------------------------- the doctor


def test_doctor_on_a_gpu_below_the_minimum_says_what_it_lacks_and_what_to_do():
    found = doctor.capability_findings((6, 1))
    assert [f.fatal for f in found] == [False, False]
    below, tf32 = found
    assert "compute capability 6.1 is below the course's minimum, 7.5" in below.problem
    assert "CUDA 13" in below.problem and "chapter 10" in below.problem  # Triton too
    assert "Colab" in below.fix and "NUMBA_ENABLE_CUDASIM=1" in below.fix and "cu126" in below.fix
    assert "TF32" in tf32.problem and "chapter 07" in tf32.problem
    (volta_below, _) = doctor.capability_findings((7, 0))
    assert "below" in volta_below.problem and "chapter 10" not in volta_below.problem


def test_doctor_on_a_t4_names_the_tf32_chapters_and_nothing_else():
    (tf32,) = doctor.capability_findings((7, 5))
    assert not tf32.fatal
    assert "TF32 tensor cores" in tf32.problem and "cublas.py" in tf32.problem
    assert "compare.py --torch-tf32" in tf32.problem
    assert doctor.capability_findings((8, 6)) == doctor.capability_findings((9, 0)) == []


def _fake_attrs(cc):
    attrs = {key: 1 for key, _ in doctor._ATTRIBUTES}
    attrs.update(
        name=f"Fake GPU {cc}", compute_capability=cc, uuid="GPU-0", total_memory_bytes=2**34
    )
    return attrs


@pytest.mark.parametrize(
    "cc, says, verdict",
    [
        ((6, 1), "this GPU: 6.1, below it", "kernels run, but this GPU is below the course's"),
        ((7, 5), "this GPU: 7.5, meets it, lacks 1 feature(s)", "ready"),
        ((9, 0), "this GPU: 9.0, meets it, has all it uses", "ready"),
    ],
)
def test_doctor_report_for_a_fake_device(monkeypatch, capsys, cc, says, verdict):
    monkeypatch.setattr(doctor.runtime, "is_simulator", lambda: False)
    monkeypatch.setattr(doctor, "device_attributes", lambda: _fake_attrs(cc))
    monkeypatch.setattr(doctor, "_driver_and_toolkit", lambda: ((13, 0), (13, 0)))
    monkeypatch.setattr(doctor, "toolkit_findings", lambda: [])
    monkeypatch.setattr(doctor, "smoke_test", lambda: None)
    assert doctor.report() == 0
    out = capsys.readouterr().out
    assert f"(compute capability {cc[0]}.{cc[1]}, GPU-0)" in out
    assert "course minimum: compute capability 7.5 (Turing" in out and says in out
    assert out.splitlines()[-1].startswith("verdict: " + verdict)
    assert ("TF32" in out) == (cc < (8, 0))
