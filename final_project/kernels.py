"""Every operation of the capstone CNN's training step as a plain ``@cuda.jit`` kernel.

Version 1 of each op is naive: one thread per output element, which loops over
whatever it sums. These are the readable baseline; the fast versions (implicit
GEMM, fused and split-K kernels) are in :mod:`final_project.fast_conv` and
:mod:`final_project.fast_layers`, and every one of them is checked against the
same float64 reference (:mod:`final_project.reference`).

    conv2d_forward_naive          thread per output (n, co, oh, ow): loops ci, kh, kw
    conv2d_grad_input_naive       thread per input (n, ci, h, w): gathers from dout, no atomics
    conv2d_grad_weight_naive      thread per weight (co, ci, kh, kw): loops n, oh, ow
    channel_sum_naive             thread per channel: conv bias grad (and any NCHW channel sum)
    batchnorm_stats_naive         thread per channel: batch mean, 1/std, running-stat update
    batchnorm_normalize_naive     thread per element: xhat = (x - mean) / std, y = g xhat + b
    batchnorm_eval_naive          thread per element: normalise with the running statistics
    batchnorm_backward_reduce_naive  thread per channel: dgamma = sum dy xhat, dbeta = sum dy
    batchnorm_backward_dx_naive   thread per element: the closed-form input gradient
    relu_forward_naive, relu_backward_naive        thread per element
    maxpool2x2_forward_naive      thread per output: max of a 2x2 window, keeps the argmax
    maxpool2x2_backward_naive     thread per input: gradient if it was its window's argmax, else 0
    linear_forward_naive          thread per output (n, o): dot product over the inputs
    linear_grad_input_naive       thread per input (n, i): sum over outputs
    linear_grad_weight_naive      thread per weight (o, i): sum over the batch
    linear_grad_bias_naive        thread per output feature: sum over the batch
    log_softmax_nll_forward_naive thread per row: log-softmax and that row's loss
    mean_naive                    one thread: the mean of the row losses (deterministic)
    log_softmax_nll_backward_naive  thread per logit: (softmax - onehot) / N
    argmax_rows_naive             thread per row: predicted class
    sgd_update_naive              thread per parameter: p -= lr * g

Conventions: NCHW float32 activations, torch weight layouts (conv OIHW, linear
(out, in)), stride 1 convolutions with zero padding ``pad`` and any kernel size.
Every kernel *writes* its output (no ``+=`` into an output), so gradients need
no zeroing between steps, and no kernel needs ``cuda.atomic.add``: each output
element is owned by one thread, which makes every result deterministic.
Reductions over the batch (weight gradients, batch statistics, the loss)
accumulate in float64: a channel of the first batchnorm sums N*H*W = 800k values
at batch 1024, where a float32 running sum loses about 3 digits. Accumulators
start as ``float64(0.0)``, not a bare ``0.0``: both compile to a float64 sum,
but the simulator runs the kernel in NumPy, where ``0.0 + float32`` stays
float32 (NumPy 2's promotion rules), and would check a different sum than the
GPU runs.

Each kernel is followed by a thin launcher (same name without ``_naive``) that
computes the grid: ``ceil_div(elements, THREADS_PER_BLOCK)`` blocks of
``THREADS_PER_BLOCK`` threads. Launchers take device arrays and return nothing;
they never synchronize. The methods follow the standard derivations (e.g.
Ioffe and Szegedy 2015, "Batch Normalization", section 3, for the batchnorm
gradient; Goodfellow et al., "Deep Learning", section 9.5, for convolution).

Run the checks: ``python -m pytest tests/test_final_project_layers.py -q``
(simulator) or ``python -m final_project.check_gpu`` (GPU, full sizes).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import ceil_div, pick

import math

from numba import cuda, float64

# 256 threads a block on a GPU (8 warps: enough to hide latency, small enough
# that even a 64-channel op fills several blocks). The simulator runs one Python
# thread per CUDA thread, so small blocks there waste less on idle threads and
# still give several blocks, which exercises the block-index arithmetic.
THREADS_PER_BLOCK = pick(gpu=256, simulator=32)


def _grid(n: int) -> tuple[int, int]:
    """(blocks, threads) covering ``n`` threads, one per output element."""
    return ceil_div(max(n, 1), THREADS_PER_BLOCK), THREADS_PER_BLOCK


# A thread per element of a 4-D array gets a flat index i; this turns it back
# into the element's four indices (the last axis varies fastest, as in memory).
# Each % and // is an integer division, which costs more on a GPU than the few
# bytes such a kernel moves (fast_layers.py's window kernels avoid them).
@cuda.jit(device=True)
def nchw_index(i, channels, height, width):
    """(n, c, h, w) of flat index ``i`` into a C-contiguous (N, channels,
    height, width) array; also (co, ci, kh, kw) into OIHW weights."""
    w = i % width
    h = (i // width) % height
    c = (i // (width * height)) % channels
    n = i // (width * height * channels)
    return n, c, h, w


# ---------------------------------------------------------------------------
# Convolution (stride 1, zero padding), NCHW x OIHW
# ---------------------------------------------------------------------------


# Thread per output: Ci*K*K multiply-adds, each reading one x and one w element
# from global memory (2 loads per FMA, cached in L1/L2 by reuse across threads).
@cuda.jit(cache=True)
def conv2d_forward_naive(x, w, b, pad, out):
    i = cuda.grid(1)
    if i >= out.size:
        return
    _, c_out, h_out, w_out = out.shape
    c_in, k_h, k_w = w.shape[1], w.shape[2], w.shape[3]
    height, width = x.shape[2], x.shape[3]
    n, co, oh, ow = nchw_index(i, c_out, h_out, w_out)
    acc = b[co]
    for ci in range(c_in):
        for kh in range(k_h):
            ih = oh + kh - pad
            if ih < 0 or ih >= height:
                continue  # zero padding: the term is 0
            for kw in range(k_w):
                iw = ow + kw - pad
                if iw >= 0 and iw < width:
                    acc += x[n, ci, ih, iw] * w[co, ci, kh, kw]
    out[n, co, oh, ow] = acc


def conv2d_forward(x, w, b, pad: int, out) -> None:
    """out (N, Co, Ho, Wo) = conv(x (N, Ci, H, W), w (Co, Ci, K, K)) + b (Co,);
    Ho = H + 2 pad - K + 1. float32 device arrays."""
    conv2d_forward_naive[_grid(out.size)](x, w, b, pad, out)


# Thread per input element: it gathers every output it fed, out[oh, ow] with
# oh = h + pad - kh, so no two threads write the same dx (no atomics).
# Co*K*K multiply-adds per thread.
@cuda.jit(cache=True)
def conv2d_grad_input_naive(dout, w, pad, dx):
    i = cuda.grid(1)
    if i >= dx.size:
        return
    _, c_in, height, width = dx.shape
    c_out, k_h, k_w = w.shape[0], w.shape[2], w.shape[3]
    h_out, w_out = dout.shape[2], dout.shape[3]
    n, ci, ih, iw = nchw_index(i, c_in, height, width)
    acc = float64(0.0)
    for co in range(c_out):
        for kh in range(k_h):
            oh = ih + pad - kh
            if oh < 0 or oh >= h_out:
                continue
            for kw in range(k_w):
                ow = iw + pad - kw
                if ow >= 0 and ow < w_out:
                    acc += dout[n, co, oh, ow] * w[co, ci, kh, kw]
    dx[n, ci, ih, iw] = acc


def conv2d_grad_input(dout, w, pad: int, dx) -> None:
    """dx (N, Ci, H, W) = d loss / d x, from dout (N, Co, Ho, Wo) and w (Co, Ci, K, K)."""
    conv2d_grad_input_naive[_grid(dx.size)](dout, w, pad, dx)


# Thread per weight: sums x * dout over the whole batch and image, N*Ho*Wo
# terms. Few threads (Co*Ci*K*K, 288 for the first layer) each doing a long
# loop: the first place a faster version splits the sum (fast_conv.py's
# split-K weight gradient). Its loops mirror conv2d_grad_input_naive's with the
# roles of the summed and the owned indices swapped: two kernels, on purpose.
@cuda.jit(cache=True)
def conv2d_grad_weight_naive(dout, x, pad, dw):
    i = cuda.grid(1)
    if i >= dw.size:
        return
    _, c_in, k_h, k_w = dw.shape
    batch, height, width = x.shape[0], x.shape[2], x.shape[3]
    h_out, w_out = dout.shape[2], dout.shape[3]
    co, ci, kh, kw = nchw_index(i, c_in, k_h, k_w)
    acc = float64(0.0)  # float64: up to N*Ho*Wo = 800k terms
    for n in range(batch):
        for oh in range(h_out):
            ih = oh + kh - pad
            if ih < 0 or ih >= height:
                continue
            for ow in range(w_out):
                iw = ow + kw - pad
                if iw >= 0 and iw < width:
                    acc += x[n, ci, ih, iw] * dout[n, co, oh, ow]
    dw[co, ci, kh, kw] = acc


def conv2d_grad_weight(dout, x, pad: int, dw) -> None:
    """dw (Co, Ci, K, K) = d loss / d w, from dout (N, Co, Ho, Wo) and x (N, Ci, H, W)."""
    conv2d_grad_weight_naive[_grid(dw.size)](dout, x, pad, dw)


# Thread per channel: sums N*H*W values (float64 accumulator).
@cuda.jit(cache=True)
def channel_sum_naive(t, out):
    c = cuda.grid(1)
    if c >= out.size:
        return
    batch, _, height, width = t.shape
    acc = float64(0.0)
    for n in range(batch):
        for h in range(height):
            for w in range(width):
                acc += t[n, c, h, w]
    out[c] = acc


def conv2d_grad_bias(dout, db) -> None:
    """db (Co,) = d loss / d b = dout (N, Co, Ho, Wo) summed over n, oh, ow."""
    channel_sum_naive[_grid(db.size)](dout, db)


# ---------------------------------------------------------------------------
# Batch normalisation over (N, H, W) per channel, as torch.nn.BatchNorm2d
# ---------------------------------------------------------------------------


# Thread per channel, two passes over its N*H*W values (mean, then the biased
# variance around it: more accurate than E[x^2] - E[x]^2). Also updates the
# running statistics with the *unbiased* variance, as torch does.
@cuda.jit(cache=True)
def batchnorm_stats_naive(x, eps, momentum, mean, invstd, running_mean, running_var):
    c = cuda.grid(1)
    if c >= mean.size:
        return
    batch, _, height, width = x.shape
    count = batch * height * width
    s = float64(0.0)
    for n in range(batch):
        for h in range(height):
            for w in range(width):
                s += x[n, c, h, w]
    mu = s / count
    ss = float64(0.0)
    for n in range(batch):
        for h in range(height):
            for w in range(width):
                d = x[n, c, h, w] - mu
                ss += d * d
    var = ss / count
    mean[c] = mu
    invstd[c] = 1.0 / math.sqrt(var + eps)
    running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mu
    running_var[c] = (1.0 - momentum) * running_var[c] + momentum * var * count / (count - 1)


# Thread per element: one read of x, one write each of xhat (saved for the
# backward pass) and y.
@cuda.jit(cache=True)
def batchnorm_normalize_naive(x, mean, invstd, gamma, beta, xhat, y):
    i = cuda.grid(1)
    if i >= x.size:
        return
    _, channels, height, width = x.shape
    n, c, h, w = nchw_index(i, channels, height, width)
    xh = (x[n, c, h, w] - mean[c]) * invstd[c]
    xhat[n, c, h, w] = xh
    y[n, c, h, w] = gamma[c] * xh + beta[c]


def batchnorm_forward_train(
    x, gamma, beta, eps: float, momentum: float, mean, invstd, running_mean, running_var, xhat, y
) -> None:
    """Training-mode batchnorm of x (N, C, H, W) with the batch's statistics.

    Writes mean (C,), invstd (C,) = 1/sqrt(biased var + eps), xhat and y (N, C, H, W);
    updates running_mean and running_var (C,) in place with ``momentum``
    (new = (1 - momentum) old + momentum batch value; unbiased variance).
    """
    batchnorm_stats_naive[_grid(mean.size)](
        x, eps, momentum, mean, invstd, running_mean, running_var
    )
    batchnorm_normalize_naive[_grid(x.size)](x, mean, invstd, gamma, beta, xhat, y)


# Thread per element: evaluation mode uses the running statistics, nothing is updated.
@cuda.jit(cache=True)
def batchnorm_eval_naive(x, running_mean, running_var, gamma, beta, eps, y):
    i = cuda.grid(1)
    if i >= x.size:
        return
    _, channels, height, width = x.shape
    n, c, h, w = nchw_index(i, channels, height, width)
    scale = gamma[c] / math.sqrt(running_var[c] + eps)
    y[n, c, h, w] = (x[n, c, h, w] - running_mean[c]) * scale + beta[c]


def batchnorm_forward_eval(x, gamma, beta, running_mean, running_var, eps: float, y) -> None:
    """Evaluation-mode batchnorm: y = gamma (x - running_mean) / sqrt(running_var + eps) + beta."""
    batchnorm_eval_naive[_grid(x.size)](x, running_mean, running_var, gamma, beta, eps, y)


# Thread per channel: the two sums the input gradient needs, over N*H*W.
@cuda.jit(cache=True)
def batchnorm_backward_reduce_naive(dy, xhat, dgamma, dbeta):
    c = cuda.grid(1)
    if c >= dgamma.size:
        return
    batch, _, height, width = dy.shape
    sg = float64(0.0)
    sb = float64(0.0)
    for n in range(batch):
        for h in range(height):
            for w in range(width):
                g = dy[n, c, h, w]
                sg += g * xhat[n, c, h, w]
                sb += g
    dgamma[c] = sg
    dbeta[c] = sb


# Thread per element: dx = gamma invstd / M (M dy - sum dy - xhat sum(dy xhat)),
# M = N*H*W (Ioffe and Szegedy 2015, section 3, simplified).
@cuda.jit(cache=True)
def batchnorm_backward_dx_naive(dy, xhat, gamma, invstd, dgamma, dbeta, dx):
    i = cuda.grid(1)
    if i >= dx.size:
        return
    batch, channels, height, width = dx.shape
    count = batch * height * width
    n, c, h, w = nchw_index(i, channels, height, width)
    dx[n, c, h, w] = (gamma[c] * invstd[c] / count) * (
        count * dy[n, c, h, w] - dbeta[c] - xhat[n, c, h, w] * dgamma[c]
    )


def batchnorm_backward(dy, xhat, gamma, invstd, dgamma, dbeta, dx) -> None:
    """Gradients of training-mode batchnorm: dgamma, dbeta (C,) and dx (N, C, H, W),
    from dy (N, C, H, W) and the forward pass's saved xhat and invstd."""
    batchnorm_backward_reduce_naive[_grid(dgamma.size)](dy, xhat, dgamma, dbeta)
    batchnorm_backward_dx_naive[_grid(dx.size)](dy, xhat, gamma, invstd, dgamma, dbeta, dx)


