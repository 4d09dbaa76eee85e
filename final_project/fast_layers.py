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
                                it); keeps the window position of the max as int8
    bn_relu_maxpool_backward_reduce  block per (channel, images): pool scatter + ReLU mask
                                + xhat recomputed from the conv output, summed into
                                per-block partials of dgamma and dbeta (no xhat is stored)
    bn_backward_finalize        block per channel: partials -> dgamma, dbeta
    bn_relu_maxpool_backward_dx thread per conv output: the same scatter and mask, then
                                the closed-form batchnorm input gradient, in one pass
    gemm_splitk (3 layouts)     64x64 output tile a block, 4x4 a thread, K split across
                                blocks into partial sums (so skinny linear layers still fill
                                the GPU); linear forward, weight gradient (+ bias gradient as
                                a column of ones), input gradient
    splitk_reduce_bias_relu     thread per output: sum of the split-K partials + bias (+ReLU)
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

import math

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


def _window_grid(pooled_shape) -> tuple[tuple[int, int], int]:
    """Grid of the window kernels: (windows of one image / THREADS, N) blocks."""
    n, c, h_out, w_out = pooled_shape
    return (ceil_div(c * h_out * w_out, THREADS), n), THREADS


def bn_relu_maxpool_forward(z, scale, shift, pooled, argmax, stream=0) -> None:
    """pooled (N, C, H/2, W/2) = maxpool2x2(relu(z * scale[c] + shift[c])).

    z (N, C, H, W) float32 (the convolution's output), scale/shift (C,)
    float32 from :func:`bn_stats_finalize` or :func:`bn_eval_scale_shift`;
    argmax (N, C, H/2, W/2) int8 = the window position 0..3 (row-major) of the
    first maximum. H and W must be even.
    """
    grid, block = _window_grid(pooled.shape)
    bn_relu_maxpool_forward_kernel[grid, block, stream](z, scale, shift, pooled, argmax)


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
    dpooled, argmax, z, mean, invstd, scale, shift, partials, stream=0
) -> None:
    """Per-block partial sums of dgamma = sum(dy * xhat) and dbeta = sum(dy) of a
    BN -> ReLU -> max-pool block, where dy is dpooled routed back through the pool
    and the ReLU. xhat = (z - mean) * invstd is recomputed from z.

    dpooled (N, C, H/2, W/2), argmax int8 and z (N, C, H, W) as written by
    :func:`bn_relu_maxpool_forward`; partials (P, 2, C) float64 with
    P = :func:`bn_backward_partial_rows`; every row is written.
    """
    n, c, h_out, w_out = dpooled.shape
    per = bn_backward_images_per_block(n, h_out, w_out)
    bn_relu_maxpool_backward_reduce_kernel[(c, ceil_div(n, per)), BN_REDUCE_BLOCK, stream](
        dpooled, argmax, z, mean, invstd, scale, shift, per, partials
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

# GPU: 64x64 tiles, 256 threads of 4x4. The simulator runs every CUDA thread as
# Python code, so its tiles are 16x16 with 2x2 a thread (64 threads); the tests
# also build the GPU shape with make_gemm_splitk.
GEMM_BM = pick(gpu=64, simulator=16)  # rows of C a block computes
GEMM_BN = pick(gpu=64, simulator=16)  # columns of C a block computes
GEMM_BK = pick(gpu=32, simulator=8)  # K-slice staged in shared memory per step
GEMM_TM = pick(gpu=4, simulator=2)  # rows a thread computes
GEMM_TN = pick(gpu=4, simulator=2)  # columns a thread computes
GEMM_THREADS = (GEMM_BN // GEMM_TN, GEMM_BM // GEMM_TM)  # (16, 16)
# Split K until the grid has about this many blocks per SM of the device (4 measured
# faster than 2 for fc1 at batch 1024: README, "Version by version", version 5).
GEMM_BLOCKS_PER_SM = pick(gpu=4, simulator=2)


def make_gemm_splitk(
    TRANS_A, TRANS_B, ONES_COL, BM=GEMM_BM, BN=GEMM_BN, BK=GEMM_BK, TM=GEMM_TM, TN=GEMM_TN
):
    """C[s] = A[:, Ks] @ B[Ks, :] for the s-th K-chunk Ks, as a kernel.

    A is (M, K): ``a[m, k]``, or ``a[k, m]`` when TRANS_A. B is (K, J): ``b[k, j]``,
    or ``b[j, k]`` when TRANS_B; with ONES_COL, B gets an extra last column of
    ones, so column J of C is the row sums of A (a bias gradient for free).
    The flags are closure constants: Numba compiles only the branch taken.
    """
    BM_PAD = max(BM, BN) + 1
    NTX = BN // TN
    NTHREADS = NTX * (BM // TM)

    @cuda.jit(cache=True)
    def gemm_splitk(a, b, chunk, c):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * NTX + tx
        m0 = cuda.blockIdx.y * BM
        j0 = cuda.blockIdx.x * BN
        s = cuda.blockIdx.z
        if TRANS_A:
            m_size, k_size = a.shape[1], a.shape[0]
        else:
            m_size, k_size = a.shape[0], a.shape[1]
        j_data = b.shape[0] if TRANS_B else b.shape[1]
        j_size = c.shape[2]
        k_begin = s * chunk
        k_end = min(k_size, k_begin + chunk)
        a_tile = cuda.shared.array((BK, BM_PAD), float32)
        b_tile = cuda.shared.array((BK, BM_PAD), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        for i in range(TM):
            for jj in range(TN):
                acc[i, jj] = float32(0.0)
        for k0 in range(k_begin, k_end, BK):
            # Stage A (BM x BK) and B (BK x BN): each thread loads BM*BK/NTHREADS
            # elements, consecutive threads walking the operand's contiguous axis.
            for r in range(tid, BM * BK, NTHREADS):
                if TRANS_A:
                    mm = r % BM
                    dk = r // BM
                    m = m0 + mm
                    k = k0 + dk
                    a_tile[dk, mm] = a[k, m] if (m < m_size and k < k_end) else float32(0.0)
                else:
                    dk = r % BK
                    mm = r // BK
                    m = m0 + mm
                    k = k0 + dk
                    a_tile[dk, mm] = a[m, k] if (m < m_size and k < k_end) else float32(0.0)
            for r in range(tid, BN * BK, NTHREADS):
                if TRANS_B:
                    dk = r % BK
                    jj = r // BK
                else:
                    jj = r % BN
                    dk = r // BN
                j = j0 + jj
                k = k0 + dk
                v = float32(0.0)
                if k < k_end:
                    if j < j_data:
                        v = b[j, k] if TRANS_B else b[k, j]
                    elif ONES_COL and j == j_data:
                        v = float32(1.0)
                b_tile[dk, jj] = v
            cuda.syncthreads()
            # Outer products: per k, TM + TN shared loads (into registers) feed
            # TM*TN FMAs.
            for dk in range(BK):
                for i in range(TM):
                    a_frag[i] = a_tile[dk, ty + i * (BM // TM)]
                for jj in range(TN):
                    b_frag[jj] = b_tile[dk, tx + jj * NTX]
                for i in range(TM):
                    for jj in range(TN):
                        acc[i, jj] += a_frag[i] * b_frag[jj]
            cuda.syncthreads()
        for i in range(TM):
            m = m0 + ty + i * (BM // TM)
            if m < m_size:
                for jj in range(TN):
                    j = j0 + tx + jj * NTX
                    if j < j_size:
                        c[s, m, j] = acc[i, jj]

    return gemm_splitk


# C = x @ W^T (linear forward), C = dy^T @ x (+ ones: weight and bias gradient),
# C = dy @ W (linear input gradient).
gemm_splitk_nt = make_gemm_splitk(False, True, False)
gemm_splitk_tn_ones = make_gemm_splitk(True, False, True)
gemm_splitk_nn = make_gemm_splitk(False, False, False)


def splitk_splits(m: int, j: int, k: int) -> int:
    """How many K-chunks: about GEMM_BLOCKS_PER_SM blocks per SM of the current
    device (:func:`common.runtime.sm_count`), each chunk at least one K-step."""
    tiles = ceil_div(m, GEMM_BM) * ceil_div(j, GEMM_BN)
    target = GEMM_BLOCKS_PER_SM * sm_count()
    return max(1, min(ceil_div(target, tiles), ceil_div(k, GEMM_BK)))


def splitk_chunk(k: int, splits: int) -> int:
    """K-chunk length for ``splits`` chunks, a multiple of GEMM_BK."""
    return ceil_div(ceil_div(k, splits), GEMM_BK) * GEMM_BK


def gemm_splitk(kernel, a, b, m: int, j: int, k: int, c, stream=0) -> int:
    """Launch a split-K GEMM kernel into partials c (S, m, j); returns S.

    ``c`` must have room for S = :func:`splitk_splits` (m, j, k) chunks (it is
    sliced to them here). The chunk count is recomputed from the actual K so
    that no chunk is empty.
    """
    splits = splitk_splits(m, j, k)
    chunk = splitk_chunk(k, splits)
    splits = ceil_div(k, chunk)
    grid = (ceil_div(j, GEMM_BN), ceil_div(m, GEMM_BM), splits)
    kernel[grid, GEMM_THREADS, stream](a, b, chunk, c[:splits])
    return splits


def splitk_partials_size(m: int, j: int, k: int) -> int:
    """Elements of the partial buffer :func:`gemm_splitk` needs for (m, j, k)."""
    return splitk_splits(m, j, k) * m * j


def make_splitk_reduce_bias(RELU):
    @cuda.jit(cache=True)
    def splitk_reduce_bias(partials, splits, bias, y):
        i = cuda.grid(1)
        if i >= y.size:
            return
        n_out = y.shape[1]
        o = i % n_out
        n = i // n_out
        acc = bias[o]
        for s in range(splits):
            acc += partials[s, n, o]
        y[n, o] = max(acc, float32(0.0)) if RELU else acc

    return splitk_reduce_bias


splitk_reduce_bias_relu_kernel = make_splitk_reduce_bias(True)
splitk_reduce_bias_kernel = make_splitk_reduce_bias(False)


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


# OUTS outputs x LANES lanes of chunks a block.
SPLITK_REDUCE_SHAPE = pick(gpu=(64, 4), simulator=(8, 2))
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


def _partials_view(buf, splits: int, m: int, j: int):
    return buf[: splits * m * j].reshape((splits, m, j))


def linear_forward(x, w, b, y, partials_buf, relu: bool, stream=0) -> None:
    """y (N, O) = [relu](x (N, I) @ w (O, I)^T + b (O,)), split-K over I.

    partials_buf: 1-D float32 scratch of at least :func:`splitk_partials_size`
    (N, O, I) elements.
    """
    n, n_in = x.shape
    n_out = w.shape[0]
    splits = splitk_splits(n, n_out, n_in)
    part = _partials_view(partials_buf, splits, n, n_out)
    splits = gemm_splitk(gemm_splitk_nt, x, w, n, n_out, n_in, part, stream)
    reduce = splitk_reduce_bias_relu_kernel if relu else splitk_reduce_bias_kernel
    reduce[ceil_div(y.size, THREADS), THREADS, stream](part, splits, b, y)


def linear_grad_weight(dy, x, dw, db, partials_buf, stream=0) -> None:
    """dw (O, I) = dy^T x and db (O,) = sum_n dy, from dy (N, O) and x (N, I);
    split-K over the batch, partials summed in float64.

    partials_buf: at least :func:`splitk_partials_size` (O, I + 1, N) elements.
    """
    n, n_out = dy.shape
    n_in = x.shape[1]
    splits = splitk_splits(n_out, n_in + 1, n)
    part = _partials_view(partials_buf, splits, n_out, n_in + 1)
    splits = gemm_splitk(gemm_splitk_tn_ones, dy, x, n_out, n_in + 1, n, part, stream)
    splitk_reduce_weight_bias(part, splits, dw, db, stream)


def linear_grad_input(dy, w, dx, stream=0) -> None:
    """dx (N, I) = dy (N, O) @ w (O, I); K = O is short, so no split."""
    n, n_out = dy.shape
    n_in = w.shape[1]
    gemm_splitk_nn[(ceil_div(n_in, GEMM_BN), ceil_div(n, GEMM_BM), 1), GEMM_THREADS, stream](
        dy, w, ceil_div(n_out, GEMM_BK) * GEMM_BK, dx.reshape((1, n, n_in))
    )


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
