"""Layer normalisation over the last dimension, forward and backward, in Numba, Triton and torch.

y = (x - mean) * rstd * w + b for each row of x (M, N), rstd = 1 / sqrt(var + eps);
backward, with xhat = (x - mean) * rstd and g = w * dy:
  dx = rstd * (g - xhat * mean(xhat * g) - mean(g))      (means over the row)
  dw = sum over rows of dy * xhat,   db = sum over rows of dy

Versions:
  numba (block a row, atomics): forward: one block of LN_BLOCK threads a row, two
      shared-memory trees (chapter 06's block_reduce_sum) for the mean and the variance
      (two passes: no E[x^2] - E[x]^2 cancellation); saves mean and rstd (M,).
      Backward: one block a row for dx (two trees: mean(xhat * g), mean(g)); then
      dw, db by one thread a column over GROUP_ROWS rows, one cuda.atomic.add a
      column a group (coalesced over columns, M / GROUP_ROWS atomics an address).
  triton (row a program, partial sums): forward: one program a row, the row one
      vector, tl.sum for both moments. Backward: PROGRAMS programs, each takes rows
      pid, pid + PROGRAMS, ...: writes dx and keeps dw, db as BLOCK-long vectors
      in registers, stores one partial row each; a second kernel sums the partial rows
      (Triton tutorial 05's plan, without its locks: deterministic).
  torch eager: F.layer_norm and its autograd backward.
  torch.compile: the same, compiled by Inductor (GPU only).

Bytes (the fewest a version must move; w, b, mean, rstd and the partial rows are
O(M + N) and not counted): forward reads x, writes y (2 M N floats); forward +
backward also reads x and dy and writes dx (5 M N floats).

Source: J. L. Ba, J. R. Kiros, G. E. Hinton, "Layer Normalization", arXiv:1607.06450
(2016); Triton's tutorial 05-layer-norm for the backward's partial sums.

Run: python chapters/12_triton/layernorm.py [--out DIR]
Without a GPU, Numba runs in its simulator and Triton in its interpreter, at tiny sizes,
nothing timed; torch.compile needs a GPU and is left out there.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator, pick
from common.checking import check, poison_value, rounding_tolerance
from common.harness import run_script, save_results, script_parser
from common.internal.exercises import import_sibling, load_chapter_module
from common.runtime import sm_count
from common.timing import Timing, benchmark, device_peaks, format_table, timed_call

import math
from functools import partial

import numpy as np
from numba import cuda, float32

vector_add = import_sibling(__file__, "vector_add")  # the chapter's launch checks
triton_env = vector_add.triton_env
triton, tl = triton_env.triton, triton_env.tl
bridge = vector_add.bridge
block_reduce_sum = load_chapter_module("06_memory", "reduction").block_reduce_sum

import torch  # noqa: E402  (after triton_env, which sets TRITON_INTERPRET first)
import torch.nn.functional as F  # noqa: E402

EPS = 1e-5
LN_BLOCK = 128  # numba: threads a row (a power of two, for the tree)
GROUP_ROWS = 64  # numba dw, db: rows a thread sums before its atomic
COL_THREADS = 128  # numba dw, db: columns a block
MAX_COLS = 16384  # triton: a row is one vector held in registers (64 KiB)
SHAPES = pick(gpu=[(4096, 1024), (8192, 4096)], simulator=[(5, 37)])
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


def layernorm_reference(x, w, b, dy, eps: float = EPS) -> tuple[torch.Tensor, ...]:
    """(y, dx, dw, db) in float64 on the CPU, from torch autograd."""
    x, w, b = (t.detach().cpu().double().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return (y.detach(), *torch.autograd.grad(y, (x, w, b), dy.cpu().double()))


def layernorm_tolerances(x, w, b, dy, ref) -> tuple[float, ...]:
    """rounding_tolerance for (y, dx, dw, db): each element's rounded terms, from the
    float64 ``ref``; a few roundings each (a sum over rows counted as its terms'
    magnitude, which already grows with M)."""
    x, w, b, dy = (t.detach().cpu().double() for t in (x, w, b, dy))
    y, dx, dw, db = ref
    mean = x.mean(dim=1, keepdim=True)
    rstd = 1 / torch.sqrt(x.var(dim=1, unbiased=False, keepdim=True) + EPS)
    xhat = (x - mean) * rstd
    g = w * dy
    c1, c2 = (xhat * g).mean(dim=1, keepdim=True), g.mean(dim=1, keepdim=True)
    return (
        rounding_tolerance(y, (xhat * w).abs() + b.abs(), 4, 1e-5),
        rounding_tolerance(dx, rstd * (g.abs() + (xhat * c1).abs() + c2.abs()), 6, 1e-5),
        rounding_tolerance(dw, (dy * xhat).abs().sum(dim=0), 4, 1e-5),
        rounding_tolerance(db, dy.abs().sum(dim=0), 4, 1e-5),
    )


# ---------------------------------------------------------------- numba kernels


# numba forward: a block a row; 2 trees (mean, variance), 2 reads + 1 write of the row
@cuda.jit  # not cached: calls chapter 06's block_reduce_sum, whose edits numba's cache does not see
def layernorm_forward_block_row(x, w, b, eps, y, mean, rstd):
    s = cuda.shared.array(LN_BLOCK, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = x.shape[1]
    inv_n = ONE / float32(n)
    acc = ZERO
    for j in range(t, n, LN_BLOCK):
        acc += x[r, j]
    mu = block_reduce_sum(s, acc) * inv_n
    acc = ZERO
    for j in range(t, n, LN_BLOCK):
        d = x[r, j] - mu
        acc += d * d
    rs = ONE / math.sqrt(block_reduce_sum(s, acc) * inv_n + eps)
    for j in range(t, n, LN_BLOCK):
        y[r, j] = (x[r, j] - mu) * rs * w[j] + b[j]
    if t == 0:
        mean[r] = mu
        rstd[r] = rs


# numba backward dx: a block a row; 2 trees (mean(xhat g), mean(g)), reads x, dy twice
@cuda.jit  # not cached: calls chapter 06's block_reduce_sum, whose edits numba's cache does not see
def layernorm_backward_dx_block_row(dy, x, w, mean, rstd, dx):
    s = cuda.shared.array(LN_BLOCK, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = x.shape[1]
    inv_n = ONE / float32(n)
    mu = mean[r]
    rs = rstd[r]
    a1 = ZERO
    a2 = ZERO
    for j in range(t, n, LN_BLOCK):
        g = w[j] * dy[r, j]
        a1 += (x[r, j] - mu) * rs * g
        a2 += g
    c1 = block_reduce_sum(s, a1) * inv_n
    c2 = block_reduce_sum(s, a2) * inv_n
    for j in range(t, n, LN_BLOCK):
        xhat = (x[r, j] - mu) * rs
        dx[r, j] = (w[j] * dy[r, j] - (xhat * c1 + c2)) * rs


# numba backward dw, db: thread a column (coalesced), GROUP_ROWS rows, 2 atomics
@cuda.jit(cache=True)
def layernorm_backward_weight_bias_atomic(dy, x, mean, rstd, dw, db):
    j = cuda.grid(1)
    if j >= x.shape[1]:
        return
    start = cuda.blockIdx.y * GROUP_ROWS
    aw = ZERO
    ab = ZERO
    for r in range(start, min(start + GROUP_ROWS, x.shape[0])):
        d = dy[r, j]
        aw += d * (x[r, j] - mean[r]) * rstd[r]
        ab += d
    cuda.atomic.add(dw, j, aw)
    cuda.atomic.add(db, j, ab)


@cuda.jit(cache=True)
def zero_fill(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = ZERO


# ---------------------------------------------------------------- triton kernels

if triton is not None:
    # triton forward: a program a row; read N, write N floats (+ mean, rstd)
    @triton.jit
    def layernorm_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps,
                                 BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        offset = row.to(tl.int64) * n  # row * n overflows int32 past 2**31 elements
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + offset + cols, mask=mask, other=0.0)
        mu = tl.sum(x, axis=0) / n
        d = tl.where(mask, x - mu, 0.0)  # the padding must not count in the variance
        rs = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask)
        b = tl.load(b_ptr + cols, mask=mask)
        tl.store(y_ptr + offset + cols, d * rs * w + b, mask=mask)
        tl.store(mean_ptr + row, mu)
        tl.store(rstd_ptr + row, rs)

    # triton backward: a program every PROGRAMS-th row; dx, and dw, db kept in registers
    @triton.jit
    def layernorm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
                                  dw_part_ptr, db_part_ptr, m, n, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        db = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid, m, tl.num_programs(0)):
            offset = tl.cast(row, tl.int64) * n
            x = tl.load(x_ptr + offset + cols, mask=mask, other=0.0)
            dy = tl.load(dy_ptr + offset + cols, mask=mask, other=0.0)
            xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row), 0.0)
            g = w * dy
            c1 = tl.sum(xhat * g, axis=0) / n
            c2 = tl.sum(g, axis=0) / n
            dx = (g - (xhat * c1 + c2)) * tl.load(rstd_ptr + row)
            tl.store(dx_ptr + offset + cols, dx, mask=mask)
            dw += dy * xhat
            db += dy
        tl.store(dw_part_ptr + pid * n + cols, dw, mask=mask)
        tl.store(db_part_ptr + pid * n + cols, db, mask=mask)

    # triton: out[j] = sum over rows of part[:, j]; a program a BLOCK_N-wide strip
    @triton.jit
    def column_sum_kernel(part_ptr, out_ptr, rows, n, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            mask = (r[:, None] < rows) & (cols[None, :] < n)
            acc += tl.load(part_ptr + r[:, None] * n + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < n)


# ---------------------------------------------------------------- launchers


def _shapes(x, w, b, outs_2d, outs_row, outs_col) -> tuple[int, int]:
    """(M, N) of x; ValueError unless the other arrays fit it."""
    m, n = x.shape
    for name, a, want in (
        [("w", w, (n,)), ("b", b, (n,))]
        + [(k, a, (m, n)) for k, a in outs_2d]
        + [(k, a, (m,)) for k, a in outs_row]
        + [(k, a, (n,)) for k, a in outs_col]
    ):
        if a is not None and tuple(a.shape) != want:
            raise ValueError(f"{name} must have shape {want} for x {(m, n)}, got {tuple(a.shape)}")
    if m == 0 or n == 0:
        raise ValueError(f"x must not be empty, got shape {(m, n)}")
    return m, n


def forward_numba(x, w, b, y, mean, rstd, eps: float = EPS) -> None:
    """y = layer_norm(x) * w + b, saving mean and rstd, with Numba.

    x, y: float32 (M, N); w, b: (N,); mean, rstd: (M,): torch tensors (GPU; CPU in
    the simulator) or Numba device arrays. Raises TypeError (NumPy host array,
    wrong dtype) or ValueError (rank, shape, non-contiguous, wrong device) before
    any launch.
    """
    x, y = vector_add.as_numba(x, "x", 2), vector_add.as_numba(y, "y", 2)
    w, b = vector_add.as_numba(w, "w", 1), vector_add.as_numba(b, "b", 1)
    mean, rstd = vector_add.as_numba(mean, "mean", 1), vector_add.as_numba(rstd, "rstd", 1)
    m, _ = _shapes(x, w, b, [("y", y)], [("mean", mean), ("rstd", rstd)], [])
    layernorm_forward_block_row[m, LN_BLOCK](x, w, b, np.float32(eps), y, mean, rstd)


def backward_numba(dy, x, w, mean, rstd, dx, dw, db) -> None:
    """dx, dw, db of layer norm from dy and the forward's mean, rstd, with Numba.

    dy, x, dx: float32 (M, N); w, dw, db: (N,); mean, rstd: (M,); arrays and errors
    as :func:`forward_numba`. dw and db are overwritten (zeroed, then accumulated).
    """
    dy, x, dx = (vector_add.as_numba(a, k, 2) for a, k in ((dy, "dy"), (x, "x"), (dx, "dx")))
    w, dw, db = (vector_add.as_numba(a, k, 1) for a, k in ((w, "w"), (dw, "dw"), (db, "db")))
    mean, rstd = vector_add.as_numba(mean, "mean", 1), vector_add.as_numba(rstd, "rstd", 1)
    m, n = _shapes(
        x,
        w,
        None,
        [("dy", dy), ("dx", dx)],
        [("mean", mean), ("rstd", rstd)],
        [("dw", dw), ("db", db)],
    )
    layernorm_backward_dx_block_row[m, LN_BLOCK](dy, x, w, mean, rstd, dx)
    zero_fill[ceil_div(n, COL_THREADS), COL_THREADS](dw)
    zero_fill[ceil_div(n, COL_THREADS), COL_THREADS](db)
    grid = (ceil_div(n, COL_THREADS), ceil_div(m, GROUP_ROWS))
    layernorm_backward_weight_bias_atomic[grid, COL_THREADS](dy, x, mean, rstd, dw, db)


def _require_all(**tensors) -> None:
    triton_env.require()
    for name, (t, ndim) in tensors.items():
        vector_add.require_tensor(t, name, ndim)


def _block(n: int) -> int:
    if n > MAX_COLS:
        raise ValueError(f"rows of {n} > {MAX_COLS} columns do not fit one Triton program")
    return triton.next_power_of_2(n)


def forward_triton(x, w, b, y, mean, rstd, eps: float = EPS) -> None:
    """As :func:`forward_numba` with Triton (M programs of next_power_of_2(N) lanes).

    All arrays: contiguous float32 torch tensors on the GPU (CPU in the interpreter).
    Raises TypeError / ValueError (vector_add.require_tensor; N > MAX_COLS) before
    the launch.
    """
    _require_all(x=(x, 2), w=(w, 1), b=(b, 1), y=(y, 2), mean=(mean, 1), rstd=(rstd, 1))
    m, n = _shapes(x, w, b, [("y", y)], [("mean", mean), ("rstd", rstd)], [])
    block = _block(n)
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
    layernorm_forward_kernel[(m,)](x, w, b, y, mean, rstd, n, eps, BLOCK=block, num_warps=num_warps)


def backward_programs(m: int) -> int:
    """Programs of the Triton backward: enough to fill the GPU (4 an SM), at most M;
    each adds one partial row of dw and db for the second kernel to sum."""
    return min(m, pick(gpu=4 * sm_count(), simulator=3))


def backward_triton(dy, x, w, mean, rstd, dx, dw, db) -> None:
    """As :func:`backward_numba` with Triton: layernorm_backward_kernel on
    backward_programs(M) programs, then column_sum_kernel for dw and for db.
    Arrays and errors as :func:`forward_triton`."""
    _require_all(dy=(dy, 2), x=(x, 2), w=(w, 1), mean=(mean, 1), rstd=(rstd, 1), dx=(dx, 2),
                 dw=(dw, 1), db=(db, 1))  # fmt: skip
    m, n = _shapes(
        x,
        w,
        None,
        [("dy", dy), ("dx", dx)],
        [("mean", mean), ("rstd", rstd)],
        [("dw", dw), ("db", db)],
    )
    block = _block(n)
    programs = backward_programs(m)
    dw_part = torch.empty(programs, n, device=x.device)
    db_part = torch.empty(programs, n, device=x.device)
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
    layernorm_backward_kernel[(programs,)](
        dy, x, w, mean, rstd, dx, dw_part, db_part, m, n, BLOCK=block, num_warps=num_warps
    )
    strip = min(128, block)
    for part, out in ((dw_part, dw), (db_part, db)):
        column_sum_kernel[(triton.cdiv(n, strip),)](
            part, out, programs, n, BLOCK_R=32, BLOCK_N=strip
        )


# ---------------------------------------------------------------- versions, as run() times them


def _new(shape, poison: bool) -> torch.Tensor:
    """An output: NaN-poisoned for a checked call (unwritten elements fail), else empty."""
    if poison:
        return torch.full(shape, poison_value(np.float32), device=bridge.device())
    return torch.empty(shape, device=bridge.device())


def _ours(forward, backward):
    """(forward(x, w, b, poison) -> (y, mean, rstd), step(x, w, b, dy, poison) ->
    (y, dx, dw, db)) from a pair of launchers."""

    def fwd(x, w, b, poison=False):
        m, n = x.shape
        y, mean, rstd = _new((m, n), poison), _new((m,), poison), _new((m,), poison)
        forward(x, w, b, y, mean, rstd)
        return y, mean, rstd

    def step(x, w, b, dy, poison=False):
        y, mean, rstd = fwd(x, w, b, poison)
        dx, dw, db = _new(x.shape, poison), _new(w.shape, poison), _new(w.shape, poison)
        backward(dy, x, w, mean, rstd, dx, dw, db)
        return y, dx, dw, db

    return fwd, step


def _torch(layer_norm):
    """forward and step as :func:`_ours` for ``layer_norm(x, w, b)`` (eager or compiled)
    with torch autograd for the backward."""

    def fwd(x, w, b, poison=False):
        return (layer_norm(x, w, b),)

    def step(x, w, b, dy, poison=False):
        x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
        y = layer_norm(x, w, b)
        return (y.detach(), *torch.autograd.grad(y, (x, w, b), dy))

    return fwd, step


def layer_norm_torch(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


# The kernels behind each of our versions' timed rows, for summary.py's closing table.
KERNELS = {
    "numba (block a row, atomics)": {
        "forward": ["layernorm_forward_block_row"],
        "forward + backward": [
            "layernorm_forward_block_row",
            "zero_fill",
            "layernorm_backward_dx_block_row",
            "layernorm_backward_weight_bias_atomic",
        ],
    },
    "triton (row a program, partial sums)": {
        "forward": ["layernorm_forward_kernel"],
        "forward + backward": [
            "layernorm_forward_kernel",
            "layernorm_backward_kernel",
            "column_sum_kernel",
        ],
    },
}


def versions() -> dict[str, tuple]:
    """name -> (forward, step) of every version this runtime has."""
    table = {"numba (block a row, atomics)": _ours(forward_numba, backward_numba)}
    if triton is not None:
        table["triton (row a program, partial sums)"] = _ours(forward_triton, backward_triton)
    table["torch eager"] = _torch(layer_norm_torch)
    if not is_simulator():
        table["torch.compile"] = _torch(torch.compile(layer_norm_torch, dynamic=False))
    return table


def run(shapes=None) -> list[Timing]:
    """Check every version (y, dx, dw, db) against float64 torch autograd at each
    (M, N) of ``shapes`` (default SHAPES), then time its forward and its forward +
    backward. Returns the Timings ("numba ... forward 4096x1024", ...)."""
    gen = torch.Generator().manual_seed(0)
    peaks = device_peaks()
    results = []
    for m, n in shapes or SHAPES:
        x, dy = (torch.randn(m, n, generator=gen).to(bridge.device()) for _ in range(2))
        w, b = (torch.randn(n, generator=gen).to(bridge.device()) for _ in range(2))
        ref = layernorm_reference(x, w, b, dy)
        tols = layernorm_tolerances(x, w, b, dy, ref)
        rows = []
        for name, (fwd, step) in versions().items():
            # First calls at this shape (compiles): the forward alone, then the step,
            # whose forward is warm by then; a fresh process's first step pays both.
            _, fwd_ms = timed_call(partial(fwd, x, w, b, True))
            outs, step_ms = timed_call(partial(step, x, w, b, dy, True))
            first_ms = {"forward": fwd_ms, "forward + backward": fwd_ms + step_ms}
            err = 0.0
            for what, got, r, tol in zip(("y", "dx", "dw", "db"), outs, ref, tols):
                err = max(err, check(got, r, tol, name=f"{name} {m}x{n} {what}"))
            for label, fn, floats in (("forward", fwd, 2), ("forward + backward", step, 5)):
                t = benchmark(
                    partial(fn, x, w, b) if fn is fwd else partial(fn, x, w, b, dy),
                    f"{name} {label} {m}x{n}",
                    nbytes=floats * m * n * 4,
                    peaks=peaks,
                    first_call_ms=first_ms[label],
                    hold_ms=vector_add.HOLD_MS,
                )
                t.extra["rel_error"] = err
                if name in KERNELS:
                    t.extra["kernel"] = KERNELS[name][label]
                rows.append(t)
        print(format_table(rows, title=f"layer norm {m} x {n} float32"))
        results += rows
    return results


def main(argv=None) -> int:
    args = script_parser(__doc__, "12_triton").parse_args(argv)
    if triton_env.MISSING:
        print(triton_env.MISSING)
        return 0
    if is_simulator():
        print("torch.compile: needs a GPU (Inductor generates Triton for CUDA); left out here")
    save_results(run(), args.out, "layernorm", triton=triton_env.VERSION)
    return 0


if __name__ == "__main__":
    run_script(main)
