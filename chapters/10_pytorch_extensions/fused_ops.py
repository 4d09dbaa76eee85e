"""Fusion that pays: our two fused operators against the PyTorch code they replace.

For each operator (ops.py), forward + backward as a training step runs them:
``torch.autograd.grad(out, inputs, grad_out)``, in three versions:

* **ours**: ``ops.bias_gelu`` / ``ops.softmax_cross_entropy`` (the loss of
  ``course10::softmax_cross_entropy_with_lse``), the custom ops with our
  kernels forward and backward;
* **torch eager**: the composite ``F.gelu(x + b)`` /
  ``F.cross_entropy(logits, target, reduction="none")``;
* **torch.compile**: the same composite compiled (Inductor generates fused
  Triton kernels for it: the strongest baseline).

Every version is first checked against torch autograd in float64 on the same
inputs (forward and every gradient, relative error at most 1e-5), then timed
with CUDA events (median of 50 calls after warm-up, compilation excluded). GB/s
counts the fewest bytes the operation must move: bias+GELU reads x and writes
y forward, reads dy and x and writes dx backward (5 M N floats);
cross-entropy reads the logits forward, reads them again and writes their
gradient backward (3 N C floats). Two sizes each: one where the data is large
(the kernels' speed decides) and one small (the cost of a call decides). Torch
runs with TF32 off (bridge.full_float32), in float32 as our kernels do.

Run: python chapters/10_pytorch_extensions/fused_ops.py
In the simulator the checks run at tiny sizes and nothing is timed.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator, pick
from common.checking import CheckError, check
from common.harness import run_script, save_results, script_parser
from common.internal.exercises import import_sibling
from common.runtime import device_name
from common.timing import Timing, benchmark, device_peaks, format_table

from functools import partial

import torch
import torch.nn.functional as F

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")
BIAS_GELU_SIZES = pick(gpu=[(16384, 8192), (512, 1024)], simulator=[(5, 11), (1, 3)])
CROSS_ENTROPY_SIZES = pick(gpu=[(8192, 32768), (256, 1024)], simulator=[(4, 13), (1, 2)])


def bias_gelu_composite(x, b):
    return F.gelu(x + b)


def cross_entropy_composite(logits, target):
    return F.cross_entropy(logits, target, reduction="none")


def bias_gelu_bytes(m, n):
    """Fewest bytes moved: read x, write y forward; read dy and x, write dx backward."""
    return 4 * 5 * m * n


def cross_entropy_bytes(n, c):
    """Fewest bytes moved: read the logits forward; read them, write dlogits backward."""
    return 4 * 3 * n * c


def bias_gelu_inputs(m, n, gen):
    dev = bridge.device()
    x = torch.randn(m, n, generator=gen).to(dev).requires_grad_()
    b = torch.randn(n, generator=gen).to(dev).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(dev)
    return (x, b), dy


def cross_entropy_inputs(n, c, gen):
    dev = bridge.device()
    logits = (3 * torch.randn(n, c, generator=gen)).to(dev).requires_grad_()
    target = torch.randint(0, c, (n,), generator=gen).to(dev)
    dloss = torch.rand(n, generator=gen).to(dev) + 0.5
    return (logits, target), dloss


def step(fn, inputs, grad_out):
    """(output, gradients of the floating inputs) of one forward + backward."""
    out = fn(*inputs)
    wrt = [t for t in inputs if t.is_floating_point()]
    return out, torch.autograd.grad(out, wrt, grad_out)


def check_against_float64(name, fn, composite, inputs, grad_out, tolerances) -> float:
    """``fn``'s output and gradients against ``composite``'s in float64 (torch
    autograd), each within the relative tolerance that ``tolerances(ref)``
    derives from the float64 results ``ref`` = (output, *gradients) (for our
    operators: ops.bias_gelu_tolerances, ops.cross_entropy_tolerances, from the
    float32 rounding of their kernels). Raises common.CheckError; returns the
    largest relative error."""
    ref_inputs = [
        t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs
    ]
    ref_out, ref_grads = step(composite, ref_inputs, grad_out.double())
    out, grads = step(fn, inputs, grad_out)
    ref = (ref_out, *ref_grads)
    got = (out, *grads)
    if not any(r.any() for r in ref):  # e.g. one class: loss and gradient are exactly 0
        for k, g in enumerate(got):
            if g.any():
                raise CheckError(f"{name} {k}: expected exact zeros, got {g.ravel()[:4]}")
        return 0.0
    worst = 0.0
    for k, (g, r, tol) in enumerate(zip(got, ref, tolerances(ref))):
        what = "output" if k == 0 else f"gradient {k - 1}"
        worst = max(worst, check(g, r, tol, name=f"{name} {what}"))
    return worst


def compare(op_name, ours, composite, make_inputs, sizes, nbytes_of, tolerances, peaks, gen):
    """Check and time ours, torch eager and torch.compile at each size; Timings.
    ``make_inputs(*size, gen)`` -> (inputs, grad_out); ``nbytes_of(*size)``: the
    bytes a step must move; ``tolerances(*inputs, grad_out, ref)``: as
    ops.bias_gelu_tolerances, see check_against_float64."""
    versions = {"ours (custom op)": ours, "torch eager": composite}
    if not is_simulator():
        versions["torch.compile"] = torch.compile(composite, dynamic=False)
    results = []
    for size in sizes:
        inputs, grad_out = make_inputs(*size, gen)
        for label, fn in versions.items():
            err = check_against_float64(
                f"{op_name} {size} {label}",
                fn,
                composite,
                inputs,
                grad_out,
                partial(tolerances, *inputs, grad_out),
            )
            t = benchmark(
                partial(step, fn, inputs, grad_out),
                f"{op_name} {size[0]}x{size[1]} {label}",
                nbytes=nbytes_of(*size),
                warmup=5,
                repeats=50,
                peaks=peaks,
            )
            t.extra.update(rel_error=err, op=op_name, size=list(size), version=label)
            results.append(t)
    return results


def compare_all(gen: torch.Generator | None = None) -> list[Timing]:
    """Both operators at their sizes (BIAS_GELU_SIZES, CROSS_ENTROPY_SIZES): each
    version checked against float64 torch autograd, then timed (compare), with
    TF32 off. ``gen`` draws the inputs (default: seed 0)."""
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    peaks = device_peaks()
    with bridge.full_float32():
        return compare(
            "bias_gelu",
            ops.bias_gelu,
            bias_gelu_composite,
            bias_gelu_inputs,
            BIAS_GELU_SIZES,
            bias_gelu_bytes,
            ops.bias_gelu_tolerances,
            peaks,
            gen,
        ) + compare(
            "cross_entropy",
            ops.softmax_cross_entropy,
            cross_entropy_composite,
            cross_entropy_inputs,
            CROSS_ENTROPY_SIZES,
            cross_entropy_bytes,
            ops.cross_entropy_tolerances,
            peaks,
            gen,
        )


def report(results: list[Timing]) -> str:
    """What main prints of compare_all's results: the largest error, the table,
    and (GPU) each size's times against ours."""
    worst = max(t.extra["rel_error"] for t in results)
    lines = [
        f"every version matches torch autograd in float64 (largest relative error {worst:.1e}; "
        "tolerances from each kernel's float32 rounding, at least 1e-5)",
        format_table(results, f"forward + backward, {device_name()}"),
    ]
    by = {(t.extra["op"], tuple(t.extra["size"]), t.extra["version"]): t for t in results}
    timed = not is_simulator()  # the simulator times nothing
    for op_name, size, _ in [k for k in by if timed and k[2] == "ours (custom op)"]:
        ours = by[op_name, size, "ours (custom op)"].median_ms
        eager = by[op_name, size, "torch eager"].median_ms
        compiled = by[op_name, size, "torch.compile"].median_ms
        lines.append(
            f"{op_name} {size[0]}x{size[1]}: ours {ours:.3f} ms, torch eager {eager:.3f} ms "
            f"({eager / ours:.2f}x ours), torch.compile {compiled:.3f} ms ({compiled / ours:.2f}x ours)"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = script_parser(__doc__, "10_pytorch_extensions")
    args = parser.parse_args(argv)
    results = compare_all()
    print(report(results))
    save_results(results, args.out, "fused_ops")
    return 0


if __name__ == "__main__":
    run_script(main)
