"""cuDNN through torch.nn.functional.conv2d, checked against a direct convolution of our own.

version 1  conv2d_direct: our kernel, one thread an output (n, k, y, x) of an NCHW
           tensor; C * R * S multiply-adds per thread, no reuse through shared memory
version 2  F.conv2d with cudnn.benchmark off (cuDNN's heuristic picks an algorithm)
version 3  F.conv2d with cudnn.benchmark on (cuDNN times its algorithms once per shape)

Run:   python chapters/07_libraries/cudnn_conv.py [--out DIR]
Layout NCHW, "valid" convolution (no padding), stride 1, cross-correlation as in
deep learning frameworks. cuDNN timings need a GPU and CUDA torch.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, pick
from common.checking import check, poisoned, random_array, require_device_array
from common.harness import run_script, save_results, script_parser
from common.runtime import torch_cuda_available
from common.timing import benchmark, format_table

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda, float32


def conv2d_reference(x, w):
    """x: (N, C, H, W), w: (K, C, R, S) -> (N, K, H-R+1, W-S+1) float64, by loops over R, S.

    Raises ValueError for an operand that is not 4-D or channel counts that differ.
    """
    if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need NCHW x and KCRS w with the same C, got {x.shape}, {w.shape}")
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    out = np.zeros((n, k, h - r + 1, wd - s + 1))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    for i in range(r):
        for j in range(s):
            patch = x64[:, :, i : i + h - r + 1, j : j + wd - s + 1]
            # (K, C) . (N, C, H', W') over C, through BLAS: -> (K, N, H', W')
            out += np.tensordot(w64[:, :, i, j], patch, axes=([1], [1])).transpose(1, 0, 2, 3)
    return out


# v1: one thread one output; C*R*S FMAs and 2*C*R*S global loads each (cache helps).
@cuda.jit(cache=True)
def conv2d_direct(x, w, y):
    ox = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    oy = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    nk = cuda.blockIdx.z
    kk = w.shape[0]
    n, k = nk // kk, nk % kk
    if oy < y.shape[2] and ox < y.shape[3]:
        acc = float32(0.0)
        for c in range(x.shape[1]):
            for i in range(w.shape[2]):
                for j in range(w.shape[3]):
                    acc += x[n, c, oy + i, ox + j] * w[k, c, i, j]
        y[n, k, oy, ox] = acc


def conv2d_direct_launch(x, w, y, block=(16, 16)):
    """x (N,C,H,W), w (K,C,R,S), y (N,K,H-R+1,W-S+1) float32 device arrays.

    Raises (before launching): TypeError for a host array or another dtype,
    ValueError for an operand that is not 4-D or shapes that do not match.
    """
    for a, name in ((x, "x"), (w, "w"), (y, "y")):
        require_device_array(a, name, 4, np.float32)
    n, c, h, wd = x.shape
    k, c_w, r, s = w.shape
    if c_w != c or tuple(y.shape) != (n, k, h - r + 1, wd - s + 1):
        raise ValueError(
            f"need x (N, C, H, W), w (K, C, R, S), y (N, K, H-R+1, W-S+1); "
            f"got x {x.shape}, w {w.shape}, y {y.shape}"
        )
    grid = (ceil_div(y.shape[3], block[0]), ceil_div(y.shape[2], block[1]), y.shape[0] * y.shape[1])
    conv2d_direct[grid, block](x, w, y)


def main(argv=None):
    args = script_parser(__doc__, "07_libraries").parse_args(argv)
    rng = np.random.default_rng(0)
    n, c, h, wd, k, r = pick(gpu=(32, 64, 56, 56, 64, 3), simulator=(1, 2, 9, 7, 2, 3))
    x_h = random_array((n, c, h, wd), np.float32, rng)
    w_h = random_array((k, c, r, r), np.float32, rng)
    ref = conv2d_reference(x_h, w_h)
    x, w = cuda.to_device(x_h), cuda.to_device(w_h)
    y = poisoned(ref.shape, np.float32)
    conv2d_direct_launch(x, w, y)
    check(y, ref, tol=1e-5, name="conv2d_direct")
    flops = 2 * ref.size * c * r * r
    results = [
        benchmark(partial(conv2d_direct_launch, x, w, y), "1 conv2d_direct (ours)", flops=flops)
    ]
    if not torch_cuda_available():
        out = F.conv2d(torch.from_numpy(x_h), torch.from_numpy(w_h))
        check(out, ref, tol=1e-5, name="F.conv2d (CPU)")
        print("F.conv2d on the CPU matches; SKIPPED: cuDNN timings (need a GPU and CUDA torch)")
    else:
        tx, tw = torch.as_tensor(x, device="cuda"), torch.as_tensor(w, device="cuda")
        torch.backends.cudnn.allow_tf32 = False
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            # 1e-4: cuDNN may pick FFT or Winograd algorithms, which round differently.
            check(F.conv2d(tx, tw), ref, tol=1e-4, name=f"cuDNN benchmark={bench}")
            results.append(
                benchmark(
                    partial(F.conv2d, tx, tw),
                    f"{2 + bench} F.conv2d cudnn.benchmark={bench}",
                    flops=flops,
                )
            )
    print(format_table(results, title=f"conv2d NCHW x{(n, c, h, wd)} w{(k, c, r, r)}"))
    save_results(results, args.out, "cudnn_conv")
    return 0


if __name__ == "__main__":
    run_script(main)
