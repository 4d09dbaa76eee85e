"""Hopper's warpgroup MMA from Numba: PTX ``wgmma.mma_async`` and its helpers as intrinsics.

``mma.sync`` (``common/tensor_cores.py``) is one warp multiplying operands it holds in
registers, 16 x 8 x 8 a call. Hopper (compute capability 9.0) adds ``wgmma``: a
*warpgroup* (four consecutive warps, 128 threads, the first warp's index a multiple
of 4) multiplies a 64 x N tile of A by an N-column tile of B, N up to 256, reading
both straight from shared memory through 64-bit *matrix descriptors*, and adds the
product into float32 accumulators spread over the warpgroup's registers. The call
returns at once (``mma_async``): the tensor cores run while the threads load the
next tiles, and ``wgmma_commit`` / ``wgmma_wait`` say when the results are needed.
One instruction does 64 x N x 8 (TF32) or 64 x N x 16 (BF16, FP16) multiply-adds,
up to 32 times what an mma.sync does, so the instructions around it (address
arithmetic, fragment loads) stop being the limit that they are for mma.sync in
Numba.

The instructions exist only on ``sm_90a`` (the "a" is for architecture-specific
features that later GPUs need not have; Blackwell replaces wgmma with tcgen05).
numba-cuda compiles a kernel for the GPU it launches on with the "a" suffix when the
compute capability is 9.0 or newer (``CUDACodeLibrary._ensure_cc``), so a kernel using
these functions compiles on an H100/H200 and fails to compile elsewhere:
:func:`require_wgmma` checks first and says so.

Shared memory layout (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory
Layout", 128-byte swizzle, K-major): a tile is rows of 128 bytes (32 registers'
words: 32 TF32 values, or 64 BF16 / FP16 values two a word, k along the row). Row
``r``'s 16-byte chunk ``c`` (words 4c..4c+3) is stored at chunk ``c ^ (r % 8)``
(:func:`swizzle_offset`), so eight consecutive rows form a 1024-byte "atom" whose
columns of chunks are spread over all 32 banks; the tile must start at a multiple
of 1024 bytes. Both A (64 rows of M) and B (N rows: B's columns) are K-major.

Descriptor (64 bits, :func:`make_descriptor`): bits 0-13 the start address in shared
memory / 16; bits 16-29 the leading-dimension byte offset / 16 (unused with a
128-byte swizzle whose rows hold the whole K of the instruction; 1 by convention);
bits 32-45 the stride byte offset / 16 (1024: from one 8-row atom to the next);
bits 62-63 the swizzle mode (1 = 128 bytes). The K-steps of a 128-byte row (4 of
them, 32 bytes each) are the same descriptor with the start address moved 32, 64,
96 bytes: the swizzle is applied to the address bits, as CUTLASS's descriptor
iterator does.

Accumulators (PTX ISA, "Matrix fragments for wgmma .m64nNk8/k16", D): warp ``q`` of
the warpgroup holds rows 16q..16q+15; lane ``l`` (g = l // 4, t = l % 4) holds, for
each 8-column block ``j`` of the N columns, four values::

    d[4j]   = D[16q + g,     8j + 2t]      d[4j+1] = D[16q + g,     8j + 2t + 1]
    d[4j+2] = D[16q + g + 8, 8j + 2t]      d[4j+3] = D[16q + g + 8, 8j + 2t + 1]

(mma.sync's C layout, repeated along N). In a kernel they are one Numba tuple of
N / 2 float32 (``wgmma_zeros``), passed into and returned from each call, so they
live in registers.

The order a kernel must keep (PTX ISA, "wgmma.fence", "wgmma.commit_group",
"wgmma.wait_group", and "fence.proxy.async"): ordinary stores to shared memory
are made visible to the tensor cores' "async proxy" with :func:`fence_proxy_async`
followed by a ``cuda.syncthreads()``; :func:`wgmma_fence` before the first wgmma
that reads accumulators written by other instructions; the wgmmas; then
:func:`wgmma_commit` closes a group, and :func:`wgmma_wait` (0 or 1 groups left
in flight) before the accumulators are read or a group's shared memory is
overwritten. All 128 threads of a warpgroup execute every one of these calls
together.

Copies (sm_80+, used to fill the tiles): ``cp_async_4`` / ``cp_async_16`` (dst shared
address, array, flat element index, bytes to read: the rest of the 4 or 16 written as
zeros, so edges need no branch) copy global memory straight to shared memory without
passing through registers; ``cp_async_commit`` closes a group of them and
``cp_async_wait{n}`` (n = 0..3) waits until at most n groups are still in flight.

The intrinsics, by name (:func:`intrinsic_named`): ``wgmma_{tf32,bf16,f16}_m64n{32,64,96,128,256}``
(acc, desc_a, desc_b) -> acc, ``wgmma_zeros_{32,64,96,128,256}``, ``make_descriptor``,
``shared_address``, ``store_accumulators``, ``fence_proxy_async``, ``wgmma_fence``,
``wgmma_commit``, ``wgmma_wait0``, ``wgmma_wait1``, ``cp_async_4``, ``cp_async_16``,
``cp_async_commit``, ``cp_async_wait0`` .. ``cp_async_wait3``.

No simulator: the Numba CUDA simulator cannot run PTX, and these calls are
asynchronous across a warpgroup, so a kernel using them runs only on an H100 /
H200. :func:`wgmma_reference` is the NumPy model of one call (descriptors decoded
against a shared-memory image), which the CPU tests check the layout helpers
against and the GPU tests check the hardware against.

Sources: PTX ISA 8.x, section "Asynchronous Warpgroup Level Matrix Multiply-
Accumulate Instructions"; CUTLASS ``cute/arch/mma_sm90_desc.hpp`` and
``mma_sm90_gmma.hpp`` (the same instructions from CUDA C++).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .runtime import is_simulator

WGMMA_COMPUTE_CAPABILITY = (9, 0)
ROW_BYTES = 128  # one swizzled row: 32 registers' words
ROW_WORDS = ROW_BYTES // 4
ATOM_BYTES = 8 * ROW_BYTES  # 8 rows: the swizzle pattern's period, and the stride offset
K_STEP_BYTES = 32  # K of one wgmma: 8 TF32 or 16 BF16 / FP16 values
N_SIZES = (32, 64, 96, 128, 256)
# precision -> (k values a register word holds, k of one wgmma)
PRECISIONS = {"tf32": (1, 8), "bf16": (2, 16), "f16": (2, 16)}
# Descriptor bits that do not depend on the address: leading byte offset 1 (unused
# with the 128-byte swizzle), stride byte offset 1024 / 16, swizzle mode 1 (128 B).
_DESCRIPTOR_CONSTANT = (1 << 16) | ((ATOM_BYTES >> 4) << 32) | (1 << 62)


def swizzle_offset(row: Any, word: Any) -> Any:
    """Word offset of (row, word) in a 128-byte-swizzled K-major tile: row * 32 +
    ((word // 4) ^ (row % 8)) * 4 + word % 4. Plain integer arithmetic: the
    kernels call it as a device function, the tests on NumPy arrays."""
    return row * ROW_WORDS + (((word >> 2) ^ (row & 7)) << 2) + (word & 3)


def make_descriptor_value(address: int) -> int:
    """The 64-bit descriptor (a Python int) of a 128-byte-swizzled K-major tile whose
    first row starts at shared-memory byte ``address`` (a multiple of 1024 plus a
    K-step's 0, 32, 64 or 96 bytes)."""
    return ((int(address) & 0x3FFFF) >> 4) | _DESCRIPTOR_CONSTANT


def decode_descriptor(descriptor: int) -> dict[str, int]:
    """The fields of a descriptor: start address, leading and stride byte offsets
    (bytes), base offset and swizzle mode."""
    d = int(descriptor)
    return {
        "address": (d & 0x3FFF) << 4,
        "leading": ((d >> 16) & 0x3FFF) << 4,
        "stride": ((d >> 32) & 0x3FFF) << 4,
        "base_offset": (d >> 49) & 7,
        "swizzle": (d >> 62) & 3,
    }


def _operand_words(smem: np.ndarray, descriptor: int, rows: int) -> np.ndarray:
    """The (rows, 8) registers' words one wgmma reads through ``descriptor`` from the
    shared-memory image ``smem`` (uint32 words, byte address = 4 * index)."""
    f = decode_descriptor(descriptor)
    if f["swizzle"] != 1 or f["stride"] != ATOM_BYTES:
        raise ValueError(f"only the 128-byte swizzle with a 1024-byte stride is modelled: {f}")
    out = np.empty((rows, K_STEP_BYTES // 4), np.uint32)
    for r in range(rows):
        for w in range(K_STEP_BYTES // 4):
            # unswizzled byte address, then bits 4-6 XOR bits 7-9 (the swizzle)
            byte = f["address"] + (r // 8) * f["stride"] + (r % 8) * ROW_BYTES + 4 * w
            byte ^= ((byte >> 7) & 7) << 4
            out[r, w] = smem[byte // 4]
    return out


def _values(words: np.ndarray, precision: str) -> np.ndarray:
    """(rows, 8) words -> (rows, k) float64 values, lower k first in a word."""
    if precision == "tf32":  # the tensor cores read the upper 19 bits
        return (words & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    half = np.empty(words.shape + (2,), np.uint16)
    half[..., 0], half[..., 1] = words & 0xFFFF, words >> 16
    half = half.reshape(words.shape[0], -1)
    if precision == "bf16":
        return (half.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return half.view(np.float16).astype(np.float64)


def wgmma_reference(
    smem: np.ndarray, desc_a: int, desc_b: int, n: int, precision: str
) -> np.ndarray:
    """What one ``wgmma.mma_async.m64nNk8`` (TF32) / ``k16`` (BF16, FP16) adds to its
    accumulators: A (64 x k, from ``desc_a``) @ B (k x n, B's columns from
    ``desc_b``), float64 (64, n). ``smem``: the block's shared memory as uint32 words
    (descriptor addresses are byte offsets into it)."""
    a = _values(_operand_words(smem, desc_a, 64), precision)
    b = _values(_operand_words(smem, desc_b, n), precision)
    return a @ b.T


def accumulator_positions(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): int arrays of shape (128, n // 2), the D element thread ``i`` of
    the warpgroup holds in accumulator ``r`` (the layout in the module docstring)."""
    thread = np.arange(128)[:, None]
    r = np.arange(n // 2)[None, :]
    q, g, t = thread // 32, (thread % 32) // 4, thread % 4
    rows = 16 * q + g + 8 * ((r % 4) // 2)
    cols = 8 * (r // 4) + 2 * t + r % 2
    return np.broadcast_to(rows, (128, n // 2)), np.broadcast_to(cols, (128, n // 2))


# --------------------------------------------------------------------------
# The compute capability check
# --------------------------------------------------------------------------


def check_compute_capability(capability: tuple[int, int]) -> None:
    """Raise RuntimeError unless ``capability`` is 9.0 (Hopper): wgmma is an sm_90a
    feature, absent before and after."""
    if tuple(capability) != WGMMA_COMPUTE_CAPABILITY:
        major, minor = capability
        raise RuntimeError(
            f"wgmma kernels need a Hopper GPU (compute capability 9.0, e.g. H100 or H200); "
            f"this GPU is {major}.{minor}. Use the mma.sync versions instead (sm_80+)."
        )


def require_wgmma() -> None:
    """Raise RuntimeError before any work unless the current GPU is a Hopper GPU;
    in the simulator, RuntimeError too (it cannot run wgmma)."""
    if is_simulator():
        raise RuntimeError(
            "wgmma kernels run only on a Hopper GPU; the CUDA simulator cannot run them"
        )
    from numba import cuda

    check_compute_capability(cuda.get_current_device().compute_capability)


def has_wgmma() -> bool:
    """True where wgmma kernels run (a Hopper GPU): :func:`require_wgmma` without
    the error, for skipping and for choosing."""
    try:
        require_wgmma()
    except RuntimeError:
        return False
    return True


def allow_dynamic_shared_memory(kernel: Any, args: tuple, nbytes: int) -> None:
    """:func:`set_dynamic_shared_memory` for the types of ``args`` (the launch's
    arguments), once per kernel and types: the answers are kept on the kernel."""
    from numba import typeof

    types = tuple(typeof(a) for a in args)
    done = kernel.__dict__.setdefault("_course_shared_memory_allowed", set())
    if types not in done:
        set_dynamic_shared_memory(kernel, types, nbytes)
        done.add(types)


def set_dynamic_shared_memory(kernel: Any, argument_types: tuple, nbytes: int) -> None:
    """Compile ``kernel`` for ``argument_types`` and allow it ``nbytes`` of dynamic
    shared memory (above the 48 KiB a launch gets without asking:
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``, CUDA Driver API)."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = kernel.compile(argument_types)
    function = compiled.library.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, int(nbytes), function.handle, function.device.id)


# --------------------------------------------------------------------------
# GPU: the intrinsics
# --------------------------------------------------------------------------


def _wgmma_ptx(precision: str, n: int) -> str:
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    a, b, scale = 2 * regs, 2 * regs + 1, 2 * regs + 2
    _, k = PRECISIONS[precision]
    # BF16 / FP16 take two more immediates, the transposes (0: both K-major).
    tail = ", 1, 1" if precision == "tf32" else ", 1, 1, 0, 0"
    return (
        f"{{ .reg .pred p; setp.ne.b32 p, ${scale}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{precision}.{precision} "
        f"{{{outs}}}, ${a}, ${b}, p{tail}; }}"
    )


def _gpu_intrinsics() -> dict[str, Any]:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.cuda.extending import intrinsic

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)

    def asm_statement(text: str) -> Any:
        """An intrinsic () -> None emitting ``text``; volatile, and a memory clobber so
        LLVM moves no shared-memory access across it."""

        def statement(typingctx):
            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return intrinsic(statement)

    @intrinsic
    def shared_address(typingctx, array):
        """uint32 byte address of array[0] in the shared-memory window."""
        sig = types.uint32(array)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            generic = builder.ptrtoint(data, i64)
            asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
            return builder.trunc(builder.call(asm, [generic]), i32)

        return sig, codegen

    @intrinsic
    def make_descriptor(typingctx, address):
        """uint32 shared address -> the uint64 descriptor (make_descriptor_value)."""
        sig = types.uint64(types.uint32)

        def codegen(context, builder, signature, args):
            field = builder.and_(
                builder.lshr(args[0], ir.Constant(i32, 4)), ir.Constant(i32, 0x3FFF)
            )
            return builder.or_(builder.zext(field, i64), ir.Constant(i64, _DESCRIPTOR_CONSTANT))

        return sig, codegen

    def make_zeros(regs: int) -> Any:
        def zeros(typingctx):
            ret = types.UniTuple(types.float32, regs)

            def codegen(context, builder, signature, args):
                zero = context.get_constant(types.float32, 0.0)
                return context.make_tuple(builder, ret, [zero] * regs)

            return ret(), codegen

        return intrinsic(zeros)

    def make_wgmma(precision: str, n: int) -> Any:
        regs = n // 2
        text = _wgmma_ptx(precision, n)
        constraints = ",".join(
            ["=f"] * regs + [str(i) for i in range(regs)] + ["l", "l", "r", "~{memory}"]
        )

        def wgmma(typingctx, acc, desc_a, desc_b):
            acc_type = types.UniTuple(types.float32, regs)
            sig = acc_type(acc_type, types.uint64, types.uint64)

            def codegen(context, builder, signature, args):
                values = [builder.extract_value(args[0], i) for i in range(regs)]
                fnty = ir.FunctionType(
                    ir.LiteralStructType([f32] * regs), [f32] * regs + [i64, i64, i32]
                )
                asm = ir.InlineAsm(fnty, text, constraints, side_effect=True)
                out = builder.call(asm, values + [args[1], args[2], ir.Constant(i32, 1)])
                parts = [builder.extract_value(out, i) for i in range(regs)]
                return context.make_tuple(builder, signature.return_type, parts)

            return sig, codegen

        return intrinsic(wgmma)

    @intrinsic
    def store_accumulators(typingctx, acc, out):
        """out[i] = acc[i] for every i: a tuple's values into a (local) array."""
        sig = types.void(acc, out)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[1])(context, builder, args[1]).data
            for i in range(signature.args[0].count):
                value = builder.extract_value(args[0], i)
                builder.store(value, cgutils.gep(builder, data, i))
            return context.get_dummy_value()

        return sig, codegen

    def make_wait(groups: int) -> Any:
        return asm_statement(f"wgmma.wait_group.sync.aligned {groups};")

    def make_cp_async(size: int, cache: str) -> Any:
        """An intrinsic (dst, array, index, nbytes): copy ``size`` bytes from
        array.flat[index] on (``size``-byte aligned) to shared byte address dst,
        without passing through registers; only the first nbytes (0..size) are
        read, the rest written as zeros (nbytes 0 reads nothing)."""
        text = f"cp.async.{cache}.shared.global [$0], [$1], {size}, $2;"

        def cp_async(typingctx, dst, array, index, nbytes):
            sig = types.void(types.uint32, array, types.int64, types.uint32)

            def codegen(context, builder, signature, args):
                data = context.make_array(signature.args[1])(context, builder, args[1]).data
                source = builder.ptrtoint(builder.gep(data, [args[2]]), i64)
                fnty = ir.FunctionType(ir.VoidType(), [i32, i64, i32])
                asm = ir.InlineAsm(fnty, text, "r,l,r,~{memory}", side_effect=True)
                builder.call(asm, [args[0], source, args[3]])
                return context.get_dummy_value()

            return sig, codegen

        return intrinsic(cp_async)

    functions = {
        "shared_address": shared_address,
        "make_descriptor": make_descriptor,
        "store_accumulators": store_accumulators,
        "fence_proxy_async": asm_statement("fence.proxy.async.shared::cta;"),
        "wgmma_fence": asm_statement("wgmma.fence.sync.aligned;"),
        "wgmma_commit": asm_statement("wgmma.commit_group.sync.aligned;"),
        "wgmma_wait0": make_wait(0),
        "wgmma_wait1": make_wait(1),
        # .ca (through L1) is the only form for 4 bytes; .cg (L2 only) for 16
        "cp_async_4": make_cp_async(4, "ca"),
        "cp_async_16": make_cp_async(16, "cg"),
        "cp_async_commit": asm_statement("cp.async.commit_group;"),
    }
    for groups in range(4):
        functions[f"cp_async_wait{groups}"] = asm_statement(f"cp.async.wait_group {groups};")
    for n in N_SIZES:
        functions[f"wgmma_zeros_{n}"] = make_zeros(n // 2)
        for precision in PRECISIONS:
            functions[f"wgmma_{precision}_m64n{n}"] = make_wgmma(precision, n)
    return functions


_FUNCTIONS: dict[str, Any] = {} if is_simulator() else _gpu_intrinsics()


def intrinsic_named(name: str) -> Any:
    """The GPU intrinsic ``name`` (e.g. ``"wgmma_tf32_m64n128"``); RuntimeError in the
    simulator, which has none of them."""
    if name not in _FUNCTIONS:
        require_wgmma()
        raise KeyError(f"no wgmma intrinsic {name!r}; have {sorted(_FUNCTIONS)}")
    return _FUNCTIONS[name]


class Pipeline(NamedTuple):
    """The intrinsics of one wgmma kernel with a ``cp.async`` pipeline, by role
    (:func:`pipeline_intrinsics`). A kernel factory unpacks them into local names,
    which Numba then compiles as calls: ``mma, zeros, ... = pipeline_intrinsics(...)``."""

    mma: Any  # (acc, desc_a, desc_b) -> acc: one wgmma of the precision and N
    zeros: Any  # () -> acc of zeros
    shared_address: Any
    make_descriptor: Any
    fence_proxy_async: Any
    wgmma_fence: Any
    wgmma_commit: Any
    wgmma_wait0: Any
    wgmma_wait1: Any
    store_accumulators: Any
    cp_async_4: Any
    cp_async_16: Any
    cp_async_commit: Any
    cp_async_wait: Any  # wait until at most stages - 3 groups are in flight


def pipeline_intrinsics(precision: str, n: int, stages: int) -> Pipeline:
    """The intrinsics a kernel of ``stages`` shared-memory stages (3 or more: two
    slices in flight past the one multiplied, less one) needs, for wgmma in
    ``precision`` with N = ``n``. RuntimeError in the simulator."""
    if not 3 <= stages <= 6:
        raise ValueError(f"a pipeline needs 3 to 6 stages, got {stages}")
    return Pipeline(
        intrinsic_named(f"wgmma_{precision}_m64n{n}"),
        intrinsic_named(f"wgmma_zeros_{n}"),
        *(intrinsic_named(name) for name in Pipeline._fields[2:-1]),
        intrinsic_named(f"cp_async_wait{stages - 3}"),
    )
