"""Chapter 09: the exercises, the occupancy calculator against Nsight Compute's
figures, the ncu report parser on reports saved from a GPU run, the roofline
arithmetic, the case study's kernels and the chapter scripts in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import check, poisoned, random_array
from common.internal.exercises import implementations, load_chapter_module

import json

import numpy as np
import pytest
from numba import cuda

CHAPTER = "09_profiling"
occupancy = load_chapter_module(CHAPTER, "occupancy")
nsight = load_chapter_module(CHAPTER, "nsight_compute")
roofline = load_chapter_module(CHAPTER, "roofline")
names = load_chapter_module(CHAPTER, "kernel_names")
H100 = occupancy.KNOWN_LIMITS[(9, 0)]
SAVED = occupancy.SAVED


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


@pytest.mark.parametrize(
    "threads, regs, smem, limits, blocks, limiter",
    [
        (256, 48, 4096, H100, 5, "registers"),  # 1536 regs a warp: 10 warps a quarter
        (32, 143, 7360, H100, 12, "registers"),  # 4608 a warp: 3 warps a quarter, not 14
        (256, 32, 34848, H100, 6, "shared"),  # 34848 + 1024 reserved: 6 x 35872 fit
        (1, 16, 0, H100, 32, "blocks"),  # one warp a block: the 32-block cap
        (1024, 32, 0, H100, 2, "warps"),
        (1024, 64, 0, H100, 1, "registers"),
        (128, 32, 48 * 1024, occupancy.KNOWN_LIMITS[(7, 5)], 1, "shared"),  # T4: no reserve
        (
            64,
            40,
            0,
            occupancy.KNOWN_LIMITS[(8, 6)],
            16,
            "blocks",
        ),  # 2 warps: 16 blocks, 32 of 48 warps
        (96, 40, 0, occupancy.KNOWN_LIMITS[(8, 6)], 16, "warps"),  # a tie: the first budget named
    ],
)
def test_occupancy_by_hand(threads, regs, smem, limits, blocks, limiter):
    occ = occupancy.theoretical_occupancy(threads, regs, smem, limits)
    assert (occ.blocks_per_sm, occ.limiter) == (blocks, limiter)
    assert occ.occupancy == blocks * ceil_div(threads, 32) / limits.max_warps_per_sm


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
    measured = json.loads(roofline.SAVED.read_text())
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
    assert fn(96, 40, 0, occupancy.KNOWN_LIMITS[(8, 6)])[:2] == (16, 1.0)
    assert fn(128, 32, 48 * 1024, occupancy.KNOWN_LIMITS[(7, 5)]) == (1, 0.125, "shared")
    for bad in [(0, 32, 0), (1025, 32, 0), (128, 0, 0), (128, 256, 0), (128, 32, -1)]:
        with pytest.raises(ValueError):
            fn(*bad, H100)


def check_bottleneck_kernel(fn):
    records = json.loads((SAVED / "torch_profile_kernels_naive.json").read_text())["kernels"]
    tp = load_chapter_module(CHAPTER, "torch_profile")
    top = tp.kernel_table(tp.KernelRecord(r["name"], r["start_us"], r["end_us"]) for r in records)[
        0
    ]
    name, share = fn(records)
    assert (name, share) == (top.name, pytest.approx(top.percent / 100))
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


def check_block_sums(fn, rng):
    for n, threads in [(1, 32), (100, 32), (33, 16), (64, 64), (257, 128), (5, 1)]:
        x_host = random_array((n,), np.float32, rng)
        out = poisoned(ceil_div(n, threads))
        fn(cuda.to_device(x_host), out, threads)
        ref = np.add.reduceat(x_host.astype(np.float64), np.arange(0, n, threads))
        check(out, ref, tol=1e-5, name=f"block_sums n={n} threads={threads}")
    x = cuda.to_device(random_array((10,), np.float32, rng))
    with pytest.raises(ValueError):
        fn(x, poisoned(1), 12)  # not a power of two
    with pytest.raises(ValueError):
        fn(x, poisoned(3), 8)  # out has the wrong size
    with pytest.raises(TypeError):
        fn(np.ones(10, np.float32), poisoned(1), 16)


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
def test_flagged_kernel_fails_the_block_sums_check(rng):
    ex = load_chapter_module(CHAPTER, "exercises")
    kernels = {}

    def flagged(x, out, threads):
        kernels.setdefault(threads, ex.make_block_sums_flagged(threads))
        kernels[threads][out.size, threads](x, out)

    with pytest.raises((IndexError, common.RaceError, common.CheckError)):
        check_block_sums(flagged, rng)


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
