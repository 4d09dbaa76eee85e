"""PyTorch's own tools on our operators (opcheck, gradcheck), the one check they lack
(which stream each launch went to), and what each of them catches.

``torch.library.opcheck(op, args)`` runs four tests on a custom operator:

* ``test_schema``: the operator does what its schema says (no input mutated
  that the schema does not declare, no output aliasing an input);
* ``test_autograd_registration``: its autograd is registered the way
  ``register_autograd`` does it (not by calling autograd from inside the op);
* ``test_faketensor``: the fake implementation gives the shapes, dtypes and
  strides the real one gives (what torch.compile and FakeTensor rely on);
* ``test_aot_dispatch_dynamic``: it traces through AOTAutograd, forward and
  backward, with dynamic shapes.

As PyTorch's custom-operator tutorial does, each operator gets several samples
(:func:`samples`): float32 and float64, one element, an empty batch, shapes
that fit no block, a transposed input, and ``requires_grad`` on all, some or
none of the inputs. ``torch.autograd.gradcheck`` compares the backward with
finite differences of the forward, in float64 (our kernels are built per dtype
for this), for the cross-entropy on both of its outputs, the loss and the
logsumexp. Neither tool sees streams: :func:`recorded_launches` records every
kernel launch and tells one on torch's current stream from one on Numba's
default stream, in the simulator too.

This script runs the three on every operator of ops.py, then shows that they
fail where they should: a copy of bias_gelu whose backward forgets a term fails
gradcheck (opcheck cannot see numbers), a copy whose fake implementation gives
the wrong shape fails opcheck's ``test_faketensor``, and a copy launched with
no stream fails the stream check (a race only a long producer shows on a GPU:
pitfalls.py).

Run: python chapters/10_pytorch_extensions/operator_checks.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import CheckError
from common.harness import run_script, script_parser

import contextlib
from collections.abc import Iterator

import torch
from numba import cuda

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")

F32, F64 = torch.float32, torch.float64


def sample_inputs() -> dict[str, tuple[object, list[tuple]]]:
    """{operator name: (op overload, [args, ...])}: several samples an operator.

    (M, N) for bias_gelu and (N, C) for the cross-entropy: one element; fewer
    and more columns than a block of ops.THREADS and than two, and more rows
    than the row groups (ops.ROW_SPLITS), none of them a multiple; an empty batch; a transposed
    (non-contiguous) first input. requires_grad on all, some or none of the
    differentiable inputs; the backward operators get none (they have no
    autograd of their own).
    """
    gen = torch.Generator().manual_seed(0)
    dev = bridge.device()

    def rand(*shape, dtype, grad=False, transposed=False):
        t = torch.randn(*shape[::-1] if transposed else shape, generator=gen, dtype=dtype)
        t = t.to(dev)
        return (t.t() if transposed else t).requires_grad_(grad)

    def classes(n, c):
        return torch.randint(0, c, (n,), generator=gen).to(dev)

    # Wider than one and two blocks, a multiple of neither (11 and 19 columns in
    # the simulator, 259 and 515 on a GPU); more rows than the row groups.
    wide, wider = ops.THREADS + 3, 2 * ops.THREADS + 3
    rows = ops.ROW_SPLITS + 2
    bias_gelu, bias_gelu_backward = [], []
    # (M, N), dtype, x requires grad, b requires grad, x transposed
    for (m, n), dtype, gx, gb, tx in [
        ((rows, wide), F64, True, True, False),
        ((1, 1), F32, True, False, False),
        ((7, 3), F64, False, True, False),
        ((2, wider), F32, False, False, False),
        ((0, 3), F64, True, True, False),
        ((4, 9), F32, True, True, True),
    ]:
        x, b = rand(m, n, dtype=dtype, grad=gx, transposed=tx), rand(n, dtype=dtype, grad=gb)
        bias_gelu.append((x, b))
        dy = rand(m, n, dtype=dtype, transposed=tx)
        bias_gelu_backward.append((dy, x.detach(), b.detach()))
    cross_entropy, cross_entropy_backward = [], []
    for (n, c), dtype, grad, transposed in [
        ((4, wide + 2), F64, True, False),
        ((1, 1), F32, True, False),
        ((3, 2), F64, False, False),
        ((2, wider), F32, True, True),
        ((0, 5), F64, True, False),
    ]:
        logits, target = rand(n, c, dtype=dtype, grad=grad, transposed=transposed), classes(n, c)
        cross_entropy.append((logits, target))
        lse = torch.logsumexp(logits.detach(), dim=1)
        dloss, dlse = rand(n, dtype=dtype), rand(n, dtype=dtype)
        cross_entropy_backward.append((dloss, dlse, logits.detach(), target, lse))
    course10 = torch.ops.course10
    return {
        "bias_gelu": (course10.bias_gelu.default, bias_gelu),
        "bias_gelu_backward": (course10.bias_gelu_backward.default, bias_gelu_backward),
        "softmax_cross_entropy_with_lse": (
            course10.softmax_cross_entropy_with_lse.default,
            cross_entropy,
        ),
        "softmax_cross_entropy_backward": (
            course10.softmax_cross_entropy_backward.default,
            cross_entropy_backward,
        ),
    }


def run_opcheck(op, args) -> dict[str, str]:
    """opcheck's four results ({"test_schema": "SUCCESS", ...}); never raises."""
    return torch.library.opcheck(op, args, raise_exception=False)


