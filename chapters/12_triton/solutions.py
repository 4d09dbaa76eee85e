"""Chapter 12 exercises, solved. Same functions as exercises.py; read those first.

Check yours with: python -m pytest tests/test_ch12_exercises.py -q

The argument checks at the top (``require_*``) are given to the exercises too:
each raises TypeError / ValueError with the fix, before any launch.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling

import torch

triton_env = import_sibling(__file__, "triton_env")
triton_env.require()  # without Triton: one RuntimeError line that says how to install it
triton, tl = triton_env.triton, triton_env.tl

VEC_BLOCK = 128  # 12.1: elements a program
MAX_ROW = 4096  # 12.2, 12.3: the longest row one program holds whole
BIAS_BLOCK_M, BIAS_BLOCK_N = 16, 32  # 12.4: the 2-D block of one program
MM_BLOCK_M = MM_BLOCK_N = MM_BLOCK_K = 16  # 12.5, 12.6: tl.dot needs every dimension >= 16
GROUP_M = 4  # 12.6: row tiles in one group of the program order


# ---------------------------------------------------------------- given: argument checks
def require_tensor(t, name, ndim):
    """``t`` if it is a contiguous float32 torch tensor of ``ndim`` dimensions, with at
    least one element, where Triton can reach it (a CUDA tensor, or any tensor when
    Triton runs in its interpreter); else TypeError (not a tensor, not float32) or
    ValueError (dimensions, empty, strides, device), saying what to pass instead."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype} (use .float())")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): nothing to launch")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)}): "
            "the kernels compute offsets for row-major data; pass .contiguous()"
        )
    if not triton_env.INTERPRETED and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: compiled Triton kernels need CUDA tensors")
    return t


def require_same_device(**tensors):
    """ValueError unless every tensor is on one device (a pointer means nothing elsewhere)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def require_shape(t, shape, name, why=""):
    """ValueError unless ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}{why}, got {tuple(t.shape)}")


def require_separate(out, name, **inputs):
    """ValueError if ``out`` shares memory with an input that is still read after
    some of ``out`` is written (another program's tile)."""
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    for other, t in inputs.items():
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if t.device == out.device and start < hi and lo < end:
            raise ValueError(
                f"{name} overlaps {other}: programs would read values other programs "
                "already overwrote; pass a separate output"
            )


def row_block(n, name="N"):
    """The power-of-two block that holds a whole row of n: tl.arange needs a power of two."""
    if n > MAX_ROW:
        raise ValueError(f"{name} = {n} > MAX_ROW = {MAX_ROW}: one program holds a whole row")
    return triton.next_power_of_2(n)


# ---------------------------------------------------------------- 12.1 masked vector add
@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def vector_add(x, y, out):
    """Exercise 12.1: ``out = x + y`` (see exercises.py for the spec)."""
    x, y = require_tensor(x, "x", 1), require_tensor(y, "y", 1)
    out = require_tensor(out, "out", 1)
    require_same_device(x=x, y=y, out=out)
    require_shape(y, x.shape, "y", " (x's)")
    require_shape(out, x.shape, "out", " (x's)")
    n = x.numel()
    vector_add_kernel[(triton.cdiv(n, VEC_BLOCK),)](x, y, out, n, BLOCK=VEC_BLOCK)


# ---------------------------------------------------------------- 12.2 row sums
@triton.jit
def row_sums_kernel(x_ptr, out_ptr, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    v = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row, tl.sum(v, axis=0))


def row_sums(x, out):
    """Exercise 12.2: ``out[i] = sum_j x[i, j]`` (see exercises.py for the spec)."""
    x, out = require_tensor(x, "x", 2), require_tensor(out, "out", 1)
    require_same_device(x=x, out=out)
    m, n = x.shape
    require_shape(out, (m,), "out", " (one sum a row of x)")
    row_sums_kernel[(m,)](x, out, n, BLOCK_N=row_block(n))


# ---------------------------------------------------------------- 12.3 fused row softmax
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf"))
    z = x - tl.max(x, axis=0)
    e = tl.exp(z)
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


def softmax_rows(x, out):
    """Exercise 12.3: ``out[i] = softmax(x[i])`` (see exercises.py for the spec)."""
    x, out = require_tensor(x, "x", 2), require_tensor(out, "out", 2)
    require_same_device(x=x, out=out)
    require_shape(out, x.shape, "out", " (x's)")
    m, n = x.shape
    softmax_kernel[(m,)](x, out, n, BLOCK_N=row_block(n))


