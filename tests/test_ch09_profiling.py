"""Chapter 09: the exercises, the occupancy calculator against Nsight Compute's
figures, the ncu report parser on reports saved from a GPU run, the roofline
arithmetic, the case study's kernels and the chapter scripts in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import check, poisoned, random_array, rounding_tolerance
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import (
    float32_pure_launches,
    float64_uses,
    recording_launches,
)

import functools
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, float32

CHAPTER = "09_profiling"
occupancy = load_chapter_module(CHAPTER, "occupancy")
nsight = load_chapter_module(CHAPTER, "nsight_compute")
roofline = load_chapter_module(CHAPTER, "roofline")
names = load_chapter_module(CHAPTER, "kernel_names")
tools = load_chapter_module(CHAPTER, "tools")
H100 = occupancy.KNOWN_LIMITS[(9, 0)]
SAVED = tools.SAVED_DIR


def saved_kernels():
    """(report name, NcuKernel) for every launch in every saved ncu report."""
    out = []
    for path in sorted(SAVED.glob("ncu_*.csv")):
        out += [(path.name, k) for k in nsight.parse_ncu_csv(path.read_text())]
    assert len(out) >= 30, "the saved ncu reports are missing: rerun the chapter on a GPU"
    return out


def saved_report(pair):
    return {
        k.name: nsight.summary(k)
        for k in nsight.parse_ncu_csv((SAVED / f"ncu_{pair}.csv").read_text())
    }


# ------------------------------------------------------------------ kernel names

NAME_FORMS = {
    # compute-sanitizer
    "__main__::divergent_barrier[abi:v1,cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3Cw6igA9duC0hkwnNGiHEkYkrqQBFBTDEwCyQe21eqwcFW3UoDGjzpQEsgzrtUEAA_3d_3d](Array<float, (int)1, C, mutable, aligned>)+0x1b0": (
        "divergent_barrier",
        "__main__.divergent_barrier",
    ),
    # torch.profiler, a kernel made in a factory
    "final_project::fast_conv::make_conv2d_igemm::_3clocals_3e::conv2d_igemm[abi:v22][abi:cw51c](Array<float": (
        "conv2d_igemm",
        "final_project.fast_conv.conv2d_igemm",
    ),
    # ncu --print-kernel-base function
    "transpose_naive[abi:v1,cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3Cw6igA9duC0hkwnNGiHEkYkrqQBFBTDEwCyQe21eqwcFW3UoDGjzpQEsgzrtUEAA_3d_3d]": (
        "transpose_naive",
        "transpose_naive",
    ),
    # mangled (PTX, cuobjdump); the module "06_memory" starts with a digit
    "_ZN8chapters10_06_memory9transpose21transpose_smem_paddedB2v3B104cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3Cw6igA9duC0hkwnNGiHEkYkrqQBFBTDEwCyQe21eqwcFW3UoDGjzpQEsgzrtUEAA_3d_3dE5ArrayIfLi2E1C7mutable7alignedE": (
        "transpose_smem_padded",
        "chapters.06_memory.transpose.transpose_smem_padded",
    ),
    "Memcpy DtoD (Device -> Device)": ("Memcpy DtoD", "Memcpy DtoD"),
}


@pytest.mark.parametrize("printed", list(NAME_FORMS))
def test_short_kernel_name(printed):
    short, qualified = NAME_FORMS[printed]
    assert names.short_kernel_name(printed) == short
    assert names.short_kernel_name(printed, qualified=True) == qualified


def test_short_kernel_name_refuses_garbage():
    with pytest.raises(ValueError):
        names.short_kernel_name("  ")
    with pytest.raises(ValueError):
        names.short_kernel_name("_ZN3foo")  # no end of the nested name


# --------------------------------------------------------- occupancy calculator


def test_occupancy_matches_ncu_on_every_saved_kernel():
    # registers, shared memory and block size as ncu reported them, and ncu's own
    # "Theoretical Occupancy" for the same launch: over 30 launches, 4 limiters
    seen = set()
    for report, k in saved_kernels():
        shared = k.value("Static Shared Memory Per Block") + k.value(
            "Dynamic Shared Memory Per Block"
        )
        occ = occupancy.theoretical_occupancy(
            k.block_threads, int(k.value("Registers Per Thread")), int(shared), H100
        )
        assert 100 * occ.occupancy == pytest.approx(k.value("Theoretical Occupancy"), abs=0.01), (
            report,
            k.name,
        )
        seen.add(occ.limiter)
    assert {"warps", "registers", "shared"} <= seen


# Launches worked by hand from occupancy.py's four budgets. H100: 64 warp slots, 32
# blocks, 16,384 registers a quarter SM in units of 256 a warp, 233,472 B of shared
# memory in units of 128 B, 1 KiB of it reserved a block. The blocks that are not whole
# warps and those whose shared memory decides appear in no saved ncu report; an H100's
# driver gives the same blocks for those block sizes and bytes
# (test_occupancy_matches_the_driver_on_compiled_kernels).
OCCUPANCY_BY_HAND = [
    # (threads, registers, shared bytes, limits, blocks per SM, limiter)
    (256, 48, 4096, H100, 5, "registers"),  # 1536 regs a warp: 10 warps a quarter
    (32, 143, 7360, H100, 12, "registers"),  # 4608 a warp: 3 warps a quarter, not 14
    (256, 32, 34848, H100, 6, "shared"),  # 34848 + 1024 reserved: 6 x 35872 fit
    (1, 16, 0, H100, 32, "blocks"),  # one warp a block: the 32-block cap
    (1024, 32, 0, H100, 2, "warps"),
    (1024, 64, 0, H100, 1, "registers"),
    (128, 32, 48 * 1024, occupancy.KNOWN_LIMITS[(7, 5)], 1, "shared"),  # T4: no reserve
    (64, 40, 0, occupancy.KNOWN_LIMITS[(8, 6)], 16, "blocks"),  # 2 warps: 16 blocks, 32 of 48
    (96, 40, 0, occupancy.KNOWN_LIMITS[(8, 6)], 16, "warps"),  # a tie: the first budget named
    # blocks that are not whole warps: the SM allocates whole warps
    (33, 64, 0, H100, 16, "registers"),  # 2 warps of 2048 regs: 8 a quarter, 32 // 2 = 16
    (100, 32, 0, H100, 16, "warps"),  # 4 warps, not 3: 64 // 4 = 16 (registers: 64 // 4 too)
    (1000, 32, 0, H100, 2, "warps"),  # 32 warps, not 31: 2 blocks fill all 64 slots
    # shared memory decides, the 1 KiB a block reserves and the 128 B unit included
    (256, 32, 57 * 1024, H100, 3, "shared"),  # 58368 + 1024 = 59392: 3; without the 1 KiB, 4
    (128, 32, 114 * 1024, H100, 1, "shared"),  # 116736 + 1024: 1; without, 2 x 116736 = 233472
    (256, 32, 45600, H100, 4, "shared"),  # 46624 -> 46720 (128 B units): 4.997; unrounded 5.007
]


def check_occupancy_by_hand(theoretical_occupancy):
    """occupancy.py's calculator (or a copy of it) against every OCCUPANCY_BY_HAND row."""
    for threads, regs, smem, limits, blocks, limiter in OCCUPANCY_BY_HAND:
        occ = theoretical_occupancy(threads, regs, smem, limits)
        launch = f"{threads} threads, {regs} registers, {smem} B shared on {limits.name}"
        assert (occ.blocks_per_sm, occ.limiter) == (blocks, limiter), launch
        assert occ.occupancy == blocks * ceil_div(threads, 32) / limits.max_warps_per_sm, launch


