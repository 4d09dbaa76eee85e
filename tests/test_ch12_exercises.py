"""Chapter 12 exercises (Triton): hostile checks, run on the solutions and on yours.

Each ``check_*`` takes the exercise's host function and raises (CheckError,
AssertionError) on a wrong one. Sizes: one element, one row, one short of and one
past a block, N a power of two and not, plus a fresh random one (``--seed`` replays
it). Every tensor is a view into a larger buffer of NaN guard cells: an output
element never written stays NaN, a store past the end lands in the guard (checked
bit for bit), a load past the end reads NaN into the result. Elementwise results
(12.1, 12.4) must equal float32 arithmetic exactly; sums, softmax and matmul are
compared with float64 within the roundings a float32 computation is allowed.

The ``test_broken_*`` tests prove each check bites: a forgotten mask, a wrong
offset, a softmax without its max subtracted (large inputs overflow) or with
padding loaded as 0, a K loop that drops the last partial tile, a grouped order
without its short last group. Without Triton the whole module skips with
triton_env.MISSING's one line.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import EPS32, CheckError, check, poison_value, rounding_tolerance
from common.internal.exercises import implementations, load_chapter_module

import inspect
import itertools
import linecache
import math
import textwrap

import numpy as np
import pytest

CHAPTER = "12_triton"
triton_env = load_chapter_module(CHAPTER, "triton_env")
if triton_env.MISSING:
    pytest.skip(triton_env.MISSING, allow_module_level=True)

import torch  # noqa: E402

sol = load_chapter_module(CHAPTER, "solutions")
IMPLS = implementations(CHAPTER)
DEVICE = "cpu" if triton_env.INTERPRETED else "cuda"
FAILS = (CheckError, AssertionError)
VEC, MMB = sol.VEC_BLOCK, sol.MM_BLOCK_M
PAD = 2048  # guard cells each side: more than any unmasked tile reaches past the end here
POISON_BITS = int(np.full(1, poison_value(np.float32), np.float32).view(np.int32)[0])
# Inputs' guard cells: another NaN, so that an unmasked lane that copies one (the
# interpreter keeps a NaN's bits through arithmetic) into an output's guard shows
INPUT_GUARD_BITS = 0x7FC0BEEF


# ---------------------------------------------------------------- guarded tensors
class Guarded:
    """A contiguous float32 tensor (``.t``) inside a buffer of NaN guard cells:
    filled with ``data`` if given, else with the poison NaN."""

    def __init__(self, shape, data=None, pad=PAD):
        self.shape, self.pad, self.n = tuple(shape), pad, math.prod(shape)
        fill = POISON_BITS if data is None else INPUT_GUARD_BITS
        bits = torch.full((self.n + 2 * pad,), fill, dtype=torch.int32, device=DEVICE)
        self.buffer = bits.view(torch.float32)
        self.t = self.buffer[pad : pad + self.n].view(self.shape)
        if data is not None:
            self.t.copy_(torch.from_numpy(np.ascontiguousarray(data, np.float32)))

    def host(self):
        return self.t.detach().cpu().numpy().astype(np.float64)

    def check_untouched(self, name):
        __tracebackhide__ = True
        bits = self.buffer.view(torch.int32).cpu().numpy()
        before = int((bits[: self.pad] != POISON_BITS).sum())
        after = int((bits[self.pad + self.n :] != POISON_BITS).sum())
        if before or after:
            raise CheckError(
                f"{name}: the kernel wrote outside the output ({before} cells before its "
                f"start, {after} past its end): a store without its mask? lanes past the "
                "end must be masked off"
            )


def guarded_input(data):
    return Guarded(np.shape(data), data).t


def check_exact(out, ref, name):
    """out must equal ref (float32 arithmetic, rounded as the kernel rounds) exactly."""
    __tracebackhide__ = True
    got = out.host()
    ref = np.asarray(ref, np.float64)
    bad = ~(got == ref)
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    unwritten = int(np.isnan(got).sum())
    hint = (
        f"{unwritten} never written (still NaN): a mask that drops real elements, or "
        "offsets that skip some?"
        if unwritten
        else "every element written, some with wrong values: offsets, or the formula?"
    )
    raise CheckError(
        f"{name}: {int(bad.sum())} of {got.size} elements wrong; first at {idx}: got "
        f"{float(got[idx])!r}, expected {float(ref[idx])!r}; {hint}"
    )


def normal(shape, rng, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


# ---------------------------------------------------------------- checks
def check_vector_add(fn, rng):
    for n in [1, VEC - 1, VEC, VEC + 1, 2 * VEC + 7, int(rng.integers(2, 3 * VEC))]:
        x, y = normal(n, rng), normal(n, rng)
        out = Guarded((n,))
        fn(guarded_input(x), guarded_input(y), out.t)
        name = f"vector_add n={n}"
        check_exact(out, x + y, name)
        out.check_untouched(name)
    x, y = normal(VEC + 3, rng), normal(VEC + 3, rng)  # in place: out is x
    xg = Guarded(x.shape, x)
    fn(xg.t, guarded_input(y), xg.t)
    check_exact(xg, x + y, "vector_add in place (out is x)")


def row_shapes(rng):
    """(M, N): one element, one row, N a power of two and not, a random one."""
    return [(1, 1), (1, 5), (3, 16), (4, 33), (2, 128), (5, 100)] + [
        (int(rng.integers(1, 6)), int(rng.integers(2, 200)))
    ]


def check_row_sums(fn, rng):
    for m, n in row_shapes(rng):
        x = normal((m, n), rng)
        out = Guarded((m,))
        fn(guarded_input(x), out.t)
        x64 = x.astype(np.float64)
        ref = x64.sum(axis=1)
        # n - 1 additions, each rounding by eps32 / 2 of a partial sum <= sum |x|
        tol = rounding_tolerance(ref, np.abs(x64).sum(axis=1), n, 1e-7)
        name = f"row_sums {m}x{n}"
        check(out.t, ref, tol, name)
        out.check_untouched(name)


def softmax_reference(x):
    z = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def softmax_tolerance(x):
    """Relative error allowed to each element: exp of a rounded x - m (its rounding
    times |x - m|, plus exp's own few ulps), n - 1 additions and a division. Each
    element within it, so the L2 relative error is too. A missing max overflows to
    NaN; padding loaded as 0 adds whole terms to the sum."""
    spread = float((x.max(axis=1, keepdims=True) - x).max())
    return (x.shape[1] + 8 + 2 * spread) * EPS32


def check_softmax(fn, rng):
    cases = [(shape, normal(shape, rng, 3.0)) for shape in row_shapes(rng)]
    cases += [((2, 37), normal((2, 37), rng, 3.0, 100.0))]  # exp(x) overflows float32
    cases += [((3, 20), normal((3, 20), rng, 3.0, -200.0))]  # exp(x) underflows to 0
    for (m, n), x in cases:
        out = Guarded((m, n))
        with np.errstate(all="ignore"):  # the interpreter's exp of a broken kernel
            fn(guarded_input(x), out.t)
        name = f"softmax_rows {m}x{n} (x in [{x.min():.3g}, {x.max():.3g}])"
        check(out.t, softmax_reference(x), softmax_tolerance(x), name)
        out.check_untouched(name)
    x = normal((3, 33), rng)
    xg = Guarded(x.shape, x)  # in place: out is x
    fn(xg.t, xg.t)
    check(xg.t, softmax_reference(x), softmax_tolerance(x), "softmax_rows in place")


def check_bias_relu(fn, rng):
    bm, bn = sol.BIAS_BLOCK_M, sol.BIAS_BLOCK_N
    shapes = [(1, 1), (1, 2 * bn + 3), (bm + 1, 1), (bm, bn), (bm + 1, bn + 1), (20, 70)]
    shapes += [(int(rng.integers(1, 40)), int(rng.integers(1, 80)))]
    for m, n in shapes:
        x, b = normal((m, n), rng), normal(n, rng)
        out = Guarded((m, n))
        fn(guarded_input(x), guarded_input(b), out.t)
        name = f"bias_relu {m}x{n}"
        check_exact(out, np.maximum(x + b[None, :], np.float32(0)), name)
        out.check_untouched(name)


def check_product(out, a, b, name):
    __tracebackhide__ = True
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64
    # a K-long dot product: K roundings, each of at most eps32 / 2 of sum |a||b| (Higham 3.1)
    tol = rounding_tolerance(ref, np.abs(a64) @ np.abs(b64), a.shape[1] + 1, 1e-7)
    check(out.t, ref, tol, name)
    out.check_untouched(name)


MATMUL_SHAPES = [(1, 1, 1), (MMB, MMB, MMB), (17, 15, 33), (5, 40, 20), (33, 17, 47)]


def check_matmul(fn, rng):
    shapes = MATMUL_SHAPES + [tuple(int(v) for v in rng.integers(1, 40, 3))]
    for m, n, k in shapes:
        a, b = normal((m, k), rng), normal((k, n), rng)
        out = Guarded((m, n))
        fn(guarded_input(a), guarded_input(b), out.t)
        check_product(out, a, b, f"matmul M={m} N={n} K={k}")


def grouped_order_reference(num_m, num_n, group):
    """(pid_m, pid_n) of each program: down `group` tile rows, then one column right."""
    order = []
    for first in range(0, num_m, group):
        rows = range(first, min(first + group, num_m))
        order += [(pm, pn) for pn in range(num_n) for pm in rows]
    return np.array(order, np.int32)


def check_grouped_matmul(fn, rng):
    cases = [(1, 1, 1, 4), (50, 40, 20, 2), (70, 20, 33, 4), (40, 33, 17, 1), (33, 33, 9, 8)]
    cases += [tuple(int(v) for v in rng.integers(1, 50, 3)) + (int(rng.integers(1, 5)),)]
    for m, n, k, group in cases:
        a, b = normal((m, k), rng), normal((k, n), rng)
        num_m, num_n = -(-m // MMB), -(-n // sol.MM_BLOCK_N)
        order = torch.full((num_m * num_n, 2), -1, dtype=torch.int32, device=DEVICE)
        out = Guarded((m, n))
        fn(guarded_input(a), guarded_input(b), out.t, group=group, order=order)
        name = f"grouped_matmul M={m} N={n} K={k} group={group}"
        want = grouped_order_reference(num_m, num_n, group)
        got = order.cpu().numpy()
        wrong = np.flatnonzero((got != want).any(axis=1))
        if wrong.size:
            p = int(wrong[0])
            raise CheckError(
                f"{name}: program {p} took tile {tuple(got[p])}, expected {tuple(want[p])} "
                f"({wrong.size} of {len(want)} programs wrong; {num_m} x {num_n} tiles, the "
                f"last group has {num_m - (num_m - 1) // group * group} tile rows)"
            )
        check_product(out, a, b, name)
    a, b = normal((20, 30), rng), normal((30, 18), rng)
    out = Guarded((20, 18))
    fn(guarded_input(a), guarded_input(b), out.t)  # default group, order not recorded
    check_product(out, a, b, "grouped_matmul without order")


# ---------------------------------------------------------------- exercise tests
EXERCISES = [  # (the exercise's host function, its check), in the exercises' order
    ("vector_add", check_vector_add),
    ("row_sums", check_row_sums),
    ("softmax_rows", check_softmax),
    ("bias_relu", check_bias_relu),
    ("matmul", check_matmul),
    ("grouped_matmul", check_grouped_matmul),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "check_fn"), EXERCISES, ids=[name for name, _ in EXERCISES])
def test_exercise(name, check_fn, impl, rng):
    check_fn(getattr(impl, name), rng)


def _t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.ones(shape, dtype=dtype, device=device)


def _refusals(impl):
    """(exercise, call, error) triples: each call must raise error before a launch."""
    f64, meta = torch.float64, "meta"
    x8, sq = _t(8), _t(16, 16)
    return {
        "vector_add": [
            (lambda: impl.vector_add(np.ones(8, np.float32), x8, _t(8)), TypeError),
            (lambda: impl.vector_add(_t(8, dtype=f64), x8, _t(8)), TypeError),
            (lambda: impl.vector_add(x8, _t(8), _t(8, dtype=f64)), TypeError),
            (lambda: impl.vector_add(x8, _t(7), _t(8)), ValueError),
            (lambda: impl.vector_add(x8, x8, _t(9)), ValueError),
            (lambda: impl.vector_add(_t(16)[::2], x8, _t(8)), ValueError),
            (lambda: impl.vector_add(_t(0), _t(0), _t(0)), ValueError),
            (lambda: impl.vector_add(_t(2, 4), _t(2, 4), _t(2, 4)), ValueError),
            (lambda: impl.vector_add(x8, x8, _t(8, device=meta)), ValueError),
        ],
        "row_sums": [
            (lambda: impl.row_sums(np.ones((2, 3), np.float32), _t(2)), TypeError),
            (lambda: impl.row_sums(_t(2, 3, dtype=f64), _t(2)), TypeError),
            (lambda: impl.row_sums(_t(2, 3), _t(3)), ValueError),
            (lambda: impl.row_sums(_t(6), _t(6)), ValueError),
            (lambda: impl.row_sums(_t(3, 2).t(), _t(2)), ValueError),
            (lambda: impl.row_sums(_t(1, sol.MAX_ROW + 1), _t(1)), ValueError),
            (lambda: impl.row_sums(_t(2, 3), _t(2, device=meta)), ValueError),
        ],
        "softmax_rows": [
            (lambda: impl.softmax_rows(_t(2, 3).tolist(), _t(2, 3)), TypeError),
            (lambda: impl.softmax_rows(_t(2, 3, dtype=torch.float16), _t(2, 3)), TypeError),
            (lambda: impl.softmax_rows(_t(2, 3), _t(3, 2)), ValueError),
            (lambda: impl.softmax_rows(_t(3, 2).t(), _t(2, 3)), ValueError),
            (lambda: impl.softmax_rows(_t(2, 0), _t(2, 0)), ValueError),
            (lambda: impl.softmax_rows(_t(1, 5000), _t(1, 5000)), ValueError),
            (lambda: impl.softmax_rows(_t(2, 3), _t(2, 3, device=meta)), ValueError),
        ],
        "bias_relu": [
            (lambda: impl.bias_relu(_t(2, 3), np.ones(3, np.float32), _t(2, 3)), TypeError),
            (lambda: impl.bias_relu(_t(2, 3), _t(3, dtype=f64), _t(2, 3)), TypeError),
            (lambda: impl.bias_relu(_t(2, 3), _t(2), _t(2, 3)), ValueError),
            (lambda: impl.bias_relu(_t(2, 3), _t(3), _t(3, 2)), ValueError),
            (lambda: impl.bias_relu(_t(3, 2).t(), _t(3), _t(2, 3)), ValueError),
            (lambda: impl.bias_relu(_t(2, 3), _t(3, device=meta), _t(2, 3)), ValueError),
        ],
        "matmul": [
            (lambda: impl.matmul(np.ones((4, 4), np.float32), _t(4, 4), _t(4, 4)), TypeError),
            (lambda: impl.matmul(_t(4, 4, dtype=f64), _t(4, 4), _t(4, 4)), TypeError),
            (lambda: impl.matmul(_t(4, 5), _t(4, 4), _t(4, 4)), ValueError),
            (lambda: impl.matmul(_t(4, 5), _t(5, 3), _t(4, 4)), ValueError),
            (lambda: impl.matmul(_t(5, 4).t(), _t(5, 3), _t(4, 3)), ValueError),
            (lambda: impl.matmul(sq, _t(16, 16), sq), ValueError),  # out is a
            (lambda: impl.matmul(_t(4, 4), _t(4, 4), _t(4, 4, device=meta)), ValueError),
        ],
        "grouped_matmul": [
            (lambda: impl.grouped_matmul(_t(4, 4, dtype=f64), _t(4, 4), _t(4, 4)), TypeError),
            (lambda: impl.grouped_matmul(_t(4, 5), _t(4, 4), _t(4, 4)), ValueError),
            (lambda: impl.grouped_matmul(_t(4, 4), sq[:4, :4], _t(4, 4)), ValueError),
            (lambda: impl.grouped_matmul(_t(4, 16), sq, _t(4, 16), group=0), ValueError),
            (lambda: impl.grouped_matmul(_t(4, 16), sq, _t(4, 16), group=2.0), ValueError),
            (
                lambda: impl.grouped_matmul(_t(4, 16), sq, _t(4, 16), order=_t(1, 2)),
                TypeError,
            ),
            (
                lambda: impl.grouped_matmul(
                    _t(4, 16), sq, _t(4, 16), order=_t(2, 2, dtype=torch.int32)
                ),
                ValueError,
            ),
        ],
    }


class _RecordingKernel:
    """Stands in for a kernel: ``kernel[grid](...)`` records the launch, runs nothing."""

    def __init__(self, name, launched):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(self.name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", [name for name, _ in EXERCISES])
def test_bad_arguments_are_refused_before_any_launch(name, impl, monkeypatch):
    launched = []
    for kernel in [k for k in vars(impl.module) if k.endswith("_kernel")]:
        monkeypatch.setattr(impl.module, kernel, _RecordingKernel(kernel, launched))
    for k, (call, error) in enumerate(_refusals(impl)[name]):
        with pytest.raises(error):
            call()
        assert not launched, f"{name}: bad call {k} launched {launched} before raising"


# ---------------------------------------------------------------- broken kernels fail
_serial = itertools.count(1)


def triton_mutant(kernel, *edits, **globals_):
    """A copy of a ``@triton.jit`` function with each (old, new) source edit applied
    (each ``old`` exactly once) and ``globals_`` replacing names it uses."""
    fn = kernel.fn
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        assert src.count(old) == 1, f"{old!r} occurs {src.count(old)} times in {fn.__name__}"
        src = src.replace(old, new)
    filename = f"<triton mutant {next(_serial)} of {fn.__name__}>"
    # Triton reads a kernel's source through inspect.getsource: register it
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace = {**fn.__globals__, **globals_}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[fn.__name__]


def _expect_failure(kernel_name, check_fn, launcher, rng, monkeypatch, *edits):
    monkeypatch.setattr(sol, kernel_name, triton_mutant(getattr(sol, kernel_name), *edits))
    with np.errstate(all="ignore"), pytest.raises(FAILS):
        check_fn(launcher, rng)


@pytest.mark.parametrize(
    "edit",
    [
        ("mask = offsets < n\n", "mask = offsets < n + BLOCK  # wrong: no mask\n"),
        ("pid * BLOCK + tl.arange", "pid + tl.arange"),  # wrong: blocks overlap
    ],
    ids=["no-mask", "offset-without-block"],
)
def test_broken_vector_add_fails(edit, rng, monkeypatch):
    _expect_failure("vector_add_kernel", check_vector_add, sol.vector_add, rng, monkeypatch, edit)


@pytest.mark.parametrize(
    "edit",
    [
        ("mask = cols < n_cols", "mask = cols < BLOCK_N"),
        ("row * n_cols + cols", "row * BLOCK_N + cols"),
    ],
    ids=["no-mask", "row-stride-block"],
)
def test_broken_row_sums_fails(edit, rng, monkeypatch):
    _expect_failure("row_sums_kernel", check_row_sums, sol.row_sums, rng, monkeypatch, edit)


@pytest.mark.parametrize(
    "edit",
    [
        ("z = x - tl.max(x, axis=0)", "z = x  # wrong: exp overflows"),
        ('other=-float("inf")', "other=0.0"),
    ],
    ids=["no-max-subtraction", "padding-zero"],
)
def test_broken_softmax_fails(edit, rng, monkeypatch):
    _expect_failure("softmax_kernel", check_softmax, sol.softmax_rows, rng, monkeypatch, edit)


@pytest.mark.parametrize(
    "edit",
    [
        ("(rows[:, None] < n_rows) & ", ""),  # wrong: rows past M written
        ("rows[:, None] * n_cols", "rows[:, None] * BLOCK_N"),  # wrong: row stride
        ("b = tl.load(b_ptr + cols", "b = tl.load(b_ptr + cols * 0"),  # wrong: one bias
    ],
    ids=["no-row-mask", "row-stride-block", "one-bias"],
)
def test_broken_bias_relu_fails(edit, rng, monkeypatch):
    _expect_failure("bias_relu_kernel", check_bias_relu, sol.bias_relu, rng, monkeypatch, edit)


@pytest.mark.parametrize(
    "edit",
    [
        ("range(0, tl.cdiv(K, BLOCK_K))", "range(0, K // BLOCK_K)"),  # drops the partial tile
        ("mask=(k[:, None] < K) & (cols[None, :] < N)", "mask=cols[None, :] < N"),
        ("    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)", "    pass"),
    ],
    ids=["k-loop-drops-last-tile", "no-k-mask-on-b", "no-store"],
)
def test_broken_matmul_fails(edit, rng, monkeypatch):
    _expect_failure("matmul_kernel", check_matmul, sol.matmul, rng, monkeypatch, edit)


@pytest.mark.parametrize(
    "edit",
    [
        ("tl.minimum(num_pid_m - first_m, GROUP)", "GROUP"),  # wrong: no short last group
        ("pid_n = (pid % group_size) // rows_here", "pid_n = pid // num_pid_m"),
    ],
    ids=["no-short-last-group", "wrong-column"],
)
def test_broken_grouped_matmul_fails(edit, rng, monkeypatch):
    wrong_tile = triton_mutant(sol.grouped_tile, edit)
    kernel = triton_mutant(sol.grouped_matmul_kernel, grouped_tile=wrong_tile)
    monkeypatch.setattr(sol, "grouped_matmul_kernel", kernel)
    with pytest.raises(FAILS):
        check_grouped_matmul(sol.grouped_matmul, rng)


def test_references_match_their_definitions():
    """The checks are only as good as their references."""
    assert grouped_order_reference(3, 2, 2).tolist() == [
        [0, 0],
        [1, 0],
        [0, 1],
        [1, 1],
        [2, 0],
        [2, 1],
    ]
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    np.testing.assert_allclose(softmax_reference(x + 1000), softmax_reference(x), rtol=1e-12)
    np.testing.assert_allclose(softmax_reference(x)[0], np.exp(x[0]) / np.exp(x[0]).sum(), 1e-6)
