"""Chapter 10 exercises: each is checked on solutions.py and on the learner's
exercises.py, and each check is shown to fail on a wrong version (a backward
with a sign error, a fake of the wrong shape or device, a launch on the wrong
stream, a kernel that reads a non-contiguous input as if it were contiguous,
a ReLU mask of >= 0, an operator that writes into its input, a setup_context
that does not save for backward, ...).

Every operator call in a check goes through :func:`call_op`, which holds it to
what any operator owes its caller: its launches go to torch's current stream,
and its inputs are left as they were. Every operator meets inputs in three
layouts (:func:`laid_out`), and its fake implementation is run on "meta"
copies of the inputs and compared with the real output (:func:`check_fake`).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import CheckError
from common.checking import EPS32, check, random_array, rounding_tolerance
from common.internal.exercises import Implementation, implementations, load_chapter_module

import ast
import contextlib
import functools
import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mutants import mutant
from numba import cuda
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests import OpCheckError

CHAPTER = "10_pytorch_extensions"
bridge = load_chapter_module(CHAPTER, "bridge")
sol = load_chapter_module(CHAPTER, "solutions")
checks = load_chapter_module(CHAPTER, "operator_checks")
DEVICE = bridge.device()
F32, F64 = torch.float32, torch.float64
# float32: a few roundings of O(1) values; float64: the same kernels, to ~1e-16
TOL = {F32: 1e-5, F64: 1e-12}
EPS = {F32: EPS32, F64: float(np.finfo(np.float64).eps)}
# Mismatches that gradcheck and opcheck report.
GRAD_ERRORS = (
    importlib.import_module("torch.autograd.gradcheck").GradcheckError,  # the name is the function
    OpCheckError,
)
# What a check raises on a wrong version: a failed assert, check or
# pytest.raises (pytest's Failed is no AssertionError), gradcheck or opcheck.
CHECK_FAILS = (AssertionError, pytest.fail.Exception, *GRAD_ERRORS)


def tensor(rng, shape, dtype=F32, low=None, high=None, requires_grad=False):
    """Fresh random data as a torch tensor on the course's device."""
    np_dtype = {F32: np.float32, F64: np.float64, torch.int64: np.int64}[dtype]
    t = torch.from_numpy(random_array(shape, np_dtype, rng, low, high)).to(DEVICE)
    return t.requires_grad_(requires_grad)


def away_from_zero(rng, shape, dtype, margin=0.1):
    """Random values with |v| >= margin: a kink (ReLU at 0) stays out of gradcheck's
    reach, and an upstream gradient of this size is never too small to see."""
    z = tensor(rng, shape, F64)
    return (torch.sign(z) * (margin + z.abs())).to(dtype)


def rounding_tol(ref, magnitude, roundings, dtype):
    """TOL[dtype], or more where the rounded terms (of size ``magnitude``) cancel:
    ``roundings`` roundings of ``dtype`` (common.checking.rounding_tolerance, which
    counts in float32 eps; a float64 kernel rounds 2**-29 times as much)."""
    return rounding_tolerance(ref, magnitude, roundings * EPS[dtype] / EPS32, TOL[dtype])


def raw(impl, name):
    """The module's own object (a custom op itself, not the test wrapper around it)."""
    return getattr(impl.module if isinstance(impl, Implementation) else impl, name)


@contextlib.contextmanager
def autograd_replaced(op, backward, setup_context, restore):
    """``op`` with another autograd formula for the block; ``restore`` = the
    (backward, setup_context) to register again after it."""
    op.register_autograd(backward, setup_context=setup_context)
    try:
        yield
    finally:
        op.register_autograd(restore[0], setup_context=restore[1])


class RecordingContext:
    """Stands in for autograd's ctx when setup_context and backward are called directly."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


# ------------------------------------------------------------------ launch recording


@pytest.fixture
def launches():
    """Every kernel launch in the test (operator_checks.LaunchLog; ``seen.clear()``
    starts again).

    operator_checks.recorded_launches: bridge.torch_stream() returns a mark,
    which the launch recorder swaps back for the real stream before the launch
    goes on, so kernels run as usual. In the simulator, where there are no
    streams, this is how a launch on Numba's default stream (no stream given,
    cuda.default_stream(), 0) is told apart from one on torch's current stream.
    """
    with checks.recorded_launches() as log:
        yield log


# ------------------------------------------------- what every operator call owes


def outputs(out):
    """The tensors among an operator's results (a tensor or a tuple)."""
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def call_op(launches, op, *args, what, watch=()):
    """``op(*args)``, held to what every operator owes its caller.

    Every kernel it launches goes to torch's current stream (a launch on
    Numba's default stream can run before the torch work that wrote its
    inputs), and it writes into none of its input tensors, nor into those in
    ``watch`` (the tensors a backward reads from ctx): torch was told
    ``mutates_args=()``, and a changed input silently corrupts whatever reads
    it next (autograd's saved tensors, the caller's data). Returns the output.
    """
    inputs = [t for t in (*args, *watch) if isinstance(t, torch.Tensor)]
    before = [t.detach().clone() for t in inputs]
    launches.seen.clear()
    out = op(*args)
    if any(t.numel() for t in outputs(out)):
        launches.check_on_torch_stream(what)
    for k, (now, then) in enumerate(zip(inputs, before)):
        assert torch.equal(now.detach(), then), (
            f"{what} wrote into its input tensor {k} ({tuple(now.shape)} {now.dtype}): "
            "an operator with mutates_args=() leaves its inputs as they were"
        )
    return out


