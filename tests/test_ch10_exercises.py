"""Chapter 10 exercises: each is checked on solutions.py and on the learner's
exercises.py, and each check is shown to fail on a wrong version (a backward
with a sign error, a fake of the wrong shape, a launch on the wrong stream, a
setup_context that does not save for backward, ...)."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import CheckError, is_simulator
from common.checking import check, random_array
from common.internal.exercises import Implementation, implementations, load_chapter_module

import contextlib
import functools
import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from numba import cuda
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests import OpCheckError

CHAPTER = "10_pytorch_extensions"
bridge = load_chapter_module(CHAPTER, "bridge")
sol = load_chapter_module(CHAPTER, "solutions")
DEVICE = "cpu" if is_simulator() else "cuda"
F32, F64 = torch.float32, torch.float64
# float32: a few roundings of O(1) values; float64: the same kernels, to ~1e-16
TOL = {F32: 1e-5, F64: 1e-12}
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
    """Random values with |v| >= margin: a kink (ReLU at 0) stays out of gradcheck's reach."""
    z = tensor(rng, shape, F64)
    return (torch.sign(z) * (margin + z.abs())).to(dtype)


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


@cuda.jit
def _probe(x):  # only its type matters: the class every @cuda.jit kernel is
    pass


def kernel_name(kernel):
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", "?")


