"""Chapter 08: the SGEMM progression and its exercises, at simulator sizes."""

import common  # noqa: F401, I001  (first: picks GPU or simulator before numba loads)
import numpy as np
import pytest
from numba import cuda, float32

from common import ceil_div
from common.checking import CheckError, check, guarded, random_array
from common.exercises import implementations, load_chapter_module
from common.float32_purity import float32_pure_launches

CHAPTER = "08_faster_matmul"
mm = load_chapter_module(CHAPTER, "matmul")

# M, N, K: not multiples of any tile, one element, thin shapes.
SHAPES = [(17, 13, 9), (1, 1, 1), (5, 19, 2)]


def _operands(m, n, k, rng):
    a_h = random_array((m, k), np.float32, rng)
    b_h = random_array((k, n), np.float32, rng)
    return a_h, b_h, cuda.to_device(a_h), cuda.to_device(b_h)


def _run_checked(matmul, m, n, k, rng, **kw):
    a_h, b_h, a, b = _operands(m, n, k, rng)
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


def _tiled_without_sync(TILE):
    @cuda.jit
    def matmul_tiled_no_sync(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        m, kk = a.shape
        n = b.shape[1]
        acc = float32(0.0)
        for k0 in range(0, kk, TILE):
            a_tile[ty, tx] = a[row, k0 + tx] if row < m and k0 + tx < kk else float32(0.0)
            b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < kk and col < n else float32(0.0)
            for k in range(TILE):  # no syncthreads before or after: reads race the loads
                acc += a_tile[ty, k] * b_tile[k, tx]
        if row < m and col < n:
            c[row, col] = acc

    return matmul_tiled_no_sync


def _tiled_without_bounds(TILE):
    @cuda.jit
    def matmul_tiled_no_bounds(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        acc = float32(0.0)
        for k0 in range(0, a.shape[1], TILE):
            a_tile[ty, tx] = a[row, k0 + tx]  # no bounds checks anywhere
            b_tile[ty, tx] = b[k0 + ty, col]
            cuda.syncthreads()
            for k in range(TILE):
                acc += a_tile[ty, k] * b_tile[k, tx]
            cuda.syncthreads()
        c[row, col] = acc

    return matmul_tiled_no_bounds


def _as_launcher(kernel):
    def launch(a, b, c, tile):
        m, n = c.shape
        kernel[(ceil_div(n, tile), ceil_div(m, tile)), (tile, tile)](a, b, c)

    return launch


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # may add uninitialised tiles: the point
def test_tiled_without_syncthreads_fails(rng):
    with pytest.raises(CheckError):
        for _ in range(3):  # a race shows up with high probability on each try
            check_matmul_tiled(_as_launcher(_tiled_without_sync(4)), rng)


def test_tiled_without_bounds_check_fails(rng):
    with pytest.raises((CheckError, IndexError)):
        check_matmul_tiled(_as_launcher(_tiled_without_bounds(4)), rng)


def _register_tile_swapped(BM, BN, BK, TM, TN):
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY

    @cuda.jit
    def matmul_register_tile_swapped(a, b, c):
        a_tile = cuda.shared.array((BM, BK), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array((TM, TN), float32)
        tid = cuda.threadIdx.x
        ty, tx = tid % TX, tid // TX  # wrong: tx, ty = tid % TX, tid // TX
        m, kk = a.shape
        n = b.shape[1]
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        for k0 in range(0, kk, BK):
            for idx in range(tid, BM * BK, THREADS):
                r, q = idx // BK, idx % BK
                ok = row0 + r < m and k0 + q < kk
                a_tile[r, q] = a[row0 + r, k0 + q] if ok else float32(0.0)
            for idx in range(tid, BK * BN, THREADS):
                r, q = idx // BN, idx % BN
                ok = k0 + r < kk and col0 + q < n
                b_tile[r, q] = b[k0 + r, col0 + q] if ok else float32(0.0)
            cuda.syncthreads()
            for k in range(BK):
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_tile[ty * TM + i, k] * b_tile[k, tx * TN + j]
            cuda.syncthreads()
        for i in range(TM):
            for j in range(TN):
                row, col = row0 + ty * TM + i, col0 + tx * TN + j
                if row < m and col < n:
                    c[row, col] = acc[i, j]

    return matmul_register_tile_swapped


def test_register_tile_with_tx_ty_swapped_fails(rng):
    def launch(a, b, c, bm, bn, bk, tm, tn):
        m, n = c.shape
        kernel = _register_tile_swapped(bm, bn, bk, tm, tn)
        kernel[(ceil_div(n, bn), ceil_div(m, bm)), (bm // tm) * (bn // tn)](a, b, c)

    with pytest.raises((CheckError, IndexError)):
        check_matmul_register_tile(launch, rng)


def _tiled_acc_float64(TILE):
    @cuda.jit
    def matmul_tiled_acc_float64(a, b, c):
        a_tile = cuda.shared.array((TILE, TILE), float32)
        b_tile = cuda.shared.array((TILE, TILE), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * TILE + ty
        col = cuda.blockIdx.x * TILE + tx
        m, kk = a.shape
        n = b.shape[1]
        acc = 0.0  # wrong: a float64 accumulator, so every FMA below is float64
        for k0 in range(0, kk, TILE):
            a_tile[ty, tx] = a[row, k0 + tx] if row < m and k0 + tx < kk else float32(0.0)
            b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < kk and col < n else float32(0.0)
            cuda.syncthreads()
            for k in range(TILE):
                acc += a_tile[ty, k] * b_tile[k, tx]
            cuda.syncthreads()
        if row < m and col < n:
            c[row, col] = acc

    return matmul_tiled_acc_float64


def test_tiled_with_float64_accumulator_fails(rng):
    # Right values (the simulator rounds the result to float32 on the store); the
    # float64 check names the line.
    with pytest.raises(CheckError, match=r"line \d+ of test_ch08_matmul.py: `acc = 0.0` makes "
                       r"acc float64; write acc = np.float32\(0.0\)"):
        kernels = {tile: _tiled_acc_float64(tile) for tile in (3, 4)}
        check_matmul_tiled(lambda a, b, c, tile: _as_launcher(kernels[tile])(a, b, c, tile), rng)


def test_register_tile_with_wrong_fragment_fails(rng):
    sol = load_chapter_module(CHAPTER, "solutions")
    good = sol.make_register_tile_kernel

    def launch(a, b, c, bm, bn, bk, tm, tn):
        # A "register tile" with TN = 1 launched as if it were tn wide: most
        # columns are never written and keep their NaN poison.
        k = good(bm, bn, bk, tm, 1)
        m, n = c.shape
        k[(ceil_div(n, bn), ceil_div(m, bm)), (bm // tm) * (bn // tn)](a, b, c)

    with pytest.raises(CheckError):
        check_matmul_register_tile(launch, rng)


# ------------------------------------------------- the chapter script, every version


@pytest.mark.parametrize("m, n, k", [(17, 13, 9), (1, 1, 1), (21, 34, 5)])
def test_every_script_version_matches_float64(m, n, k, rng):
    a_h, b_h, a, b = _operands(m, n, k, rng)
    ref = mm.matmul_reference(a_h, b_h)
    versions = dict(mm.gpu_versions())
    versions["11 tuned"] = (lambda a, b, c: mm.matmul_best(a, b, c), None)
    for name, (launch, _) in versions.items():
        out = guarded((m, n), np.float32)
        launch(a, b, out.array)
        check(out.array, ref, tol=1e-5, name=name)
        out.check_untouched(name)


# Multiples of the kernel's tile shape (which differs between the simulator and
# a GPU), so v10's unguarded kernel runs: (tiles in M, tiles in N, tiles in K).
DIVISIBLE = [(1, 1, 1), (2, 3, 3), (3, 1, 5)]


@pytest.mark.parametrize("tiles_m, tiles_n, tiles_k", DIVISIBLE)
def test_unguarded_kernel_on_divisible_sizes(tiles_m, tiles_n, tiles_k, rng):
    fast, _ = mm.make_matmul_fast(*mm.SHAPE_8).kernels
    bm, bn = fast.tile
    m, n, k = tiles_m * bm, tiles_n * bn, tiles_k * fast.bk
    _run_checked(lambda a, b, c: mm.launch_unguarded(fast, a, b, c), m, n, k, rng)


def test_unguarded_kernel_refuses_ragged_sizes(rng):
    fast, _ = mm.make_matmul_fast(*mm.SHAPE_8).kernels
    bm, bn = fast.tile
    for m, n, k in ((bm + 1, bn, fast.bk), (bm, bn - 1, fast.bk), (bm, bn, fast.bk + 2)):
        a = cuda.to_device(random_array((m, k), np.float32, rng))
        b = cuda.to_device(random_array((k, n), np.float32, rng))
        with pytest.raises(ValueError, match="multiples|%"):
            mm.launch_unguarded(fast, a, b, cuda.device_array((m, n), np.float32))


@pytest.mark.parametrize("shape", mm.TUNE_SHAPES)
def test_fast_path_chooses_kernel_by_size(shape, rng):
    """make_matmul_fast: divisible sizes go to the unguarded kernel, ragged ones to
    the guarded one; both must be right (each kernel counts its launches here)."""
    launch = mm.make_matmul_fast(*shape)
    bm, bn, bk = shape[:3]
    used = []
    real = mm.launch_unguarded, mm.launch_blocktiled
    try:
        mm.launch_unguarded = lambda *args: (used.append("fast"), real[0](*args))
        mm.launch_blocktiled = lambda *args: (used.append("edge"), real[1](*args))
        _run_checked(launch, bm, 2 * bn, 2 * bk, rng)
        _run_checked(launch, bm + 3, bn - 1, bk + 1, rng)
    finally:
        mm.launch_unguarded, mm.launch_blocktiled = real
    assert used == ["fast", "edge"]


def test_unguarded_kernel_on_ragged_sizes_fails(rng):
    """Launched past the edge (what the size check prevents), the kernel without
    guards writes outside C or reads past A and B: the checks catch it."""
    fast, _ = mm.make_matmul_fast(*mm.SHAPE_8).kernels
    bm, bn = fast.tile
    m, n, k = bm + 5, bn + 3, fast.bk * 2
    a_h, b_h, a, b = _operands(m, n, k, rng)
    out = guarded((m, n), np.float32)
    with pytest.raises((CheckError, IndexError)):
        fast[(ceil_div(n, bn), ceil_div(m, bm)), fast.threads](
            a.reshape(m * k), b.reshape(k * n), out.array.reshape(m * n), n, k)
        check(out.array, mm.matmul_reference(a_h, b_h), tol=1e-5)
        out.check_untouched()


def test_python_loops_match_numpy(rng):
    a = random_array((3, 4), np.float32, rng)
    b = random_array((4, 2), np.float32, rng)
    np.testing.assert_allclose(mm.matmul_python_loops(a, b), mm.matmul_reference(a, b))


def test_matmul_best_refuses_bad_operands(rng):
    a = cuda.to_device(random_array((4, 3), np.float32, rng))
    with pytest.raises(TypeError):
        mm.matmul_best(a, cuda.to_device(random_array((3, 5), np.float64, rng)),
                       cuda.device_array((4, 5), np.float32))
    with pytest.raises(ValueError):
        mm.matmul_best(a, cuda.to_device(random_array((2, 5), np.float32, rng)),
                       cuda.device_array((4, 5), np.float32))


def test_script_main_runs(tmp_path):
    results = mm.main(["--sizes", "9x7x5", "--out", str(tmp_path)])
    assert (tmp_path / "matmul.json").exists()
    names = [r.name for res in results.values() for r in res]
    assert any(nm.startswith("11 autotuned") for nm in names)
    assert any(nm.startswith("10 unguarded") for nm in names)
    assert any(nm.startswith("9 double buffered") for nm in names)


def test_readme_code_is_the_chapter_code():
    from common.readme_sync import REPO_ROOT, sync_readme

    assert sync_readme(REPO_ROOT / "chapters" / "08_faster_matmul" / "README.md", write=False) == []
