"""Two fused operators written as Numba kernels and registered with PyTorch.

``course10::bias_gelu(x, b)``: y = GELU(x + b), the exact (erf) GELU of
``torch.nn.functional.gelu``, for x (M, N) and b (N,), as after a linear layer.
The composite ``F.gelu(x + b)`` runs two kernels forward (the add writes x + b,
the GELU reads it back) and two backward (GELU's backward, then the column sum
for b's gradient reads the gradient again). Ours: one kernel forward (read x,
write y); backward, one kernel that recomputes x + b, writes dx and per-block
column sums, and a small one that adds those sums into db.

``course10::softmax_cross_entropy_with_lse(logits, target)``: the per-row
loss logsumexp(logits) - logits[target] and the logsumexp itself, each (N,),
for logits (N, C) and target (N,) int64; its gradient is
dloss (softmax - onehot) + dlse softmax (the logsumexp's gradient is the
softmax). ``softmax_cross_entropy`` is its loss alone, as a loss function
returns it. The composite
``F.cross_entropy(logits, target, reduction="none")`` writes the whole
log-softmax forward and, backward, a dense gradient of the NLL before the
log-softmax backward reads it. Ours reads the logits once forward (an online
max and sum of exponentials, Milakov and Gimelshein 2018) and saves one
number a row (the logsumexp, which the backward needs and the operator
returns); backward reads the logits once more and writes the gradient (the
fused classifier of Karpathy's llm.c does the same).

Each is a ``torch.library.custom_op`` with a ``register_fake`` (shapes and
dtypes, for torch.compile and FakeTensor) and a ``register_autograd`` whose
backward is itself a custom op running our kernels. The kernels are built per
dtype (float32, and float64 so that ``torch.autograd.gradcheck`` can run) and
launched on torch's current stream (bridge.py). A target outside [0, C) gives
a NaN loss and a NaN gradient row, never a silently wrong number.

The helpers every operator of the chapter uses (``kernel_for``,
``check_floating``, ``view``) are here; solutions.py and exercises.py take them
from this file.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling, pick
from common.checking import rounding_tolerance

import math

import numpy as np
import torch
from numba import cuda

bridge = import_sibling(__file__, "bridge")

THREADS = pick(gpu=256, simulator=8)  # threads a block, along columns
ROW_SPLITS = pick(gpu=64, simulator=3)  # bias_gelu: row groups (blocks along y)
DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

_KERNELS: dict = {}


def kernel_for(make, dtype: torch.dtype):
    """``make(np_dtype)`` for the NumPy dtype of ``dtype``, built once and cached:
    a factory of kernels (make_bias_gelu_kernels) whose constants carry the dtype."""
    key = (make, dtype)
    if key not in _KERNELS:
        _KERNELS[key] = make(DTYPES[dtype])
    return _KERNELS[key]


def check_floating(t: torch.Tensor, name: str) -> None:
    """TypeError unless ``t`` is a float32 or float64 tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; the kernels take float32 or float64")


def view(t: torch.Tensor, name: str, flat: bool = False):
    """A Numba view of an operator's input tensor (flattened to 1-D if ``flat``).

    Inside an operator the inputs may still carry requires_grad (autograd runs
    around us, not through us): detach() is the same memory. A non-contiguous
    input (transposed, sliced) is copied to a contiguous one first: the kernels
    index row-major, and a view of its storage would read the wrong elements.
    The view of such a copy holds it (:func:`bridge.owning_view`), so its memory
    cannot go to another tensor before the kernel has read it.
    """
    t = t.detach()
    if t.is_contiguous():
        return bridge.numba_view(t.view(-1) if flat else t, name)
    copy = t.contiguous()
    return bridge.owning_view(copy.view(-1) if flat else copy, name)


# ---------------------------------------------------------------- bias + GELU


