"""Chapter 10: the fused operators against torch autograd in float64, their
argument checks, PyTorch's own operator tests, and the scripts in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator
from common.checking import CheckError
from common.internal.exercises import load_chapter_module

import math

import pytest
import torch
import torch.nn.functional as F

CHAPTER = "10_pytorch_extensions"
ops = load_chapter_module(CHAPTER, "ops")
fused = load_chapter_module(CHAPTER, "fused_ops")
checks = load_chapter_module(CHAPTER, "operator_checks")
DEV = fused.device()


# (M, N): one element, fewer columns than a block, more columns than a block
# (THREADS is 8 in the simulator), more rows than the row splits
@pytest.mark.parametrize("shape", [(1, 1), (5, 11), (7, 3), (2, 19)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_gelu_matches_float64(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    (x, b), dy = fused.bias_gelu_inputs(*shape, gen)
    x, b, dy = (t.detach().to(dtype) for t in (x, b, dy))
    fused.check_against_float64(
        "bias_gelu",
        ops.bias_gelu,
        fused.bias_gelu_composite,
        (x.requires_grad_(), b.requires_grad_()),
        dy,
    )


@pytest.mark.parametrize("shape", [(1, 1), (4, 13), (3, 2), (2, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_matches_float64(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    (logits, target), dloss = fused.cross_entropy_inputs(*shape, gen)
    target[0] = shape[1] - 1  # the last class, and (below) the first
    target[-1] = 0
    logits = logits.detach().to(dtype).requires_grad_()
    fused.check_against_float64(
        "cross_entropy",
        ops.softmax_cross_entropy,
        fused.cross_entropy_composite,
        (logits, target),
        dloss.to(dtype),
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


def test_invalid_target_gives_nan_not_a_wrong_number():
    logits = torch.randn(3, 5, device=DEV, requires_grad=True)
    target = torch.tensor([1, 5, -1], device=DEV)  # 5 and -1 are outside [0, 5)
    loss = ops.softmax_cross_entropy(logits, target)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()
    (g,) = torch.autograd.grad(loss[0], logits)  # row 0's gradient is still right
    assert torch.isfinite(g[0]).all()
    (g,) = torch.autograd.grad(ops.softmax_cross_entropy(logits, target).sum(), logits)
    assert torch.isnan(g[1:]).all() and torch.isfinite(g[0]).all()


def test_non_contiguous_input_is_handled():
    x = torch.randn(11, 5, device=DEV).t()  # (5, 11), transposed strides
    b = torch.randn(11, device=DEV)
    assert not x.is_contiguous()
    torch.testing.assert_close(ops.bias_gelu(x, b), F.gelu(x + b), rtol=1e-5, atol=1e-6)


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


def test_check_catches_a_wrong_gradient():
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

    (x, b), dy = fused.bias_gelu_inputs(5, 11, torch.Generator().manual_seed(1))
    with pytest.raises(CheckError, match="gradient"):
        fused.check_against_float64("wrong", Wrong.apply, fused.bias_gelu_composite, (x, b), dy)


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
