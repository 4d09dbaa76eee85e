"""common/wgmma.py: the shared-memory layout, descriptors and accumulator layout
(NumPy, everywhere), and one wgmma call per precision and N against them (Hopper)."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import wgmma as wg
from common.runtime import is_simulator

import numpy as np
import pytest

ON_HOPPER = False
if not is_simulator():
    from numba import cuda

    ON_HOPPER = tuple(cuda.get_current_device().compute_capability) == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="wgmma runs only on a Hopper GPU")


def _tile_words(rng, rows, precision):
    """(rows, 32) uint32 words of small random integers (exact in every precision and
    in float32 sums), none zero, and their values (rows, 32 * per_word) float64."""
    per_word, _ = wg.PRECISIONS[precision]
    values = rng.integers(1, 5, size=(rows, 32 * per_word)) * rng.choice(
        [-1, 1], (rows, 32 * per_word)
    )
    values = values.astype(np.float32)
    if precision == "tf32":
        return values.view(np.uint32), values.astype(np.float64)
    if precision == "bf16":  # small integers are exact in BF16: a float32's upper half
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:
        bits = values.astype(np.float16).view(np.uint16)
    words = bits[:, 0::2].astype(np.uint32) | (bits[:, 1::2].astype(np.uint32) << 16)
    return words, values.astype(np.float64)


def _image(a_words, b_words):
    """Shared memory as the kernels lay it out: A's rows, then B's, swizzled; A at 0."""
    smem = np.zeros((a_words.shape[0] + b_words.shape[0]) * wg.ROW_WORDS, np.uint32)
    for r in range(a_words.shape[0]):
        for w in range(wg.ROW_WORDS):
            smem[wg.swizzle_offset(r, w)] = a_words[r, w]
    b0 = a_words.shape[0] * wg.ROW_WORDS
    for r in range(b_words.shape[0]):
        for w in range(wg.ROW_WORDS):
            smem[b0 + wg.swizzle_offset(r, w)] = b_words[r, w]
    return smem


def test_swizzle_is_a_permutation_within_each_row():
    rows = np.arange(16)[:, None]
    words = np.arange(32)[None, :]
    offsets = wg.swizzle_offset(rows, words)
    assert np.array_equal(np.sort(offsets, axis=1), rows * 32 + words)
    # a warp storing one row, or 8 rows x 4 words, hits 32 different banks
    assert len(set(offsets[5] % 32)) == 32
    assert (
        len(set((wg.swizzle_offset(np.arange(8)[:, None], np.arange(4, 8)[None, :]) % 32).ravel()))
        == 32
    )


def test_descriptor_fields():
    for address in (0, 1024, 1024 + 32, 5 * 1024 + 96, 200 * 1024):
        f = wg.decode_descriptor(wg.make_descriptor_value(address))
        assert f == {
            "address": address,
            "leading": 16,
            "stride": 1024,
            "base_offset": 0,
            "swizzle": 1,
        }


@pytest.mark.parametrize("precision", list(wg.PRECISIONS))
def test_reference_reads_what_the_layout_stores(precision, rng):
    """Every K-step of a stored tile, read back through its descriptor, multiplies
    to the NumPy product of that K-slice; a tile stored without the swizzle does not."""
    n = 64
    (a_words, a), (b_words, b) = _tile_words(rng, 64, precision), _tile_words(rng, n, precision)
    smem = _image(a_words, b_words)
    per_word, k = wg.PRECISIONS[precision]
    for step in range(4):
        off = step * wg.K_STEP_BYTES
        got = wg.wgmma_reference(
            smem,
            wg.make_descriptor_value(off),
            wg.make_descriptor_value(64 * 128 + off),
            n,
            precision,
        )
        want = a[:, step * k : (step + 1) * k] @ b[:, step * k : (step + 1) * k].T
        assert np.array_equal(got, want)
    plain = np.concatenate([a_words.ravel(), b_words.ravel()])
    got = wg.wgmma_reference(
        plain, wg.make_descriptor_value(32), wg.make_descriptor_value(64 * 128 + 32), n, precision
    )
    assert not np.array_equal(got, a[:, k : 2 * k] @ b[:, k : 2 * k].T)


@pytest.mark.parametrize("n", wg.N_SIZES)
def test_accumulator_layout_covers_the_tile_once(n):
    rows, cols = wg.accumulator_positions(n)
    flat = (rows * n + cols).ravel()
    assert np.array_equal(np.sort(flat), np.arange(64 * n))
    # thread 37 (warp 1, g 1, t 1): d[0] = D[17, 2], d[3] = D[25, 3], d[4] = D[17, 10]
    assert (rows[37, 0], cols[37, 0]) == (17, 2)
    assert (rows[37, 3], cols[37, 3]) == (25, 3)
    assert (rows[37, 4], cols[37, 4]) == (17, 10)


def test_compute_capability_check():
    wg.check_compute_capability((9, 0))
    for cc in ((8, 0), (8, 9), (10, 0), (12, 0)):
        with pytest.raises(RuntimeError, match="Hopper"):
            wg.check_compute_capability(cc)


@pytest.mark.skipif(not is_simulator(), reason="the simulator's message")
def test_simulator_refuses_clearly():
    with pytest.raises(RuntimeError, match="simulator cannot run"):
        wg.require_wgmma()
    with pytest.raises(RuntimeError, match="simulator cannot run"):
        wg.intrinsic_named("wgmma_tf32_m64n128")


# --------------------------------------------------------------------------
# Hopper: one wgmma chain against the model
# --------------------------------------------------------------------------


def _one_tile_kernel(precision, n, steps):
    from numba import cuda, float32, uint32

    regs = n // 2
    size = (64 + n) * wg.ROW_WORDS + wg.ATOM_BYTES // 4
    mma = wg.intrinsic_named(f"wgmma_{precision}_m64n{n}")
    zeros = wg.intrinsic_named(f"wgmma_zeros_{n}")
    f = {
        k: wg.intrinsic_named(k)
        for k in (
            "shared_address",
            "make_descriptor",
            "fence_proxy_async",
            "wgmma_fence",
            "wgmma_commit",
            "wgmma_wait0",
            "store_accumulators",
        )
    }
    shared_address, make_descriptor = f["shared_address"], f["make_descriptor"]
    fence_proxy_async, wgmma_fence, wgmma_commit = (
        f["fence_proxy_async"],
        f["wgmma_fence"],
        f["wgmma_commit"],
    )
    wgmma_wait0, store_accumulators = f["wgmma_wait0"], f["store_accumulators"]
    swizzle = cuda.jit(device=True)(wg.swizzle_offset)

    @cuda.jit
    def one_tile(a_words, b_words, d):
        smem = cuda.shared.array(size, uint32)
        out = cuda.local.array(regs, float32)
        tid = cuda.threadIdx.x
        base = shared_address(smem)
        pad = ((uint32(1024) - (base & uint32(1023))) & uint32(1023)) >> uint32(2)
        for i in range(tid, 64 * 32, 128):
            smem[pad + swizzle(i >> 5, i & 31)] = a_words[i >> 5, i & 31]
        for i in range(tid, n * 32, 128):
            smem[pad + 64 * 32 + swizzle(i >> 5, i & 31)] = b_words[i >> 5, i & 31]
        fence_proxy_async()
        cuda.syncthreads()
        acc = zeros()
        wgmma_fence()
        for step in range(steps):
            acc = mma(
                acc,
                make_descriptor(uint32(base + 4 * pad + 32 * step)),
                make_descriptor(uint32(base + 4 * (pad + 64 * 32) + 32 * step)),
            )
        wgmma_commit()
        wgmma_wait0()
        store_accumulators(acc, out)
        for r in range(regs):
            d[tid, r] = out[r]

    return one_tile


@hopper_only
@pytest.mark.parametrize("precision", list(wg.PRECISIONS))
@pytest.mark.parametrize("n", wg.N_SIZES)
def test_one_wgmma_chain_on_hopper(precision, n, rng):
    """4 K-steps (a whole 128-byte row) of 64 x n: exact on small integers, so any
    layout, descriptor or accumulator-order mistake shows."""
    from numba import cuda

    (a_words, a), (b_words, b) = _tile_words(rng, 64, precision), _tile_words(rng, n, precision)
    d = cuda.to_device(np.full((128, n // 2), np.nan, np.float32))
    _one_tile_kernel(precision, n, 4)[1, 128](cuda.to_device(a_words), cuda.to_device(b_words), d)
    want = a @ b.T
    rows, cols = wg.accumulator_positions(n)
    np.testing.assert_array_equal(d.copy_to_host(), want[rows, cols].astype(np.float32))


def test_pipeline_intrinsics_refuses_a_short_pipeline_and_the_simulator():
    with pytest.raises(ValueError, match="3 to 6 stages"):
        wg.pipeline_intrinsics("tf32", 64, 2)
    if not wg.has_wgmma():
        with pytest.raises(RuntimeError, match="Hopper"):
            wg.pipeline_intrinsics("tf32", 64, 4)
    else:  # the fields name the intrinsics their roles say
        p = wg.pipeline_intrinsics("tf32", 64, 4)
        assert p.mma is wg.intrinsic_named("wgmma_tf32_m64n64")
        assert p.cp_async_wait is wg.intrinsic_named("cp_async_wait1")
        assert p.cp_async_16 is wg.intrinsic_named("cp_async_16")
