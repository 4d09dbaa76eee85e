"""Tensor cores from Numba: PTX ``mma.sync`` and its operand conversions as intrinsics.

numba-cuda has no tensor-core API. A Numba *intrinsic* (``@intrinsic``) is a
function whose body is LLVM IR built at compile time; here each one is a single
PTX instruction written as LLVM inline assembly, so the kernel runs exactly the
instruction the PTX ISA documents, as CUDA C++'s ``asm volatile`` does (CUTLASS's
``cute/arch/mma_sm80.hpp`` does the same). All of it needs compute capability
8.0 or newer (``mma.sync`` with .tf32 / .bf16 operands, ``cvt.rna.tf32.f32``,
``cvt.rn.bf16x2.f32``): call :func:`require_tensor_cores` before launching.

==================================  =========  ==========================================
function                            PTX        per lane
==================================  =========  ==========================================
``mma_tf32_m16n8k8(a0..a3, b0, b1,  mma.sync   D[16x8] = A[16x8] @ B[8x8] + C, TF32 in,
c0..c3) -> (d0, d1, d2, d3)``                  FP32 accumulate
``mma_bf16_m16n8k16(...)``          mma.sync   D[16x8] = A[16x16] @ B[16x8] + C, BF16 in
``mma_f16_m16n8k16(...)``           mma.sync   the same with FP16 in
``to_tf32(x) -> uint32``            cvt.rna    a float32 rounded to TF32, as its bits
``pack_bf16x2(lo, hi) -> uint32``   cvt.rn     two float32 rounded to BF16, one register
``pack_f16x2(lo, hi) -> uint32``    cvt.rn     two float32 rounded to FP16, one register
==================================  =========  ==========================================

Registers ("words"): every A and B operand is a 32-bit register, a ``uint32``
in the kernel: one TF32 value (its float32 bits, low 13 bits zero) or two BF16
/ FP16 values (the lower k index in the low 16 bits). With words the three
instructions share one fragment layout (PTX ISA, "Matrix Fragments for
mma.m16n8k8" and "for mma.m16n8k16 with floating point type"): lane ``l``,
``g = l // 4``, ``t = l % 4``; ``Aw`` is A as a 16 x 8 matrix of words (row
i, word w holds A[i, w] for TF32 and A[i, 2w], A[i, 2w+1] for BF16/FP16),
``Bw`` is B transposed the same way, 8 columns n x 8 words (word w of
column n holds B[w, n], or B[2w, n] and B[2w+1, n])::

    a0 = Aw[g, t]    a1 = Aw[g+8, t]    a2 = Aw[g, t+4]    a3 = Aw[g+8, t+4]
    b0 = Bw[g, t]    b1 = Bw[g, t+4]
    c0 = C[g, 2t]    c1 = C[g, 2t+1]    c2 = C[g+8, 2t]    c3 = C[g+8, 2t+1]

and d0..d3 as c0..c3. ``mma.sync.aligned`` is warp-collective: all 32 lanes
of the warp must execute the same call (never inside a branch some lanes skip).

In the simulator (``NUMBA_ENABLE_CUDASIM=1``) the same names are Python
functions with the same semantics: the conversions round as the hardware does
(:func:`round_tf32_bits`, :func:`round_bf16_bits`, :func:`round_f16_bits`),
and an mma gathers the 32 lanes' registers (``common/internal/simulator.py``
runs such a kernel in turns, the call being a point where a warp meets), takes
the upper 19 bits of each TF32 register, computes the products exactly and
rounds the sum with C once to float32, and hands each lane its d0..d3. The
GPU's adder may round the sum differently (within K float32 roundings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .runtime import is_simulator

MIN_COMPUTE_CAPABILITY = (8, 0)

# --------------------------------------------------------------------------
# NumPy models of the conversions (the simulator's and the tests' ground truth)
# --------------------------------------------------------------------------


def round_tf32_bits(x: Any) -> np.ndarray:
    """float32 -> TF32 as ``cvt.rna.tf32.f32`` does: round to the nearest value
    with a 10-bit mantissa, ties away from zero; the result's float32 bits
    (uint32, low 13 bits zero). Infinities stay, a NaN becomes 0x7FFFFFFF.

    x: float32 array or scalar (anything else is converted to float32 first).
    Source: PTX ISA, "cvt" (.rna rounding, .tf32 destination).
    """
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    finite = (bits & 0x7F800000) != 0x7F800000
    nan = ~finite & ((bits & 0x007FFFFF) != 0)
    # Adding half a TF32 ulp to the magnitude bits rounds ties up in magnitude,
    # i.e. away from zero; a carry into the exponent is the right result too.
    rounded = np.where(finite, (bits + 0x1000) & 0xFFFFE000, bits)
    return np.where(nan, 0x7FFFFFFF, rounded).astype(np.uint32)


def round_bf16_bits(x: Any) -> np.ndarray:
    """float32 -> BF16 bits (uint16) as ``cvt.rn.bf16x2.f32`` rounds: to nearest,
    ties to even; a NaN becomes 0x7FFF. Source: PTX ISA, "cvt" (.rn, .bf16x2)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, 0x7FFF, rounded).astype(np.uint16)


