"""conv1's fused backward (final_project/first_conv.py) against float64.

The kernel recomputes conv1's output from the images and routes the pooled
gradient through the forward's records (argmax, the winners' z), so the
reference here is the same chain in float64: conv2d_forward, the batchnorm
backward formula, conv2d_backward's weight gradient. The statistics are drawn
at random (not the batch's own), so db does not cancel to 0 and is checked too.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance

import numpy as np
import pytest
from conv1_inputs import bn_backward_inputs
from mutants import mutant
from numba import cuda

from final_project import first_conv as FC1
from final_project import reference as ref


def _inputs(rng, n, ci, h, w, c_out):
    return bn_backward_inputs(rng, n, ci, h, w, c_out)


def _reference(a):
    """(dw, db, magnitude of dw's terms, of db's terms) in float64."""
    f = {k: v.astype(np.float64) for k, v in a.items()}
    n, c_out, ph, pw = f["dpooled"].shape
    pc = lambda v: v[None, :, None, None]  # noqa: E731
    z, _ = ref.conv2d_forward(f["x"], f["w"], f["b"], 1)
    zabs, _ = ref.conv2d_forward(np.abs(f["x"]), np.abs(f["w"]), np.abs(f["b"]), 1)
    m = z.shape[0] * z.shape[2] * z.shape[3]
    xhat = (z - pc(f["mean"])) * pc(f["invstd"])
    open_ = f["zwin"] * pc(f["scale"]) + pc(f["shift"]) > 0
    g = np.where(open_, f["dpooled"], 0.0)
    code = np.repeat(np.repeat(a["argmax"].astype(np.int64), 2, 2), 2, 3)
    pos = (np.arange(2 * ph)[:, None] % 2) * 2 + np.arange(2 * pw)[None, :] % 2
    dy = np.where(code == pos, np.repeat(np.repeat(g, 2, 2), 2, 3), 0.0)
    k = pc(f["gamma"] * f["invstd"] / m)
    dz = k * (m * dy - pc(f["dbeta"]) - xhat * pc(f["dgamma"]))
    _, dw, db = ref.conv2d_backward(dz, (f["x"], f["w"], 1))
    # each dz's terms, with z's own: xhat's error is invstd times z's rounding
    dz_mag = np.abs(k) * (
        m * np.abs(dy)
        + np.abs(pc(f["dbeta"]))
        + (np.abs(xhat) + pc(f["invstd"]) * (zabs + np.abs(pc(f["mean"]))))
        * np.abs(pc(f["dgamma"]))
    )
    _, dw_mag, db_mag = ref.conv2d_backward(dz_mag, (np.abs(f["x"]), f["w"], 1))
    return dw, db, dw_mag, db_mag


def check_fused_backward(rng, n, ci, h, w, c_out, imgs=None, kernel=None, edit=None, cpw=None):
    """Run the fused kernel on fresh inputs and check dw and db against float64;
    ``edit(a)`` may change the inputs the kernel gets (not the reference's)."""
    a = _inputs(rng, n, ci, h, w, c_out)
    want_dw, want_db, dw_mag, db_mag = _reference(a)
    given = dict(a)
    if edit is not None:
        edit(given)
    dev = {k: cuda.to_device(v) for k, v in given.items()}
    dw, db = guarded((c_out, ci, 3, 3), np.float32), guarded(c_out, np.float32)
    parts = guarded(FC1.partials_shape(n, c_out, ci, h, w, imgs), np.float32)
    FC1.bn_backward_conv_grad_weight(
        *(dev[k] for k in ("x", "w", "b", "dpooled", "argmax", "zwin")),
        *(dev[k] for k in ("mean", "invstd", "gamma", "scale", "shift", "dgamma", "dbeta")),
        dw.array,
        db.array,
        parts.array,
        imgs=imgs,
        cpw=cpw,
        kernel=kernel,
    )
    for g, name in ((dw, "dw"), (db, "db"), (parts, "partials")):
        g.check_untouched(name)
    # z: 9 Ci + 1 roundings, xhat and dz about 6 more; a lane adds its pixels in
    # order, then the 32 lane sums are added in order
    per_lane = 4 * _lane_windows(imgs or FC1.images_per_block(n, ci, h, w), h * w // 4)
    roundings = 9 * ci + 8 + per_lane + 32
    check(dw.array, want_dw, rounding_tolerance(want_dw, dw_mag, roundings, 1e-5), "dw")
    check(db.array, want_db, rounding_tolerance(want_db, db_mag, roundings, 1e-5), "db")


def _lane_windows(imgs, windows):
    """Windows one lane takes: the block's windows over 32 lanes, rounded up."""
    return -(-imgs * windows // 32)


# Shapes for all three kernels: (N, Ci, H, W, Co, images a block, channels a warp)
SHAPES = [
    (1, 1, 2, 2, 1, None, None),  # one window, one channel
    (3, 1, 6, 4, 5, 2, 1),  # a short last block of images; a warp past Co
    (3, 1, 6, 4, 5, 2, 2),  # a warp's second channel past Co, a warp idle
    (2, 3, 4, 6, 3, 1, 4),  # three input channels; slots past Co
    (3, 1, 8, 12, 2, 3, 2),  # more windows than lanes
]


@pytest.mark.parametrize("n, ci, h, w, c_out, imgs, cpw", SHAPES)
def test_fused_backward_matches_float64(rng, n, ci, h, w, c_out, imgs, cpw):
    check_fused_backward(rng, n, ci, h, w, c_out, imgs, cpw=cpw)


def test_default_images_per_block_fits_and_fills():
    for n in (1, 7, 64, 1024):
        imgs = FC1.images_per_block(n, 1, 28, 28)
        assert 1 <= imgs <= min(n, FC1.SMEM_FLOATS // 900)


@pytest.mark.parametrize(
    "edit, why",
    [
        (("dx = j % 2", "dx = 0"), "pixel"),
        (
            (
                "conv_at(patch, wr, u, bias[u], j) - mu[u]",
                "conv_at(patch, wr, u, bias[u], j) - 2 * mu[u]",
            ),
            "bias",
        ),
        (("if j == win[u] else", "if j != win[u] else"), "winner"),
        (("zw[u] * sc[u] + sh[u] > float32(0.0)", "zw[u] * sc[u] + sh[u] > -1e30"), "relu"),
        (("acc[u * NJ + NW] += d", "acc[u * NJ + NW] += d * d"), "db"),
        (("= acc[u * NJ + j]", "= acc[j]"), "second channel"),
        (("(el + t) % 32", "(el + t) % 31"), "lane sums"),
        (("here = min(imgs, n_img - img0)", "here = min(imgs, n_img - img0 - 1)"), "last image"),
    ],
)
def test_check_catches_a_broken_kernel(rng, edit, why):
    kernel = mutant(FC1.make_bn_backward_conv_grad_weight, edit)(1, 2)
    with pytest.raises(CheckError):  # every lane busy: 2 images of 24 windows a block
        check_fused_backward(rng, 3, 1, 8, 12, 5, 2, kernel=kernel)


def test_check_catches_the_gradient_routed_past_the_relu(rng):
    """The kernel given every ReLU open, the reference the drawn ones."""

    def all_open(a):
        a["zwin"] = np.full_like(a["zwin"], 1e6)
        a["scale"] = np.abs(a["scale"]) + 1

    with pytest.raises(CheckError, match="dw"):
        check_fused_backward(rng, 2, 1, 4, 4, 3, edit=all_open)


def test_refuses_bad_inputs(rng):
    a = _inputs(rng, 2, 1, 4, 4, 3)
    dev = {k: cuda.to_device(v) for k, v in a.items()}
    dw, db = cuda.device_array((3, 1, 3, 3), np.float32), cuda.device_array(3, np.float32)
    parts = cuda.device_array(FC1.partials_shape(2, 3, 1, 4, 4), np.float32)

    def run(**over):
        d = {**dev, "dw": dw, "db": db, "partials": parts, **over}
        FC1.bn_backward_conv_grad_weight(
            *(
                d[k]
                for k in (
                    "x", "w", "b", "dpooled", "argmax", "zwin", "mean", "invstd",
                    "gamma", "scale", "shift", "dgamma", "dbeta", "dw", "db", "partials",
                )
            )
        )  # fmt: skip

    with pytest.raises(TypeError, match="argmax"):
        run(argmax=cuda.to_device(a["argmax"].astype(np.int32)))
    with pytest.raises(ValueError, match="dpooled"):
        run(dpooled=cuda.to_device(a["dpooled"][:1]))
    with pytest.raises(ValueError, match="partials"):
        run(partials=cuda.device_array((1, 3, 10), np.float32))
    with pytest.raises(ValueError, match="input channels"):
        run(x=cuda.to_device(random_array((2, 4, 4, 4), np.float32, rng)))
    with pytest.raises(ValueError, match="even"):
        run(x=cuda.to_device(random_array((2, 1, 5, 4), np.float32, rng)))
    run()  # and the same arrays, unchanged, run


# -- the forward: batchnorm sums, then the window kernel -----------------------


def check_conv_bn_sums(rng, n, ci, h, w, c_out, imgs=None, bias=None, kernel=None, cpw=None):
    """The kernel's sums of z and z^2 (its rows added in float64) against float64,
    and the variance they give. ``bias``: one bias for every channel, with
    small-integer images and weights of 1/1024 steps, so every z is exact in
    float32 and the variance's only error is the sums' own: a mean hundreds of
    times the spread must not cost the variance its accuracy."""
    if bias is None:
        x = random_array((n, ci, h, w), np.float32, rng)
        wt = random_array((c_out, ci, 3, 3), np.float32, rng)
        b = random_array(c_out, np.float32, rng)
    else:
        x = rng.integers(-4, 5, (n, ci, h, w)).astype(np.float32)
        wt = (rng.integers(-8, 9, (c_out, ci, 3, 3)) / 1024).astype(np.float32)
        b = np.full(c_out, bias, np.float32)
    f = [a.astype(np.float64) for a in (x, wt, b)]
    z, _ = ref.conv2d_forward(*f, 1)
    zabs, _ = ref.conv2d_forward(*(np.abs(a) for a in f), 1)
    imgs_ = imgs or FC1.images_per_block(n, ci, h, w)
    parts = guarded((-(-n // imgs_), 2, c_out), np.float64)
    FC1.conv_bn_sums(
        *(cuda.to_device(a) for a in (x, wt, b)), parts.array, imgs=imgs, cpw=cpw, kernel=kernel
    )
    parts.check_untouched("bn_partials")
    sums = parts.array.copy_to_host().sum(axis=0)
    count = n * h * w
    axes = (0, 2, 3)
    want1, want2 = z.sum(axis=axes), (z * z).sum(axis=axes)
    # z: 9 Ci + 1 roundings of zabs (none for the exact draw); z - k, its square
    # and the window's float32 sums: 4 more, of |z - k| (k, a z of the channel)
    z_err = 0.0 if bias is not None else zabs
    dev = np.abs(z - z.mean(axis=axes, keepdims=True))
    near = dev + dev.max(axis=axes, keepdims=True)  # bounds |z - k|
    roundings = 9 * ci + 5
    for got, want, mag, name in (
        (sums[0], want1, (z_err + near).sum(axis=axes), "sum of z"),
        (sums[1], want2, (2 * np.abs(z) * z_err + near**2).sum(axis=axes), "sum of z^2"),
        (
            sums[1] / count - (sums[0] / count) ** 2,
            z.var(axis=axes),
            (2 * dev * z_err + near**2).mean(axis=axes),
            "variance",
        ),
    ):
        check(got, want, rounding_tolerance(want, mag, roundings, 1e-6), name)


@pytest.mark.parametrize("n, ci, h, w, c_out, imgs, cpw", SHAPES)
def test_conv_bn_sums_match_float64(rng, n, ci, h, w, c_out, imgs, cpw):
    check_conv_bn_sums(rng, n, ci, h, w, c_out, imgs, cpw=cpw)


def test_conv_bn_sums_keep_a_large_mean_apart_from_the_spread(rng):
    check_conv_bn_sums(rng, 3, 1, 6, 4, 3, 2, bias=300.0)


@pytest.mark.parametrize(
    "edit, bias",
    [
        (("kk[u] = conv_at(patch, wr, u, bias[u], 0)", "kk[u] = float32(0.0)"), 300.0),
        (("here = min(imgs, n_img - img0)", "here = min(imgs, n_img - img0 - 1)"), None),
        (("t = conv_at(patch, wr, u, bias[u], j)", "t = conv_at(patch, wr, u, bias[u], 0)"), None),
        (("t = conv_at(patch, wr, u, bias[u], j)", "t = conv_at(patch, wr, 0, bias[u], j)"), None),
    ],
    ids=["unshifted", "last-image", "one-pixel", "first-channel-weights"],
)
def test_sums_check_catches_a_broken_kernel(rng, edit, bias):
    kernel = mutant(FC1.make_conv_bn_sums, edit)(1, 2)
    with pytest.raises(CheckError):
        check_conv_bn_sums(rng, 3, 1, 8, 12, 5, 2, bias=bias, kernel=kernel)


def _judgeable(y, margin):
    """No window whose two largest ReLU outputs are within ``margin`` unless both
    are exactly 0, and no pre-activation within ``margin`` of 0."""
    r = np.maximum(y, 0.0)
    n, c, h, w = r.shape
    win = r.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(-1, 4)
    top = np.sort(win, axis=1)
    close = (top[:, 3] - top[:, 2] < margin) & (top[:, 3] > 0)
    return not close.any() and np.all(np.abs(y) > margin)


def check_conv_bn_relu_maxpool(rng, n, ci, h, w, c_out, imgs=None, kernel=None, cpw=None):
    """pooled, argmax and zwin against float64, on a draw with no near-ties (with
    Co > 1 one channel's ReLU closed everywhere: four tied zeros, the first must
    win)."""
    for _ in range(100):
        x = random_array((n, ci, h, w), np.float32, rng)
        wt = random_array((c_out, ci, 3, 3), np.float32, rng)
        b, sc, sh = (random_array(c_out, np.float32, rng) for _ in range(3))
        f = [a.astype(np.float64) for a in (x, wt, b)]
        z, _ = ref.conv2d_forward(*f, 1)
        zabs, _ = ref.conv2d_forward(*(np.abs(a) for a in f), 1)
        if c_out > 1:  # the last channel's ReLU closed everywhere: four tied zeros
            sh[-1] = np.float32(-(np.abs(z[:, -1] * sc[-1]).max() + 1.0))
        pc = lambda v: v.astype(np.float64)[None, :, None, None]  # noqa: E731
        y = z * pc(sc) + pc(sh)
        mag = zabs * np.abs(pc(sc)) + np.abs(pc(sh))
        if _judgeable(y, 1e-4 * mag.max()) and np.any(y > 0):
            break
    else:
        raise AssertionError("100 draws in a row had a near-tie or no open ReLU")
    ph, pw = h // 2, w // 2
    pooled = guarded((n, c_out, ph, pw), np.float32)
    argmax = guarded((n, c_out, ph, pw), np.int8)
    zwin = guarded((n, c_out, ph, pw), np.float32)
    FC1.conv_bn_relu_maxpool(
        *(cuda.to_device(a) for a in (x, wt, b, sc, sh)),
        pooled.array,
        argmax.array,
        zwin.array,
        imgs=imgs,
        cpw=cpw,
        kernel=kernel,
    )
    for g, name in ((pooled, "pooled"), (argmax, "argmax"), (zwin, "zwin")):
        g.check_untouched(name)

    def windows(a):
        shape = (n, c_out, ph, 2, pw, 2)
        return a.reshape(shape).transpose(0, 1, 2, 4, 3, 5).reshape(n, c_out, ph, pw, 4)

    r = windows(np.maximum(y, 0.0))
    code = r.argmax(axis=-1)  # numpy's argmax: the first maximum
    check(argmax.array, code.astype(np.int8), name="argmax (first maximum wins)")
    take = lambda a: np.take_along_axis(windows(a), code[..., None], axis=-1)[..., 0]  # noqa: E731
    roundings = 9 * ci + 4
    want = take(np.maximum(y, 0.0))
    check(pooled.array, want, rounding_tolerance(want, take(mag), roundings, 1e-6), "pooled")
    want_z = take(z)
    check(zwin.array, want_z, rounding_tolerance(want_z, take(zabs), roundings, 1e-6), "zwin")


@pytest.mark.parametrize("n, ci, h, w, c_out, imgs, cpw", SHAPES)
def test_conv_bn_relu_maxpool_matches_float64(rng, n, ci, h, w, c_out, imgs, cpw):
    check_conv_bn_relu_maxpool(rng, n, ci, h, w, c_out, imgs, cpw=cpw)


@pytest.mark.parametrize(
    "edit",
    [
        ("if v > best:", "if v >= best:"),
        ("best = max(z_best * sc[u] + sh[u], zero)", "best = z_best * sc[u] + sh[u]"),
        ("z_best = zj", "z_best = zj + sh[u]"),
        ("at = uint64(at0 + u * windows)", "at = uint64(at0 + u)"),
        ("here = min(imgs, n_img - img0)", "here = min(imgs, n_img - img0 - 1)"),
    ],
    ids=["last-maximum", "relu", "zwin", "channel-offset", "last-image"],
)
def test_pool_check_catches_a_broken_kernel(rng, edit):
    kernel = mutant(FC1.make_conv_bn_relu_maxpool, edit)(1, 2)
    with pytest.raises(CheckError):
        check_conv_bn_relu_maxpool(rng, 3, 1, 8, 12, 5, 2, kernel=kernel)
