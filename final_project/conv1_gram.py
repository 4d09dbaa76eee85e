"""conv1's batch statistics and weight gradient from the images' patch Gram matrix.

For a 3 x 3 convolution of a single-channel image, each output is a dot product
z = w~ . v of the channel's weights and bias w~ = (w, b) with the pixel's patch
vector v = (its 9 neighbours, 1). Everything batchnorm needs from z, and most of
what the weight gradient needs, is then a quadratic form of one 10 x 10 matrix
of the images alone, G = sum over the batch's pixels of v v^T:

    sum z         = w~ . G[:, 9]          (G[t, 9] = X[t], the sum of tap t; G[9, 9] = M pixels)
    sum z^2       = w~^T G w~
    sum z v[t]    = (G w~)[t]

The backward of batchnorm -> ReLU -> max-pool (the formula of
``first_conv``) gives, with k = gamma invstd / M and dgamma, dbeta its two
gradients,

    dw~[t] = sum over pixels of dz v[t]
           = k (M S[t] - dbeta X[t] - dgamma invstd ((G w~)[t] - mean X[t]))

where S[t] = sum over windows of g v_winner[t], g the pooled gradient that
reaches the window's winner (0 where the ReLU was closed): a sum over the
winners only, which the kernel that sums dgamma and dbeta (over the same
winners) adds at the same time. t = 9 gives db. So conv1's output is computed
once, in the forward's max-pool kernel (``first_conv.conv_bn_relu_maxpool``);
the statistics come from G (55 distinct entries, 55 float64 FMAs a pixel) and
the weight gradient from G and S, instead of two more passes that each compute
conv1 again (``first_conv.conv_bn_sums`` and
``first_conv.bn_backward_conv_grad_weight``, still used for 2 or 3 input
channels, where G has 190 or 406 entries).

Precision: a float32 pixel times a float32 pixel is exact in float64, so G is
the float64 sum of exact products; the statistics and the combination above are
evaluated in float64 (the mean too, from G), so the cancellations in
E[z^2] - E[z]^2 and in (G w~)[t] - mean X[t] cost float64 rounding only. S is
summed in float32 a lane and a block and float64 across blocks, as dz was.

Kernels: ``patch_gram`` (a block an image: its thread's pixels' v v^T in
float64 registers, the threads added in a fixed order), ``gram_finalize`` (the
images added in a fixed order), ``gram_bn_sums`` (sum z and sum z^2 a channel,
as the one row of batchnorm partials ``fast_layers.bn_stats_finalize`` reads),
``winners_reduce`` (dgamma's and dbeta's partials and S, one pass over the
pooled arrays), ``gram_grad_weight`` (dw and db).

Run the checks: ``python -m pytest tests/test_final_project_conv1_gram.py -q``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div, jit, pick

import numpy as np
from numba import cuda, float32, float64, int32, uint64

from final_project import fast_layers
from final_project import first_conv as fc1

V = fc1.TAPS + 1  # a pixel's patch vector: 9 taps, then 1
ENTRIES = V * (V + 1) // 2  # G's distinct entries (upper triangle, row by row)
GRAM_THREADS = pick(gpu=64, simulator=16)
GRAM_IMAGE = 4096  # floats of shared memory for one zero-padded image
FINAL_THREADS = pick(gpu=128, simulator=16)
RED = ENTRIES * GRAM_THREADS  # the threads' G entries, for the block's sum
STAGE = 4  # image values a thread loads at once when staging
WARPS, THREADS, SMEM_FLOATS = fc1.WARPS, fc1.THREADS, fc1.SMEM_FLOATS
# winners_reduce: 2 channels a warp, 3 blocks an SM (at 1 block, 136 registers
# at 4 channels a warp, it waited on its loads: 12% occupancy, 0.124 ms)
WINNERS_CPW = 2
WINNERS_MIN_BLOCKS = 3


def supported(in_channels: int, height: int, width: int) -> str | None:
    """Why the Gram path cannot take these sizes (a sentence), or None."""
    if in_channels != 1:
        return f"it takes 1 input channel, not {in_channels}"
    reason = fc1.supported(in_channels, height, width)
    if reason:
        return reason
    if (height + 2) * (width + 2) > GRAM_IMAGE:
        return f"a padded {height} x {width} image is over {GRAM_IMAGE} floats"
    return None


def entry(i: int, j: int) -> int:
    """G[i, j]'s index among the ENTRIES stored (i <= j; row-major upper triangle)."""
    return i * V - i * (i - 1) // 2 + (j - i)