def round_f16_bits(x: Any) -> np.ndarray:
    """float32 -> IEEE FP16 bits (uint16), to nearest, ties to even, overflow to
    infinity, as ``cvt.rn.f16x2.f32``. Source: PTX ISA, "cvt" (.rn, .f16x2)."""
    with np.errstate(over="ignore"):  # overflow to infinity is the documented result
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def tf32_value(bits: Any) -> np.ndarray:
    """The float32 value an mma reads from TF32 registers: the upper 19 bits
    (PTX ISA, "mma": .tf32 operands use the upper 19 bits; the rest are ignored)."""
    return (np.asarray(bits, np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def bf16_value(bits: Any) -> np.ndarray:
    """float32 value of BF16 bits (uint16): the upper half of a float32."""
    return (np.asarray(bits, np.uint32) << np.uint32(16)).view(np.float32)


def f16_value(bits: Any) -> np.ndarray:
    """float32 value of FP16 bits (uint16)."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------
# The compute capability check
# --------------------------------------------------------------------------


def check_compute_capability(capability: tuple[int, int]) -> None:
    """Raise RuntimeError unless ``capability`` (major, minor) is at least 8.0,
    the first with mma.sync on TF32 and BF16 (PTX ISA, "mma": "requires sm_80
    or higher")."""
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        major, minor = capability
        raise RuntimeError(
            f"tensor-core kernels need compute capability 8.0 or newer; this GPU is {major}.{minor}"
        )


def require_tensor_cores() -> None:
    """Raise RuntimeError before any work when the current GPU is older than
    compute capability 8.0 (Ampere). In the simulator it does nothing: the
    simulator runs the sm_80 semantics of every function here."""
    if is_simulator():
        return
    from numba import cuda

    check_compute_capability(cuda.get_current_device().compute_capability)


# --------------------------------------------------------------------------
# GPU: Numba intrinsics emitting inline PTX
# --------------------------------------------------------------------------

# D (4 x .f32), A (4 x .b32), B (2 x .b32), C (4 x .f32), as in the PTX ISA's
# examples: `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {d0,d1,d2,d3},
# {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};`. Constraints: "=f" a float32 output,
# "r" a 32-bit integer register, "f" a float32 input.
_MMA_OPERANDS = "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
_MMA_CONSTRAINTS = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"
MMA_PTX = {
    "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 " + _MMA_OPERANDS,
    "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " + _MMA_OPERANDS,
    "f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " + _MMA_OPERANDS,
}
TO_TF32_PTX = ("cvt.rna.tf32.f32 $0, $1;", "=r,f")
# cvt.rn.bf16x2.f32 d, a, b puts a (the FIRST source) in the upper half of d,
# so pack(lo, hi) passes (hi, lo).
PACK_PTX = {
    "bf16": ("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"),
    "f16": ("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"),
}


def _gpu_intrinsics() -> dict[str, Any]:
    """The intrinsics, built only where Numba compiles for a GPU."""
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    def make_mma(ptx: str) -> Any:
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, signature, args):
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                # side_effect: the asm is `volatile`, so LLVM never sinks the mma into
                # a branch only some lanes take (mma.sync needs the whole warp).
                asm = ir.InlineAsm(fnty, ptx, _MMA_CONSTRAINTS, side_effect=True)
                out = builder.call(asm, args)
                parts = [builder.extract_value(out, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, parts)

            return sig, codegen

        return intrinsic(mma)

    @intrinsic
    def to_tf32(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32]), *TO_TF32_PTX)
            return builder.call(asm, args)

        return sig, codegen

    def make_pack(ptx: str, constraints: str) -> Any:
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), ptx, constraints)
                return builder.call(asm, [args[1], args[0]])  # PTX: first source -> high half

            return sig, codegen

        return intrinsic(pack)

    return {
        "mma_tf32_m16n8k8": make_mma(MMA_PTX["tf32"]),
        "mma_bf16_m16n8k16": make_mma(MMA_PTX["bf16"]),
        "mma_f16_m16n8k16": make_mma(MMA_PTX["f16"]),
        "to_tf32": to_tf32,
        "pack_bf16x2": make_pack(*PACK_PTX["bf16"]),
        "pack_f16x2": make_pack(*PACK_PTX["f16"]),
    }