def run_gradcheck(fn, inputs) -> bool:
    """gradcheck in float64 on ``fn(*inputs)`` (every output, one at a time);
    False (not an exception) on a mismatch."""
    return torch.autograd.gradcheck(fn, inputs, raise_exception=False)


# ---------------------------------------------------------------- which stream


@cuda.jit(cache=True)
def _probe():  # only its type matters: the class every @cuda.jit kernel is
    pass


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", "?")


class TorchStreamMark:
    """What bridge.torch_stream() returns while launches are recorded."""

    def __repr__(self) -> str:
        return "<bridge.torch_stream()>"


class LaunchLog:
    """The kernel launches recorded by :func:`recorded_launches`, as (kernel name,
    launch configuration) in ``seen`` (clear it to start again); ``mark``: what
    bridge.torch_stream() returns meanwhile."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []
        self.mark = TorchStreamMark()

    def off_torch_stream(self) -> list[str]:
        """One line for each launch that did not pass on bridge.torch_stream()."""
        wrong = []
        for name, configuration in self.seen:
            has_stream = isinstance(configuration, tuple) and len(configuration) >= 3
            stream = configuration[2] if has_stream else "none (the default)"
            if stream is not self.mark:
                wrong.append(f"{name} launched on stream {stream!r}, not bridge.torch_stream()")
        return wrong

    def check_on_torch_stream(self, what: str) -> None:
        """CheckError unless something was launched, every launch on bridge.torch_stream()."""
        if not self.seen:
            raise CheckError(f"{what} launched no Numba kernel")
        wrong = self.off_torch_stream()
        if wrong:
            raise CheckError(f"{what}: " + "; ".join(wrong))


@contextlib.contextmanager
def recorded_launches() -> Iterator[LaunchLog]:
    """Every Numba kernel launch in the block, recorded in a :class:`LaunchLog`.

    Meanwhile bridge.torch_stream() returns the log's mark, and each
    ``kernel[grid, block, stream]`` is recorded, then the mark swapped back for
    torch's stream and the launch let through: the kernels run as usual. A
    launch that passed the mark on is on torch's current stream; one given no
    stream, ``cuda.default_stream()`` or 0 is on Numba's default stream. The
    launch's own arguments, not a race, decide: the check fails on every run,
    in the simulator too, where a race never shows.
    """
    kernel_type = type(_probe)
    own = kernel_type.__dict__.get("__getitem__")
    launch_config = kernel_type.__getitem__
    torch_stream = bridge.torch_stream
    log = LaunchLog()

    def recording_getitem(kernel, configuration):
        log.seen.append((kernel_name(kernel), configuration))
        if isinstance(configuration, tuple) and len(configuration) >= 3:
            if configuration[2] is log.mark:
                configuration = (*configuration[:2], torch_stream(), *configuration[3:])
        return launch_config(kernel, configuration)

    kernel_type.__getitem__ = recording_getitem
    bridge.torch_stream = lambda: log.mark
    try:
        yield log
    finally:
        bridge.torch_stream = torch_stream
        if own is None:
            del kernel_type.__getitem__
        else:
            kernel_type.__getitem__ = own


def stream_check(name: str, fn, inputs) -> int:
    """Forward and backward of ``fn(*inputs)`` (the sum of its outputs) with every
    launch recorded; CheckError (naming ``name``, the kernel and its stream)
    unless each went to torch's stream. Returns the number of launches."""
    with recorded_launches() as log:
        out = fn(*inputs)
        outputs = out if isinstance(out, tuple) else (out,)
        wrt = [t for t in inputs if t.requires_grad]
        torch.autograd.grad(sum(o.sum() for o in outputs), wrt)
    log.check_on_torch_stream(name)
    return len(log.seen)


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