LAYOUTS = ("contiguous", "transposed", "sliced")


def laid_out(t, layout):
    """``t``'s values in another memory layout, as a new leaf.

    "transposed": the last two dimensions' strides swapped (a 1-D ``t`` is
    "sliced" instead). "sliced": every other element of rows twice as long,
    from offset 1, the gaps poisoned (NaN; for integers -2**63, a class index
    out of range). A kernel handed a non-contiguous tensor's storage as if it
    were contiguous reads the wrong elements or the poison.
    """
    if layout == "contiguous":
        return t
    data = t.detach()
    if layout == "transposed" and t.dim() >= 2:
        out = data.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        poison = math.nan if t.is_floating_point() else torch.iinfo(t.dtype).min
        base = torch.full((*t.shape[:-1], 2 * t.shape[-1]), poison, dtype=t.dtype, device=t.device)
        out = base[..., 1::2]
        out.copy_(data)
    return out.detach().requires_grad_(t.requires_grad)


def check_fake(op, args, out, what):
    """``op``'s fake implementation against ``out``, the real operator's output for ``args``.

    Run on "meta" copies of ``args``, the fake must give the real output's
    shapes and dtypes, on the inputs' device ("meta"). A fake that allocates
    without ``device=`` (``torch.empty(shape)``) returns CPU tensors: with
    CUDA inputs torch.compile would then trace the rest of the graph on the
    wrong device. In the simulator, where real tensors live on the CPU too,
    the meta device is what shows it.
    """
    meta = [a.detach().to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    fakes, reals = outputs(op(*meta)), outputs(out)
    assert len(fakes) == len(reals), f"{what}'s fake returns {len(fakes)} tensors, not {len(reals)}"
    for k, (fake, real) in enumerate(zip(fakes, reals)):
        got = (tuple(fake.shape), fake.dtype, fake.device)
        want = (tuple(real.shape), real.dtype, torch.device("meta"))
        assert got == want, (
            f"{what}'s fake, output {k}: {got}, expected {want} (the real output's shape and "
            "dtype, on the inputs' device: allocate with x.new_empty or device=x.device)"
        )


# ------------------------------------------------------- exercises.py copies nothing

# Defined again in exercises.py although solutions.py has them, because each
# names this file's own functions: an operator registered in the learner's
# namespace (with the learner's fake or autograd), and bias_relu's autograd
# formula, which calls the learner's bias_relu_backward.
REGISTERED_AGAIN = {"scaled_tanh", "row_sums", "brier_score", "bias_relu_grad"}


def top_level_functions(path):
    """{name: ast.dump of the def without its docstring} of a file's top-level functions."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            found[node.name] = ast.dump(ast.Module(body=[*node.decorator_list, *body]))
    return found


def test_exercises_import_what_is_not_an_exercise():
    # A helper or a given kernel copied into exercises.py drifts from solutions.py's;
    # exercises.py imports them, and holds the learner's stubs and registrations.
    exercises = top_level_functions(Implementation(CHAPTER, "exercises").path)
    solutions = top_level_functions(Implementation(CHAPTER, "solutions").path)
    copies = {name for name, code in exercises.items() if solutions.get(name) == code}
    assert copies == REGISTERED_AGAIN, f"copied from solutions.py: {copies - REGISTERED_AGAIN}"


# ---------------------------------------------------------------- 10.1 scaled_tanh


def scaled_tanh_backward_tol(dy, x, a, ref, dtype):
    """dx = dy a (1 - t**2), t = tanh(x): tanh (2 ulp on a GPU), t * t, 1 - t**2 and
    two products. Where |x| is large, 1 - t**2 cancels: terms of size |dy| a (1 + t**2)."""
    t = torch.tanh(x.detach().double())
    return rounding_tol(ref, dy.detach().double().abs() * a * (1 + t * t), 6, dtype)


def check_scaled_tanh_backward(impl, rng, launches):
    for dtype in (F32, F64):
        for shape in [(3, 4), (1,), (13,), (2, 3, 2), (0, 3)]:
            for layout in LAYOUTS:
                x, dy = tensor(rng, shape, dtype), tensor(rng, shape, dtype)
                a = float(rng.uniform(0.5, 2.0))
                what = f"scaled_tanh_backward {dtype} {shape} {layout}"
                dx = call_op(
                    launches,
                    impl.scaled_tanh_backward,
                    laid_out(dy, layout),
                    laid_out(x, layout),
                    a,
                    what=what,
                )
                assert dx.dtype == dtype and dx.shape == x.shape, (dx.dtype, dx.shape)
                check_fake(raw(impl, "scaled_tanh_backward"), (dy, x, a), dx, what)
                ref = dy.double() * a * (1 - torch.tanh(x.double()) ** 2)
                if x.numel():
                    check(dx, ref, scaled_tanh_backward_tol(dy, x, a, ref, dtype), name=what)
    x = tensor(rng, (3, 4))
    with pytest.raises(TypeError):
        impl.scaled_tanh_backward(x.double(), x, 1.0)
    with pytest.raises(ValueError):
        impl.scaled_tanh_backward(tensor(rng, (4, 3)), x, 1.0)
    with pytest.raises(TypeError):
        impl.scaled_tanh_backward(x.int(), x.int(), 1.0)


def check_scaled_tanh_grad(scaled_tanh_grad, rng, launches):
    x, dy = tensor(rng, (3, 4)), tensor(rng, (3, 4))
    ctx = RecordingContext()
    sol.scaled_tanh_setup_context(ctx, (x, 0.75), None)
    grads = call_op(launches, scaled_tanh_grad, ctx, dy, what="scaled_tanh_grad", watch=(x,))
    assert len(grads) == 2 and grads[1] is None, "one gradient per input (x, a); a's is None"
    ref = dy.double() * 0.75 / torch.cosh(x.double()) ** 2
    check(grads[0], ref, scaled_tanh_backward_tol(dy, x, 0.75, ref, F32), name="dx")


def check_scaled_tanh_gradients(impl, rng, launches):
    a = float(rng.uniform(1.25, 2.0))  # not 1: a formula that forgets a is wrong
    for dtype in (F32, F64):
        for layout in LAYOUTS:
            x = tensor(rng, (3, 5), dtype)
            what = f"scaled_tanh {dtype} {layout}"
            y = call_op(launches, impl.scaled_tanh, laid_out(x, layout), a, what=what)
            check(y, a * torch.tanh(x.double()), TOL[dtype], name=what)
            check_fake(raw(impl, "scaled_tanh"), (x, a), y, what)
    x = tensor(rng, (3, 4), F64, requires_grad=True)
    torch.autograd.gradcheck(functools.partial(impl.scaled_tanh, a=a), (x,), raise_exception=True)
    # float32 through autograd against torch's own a * tanh(x) in float64
    x32 = tensor(rng, (5, 3), F32, requires_grad=True)
    g = tensor(rng, (5, 3), F32)
    launches.seen.clear()
    impl.scaled_tanh(x32, a).backward(g)
    launches.check_on_torch_stream("scaled_tanh forward and backward (autograd)")
    x64 = x32.detach().double().requires_grad_()
    (a * torch.tanh(x64)).backward(g.double())
    tol = scaled_tanh_backward_tol(g, x64, a, x64.grad, F32)
    check(x32.grad, x64.grad, tol, name="scaled_tanh gradient (float32)")
    torch.library.opcheck(raw(impl, "scaled_tanh"), (x, a))


def check_exercise_10_1(impl, rng, launches):
    check_scaled_tanh_backward(impl, rng, launches)
    check_scaled_tanh_grad(impl.scaled_tanh_grad, rng, launches)
    check_scaled_tanh_gradients(impl, rng, launches)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_scaled_tanh_backward(impl, rng, launches):
    check_exercise_10_1(impl, rng, launches)


def make_scaled_tanh_backward_sign_error(np_dtype):
    one = np_dtype(1.0)

    @cuda.jit
    def scaled_tanh_backward_sign_error(dy, x, a, dx):
        i = cuda.grid(1)
        if i < dx.size:
            t = math.tanh(x[i])
            dx[i] = dy[i] * a * (t * t - one)

    return scaled_tanh_backward_sign_error


def test_scaled_tanh_checks_catch_a_sign_error(monkeypatch, rng, launches):
    monkeypatch.setattr(sol, "make_scaled_tanh_backward", make_scaled_tanh_backward_sign_error)
    with pytest.raises(CheckError):
        check_scaled_tanh_backward(sol, rng, launches)
    with pytest.raises(GRAD_ERRORS):
        check_scaled_tanh_gradients(sol, rng, launches)


def scaled_tanh_grad_without_a(ctx, dy):
    (x,) = ctx.saved_tensors
    return sol.scaled_tanh_backward(dy.contiguous(), x, 1.0), None


def test_scaled_tanh_gradients_catch_a_forgotten_scale(rng, launches):
    ours = (sol.scaled_tanh_grad, sol.scaled_tanh_setup_context)
    with pytest.raises(CheckError):
        check_scaled_tanh_grad(scaled_tanh_grad_without_a, rng, launches)
    with autograd_replaced(sol.scaled_tanh, scaled_tanh_grad_without_a, ours[1], ours):
        with pytest.raises(GRAD_ERRORS):
            check_scaled_tanh_gradients(sol, rng, launches)


# ------------------------------------------------------------------ 10.2 row_sums fake

FAKE_CASES = [((3, 4), F32), ((1, 1), F64), ((5, 2), F32), ((2, 7), F64), ((4, 4), F64)]


def check_row_sums_fake_direct(impl, rng):
    for shape, dtype in FAKE_CASES:
        x = tensor(rng, shape, dtype)
        for given in (x, x.to("meta")):  # real data, and none at all
            y = impl.row_sums_fake(given)
            assert (tuple(y.shape), y.dtype, y.device) == ((shape[0],), dtype, given.device), (
                f"fake of x {shape} {dtype} on {given.device}: got {tuple(y.shape)} {y.dtype} "
                f"{y.device}"
            )
    with pytest.raises(ValueError):
        impl.row_sums_fake(tensor(rng, (6,)))
    with pytest.raises(TypeError):
        impl.row_sums_fake(torch.ones(2, 3, dtype=torch.int32))


def check_row_sums_fake_registered(impl, rng, launches):
    op = raw(impl, "row_sums")
    for shape, dtype in FAKE_CASES:
        for layout in LAYOUTS:
            x = tensor(rng, shape, dtype)
            what = f"row_sums {shape} {dtype} {layout}"
            y = call_op(launches, op, laid_out(x, layout), what=what)
            # a sum of N terms: N roundings of terms of size sum |x|
            ref = x.double().sum(1)
            check(y, ref, rounding_tol(ref, x.double().abs().sum(1), shape[1], dtype), name=what)
        torch.library.opcheck(op, (x,))  # test_faketensor: the fake agrees with the kernel
        check_fake(op, (x,), y, "row_sums")
        with FakeTensorMode():
            fake = op(torch.empty(shape, dtype=dtype, device=DEVICE))
        assert (tuple(fake.shape), fake.dtype, fake.device) == (tuple(y.shape), dtype, y.device), (
            tuple(fake.shape),
            fake.dtype,
            fake.device,
        )
    with FakeTensorMode(), pytest.raises(ValueError):
        op(torch.empty(2, 3, 4))  # the fake refuses what the real operator refuses


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_row_sums_fake(impl, rng, launches):
    check_row_sums_fake_direct(impl, rng)
    check_row_sums_fake_registered(impl, rng, launches)


def fake_with_column(x):
    return x.new_empty(x.shape[0], 1)


def fake_of_columns(x):
    return x.new_empty(x.shape[1])


def fake_always_float32(x):
    return x.new_empty(x.shape[0], dtype=torch.float32)


def fake_fixed_size(x):
    return x.new_empty(3)


def fake_on_the_default_device(x):
    sol.check_row_sums_args(x)
    return torch.empty(x.shape[0], dtype=x.dtype)  # no device=: the CPU, whatever x's is


WRONG_FAKES = [
    fake_with_column,
    fake_of_columns,
    fake_always_float32,
    fake_fixed_size,
    fake_on_the_default_device,
]


@functools.cache
def row_sums_with_fake(fake):
    """row_sums registered again (its own name) with a wrong fake."""

    def body(x: torch.Tensor) -> torch.Tensor:
        return sol.row_sums(x)

    op = torch.library.custom_op(f"course10_wrong::row_sums_{fake.__name__}", body, mutates_args=())
    op.register_fake(fake)
    return SimpleNamespace(row_sums=op, row_sums_fake=fake)


@pytest.mark.parametrize("fake", WRONG_FAKES, ids=lambda f: f.__name__)
def test_row_sums_fake_checks_catch_a_wrong_fake(fake, rng, launches):
    wrong = row_sums_with_fake(fake)
    with pytest.raises(CHECK_FAILS):
        check_row_sums_fake_direct(wrong, rng)
    with pytest.raises(CHECK_FAILS, match="test_faketensor|fake"):
        check_row_sums_fake_registered(wrong, rng, launches)


# ------------------------------------------------------------- 10.3 softsign compiles


def check_softsign(impl, rng, launches):
    for dtype in (F32, F64):
        for shape in [(3, 5), (1,), (2, 9)]:
            for layout in LAYOUTS:
                x = tensor(rng, shape, dtype)
                what = f"softsign {dtype} {shape} {layout}"
                y = call_op(launches, impl.softsign, laid_out(x, layout), what=what)
                assert y.dtype == dtype and y.shape == x.shape, (y.dtype, y.shape)
                check(y, x.double() / (1 + x.double().abs()), TOL[dtype], name=what)
    with pytest.raises(TypeError):
        impl.softsign(torch.ones(3, dtype=torch.int32))
    op = raw(impl, "softsign")

    def model(t):  # the operator between torch operations, as in a network
        return op(t * 2.0) + 1.0

    torch._dynamo.reset()
    x = tensor(rng, (3, 5))
    explanation = torch._dynamo.explain(model)(x)
    reasons = [b.reason.splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, f"graph breaks: {reasons}"
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    launches.seen.clear()
    x = tensor(rng, (4, 3))
    out = compiled(x)
    launches.check_on_torch_stream("the compiled function")
    x64 = 2.0 * x.double()
    check(out, x64 / (1 + x64.abs()) + 1.0, TOL[F32], name="compiled softsign")
    x = tensor(rng, (3, 5))
    torch.library.opcheck(op, (x,))
    check_fake(op, (x,), op(x), "softsign")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_softsign_compiles(impl, rng, launches):
    check_softsign(impl, rng, launches)


def softsign_in_torch(x: torch.Tensor) -> torch.Tensor:
    sol.check_floating(x, "x")
    return x / (1 + x.abs())


@pytest.mark.parametrize(
    "fn, failure",
    [(sol.softsign_eager, "graph breaks"), (softsign_in_torch, "launched no Numba kernel")],
    ids=["softsign_eager", "in_torch"],
)
def test_softsign_check_catches_graph_breaks_and_no_kernel(fn, failure, rng, launches):
    # softsign_eager: the Numba launch breaks the graph; in torch: no break,
    # but no kernel of ours either
    with pytest.raises(AssertionError, match=failure):
        check_softsign(SimpleNamespace(softsign=fn), rng, launches)


@functools.cache
def softsign_with_cpu_fake():
    """softsign registered again (its own name) with a fake that allocates on the CPU."""

    def body(x: torch.Tensor) -> torch.Tensor:
        return sol.softsign_eager(x)

    def fake(x):
        sol.check_floating(x, "x")
        return torch.empty(x.shape, dtype=x.dtype)  # no device=: the CPU, whatever x's is

    op = torch.library.custom_op("course10_wrong::softsign_cpu_fake", body, mutates_args=())
    op.register_fake(fake)
    return op


def test_softsign_check_catches_a_fake_on_the_wrong_device(rng, launches):
    # On a GPU opcheck's test_faketensor sees the fake's CPU tensor beside the real
    # CUDA one; on the CPU opcheck and torch.compile see nothing wrong (the real
    # output is there too) and only the check's own device comparison catches it.
    with pytest.raises(CHECK_FAILS, match="(?i)fake"):
        check_softsign(SimpleNamespace(softsign=softsign_with_cpu_fake()), rng, launches)


# ------------------------------------------------------------- 10.4 torch's stream


def check_scale_rows(impl, rng, launches):
    for dtype in (F32, F64):
        for shape in [(3, 4), (1, 1), (5, 3), (2, 9)]:
            for layout in LAYOUTS:
                x, s = tensor(rng, shape, dtype), tensor(rng, shape[:1], dtype)
                what = f"scale_rows {dtype} {shape} {layout}"
                args = (laid_out(x, layout), laid_out(s, layout))
                y = call_op(launches, impl.scale_rows, *args, what=what)
                check(y, s.double()[:, None] * x.double(), TOL[dtype], name=what)
                check_fake(raw(impl, "scale_rows"), (x, s), y, what)
    x = tensor(rng, (3, 4))
    with pytest.raises(ValueError):
        impl.scale_rows(x, tensor(rng, (4,)))
    with pytest.raises(TypeError):
        impl.scale_rows(x, tensor(rng, (3,), F64))


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_scale_rows_launches_on_torch_stream(impl, rng, launches):
    check_scale_rows(impl, rng, launches)


def test_scale_rows_check_catches_the_default_stream(rng, launches):
    wrong = SimpleNamespace(scale_rows=sol.scale_rows_default_stream)
    with pytest.raises(AssertionError, match="not bridge.torch_stream"):
        check_scale_rows(wrong, rng, launches)


# ---------------------------------------------------------------- 10.5 bias + ReLU

BIAS_RELU_KERNELS = sol.make_bias_relu_kernels  # before a test patches in a wrong one
BIAS_RELU_SHAPES = [(3, 4), (1, 1), (5, 9), (2, 17)]


def bias_relu_inputs(rng, shape, dtype, requires_grad=False, kinks=False):
    """x, b with z = x + b at least 0.1 away from ReLU's kink, its last element
    negative (if not [0, 0]), z[0, 0] = b[0] / 2 > 0.5 and x[0, 0] < 0: a backward that
    tests x > 0 instead of x + b > 0, or a forward relu(x) + b, is wrong there.

    kinks: every third element from [0, 1] on (not the last) sits exactly on
    the kink instead, x = -b (x + b is 0 in any float: negation is exact);
    there torch's ReLU passes no gradient, and a mask of z >= 0 passes dy.
    (Not for gradcheck: its finite differences straddle the kink.)
    """
    b = tensor(rng, shape[1:], F64)
    b[0] = 1.0 + b[0].abs()
    z = away_from_zero(rng, shape, F64)
    z.view(-1)[-1] = -z.view(-1)[-1].abs()
    z[0, 0] = 0.5 * b[0]
    if kinks:
        z.view(-1)[1:-1:3] = 0.0
    x = z - b
    return x.to(dtype).requires_grad_(requires_grad), b.to(dtype).requires_grad_(requires_grad)


def check_bias_relu_values(impl, rng, launches):
    for dtype in (F32, F64):
        for shape in BIAS_RELU_SHAPES:
            for layout in LAYOUTS:
                x, b = bias_relu_inputs(rng, shape, dtype, kinks=True)
                dy = away_from_zero(rng, shape, dtype, margin=0.5)  # visible where the mask errs
                what = f"{dtype} {shape} {layout}"
                x_, b_, dy_ = (laid_out(t, layout) for t in (x, b, dy))
                y = call_op(launches, impl.bias_relu, x_, b_, what=f"bias_relu {what}")
                assert y.dtype == dtype and y.shape == x.shape, (y.dtype, y.shape)
                z = x.double() + b.double()
                check(y, torch.relu(z), TOL[dtype], name=f"bias_relu {what}")
                dx, db = call_op(
                    launches,
                    impl.bias_relu_backward,
                    dy_,
                    x_,
                    b_,
                    what=f"bias_relu_backward {what}",
                )
                ref_dx = dy.double() * (z > 0)  # torch's ReLU: no gradient at 0
                check(dx, ref_dx, TOL[dtype], name=f"bias_relu_backward dx {what}")
                # db: a sum down each column, M roundings of terms of size |dx|
                ref_db = ref_dx.sum(0)
                tol = rounding_tol(ref_db, ref_dx.abs().sum(0), shape[0], dtype)
                check(db, ref_db, tol, name=f"bias_relu_backward db {what}")
                check_fake(raw(impl, "bias_relu"), (x, b), y, f"bias_relu {what}")
                check_fake(raw(impl, "bias_relu_backward"), (dy, x, b), (dx, db), what)
    x, b = bias_relu_inputs(rng, (3, 4), F32)
    with pytest.raises(ValueError):
        impl.bias_relu(x, tensor(rng, (3,)))
    with pytest.raises(TypeError):
        impl.bias_relu(x, b.double())
    with pytest.raises(ValueError):
        impl.bias_relu_backward(tensor(rng, (3, 5)), x, b)


def check_bias_relu_gradients(impl, rng, launches):
    x, b = bias_relu_inputs(rng, (3, 4), F64, requires_grad=True)
    torch.autograd.gradcheck(impl.bias_relu, (x, b), raise_exception=True)
    torch.library.opcheck(raw(impl, "bias_relu"), (x, b))
    x, b = bias_relu_inputs(rng, (4, 9), F32, requires_grad=True, kinks=True)
    g = away_from_zero(rng, (4, 9), F32, margin=0.5)
    launches.seen.clear()
    impl.bias_relu(x, b).backward(g)
    launches.check_on_torch_stream("bias_relu forward and backward (autograd)")
    x64, b64 = (t.detach().double().requires_grad_() for t in (x, b))
    torch.relu(x64 + b64).backward(g.double())
    check(x.grad, x64.grad, TOL[F32], name="bias_relu dx (float32, autograd)")
    tol = rounding_tol(b64.grad, x64.grad.abs().sum(0), 4, F32)
    check(b.grad, b64.grad, tol, name="bias_relu db (float32, autograd)")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_bias_relu(impl, rng, launches):
    check_bias_relu_values(impl, rng, launches)
    check_bias_relu_gradients(impl, rng, launches)


def make_bias_relu_wrong(np_dtype, bug):
    """solutions' kernels with one bug: "mask_without_bias" (backward tests
    x > 0, not x + b > 0), "relu_then_add" (forward relu(x) + b) or
    "db_skips_row_0"."""
    forward, backward = BIAS_RELU_KERNELS(np_dtype)
    zero = np_dtype(0.0)

    @cuda.jit
    def relu_then_add(x, b, y):
        c = cuda.grid(1)
        if c < x.shape[1]:
            for r in range(x.shape[0]):
                y[r, c] = max(x[r, c], zero) + b[c]

    @cuda.jit
    def backward_wrong(dy, x, b, dx, db):
        c = cuda.grid(1)
        if c < x.shape[1]:
            acc = zero
            for r in range(x.shape[0]):
                z = x[r, c] if bug == "mask_without_bias" else x[r, c] + b[c]
                g = dy[r, c] if z > zero else zero
                dx[r, c] = g
                if r > 0 or bug != "db_skips_row_0":
                    acc += g
            db[c] = acc

    if bug == "relu_then_add":
        return relu_then_add, backward
    return forward, backward_wrong


@pytest.mark.parametrize("bug", ["mask_without_bias", "relu_then_add", "db_skips_row_0"])
def test_bias_relu_checks_catch_a_wrong_kernel(bug, monkeypatch, rng, launches):
    monkeypatch.setattr(
        sol, "make_bias_relu_kernels", functools.partial(make_bias_relu_wrong, bug=bug)
    )
    with pytest.raises(CheckError):
        check_bias_relu_values(sol, rng, launches)
    with pytest.raises(GRAD_ERRORS):
        check_bias_relu_gradients(sol, rng, launches)


def test_bias_relu_checks_catch_a_gradient_at_the_kink(monkeypatch, rng, launches):
    # relu'(0) taken as 1: dx = dy where x + b >= 0. Away from the kink it is
    # right, and gradcheck cannot look at the kink itself.
    wrong = mutant(BIAS_RELU_KERNELS, ("x[r, c] + bc > zero", "x[r, c] + bc >= zero"))
    monkeypatch.setattr(sol, "make_bias_relu_kernels", wrong)
    with pytest.raises(CheckError, match="dx"):
        check_bias_relu_values(sol, rng, launches)
    with pytest.raises(CheckError, match="dx"):
        check_bias_relu_gradients(sol, rng, launches)


def test_bias_relu_checks_catch_a_backward_that_writes_into_x(monkeypatch, rng, launches):
    # "x + b is recomputed": stored back into x, it is no longer recomputed ...
    # and the caller's x (autograd's saved tensor) is x + b from then on.
    wrong = mutant(
        BIAS_RELU_KERNELS,
        (
            "g = dy[r, c] if x[r, c] + bc > zero else zero",
            "x[r, c] += bc\n                g = dy[r, c] if x[r, c] > zero else zero",
        ),
    )
    monkeypatch.setattr(sol, "make_bias_relu_kernels", wrong)
    with pytest.raises(AssertionError, match="bias_relu_backward .* wrote into its input"):
        check_bias_relu_values(sol, rng, launches)


# ------------------------------------------------------------ 10.6 setup_context


def brier_inputs(rng, n, c, dtype, requires_grad=False):
    p = tensor(rng, (n, c), dtype, low=0.0, high=1.0, requires_grad=requires_grad)
    target = torch.from_numpy(rng.integers(0, c, n)).to(DEVICE)
    w = tensor(rng, (c,), dtype, low=0.5, high=2.0, requires_grad=requires_grad)
    return p, target, w


def brier_reference(p, target, w):
    onehot = torch.nn.functional.one_hot(target, p.shape[1]).to(p.dtype)
    return (w * (p - onehot) ** 2).sum(1)


def brier_dw_tol(p, target, dloss, ref_dw, dtype):
    """dw[c] = sum over n of dloss[n] e**2: the signs of dloss cancel. Terms of size
    |dloss| e**2, rounded in e, e * e, the product and N additions."""
    onehot = torch.nn.functional.one_hot(target, p.shape[1]).double()
    terms = (dloss.detach().double().abs()[:, None] * (p.detach().double() - onehot) ** 2).sum(0)
    return rounding_tol(ref_dw, terms, p.shape[0] + 3, dtype)


def check_brier_direct(impl, rng, launches):
    for dtype in (F32, F64):
        for n, c in [(3, 4), (1, 1), (5, 9)]:
            for layout in LAYOUTS:
                p, target, w = brier_inputs(rng, n, c, dtype)
                dloss = tensor(rng, (n,), dtype)
                p_, target_, w_, dloss_ = (laid_out(t, layout) for t in (p, target, w, dloss))
                what = f"{n}x{c} {dtype} {layout}"
                ctx = RecordingContext()
                loss = call_op(
                    launches, impl.brier_score, p_, target_, w_, what=f"brier_score {what}"
                )
                ref = brier_reference(p.double(), target, w.double())
                check(loss, ref, TOL[dtype], name=f"brier_score loss {what}")
                check_fake(raw(impl, "brier_score"), (p, target, w), loss, f"brier_score {what}")
                impl.brier_setup_context(ctx, (p_, target_, w_), loss)
                grads = call_op(
                    launches,
                    impl.brier_backward,
                    ctx,
                    dloss_,
                    what=f"brier_backward {what}",
                    watch=(p_, target_, w_),
                )
                assert len(grads) == 3, f"one gradient per input (p, target, w), got {len(grads)}"
                assert grads[1] is None, "target holds class indices: its gradient is None"
                p64, w64 = (t.double().requires_grad_() for t in (p, w))
                brier_reference(p64, target, w64).backward(dloss.double())
                check(grads[0], p64.grad, TOL[dtype], name=f"brier_score_backward dp {what}")
                tol = brier_dw_tol(p, target, dloss, w64.grad, dtype)
                check(grads[2], w64.grad, tol, name=f"brier_score_backward dw {what}")
                fake_args = (dloss, p, target, w)
                real = (grads[0], grads[2])  # what brier_score_backward returned
                check_fake(raw(impl, "brier_score_backward"), fake_args, real, what)


def check_brier_autograd(impl, rng, launches):
    op = raw(impl, "brier_score")
    p, target, w = brier_inputs(rng, 3, 4, F64, requires_grad=True)
    torch.autograd.gradcheck(op, (p, target, w), raise_exception=True)
    torch.library.opcheck(op, (p, target, w))
    p, target, w = brier_inputs(rng, 4, 5, F32, requires_grad=True)
    g = tensor(rng, (4,))
    launches.seen.clear()
    impl.brier_score(p, target, w).backward(g)
    launches.check_on_torch_stream("brier_score forward and backward (autograd)")
    p64, w64 = (t.detach().double().requires_grad_() for t in (p, w))
    brier_reference(p64, target, w64).backward(g.double())
    check(p.grad, p64.grad, TOL[F32], name="dp (float32, autograd)")
    check(
        w.grad, w64.grad, brier_dw_tol(p, target, g, w64.grad, F32), name="dw (float32, autograd)"
    )
    # Saved with save_for_backward, an input changed in place before the
    # backward is an error, not a gradient of numbers that are gone: every
    # input, the class indices too.
    for which in range(3):
        inputs = brier_inputs(rng, 3, 4, F32, requires_grad=True)
        loss = op(*inputs)
        with torch.no_grad():
            inputs[which].add_(1)  # another class, or other probabilities or weights
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.sum().backward()


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_brier_setup_context_and_backward(impl, rng, launches):
    check_brier_direct(impl, rng, launches)
    check_brier_autograd(impl, rng, launches)


def brier_setup_in_attributes(ctx, inputs, output):
    ctx.p, ctx.target, ctx.w = inputs  # works, but autograd cannot see them saved


def brier_setup_target_in_attribute(ctx, inputs, output):
    p, target, w = inputs
    ctx.save_for_backward(p, w)
    ctx.target = target  # "no gradient, so no need to save it": its changes go unseen


def brier_backward_wrong(ctx, dloss, bug):
    """A backward with one bug, as named in BRIER_BUGS."""
    if bug == "attributes":
        p, target, w = ctx.p, ctx.target, ctx.w
    elif bug == "target_in_attribute":
        (p, w), target = ctx.saved_tensors, ctx.target
    else:
        p, target, w = ctx.saved_tensors
    dp, dw = sol.brier_score_backward(dloss.contiguous(), p, target, w)
    if bug == "no_dw":
        return dp, None, None
    if bug == "target_grad":
        return dp, torch.zeros_like(p), dw
    if bug == "swapped":
        return dw, None, dp
    return dp, None, dw


# bug -> the check that must catch it
BRIER_BUGS = {
    "attributes": "autograd",  # the in-place change goes unnoticed
    "target_in_attribute": "autograd",  # the in-place change of target goes unnoticed
    "no_dw": "autograd",  # gradcheck: w's gradient is missing
    "target_grad": "direct",  # a gradient for class indices
    "swapped": "direct",
}
BRIER_SETUPS = {
    "attributes": brier_setup_in_attributes,
    "target_in_attribute": brier_setup_target_in_attribute,
}


@pytest.mark.parametrize("bug", list(BRIER_BUGS))
def test_brier_checks_catch_a_wrong_registration(bug, rng, launches):
    setup = BRIER_SETUPS.get(bug, sol.brier_setup_context)
    backward = functools.partial(brier_backward_wrong, bug=bug)
    wrong = SimpleNamespace(
        brier_setup_context=setup,
        brier_backward=backward,
        brier_score=sol.brier_score,
        brier_score_backward=sol.brier_score_backward,
    )
    ours = (sol.brier_backward, sol.brier_setup_context)
    with autograd_replaced(sol.brier_score, backward, setup, ours):
        with pytest.raises(CHECK_FAILS):
            if BRIER_BUGS[bug] == "direct":
                check_brier_direct(wrong, rng, launches)
            else:
                check_brier_autograd(wrong, rng, launches)


def test_brier_score_gives_nan_for_a_target_out_of_range(rng):
    p, target, w = brier_inputs(rng, 3, 4, F32, requires_grad=True)
    target[1] = 4
    loss = sol.brier_score(p, target, w)
    assert torch.isnan(loss[1]) and not torch.isnan(loss[[0, 2]]).any(), loss
    loss.sum().backward()
    assert torch.isnan(p.grad[1]).all() and not torch.isnan(p.grad[[0, 2]]).any(), p.grad


# ------------------------------------------- every operator, held to call_op's rules

# operator -> (the kernel it launches, its tensor inputs' positions, the check
# that calls it directly)
OPERATOR_CHECKS = {
    "scaled_tanh": ("scaled_tanh_forward", (0,), check_scaled_tanh_gradients),
    "scaled_tanh_backward": ("scaled_tanh_backward_kernel", (0, 1), check_scaled_tanh_backward),
    "row_sums": ("row_sums_kernel", (0,), check_row_sums_fake_registered),
    "softsign": ("softsign_kernel", (0,), check_softsign),
    "scale_rows": ("scale_rows_kernel", (0, 1), check_scale_rows),
    "bias_relu": ("bias_relu_forward", (0, 1), check_bias_relu_values),
    "bias_relu_backward": ("bias_relu_backward_kernel", (0, 1, 2), check_bias_relu_values),
    "brier_score": ("brier_forward", (0, 1, 2), check_brier_direct),
    "brier_score_backward": ("brier_backward", (0, 1, 2, 3), check_brier_direct),
}


def with_global(op, name, value):
    """``op`` with solutions.py's global ``name`` set to ``value`` during its calls
    only: a bug in a helper that one operator alone has. The registration
    (fake, autograd) stays the real operator's."""

    def wrong(*args):
        real = getattr(sol, name)
        setattr(sol, name, value)
        try:
            return op(*args)
        finally:
            setattr(sol, name, real)

    return wrong