# ---------------------------------------------------------------------------
# ReLU (any shape; the launchers flatten C-contiguous arrays to 1-D)
# ---------------------------------------------------------------------------


# Thread per element: one read, one write (memory-bound: 8 bytes per element).
@cuda.jit(cache=True)
def relu_forward_naive(x, y):
    i = cuda.grid(1)
    if i < y.size:
        v = x[i]
        y[i] = v if v > 0 else 0.0


# Thread per element: the gradient passes where the forward input was positive.
@cuda.jit(cache=True)
def relu_backward_naive(dy, x, dx):
    i = cuda.grid(1)
    if i < dx.size:
        dx[i] = dy[i] if x[i] > 0 else 0.0


def _flat(a):
    return a.reshape(a.size)


def relu_forward(x, y) -> None:
    """y = max(x, 0); x and y C-contiguous float32 of the same shape."""
    relu_forward_naive[_grid(y.size)](_flat(x), _flat(y))


def relu_backward(dy, x, dx) -> None:
    """dx = dy where x > 0, else 0 (x: the forward input)."""
    relu_backward_naive[_grid(dx.size)](_flat(dy), _flat(x), _flat(dx))


# ---------------------------------------------------------------------------
# Max-pool 2x2, stride 2 (floor mode: a trailing odd row/column is dropped)
# ---------------------------------------------------------------------------


