"""Chapter 08's tensor-core GEMM (tensor_cores.py) at simulator sizes: every version
and precision on shapes that do not divide the tiles, bit-exact against the NumPy
model of the mma sequence and within the derived tolerance of float64."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import tensor_cores as tc
from common.checking import check, guarded
from common.internal.exercises import load_chapter_module
from common.runtime import is_simulator

import numpy as np
import pytest
from numba import cuda

tcm = load_chapter_module("08_faster_matmul", "tensor_cores")
mm = tcm.mm

# M, N, K: one element, none a multiple of a tile (v2's simulator tile: 32 x 16, KW 8),
# K past one slice of both K-widths (8 words = 8 TF32 or 16 BF16 values)
SHAPES = [(1, 1, 1), (37, 21, 19), (17, 9, 33)]


def _checked(launcher, precision, m, n, k, rng, unit=None):
    a_h, b_h, a, b = mm.random_operands(m, n, k, rng)
    out = guarded((m, n), np.float32)
    launcher(a, b, out.array)
    ref = mm.matmul_reference(a_h, b_h)
    tol = tcm.tolerance(a_h, b_h, ref, unit or tc.UNIT_ROUNDOFF[precision])
    got = out.array.copy_to_host() if hasattr(out.array, "copy_to_host") else out.array
    check(got, ref, tol=tol, name=f"{precision} {m}x{n}x{k}")
    out.check_untouched()
    return a_h, b_h, np.asarray(got)


@pytest.mark.parametrize("precision", tcm.PRECISIONS)
def test_versions_on_hostile_shapes(precision, rng):
    for version in tcm.versions(precision):
        for m, n, k in SHAPES:
            a_h, b_h, got = _checked(version.launcher, precision, m, n, k, rng, version.input_unit)
            if is_simulator():  # the same mma sequence, bit for bit
                model = tcm.mma_gemm_model(a_h, b_h, precision)
                assert np.array_equal(got, model), f"{version.label} {m}x{n}x{k}"


def test_block_tile_with_several_blocks_and_slices(rng):
    """Two blocks each way (64 x 32 of 32 x 16 tiles) and three K-slices: the double
    buffer's swap and the block offsets."""
    m, n, k = tcm.TILE.bm + 5, tcm.TILE.bn + 3, 3 * 2 * tcm.TILE.kw + 3
    _checked(tcm.versions("bf16")[1].launcher, "bf16", m, n, k, rng)


@pytest.mark.skipif(not is_simulator(), reason="replaces a simulator function")
def test_truncating_instead_of_rounding_is_caught(rng, monkeypatch):
    """Registers of raw float32 bits (no cvt.rna): the mma truncates them to TF32,
    an error the tolerance may admit but the bit-exact model does not. (Swapping
    pack's operands is no such test: it swaps the k pairs of A and B alike, and
    the sum is the same.)"""
    monkeypatch.setattr(tc, "to_tf32", lambda x: np.float32(x).view(np.uint32))
    wrong = tcm.make_mma_warp_tile("tf32")
    a_h, b_h, got = _checked(
        lambda a, b, c: tcm.launch_warp_tile(wrong, a, b, c), "tf32", 17, 9, 16, rng
    )
    assert not np.array_equal(got, tcm.mma_gemm_model(a_h, b_h, "tf32"))


def test_tolerance_is_derived_not_loose(rng):
    """The tolerance admits the rounding of the inputs and no more: a product that
    drops one K term, or reads B's rows one k off, fails it; an unrounded float32
    product passes it with room to spare."""
    m, n, k = 24, 16, 32
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b
    for precision in tcm.PRECISIONS:
        tol = tcm.tolerance(a, b, ref, tc.UNIT_ROUNDOFF[precision])
        err = np.linalg.norm(tcm.mma_gemm_model(a, b, precision) - ref) / np.linalg.norm(ref)
        assert err <= tol
        dropped = a[:, :-1].astype(np.float64) @ b[:-1]
        shifted = a.astype(np.float64) @ np.roll(b, 1, axis=0)
        for wrong in (dropped, shifted):
            assert np.linalg.norm(wrong - ref) / np.linalg.norm(ref) > tol, precision
    assert tcm.tolerance(a, b, ref, 2.0**-8) < 0.1  # BF16 at K = 32: O(K u), not O(1)


def test_bad_operands_are_refused_before_work():
    a = cuda.to_device(np.ones((4, 3), np.float32))
    b = cuda.to_device(np.ones((3, 5), np.float32))
    c = cuda.to_device(np.ones((4, 5), np.float32))
    with pytest.raises(TypeError):
        tcm.tc_matmul(np.ones((4, 3), np.float32), b, c)
    with pytest.raises(TypeError):
        tcm.tc_matmul(cuda.to_device(np.ones((4, 3))), b, c)
    with pytest.raises(ValueError, match="chain"):
        tcm.tc_matmul(a, cuda.to_device(np.ones((4, 5), np.float32)), c)
    with pytest.raises(ValueError, match="precision"):
        tcm.tc_matmul(a, b, c, precision="fp8")
    tcm.tc_matmul(a, b, c, precision="f16")
    assert np.array_equal(c.copy_to_host(), np.full((4, 5), 3.0, np.float32))


@pytest.mark.skipif(not tcm.has_wgmma(), reason="version 3 (wgmma) runs only on a Hopper GPU")
@pytest.mark.parametrize("precision", tcm.PRECISIONS)
@pytest.mark.parametrize("tile", tcm.WG_TILES, ids=str)
def test_wgmma_block_tile_with_several_blocks_and_slices(precision, tile, rng):
    """Version 3: two blocks and a partial one each way; more K-slices than stages
    and a partial one (every stage reused); one element; an odd K."""
    if precision != "tf32" and tile.b_layout != "nk":
        pytest.skip("BF16 / FP16 take B as (N, K)")
    per_word, _ = tcm.wg.PRECISIONS[precision]
    version = next(v for v in tcm.versions(precision) if v.number == 3 and v.launcher.tile == tile)
    launcher = version.launcher
    slices = tile.stages + 2
    for m, n, k in [
        (2 * tcm.WG_BM + 5, 2 * tile.bn + 3, slices * tcm.WG_KW * per_word + 3),
        (1, 1, 1),
        (130, 9, 70),
    ]:
        _checked(launcher, precision, m, n, k, rng, version.input_unit)
