"""The fast capstone kernels around the convolutions: fused, tiled, few launches.

The naive kernels (:mod:`final_project.kernels`) give each output element a
thread and each op a kernel; what made them slow (capstone README) was the
per-channel reductions done by one thread a channel, and one pass over memory
per op. Each kernel here names the idea it adds over its naive twin:

    bn_stats_finalize           block per channel: sums the conv epilogue's per-block
                                partial sums (float64), writes mean, 1/std, the running
                                statistics and the folded affine scale/shift
    bn_eval_scale_shift         thread per channel: scale/shift from the running statistics
    bn_relu_maxpool_forward     thread per pooled output: BN apply + ReLU + 2x2 max-pool in
                                one pass (reads the conv output once, writes a quarter of
                                it); keeps the window position of the max as int8 and, in
                                training, the winner's conv output (zwin)
    bn_relu_maxpool_backward_reduce  block per (channel, images): pool scatter + ReLU mask
                                + xhat recomputed from the conv output, summed into
                                per-block partials of dgamma and dbeta (no xhat is stored);
                                the capstone's step streams dpooled and zwin instead
                                (bn_relu_maxpool_backward_reduce_winners): two coalesced
                                reads of pooled size, no gather through the argmax
    bn_backward_finalize        block per channel: partials -> dgamma, dbeta
    bn_relu_maxpool_backward_dx thread per conv output: the same scatter and mask, then
                                the closed-form batchnorm input gradient, in one pass
    gemm_splitk (3 layouts)     chapter 08's register-tiled SGEMM (128x128 tile a block, 8x8
                                a thread, 64x64 and 4x4 for small products; fragments of 4:
                                per k, TM/4 + TN/4 LDS.128 feed TM*TN FMAs; operands double-
                                buffered through registers), K split across blocks into
                                partial sums (so skinny linear layers still fill the GPU);
                                linear forward, weight gradient (+ bias gradient as a column
                                of ones), input gradient (unsplit: writes dx itself)
    splitk_reduce_bias          OUTS outputs x LANES lanes of chunks a block: the S partials
                                of each output summed in a fixed order, + bias (+ReLU)
    splitk_reduce_weight_bias   OUTS weights x LANES lanes of chunks a block: the S partials
                                of each weight summed in float64 in a fixed order, the last
                                column to the bias gradient (the linear layers' and the
                                convolutions' weight gradients, fast_conv.py)
    classifier_fused            block per 8 rows: fc2 forward, log-softmax, NLL row loss,
                                dlogits = (softmax - onehot)/N and fc1's ReLU-masked input
                                gradient, all from one read of the hidden activations
    mean_reduce                 one block: the batch's mean loss (float64 tree, deterministic)

Every reduction over the batch goes through per-block partial sums reduced by a
second kernel in a fixed order, never through atomics, so a step gives the
same bits every run. Sums longer than a few thousand terms are combined in
float64. Compared with the naive kernels the *order* of summation differs, so
results agree to float32 rounding (relative 1e-6), not bit for bit.

Launchers take device arrays and a stream, allocate nothing and never
synchronize: the model captures a whole training step of them into one CUDA
graph. Sources: batchnorm forward and backward as in Ioffe and Szegedy 2015
(section 3); split-K GEMM as in NVIDIA CUTLASS ("GEMM API: split-K"); the
fused classifier as in llm.c's ``fused_classifier`` (Karpathy 2024).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import ceil_div, jit, pick, sm_count

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, float64, int32, uint64

THREADS = pick(gpu=256, simulator=32)  # elementwise kernels: threads per block
REDUCE_THREADS = pick(gpu=128, simulator=16)  # per-channel finalize blocks

# ---------------------------------------------------------------------------
# Batchnorm statistics from the convolution's per-block partial sums
# ---------------------------------------------------------------------------


@cuda.jit(device=True)
def tree_sum_pair(s0, s1, t, size):
    """Add up s0[:size] and s1[:size] (shared, float64) into s0[0], s1[0].

    The caller has stored one value per thread in each and synchronised; a
    shared-memory tree halves the live sums log2(size) times (size a power of
    two), a barrier after each level (chapter 6, reduction version 3).
    """
    stride = size // 2
    while stride > 0:
        if t < stride:
            s0[t] += s0[t + stride]
            s1[t] += s1[t + stride]
        cuda.syncthreads()
        stride //= 2


def make_partials_finalize(THREADS_R):
    """Kernels that sum (P, 2, C) float64 partials over P, one block per channel."""

    @cuda.jit(device=True)
    def block_sum_pair(partials, c, s0, s1):
        # Each thread sums a strided slice of the P rows, then a shared-memory
        # tree halves the THREADS_R sums log2(THREADS_R) times (chapter 6).
        t = cuda.threadIdx.x
        a = 0.0
        b = 0.0
        for p in range(t, partials.shape[0], THREADS_R):
            a += partials[p, 0, c]
            b += partials[p, 1, c]
        s0[t] = a
        s1[t] = b
        cuda.syncthreads()
        tree_sum_pair(s0, s1, t, THREADS_R)

    @cuda.jit(cache=True)
    def bn_stats_finalize(
        partials,
        count,
        gamma,
        beta,
        eps,
        momentum,
        running_mean,
        running_var,
        mean,
        invstd,
        scale,
        shift,
    ):
        c = cuda.blockIdx.x
        s0 = cuda.shared.array(THREADS_R, float64)
        s1 = cuda.shared.array(THREADS_R, float64)
        block_sum_pair(partials, c, s0, s1)
        if cuda.threadIdx.x == 0:
            mu = s0[0] / count
            # One pass: var = E[x^2] - E[x]^2 in float64 loses about R^2 * 1e-16
            # of var for a channel with |mean| = R std: below float32 rounding up
            # to R ~ 1e4. The partial sums must be that accurate too: the
            # convolutions take their float32 per-thread sums around a value of
            # the channel (fast_conv.shifted_sums), not around 0.
            var = max(s1[0] / count - mu * mu, 0.0)
            inv = 1.0 / math.sqrt(var + eps)
            mean[c] = mu
            invstd[c] = inv
            running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mu
            running_var[c] = (1.0 - momentum) * running_var[c] + momentum * var * count / (
                count - 1
            )
            sc = gamma[c] * inv
            scale[c] = sc
            shift[c] = beta[c] - mu * sc

    @cuda.jit(cache=True)
    def bn_backward_finalize(partials, dgamma, dbeta):
        c = cuda.blockIdx.x
        s0 = cuda.shared.array(THREADS_R, float64)
        s1 = cuda.shared.array(THREADS_R, float64)
        block_sum_pair(partials, c, s0, s1)
        if cuda.threadIdx.x == 0:
            dgamma[c] = s0[0]
            dbeta[c] = s1[0]

    return bn_stats_finalize, bn_backward_finalize


bn_stats_finalize_kernel, bn_backward_finalize_kernel = make_partials_finalize(REDUCE_THREADS)


def bn_stats_finalize(
    partials,
    count: int,
    gamma,
    beta,
    eps: float,
    momentum: float,
    running_mean,
    running_var,
    mean,
    invstd,
    scale,
    shift,
    stream=0,
) -> None:
    """Batch statistics of one batchnorm layer from per-block partial sums.

    partials (P, 2, C) float64: [p, 0, c] a block's sum of channel c, [p, 1, c]
    its sum of squares (written by the convolution's epilogue); ``count`` the
    number of values per channel (N*H*W). Writes mean, invstd = 1/sqrt(biased
    var + eps), scale = gamma*invstd and shift = beta - mean*scale (C,) float32,
    and updates running_mean / running_var in place (unbiased variance, as
    torch.nn.BatchNorm2d).
    """
    c = mean.shape[0]
    bn_stats_finalize_kernel[c, REDUCE_THREADS, stream](
        partials,
        count,
        gamma,
        beta,
        eps,
        momentum,
        running_mean,
        running_var,
        mean,
        invstd,
        scale,
        shift,
    )


def bn_backward_finalize(partials, dgamma, dbeta, stream=0) -> None:
    """dgamma, dbeta (C,) float32 from (P, 2, C) float64 partials of sum(dy*xhat), sum(dy)."""
    bn_backward_finalize_kernel[dgamma.shape[0], REDUCE_THREADS, stream](partials, dgamma, dbeta)


# Thread per channel: evaluation mode folds the running statistics into the
# same scale/shift the fused kernel applies.
@cuda.jit(cache=True)
def bn_eval_scale_shift_kernel(gamma, beta, running_mean, running_var, eps, scale, shift):
    c = cuda.grid(1)
    if c < scale.shape[0]:
        sc = gamma[c] / math.sqrt(running_var[c] + eps)
        scale[c] = sc
        shift[c] = beta[c] - running_mean[c] * sc


def bn_eval_scale_shift(
    gamma, beta, running_mean, running_var, eps: float, scale, shift, stream=0
) -> None:
    """scale = gamma / sqrt(running_var + eps), shift = beta - running_mean * scale (C,)."""
    c = scale.shape[0]
    bn_eval_scale_shift_kernel[ceil_div(c, THREADS), THREADS, stream](
        gamma, beta, running_mean, running_var, eps, scale, shift
    )


# ---------------------------------------------------------------------------
# Batchnorm apply + ReLU + 2x2 max-pool, forward and backward
# ---------------------------------------------------------------------------

# Index arithmetic: a flat thread index over N*C*H*W decoded with 64-bit
# divisions (what Numba does with array shapes) costs more than the 16 bytes a
# thread moves: at batch 1024 it made these kernels several times slower than
# memory. Here blockIdx.y is the image, the flat index covers one image's
# (c, ph, pw) windows, and the decode uses 32-bit integers: two divisions a window.


@cuda.jit(device=True, inline=True)
def _this_window(pooled):
    """(n, c, ph, pw) of this thread's 2x2 window under the grid of
    :func:`_window_grid`, in int32; c = -1 for a thread past the last window."""
    channels = int32(pooled.shape[1])
    w_out = int32(pooled.shape[3])
    plane_out = int32(pooled.shape[2]) * w_out
    q = int32(cuda.blockIdx.x) * int32(cuda.blockDim.x) + int32(cuda.threadIdx.x)
    if q >= channels * plane_out:
        return 0, -1, 0, 0
    c = q // plane_out
    r = q - c * plane_out
    ph = r // w_out
    return cuda.blockIdx.y, c, ph, r - ph * w_out


# Thread per pooled output: 4 reads of z, 1 write + 1 byte of argmax, where the
# naive path wrote xhat, y, the ReLU output and the pool output (4 full-size
# passes). max(relu(a), relu(b)) = relu(max(a, b)): ReLU and pooling commute,
# but the argmax must still be taken on the ReLU outputs, first maximum winning
# in row-major order, as torch's max_pool2d does (ties among zeros included).
@cuda.jit(cache=True)
def bn_relu_maxpool_forward_kernel(z, scale, shift, pooled, argmax):
    n, c, ph, pw = _this_window(pooled)
    if c < 0:
        return
    sc = scale[c]
    sh = shift[c]
    zero = float32(0.0)
    best = max(z[n, c, 2 * ph, 2 * pw] * sc + sh, zero)
    best_k = 0
    for k in range(1, 4):
        v = max(z[n, c, 2 * ph + k // 2, 2 * pw + k % 2] * sc + sh, zero)
        if v > best:
            best = v
            best_k = k
    pooled[n, c, ph, pw] = best
    argmax[n, c, ph, pw] = best_k


# The training step's forward: the same pass, and the winner's conv output kept
# (zwin, pooled-sized), so the backward reduction reads two pooled-size arrays in
# order instead of gathering z through the argmax (a scattered read of the
# conv-sized z).
@cuda.jit(cache=True)
def bn_relu_maxpool_forward_train_kernel(z, scale, shift, pooled, argmax, zwin):
    n, c, ph, pw = _this_window(pooled)
    if c < 0:
        return
    sc = scale[c]
    sh = shift[c]
    zero = float32(0.0)
    z_best = z[n, c, 2 * ph, 2 * pw]
    best = max(z_best * sc + sh, zero)
    best_k = 0
    for k in range(1, 4):
        zk = z[n, c, 2 * ph + k // 2, 2 * pw + k % 2]
        v = max(zk * sc + sh, zero)
        if v > best:
            best = v
            best_k = k
            z_best = zk
    pooled[n, c, ph, pw] = best
    argmax[n, c, ph, pw] = best_k
    zwin[n, c, ph, pw] = z_best


def _window_grid(pooled_shape) -> tuple[tuple[int, int], int]:
    """Grid of the window kernels: (windows of one image / THREADS, N) blocks."""
    n, c, h_out, w_out = pooled_shape
    return (ceil_div(c * h_out * w_out, THREADS), n), THREADS


def bn_relu_maxpool_forward(z, scale, shift, pooled, argmax, stream=0, zwin=None) -> None:
    """pooled (N, C, H/2, W/2) = maxpool2x2(relu(z * scale[c] + shift[c])).

    z (N, C, H, W) float32 (the convolution's output), scale/shift (C,)
    float32 from :func:`bn_stats_finalize` or :func:`bn_eval_scale_shift`;
    argmax (N, C, H/2, W/2) int8 = the window position 0..3 (row-major) of the
    first maximum. zwin: None, or (N, C, H/2, W/2) float32 that receives z at
    that position (for :func:`bn_relu_maxpool_backward_reduce_winners`). H and
    W must be even.
    """
    grid, block = _window_grid(pooled.shape)
    if zwin is None:
        bn_relu_maxpool_forward_kernel[grid, block, stream](z, scale, shift, pooled, argmax)
    else:
        bn_relu_maxpool_forward_train_kernel[grid, block, stream](
            z, scale, shift, pooled, argmax, zwin
        )


@cuda.jit(device=True, inline=True)
def _advance(n, ph, pw, dn, dh, dw, h_out, w_out):
    """(n, ph, pw) moved on by dn images, dh rows and dw columns of the pooled
    grid, with carries (dh < h_out, dw < w_out: at most one carry each)."""
    n += dn
    ph += dh
    pw += dw
    if pw >= w_out:
        pw -= w_out
        ph += 1
    if ph >= h_out:
        ph -= h_out
        n += 1
    return n, ph, pw


def make_bn_backward_reduce(BLOCK, MIN_BLOCKS=5):
    """Block per (channel, group of images): partial sums of dy*xhat and dy.

    Chapter 09's case study profiles and fixes this kernel. Each thread walks the
    pooled positions j = t, t + BLOCK, ... of its group: j is decoded into
    (image, row, column) once and then stepped with carries (a division per
    element cost more instructions than the element's work), and each iteration
    issues the loads of two elements before using either (the gather of z
    through the argmax waits on the argmax: two chains in flight hide half the
    latency). ``launch_bounds`` keeps registers at 48, MIN_BLOCKS blocks an SM.
    The sums are added in the order j takes, as one element an iteration would.
    """

    @jit(launch_bounds=(BLOCK, MIN_BLOCKS), cache=True)
    def bn_relu_maxpool_backward_reduce(
        dpooled, argmax, z, mean, invstd, scale, shift, images_per_block, partials
    ):
        c = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = int32(cuda.threadIdx.x)
        batch = int32(z.shape[0])
        h_out = int32(dpooled.shape[2])
        w_out = int32(dpooled.shape[3])
        plane = h_out * w_out
        n0 = int32(p) * int32(images_per_block)
        n1 = min(batch, n0 + int32(images_per_block))
        total = (n1 - n0) * plane
        mu = mean[c]
        inv = invstd[c]
        sc = scale[c]
        sh = shift[c]
        # BLOCK = dn images + dh rows + dw columns: the step every thread takes.
        dn = int32(BLOCK) // plane
        dq = int32(BLOCK) - dn * plane
        dh = dq // w_out
        dw = dq - dh * w_out
        n = n0 + t // plane
        q = t - (t // plane) * plane
        ph = q // w_out
        pw = q - ph * w_out
        zero = float32(0.0)  # a bare 0.0 is float64: the comparisons would promote
        a = zero
        b = zero
        j = t
        while j < total:
            second = j + int32(BLOCK) < total
            n2, ph2, pw2 = _advance(n, ph, pw, dn, dh, dw, h_out, w_out)
            # Only the window winners carry a gradient: gather the winner's z.
            k1 = argmax[n, c, ph, pw]
            k2 = argmax[n2, c, ph2, pw2] if second else k1
            z1 = z[n, c, 2 * ph + (k1 >> 1), 2 * pw + (k1 & 1)]
            g1 = dpooled[n, c, ph, pw]
            z2 = z[n2, c, 2 * ph2 + (k2 >> 1), 2 * pw2 + (k2 & 1)] if second else z1
            g2 = dpooled[n2, c, ph2, pw2] if second else g1
            if z1 * sc + sh > zero:
                a += g1 * (z1 - mu) * inv
                b += g1
            if second and z2 * sc + sh > zero:
                a += g2 * (z2 - mu) * inv
                b += g2
            n, ph, pw = _advance(n2, ph2, pw2, dn, dh, dw, h_out, w_out)
            j += int32(2 * BLOCK)
        s0 = cuda.shared.array(BLOCK, float64)
        s1 = cuda.shared.array(BLOCK, float64)
        s0[t] = a
        s1[t] = b
        cuda.syncthreads()
        tree_sum_pair(s0, s1, t, BLOCK)
        if t == 0:
            partials[p, 0, c] = s0[0]
            partials[p, 1, c] = s1[0]

    return bn_relu_maxpool_backward_reduce


BN_REDUCE_BLOCK = pick(gpu=256, simulator=16)
bn_relu_maxpool_backward_reduce_kernel = make_bn_backward_reduce(BN_REDUCE_BLOCK)


def bn_backward_images_per_block(n: int, h_out: int, w_out: int) -> int:
    """Images per block of the backward reduce: about 8 pooled values a thread."""
    return max(1, min(n, (8 * BN_REDUCE_BLOCK) // max(1, h_out * w_out)))


def bn_backward_partial_rows(n: int, h_out: int, w_out: int) -> int:
    """P, the first dimension of the partials the backward reduce writes."""
    return ceil_div(n, bn_backward_images_per_block(n, h_out, w_out))


def bn_relu_maxpool_backward_reduce(
    dpooled, argmax, z, mean, invstd, scale, shift, partials, stream=0, kernel=None
) -> None:
    """Per-block partial sums of dgamma = sum(dy * xhat) and dbeta = sum(dy) of a
    BN -> ReLU -> max-pool block, where dy is dpooled routed back through the pool
    and the ReLU. xhat = (z - mean) * invstd is recomputed from z.

    dpooled (N, C, H/2, W/2), argmax int8 and z (N, C, H, W) as written by
    :func:`bn_relu_maxpool_forward`; partials (P, 2, C) float64 with
    P = :func:`bn_backward_partial_rows`; every row is written. ``kernel``: one
    from :func:`make_bn_backward_reduce` (``BN_REDUCE_BLOCK`` threads) in place of
    the module's, for tests that launch a broken one.
    """
    n, c, h_out, w_out = dpooled.shape
    per = bn_backward_images_per_block(n, h_out, w_out)
    kernel = kernel or bn_relu_maxpool_backward_reduce_kernel
    kernel[(c, ceil_div(n, per)), BN_REDUCE_BLOCK, stream](
        dpooled, argmax, z, mean, invstd, scale, shift, per, partials
    )


def make_bn_backward_reduce_winners(BLOCK):
    """Block per (channel, group of images): partial sums of dy*xhat and dy, read
    from the pooled gradient and the window winners' conv outputs (zwin, kept by
    the training forward) instead of gathering z through the argmax.

    Both inputs are (N, C, Hp, Wp) and a channel's plane of an image is
    contiguous: each thread walks the group's values j = t, t + BLOCK, ... as
    (image, offset in the plane), stepped with a carry, loading two values of
    each array before using them (no load waits on another). The sums are added
    in the order j takes.
    """

    @cuda.jit(cache=True)
    def bn_relu_maxpool_backward_reduce_winners(
        g_flat,
        z_flat,
        batch,
        channels,
        plane,
        mean,
        invstd,
        scale,
        shift,
        images_per_block,
        partials,
    ):
        # g_flat, z_flat: dpooled and zwin (N, C, Hp, Wp) flattened; plane = Hp * Wp
        c = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = int32(cuda.threadIdx.x)
        batch = int32(batch)
        channels = int32(channels)
        plane = int32(plane)
        n0 = int32(p) * int32(images_per_block)
        n1 = min(batch, n0 + int32(images_per_block))
        total = (n1 - n0) * plane
        mu = mean[c]
        inv = invstd[c]
        sc = scale[c]
        sh = shift[c]
        dn = int32(BLOCK) // plane  # BLOCK = dn planes + dq values: every thread's step
        dq = int32(BLOCK) - dn * plane
        n = n0 + t // plane
        q = t - (t // plane) * plane
        zero = float32(0.0)
        a = zero
        b = zero
        j = t
        while j < total:
            second = j + int32(BLOCK) < total
            n2 = n + dn
            q2 = q + dq
            if q2 >= plane:
                q2 -= plane
                n2 += 1
            i1 = uint64((n * channels + c) * plane + q)
            i2 = uint64((n2 * channels + c) * plane + q2) if second else i1
            g1 = g_flat[i1]
            z1 = z_flat[i1]
            g2 = g_flat[i2]
            z2 = z_flat[i2]
            if z1 * sc + sh > zero:
                a += g1 * (z1 - mu) * inv
                b += g1
            if second and z2 * sc + sh > zero:
                a += g2 * (z2 - mu) * inv
                b += g2
            n = n2 + dn
            q = q2 + dq
            if q >= plane:
                q -= plane
                n += 1
            j += int32(2 * BLOCK)
        s0 = cuda.shared.array(BLOCK, float64)
        s1 = cuda.shared.array(BLOCK, float64)
        s0[t] = a
        s1[t] = b
        cuda.syncthreads()
        tree_sum_pair(s0, s1, t, BLOCK)
        if t == 0:
            partials[p, 0, c] = s0[0]
            partials[p, 1, c] = s1[0]

    return bn_relu_maxpool_backward_reduce_winners


bn_relu_maxpool_backward_reduce_winners_kernel = make_bn_backward_reduce_winners(BN_REDUCE_BLOCK)


def bn_relu_maxpool_backward_reduce_winners(
    dpooled, zwin, mean, invstd, scale, shift, partials, stream=0, kernel=None
) -> None:
    """As :func:`bn_relu_maxpool_backward_reduce`, from zwin (N, C, H/2, W/2)
    float32 (the winners' conv outputs, written by :func:`bn_relu_maxpool_forward`
    with ``zwin``) instead of argmax and z. partials (P, 2, C) float64, P =
    :func:`bn_backward_partial_rows`; every row is written. ``kernel``: one from
    :func:`make_bn_backward_reduce_winners` (``BN_REDUCE_BLOCK`` threads) in place
    of the module's, for tests that launch a broken one."""
    n, c, h_out, w_out = dpooled.shape
    per = bn_backward_images_per_block(n, h_out, w_out)
    kernel = kernel or bn_relu_maxpool_backward_reduce_winners_kernel
    kernel[(c, ceil_div(n, per)), BN_REDUCE_BLOCK, stream](
        dpooled.reshape(dpooled.size),
        zwin.reshape(zwin.size),
        n,
        c,
        h_out * w_out,
        mean,
        invstd,
        scale,
        shift,
        per,
        partials,
    )


# Thread per 2x2 window: dz = gamma invstd / M (M dy - sum dy - xhat sum(dy xhat))
# for its 4 conv outputs, dy being the pooled gradient at the window's winner
# (if its ReLU was open) and 0 elsewhere: one read of z, one write of dz.
@cuda.jit(cache=True)
def bn_relu_maxpool_backward_dx_kernel(
    dpooled, argmax, z, mean, invstd, scale, shift, gamma, dgamma, dbeta, dz
):
    n, c, ph, pw = _this_window(dpooled)
    if c < 0:
        return
    count = float32(dz.shape[0] * dz.shape[2] * dz.shape[3])
    mu = mean[c]
    inv = invstd[c]
    k = gamma[c] * inv / count
    base = -dbeta[c]
    dg = dgamma[c]
    win = argmax[n, c, ph, pw]
    zw = z[n, c, 2 * ph + win // 2, 2 * pw + win % 2]
    g = dpooled[n, c, ph, pw] if zw * scale[c] + shift[c] > 0 else float32(0.0)
    for j in range(4):
        h = 2 * ph + j // 2
        w = 2 * pw + j % 2
        xhat = (z[n, c, h, w] - mu) * inv
        dy = count * g if j == win else float32(0.0)
        dz[n, c, h, w] = k * (dy + base - xhat * dg)


def bn_relu_maxpool_backward_dx(
    dpooled, argmax, z, mean, invstd, scale, shift, gamma, dgamma, dbeta, dz, stream=0
) -> None:
    """dz (N, C, H, W): the gradient at the convolution's output of
    maxpool2x2(relu(batchnorm(z))), from dpooled (N, C, H/2, W/2) and the
    forward's argmax, mean, invstd, scale, shift, and dgamma, dbeta (C,)."""
    grid, block = _window_grid(dpooled.shape)
    bn_relu_maxpool_backward_dx_kernel[grid, block, stream](
        dpooled, argmax, z, mean, invstd, scale, shift, gamma, dgamma, dbeta, dz
    )


# ---------------------------------------------------------------------------
# Split-K GEMM for the linear layers
# ---------------------------------------------------------------------------

# Chapter 08's versions 9-10 for the three layouts of a linear layer: a block
# computes a BM x BN tile of C (a K-chunk of it, blockIdx.z), a thread a TM x TN
# register tile whose fragments are groups of 4 consecutive rows/columns (one
# LDS.128 each: per k, TM/4 + TN/4 shared loads feed TM*TN FMAs), operands
# double-buffered through registers (one syncthreads per K-slice). fc1's shapes
# are M = batch, J = 128, K = 3,136 (forward); 128 x 3,137 x batch (weight
# gradient); batch x 3,136 x 128 (input gradient): only the split across K
# gives a small batch enough blocks.

# The simulator refuses shared-memory alignment; on a GPU 16 bytes allows LDS.128.
SMEM_ALIGN = pick(gpu=16, simulator=None)


@dataclass(frozen=True)
class GemmTile:
    """A split-K GEMM's block tile bm x bn of C, bk-deep K-slices in shared
    memory, a tm x tn register tile a thread ((bm/tm)(bn/tn) threads) and the
    launch bound min_blocks (blocks an SM the compiler must fit in registers).
    The threads load each operand tile in whole rows of either layout: they are
    a multiple of bk, bm and bn, and their quotients divide the tile's sides."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    min_blocks: int = 2

    def __post_init__(self):
        t = self.threads
        gm, gn = min(self.tm, 4), min(self.tn, 4)
        if (
            self.bm % self.tm
            or self.bn % self.tn
            or self.tm % gm
            or self.tn % gn
            or self.bk % 2
            or any(t % d for d in (self.bk, self.bm, self.bn))
            or self.bm % (t // self.bk)
            or self.bn % (t // self.bk)
            or self.bk % (t // self.bm)
            or self.bk % (t // self.bn)
        ):
            raise ValueError(f"{self}: the threads do not tile A and B evenly")

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


def make_gemm_splitk(TRANS_A, TRANS_B, ONES_COL, tile):
    """C[s] = A[:, Ks] @ B[Ks, :] for the s-th K-chunk Ks (blockIdx.z), as a kernel.

    A is (M, K): ``a[m, k]``, or ``a[k, m]`` when TRANS_A. B is (K, J'): ``b[k, j]``,
    or ``b[j, k]`` when TRANS_B; with ONES_COL, B gets an extra last column of
    ones (J = J' + 1), so column J' of C is the row sums of A (a bias gradient
    for free). The flags are closure constants: Numba compiles only the branch
    taken. Kernel arguments: ``(a, b, c, m_size, j_size, k_size, chunk)``, the
    arrays flat (C-contiguous), c holding the (S, M, J) float32 partials; grid
    (ceil(J / bn), ceil(M / bm), S), tile.threads threads.
    """
    BM, BN, BK, TM, TN, MIN_BLOCKS = (
        tile.bm,
        tile.bn,
        tile.bk,
        tile.tm,
        tile.tn,
        tile.min_blocks,
    )
    TX, TY = BN // TN, BM // TM
    THREADS = TX * TY
    GM, GN = min(TM, 4), min(TN, 4)  # fragment groups (one LDS.128 each when 4)
    GA, GB = TY * GM, TX * GN  # distance between a thread's groups
    # An operand contiguous along K (A = x, B = W in the forward) is read k-fast
    # (a warp reads BK-long runs of rows) and stored transposed, tile[k][row]; one
    # contiguous along its rows is read row-fast and stored as it comes. Load l of
    # a thread is tile row p + l * P_STEP, K-offset q + l * Q_STEP.
    A_FAST_K, B_FAST_K = not TRANS_A, TRANS_B
    A_LOADS, B_LOADS = BM * BK // THREADS, BN * BK // THREADS
    A_PSTEP, A_QSTEP = (THREADS // BK, 0) if A_FAST_K else (0, THREADS // BM)
    B_PSTEP, B_QSTEP = (THREADS // BK, 0) if B_FAST_K else (0, THREADS // BN)
    AP, BP = BM + 4, BN + 4  # padded rows (transposed stores: fewer bank conflicts)
    A_DSTEP, B_DSTEP = A_QSTEP * AP + A_PSTEP, B_QSTEP * BP + B_PSTEP
    A_BUF, B_BUF = BK * AP, BK * BP
    A_SIZE, B_SIZE = 2 * A_BUF, 2 * B_BUF  # shared array sizes must be plain constants
    assert 4 * (A_SIZE + B_SIZE) <= 48 * 1024, "shared memory over 48 KiB"

    @jit(launch_bounds=(THREADS, MIN_BLOCKS), cache=True)
    def gemm_splitk(a, b, c, m_size, j_size, k_size, chunk):
        a_tile = cuda.shared.array(A_SIZE, float32, alignment=SMEM_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, float32, alignment=SMEM_ALIGN)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_LOADS, float32)
        b_next = cuda.local.array(B_LOADS, float32)
        # `& 1023` tells the compiler tid >= 0 (no negative-index fix-ups below).
        tid = cuda.threadIdx.x & 1023
        tx = tid % TX
        ty = tid // TX
        m0 = cuda.blockIdx.y * BM
        j0 = cuda.blockIdx.x * BN
        s = cuda.blockIdx.z
        k_begin = s * chunk
        k_end = min(k_size, k_begin + chunk)
        k_tiles = (k_end - k_begin + BK - 1) // BK
        j_data = j_size - 1 if ONES_COL else j_size
        # This thread's first element of each operand tile (row p, K-offset q), its
        # flat address at k_begin, and how far the address moves per K-slice.
        if A_FAST_K:
            a_p, a_q = tid // BK, tid % BK
            a_src = (m0 + a_p) * k_size + k_begin + a_q
            a_lstep, a_tstep = A_PSTEP * k_size, BK
        else:
            a_p, a_q = tid % BM, tid // BM
            a_src = (k_begin + a_q) * m_size + m0 + a_p
            a_lstep, a_tstep = A_QSTEP * m_size, BK * m_size
        if B_FAST_K:
            b_p, b_q = tid // BK, tid % BK
            b_src = (j0 + b_p) * k_size + k_begin + b_q
            b_lstep, b_tstep = B_PSTEP * k_size, BK
        else:
            b_p, b_q = tid % BN, tid // BN
            b_src = (k_begin + b_q) * j_data + j0 + b_p
            b_lstep, b_tstep = B_QSTEP * j_data, BK * j_data
        a_dst = a_q * AP + a_p
        b_dst = b_q * BP + b_p
        for i in range(TM):
            for jj in range(TN):
                acc[i, jj] = float32(0.0)
        # Iteration t: store K-slice t (held in registers) into buffer t % 2, sync,
        # issue the global loads of slice t + 1, then the FMAs of slice t. The
        # buffer written at t was last read at t - 2, before the sync of t - 1.
        for t in range(-1, k_tiles):
            cur = t & 1
            if t >= 0:
                for ld in range(A_LOADS):
                    a_tile[uint64(cur * A_BUF + a_dst + ld * A_DSTEP)] = a_next[ld]
                for ld in range(B_LOADS):
                    b_tile[uint64(cur * B_BUF + b_dst + ld * B_DSTEP)] = b_next[ld]
                cuda.syncthreads()
            if t + 1 < k_tiles:
                k = k_begin + (t + 1) * BK
                for ld in range(A_LOADS):
                    v = float32(0.0)
                    if m0 + a_p + ld * A_PSTEP < m_size and k + a_q + ld * A_QSTEP < k_end:
                        v = a[uint64(a_src + ld * a_lstep)]
                    a_next[ld] = v
                for ld in range(B_LOADS):
                    j = j0 + b_p + ld * B_PSTEP
                    v = float32(0.0)
                    if k + b_q + ld * B_QSTEP < k_end:
                        if j < j_data:
                            v = b[uint64(b_src + ld * b_lstep)]
                        elif ONES_COL and j == j_data:
                            v = float32(1.0)
                    b_next[ld] = v
                a_src += a_tstep
                b_src += b_tstep
            if t >= 0:
                a_base = cur * A_BUF + ty * GM
                b_base = cur * B_BUF + tx * GN
                kk = 0
                while kk < BK:
                    for k1 in range(2):  # unrolled: two k per trip
                        a_k = a_base + (kk + k1) * AP
                        b_k = b_base + (kk + k1) * BP
                        for i in range(TM):
                            a_frag[i] = a_tile[uint64(a_k + (i // GM) * GA + i % GM)]
                        for jj in range(TN):
                            b_frag[jj] = b_tile[uint64(b_k + (jj // GN) * GB + jj % GN)]
                        for i in range(TM):
                            for jj in range(TN):
                                acc[i, jj] += a_frag[i] * b_frag[jj]
                    kk += 2
        for i in range(TM):
            m = m0 + (i // GM) * GA + ty * GM + i % GM
            if m < m_size:
                row = (s * m_size + m) * j_size
                for jj in range(TN):
                    j = j0 + (jj // GN) * GB + tx * GN + jj % GN
                    if j < j_size:
                        c[uint64(row + j)] = acc[i, jj]

    gemm_splitk.tile = tile
    return gemm_splitk


# Tiles and splits chosen by timing fc1's three products at batch 64, 256 and 1024
# over 6 tile shapes x 12 split counts (README, "Version by version", version 8):
# 128 x 128 tiles of 256 threads, 8 x 8 a thread (chapter 08's best shape at
# 4096^3), pay where every SM gets at least GEMM_LARGE_WORK FMAs (batch 1024: 3.1 M
# an SM); below that, 64 x 64 tiles of 4 x 4 give the grid more blocks. K is cut
# into chunks of at least GEMM_MIN_CHUNK (3 K-slices; shorter chunks are mostly the
# double buffer's fill and the partial tile's write) until the grid has
# GEMM_BLOCKS_PER_SM blocks an SM, never more (a third, partial wave of blocks
# was slower). Simulator: 8 x 8 and 8 x 4 tiles of 2 x 2 (16 and 8 threads); the
# tests also run the GPU shapes.
GPU_GEMM_TILE = GemmTile(128, 128, 16, 8, 8)
GPU_GEMM_TILE_SMALL = GemmTile(64, 64, 16, 4, 4)
GEMM_TILE = pick(gpu=GPU_GEMM_TILE, simulator=GemmTile(8, 8, 4, 2, 2))
GEMM_TILE_SMALL = pick(gpu=GPU_GEMM_TILE_SMALL, simulator=GemmTile(8, 4, 4, 2, 2))
GEMM_LARGE_WORK = pick(gpu=128 * 128 * 128, simulator=8 * 8 * 8)  # FMAs an SM
GEMM_BLOCKS_PER_SM = 2
GEMM_MIN_CHUNK = pick(gpu=48, simulator=8)

# (TRANS_A, TRANS_B, ONES_COL) of the three products: C = x @ W^T (linear
# forward), C = dy^T @ [x, 1] (weight and bias gradient), C = dy @ W (input gradient).
GEMM_LAYOUTS = {
    "nt": (False, True, False),
    "tn_ones": (True, False, True),
    "nn": (False, False, False),
}


@functools.cache
def gemm_kernel(layout: str, tile: GemmTile):
    """The split-K GEMM kernel of ``layout`` (a key of GEMM_LAYOUTS) for ``tile``,
    built once per process."""
    return make_gemm_splitk(*GEMM_LAYOUTS[layout], tile)


@dataclass(frozen=True)
class GemmPlan:
    """How a GEMM is launched: its tile, and K cut into ``splits`` chunks of
    ``chunk`` (a multiple of tile.bk; the last chunk may be shorter)."""

    tile: GemmTile
    splits: int
    chunk: int


def gemm_plan(m: int, j: int, k: int, split: bool = True) -> GemmPlan:
    """The tile and K-split for an (m x k) @ (k x j) product on the current device.

    GEMM_TILE where both sides of C fill it and each SM gets GEMM_LARGE_WORK
    FMAs or more, else GEMM_TILE_SMALL; then, unless ``split=False``, K cut
    into chunks of at least GEMM_MIN_CHUNK, as many as keep the grid within
    GEMM_BLOCKS_PER_SM blocks an SM (:func:`common.runtime.sm_count`). The same
    (m, j, k) on the same device gives the same plan, so the partial sums are
    added in the same order every run."""
    sms = sm_count()
    big = GEMM_TILE
    large = m >= big.bm and j >= big.bn and m * j * k >= GEMM_LARGE_WORK * sms
    tile = big if large else GEMM_TILE_SMALL
    splits = 1
    if split:
        tiles = ceil_div(m, tile.bm) * ceil_div(j, tile.bn)
        splits = max(1, min(GEMM_BLOCKS_PER_SM * sms // tiles, ceil_div(k, GEMM_MIN_CHUNK)))
    chunk = ceil_div(ceil_div(k, splits), tile.bk) * tile.bk
    return GemmPlan(tile, ceil_div(k, chunk), chunk)


def gemm_splitk(layout: str, a, b, m: int, j: int, k: int, c, plan: GemmPlan, stream=0) -> None:
    """Launch the ``layout`` GEMM (see GEMM_LAYOUTS) of an (m x k) A and a (k x j)
    B (j counting the ones column of "tn_ones") into c: float32 partials, at
    least plan.splits * m * j elements, any shape (only its first elements are
    written, as (splits, m, j)). a, b: float32 C-contiguous device arrays."""
    kernel = gemm_kernel(layout, plan.tile)
    grid = (ceil_div(j, plan.tile.bn), ceil_div(m, plan.tile.bm), plan.splits)
    kernel[grid, plan.tile.threads, stream](
        a.reshape(a.size), b.reshape(b.size), c.reshape(c.size), m, j, k, plan.chunk
    )


def splitk_partials_size(m: int, j: int, k: int) -> int:
    """Elements of the partial buffer :func:`gemm_splitk` needs for (m, j, k)."""
    return gemm_plan(m, j, k).splits * m * j


def make_splitk_reduce_bias(RELU, OUTS, LANES, UNROLL=4):
    """Factory: y = [relu](bias + the sum of S split-K partials), float32.

    partials (S' >= S chunks of an N x O output, flat): block = OUTS outputs x
    LANES lanes; lane l adds chunks l, l + LANES, ... in increasing order, UNROLL
    loads in flight at a time, then lane 0 adds bias and the LANES sums in order:
    a fixed order, so the same bits every run. Arguments: (partials flat, s_count
    = S, bias (O,), y flat (N * O), n_out = O)."""
    THREADS = OUTS * LANES

    @jit(cache=True)
    def splitk_reduce_bias(partials, s_count, bias, y, n_out):
        red = cuda.shared.array(THREADS, float32)
        vals = cuda.local.array(UNROLL, float32)
        tid = cuda.threadIdx.x & 1023
        e_l = tid % OUTS
        lane = tid // OUTS
        e = cuda.blockIdx.x * OUTS + e_l
        total = y.size
        acc = float32(0.0)
        if e < total:
            s = lane
            while s + (UNROLL - 1) * LANES < s_count:
                for u in range(UNROLL):
                    vals[u] = partials[uint64((s + u * LANES) * total + e)]
                for u in range(UNROLL):
                    acc += vals[u]
                s += UNROLL * LANES
            while s < s_count:
                acc += partials[uint64(s * total + e)]
                s += LANES
        red[tid] = acc
        cuda.syncthreads()
        if lane == 0 and e < total:
            v = bias[e % n_out]
            for r in range(LANES):
                v += red[r * OUTS + e_l]
            y[e] = max(v, float32(0.0)) if RELU else v

    splitk_reduce_bias.threads = THREADS
    splitk_reduce_bias.outs = OUTS
    return splitk_reduce_bias


# OUTS outputs x LANES lanes of chunks a block (both split-K reductions).
SPLITK_REDUCE_SHAPE = pick(gpu=(64, 4), simulator=(8, 2))
splitk_reduce_bias_relu_kernel = make_splitk_reduce_bias(True, *SPLITK_REDUCE_SHAPE)
splitk_reduce_bias_kernel = make_splitk_reduce_bias(False, *SPLITK_REDUCE_SHAPE)


def make_splitk_reduce_weight_bias(OUTS, LANES, UNROLL=4):
    """Factory: dw and db from split-K partials, each sum in float64 in a fixed order.

    partials[s, o, j] (S' >= S chunks of an O x J gradient, flat) hold chunk s's
    float32 sum for weight (o, j), j < J - 1, and for the bias when j = J - 1 (the
    GEMM's column of ones). Block = OUTS outputs x LANES lanes: lane l sums chunks
    l, l + LANES, ... in increasing order, UNROLL independent loads in flight at a
    time (a plain loop waits a memory latency per chunk), then lane 0 adds the
    LANES sums in order. Arguments: (partials flat, dw flat (O * (J - 1)), db (O,),
    s_count = S, n_cols = J, total = O * J)."""
    THREADS = OUTS * LANES

    @jit(cache=True)
    def splitk_reduce_weight_bias(partials, dw, db, s_count, n_cols, total):
        red = cuda.shared.array(THREADS, float64)
        vals = cuda.local.array(UNROLL, float32)
        tid = cuda.threadIdx.x & 1023
        e_l = tid % OUTS
        lane = tid // OUTS
        e = cuda.blockIdx.x * OUTS + e_l
        acc = 0.0
        if e < total:
            s = lane
            while s + (UNROLL - 1) * LANES < s_count:
                for u in range(UNROLL):
                    vals[u] = partials[uint64((s + u * LANES) * total + e)]
                for u in range(UNROLL):
                    acc += float64(vals[u])
                s += UNROLL * LANES
            while s < s_count:
                acc += float64(partials[uint64(s * total + e)])
                s += LANES
        red[tid] = acc
        cuda.syncthreads()
        if lane == 0 and e < total:
            sum_all = 0.0
            for r in range(LANES):
                sum_all += red[r * OUTS + e_l]
            o = e // n_cols
            j = e - o * n_cols
            if j < n_cols - 1:
                dw[uint64(o * (n_cols - 1) + j)] = sum_all
            else:
                db[o] = sum_all

    splitk_reduce_weight_bias.threads = THREADS
    splitk_reduce_weight_bias.outs = OUTS
    return splitk_reduce_weight_bias


splitk_reduce_weight_bias_kernel = make_splitk_reduce_weight_bias(*SPLITK_REDUCE_SHAPE)


def splitk_reduce_weight_bias(partials, s_count: int, dw, db, stream=0) -> None:
    """dw (O, J - 1) and db (O,) float32 from the first ``s_count`` chunks of
    split-K partials (S', O, J) float32 (S' >= s_count; the last column is the
    bias's): each sum in float64, in a fixed order, so the result is the same
    bit for bit on every run. dw may have any C-contiguous shape of O * (J - 1)
    elements (a convolution's (Co, Ci, K, K)). Never synchronizes or allocates."""
    _, n_out, n_cols = partials.shape
    total = n_out * n_cols
    kernel = splitk_reduce_weight_bias_kernel
    kernel[ceil_div(total, kernel.outs), kernel.threads, stream](
        partials.reshape(partials.size), dw.reshape(dw.size), db, s_count, n_cols, total
    )


def linear_forward(x, w, b, y, partials_buf, relu: bool, stream=0, plan=None) -> None:
    """y (N, O) = [relu](x (N, I) @ w (O, I)^T + b (O,)), split-K over I.

    partials_buf: 1-D float32 scratch of at least :func:`splitk_partials_size`
    (N, O, I) elements. ``plan`` (default :func:`gemm_plan`) is for benchmarks.
    """
    n, n_in = x.shape
    n_out = w.shape[0]
    plan = plan or gemm_plan(n, n_out, n_in)
    gemm_splitk("nt", x, w, n, n_out, n_in, partials_buf, plan, stream)
    reduce = splitk_reduce_bias_relu_kernel if relu else splitk_reduce_bias_kernel
    reduce[ceil_div(y.size, reduce.outs), reduce.threads, stream](
        partials_buf, plan.splits, b, y.reshape(y.size), n_out
    )


def linear_grad_weight(dy, x, dw, db, partials_buf, stream=0, plan=None) -> None:
    """dw (O, I) = dy^T x and db (O,) = sum_n dy, from dy (N, O) and x (N, I);
    split-K over the batch, partials summed in float64.

    partials_buf: 1-D, at least :func:`splitk_partials_size` (O, I + 1, N)
    elements. ``plan`` (default :func:`gemm_plan`) is for benchmarks.
    """
    n, n_out = dy.shape
    n_in = x.shape[1]
    plan = plan or gemm_plan(n_out, n_in + 1, n)
    gemm_splitk("tn_ones", dy, x, n_out, n_in + 1, n, partials_buf, plan, stream)
    part = partials_buf[: plan.splits * n_out * (n_in + 1)].reshape((plan.splits, n_out, n_in + 1))
    splitk_reduce_weight_bias(part, plan.splits, dw, db, stream)


def linear_grad_input(dy, w, dx, stream=0, plan=None) -> None:
    """dx (N, I) = dy (N, O) @ w (O, I); K = O is short, so no split: the GEMM
    writes dx itself. ``plan`` (default :func:`gemm_plan` unsplit) is for benchmarks."""
    n, n_out = dy.shape
    n_in = w.shape[1]
    plan = plan or gemm_plan(n, n_in, n_out, split=False)
    if plan.splits != 1:
        raise ValueError(f"linear_grad_input has no partials to split into: {plan}")
    gemm_splitk("nn", dy, w, n, n_in, n_out, dx, plan, stream)


# ---------------------------------------------------------------------------
# Classifier: fc2 + log-softmax + NLL + its gradients, one kernel
# ---------------------------------------------------------------------------

CLS_ROWS = 8  # batch rows a block handles
CLS_MAX_CLASSES = 32  # threads along the class axis (num_classes must fit)
CLS_MAX_HIDDEN = 1024  # fc2 inputs staged in shared memory


@cuda.jit(cache=True)
def classifier_fused_kernel(h, w, b, labels, logits, row_loss, dlogits, dh):
    # Block (CLS_MAX_CLASSES, CLS_ROWS): thread (c, r) owns logit (n0 + r, c).
    c = cuda.threadIdx.x
    r = cuda.threadIdx.y
    tid = r * CLS_MAX_CLASSES + c
    nthreads = CLS_MAX_CLASSES * CLS_ROWS
    n0 = cuda.blockIdx.x * CLS_ROWS
    batch, hidden = h.shape
    classes = w.shape[0]
    h_rows = cuda.shared.array((CLS_ROWS, CLS_MAX_HIDDEN), float32)
    z = cuda.shared.array((CLS_ROWS, CLS_MAX_CLASSES), float32)
    dz = cuda.shared.array((CLS_ROWS, CLS_MAX_CLASSES), float32)
    lse = cuda.shared.array(CLS_ROWS, float32)
    for e in range(tid, CLS_ROWS * hidden, nthreads):
        rr = e // hidden
        n = n0 + rr
        h_rows[rr, e % hidden] = h[n, e % hidden] if n < batch else 0.0
    cuda.syncthreads()
    n = n0 + r
    if c < classes:
        acc = b[c]
        for k in range(hidden):
            acc += h_rows[r, k] * w[c, k]
        z[r, c] = acc
    cuda.syncthreads()
    if c == 0 and n < batch:
        # One thread a row: max, then log-sum-exp around it (no overflow).
        m = z[r, 0]
        for k in range(1, classes):
            m = max(m, z[r, k])
        s = 0.0
        for k in range(classes):
            s += math.exp(z[r, k] - m)
        v = m + math.log(s)
        lse[r] = v
        label = labels[n]
        row_loss[n] = v - z[r, label] if (label >= 0 and label < classes) else math.nan
    cuda.syncthreads()
    if c < classes and n < batch:
        g = math.exp(z[r, c] - lse[r])
        if c == labels[n]:
            g -= 1.0
        g /= batch
        logits[n, c] = z[r, c]
        dlogits[n, c] = g
        dz[r, c] = g
    cuda.syncthreads()
    # fc1's output gradient: dh = dlogits @ w, masked where ReLU was closed
    # (h is fc1's ReLU output, so h > 0 is the mask).
    for e in range(tid, CLS_ROWS * hidden, nthreads):
        rr = e // hidden
        k = e % hidden
        nn = n0 + rr
        if nn < batch:
            acc = 0.0
            for cc in range(classes):
                acc += dz[rr, cc] * w[cc, k]
            dh[nn, k] = acc if h_rows[rr, k] > 0.0 else 0.0


def classifier_fused(h, w, b, labels, logits, row_loss, dlogits, dh, stream=0) -> None:
    """The network's head and its gradient in one kernel.

    h (N, Hd) float32: fc1's ReLU output; w (C, Hd), b (C,): fc2; labels (N,)
    int32. Writes logits (N, C) = h w^T + b, row_loss (N,) = -log_softmax(logits)
    [n, label] (NaN for a label outside [0, C)), dlogits (N, C) = (softmax -
    onehot) / N (the gradient of the mean loss), and dh (N, Hd) = (dlogits @ w)
    where h > 0, else 0.

    Raises:
        ValueError: C > 32 or Hd > 1024 (the shared-memory tiles' limits).
    """
    n, hidden = h.shape
    classes = w.shape[0]
    if classes > CLS_MAX_CLASSES or hidden > CLS_MAX_HIDDEN:
        raise ValueError(
            f"classifier_fused handles at most {CLS_MAX_CLASSES} classes and "
            f"{CLS_MAX_HIDDEN} hidden units, got {classes} and {hidden}"
        )
    classifier_fused_kernel[ceil_div(n, CLS_ROWS), (CLS_MAX_CLASSES, CLS_ROWS), stream](
        h, w, b, labels, logits, row_loss, dlogits, dh
    )


MEAN_THREADS = pick(gpu=256, simulator=16)


@cuda.jit(cache=True)
def mean_reduce_kernel(values, out):
    t = cuda.threadIdx.x
    acc = 0.0
    for i in range(t, values.size, MEAN_THREADS):
        acc += values[i]
    s = cuda.shared.array(MEAN_THREADS, float64)
    s[t] = acc
    cuda.syncthreads()
    stride = MEAN_THREADS // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        out[0] = s[0] / values.size


def mean_reduce(values, out, stream=0) -> None:
    """out (1,) = mean of values (N,), a float64 tree in one block (deterministic)."""
    mean_reduce_kernel[1, MEAN_THREADS, stream](values, out)