@torch.library.custom_op("course10_broken::bias_gelu_default_stream", mutates_args=())
def bias_gelu_default_stream(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ops.launch_bias_gelu_forward's launch without its stream: Numba's default
    stream, which does not wait for torch's (pitfall 1 of pitfalls.py)."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    forward, _, _ = ops.kernel_for(ops.make_bias_gelu_kernels, x.dtype)
    m, n = x.shape
    forward[(ceil_div(n, ops.THREADS), ops.grid_rows(m)), ops.THREADS](  # the bug: no stream
        ops.view(x, "x"), ops.view(b, "b"), bridge.numba_view(y, "y")
    )
    return y


@bias_gelu_default_stream.register_fake
def _(x, b):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


bias_gelu_default_stream.register_autograd(
    ops.bias_gelu_grad, setup_context=ops.bias_gelu_setup_context
)


def main(argv=None) -> int:
    parser = script_parser(__doc__, "10_pytorch_extensions")
    parser.parse_args(argv)
    failed = []
    samples = sample_inputs()
    print(
        "opcheck on every operator: float32 and float64, 1 element, an empty batch, shapes "
        "that fit no block, a transposed input, requires_grad on all, some or none:"
    )
    for name, (op, arg_sets) in samples.items():
        bad = {}
        for args in arg_sets:
            result = run_opcheck(op, args)
            bad.update({k: v for k, v in result.items() if v != "SUCCESS"})
        verdict = f"all 4 tests pass on {len(arg_sets)} samples" if not bad else f"FAILED {bad}"
        print(f"  {name:<32} {verdict}")
        if bad:
            failed.append(name)

    x, b = samples["bias_gelu"][1][0]  # float64, 5 x 11, both require grad
    logits, target = samples["softmax_cross_entropy_with_lse"][1][0]  # float64, 4 x 13
    print("gradcheck (float64, finite differences):")
    for name, fn, args in (
        ("bias_gelu", ops.bias_gelu, (x, b)),
        (
            "softmax_cross_entropy_with_lse",
            lambda z: ops.softmax_cross_entropy_with_lse(z, target),  # loss and logsumexp
            (logits,),
        ),
    ):
        ok = run_gradcheck(fn, args)
        print(f"  {name:<32} {'passes' if ok else 'FAILED'}")
        if not ok:
            failed.append(name)

    print("streams (forward + backward, every launch recorded):")
    for name, fn, args in (
        ("bias_gelu", ops.bias_gelu, (x, b)),
        ("softmax_cross_entropy_with_lse", ops.softmax_cross_entropy_with_lse, (logits, target)),
    ):
        try:
            launches = stream_check(name, fn, args)
        except CheckError as exc:
            print(f"  FAILED: {exc}")
            failed.append(name)
        else:
            print(f"  {name:<32} {launches} launches, each on bridge.torch_stream()")

    print("the same tools on deliberately broken copies:")
    caught = run_gradcheck(bias_gelu_half_grad, (x, b)) is False
    autograd_test = run_opcheck(torch.ops.course10_broken.bias_gelu_half_grad.default, (x, b))[
        "test_autograd_registration"
    ]
    print(
        f"  backward without the x*pdf(x) term: gradcheck {'fails (caught)' if caught else 'PASSES (missed!)'}; "
        f"opcheck {autograd_test} on its autograd test (it checks the registration, not the numbers)"
    )
    fake = run_opcheck(torch.ops.course10_broken.bias_gelu_bad_fake.default, (x, b))[
        "test_faketensor"
    ]
    fake_caught = fake != "SUCCESS"
    print(
        f"  fake implementation with the wrong shape: opcheck test_faketensor "
        f"{'fails (caught)' if fake_caught else 'PASSES (missed!)'}"
    )
    try:
        stream_check("bias_gelu_default_stream", bias_gelu_default_stream, (x, b))
    except CheckError as exc:
        stream_caught = True
        print(f"  launch with no stream: the stream check fails (caught): {exc}")
    else:
        stream_caught = False
        print("  launch with no stream: the stream check PASSES (missed!)")
    if not (caught and fake_caught and stream_caught):
        failed.append("broken copies not caught")
    if failed:
        print(f"FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
