"""What one call costs on the host, from a bare Numba launch to a PyTorch operator.

bias + GELU on a tiny input (4 x 256 = 1024 floats), so the GPU work is a few
microseconds and what is measured is the host's cost per call:

path a  raw launch, Numba device arrays made once (the floor: Numba's launch)
path b  a + a new view of each of the three tensors on every call
        (numba_view(cached=False), what cuda.as_cuda_array makes)
path c  a + numba_view() of the three tensors on every call: the views
        bridge.py cached on the first call (the same address, shape, dtype)
path d  torch tensors passed straight to the kernel (Numba reads their
        __cuda_array_interface__ on every call)
path e  the autograd.Function forward (autograd_function.py): + checks, an
        output allocation, torch_stream(), Function.apply
path f  the custom op forward, torch.ops.course10.bias_gelu (ops.py): + the
        dispatcher
path g  x + b, one plain torch op, for scale (torch's own launch)
path h  F.gelu(x + b), the composite our operator replaces (two torch ops)

Host time per call: synchronize, time.perf_counter around many calls,
synchronize; the median of several repeats. Launches are asynchronous, so
while the kernel is shorter than the call, this is the host's cost alone.
Then, on a GPU, where that cost stops mattering: the GPU time of the forward
kernel (CUDA events, the stream held so the host queues every call first) at
a few sizes, and the size at which it equals path f's cost per call.

Run:   python chapters/10_pytorch_extensions/dispatch_overhead.py [--out DIR]
In the simulator, nothing is timed: each path runs once and is checked.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling, load_chapter_module
from common.checking import check
from common.harness import run_script, save_results, script_parser
from common.timing import SIMULATOR_NOTE, Timing, benchmark

import math
import statistics
from functools import partial

import torch
import torch.nn.functional as F

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")
autograd_function = import_sibling(__file__, "autograd_function")
interop = load_chapter_module("07_libraries", "interop")  # per_launch_us: the host clock loop

M, N = 4, 256  # 1024 floats
CALLS, REPEATS = 2000, 7
SIZES = [1 << k for k in (10, 14, 16, 18, 20, 22, 24, 26)]  # elements, for the crossover (N = 1024)


def raw_launch(kernel, grid, stream, x, b, y):
    """Path a, and path d when x, b, y are torch tensors: the launch alone."""
    kernel[grid, ops.THREADS, stream](x, b, y)


def view_each_call(kernel, grid, stream, x, b, y, cached=True):
    """Paths b and c: numba_view of every tensor, then the launch."""
    kernel[grid, ops.THREADS, stream](
        bridge.numba_view(x, "x", cached=cached),
        bridge.numba_view(b, "b", cached=cached),
        bridge.numba_view(y, "y", cached=cached),
    )


def paths(x: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> dict:
    """name -> (callable taking no arguments, the tensor it writes its result to)."""
    forward, _, _ = ops.kernel_for(ops.make_bias_gelu_kernels, x.dtype)
    grid = (ceil_div(N, ops.THREADS), ops.grid_rows(M))
    stream = bridge.torch_stream()
    xn, bn, yn = bridge.numba_view(x), bridge.numba_view(b), bridge.numba_view(y)
    # In the simulator a CPU tensor has no __cuda_array_interface__: path d passes
    # NumPy views of the tensors (the simulator's own argument handling).
    xs, bs, ys = (x, b, y) if not common.is_simulator() else (x.numpy(), b.numpy(), y.numpy())
    out: dict = {}  # d, e, f, g return their result: kept here to check it
    return {
        "a: raw launch, Numba arrays made once": (
            partial(raw_launch, forward, grid, stream, xn, bn, yn),
            lambda: y,
        ),
        "b: launch + a new view per call": (
            partial(view_each_call, forward, grid, stream, x, b, y, cached=False),
            lambda: y,
        ),
        "c: launch + numba_view (cached)": (
            partial(view_each_call, forward, grid, stream, x, b, y),
            lambda: y,
        ),
        "d: launch, torch tensors passed": (
            partial(raw_launch, forward, grid, stream, xs, bs, ys),
            lambda: y,
        ),
        "e: autograd.Function forward": (
            partial(_keep, out, "e", autograd_function.bias_gelu_function, x, b),
            partial(out.get, "e"),
        ),
        "f: custom op forward": (
            partial(_keep, out, "f", torch.ops.course10.bias_gelu, x, b),
            partial(out.get, "f"),
        ),
        "g: x + b (one torch op)": (partial(_keep, out, "g", torch.add, x, b), None),
        "h: F.gelu(x + b) (composite)": (
            partial(_keep, out, "h", _composite, x, b),
            partial(out.get, "h"),
        ),
    }


def _composite(x, b):
    return F.gelu(x + b)


def _keep(out: dict, key: str, fn, *args):
    out[key] = fn(*args)


def host_us_per_call(fn) -> float:
    """Median over REPEATS of the host time per call (us) of CALLS calls in a row."""
    fn()  # the first call compiles
    return statistics.median(interop.per_launch_us(fn, CALLS) for _ in range(REPEATS))


def crossover(sizes: list[int], gpu_us: list[float], host_us: float) -> float | None:
    """The size (elements) where the kernel's GPU time reaches ``host_us``:
    log-log interpolation between the two measured sizes around it; None when
    every measured size is below it or the smallest already above it."""
    points = list(zip(sizes, gpu_us))
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if t0 <= host_us <= t1 and t1 > t0:
            frac = (math.log(host_us) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0)))
    return None


def main(argv=None) -> int:
    args = script_parser(__doc__, "10_pytorch_extensions").parse_args(argv)
    device = bridge.device()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, N, generator=g).to(device)
    b = torch.randn(N, generator=g).to(device)
    y = torch.full_like(x, math.nan)
    ref = F.gelu(x.double() + b.double())
    results: list = []
    if common.is_simulator():
        print(f"{SIMULATOR_NOTE}: the simulator's per-call times are meaningless;")
        print("each path runs once and its output is checked")
    else:
        print(
            f"host time per call, {M}x{N} float32 ({M * N} elements), "
            f"median of {REPEATS} x {CALLS} calls"
        )
    for name, (fn, result) in paths(x, b, y).items():
        y.fill_(math.nan)  # poison: a path that launches nothing fails its check
        if common.is_simulator():
            fn()
            us = None
        else:
            us = host_us_per_call(fn)
            print(f"  {name:<38} {us:7.2f} us")
        if result is not None:
            check(result(), ref, tol=1e-5, name=name)
        results.append(
            Timing(name=name, median_ms=None if us is None else us / 1e3, extra={"us_per_call": us})
        )
    if common.is_simulator():
        print("every path computes GELU(x + b) within 1e-5 of float64 torch")
        save_results(results, args.out, "dispatch_overhead")
        return 0

    op_us = next(r for r in results if r.name.startswith("f:")).extra["us_per_call"]
    gpu_us = []
    print(f"GPU time of the bias_gelu forward (N = 1024) vs the custom op's {op_us:.1f} us a call:")
    for size in SIZES:
        xs = torch.randn(size // 1024, 1024, device="cuda")
        bs = torch.randn(1024, device="cuda")
        t = benchmark(
            partial(torch.ops.course10.bias_gelu, xs, bs),
            f"forward, {size} elements",
            nbytes=2 * 4 * size,
            repeats=50,
            hold_ms=50,
        )
        gpu_us.append(t.median_ms * 1e3)
        t.extra["elements"] = size
        results.append(t)
        side = "GPU time > dispatch" if gpu_us[-1] > op_us else "dispatch dominates"
        print(f"  {size:>10} elements  {gpu_us[-1]:9.2f} us   {side}")
    at = crossover(SIZES, gpu_us, op_us)
    if at is None:
        print("  the crossover is outside the sizes measured")
    else:
        print(
            f"  the kernel's GPU time equals the dispatch cost at about {at:,.0f} elements "
            f"({at * 4 / 2**20:.1f} MiB of float32): below that, a call costs the host "
            "more than the GPU"
        )
    save_results(results, args.out, "dispatch_overhead", crossover_elements=at)
    return 0


if __name__ == "__main__":
    run_script(main)