def gram_matrix(g: np.ndarray) -> np.ndarray:
    """The full symmetric (V, V) matrix from the ENTRIES stored (host)."""
    out = np.empty((V, V), np.float64)
    for i in range(V):
        for j in range(i, V):
            out[i, j] = out[j, i] = g[entry(i, j)]
    return out


@jit(device=True, inline=True)
def _entry(i, j):
    return i * V - i * (i - 1) // 2 + (j - i)


@jit(cache=True)
def patch_gram_kernel(x, partials, height, width):
    img = cuda.shared.array(GRAM_IMAGE, float32)
    red = cuda.shared.array(RED, float64)
    acc = cuda.local.array(ENTRIES, float64)
    v = cuda.local.array(V, float64)
    tid = int32(cuda.threadIdx.x & 1023)
    n = int32(cuda.blockIdx.x)
    wp = width + 2
    vals = cuda.local.array(STAGE, float32)
    total = (height + 2) * wp
    i0 = tid
    while i0 < total:  # STAGE loads issued before their stores
        for k in range(STAGE):
            i = i0 + k * GRAM_THREADS
            yy = i // wp
            xx = i - yy * wp
            val = float32(0.0)
            if i < total and yy >= 1 and yy <= height and xx >= 1 and xx <= width:
                val = x[uint64((n * height + yy - 1) * width + xx - 1)]
            vals[k] = val
        for k in range(STAGE):
            i = i0 + k * GRAM_THREADS
            if i < total:
                img[i] = vals[k]
        i0 += STAGE * GRAM_THREADS
    cuda.syncthreads()
    for e in range(ENTRIES):
        acc[e] = 0.0
    v[V - 1] = 1.0
    h = tid // width  # then stepped by GRAM_THREADS with a carry
    w = tid - h * width
    dh = GRAM_THREADS // width
    dw = GRAM_THREADS - dh * width
    while h < height:
        for kh in range(3):
            for kw in range(3):
                v[kh * 3 + kw] = float64(img[(h + kh) * wp + w + kw])
        for i in range(V):
            for j in range(V):  # constant bounds: unrolled, acc stays in registers
                if j >= i:
                    acc[_entry(i, j)] += v[i] * v[j]  # exact: two float32 in float64
        w += dw
        h += dh
        if w >= width:
            w -= width
            h += 1
    for e in range(ENTRIES):
        red[e * GRAM_THREADS + tid] = acc[e]
    cuda.syncthreads()
    for e in range(tid, ENTRIES, GRAM_THREADS):
        s = 0.0
        for t in range(GRAM_THREADS):
            s += red[e * GRAM_THREADS + (t + e) % GRAM_THREADS]  # rotated: no bank conflict
        partials[uint64(n * ENTRIES + e)] = s


