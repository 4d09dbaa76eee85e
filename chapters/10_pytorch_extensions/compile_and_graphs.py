"""Our operators under torch.compile and inside a CUDA graph.

A small classifier's loss, loss = mean(CE(GELU(x @ w1 + b1) @ w2, target)),
written twice: with the custom ops of ops.py, and with the autograd.Function
of autograd_function.py in place of ``course10::bias_gelu``.

1  ``torch._dynamo.explain``: how many graphs torch.compile's tracer makes
   and where it breaks. A custom op is one opaque node (its fake
   implementation gives the output's shape and dtype): one graph, no break.
   An autograd.Function is traced into, and a Numba launch cannot be traced
   (bridge.py hides its view and stream helpers from the tracer with
   torch.compiler.disable): the graph breaks at each of them.
2  ``torch.compile(fullgraph=True)``: runs the custom-op version (forward
   and backward) and matches eager; the autograd.Function version is refused.
3  CUDA graphs (GPU only): the custom-op version's forward and backward
   captured in ``torch.cuda.graph`` and replayed on new inputs. Our launches
   go to torch's current stream (bridge.torch_stream()), which inside a
   capture is the capture stream, so they are recorded into the graph.

Run:   python chapters/10_pytorch_extensions/compile_and_graphs.py [--backend NAME]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.checking import CheckError, check
from common.harness import run_script, script_parser

import torch
import torch.nn.functional as F

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")
autograd_function = import_sibling(__file__, "autograd_function")

# batch, features, hidden, classes: small in the simulator (one Python thread a CUDA thread)
SHAPES = common.pick(gpu=(512, 256, 1024, 1000), simulator=(5, 6, 9, 7))


def mlp_loss(bias_gelu, x, w1, b1, w2, target):
    """Mean cross-entropy of a two-layer classifier: x (B, D), w1 (D, H), b1 (H,),
    w2 (H, C), target (B,) int64 -> a scalar; ``bias_gelu(z, b1)`` is the hidden layer."""
    h = bias_gelu(x @ w1, b1)
    return ops.softmax_cross_entropy(h @ w2, target).mean()


def loss_custom_op(x, w1, b1, w2, target):
    """``mlp_loss`` with ``course10::bias_gelu`` (ops.py)."""
    return mlp_loss(ops.bias_gelu, x, w1, b1, w2, target)


def loss_autograd_function(x, w1, b1, w2, target):
    """``mlp_loss`` with ``BiasGeluFunction`` (autograd_function.py)."""
    return mlp_loss(autograd_function.bias_gelu_function, x, w1, b1, w2, target)


def loss_torch(x, w1, b1, w2, target):
    """The same loss with torch's own GELU and cross-entropy: the reference."""
    h = F.gelu(x @ w1 + b1)
    return F.cross_entropy(h @ w2, target)


def make_inputs(generator: torch.Generator, device: torch.device | str, dtype=torch.float32):
    """(x, w1, b1, w2, target): the weights are leaves that require grad."""
    batch, features, hidden, classes = SHAPES
    x = torch.randn(batch, features, generator=generator, dtype=dtype)
    w1 = torch.randn(features, hidden, generator=generator, dtype=dtype) / features**0.5
    b1 = torch.randn(hidden, generator=generator, dtype=dtype)
    w2 = torch.randn(hidden, classes, generator=generator, dtype=dtype) / hidden**0.5
    target = torch.randint(0, classes, (batch,), generator=generator)
    x, target = x.to(device), target.to(device)
    weights = [t.to(device).requires_grad_() for t in (w1, b1, w2)]
    return (x, *weights, target)


def loss_and_grads(fn, inputs):
    """(loss, dw1, db1, dw2) of ``fn(*inputs)`` on fresh copies of the weights."""
    x, w1, b1, w2, target = inputs
    weights = [w.detach().clone().requires_grad_() for w in (w1, b1, w2)]
    loss = fn(x, *weights, target)
    loss.backward()
    return [loss.detach()] + [w.grad for w in weights]


def check_all(got, want, tol, what):
    for name, a, b in zip(("loss", "dw1", "db1", "dw2"), got, want):
        check(a, b, tol=tol, name=f"{name}, {what}")