def test_occupancy_by_hand():
    check_occupancy_by_hand(occupancy.theoretical_occupancy)


# What a calculator gets wrong when it is fed only whole warps and shared memory that
# never decides (each passes the saved ncu reports alone):
WRONG_OCCUPANCY = {
    # warps rounded down: 33 threads counted as 1 warp, 1000 as 31
    "warps rounded down": (
        "ceil_div(threads_per_block, WARP)",
        "max(threads_per_block // WARP, 1)",
    ),
    # 57 KiB blocks: 4 fit without the reservation, 3 with it
    "no per-block reservation": (
        "shared_bytes_per_block + limits.reserved_shared_per_block",
        "shared_bytes_per_block",
    ),
    # 45600 B blocks: 5 fit unrounded, 4 in 128 B units
    "no 128 B shared unit": (
        "round_up(\n        shared_bytes_per_block + limits.reserved_shared_per_block, "
        "limits.shared_allocation_unit\n    )",
        "shared_bytes_per_block + limits.reserved_shared_per_block",
    ),
}


@pytest.mark.parametrize("wrong", list(WRONG_OCCUPANCY))
def test_occupancy_check_fails_wrong_calculators(wrong):
    from tests.mutants import mutant

    with pytest.raises(AssertionError):
        check_occupancy_by_hand(mutant(occupancy.theoretical_occupancy, WRONG_OCCUPANCY[wrong]))