# Thread per output: reads its 2x2 window, keeps the first maximum in row-major
# order (as torch does) and its flat index into x, for the backward pass.
@cuda.jit(cache=True)
def maxpool2x2_forward_naive(x, out, argmax):
    i = cuda.grid(1)
    if i >= out.size:
        return
    _, channels, h_out, w_out = out.shape
    height, width = x.shape[2], x.shape[3]
    n, c, oh, ow = nchw_index(i, channels, h_out, w_out)
    best = x[n, c, 2 * oh, 2 * ow]
    best_h = 2 * oh
    best_w = 2 * ow
    for dh in range(2):
        for dw in range(2):
            v = x[n, c, 2 * oh + dh, 2 * ow + dw]
            if v > best:
                best = v
                best_h = 2 * oh + dh
                best_w = 2 * ow + dw
    out[n, c, oh, ow] = best
    argmax[n, c, oh, ow] = ((n * channels + c) * height + best_h) * width + best_w


def maxpool2x2_forward(x, out, argmax) -> None:
    """out (N, C, H//2, W//2) = 2x2 max of x (N, C, H, W); argmax (int32, out's
    shape) = flat index into x of each maximum."""
    maxpool2x2_forward_naive[_grid(out.size)](x, out, argmax)


# Thread per *input* element: it looks up its window's argmax and takes the
# gradient if it is the winner, else writes 0. Every dx element is written once.
@cuda.jit(cache=True)
def maxpool2x2_backward_naive(dout, argmax, dx):
    i = cuda.grid(1)
    if i >= dx.size:
        return
    _, channels, height, width = dx.shape
    h_out, w_out = dout.shape[2], dout.shape[3]
    n, c, h, w = nchw_index(i, channels, height, width)
    oh = h // 2
    ow = w // 2
    g = 0.0
    if oh < h_out and ow < w_out and argmax[n, c, oh, ow] == i:
        g = dout[n, c, oh, ow]
    dx[n, c, h, w] = g


