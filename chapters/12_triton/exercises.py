# ruff: noqa: F841, B007  (stubs: the TODO lines will use these names)
"""Chapter 12 exercises: Triton kernels, one block of data a program.

Each exercise is a host function whose docstring is the spec. The ``@triton.jit``
kernel stub sits right above it: fill the lines marked ``# TODO``, then delete the
``raise NotImplementedError`` line of the host function (the argument checks and the
launch below it are written for you). Check your work with

    python -m pytest tests/test_ch12_exercises.py -q

12.1 vector_add      out = x + y: tl.program_id, tl.arange and a mask for the last block
12.2 row_sums        out[i] = sum_j x[i, j]: one program a row, tl.sum, masked lanes load 0
12.3 softmax_rows    a fused row softmax: masked lanes load -inf, the max subtracted first
12.4 bias_relu       out = max(x + b, 0) over (M, N) in 2-D blocks: offsets and masks by broadcasting
12.5 matmul          out = a @ b in tiles with tl.dot: a loop over K, masks on every edge
12.6 grouped_matmul  12.5 with a 1-D grid in grouped order: GROUP_M row tiles share b's columns

A Triton kernel is written for one *program* (a CUDA block): ``tl.program_id(0)``
says which, ``tl.arange(0, BLOCK)`` is the block of offsets it handles (BLOCK a
power of two, a ``tl.constexpr``), ``tl.load`` / ``tl.store`` take a block of
pointers and a mask, and every lane whose mask is False neither reads nor writes
(a masked ``tl.load`` gives ``other`` there). Triton splits the block across the
threads itself. (Tillet, Kung & Cox, "Triton: an intermediate language and compiler
for tiled neural network computations", MAPL 2019; the tutorials at
https://triton-lang.org/main/getting-started/tutorials/, whose 01 vector add,
02 fused softmax and 03 matrix multiplication these exercises follow.)

All tensors are torch float32 and contiguous, on one device: CUDA tensors on a GPU;
without one Triton runs in its interpreter (``TRITON_INTERPRET=1``, set by
common.runtime) on CPU tensors, one program at a time, in NumPy. The checks compare
with float64 references on sizes that are not multiples of the block (one element,
one row, N a power of two and not), with fresh random data, outputs pre-filled with
NaN and NaN guard cells around every tensor: a lane left unmasked reads or writes
them and fails.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling

import torch  # noqa: F401

triton_env = import_sibling(__file__, "triton_env")
triton_env.require()  # without Triton: one RuntimeError line that says how to install it
triton, tl = triton_env.triton, triton_env.tl
solutions = import_sibling(__file__, "solutions")

VEC_BLOCK = solutions.VEC_BLOCK  # 12.1: elements a program
MAX_ROW = solutions.MAX_ROW  # 12.2, 12.3: the longest row one program holds whole
BIAS_BLOCK_M, BIAS_BLOCK_N = solutions.BIAS_BLOCK_M, solutions.BIAS_BLOCK_N  # 12.4
MM_BLOCK_M, MM_BLOCK_N = solutions.MM_BLOCK_M, solutions.MM_BLOCK_N  # 12.5, 12.6
MM_BLOCK_K = solutions.MM_BLOCK_K
GROUP_M = solutions.GROUP_M  # 12.6: row tiles in one group

# Given (solutions.py, where each has its docstring): argument checks that raise
# TypeError / ValueError before any launch, and the power-of-two block of a row.
require_tensor, require_same_device = solutions.require_tensor, solutions.require_same_device
require_shape, require_separate = solutions.require_shape, solutions.require_separate
require_matmul, require_order, row_block = (
    solutions.require_matmul,
    solutions.require_order,
    solutions.row_block,
)


# ---------------------------------------------------------------- 12.1 masked vector add
@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)  # TODO: program pid handles elements pid * BLOCK + 0..BLOCK-1
    mask = offsets < 0  # TODO: True for the offsets inside the n elements
    x = tl.zeros((BLOCK,), dtype=tl.float32)  # TODO: tl.load(x_ptr + offsets, mask=mask)
    y = tl.zeros((BLOCK,), dtype=tl.float32)  # TODO: the same from y_ptr
    tl.store(out_ptr + offsets, x + y, mask=mask)


def vector_add(x, y, out):
    """Exercise 12.1: ``out = x + y``, elementwise, in float32.

    x, y, out: float32 (n,) contiguous torch tensors on one device, n >= 1; out may be
    x or y. Launch: a 1-D grid of ceil(n / VEC_BLOCK) programs, program pid adds
    elements pid * VEC_BLOCK ... pid * VEC_BLOCK + VEC_BLOCK - 1; in the last one,
    the offsets at n and past it must be masked off: their loads would read past the
    end of x and y, and their stores write past the end of out (on a GPU silently;
    the checks put NaN guard cells there). The result must equal ``x + y`` rounded
    once, exactly. Source: Triton tutorial 01, "Vector Addition".
    Raises TypeError (not a torch tensor, not float32) and ValueError (not 1-D,
    empty, shapes that differ, not contiguous, devices that differ, a CPU tensor
    with Triton compiled for a GPU), all before any launch.
    """
    raise NotImplementedError("Exercise 12.1: fill the TODOs in vector_add_kernel")
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
    mask = cols < 0  # TODO: True for the n_cols real columns (BLOCK_N is a power of two >= them)
    v = tl.zeros(
        (BLOCK_N,), dtype=tl.float32
    )  # TODO: load row `row` (it starts at row * n_cols), masked lanes 0.0 (other=)
    total = tl.sum(v, axis=0)
    pass  # TODO: tl.store the total at out_ptr + row


def row_sums(x, out):
    """Exercise 12.2: ``out[i] = sum_j x[i, j]``.

    x: float32 (M, N) contiguous torch tensor, 1 <= N <= MAX_ROW; out: float32 (M,),
    same device. Launch: M programs, one a row; program i loads its whole row as
    one block of BLOCK_N = next_power_of_2(N) lanes (``tl.arange`` needs a power of
    two: row_block(N), given), the N - BLOCK_N lanes past the row masked and loaded
    as 0.0 (``other=0.0``: the sum's identity), and ``tl.sum`` adds them. Row i
    starts at x_ptr + i * N (N, the row length, not BLOCK_N). Compared with a
    float64 sum within the rounding N float32 additions allow (Higham, "Accuracy
    and Stability of Numerical Algorithms", 2nd ed., sec. 4.2). Source: Triton
    tutorial 02 (its softmax), the reduction half.
    Raises TypeError / ValueError (as 12.1; x not 2-D, out not (M,), N > MAX_ROW),
    before any launch.
    """
    raise NotImplementedError("Exercise 12.2: fill the TODOs in row_sums_kernel")
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
    mask = cols < 0  # TODO: True for the n_cols real columns
    x = tl.zeros(
        (BLOCK_N,), dtype=tl.float32
    )  # TODO: load the row, masked lanes -inf: other=-float("inf")
    z = x  # TODO: subtract the row's max (tl.max(x, axis=0)): exp of a large x overflows
    e = tl.exp(z)
    pass  # TODO: store e / (the sum of e over the row) to the row of out, masked


def softmax_rows(x, out):
    """Exercise 12.3: ``out[i, j] = exp(x[i, j]) / sum_k exp(x[i, k])``, row by row.

    x, out: float32 (M, N) contiguous torch tensors on one device, 1 <= N <= MAX_ROW;
    out may be x (each program reads its row whole before it writes it).
    Launch: M programs, one a row, BLOCK_N = row_block(N) lanes: one read and one
    write of each element (the "fused" softmax: torch's eager version goes over
    memory 5 times). Two details make it right:
    * the lanes past the row load ``-inf`` (``other=-float("inf")``): exp(-inf) = 0
      adds nothing to the sum, and -inf is never the max (0.0 there would be both);
    * the row's max m is subtracted before ``tl.exp``: exp(x - m) is in (0, 1], while
      exp(x) overflows to inf for x > 88.7 (inf / inf = NaN) and underflows to 0 for
      every x < -103 (0 / 0 = NaN). Mathematically the same: softmax(x) = softmax(x - m).
    Compared with a float64 softmax elementwise, within the roundings of exp, the
    sum and the division. Source: Triton tutorial 02, "Fused Softmax"; Goodfellow,
    Bengio & Courville, "Deep Learning", sec. 4.1 (the max subtraction).
    Raises TypeError / ValueError (as 12.1; x not 2-D, out not x's shape, N > MAX_ROW),
    before any launch.
    """
    raise NotImplementedError("Exercise 12.3: fill the TODOs in softmax_kernel")
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
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's rows
    cols = tl.arange(0, BLOCK_N)  # TODO: this program's columns (program_id(1))
    mask = (rows[:, None] < 0) & (cols[None, :] < 0)  # TODO: inside n_rows and n_cols
    offsets = rows[:, None] + cols[None, :]  # TODO: row-major: row r starts at r * n_cols
    x = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # TODO: load x, masked
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # TODO: load b at cols, masked by cols alone
    y = x + b[None, :]  # b[None, :]: one bias a column, the same for every row
    pass  # TODO: store max(y, 0) (tl.maximum) at offsets, masked


def bias_relu(x, b, out):
    """Exercise 12.4: ``out[i, j] = max(x[i, j] + b[j], 0)``: a layer's bias and ReLU in one pass.

    x, out: float32 (M, N) contiguous torch tensors, b: float32 (N,), on one device;
    out may be x. Launch: a 2-D grid of (ceil(M / BIAS_BLOCK_M), ceil(N / BIAS_BLOCK_N))
    programs, each a BIAS_BLOCK_M x BIAS_BLOCK_N tile. Make the tile's offsets by
    broadcasting a column of row indices against a row of column indices,
    ``rows[:, None] * N + cols[None, :]``, and its mask the same way: a tile on the
    right edge has columns past N, one on the bottom edge rows past M, and both
    must be masked (a column past N is the next row's first element: a wrong value,
    not an error). The result must equal float32 ``max(x + b, 0)`` exactly.
    Source: Triton's tutorials (03's 2-D blocks of pointers); the epilogue of a
    fused linear layer.
    Raises TypeError / ValueError (as 12.1; b not (N,), out not x's shape), before
    any launch.
    """
    raise NotImplementedError("Exercise 12.4: fill the TODOs in bias_relu_kernel")
    x, b = require_tensor(x, "x", 2), require_tensor(b, "b", 1)
    out = require_tensor(out, "out", 2)
    require_same_device(x=x, b=b, out=out)
    m, n = x.shape
    require_shape(b, (n,), "b", " (one bias a column of x)")
    require_shape(out, x.shape, "out", " (x's)")
    grid = (triton.cdiv(m, BIAS_BLOCK_M), triton.cdiv(n, BIAS_BLOCK_N))
    bias_relu_kernel[grid](x, b, out, m, n, BLOCK_M=BIAS_BLOCK_M, BLOCK_N=BIAS_BLOCK_N)


# ---------------------------------------------------------------- 12.5 tiled matmul
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
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's rows of a and c
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # its columns of b and c
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, 0):  # TODO: every K tile, the last one partial: tl.cdiv(K, BLOCK_K) of them
        k = k0 * BLOCK_K + ks
        a = tl.zeros(
            (BLOCK_M, BLOCK_K), dtype=tl.float32
        )  # TODO: a[rows, k] (a is M x K), masked, other=0.0
        b = tl.zeros(
            (BLOCK_K, BLOCK_N), dtype=tl.float32
        )  # TODO: b[k, cols] (b is K x N), masked, other=0.0
        acc = tl.dot(a, b, acc, input_precision="ieee")  # acc += a @ b, in full float32
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    pass  # TODO: store acc at c[rows, cols] (c is M x N), masked


def matmul(a, b, out):
    """Exercise 12.5: ``out = a @ b``, one MM_BLOCK_M x MM_BLOCK_N tile of out a program.

    a: float32 (M, K), b: float32 (K, N), out: float32 (M, N) contiguous torch
    tensors on one device; out must not overlap a or b. Launch: a 2-D grid of
    (ceil(M / MM_BLOCK_M), ceil(N / MM_BLOCK_N)) programs. Program (pm, pn) keeps a
    float32 accumulator tile and walks K in MM_BLOCK_K steps: load a's tile
    a[rows, k] and b's tile b[k, cols] and ``acc = tl.dot(a, b, acc)``. Three edges
    need masks, with ``other=0.0`` so that padding adds 0 to the dot products: rows
    past M, columns past N, and k past K in the last K tile, which is partial
    whenever K is not a multiple of MM_BLOCK_K: the loop runs ``tl.cdiv(K,
    MM_BLOCK_K)`` times, not K // MM_BLOCK_K. ``input_precision="ieee"`` keeps float32
    products in float32 (the default on a GPU with tensor cores is TF32: 10-bit
    mantissas, ~1e-3 relative error; "ieee" is accepted from Triton 3.0 on). Compared
    with a float64 matmul within the rounding a K-long float32 dot product allows
    (Higham, sec. 3.1). Source: Triton tutorial 03, "Matrix Multiplication".
    Raises TypeError / ValueError (as 12.1; a.shape[1] != b.shape[0], out not (M, N),
    out overlapping a or b), before any launch.
    """
    raise NotImplementedError("Exercise 12.5: fill the TODOs in matmul_kernel")
    m, n, k = require_matmul(a, b, out)
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N))
    matmul_kernel[grid](
        a, b, out, m, n, k, BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K
    )


# ---------------------------------------------------------------- 12.6 grouped program order
@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    group_size = GROUP * num_pid_n  # programs in one group: GROUP tile rows, every column
    first_m = 0  # TODO: the first tile row of pid's group: (pid // group_size) * GROUP
    rows_here = GROUP  # TODO: the last group can be shorter: at most num_pid_m - first_m rows
    pid_m = first_m  # TODO: down the group's rows first: + (pid % group_size) % rows_here
    pid_n = pid  # TODO: then across: (pid % group_size) // rows_here
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
    pass  # TODO: the rest of your 12.5 kernel from `ks = ...` on, unchanged


def grouped_matmul(a, b, out, group=GROUP_M, order=None):
    """Exercise 12.6: ``out = a @ b`` as 12.5, on a 1-D grid whose programs take tiles in groups.

    a, b, out: as 12.5; group: an int >= 1; order: None, or an int32
    (programs, 2) tensor on out's device, where program pid records the tile
    (pid_m, pid_n) it took (the given RECORD lines). Launch: programs =
    ceil(M / MM_BLOCK_M) * ceil(N / MM_BLOCK_N), one a tile. Row-major order (pid_m =
    pid // num_pid_n) has the programs running at once share one row of a tiles but
    read every column tile of b; grouped order goes down ``group`` tile rows before
    it moves one column right, so programs running together share both and
    re-read them from L2 instead of DRAM. Program pid: group g = pid // (group *
    num_pid_n) covers tile rows g * group ... g * group + rows_here - 1, rows_here =
    min(group, num_pid_m - g * group) (the last group is short when num_pid_m is not
    a multiple of group); inside it, with p = pid % (group * num_pid_n),
    pid_m = g * group + p % rows_here and pid_n = p // rows_here. Every tile is taken
    exactly once: the order is checked exactly, the result as 12.5's.
    Source: Triton tutorial 03, "L2 Cache Optimizations".
    Raises TypeError / ValueError (as 12.5; a bad group; order not int32 (programs,
    2) on out's device), before any launch.
    """
    raise NotImplementedError("Exercise 12.6: fill the TODOs in grouped_tile and the kernel")
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