# --------------------------------------------------------------------------
# Simulator: the same semantics in Python
# --------------------------------------------------------------------------

_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def mma_words_reference(aw: np.ndarray, bw: np.ndarray, c: np.ndarray, precision: str):
    """D (16, 8) float32 = A @ B + C from word matrices, as the simulator's mma:
    ``aw`` (16, 8) and ``bw`` (8, 8) uint32 words (see the module docstring),
    ``c`` (16, 8) float32; ``precision`` "tf32", "bf16" or "f16". Products
    exact, the sum rounded once to float32."""
    a, bt = (
        _unpack(np.asarray(aw, np.uint32), precision),
        _unpack(np.asarray(bw, np.uint32), precision),
    )
    d = a.astype(np.float64) @ bt.astype(np.float64).T + np.asarray(c, np.float64)
    return d.astype(np.float32)


def _unpack(words: np.ndarray, precision: str) -> np.ndarray:
    """Rows of words -> rows of float32 values (one per word, or two: low half first)."""
    if precision == "tf32":
        return tf32_value(words)
    value = bf16_value if precision == "bf16" else f16_value
    out = np.empty(words.shape[:-1] + (2 * words.shape[-1],), np.float32)
    out[..., 0::2] = value((words & 0xFFFF).astype(np.uint16))
    out[..., 1::2] = value((words >> 16).astype(np.uint16))
    return out