# The bug of exercise 10.4 in every operator: each launch names Numba's default
# stream (as kernel[grid, block] or kernel[grid, block, cuda.default_stream()] do).
DEFAULT_STREAM_BRIDGE = SimpleNamespace(
    numba_view=bridge.numba_view, torch_stream=lambda: cuda.default_stream()
)


@pytest.mark.parametrize("name", list(OPERATOR_CHECKS))
def test_every_operator_check_catches_a_launch_on_the_default_stream(
    name, monkeypatch, rng, launches
):
    monkeypatch.setattr(sol, name, with_global(getattr(sol, name), "bridge", DEFAULT_STREAM_BRIDGE))
    kernel, _, check_calling = OPERATOR_CHECKS[name]
    with pytest.raises(AssertionError, match=f"{kernel} launched on stream"):
        check_calling(sol, rng, launches)


def writing_into_input(op, k):
    """``op`` followed by a write into its k-th argument: a kernel that stores a
    scratch value into an input (x + b into x, say)."""

    def wrong(*args):
        out = op(*args)
        with torch.no_grad():
            args[k].detach().add_(1)
        return out

    return wrong


@pytest.mark.parametrize(
    "name, k",
    [(name, k) for name, (_, positions, _) in OPERATOR_CHECKS.items() for k in positions],
)
def test_every_operator_check_catches_a_write_into_any_input(name, k, monkeypatch, rng, launches):
    monkeypatch.setattr(sol, name, writing_into_input(getattr(sol, name), k))
    *_, check_calling = OPERATOR_CHECKS[name]
    with pytest.raises(AssertionError, match=f"wrote into its input tensor {k} "):
        check_calling(sol, rng, launches)


def view_as_if_contiguous(t, name, flat=False):
    """solutions.view without its .contiguous(): a non-contiguous tensor's
    storage read in row-major order, from its offset (bridge.numba_view alone
    would refuse the strides, so they are dropped: the bug a hand-made view has)."""
    t = t.detach()
    t = t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())
    return bridge.numba_view(t.view(-1) if flat else t, name)


@pytest.mark.parametrize("name", list(OPERATOR_CHECKS))
def test_every_operator_check_catches_a_non_contiguous_input_read_as_contiguous(
    name, monkeypatch, rng, launches
):
    monkeypatch.setattr(sol, name, with_global(getattr(sol, name), "view", view_as_if_contiguous))
    *_, check_calling = OPERATOR_CHECKS[name]
    with pytest.raises(CheckError, match=f"{name} .*(transposed|sliced)"):
        check_calling(sol, rng, launches)