def maxpool2x2_backward(dout, argmax, dx) -> None:
    """dx (N, C, H, W) from dout (N, C, H//2, W//2) and the forward pass's argmax."""
    maxpool2x2_backward_naive[_grid(dx.size)](dout, argmax, dx)


# ---------------------------------------------------------------------------
# Linear: y = x W^T + b, x (N, I), W (O, I) as torch.nn.Linear
# ---------------------------------------------------------------------------


# Thread per output (n, o): an I-long dot product, 2 loads per FMA (no reuse
# through shared memory: the matmul chapter's tiling is the faster version).
@cuda.jit(cache=True)
def linear_forward_naive(x, w, b, y):
    i = cuda.grid(1)
    if i >= y.size:
        return
    n_out = y.shape[1]
    o = i % n_out
    n = i // n_out
    acc = b[o]
    for k in range(x.shape[1]):
        acc += x[n, k] * w[o, k]
    y[n, o] = acc


def linear_forward(x, w, b, y) -> None:
    """y (N, O) = x (N, I) @ w (O, I)^T + b (O,)."""
    linear_forward_naive[_grid(y.size)](x, w, b, y)


# Thread per input element (n, i): an O-long dot product with a column of W.
@cuda.jit(cache=True)
def linear_grad_input_naive(dy, w, dx):
    i = cuda.grid(1)
    if i >= dx.size:
        return
    n_in = dx.shape[1]
    k = i % n_in
    n = i // n_in
    acc = float64(0.0)
    for o in range(dy.shape[1]):
        acc += dy[n, o] * w[o, k]
    dx[n, k] = acc


