"""bias + GELU as a ``torch.autograd.Function``: the older route to the same kernels.

ops.py registers ``course10::bias_gelu`` with ``torch.library.custom_op``. Here
the same Numba kernels (``ops.make_bias_gelu_kernels``, launched by ops.py's
own launchers) sit behind ``BiasGeluFunction``: a forward that launches
the forward kernel and saves x and b, a backward that launches the backward
and column-sum kernels.

Which route when:

* ``torch.library.custom_op`` (ops.py): the operator has a schema and a name
  (``torch.ops.course10.bias_gelu``); torch.compile sees one opaque node and
  traces shapes through its fake implementation (``register_fake``) without
  running it; ``torch.library.opcheck`` tests the registration; it works with
  the rest of the ``torch.library`` tooling (other backends, ``torch.export``).
  More to write: a fake implementation, a backward that is itself an operator.
* ``torch.autograd.Function`` (this file): the quickest way to give autograd a
  backward, a Python class and nothing to register. But there is no schema:
  torch.compile traces *into* ``forward`` and cannot trace a Numba launch
  (compile_and_graphs.py shows what ``torch._dynamo.explain`` reports), and
  nothing outside autograd knows the operator exists.

Run:   python chapters/10_pytorch_extensions/autograd_function.py
It checks outputs and gradients against ops.bias_gelu (bit for bit) and a
float64 reference (to float32 rounding: ops.bias_gelu_tolerances), and runs
``torch.autograd.gradcheck`` in float64.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.checking import check
from common.harness import run_script, script_parser

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")


class BiasGeluFunction(torch.autograd.Function):
    """y = GELU(x + b) (exact, erf) for x (M, N) and b (N,), float32 or float64.

    ``BiasGeluFunction.apply(x, b)`` returns y (M, N), contiguous, x's dtype
    and device; backward gives (dx (M, N), db (N,)). Raises TypeError or
    ValueError (ops.check_bias_gelu_args) for mismatched dtypes, shapes or
    devices. Backward is not differentiable again (once_differentiable).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # the custom op's own launcher: the same checks, kernels and stream
        y = ops.launch_bias_gelu_forward(x, b)
        ctx.save_for_backward(x, b)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, b = ctx.saved_tensors
        return ops.launch_bias_gelu_backward(dy, x, b)


def bias_gelu_function(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``BiasGeluFunction.apply(x, b)``: y (M, N) = GELU(x (M, N) + b (N,))."""
    return BiasGeluFunction.apply(x, b)


def forward_backward(fn, x: torch.Tensor, b: torch.Tensor, dy: torch.Tensor):
    """(y, dx, db) of ``fn(x, b)`` with upstream gradient dy, on fresh leaf copies."""
    x = x.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    y = fn(x, b)
    y.backward(dy)
    return y.detach(), x.grad, b.grad


def reference(x: torch.Tensor, b: torch.Tensor, dy: torch.Tensor):
    """(y, dx, db) in float64 through torch's own GELU, the ground truth."""
    return forward_backward(lambda x, b: F.gelu(x + b), x.double(), b.double(), dy.double())


def main(argv=None) -> int:
    script_parser(__doc__, "10_pytorch_extensions").parse_args(argv)  # --help; writes nothing
    device = bridge.device()
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1), (5, 13), (37, 21)] if common.is_simulator() else [(1, 1), (257, 1000)]
    for m, n in shapes:
        x, b, dy = (torch.randn(s, generator=g).to(device) for s in ((m, n), (n,), (m, n)))
        ours = forward_backward(bias_gelu_function, x, b, dy)
        theirs = forward_backward(ops.bias_gelu, x, b, dy)
        ref = reference(x, b, dy)
        tols = ops.bias_gelu_tolerances(x, b, dy, ref)
        for name, a, c, r, tol in zip(("y", "dx", "db"), ours, theirs, ref, tols):
            # The same kernels with the same launch: bit for bit the same numbers.
            check(a, c, tol=0, name=f"{name}: autograd.Function vs custom_op, {m}x{n}")
            check(a, r, tol=tol, name=f"{name} vs float64 torch reference, {m}x{n}")
        print(
            f"{m}x{n}: y, dx, db equal to ops.bias_gelu's and within float32 rounding "
            "(1e-5, more where terms cancel) of float64 torch"
        )

    x = torch.randn(4, 7, dtype=torch.float64, generator=g).to(device).requires_grad_()
    b = torch.randn(7, dtype=torch.float64, generator=g).to(device).requires_grad_()
    torch.autograd.gradcheck(bias_gelu_function, (x, b))  # raises GradcheckError if wrong
    print("gradcheck (float64, 4x7): passed")
    return 0


if __name__ == "__main__":
    run_script(main)
