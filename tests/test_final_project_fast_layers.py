"""The fast capstone kernels around the convolutions (final_project.fast_layers)
against torch.autograd in float64, on hostile shapes: batch 1, odd channel
counts, sizes that are not multiples of the tiles, ties in the max-pool, a
closed ReLU at exactly zero, logits past float64's exp range, a variance below
batchnorm's eps, channels whose |mean| is 40 to 1000 times their std, a batch
that leaves the batchnorm backward reduce a short last group of images, labels
outside [0, C) (C itself among them); for each edge a broken kernel (a one-token
source edit of the real one) must fail the check. float32 kernels against a
float64 truth land near 1e-6; the tolerance 1e-4 (final_project.checks.TOL)
leaves room for sums of a few thousand terms and fails any wrong index; where
terms cancel, the tolerance is their float32 rounding (rounding_tolerance).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance
from common.internal.float32_purity import float64_uses, recording_launches
from common.runtime import ceil_div, is_simulator

import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mutants import mutant
from numba import cuda

from final_project import checks
from final_project import fast_layers as fl
from final_project.checks import TOL


def _t(a, grad=False):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _partials_of(z, rows):
    """(rows, 2, C) float64 per-block sums as a convolution epilogue writes them:
    the flat N*H*W positions of each channel split into ``rows`` chunks."""
    n, c, h, w = z.shape
    flat = z.astype(np.float64).transpose(1, 0, 2, 3).reshape(c, -1)
    parts = np.array_split(flat, rows, axis=1)
    out = np.empty((rows, 2, c))
    for p, chunk in enumerate(parts):
        out[p, 0] = chunk.sum(1)
        out[p, 1] = (chunk**2).sum(1)
    return out


def _bn_forward_stats(
    rng, z, rows=3, eps=1e-5, momentum=0.1, zero_beta=(), finalize=fl.bn_stats_finalize
):
    c = z.shape[1]
    gamma = random_array(c, np.float32, rng, 0.5, 2.0)
    # beta >= 0: each channel's largest value passes the ReLU, so with one
    # window a channel (batch 1, 2 x 2) dgamma and dbeta are not all zero.
    beta = np.abs(random_array(c, np.float32, rng))
    beta[list(zero_beta)] = 0.0
    rm = random_array(c, np.float32, rng)
    rv = random_array(c, np.float32, rng, 0.5, 2.0)
    dev = {k: cuda.to_device(v) for k, v in dict(gamma=gamma, beta=beta, rm=rm, rv=rv).items()}
    stats = {k: guarded(c, np.float32) for k in ("mean", "invstd", "scale", "shift")}
    finalize(
        cuda.to_device(_partials_of(z, rows)),
        z.size // c,
        dev["gamma"],
        dev["beta"],
        eps,
        momentum,
        dev["rm"],
        dev["rv"],
        *(stats[k].array for k in ("mean", "invstd", "scale", "shift")),
    )
    for k, g in stats.items():
        g.check_untouched(k)
    return gamma, beta, rm, rv, dev, {k: g.array for k, g in stats.items()}


def _conv_like(rng, n, c, h, w):
    """Per-channel shifted and scaled data, as a convolution's output."""
    return (
        random_array((n, c, h, w), np.float32, rng) * rng.uniform(0.5, 3, (1, c, 1, 1))
        + rng.uniform(-2, 2, (1, c, 1, 1))
    ).astype(np.float32)


@pytest.mark.parametrize("n, c, h, w, rows", [(2, 3, 4, 6, 3), (1, 5, 2, 2, 1), (3, 1, 4, 4, 7)])
def test_bn_stats_finalize(rng, n, c, h, w, rows):
    z = _conv_like(rng, n, c, h, w)
    gamma, beta, rm, rv, dev, stats = _bn_forward_stats(rng, z, rows)
    tz, trm, trv = _t(z), _t(rm), _t(rv)
    y = F.batch_norm(tz, trm, trv, _t(gamma), _t(beta), training=True, momentum=0.1, eps=1e-5)
    mean = tz.mean((0, 2, 3))
    var = tz.var((0, 2, 3), unbiased=False)
    check(stats["mean"], mean, TOL, "mean")
    check(stats["invstd"], 1 / torch.sqrt(var + 1e-5), TOL, "invstd")
    check(dev["rm"], trm, TOL, "running mean")
    check(dev["rv"], trv, TOL, "running var")
    # scale/shift fold the whole affine map: z * scale + shift must be y.
    sc = stats["scale"].copy_to_host().reshape(1, c, 1, 1)
    sh = stats["shift"].copy_to_host().reshape(1, c, 1, 1)
    check(z * sc + sh, y, TOL, "z * scale + shift")


# Channels' |mean| / std from 40, where a float32 E[x^2] - E[x]^2 starts to
# lose the variance (it rounds E[x^2] = (R^2 + 1) var by eps32 / 2: 1e-4 of var
# at R = 40), to 1000, where float32 data still resolve the spread (a value's
# rounding is 1e-4 of std).
MEAN_OVER_STD = (40.0, 1000.0)


def _large_mean_input(rng, n, c, h, w):
    """Conv-like z whose channel c has |mean| = R_c std, R_c spread geometrically
    over MEAN_OVER_STD in random order, random signs and spreads."""
    std = rng.uniform(0.5, 3, c)
    mean = rng.choice([-1.0, 1.0], c) * rng.permutation(np.geomspace(*MEAN_OVER_STD, c)) * std
    z = random_array((n, c, h, w), np.float32, rng) * std[:, None, None] + mean[:, None, None]
    return z.astype(np.float32)