# Thread per weight (o, i): an N-long sum over the batch (float64 accumulator).
@cuda.jit(cache=True)
def linear_grad_weight_naive(dy, x, dw):
    i = cuda.grid(1)
    if i >= dw.size:
        return
    n_in = dw.shape[1]
    k = i % n_in
    o = i // n_in
    acc = float64(0.0)
    for n in range(x.shape[0]):
        acc += dy[n, o] * x[n, k]
    dw[o, k] = acc


# Thread per output feature: sums its column of dy over the batch.
@cuda.jit(cache=True)
def linear_grad_bias_naive(dy, db):
    o = cuda.grid(1)
    if o >= db.size:
        return
    acc = float64(0.0)
    for n in range(dy.shape[0]):
        acc += dy[n, o]
    db[o] = acc


def linear_backward(dy, x, w, dx, dw, db) -> None:
    """From dy (N, O): dw (O, I) = dy^T x, db (O,) = sum_n dy, and dx (N, I) = dy w
    (skipped when ``dx`` is None: the first layer needs no input gradient)."""
    linear_grad_weight_naive[_grid(dw.size)](dy, x, dw)
    linear_grad_bias_naive[_grid(db.size)](dy, db)
    if dx is not None:
        linear_grad_input_naive[_grid(dx.size)](dy, w, dx)


