"""Checks of every capstone kernel, and of a whole training step, against the
NumPy float64 reference (:mod:`final_project.reference`).

Shared by the simulator tests (tiny hostile shapes), ``python -m
final_project.check_gpu`` (full sizes on a GPU) and ``python -m
final_project.train --check`` (a step now and then during training), so none
can drift from the others. Each ``check_<layer>`` draws fresh random float32
inputs, computes the float64 truth with reference.py's function for that layer
(forward, then backward with a random upstream gradient), runs our kernels
into poisoned, guarded outputs (NaN everywhere, with a poisoned margin that
must stay untouched), and compares with :func:`common.checking.check`. The
launchers are parameters, so a test can hand in a deliberately broken kernel
and see the check fail. reference.py itself is checked against
``torch.autograd`` by the tests (``test_reference_*``); torch is not a ground
truth here.

Every function returns ``{output name: relative error}`` and raises
:class:`common.checking.CheckError` on the first mismatch.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

from final_project import kernels
from final_project import reference as ref

# Relative error ||out - ref|| / ||ref|| allowed between a float32 kernel (or a
# whole float32 training step) and the float64 reference; see check_train_step.
TOL = 1e-4


def _f64(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


def _run_guarded(shape, dtype, launch: Callable[[Any], None]) -> Any:
    g = guarded(shape, dtype)
    launch(g.array)
    g.check_untouched()
    return g.array


def check_conv2d(
    rng,
    n,
    c_in,
    c_out,
    h,
    w,
    k=3,
    pad=1,
    *,
    forward=kernels.conv2d_forward,
    grad_input=kernels.conv2d_grad_input,
    grad_weight=kernels.conv2d_grad_weight,
    grad_bias=kernels.conv2d_grad_bias,
    tol=TOL,
) -> dict[str, float]:
    """Conv2d forward, grad input, grad weight, grad bias for x (n, c_in, h, w),
    w (c_out, c_in, k, k), stride 1, zero padding ``pad``."""
    x = random_array((n, c_in, h, w), np.float32, rng)
    wt = random_array((c_out, c_in, k, k), np.float32, rng)
    b = random_array(c_out, np.float32, rng)
    want, cache = ref.conv2d_forward(*_f64(x, wt, b), pad)
    dout = random_array(want.shape, np.float32, rng)
    want_dx, want_dw, want_db = ref.conv2d_backward(*_f64(dout), cache)
    x_, w_, b_, dout_ = (cuda.to_device(a) for a in (x, wt, b, dout))
    errs = {}
    out = _run_guarded(want.shape, np.float32, lambda o: forward(x_, w_, b_, pad, o))
    errs["conv2d forward"] = check(out, want, tol, "conv2d forward")
    out = _run_guarded(x.shape, np.float32, lambda o: grad_input(dout_, w_, pad, o))
    errs["conv2d grad input"] = check(out, want_dx, tol, "conv2d grad input")
    out = _run_guarded(wt.shape, np.float32, lambda o: grad_weight(dout_, x_, pad, o))
    errs["conv2d grad weight"] = check(out, want_dw, tol, "conv2d grad weight")
    out = _run_guarded(b.shape, np.float32, lambda o: grad_bias(dout_, o))
    errs["conv2d grad bias"] = check(out, want_db, tol, "conv2d grad bias")
    return errs


def check_batchnorm(
    rng,
    n,
    c,
    h,
    w,
    eps=1e-5,
    momentum=0.1,
    *,
    forward_train=kernels.batchnorm_forward_train,
    backward=kernels.batchnorm_backward,
    forward_eval=kernels.batchnorm_forward_eval,
    tol=TOL,
) -> dict[str, float]:
    """Batchnorm training forward (y, running mean and unbiased running var),
    backward (dx, dgamma, dbeta) and evaluation forward. The input has a
    non-zero mean and non-unit scale per channel."""
    if n * h * w < 2:
        raise ValueError("batchnorm needs at least 2 values per channel in training")
    x = (
        random_array((n, c, h, w), np.float32, rng) * rng.uniform(0.5, 3, (1, c, 1, 1))
        + rng.uniform(-2, 2, (1, c, 1, 1))
    ).astype(np.float32)
    gamma = random_array(c, np.float32, rng, 0.5, 2.0)
    beta = random_array(c, np.float32, rng)
    rm0 = random_array(c, np.float32, rng)
    rv0 = random_array(c, np.float32, rng, 0.5, 2.0)
    want, cache, want_rm, want_rv = ref.batchnorm_forward_train(
        *_f64(x, gamma, beta, rm0, rv0), eps, momentum
    )
    dy = random_array(x.shape, np.float32, rng)
    want_dx, want_dgamma, want_dbeta = ref.batchnorm_backward(*_f64(dy), cache)

    x_, g_, b_, dy_ = (cuda.to_device(a) for a in (x, gamma, beta, dy))
    rm_, rv_ = cuda.to_device(rm0), cuda.to_device(rv0)
    mean = guarded(c, np.float32)
    invstd = guarded(c, np.float32)
    xhat = guarded(x.shape, np.float32)
    errs = {}
    y = _run_guarded(
        x.shape,
        np.float32,
        lambda o: forward_train(
            x_, g_, b_, eps, momentum, mean.array, invstd.array, rm_, rv_, xhat.array, o
        ),
    )
    for gd, name in ((mean, "mean"), (invstd, "invstd"), (xhat, "xhat")):
        gd.check_untouched(f"batchnorm {name}")
    errs["batchnorm forward"] = check(y, want, tol, "batchnorm forward")
    errs["batchnorm running mean"] = check(rm_, want_rm, tol, "batchnorm running mean")
    errs["batchnorm running var"] = check(rv_, want_rv, tol, "batchnorm running var (unbiased)")
    dgamma = guarded(c, np.float32)
    dbeta = guarded(c, np.float32)
    dx = _run_guarded(
        x.shape,
        np.float32,
        lambda o: backward(dy_, xhat.array, g_, invstd.array, dgamma.array, dbeta.array, o),
    )
    dgamma.check_untouched("batchnorm dgamma")
    dbeta.check_untouched("batchnorm dbeta")
    errs["batchnorm grad input"] = check(dx, want_dx, tol, "batchnorm grad input")
    errs["batchnorm grad weight"] = check(dgamma.array, want_dgamma, tol, "batchnorm grad weight")
    errs["batchnorm grad bias"] = check(dbeta.array, want_dbeta, tol, "batchnorm grad bias")

    want_eval = ref.batchnorm_forward_eval(*_f64(x, gamma, beta, rm0, rv0), eps)
    rm_e, rv_e = cuda.to_device(rm0), cuda.to_device(rv0)
    y = _run_guarded(x.shape, np.float32, lambda o: forward_eval(x_, g_, b_, rm_e, rv_e, eps, o))
    errs["batchnorm eval forward"] = check(y, want_eval, tol, "batchnorm eval forward")
    return errs


def check_relu(
    rng, shape, *, forward=kernels.relu_forward, backward=kernels.relu_backward, tol=TOL
) -> dict[str, float]:
    """ReLU forward and backward on any shape (at least one positive input, so
    the reference is not all zeros)."""
    x = random_array(shape, np.float32, rng)
    x.flat[0] = abs(x.flat[0]) + 0.1
    want, cache = ref.relu_forward(*_f64(x))
    dy = random_array(shape, np.float32, rng)
    want_dx = ref.relu_backward(*_f64(dy), cache)
    x_, dy_ = cuda.to_device(x), cuda.to_device(dy)
    errs = {}
    out = _run_guarded(shape, np.float32, lambda o: forward(x_, o))
    errs["relu forward"] = check(out, want, tol, "relu forward")
    out = _run_guarded(shape, np.float32, lambda o: backward(dy_, x_, o))
    errs["relu backward"] = check(out, want_dx, tol, "relu backward")
    return errs


def check_maxpool(
    rng,
    n,
    c,
    h,
    w,
    *,
    forward=kernels.maxpool2x2_forward,
    backward=kernels.maxpool2x2_backward,
    tol=TOL,
) -> dict[str, float]:
    """2x2 max-pool forward (values and argmax) and backward; odd h or w drop
    the last row or column (floor mode), whose gradient must be 0."""
    x = random_array((n, c, h, w), np.float32, rng)
    want, cache = ref.maxpool2x2_forward(*_f64(x))
    dy = random_array(want.shape, np.float32, rng)
    want_dx = ref.maxpool2x2_backward(*_f64(dy), cache)
    x_, dy_ = cuda.to_device(x), cuda.to_device(dy)
    errs = {}
    arg = guarded(want.shape, np.int32)
    out = _run_guarded(want.shape, np.float32, lambda o: forward(x_, o, arg.array))
    arg.check_untouched("maxpool argmax")
    errs["maxpool forward"] = check(out, want, tol, "maxpool forward")
    # The reference keeps each window's position 0..3; the kernel, the flat index into x.
    window = cache[1]
    ni, ci, oh, ow = np.indices(window.shape)
    want_arg = ((ni * c + ci) * h + 2 * oh + window // 2) * w + 2 * ow + window % 2
    check(arg.array, want_arg.astype(np.int32), name="maxpool argmax")
    out = _run_guarded(x.shape, np.float32, lambda o: backward(dy_, arg.array, o))
    errs["maxpool backward"] = check(out, want_dx, tol, "maxpool backward")
    return errs


def check_linear(
    rng,
    n,
    n_in,
    n_out,
    *,
    forward=kernels.linear_forward,
    backward=kernels.linear_backward,
    tol=TOL,
) -> dict[str, float]:
    """Linear forward and backward (dx, dW, db), torch layout W (out, in)."""
    x = random_array((n, n_in), np.float32, rng)
    wt = random_array((n_out, n_in), np.float32, rng)
    b = random_array(n_out, np.float32, rng)
    want, cache = ref.linear_forward(*_f64(x, wt, b))
    dy = random_array((n, n_out), np.float32, rng)
    want_dx, want_dw, want_db = ref.linear_backward(*_f64(dy), cache)
    x_, w_, b_, dy_ = (cuda.to_device(a) for a in (x, wt, b, dy))
    errs = {}
    out = _run_guarded((n, n_out), np.float32, lambda o: forward(x_, w_, b_, o))
    errs["linear forward"] = check(out, want, tol, "linear forward")
    dw, db = guarded(wt.shape, np.float32), guarded(n_out, np.float32)
    dx = _run_guarded((n, n_in), np.float32, lambda o: backward(dy_, x_, w_, o, dw.array, db.array))
    dw.check_untouched("linear grad weight")
    db.check_untouched("linear grad bias")
    errs["linear grad input"] = check(dx, want_dx, tol, "linear grad input")
    errs["linear grad weight"] = check(dw.array, want_dw, tol, "linear grad weight")
    errs["linear grad bias"] = check(db.array, want_db, tol, "linear grad bias")
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


def softmax_grad_tol(logits: np.ndarray, ref_grad: Any, tol: float = TOL) -> float:
    """Tolerance for (softmax - onehot) / N from float32 logits.

    When every row is confident, (p - onehot) is tiny and the rounding of
    :func:`softmax_grad_magnitude` alone passes 1e-4 relative (about one draw
    in eight of one row of 3 classes with logits near 30). Allow that much, and
    no more: a wrong label, a missing 1/N or a missing max-subtraction errs by
    O(1) or overflows.
    """
    return rounding_tolerance(ref_grad, softmax_grad_magnitude(logits), 4, tol)


def check_log_softmax_nll(
    rng,
    n,
    classes,
    *,
    forward=kernels.log_softmax_nll_forward,
    backward=kernels.log_softmax_nll_backward,
    tol=TOL,
) -> dict[str, float]:
    """Mean cross-entropy and its gradient. Logits are scaled up (std 5) and
    shifted so a max-subtraction bug overflows or loses precision."""
    logits = (random_array((n, classes), np.float32, rng) * 5 + 30).astype(np.float32)
    labels = rng.integers(0, classes, n).astype(np.int32)
    want_loss, cache = ref.log_softmax_nll_forward(*_f64(logits), labels)
    want_logprobs = cache[0]
    want_grad = ref.log_softmax_nll_backward(cache)
    logits_, labels_ = cuda.to_device(logits), cuda.to_device(labels)
    logprobs, row_loss = guarded((n, classes), np.float32), guarded(n, np.float32)
    loss = _run_guarded(
        1, np.float32, lambda o: forward(logits_, labels_, logprobs.array, row_loss.array, o)
    )
    logprobs.check_untouched("logprobs")
    row_loss.check_untouched("row loss")
    # Subtracting the row max from logits near 30 leaves an absolute float32
    # error of about eps * 30 in each row's loss; when the mean loss itself is
    # small (one confident row) that is more than `tol` relative. Allow that
    # much, and no more: a max-subtraction or indexing bug is far larger.
    want_loss = np.array([want_loss])
    loss_tol = rounding_tolerance(want_loss, float(np.abs(logits).max()) + np.log(classes), 4, tol)
    errs = {"nll loss": check(loss, want_loss, loss_tol, "nll loss")}
    errs["logprobs"] = check(logprobs.array, want_logprobs, tol, "logprobs")
    d = _run_guarded((n, classes), np.float32, lambda o: backward(logprobs.array, labels_, o))
    errs["nll grad logits"] = check(
        d, want_grad, softmax_grad_tol(logits, want_grad, tol), "nll grad logits"
    )
    return errs


def check_sgd(rng, size, lr=0.1, *, update=kernels.sgd_update, tol=1e-6) -> dict[str, float]:
    """p -= lr * g in place over a 1-D buffer of ``size``."""
    p = random_array(size, np.float32, rng)
    g = random_array(size, np.float32, rng)
    g_buf = guarded(size, np.float32)
    g_buf.array.copy_to_device(p)
    update(g_buf.array, cuda.to_device(g), lr)
    g_buf.check_untouched("sgd params")
    p64, step = p.astype(np.float64), lr * g.astype(np.float64)
    want = p64 - step
    # float32 rounds lr * g and the difference: up to 2 eps32 (|p| + |lr g|) an
    # element, which is more than `tol` relative where p and lr * g nearly cancel
    # (a one-element buffer: about one draw in a few hundred). Allow that, no more:
    # a wrong sign or a missing lr is off by O(1).
    sgd_tol = rounding_tolerance(want, np.abs(p64) + np.abs(step), 2, tol)
    return {"sgd": check(g_buf.array, want, sgd_tol, "sgd")}


# ---------------------------------------------------------------------------
# The whole network against the reference
# ---------------------------------------------------------------------------


# How far below its window's float64 maximum a max-pool's chosen value may be:
# float32 rounding of a batchnorm output of size ~5 (a few eps32 * 5 ~ 1e-6), with
# room; a wrong choice (not the maximum) is off by O(0.1) or more.
POOL_TIE_TOL = 1e-5
# How far from 0 a ReLU input may be where the model's on/off decision differs
# from the float64 sign: fc1's inputs are sums of 3,136 float32 terms of size ~1,
# off by about sqrt(K) eps32 ~ 7e-6 (the batchnorm outputs before the other two
# ReLUs are held to POOL_TIE_TOL); a wrong decision is off by O(0.1).
RELU_TIE_TOL = 1e-4


def tf32_step_tolerance(tol: float) -> float:
    """The tolerance of a step with TF32 operations, against the reference's TF32
    model (``reference_forward``'s ``tf32=``), from the FP32 tolerance ``tol``.

    The model truncates the float64 operands, the kernels the float32 ones. Where
    the FP32 layers before have left an operand off by a relative d (at most
    ``tol``), it lies across a TF32 step (2^-10 = u relative) from its float64
    twin with probability about d / u, and is then read one step, u, apart. So
    the TF32 operands differ from the model's by a root-mean-square sqrt(d u)
    relative, at most sqrt(tol u): 3.1e-4 for tol = 1e-4, where a wrong kernel
    still errs by 1e-2 or more. (Measured on an H100: 2e-5 to 1e-4 at batches
    1 to 256; the README's TF32 section has the table.)
    """
    return max(tol, math.sqrt(tol * ref.TF32_UNIT))


def random_batch(config, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 images (n, C, H, W) and int32 labels (n,) for ``config``."""
    x = random_array((n, config.in_channels, config.height, config.width), np.float32, rng)
    y = rng.integers(0, config.num_classes, n).astype(np.int32)
    return x, y


def _check_or_exact_zero(out: np.ndarray, want: np.ndarray, tol: float, name: str) -> float:
    """``check(out, want, tol, name)``, or, where ``want`` is exactly zero in
    float64, that ``out`` is exactly zero too. That happens when every unit
    behind a layer is closed (a batch of one whose hidden ReLUs are all off:
    about one draw in 256 with 8 units), and then for a zero-initialised bias
    after the step; the kernels multiply by those exact zeros, so they give
    exact zeros, and a relative error would have no meaning."""
    if np.any(want):
        return check(out, want, tol, name)
    nonzero = int(np.count_nonzero(out))
    if nonzero:
        raise CheckError(
            f"{name}: {nonzero} non-zero elements where the float64 reference is exactly "
            "zero (every unit behind this layer is closed)"
        )
    return 0.0


def check_train_step(
    model, x: np.ndarray, y: np.ndarray, lr: float, tol: float = TOL
) -> dict[str, float]:
    """Take one training step of ``model`` on the batch (x, y) and check it
    against the float64 reference from the model's state before the step.

    The one check of a training step: the tests, ``check_gpu`` and ``train
    --check`` all call it. ``model``: a NumbaCNN or FastCNN (anything with
    ``train_step``, ``state_dict``, ``grads``, ``loss``, ``pool_windows``);
    x float32 (N, C, H, W) and y int32 (N,) host arrays, N <= model.max_batch.
    The model is left after the step, as a plain ``train_step`` leaves it.

    Checked, each as relative error ||ours - ref|| / ||ref|| <= ``tol``: the
    loss, every parameter's gradient, every parameter after the SGD update and
    the running statistics. The tolerance, TOL = 1e-4: a float32 sum of K
    terms errs by about sqrt(K) eps32 (eps32 = 1.2e-7) relative, and the
    longest sums of the full network (fc1's 3,136 inputs, conv2's weight
    gradient over 200,704 pixels, summed in float64 or in float32 chunks) land
    more than an order of magnitude below it at batch 1024 (``check_gpu``; the
    README's "Checks at full size" gives the figure), which leaves room for other
    seeds and data. A wrong kernel (a missing term or mask, a wrong
    index, sign or 1/N) errs by 1e-2 to O(1) at the tests' small sizes.

    A model that runs some operations in TF32 (its ``tf32_ops``: FastCNN with
    precision "tf32") is checked against the reference with those operations'
    operands rounded as the tensor cores round them (``reference_forward``'s
    ``tf32=``), at :func:`tf32_step_tolerance` (``tol``) and, for the max-pool
    after conv2, a tie rule widened by what one TF32 step of an operand moves
    conv2's output; how far TF32 moves training from FP32 is the accuracy run's
    to measure, not this check's.

    Two things a relative error cannot judge get their own rules:

    * the conv biases: batchnorm follows each convolution and removes any
      per-channel constant, so their true gradient is 0 and float32 leaves
      only rounding noise; its norm must stay below ``tol`` times the norm of
      the same layer's weight gradient;
    * max-pool near-ties: the reference takes each 2x2 window's element where
      the model took it (``model.pool_windows``), and each such element must be
      within POOL_TIE_TOL of its window's float64 maximum;
    * ReLU near-ties (models with ``relu_open``: FastCNN): where the model's ReLU
      was on and the float64 input is not positive, or the other way round, the
      reference follows the model, and that input must be within POOL_TIE_TOL
      (the batchnorm ReLUs) or RELU_TIE_TOL (fc1's) of 0. Without this a
      float32 input within rounding of 0 moves a whole unit's gradient.

    Returns:
        name -> relative error (or the measure each rule checks).

    Raises:
        CheckError: a non-finite loss, or the first quantity above its
            tolerance, named.
    """
    config = model.config
    before = model.state_dict()
    n = len(y)
    model.train_step(
        cuda.to_device(np.ascontiguousarray(x)), cuda.to_device(np.ascontiguousarray(y)), lr
    )
    cuda.synchronize()
    loss = float(model.loss.copy_to_host()[0])
    grads = model.grads.download()
    windows = model.pool_windows(n)
    after = model.state_dict()

    tf32 = tuple(getattr(model, "tf32_ops", ()))
    relu_open = model.relu_open(n) if hasattr(model, "relu_open") else None
    logits, caches, want_buffers = ref.reference_forward(
        before,
        x,
        config,
        training=True,
        pool_windows=windows,
        tf32=tf32,
        relu_open=relu_open,
    )
    want_loss, want_grads = ref.reference_backward(logits, caches, y)
    if not math.isfinite(loss):
        raise CheckError(f"the loss is {loss} (the float64 reference's: {want_loss:.6g})")
    pool_tols = [POOL_TIE_TOL, POOL_TIE_TOL]
    if tf32:
        tol = tf32_step_tolerance(tol)
    if "conv2 forward" in tf32:
        # an operand read one TF32 step from the model's (tf32_step_tolerance)
        # moves a conv2 output by up to u |x| |w|; room for two such in each of
        # the two values a tie compares
        x2, w2, _ = caches["conv2"]
        pool_tols[1] += 4 * ref.TF32_UNIT * float(np.abs(x2).max() * np.abs(w2).max())
    # ReLU near-ties (models with relu_open): the units after conv2 move as its
    # outputs do; fc1's sum of many such inputs, up to four of them moved
    relu_tols = [POOL_TIE_TOL, pool_tols[1], RELU_TIE_TOL]
    if "conv2 forward" in tf32:
        relu_tols[2] += 4 * float(np.abs(before["fc1.weight"]).max()) * pool_tols[1]
    errs = {}
    for name, gap, limit in zip(("bn1", "bn2", "fc1"), caches["relu_gaps"], relu_tols):
        if gap > limit:
            raise CheckError(
                f"{name} ReLU: a unit the model switched on or off against the "
                f"float64 sign has input {gap:.3g}, beyond the {limit:.3g} rounding "
                "allows (a wrong ReLU or a wrong input)"
            )
        errs[f"{name} ReLU decision against float64 (input at a tie)"] = gap
    for k, gap in enumerate(caches["pool_gaps"], 1):
        worst = float(gap.max())
        if worst > pool_tols[k - 1]:
            raise CheckError(
                f"pool{k}: a window's taken value is {worst:.3g} below its "
                "maximum (the max-pool picks a wrong element)"
            )
        errs[f"pool{k} taken value below window max"] = worst
    errs["loss"] = check(np.array([loss]), np.array([want_loss]), tol, "loss")
    for name, want in want_grads.items():
        if name in ("conv1.bias", "conv2.bias"):
            w_norm = float(np.linalg.norm(grads[name.replace("bias", "weight")]))
            noise = float(np.linalg.norm(grads[name]))
            if not np.isfinite(noise) or noise > tol * w_norm:
                raise CheckError(
                    f"grad {name}: norm {noise:.3g}, expected ~0 (batchnorm "
                    f"follows), at most {tol:g} x the weight gradient's "
                    f"{w_norm:.3g}"
                )
            errs[f"grad {name} (norm / weight grad norm)"] = noise / max(w_norm, 1e-30)
            continue
        errs[f"grad {name}"] = _check_or_exact_zero(grads[name], want, tol, f"grad {name}")
    for name, want in want_grads.items():
        want_after = before[name].astype(np.float64) - lr * want
        errs[f"after step {name}"] = _check_or_exact_zero(
            after[name], want_after, tol, f"after step {name}"
        )
    for name, want in want_buffers.items():
        errs[f"after step {name}"] = check(after[name], want, tol, f"after step {name}")
    return errs


def check_eval_forward(
    config, n: int, rng, seed: int = 0, train_steps: int = 1, tol: float = TOL, model_cls=None
) -> dict[str, float]:
    """Evaluation-mode logits of NumbaCNN (or ``model_cls``, built as
    model_cls(config, max_batch=n, seed=seed)) after ``train_steps`` steps, so
    the running statistics are not the initial 0 and 1, against the reference
    in evaluation mode; the forward pass must change no state, and ``predict``
    must give the reference's classes."""
    from final_project.model import NumbaCNN

    model = (model_cls or NumbaCNN)(config, max_batch=n, seed=seed)
    for _ in range(train_steps):
        xt, yt = random_batch(config, n, rng)
        model.train_step(cuda.to_device(xt), cuda.to_device(yt), 0.1)
    x, _ = random_batch(config, n, rng)
    before = model.state_dict()
    want, _, _ = ref.reference_forward(
        before, x, config, training=False, tf32=getattr(model, "tf32_ops", ())
    )
    logits = model.forward(cuda.to_device(x), training=False)
    errs = {"eval logits": check(logits, want, tol, "eval logits")}
    after = model.state_dict()
    for k in before:
        if not np.array_equal(before[k], after[k]):
            raise CheckError(f"eval forward changed {k}")
    preds = model.predict(cuda.to_device(x))
    check(preds, want.argmax(1).astype(np.int32), name="predict")
    return errs