def check_bn_stats_large_mean(rng, finalize=fl.bn_stats_finalize):
    """Training statistics of channels whose |mean| is 40 to 1000 times their
    std, from float64 partial sums (as the convolutions write them; their own
    accuracy on such channels is tests/test_final_project_fast_conv.py's).

    bn_stats_finalize works in float64 and rounds each result to float32 once;
    its one-pass variance loses R^2 2^-52 <= 3e-10 of var, far below that. So
    mean, invstd and the running statistics get two float32 roundings
    (eps32 each) and no more: a variance taken in float32 errs by R^2 eps32 / 2
    of var, from 1e-4 at R = 40, and fails.
    """
    z = _large_mean_input(rng, 2, 4, 4, 6)
    gamma, beta, rm, rv, dev, st = _bn_forward_stats(rng, z, finalize=finalize)
    tz, trm, trv = _t(z), _t(rm), _t(rv)
    y = F.batch_norm(tz, trm, trv, _t(gamma), _t(beta), training=True, momentum=0.1, eps=1e-5)
    want = {
        "mean": tz.mean((0, 2, 3)),
        "invstd": 1 / torch.sqrt(tz.var((0, 2, 3), unbiased=False) + 1e-5),
    }
    for k, ref in want.items():
        check(st[k], ref, rounding_tolerance(ref, ref, 2, 0.0), f"{k} (|mean| = 40 to 1000 std)")
    for got, ref, k in ((dev["rm"], trm, "running mean"), (dev["rv"], trv, "running var")):
        check(got, ref, rounding_tolerance(ref, ref, 2, 0.0), f"{k} (|mean| = 40 to 1000 std)")
    # z * scale + shift cancels (both terms are R times the output): allow the
    # float32 rounding of those terms, as check_bn_relu_maxpool does.
    sc = st["scale"].copy_to_host().astype(np.float64).reshape(1, -1, 1, 1)
    sh = st["shift"].copy_to_host().reshape(1, -1, 1, 1)
    mean64 = st["mean"].copy_to_host().astype(np.float64).reshape(1, -1, 1, 1)
    terms = np.abs(z * sc) + np.abs(mean64 * sc) + np.abs(beta).reshape(1, -1, 1, 1)
    check(
        z * sc.astype(np.float32) + sh,
        y,
        rounding_tolerance(y, terms, 6, TOL),
        "z * scale + shift (|mean| = 40 to 1000 std)",
    )


def test_bn_stats_large_mean(rng):
    check_bn_stats_large_mean(rng)


def test_large_mean_check_catches_float32_variance(rng):
    stats_kernel, _ = mutant(
        fl.make_partials_finalize,
        (
            "var = max(s1[0] / count - mu * mu, 0.0)",
            "var = max(float32(s1[0] / count) - float32(mu * mu), 0.0)",
        ),
    )(fl.REDUCE_THREADS)

    def broken(partials, count, gamma, beta, eps, momentum, rm, rv, mean, invstd, scale, shift):
        stats_kernel[mean.shape[0], fl.REDUCE_THREADS](
            partials, count, gamma, beta, eps, momentum, rm, rv, mean, invstd, scale, shift
        )

    with pytest.raises(CheckError, match="invstd"):
        check_bn_stats_large_mean(rng, finalize=broken)


def _bn_block_reference(z, gamma, beta, dpooled_shape_rng):
    """maxpool(relu(batchnorm(z))) in float64 torch, with grads wrt z, gamma, beta."""
    tz, tg, tb = _t(z, True), _t(gamma, True), _t(beta, True)
    y = F.batch_norm(tz, None, None, tg, tb, training=True, eps=1e-5)
    pooled, idx = F.max_pool2d(F.relu(y), 2, return_indices=True)
    return tz, tg, tb, pooled, idx


