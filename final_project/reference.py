"""The capstone CNN in plain NumPy float64, forward and backward, written to be read.

One function pair per layer, micrograd style: ``<layer>_forward`` returns the
output and a ``cache`` of what the backward pass needs; ``<layer>_backward``
takes the gradient of the loss with respect to the output (``dout``) and the
cache, and returns the gradients with respect to the inputs and parameters.
The kernels in :mod:`final_project.kernels` compute the same things, one thread
per output element. This file is the course's one ground truth: every kernel
check (:mod:`final_project.checks`: each layer, a whole training step, the
evaluation forward) compares float32 kernels with these float64 functions,
and the tests check this file itself against ``torch.autograd`` in float64
(``tests/test_final_project_layers.py``, the ``test_reference_*`` tests).

    conv 3x3 pad 1 -> batchnorm -> ReLU -> max-pool 2x2      (x2)
    -> flatten (NCHW order) -> linear -> ReLU -> linear -> log-softmax + NLL

Layouts follow torch: NCHW activations, conv weights OIHW, linear weights
(out, in). Usage::

    loss, new_params, new_buffers = reference_train_step(state, x, y, lr, config)
    logits, caches, new_buffers = reference_forward(state, x, config, training=True)
    loss, grads = reference_backward(logits, caches, y)
"""

from __future__ import annotations

from typing import Any

import numpy as np

# ---------------------------------------------------------------------------
# Convolution, stride 1, zero padding
# ---------------------------------------------------------------------------


def conv2d_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, pad: int = 1):
    """out[n, o, i, j] = b[o] + sum_{c, p, q} xpad[n, c, i + p, j + q] w[o, c, p, q].

    x (N, C, H, W), w (O, C, K, K), b (O,) -> out (N, O, H + 2 pad - K + 1, ...).
    One einsum per kernel offset (p, q): the image shifted by (p, q) times a
    (O, C) slice of the weights.
    """
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    k_h, k_w = w.shape[2], w.shape[3]
    h_out, w_out = xp.shape[2] - k_h + 1, xp.shape[3] - k_w + 1
    out = np.zeros((x.shape[0], w.shape[0], h_out, w_out))
    for p in range(k_h):
        for q in range(k_w):
            out += np.einsum("nchw,oc->nohw", xp[:, :, p : p + h_out, q : q + w_out], w[:, :, p, q])
    return out + b[None, :, None, None], (x, w, pad)


def conv2d_backward(dout: np.ndarray, cache):
    """-> dx (N, C, H, W), dw (O, C, K, K), db (O,) for :func:`conv2d_forward`."""
    x, w, pad = cache
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w, dtype=np.float64)
    h_out, w_out = dout.shape[2], dout.shape[3]
    for p in range(w.shape[2]):
        for q in range(w.shape[3]):
            window = xp[:, :, p : p + h_out, q : q + w_out]
            dw[:, :, p, q] = np.einsum("nohw,nchw->oc", dout, window)
            dxp[:, :, p : p + h_out, q : q + w_out] += np.einsum(
                "nohw,oc->nchw", dout, w[:, :, p, q]
            )
    dx = dxp[:, :, pad : pad + x.shape[2], pad : pad + x.shape[3]]
    return dx, dw, dout.sum(axis=(0, 2, 3))


# ---------------------------------------------------------------------------
# Batch normalisation (per channel over N, H, W), as torch.nn.BatchNorm2d
# ---------------------------------------------------------------------------


def batchnorm_forward_train(
    x, gamma, beta, running_mean, running_var, eps: float = 1e-5, momentum: float = 0.1
):
    """Normalise with the batch's mean and biased variance; return
    (y, cache, new_running_mean, new_running_var). The running variance is
    updated with the unbiased variance (factor M / (M - 1), M = N*H*W), as torch."""
    m = x.shape[0] * x.shape[2] * x.shape[3]
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean[None, :, None, None]) * invstd[None, :, None, None]
    y = gamma[None, :, None, None] * xhat + beta[None, :, None, None]
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * var * m / (m - 1)
    return y, (xhat, gamma, invstd), new_mean, new_var


def batchnorm_forward_eval(x, gamma, beta, running_mean, running_var, eps: float = 1e-5):
    """Normalise with the running statistics (evaluation mode)."""
    scale = gamma / np.sqrt(running_var + eps)
    return (x - running_mean[None, :, None, None]) * scale[None, :, None, None] + beta[
        None, :, None, None
    ]