def make_bias_gelu_kernels(np_dtype):
    """(forward, backward, column_sum) kernels for one dtype. Constants carry the
    dtype, so float32 kernels compute in float32 throughout."""
    half = np_dtype(0.5)
    one = np_dtype(1.0)
    zero = np_dtype(0.0)
    inv_sqrt2 = np_dtype(1.0 / math.sqrt(2.0))
    inv_sqrt_2pi = np_dtype(1.0 / math.sqrt(2.0 * math.pi))

    @cuda.jit(device=True, inline=True)
    def gelu(z):
        return half * z * (one + math.erf(z * inv_sqrt2))

    @cuda.jit(device=True, inline=True)
    def gelu_grad(z):  # d/dz [z Phi(z)] = Phi(z) + z phi(z)
        return half * (one + math.erf(z * inv_sqrt2)) + z * inv_sqrt_2pi * math.exp(-half * z * z)

    # Thread per column, blocks along y stride over rows: b[c] read once, every
    # warp reads and writes 32 consecutive elements of a row.
    @cuda.jit(cache=True)
    def bias_gelu_forward(x, b, y):
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= x.shape[1]:
            return
        bc = b[c]
        for r in range(cuda.blockIdx.y, x.shape[0], cuda.gridDim.y):
            y[r, c] = gelu(x[r, c] + bc)

    # The same walk: dx = dy * GELU'(x + b), x + b recomputed (never stored
    # forward), and this block's sum of dx down its column into partials.
    @cuda.jit(cache=True)
    def bias_gelu_backward(dy, x, b, dx, partials):
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= x.shape[1]:
            return
        bc = b[c]
        acc = zero
        for r in range(cuda.blockIdx.y, x.shape[0], cuda.gridDim.y):
            g = dy[r, c] * gelu_grad(x[r, c] + bc)
            dx[r, c] = g
            acc += g
        partials[cuda.blockIdx.y, c] = acc

    # db[c] = the row groups' partial sums, added in a fixed order (deterministic).
    @cuda.jit(cache=True)
    def column_sum(partials, db):
        c = cuda.grid(1)
        if c < db.shape[0]:
            acc = zero
            for r in range(partials.shape[0]):
                acc += partials[r, c]
            db[c] = acc

    return bias_gelu_forward, bias_gelu_backward, column_sum


# ------------------------------------------------------ softmax + cross-entropy


def make_cross_entropy_kernels(np_dtype, BLOCK=THREADS):
    """(forward, backward) kernels for one dtype: a block of BLOCK threads a row."""
    zero = np_dtype(0.0)
    one = np_dtype(1.0)
    minus_inf = np_dtype(-np.inf)
    nan = np_dtype(np.nan)

    @cuda.jit(device=True, inline=True)
    def merge(m1, s1, m2, s2):
        """(max, sum of exp(v - max)) of two parts, either of which may be empty."""
        if s2 == zero:
            return m1, s1
        if s1 == zero:
            return m2, s2
        m = max(m1, m2)
        return m, s1 * math.exp(m1 - m) + s2 * math.exp(m2 - m)

    @cuda.jit(cache=True)
    def cross_entropy_forward(logits, target, loss, lse):
        n = cuda.blockIdx.x
        t = cuda.threadIdx.x
        classes = logits.shape[1]
        m = minus_inf
        s = zero
        for c in range(t, classes, BLOCK):  # one pass: a running max and sum
            m, s = merge(m, s, logits[n, c], one)
        sm = cuda.shared.array(BLOCK, np_dtype)
        ss = cuda.shared.array(BLOCK, np_dtype)
        sm[t] = m
        ss[t] = s
        cuda.syncthreads()
        stride = BLOCK // 2
        while stride > 0:
            if t < stride:
                sm[t], ss[t] = merge(sm[t], ss[t], sm[t + stride], ss[t + stride])
            cuda.syncthreads()
            stride //= 2
        if t == 0:
            total = sm[0] + math.log(ss[0])
            lse[n] = total
            label = target[n]
            loss[n] = total - logits[n, label] if 0 <= label < classes else nan

    # dlogits = dloss (p - onehot) + dlse p, p = softmax(logits) = exp(logits - lse):
    # the loss's gradient and the logsumexp's, in one pass over the row.
    @cuda.jit(cache=True)
    def cross_entropy_backward(dloss, dlse, logits, target, lse, dlogits):
        n = cuda.blockIdx.x
        label = target[n]
        classes = logits.shape[1]
        g = dloss[n] if 0 <= label < classes else nan
        d = dlse[n]
        total = lse[n]
        for c in range(cuda.threadIdx.x, classes, BLOCK):
            p = math.exp(logits[n, c] - total)
            dlogits[n, c] = g * (p - one) + d * p if c == label else (g + d) * p

    return cross_entropy_forward, cross_entropy_backward