class _SimulatedMma:
    """A warp-collective mma.sync in the simulator. The kernel's call becomes a
    point where the warp's 32 lanes meet (``common/internal/simulator.py``),
    which then calls :meth:`collective` once with every lane's operands."""

    _course_warp_collective = True  # simulator.WARP_COLLECTIVE

    def __init__(self, name: str, precision: str) -> None:
        self.__name__ = self.__qualname__ = name
        self.precision = precision

    def collective(self, lanes: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """lanes[i]: lane i's (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3); returns
        each lane's (d0, d1, d2, d3) as float32."""
        regs = np.array([[int(v) & 0xFFFFFFFF for v in lane[:6]] for lane in lanes], np.uint32)
        c_regs = np.array([lane[6:] for lane in lanes], np.float32)
        aw = np.zeros((16, 8), np.uint32)
        bw = np.zeros((8, 8), np.uint32)
        c = np.zeros((16, 8), np.float32)
        aw[_G, _T], aw[_G + 8, _T], aw[_G, _T + 4], aw[_G + 8, _T + 4] = regs[:, :4].T
        bw[_G, _T], bw[_G, _T + 4] = regs[:, 4:6].T
        c[_G, 2 * _T], c[_G, 2 * _T + 1], c[_G + 8, 2 * _T], c[_G + 8, 2 * _T + 1] = c_regs.T
        d = mma_words_reference(aw, bw, c, self.precision)
        parts = (d[_G, 2 * _T], d[_G, 2 * _T + 1], d[_G + 8, 2 * _T], d[_G + 8, 2 * _T + 1])
        return [tuple(np.float32(p[i]) for p in parts) for i in range(32)]

    def __call__(self, *operands: Any) -> Any:
        raise RuntimeError(
            f"{self.__name__} is warp-collective: in the simulator it runs only where "
            "the simulator can rewrite its kernel's source to meet the warp there (a "
            "call with positional arguments, in the kernel or a device function, not in "
            "a nested function or a comprehension, and not under interleaved_threads)"
        )


def _simulated_to_tf32(x: Any) -> np.uint32:
    return np.uint32(round_tf32_bits(np.float32(x)))


def _simulated_pack(round_bits: Any) -> Any:
    def pack(lo: Any, hi: Any) -> np.uint32:
        return np.uint32(int(round_bits(np.float32(lo))) | int(round_bits(np.float32(hi))) << 16)

    return pack


def _simulator_functions() -> dict[str, Any]:
    return {
        "mma_tf32_m16n8k8": _SimulatedMma("mma_tf32_m16n8k8", "tf32"),
        "mma_bf16_m16n8k16": _SimulatedMma("mma_bf16_m16n8k16", "bf16"),
        "mma_f16_m16n8k16": _SimulatedMma("mma_f16_m16n8k16", "f16"),
        "to_tf32": _simulated_to_tf32,
        "pack_bf16x2": _simulated_pack(round_bf16_bits),
        "pack_f16x2": _simulated_pack(round_f16_bits),
    }


_FUNCTIONS = _simulator_functions() if is_simulator() else _gpu_intrinsics()

mma_tf32_m16n8k8 = _FUNCTIONS["mma_tf32_m16n8k8"]
mma_tf32_m16n8k8.__doc__ = """D = A @ B + C on one warp, ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``.

A (16 x 8, row-major) and B (8 x 8, column-major) in TF32, C and D (16 x 8)
float32. Per lane: a0..a3 and b0, b1 uint32 (TF32 bits from :func:`to_tf32`),
c0..c3 float32; returns (d0, d1, d2, d3) float32. Layout (lane l, g = l // 4,
t = l % 4): a0 = A[g, t], a1 = A[g+8, t], a2 = A[g, t+4], a3 = A[g+8, t+4];
b0 = B[t, g], b1 = B[t+4, g]; c0 = C[g, 2t], c1 = C[g, 2t+1], c2 = C[g+8, 2t],
c3 = C[g+8, 2t+1]. All 32 lanes must call it together. Needs sm_80+.
Source: PTX ISA, "Matrix Fragments for mma.m16n8k8" (.tf32).
"""
mma_bf16_m16n8k16 = _FUNCTIONS["mma_bf16_m16n8k16"]
mma_bf16_m16n8k16.__doc__ = """D = A @ B + C on one warp, ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``.

A (16 x 16) and B (16 x 8) in BF16, two values a register
(:func:`pack_bf16x2`, lower k in the low half); C and D (16 x 8) float32.
Per lane (g = l // 4, t = l % 4): a0 = (A[g, 2t], A[g, 2t+1]),
a1 = (A[g+8, 2t], A[g+8, 2t+1]), a2 = (A[g, 2t+8], A[g, 2t+9]),
a3 = (A[g+8, 2t+8], A[g+8, 2t+9]); b0 = (B[2t, g], B[2t+1, g]),
b1 = (B[2t+8, g], B[2t+9, g]); c0..c3 and d0..d3 as in
:func:`mma_tf32_m16n8k8`. All 32 lanes must call it together. Needs sm_80+.
Source: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type".
"""
mma_f16_m16n8k16 = _FUNCTIONS["mma_f16_m16n8k16"]
mma_f16_m16n8k16.__doc__ = """D = A @ B + C on one warp, ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``.

As :func:`mma_bf16_m16n8k16` with IEEE FP16 operands (:func:`pack_f16x2`).
Needs sm_80+ (the instruction exists from sm_75 for .f16, but the course
checks 8.0 for all). Source: PTX ISA, "Matrix Fragments for mma.m16n8k16
with floating point type".
"""
to_tf32 = _FUNCTIONS["to_tf32"]
to_tf32.__doc__ = """float32 -> TF32 bits (uint32), ``cvt.rna.tf32.f32``: round to
a 10-bit mantissa, ties away from zero (model: :func:`round_tf32_bits`).
Needs sm_80+. Source: PTX ISA, "cvt"."""
pack_bf16x2 = _FUNCTIONS["pack_bf16x2"]
pack_bf16x2.__doc__ = """(lo, hi) float32 -> one uint32 holding BF16(lo) in bits 0-15
and BF16(hi) in bits 16-31, ``cvt.rn.bf16x2.f32`` (round to nearest even;
model: :func:`round_bf16_bits`). Needs sm_80+. Source: PTX ISA, "cvt"."""
pack_f16x2 = _FUNCTIONS["pack_f16x2"]
pack_f16x2.__doc__ = """(lo, hi) float32 -> one uint32 holding FP16(lo) in bits 0-15
and FP16(hi) in bits 16-31, ``cvt.rn.f16x2.f32`` (round to nearest even;
model: :func:`round_f16_bits`). Needs sm_80+. Source: PTX ISA, "cvt"."""

# precision -> (its mma, k values a register holds, k of one mma)
PRECISIONS = {
    "tf32": (mma_tf32_m16n8k8, 1, 8),
    "bf16": (mma_bf16_m16n8k16, 2, 16),
    "f16": (mma_f16_m16n8k16, 2, 16),
}
# unit roundoff of each input format: 2^-(p) for a p-bit significand incl. the hidden bit
UNIT_ROUNDOFF = {"tf32": 2.0**-11, "bf16": 2.0**-8, "f16": 2.0**-11}
