"""cuBLAS from Python: torch.matmul on Numba device arrays, TF32 cost, GEMV, batched GEMM.

version 1  SGEMM: torch.matmul on Numba arrays wrapped with torch.as_tensor (no copy)
version 2  TF32 on (torch.backends.cuda.matmul.allow_tf32): speed and accuracy cost
version 3  GEMV (matrix-vector) and batched GEMM (torch.bmm)
version 4  the transpose trick: a column-major library computes row-major C as C^T = B^T A^T

Run:   python chapters/07_libraries/cublas.py [--n 4096] [--out DIR]
On the simulator (or CPU-only torch) the cuBLAS timings are skipped and said so;
the zero-copy wrap, the transpose trick and the checks still run.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, pick
from common.checking import check, random_array, rel_error
from common.harness import run_script, save_results, script_parser
from common.runtime import torch_cuda_available
from common.timing import benchmark, device_peaks, format_table

from functools import partial

import numpy as np
import torch
from numba import cuda

sol = import_sibling(__file__, "solutions")


def gpu_torch():
    return torch_cuda_available()


def transpose_trick(a, b):
    """Row-major C = A @ B computed the way a column-major BLAS sees it.

    A row-major (M, K) buffer read column-major is A^T (K, M). Asking the
    column-major library for B^T @ A^T (N x M, column-major) writes exactly
    the bytes of row-major C: no copy, no transpose kernel. NumPy shows it:
    ``.T`` only swaps strides.

    a (M, K), b (K, N): NumPy arrays; returns C (M, N) in their dtype (a view of C^T).
    Raises ValueError, before any work, for an operand that is not 2-D or shapes
    that do not chain.
    """
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {x.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"shapes do not chain: a {a.shape} @ b {b.shape}")
    ct = b.T @ a.T  # what cuBLAS computes on the raw buffers
    return ct.T  # the same bytes, read row-major


def main(argv=None):
    parser = script_parser(__doc__, "07_libraries")
    parser.add_argument(
        "--n", type=int, default=pick(gpu=4096, simulator=16), help="matrix size n (n x n @ n x n)"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    n = args.n
    a_h, b_h = random_array((n, n), np.float32, rng), random_array((n, n), np.float32, rng)
    ref = a_h.astype(np.float64) @ b_h
    a, b = cuda.to_device(a_h), cuda.to_device(b_h)
    c = cuda.device_array((n, n), np.float32)

    sol.matmul_torch_zero_copy(a, b, c)
    print(
        f"zero-copy torch.matmul on Numba arrays {n}x{n}: rel error "
        f"{check(c, ref, tol=1e-4, name='sgemm'):.2e}"
    )
    check(transpose_trick(a_h, b_h), ref, tol=1e-4, name="transpose trick")
    print("transpose trick (C^T = B^T A^T on the same buffers): matches")

    results, meta = [], {}
    if not gpu_torch():
        print(
            "SKIPPED: cuBLAS timings, TF32, GEMV and batched GEMM on the GPU "
            "(needs a GPU and CUDA torch)"
        )
    else:
        peaks = device_peaks()
        ta, tb = (torch.as_tensor(x, device="cuda") for x in (a, b))
        tc = torch.empty(n, n, device="cuda")
        flops = 2 * n**3
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.matmul(ta, tb, out=tc)
            err = rel_error(tc, ref)
            t = benchmark(
                partial(torch.matmul, ta, tb, out=tc),
                f"SGEMM {n} TF32 {'on' if tf32 else 'off'}",
                flops=flops,
                peaks=peaks,
            )
            t.extra["rel_error"] = err
            meta[f"rel_error_tf32_{'on' if tf32 else 'off'}"] = err
            results.append(t)
        torch.backends.cuda.matmul.allow_tf32 = False
        x = torch.randn(n, device="cuda")
        y = torch.empty(n, device="cuda")
        results.append(
            benchmark(
                partial(torch.mv, ta, x, out=y),
                f"GEMV {n}",
                nbytes=4 * (n * n + 2 * n),
                flops=2 * n * n,
                peaks=peaks,
            )
        )
        bs, s = 64, 256
        xa, xb = torch.randn(bs, s, s, device="cuda"), torch.randn(bs, s, s, device="cuda")
        xc = torch.empty(bs, s, s, device="cuda")
        results.append(
            benchmark(
                partial(torch.bmm, xa, xb, out=xc),
                f"batched GEMM {bs}x{s}^3",
                flops=2 * bs * s**3,
                peaks=peaks,
            )
        )

        def separate_gemms():
            for i in range(bs):
                torch.mm(xa[i], xb[i], out=xc[i])

        results.append(
            benchmark(
                separate_gemms, f"{bs} separate GEMMs {s}^3", flops=2 * bs * s**3, peaks=peaks
            )
        )
        print(format_table(results, title="cuBLAS through torch"))
        print(
            "TF32 relative error: off {rel_error_tf32_off:.2e}, on {rel_error_tf32_on:.2e}".format(
                **meta
            )
        )
    save_results(results, args.out, "cublas", n=n, **meta)
    return 0


if __name__ == "__main__":
    run_script(main)