def explain(fn, inputs, label):
    """Print and return torch._dynamo.explain's graph and break counts for fn."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(*inputs)
    print(
        f"explain, {label}: graph_count {report.graph_count}, "
        f"graph_break_count {report.graph_break_count}"
    )
    for reason in report.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        # the file and function, not the line: a line number drifts with every edit
        where = f" (in {frame.filename.split('/')[-1]}, {frame.name})" if frame else ""
        print(f"  break: {reason.reason.strip().splitlines()[0]}{where}")
    return report


def compiled(fn, backend: str):
    """torch.compile(fn, fullgraph=True, backend=backend), compiled on first call."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def run_compiled(inputs, eager, backend: str) -> str:
    """Check the compiled custom-op loss against eager; return the backend used.

    Inductor needs a C++ compiler for CPU tensors (the simulator's case); when
    it fails to compile, the same graph runs through "aot_eager" (the forward
    and backward graphs torch.compile traces, run op by op) and we say so.
    """
    try:
        got = loss_and_grads(compiled(loss_custom_op, backend), inputs)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        if backend == "aot_eager":
            raise
        print(
            f"  backend {backend!r} failed ({str(exc).splitlines()[0][:120]}); "
            "using backend='aot_eager'"
        )
        backend = "aot_eager"
        got = loss_and_grads(compiled(loss_custom_op, backend), inputs)
    check_all(got, eager, 1e-5, f"torch.compile(backend={backend!r}) vs eager")
    print(
        f"torch.compile(loss_custom_op, fullgraph=True, backend={backend!r}): "
        "loss and gradients match eager"
    )
    return backend


def autograd_function_fullgraph(inputs, backend: str) -> None:
    """Show that fullgraph=True refuses the autograd.Function version."""
    try:
        loss_and_grads(compiled(loss_autograd_function, backend), inputs)
    except torch._dynamo.exc.Unsupported as exc:
        print(
            "torch.compile(loss_autograd_function, fullgraph=True): refused, "
            f"{str(exc).strip().splitlines()[0]}"
        )
        return
    print("torch.compile(loss_autograd_function, fullgraph=True): compiled without a break")


def cuda_graph_replay(inputs, trials: int = 3) -> None:
    """Capture forward + backward of loss_custom_op in a CUDA graph, replay on new inputs.

    As torch's CUDA-graph notes ask: warm up on a side stream (this also
    compiles every kernel, which must not happen during capture), set the
    gradients to None so that backward allocates them from the graph's pool,
    capture, then copy new data into the static inputs before each replay.

    The weights are fresh leaves made on the side stream: autograd remembers
    the stream on which a leaf's gradient accumulator was made (here, the
    legacy default stream of the eager checks before), and a backward captured
    on another stream that has to wait on the legacy stream fails with "operation
    would make the legacy stream depend on a capturing blocking stream".
    """
    x, target = inputs[0], inputs[4]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        weights = w1, b1, w2 = [w.detach().clone().requires_grad_() for w in inputs[1:4]]
        for _ in range(3):
            for w in weights:
                w.grad = None
            loss_custom_op(x, w1, b1, w2, target).backward()
    torch.cuda.current_stream().wait_stream(side)
    for w in weights:
        w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_custom_op(x, w1, b1, w2, target)
        static_loss.backward()
    # A launch that missed the capture stream is not in the graph: replays on new
    # inputs would then leave its outputs stale, and the checks below fail.
    g = torch.Generator().manual_seed(1)
    for trial in range(trials):
        fresh = make_inputs(g, "cuda")
        x.copy_(fresh[0])
        target.copy_(fresh[4])
        graph.replay()
        want = loss_and_grads(loss_custom_op, (x, w1, b1, w2, target))
        check_all(
            [static_loss, w1.grad, b1.grad, w2.grad],
            want,
            1e-6,
            f"CUDA graph replay {trial} vs eager",
        )
    print(
        f"CUDA graph: forward + backward captured (launches on torch's capture stream), "
        f"{trials} replays on new inputs match eager"
    )


def main(argv=None) -> int:
    parser = script_parser(__doc__, "10_pytorch_extensions")  # --out unused: writes nothing
    parser.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend (default inductor; aot_eager needs no compiler)",
    )
    args = parser.parse_args(argv)
    device = bridge.device()
    g = torch.Generator().manual_seed(0)
    inputs = make_inputs(g, device)

    eager = loss_and_grads(loss_custom_op, inputs)
    inputs64 = [t.double() if t.is_floating_point() else t for t in inputs]
    check_all(eager, loss_and_grads(loss_torch, inputs64), 1e-5, "custom ops vs float64 torch")
    check_all(
        loss_and_grads(loss_autograd_function, inputs), eager, 0, "autograd.Function vs custom op"
    )
    print(
        f"eager, {SHAPES[0]}x{SHAPES[1]} -> {SHAPES[2]} -> {SHAPES[3]} classes: "
        "both versions match float64 torch within 1e-5"
    )

    report = explain(loss_custom_op, inputs, "custom op")
    if (report.graph_count, report.graph_break_count) != (1, 0):
        raise CheckError("the custom-op version should trace as one graph with no break")
    explain(loss_autograd_function, inputs, "autograd.Function")

    run_compiled(inputs, eager, args.backend)
    autograd_function_fullgraph(inputs, "aot_eager")

    if common.is_simulator():
        print("SKIPPED: CUDA graphs (need a GPU)")
    else:
        cuda_graph_replay(inputs)
    return 0


if __name__ == "__main__":
    run_script(main)
