"""Chapter 10 solutions. Same functions as exercises.py, done; the tests check both.

exercises.py takes from this file everything that is not an exercise (the
helpers, the kernels and launchers it is given, the argument checks, the fake
implementations), so what a learner writes is all that differs between the two.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling

import math
from pathlib import Path

import numpy as np
import torch
from numba import cuda

bridge = import_sibling(__file__, "bridge")
ops = import_sibling(__file__, "ops")
# ops.py's helpers: kernels built once per dtype, the dtype check, views of inputs
DTYPES, THREADS = ops.DTYPES, ops.THREADS
kernel_for, check_floating, view = ops.kernel_for, ops.check_floating, ops.view

# torch keeps one table of operator names for the whole process, and the tests
# load this file and exercises.py side by side: naming the namespace after the
# file ("course10_solutions", "course10_exercises") keeps their operators apart.
NAMESPACE = f"course10_{Path(__file__).stem}"


def launch_elementwise(kernel, *tensors: torch.Tensor, scalar: float | None = None) -> None:
    """One thread an element: ``kernel(*flat views, [scalar])`` over the last
    tensor's elements, on torch's stream. The scalar goes in the tensors' dtype,
    so a float32 kernel never computes in float64."""
    out = tensors[-1]
    if out.numel() == 0:
        return
    views = [view(t, f"arg{i}", flat=True) for i, t in enumerate(tensors)]
    if scalar is not None:
        views.insert(len(views) - 1, DTYPES[out.dtype](scalar))
    kernel[ceil_div(out.numel(), THREADS), THREADS, bridge.torch_stream()](*views)


# ---------------------------------------------------------------- Exercise 10.1


def make_scaled_tanh_forward(np_dtype):
    """y[i] = a * tanh(x[i]), a thread an element."""

    @cuda.jit(cache=True)
    def scaled_tanh_forward(x, a, y):
        i = cuda.grid(1)
        if i < y.size:
            y[i] = a * math.tanh(x[i])

    return scaled_tanh_forward


def launch_scaled_tanh(x: torch.Tensor, a: float) -> torch.Tensor:
    """y = a * tanh(x) by make_scaled_tanh_forward's kernel; x of any shape,
    float32 or float64 (TypeError otherwise); y has x's shape and dtype."""
    check_floating(x, "x")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_elementwise(kernel_for(make_scaled_tanh_forward, x.dtype), x, y, scalar=a)
    return y


@torch.library.custom_op(f"{NAMESPACE}::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, a: float) -> torch.Tensor:
    """y = a * tanh(x), x of any shape, float32 or float64; y has x's shape and dtype."""
    return launch_scaled_tanh(x, a)


@scaled_tanh.register_fake
def scaled_tanh_fake(x, a):
    check_floating(x, "x")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def make_scaled_tanh_backward(np_dtype):
    """The kernel scaled_tanh_backward launches, a thread an element:
    dx[i] = dy[i] * a * (1 - tanh(x[i])**2)."""
    one = np_dtype(1.0)

    @cuda.jit(cache=True)
    def scaled_tanh_backward_kernel(dy, x, a, dx):
        i = cuda.grid(1)
        if i < dx.size:
            t = math.tanh(x[i])
            dx[i] = dy[i] * a * (one - t * t)

    return scaled_tanh_backward_kernel


@torch.library.custom_op(f"{NAMESPACE}::scaled_tanh_backward", mutates_args=())
def scaled_tanh_backward(dy: torch.Tensor, x: torch.Tensor, a: float) -> torch.Tensor:
    """Exercise 10.1: dx = dy * a * (1 - tanh(x)**2), the gradient of y = a * tanh(x).

    dy, x: one shape, one dtype (float32 or float64); returns dx of that shape
    and dtype, computed by make_scaled_tanh_backward's kernel (launched with
    launch_elementwise). TypeError for another dtype or dy and x of different
    dtypes, ValueError for different shapes.
    """
    check_floating(x, "x")
    if dy.dtype != x.dtype:
        raise TypeError(f"dy has dtype {dy.dtype}, x {x.dtype}: they must match")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)}, x {tuple(x.shape)}: they must match")
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_elementwise(kernel_for(make_scaled_tanh_backward, x.dtype), dy, x, dx, scalar=a)
    return dx


