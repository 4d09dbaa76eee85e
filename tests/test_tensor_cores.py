"""common/tensor_cores.py: the mma.sync and cvt intrinsics, one warp one tile, against
NumPy models of the hardware's rounding; the simulator's warp meeting; the inline
PTX the GPU versions emit."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import tensor_cores as tc
from common.checking import EPS32, rounding_tolerance
from common.errors import BarrierError
from common.runtime import is_simulator

import numpy as np
import pytest
from numba import cuda, float32

PRECISIONS = ("tf32", "bf16", "f16")
MMA = {"tf32": tc.mma_tf32_m16n8k8, "bf16": tc.mma_bf16_m16n8k16, "f16": tc.mma_f16_m16n8k16}
PACK = {"bf16": tc.pack_bf16x2, "f16": tc.pack_f16x2}
ROUND_BITS = {"bf16": tc.round_bf16_bits, "f16": tc.round_f16_bits}
VALUE = {"bf16": tc.bf16_value, "f16": tc.f16_value}

# ----------------------------------------------------------- rounding models


def test_tf32_rounds_to_nearest_ties_away_from_zero():
    one = 1.0
    ulp = 2.0**-10  # TF32 keeps 10 mantissa bits
    cases = {
        one + ulp / 2: one + ulp,  # a tie: away from zero, not to even (1.0 is even)
        -(one + ulp / 2): -(one + ulp),
        one + 3 * ulp / 2: one + 2 * ulp,  # a tie from an odd mantissa
        one + ulp / 2 - 2.0**-23: one,  # just below the tie
        one + ulp / 2 + 2.0**-23: one + ulp,
        -(one + ulp / 4): -one,
        float(np.finfo(np.float32).max): np.inf,  # rounds past the largest TF32
    }
    x = np.array(list(cases), np.float32)
    want = np.array(list(cases.values()), np.float32)
    assert np.array_equal(tc.round_tf32_bits(x).view(np.float32), want)
    assert not np.any(tc.round_tf32_bits(x) & 0x1FFF), "TF32 leaves the low 13 bits zero"
    assert tc.round_tf32_bits(np.float32(np.nan)) == 0x7FFFFFFF


def test_bf16_and_f16_round_to_nearest_even():
    bf_ulp, h_ulp = 2.0**-7, 2.0**-10
    bf = {1 + bf_ulp / 2: 1.0, 1 + 3 * bf_ulp / 2: 1 + 2 * bf_ulp, -(1 + bf_ulp / 2): -1.0}
    h = {
        1 + h_ulp / 2: 1.0,
        1 + 3 * h_ulp / 2: 1 + 2 * h_ulp,
        -(1 + 3 * h_ulp / 2): -(1 + 2 * h_ulp),
    }
    x = np.array(list(bf), np.float32)
    assert np.array_equal(
        tc.bf16_value(tc.round_bf16_bits(x)), np.array(list(bf.values()), np.float32)
    )
    x = np.array(list(h), np.float32)
    assert np.array_equal(
        tc.f16_value(tc.round_f16_bits(x)), np.array(list(h.values()), np.float32)
    )
    assert tc.f16_value(tc.round_f16_bits(np.float32(70000.0))) == np.inf


def test_mma_reads_the_upper_19_bits_of_a_tf32_register():
    bits = np.array([0x3F800FFF], np.uint32)  # 1.0 plus low bits an mma ignores
    assert tc.tf32_value(bits)[0] == 1.0


# ----------------------------------------------------- conversions in a kernel


@cuda.jit
def convert(x, y, tf32_bits, bf16_pairs, f16_pairs):
    i = cuda.grid(1)
    if i < x.size:
        tf32_bits[i] = tc.to_tf32(x[i])
        bf16_pairs[i] = tc.pack_bf16x2(x[i], y[i])
        f16_pairs[i] = tc.pack_f16x2(x[i], y[i])


def _hostile_floats(rng):
    """Random values, and ties of each format (positive and negative)."""
    ties = [1 + 2.0**-11, -(1 + 2.0**-11), 1 + 3 * 2.0**-11, 1 + 2.0**-8, -(1 + 3 * 2.0**-8)]
    return np.concatenate([rng.standard_normal(59), ties]).astype(np.float32)


def test_conversions_bit_exact(rng):
    x = _hostile_floats(rng)
    y = rng.permutation(x)
    outs = [np.zeros(x.size, np.uint32) for _ in range(3)]
    convert[2, 32](x, y, *outs)
    tf32, bf, h = outs
    assert np.array_equal(tf32, tc.round_tf32_bits(x))
    # the FIRST argument (lo) in bits 0-15: cvt.rn.bf16x2.f32 takes its sources high first
    assert np.array_equal(bf & 0xFFFF, tc.round_bf16_bits(x))
    assert np.array_equal(bf >> 16, tc.round_bf16_bits(y))
    assert np.array_equal(h & 0xFFFF, tc.round_f16_bits(x))
    assert np.array_equal(h >> 16, tc.round_f16_bits(y))


# ------------------------------------------------------- one warp, one mma


def make_one_tile(precision):
    """One warp loads A (16, K) and B (K, 8) (float32) by the PTX ISA's fragment
    layout, in element terms, converts in the kernel and runs one mma with C."""
    mma = MMA[precision]
    if precision == "tf32":
        to_tf32 = tc.to_tf32

        @cuda.jit
        def one_tile(a, b, c, d):
            lane = cuda.threadIdx.x
            g, t = lane // 4, lane % 4
            r = mma(
                to_tf32(a[g, t]),
                to_tf32(a[g + 8, t]),
                to_tf32(a[g, t + 4]),
                to_tf32(a[g + 8, t + 4]),
                to_tf32(b[t, g]),
                to_tf32(b[t + 4, g]),
                c[g, 2 * t],
                c[g, 2 * t + 1],
                c[g + 8, 2 * t],
                c[g + 8, 2 * t + 1],
            )
            d[g, 2 * t] = r[0]
            d[g, 2 * t + 1] = r[1]
            d[g + 8, 2 * t] = r[2]
            d[g + 8, 2 * t + 1] = r[3]

        return one_tile
    pack = PACK[precision]

    @cuda.jit
    def one_tile_x2(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        k = 2 * t
        r = mma(
            pack(a[g, k], a[g, k + 1]),
            pack(a[g + 8, k], a[g + 8, k + 1]),
            pack(a[g, k + 8], a[g, k + 9]),
            pack(a[g + 8, k + 8], a[g + 8, k + 9]),
            pack(b[k, g], b[k + 1, g]),
            pack(b[k + 8, g], b[k + 9, g]),
            c[g, 2 * t],
            c[g, 2 * t + 1],
            c[g + 8, 2 * t],
            c[g + 8, 2 * t + 1],
        )
        d[g, 2 * t] = r[0]
        d[g, 2 * t + 1] = r[1]
        d[g + 8, 2 * t] = r[2]
        d[g + 8, 2 * t + 1] = r[3]

    return one_tile_x2


def rounded(x, precision):
    """x (float32) as the mma reads it after the kernel's conversion."""
    if precision == "tf32":
        return tc.tf32_value(tc.round_tf32_bits(x))
    return VALUE[precision](ROUND_BITS[precision](x))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_tile(precision, rng):
    k = 8 if precision == "tf32" else 16
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    make_one_tile(precision)[1, 32](a, b, c, d)
    assert not np.isnan(d).any(), "an element of D was never written"
    a64, b64 = rounded(a, precision).astype(np.float64), rounded(b, precision).astype(np.float64)
    exact = a64 @ b64 + c
    if is_simulator():  # products exact, one float32 rounding: the documented model
        assert np.array_equal(d, exact.astype(np.float32))
    else:  # the adder's rounding is the hardware's own: within K + 1 float32 ulps
        magnitude = np.abs(a64) @ np.abs(b64) + np.abs(c)
        assert np.all(np.abs(d - exact) <= (k + 1) * EPS32 * magnitude)
    # against the unrounded float64 product: rounding the inputs is what the tolerance allows
    ref = a.astype(np.float64) @ b + c
    u = tc.UNIT_ROUNDOFF[precision]
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b) + np.abs(c)
    tol = rounding_tolerance(ref, magnitude, (2 * u + u * u) / EPS32 + k + 1, tol=0.0)
    err = np.linalg.norm(d - ref) / np.linalg.norm(ref)
    assert err <= tol
    # the inputs' rounding shows: the float32 product of unrounded inputs differs
    assert not np.array_equal(d, (a.astype(np.float64) @ b + c).astype(np.float32))


