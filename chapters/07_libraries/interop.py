"""Numba and torch in one program: the pitfalls, each shown and measured.

pitfall 1  a tensor with requires_grad cannot be wrapped: detach() it first
pitfall 2  stream ordering: torch may run on its own stream; launch our kernel
           on cuda.external_stream(torch.cuda.current_stream().cuda_stream)
pitfall 3  passing torch tensors to a Numba kernel costs more per launch than
           passing Numba device arrays (the __cuda_array_interface__ is read
           and checked on every call): measured

Run:   python chapters/07_libraries/interop.py [--out DIR]
Needs a GPU and CUDA torch for pitfalls 2 and 3; elsewhere it says they were skipped.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import CheckError, check
from common.harness import run_script, save_results, script_parser
from common.runtime import is_simulator, torch_cuda_available
from common.timing import Timing

import time
from functools import partial

import torch
from numba import cuda


# One thread an element: y[i] = 2 x[i]; the kernel whose launch cost we measure.
@cuda.jit(cache=True)
def scale2(x, y):
    i = cuda.grid(1)
    if i < y.size:
        y[i] = 2 * x[i]


def wrap_for_numba(t):
    """A Numba view of torch tensor ``t`` (no copy); refuses tensors that track gradients.

    Raises ValueError with the fix (``t.detach()``) when ``t.requires_grad``.
    """
    if t.requires_grad:
        raise ValueError("tensor requires grad: pass t.detach() (same memory, no autograd)")
    if is_simulator():
        return cuda.to_device(t.numpy())
    if not t.is_cuda:
        raise ValueError(
            f"tensor is on {t.device}; move it first with t.cuda() (a Numba view needs GPU memory)"
        )
    return cuda.as_cuda_array(t)


def per_launch_us(fn, calls=2000):
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    args = script_parser(__doc__, "07_libraries").parse_args(argv)
    on_gpu = torch_cuda_available()
    t = torch.randn(64, requires_grad=True, device="cuda" if on_gpu else "cpu")
    try:
        wrap_for_numba(t)
        raise CheckError("a requires_grad tensor was wrapped silently")
    except ValueError as exc:
        print(f"pitfall 1: {exc}")
    x = wrap_for_numba(t.detach())
    print(f"  t.detach() wraps fine: shape {x.shape}")

    results = []
    if not torch_cuda_available():
        print("SKIPPED: pitfalls 2 and 3 (need a GPU and CUDA torch)")
    else:
        n = 1 << 24
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            tx = torch.randn(n, device="cuda")  # written on stream s
            ty = torch.empty(n, device="cuda")
            ns = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            scale2[ceil_div(n, 256), 256, ns](cuda.as_cuda_array(tx), cuda.as_cuda_array(ty))
        s.synchronize()
        check(ty, 2 * tx.double(), tol=0, name="kernel on torch's stream")
        print("pitfall 2: kernel launched on torch's current stream sees its data: checked")

        small = 1024
        xt, yt = torch.randn(small, device="cuda"), torch.empty(small, device="cuda")
        xn, yn = cuda.as_cuda_array(xt), cuda.as_cuda_array(yt)
        grid = ceil_div(small, 256)
        us_numba = per_launch_us(partial(scale2[grid, 256], xn, yn))
        us_torch = per_launch_us(partial(scale2[grid, 256], xt, yt))
        us_op = per_launch_us(partial(torch.mul, xt, 2, out=yt))
        for name, us in (
            ("launch, Numba device arrays", us_numba),
            ("launch, torch tensors", us_torch),
            ("torch.mul (one torch op)", us_op),
        ):
            print(f"pitfall 3: {name:<30} {us:6.1f} us per call")
            results.append(Timing(name=name, median_ms=us / 1e3, extra={"us_per_call": us}))
    save_results(results, args.out, "interop")
    return 0


if __name__ == "__main__":
    run_script(main)
