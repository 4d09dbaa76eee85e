"""Every capstone layer, forward and backward, against the float64 reference.

The kernels (float32) must land within 1e-4 relative error of the NumPy
reference (final_project.checks, which runs final_project.reference); the
reference itself must land within 1e-10 of torch.autograd in float64 (the
``test_reference_*`` tests at the end), so it can be trusted. The edge-value
checks below compute their float64 truth with torch.autograd directly. Shapes are hostile: batch 1, odd
sizes, sizes that do not fill a block, one channel, kernels other than 3x3.
Deliberately broken kernels must fail the same checks. Edge values get their
own tests, each with a broken kernel it must catch: tied maxima (the first
index wins, as in torch), exact zeros at the ReLU, log-softmax rows past
float64's exp range, a batch variance below batchnorm's eps.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mutants import mutant
from numba import cuda

from final_project import checks, kernels, reference
from final_project.model import NetConfig, init_params
from final_project.torch_twin import TorchCNN

# ---------------------------------------------------------------------------
# Kernels against the float64 reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c_in, c_out, h, w, k, pad",
    [
        (2, 3, 4, 8, 8, 3, 1),  # the network's shape, small
        (1, 1, 2, 5, 7, 3, 1),  # batch 1, one input channel, odd sizes
        (2, 2, 3, 6, 5, 5, 2),  # 5x5 kernel
        (1, 3, 2, 5, 6, 3, 0),  # no padding: the output shrinks
        (3, 2, 1, 1, 1, 3, 1),  # 1x1 image: only the kernel's centre sees data
    ],
)
def test_conv2d(rng, n, c_in, c_out, h, w, k, pad):
    checks.check_conv2d(rng, n, c_in, c_out, h, w, k, pad)


# Not (2, c, 1, 1): with 2 values per channel the output is +-gamma + beta whatever x
# is, so the true dx is ~0 and a relative error measures only rounding.
@pytest.mark.parametrize("n, c, h, w", [(2, 3, 8, 8), (1, 2, 5, 7), (1, 4, 1, 3), (3, 1, 3, 2)])
def test_batchnorm(rng, n, c, h, w):
    checks.check_batchnorm(rng, n, c, h, w)


@pytest.mark.parametrize("shape", [(1,), (33,), (2, 3, 5, 7), (1, 13)])
def test_relu(rng, shape):
    checks.check_relu(rng, shape)


@pytest.mark.parametrize("n, c, h, w", [(2, 3, 8, 8), (1, 2, 5, 7), (2, 1, 2, 2), (1, 2, 3, 6)])
def test_maxpool(rng, n, c, h, w):
    checks.check_maxpool(rng, n, c, h, w)


@pytest.mark.parametrize("n, n_in, n_out", [(2, 48, 16), (1, 7, 3), (3, 1, 10), (5, 33, 1)])
def test_linear(rng, n, n_in, n_out):
    checks.check_linear(rng, n, n_in, n_out)


@pytest.mark.parametrize("n, classes", [(2, 10), (1, 3), (5, 2), (33, 7)])
def test_log_softmax_nll(rng, n, classes):
    checks.check_log_softmax_nll(rng, n, classes)


@pytest.mark.parametrize("size", [1, 31, 33, 100])
def test_sgd(rng, size):
    checks.check_sgd(rng, size)


def test_loss_with_out_of_range_label_is_nan(rng):
    logits = cuda.to_device(rng.standard_normal((3, 4)).astype(np.float32))
    labels = cuda.to_device(np.array([0, 4, 1], dtype=np.int32))
    logprobs, rows = cuda.device_array((3, 4), np.float32), cuda.device_array(3, np.float32)
    loss = cuda.device_array(1, np.float32)
    kernels.log_softmax_nll_forward(logits, labels, logprobs, rows, loss)
    assert math.isnan(loss.copy_to_host()[0])


def test_argmax_rows(rng):
    logits = rng.standard_normal((37, 6)).astype(np.float32)
    out = cuda.to_device(np.full(37, -1, np.int32))
    kernels.argmax_rows(cuda.to_device(logits), out)
    check(out, logits.argmax(1).astype(np.int32), name="argmax")


# ---------------------------------------------------------------------------
# Broken kernels must fail the checks (a check that cannot fail is a defect)
# ---------------------------------------------------------------------------


@cuda.jit
def conv2d_forward_no_padding_check(x, w, b, pad, out):
    # Bug: reads x[ih, iw] without testing 0 <= ih < H: negative indices wrap around.
    i = cuda.grid(1)
    if i >= out.size:
        return
    _, c_out, h_out, w_out = out.shape
    n, co, oh, ow = kernels.nchw_index(i, c_out, h_out, w_out)
    acc = b[co]
    for ci in range(w.shape[1]):
        for kh in range(w.shape[2]):
            for kw in range(w.shape[3]):
                ih = min(oh + kh - pad, x.shape[2] - 1)
                iw = min(ow + kw - pad, x.shape[3] - 1)
                acc += x[n, ci, ih, iw] * w[co, ci, kh, kw]
    out[n, co, oh, ow] = acc


@cuda.jit
def maxpool2x2_backward_scatter(dout, argmax, dx):
    # Bug: thread per output writes only the winner; the other 3 inputs of the
    # window are never written (they must be 0).
    i = cuda.grid(1)
    if i >= dout.size:
        return
    _, channels, h_out, w_out = dout.shape
    n, c, oh, ow = kernels.nchw_index(i, channels, h_out, w_out)
    j = argmax[n, c, oh, ow]
    width = dx.shape[3]
    height = dx.shape[2]
    dx[n, c, (j // width) % height, j % width] = dout[n, c, oh, ow]


@cuda.jit
def batchnorm_stats_biased_running_var(x, eps, momentum, mean, invstd, running_mean, running_var):
    # Bug: updates the running variance with the biased variance (torch uses unbiased).
    c = cuda.grid(1)
    if c >= mean.size:
        return
    batch, _, height, width = x.shape
    count = batch * height * width
    s = 0.0
    ss = 0.0
    for n in range(batch):
        for h in range(height):
            for w in range(width):
                s += x[n, c, h, w]
                ss += x[n, c, h, w] * x[n, c, h, w]
    mu = s / count
    var = ss / count - mu * mu
    mean[c] = mu
    invstd[c] = 1.0 / math.sqrt(var + eps)
    running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mu
    running_var[c] = (1.0 - momentum) * running_var[c] + momentum * var


@cuda.jit
def batchnorm_backward_dx_no_mean_terms(dy, xhat, gamma, invstd, dgamma, dbeta, dx):
    # Bug: treats the batch statistics as constants (dx = gamma invstd dy).
    i = cuda.grid(1)
    if i >= dx.size:
        return
    _, channels, height, width = dx.shape
    n, c, h, w = kernels.nchw_index(i, channels, height, width)
    dx[n, c, h, w] = gamma[c] * invstd[c] * dy[n, c, h, w]


@cuda.jit
def linear_grad_weight_no_bounds_check(dy, x, dw):
    # Bug: no `if i >= dw.size: return`; the last block's extra threads write past dw.
    i = cuda.grid(1)
    n_in = dw.shape[1]
    acc = 0.0
    for n in range(x.shape[0]):
        acc += dy[n, i // n_in] * x[n, i % n_in]
    dw[i // n_in, i % n_in] = acc


@cuda.jit
def nll_backward_sum_not_mean(logprobs, labels, dlogits):
    # Bug: the gradient of the summed loss (no 1/N), right only for batch 1.
    i = cuda.grid(1)
    if i >= dlogits.size:
        return
    classes = dlogits.shape[1]
    c = i % classes
    n = i // classes
    g = math.exp(logprobs[n, c])
    if c == labels[n]:
        g -= 1.0
    dlogits[n, c] = g


def _launch(kernel, size):
    return kernel[kernels._grid(size)]


def test_conv2d_check_catches_missing_padding_check(rng):
    def broken(x, w, b, pad, out):
        _launch(conv2d_forward_no_padding_check, out.size)(x, w, b, pad, out)

    with pytest.raises(CheckError, match="conv2d forward"):
        checks.check_conv2d(rng, 1, 2, 2, 5, 6, forward=broken)


def test_maxpool_check_catches_unwritten_gradients(rng):
    def broken(dout, arg, dx):
        _launch(maxpool2x2_backward_scatter, dout.size)(dout, arg, dx)

    with pytest.raises(CheckError, match="NaN"):
        checks.check_maxpool(rng, 1, 2, 4, 6, backward=broken)


def test_batchnorm_check_catches_biased_running_var(rng):
    def broken(x, gamma, beta, eps, momentum, mean, invstd, rm, rv, xhat, y):
        _launch(batchnorm_stats_biased_running_var, mean.size)(
            x, eps, momentum, mean, invstd, rm, rv
        )
        kernels.batchnorm_normalize_naive[kernels._grid(x.size)](
            x, mean, invstd, gamma, beta, xhat, y
        )

    with pytest.raises(CheckError, match="running var"):
        checks.check_batchnorm(rng, 2, 2, 3, 3, forward_train=broken)


def test_batchnorm_check_catches_missing_mean_terms(rng):
    def broken(dy, xhat, gamma, invstd, dgamma, dbeta, dx):
        kernels.batchnorm_backward_reduce_naive[kernels._grid(dgamma.size)](dy, xhat, dgamma, dbeta)
        _launch(batchnorm_backward_dx_no_mean_terms, dx.size)(
            dy, xhat, gamma, invstd, dgamma, dbeta, dx
        )

    with pytest.raises(CheckError, match="batchnorm grad input"):
        checks.check_batchnorm(rng, 2, 2, 3, 3, backward=broken)


def test_linear_check_catches_missing_bounds_check(rng):
    def broken(dy, x, w, dx, dw, db):
        _launch(linear_grad_weight_no_bounds_check, dw.size)(dy, x, dw)
        kernels.linear_grad_bias_naive[kernels._grid(db.size)](dy, db)
        kernels.linear_grad_input_naive[kernels._grid(dx.size)](dy, w, dx)

    # 3 x 7 = 21 weights: the rest of the 32-thread block (simulator) runs past the end.
    with pytest.raises((CheckError, IndexError)):
        checks.check_linear(rng, 2, 7, 3, backward=broken)


def test_nll_check_catches_missing_mean(rng):
    def broken(logprobs, labels, dlogits):
        _launch(nll_backward_sum_not_mean, dlogits.size)(logprobs, labels, dlogits)

    with pytest.raises(CheckError, match="grad logits"):
        checks.check_log_softmax_nll(rng, 4, 5, backward=broken)


# ---------------------------------------------------------------------------
# Edge values: ties, exact zeros, huge logits, a variance below eps
# ---------------------------------------------------------------------------


def _launcher(kernel):
    """launch(*args) with one thread per element of the last argument (the output)."""
    return lambda *args: kernel[kernels._grid(args[-1].size)](*args)


def check_maxpool_ties(
    rng, forward=kernels.maxpool2x2_forward, backward=kernels.maxpool2x2_backward
):
    """Max-pool on integer-valued data (most windows hold tied maxima, one
    window four equal values): torch keeps the first maximum in row-major order
    and routes the whole gradient to it; so must we."""
    n, c, h, w = 2, 2, 5, 6
    x = rng.integers(-2, 3, (n, c, h, w)).astype(np.float32)
    x[0, 0, 0:2, 0:2] = 1.0
    tx = _leaf(x)
    ref, idx = F.max_pool2d(tx, 2, return_indices=True)
    dy = random_array(tuple(ref.shape), np.float32, rng)
    ref.backward(torch.from_numpy(dy.astype(np.float64)))
    out, arg = guarded(tuple(ref.shape), np.float32), guarded(tuple(ref.shape), np.int32)
    forward(cuda.to_device(x), out.array, arg.array)
    check(out.array, ref.detach(), checks.TOL, "maxpool forward (ties)")
    check(
        arg.array.copy_to_host() % (h * w),
        idx.numpy().astype(np.int32),
        name="maxpool argmax (ties: the first maximum wins)",
    )
    dx = guarded(x.shape, np.float32)
    backward(cuda.to_device(dy), arg.array, dx.array)
    check(dx.array, tx.grad, checks.TOL, "maxpool backward (ties)")


def check_argmax_ties(rng, argmax=kernels.argmax_rows):
    """argmax_rows on integer-valued logits (tied maxima; row 0 all equal):
    the first largest class, as numpy and torch give."""
    logits = rng.integers(-2, 3, (37, 6)).astype(np.float32)
    logits[0] = 1.0
    out = guarded(37, np.int32)
    argmax(cuda.to_device(logits), out.array)
    out.check_untouched("argmax")
    check(out.array, logits.argmax(1).astype(np.int32), name="argmax (ties: the first wins)")


def check_relu_at_zero(rng, backward=kernels.relu_backward):
    """ReLU backward where a third of the inputs are exactly 0 (and -0): torch's
    gradient there is 0, so a kernel testing ``x >= 0`` fails."""
    x = random_array((3, 4, 5), np.float32, rng)
    x[rng.random(x.shape) < 0.35] = 0.0
    x.flat[1] = -0.0
    x.flat[0] = abs(x.flat[0]) + 0.1  # one open unit: the reference is not all zero
    tx = _leaf(x)
    dy = random_array(x.shape, np.float32, rng)
    F.relu(tx).backward(torch.from_numpy(dy.astype(np.float64)))
    dx = guarded(x.shape, np.float32)
    backward(cuda.to_device(dy), cuda.to_device(x), dx.array)
    check(dx.array, tx.grad, checks.TOL, "relu backward at exactly 0")


def check_log_softmax_extreme_rows(rng, forward=kernels.log_softmax_nll_forward):
    """Log-softmax + NLL on rows near +800 and -800, past float64's exp range
    (709): without the max subtraction exp overflows to inf (or, for the
    negative rows, every term underflows to 0 and log(0) = -inf), on a GPU in
    float32 and in the simulator, which computes exp in float64."""
    n, classes = 5, 4
    offsets = np.array([800.0, -800.0, 0.0, 760.0, -790.0])[:, None]
    logits = (random_array((n, classes), np.float32, rng) * 2 + offsets).astype(np.float32)
    labels = rng.integers(0, classes, n).astype(np.int32)
    tl = _leaf(logits)
    ref = F.cross_entropy(tl, torch.from_numpy(labels).long())
    ref.backward()
    ref_lp = F.log_softmax(torch.from_numpy(logits.astype(np.float64)), 1)
    logprobs, rows = guarded((n, classes), np.float32), guarded(n, np.float32)
    loss = guarded(1, np.float32)
    l_ = cuda.to_device(logits)
    y_ = cuda.to_device(labels)
    forward(l_, y_, logprobs.array, rows.array, loss.array)
    # A float32 log-sum-exp near 800 is off by a few eps32 * 800 (softmax_grad_tol).
    lse = 800 + math.log(classes)
    check(
        logprobs.array,
        ref_lp,
        rounding_tolerance(ref_lp, lse, 4, checks.TOL),
        "logprobs (rows near +-800)",
    )
    check(
        loss.array,
        ref.detach().reshape(1),
        rounding_tolerance(ref.detach(), lse, 4, checks.TOL),
        "nll loss (rows near +-800)",
    )
    d = guarded((n, classes), np.float32)
    kernels.log_softmax_nll_backward(logprobs.array, y_, d.array)
    check(
        d.array,
        tl.grad,
        checks.softmax_grad_tol(logits, tl.grad),
        "nll grad logits (rows near +-800)",
    )


def check_batchnorm_tiny_variance(
    rng,
    forward_train=kernels.batchnorm_forward_train,
    forward_eval=kernels.batchnorm_forward_eval,
    eps=1e-5,
):
    """Batchnorm where eps matters: channel 0's batch variance is ~1e-6 (std
    1e-3, mean ~0, so no cancellation) and two running variances are 1e-7, all
    below eps = 1e-5. Forgetting eps scales the output by sqrt(1 + eps/var),
    3x or more here, where variances near 1 would hide it (1 + 5e-6)."""
    n, c, h, w = 2, 3, 3, 5
    x = random_array((n, c, h, w), np.float32, rng)
    x[:, 0] *= 1e-3
    gamma = random_array(c, np.float32, rng, 0.5, 2.0)
    beta = random_array(c, np.float32, rng)
    rm = random_array(c, np.float32, rng)
    rv = random_array(c, np.float32, rng, 0.5, 2.0)
    rv[[0, 2]] = 1e-7
    tx, tg, tb, trm, trv = (
        torch.from_numpy(a.astype(np.float64)) for a in (x, gamma, beta, rm, rv)
    )
    ref = F.batch_norm(tx, trm.clone(), trv.clone(), tg, tb, training=True, momentum=0.1, eps=eps)
    x_, g_, b_ = (cuda.to_device(a) for a in (x, gamma, beta))
    rm_, rv_ = cuda.to_device(rm), cuda.to_device(rv)
    stats = [guarded(c, np.float32) for _ in range(2)]
    xhat, y = guarded(x.shape, np.float32), guarded(x.shape, np.float32)
    forward_train(
        x_, g_, b_, eps, 0.1, stats[0].array, stats[1].array, rm_, rv_, xhat.array, y.array
    )
    check(y.array, ref, checks.TOL, "batchnorm forward (batch variance below eps)")
    check(
        stats[1].array,
        1 / torch.sqrt(tx.var((0, 2, 3), unbiased=False) + eps),
        checks.TOL,
        "batchnorm invstd (batch variance below eps)",
    )
    ref_eval = F.batch_norm(tx, trm, trv, tg, tb, training=False, eps=eps)
    y_eval = guarded(x.shape, np.float32)
    forward_eval(x_, g_, b_, cuda.to_device(rm), cuda.to_device(rv), eps, y_eval.array)
    check(y_eval.array, ref_eval, checks.TOL, "batchnorm eval forward (running variance below eps)")


def test_maxpool_ties_first_maximum_wins(rng):
    check_maxpool_ties(rng)


def test_maxpool_ties_check_catches_last_maximum(rng):
    broken = _launcher(mutant(kernels.maxpool2x2_forward_naive, ("if v > best:", "if v >= best:")))
    with pytest.raises(CheckError, match="argmax"):
        check_maxpool_ties(rng, forward=broken)


def test_argmax_rows_ties_first_wins(rng):
    # FastCNN.predict launches this same kernel.
    check_argmax_ties(rng)


def test_argmax_ties_check_catches_last_maximum(rng):
    broken = _launcher(
        mutant(
            kernels.argmax_rows_naive,
            ("if logits[n, c] > logits[n, best]:", "if logits[n, c] >= logits[n, best]:"),
        )
    )
    with pytest.raises(CheckError, match="argmax"):
        check_argmax_ties(rng, argmax=broken)


def test_relu_gradient_at_exact_zero(rng):
    check_relu_at_zero(rng)


def test_relu_zero_check_catches_greater_or_equal(rng):
    broken = _launcher(mutant(kernels.relu_backward_naive, ("if x[i] > 0", "if x[i] >= 0")))
    flat = kernels._flat
    with pytest.raises(CheckError, match="relu backward"):
        check_relu_at_zero(rng, backward=lambda dy, x, dx: broken(flat(dy), flat(x), flat(dx)))


def test_log_softmax_rows_past_exp_range(rng):
    check_log_softmax_extreme_rows(rng)


def test_extreme_rows_check_catches_missing_max_subtraction(rng):
    kernel = mutant(
        kernels.log_softmax_nll_forward_naive,
        ("s += math.exp(logits[n, c] - m)", "s += math.exp(logits[n, c])"),
        ("lse = m + math.log(s)", "lse = math.log(s)"),
    )

    def broken(logits, labels, logprobs, rows, loss):
        kernel[kernels._grid(logits.shape[0])](logits, labels, logprobs, rows)
        kernels.mean_naive[1, 1](rows, loss)

    # A GPU returns inf (and the check fails); the simulator's math.exp and
    # math.log raise instead of returning inf and -inf.
    with pytest.raises((CheckError, OverflowError, ValueError)):
        check_log_softmax_extreme_rows(rng, forward=broken)


def test_batchnorm_variance_below_eps(rng):
    check_batchnorm_tiny_variance(rng)


def test_tiny_variance_check_catches_missing_eps_in_training(rng):
    stats = mutant(kernels.batchnorm_stats_naive, ("math.sqrt(var + eps)", "math.sqrt(var)"))

    def broken(x, gamma, beta, eps, momentum, mean, invstd, rm, rv, xhat, y):
        stats[kernels._grid(mean.size)](x, eps, momentum, mean, invstd, rm, rv)
        kernels.batchnorm_normalize_naive[kernels._grid(x.size)](
            x, mean, invstd, gamma, beta, xhat, y
        )

    with pytest.raises(CheckError, match="batch variance below eps"):
        check_batchnorm_tiny_variance(rng, forward_train=broken)


def test_tiny_variance_check_catches_missing_eps_in_eval(rng):
    kernel = mutant(
        kernels.batchnorm_eval_naive,
        ("math.sqrt(running_var[c] + eps)", "math.sqrt(running_var[c])"),
    )
    with pytest.raises(CheckError, match="running variance below eps"):
        check_batchnorm_tiny_variance(
            rng,
            forward_eval=lambda x, g, b, rm, rv, eps, y: kernel[kernels._grid(x.size)](
                x, rm, rv, g, b, eps, y
            ),
        )


# ---------------------------------------------------------------------------
# The NumPy reference against torch.autograd (so the reference can be trusted)
# ---------------------------------------------------------------------------

REF_TOL = 1e-10


def _leaf(a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("k, pad, h, w", [(3, 1, 5, 7), (5, 2, 6, 6), (3, 0, 4, 5)])
def test_reference_conv2d(rng, k, pad, h, w):
    x, wt, b = (
        rng.standard_normal((2, 3, h, w)),
        rng.standard_normal((4, 3, k, k)),
        rng.standard_normal(4),
    )
    out, cache = reference.conv2d_forward(x, wt, b, pad)
    tx, tw, tb = _leaf(x), _leaf(wt), _leaf(b)
    ref = F.conv2d(tx, tw, tb, padding=pad)
    dout = rng.standard_normal(out.shape)
    ref.backward(torch.from_numpy(dout))
    dx, dw, db = reference.conv2d_backward(dout, cache)
    for got, want, name in (
        (out, ref.detach(), "out"),
        (dx, tx.grad, "dx"),
        (dw, tw.grad, "dw"),
        (db, tb.grad, "db"),
    ):
        check(got, want, REF_TOL, f"reference conv2d {name}")


def test_reference_batchnorm(rng):
    x = rng.standard_normal((2, 3, 5, 7)) * 2 + 1
    g, b = rng.uniform(0.5, 2, 3), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    y, cache, nm, nv = reference.batchnorm_forward_train(x, g, b, rm, rv, 1e-5, 0.1)
    tx, tg, tb = _leaf(x), _leaf(g), _leaf(b)
    trm, trv = torch.tensor(rm), torch.tensor(rv)
    ref = F.batch_norm(tx, trm, trv, tg, tb, training=True, momentum=0.1, eps=1e-5)
    dy = rng.standard_normal(x.shape)
    ref.backward(torch.from_numpy(dy))
    dx, dg, db = reference.batchnorm_backward(dy, cache)
    for got, want, name in (
        (y, ref.detach(), "y"),
        (nm, trm, "running mean"),
        (nv, trv, "running var"),
        (dx, tx.grad, "dx"),
        (dg, tg.grad, "dgamma"),
        (db, tb.grad, "dbeta"),
    ):
        check(got, want, REF_TOL, f"reference batchnorm {name}")
    ev = reference.batchnorm_forward_eval(x, g, b, rm, rv, 1e-5)
    check(
        ev,
        F.batch_norm(
            torch.tensor(x),
            torch.tensor(rm),
            torch.tensor(rv),
            torch.tensor(g),
            torch.tensor(b),
            training=False,
            eps=1e-5,
        ),
        REF_TOL,
        "reference batchnorm eval",
    )


@pytest.mark.parametrize("h, w", [(4, 6), (5, 7)])
def test_reference_maxpool_relu_linear_loss(rng, h, w):
    x = rng.standard_normal((2, 3, h, w))
    out, cache = reference.maxpool2x2_forward(x)
    tx = _leaf(x)
    ref = F.max_pool2d(tx, 2)
    dout = rng.standard_normal(out.shape)
    ref.backward(torch.from_numpy(dout))
    check(out, ref.detach(), REF_TOL, "reference maxpool")
    check(
        reference.maxpool2x2_backward(dout, cache), tx.grad, REF_TOL, "reference maxpool backward"
    )

    r, rc = reference.relu_forward(x)
    check(r, F.relu(torch.tensor(x)), REF_TOL, "reference relu")
    check(reference.relu_backward(x + 5, rc), (x + 5) * (x > 0), REF_TOL, "reference relu backward")

    a, wt, b = rng.standard_normal((3, 7)), rng.standard_normal((4, 7)), rng.standard_normal(4)
    ta, tw, tb = _leaf(a), _leaf(wt), _leaf(b)
    ref = F.linear(ta, tw, tb)
    dy = rng.standard_normal((3, 4))
    ref.backward(torch.from_numpy(dy))
    y, lc = reference.linear_forward(a, wt, b)
    check(y, ref.detach(), REF_TOL, "reference linear")
    for got, want, name in zip(
        reference.linear_backward(dy, lc), (ta.grad, tw.grad, tb.grad), ("dx", "dw", "db")
    ):
        check(got, want, REF_TOL, f"reference linear {name}")

    logits, labels = rng.standard_normal((5, 4)) * 10, rng.integers(0, 4, 5)
    tl = _leaf(logits)
    ref = F.cross_entropy(tl, torch.from_numpy(labels))
    ref.backward()
    loss, cc = reference.log_softmax_nll_forward(logits, labels)
    check(np.array([loss]), ref.detach().reshape(1), REF_TOL, "reference nll")
    check(reference.log_softmax_nll_backward(cc), tl.grad, REF_TOL, "reference nll backward")


def test_reference_train_step_matches_twin(rng):
    cfg = NetConfig(in_channels=2, height=8, width=4, c1=3, c2=2, hidden=5, num_classes=3)
    state = init_params(cfg, seed=3)
    x = rng.standard_normal((3, 2, 8, 4))
    y = rng.integers(0, 3, 3)
    loss, new_params, new_buffers = reference.reference_train_step(state, x, y, 0.2, cfg)
    twin = TorchCNN.from_state_dict(cfg, state, dtype=torch.float64)
    opt = torch.optim.SGD(twin.parameters(), lr=0.2)
    from final_project.torch_twin import torch_train_step

    tloss = torch_train_step(twin, opt, torch.from_numpy(x), torch.from_numpy(y))
    assert abs(loss - float(tloss)) <= REF_TOL * abs(float(tloss))
    tstate = twin.state_dict()
    for name, value in {**new_params, **new_buffers}.items():
        check(value, tstate[name], REF_TOL, f"reference step {name}")
    logits, _, _ = reference.reference_forward(
        {**new_params, **new_buffers}, x, cfg, training=False
    )
    with torch.no_grad():
        check(logits, twin.eval()(torch.from_numpy(x)), REF_TOL, "reference eval forward")