def test_one_tile_catches_a_swapped_fragment(rng):
    """A kernel that swaps a1 and a2 (rows g+8 and columns t+4) still writes every
    element: only the comparison with A @ B catches it."""

    @cuda.jit
    def swapped(a, b, d):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        z = float32(0.0)
        r = tc.mma_tf32_m16n8k8(
            tc.to_tf32(a[g, t]),
            tc.to_tf32(a[g, t + 4]),
            tc.to_tf32(a[g + 8, t]),
            tc.to_tf32(a[g + 8, t + 4]),
            tc.to_tf32(b[t, g]),
            tc.to_tf32(b[t + 4, g]),
            z,
            z,
            z,
            z,
        )
        d[g, 2 * t] = r[0]
        d[g, 2 * t + 1] = r[1]
        d[g + 8, 2 * t] = r[2]
        d[g + 8, 2 * t + 1] = r[3]

    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    swapped[1, 32](a, b, d)
    ref = a.astype(np.float64) @ b
    assert np.linalg.norm(d - ref) / np.linalg.norm(ref) > 0.1


# ------------------------------------------------- the simulator's warp meeting


@cuda.jit
def mma_zeros(d, lanes_that_return):
    lane = cuda.threadIdx.x
    if lane < lanes_that_return:
        return
    z = float32(0.0)
    w = tc.to_tf32(z)
    r = tc.mma_tf32_m16n8k8(w, w, w, w, w, w, z, z, z, z)
    d[cuda.threadIdx.x] = r[0]