@pytest.mark.skipif(is_simulator(), reason="the driver and compiled kernels exist only on a GPU")
def test_occupancy_matches_the_driver_on_compiled_kernels():
    # also a check of the numba-cuda internal driver_blocks_per_sm reads (_codelibrary)
    limits = occupancy.device_limits()
    for run in load_chapter_module(CHAPTER, "workloads").kernel_runs(("transpose", "matmul")):
        run.run()
        res = occupancy.compiled_resources(run.kernel)
        want = occupancy.theoretical_occupancy(run.threads, res["registers"], res["shared"], limits)
        assert occupancy.driver_blocks_per_sm(run.kernel, run.threads) == want.blocks_per_sm, (
            run.label
        )
    # The block sizes and shared bytes of OCCUPANCY_BY_HAND that no saved report has
    # (part warps; dynamic shared memory that decides), on a kernel of few registers
    kernel = cuda.jit("void(float32[::1])")(reverse_in_dynamic_shared)
    res = occupancy.compiled_resources(kernel)
    launches = [
        (threads, smem)
        for threads, _, smem, *_ in OCCUPANCY_BY_HAND
        if smem + limits.reserved_shared_per_block <= limits.shared_per_sm
    ]
    allow_dynamic_shared(kernel, max(smem for _, smem in launches))
    for threads, smem in launches:
        want = occupancy.theoretical_occupancy(threads, res["registers"], smem, limits)
        got = occupancy.driver_blocks_per_sm(kernel, threads, smem)
        assert got == want.blocks_per_sm, f"{threads} threads, {smem} B dynamic shared"


def reverse_in_dynamic_shared(out):
    s = cuda.shared.array(0, float32)  # size 0: the launch's dynamic shared memory
    t = cuda.threadIdx.x
    s[t] = out[cuda.grid(1)]
    cuda.syncthreads()
    out[cuda.grid(1)] = s[cuda.blockDim.x - 1 - t]


def allow_dynamic_shared(kernel, nbytes):
    """Opt the kernel's one compiled signature in to ``nbytes`` of dynamic shared
    memory a block (above 48 KiB a kernel must; see driver_blocks_per_sm)."""
    from numba.cuda.cudadrv.driver import binding, driver

    (compiled,) = kernel.overloads.values()
    handle = compiled._codelibrary.get_cufunc().handle  # numba-cuda 0.30: a CUkernel
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, handle, cuda.get_current_device().id)


@pytest.mark.parametrize(
    "args",
    [(0, 32, 0), (1025, 32, 0), (128, 0, 0), (128, 256, 0), (128, 32, -1), (128, 32, 233472)],
)
def test_occupancy_refuses_impossible_launches(args):
    with pytest.raises(ValueError):
        occupancy.theoretical_occupancy(*args, H100)


# ------------------------------------------------------------- ncu report parser


def test_parser_skips_non_csv_lines_and_groups_by_launch():
    text = (SAVED / "ncu_transpose.csv").read_text()
    noisy = "==PROF== Connected to process 1\nprogram output\n" + text + "==PROF== Disconnected\n"
    assert [k.name for k in nsight.parse_ncu_csv(noisy)] == [
        k.name for k in nsight.parse_ncu_csv(text)
    ]
    kernels = nsight.parse_ncu_csv(text)
    assert [k.name for k in kernels] == [
        "transpose_naive",
        "transpose_smem",
        "transpose_smem_padded",
    ]
    assert all(k.block == (32, 8, 1) for k in kernels)
    with pytest.raises(KeyError, match="not in ncu's report"):
        kernels[0].value("No Such Metric")
    with pytest.raises(ValueError, match="no ncu CSV header"):
        nsight.parse_ncu_csv("==PROF== nothing profiled\n")