@scaled_tanh_backward.register_fake
def scaled_tanh_backward_fake(dy, x, a):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def scaled_tanh_setup_context(ctx, inputs, output):
    x, a = inputs
    ctx.save_for_backward(x)
    ctx.a = a  # a float, not a tensor: an attribute of ctx


def scaled_tanh_grad(ctx, dy):
    """Exercise 10.1 (the autograd formula): (dx, None) for the inputs (x, a) of
    scaled_tanh; a is a float, so its gradient is None."""
    (x,) = ctx.saved_tensors
    return scaled_tanh_backward(dy.contiguous(), x, ctx.a), None


scaled_tanh.register_autograd(scaled_tanh_grad, setup_context=scaled_tanh_setup_context)


# ---------------------------------------------------------------- Exercise 10.2


def make_row_sums(np_dtype):
    """out[r] = sum of x[r, :], a thread a row."""
    zero = np_dtype(0.0)

    @cuda.jit(cache=True)
    def row_sums_kernel(x, out):
        r = cuda.grid(1)
        if r < out.shape[0]:
            acc = zero
            for c in range(x.shape[1]):
                acc += x[r, c]
            out[r] = acc

    return row_sums_kernel


def check_row_sums_args(x: torch.Tensor) -> None:
    """x (M, N) float32 or float64; TypeError/ValueError otherwise."""
    check_floating(x, "x")
    if x.dim() != 2:
        raise ValueError(f"row_sums needs x (M, N), got shape {tuple(x.shape)}")


def launch_row_sums(x: torch.Tensor) -> torch.Tensor:
    """out (M,) = x (M, N) summed along rows by make_row_sums's kernel; float32 or
    float64, out in x's dtype. TypeError/ValueError as check_row_sums_args."""
    check_row_sums_args(x)
    m = x.shape[0]
    out = torch.empty(m, dtype=x.dtype, device=x.device)
    if m:
        kernel = kernel_for(make_row_sums, x.dtype)
        kernel[ceil_div(m, THREADS), THREADS, bridge.torch_stream()](
            view(x, "x"), bridge.numba_view(out, "out")
        )
    return out


@torch.library.custom_op(f"{NAMESPACE}::row_sums", mutates_args=())
def row_sums(x: torch.Tensor) -> torch.Tensor:
    """out (M,) = x (M, N) summed along rows; float32 or float64, out in x's dtype."""
    return launch_row_sums(x)


@row_sums.register_fake
def row_sums_fake(x):
    """Exercise 10.2: what row_sums returns, without computing it.

    x: a tensor (M, N) with no data (a FakeTensor or on the "meta" device).
    Returns an empty tensor of row_sums's output shape (M,), dtype and device
    (x's device: "meta" for a meta x, never the default device); raises the
    same TypeError/ValueError as row_sums for a bad x.
    """
    check_row_sums_args(x)
    return x.new_empty(x.shape[0])


# ---------------------------------------------------------------- Exercise 10.3


def make_softsign(np_dtype):
    """y[i] = x[i] / (1 + |x[i]|), a thread an element."""
    one = np_dtype(1.0)

    @cuda.jit(cache=True)
    def softsign_kernel(x, y):
        i = cuda.grid(1)
        if i < y.size:
            y[i] = x[i] / (one + abs(x[i]))

    return softsign_kernel


def softsign_eager(x: torch.Tensor) -> torch.Tensor:
    """y = x / (1 + |x|), x of any shape, float32 or float64: works eagerly, but
    torch.compile cannot trace into numba_view and the launch (graph breaks)."""
    check_floating(x, "x")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_elementwise(kernel_for(make_softsign, x.dtype), x, y)
    return y