# ---------------------------------------------------------------- 12.4 bias + ReLU, 2-D blocks
@triton.jit
def bias_relu_kernel(
    x_ptr, b_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(out_ptr + offsets, tl.maximum(x + b[None, :], 0.0), mask=mask)


def bias_relu(x, b, out):
    """Exercise 12.4: ``out = max(x + b, 0)`` (see exercises.py for the spec)."""
    x, b = require_tensor(x, "x", 2), require_tensor(b, "b", 1)
    out = require_tensor(out, "out", 2)
    require_same_device(x=x, b=b, out=out)
    m, n = x.shape
    require_shape(b, (n,), "b", " (one bias a column of x)")
    require_shape(out, x.shape, "out", " (x's)")
    grid = (triton.cdiv(m, BIAS_BLOCK_M), triton.cdiv(n, BIAS_BLOCK_N))
    bias_relu_kernel[grid](x, b, out, m, n, BLOCK_M=BIAS_BLOCK_M, BLOCK_N=BIAS_BLOCK_N)


# ---------------------------------------------------------------- 12.5 tiled matmul
def require_matmul(a, b, out):
    """Given: the checks of 12.5 and 12.6; returns (M, N, K)."""
    a, b = require_tensor(a, "a", 2), require_tensor(b, "b", 2)
    out = require_tensor(out, "out", 2)
    require_same_device(a=a, b=b, out=out)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"a is {m}x{k} and b is {k2}x{n}: a.shape[1] must equal b.shape[0]")
    require_shape(out, (m, n), "out", " (a.shape[0], b.shape[1])")
    require_separate(out, "out", a=a, b=b)
    return m, n, k


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + ks
        a = tl.load(
            a_ptr + rows[:, None] * K + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + k[:, None] * N + cols[None, :],
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision="ieee")
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def matmul(a, b, out):
    """Exercise 12.5: ``out = a @ b`` (see exercises.py for the spec)."""
    m, n, k = require_matmul(a, b, out)
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N))
    matmul_kernel[grid](
        a, b, out, m, n, k, BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K
    )


# ---------------------------------------------------------------- 12.6 grouped program order
@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    group_size = GROUP * num_pid_n  # programs in one group: GROUP tile rows, every column
    first_m = (pid // group_size) * GROUP
    rows_here = tl.minimum(num_pid_m - first_m, GROUP)  # the last group can be shorter
    pid_m = first_m + (pid % group_size) % rows_here
    pid_n = (pid % group_size) // rows_here
    return pid_m, pid_n


@triton.jit
def grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    order_ptr,
    M,
    N,
    K,
    GROUP: tl.constexpr,
    RECORD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    if RECORD:  # given: which tile this program took
        tl.store(order_ptr + 2 * pid, pid_m)
        tl.store(order_ptr + 2 * pid + 1, pid_n)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + ks
        a = tl.load(
            a_ptr + rows[:, None] * K + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + k[:, None] * N + cols[None, :],
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision="ieee")
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def require_order(order, programs, device):
    """Given: ``order`` None, or an int32 (programs, 2) tensor on ``device``."""
    if order is None:
        return
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int32:
        raise TypeError(
            f"order must be an int32 torch.Tensor, got {getattr(order, 'dtype', order)}"
        )
    require_shape(order, (programs, 2), "order", " (one (pid_m, pid_n) row a program)")
    if not order.is_contiguous() or order.device != device:
        raise ValueError(f"order must be contiguous and on {device}")


def grouped_matmul(a, b, out, group=GROUP_M, order=None):
    """Exercise 12.6: ``out = a @ b``, programs in grouped order (see exercises.py)."""
    m, n, k = require_matmul(a, b, out)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    programs = triton.cdiv(m, MM_BLOCK_M) * triton.cdiv(n, MM_BLOCK_N)
    require_order(order, programs, out.device)
    grouped_matmul_kernel[(programs,)](
        a,
        b,
        out,
        out if order is None else order,  # never written without RECORD
        m,
        n,
        k,
        GROUP=group,
        RECORD=order is not None,
        BLOCK_M=MM_BLOCK_M,
        BLOCK_N=MM_BLOCK_N,
        BLOCK_K=MM_BLOCK_K,
    )