def batchnorm_backward(dy, cache):
    """-> dx, dgamma, dbeta for :func:`batchnorm_forward_train`.

    dx = gamma invstd / M (M dy - sum(dy) - xhat sum(dy xhat)), sums per channel
    over M = N*H*W elements (Ioffe and Szegedy 2015, section 3, simplified).
    """
    xhat, gamma, invstd = cache
    m = dy.shape[0] * dy.shape[2] * dy.shape[3]
    dbeta = dy.sum(axis=(0, 2, 3))
    dgamma = (dy * xhat).sum(axis=(0, 2, 3))
    dx = _per_channel(gamma * invstd / m) * (
        m * dy - _per_channel(dbeta) - xhat * _per_channel(dgamma)
    )
    return dx, dgamma, dbeta


def _per_channel(v):
    """A (C,) vector shaped (1, C, 1, 1), to broadcast over NCHW."""
    return v[None, :, None, None]


# ---------------------------------------------------------------------------
# ReLU, max-pool, linear
# ---------------------------------------------------------------------------


def relu_forward(x):
    return np.maximum(x, 0), x


def relu_backward(dout, x):
    return dout * (x > 0)


def maxpool2x2_forward(x, taken=None):
    """2x2 max-pool, stride 2, floor mode. Returns (out, cache); the cache holds
    each window's argmax (0..3, first maximum in row-major order, as torch).

    ``taken``: optional int (N, C, H/2, W/2) window positions 0..3 to take
    instead of each window's maximum. A float32 model and this float64 function
    may pick different elements where two values of a window are equal up to
    float32 rounding; the gradient then flows to another pixel and a batch-wide
    sum moves by ~1e-3. Following the model's choices (``pool_windows`` of the
    models) compares the rest of the step exactly; the caller checks that each
    choice is a maximum up to rounding.
    """
    n, c, h, w = x.shape
    ho, wo = h // 2, w // 2
    windows = x[:, :, : 2 * ho, : 2 * wo].reshape(n, c, ho, 2, wo, 2)
    windows = windows.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, 4)
    arg = windows.argmax(axis=-1) if taken is None else np.asarray(taken, np.int64)
    out = np.take_along_axis(windows, arg[..., None], axis=-1)[..., 0]
    return out, (x.shape, arg)


def maxpool2x2_backward(dout, cache):
    """Route each output's gradient to its window's argmax; 0 everywhere else."""
    shape, arg = cache
    n, c, ho, wo = dout.shape
    onehot = np.arange(4) == arg[..., None]  # (n, c, ho, wo, 4)
    windows = (onehot * dout[..., None]).reshape(n, c, ho, wo, 2, 2)
    dx = np.zeros(shape)
    dx[:, :, : 2 * ho, : 2 * wo] = windows.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, 2 * ho, 2 * wo)
    return dx


def linear_forward(x, w, b):
    """y (N, O) = x (N, I) @ w (O, I)^T + b."""
    return x @ w.T + b, (x, w)


def linear_backward(dout, cache):
    """-> dx (N, I), dw (O, I), db (O,)."""
    x, w = cache
    return dout @ w, dout.T @ x, dout.sum(axis=0)


# ---------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------


def log_softmax_nll_forward(logits, labels):
    """Mean over the batch of -log softmax(logits)[n, labels[n]]; returns (loss, cache)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    n = logits.shape[0]
    return -logprobs[np.arange(n), labels].mean(), (logprobs, labels)


def log_softmax_nll_backward(cache):
    """d loss / d logits = (softmax - onehot(labels)) / N."""
    logprobs, labels = cache
    n = logprobs.shape[0]
    d = np.exp(logprobs)
    d[np.arange(n), labels] -= 1
    return d / n


# ---------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------


def _f64(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}


def _buffers(state: dict[str, Any], config) -> dict[str, np.ndarray]:
    """Running statistics from ``state``, or torch's initial values when absent."""
    out = {}
    for bn, c in (("bn1", config.c1), ("bn2", config.c2)):
        out[f"{bn}.running_mean"] = np.asarray(
            state.get(f"{bn}.running_mean", np.zeros(c)), dtype=np.float64
        )
        out[f"{bn}.running_var"] = np.asarray(
            state.get(f"{bn}.running_var", np.ones(c)), dtype=np.float64
        )
    return out


