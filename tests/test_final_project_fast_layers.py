"""The fast capstone kernels around the convolutions (final_project.fast_layers)
against torch.autograd in float64, on hostile shapes: batch 1, odd channel
counts, sizes that are not multiples of the tiles, ties in the max-pool, a
closed ReLU at exactly zero, an invalid label. float32 kernels against a
float64 truth land near 1e-6; the tolerance 1e-4 (final_project.checks.TOL)
leaves room for sums of a few thousand terms and fails any wrong index.
"""

import common  # noqa: F401, I001  (first: picks GPU or simulator before numba loads)

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numba import cuda

from common.checking import CheckError, check, guarded, random_array
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


def _bn_forward_stats(rng, z, rows=3, eps=1e-5, momentum=0.1):
    c = z.shape[1]
    gamma = random_array(c, np.float32, rng, 0.5, 2.0)
    beta = random_array(c, np.float32, rng)
    rm = random_array(c, np.float32, rng)
    rv = random_array(c, np.float32, rng, 0.5, 2.0)
    dev = {k: cuda.to_device(v) for k, v in dict(gamma=gamma, beta=beta, rm=rm, rv=rv).items()}
    stats = {k: guarded(c, np.float32) for k in ("mean", "invstd", "scale", "shift")}
    fl.bn_stats_finalize(cuda.to_device(_partials_of(z, rows)), z.size // c, dev["gamma"],
                         dev["beta"], eps, momentum, dev["rm"], dev["rv"],
                         *(stats[k].array for k in ("mean", "invstd", "scale", "shift")))
    for k, g in stats.items():
        g.check_untouched(k)
    return gamma, beta, rm, rv, dev, {k: g.array for k, g in stats.items()}


def _conv_like(rng, n, c, h, w):
    """Per-channel shifted and scaled data, as a convolution's output."""
    return (random_array((n, c, h, w), np.float32, rng) * rng.uniform(0.5, 3, (1, c, 1, 1))
            + rng.uniform(-2, 2, (1, c, 1, 1))).astype(np.float32)


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


def _bn_block_reference(z, gamma, beta, dpooled_shape_rng):
    """maxpool(relu(batchnorm(z))) in float64 torch, with grads wrt z, gamma, beta."""
    tz, tg, tb = _t(z, True), _t(gamma, True), _t(beta, True)
    y = F.batch_norm(tz, None, None, tg, tb, training=True, eps=1e-5)
    pooled, idx = F.max_pool2d(F.relu(y), 2, return_indices=True)
    return tz, tg, tb, pooled, idx