def check_bn_relu_maxpool(
    rng,
    z,
    zero_beta=(),
    forward=fl.bn_relu_maxpool_forward,
    reduce=None,
    backward_dx=fl.bn_relu_maxpool_backward_dx,
    winners=False,
):
    """maxpool(relu(batchnorm(z))) forward (values and the argmax code) and
    backward (dgamma, dbeta, dz) against torch; ``zero_beta``: channels whose
    beta is 0 (with a channel mean of exactly 0, a z of 0 is then exactly 0
    before the ReLU). ``winners``: the training step's path, the forward also
    keeping the winners' z (checked exactly) and the reduction reading it
    (default reduce: bn_relu_maxpool_backward_reduce_winners, else the gather
    through the argmax, bn_relu_maxpool_backward_reduce)."""
    if reduce is None:
        reduce = (
            fl.bn_relu_maxpool_backward_reduce_winners
            if winners
            else fl.bn_relu_maxpool_backward_reduce
        )
    n, c, h, w = z.shape
    gamma, beta, rm, rv, dev, st = _bn_forward_stats(rng, z, zero_beta=zero_beta)
    tz, tg, tb, pooled_ref, idx = _bn_block_reference(z, gamma, beta, rng)
    z_ = cuda.to_device(z)
    ph, pw = h // 2, w // 2
    pooled = guarded((n, c, ph, pw), np.float32)
    argmax = guarded((n, c, ph, pw), np.int8)
    if winners:
        zwin = guarded((n, c, ph, pw), np.float32)
        forward(z_, st["scale"], st["shift"], pooled.array, argmax.array, zwin=zwin.array)
        zwin.check_untouched("zwin")
    else:
        forward(z_, st["scale"], st["shift"], pooled.array, argmax.array)
    pooled.check_untouched("pooled")
    argmax.check_untouched("argmax")
    # z * scale + shift cancels where a channel's values are nearly equal (its
    # invstd near 1/sqrt(eps), scale and shift huge): allow the float32 rounding
    # of those terms, about 6 roundings of |z scale| + |mean scale| + |beta|
    # (scale and shift are rounded too), at the pooled element's window.
    sc64, mean64 = (
        st[k].copy_to_host().astype(np.float64)[None, :, None, None] for k in ("scale", "mean")
    )
    terms = np.abs(z * sc64) + np.abs(mean64 * sc64) + np.abs(beta)[None, :, None, None]
    terms = F.max_pool2d(torch.from_numpy(terms), 2).numpy()
    check(
        pooled.array,
        pooled_ref.detach(),
        rounding_tolerance(pooled_ref, terms, 6, TOL),
        "bn+relu+pool forward",
    )
    ref_code = (idx // w % 2) * 2 + idx % w % 2  # torch's flat plane index -> window position
    check(argmax.array, ref_code.numpy().astype(np.int8), name="argmax (first maximum wins)")
    if winners:
        # z at each window's winner, a copy: exact
        windows = z.reshape(n, c, ph, 2, pw, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, ph, pw, 4)
        code = argmax.array.copy_to_host().astype(np.int64)[..., None]
        check(zwin.array, np.take_along_axis(windows, code, axis=-1)[..., 0], name="zwin")

    dpooled = random_array((n, c, ph, pw), np.float32, rng)
    pooled_ref.backward(_t(dpooled))
    dp_ = cuda.to_device(dpooled)
    stats = [st[k] for k in ("mean", "invstd", "scale", "shift")]
    rows = fl.bn_backward_partial_rows(n, ph, pw)
    partials = guarded((rows, 2, c), np.float64)
    if winners:
        reduce(dp_, zwin.array, *stats, partials.array)
    else:
        reduce(dp_, argmax.array, z_, *stats, partials.array)
    partials.check_untouched("partials")
    dgamma, dbeta = guarded(c, np.float32), guarded(c, np.float32)
    fl.bn_backward_finalize(partials.array, dgamma.array, dbeta.array)
    check(dgamma.array, tg.grad, TOL, "dgamma")
    check(dbeta.array, tb.grad, TOL, "dbeta")
    dz = guarded(z.shape, np.float32)
    backward_dx(dp_, argmax.array, z_, *stats, dev["gamma"], dgamma.array, dbeta.array, dz.array)
    dz.check_untouched("dz")
    check(dz.array, tz.grad, TOL, "dz")


@pytest.mark.parametrize("winners", [False, True], ids=["gather", "winners"])
@pytest.mark.parametrize("n, c, h, w", [(2, 3, 4, 6), (1, 2, 2, 2), (3, 5, 8, 4)])
def test_bn_relu_maxpool_forward_and_backward(rng, n, c, h, w, winners):
    z = _conv_like(rng, n, c, h, w)
    # Ties: a window of equal values (the first must win, as in torch); and
    # windows all below the ReLU threshold (four tied zeros after it).
    z[0, 0, 0:2, 0:2] = z[0, 0, 0, 0]
    check_bn_relu_maxpool(rng, z, winners=winners)


def tail_group_shape(c=2):
    """(N, C, H, W) of a z whose backward reduce leaves its last block short:
    pooled planes of 6 x BN_REDUCE_BLOCK / 2 values, so a block (about 8 values
    a thread) takes bn_backward_images_per_block = 2 images, and N = 3 leaves
    one image for the last block, with the GPU's block size as with the
    simulator's."""
    n, h, w = 3, 12, fl.BN_REDUCE_BLOCK
    per = fl.bn_backward_images_per_block(n, h // 2, w // 2)
    assert per == 2 and n % per, per
    return n, c, h, w


@pytest.mark.parametrize("winners", [False, True], ids=["gather", "winners"])
def test_bn_relu_maxpool_batch_not_a_multiple_of_the_image_group(rng, winners):
    check_bn_relu_maxpool(rng, _conv_like(rng, *tail_group_shape()), winners=winners)


@pytest.mark.parametrize("winners", [False, True], ids=["gather", "winners"])
def test_tail_group_check_catches_dropped_last_block(rng, winners):
    """A launch of the backward reduce that rounds the block count down
    (N // images per block): the last, short group is never summed."""
    launcher = (
        fl.bn_relu_maxpool_backward_reduce_winners
        if winners
        else fl.bn_relu_maxpool_backward_reduce
    )
    broken = mutant(launcher, ("ceil_div(n, per)", "n // per"))
    with pytest.raises(CheckError, match="dgamma"):
        check_bn_relu_maxpool(
            rng, _conv_like(rng, *tail_group_shape()), reduce=broken, winners=winners
        )


def _zero_preactivation_input(rng, n=2, c=2, h=4, w=6):
    """Conv-like z whose channel 0 holds multiples of 1/8 (every sum exact) with
    a mean of exactly 0, and windows (0, 0, 1) of each image whose first value
    is exactly 0 and the other three negative. With beta = 0 that first value is
    exactly 0 after batchnorm: the window pools four ReLU zeros, the first wins
    (as in torch), and its ReLU is closed *at* 0, where torch's gradient is 0."""
    z = _conv_like(rng, n, c, h, w)
    q = rng.integers(1, 17, (n, h, w)) * rng.choice([-1.0, 1.0], (n, h, w)) / 8
    for pw in (0, 1):
        q[:, 0:2, 2 * pw : 2 * pw + 2] = -np.abs(q[:, 0:2, 2 * pw : 2 * pw + 2])
        q[:, 0, 2 * pw] = 0.0
    q[-1, -1, -1] -= q.sum()  # the channel mean becomes exactly 0
    z[:, 0] = q
    return z


@pytest.mark.parametrize("winners", [False, True], ids=["gather", "winners"])
def test_bn_relu_at_exactly_zero(rng, winners):
    check_bn_relu_maxpool(rng, _zero_preactivation_input(rng), zero_beta=(0,), winners=winners)


def test_bn_relu_maxpool_check_catches_last_maximum(rng):
    kernel = mutant(fl.bn_relu_maxpool_forward_kernel, ("if v > best:", "if v >= best:"))

    def broken(z, scale, shift, pooled, argmax):
        grid, block = fl._window_grid(pooled.shape)
        kernel[grid, block](z, scale, shift, pooled, argmax)

    z = _conv_like(rng, 2, 2, 4, 4)
    z[0, 0, 0:2, 0:2] = z[0, 0, 0, 0]
    with pytest.raises(CheckError, match="argmax"):
        check_bn_relu_maxpool(rng, z, forward=broken)


def test_relu_zero_check_catches_open_mask_in_backward_reduce(rng):
    kernel = mutant(
        fl.make_bn_backward_reduce,
        ("if z1 * sc + sh > zero:", "if z1 * sc + sh >= zero:"),
        ("if second and z2 * sc + sh > zero:", "if second and z2 * sc + sh >= zero:"),
    )(fl.BN_REDUCE_BLOCK)

    broken = partial(fl.bn_relu_maxpool_backward_reduce, kernel=kernel)

    with pytest.raises(CheckError, match="dgamma|dbeta"):
        check_bn_relu_maxpool(rng, _zero_preactivation_input(rng), zero_beta=(0,), reduce=broken)


def test_relu_zero_check_catches_open_mask_in_the_winners_reduce(rng):
    kernel = mutant(
        fl.make_bn_backward_reduce_winners,
        ("if z1 * sc + sh > zero:", "if z1 * sc + sh >= zero:"),
        ("if second and z2 * sc + sh > zero:", "if second and z2 * sc + sh >= zero:"),
    )(fl.BN_REDUCE_BLOCK)
    broken = partial(fl.bn_relu_maxpool_backward_reduce_winners, kernel=kernel)

    with pytest.raises(CheckError, match="dgamma|dbeta"):
        check_bn_relu_maxpool(
            rng, _zero_preactivation_input(rng), zero_beta=(0,), reduce=broken, winners=True
        )


def test_winners_check_catches_a_stale_winner(rng):
    """A training forward that does not take the winner's z along when a later
    window position wins (zwin keeps the first position's z) is caught by the
    exact zwin check."""
    kernel = mutant(fl.bn_relu_maxpool_forward_train_kernel, ("            z_best = zk\n", ""))

    def broken(z, scale, shift, pooled, argmax, zwin):
        grid, block = fl._window_grid(pooled.shape)
        kernel[grid, block](z, scale, shift, pooled, argmax, zwin)

    with pytest.raises(CheckError, match="zwin"):
        check_bn_relu_maxpool(rng, _conv_like(rng, 2, 2, 4, 4), forward=broken, winners=True)


def test_relu_zero_check_catches_open_mask_in_backward_dx(rng):
    kernel = mutant(
        fl.bn_relu_maxpool_backward_dx_kernel,
        ("if zw * scale[c] + shift[c] > 0 else", "if zw * scale[c] + shift[c] >= 0 else"),
    )

    def broken(*args):
        grid, block = fl._window_grid(args[0].shape)
        kernel[grid, block](*args)

    with pytest.raises(CheckError, match="dz"):
        check_bn_relu_maxpool(
            rng, _zero_preactivation_input(rng), zero_beta=(0,), backward_dx=broken
        )


def check_bn_eval_scale_shift(rng, scale_shift=fl.bn_eval_scale_shift):
    c = 5
    gamma, beta = random_array(c, np.float32, rng), random_array(c, np.float32, rng)
    rm, rv = random_array(c, np.float32, rng), random_array(c, np.float32, rng, 0.1, 2.0)
    rv[0] = 1e-7  # a tiny running variance: eps must matter
    scale, shift = guarded(c, np.float32), guarded(c, np.float32)
    scale_shift(*(cuda.to_device(a) for a in (gamma, beta, rm, rv)), 1e-5, scale.array, shift.array)
    sc_ref = gamma / np.sqrt(rv.astype(np.float64) + 1e-5)
    check(scale.array, sc_ref, TOL, "eval scale")
    check(shift.array, beta - rm * sc_ref, TOL, "eval shift")


def test_bn_eval_scale_shift(rng):
    check_bn_eval_scale_shift(rng)


def test_eval_eps_check_catches_missing_eps(rng):
    kernel = mutant(
        fl.bn_eval_scale_shift_kernel,
        ("math.sqrt(running_var[c] + eps)", "math.sqrt(running_var[c])"),
    )
    with pytest.raises(CheckError, match="eval scale"):
        check_bn_eval_scale_shift(rng, lambda *args: kernel[1, fl.THREADS](*args))


def check_bn_stats_tiny_variance(rng, finalize=fl.bn_stats_finalize):
    """Training statistics where eps matters: channel 0's batch variance ~1e-6
    (std 1e-3 around ~0, so no cancellation), below eps = 1e-5."""
    z = _conv_like(rng, 2, 3, 4, 6)
    z[:, 0] = random_array((2, 4, 6), np.float32, rng) * 1e-3
    gamma, beta, rm, rv, dev, st = _bn_forward_stats(rng, z, finalize=finalize)
    tz = _t(z)
    var = tz.var((0, 2, 3), unbiased=False)
    check(st["invstd"], 1 / torch.sqrt(var + 1e-5), TOL, "invstd (batch variance below eps)")
    y = F.batch_norm(tz, None, None, _t(gamma), _t(beta), training=True, eps=1e-5)
    sc = st["scale"].copy_to_host().reshape(1, -1, 1, 1)
    sh = st["shift"].copy_to_host().reshape(1, -1, 1, 1)
    check(z * sc + sh, y, TOL, "z * scale + shift (batch variance below eps)")


def test_bn_stats_variance_below_eps(rng):
    check_bn_stats_tiny_variance(rng)


def test_tiny_variance_check_catches_missing_eps_in_training(rng):
    stats_kernel, _ = mutant(
        fl.make_partials_finalize,
        ("inv = 1.0 / math.sqrt(var + eps)", "inv = 1.0 / math.sqrt(var)"),
    )(fl.REDUCE_THREADS)

    def broken(partials, count, gamma, beta, eps, momentum, rm, rv, mean, invstd, scale, shift):
        stats_kernel[mean.shape[0], fl.REDUCE_THREADS](
            partials, count, gamma, beta, eps, momentum, rm, rv, mean, invstd, scale, shift
        )

    with pytest.raises(CheckError, match="below eps"):
        check_bn_stats_tiny_variance(rng, finalize=broken)


# The GEMM's tile follows the work (in the simulator, on 2 SMs: 8 x 8 tiles for
# 19 x 20 and 16 x 16 outputs, 8 x 4 for the others; on 64 SMs 8 x 4 for all) and
# its K-split the SM count: 64 SMs cut the forward's K into up to K / GEMM_MIN_CHUNK
# chunks (in the simulator S = 1, 5, 5, 2; the reduction's unrolled steps, S past
# LANES x (UNROLL - 1), are checked below with S = 7 and 13).
@pytest.mark.parametrize("n, n_in, n_out", [(1, 7, 3), (5, 40, 17), (19, 33, 20), (16, 16, 16)])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("sms", [None, 64])
def test_linear_forward(rng, monkeypatch, n, n_in, n_out, relu, sms):
    if sms:
        monkeypatch.setattr(fl, "sm_count", lambda: sms)
    x, w, b = (random_array(s, np.float32, rng) for s in ((n, n_in), (n_out, n_in), n_out))
    # Output 0 is positive in every row, so the ReLU'd reference is never all zero
    # (with 1 x 3 outputs all three are negative in one draw of eight).
    b[0] = np.abs(x).sum(1).max() * np.abs(w[0]).max() + 0.1
    ref = F.linear(_t(x), _t(w), _t(b))
    if relu:
        ref = F.relu(ref)
    y = check_linear_forward(rng, x, w, b, relu)
    check(y, ref, TOL, "linear forward")


def check_linear_forward(rng, x, w, b, relu, reduce=None):
    """y from fl.linear_forward (``reduce``: another reduction kernel) into a
    guarded output, twice: the repeat must give the same bits (a fixed summation
    order). The partial buffer holds NaN past what the plan needs."""
    n, n_in = x.shape
    size = fl.splitk_partials_size(n, w.shape[0], n_in)
    buf = cuda.to_device(np.full(size + 64, np.nan, np.float32))
    x_, w_, b_ = (cuda.to_device(a) for a in (x, w, b))
    ys = []
    for _ in range(2):
        y = guarded((n, w.shape[0]), np.float32)
        if reduce is None:
            fl.linear_forward(x_, w_, b_, y.array, buf, relu=relu)
        else:
            plan = fl.gemm_plan(n, w.shape[0], n_in)
            fl.gemm_splitk("nt", x_, w_, n, w.shape[0], n_in, buf, plan)
            reduce[ceil_div(y.array.size, reduce.outs), reduce.threads](
                buf, plan.splits, b_, y.array.reshape(y.array.size), w.shape[0]
            )
        y.check_untouched("y")
        ys.append(y.array.copy_to_host())
    assert np.array_equal(ys[0], ys[1], equal_nan=True), "two runs, two results"
    return ys[0]


@pytest.mark.parametrize("n, n_in, n_out", [(1, 7, 3), (37, 21, 10), (16, 16, 16)])
def test_linear_grads(rng, n, n_in, n_out):
    x, w = random_array((n, n_in), np.float32, rng), random_array((n_out, n_in), np.float32, rng)
    tx, tw, tb = _t(x, True), _t(w, True), _t(np.zeros(n_out), True)
    dy = random_array((n, n_out), np.float32, rng)
    F.linear(tx, tw, tb).backward(_t(dy))
    x_, w_, dy_ = (cuda.to_device(a) for a in (x, w, dy))
    buf = cuda.device_array(fl.splitk_partials_size(n_out, n_in + 1, n), np.float32)
    dw, db = guarded((n_out, n_in), np.float32), guarded(n_out, np.float32)
    fl.linear_grad_weight(dy_, x_, dw.array, db.array, buf)
    dw.check_untouched("dw")
    db.check_untouched("db")
    check(dw.array, tw.grad, TOL, "linear grad weight")
    check(db.array, tb.grad, TOL, "linear grad bias")
    dx = guarded((n, n_in), np.float32)
    fl.linear_grad_input(dy_, w_, dx.array)
    dx.check_untouched("dx")
    check(dx.array, tx.grad, TOL, "linear grad input")


def test_linear_split_follows_the_sm_count(monkeypatch):
    """The split-K grid is sized for the device it runs on: fc1's forward at batch
    64 (K = 3,136) is cut into more K-chunks on more SMs, until the chunks reach
    their minimum length; every plan covers K exactly with chunks of whole K-slices."""
    m, j, k = fl.GEMM_TILE_SMALL.bm, 2 * fl.GEMM_TILE_SMALL.bn, 3136
    plans = {}
    for sms in (20, 40, 132):
        monkeypatch.setattr(fl, "sm_count", lambda sms=sms: sms)
        plans[sms] = fl.gemm_plan(m, j, k)
    splits = [p.splits for p in plans.values()]
    assert splits == sorted(splits) and splits[0] < splits[1], plans
    for sms, p in plans.items():
        tiles = ceil_div(m, p.tile.bm) * ceil_div(j, p.tile.bn)
        assert p.chunk % p.tile.bk == 0 and (p.splits - 1) * p.chunk < k <= p.splits * p.chunk
        # at least one block an SM, or chunks as short as allowed
        assert p.splits * tiles >= sms or p.chunk < 2 * fl.GEMM_MIN_CHUNK, (sms, p)


@pytest.mark.parametrize("sms", [1, 64])
def test_linear_grads_on_other_sm_counts(rng, monkeypatch, sms):
    """Few chunks (1 SM) or many (64 SMs; in the simulator 1 and 4 chunks of the
    weight gradient's 37 rows): the same gradients."""
    monkeypatch.setattr(fl, "sm_count", lambda: sms)
    test_linear_grads(rng, 37, 7, 10)


@pytest.mark.parametrize("outs, lanes", sorted({fl.SPLITK_REDUCE_SHAPE, (64, 4)}))
def test_linear_forward_check_catches_a_reduce_past_the_last_chunk(rng, monkeypatch, outs, lanes):
    """The forward's reduction with the weight reduction's off-by-one (one more
    unrolled step than there are chunks) reads the NaN past the partials."""
    unroll = 4
    kernel = mutant(
        fl.make_splitk_reduce_bias,
        ("while s + (UNROLL - 1) * LANES < s_count:", "while s + (UNROLL - 1) * LANES <= s_count:"),
    )(False, outs, lanes, unroll)
    s_count = (unroll - 1) * lanes + 1  # the one S where the mutant reads chunk S
    n, n_in, n_out = 3, s_count * fl.GEMM_MIN_CHUNK, 5
    monkeypatch.setattr(fl, "sm_count", lambda: 10 * s_count)  # enough SMs for S chunks
    assert fl.gemm_plan(n, n_out, n_in).splits == s_count
    x, w, b = (random_array(s, np.float32, rng) for s in ((n, n_in), (n_out, n_in), n_out))
    want = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if (outs, lanes) == fl.SPLITK_REDUCE_SHAPE:
        check(check_linear_forward(rng, x, w, b, False), want, TOL, "forward, S chunks")
    with pytest.raises(CheckError, match="NaN"):
        check(check_linear_forward(rng, x, w, b, False, kernel), want, TOL, "mutant forward")


# The reduction both split-K weight gradients share (linear layers and
# convolutions): S chunks against NumPy's float64 sum, for S below, at and past
# the LANES x UNROLL a block takes per step; rows past S hold NaN and must stay
# unread; dw as a convolution's 4-D weight.
@pytest.mark.parametrize("s_count", [1, 7, 8, 13])
def test_splitk_reduce_weight_bias(rng, s_count):
    check_splitk_reduce_weight_bias(rng, s_count)


def check_splitk_reduce_weight_bias(rng, s_count, reduce=fl.splitk_reduce_weight_bias):
    c_out, c_in, k = 3, 2, 2  # n_cols = 9: a block of 8 outputs and one more
    parts = np.full((s_count + 2, c_out, c_in * k * k + 1), np.nan, np.float32)
    parts[:s_count] = random_array((s_count, c_out, c_in * k * k + 1), np.float32, rng)
    total = parts[:s_count].astype(np.float64).sum(0)
    dw, db = guarded((c_out, c_in, k, k), np.float32), guarded(c_out, np.float32)
    reduce(cuda.to_device(parts), s_count, dw.array, db.array)
    dw.check_untouched("dw")
    db.check_untouched("db")
    check(dw.array, total[:, :-1].reshape(c_out, c_in, k, k), TOL, "split-K reduce dw")
    check(db.array, total[:, -1], TOL, "split-K reduce db")


# The block shape this runtime launches, and the GPU's in the simulator too: the
# off-by-one below shows only for S = (UNROLL - 1) x LANES + 1, which depends on it.
SPLITK_REDUCE_SHAPES = sorted({fl.SPLITK_REDUCE_SHAPE, (64, 4)})


@pytest.mark.parametrize("outs, lanes", SPLITK_REDUCE_SHAPES)
def test_splitk_reduce_check_catches_a_read_past_the_last_chunk(rng, outs, lanes):
    unroll = 4
    kernel = mutant(
        fl.make_splitk_reduce_weight_bias,
        ("while s + (UNROLL - 1) * LANES < s_count:", "while s + (UNROLL - 1) * LANES <= s_count:"),
    )(outs, lanes, unroll)

    def broken(partials, s_count, dw, db):
        _, c_out, n_cols = partials.shape
        total = c_out * n_cols
        kernel[ceil_div(total, kernel.outs), kernel.threads](
            partials.reshape(partials.size), dw.reshape(dw.size), db, s_count, n_cols, total
        )

    # The one S where the mutant takes an unrolled step it must not: lane 1's step
    # reads chunks 1, 1 + LANES, ..., 1 + (UNROLL - 1) LANES = S, one past the last,
    # into the NaN rows the check puts after the S chunks (S = 7 for the simulator's
    # 2 lanes, 13 for the GPU's 4, where S = 7 takes no unrolled step at all).
    s_count = (unroll - 1) * lanes + 1
    if (outs, lanes) == fl.SPLITK_REDUCE_SHAPE:
        check_splitk_reduce_weight_bias(rng, s_count)  # the real kernel, same S
    with pytest.raises(CheckError, match="NaN"):
        check_splitk_reduce_weight_bias(rng, s_count, broken)


def test_splitk_reduce_computes_in_float64_only_its_sums():
    """The partials are read and dw, db written as float32; only the sums (acc,
    sum_all) are float64, on purpose: no other float64 a GPU would have to run."""
    parts = cuda.to_device(np.ones((3, 2, 5), np.float32))
    with recording_launches() as launches:
        fl.splitk_reduce_weight_bias(
            parts, 3, cuda.device_array((2, 4), np.float32), cuda.device_array(2, np.float32)
        )
    ((fn, argtypes, _),) = launches
    stray = [
        u
        for u in float64_uses(fn, argtypes)
        if not any(v in u.source or v in u.message for v in ("acc", "sum_all"))
    ]
    assert not stray, "\n".join(map(str, stray))


def check_gemm(rng, layout, tile, m, j, k, chunk, kernel=None):
    """The ``layout`` GEMM (fl.GEMM_LAYOUTS) of an m x k and a k x j operand, K cut
    into chunks of ``chunk``, against float64: each chunk's partial on its own (a
    kernel that mixes chunks up fails even where the total is right), no write
    outside the S x m x j partials. ``kernel``: another kernel for the same tile."""
    trans_a, trans_b, ones = fl.GEMM_LAYOUTS[layout]
    j_data = j - 1 if ones else j
    a = random_array((k, m) if trans_a else (m, k), np.float32, rng)
    b = random_array((j_data, k) if trans_b else (k, j_data), np.float32, rng)
    a64 = a.astype(np.float64).T if trans_a else a.astype(np.float64)
    b64 = b.astype(np.float64).T if trans_b else b.astype(np.float64)
    if ones:
        b64 = np.hstack([b64, np.ones((k, 1))])
    splits = ceil_div(k, chunk)
    c = guarded((splits, m, j), np.float32)
    plan = fl.GemmPlan(tile, splits, chunk)
    if kernel is None:
        fl.gemm_splitk(layout, cuda.to_device(a), cuda.to_device(b), m, j, k, c.array, plan)
    else:
        kernel[(ceil_div(j, tile.bn), ceil_div(m, tile.bm), splits), tile.threads](
            cuda.to_device(a.ravel()),
            cuda.to_device(b.ravel()),
            c.array.reshape(c.array.size),
            m,
            j,
            k,
            chunk,
        )
    c.check_untouched("partials")
    parts = c.array.copy_to_host()
    for s in range(splits):
        ks = slice(s * chunk, (s + 1) * chunk)
        check(parts[s], a64[:, ks] @ b64[ks], TOL, f"{layout} GEMM on {tile}, chunk {s}")


# This runtime's tiles on several blocks a side and ragged edges: M, J not
# multiples of the tile, K of 3 chunks the last of which ends inside a K-slice.
@pytest.mark.parametrize("layout", list(fl.GEMM_LAYOUTS))
@pytest.mark.parametrize("tile", sorted({fl.GEMM_TILE, fl.GEMM_TILE_SMALL}, key=str), ids=str)
def test_gemm_layouts(rng, layout, tile):
    check_gemm(
        rng, layout, tile, 2 * tile.bm + 3, 2 * tile.bn - 1, 2 * 2 * tile.bk + 3, 2 * tile.bk
    )


# The GPU's tiles (256 threads, slow in the simulator: one block a chunk): M, J
# inside one tile, and 2 chunks, the second a partial K-slice. Every layout with
# the small GPU tile; the large one (4.5 s of simulator a layout) with "nt" only
# in the simulator, every layout on a GPU (the layouts' own indexing is tested
# with each tile above).
_GPU_TILE_CASES = [(fl.GPU_GEMM_TILE_SMALL, layout) for layout in fl.GEMM_LAYOUTS] + [
    (fl.GPU_GEMM_TILE, layout) for layout in fl.GEMM_LAYOUTS if not is_simulator() or layout == "nt"
]


@pytest.mark.parametrize("tile, layout", _GPU_TILE_CASES, ids=lambda v: str(v))
def test_gemm_gpu_tiles(rng, layout, tile):
    check_gemm(rng, layout, tile, tile.bm - 3, tile.bn - 5, tile.bk + 5, tile.bk)


def test_gemm_check_catches_a_write_past_the_row(rng):
    """An epilogue that writes column J too (``<=`` for ``<``) writes a zero into
    the next row's first partial, and past the last row's end (on a GPU into the
    guard cells; the simulator stops there with an IndexError)."""
    tile = fl.GEMM_TILE
    kernel = mutant(fl.make_gemm_splitk, ("if j < j_size:", "if j <= j_size:"))(
        *fl.GEMM_LAYOUTS["nt"], tile
    )
    with pytest.raises((CheckError, IndexError)):
        check_gemm(rng, "nt", tile, tile.bm + 1, tile.bn - 1, 2 * tile.bk, tile.bk, kernel)


def test_gemm_missing_k_chunk_fails(rng):
    """A launch one K-chunk short (the last partial tile skipped) must fail the check."""
    n, n_in, n_out = 5, 40, 6
    x, w = random_array((n, n_in), np.float32, rng), random_array((n_out, n_in), np.float32, rng)
    tile = fl.GEMM_TILE_SMALL
    chunk = tile.bk
    splits = ceil_div(n_in, chunk)
    part = cuda.to_device(np.zeros((splits, n, n_out), np.float32))
    plan = fl.GemmPlan(tile, splits - 1, chunk)
    fl.gemm_splitk("nt", cuda.to_device(x), cuda.to_device(w), n, n_out, n_in, part, plan)
    with pytest.raises(CheckError):
        check(part.copy_to_host().sum(0), x.astype(np.float64) @ w.T, TOL, "short split-K")


@pytest.mark.parametrize("n, hidden, classes", [(1, 5, 2), (11, 24, 10), (8, 33, 7)])
def test_classifier_fused(rng, n, hidden, classes):
    h = np.maximum(random_array((n, hidden), np.float32, rng), 0)  # a ReLU output
    h[0, 0] = 0.0  # closed exactly at 0: torch's ReLU gradient there is 0
    h[:, -1] = np.abs(h[:, -1]) + 0.1  # and one open unit a row, so dh is not all zero
    w, b = random_array((classes, hidden), np.float32, rng), random_array(classes, np.float32, rng)
    # Logits near 90: float32 exp overflows past 88.7, so a kernel without the
    # max subtraction returns inf or NaN; the shift leaves the softmax unchanged.
    b += 90
    labels = rng.integers(0, classes, n).astype(np.int32)
    # Row 0 is labelled with its least likely class, so its gradient is O(1) and
    # the check stays strict (a lone confident row's gradient can be smaller than
    # the float32 rounding of its logits, and then no check can judge it).
    labels[0] = np.argmin(h[0].astype(np.float64) @ w.T.astype(np.float64) + b)
    th, tw, tb = _t(h, True), _t(w, True), _t(b, True)
    logits_ref = F.linear(th, tw, tb)
    logits_ref.retain_grad()
    loss = F.cross_entropy(logits_ref, torch.from_numpy(labels).long())
    loss.backward()
    # dh as the network sees it: through fc1's ReLU (h > 0)
    dh_ref = th.grad * torch.from_numpy(h > 0)
    outs = {
        k: guarded(s, np.float32)
        for k, s in dict(
            logits=(n, classes), row_loss=n, dlogits=(n, classes), dh=(n, hidden)
        ).items()
    }
    fl.classifier_fused(
        *(cuda.to_device(a) for a in (h, w, b, labels)),
        *(outs[k].array for k in ("logits", "row_loss", "dlogits", "dh")),
    )
    for k, g in outs.items():
        g.check_untouched(k)
    check(outs["logits"].array, logits_ref.detach(), TOL, "logits")
    row_ref = F.cross_entropy(
        logits_ref.detach(), torch.from_numpy(labels).long(), reduction="none"
    )
    # A row's loss is lse - logit[label]: in float32 both terms carry an absolute
    # error of a few eps * |logit|, which a confident row's tiny loss cannot
    # absorb. Allow that much per row (as checks.check_log_softmax_nll does),
    # and no more: an indexing or max-subtraction bug is far larger.
    lse = float(logits_ref.detach().abs().max()) + np.log(classes)
    check(outs["row_loss"].array, row_ref, rounding_tolerance(row_ref, lse, 4, TOL), "row loss")
    # A confident row's (softmax - onehot) is tiny beside the float32 rounding of
    # its log-sum-exp near 90 (checks.softmax_grad_magnitude), and dh carries
    # that rounding through w: allow exactly that, no more. A wrong label or a
    # missing max-subtraction errs by O(1) or overflows.
    mag = checks.softmax_grad_magnitude(logits_ref.detach().numpy())
    check(
        outs["dlogits"].array,
        logits_ref.grad,
        rounding_tolerance(logits_ref.grad, mag, 4, TOL),
        "dlogits",
    )
    dh_mag = (mag @ np.abs(w.astype(np.float64))) * (h > 0)
    check(outs["dh"].array, dh_ref, rounding_tolerance(dh_ref, dh_mag, 4, TOL), "dh")
    mean = guarded(1, np.float32)
    fl.mean_reduce(outs["row_loss"].array, mean.array)
    check(
        mean.array,
        loss.detach().reshape(1),
        rounding_tolerance(loss.detach(), lse, 4, TOL),
        "mean loss",
    )


def check_classifier_extreme_rows(rng, classifier=fl.classifier_fused):
    """The fused classifier on rows of logits near +800, 0 and -800 (past
    float64's exp range, so a missing max-subtraction overflows, or underflows
    to log(0), in the simulator too). Multiples of 1/4 in h and w and of 1/16 in
    b keep every logit exact in float32 (the +-800 comes from hidden unit 0,
    whose weight is 800 for every class); so the only rounding left is the
    float32 log-sum-exp near 800 (softmax_grad_tol). Unit 1 is closed at exactly 0."""
    n, hidden, classes = 6, 9, 5
    h = rng.integers(0, 9, (n, hidden)) / 4
    h[:, 0] = [2, 0, 1, 2, 0, 1]  # logit offsets +800, -800, 0 (b carries -800)
    h[:, 1] = 0.0
    w = rng.integers(-8, 9, (classes, hidden)) / 4
    w[:, 0] = 800.0
    b = rng.integers(-32, 33, classes) / 16 - 800
    h, w, b = (a.astype(np.float32) for a in (h, w, b))
    labels = rng.integers(0, classes, n).astype(np.int32)
    # Row 0 is labelled with its least likely class, so its gradient is O(1) and
    # the check stays strict (a lone confident row's gradient can be smaller than
    # the float32 rounding of its logits, and then no check can judge it).
    labels[0] = np.argmin(h[0].astype(np.float64) @ w.T.astype(np.float64) + b)
    th, tw, tb = _t(h, True), _t(w, True), _t(b, True)
    logits_ref = F.linear(th, tw, tb)
    logits_ref.retain_grad()
    F.cross_entropy(logits_ref, torch.from_numpy(labels).long()).backward()
    dh_ref = th.grad * torch.from_numpy(h > 0)
    outs = {
        k: guarded(s, np.float32)
        for k, s in dict(
            logits=(n, classes), row_loss=n, dlogits=(n, classes), dh=(n, hidden)
        ).items()
    }
    classifier(
        *(cuda.to_device(a) for a in (h, w, b, labels)),
        *(outs[k].array for k in ("logits", "row_loss", "dlogits", "dh")),
    )
    check(outs["logits"].array, logits_ref.detach(), TOL, "logits (rows near +-800)")
    row_ref = F.cross_entropy(
        logits_ref.detach(), torch.from_numpy(labels).long(), reduction="none"
    )
    check(
        outs["row_loss"].array,
        row_ref,
        rounding_tolerance(row_ref, 800 + math.log(classes), 4, TOL),
        "row loss (rows near +-800)",
    )
    grad_tol = checks.softmax_grad_tol(logits_ref.detach().numpy(), logits_ref.grad)
    check(outs["dlogits"].array, logits_ref.grad, grad_tol, "dlogits (rows near +-800)")
    # Unit 0's true gradient is 800 * sum(dlogits) of a row = 0, so float32 leaves
    # only 800 times dlogits' rounding there: check the other units.
    check(outs["dh"].array.copy_to_host()[:, 1:], dh_ref[:, 1:], grad_tol, "dh (rows near +-800)")


def test_classifier_rows_past_exp_range(rng):
    check_classifier_extreme_rows(rng)


def test_classifier_check_catches_missing_max_subtraction(rng):
    kernel = mutant(
        fl.classifier_fused_kernel,
        ("s += math.exp(z[r, k] - m)", "s += math.exp(z[r, k])"),
        ("v = m + math.log(s)", "v = math.log(s)"),
    )

    def broken(h, w, b, labels, *outs):
        kernel[ceil_div(h.shape[0], fl.CLS_ROWS), (fl.CLS_MAX_CLASSES, fl.CLS_ROWS)](
            h, w, b, labels, *outs
        )

    # A GPU returns inf (and the check fails); the simulator's math.exp and
    # math.log raise instead of returning inf and -inf.
    with pytest.raises((CheckError, OverflowError, ValueError)):
        check_classifier_extreme_rows(rng, classifier=broken)


def test_classifier_check_catches_open_relu_mask(rng):
    kernel = mutant(
        fl.classifier_fused_kernel, ("if h_rows[rr, k] > 0.0", "if h_rows[rr, k] >= 0.0")
    )

    def broken(h, w, b, labels, *outs):
        kernel[ceil_div(h.shape[0], fl.CLS_ROWS), (fl.CLS_MAX_CLASSES, fl.CLS_ROWS)](
            h, w, b, labels, *outs
        )

    with pytest.raises(CheckError, match="dh"):
        check_classifier_extreme_rows(rng, classifier=broken)


def check_classifier_invalid_labels(rng, classes, classifier=fl.classifier_fused):
    """Labels outside [0, C) give a NaN row loss (so the mean loss is NaN: the
    model's contract for bad labels, checked on the device), valid rows stay
    finite. Among them C itself, one past the last class: a bounds test with
    ``<=`` for ``<`` reads logit C, which does not exist."""
    n, hidden = 6, 4
    h = random_array((n, hidden), np.float32, rng)
    w, b = random_array((classes, hidden), np.float32, rng), random_array(classes, np.float32, rng)
    labels = rng.integers(0, classes, n).astype(np.int32)
    invalid = {1: classes, 3: -1, 4: classes + 7}
    for row, label in invalid.items():
        labels[row] = label
    row_loss = guarded(n, np.float32)
    bufs = [cuda.device_array(s, np.float32) for s in ((n, classes), (n, classes), (n, hidden))]
    classifier(
        *(cuda.to_device(a) for a in (h, w, b, labels)), bufs[0], row_loss.array, bufs[1], bufs[2]
    )
    row = row_loss.array.copy_to_host()
    bad = sorted(invalid)
    good = [r for r in range(n) if r not in invalid]
    assert np.isnan(row[bad]).all(), f"labels {labels[bad]} (of {classes} classes) gave {row[bad]}"
    assert np.isfinite(row[good]).all(), f"valid labels gave {row[good]}"


@pytest.mark.parametrize("classes", [5, fl.CLS_MAX_CLASSES])
def test_classifier_invalid_label_gives_nan(rng, classes):
    check_classifier_invalid_labels(rng, classes)


def test_invalid_label_check_catches_label_equal_to_classes(rng):
    kernel = mutant(
        fl.classifier_fused_kernel,
        ("if (label >= 0 and label < classes)", "if (label >= 0 and label <= classes)"),
    )

    def broken(h, w, b, labels, *outs):
        kernel[ceil_div(h.shape[0], fl.CLS_ROWS), (fl.CLS_MAX_CLASSES, fl.CLS_ROWS)](
            h, w, b, labels, *outs
        )

    # With C = 32 the logit row in shared memory is full, so logit C is past its
    # end: the simulator raises IndexError; a GPU reads the next row's logit 0,
    # a finite number, and the check fails.
    with pytest.raises((AssertionError, IndexError)):
        check_classifier_invalid_labels(rng, fl.CLS_MAX_CLASSES, classifier=broken)


def test_classifier_refuses_too_many_classes():
    bufs = [cuda.device_array(s, np.float32) for s in ((2, 4), (40, 4), 40)]
    with pytest.raises(ValueError, match="at most 32 classes"):
        fl.classifier_fused(*bufs, None, None, None, None, None)
