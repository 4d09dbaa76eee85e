"""Checks of every capstone kernel against ``torch.autograd`` in float64 on the CPU.

Shared by the simulator tests (tiny hostile shapes) and ``python -m
final_project.check_gpu`` (full sizes on a GPU), so neither can drift from the
other. Each ``check_<layer>`` draws fresh random float32 inputs, computes the
float64 truth with torch (forward, then ``backward`` with a random upstream
gradient), runs our kernels into poisoned, guarded outputs (NaN everywhere, with
a poisoned margin that must stay untouched), and compares with
:func:`common.checking.check`. The launchers are parameters, so a test can hand
in a deliberately broken kernel and see the check fail.

Every function returns ``{output name: relative error}`` and raises
:class:`common.checking.CheckError` on the first mismatch.
"""

import common  # noqa: F401, I001  (first: picks GPU or simulator before numba loads)
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda

from common.checking import CheckError, check, guarded, random_array, rounding_tolerance
from final_project import kernels as K

TOL = 1e-4  # float32 kernels against float64 truth (the bar)


def _t(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _run_guarded(shape, dtype, launch: Callable[[Any], None]) -> Any:
    g = guarded(shape, dtype)
    launch(g.array)
    g.check_untouched()
    return g.array


def check_conv2d(rng, n, c_in, c_out, h, w, k=3, pad=1, *, forward=K.conv2d_forward,
                 grad_input=K.conv2d_grad_input, grad_weight=K.conv2d_grad_weight,
                 grad_bias=K.conv2d_grad_bias, tol=TOL) -> dict[str, float]:
    """Conv2d forward, grad input, grad weight, grad bias for x (n, c_in, h, w),
    w (c_out, c_in, k, k), stride 1, zero padding ``pad``."""
    x = random_array((n, c_in, h, w), np.float32, rng)
    wt = random_array((c_out, c_in, k, k), np.float32, rng)
    b = random_array(c_out, np.float32, rng)
    tx, tw, tb = _t(x, True), _t(wt, True), _t(b, True)
    ref = F.conv2d(tx, tw, tb, padding=pad)
    dout = random_array(tuple(ref.shape), np.float32, rng)
    ref.backward(_t(dout))
    dx_, w_, b_, dout_ = (cuda.to_device(a) for a in (x, wt, b, dout))
    errs = {}
    out = _run_guarded(ref.shape, np.float32, lambda o: forward(dx_, w_, b_, pad, o))
    errs["conv2d forward"] = check(out, ref.detach(), tol, "conv2d forward")
    out = _run_guarded(x.shape, np.float32, lambda o: grad_input(dout_, w_, pad, o))
    errs["conv2d grad input"] = check(out, tx.grad, tol, "conv2d grad input")
    out = _run_guarded(wt.shape, np.float32, lambda o: grad_weight(dout_, dx_, pad, o))
    errs["conv2d grad weight"] = check(out, tw.grad, tol, "conv2d grad weight")
    out = _run_guarded(b.shape, np.float32, lambda o: grad_bias(dout_, o))
    errs["conv2d grad bias"] = check(out, tb.grad, tol, "conv2d grad bias")
    return errs


def check_batchnorm(rng, n, c, h, w, eps=1e-5, momentum=0.1, *,
                    forward_train=K.batchnorm_forward_train, backward=K.batchnorm_backward,
                    forward_eval=K.batchnorm_forward_eval, tol=TOL) -> dict[str, float]:
    """Batchnorm training forward (y, running mean and unbiased running var),
    backward (dx, dgamma, dbeta) and evaluation forward, against torch's
    F.batch_norm. The input has a non-zero mean and non-unit scale per channel."""
    if n * h * w < 2:
        raise ValueError("batchnorm needs at least 2 values per channel in training")
    x = (random_array((n, c, h, w), np.float32, rng) * rng.uniform(0.5, 3, (1, c, 1, 1))
         + rng.uniform(-2, 2, (1, c, 1, 1))).astype(np.float32)
    gamma = random_array(c, np.float32, rng, 0.5, 2.0)
    beta = random_array(c, np.float32, rng)
    rm0 = random_array(c, np.float32, rng)
    rv0 = random_array(c, np.float32, rng, 0.5, 2.0)
    tx, tg, tb = _t(x, True), _t(gamma, True), _t(beta, True)
    trm, trv = _t(rm0), _t(rv0)
    ref = F.batch_norm(tx, trm, trv, tg, tb, training=True, momentum=momentum, eps=eps)
    dy = random_array(x.shape, np.float32, rng)
    ref.backward(_t(dy))

    x_, g_, b_, dy_ = (cuda.to_device(a) for a in (x, gamma, beta, dy))
    rm_, rv_ = cuda.to_device(rm0), cuda.to_device(rv0)
    mean = guarded(c, np.float32)
    invstd = guarded(c, np.float32)
    xhat = guarded(x.shape, np.float32)
    errs = {}
    y = _run_guarded(x.shape, np.float32, lambda o: forward_train(
        x_, g_, b_, eps, momentum, mean.array, invstd.array, rm_, rv_, xhat.array, o))
    for gd, name in ((mean, "mean"), (invstd, "invstd"), (xhat, "xhat")):
        gd.check_untouched(f"batchnorm {name}")
    errs["batchnorm forward"] = check(y, ref.detach(), tol, "batchnorm forward")
    errs["batchnorm running mean"] = check(rm_, trm, tol, "batchnorm running mean")
    errs["batchnorm running var"] = check(rv_, trv, tol, "batchnorm running var (unbiased)")
    dgamma = guarded(c, np.float32)
    dbeta = guarded(c, np.float32)
    dx = _run_guarded(x.shape, np.float32, lambda o: backward(
        dy_, xhat.array, g_, invstd.array, dgamma.array, dbeta.array, o))
    dgamma.check_untouched("batchnorm dgamma")
    dbeta.check_untouched("batchnorm dbeta")
    errs["batchnorm grad input"] = check(dx, tx.grad, tol, "batchnorm grad input")
    errs["batchnorm grad weight"] = check(dgamma.array, tg.grad, tol, "batchnorm grad weight")
    errs["batchnorm grad bias"] = check(dbeta.array, tb.grad, tol, "batchnorm grad bias")

    ref_eval = F.batch_norm(_t(x), _t(rm0), _t(rv0), _t(gamma), _t(beta), training=False,
                            eps=eps)
    rm_e, rv_e = cuda.to_device(rm0), cuda.to_device(rv0)
    y = _run_guarded(x.shape, np.float32,
                     lambda o: forward_eval(x_, g_, b_, rm_e, rv_e, eps, o))
    errs["batchnorm eval forward"] = check(y, ref_eval, tol, "batchnorm eval forward")
    return errs


def check_relu(rng, shape, *, forward=K.relu_forward, backward=K.relu_backward,
               tol=TOL) -> dict[str, float]:
    """ReLU forward and backward on any shape (at least one positive input, so
    the reference is not all zeros)."""
    x = random_array(shape, np.float32, rng)
    x.flat[0] = abs(x.flat[0]) + 0.1
    tx = _t(x, True)
    ref = F.relu(tx)
    dy = random_array(shape, np.float32, rng)
    ref.backward(_t(dy))
    x_, dy_ = cuda.to_device(x), cuda.to_device(dy)
    errs = {}
    out = _run_guarded(shape, np.float32, lambda o: forward(x_, o))
    errs["relu forward"] = check(out, ref.detach(), tol, "relu forward")
    out = _run_guarded(shape, np.float32, lambda o: backward(dy_, x_, o))
    errs["relu backward"] = check(out, tx.grad, tol, "relu backward")
    return errs


def check_maxpool(rng, n, c, h, w, *, forward=K.maxpool2x2_forward,
                  backward=K.maxpool2x2_backward, tol=TOL) -> dict[str, float]:
    """2x2 max-pool forward (values and argmax) and backward; odd h or w drop
    the last row or column (floor mode), whose gradient must be 0."""
    x = random_array((n, c, h, w), np.float32, rng)
    tx = _t(x, True)
    ref, idx = F.max_pool2d(tx, 2, return_indices=True)
    dy = random_array(tuple(ref.shape), np.float32, rng)
    ref.backward(_t(dy))
    x_, dy_ = cuda.to_device(x), cuda.to_device(dy)
    errs = {}
    arg = guarded(tuple(ref.shape), np.int32)
    out = _run_guarded(ref.shape, np.float32, lambda o: forward(x_, o, arg.array))
    arg.check_untouched("maxpool argmax")
    errs["maxpool forward"] = check(out, ref.detach(), tol, "maxpool forward")
    # torch's indices count within one (n, c) plane; ours index the whole tensor
    check(arg.array.copy_to_host() % (h * w), idx.numpy().astype(np.int32), name="maxpool argmax")
    out = _run_guarded(x.shape, np.float32, lambda o: backward(dy_, arg.array, o))
    errs["maxpool backward"] = check(out, tx.grad, tol, "maxpool backward")
    return errs


def check_linear(rng, n, n_in, n_out, *, forward=K.linear_forward, backward=K.linear_backward,
                 tol=TOL) -> dict[str, float]:
    """Linear forward and backward (dx, dW, db), torch layout W (out, in)."""
    x = random_array((n, n_in), np.float32, rng)
    wt = random_array((n_out, n_in), np.float32, rng)
    b = random_array(n_out, np.float32, rng)
    tx, tw, tb = _t(x, True), _t(wt, True), _t(b, True)
    ref = F.linear(tx, tw, tb)
    dy = random_array((n, n_out), np.float32, rng)
    ref.backward(_t(dy))
    x_, w_, b_, dy_ = (cuda.to_device(a) for a in (x, wt, b, dy))
    errs = {}
    out = _run_guarded((n, n_out), np.float32, lambda o: forward(x_, w_, b_, o))
    errs["linear forward"] = check(out, ref.detach(), tol, "linear forward")
    dw, db = guarded(wt.shape, np.float32), guarded(n_out, np.float32)
    dx = _run_guarded((n, n_in), np.float32,
                      lambda o: backward(dy_, x_, w_, o, dw.array, db.array))
    dw.check_untouched("linear grad weight")
    db.check_untouched("linear grad bias")
    errs["linear grad input"] = check(dx, tx.grad, tol, "linear grad input")
    errs["linear grad weight"] = check(dw.array, tw.grad, tol, "linear grad weight")
    errs["linear grad bias"] = check(db.array, tb.grad, tol, "linear grad bias")
    return errs


def softmax_grad_magnitude(logits: np.ndarray) -> np.ndarray:
    """Size of the float32 rounding in each element of (softmax - onehot) / N.

    A float32 log-sum-exp at |logit| ~ L is off by a few eps32 * L (its last
    bit), so each softmax value p is off by p times that, and the gradient by
    that over N: the magnitude L * p / N, for ``rounding_tolerance`` with 4
    roundings. ``logits``: (N, classes), any float dtype.
    """
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return (float(np.abs(z).max()) + math.log(z.shape[1])) * p / z.shape[0]


def softmax_grad_tol(logits: np.ndarray, ref_grad: torch.Tensor, tol: float = TOL) -> float:
    """Tolerance for (softmax - onehot) / N from float32 logits.

    When every row is confident, (p - onehot) is tiny and the rounding of
    :func:`softmax_grad_magnitude` alone passes 1e-4 relative (about one draw
    in eight of one row of 3 classes with logits near 30). Allow that much, and
    no more: a wrong label, a missing 1/N or a missing max-subtraction errs by
    O(1) or overflows.
    """
    return rounding_tolerance(ref_grad, softmax_grad_magnitude(logits), 4, tol)


def check_log_softmax_nll(rng, n, classes, *, forward=K.log_softmax_nll_forward,
                          backward=K.log_softmax_nll_backward, tol=TOL) -> dict[str, float]:
    """Mean cross-entropy and its gradient. Logits are scaled up (std 5) and
    shifted so a max-subtraction bug overflows or loses precision."""
    logits = (random_array((n, classes), np.float32, rng) * 5 + 30).astype(np.float32)
    labels = rng.integers(0, classes, n).astype(np.int32)
    tl = _t(logits, True)
    ref = F.cross_entropy(tl, torch.from_numpy(labels).long())
    ref.backward()
    l_, y_ = cuda.to_device(logits), cuda.to_device(labels)
    logprobs, row_loss = guarded((n, classes), np.float32), guarded(n, np.float32)
    loss = _run_guarded(1, np.float32,
                        lambda o: forward(l_, y_, logprobs.array, row_loss.array, o))
    logprobs.check_untouched("logprobs")
    row_loss.check_untouched("row loss")
    # Subtracting the row max from logits near 30 leaves an absolute float32
    # error of about eps * 30 in each row's loss; when the mean loss itself is
    # small (one confident row) that is more than `tol` relative. Allow that
    # much, and no more: a max-subtraction or indexing bug is far larger.
    loss_tol = rounding_tolerance(ref.detach(), float(np.abs(logits).max()) + np.log(classes),
                                  4, tol)
    errs = {"nll loss": check(loss, ref.detach().reshape(1), loss_tol, "nll loss")}
    errs["logprobs"] = check(logprobs.array, F.log_softmax(_t(logits), 1), tol, "logprobs")
    d = _run_guarded((n, classes), np.float32, lambda o: backward(logprobs.array, y_, o))
    errs["nll grad logits"] = check(d, tl.grad, softmax_grad_tol(logits, tl.grad, tol),
                                    "nll grad logits")
    return errs


def check_sgd(rng, size, lr=0.1, *, update=K.sgd_update, tol=1e-6) -> dict[str, float]:
    """p -= lr * g in place over a 1-D buffer of ``size``."""
    p = random_array(size, np.float32, rng)
    g = random_array(size, np.float32, rng)
    g_buf = guarded(size, np.float32)
    g_buf.array.copy_to_device(p)
    update(g_buf.array, cuda.to_device(g), lr)
    g_buf.check_untouched("sgd params")
    p64, step = p.astype(np.float64), lr * g.astype(np.float64)
    ref = p64 - step
    # float32 rounds lr * g and the difference: up to 2 eps32 (|p| + |lr g|) an
    # element, which is more than `tol` relative where p and lr * g nearly cancel
    # (a one-element buffer: about one draw in a few hundred). Allow that, no more:
    # a wrong sign or a missing lr is off by O(1).
    sgd_tol = rounding_tolerance(ref, np.abs(p64) + np.abs(step), 2, tol)
    return {"sgd": check(g_buf.array, ref, sgd_tol, "sgd")}


# ---------------------------------------------------------------------------
# The whole network against its torch twin
# ---------------------------------------------------------------------------


# How far below its window's float64 maximum a max-pool's chosen value may be:
# float32 rounding of a batchnorm output of size ~5 (a few eps32 * 5 ~ 1e-6), with
# room; a wrong choice (not the maximum) is off by O(0.1) or more.
POOL_TIE_TOL = 1e-5


def random_batch(config, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Images with a per-image contrast and labels covering the classes."""
    x = random_array((n, config.in_channels, config.height, config.width), np.float32, rng)
    y = rng.integers(0, config.num_classes, n).astype(np.int32)
    return x, y


def check_train_step(config, n: int, rng, lr: float = 0.1, seed: int = 0,
                     tol: float = TOL, model_cls=None) -> dict[str, float]:
    """One NumbaCNN training step against the float64 torch twin from the same
    initial parameters on the same batch: the loss, every gradient, every
    parameter after the update and the running statistics.

    The conv biases' gradients are checked by size instead: batchnorm removes any
    per-channel constant, so their true gradient is 0 and float32 leaves only
    rounding noise; it must stay below ``tol`` times the weight gradient's norm.
    ``model_cls``: NumbaCNN (default) or FastCNN, built as model_cls(config,
    max_batch, params=...).
    """
    from final_project.model import BUFFER_NAMES, PARAM_NAMES, NumbaCNN, init_params
    from final_project.torch_twin import TorchCNN

    state = init_params(config, seed)
    x, y = random_batch(config, n, rng)
    model = (model_cls or NumbaCNN)(config, max_batch=n + 1, params=state)
    x_, y_ = cuda.to_device(x), cuda.to_device(y)
    model.loss_and_grads(x_, y_)
    grads = model.grads.download()
    windows = model.pool_windows(n)
    model.load_state_dict(state)  # undo the running-stat update, then a real step
    model.train_step(x_, y_, lr)
    after = model.state_dict()

    twin = TorchCNN.from_state_dict(config, state, dtype=torch.float64)
    twin.train()
    # The twin takes each max-pool window's element where the model took it: a
    # near-tie (two values within float32 rounding, a few per full-size batch)
    # would otherwise send one pixel's gradient elsewhere and move a batch-wide sum
    # by ~1e-3. Each choice must be a maximum up to float32 rounding.
    loss = F.cross_entropy(twin(_t(x), pool_windows=windows), torch.from_numpy(y).long())
    loss.backward()
    errs = {}
    for k, gap in enumerate(twin.pool_gaps, 1):
        worst = float(gap.max())
        if worst > POOL_TIE_TOL:
            raise CheckError(f"pool{k}: a window's taken value is {worst:.3g} below its "
                             "maximum (the max-pool picks a wrong element)")
        errs[f"pool{k} taken value below window max"] = worst
    errs["loss"] = check(model.loss, loss.detach().reshape(1), tol, "loss")
    tparams = dict(twin.named_parameters())
    for name in PARAM_NAMES:
        ref = tparams[name].grad
        if name in ("conv1.bias", "conv2.bias"):
            w_norm = float(np.linalg.norm(grads[name.replace("bias", "weight")]))
            noise = float(np.linalg.norm(grads[name]))
            if not np.isfinite(noise) or noise > tol * w_norm:
                raise CheckError(f"grad {name}: norm {noise:.3g}, expected ~0 (batchnorm follows)")
            errs[f"grad {name} (norm / weight grad norm)"] = noise / max(w_norm, 1e-30)
            continue
        errs[f"grad {name}"] = check(grads[name], ref, tol, f"grad {name}")
    with torch.no_grad():
        for p in twin.parameters():
            p -= lr * p.grad
    tstate = twin.state_dict()
    for name in (*PARAM_NAMES, *BUFFER_NAMES):
        errs[f"after step {name}"] = check(after[name], tstate[name], tol, f"after step {name}")
    return errs


def check_eval_forward(config, n: int, rng, seed: int = 0, train_steps: int = 1,
                       tol: float = TOL, model_cls=None) -> dict[str, float]:
    """Evaluation-mode logits of NumbaCNN (after ``train_steps`` steps, so the
    running statistics are not the initial 0 and 1) against the twin in eval mode."""
    from final_project.model import NumbaCNN
    from final_project.torch_twin import TorchCNN

    model = (model_cls or NumbaCNN)(config, max_batch=n, seed=seed)
    for _ in range(train_steps):
        xt, yt = random_batch(config, n, rng)
        model.train_step(cuda.to_device(xt), cuda.to_device(yt), 0.1)
    x, _ = random_batch(config, n, rng)
    twin = TorchCNN.from_state_dict(config, model.state_dict(), dtype=torch.float64).eval()
    with torch.no_grad():
        ref = twin(_t(x))
    before = model.state_dict()
    logits = model.forward(cuda.to_device(x), training=False)
    errs = {"eval logits": check(logits, ref, tol, "eval logits")}
    after = model.state_dict()
    for k in before:
        if not np.array_equal(before[k], after[k]):
            raise CheckError(f"eval forward changed {k}")
    preds = model.predict(cuda.to_device(x))
    check(preds, ref.argmax(1).numpy().astype(np.int32), name="predict")
    return errs
