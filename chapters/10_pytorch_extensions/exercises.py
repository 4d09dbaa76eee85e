# ruff: noqa: F401, F841, B007  (stubs: the imports and TODO names are for your code)
"""Chapter 10 exercises: your Numba kernels as PyTorch operators, with backward.

Write each function from its docstring (delete its `raise NotImplementedError`
line), then run `python -m pytest tests/test_ch10_exercises.py -q`. Every
operator here follows ops.py: a torch.library.custom_op whose body launches a
Numba kernel on torch's stream (bridge.py), a fake implementation (shapes and
dtypes only, for torch.compile and FakeTensor), and a register_autograd whose
backward is itself an operator. 10.1 writes a backward kernel, 10.2 a fake,
10.3 turns a launcher into an operator torch.compile traces in one graph, 10.4
fixes a launch on the wrong stream, 10.5 fuses two operations forward and
backward, 10.6 tells autograd what to save and which gradients to return.
The tests check gradients with torch.autograd.gradcheck (in float64: the
kernels are built per dtype) and registrations with torch.library.opcheck.
Every operator also gets transposed and sliced (non-contiguous) inputs, must
launch every kernel on bridge.torch_stream(), must leave its inputs as they
were, and its fake must match its real output's shape, dtype and device.

What is not an exercise (the helpers, the kernels, launchers and argument
checks you are given, the fake implementations you do not write) is imported
from solutions.py, where each has its docstring: this file holds only what you
write, and the registrations that tie it to torch. (solutions.py also holds
the answers: read only the functions this file names.)
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling

import math
from pathlib import Path

import numpy as np
import torch
from numba import cuda

bridge = import_sibling(__file__, "bridge")
solutions = import_sibling(__file__, "solutions")

# Your operators' names: "course10_exercises::...", apart from solutions.py's
# "course10_solutions::..." (torch keeps one table of names for the process).
NAMESPACE = f"course10_{Path(__file__).stem}"

# The helpers (ops.py's, through solutions.py): THREADS a block, a kernel
# factory's kernels built once per dtype, the dtype check, a Numba view of an
# input tensor, and one thread an element on torch's stream.
DTYPES, THREADS = solutions.DTYPES, solutions.THREADS
kernel_for, check_floating, view = solutions.kernel_for, solutions.check_floating, solutions.view
launch_elementwise = solutions.launch_elementwise


# ---------------------------------------------------------------- Exercise 10.1
# Given: the forward kernel and its launcher, and what autograd saves (x and a).
make_scaled_tanh_forward = solutions.make_scaled_tanh_forward
launch_scaled_tanh = solutions.launch_scaled_tanh
scaled_tanh_setup_context = solutions.scaled_tanh_setup_context


@torch.library.custom_op(f"{NAMESPACE}::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, a: float) -> torch.Tensor:
    """y = a * tanh(x) (launch_scaled_tanh), differentiated by your scaled_tanh_grad."""
    return launch_scaled_tanh(x, a)


scaled_tanh.register_fake(solutions.scaled_tanh_fake)


def make_scaled_tanh_backward(np_dtype):
    """The kernel scaled_tanh_backward launches, a thread an element:
    dx[i] = dy[i] * a * (1 - tanh(x[i])**2)."""
    one = np_dtype(1.0)  # constants in the kernel's dtype: a float32 kernel stays float32

    @cuda.jit(cache=True)
    def scaled_tanh_backward_kernel(dy, x, a, dx):
        i = cuda.grid(1)
        # TODO: for i inside dx (all four arrays are flat views of one size),
        # dx[i] = dy[i] * a * (one - tanh(x[i])**2)

    raise NotImplementedError("write the kernel above, then delete this line")
    return scaled_tanh_backward_kernel


@torch.library.custom_op(f"{NAMESPACE}::scaled_tanh_backward", mutates_args=())
def scaled_tanh_backward(dy: torch.Tensor, x: torch.Tensor, a: float) -> torch.Tensor:
    """Exercise 10.1: dx = dy * a * (1 - tanh(x)**2), the gradient of y = a * tanh(x).

    dy, x: one shape, one dtype (float32 or float64); returns dx of that shape
    and dtype, computed by make_scaled_tanh_backward's kernel (launched with
    launch_elementwise). TypeError for another dtype or dy and x of different
    dtypes, ValueError for different shapes.
    """
    # launch_scaled_tanh (the forward's launcher) is the model: check the
    # arguments, allocate the output, launch_elementwise, return.
    raise NotImplementedError("Exercise 10.1: write scaled_tanh_backward")


scaled_tanh_backward.register_fake(solutions.scaled_tanh_backward_fake)


def scaled_tanh_grad(ctx, dy):
    """Exercise 10.1 (the autograd formula): (dx, None) for the inputs (x, a) of
    scaled_tanh; a is a float, so its gradient is None."""
    # ctx holds what scaled_tanh_setup_context saved: ctx.saved_tensors == (x,), and ctx.a.
    raise NotImplementedError("Exercise 10.1: write scaled_tanh_grad")


scaled_tanh.register_autograd(scaled_tanh_grad, setup_context=scaled_tanh_setup_context)


# ---------------------------------------------------------------- Exercise 10.2
# Given: the kernel's launcher (a thread a row) and the argument check.
launch_row_sums = solutions.launch_row_sums
check_row_sums_args = solutions.check_row_sums_args


@torch.library.custom_op(f"{NAMESPACE}::row_sums", mutates_args=())
def row_sums(x: torch.Tensor) -> torch.Tensor:
    """out (M,) = x (M, N) summed along rows (launch_row_sums), traced through your row_sums_fake."""
    return launch_row_sums(x)


@row_sums.register_fake
def row_sums_fake(x):
    """Exercise 10.2: what row_sums returns, without computing it.

    x: a tensor (M, N) with no data (a FakeTensor or on the "meta" device).
    Returns an empty tensor of row_sums's output shape (M,), dtype and device
    (x's device: "meta" for a meta x, never the default device); raises the
    same TypeError/ValueError as row_sums for a bad x.
    """
    raise NotImplementedError("Exercise 10.2: write row_sums_fake")


# ---------------------------------------------------------------- Exercise 10.3
# Given: y = x / (1 + |x|) as an eager launcher, which torch.compile cannot
# trace (numba_view and the launch break the graph).
softsign_eager = solutions.softsign_eager


# TODO: make softsign an operator (the decorator that scaled_tanh has, with
# the name f"{NAMESPACE}::softsign"), and give it a fake implementation.
def softsign(x: torch.Tensor) -> torch.Tensor:
    """Exercise 10.3: softsign_eager as an operator torch.compile treats as one node.

    x: any shape, float32 or float64; returns y = x / (1 + |x|), x's shape and
    dtype, computed by softsign_eager (the Numba kernel). With a fake
    implementation (an empty tensor of x's shape and dtype, on x's device),
    torch.compile(fullgraph=True) traces a function calling it without a graph
    break. TypeError for another dtype.
    """
    raise NotImplementedError("Exercise 10.3: write softsign")


# ---------------------------------------------------------------- Exercise 10.4
# Given: the kernel (y[r, c] = s[r] * x[r, c], a thread an element), the
# argument check, and the launch to fix: scale_rows_default_stream.
make_scale_rows = solutions.make_scale_rows
check_scale_rows_args = solutions.check_scale_rows_args
scale_rows_default_stream = solutions.scale_rows_default_stream


@torch.library.custom_op(f"{NAMESPACE}::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Exercise 10.4: scale_rows_default_stream, launched on torch's current stream.

    x (M, N) and s (M,), one dtype (float32 or float64); returns y (M, N) with
    y[r, c] = s[r] * x[r, c], from make_scale_rows's kernel launched on
    bridge.torch_stream(). TypeError/ValueError as check_scale_rows_args.
    """
    raise NotImplementedError("Exercise 10.4: write scale_rows")


scale_rows.register_fake(solutions.scale_rows_fake)


# ---------------------------------------------------------------- Exercise 10.5
# Given: the argument check, and what autograd saves (x and b).
check_bias_relu_args = solutions.check_bias_relu_args
bias_relu_setup_context = solutions.bias_relu_setup_context


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
        # TODO: for a column c inside x, y[r, c] = max(x[r, c] + b[c], zero) down the rows

    @cuda.jit(cache=True)
    def bias_relu_backward_kernel(dy, x, b, dx, db):
        c = cuda.grid(1)
        # TODO: for a column c inside x: dx down the column, and their sum into db[c]

    raise NotImplementedError("write the kernels above, then delete this line")
    return bias_relu_forward, bias_relu_backward_kernel


@torch.library.custom_op(f"{NAMESPACE}::bias_relu", mutates_args=())
def bias_relu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exercise 10.5: y = relu(x + b) in one kernel (torch runs two: the add, then the ReLU).

    x (M, N) and b (N,), one dtype (float32 or float64); returns y (M, N).
    TypeError/ValueError as check_bias_relu_args.
    """
    raise NotImplementedError("Exercise 10.5: write bias_relu")


bias_relu.register_fake(solutions.bias_relu_fake)


@torch.library.custom_op(f"{NAMESPACE}::bias_relu_backward", mutates_args=())
def bias_relu_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.5: (dx (M, N), db (N,)) of y = relu(x + b), given dy (M, N), in one kernel.

    An element where x + b <= 0 passes no gradient (torch's choice at 0 too).
    TypeError/ValueError as check_bias_relu_args, and ValueError for a dy not of x's shape.
    """
    raise NotImplementedError("Exercise 10.5: write bias_relu_backward")


bias_relu_backward.register_fake(solutions.bias_relu_backward_fake)


def bias_relu_grad(ctx, dy):
    """Given: (dx, db) from your bias_relu_backward, with what bias_relu_setup_context saved."""
    x, b = ctx.saved_tensors
    return bias_relu_backward(dy.contiguous(), x, b)


bias_relu.register_autograd(bias_relu_grad, setup_context=bias_relu_setup_context)


# ---------------------------------------------------------------- Exercise 10.6
# Given: the argument check, the forward's launcher, and the backward operator
# brier_score_backward(dloss, p, target, w) -> (dp, dw) that brier_backward calls.
check_brier_args = solutions.check_brier_args
launch_brier_score = solutions.launch_brier_score
brier_score_backward = solutions.brier_score_backward


@torch.library.custom_op(f"{NAMESPACE}::brier_score", mutates_args=())
def brier_score(p: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """loss (N,): the class-weighted Brier score of each row of p (N, C), target (N,)
    int64, w (C,) (launch_brier_score), differentiated by your brier_backward."""
    return launch_brier_score(p, target, w)


brier_score.register_fake(solutions.brier_score_fake)


def brier_setup_context(ctx, inputs, output):
    """Exercise 10.6 (what the backward needs): save p, target and w.

    inputs: (p, target, w) as brier_score got them; output: its loss. Tensors
    go through ctx.save_for_backward (so autograd notices if one is modified
    in place before the backward runs), not ctx attributes.
    """
    raise NotImplementedError("Exercise 10.6: write brier_setup_context")


def brier_backward(ctx, dloss):
    """Exercise 10.6: one gradient for each input of brier_score, in order.

    dloss (N,): the gradient of the loss. Returns (dp (N, C), None, dw (C,)),
    from brier_score_backward with the tensors brier_setup_context saved;
    target holds class indices, so its gradient is None.
    """
    raise NotImplementedError("Exercise 10.6: write brier_backward")


brier_score.register_autograd(brier_backward, setup_context=brier_setup_context)