class MarkedStream:
    """What bridge.torch_stream() returns during a test: a launch that passes it
    on is a launch on torch's stream."""


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch in the test, as (kernel name, launch configuration).

    bridge.torch_stream() returns a MarkedStream; the launch recorder puts the
    real stream back before the launch goes on, so kernels run as usual.
    """
    kernel_type = type(_probe)
    launch_config = kernel_type.__getitem__
    real_stream = bridge.torch_stream
    mark = MarkedStream()
    seen = []

    def recording_getitem(kernel, configuration):
        seen.append((kernel_name(kernel), configuration))
        if isinstance(configuration, tuple) and len(configuration) >= 3:
            if configuration[2] is mark:
                configuration = (*configuration[:2], real_stream(), *configuration[3:])
        return launch_config(kernel, configuration)

    def marked_stream():
        return mark

    monkeypatch.setattr(kernel_type, "__getitem__", recording_getitem)
    monkeypatch.setattr(bridge, "torch_stream", marked_stream)
    return SimpleNamespace(seen=seen, mark=mark)


# ---------------------------------------------------------------- 10.1 scaled_tanh


def check_scaled_tanh_backward(scaled_tanh_backward, rng):
    for dtype in (F32, F64):
        for shape in [(3, 4), (1,), (13,), (2, 3, 2), (0, 3)]:
            x, dy = tensor(rng, shape, dtype), tensor(rng, shape, dtype)
            a = float(rng.uniform(0.5, 2.0))
            dx = scaled_tanh_backward(dy, x, a)
            assert dx.dtype == dtype and dx.shape == x.shape, (dx.dtype, dx.shape)
            ref = dy.double() * a * (1 - torch.tanh(x.double()) ** 2)
            if x.numel():
                check(dx, ref, TOL[dtype], name=f"scaled_tanh_backward {dtype} {shape}")
    x = tensor(rng, (3, 4))
    with pytest.raises(TypeError):
        scaled_tanh_backward(x.double(), x, 1.0)
    with pytest.raises(ValueError):
        scaled_tanh_backward(tensor(rng, (4, 3)), x, 1.0)
    with pytest.raises(TypeError):
        scaled_tanh_backward(x.int(), x.int(), 1.0)


def check_scaled_tanh_grad(scaled_tanh_grad, rng):
    x, dy = tensor(rng, (3, 4)), tensor(rng, (3, 4))
    ctx = RecordingContext()
    sol.scaled_tanh_setup_context(ctx, (x, 0.75), None)
    grads = scaled_tanh_grad(ctx, dy)
    assert len(grads) == 2 and grads[1] is None, "one gradient per input (x, a); a's is None"
    check(grads[0], dy.double() * 0.75 / torch.cosh(x.double()) ** 2, TOL[F32], name="dx")


def check_scaled_tanh_gradients(impl, rng):
    a = float(rng.uniform(1.25, 2.0))  # not 1: a formula that forgets a is wrong
    x = tensor(rng, (3, 4), F64, requires_grad=True)
    torch.autograd.gradcheck(functools.partial(impl.scaled_tanh, a=a), (x,), raise_exception=True)
    # float32 through autograd against torch's own a * tanh(x) in float64
    x32 = tensor(rng, (5, 3), F32, requires_grad=True)
    g = tensor(rng, (5, 3), F32)
    impl.scaled_tanh(x32, a).backward(g)
    x64 = x32.detach().double().requires_grad_()
    (a * torch.tanh(x64)).backward(g.double())
    check(x32.grad, x64.grad, TOL[F32], name="scaled_tanh gradient (float32)")
    torch.library.opcheck(raw(impl, "scaled_tanh"), (x, a))


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_scaled_tanh_backward(impl, rng):
    check_scaled_tanh_backward(impl.scaled_tanh_backward, rng)
    check_scaled_tanh_grad(impl.scaled_tanh_grad, rng)
    check_scaled_tanh_gradients(impl, rng)


def make_scaled_tanh_backward_sign_error(np_dtype):
    one = np_dtype(1.0)

    @cuda.jit
    def scaled_tanh_backward_sign_error(dy, x, a, dx):
        i = cuda.grid(1)
        if i < dx.size:
            t = math.tanh(x[i])
            dx[i] = dy[i] * a * (t * t - one)

    return scaled_tanh_backward_sign_error


def test_scaled_tanh_checks_catch_a_sign_error(monkeypatch, rng):
    monkeypatch.setattr(sol, "make_scaled_tanh_backward", make_scaled_tanh_backward_sign_error)
    with pytest.raises(CheckError):
        check_scaled_tanh_backward(sol.scaled_tanh_backward, rng)
    with pytest.raises(GRAD_ERRORS):
        check_scaled_tanh_gradients(sol, rng)


def scaled_tanh_grad_without_a(ctx, dy):
    (x,) = ctx.saved_tensors
    return sol.scaled_tanh_backward(dy.contiguous(), x, 1.0), None


def test_scaled_tanh_gradients_catch_a_forgotten_scale(rng):
    ours = (sol.scaled_tanh_grad, sol.scaled_tanh_setup_context)
    with pytest.raises(CheckError):
        check_scaled_tanh_grad(scaled_tanh_grad_without_a, rng)
    with autograd_replaced(sol.scaled_tanh, scaled_tanh_grad_without_a, ours[1], ours):
        with pytest.raises(GRAD_ERRORS):
            check_scaled_tanh_gradients(sol, rng)


# ------------------------------------------------------------------ 10.2 row_sums fake

FAKE_CASES = [((3, 4), F32), ((1, 1), F64), ((5, 2), F32), ((2, 7), F64), ((4, 4), F64)]


def check_row_sums_fake_direct(impl, rng):
    for shape, dtype in FAKE_CASES:
        x = tensor(rng, shape, dtype)
        y = impl.row_sums_fake(x)
        assert (tuple(y.shape), y.dtype, y.device) == ((shape[0],), dtype, x.device), (
            f"fake of x {shape} {dtype}: got {tuple(y.shape)} {y.dtype} {y.device}"
        )
    with pytest.raises(ValueError):
        impl.row_sums_fake(tensor(rng, (6,)))
    with pytest.raises(TypeError):
        impl.row_sums_fake(torch.ones(2, 3, dtype=torch.int32))


def check_row_sums_fake_registered(impl, rng):
    op = raw(impl, "row_sums")
    for shape, dtype in FAKE_CASES:
        x = tensor(rng, shape, dtype)
        check(op(x), x.double().sum(1), TOL[dtype], name=f"row_sums {shape}")
        torch.library.opcheck(op, (x,))  # test_faketensor: the fake agrees with the kernel
        with FakeTensorMode():
            y = op(torch.empty(shape, dtype=dtype, device=DEVICE))
        assert (tuple(y.shape), y.dtype) == ((shape[0],), dtype), (tuple(y.shape), y.dtype)
        y = op(torch.empty(shape, dtype=dtype, device="meta"))
        assert (tuple(y.shape), y.dtype) == ((shape[0],), dtype), (tuple(y.shape), y.dtype)
    with FakeTensorMode(), pytest.raises(ValueError):
        op(torch.empty(2, 3, 4))  # the fake refuses what the real operator refuses


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_row_sums_fake(impl, rng):
    check_row_sums_fake_direct(impl, rng)
    check_row_sums_fake_registered(impl, rng)


def fake_with_column(x):
    return x.new_empty(x.shape[0], 1)


def fake_of_columns(x):
    return x.new_empty(x.shape[1])


def fake_always_float32(x):
    return x.new_empty(x.shape[0], dtype=torch.float32)


def fake_fixed_size(x):
    return x.new_empty(3)


WRONG_FAKES = [fake_with_column, fake_of_columns, fake_always_float32, fake_fixed_size]


@functools.cache
def row_sums_with_fake(fake):
    """row_sums registered again (its own name) with a wrong fake."""

    def body(x: torch.Tensor) -> torch.Tensor:
        return sol.row_sums(x)

    op = torch.library.custom_op(f"course10_wrong::row_sums_{fake.__name__}", body, mutates_args=())
    op.register_fake(fake)
    return SimpleNamespace(row_sums=op, row_sums_fake=fake)


@pytest.mark.parametrize("fake", WRONG_FAKES, ids=lambda f: f.__name__)
def test_row_sums_fake_checks_catch_a_wrong_fake(fake, rng):
    wrong = row_sums_with_fake(fake)
    with pytest.raises(CHECK_FAILS):
        check_row_sums_fake_direct(wrong, rng)
    with pytest.raises(OpCheckError, match="test_faketensor"):
        check_row_sums_fake_registered(wrong, rng)


# ------------------------------------------------------------- 10.3 softsign compiles


def check_softsign(impl, rng, launches):
    for dtype in (F32, F64):
        for shape in [(3, 5), (1,), (2, 9)]:
            x = tensor(rng, shape, dtype)
            y = impl.softsign(x)
            assert y.dtype == dtype and y.shape == x.shape, (y.dtype, y.shape)
            check(y, x.double() / (1 + x.double().abs()), TOL[dtype], name=f"softsign {shape}")
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
    assert launches.seen, "the compiled function launched no Numba kernel"
    x64 = 2.0 * x.double()
    check(out, x64 / (1 + x64.abs()) + 1.0, TOL[F32], name="compiled softsign")
    torch.library.opcheck(op, (tensor(rng, (3, 5)),))


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


# ------------------------------------------------------------- 10.4 torch's stream


def check_scale_rows(fn, rng, launches):
    for dtype in (F32, F64):
        for shape in [(3, 4), (1, 1), (5, 3), (2, 9)]:
            x, s = tensor(rng, shape, dtype), tensor(rng, shape[:1], dtype)
            launches.seen.clear()
            y = fn(x, s)
            assert launches.seen, "no kernel was launched"
            for name, configuration in launches.seen:
                stream = configuration[2] if len(configuration) >= 3 else "none (the default)"
                assert stream is launches.mark, (
                    f"{name} launched on stream {stream!r}, not bridge.torch_stream()"
                )
            check(y, s.double()[:, None] * x.double(), TOL[dtype], name=f"scale_rows {shape}")
    x = tensor(rng, (3, 4))
    with pytest.raises(ValueError):
        fn(x, tensor(rng, (4,)))
    with pytest.raises(TypeError):
        fn(x, tensor(rng, (3,), F64))


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_scale_rows_launches_on_torch_stream(impl, rng, launches):
    check_scale_rows(impl.scale_rows, rng, launches)


def test_scale_rows_check_catches_the_default_stream(rng, launches):
    with pytest.raises(AssertionError, match="not bridge.torch_stream"):
        check_scale_rows(sol.scale_rows_default_stream, rng, launches)


# ---------------------------------------------------------------- 10.5 bias + ReLU

BIAS_RELU_KERNELS = sol.make_bias_relu_kernels  # before a test patches in a wrong one
BIAS_RELU_SHAPES = [(3, 4), (1, 1), (5, 9), (2, 17)]


def bias_relu_inputs(rng, shape, dtype, requires_grad=False):
    """x, b with z = x + b at least 0.1 away from ReLU's kink, its last element
    negative (if not [0, 0]), z[0, 0] = b[0] / 2 > 0.5 and x[0, 0] < 0: a backward that
    tests x > 0 instead of x + b > 0, or a forward relu(x) + b, is wrong there."""
    b = tensor(rng, shape[1:], F64)
    b[0] = 1.0 + b[0].abs()
    z = away_from_zero(rng, shape, F64)
    z.view(-1)[-1] = -z.view(-1)[-1].abs()
    z[0, 0] = 0.5 * b[0]
    x = z - b
    return x.to(dtype).requires_grad_(requires_grad), b.to(dtype).requires_grad_(requires_grad)


def check_bias_relu_values(bias_relu, bias_relu_backward, rng):
    for dtype in (F32, F64):
        for shape in BIAS_RELU_SHAPES:
            x, b = bias_relu_inputs(rng, shape, dtype)
            y = bias_relu(x, b)
            assert y.dtype == dtype and y.shape == x.shape, (y.dtype, y.shape)
            z = x.double() + b.double()
            check(y, torch.relu(z), TOL[dtype], name=f"bias_relu {shape}")
            dy = tensor(rng, shape, dtype)
            dx, db = bias_relu_backward(dy, x, b)
            ref_dx = dy.double() * (z > 0)
            check(dx, ref_dx, TOL[dtype], name=f"bias_relu dx {shape}")
            check(db, ref_dx.sum(0), TOL[dtype], name=f"bias_relu db {shape}")
    x, b = bias_relu_inputs(rng, (3, 4), F32)
    with pytest.raises(ValueError):
        bias_relu(x, tensor(rng, (3,)))
    with pytest.raises(TypeError):
        bias_relu(x, b.double())
    with pytest.raises(ValueError):
        bias_relu_backward(tensor(rng, (3, 5)), x, b)


def check_bias_relu_gradients(impl, rng):
    x, b = bias_relu_inputs(rng, (3, 4), F64, requires_grad=True)
    torch.autograd.gradcheck(impl.bias_relu, (x, b), raise_exception=True)
    torch.library.opcheck(raw(impl, "bias_relu"), (x, b))
    x, b = bias_relu_inputs(rng, (4, 9), F32, requires_grad=True)
    g = tensor(rng, (4, 9))
    impl.bias_relu(x, b).backward(g)
    x64, b64 = (t.detach().double().requires_grad_() for t in (x, b))
    torch.relu(x64 + b64).backward(g.double())
    check(x.grad, x64.grad, TOL[F32], name="bias_relu dx (float32, autograd)")
    check(b.grad, b64.grad, TOL[F32], name="bias_relu db (float32, autograd)")


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_bias_relu(impl, rng):
    check_bias_relu_values(impl.bias_relu, impl.bias_relu_backward, rng)
    check_bias_relu_gradients(impl, rng)


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
def test_bias_relu_checks_catch_a_wrong_kernel(bug, monkeypatch, rng):
    monkeypatch.setattr(
        sol, "make_bias_relu_kernels", functools.partial(make_bias_relu_wrong, bug=bug)
    )
    with pytest.raises(CheckError):
        check_bias_relu_values(sol.bias_relu, sol.bias_relu_backward, rng)
    with pytest.raises(GRAD_ERRORS):
        check_bias_relu_gradients(sol, rng)


# ------------------------------------------------------------ 10.6 setup_context


def brier_inputs(rng, n, c, dtype, requires_grad=False):
    p = tensor(rng, (n, c), dtype, low=0.0, high=1.0, requires_grad=requires_grad)
    target = torch.from_numpy(rng.integers(0, c, n)).to(DEVICE)
    w = tensor(rng, (c,), dtype, low=0.5, high=2.0, requires_grad=requires_grad)
    return p, target, w


def brier_reference(p, target, w):
    onehot = torch.nn.functional.one_hot(target, p.shape[1]).to(p.dtype)
    return (w * (p - onehot) ** 2).sum(1)


def check_brier_direct(brier_setup_context, brier_backward, rng):
    for dtype in (F32, F64):
        for n, c in [(3, 4), (1, 1), (5, 9)]:
            p, target, w = brier_inputs(rng, n, c, dtype)
            ctx = RecordingContext()
            loss = sol.brier_score(p, target, w)
            check(loss, brier_reference(p.double(), target, w.double()), TOL[dtype], name="loss")
            brier_setup_context(ctx, (p, target, w), loss)
            dloss = tensor(rng, (n,), dtype)
            grads = brier_backward(ctx, dloss)
            assert len(grads) == 3, f"one gradient per input (p, target, w), got {len(grads)}"
            assert grads[1] is None, "target holds class indices: its gradient is None"
            p64, w64 = (t.double().requires_grad_() for t in (p, w))
            brier_reference(p64, target, w64).backward(dloss.double())
            check(grads[0], p64.grad, TOL[dtype], name=f"dp {n}x{c}")
            check(grads[2], w64.grad, TOL[dtype], name=f"dw {n}x{c}")


def check_brier_autograd(impl, rng):
    op = raw(impl, "brier_score")
    p, target, w = brier_inputs(rng, 3, 4, F64, requires_grad=True)
    torch.autograd.gradcheck(op, (p, target, w), raise_exception=True)
    torch.library.opcheck(op, (p, target, w))
    p, target, w = brier_inputs(rng, 4, 5, F32, requires_grad=True)
    g = tensor(rng, (4,))
    impl.brier_score(p, target, w).backward(g)
    p64, w64 = (t.detach().double().requires_grad_() for t in (p, w))
    brier_reference(p64, target, w64).backward(g.double())
    check(p.grad, p64.grad, TOL[F32], name="dp (float32, autograd)")
    check(w.grad, w64.grad, TOL[F32], name="dw (float32, autograd)")
    # Saved with save_for_backward, an input changed in place before the
    # backward is an error, not a gradient of numbers that are gone.
    for which in (0, 2):
        inputs = brier_inputs(rng, 3, 4, F32, requires_grad=True)
        loss = op(*inputs)
        with torch.no_grad():
            inputs[which].mul_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.sum().backward()


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_brier_setup_context_and_backward(impl, rng):
    check_brier_direct(impl.brier_setup_context, impl.brier_backward, rng)
    check_brier_autograd(impl, rng)


def brier_setup_in_attributes(ctx, inputs, output):
    ctx.p, ctx.target, ctx.w = inputs  # works, but autograd cannot see them saved


def brier_backward_wrong(ctx, dloss, bug):
    """A backward with one bug, as named in BRIER_BUGS."""
    if bug == "attributes":
        p, target, w = ctx.p, ctx.target, ctx.w
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
    "no_dw": "autograd",  # gradcheck: w's gradient is missing
    "target_grad": "direct",  # a gradient for class indices
    "swapped": "direct",
}


@pytest.mark.parametrize("bug", list(BRIER_BUGS))
def test_brier_checks_catch_a_wrong_registration(bug, rng):
    setup = brier_setup_in_attributes if bug == "attributes" else sol.brier_setup_context
    backward = functools.partial(brier_backward_wrong, bug=bug)
    wrong = SimpleNamespace(
        brier_setup_context=setup, brier_backward=backward, brier_score=sol.brier_score
    )
    ours = (sol.brier_backward, sol.brier_setup_context)
    with autograd_replaced(sol.brier_score, backward, setup, ours):
        with pytest.raises(CHECK_FAILS):
            if BRIER_BUGS[bug] == "direct":
                check_brier_direct(setup, backward, rng)
            else:
                check_brier_autograd(wrong, rng)


def test_brier_score_gives_nan_for_a_target_out_of_range(rng):
    p, target, w = brier_inputs(rng, 3, 4, F32, requires_grad=True)
    target[1] = 4
    loss = sol.brier_score(p, target, w)
    assert torch.isnan(loss[1]) and not torch.isnan(loss[[0, 2]]).any(), loss
    loss.sum().backward()
    assert torch.isnan(p.grad[1]).all() and not torch.isnan(p.grad[[0, 2]]).any(), p.grad