def test_saved_reports_tell_the_chapter_06_and_08_stories():
    t = saved_report("transpose")
    # v1: a warp's store to a column touches 32 sectors, one per thread
    assert t["transpose_naive"]["sectors_per_st"] == pytest.approx(32, rel=0.01)
    assert t["transpose_smem"]["sectors_per_st"] == pytest.approx(4, rel=0.01)
    # v2: the tile column read hits one bank 32 times; the padded tile does not
    assert (
        t["transpose_smem"]["bank_conflicts"] > 100 * t["transpose_smem_padded"]["bank_conflicts"]
    )
    assert t["transpose_naive"]["us"] > t["transpose_smem"]["us"] > t["transpose_smem_padded"]["us"]
    h = saved_report("histogram")
    assert h["histogram_global_atomic"]["us"] > 20 * h["histogram_smem_atomic"]["us"]
    m = saved_report("matmul")
    assert (
        m["matmul_unguarded"]["registers"] > 64
        and m["matmul_unguarded"]["us"] < m["matmul_smem_tiled"]["us"]
    )


# ------------------------------------------------------------------ roofline


def test_roofline_point_by_hand():
    peaks = {"sgemm_tflops": 50.0, "copy_gbps": 2500.0}  # ridge at 20 FLOP/byte
    p = roofline.roofline_point("m", 4e9, 1e9, 1e-3, peaks)  # I = 4: memory-bound, roof 10 TFLOP/s
    assert (p["intensity"], p["bound"]) == (4.0, "memory")
    assert p["attainable_tflops"] == pytest.approx(10.0)
    assert p["fraction_of_roof"] == pytest.approx(0.4)
    p = roofline.roofline_point("c", 1e11, 1e9, 4e-3, peaks)  # I = 100: compute-bound
    assert (p["bound"], p["attainable_tflops"], p["fraction_of_roof"]) == (
        "compute",
        50.0,
        pytest.approx(0.5),
    )
    p = roofline.roofline_point("copy", 0, 2e9, 1e-3, peaks)  # bytes only: judged by bandwidth
    assert p["fraction_of_roof"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        roofline.roofline_point("bad", 1, 0, 1e-3, peaks)


def test_saved_roofline_points_are_consistent():
    measured = json.loads(roofline.SAVED_POINTS.read_text())
    rows = roofline.points(measured)
    assert any(r["name"].startswith("capstone") for r in rows)
    for r in rows:
        assert r["tflops"] <= r["attainable_tflops"] * 1.05 or not r["flops"], r["name"]
        assert r["gbps"] <= measured["peaks"]["copy_gbps"] * 1.05, r["name"]


# ------------------------------------------------------------------ case study

case = load_chapter_module(CHAPTER, "case_study")


@pytest.mark.parametrize(
    "shape",
    [(3, 2, 10, 6), (1, 1, 2, 2), (5, 3, 4, 4), (2, 2, 12, 14), (20, 2, 10, 6), (9, 3, 14, 14)],
)
def test_case_study_versions_give_the_same_sums(shape, rng):
    # planes of 15, 1, 4, 42 and 49 pooled values against blocks of 16 (simulator)
    # or 256 threads (GPU: the last two shapes give a block more than 256 values,
    # so threads step, wrapping rows and images); threads with no element
    inputs = case.Inputs(shape, rng)
    got = case.check_versions(inputs)
    assert set(got) == set(case.VERSIONS)


def test_case_study_check_catches_a_missing_carry(rng, monkeypatch):
    from tests.mutants import mutant

    broken = mutant(case.make_bn_backward_reduce_carried, ("                ph += 1\n", ""))(
        case.BLOCK
    )
    monkeypatch.setitem(case.VERSIONS, "v2 carries", broken)
    with pytest.raises(common.CheckError):
        # 20 images of 15 pooled values a channel: more than a block of 256 (GPU)
        # or 16 (simulator) threads, so every thread steps and columns carry
        case.check_versions(case.Inputs((20, 2, 10, 6), rng))


# The partial sums are float64 on purpose: the capstone's tree (fast_layers.tree_sum_pair)
# adds a block's float32 sums in float64, deterministically. Anything else in float64 is
# a promotion the simulator cannot show.
@pytest.mark.parametrize(
    "version",
    [
        "v1 divisions",
        "v2 carries",
        "v3 two in flight",
    ],
)
def test_case_study_versions_compute_in_float32(version, rng):
    from final_project import fast_layers

    inputs = case.Inputs((3, 2, 10, 6), rng)
    with recording_launches() as launches:
        inputs.launch(case.VERSIONS[version])
    ((fn, argtypes, _),) = launches
    tree = getattr(fast_layers.tree_sum_pair, "py_func", fast_layers.tree_sum_pair)
    lines, first = inspect.getsourcelines(tree)
    tree_file = Path(inspect.getsourcefile(tree)).resolve()
    in_tree = range(first, first + len(lines))
    stray = [
        u
        for u in float64_uses(fn, argtypes)
        if not (Path(u.file).resolve() == tree_file and u.line in in_tree)
    ]
    assert not stray, "\n".join(map(str, stray))


# ------------------------------------------------------------------ exercises


def check_theoretical_occupancy(fn):
    for _, k in saved_kernels():
        shared = int(
            k.value("Static Shared Memory Per Block") + k.value("Dynamic Shared Memory Per Block")
        )
        blocks, occ, limiter = fn(
            k.block_threads, int(k.value("Registers Per Thread")), shared, H100
        )
        want = occupancy.theoretical_occupancy(
            k.block_threads, int(k.value("Registers Per Thread")), shared, H100
        )
        assert (blocks, limiter) == (want.blocks_per_sm, want.limiter), k.name
        assert 100 * occ == pytest.approx(k.value("Theoretical Occupancy"), abs=0.01), k.name
    # part warps, and shared memory that decides (the reservation and the unit count)
    for threads, regs, smem, limits, blocks, limiter in OCCUPANCY_BY_HAND:
        occ = blocks * ceil_div(threads, 32) / limits.max_warps_per_sm
        assert fn(threads, regs, smem, limits) == (blocks, pytest.approx(occ), limiter), (
            f"{threads} threads, {regs} registers, {smem} B shared on {limits.name}"
        )
    for bad in [(0, 32, 0), (1025, 32, 0), (128, 0, 0), (128, 256, 0), (128, 32, -1)]:
        with pytest.raises(ValueError):
            fn(*bad, H100)


def check_bottleneck_kernel(fn):
    # In the fast and graph profiles the top kernel, conv2d_igemm, runs under two
    # printed names (the factory's kernel compiled for two layers), neither of them
    # the largest alone
    for path in sorted(SAVED.glob("torch_profile_kernels_*.json")):
        records = json.loads(path.read_text())["kernels"]
        table = tools.kernel_table(
            tools.KernelRecord(r["name"], r["start_us"], r["end_us"]) for r in records
        )
        name, share = fn(records)
        assert (name, share) == (table[0].name, pytest.approx(table[0].percent / 100)), path.name
    # one kernel compiled for float32 and for float64 arrays: two printed names, one kernel
    f32 = "m::scale[abi:v1,cw51c](Array<float, 1, C, mutable, aligned>, float)"
    f64 = "m::scale[abi:v2,cw51c](Array<double, 1, C, mutable, aligned>, double)"
    other = "m::copy[abi:v3,cw51c](Array<float, 1, C, mutable, aligned>)"
    rec = [
        {"name": f32, "start_us": 0.0, "end_us": 4.0},
        {"name": other, "start_us": 5.0, "end_us": 11.0},
        {"name": f64, "start_us": 12.0, "end_us": 16.0},
    ]
    assert fn(rec) == ("scale", pytest.approx(8 / 14))
    # many short launches of one kernel outweigh one long launch of another
    rec = [{"name": "a[abi:v1](x)", "start_us": 0.0, "end_us": 5.0}] + [
        {"name": "m::b[abi:v2](y)", "start_us": 10.0 + 2 * i, "end_us": 11.0 + 2 * i}
        for i in range(6)
    ]
    assert fn(rec) == ("b", pytest.approx(6 / 11))
    with pytest.raises(ValueError):
        fn([])
    with pytest.raises(ValueError):
        fn([{"name": "a", "start_us": 2.0, "end_us": 1.0}])


def check_roofline_bound(fn):
    i, bound, frac = fn(4e9, 1e9, 1e-3, 50.0, 2500.0)
    assert (i, bound) == (4.0, "memory") and frac == pytest.approx(0.4)
    i, bound, frac = fn(1e11, 1e9, 4e-3, 50.0, 2500.0)
    assert (i, bound) == (100.0, "compute") and frac == pytest.approx(0.5)
    assert fn(2e10, 1e9, 1e-3, 50.0, 2500.0)[1] == "compute"  # exactly on the ridge
    for bad in [(0, 1, 1, 1, 1), (1, 0, 1, 1, 1), (1, 1, 0, 1, 1), (1, 1, 1, -1, 1)]:
        with pytest.raises(ValueError):
            fn(*bad)


def check_sectors_per_request(fn):
    assert fn([4 * t for t in range(32)]) == 4  # coalesced float32
    assert fn([128 * t for t in range(32)]) == 32  # a column of a row-major float32 matrix
    assert fn([8 * t for t in range(32)], access_bytes=8) == 8  # float64
    assert fn([4 + 4 * t for t in range(32)]) == 5  # one float32 off alignment
    assert fn([4 * (t // 2) for t in range(32)]) == 2  # pairs share a word
    assert fn([30]) == 2  # a 4-byte access across a sector boundary
    assert fn([1000]) == 1
    for bad in ([], list(range(33)), [-4]):
        with pytest.raises(ValueError):
            fn(bad)


def check_bank_conflict_ways(fn):
    assert fn(list(range(32))) == 1
    assert fn([32 * t for t in range(32)]) == 32  # a column of a 32 x 32 tile
    assert fn([33 * t for t in range(32)]) == 1  # the padded tile
    assert fn([2 * t for t in range(32)]) == 2
    assert fn([7] * 32) == 1  # a broadcast
    assert fn([0, 32, 32, 64]) == 3
    assert fn([5]) == 1
    for bad in ([], list(range(33)), [-1]):
        with pytest.raises(ValueError):
            fn(bad)


# Blocks up to 1024 threads, the most the docstring allows: a kernel with a tile of a
# fixed 128 floats fails at 256 and 1024. One block of 1024 only: the simulator runs
# every thread as Python code, and this is the file's slowest launch.
BLOCK_SUMS_LAUNCHES = [
    (1, 32),
    (100, 32),
    (33, 16),
    (64, 64),
    (257, 128),
    (5, 1),
    (300, 256),
    (1000, 1024),
]


def check_block_sums(fn, rng):
    with float32_pure_launches():
        for n, threads in BLOCK_SUMS_LAUNCHES:
            x_host = random_array((n,), np.float32, rng)
            out = poisoned(ceil_div(n, threads))
            fn(cuda.to_device(x_host), out, threads)
            starts = np.arange(0, n, threads)
            ref = np.add.reduceat(x_host.astype(np.float64), starts)
            # A tree of log2(threads) levels: a block's float32 sum is off by at most
            # log2(threads) * eps32 / 2 * the sum of its |x| (Higham, sec. 4.2), however
            # much its terms cancel; a wrong or missing term errs by |x| itself.
            magnitude = np.add.reduceat(np.abs(x_host.astype(np.float64)), starts)
            tol = rounding_tolerance(ref, magnitude, max(threads.bit_length() - 1, 1), 0.0)
            check(out, ref, tol=tol, name=f"block_sums n={n} threads={threads}")
    x = cuda.to_device(random_array((10,), np.float32, rng))
    with pytest.raises(ValueError):
        fn(x, poisoned(1), 12)  # not a power of two
    with pytest.raises(ValueError):
        fn(x, poisoned(3), 8)  # out has the wrong size
    with pytest.raises(TypeError):
        fn(np.ones(10, np.float32), poisoned(1), 16)


@functools.cache
def broken_solution(name, *edits):
    """A copy of solutions.<name> with each (old, new) source edit (tests/mutants.py),
    built once a process, so the float64 check types its kernels once."""
    from tests.mutants import mutant

    return mutant(getattr(load_chapter_module(CHAPTER, "solutions"), name), *edits)


def block_sums_launching(make_kernel, monkeypatch):
    """solutions.block_sums, its argument checks and all, launching make_kernel(threads)."""
    sol = load_chapter_module(CHAPTER, "solutions")
    monkeypatch.setattr(sol, "make_block_sums", make_kernel)
    monkeypatch.setattr(sol, "_BLOCK_SUMS", {})
    return sol.block_sums


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_theoretical_occupancy(impl):
    check_theoretical_occupancy(impl.theoretical_occupancy)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_bottleneck_kernel(impl):
    check_bottleneck_kernel(impl.bottleneck_kernel)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_roofline_bound(impl):
    check_roofline_bound(impl.roofline_bound)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_sectors_per_request(impl):
    check_sectors_per_request(impl.sectors_per_request)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_bank_conflict_ways(impl):
    check_bank_conflict_ways(impl.bank_conflict_ways)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_block_sums(impl, rng):
    check_block_sums(impl.block_sums, rng)


@pytest.mark.skipif(
    not is_simulator(),
    reason="the simulator's bounds checks and race detector catch both bugs every time",
)
def test_flagged_kernel_fails_the_block_sums_check(rng, monkeypatch):
    ex = load_chapter_module(CHAPTER, "exercises")
    flagged = block_sums_launching(ex.make_block_sums_flagged, monkeypatch)
    with pytest.raises((IndexError, common.RaceError, common.CheckError)):
        check_block_sums(flagged, rng)


@pytest.mark.skipif(
    not is_simulator(), reason="the simulator's bounds checks catch the overrun every time"
)
def test_fixed_size_tile_fails_the_block_sums_check(rng, monkeypatch):
    # a tile sized for the default 128 threads: blocks of 256 and 1024 write past it
    fixed = broken_solution(
        "make_block_sums", ("cuda.shared.array(BLOCK, float32)", "cuda.shared.array(128, float32)")
    )
    with pytest.raises(IndexError):
        check_block_sums(block_sums_launching(fixed, monkeypatch), rng)


def test_float64_block_sums_fail_the_check(rng, monkeypatch):
    # the padding 0.0 is a float64: the simulator stores float32 anyway, a GPU
    # converts every loaded value to float64 and back
    promoted = broken_solution("make_block_sums", ("else float32(0.0)", "else 0.0"))
    with pytest.raises(common.CheckError, match="float64"):
        check_block_sums(block_sums_launching(promoted, monkeypatch), rng)


# What an implementation gets wrong when fed only friendly inputs (each passes the
# checks as they were: whole warps, shared memory that never decides, one printed name
# per kernel); built from the solution, so they keep in step with it.
WRONG_EXERCISES = {
    "occupancy: warps rounded down": (
        "theoretical_occupancy",
        check_theoretical_occupancy,
        ("warps = ceil_div(threads_per_block, 32)", "warps = max(threads_per_block // 32, 1)"),
    ),
    "occupancy: no per-block reservation": (
        "theoretical_occupancy",
        check_theoretical_occupancy,
        (
            "shared = shared_bytes_per_block + limits.reserved_shared_per_block",
            "shared = shared_bytes_per_block",
        ),
    ),
    "occupancy: no 128 B shared unit": (
        "theoretical_occupancy",
        check_theoretical_occupancy,
        (
            "    shared = ceil_div(shared, limits.shared_allocation_unit) * "
            "limits.shared_allocation_unit\n",
            "",
        ),
    ),
    "bottleneck: grouped by printed name": (
        "bottleneck_kernel",
        check_bottleneck_kernel,
        ('totals[short_kernel_name(r["name"])] += us', 'totals[r["name"]] += us'),
        ("return name, totals[name]", "return short_kernel_name(name), totals[name]"),
    ),
}


@pytest.mark.parametrize("wrong", list(WRONG_EXERCISES))
def test_exercise_checks_fail_wrong_implementations(wrong):
    name, check_fn, *edits = WRONG_EXERCISES[wrong]
    with pytest.raises(AssertionError):
        check_fn(broken_solution(name, *edits))


# ------------------------------------------------------------------ scripts


@pytest.mark.skipif(not is_simulator(), reason="on a GPU these scripts profile at full size")
@pytest.mark.parametrize(
    "script", ["workloads", "occupancy", "nsight_compute", "case_study", "roofline"]
)
def test_script_runs_in_the_simulator(script, tmp_path, capsys):
    argv = [] if script == "workloads" else ["--out", str(tmp_path)]
    assert load_chapter_module(CHAPTER, script).main(argv) == 0
    text = capsys.readouterr().out
    if script in ("nsight_compute", "case_study"):
        assert "skipped running ncu" in text and "ncu --csv --page details" in text
    if script == "occupancy":
        assert "the calculator agrees with the saved ncu reports" in text
    if script == "roofline":
        assert (tmp_path / "roofline.png").stat().st_size > 10_000