# ------------------------------------------------------------- argument checks


def check_bias_gelu_args(x: torch.Tensor, b: torch.Tensor) -> None:
    """x (M, N) and b (N,), one floating dtype, one device; TypeError/ValueError otherwise."""
    check_floating(x, "x")
    if b.dtype != x.dtype:
        raise TypeError(f"b has dtype {b.dtype}, x {x.dtype}: they must match")
    if x.dim() != 2 or b.dim() != 1 or b.shape[0] != x.shape[1]:
        raise ValueError(f"need x (M, N) and b (N,), got {tuple(x.shape)} and {tuple(b.shape)}")
    if x.device != b.device:
        raise ValueError(f"x is on {x.device}, b on {b.device}")


def check_cross_entropy_args(logits: torch.Tensor, target: torch.Tensor) -> None:
    """logits (N, C) floating, target (N,) int64 on the same device; errors otherwise."""
    check_floating(logits, "logits")
    if target.dtype != torch.int64:
        raise TypeError(f"target has dtype {target.dtype}; class indices are int64 (target.long())")
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"need logits (N, C) and target (N,), got {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if logits.device != target.device:
        raise ValueError(f"logits are on {logits.device}, target on {target.device}")


def grid_rows(m: int) -> int:
    """bias_gelu's blocks along y (row groups) for M rows."""
    return max(1, min(m, ROW_SPLITS))


# ------------------------------------------------------------ the operators


