"""Chapter 10: the fused operators against torch autograd in float64, their
argument checks, PyTorch's own operator tests, and the scripts in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator
from common.checking import CheckError
from common.internal.exercises import load_chapter_module

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mutants import mutant

CHAPTER = "10_pytorch_extensions"
ops = load_chapter_module(CHAPTER, "ops")
bridge = load_chapter_module(CHAPTER, "bridge")
fused = load_chapter_module(CHAPTER, "fused_ops")
checks = load_chapter_module(CHAPTER, "operator_checks")
DEV = fused.device()


def generator(rng):
    """A torch.Generator seeded from the rng fixture (fused_ops' input makers take one)."""
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def randn(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(DEV)


def check_step(name, op, composite, inputs, grad_out, tolerances):
    """The script's own check (fused_ops.check_against_float64): ``op``'s output
    and gradients against ``composite``'s in float64, within ``tolerances(ref)``."""
    fused.check_against_float64(name, op, composite, inputs, grad_out, tolerances)


# (M, N): one element, fewer columns than a block, more columns than a block
# (THREADS is 8 in the simulator), more rows than the row splits
@pytest.mark.parametrize("shape", [(1, 1), (5, 11), (7, 3), (2, 19)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_gelu_matches_float64(shape, dtype, rng):
    (x, b), dy = fused.bias_gelu_inputs(*shape, generator(rng))
    x, b, dy = (t.detach().to(dtype) for t in (x, b, dy))
    # float32 rounding, not a fixed 1e-5: one element near GELU'(z) = 0 cancels
    check_step(
        "bias_gelu",
        ops.bias_gelu,
        fused.bias_gelu_composite,
        (x.requires_grad_(), b.requires_grad_()),
        dy,
        lambda ref: ops.bias_gelu_tolerances(x, b, dy, ref),
    )


@pytest.mark.parametrize("shape", [(1, 1), (4, 13), (3, 2), (2, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_matches_float64(shape, dtype, rng):
    check_cross_entropy(shape, dtype, rng)


def test_cross_entropy_check_catches_a_gradient_without_the_onehot(rng, monkeypatch):
    # softmax instead of softmax - onehot: off by |dloss| at each row's target,
    # far above the rounding cross_entropy_tolerances allows even for a confident row
    wrong = mutant(
        ops.make_cross_entropy_kernels, ("g * (p - one) if c == label else g * p", "g * p")
    )
    monkeypatch.setattr(ops, "make_cross_entropy_kernels", wrong)
    monkeypatch.setattr(ops, "_KERNELS", {})
    for shape in [(4, 13), (3, 2)]:
        with pytest.raises(CheckError, match="gradient 0"):
            check_cross_entropy(shape, torch.float32, rng)


def check_cross_entropy(shape, dtype, rng):
    (logits, target), dloss = fused.cross_entropy_inputs(*shape, generator(rng))
    target[0] = shape[1] - 1  # the last class, and (below) the first
    target[-1] = 0
    logits, dloss = logits.detach().to(dtype).requires_grad_(), dloss.to(dtype)
    # float32 rounding, not a fixed 1e-5: a confident row's loss is near 0
    check_step(
        "cross_entropy",
        ops.softmax_cross_entropy,
        fused.cross_entropy_composite,
        (logits, target),
        dloss,
        lambda ref: ops.cross_entropy_tolerances(logits, target, dloss, ref),
    )


def test_cross_entropy_large_logits_do_not_overflow():
    # exp(1000) overflows float32: the online max keeps every exponent <= 0
    logits = torch.tensor([[1000.0, 999.0, -1000.0]], device=DEV, requires_grad=True)
    target = torch.tensor([1], device=DEV)
    loss = ops.softmax_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.double(), target, reduction="none")
    # loss = logsumexp - 999 = 1.313: the float32 logsumexp near 1000 is known to one
    # ulp there (6.1e-5), so the loss agrees to about 5e-5 relative
    assert torch.isfinite(loss).all() and math.isclose(loss.item(), ref.item(), rel_tol=1e-4)


def test_invalid_target_gives_nan_not_a_wrong_number(rng):
    logits = randn(rng, 3, 5).requires_grad_()
    target = torch.tensor([1, 5, -1], device=DEV)  # 5 and -1 are outside [0, 5)
    loss = ops.softmax_cross_entropy(logits, target)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()
    (g,) = torch.autograd.grad(loss[0], logits)  # row 0's gradient is still right
    assert torch.isfinite(g[0]).all()
    (g,) = torch.autograd.grad(ops.softmax_cross_entropy(logits, target).sum(), logits)
    assert torch.isnan(g[1:]).all() and torch.isfinite(g[0]).all()


def strided(t):
    """``t``'s values, not contiguous: a matrix transposed in memory, a vector every
    other element of one twice as long from offset 1 (the gaps NaN, or -1 for
    class indices: a kernel reading them as contiguous gets poison)."""
    if t.dim() == 2:
        out = t.detach().t().contiguous().t()
    else:
        base = torch.full((2 * t.shape[0],), -1 if t.dtype == torch.int64 else math.nan)
        out = base.to(t.device, t.dtype)[1::2]
        out.copy_(t.detach())
    assert not out.is_contiguous()
    return out.detach().requires_grad_(t.requires_grad)


def check_non_contiguous(rng, which):
    """bias_gelu or cross_entropy, forward and backward, on non-contiguous inputs
    and upstream gradient; ops.view copies each to a contiguous one."""
    if which == "bias_gelu":
        (x, b), dy = fused.bias_gelu_inputs(5, 11, generator(rng))
        inputs, grad_out = (strided(x), strided(b)), strided(dy)
        check_step(
            "bias_gelu (non-contiguous)",
            ops.bias_gelu,
            fused.bias_gelu_composite,
            inputs,
            grad_out,
            lambda ref: ops.bias_gelu_tolerances(*inputs, grad_out, ref),
        )
    else:
        (logits, target), dloss = fused.cross_entropy_inputs(4, 13, generator(rng))
        inputs, grad_out = (strided(logits), strided(target)), strided(dloss)
        check_step(
            "cross_entropy (non-contiguous)",
            ops.softmax_cross_entropy,
            fused.cross_entropy_composite,
            inputs,
            grad_out,
            lambda ref: ops.cross_entropy_tolerances(*inputs, grad_out, ref),
        )


@pytest.mark.parametrize("which", ["bias_gelu", "cross_entropy"])
def test_non_contiguous_inputs_are_handled(which, rng):
    check_non_contiguous(rng, which)


def view_as_if_contiguous(t, name):
    """ops.view without its .contiguous(): a transposed or sliced tensor's storage
    read in row-major order (numba_view would refuse the strides, so they are dropped)."""
    t = t.detach()
    return bridge.numba_view(t.as_strided(t.shape, t.new_empty(t.shape).stride()), name)


@pytest.mark.parametrize("which", ["bias_gelu", "cross_entropy"])
def test_non_contiguous_check_catches_storage_read_as_contiguous(which, rng, monkeypatch):
    monkeypatch.setattr(ops, "view", view_as_if_contiguous)
    with pytest.raises(CheckError, match="non-contiguous"):
        check_non_contiguous(rng, which)


@pytest.mark.parametrize(
    "args, error",
    [
        ((torch.randn(2, 3, dtype=torch.float16), torch.randn(3, dtype=torch.float16)), TypeError),
        ((torch.randn(2, 3), torch.randn(3, dtype=torch.float64)), TypeError),
        ((torch.randn(2, 3), torch.randn(4)), ValueError),
        ((torch.randn(6), torch.randn(6)), ValueError),
    ],
)
def test_bias_gelu_refuses_bad_arguments(args, error):
    with pytest.raises(error):
        ops.bias_gelu(*(t.to(DEV) for t in args))


def test_cross_entropy_refuses_bad_arguments():
    logits = torch.randn(3, 4, device=DEV)
    with pytest.raises(TypeError, match="int64"):
        ops.softmax_cross_entropy(logits, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="target"):
        ops.softmax_cross_entropy(logits, torch.tensor([0, 1], device=DEV))


def test_check_catches_a_wrong_gradient(rng):
    # the float64 check the script runs, on a composite with a wrong backward
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, b):
            ctx.save_for_backward(x, b)
            return F.gelu(x + b)

        @staticmethod
        def backward(ctx, dy):
            x, b = ctx.saved_tensors
            dz = dy * 0.5 * (1 + torch.erf((x + b) / 2**0.5))  # the x * pdf(x) term dropped
            return dz, dz.sum(0)

    (x, b), dy = fused.bias_gelu_inputs(5, 11, generator(rng))
    with pytest.raises(CheckError, match="gradient"):
        fused.check_against_float64(
            "wrong",
            Wrong.apply,
            fused.bias_gelu_composite,
            (x, b),
            dy,
            lambda ref: ops.bias_gelu_tolerances(x, b, dy, ref),
        )


def test_operator_checks_pass_and_catch_the_broken_copies(capsys):
    # opcheck on all four operators, gradcheck on both, and both tools failing on
    # the broken copies (a backward missing a term, a fake with the wrong shape)
    assert checks.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("all 4 tests pass") == 4 and out.count("passes") >= 2
    assert "gradcheck fails (caught)" in out and "test_faketensor fails (caught)" in out


@pytest.mark.skipif(is_simulator(), reason="streams exist only on a GPU")
def test_op_runs_on_torchs_current_stream():
    # inputs made on a side stream and used there: launched on any other stream,
    # the kernel could read x before it is written
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(4096, 4096, device="cuda") * 2
        b = torch.randn(4096, device="cuda")
        y = ops.bias_gelu(x, b)
        ref = F.gelu(x + b)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not is_simulator(), reason="on a GPU fused_ops.py times full sizes")
def test_fused_ops_script_checks_every_version(tmp_path, capsys):
    assert fused.main(["--out", str(tmp_path)]) == 0
    assert "every version matches torch autograd in float64" in capsys.readouterr().out