@pytest.mark.parametrize("n, c, h, w", [(2, 3, 4, 6), (1, 2, 2, 2), (3, 5, 8, 4)])
def test_bn_relu_maxpool_forward_and_backward(rng, n, c, h, w):
    z = _conv_like(rng, n, c, h, w)
    # Ties: a window of equal positive values (the first must win, as in torch),
    # and a window all below the ReLU threshold (all zeros after it).
    z[0, 0, 0:2, 0:2] = z[0, 0, 0, 0]
    gamma, beta, rm, rv, dev, st = _bn_forward_stats(rng, z)
    tz, tg, tb, pooled_ref, idx = _bn_block_reference(z, gamma, beta, rng)
    z_ = cuda.to_device(z)
    ph, pw = h // 2, w // 2
    pooled = guarded((n, c, ph, pw), np.float32)
    argmax = guarded((n, c, ph, pw), np.int8)
    fl.bn_relu_maxpool_forward(z_, st["scale"], st["shift"], pooled.array, argmax.array)
    pooled.check_untouched("pooled")
    argmax.check_untouched("argmax")
    check(pooled.array, pooled_ref.detach(), TOL, "bn+relu+pool forward")
    ref_code = (idx // w % 2) * 2 + idx % w % 2  # torch's flat plane index -> window position
    check(argmax.array, ref_code.numpy().astype(np.int8), name="argmax (first maximum wins)")

    dpooled = random_array((n, c, ph, pw), np.float32, rng)
    pooled_ref.backward(_t(dpooled))
    dp_ = cuda.to_device(dpooled)
    stats = [st[k] for k in ("mean", "invstd", "scale", "shift")]
    rows = fl.bn_backward_partial_rows(n, ph, pw)
    partials = guarded((rows, 2, c), np.float64)
    fl.bn_relu_maxpool_backward_reduce(dp_, argmax.array, z_, *stats, partials.array)
    partials.check_untouched("partials")
    dgamma, dbeta = guarded(c, np.float32), guarded(c, np.float32)
    fl.bn_backward_finalize(partials.array, dgamma.array, dbeta.array)
    check(dgamma.array, tg.grad, TOL, "dgamma")
    check(dbeta.array, tb.grad, TOL, "dbeta")
    dz = guarded(z.shape, np.float32)
    fl.bn_relu_maxpool_backward_dx(dp_, argmax.array, z_, *stats, dev["gamma"], dgamma.array,
                                   dbeta.array, dz.array)
    dz.check_untouched("dz")
    check(dz.array, tz.grad, TOL, "dz")


def test_bn_eval_scale_shift(rng):
    c = 5
    gamma, beta = random_array(c, np.float32, rng), random_array(c, np.float32, rng)
    rm, rv = random_array(c, np.float32, rng), random_array(c, np.float32, rng, 0.1, 2.0)
    rv[0] = 1e-7  # a tiny running variance: eps must matter
    scale, shift = guarded(c, np.float32), guarded(c, np.float32)
    fl.bn_eval_scale_shift(*(cuda.to_device(a) for a in (gamma, beta, rm, rv)), 1e-5,
                           scale.array, shift.array)
    sc_ref = gamma / np.sqrt(rv.astype(np.float64) + 1e-5)
    check(scale.array, sc_ref, TOL, "eval scale")
    check(shift.array, beta - rm * sc_ref, TOL, "eval shift")


@pytest.mark.parametrize("n, n_in, n_out", [(1, 7, 3), (5, 40, 17), (19, 33, 20), (16, 16, 16)])
@pytest.mark.parametrize("relu", [True, False])
def test_linear_forward(rng, n, n_in, n_out, relu):
    x, w, b = (random_array(s, np.float32, rng) for s in ((n, n_in), (n_out, n_in), n_out))
    ref = F.linear(_t(x), _t(w), _t(b))
    if relu:
        ref = F.relu(ref)
    buf = cuda.device_array(fl.splitk_partials_size(n, n_out, n_in), np.float32)
    y = guarded((n, n_out), np.float32)
    fl.linear_forward(*(cuda.to_device(a) for a in (x, w, b)), y.array, buf, relu=relu)
    y.check_untouched("y")
    check(y.array, ref, TOL, "linear forward")


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


def test_gemm_gpu_tile_shape(rng):
    """The GPU's 64x64 tiles (4x4 a thread, 256 threads), on a ragged problem."""
    kernel = fl.make_gemm_splitk(False, True, False, BM=64, BN=64, BK=16, TM=4, TN=4)
    n, n_in, n_out = 70, 37, 65
    x, w = random_array((n, n_in), np.float32, rng), random_array((n_out, n_in), np.float32, rng)
    c = guarded((2, n, n_out), np.float32)
    kernel[(2, 2, 2), (16, 16)](cuda.to_device(x), cuda.to_device(w), 32, c.array)
    c.check_untouched("partials")
    check(c.array.copy_to_host().sum(0), x.astype(np.float64) @ w.T, TOL, "64x64 split-K GEMM")


def test_gemm_missing_k_chunk_fails(rng):
    """A launch one K-chunk short (the last partial tile skipped) must fail the check."""
    n, n_in, n_out = 5, 40, 6
    x, w = random_array((n, n_in), np.float32, rng), random_array((n_out, n_in), np.float32, rng)
    chunk = fl.GEMM_BK
    splits = -(-n_in // chunk)
    part = cuda.to_device(np.zeros((splits, n, n_out), np.float32))
    fl.gemm_splitk_nt[(1, 1, splits - 1), fl.GEMM_THREADS](cuda.to_device(x), cuda.to_device(w),
                                                          chunk, part)
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
    th, tw, tb = _t(h, True), _t(w, True), _t(b, True)
    logits_ref = F.linear(th, tw, tb)
    logits_ref.retain_grad()
    loss = F.cross_entropy(logits_ref, torch.from_numpy(labels).long())
    loss.backward()
    # dh as the network sees it: through fc1's ReLU (h > 0)
    dh_ref = th.grad * torch.from_numpy(h > 0)
    outs = {k: guarded(s, np.float32) for k, s in dict(
        logits=(n, classes), row_loss=n, dlogits=(n, classes), dh=(n, hidden)).items()}
    fl.classifier_fused(*(cuda.to_device(a) for a in (h, w, b, labels)),
                        *(outs[k].array for k in ("logits", "row_loss", "dlogits", "dh")))
    for k, g in outs.items():
        g.check_untouched(k)
    check(outs["logits"].array, logits_ref.detach(), TOL, "logits")
    row_ref = F.cross_entropy(logits_ref.detach(), torch.from_numpy(labels).long(),
                              reduction="none")
    # A row's loss is lse - logit[label]: in float32 both terms carry an absolute
    # error of a few eps * |logit|, which a confident row's tiny loss cannot
    # absorb. Allow that much per row (as checks.check_log_softmax_nll does),
    # and no more: an indexing or max-subtraction bug is far larger.
    eps32 = float(np.finfo(np.float32).eps)
    logits_max = float(logits_ref.detach().abs().max()) + np.log(classes)
    abs_row = 4 * eps32 * logits_max
    row_tol = max(TOL, abs_row * np.sqrt(n) / float(row_ref.norm()))
    check(outs["row_loss"].array, row_ref, row_tol, "row loss")
    check(outs["dlogits"].array, logits_ref.grad, TOL, "dlogits")
    check(outs["dh"].array, dh_ref, TOL, "dh")
    mean = guarded(1, np.float32)
    fl.mean_reduce(outs["row_loss"].array, mean.array)
    check(mean.array, loss.detach().reshape(1), max(TOL, abs_row / float(loss.detach())),
          "mean loss")


def test_classifier_invalid_label_gives_nan(rng):
    h = random_array((3, 4), np.float32, rng)
    w, b = random_array((5, 4), np.float32, rng), random_array(5, np.float32, rng)
    labels = np.array([0, 7, 4], np.int32)
    bufs = [cuda.device_array(s, np.float32) for s in ((3, 5), 3, (3, 5), (3, 4))]
    fl.classifier_fused(*(cuda.to_device(a) for a in (h, w, b, labels)), *bufs)
    row = bufs[1].copy_to_host()
    assert np.isnan(row[1]) and np.isfinite(row[[0, 2]]).all()


def test_classifier_refuses_too_many_classes():
    bufs = [cuda.device_array(s, np.float32) for s in ((2, 4), (40, 4), 40)]
    with pytest.raises(ValueError, match="at most 32 classes"):
        fl.classifier_fused(*bufs, None, None, None, None, None)