def launch_bias_gelu_forward(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y = GELU(x + b) by our forward kernel on torch's current stream; x (M, N),
    b (N,), float32 or float64 (TypeError/ValueError otherwise). Returns y,
    contiguous. Both routes (this custom op, autograd_function.py) call it."""
    check_bias_gelu_args(x, b)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        forward, _, _ = kernel_for(make_bias_gelu_kernels, x.dtype)
        m, n = x.shape
        forward[(ceil_div(n, THREADS), grid_rows(m)), THREADS, bridge.torch_stream()](
            view(x, "x"), view(b, "b"), bridge.numba_view(y, "y")
        )
    return y


def launch_bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (M, N), db (N,)) of y = GELU(x + b) given dy (M, N), by our backward
    kernels on torch's current stream; errors as launch_bias_gelu_forward."""
    check_bias_gelu_args(x, b)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    db = torch.empty_like(b)
    m, n = x.shape
    if x.numel() == 0:
        return dx, db.zero_()
    _, backward, column_sum = kernel_for(make_bias_gelu_kernels, x.dtype)
    rows = grid_rows(m)
    partials = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    stream = bridge.torch_stream()
    backward[(ceil_div(n, THREADS), rows), THREADS, stream](
        view(dy, "dy"),
        view(x, "x"),
        view(b, "b"),
        bridge.numba_view(dx, "dx"),
        bridge.numba_view(partials, "partials"),
    )
    column_sum[ceil_div(n, THREADS), THREADS, stream](
        bridge.numba_view(partials, "partials"), bridge.numba_view(db, "db")
    )
    return dx, db


@torch.library.custom_op("course10::bias_gelu", mutates_args=())
def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y = GELU(x + b) (exact, erf), x (M, N), b (N,), float32 or float64."""
    return launch_bias_gelu_forward(x, b)


@bias_gelu.register_fake
def bias_gelu_fake(x, b):
    check_bias_gelu_args(x, b)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("course10::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, db) of y = GELU(x + b) given dy (M, N)."""
    return launch_bias_gelu_backward(dy, x, b)


@bias_gelu_backward.register_fake
def bias_gelu_backward_fake(dy, x, b):
    check_bias_gelu_args(x, b)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(b)


def bias_gelu_tolerances(x, b, dy, ref, tol: float = 1e-5) -> tuple[float, float, float]:
    """Relative tolerances of float32 (y, dx, db) against their float64 ``ref`` = (y, dx, db).

    x (M, N), b (N,), dy (M, N): the inputs the kernels got (any float dtype;
    float64 kernels err far less, so the float32 bound covers them too). Each
    is ``common.checking.rounding_tolerance(ref, M, k, tol)`` with M the size
    of the terms that the kernels round, per element, and k their roundings:

    * z = x + b rounds once: off by eps |z|, which moves GELU by |GELU'(z)| <= 1.13
      times that and GELU' by |GELU''(z) z| <= 0.5 times |dy|.
    * y = z Phi(z) = z (1 + erf(z / sqrt 2)) / 2: the erf (2 ulp on a GPU),
      the scaled z, the 1 + erf and the products, each relative to terms of size
      <= |z|, so M = |z|. Where erf nears -1 (z << 0), 1 + erf cancels: y is
      tiny and its relative error large.
    * dx = dy (Phi(z) + z phi(z)): both terms below |dy| (1 + |z|) in size;
      near z = -0.75, where GELU' = 0, they cancel (a one-element draw there
      fails a fixed 1e-5). M = |dy| (1 + |z|); erf, exp and the arithmetic: 8 roundings.
    * db = the column sums of dx, over M rows: M more roundings of terms of
      size sum_r |dy| (1 + |z|).

    A wrong term or sign errs by O(M), far above these. Method: the standard
    model fl(a op b) = (a op b)(1 + d), |d| <= eps/2 (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., sec. 2.2).
    """
    z = (x.detach().double() + b.detach().double()).abs()
    dx_terms = dy.detach().double().abs() * (1 + z)
    y_ref, dx_ref, db_ref = ref
    return (
        rounding_tolerance(y_ref, z, 8, tol),
        rounding_tolerance(dx_ref, dx_terms, 8, tol),
        rounding_tolerance(db_ref, dx_terms.sum(0), 8 + x.shape[0], tol),
    )


def bias_gelu_setup_context(ctx, inputs, output):
    x, b = inputs
    ctx.save_for_backward(x, b)


def bias_gelu_grad(ctx, dy):
    x, b = ctx.saved_tensors
    return bias_gelu_backward(dy, x, b)  # view() makes dy contiguous


bias_gelu.register_autograd(bias_gelu_grad, setup_context=bias_gelu_setup_context)


def launch_cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss (N,), lse (N,)) of logits (N, C) and target (N,) int64 by our forward
    kernel on torch's current stream; NaN for a row with no class (C = 0) or a
    target outside [0, C). TypeError/ValueError as check_cross_entropy_args."""
    check_cross_entropy_args(logits, target)
    n = logits.shape[0]
    loss = torch.empty(n, dtype=logits.dtype, device=logits.device)
    lse = torch.empty(n, dtype=logits.dtype, device=logits.device)
    if n and logits.shape[1]:
        forward, _ = kernel_for(make_cross_entropy_kernels, logits.dtype)
        forward[n, THREADS, bridge.torch_stream()](
            view(logits, "logits"),
            view(target, "target"),
            bridge.numba_view(loss, "loss"),
            bridge.numba_view(lse, "lse"),
        )
    else:
        loss.fill_(math.nan)
        lse.fill_(math.nan)
    return loss, lse


def launch_cross_entropy_backward(
    dloss: torch.Tensor,
    dlse: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
) -> torch.Tensor:
    """dlogits (N, C) = dloss (softmax - onehot) + dlse softmax, row by row, by our
    backward kernel on torch's current stream; dloss, dlse, lse (N,)."""
    check_cross_entropy_args(logits, target)
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if logits.numel():
        _, backward = kernel_for(make_cross_entropy_kernels, logits.dtype)
        backward[logits.shape[0], THREADS, bridge.torch_stream()](
            view(dloss, "dloss"),
            view(dlse, "dlse"),
            view(logits, "logits"),
            view(target, "target"),
            view(lse, "lse"),
            bridge.numba_view(dlogits, "dlogits"),
        )
    return dlogits


