"""PyTorch's own tools on our operators: opcheck, gradcheck, and what they catch.

``torch.library.opcheck(op, args)`` runs four tests on a custom operator:

* ``test_schema``: the operator does what its schema says (no input mutated
  that the schema does not declare, no output aliasing an input);
* ``test_autograd_registration``: its autograd is registered the way
  ``register_autograd`` does it (not by calling autograd from inside the op);
* ``test_faketensor``: the fake implementation gives the shapes, dtypes and
  strides the real one gives (what torch.compile and FakeTensor rely on);
* ``test_aot_dispatch_dynamic``: it traces through AOTAutograd, forward and
  backward, with dynamic shapes.

``torch.autograd.gradcheck`` compares the backward with finite differences
of the forward, in float64 (our kernels are built per dtype for this).

This script runs both on every operator of ops.py, then shows that they fail
where they should: a copy of bias_gelu whose backward forgets a term fails
gradcheck (opcheck cannot see numbers), and a copy whose fake implementation
gives the wrong shape fails opcheck's ``test_faketensor``.

Run: python chapters/10_pytorch_extensions/operator_checks.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator
from common.harness import run_script, script_parser
from common.internal.exercises import import_sibling

import torch

ops = import_sibling(__file__, "ops")


def device() -> torch.device:
    return torch.device("cpu" if is_simulator() else "cuda")


def sample_inputs(dtype=torch.float64, requires_grad=True):
    """Small inputs for every operator: {name: (op overload, args)}. Shapes are
    not multiples of any block: 5 x 11 (bias_gelu), 4 x 13 (cross-entropy)."""
    gen = torch.Generator().manual_seed(0)
    dev = device()

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(dev).requires_grad_(requires_grad)

    x, b = rand(5, 11), rand(11)
    logits = rand(4, 13)
    target = torch.tensor([0, 12, 5, 3], device=dev)
    dy = torch.randn(5, 11, generator=gen, dtype=dtype).to(dev)
    lse = torch.logsumexp(logits.detach(), dim=1)
    dloss = torch.rand(4, generator=gen, dtype=dtype).to(dev)
    return {
        "bias_gelu": (torch.ops.course10.bias_gelu.default, (x, b)),
        "bias_gelu_backward": (
            torch.ops.course10.bias_gelu_backward.default,
            (dy, x.detach(), b.detach()),
        ),
        "softmax_cross_entropy": (
            torch.ops.course10.softmax_cross_entropy.default,
            (logits, target),
        ),
        "softmax_cross_entropy_backward": (
            torch.ops.course10.softmax_cross_entropy_backward.default,
            (dloss, logits.detach(), target, lse),
        ),
    }


def run_opcheck(op, args) -> dict[str, str]:
    """opcheck's four results ({"test_schema": "SUCCESS", ...}); never raises."""
    return torch.library.opcheck(op, args, raise_exception=False)


def run_gradcheck(fn, inputs) -> bool:
    """gradcheck in float64 on ``fn(*inputs)``; False (not an exception) on a mismatch."""
    return torch.autograd.gradcheck(fn, inputs, raise_exception=False)


# ---------------------------------------------------------------- broken copies
# Registered under their own namespace, so they never replace the real ones.


@torch.library.custom_op("course10_broken::bias_gelu_half_grad", mutates_args=())
def bias_gelu_half_grad(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bias_gelu, whose backward (below) drops the x * pdf(x) term of GELU'."""
    return ops.bias_gelu(x.detach(), b.detach())


@bias_gelu_half_grad.register_fake
def _(x, b):
    return torch.empty_like(x)


def _half_grad_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _half_grad_backward(ctx, dy):
    x, b = ctx.saved_tensors
    z = x + b
    dz = dy * 0.5 * (1 + torch.erf(z / 2**0.5))  # Phi(z) only: the bug
    return dz, dz.sum(0)


bias_gelu_half_grad.register_autograd(_half_grad_backward, setup_context=_half_grad_setup)


@torch.library.custom_op("course10_broken::bias_gelu_bad_fake", mutates_args=())
def bias_gelu_bad_fake(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bias_gelu whose fake implementation (below) returns (N, M) instead of (M, N)."""
    return ops.bias_gelu(x.detach(), b.detach())


@bias_gelu_bad_fake.register_fake
def _(x, b):
    return x.new_empty(x.shape[1], x.shape[0])  # the bug: transposed shape


def main(argv=None) -> int:
    parser = script_parser(__doc__, "10_pytorch_extensions")
    parser.parse_args(argv)
    failed = []
    print("opcheck on every operator (float64 inputs):")
    for name, (op, args) in sample_inputs().items():
        result = run_opcheck(op, args)
        bad = {k: v for k, v in result.items() if v != "SUCCESS"}
        print(f"  {name:<32} " + ("all 4 tests pass" if not bad else f"FAILED {bad}"))
        if bad:
            failed.append(name)
    inputs = sample_inputs()
    x, b = inputs["bias_gelu"][1]
    logits, target = inputs["softmax_cross_entropy"][1]
    print("gradcheck (float64, finite differences):")
    for name, fn, args in (
        ("bias_gelu", ops.bias_gelu, (x, b)),
        ("softmax_cross_entropy", lambda z: ops.softmax_cross_entropy(z, target), (logits,)),
    ):
        ok = run_gradcheck(fn, args)
        print(f"  {name:<32} {'passes' if ok else 'FAILED'}")
        if not ok:
            failed.append(name)
    print("the same tools on deliberately broken copies:")
    caught = run_gradcheck(bias_gelu_half_grad, (x, b)) is False
    print(
        f"  backward without the x*pdf(x) term: gradcheck {'fails (caught)' if caught else 'PASSES (missed!)'}; "
        f"opcheck {run_opcheck(torch.ops.course10_broken.bias_gelu_half_grad.default, (x, b))['test_autograd_registration']}"
        " on its autograd test (it checks the registration, not the numbers)"
    )
    fake = run_opcheck(torch.ops.course10_broken.bias_gelu_bad_fake.default, (x, b))[
        "test_faketensor"
    ]
    fake_caught = fake != "SUCCESS"
    print(
        f"  fake implementation with the wrong shape: opcheck test_faketensor "
        f"{'fails (caught)' if fake_caught else 'PASSES (missed!)'}"
    )
    if not (caught and fake_caught):
        failed.append("broken copies not caught")
    if failed:
        print(f"FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