# ---------------------------------------------------------------------------
# Log-softmax + negative log-likelihood (cross-entropy), mean over the batch
# ---------------------------------------------------------------------------


# Thread per row: max, log-sum-exp around it (no overflow), C log-probabilities,
# and the row's loss. A label outside [0, C) gives a NaN loss (a device-side
# check: the host never looks at the labels).
@cuda.jit(cache=True)
def log_softmax_nll_forward_naive(logits, labels, logprobs, row_loss):
    n = cuda.grid(1)
    if n >= logits.shape[0]:
        return
    classes = logits.shape[1]
    m = logits[n, 0]
    for c in range(1, classes):
        m = max(m, logits[n, c])
    s = float64(0.0)
    for c in range(classes):
        s += math.exp(logits[n, c] - m)
    lse = m + math.log(s)
    for c in range(classes):
        logprobs[n, c] = logits[n, c] - lse
    label = labels[n]
    if label >= 0 and label < classes:
        row_loss[n] = lse - logits[n, label]
    else:
        row_loss[n] = math.nan


# One thread sums the N row losses in order: deterministic, and N <= a few
# thousand, so the serial loop costs microseconds.
@cuda.jit(cache=True)
def mean_naive(values, out):
    if cuda.grid(1) == 0:
        acc = float64(0.0)
        for n in range(values.size):
            acc += values[n]
        out[0] = acc / values.size


def log_softmax_nll_forward(logits, labels, logprobs, row_loss, loss) -> None:
    """loss (1,) = mean over n of -log_softmax(logits)[n, labels[n]].

    logits (N, C) float32, labels (N,) int32; writes logprobs (N, C) (saved for
    the backward pass) and row_loss (N,). A label outside [0, C) makes the loss NaN.
    """
    log_softmax_nll_forward_naive[_grid(logits.shape[0])](logits, labels, logprobs, row_loss)
    mean_naive[1, 1](row_loss, loss)


# Thread per logit: d(mean loss)/d logit = (softmax - onehot(label)) / N.
@cuda.jit(cache=True)
def log_softmax_nll_backward_naive(logprobs, labels, dlogits):
    i = cuda.grid(1)
    if i >= dlogits.size:
        return
    batch, classes = dlogits.shape
    c = i % classes
    n = i // classes
    g = math.exp(logprobs[n, c])
    if c == labels[n]:
        g -= 1.0
    dlogits[n, c] = g / batch


def log_softmax_nll_backward(logprobs, labels, dlogits) -> None:
    """dlogits (N, C) = gradient of the mean NLL, from the saved logprobs (N, C)."""
    log_softmax_nll_backward_naive[_grid(dlogits.size)](logprobs, labels, dlogits)


# Thread per row: index of the first largest logit.
@cuda.jit(cache=True)
def argmax_rows_naive(logits, out):
    n = cuda.grid(1)
    if n >= logits.shape[0]:
        return
    best = 0
    for c in range(1, logits.shape[1]):
        if logits[n, c] > logits[n, best]:
            best = c
    out[n] = best


def argmax_rows(logits, out) -> None:
    """out (N,) int32 = argmax over classes of logits (N, C)."""
    argmax_rows_naive[_grid(out.size)](logits, out)


# ---------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------


# Thread per parameter: 12 bytes of traffic per element (read p and g, write p).
# The model keeps all parameters in one flat buffer, so one launch updates them all.
@cuda.jit(cache=True)
def sgd_update_naive(params, grads, lr):
    i = cuda.grid(1)
    if i < params.size:
        params[i] -= lr * grads[i]


def sgd_update(params, grads, lr: float) -> None:
    """params -= lr * grads, in place; both 1-D float32 of the same length."""
    sgd_update_naive[_grid(params.size)](params, grads, lr)