@torch.library.custom_op("course10::softmax_cross_entropy_with_lse", mutates_args=())
def softmax_cross_entropy_with_lse(
    logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse), each (N,): lse[n] = logsumexp(logits[n]) and loss[n] = lse[n] -
    logits[n, target[n]], for logits (N, C) float32 or float64, target (N,) int64.
    Both are differentiable: loss's gradient is softmax - onehot, lse's softmax."""
    return launch_cross_entropy_forward(logits, target)


@softmax_cross_entropy_with_lse.register_fake
def softmax_cross_entropy_with_lse_fake(logits, target):
    check_cross_entropy_args(logits, target)
    n = logits.shape[0]
    return logits.new_empty(n), logits.new_empty(n)


@torch.library.custom_op("course10::softmax_cross_entropy_backward", mutates_args=())
def softmax_cross_entropy_backward(
    dloss: torch.Tensor,
    dlse: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
) -> torch.Tensor:
    """dlogits (N, C) = dloss (softmax(logits) - onehot(target)) + dlse softmax(logits)."""
    return launch_cross_entropy_backward(dloss, dlse, logits, target, lse)


@softmax_cross_entropy_backward.register_fake
def softmax_cross_entropy_backward_fake(dloss, dlse, logits, target, lse):
    check_cross_entropy_args(logits, target)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def softmax_cross_entropy_setup_context(ctx, inputs, output):
    logits, target = inputs
    _, lse = output
    ctx.save_for_backward(logits, target, lse)


def softmax_cross_entropy_grad(ctx, dloss, dlse):
    """(dlogits, None) for the inputs (logits, target). Autograd hands a None (or
    zeros) for an output nothing downstream used: a loss alone has no dlse, a
    logsumexp alone no dloss."""
    logits, target, lse = ctx.saved_tensors
    dloss = torch.zeros_like(lse) if dloss is None else dloss
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    return softmax_cross_entropy_backward(dloss, dlse, logits, target, lse), None


softmax_cross_entropy_with_lse.register_autograd(
    softmax_cross_entropy_grad, setup_context=softmax_cross_entropy_setup_context
)


def cross_entropy_tolerances(
    logits, target, dloss, ref, tol: float = 1e-5, dlse=None
) -> tuple[float, float]:
    """Relative tolerances of float32 (loss, dlogits) against their float64 ``ref`` = (loss, dlogits).

    logits (N, C), target (N,) int64 in [0, C), dloss (N,): the inputs the
    kernels got; dlse (N,): the logsumexp's upstream gradient, if it had one.
    In float32 the logsumexp is off by about
    e = 4 eps (max |logits| + |lse|) (the subtraction of the max, exp, log,
    the add) + (C + 2) eps (the sum of C positive exponentials); then:

    * loss = lse - logits[target] cancels for a confident row (loss near 0):
      M = 4 (|lse| + |logits[target]|) + C + 2, in eps.
    * dlogits = dloss (p - onehot) + dlse p, p = exp(logits - lse): p is off by
      p times e + 4 eps |logits|, and p - 1 cancels where p is near 1:
      M = |dloss| (p (e / eps + 4 |logits|) + 2 (p + onehot))
      + |dlse| (p (e / eps + 4 |logits|) + 2 p).

    A wrong label, a missing max or a missing term errs by O(1). Method as
    bias_gelu_tolerances (Higham, 2nd ed., sec. 2.2).
    """
    z = logits.detach().double()
    lse = torch.logsumexp(z, 1, keepdim=True)
    p = torch.exp(z - lse)
    onehot = torch.nn.functional.one_hot(target, z.shape[1]).double()
    lse_error = 4 * (z.abs().amax(1, keepdim=True) + lse.abs()) + z.shape[1] + 2
    loss_terms = 4 * (lse.abs() + z.gather(1, target[:, None]).abs()) + z.shape[1] + 2
    p_terms = p * (lse_error + 4 * z.abs())
    grad_terms = dloss.detach().double().abs()[:, None] * (p_terms + 2 * (p + onehot))
    if dlse is not None:
        grad_terms = grad_terms + dlse.detach().double().abs()[:, None] * (p_terms + 2 * p)
    loss_ref, grad_ref = ref
    return (
        rounding_tolerance(loss_ref, loss_terms[:, 0], 1, tol),
        rounding_tolerance(grad_ref, grad_terms, 1, tol),
    )


def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The per-row loss (N,) of softmax_cross_entropy_with_lse, as
    ``F.cross_entropy(logits, target, reduction="none")`` returns it. A plain
    function, not an operator: torch.compile sees the operator inside it."""
    loss, _ = softmax_cross_entropy_with_lse(logits, target)
    return loss