@pytest.mark.skipif(not is_simulator(), reason="the simulator's check (a GPU hangs or errs)")
def test_partial_warp_is_an_error():
    d = np.zeros(64, np.float32)
    with pytest.raises(BarrierError, match="16 of the 32 lanes"):
        mma_zeros[1, 16](d, 0)  # a block of 16 threads: half a warp
    with pytest.raises(BarrierError, match="returned or wait"):
        mma_zeros[1, 32](d, 4)  # 4 lanes returned before the mma
    mma_zeros[1, 64](d, 0)  # two whole warps meet separately
    assert not d.any()


@pytest.mark.skipif(not is_simulator(), reason="the simulator's own behaviour")
def test_direct_call_outside_a_kernel_says_why():
    with pytest.raises(RuntimeError, match="warp-collective"):
        tc.mma_tf32_m16n8k8(*([0] * 6 + [0.0] * 4))


# ------------------------------------------------------------ the GPU versions


def test_compute_capability_check():
    for ok in ((8, 0), (8, 6), (9, 0), (10, 0)):
        tc.check_compute_capability(ok)
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer; this GPU is 7.5"):
        tc.check_compute_capability((7, 5))
    tc.require_tensor_cores()  # the simulator, or the GPU the suite runs on (sm_80+)


class _Context:
    """The one method of Numba's lowering context the codegens use."""

    def make_tuple(self, builder, typ, values):
        from llvmlite import ir

        struct = ir.LiteralStructType([v.type for v in values])
        out = ir.Constant(struct, ir.Undefined)
        for i, v in enumerate(values):
            out = builder.insert_value(out, v, i)
        return out


def _emitted_ir(intrinsic, argtypes):
    """The LLVM IR an intrinsic's codegen emits for ``argtypes`` (no GPU needed)."""
    from llvmlite import ir

    sig, codegen = intrinsic._defn(None, *argtypes)
    lltype = {"float32": ir.FloatType(), "uint32": ir.IntType(32)}
    module = ir.Module()
    fn = ir.Function(
        module, ir.FunctionType(ir.VoidType(), [lltype[str(t)] for t in sig.args]), "f"
    )
    builder = ir.IRBuilder(fn.append_basic_block())
    codegen(_Context(), builder, sig, list(fn.args))
    builder.ret_void()
    return sig, str(module)


def test_gpu_versions_are_numba_intrinsics_emitting_this_ptx():
    from numba.core import types
    from numba.cuda.extending import _Intrinsic

    gpu = tc._gpu_intrinsics()
    assert all(isinstance(f, _Intrinsic) for f in gpu.values())
    mma_args = [types.uint32] * 6 + [types.float32] * 4
    for name, precision in (
        ("mma_tf32_m16n8k8", "tf32"),
        ("mma_bf16_m16n8k16", "bf16"),
        ("mma_f16_m16n8k16", "f16"),
    ):
        sig, text = _emitted_ir(gpu[name], mma_args)
        assert sig.return_type == types.UniTuple(types.float32, 4)
        assert tc.MMA_PTX[precision] in text and "sideeffect" in text
        assert '"=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"' in text
    sig, text = _emitted_ir(gpu["to_tf32"], [types.float32])
    assert sig.return_type == types.uint32 and "cvt.rna.tf32.f32 $0, $1;" in text
    for name, ptx in (("pack_bf16x2", "cvt.rn.bf16x2.f32"), ("pack_f16x2", "cvt.rn.f16x2.f32")):
        sig, text = _emitted_ir(gpu[name], [types.float32, types.float32])
        assert ptx in text and '"=r,f,f"' in text
        # the asm gets (hi, lo): %".2" is the second parameter (hi), first
        call = next(line for line in text.splitlines() if ptx in line)
        assert call.rstrip().endswith('(float %".2", float %".1")'), call


@pytest.mark.skipif(is_simulator(), reason="needs a GPU: reads the compiled PTX")
def test_compiled_kernel_contains_the_instructions():
    kernel = make_one_tile("bf16")
    a = np.ones((16, 16), np.float32)
    kernel[1, 32](a, a[:, :8].copy(), np.ones((16, 8), np.float32), np.ones((16, 8), np.float32))
    ptx = kernel.inspect_asm(kernel.signatures[0])
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cvt.rn.bf16x2.f32" in ptx