def tf32_operand(a: np.ndarray) -> np.ndarray:
    """What the tensor cores read of ``a`` in TF32, as float64: ``a`` rounded to
    float32 (the kernels' operands are float32), then its 13 low mantissa bits
    cleared (TF32 keeps 10, and the hardware truncates)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


# The operations a model may run in TF32, as reference_forward's tf32= names them.
TF32_OPS = ("conv2 forward", "conv2 grad input", "conv2 grad weight")
# Largest relative change tf32_operand makes to a float32: one unit of the 10th
# mantissa bit (truncation; rounding to nearest would make half that).
TF32_UNIT = 2.0**-10


def _follow_relu(pre: np.ndarray, open_: np.ndarray, gaps: list, at=None) -> np.ndarray:
    """``pre`` (a ReLU's input) with the model's on/off decisions ``open_`` imposed
    where they differ from its own sign (set to +-1e-300, so the forward value
    stays ~0 and the backward follows the model); appends to ``gaps`` the largest
    |pre| among those (0 if none), which the caller holds to a tie tolerance.
    ``at``: (n, c, row, col) index arrays of the units ``open_`` decides (a
    max-pool's winners), or None for every unit."""
    units = pre if at is None else pre[at]
    differ = (units > 0) != np.asarray(open_, bool)
    gaps.append(float(np.abs(units[differ]).max()) if differ.any() else 0.0)
    if not differ.any():
        return pre
    pre = pre.copy()
    fixed = np.where(np.asarray(open_, bool)[differ], 1e-300, -1e-300)
    if at is None:
        pre[differ] = fixed
    else:
        pre[tuple(i[differ] for i in at)] = fixed
    return pre


def _winners(shape, taken) -> tuple:
    """(n, c, row, col) index arrays of each 2x2 window's taken element."""
    n, c, ho, wo = np.asarray(taken).shape
    arg = np.asarray(taken, np.int64)
    nn, cc, ph, pw = np.indices((n, c, ho, wo))
    return nn, cc, 2 * ph + arg // 2, 2 * pw + arg % 2


def reference_forward(
    state: dict[str, Any],
    x: np.ndarray,
    config,
    training: bool = False,
    pool_windows=None,
    tf32: tuple[str, ...] = (),
    relu_open=None,
):
    """Logits (N, num_classes) float64 of the network for x (N, C, H, W).

    ``training`` selects batch statistics (True) or the running statistics in
    ``state`` (False) for batchnorm. Returns (logits, caches, new_buffers);
    caches and new_buffers are only meaningful for training.

    ``pool_windows``: optional (pool1, pool2) window positions, as a model's
    ``pool_windows(n)`` returns: each max-pool takes those elements (see
    :func:`maxpool2x2_forward`), and ``caches["pool_gaps"]`` holds, per pool,
    how far each taken value is below its window's maximum (0 where it is the
    maximum).

    ``tf32``: operations of :data:`TF32_OPS` to model as the tensor cores run
    them: their two operands rounded as :func:`tf32_operand` says, the products
    and sums still exact. A model's TF32 kernels then differ from this reference
    by float32 rounding alone (a float32 value and its float64 twin can fall on
    either side of a TF32 step: a rare 2^-10 relative change of one operand), so
    one tolerance checks both precisions. The choice reaches
    :func:`reference_backward` through the caches.

    ``relu_open``: optional (pool1, pool2, fc1) boolean arrays, whether the model's
    ReLU was on at each max-pool's taken element (its pooled output > 0) and at
    each fc1 unit, with ``pool_windows``. Where the model decided otherwise than
    the reference's sign (an input within rounding of 0), the reference follows
    it, as it follows the windows; ``caches["relu_gaps"]`` holds, per ReLU, the
    largest |input| at such a unit (0 where they agree), for the caller to judge.
    """
    unknown = set(tf32) - set(TF32_OPS)
    if unknown:
        raise ValueError(f"tf32: unknown operations {sorted(unknown)}; choose from {TF32_OPS}")
    p = _f64(state)
    buf = _buffers(state, config)
    x = np.asarray(x, dtype=np.float64)
    caches: dict[str, Any] = {}
    new_buffers: dict[str, np.ndarray] = {}
    h = x
    caches["pool_gaps"] = []
    caches["relu_gaps"] = []
    if relu_open is not None and pool_windows is None:
        raise ValueError("relu_open needs pool_windows (the units it decides are the winners)")
    caches["tf32"] = tuple(tf32)
    for k, (conv, bn) in enumerate((("conv1", "bn1"), ("conv2", "bn2"))):
        w, b = p[f"{conv}.weight"], p[f"{conv}.bias"]
        if f"{conv} forward" in tf32:
            # the backward rounds (or not) for itself: keep the unrounded input
            caches[conv] = (h, w, 1)
            h, _ = conv2d_forward(tf32_operand(h), tf32_operand(w), b, pad=1)
        else:
            h, caches[conv] = conv2d_forward(h, w, b, pad=1)
        rm, rv = buf[f"{bn}.running_mean"], buf[f"{bn}.running_var"]
        if training:
            h, caches[bn], nm, nv = batchnorm_forward_train(
                h, p[f"{bn}.weight"], p[f"{bn}.bias"], rm, rv, config.bn_eps, config.bn_momentum
            )
            new_buffers[f"{bn}.running_mean"], new_buffers[f"{bn}.running_var"] = nm, nv
        else:
            h = batchnorm_forward_eval(h, p[f"{bn}.weight"], p[f"{bn}.bias"], rm, rv, config.bn_eps)
        if relu_open is not None:
            h = _follow_relu(
                h, relu_open[k], caches["relu_gaps"], _winners(h.shape, pool_windows[k])
            )
        h, caches[f"relu_{bn}"] = relu_forward(h)
        if pool_windows is None:
            h, caches[f"pool_{bn}"] = maxpool2x2_forward(h)
        else:
            best, _ = maxpool2x2_forward(h)
            h, caches[f"pool_{bn}"] = maxpool2x2_forward(h, pool_windows[k])
            caches["pool_gaps"].append(best - h)
    caches["flatten"] = h.shape
    h = h.reshape(h.shape[0], -1)  # NCHW flatten, as torch's x.flatten(1)
    h, caches["fc1"] = linear_forward(h, p["fc1.weight"], p["fc1.bias"])
    if relu_open is not None:
        h = _follow_relu(h, relu_open[2], caches["relu_gaps"])
    h, caches["relu_fc1"] = relu_forward(h)
    logits, caches["fc2"] = linear_forward(h, p["fc2.weight"], p["fc2.bias"])
    return logits, caches, new_buffers


def reference_backward(logits: np.ndarray, caches: dict[str, Any], y: np.ndarray):
    """Mean NLL of ``logits`` (from a training-mode :func:`reference_forward`)
    against labels y (N,), and its gradient: (loss, grads by parameter name)."""
    loss, loss_cache = log_softmax_nll_forward(logits, np.asarray(y, dtype=np.int64))
    g: dict[str, np.ndarray] = {}
    d = log_softmax_nll_backward(loss_cache)
    d, g["fc2.weight"], g["fc2.bias"] = linear_backward(d, caches["fc2"])
    d = relu_backward(d, caches["relu_fc1"])
    d, g["fc1.weight"], g["fc1.bias"] = linear_backward(d, caches["fc1"])
    d = d.reshape(caches["flatten"])
    for conv, bn in (("conv2", "bn2"), ("conv1", "bn1")):
        d = maxpool2x2_backward(d, caches[f"pool_{bn}"])
        d = relu_backward(d, caches[f"relu_{bn}"])
        d, g[f"{bn}.weight"], g[f"{bn}.bias"] = batchnorm_backward(d, caches[bn])
        tf32 = caches.get("tf32", ())
        x, w, pad = caches[conv]
        gw, gi = f"{conv} grad weight" in tf32, f"{conv} grad input" in tf32
        d_t = tf32_operand(d) if gw or gi else d
        x_t = tf32_operand(x) if gw else x
        w_t = tf32_operand(w) if gi else w
        if gw == gi:  # one pass: both products plain, or both in TF32
            dx, g[f"{conv}.weight"], _ = conv2d_backward(d_t, (x_t, w_t, pad))
        else:
            dx, _, _ = conv2d_backward(d_t if gi else d, (x, w_t, pad))
            _, g[f"{conv}.weight"], _ = conv2d_backward(d_t if gw else d, (x_t, w, pad))
        g[f"{conv}.bias"] = d.sum(axis=(0, 2, 3))  # a plain sum in either precision
        d = dx
    return float(loss), g


def reference_loss_and_grads(state: dict[str, Any], x: np.ndarray, y: np.ndarray, config):
    """Training-mode forward and backward: (loss, grads by parameter name, new_buffers)."""
    logits, caches, new_buffers = reference_forward(state, x, config, training=True)
    loss, grads = reference_backward(logits, caches, y)
    return loss, grads, new_buffers


def reference_train_step(params: dict[str, Any], x: np.ndarray, y: np.ndarray, lr: float, config):
    """One plain-SGD step in float64: (loss before the step, new_params, new_buffers).

    params: the parameters by torch name (as :func:`final_project.model.init_params`
    returns), optionally with the batchnorm running statistics (torch's initial
    zeros and ones are used when absent). x (N, C, H, W), y (N,) integer labels.
    """
    loss, grads, new_buffers = reference_loss_and_grads(params, x, y, config)
    new_params = {k: np.asarray(params[k], dtype=np.float64) - lr * grads[k] for k in grads}
    return loss, new_params, new_buffers
