"""Chapter 10: the fused operators against torch autograd in float64 (the
logsumexp output's gradient too), their argument checks, PyTorch's own operator
tests on several samples, the stream each launch goes to, and the scripts in the
simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator
from common.checking import CheckError, check
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
DEV = bridge.device()


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
    wrong = mutant(ops.make_cross_entropy_kernels, ("g * (p - one) + d * p", "g * p + d * p"))
    monkeypatch.setattr(ops, "make_cross_entropy_kernels", wrong)
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


def test_each_operator_is_registered_under_its_python_name():
    # one name, one meaning: torch.ops.course10.<name> is ops.<name>, and the
    # function that returns the loss alone is not an operator of that name
    registered = {
        name: op
        for name, op in vars(ops).items()
        if isinstance(op, torch._library.custom_ops.CustomOpDef)
    }
    assert set(registered) == {
        "bias_gelu",
        "bias_gelu_backward",
        "softmax_cross_entropy_with_lse",
        "softmax_cross_entropy_backward",
    }
    for name, op in registered.items():
        assert op._qualname == f"course10::{name}", (name, op._qualname)
    assert not hasattr(torch.ops.course10, "softmax_cross_entropy")


# ------------------------------------------------- the logsumexp output's gradient
# lse = logsumexp(logits) is an output of course10::softmax_cross_entropy_with_lse:
# a loss that uses it (z-loss, a log-partition term) needs its gradient, softmax
# times dlse, added to the cross-entropy's. A backward that drops it errs by O(1).

CE_SHAPES = [(1, 1), (4, 13), (3, 2), (2, 19)]


def composite_with_lse(logits, target):
    return F.cross_entropy(logits, target, reduction="none"), torch.logsumexp(logits, 1)


@pytest.mark.parametrize("shape", CE_SHAPES)
def test_lse_output_passes_gradcheck(shape, rng):
    (logits, target), _ = fused.cross_entropy_inputs(*shape, generator(rng))
    z = logits.detach().double().requires_grad_()
    # both outputs, then the logsumexp alone (the loss's upstream gradient is None)
    assert torch.autograd.gradcheck(lambda z: ops.softmax_cross_entropy_with_lse(z, target), (z,))
    assert torch.autograd.gradcheck(
        lambda z: ops.softmax_cross_entropy_with_lse(z, target)[1], (z,)
    )


@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_output_gradient_matches_float64_composite(shape, dtype, rng):
    # dloss and dlse of either sign: a backward that adds dlse p with the wrong
    # sign, to the label only, or not at all is off by |dlse| p
    (logits, target), dloss = fused.cross_entropy_inputs(*shape, generator(rng))
    dlse = torch.from_numpy(rng.uniform(-2, 2, shape[0])).to(DEV)
    dloss = dloss * torch.from_numpy(rng.choice([-1.0, 1.0], shape[0])).to(DEV)
    z = logits.detach().to(dtype).requires_grad_()
    outs = ops.softmax_cross_entropy_with_lse(z, target)
    (got,) = torch.autograd.grad(outs, z, (dloss.to(dtype), dlse.to(dtype)))
    z64 = logits.detach().double().requires_grad_()
    ref_outs = composite_with_lse(z64, target)
    (ref,) = torch.autograd.grad(ref_outs, z64, (dloss.double(), dlse.double()))
    if dtype == torch.float64:
        tol = 1e-12
    elif shape[1] == 1:  # one class: p = 1 exactly, dlogits = dlse (and the loss is 0)
        tol = 1e-5
    else:
        _, tol = ops.cross_entropy_tolerances(z, target, dloss, (ref_outs[0], ref), dlse=dlse)
    check(got, ref, tol, name=f"dlogits {dtype}")
    check(outs[1], ref_outs[1], 1e-5 if dtype == torch.float32 else 1e-12, name="lse")


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
    # opcheck on several samples of all four operators, gradcheck on both, the
    # stream check on both, and each tool failing on its broken copy (a backward
    # missing a term, a fake with the wrong shape, a launch with no stream)
    assert checks.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("all 4 tests pass on") == 4 and out.count("passes") >= 2
    assert out.count("each on bridge.torch_stream()") == 2
    assert "gradcheck fails (caught)" in out and "test_faketensor fails (caught)" in out
    assert "the stream check fails (caught)" in out


def test_operator_checks_sample_every_dtype_layout_and_requires_grad_mix():
    # one friendly sample hides a fake that is wrong for float32, a transposed
    # input or an empty batch, and an autograd registration wrong without grad
    for name, (_, arg_sets) in checks.sample_inputs().items():
        tensors = [[a for a in args if a.is_floating_point()] for args in arg_sets]
        assert {ts[0].dtype for ts in tensors} == {torch.float32, torch.float64}, name
        every = [t for ts in tensors for t in ts]
        assert any(ts[0].numel() == 1 for ts in tensors), f"{name}: no one-element sample"
        assert any(ts[0].numel() == 0 for ts in tensors), f"{name}: no empty batch"
        assert any(not t.is_contiguous() for t in every), f"{name}: no strided input"
        assert any(t.shape[-1] % ops.THREADS and t.shape[-1] > ops.THREADS for t in every), (
            f"{name}: no sample wider than a block and not a multiple of it"
        )
        if name.startswith("bias_gelu"):  # rows spread over ops.ROW_SPLITS groups
            assert any(
                ts[0].shape[0] % ops.ROW_SPLITS and ts[0].shape[0] > ops.ROW_SPLITS
                for ts in tensors
            ), f"{name}: no sample with more rows than row groups, not a multiple"
        if not name.endswith("_backward"):
            grads = {tuple(t.requires_grad for t in ts) for ts in tensors}
            assert any(all(g) for g in grads) and any(not any(g) for g in grads), name


# ---------------------------------------------------------------- streams
# Each operator launches every kernel on bridge.torch_stream(), torch's current
# stream: a kernel on Numba's default stream does not wait for the torch work
# that wrote its inputs. On a GPU that race shows only behind a long producer,
# and not always (pitfalls.py: 19 of 20 trials); never in the simulator. What
# the guard checks is the launch itself: operator_checks.recorded_launches
# records each launch's stream, so a launch off torch's stream fails every run.

STREAM_CASES = {
    "bias_gelu": (lambda x, b: ops.bias_gelu(x, b), 3),  # forward; backward, column sum
    "cross_entropy": (lambda z, t: ops.softmax_cross_entropy_with_lse(z, t), 2),
}


def stream_inputs(which, rng):
    if which == "bias_gelu":
        (x, b), _ = fused.bias_gelu_inputs(5, 11, generator(rng))
        return x, b
    (logits, target), _ = fused.cross_entropy_inputs(4, 13, generator(rng))
    return logits, target


@pytest.mark.parametrize("which", list(STREAM_CASES))
def test_every_launch_goes_to_torchs_current_stream(which, rng):
    fn, launches = STREAM_CASES[which]
    assert checks.stream_check(which, fn, stream_inputs(which, rng)) == launches


# Each launch of ops.py: (its launcher, the launch with its stream, kernel name).
# Each mutant drops the stream: kernel[grid, block] runs on Numba's default stream.
LAUNCHES = [
    ("launch_bias_gelu_forward", "THREADS, bridge.torch_stream()]", "bias_gelu_forward"),
    ("launch_bias_gelu_backward", "rows), THREADS, stream]", "bias_gelu_backward"),
    (
        "launch_bias_gelu_backward",
        "column_sum[ceil_div(n, THREADS), THREADS, stream]",
        "column_sum",
    ),
    ("launch_cross_entropy_forward", "THREADS, bridge.torch_stream()]", "cross_entropy_forward"),
    ("launch_cross_entropy_backward", "THREADS, bridge.torch_stream()]", "cross_entropy_backward"),
]


@pytest.mark.parametrize("launcher, launch, kernel", LAUNCHES, ids=[k for *_, k in LAUNCHES])
def test_stream_check_catches_a_launch_on_the_default_stream(
    launcher, launch, kernel, rng, monkeypatch
):
    default_stream = launch.replace(", bridge.torch_stream()", "").replace(", stream]", "]")
    monkeypatch.setattr(ops, launcher, mutant(getattr(ops, launcher), (launch, default_stream)))
    which = "bias_gelu" if "bias_gelu" in launcher else "cross_entropy"
    fn, _ = STREAM_CASES[which]
    with pytest.raises(CheckError, match=f"{kernel} launched on stream .none"):
        checks.stream_check(which, fn, stream_inputs(which, rng))


def test_recorded_launches_restores_the_launch_and_the_stream(rng):
    launch = type(checks._probe).__getitem__
    torch_stream = bridge.torch_stream
    with pytest.raises(RuntimeError), checks.recorded_launches():
        raise RuntimeError("a check that fails inside the block")
    assert type(checks._probe).__getitem__ is launch and bridge.torch_stream is torch_stream


@pytest.mark.skipif(is_simulator(), reason="streams race only on a GPU")
def test_ops_wait_for_a_long_producer_on_torchs_stream():
    # As pitfalls.py's race: on a side stream, a 4096^3 matmul (milliseconds)
    # writes x, then the operator reads it. Launched on any other stream, the
    # kernel reads x (zeros) before the matmul has written it.
    a = torch.randn(4096, 4096, device="cuda") / 16  # x = a @ a of about 0.25, not 0
    b = torch.randn(1024, device="cuda")
    target = torch.randint(0, 1024, (64,), device="cuda")
    for trial in range(3):
        x = torch.zeros(64, 1024, device="cuda")
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x.copy_((a @ a)[:64, :1024])  # long, then x written on s
            y = ops.bias_gelu(x, b)
            loss = ops.softmax_cross_entropy(x, target)
        torch.cuda.synchronize()
        check(y, F.gelu(x.double() + b.double()), 1e-5, name=f"bias_gelu, trial {trial}")
        ref = F.cross_entropy(x.double(), target, reduction="none")
        check(loss, ref, 1e-5, name=f"cross-entropy, trial {trial}")


@pytest.mark.skipif(not is_simulator(), reason="on a GPU fused_ops.py times full sizes")
def test_fused_ops_script_checks_every_version(tmp_path, capsys):
    assert fused.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every version matches torch autograd in float64" in out
    # the notebook calls compare_all and report instead of re-typing main: the same run
    results = fused.compare_all()
    assert {(t.extra["op"], t.extra["version"]) for t in results} == {
        (op, version)
        for op in ("bias_gelu", "cross_entropy")
        for version in ("ours (custom op)", "torch eager")
    }
    assert fused.report(results) in out


def test_full_float32_switches_tf32_off_and_restores_it():
    flags = (torch.backends.cudnn, torch.backends.cuda.matmul)
    saved = [f.allow_tf32 for f in flags]
    try:
        for before in (True, False):
            for f in flags:
                f.allow_tf32 = before
            with pytest.raises(RuntimeError), bridge.full_float32():
                assert [f.allow_tf32 for f in flags] == [False, False]
                raise RuntimeError("restored on the way out of an error too")
            assert [f.allow_tf32 for f in flags] == [before, before]
    finally:
        for f, value in zip(flags, saved):
            f.allow_tf32 = value


def test_a_copy_made_for_a_launch_outlives_the_launch_call():
    # ops.view copies a transposed input; the view must hold that copy. A view
    # that did not (bridge.numba_view's) would let the next allocation take its
    # memory on a GPU: here, the fresh tensors made after every reference to
    # the copy is gone.
    import gc

    x = torch.randn(37, 53, device=bridge.device())
    want = x.t().contiguous().cpu()
    v = ops.view(x.t(), "x")
    gc.collect()
    others = [torch.randn(53, 37, device=bridge.device()) for _ in range(8)]
    np.testing.assert_array_equal(v.copy_to_host(), want.numpy())
    assert len(others) == 8


def test_owning_view_checks_as_numba_view_does():
    with pytest.raises(TypeError, match="float32"):
        bridge.owning_view(
            torch.zeros(3, dtype=torch.float64, device=bridge.device()), "t", torch.float32
        )
    with pytest.raises(ValueError, match="contiguous"):
        bridge.owning_view(torch.zeros(3, 4, device=bridge.device()).t(), "t")
