"""Chapter 08: the SGEMM progression and its exercises, at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import CheckError, check, guarded, random_array
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches

import inspect
import json
import textwrap
from functools import partial

import numpy as np
import pytest
from numba import cuda

CHAPTER = "08_faster_matmul"
mm = load_chapter_module(CHAPTER, "matmul")
sol = load_chapter_module(CHAPTER, "solutions")

# M, N, K: not multiples of any tile, one element, thin shapes.
SHAPES = [(17, 13, 9), (1, 1, 1), (5, 19, 2)]


def _run_checked(matmul, m, n, k, rng, **kw):
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    out = guarded((m, n), np.float32)
    matmul(a, b, out.array, **kw)
    check(out.array, mm.matmul_reference(a_h, b_h), tol=1e-5, name=f"{m}x{n}x{k} {kw}")
    out.check_untouched()


# ----------------------------------------------------------------- exercises


def check_matmul_tiled(fn, rng):
    # (12, 12, 12): exact multiples of both tiles, where a grid one tile too large
    # or a K loop one tile too long is wrong
    with float32_pure_launches():
        for m, n, k in SHAPES + [(12, 12, 12), tuple(int(x) for x in rng.integers(2, 14, 3))]:
            for tile in (4, 3):
                _run_checked(fn, m, n, k, rng, tile=tile)


# (bm, bn, bk, tm, tn): thread grids of (bn // tn) x (bm // tm) = 4 x 4, 8 x 4 and 2 x 4,
# and tm != tn: with a square thread grid and square register tiles, a kernel that
# swaps tx and ty (or tm and tn) still covers every element once and passes.
REGISTER_TILES = ((16, 8, 3, 4, 2), (8, 16, 4, 2, 2), (12, 8, 2, 3, 4))


def check_matmul_register_tile(fn, rng):
    shapes = [(17, 13, 9), (1, 1, 1), (24, 16, 8), tuple(int(x) for x in rng.integers(2, 20, 3))]
    with float32_pure_launches():
        for m, n, k in shapes:
            for bm, bn, bk, tm, tn in REGISTER_TILES:
                _run_checked(fn, m, n, k, rng, bm=bm, bn=bn, bk=bk, tm=tm, tn=tn)


def check_arithmetic_intensity(fn):
    assert fn(32, 32, 32) == pytest.approx(8.0)
    for bm, bn, bk in ((128, 128, 8), (64, 32, 16), (1, 1, 1)):
        assert fn(bm, bn, bk) == pytest.approx(bm * bn / (2 * (bm + bn)))
    with pytest.raises(ValueError):
        fn(0, 4, 4)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_matmul_tiled(impl, rng):
    check_matmul_tiled(impl.matmul_tiled, rng)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_matmul_register_tile(impl, rng):
    check_matmul_register_tile(impl.matmul_register_tile, rng)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_arithmetic_intensity(impl):
    check_arithmetic_intensity(impl.arithmetic_intensity)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_bad_operands_are_refused(impl, rng):
    a = cuda.to_device(random_array((4, 3), np.float32, rng))
    b64 = cuda.to_device(random_array((3, 5), np.float64, rng))
    c = cuda.device_array((4, 5), np.float32)
    with pytest.raises(TypeError):
        impl.matmul_tiled(a, b64, c)
    with pytest.raises(ValueError):
        impl.matmul_tiled(a, cuda.to_device(random_array((4, 5), np.float32, rng)), c)


# ------------------------------------------- broken kernels must fail the checks


def mutant(tmp_path, factory, *edits):
    """``factory`` (a kernel factory of the chapter) rebuilt from its source with
    each (old, new) edit applied wherever ``old`` occurs: the one bug a check
    must catch, kept in step with the real kernel. The source is written to a
    file in ``tmp_path`` so that tracebacks and the float64 check quote its lines."""
    src = textwrap.dedent(inspect.getsource(factory))
    for old, new in edits:
        assert old in src, f"{old!r} is not in {factory.__name__} any more: update the test"
        src = src.replace(old, new)
    # never mistaken for the cached original, nor kept in the course's kernel cache
    src = src.replace("cache=True", "cache=False")
    path = tmp_path / f"{factory.__name__}_mutant.py"
    path.write_text(src)
    namespace = dict(factory.__globals__)
    exec(compile(src, str(path), "exec"), namespace)
    return namespace[factory.__name__]


def _tiled_launcher(factory):
    """launch(a, b, c, tile) as matmul_tiled launches, for kernels made by ``factory(TILE)``."""
    kernels = {}

    def launch(a, b, c, tile):
        if tile not in kernels:
            kernels[tile] = factory(tile)
        m, n = c.shape
        kernels[tile][(ceil_div(n, tile), ceil_div(m, tile)), (tile, tile)](a, b, c)

    return launch


def _register_tile_launcher(factory):
    """launch(a, b, c, bm, bn, bk, tm, tn) as matmul_register_tile launches, for
    kernels made by ``factory(BM, BN, BK, TM, TN)``."""

    def launch(a, b, c, bm, bn, bk, tm, tn):
        m, n = c.shape
        kernel = factory(bm, bn, bk, tm, tn)
        kernel[(ceil_div(n, bn), ceil_div(m, bm)), (bm // tm) * (bn // tn)](a, b, c)

    return launch


@pytest.mark.skipif(
    not is_simulator(),
    reason="a missing barrier is caught every time only by the simulator's race detector; "
    "on a GPU a value check sees it by chance (compute-sanitizer --tool racecheck finds it)",
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # may add uninitialised tiles: the point
def test_tiled_without_syncthreads_fails(rng, tmp_path):
    no_sync = mutant(
        tmp_path,
        sol.make_tiled_kernel,
        ("cuda.syncthreads()", "pass  # no barrier: the reads race the loads"),
    )
    with pytest.raises(CheckError):  # a RaceError, on the first launch
        check_matmul_tiled(_tiled_launcher(no_sync), rng)


def test_tiled_without_bounds_check_fails(rng, tmp_path):
    no_bounds = mutant(
        tmp_path,
        sol.make_tiled_kernel,
        (" if row < m and k0 + tx < k_total else float32(0.0)", ""),
        (" if k0 + ty < k_total and col < n else float32(0.0)", ""),
        ("if row < m and col < n:", "if True:  # no bounds checks anywhere"),
    )
    with pytest.raises((CheckError, IndexError)):
        check_matmul_tiled(_tiled_launcher(no_bounds), rng)


def test_register_tile_with_tx_ty_swapped_fails(rng, tmp_path):
    swapped = mutant(
        tmp_path,
        sol.make_register_tile_kernel,
        ("tx, ty = tid % TX, tid // TX", "ty, tx = tid % TX, tid // TX"),
    )
    with pytest.raises((CheckError, IndexError)):
        check_matmul_register_tile(_register_tile_launcher(swapped), rng)


def test_tiled_with_float64_accumulator_fails(rng, tmp_path):
    # Right values (the simulator rounds the result to float32 on the store); the
    # float64 check names the line.
    acc64 = mutant(
        tmp_path,
        sol.make_tiled_kernel,
        ("acc = float32(0.0)", "acc = 0.0  # wrong: a float64 accumulator"),
    )
    with pytest.raises(
        CheckError,
        match=r"line \d+ of make_tiled_kernel_mutant.py: `acc = 0.0` "
        r"makes acc float64; write acc = np.float32\(0.0\)",
    ):
        check_matmul_tiled(_tiled_launcher(acc64), rng)


# Wrong products may overflow float32 to inf, and inf * 0 is NaN: that is the
# point, not a warning to show.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_register_tile_with_wrong_fragment_fails(rng):
    def one_column_wide(bm, bn, bk, tm, tn):
        # A "register tile" with TN = 1 launched as if it were tn wide: most
        # columns are never written and keep their NaN poison.
        return sol.make_register_tile_kernel(bm, bn, bk, tm, 1)

    with pytest.raises(CheckError):
        check_matmul_register_tile(_register_tile_launcher(one_column_wide), rng)


# ------------------------------------------------- the chapter script, every version


@pytest.mark.parametrize("m, n, k", [(17, 13, 9), (1, 1, 1), (21, 34, 5)])
def test_every_script_version_matches_float64(m, n, k, rng):
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    ref = mm.matmul_reference(a_h, b_h)
    versions = mm.gpu_versions()
    assert [v.number for v in versions] == list(range(3, 11))
    launchers = {v.label: v.launcher for v in versions}
    launchers["matmul_best"] = mm.matmul_best
    for name, launch in launchers.items():
        out = guarded((m, n), np.float32)
        launch(a, b, out.array)
        check(out.array, ref, tol=1e-5, name=name)
        out.check_untouched(name)


# Multiples of the kernel's tile shape (which differs between the simulator and
# a GPU), so v10's unguarded kernel runs: (tiles in M, tiles in N, tiles in K).
DIVISIBLE = [(1, 1, 1), (2, 3, 3), (3, 1, 5)]


@pytest.mark.parametrize("tiles_m, tiles_n, tiles_k", DIVISIBLE)
def test_unguarded_kernel_on_divisible_sizes(tiles_m, tiles_n, tiles_k, rng):
    tile = mm.SHAPE_8
    fast = mm.make_matmul_unguarded(tile)
    m, n, k = tiles_m * tile.bm, tiles_n * tile.bn, tiles_k * tile.bk
    _run_checked(partial(mm.launch_unguarded, fast, tile), m, n, k, rng)


def test_unguarded_kernel_refuses_ragged_sizes(rng):
    tile = mm.SHAPE_8
    fast = mm.make_matmul_unguarded(tile)
    bm, bn, bk = tile.bm, tile.bn, tile.bk
    for m, n, k in ((bm + 1, bn, bk), (bm, bn - 1, bk), (bm, bn, bk + 2)):
        a = cuda.to_device(random_array((m, k), np.float32, rng))
        b = cuda.to_device(random_array((k, n), np.float32, rng))
        with pytest.raises(ValueError, match="multiples|%"):
            mm.launch_unguarded(fast, tile, a, b, cuda.device_array((m, n), np.float32))


@pytest.mark.parametrize("tile", mm.TUNE_SHAPES, ids=str)
def test_fast_path_chooses_kernel_by_size(tile, rng, monkeypatch):
    """make_matmul_fast: divisible sizes go to the unguarded kernel, ragged ones to
    the guarded one; both must be right (each launcher counts its calls here)."""
    used = []

    def counted(kind, real):
        def launch(*args):
            used.append(kind)
            real(*args)

        return launch

    monkeypatch.setattr(mm, "launch_unguarded", counted("unguarded", mm.launch_unguarded))
    monkeypatch.setattr(mm, "launch_blocktiled", counted("guarded", mm.launch_blocktiled))
    launch = mm.make_matmul_fast(tile).launcher
    _run_checked(launch, tile.bm, 2 * tile.bn, 2 * tile.bk, rng)
    _run_checked(launch, tile.bm + 3, tile.bn - 1, tile.bk + 1, rng)
    assert used == ["unguarded", "guarded"]


def test_unguarded_kernel_on_ragged_sizes_fails(rng):
    """Launched past the edge (what the size check prevents), the kernel without
    guards writes outside C or reads past A and B: the checks catch it."""
    tile = mm.SHAPE_8
    fast = mm.make_matmul_unguarded(tile)
    m, n, k = tile.bm + 5, tile.bn + 3, tile.bk * 2
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    out = guarded((m, n), np.float32)
    with pytest.raises((CheckError, IndexError)):
        fast[(ceil_div(n, tile.bn), ceil_div(m, tile.bm)), tile.threads](
            a.reshape(m * k), b.reshape(k * n), out.array.reshape(m * n), n, k
        )
        check(out.array, mm.matmul_reference(a_h, b_h), tol=1e-5)
        out.check_untouched()


def test_python_loops_match_numpy(rng):
    a = random_array((3, 4), np.float32, rng)
    b = random_array((4, 2), np.float32, rng)
    np.testing.assert_allclose(mm.matmul_python_loops(a, b), mm.matmul_reference(a, b))


def test_matmul_best_refuses_bad_operands(rng):
    a = cuda.to_device(random_array((4, 3), np.float32, rng))
    with pytest.raises(TypeError):
        mm.matmul_best(
            a,
            cuda.to_device(random_array((3, 5), np.float64, rng)),
            cuda.device_array((4, 5), np.float32),
        )
    with pytest.raises(ValueError):
        mm.matmul_best(
            a,
            cuda.to_device(random_array((2, 5), np.float32, rng)),
            cuda.device_array((4, 5), np.float32),
        )
    b = cuda.to_device(random_array((3, 5), np.float32, rng))
    with pytest.raises(TypeError, match="host"):
        mm.matmul_best(
            random_array((4, 3), np.float32, rng), b, cuda.device_array((4, 5), np.float32)
        )
    # Every other column of a (4, 6) array: a strided view, not row-major. (A
    # device array's .T is no test: on a GPU Numba transposes it into a copy.)
    with pytest.raises(ValueError, match="C-contiguous"):
        mm.matmul_best(
            cuda.to_device(random_array((4, 6), np.float32, rng))[:, ::2],
            b,
            cuda.device_array((4, 5), np.float32),
        )


def test_script_main_runs(tmp_path):
    assert mm.main(["--sizes", "9x7x5", "--out", str(tmp_path)]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "matmul.json").read_text())["results"]]
    assert any(nm.startswith("11 autotuned") for nm in names)
    assert any(nm.startswith("10 unguarded") for nm in names)
    assert any(nm.startswith("9 double buffered") for nm in names)
    assert any(nm.startswith("14 chosen by shape") for nm in names)


def test_readme_code_is_the_chapter_code():
    from common.internal.readme_sync import REPO_ROOT, sync_readme

    assert sync_readme(REPO_ROOT / "chapters" / "08_faster_matmul" / "README.md", write=False) == []


# ------------------------------- versions 12-14: warp tiles, split-K, chosen by shape

# Shapes for versions 12-14 at the simulator's tiles (32 x 32 or 32 x 16, BK = 4): ragged
# in M, N and K; one element; M = 1 with K under one BK tile; N = 1.
SCHEDULE_SHAPES = [(17, 13, 9), (1, 1, 1), (1, 40, 3), (37, 1, 6)]


@pytest.mark.parametrize("m, n, k", SCHEDULE_SHAPES)
def test_schedule_versions_match_float64(m, n, k, rng):
    versions = mm.schedule_versions()
    assert [v.number for v in versions] == [12, 13, 14]
    for v in versions:
        _run_checked(v.launcher, m, n, k, rng)


def _check_split_k(tile, splits, m, n, k, rng, repeat=False, launch=None):
    """launch_warptiled (or ``launch(tile, splits, workspace, a, b, c)``) at
    ``splits`` against float64, its split-K workspace poisoned (NaN) first, so a
    partial that no split wrote, or that the reduce reads past, fails the check.
    With ``repeat``, a second run must give the same bits (a fixed-order reduce,
    no atomics)."""
    launch = launch or mm.launch_warptiled
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    workspace = mm.SplitKWorkspace()
    workspace.buffer = cuda.to_device(np.full(splits * m * n + 64, np.nan, np.float32))
    out = guarded((m, n), np.float32)
    launch(tile, splits, workspace, a, b, out.array)
    name = f"{m}x{n}x{k} {tile} splits={splits}"
    check(out.array, mm.matmul_reference(a_h, b_h), tol=1e-5, name=name)
    out.check_untouched(name)
    if repeat:
        first = out.array.copy_to_host()
        launch(tile, splits, workspace, a, b, out.array)
        assert np.array_equal(first.view(np.uint32), out.array.copy_to_host().view(np.uint32))


def _fast_split(factory=None):
    """A launcher (tile, splits, workspace, a, b, c) running version 10's unguarded
    kernel (or ``factory``'s) split, as versions 13-14 do at version 11's tile."""

    def launch(tile, splits, workspace, a, b, c):
        kernel = (factory or mm.make_matmul_unguarded)(tile)
        mm.launch_fast_split(kernel, tile, splits, workspace, a, b, c)

    return launch


def test_fast_kernel_split_k(rng):
    """Version 11's kernel on a grid of S layers: K of 5 tiles split 2 ways (uneven
    ranges, 2 + 3) and 5 ways (one tile each, bit-identical when run twice), two
    blocks each way. (3-way uneven splits: the warp-tiled test below.)"""
    tile = mm.TUNE_SHAPES[0]
    for splits in (2, 5):
        _check_split_k(
            tile, splits, 2 * tile.bm, 2 * tile.bn, 5 * tile.bk, rng, splits == 5, _fast_split()
        )


def test_fast_kernel_split_k_with_overlapping_ranges_fails(rng, tmp_path):
    factory = mutant(
        tmp_path,
        mm.make_matmul_unguarded,
        ("k0 = (z * (k_total // BK) // splits) * BK", "k0 = 0  # wrong: ranges overlap"),
    )
    tile = mm.TUNE_SHAPES[0]
    with pytest.raises(CheckError):
        _check_split_k(tile, 2, tile.bm, tile.bn, 5 * tile.bk, rng, launch=_fast_split(factory))


def test_fast_kernel_split_k_refuses_ragged_shapes_and_empty_splits(rng):
    tile = mm.TUNE_SHAPES[0]
    kernel = mm.make_matmul_unguarded(tile)
    for (m, n, k), splits in [
        ((tile.bm + 1, tile.bn, 4 * tile.bk), 2),
        ((tile.bm, tile.bn, 2 * tile.bk), 3),
    ]:
        _, _, a, b = mm.random_operands(m, n, k, rng)
        c = cuda.device_array((m, n), np.float32)
        with pytest.raises(ValueError, match="launch_fast_split needs"):
            mm.launch_fast_split(kernel, tile, splits, mm.SplitKWorkspace(), a, b, c)


def test_schedule_versions_on_version_11(rng):
    """Versions 13-14 built on version 11: a shape its tile divides with few blocks
    (split by the schedule on the simulator's 2 SMs), and ragged shapes, which run on
    the guarded warp-tiled kernel."""
    tile = mm.TUNE_SHAPES[0]
    tuned = mm.replace(mm.make_matmul_fast(tile), number=11)
    versions = mm.schedule_versions(tuned)
    m, n, k = tile.bm, tile.bn, 16 * tile.bk
    assert versions[1].launcher.schedule(m, n, k)[0] == tile
    assert versions[1].launcher.schedule(m, n, k)[1] > 1
    for v in versions[1:]:
        for shape in [(m, n, k), (17, 13, 9), (1, 1, 1)]:
            _run_checked(v.launcher, *shape, rng)


# K = 4 * BK + 1 is 5 K tiles, the last one partial (17 in the simulator, BK = 4).
def _ragged_k(tile):
    return 4 * tile.bk + 1


def test_split_k_every_split_count(rng):
    """K of 5 tiles: splits 2, 3 and 5 give uneven ranges (2 + 3, 1 + 2 + 2, 1 each);
    then the unguarded kernel (a shape the tile divides) with 3 splits of 4 tiles.
    Split 1 is version 12's test."""
    tile = mm.SCHEDULE_TILES[0]
    for splits in (2, 3, 5):
        _check_split_k(tile, splits, 9, 20, _ragged_k(tile), rng, repeat=splits == 5)
    _check_split_k(tile, 3, tile.bm, tile.bn, 4 * tile.bk, rng)


def test_split_k_refuses_splits_without_a_k_tile(rng):
    tile = mm.SCHEDULE_TILES[0]
    k = 2 * tile.bk + 1  # 3 K tiles
    _, _, a, b = mm.random_operands(5, 6, k, rng)
    c = cuda.device_array((5, 6), np.float32)
    for splits in (0, 4):
        with pytest.raises(ValueError, match=r"splits must be between 1 and .* = 3"):
            mm.launch_warptiled(tile, splits, mm.SplitKWorkspace(), a, b, c)


def test_split_k_reduce_skipping_the_last_split_fails(rng, monkeypatch, tmp_path):
    src = textwrap.dedent(inspect.getsource(mm.matmul_splitk_reduce.py_func))
    old = "range(1, splits):"
    assert old in src, "matmul_splitk_reduce changed: update the test"
    path = tmp_path / "splitk_reduce_mutant.py"
    path.write_text(src.replace(old, "range(1, splits - 1):  # wrong: the last split is lost"))
    namespace = dict(mm.matmul_splitk_reduce.py_func.__globals__)
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    monkeypatch.setattr(mm, "matmul_splitk_reduce", namespace["matmul_splitk_reduce"])
    with pytest.raises(CheckError):
        _check_split_k(mm.SCHEDULE_TILES[0], 3, 9, 20, _ragged_k(mm.SCHEDULE_TILES[0]), rng)


def test_split_k_with_overlapping_ranges_fails(rng, tmp_path):
    """Every split summing from K = 0 (ranges that overlap) counts tiles twice."""
    factory = mutant(
        tmp_path,
        mm.make_matmul_warptiled_guarded,
        ("k_begin = (z * k_tiles // splits) * BK", "k_begin = 0  # wrong: ranges overlap"),
    )
    tile = mm.SCHEDULE_TILES[0]
    a_h, b_h, a, b = mm.random_operands(9, 40, _ragged_k(tile), rng)
    workspace = mm.SplitKWorkspace()
    out = guarded((9, 40), np.float32)
    kernel = factory(tile)
    partials = workspace.partials(2, 9, 40)
    kernel[(ceil_div(40, tile.bn), ceil_div(9, tile.bm), 2), tile.threads](
        a, b, partials.reshape(2, 9, 40)
    )
    mm.matmul_splitk_reduce[1, 9 * 40](partials, out.array.reshape(9 * 40), 9 * 40, 2)
    with pytest.raises(CheckError):
        check(out.array, mm.matmul_reference(a_h, b_h), tol=1e-5)


# The H100's 132 SMs, and an H100 PCIe's 114: one wave is 264 or 228 blocks of 2 per SM.
T128, T128X64, T64 = mm.GPU_SCHEDULE_TILES


@pytest.mark.parametrize(
    "m, n, k, sms, want",
    [
        (4096, 4096, 4096, 132, (T128, 1)),  # 1024 blocks: 3.9 waves
        (2048, 2048, 2048, 132, (T128, 1)),  # 256 blocks: 0.97 of a wave
        (1024, 1024, 1024, 132, (T128, 4)),  # 64 blocks: split K in 4 (16 K tiles each)
        (4096, 4096, 256, 132, (T128, 1)),  # small K, but 1024 blocks
        (256, 4096, 4096, 132, (T128, 4)),  # small M: 64 blocks, long K
        (1024, 1024, 1024, 114, (T64, 1)),  # 3 splits fill 192 of 228: 64 x 64 tiles instead
        (1024, 1024, 64, 132, (T64, 1)),  # 4 K tiles: no split keeps MIN_K_TILES each
        (128, 128, 4096, 132, (T64, 16)),  # 16 splits of 1-4 blocks: the smallest tile
        (1, 1, 1, 132, (T64, 1)),  # nothing fills a wave: the smallest tile
    ],
)
def test_choose_schedule(m, n, k, sms, want):
    assert mm.choose_schedule(m, n, k, sms, mm.GPU_SCHEDULE_TILES) == want


def test_choose_schedule_rules():
    for m in (1, 100, 256, 1000):
        for n in (1, 64, 777, 4096):
            for k in (1, 15, 64, 1000, 20000):
                tile, splits = mm.choose_schedule(m, n, k, 132, mm.GPU_SCHEDULE_TILES)
                k_tiles = ceil_div(k, tile.bk)
                assert 1 <= splits <= min(mm.MAX_SPLITS, max(1, k_tiles // mm.MIN_K_TILES))
                blocks = ceil_div(m, tile.bm) * ceil_div(n, tile.bn)
                assert splits == 1 or blocks * splits <= 132 * tile.min_blocks  # one wave at most
    for bad in ((0, 4, 4, 132), (4, 4, 4, 0)):
        with pytest.raises(ValueError):
            mm.choose_schedule(*bad, mm.GPU_SCHEDULE_TILES)