@torch.library.custom_op(f"{NAMESPACE}::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    """Exercise 10.3: softsign_eager as an operator torch.compile treats as one node.

    x: any shape, float32 or float64; returns y = x / (1 + |x|), x's shape and
    dtype, computed by softsign_eager (the Numba kernel). With a fake
    implementation (an empty tensor of x's shape and dtype, on x's device),
    torch.compile(fullgraph=True) traces a function calling it without a graph
    break. TypeError for another dtype.
    """
    return softsign_eager(x)


@softsign.register_fake
def softsign_fake(x):
    check_floating(x, "x")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- Exercise 10.4


def make_scale_rows(np_dtype):
    """y[r, c] = s[r] * x[r, c], a thread an element of a row-major walk."""

    @cuda.jit(cache=True)
    def scale_rows_kernel(x, s, y):
        i = cuda.grid(1)
        n = x.shape[1]
        if i < y.shape[0] * n:
            r = i // n
            c = i - r * n
            y[r, c] = s[r] * x[r, c]

    return scale_rows_kernel


def check_scale_rows_args(x: torch.Tensor, s: torch.Tensor) -> None:
    """x (M, N) and s (M,), one floating dtype; TypeError/ValueError otherwise."""
    check_floating(x, "x")
    if s.dtype != x.dtype:
        raise TypeError(f"s has dtype {s.dtype}, x {x.dtype}: they must match")
    if x.dim() != 2 or s.dim() != 1 or s.shape[0] != x.shape[0]:
        raise ValueError(f"need x (M, N) and s (M,), got {tuple(x.shape)} and {tuple(s.shape)}")


def scale_rows_default_stream(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The bug that scale_rows (below) fixes: right numbers, wrong stream.

    Launched with no stream, the kernel goes to Numba's default stream, not
    the one torch queued the work that wrote x and s on (torch.cuda.stream,
    CUDA graphs): it can read x before it is written.
    """
    check_scale_rows_args(x, s)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if y.numel():
        kernel = kernel_for(make_scale_rows, x.dtype)
        kernel[ceil_div(y.numel(), THREADS), THREADS](
            view(x, "x"), view(s, "s"), bridge.numba_view(y, "y")
        )
    return y


@torch.library.custom_op(f"{NAMESPACE}::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Exercise 10.4: scale_rows_default_stream, launched on torch's current stream.

    x (M, N) and s (M,), one dtype (float32 or float64); returns y (M, N) with
    y[r, c] = s[r] * x[r, c], from make_scale_rows's kernel launched on
    bridge.torch_stream(). TypeError/ValueError as check_scale_rows_args.
    """
    check_scale_rows_args(x, s)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if y.numel():
        kernel = kernel_for(make_scale_rows, x.dtype)
        kernel[ceil_div(y.numel(), THREADS), THREADS, bridge.torch_stream()](
            view(x, "x"), view(s, "s"), bridge.numba_view(y, "y")
        )
    return y


@scale_rows.register_fake
def scale_rows_fake(x, s):
    check_scale_rows_args(x, s)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- Exercise 10.5


def check_bias_relu_args(x: torch.Tensor, b: torch.Tensor) -> None:
    """x (M, N) and b (N,), one floating dtype; TypeError/ValueError otherwise."""
    check_floating(x, "x")
    if b.dtype != x.dtype:
        raise TypeError(f"b has dtype {b.dtype}, x {x.dtype}: they must match")
    if x.dim() != 2 or b.dim() != 1 or b.shape[0] != x.shape[1]:
        raise ValueError(f"need x (M, N) and b (N,), got {tuple(x.shape)} and {tuple(b.shape)}")


def make_bias_relu_kernels(np_dtype):
    """(forward, backward) kernels of y = relu(x + b), for bias_relu and bias_relu_backward.

    forward(x, b, y): y[r, c] = max(x[r, c] + b[c], 0).
    backward(dy, x, b, dx, db): dx[r, c] = dy[r, c] where x[r, c] + b[c] > 0,
    else 0; db[c] = sum over r of dx[r, c]. A thread a column, looping over
    the rows: x + b is recomputed, never stored by the forward.
    """
    zero = np_dtype(0.0)

    @cuda.jit(cache=True)
    def bias_relu_forward(x, b, y):
        c = cuda.grid(1)
        if c < x.shape[1]:
            bc = b[c]
            for r in range(x.shape[0]):
                y[r, c] = max(x[r, c] + bc, zero)

    @cuda.jit(cache=True)
    def bias_relu_backward_kernel(dy, x, b, dx, db):
        c = cuda.grid(1)
        if c < x.shape[1]:
            bc = b[c]
            acc = zero
            for r in range(x.shape[0]):
                g = dy[r, c] if x[r, c] + bc > zero else zero
                dx[r, c] = g
                acc += g
            db[c] = acc

    return bias_relu_forward, bias_relu_backward_kernel


@torch.library.custom_op(f"{NAMESPACE}::bias_relu", mutates_args=())
def bias_relu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exercise 10.5: y = relu(x + b) in one kernel (torch runs two: the add, then the ReLU).

    x (M, N) and b (N,), one dtype (float32 or float64); returns y (M, N).
    TypeError/ValueError as check_bias_relu_args.
    """
    check_bias_relu_args(x, b)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if y.numel():
        forward, _ = kernel_for(make_bias_relu_kernels, x.dtype)
        forward[ceil_div(x.shape[1], THREADS), THREADS, bridge.torch_stream()](
            view(x, "x"), view(b, "b"), bridge.numba_view(y, "y")
        )
    return y


@bias_relu.register_fake
def bias_relu_fake(x, b):
    check_bias_relu_args(x, b)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::bias_relu_backward", mutates_args=())
def bias_relu_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.5: (dx (M, N), db (N,)) of y = relu(x + b), given dy (M, N), in one kernel.

    An element where x + b <= 0 passes no gradient (torch's choice at 0 too).
    TypeError/ValueError as check_bias_relu_args, and ValueError for a dy not of x's shape.
    """
    check_bias_relu_args(x, b)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy is {dy.dtype} {tuple(dy.shape)}, x {x.dtype} {tuple(x.shape)}")
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    db = torch.empty_like(b, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return dx, db.zero_()
    if x.shape[1]:
        _, backward = kernel_for(make_bias_relu_kernels, x.dtype)
        backward[ceil_div(x.shape[1], THREADS), THREADS, bridge.torch_stream()](
            view(dy, "dy"), view(x, "x"), view(b, "b"),
            bridge.numba_view(dx, "dx"), bridge.numba_view(db, "db"),
        )  # fmt: skip
    return dx, db


@bias_relu_backward.register_fake
def bias_relu_backward_fake(dy, x, b):
    check_bias_relu_args(x, b)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(b, memory_format=torch.contiguous_format),
    )


def bias_relu_setup_context(ctx, inputs, output):
    x, b = inputs
    ctx.save_for_backward(x, b)


def bias_relu_grad(ctx, dy):
    x, b = ctx.saved_tensors
    return bias_relu_backward(dy.contiguous(), x, b)


bias_relu.register_autograd(bias_relu_grad, setup_context=bias_relu_setup_context)


# ---------------------------------------------------------------- Exercise 10.6


def check_brier_args(p: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> None:
    """p (N, C) and w (C,) of one floating dtype, target (N,) int64; errors otherwise."""
    check_floating(p, "p")
    if w.dtype != p.dtype:
        raise TypeError(f"w has dtype {w.dtype}, p {p.dtype}: they must match")
    if target.dtype != torch.int64:
        raise TypeError(f"target has dtype {target.dtype}; class indices are int64 (target.long())")
    if p.dim() != 2 or target.shape != p.shape[:1] or w.shape != p.shape[1:]:
        raise ValueError(
            f"need p (N, C), target (N,) and w (C,), got {tuple(p.shape)}, "
            f"{tuple(target.shape)} and {tuple(w.shape)}"
        )


def make_brier_kernels(np_dtype):
    """(forward, backward) of the class-weighted Brier score.

    loss[n] = sum over c of w[c] * (p[n, c] - onehot[n, c])**2, onehot[n, c] =
    1 if c == target[n] else 0 (Brier 1950); a target outside [0, C) gives a
    NaN loss and NaN gradients for its row.
    """
    zero = np_dtype(0.0)
    one = np_dtype(1.0)
    two = np_dtype(2.0)
    nan = np_dtype(np.nan)

    # A thread a row: the row's squared errors, weighted and added.
    @cuda.jit(cache=True)
    def brier_forward(p, target, w, loss):
        n = cuda.grid(1)
        if n < loss.shape[0]:
            label = target[n]
            acc = zero if 0 <= label < p.shape[1] else nan
            for c in range(p.shape[1]):
                e = p[n, c] - (one if c == label else zero)
                acc += w[c] * e * e
            loss[n] = acc

    # A thread a column: dp[n, c] = 2 w[c] e dloss[n] down the column, and
    # dw[c] = sum over n of dloss[n] e**2, with e = p[n, c] - onehot[n, c].
    @cuda.jit(cache=True)
    def brier_backward(dloss, p, target, w, dp, dw):
        c = cuda.grid(1)
        if c < p.shape[1]:
            wc = w[c]
            acc = zero
            for n in range(p.shape[0]):
                label = target[n]
                g = dloss[n] if 0 <= label < p.shape[1] else nan
                e = p[n, c] - (one if c == label else zero)
                dp[n, c] = two * wc * e * g
                acc += g * e * e
            dw[c] = acc

    return brier_forward, brier_backward


def launch_brier_score(p: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """loss (N,) of p (N, C), target (N,) int64, w (C,) by make_brier_kernels's
    forward kernel; errors as check_brier_args."""
    check_brier_args(p, target, w)
    loss = torch.empty(p.shape[0], dtype=p.dtype, device=p.device)
    if loss.numel():
        forward, _ = kernel_for(make_brier_kernels, p.dtype)
        forward[ceil_div(loss.numel(), THREADS), THREADS, bridge.torch_stream()](
            view(p, "p"), view(target, "target"), view(w, "w"), bridge.numba_view(loss, "loss")
        )
    return loss


@torch.library.custom_op(f"{NAMESPACE}::brier_score", mutates_args=())
def brier_score(p: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """loss (N,): the class-weighted Brier score of each row of p (N, C), target (N,) int64, w (C,)."""
    return launch_brier_score(p, target, w)


@brier_score.register_fake
def brier_score_fake(p, target, w):
    check_brier_args(p, target, w)
    return p.new_empty(p.shape[0])


@torch.library.custom_op(f"{NAMESPACE}::brier_score_backward", mutates_args=())
def brier_score_backward(
    dloss: torch.Tensor, p: torch.Tensor, target: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dp (N, C), dw (C,)) of brier_score, given dloss (N,)."""
    check_brier_args(p, target, w)
    dp = torch.empty_like(p, memory_format=torch.contiguous_format)
    dw = torch.zeros_like(w, memory_format=torch.contiguous_format)
    if p.numel():
        _, backward = kernel_for(make_brier_kernels, p.dtype)
        backward[ceil_div(p.shape[1], THREADS), THREADS, bridge.torch_stream()](
            view(dloss, "dloss"), view(p, "p"), view(target, "target"), view(w, "w"),
            bridge.numba_view(dp, "dp"), bridge.numba_view(dw, "dw"),
        )  # fmt: skip
    return dp, dw


@brier_score_backward.register_fake
def brier_score_backward_fake(dloss, p, target, w):
    check_brier_args(p, target, w)
    return (
        torch.empty_like(p, memory_format=torch.contiguous_format),
        torch.empty_like(w, memory_format=torch.contiguous_format),
    )


def brier_setup_context(ctx, inputs, output):
    """Exercise 10.6 (what the backward needs): save p, target and w.

    inputs: (p, target, w) as brier_score got them; output: its loss. Tensors
    go through ctx.save_for_backward (so autograd notices if one is modified
    in place before the backward runs), not ctx attributes.
    """
    p, target, w = inputs
    ctx.save_for_backward(p, target, w)


def brier_backward(ctx, dloss):
    """Exercise 10.6: one gradient for each input of brier_score, in order.

    dloss (N,): the gradient of the loss. Returns (dp (N, C), None, dw (C,)),
    from brier_score_backward with the tensors brier_setup_context saved;
    target holds class indices, so its gradient is None.
    """
    p, target, w = ctx.saved_tensors
    dp, dw = brier_score_backward(dloss.contiguous(), p, target, w)
    return dp, None, dw


brier_score.register_autograd(brier_backward, setup_context=brier_setup_context)
