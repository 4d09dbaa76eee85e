"""Three ways a Numba kernel behind a torch operator goes wrong: symptom and fix.

pitfall 1  wrong stream (GPU only): under ``with torch.cuda.stream(s):`` torch
           writes the input on s; a kernel launched with no stream runs on
           Numba's default stream, which does not wait for s, and reads the
           input before torch wrote it. Fix: launch on bridge.torch_stream().
pitfall 2  a tensor that requires grad handed to numba_view: refused with the
           fix in the message (t.detach(): the same memory, outside autograd).
pitfall 3  a non-contiguous tensor (x.t()): numba_view refuses it. What a
           wrapper without that check gets: cuda.as_cuda_array keeps torch's
           strides, so a kernel that indexes x[r, c] computes the right numbers,
           but a warp's 32 reads are 32 rows apart (uncoalesced) and the kernel
           is compiled again for the strided layout. Fix: x.contiguous() (one
           copy, what ops.py does), measured against the strided launch.

Run:   python chapters/10_pytorch_extensions/pitfalls.py [--out DIR] [--trials N]
(chapters/07_libraries/interop.py shows the same ideas for a bare kernel.)
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import CheckError, check, rel_error
from common.harness import run_script, save_results, script_parser
from common.timing import Timing, benchmark

import math
from functools import partial

import torch
import torch.nn.functional as F
from numba import cuda

ops = import_sibling(__file__, "ops")
bridge = import_sibling(__file__, "bridge")


def launch_forward(x, b, y, stream=None) -> None:
    """ops.py's bias_gelu forward launch on Numba views x (M, N), b (N,), y (M, N);
    ``stream=None`` launches on Numba's default stream (the pitfall)."""
    forward, _, _ = ops.kernel_for(ops.make_bias_gelu_kernels, torch.float32)
    m, n = x.shape
    grid = (ceil_div(n, ops.THREADS), ops.grid_rows(m))
    if stream is None:
        forward[grid, ops.THREADS](x, b, y)
    else:
        forward[grid, ops.THREADS, stream](x, b, y)


def naive_view(t: torch.Tensor):
    """A wrapper without numba_view's checks: whatever cuda.as_cuda_array makes of t
    (in the simulator, the simulator's array over t.numpy(), strides and all)."""
    if common.is_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.detach().numpy())
    return cuda.as_cuda_array(t.detach())


# ------------------------------------------------------------ pitfall 1


def wrong_stream(trials: int) -> list[dict]:
    """Race our kernel against torch work on a side stream; count wrong results.

    Each trial: x is zeroed and the device synchronized; then, on stream s, a
    4096^3 matmul (milliseconds) whose result is copied into x, and right after
    it our kernel, launched (a) on Numba's default stream, (b) on torch_stream().
    """
    n = 1024
    a = torch.randn(4096, 4096, device="cuda") / 64
    b = torch.randn(n, device="cuda")
    x = torch.empty(64, n, device="cuda")
    y = torch.empty_like(x)
    counts = {}
    for label, fixed in (("Numba's default stream", False), ("torch_stream()", True)):
        wrong = 0
        for _ in range(trials):
            x.zero_()
            y.fill_(math.nan)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                x.copy_((a @ a)[: x.shape[0], :n])  # long, then x written on s
                stream = bridge.torch_stream() if fixed else None
                launch_forward(
                    bridge.numba_view(x), bridge.numba_view(b), bridge.numba_view(y), stream
                )
            torch.cuda.synchronize()
            if rel_error(y, F.gelu(x.double() + b.double())) > 1e-5:
                wrong += 1
        counts[label] = wrong
        print(f"  kernel on {label:<24}: wrong result in {wrong} of {trials} trials")
    if counts["torch_stream()"]:
        raise CheckError("the kernel on torch's current stream gave wrong results")
    return [
        {"name": f"wrong results, kernel on {k}", "wrong": v, "trials": trials}
        for k, v in counts.items()
    ]


# ------------------------------------------------------------ pitfall 2