@jit(cache=True)
def gram_finalize_kernel(partials, n_img, gram):
    red = cuda.shared.array(FINAL_THREADS, float64)
    e = cuda.blockIdx.x
    t = cuda.threadIdx.x
    s = 0.0
    for n in range(t, n_img, FINAL_THREADS):
        s += partials[uint64(n * ENTRIES + e)]
    red[t] = s
    cuda.syncthreads()
    half = FINAL_THREADS // 2  # a tree, in a fixed order
    while half > 0:
        if t < half:
            red[t] += red[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        gram[e] = red[0]


@jit(device=True, inline=True)
def _g(gram, i, j):
    return gram[_entry(min(i, j), max(i, j))]


@jit(device=True, inline=True)
def _gram_to_shared(gram, gs):
    # G's entries, read by every thread: in shared memory, not a chain of global loads
    for e in range(cuda.threadIdx.x, ENTRIES, cuda.blockDim.x):
        gs[e] = gram[e]
    cuda.syncthreads()


@jit(cache=True)
def gram_bn_sums_kernel(gram_in, w, b, bn_partials, c_out):
    gram = cuda.shared.array(ENTRIES, float64)
    _gram_to_shared(gram_in, gram)
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c >= c_out:
        return
    s1 = 0.0
    s2 = 0.0
    for i in range(V):
        wi = float64(b[c]) if i == V - 1 else float64(w[c * (V - 1) + i])
        s1 += wi * _g(gram, i, V - 1)
        for j in range(V):
            wj = float64(b[c]) if j == V - 1 else float64(w[c * (V - 1) + j])
            s2 += wi * wj * _g(gram, i, j)
    bn_partials[0, 0, c] = s1
    bn_partials[0, 1, c] = s2


def make_winners_reduce(CPW):
    """Kernel: per block of images and WARPS * CPW channels, the partial sums
    of dgamma (g xhat at the winner), dbeta (g) and S[t] (g times the winner's
    patch vector), g = the pooled gradient where the forward's ReLU was open
    at the winner. Arguments (x, dpooled, argmax, zwin, mean, invstd, scale,
    shift, bn_partials, s_partials, n_img, c_out, ph_n, pw_n, imgs), the arrays
    flat; bn_partials (P, 2, Co) float64, s_partials (P, Co, V) float32."""
    stage_images, first_window, next_window, load_patch, _, NP = fc1.make_window_helpers(1)
    NS = V + 1  # a channel's sums: S[0..9] (S[9] = dbeta's), then dgamma's
    NSC = NS * CPW

    @jit(launch_bounds=(THREADS, WINNERS_MIN_BLOCKS), cache=True)
    def winners_reduce(
        x,
        dpooled,
        argmax,
        zwin,
        mean,
        invstd,
        scale,
        shift,
        bn_partials,
        s_partials,
        n_img,
        c_out,
        ph_n,
        pw_n,
        imgs,
    ):
        sm = cuda.shared.array(SMEM_FLOATS, float32)
        acc = cuda.local.array(NSC, float32)
        patch = cuda.local.array(NP, float32)
        sc = cuda.local.array(CPW, float32)
        sh = cuda.local.array(CPW, float32)
        mu = cuda.local.array(CPW, float32)
        inv = cuda.local.array(CPW, float32)
        zws = cuda.local.array(CPW, float32)
        gs = cuda.local.array(CPW, float32)
        wins = cuda.local.array(CPW, int32)
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
        for j in range(NSC):
            acc[j] = float32(0.0)
        c0 = (int32(cuda.blockIdx.y) * WARPS + warp) * CPW
        if c0 < c_out:
            for u in range(CPW):
                cu = min(c0 + u, c_out - 1)
                sc[u] = scale[cu]
                sh[u] = shift[cu]
                mu[u] = mean[cu]
                inv[u] = invstd[cu]
            windows = ph_n * pw_n
            img, ph, pw, s_img, s_ph, s_pw = first_window(lane, ph_n, pw_n)
            while img < here:
                load_patch(patch, sm, img, ph, pw, plane, wp)
                at0 = ((img0 + img) * c_out + c0) * windows + ph * pw_n + pw
                # every slot's three loads first, unconditional (a slot past the
                # last channel reads the last one's), so they are all in flight
                for u in range(CPW):
                    at = uint64(at0 + (min(c0 + u, c_out - 1) - c0) * windows)
                    zws[u] = zwin[at]
                    gs[u] = dpooled[at]
                    wins[u] = int32(argmax[at])
                for u in range(CPW):
                    zw = zws[u]
                    g = gs[u]
                    win = wins[u]
                    if c0 + u < c_out and zw * sc[u] + sh[u] > float32(0.0):
                        for j in range(4):
                            gj = g if j == win else float32(0.0)
                            dy = j // 2
                            dx = j % 2
                            for kh in range(3):
                                for kw in range(3):
                                    acc[u * NS + kh * 3 + kw] += gj * patch[(dy + kh) * 4 + dx + kw]
                        acc[u * NS + V - 1] += g
                        acc[u * NS + V] += g * ((zw - mu[u]) * inv[u])
                img, ph, pw = next_window(img, ph, pw, s_img, s_ph, s_pw, ph_n, pw_n)

        # the lanes' sums in a fixed order, one channel slot at a time
        for u in range(CPW):
            cuda.syncthreads()
            for j in range(NS):
                sm[(warp * NS + j) * 32 + lane] = acc[u * NS + j]
            cuda.syncthreads()
            for t in range(tid, WARPS * NS, THREADS):
                wq = t // NS
                j = t - wq * NS
                cq = (int32(cuda.blockIdx.y) * WARPS + wq) * CPW + u
                if cq < c_out:
                    s = float64(0.0)
                    for el in range(32):
                        s += float64(sm[t * 32 + (el + t) % 32])
                    p = int32(cuda.blockIdx.x)
                    if j < V:
                        s_partials[uint64((p * c_out + cq) * V + j)] = s
                    if j == V - 1:
                        bn_partials[uint64((p * 2 + 1) * c_out + cq)] = s
                    if j == V:
                        bn_partials[uint64((p * 2) * c_out + cq)] = s

    winners_reduce.cpw = CPW
    return winners_reduce


@jit(cache=True)
def gram_grad_weight_kernel(
    gram_in, s_sum, s_bias, w, b, invstd, gamma, dgamma, dbeta, dw, db, c_out
):
    gram = cuda.shared.array(ENTRIES, float64)
    _gram_to_shared(gram_in, gram)
    q = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c = q // V
    t = q - c * V
    if c >= c_out:
        return
    m = _g(gram, V - 1, V - 1)
    mean = 0.0
    gw = 0.0  # (G w~)[t]
    for i in range(V):
        wi = float64(b[c]) if i == V - 1 else float64(w[c * (V - 1) + i])
        mean += wi * _g(gram, i, V - 1)
        gw += wi * _g(gram, i, t)
    mean /= m
    inv = float64(invstd[c])
    s = float64(s_bias[c]) if t == V - 1 else float64(s_sum[c * (V - 1) + t])
    xt = _g(gram, t, V - 1)
    val = (
        float64(gamma[c])
        * inv
        * (s - (float64(dbeta[c]) * xt + float64(dgamma[c]) * inv * (gw - mean * xt)) / m)
    )
    if t == V - 1:
        db[c] = val
    else:
        dw[c * (V - 1) + t] = val


_WINNERS: dict[int, object] = {}


def _winners_kernel(cpw: int):
    if cpw not in _WINNERS:
        _WINNERS[cpw] = make_winners_reduce(cpw)
    return _WINNERS[cpw]


def gram_partials_shape(n: int) -> tuple[int, int]:
    """(N, ENTRIES): the float64 per-image partials of :func:`patch_gram`."""
    return n, ENTRIES


def patch_gram(x, partials, gram, stream=0) -> None:
    """gram (ENTRIES,) float64: the upper triangle of G = sum over the images'
    pixels of v v^T, v = (the pixel's 3 x 3 neighbourhood, zero-padded; 1), for
    x (N, 1, H, W) float32; partials (N, ENTRIES) float64 scratch.

    Raises:
        TypeError, ValueError: arrays of the wrong kind or shape, or sizes
            :func:`supported` refuses.
    """
    require_device_array(x, "x", 4, np.float32)
    n, ci, height, width = x.shape
    reason = supported(ci, height, width)
    if reason:
        raise ValueError(f"patch_gram: {reason}")
    require_device_array(partials, "partials", 2, np.float64)
    require_device_array(gram, "gram", 1, np.float64)
    if partials.shape != gram_partials_shape(n) or gram.shape != (ENTRIES,):
        raise ValueError(
            f"partials {partials.shape} and gram {gram.shape} must be "
            f"{gram_partials_shape(n)} and ({ENTRIES},)"
        )
    flat = partials.reshape(partials.size)
    patch_gram_kernel[n, GRAM_THREADS, stream](x.reshape(x.size), flat, height, width)
    gram_finalize_kernel[ENTRIES, FINAL_THREADS, stream](flat, n, gram)


def _check_gram(gram) -> None:
    require_device_array(gram, "gram", 1, np.float64)
    if gram.shape != (ENTRIES,):
        raise ValueError(f"gram has shape {gram.shape}, not ({ENTRIES},): patch_gram's output")


def _check_weights(w, b) -> int:
    """Co of conv1's weight (Co, 1, 3, 3) and bias (Co,), float32, refused otherwise."""
    require_device_array(w, "w", 4, np.float32)
    c_out = w.shape[0]
    if w.shape != (c_out, 1, 3, 3):
        raise ValueError(f"w has shape {w.shape}, not (Co, 1, 3, 3)")
    fc1._check_vectors(c_out, b=b)
    return c_out


def _check_shape(a, name: str, shape: tuple, dtype) -> None:
    require_device_array(a, name, len(shape), dtype)
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, not {shape}")


def gram_bn_sums(gram, w, b, bn_partials, stream=0) -> None:
    """bn_partials (1, 2, Co) float64 = (sum of z, sum of z^2) a channel, z =
    conv1(x) with weight w (Co, 1, 3, 3) and bias b (Co,) float32, from
    :func:`patch_gram`'s gram (ENTRIES,) float64, for
    ``fast_layers.bn_stats_finalize``.

    Raises:
        TypeError, ValueError: an array that is not a device array of that
            dtype and shape.
    """
    _check_gram(gram)
    c_out = _check_weights(w, b)
    _check_shape(bn_partials, "bn_partials", (1, 2, c_out), np.float64)
    gram_bn_sums_kernel[ceil_div(c_out, 32), 32, stream](
        gram, w.reshape(w.size), b, bn_partials, c_out
    )


def winners_partials_shape(n: int, c_out: int, height: int, width: int) -> tuple:
    """((P, 2, Co), (P, Co, V)): the shapes of :func:`winners_reduce`'s partials."""
    p = ceil_div(n, fc1.images_per_block(n, 1, height, width))
    return (p, 2, c_out), (p, c_out, V)


def winners_reduce(
    x, dpooled, argmax, zwin, mean, invstd, scale, shift, bn_partials, s_partials, stream=0,
    kernel=None, cpw=None,
) -> None:  # fmt: skip
    """One pass over the pooled arrays: bn_partials (P, 2, Co) float64 (dgamma's
    and dbeta's partial sums, for ``fast_layers.bn_backward_finalize``) and
    s_partials (P, Co, V) float32 (S[t], for :func:`gram_grad_weight`), P and
    the shapes from :func:`winners_partials_shape`. x (N, 1, H, W) float32;
    dpooled, argmax (int8) and zwin (N, Co, H/2, W/2); mean, invstd, scale,
    shift (Co,) float32: as for ``first_conv.bn_backward_conv_grad_weight``.
    ``kernel``: one from :func:`make_winners_reduce` (tests launch broken ones).

    Raises:
        TypeError, ValueError: an array that is not a device array of the
            dtype and shape above, or sizes :func:`supported` refuses.
    """
    require_device_array(x, "x", 4, np.float32)
    n, ci, height, width = x.shape
    reason = supported(ci, height, width)
    if reason:
        raise ValueError(f"winners_reduce: {reason}")
    require_device_array(dpooled, "dpooled", 4, np.float32)
    c_out = dpooled.shape[1]
    fc1._check_pooled(
        (n, c_out, height // 2, width // 2),
        dpooled=(dpooled, np.float32),
        argmax=(argmax, np.int8),
        zwin=(zwin, np.float32),
    )
    fc1._check_vectors(c_out, mean=mean, invstd=invstd, scale=scale, shift=shift)
    shapes = winners_partials_shape(n, c_out, height, width)
    _check_shape(bn_partials, "bn_partials", shapes[0], np.float64)
    _check_shape(s_partials, "s_partials", shapes[1], np.float32)
    imgs = fc1.images_per_block(n, 1, height, width)
    rows = shapes[0][0]
    if kernel is None:
        cpw = cpw or fc1.channels_per_warp(rows, c_out, WINNERS_CPW)
        kernel = _winners_kernel(cpw)
    flat = [a.reshape(a.size) for a in (x, dpooled, argmax, zwin)]
    kernel[(rows, ceil_div(c_out, WARPS * kernel.cpw)), THREADS, stream](
        *flat,
        mean,
        invstd,
        scale,
        shift,
        bn_partials.reshape(bn_partials.size),
        s_partials.reshape(s_partials.size),
        n,
        c_out,
        height // 2,
        width // 2,
        imgs,
    )


def gram_grad_weight(
    gram, s_partials, s_sum, s_bias, w, b, invstd, gamma, dgamma, dbeta, dw, db, stream=0
) -> None:
    """dw (Co, 1, 3, 3) and db (Co,) float32 from G (:func:`patch_gram`) and the
    winners' sums S (:func:`winners_reduce`'s s_partials, added here in float64
    in a fixed order into the float32 scratch s_sum (Co, 9) and s_bias (Co,))
    and batchnorm's invstd, gamma, dgamma and dbeta (module docstring). gram
    (ENTRIES,) float64; s_partials (P, Co, V) float32; w (Co, 1, 3, 3), the
    vectors (Co,), dw and db like w and b, all float32.

    Raises:
        TypeError, ValueError: an array that is not a device array of that
            dtype and shape.
    """
    _check_gram(gram)
    c_out = _check_weights(w, b)
    fc1._check_vectors(c_out, invstd=invstd, gamma=gamma, dgamma=dgamma, dbeta=dbeta)
    require_device_array(s_partials, "s_partials", 3, np.float32)
    _check_shape(s_partials, "s_partials", (s_partials.shape[0], c_out, V), np.float32)
    _check_shape(s_sum, "s_sum", (c_out, V - 1), np.float32)
    _check_shape(s_bias, "s_bias", (c_out,), np.float32)
    _check_shape(dw, "dw", (c_out, 1, 3, 3), np.float32)
    _check_shape(db, "db", (c_out,), np.float32)
    fast_layers.splitk_reduce_weight_bias(s_partials, s_partials.shape[0], s_sum, s_bias, stream)
    gram_grad_weight_kernel[ceil_div(c_out * V, 64), 64, stream](
        gram,
        s_sum.reshape(s_sum.size),
        s_bias,
        w.reshape(w.size),
        b,
        invstd,
        gamma,
        dgamma,
        dbeta,
        dw.reshape(dw.size),
        db,
        c_out,
    )
