"""conv2 on Hopper's tensor cores in TF32: the forward, the input gradient and the
weight gradient as ``wgmma`` implicit GEMMs.

The capstone's FP32 kernels (:mod:`final_project.fast_conv`) read NCHW tensors
and multiply on the CUDA cores. With ``FastCNN(precision="tf32")`` conv2's three
GEMMs run here instead, on the tensor cores through the ``wgmma`` intrinsics of
:mod:`common.wgmma` (chapter 08, version 3, is the same pipeline for a plain
GEMM). The weight gradient (:func:`conv2d_grad_weight_tf32`, its own section
below) reads NCHW as it is; the other two read channels-last (NHWC) copies:

    forward       out (N, Co, H, W)  = conv(x, w) + b,   A = x in NHWC (N, H, W, Ci),
                                                          B = w as (Co, 3, 3, Ci)
    input grad    dx  (N, Ci, H, W)  = conv(dout, w flipped and transposed),
                                                          A = dout in NHWC (N, H, W, Co),
                                                          B = w as (Ci, 3, 3, Co)

Both are one GEMM of M = N*H*W output pixels, N = the output channels, K = 9 x the
gathered channels, in K-slices of 32 channels of one tap (kh, kw): with the gathered
tensor channels-last, each pixel's slice is 128 contiguous bytes, copied by eight
16-byte ``cp.async`` (zeros where the tap falls in the padding). That is why the
activations are given NHWC: in NCHW the same slice is 32 values 4 * H * W bytes
apart, gathered 4 bytes a copy, and the gather, not the tensor cores, sets the pace
(the README's TF32 table measures both). :func:`nchw_to_nhwc` converts, and
:func:`permute_conv_weights` writes both weight layouts.

A block is two warpgroups (256 threads) and computes 128 output pixels x all the
output channels; a 4-stage ``cp.async`` pipeline keeps two K-slices in flight
(chapter 08 version 3's schedule). The output is written NCHW, as the FP32 kernels
write it, so every other kernel of the step reads it unchanged. The forward adds the
bias and writes each block's batchnorm partial sums (sum and sum of squares per
channel, float64, around a shift as :func:`~final_project.fast_conv.shifted_sums`
explains), one row of ``bn_partials`` a block, in a fixed order (deterministic).

Precision: the tensor cores read the upper 19 bits of each float32 operand (TF32:
the 10-bit mantissa, truncated) and accumulate in float32, so a product is off by
up to 2 x 2^-10 relative: :func:`final_project.reference.tf32_operand` is the
NumPy model, which the capstone's float64 reference applies to these two GEMMs'
operands (``reference_forward(..., tf32=...)``).

GPU only: the wgmma instructions exist on compute capability 9.0 (H100, H200) and
the simulator runs no PTX; :func:`require_tf32_convs` says so before any work.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import wgmma as wg
from common.checking import EPS32, require_device_array, rounding_tolerance
from common.runtime import ceil_div, jit, sm_count

import functools
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from final_project.fast_conv import shifted_sums
from final_project.reference import TF32_UNIT

STAGES = 4  # shared-memory stages; two K-slices are loaded while one is multiplied
BM = 128  # output pixels a block: two warpgroups of 64
THREADS = 256
SLICE = 32  # channels a K-slice: one 128-byte swizzled row of float32
FULL_MASK = 0xFFFFFFFF


def tf32_tolerance(ref: Any, magnitude: Any, k: int) -> float:
    """Largest accepted ||out - ref|| / ||ref|| for a TF32 convolution (or GEMM)
    of K-term sums against its float64 ``ref``.

    ``magnitude``: the same convolution of |x| and |w| in float64 (|A| @ |B| of
    the im2col GEMM). Each product of two truncated operands is off by up to
    (2u + u^2) of its size (u = :data:`~final_project.reference.TF32_UNIT`) and the float32
    accumulation by K roundings of eps32 (the tensor cores' adder need not round
    to nearest); :func:`common.checking.rounding_tolerance` turns that into a
    relative error (Higham, *Accuracy and Stability of Numerical Algorithms*,
    2nd ed., sec. 3.1). A lost tap, channel or K-slice errs by O(1) and fails.
    """
    u = TF32_UNIT
    return rounding_tolerance(ref, magnitude, (2 * u + u * u) / EPS32 + k, tol=0.0)


# Channel counts the three kernels take: each is a wgmma N (forward: c_out, input
# gradient: c_in), c_in a whole number of 32-channel K-slices and c_out of the
# weight gradient's 64-row tiles.
C_IN_SIZES = (32, 64, 128, 256)
C_OUT_SIZES = (64, 128, 256)


def supported(c_in: int, c_out: int, h: int, w: int) -> str | None:
    """Why conv2 of these sizes cannot run here (a sentence), or None if it can:
    channel counts in :data:`C_IN_SIZES` and :data:`C_OUT_SIZES`, H and W < 256
    (a pixel's row and column are packed in one int), H * W a multiple of 4 (the
    weight gradient's 16-byte copies stay within an image)."""
    if c_in not in C_IN_SIZES:
        return f"c1 = {c_in}: the TF32 convolution needs c1 in {C_IN_SIZES}"
    if c_out not in C_OUT_SIZES:
        return f"c2 = {c_out}: the TF32 convolution needs c2 in {C_OUT_SIZES}"
    if not (0 < h < 256 and 0 < w < 256) or (h * w) % 4:
        return f"the TF32 convolution needs H, W below 256 and H * W a multiple of 4, got {h} x {w}"
    return None


def require_tf32_convs() -> None:
    """RuntimeError, saying what to do, unless wgmma can run (a Hopper GPU;
    :func:`common.wgmma.has_wgmma` asks without the error)."""
    try:
        wg.require_wgmma()
    except RuntimeError as e:
        raise RuntimeError(
            f"precision 'tf32' runs conv2 on wgmma: {e}. Use precision 'fp32'."
        ) from None


# ---------------------------------------------------------------------------
# Layout conversions
# ---------------------------------------------------------------------------

TR = 32  # transpose tile
TR_PADDED = TR + 1  # a padded row: a tile's column falls in 32 banks


@jit(cache=True)
def _nchw_to_nhwc(x, out, c, hw):
    """out[n, p, ch] = x[n, ch, p] (flat arrays), through a 32 x 33 shared tile
    (chapter 06's transpose): reads and writes are both 128-byte runs."""
    tile = cuda.shared.array((TR, TR_PADDED), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    p0, c0, n = cuda.blockIdx.x * TR, cuda.blockIdx.y * TR, cuda.blockIdx.z
    base = n * c * hw
    for r in range(ty, TR, 8):
        ch, p = c0 + r, p0 + tx
        if ch < c and p < hw:
            tile[r, tx] = x[base + ch * hw + p]
    cuda.syncthreads()
    for r in range(ty, TR, 8):
        p, ch = p0 + r, c0 + tx
        if p < hw and ch < c:
            out[base + p * c + ch] = tile[tx, r]


def nchw_to_nhwc(x, out, stream=0) -> None:
    """out (N, H, W, C) = x (N, C, H, W) permuted to channels-last; float32
    C-contiguous device arrays. Raises TypeError / ValueError on a wrong array."""
    require_device_array(x, "x", 4, np.float32)
    require_device_array(out, "out", 4, np.float32)
    n, c, h, w = x.shape
    if out.shape != (n, h, w, c):
        raise ValueError(f"out must have shape {(n, h, w, c)} for x {x.shape}, got {out.shape}")
    hw = h * w
    grid = (ceil_div(hw, TR), ceil_div(c, TR), n)
    _nchw_to_nhwc[grid, (TR, 8), stream](x.reshape(x.size), out.reshape(out.size), c, hw)


@jit(cache=True)
def _permute_weights(w, w_forward, w_grad_input, c_out, c_in):
    """w (Co, Ci, 9) -> w_forward (Co, 9, Ci) and w_grad_input (Ci, 9, Co)."""
    i = cuda.grid(1)
    if i < c_out * c_in * 9:
        co = i // (c_in * 9)
        r = i - co * c_in * 9
        ci = r // 9
        tap = r - ci * 9
        v = w[i]
        w_forward[(co * 9 + tap) * c_in + ci] = v
        w_grad_input[(ci * 9 + tap) * c_out + co] = v


def permute_conv_weights(w, w_forward, w_grad_input, stream=0) -> None:
    """The two weight layouts the TF32 kernels read, from w (Co, Ci, 3, 3):
    w_forward (Co, 3, 3, Ci) and w_grad_input (Ci, 3, 3, Co), float32 device
    arrays. One launch; the step calls it after each update (the weights change)."""
    require_device_array(w, "w", 4, np.float32)
    c_out, c_in, kh, kw = w.shape
    if (kh, kw) != (3, 3):
        raise ValueError(f"the TF32 convolution is 3 x 3, got w {w.shape}")
    for a, name, shape in (
        (w_forward, "w_forward", (c_out, 3, 3, c_in)),
        (w_grad_input, "w_grad_input", (c_in, 3, 3, c_out)),
    ):
        require_device_array(a, name, 4, np.float32)
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    size = w.size
    _permute_weights[ceil_div(size, 256), 256, stream](
        w.reshape(size), w_forward.reshape(size), w_grad_input.reshape(size), c_out, c_in
    )


# ---------------------------------------------------------------------------
# The implicit GEMM
# ---------------------------------------------------------------------------


@functools.cache
def make_conv3x3_wgmma(c_gather: int, n_out: int, h: int, w: int, forward: bool):
    """Factory: the kernel ``(x, wk, b, out, bn_partials, m_total)`` for one conv2
    shape; ``forward`` picks the forward (bias, batchnorm sums) or the input
    gradient (taps flipped, no bias, no sums: b and bn_partials unused).

    x: the gathered tensor NHWC, flat (N*H*W*c_gather); wk: (n_out, 3, 3, c_gather)
    flat; out: NCHW (N, n_out, H, W) flat; bn_partials: flat (P, 2, n_out) float64,
    P = ceil(m_total / BM); m_total = N*H*W. Launch ceil(m_total / BM) blocks of
    THREADS threads with ``kernel.shared_bytes`` of dynamic shared memory.
    """
    parts = c_gather // SLICE  # K-slices a tap
    k_total = 9 * c_gather
    hw = h * w
    slices = 9 * parts
    a_bytes = BM * 128
    stage_bytes = (BM + n_out) * 128
    regs = n_out // 2
    b_rows = max(1, n_out // 32)  # B rows a thread copies, 32 at a time
    rows = BM // 32  # A rows a thread copies
    sign = 1 if forward else -1  # the input gradient reads tap (kh, kw) at -(kh - 1, kw - 1)
    (
        mma,
        zeros,
        shared_address,
        make_descriptor,
        fence_proxy_async,
        wgmma_fence,
        wgmma_commit,
        wgmma_wait0,
        wgmma_wait1,
        store_accumulators,
        _,
        cp_async_16,
        cp_async_commit,
        cp_async_wait,
    ) = wg.pipeline_intrinsics("tf32", n_out, STAGES)
    swizzle = jit(device=True, forceinline=True)(wg.swizzle_offset)

    @jit(device=True, forceinline=True)
    def copy_slice(x, wk, stage, s, tid, bases, pos):
        """Queue K-slice s into a stage: A, 128 pixels x 32 channels of one tap;
        B, n_out rows x the same 32 values of k."""
        tap = s // parts
        part = s - parts * tap
        kh = tap // 3
        dh = sign * (kh - 1)
        dw = sign * (tap - 3 * kh - 1)
        chunk = tid & 7
        off = uint32(4 * swizzle(tid >> 3, 4 * chunk))
        shift = (dh * w + dw) * c_gather + SLICE * part + 4 * chunk
        for i in range(rows):
            p = pos[i]
            ih = (p >> 8) + dh
            iw = (p & 255) + dw
            ok = p >= 0 and ih >= 0 and ih < h and iw >= 0 and iw < w
            cp_async_16(
                stage + off + uint32(4096 * i),
                x,
                (bases[i] + shift) if ok else 0,
                uint32(16) if ok else uint32(0),
            )
        k = s * SLICE + 4 * chunk
        for i in range(b_rows):
            r = (tid >> 3) + 32 * i
            if r < n_out:
                cp_async_16(
                    stage + uint32(a_bytes) + off + uint32(4096 * i),
                    wk,
                    r * k_total + k,
                    uint32(16),
                )

    # not cached: its instructions come from common/wgmma.py, unseen by the cache key
    @jit(launch_bounds=(THREADS, 2))
    def conv3x3_wgmma(x, wk, b, out, bn_partials, m_total):
        smem = cuda.shared.array(0, uint32)
        red = cuda.shared.array((8, 2, n_out), float64)
        res = cuda.local.array(regs, float32)
        bases = cuda.local.array(rows, int32)
        pos = cuda.local.array(rows, int32)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        group = warp >> 2
        row0 = cuda.blockIdx.x * BM
        for i in range(rows):  # the pixels this thread copies: decoded once
            m = row0 + (tid >> 3) + 32 * i
            if m < m_total:
                p = m - (m // hw) * hw
                oh = p // w
                bases[i] = m * c_gather
                pos[i] = (oh << 8) | (p - oh * w)
            else:
                bases[i] = 0
                pos[i] = -1
        base = shared_address(smem)
        tiles = base + ((uint32(1024) - (base & uint32(1023))) & uint32(1023))
        for s in range(STAGES - 2):
            copy_slice(x, wk, tiles + uint32(s * stage_bytes), s, tid, bases, pos)
            cp_async_commit()
        acc = zeros()
        for s in range(slices):
            cp_async_wait()  # slice s has landed (this thread's copies) ...
            fence_proxy_async()  # ... is visible to the tensor cores ...
            cuda.syncthreads()  # ... and every thread's; stage s - 2 is free again
            stage = tiles + uint32((s % STAGES) * stage_bytes)
            a_d = stage + uint32(group * 64 * 128)
            b_d = stage + uint32(a_bytes)
            wgmma_fence()
            # the row's four K-steps of 8, written out: in a loop NVVM may keep the
            # accumulators in memory, and ptxas then serializes the wgmmas (C7515)
            acc = mma(acc, make_descriptor(a_d), make_descriptor(b_d))
            acc = mma(acc, make_descriptor(a_d + uint32(32)), make_descriptor(b_d + uint32(32)))
            acc = mma(acc, make_descriptor(a_d + uint32(64)), make_descriptor(b_d + uint32(64)))
            acc = mma(acc, make_descriptor(a_d + uint32(96)), make_descriptor(b_d + uint32(96)))
            wgmma_commit()
            ahead = s + STAGES - 2
            if ahead < slices:
                copy_slice(
                    x, wk, tiles + uint32((ahead % STAGES) * stage_bytes), ahead, tid, bases, pos
                )
            cp_async_commit()
            wgmma_wait1()  # slice s - 1's wgmmas are done: its stage may be refilled
        wgmma_wait0()
        store_accumulators(acc, res)
        g, t = lane >> 2, lane & 3
        wrow = row0 + group * 64 + (warp & 3) * 16  # this warp's rows: wrow + g (+ 8)
        m0, m1 = wrow + g, wrow + g + 8
        n0, n1 = m0 // hw, m1 // hw
        o0 = n0 * n_out * hw + (m0 - n0 * hw)
        o1 = n1 * n_out * hw + (m1 - n1 * hw)
        count = min(max(m_total - wrow, 0), 16)
        for j in range(n_out // 8):
            for e in range(2):
                c = 8 * j + 2 * t + e
                v0 = res[4 * j + e]
                v1 = res[4 * j + 2 + e]
                if forward:
                    v0 += b[c]
                    v1 += b[c]
                if m0 < m_total:
                    out[o0 + c * hw] = v0
                if m1 < m_total:
                    out[o1 + c * hw] = v1
                if forward:
                    # the warp's 16 rows of column c: shifted by row wrow's value, summed
                    # across the 8 lanes of this t (xor 4, 8, 16), finished in float64
                    shift = cuda.shfl_sync(FULL_MASK, v0, t)
                    d0 = v0 - shift if m0 < m_total else float32(0)
                    d1 = v1 - shift if m1 < m_total else float32(0)
                    s1 = d0 + d1
                    s2 = d0 * d0 + d1 * d1
                    for lanes in (4, 8, 16):
                        s1 += cuda.shfl_xor_sync(FULL_MASK, s1, lanes)
                        s2 += cuda.shfl_xor_sync(FULL_MASK, s2, lanes)
                    if g == 0:
                        total, total2 = shifted_sums(count, shift, s1, s2)
                        red[warp, 0, c] = total
                        red[warp, 1, c] = total2
        if forward:
            cuda.syncthreads()
            if tid < 2 * n_out:
                q = tid // n_out
                c = tid - q * n_out
                total = 0.0
                for wp in range(8):
                    total += red[wp, q, c]
                bn_partials[(cuda.blockIdx.x * 2 + q) * n_out + c] = total

    conv3x3_wgmma.shared_bytes = STAGES * stage_bytes + 1024  # + alignment to 1024
    return conv3x3_wgmma


def forward_partial_rows(n: int, h: int, w: int) -> int:
    """P, the rows of the TF32 forward's ``bn_partials`` (P, 2, Co): one a block
    of BM output pixels."""
    return ceil_div(n * h * w, BM)


def _launch(kernel, x, wk, b, out, bn_partials, m_total, stream) -> None:
    args = (x.reshape(x.size), wk.reshape(wk.size), b, out.reshape(out.size))
    args += (bn_partials.reshape(bn_partials.size), m_total)
    wg.allow_dynamic_shared_memory(kernel, args, kernel.shared_bytes)
    kernel[ceil_div(m_total, BM), THREADS, stream, kernel.shared_bytes](*args)


def _check_nhwc(x, name, shape):
    require_device_array(x, name, 4, np.float32)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (channels last), got {x.shape}")
    if not x.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous; copy it first")


def conv2d_forward_tf32(x_nhwc, w_forward, b, out, bn_partials, stream=0) -> None:
    """out (N, Co, H, W) = conv3x3(x, w) + b, pad 1, in TF32 on the tensor cores,
    and the batchnorm partial sums of out.

    x_nhwc (N, H, W, Ci) and w_forward (Co, 3, 3, Ci) float32 (:func:`nchw_to_nhwc`,
    :func:`permute_conv_weights`), b (Co,) float32, out (N, Co, H, W) float32 NCHW,
    bn_partials (P, 2, Co) float64 with P = :func:`forward_partial_rows`: row p sums
    output pixels p*BM .. p*BM + BM - 1 (NCHW order of (n, oh, ow)), [p, 0, c] their
    sum, [p, 1, c] their sum of squares. All device arrays; never synchronizes.

    Raises:
        RuntimeError: no Hopper GPU (:func:`require_tf32_convs`).
        TypeError, ValueError: a wrong array, or sizes :func:`supported` refuses.
    """
    require_tf32_convs()
    _check_nhwc(x_nhwc, "x_nhwc", x_nhwc.shape)
    n, h, w, c_in = x_nhwc.shape
    c_out = w_forward.shape[0]
    reason = supported(c_in, c_out, h, w)
    if reason:
        raise ValueError(reason)
    _check_nhwc(w_forward, "w_forward", (c_out, 3, 3, c_in))
    require_device_array(b, "b", 1, np.float32)
    if b.shape != (c_out,):
        raise ValueError(f"b must have shape {(c_out,)}, got {b.shape}")
    require_device_array(out, "out", 4, np.float32)
    if out.shape != (n, c_out, h, w):
        raise ValueError(f"out must have shape {(n, c_out, h, w)}, got {out.shape}")
    rows = forward_partial_rows(n, h, w)
    require_device_array(bn_partials, "bn_partials", 3, np.float64)
    if bn_partials.shape != (rows, 2, c_out):
        raise ValueError(f"bn_partials must have shape {(rows, 2, c_out)}, got {bn_partials.shape}")
    if n * h * w * max(c_in, c_out) >= 2**31:
        raise ValueError(f"batch {n} is too large for 32-bit offsets: split it")
    kernel = make_conv3x3_wgmma(c_in, c_out, h, w, True)
    _launch(kernel, x_nhwc, w_forward, b, out, bn_partials, n * h * w, stream)


def conv2d_grad_input_tf32(dout_nhwc, w_grad_input, dx, stream=0) -> None:
    """dx (N, Ci, H, W) = the gradient of conv3x3 (pad 1) with respect to its
    input, in TF32 on the tensor cores: dx[n, ci, i, j] = sum over co, kh, kw of
    dout[n, co, i + 1 - kh, j + 1 - kw] w[co, ci, kh, kw].

    dout_nhwc (N, H, W, Co) and w_grad_input (Ci, 3, 3, Co) float32
    (:func:`nchw_to_nhwc`, :func:`permute_conv_weights`), dx float32 NCHW. Device
    arrays; never synchronizes. Raises as :func:`conv2d_forward_tf32`.
    """
    require_tf32_convs()
    _check_nhwc(dout_nhwc, "dout_nhwc", dout_nhwc.shape)
    n, h, w, c_out = dout_nhwc.shape
    c_in = w_grad_input.shape[0]
    reason = supported(c_in, c_out, h, w)
    if reason:
        raise ValueError(reason)
    _check_nhwc(w_grad_input, "w_grad_input", (c_in, 3, 3, c_out))
    require_device_array(dx, "dx", 4, np.float32)
    if dx.shape != (n, c_in, h, w):
        raise ValueError(f"dx must have shape {(n, c_in, h, w)}, got {dx.shape}")
    if n * h * w * max(c_in, c_out) >= 2**31:
        raise ValueError(f"batch {n} is too large for 32-bit offsets: split it")
    kernel = make_conv3x3_wgmma(c_out, c_in, h, w, False)
    unused_b, unused_sums = _placeholders()
    _launch(kernel, dout_nhwc, w_grad_input, unused_b, dx, unused_sums, n * h * w, stream)


@functools.cache
def _placeholders():
    """(b, bn_partials) for the input gradient's launch, which reads neither."""
    return cuda.device_array(1, np.float32), cuda.device_array((1, 1, 1), np.float64)


# ---------------------------------------------------------------------------
# The weight gradient: a GEMM whose K is the batch's pixels
# ---------------------------------------------------------------------------

GW_THREADS = 384  # three warpgroups, three taps each
GW_WARPS = GW_THREADS // 32
GW_TAPS = 3  # taps a warpgroup: 3 x 32 channels = wgmma N of 96
GW_MIN_SLICES = 8  # K-slices a block at least (split-K: fewer blocks below that)
CI_ROUNDS = -(-SLICE // GW_WARPS)  # channels a warp copies for the B tile


@functools.cache
def make_conv3x3_grad_weight_wgmma(c_in: int, c_out: int, h: int, w: int):
    """Factory: the kernel ``(dout, x, partials, slices_per_block, k_total)`` for
    conv2's weight gradient in TF32,

        dw[co, ci, tap] = sum over pixels q of dout[q, co] * x[q shifted by tap, ci],

    as a GEMM of M = Co (tiles of 64, grid y), N = 9 taps x 32 input channels (one
    channel group a block, grid z), K = the N*H*W pixels, split over grid x.
    Both operands are read NCHW, where a row (a channel of an image) runs along K,
    as wgmma's TF32 operands must: dout by 16-byte copies (H*W is a multiple of 4,
    so a copy never spans two images), x shifted by each tap (and zero outside the
    image) by 4-byte copies, which that shift misaligns. The bias gradient (sum of
    dout per channel) is added from the shared-memory tiles in float32 on the way.

    partials (flat, float32): block (x, y, z)'s 64 x 288 product at
    ``((z * Y + y) * X + x) * 64 * 288``, [co][tap * 32 + ci]; then the bias sums,
    64 a block (y, x), after all the products. :func:`grad_weight_partials_size`.
    """
    hw = h * w
    a_bytes = 64 * 128
    n_cols = 9 * SLICE  # 288: the taps of 32 channels
    stage_bytes = a_bytes + n_cols * 128
    cols_wg = GW_TAPS * SLICE  # 96 columns a warpgroup
    regs = cols_wg // 2
    (
        mma,
        zeros,
        shared_address,
        make_descriptor,
        fence_proxy_async,
        wgmma_fence,
        wgmma_commit,
        wgmma_wait0,
        wgmma_wait1,
        store_accumulators,
        cp_async_4,
        cp_async_16,
        cp_async_commit,
        cp_async_wait,
    ) = wg.pipeline_intrinsics("tf32", cols_wg, STAGES)
    swizzle = jit(device=True, forceinline=True)(wg.swizzle_offset)

    @jit(device=True, forceinline=True)
    def copy_slice(dout, x, stage, s, tid, k_total, co0, ci0):
        """Queue K-slice s (pixels 32 s ..) into a stage: A = dout rows co0..co0+63,
        B = x's channels ci0.. shifted by each of the 9 taps."""
        q0 = s * SLICE
        for u in range(tid, 64 * 8, GW_THREADS):  # A: 64 rows x 8 chunks of 4 pixels
            row = u >> 3
            chunk = u & 7
            q = q0 + 4 * chunk
            ok = q < k_total
            n = q // hw
            src = (n * c_out + co0 + row) * hw + (q - n * hw)
            cp_async_16(
                stage + uint32(4 * swizzle(row, 4 * chunk)),
                dout,
                src if ok else 0,
                uint32(16) if ok else uint32(0),
            )
        lane, warp = tid & 31, tid >> 5
        q = q0 + lane  # B: this thread's pixel, its column of every row
        valid = q < k_total
        n = q // hw
        p = q - n * hw
        oh = p // w
        ow = p - oh * w
        base = n * c_in * hw + p
        b_stage = stage + uint32(a_bytes)
        for cc in range(CI_ROUNDS):  # channels warp, warp + 12, ...: a fixed count
            ci = warp + GW_WARPS * cc
            if ci >= SLICE:
                break
            chan = base + (ci0 + ci) * hw
            for tap in range(9):
                dh = tap // 3 - 1
                dw = tap % 3 - 1
                ih, iw = oh + dh, ow + dw
                ok = valid and ih >= 0 and ih < h and iw >= 0 and iw < w
                r = tap * SLICE + ci
                cp_async_4(
                    b_stage + uint32(4 * swizzle(r, lane)),
                    x,
                    (chan + dh * w + dw) if ok else 0,
                    uint32(4) if ok else uint32(0),
                )

    # not cached: its instructions come from common/wgmma.py, unseen by the cache key
    @jit(launch_bounds=(GW_THREADS, 1))
    def conv3x3_grad_weight_wgmma(dout, x, partials, slices_per_block, k_total):
        smem = cuda.shared.array(0, uint32)
        words = cuda.shared.array(0, float32)  # the same bytes, read as float32
        bias_parts = cuda.shared.array(256, float32)
        res = cuda.local.array(regs, float32)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        group = warp >> 2
        co0 = cuda.blockIdx.y * 64
        ci0 = cuda.blockIdx.z * SLICE
        slices_total = (k_total + SLICE - 1) // SLICE
        s0 = cuda.blockIdx.x * slices_per_block
        s1 = min(s0 + slices_per_block, slices_total)
        count = max(s1 - s0, 0)
        base = shared_address(smem)
        pad = (uint32(1024) - (base & uint32(1023))) & uint32(1023)
        tiles = base + pad
        for s in range(STAGES - 2):
            if s < count:
                copy_slice(dout, x, tiles + uint32(s * stage_bytes), s0 + s, tid, k_total, co0, ci0)
            cp_async_commit()
        acc = zeros()
        bias = float32(0)  # threads < 256: row tid // 4, words 8 (tid % 4) .. + 7
        for i in range(count):
            cp_async_wait()
            fence_proxy_async()
            cuda.syncthreads()
            stage = tiles + uint32((i % STAGES) * stage_bytes)
            a_d = stage
            b_d = stage + uint32(a_bytes + group * cols_wg * 128)
            wgmma_fence()
            # the row's four K-steps of 8, written out: in a loop NVVM may keep the
            # accumulators in memory, and ptxas then serializes the wgmmas (C7515)
            acc = mma(acc, make_descriptor(a_d), make_descriptor(b_d))
            acc = mma(acc, make_descriptor(a_d + uint32(32)), make_descriptor(b_d + uint32(32)))
            acc = mma(acc, make_descriptor(a_d + uint32(64)), make_descriptor(b_d + uint32(64)))
            acc = mma(acc, make_descriptor(a_d + uint32(96)), make_descriptor(b_d + uint32(96)))
            wgmma_commit()
            if tid < 256:
                first = (pad + uint32((i % STAGES) * stage_bytes)) >> 2  # the stage's word
                row = tid >> 2
                for j in range(8):
                    bias += words[first + swizzle(row, 8 * (tid & 3) + j)]
            ahead = i + STAGES - 2
            if ahead < count:
                stage_ahead = tiles + uint32((ahead % STAGES) * stage_bytes)
                copy_slice(dout, x, stage_ahead, s0 + ahead, tid, k_total, co0, ci0)
            cp_async_commit()
            wgmma_wait1()
        blocks = cuda.gridDim.x * cuda.gridDim.y * cuda.gridDim.z
        block = (cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x
        block += cuda.blockIdx.x
        # the bias sums, 4 threads a row (the z = 0 blocks: one per pixel range),
        # through shared memory: a shuffle here makes ptxas serialize the wgmmas (C7515)
        if tid < 256:
            bias_parts[tid] = bias
        cuda.syncthreads()
        if tid < 64 and cuda.blockIdx.z == 0:
            total = bias_parts[4 * tid] + bias_parts[4 * tid + 1]
            total += bias_parts[4 * tid + 2] + bias_parts[4 * tid + 3]
            partials[blocks * 64 * n_cols + block * 64 + tid] = total
        wgmma_wait0()
        store_accumulators(acc, res)
        out = block * 64 * n_cols
        g, t = lane >> 2, lane & 3
        row = (warp & 3) * 16 + g
        for j in range(cols_wg // 8):
            for e in range(2):
                col = group * cols_wg + 8 * j + 2 * t + e
                partials[out + row * n_cols + col] = res[4 * j + e]
                partials[out + (row + 8) * n_cols + col] = res[4 * j + 2 + e]

    conv3x3_grad_weight_wgmma.shared_bytes = STAGES * stage_bytes + 1024
    return conv3x3_grad_weight_wgmma


@jit(cache=True)
def _sum_grad_weight_partials(partials, grad_w, grad_b, blocks_x, c_in, c_out):
    """grad_w[co, ci, tap] and grad_b[co]: the split-K partials of
    :func:`make_conv3x3_grad_weight_wgmma` summed over grid x in order (float64)."""
    i = cuda.grid(1)
    n_cols = 9 * SLICE
    tiles_y = c_out // 64
    blocks = blocks_x * tiles_y * (c_in // SLICE)
    if i < c_out * c_in * 9:
        co = i // (c_in * 9)
        r = i - co * c_in * 9
        ci = r // 9
        tap = r - ci * 9
        y, row = co // 64, co % 64
        z, col = ci // SLICE, tap * SLICE + ci % SLICE
        first = (z * tiles_y + y) * blocks_x
        total = 0.0
        for bx in range(blocks_x):
            total += partials[((first + bx) * 64 + row) * n_cols + col]
        grad_w[i] = total
    elif i < c_out * c_in * 9 + c_out:
        co = i - c_out * c_in * 9
        y, row = co // 64, co % 64
        total = 0.0
        for bx in range(blocks_x):
            total += partials[blocks * 64 * n_cols + (y * blocks_x + bx) * 64 + row]
        grad_b[co] = total


def grad_weight_blocks(n: int, h: int, w: int) -> int:
    """Blocks along K (grid x) of the TF32 weight gradient at batch n: about one
    a streaming multiprocessor, each at least GW_MIN_SLICES K-slices."""
    slices = ceil_div(n * h * w, SLICE)
    return max(1, min(sm_count(), ceil_div(slices, GW_MIN_SLICES)))


def grad_weight_partials_size(n: int, c_in: int, c_out: int, h: int, w: int) -> int:
    """float32 elements of the ``partials`` scratch of :func:`conv2d_grad_weight_tf32`."""
    blocks = grad_weight_blocks(n, h, w) * (c_out // 64) * (c_in // SLICE)
    return blocks * 64 * 9 * SLICE + blocks * 64


def conv2d_grad_weight_tf32(dout, x, grad_w, grad_b, partials, stream=0) -> None:
    """grad_w (Co, Ci, 3, 3) and grad_b (Co,) of conv3x3 (pad 1): the products in
    TF32 on the tensor cores (split over the batch's pixels, partial sums added in
    a fixed order), the bias sums in float32 / float64.

    dout (N, Co, H, W) and x (N, Ci, H, W) float32 NCHW, as the step holds them;
    partials: float32, at least :func:`grad_weight_partials_size` elements. Device
    arrays; never synchronizes. Raises as :func:`conv2d_forward_tf32`.
    """
    require_tf32_convs()
    for a, name in ((dout, "dout"), (x, "x")):
        require_device_array(a, name, 4, np.float32)
        if not a.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous; copy it first")
    n, c_out, h, w = dout.shape
    c_in = x.shape[1]
    if x.shape != (n, c_in, h, w):
        raise ValueError(
            f"x must have shape {(n, c_in, h, w)} for dout {dout.shape}, got {x.shape}"
        )
    reason = supported(c_in, c_out, h, w)
    if reason:
        raise ValueError(reason)
    require_device_array(grad_w, "grad_w", 4, np.float32)
    if grad_w.shape != (c_out, c_in, 3, 3) or not grad_w.is_c_contiguous():
        raise ValueError(f"grad_w must be C-contiguous {(c_out, c_in, 3, 3)}, got {grad_w.shape}")
    require_device_array(grad_b, "grad_b", 1, np.float32)
    if grad_b.shape != (c_out,):
        raise ValueError(f"grad_b must have shape {(c_out,)}, got {grad_b.shape}")
    need = grad_weight_partials_size(n, c_in, c_out, h, w)
    require_device_array(partials, "partials", 1, np.float32)
    if partials.size < need:
        raise ValueError(f"partials must hold {need} float32 values, got {partials.size}")
    if n * h * w * max(c_in, c_out) >= 2**31:
        raise ValueError(f"batch {n} is too large for 32-bit offsets: split it")
    kernel = make_conv3x3_grad_weight_wgmma(c_in, c_out, h, w)
    k_total = n * h * w
    blocks_x = grad_weight_blocks(n, h, w)
    per_block = ceil_div(ceil_div(k_total, SLICE), blocks_x)
    args = (dout.reshape(dout.size), x.reshape(x.size), partials[:need], per_block, k_total)
    wg.allow_dynamic_shared_memory(kernel, args, kernel.shared_bytes)
    grid = (blocks_x, c_out // 64, c_in // SLICE)
    kernel[grid, GW_THREADS, stream, kernel.shared_bytes](*args)
    outputs = c_out * c_in * 9 + c_out
    _sum_grad_weight_partials[ceil_div(outputs, 256), 256, stream](
        partials[:need], grad_w.reshape(grad_w.size), grad_b, blocks_x, c_in, c_out
    )