def requires_grad(device: torch.device) -> None:
    w = torch.randn(3, 5, device=device, requires_grad=True)
    try:
        bridge.numba_view(w, "w")
    except ValueError as exc:
        print(f"  numba_view(w): ValueError: {exc}")
    else:
        raise CheckError("numba_view wrapped a tensor that requires grad")
    view = bridge.numba_view(w.detach(), "w")
    view[0, 0] = 7.0  # one element written through the view lands in w itself
    if float(w.detach()[0, 0]) != 7.0:
        raise CheckError("the view of w.detach() does not share w's memory")
    print("  fix: numba_view(w.detach()) wraps it; a write through the view shows in w")


# ------------------------------------------------------------ pitfall 3


def non_contiguous(device: torch.device, m: int, n: int) -> list[Timing]:
    """x = a.t() (M, N), strides (1, M): numba_view's refusal, the naive wrapper's
    numbers against float64 torch, and (GPU) its time against .contiguous()."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, m, generator=g).to(device).t()  # (m, n), column-major
    b = torch.randn(n, generator=g).to(device)
    print(
        f"  x = a.t(): shape {tuple(x.shape)}, strides {x.stride()}, contiguous {x.is_contiguous()}"
    )
    try:
        bridge.numba_view(x, "x")
    except ValueError as exc:
        print(f"  numba_view(x): ValueError: {exc}")
    else:
        raise CheckError("numba_view wrapped a non-contiguous tensor")
    ref = F.gelu(x.double() + b.double())
    view = naive_view(x)
    print(f"  cuda.as_cuda_array(x) keeps the strides: {view.strides} bytes")
    y = torch.full((m, n), math.nan, device=device)
    launch_forward(view, naive_view(b), bridge.numba_view(y), bridge.torch_stream())
    err = rel_error(y, ref)
    print(
        f"  naive wrapper, strided x: relative error {err:.1e} vs float64 torch "
        f"({'right numbers' if err <= 1e-5 else 'WRONG numbers'})"
    )
    check(y, ref, tol=1e-5, name="strided launch")
    y2 = torch.full((m, n), math.nan, device=device)
    launch_forward(
        bridge.owning_view(x.contiguous()),
        naive_view(b),
        bridge.numba_view(y2),
        bridge.torch_stream(),
    )
    check(y2, ref, tol=1e-5, name="launch on x.contiguous()")
    print("  fix: x.contiguous() (ops.view does it): right numbers, row-major reads")
    if common.is_simulator():
        return []
    xc = x.contiguous()
    strided = benchmark(
        partial(launch_forward, view, naive_view(b), bridge.numba_view(y), bridge.torch_stream()),
        "strided x",
        nbytes=2 * 4 * m * n,
    )
    fixed = benchmark(
        partial(_contiguous_then_launch, x, b, y), "x.contiguous() + launch", nbytes=4 * 4 * m * n
    )
    already = benchmark(
        partial(
            launch_forward,
            bridge.numba_view(xc),
            naive_view(b),
            bridge.numba_view(y),
            bridge.torch_stream(),
        ),
        "launch, x already contiguous",
        nbytes=2 * 4 * m * n,
    )
    for t in (strided, fixed, already):
        print(f"  {t.name:<30} {t.median_ms:8.3f} ms")
    return [strided, fixed, already]


def _contiguous_then_launch(x, b, y):
    launch_forward(
        bridge.owning_view(x.contiguous()),
        naive_view(b),
        bridge.numba_view(y),
        bridge.torch_stream(),
    )


def main(argv=None) -> int:
    parser = script_parser(__doc__, "10_pytorch_extensions")
    parser.add_argument("--trials", type=int, default=20, help="pitfall 1: races tried (GPU)")
    args = parser.parse_args(argv)
    device = bridge.device()
    results: list = []

    print("pitfall 1: wrong stream")
    if common.is_simulator():
        print(
            "SKIPPED: pitfall 1 (streams race only on a GPU; the simulator runs launches in order)"
        )
    else:
        results += wrong_stream(args.trials)

    print("pitfall 2: a tensor that requires grad")
    requires_grad(device)

    print("pitfall 3: a non-contiguous tensor")
    m, n = common.pick(gpu=(4096, 4096), simulator=(5, 11))
    results += non_contiguous(device, m, n)
    save_results(results, args.out, "pitfalls")
    return 0


if __name__ == "__main__":
    run_script(main)
