"""conv1 without its output or its output's gradient in memory.

conv1 reads 1 input channel (3 for colour images) and writes 32: at batch 1024
its output z1 and the output's gradient dz1 are 103 MB each, 32 times the
images. The unfused step writes z1 (the convolution with its batchnorm sums),
reads it (BN + ReLU + max-pool, the backward's dz1) and writes and reads dz1
(the weight gradient, a split-K implicit GEMM). But an element of z1 costs
only 9 * Ci multiply-adds to compute again from the images, so the three
kernels here each compute it where they need it:

    conv_bn_sums                  conv1's batchnorm sums (sum z, sum z^2 a channel)
    conv_bn_relu_maxpool          maxpool(relu(z scale + shift)): pooled1, argmax, zwin
    bn_backward_conv_grad_weight  the batchnorm backward and conv1's weight gradient

FastCNN uses all three for 2 or 3 input channels; for one input channel it
takes the statistics and the weight gradient from the images' patch Gram matrix
instead (:mod:`final_project.conv1_gram`) and only the max-pool kernel from here.
The backward kernel works from the images, the pooled gradient and the
forward's per-window records:

    z      = b[c] + sum over (ci, kh, kw) of w[c, ci, kh, kw] x[n, ci, h + kh - 1, w + kw - 1]
    xhat   = (z - mean[c]) * invstd[c]
    dy     = dpooled[n, c, h/2, w/2] at the window's winner (argmax) where the ReLU
             was open there (zwin * scale + shift > 0), else 0
    dz     = gamma[c] invstd[c] / M * (M dy - dbeta[c] - xhat dgamma[c])    (M = N H W)
    dw[c, ci, kh, kw] = sum over (n, h, w) of dz x[n, ci, h + kh - 1, w + kw - 1]
    db[c]             = sum over (n, h, w) of dz

dz is the batchnorm backward of :func:`final_project.fast_layers.bn_relu_maxpool_backward_dx`
(Ioffe and Szegedy 2015, section 3; the same formula as
``reference.batchnorm_backward``), dw and db the weight gradient of
:func:`final_project.fast_conv.conv2d_grad_weight_igemm`. The ReLU and the
window winner come from what the forward stored (``zwin``, ``argmax``), so the
backward routes the gradient exactly where the forward's decisions were; only
xhat is recomputed, off from the stored z1 by float32 rounding.

Work split. A block takes ``imgs`` images and WARPS x CPW channels: it copies
the images, zero-padded by one pixel, into shared memory once, then each warp
takes CPW channels and each lane one 2 x 2 pooling window at a time: a 4 x 4
patch of each input channel from shared memory into registers, shared by the
warp's CPW channels (the shared-memory loads, not the FMAs, limited the
one-channel-a-warp version), then for each channel four z's (36 FMAs a channel),
four dz's, and 9 Ci + 1 sums (another 36 FMAs a channel). Each lane sums its
windows in float32 in order; the 32 lanes' sums are added in a fixed order
through shared memory, one float32 partial per (block of images, channel,
column); the linear layers' reduction
(:func:`final_project.fast_layers.splitk_reduce_weight_bias`) adds those in
float64 in a fixed order. No atomics: the same result bit for bit, run to run.
Reads: the images (once a channel group, from L2 after the first), and three
pooled-size arrays (the gradient, the winners' z, a byte of argmax); writes:
(N / imgs) x Co x (9 Ci + 1) partials. CPW is 4 for the forward kernels and 2
for the backward (its 10 sums a channel fill the registers), halved while the
grid would leave SMs idle (:func:`channels_per_warp`).

Run the checks: ``python -m pytest tests/test_final_project_first_conv.py -q``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div, jit, pick, sm_count

import numpy as np
from numba import cuda, float32, float64, int32, uint64

from final_project import fast_layers

KSIZE = 3  # conv1: 3 x 3, padding 1, stride 1
TAPS = KSIZE * KSIZE
WARPS = pick(gpu=8, simulator=2)  # channels a block: one warp each
THREADS = 32 * WARPS
SUMS = 2 * THREADS  # a lane's two batchnorm sums
STAGE_ROWS = 4  # image rows a warp loads at once when staging
# Shared memory: the block's padded images, then (reused) the lanes' sums.
SMEM_FLOATS = pick(gpu=8192, simulator=2048)
MAX_IN_CHANNELS = 3  # (9 Ci + 1) sums a lane, WARPS * 32 lanes: must fit SMEM_FLOATS
IMAGE_BLOCKS_PER_SM = 2  # blocks of images an SM (each with its channel groups)
MIN_BLOCKS_PER_SM = 2  # fewer channels a warp until the grid has this many blocks an SM
MAX_CPW = {"sums": 4, "pool": 4, "backward": 2}  # channels a warp: the backward's 10
# sums a channel and its constants fill the registers at 4
assert WARPS * 32 * (TAPS * MAX_IN_CHANNELS + 1) <= SMEM_FLOATS


def supported(in_channels: int, height: int, width: int) -> str | None:
    """Why the fused kernel cannot take these sizes (a sentence), or None."""
    if not 1 <= in_channels <= MAX_IN_CHANNELS:
        return f"it takes 1 to {MAX_IN_CHANNELS} input channels, not {in_channels}"
    if height % 2 or width % 2:
        return f"the pooled image needs an even height and width, not {height} x {width}"
    if in_channels * (height + 2) * (width + 2) > SMEM_FLOATS:
        return (
            f"one padded {in_channels} x {height} x {width} image does not fit its "
            f"{SMEM_FLOATS * 4 // 1024} KiB of shared memory"
        )
    return None


def images_per_block(n: int, in_channels: int, height: int, width: int) -> int:
    """Images a block takes: as many as shared memory holds, but few enough for
    about IMAGE_BLOCKS_PER_SM blocks of images an SM (small batches: one)."""
    fit = SMEM_FLOATS // (in_channels * (height + 2) * (width + 2))
    want = n // (IMAGE_BLOCKS_PER_SM * sm_count())
    return max(1, min(fit, want, n))


def channels_per_warp(image_blocks: int, c_out: int, most: int) -> int:
    """Channels a warp takes (one patch from shared memory feeds them all): the
    most, halved while the grid (image_blocks x channel groups) would have fewer
    than MIN_BLOCKS_PER_SM blocks an SM."""
    cpw = most
    while cpw > 1 and image_blocks * ceil_div(c_out, WARPS * cpw) < MIN_BLOCKS_PER_SM * sm_count():
        cpw //= 2
    return cpw


def partials_shape(
    n: int, c_out: int, in_channels: int, height: int, width: int, imgs: int | None = None
) -> tuple[int, int, int]:
    """(S, Co, 9 Ci + 1): the float32 partials of :func:`bn_backward_conv_grad_weight`."""
    imgs = imgs or images_per_block(n, in_channels, height, width)
    return ceil_div(n, imgs), c_out, TAPS * in_channels + 1


def make_window_helpers(CI):
    """Device functions the three kernels share, for CI input channels:
    ``stage_images`` copies a block's images, zero-padded by one pixel, into
    shared memory; ``load_patch`` copies a window's 4 x 4 patch of each channel
    into registers; ``conv_at`` is conv1's output at pixel j (0..3, row-major) of
    the window. All three kernels compute z through ``conv_at``: the same
    operations in the same order, so the same float32 value in each."""
    NP = 16 * CI

    @jit(device=True, inline=True)
    def stage_images(sm, x, img0, here, height, width, tid):
        # a warp a padded row, its lanes along the row (one division a row);
        # STAGE_ROWS rows' loads issued before their stores, so a lane waits
        # one round trip for them, not one each
        hp = height + 2
        wp = width + 2
        warp = tid // 32
        rows = here * CI * hp
        vals = cuda.local.array(STAGE_ROWS, float32)
        for xx in range(tid - warp * 32, wp, 32):
            inside_x = xx >= 1 and xx <= width
            row0 = warp
            while row0 < rows:
                for k in range(STAGE_ROWS):
                    row = row0 + k * WARPS
                    q = row // hp
                    yy = row - q * hp
                    v = float32(0.0)
                    if row < rows and inside_x and yy >= 1 and yy <= height:
                        v = x[uint64(((img0 * CI + q) * height + yy - 1) * width + xx - 1)]
                    vals[k] = v
                for k in range(STAGE_ROWS):
                    row = row0 + k * WARPS
                    if row < rows:
                        sm[row * wp + xx] = vals[k]
                row0 += STAGE_ROWS * WARPS

    @jit(device=True, inline=True)
    def first_window(lane, ph_n, pw_n):
        """(img, ph, pw) of window ``lane`` of the block, and the step (in the
        same three) to the window 32 further: the loops then advance with
        carries, no division (a 64-bit one costs dozens of instructions)."""
        windows = ph_n * pw_n
        img = lane // windows
        r = lane - img * windows
        s_img = 32 // windows
        s_r = 32 - s_img * windows
        return img, r // pw_n, r % pw_n, s_img, s_r // pw_n, s_r % pw_n

    @jit(device=True, inline=True)
    def next_window(img, ph, pw, s_img, s_ph, s_pw, ph_n, pw_n):
        pw += s_pw
        ph += s_ph
        img += s_img
        if pw >= pw_n:
            pw -= pw_n
            ph += 1
        if ph >= ph_n:
            ph -= ph_n
            img += 1
        return img, ph, pw

    @jit(device=True, inline=True)
    def load_patch(patch, sm, img, ph, pw, plane, wp):
        for ci in range(CI):
            top = (img * CI + ci) * plane + 2 * ph * wp + 2 * pw
            for u in range(4):
                for v in range(4):
                    patch[ci * 16 + u * 4 + v] = sm[top + u * wp + v]

    @jit(device=True, inline=True)
    def conv_at(patch, wr, u, bias, j):
        # channel slot u's weights start at wr[u * 9 CI]
        dy = j // 2
        dx = j % 2
        z = bias
        for ci in range(CI):
            for kh in range(KSIZE):
                for kw in range(KSIZE):
                    z += (
                        wr[(u * CI + ci) * TAPS + kh * KSIZE + kw]
                        * patch[ci * 16 + (dy + kh) * 4 + dx + kw]
                    )
        return z

    return stage_images, first_window, next_window, load_patch, conv_at, NP


def make_conv_bn_sums(CI, CPW):
    """Kernel: conv1's batchnorm sums, without conv1's output in memory.
    Arguments (x, w, b, bn_partials, n_img, c_out, ph_n, pw_n, imgs), x, w and b
    flat; writes bn_partials[blockIdx.x, 0 or 1, c] = sum of z or of z^2 over
    the block's images, for its WARPS * CPW channels (CPW a warp, one patch
    shared by them). A lane sums each window's four z - k in float32 (k: the
    lane's first z of the channel), adds that in float64, and turns its shifted
    sums into plain ones (``fast_conv.shifted_sums``' algorithm); the 32 lanes
    are added in float64 in a fixed order."""
    stage_images, first_window, next_window, load_patch, conv_at, NP = make_window_helpers(CI)
    NW = TAPS * CI
    NWC = NW * CPW  # the warp's channels' weights

    @jit(launch_bounds=(THREADS, 1), cache=True)
    def conv_bn_sums(x, w, b, bn_partials, n_img, c_out, ph_n, pw_n, imgs):
        sm = cuda.shared.array(SMEM_FLOATS, float32)
        red = cuda.shared.array(SUMS, float64)
        wr = cuda.local.array(NWC, float32)
        bias = cuda.local.array(CPW, float32)
        kk = cuda.local.array(CPW, float32)
        a1 = cuda.local.array(CPW, float64)
        a2 = cuda.local.array(CPW, float64)
        patch = cuda.local.array(NP, float32)
        tid = int32(cuda.threadIdx.x & 1023)
        warp = tid // 32
        lane = tid - warp * 32
        height = 2 * ph_n
        width = 2 * pw_n
        wp = width + 2
        plane = (height + 2) * wp
        img0 = int32(cuda.blockIdx.x) * imgs
        here = min(imgs, n_img - img0)
        stage_images(sm, x, img0, here, height, width, tid)
        cuda.syncthreads()

        c0 = (int32(cuda.blockIdx.y) * WARPS + warp) * CPW
        count = 0
        for u in range(CPW):
            a1[u] = 0.0
            a2[u] = 0.0
            kk[u] = float32(0.0)
        if c0 < c_out and lane < here * ph_n * pw_n:
            for u in range(CPW):
                cu = min(c0 + u, c_out - 1)  # a slot past the last channel: computed, not written
                for j in range(NW):
                    wr[u * NW + j] = w[uint64(cu * NW + j)]
                bias[u] = b[cu]
            img, ph, pw, s_img, s_ph, s_pw = first_window(lane, ph_n, pw_n)
            load_patch(patch, sm, img, ph, pw, plane, wp)
            for u in range(CPW):
                kk[u] = conv_at(patch, wr, u, bias[u], 0)  # the shift: one of the channel's values
            while img < here:
                load_patch(patch, sm, img, ph, pw, plane, wp)
                for u in range(CPW):
                    s1 = float32(0.0)
                    s2 = float32(0.0)
                    for j in range(4):
                        t = conv_at(patch, wr, u, bias[u], j) - kk[u]
                        s1 += t
                        s2 += t * t
                    a1[u] += float64(s1)
                    a2[u] += float64(s2)
                count += 4
                img, ph, pw = next_window(img, ph, pw, s_img, s_ph, s_pw, ph_n, pw_n)
        for u in range(CPW):
            kd = float64(kk[u])
            red[tid] = count * kd + a1[u]
            red[THREADS + tid] = (count * kd) * kd + 2.0 * kd * a1[u] + a2[u]
            cuda.syncthreads()
            for t in range(tid, 2 * WARPS, THREADS):
                q = t // WARPS
                wq = t - q * WARPS
                cq = (int32(cuda.blockIdx.y) * WARPS + wq) * CPW + u
                if cq < c_out:
                    total = float64(0.0)
                    for el in range(32):
                        total += red[q * THREADS + wq * 32 + el]
                    bn_partials[uint64((int32(cuda.blockIdx.x) * 2 + q) * c_out + cq)] = total
            cuda.syncthreads()

    conv_bn_sums.cpw = CPW
    return conv_bn_sums


def make_conv_bn_relu_maxpool(CI, CPW):
    """Kernel: maxpool2x2(relu(conv1(x) * scale + shift)) with conv1 computed
    again from the images, as ``fast_layers.bn_relu_maxpool_forward``'s training
    kernel computes it from z1 (the argmax on the ReLU outputs, first maximum
    winning in row-major order, and the winner's z kept in zwin); CPW channels a
    warp share each patch. Arguments (x, w, b, scale, shift, pooled, argmax,
    zwin, n_img, c_out, ph_n, pw_n, imgs), the arrays flat."""
    stage_images, first_window, next_window, load_patch, conv_at, NP = make_window_helpers(CI)
    NW = TAPS * CI
    NWC = NW * CPW  # the warp's channels' weights

    @jit(launch_bounds=(THREADS, 1), cache=True)
    def conv_bn_relu_maxpool(
        x, w, b, scale, shift, pooled, argmax, zwin, n_img, c_out, ph_n, pw_n, imgs
    ):
        sm = cuda.shared.array(SMEM_FLOATS, float32)
        wr = cuda.local.array(NWC, float32)
        bias = cuda.local.array(CPW, float32)
        sc = cuda.local.array(CPW, float32)
        sh = cuda.local.array(CPW, float32)
        patch = cuda.local.array(NP, float32)
        tid = int32(cuda.threadIdx.x & 1023)
        warp = tid // 32
        lane = tid - warp * 32
        height = 2 * ph_n
        width = 2 * pw_n
        wp = width + 2
        plane = (height + 2) * wp
        img0 = int32(cuda.blockIdx.x) * imgs
        here = min(imgs, n_img - img0)
        stage_images(sm, x, img0, here, height, width, tid)
        cuda.syncthreads()
        c0 = (int32(cuda.blockIdx.y) * WARPS + warp) * CPW
        if c0 >= c_out:
            return
        for u in range(CPW):
            cu = min(c0 + u, c_out - 1)
            for j in range(NW):
                wr[u * NW + j] = w[uint64(cu * NW + j)]
            bias[u] = b[cu]
            sc[u] = scale[cu]
            sh[u] = shift[cu]
        zero = float32(0.0)
        windows = ph_n * pw_n
        img, ph, pw, s_img, s_ph, s_pw = first_window(lane, ph_n, pw_n)
        while img < here:
            load_patch(patch, sm, img, ph, pw, plane, wp)
            at0 = ((img0 + img) * c_out + c0) * windows + ph * pw_n + pw
            for u in range(CPW):
                if c0 + u < c_out:
                    z_best = conv_at(patch, wr, u, bias[u], 0)
                    best = max(z_best * sc[u] + sh[u], zero)
                    best_k = 0
                    for j in range(1, 4):
                        zj = conv_at(patch, wr, u, bias[u], j)
                        v = max(zj * sc[u] + sh[u], zero)
                        if v > best:
                            best = v
                            best_k = j
                            z_best = zj
                    at = uint64(at0 + u * windows)
                    pooled[at] = best
                    argmax[at] = best_k
                    zwin[at] = z_best
            img, ph, pw = next_window(img, ph, pw, s_img, s_ph, s_pw, ph_n, pw_n)

    conv_bn_relu_maxpool.cpw = CPW
    return conv_bn_relu_maxpool


def make_bn_backward_conv_grad_weight(CI, CPW):
    """The kernel for Ci = CI input channels and CPW channels a warp (closure
    constants: the patch and the sums are register arrays). Arguments: (x, w, b,
    dpooled, argmax, zwin, mean, invstd, gamma, scale, shift, dgamma, dbeta,
    partials, n, c_out, ph_n, pw_n, imgs), the arrays flat; grid (ceil(N /
    imgs), ceil(Co / (WARPS CPW)))."""
    stage_images, first_window, next_window, load_patch, conv_at, NP = make_window_helpers(CI)
    NW = TAPS * CI  # weights a channel
    NJ = NW + 1  # the sums: dw's columns, then db
    NWC, NJC = NW * CPW, NJ * CPW  # the warp's channels' weights and sums

    @jit(launch_bounds=(THREADS, 1), cache=True)
    def bn_backward_conv_grad_weight(
        x,
        w,
        b,
        dpooled,
        argmax,
        zwin,
        mean,
        invstd,
        gamma,
        scale,
        shift,
        dgamma,
        dbeta,
        partials,
        n_img,
        c_out,
        ph_n,
        pw_n,
        imgs,
    ):
        sm = cuda.shared.array(SMEM_FLOATS, float32)
        wr = cuda.local.array(NWC, float32)
        acc = cuda.local.array(NJC, float32)
        bias = cuda.local.array(CPW, float32)
        mu = cuda.local.array(CPW, float32)
        inv = cuda.local.array(CPW, float32)
        sc = cuda.local.array(CPW, float32)
        sh = cuda.local.array(CPW, float32)
        kd = cuda.local.array(CPW, float32)
        base = cuda.local.array(CPW, float32)
        dg = cuda.local.array(CPW, float32)
        win = cuda.local.array(CPW, int32)
        zw = cuda.local.array(CPW, float32)
        gg = cuda.local.array(CPW, float32)
        patch = cuda.local.array(NP, float32)
        tid = int32(cuda.threadIdx.x & 1023)
        warp = tid // 32
        lane = tid - warp * 32
        height = 2 * ph_n
        width = 2 * pw_n
        wp = width + 2
        plane = (height + 2) * wp
        img0 = int32(cuda.blockIdx.x) * imgs
        here = min(imgs, n_img - img0)
        stage_images(sm, x, img0, here, height, width, tid)
        cuda.syncthreads()

        for j in range(NJC):
            acc[j] = float32(0.0)
        c0 = (int32(cuda.blockIdx.y) * WARPS + warp) * CPW
        count = float32(n_img * height * width)
        if c0 < c_out:
            for u in range(CPW):
                cu = min(c0 + u, c_out - 1)
                for j in range(NW):
                    wr[u * NW + j] = w[uint64(cu * NW + j)]
                bias[u] = b[cu]
                mu[u] = mean[cu]
                inv[u] = invstd[cu]
                sc[u] = scale[cu]
                sh[u] = shift[cu]
                kd[u] = gamma[cu] * invstd[cu] / count
                base[u] = -dbeta[cu]
                dg[u] = dgamma[cu]
            windows = ph_n * pw_n
            img, ph, pw, s_img, s_ph, s_pw = first_window(lane, ph_n, pw_n)
            while img < here:
                # every slot's three loads first, unconditional (a slot past the
                # last channel reads the last one's): loads behind a branch are
                # not issued early, and each would wait its own round trip
                at0 = ((img0 + img) * c_out + c0) * windows + ph * pw_n + pw
                for u in range(CPW):
                    at = uint64(at0 + (min(c0 + u, c_out - 1) - c0) * windows)
                    win[u] = int32(argmax[at])
                    zw[u] = zwin[at]
                    gg[u] = dpooled[at]
                load_patch(patch, sm, img, ph, pw, plane, wp)
                for u in range(CPW):
                    if c0 + u < c_out:
                        g = float32(0.0)
                        if zw[u] * sc[u] + sh[u] > float32(0.0):
                            g = count * gg[u]
                        for j in range(4):
                            xhat = (conv_at(patch, wr, u, bias[u], j) - mu[u]) * inv[u]
                            d = kd[u] * (
                                (g if j == win[u] else float32(0.0)) + base[u] - xhat * dg[u]
                            )
                            dy = j // 2
                            dx = j % 2
                            for ci in range(CI):
                                for kh in range(KSIZE):
                                    for kw in range(KSIZE):
                                        acc[u * NJ + ci * TAPS + kh * KSIZE + kw] += (
                                            d * patch[ci * 16 + (dy + kh) * 4 + dx + kw]
                                        )
                            acc[u * NJ + NW] += d
                img, ph, pw = next_window(img, ph, pw, s_img, s_ph, s_pw, ph_n, pw_n)

        # the lanes' sums, added in a fixed order through shared memory (the
        # images are done), one channel slot at a time
        for u in range(CPW):
            cuda.syncthreads()
            for j in range(NJ):
                sm[(warp * NJ + j) * 32 + lane] = acc[u * NJ + j]
            cuda.syncthreads()
            for t in range(tid, WARPS * NJ, THREADS):
                wq = t // NJ
                j = t - wq * NJ
                cq = (int32(cuda.blockIdx.y) * WARPS + wq) * CPW + u
                if cq < c_out:
                    s = float32(0.0)
                    for el in range(32):
                        # rotated start: the threads of a warp read 32 different banks
                        s += sm[t * 32 + (el + t) % 32]
                    partials[uint64((int32(cuda.blockIdx.x) * c_out + cq) * NJ + j)] = s

    bn_backward_conv_grad_weight.cpw = CPW
    return bn_backward_conv_grad_weight


_KERNELS: dict[tuple, object] = {}


def _kernel(factory, ci: int, cpw: int):
    key = (factory.__name__, ci, cpw)
    if key not in _KERNELS:
        _KERNELS[key] = factory(ci, cpw)
    return _KERNELS[key]


def _pick_kernel(kernel, factory, kind, cpw, ci, image_blocks, c_out):
    """The kernel to launch and its channels a warp."""
    if kernel is not None:
        return kernel, kernel.cpw
    cpw = cpw or channels_per_warp(image_blocks, c_out, MAX_CPW[kind])
    if cpw not in (1, 2, 4):
        raise ValueError(f"cpw = {cpw}: a warp takes 1, 2 or 4 channels")
    return _kernel(factory, ci, cpw), cpw


def _check_images(x, w) -> tuple[int, int, int, int, int]:
    """(N, Ci, H, W, Co) of conv1's input and weight, refused as the kernels need."""
    require_device_array(x, "x", 4, np.float32)
    n, ci, height, width = x.shape
    reason = supported(ci, height, width)
    if reason:
        raise ValueError(f"first_conv: {reason}")
    require_device_array(w, "w", 4, np.float32)
    c_out = w.shape[0]
    if w.shape != (c_out, ci, KSIZE, KSIZE):
        raise ValueError(f"w has shape {w.shape}; x {x.shape} needs ({c_out}, {ci}, 3, 3)")
    return n, ci, height, width, c_out


def _check_vectors(c_out: int, **vectors) -> None:
    for name, a in vectors.items():
        require_device_array(a, name, 1, np.float32)
        if a.shape != (c_out,):
            raise ValueError(f"{name} has shape {a.shape}, not ({c_out},)")


def _check_pooled(shape, **arrays) -> None:
    for name, (a, dtype) in arrays.items():
        require_device_array(a, name, 4, dtype)
        if a.shape != shape:
            raise ValueError(f"{name} has shape {a.shape}; x and w need {shape}")


def _images_a_block(imgs, n, c_out, ci, height, width) -> int:
    fit = SMEM_FLOATS // (ci * (height + 2) * (width + 2))
    imgs = imgs or images_per_block(n, ci, height, width)
    if not 1 <= imgs <= fit:
        raise ValueError(f"imgs = {imgs}: a block's shared memory holds 1 to {fit} of these images")
    return imgs


def _flat(a):
    return a.reshape(a.size)


def bn_partial_rows(n: int, c_out: int, in_channels: int, height: int, width: int) -> int:
    """P, the rows of batchnorm partials :func:`conv_bn_sums` writes (one a block of images)."""
    return partials_shape(n, c_out, in_channels, height, width)[0]


def conv_bn_sums(
    x, w, b, bn_partials, imgs: int | None = None, cpw: int | None = None, stream=0, kernel=None
) -> None:
    """conv1's batchnorm partial sums, without conv1's output in memory.

    Args:
        x: (N, Ci, H, W) float32 images; Ci <= MAX_IN_CHANNELS, H and W even.
        w, b: conv1's weight (Co, Ci, 3, 3) and bias (Co,), float32 (padding 1).
        bn_partials: (P, 2, Co) float64, P = ceil(N / imgs) (:func:`bn_partial_rows`
            for the default imgs): row p holds the sums of z and of z^2 over the
            p-th block of images, z = conv1(x); every row is written, for
            :func:`final_project.fast_layers.bn_stats_finalize`.
        imgs, cpw, kernel: as for :func:`bn_backward_conv_grad_weight`.

    Raises:
        TypeError, ValueError: as for :func:`bn_backward_conv_grad_weight`.
    """
    n, ci, height, width, c_out = _check_images(x, w)
    _check_vectors(c_out, b=b)
    imgs = _images_a_block(imgs, n, c_out, ci, height, width)
    rows = ceil_div(n, imgs)
    require_device_array(bn_partials, "bn_partials", 3, np.float64)
    if bn_partials.shape != (rows, 2, c_out):
        raise ValueError(f"bn_partials has shape {bn_partials.shape}, not {(rows, 2, c_out)}")
    kernel, cpw = _pick_kernel(kernel, make_conv_bn_sums, "sums", cpw, ci, rows, c_out)
    kernel[(rows, ceil_div(c_out, WARPS * cpw)), THREADS, stream](
        _flat(x), _flat(w), b, _flat(bn_partials), n, c_out, height // 2, width // 2, imgs
    )


def conv_bn_relu_maxpool(
    x,
    w,
    b,
    scale,
    shift,
    pooled,
    argmax,
    zwin,
    imgs: int | None = None,
    cpw: int | None = None,
    stream=0,
    kernel=None,
) -> None:
    """pooled = maxpool2x2(relu(conv1(x) * scale + shift)), conv1 computed from
    the images (not read from memory), as
    :func:`final_project.fast_layers.bn_relu_maxpool_forward` computes it from z.

    Args:
        x, w, b: as for :func:`conv_bn_sums`.
        scale, shift: (Co,) float32, batchnorm's affine map (training: from
            :func:`final_project.fast_layers.bn_stats_finalize`).
        pooled: (N, Co, H/2, W/2) float32 output.
        argmax: (N, Co, H/2, W/2) int8 output, the window position 0..3
            (row-major) of the first maximum of the ReLU outputs (torch's rule).
        zwin: (N, Co, H/2, W/2) float32 output, conv1's output at that position.
        imgs, cpw, kernel: as for :func:`bn_backward_conv_grad_weight`.

    Raises:
        TypeError, ValueError: as for :func:`bn_backward_conv_grad_weight`.
    """
    n, ci, height, width, c_out = _check_images(x, w)
    _check_vectors(c_out, b=b, scale=scale, shift=shift)
    _check_pooled(
        (n, c_out, height // 2, width // 2),
        pooled=(pooled, np.float32),
        argmax=(argmax, np.int8),
        zwin=(zwin, np.float32),
    )
    imgs = _images_a_block(imgs, n, c_out, ci, height, width)
    rows = ceil_div(n, imgs)
    kernel, cpw = _pick_kernel(kernel, make_conv_bn_relu_maxpool, "pool", cpw, ci, rows, c_out)
    kernel[(rows, ceil_div(c_out, WARPS * cpw)), THREADS, stream](
        *(_flat(a) for a in (x, w)),
        b,
        scale,
        shift,
        *(_flat(a) for a in (pooled, argmax, zwin)),
        n,
        c_out,
        height // 2,
        width // 2,
        imgs,
    )


def bn_backward_conv_grad_weight(
    x,
    w,
    b,
    dpooled,
    argmax,
    zwin,
    mean,
    invstd,
    gamma,
    scale,
    shift,
    dgamma,
    dbeta,
    dw,
    db,
    partials,
    imgs: int | None = None,
    cpw: int | None = None,
    stream=0,
    kernel=None,
) -> None:
    """dw (Co, Ci, 3, 3) and db (Co,): the gradient of conv1 (3 x 3, padding 1)
    under batchnorm -> ReLU -> 2 x 2 max-pool, from the images and the pooled
    gradient, without conv1's output or its gradient in memory (module docstring).

    Args:
        x: (N, Ci, H, W) float32, conv1's input; Ci <= MAX_IN_CHANNELS, H and W even.
        w, b: conv1's weight (Co, Ci, 3, 3) and bias (Co,), float32.
        dpooled: (N, Co, H/2, W/2) float32, the loss gradient at the pool's output.
        argmax, zwin: (N, Co, H/2, W/2) int8 and float32, as the training forward
            wrote them (:func:`conv_bn_relu_maxpool` or
            :func:`final_project.fast_layers.bn_relu_maxpool_forward`).
        mean, invstd, scale, shift: (Co,) float32, the forward's batch statistics
            and affine map (:func:`final_project.fast_layers.bn_stats_finalize`).
        gamma, dgamma, dbeta: (Co,) float32, batchnorm's weight and its two
            gradients (:func:`final_project.fast_layers.bn_backward_finalize`).
        dw, db: float32 outputs, every element written.
        partials: float32 scratch of :func:`partials_shape` (N, Co, Ci, H, W, imgs),
            fully overwritten.
        imgs: images a block (default :func:`images_per_block`).
        cpw: channels a warp, 1, 2 or 4 (default :func:`channels_per_warp`).
        kernel: one from the module's factory in place of the module's (tests
            launch broken ones); its channels a warp are its own.

    Never synchronizes or allocates: a CUDA graph can capture it; nor do the
    other two launchers.

    Raises:
        TypeError: an array is not a device array or has the wrong dtype.
        ValueError: shapes that do not match, sizes :func:`supported` refuses,
            or ``imgs`` out of range.
    """
    n, ci, height, width, c_out = _check_images(x, w)
    _check_pooled(
        (n, c_out, height // 2, width // 2),
        dpooled=(dpooled, np.float32),
        argmax=(argmax, np.int8),
        zwin=(zwin, np.float32),
    )
    _check_vectors(
        c_out,
        b=b,
        mean=mean,
        invstd=invstd,
        gamma=gamma,
        scale=scale,
        shift=shift,
        dgamma=dgamma,
        dbeta=dbeta,
        db=db,
    )
    require_device_array(dw, "dw", 4, np.float32)
    if dw.shape != w.shape:
        raise ValueError(f"dw has shape {dw.shape}, not w's {w.shape}")
    imgs = _images_a_block(imgs, n, c_out, ci, height, width)
    shape = partials_shape(n, c_out, ci, height, width, imgs)
    require_device_array(partials, "partials", 3, np.float32)
    if partials.shape != shape:
        raise ValueError(f"partials has shape {partials.shape}, not {shape}")
    kernel, cpw = _pick_kernel(
        kernel, make_bn_backward_conv_grad_weight, "backward", cpw, ci, shape[0], c_out
    )
    kernel[(shape[0], ceil_div(c_out, WARPS * cpw)), THREADS, stream](
        *(_flat(a) for a in (x, w, b, dpooled, argmax, zwin)),
        mean,
        invstd,
        gamma,
        scale,
        shift,
        dgamma,
        dbeta,
        _flat(partials),
        n,
        c_out,
        height // 2,
        width // 2,
        imgs,
    )
    fast_layers.splitk_reduce_weight_bias(partials, shape[0], dw, db, stream)
