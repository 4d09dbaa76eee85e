"""cuFFT through torch.fft: the DFT by hand, then FFT convolution vs direct convolution.

version 1  dft_by_hand: X[k] = sum_n x[n] exp(-2 pi i k n / N), an N x N matrix product
version 2  torch.fft.fft (cuFFT on a GPU): O(N log N) instead of O(N^2)
version 3  conv1d_direct: our kernel, one thread an output, m multiply-adds each
version 4  FFT convolution (solutions.fft_convolve_1d): wins once the filter is long

Run:   python chapters/07_libraries/fft_conv.py [--out DIR]
The crossover (filter length where FFT beats direct) is measured on the GPU;
in the simulator only the checks run.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling, pick
from common.checking import check, random_array, require_device_array
from common.harness import run_script, save_results, script_parser
from common.runtime import torch_cuda_available
from common.timing import benchmark, format_table

from functools import partial

import numpy as np
import torch
from numba import cuda, float32

sol = import_sibling(__file__, "solutions")


def dft_by_hand(x):
    """The definition: (N,) real or complex -> (N,) complex128 spectrum.

    Raises ValueError for an input that is not 1-D or is empty.
    """
    x = np.asarray(x)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x must be a non-empty 1-D array, got shape {x.shape}")
    n = len(x)
    k = np.arange(n)
    return np.exp(-2j * np.pi * np.outer(k, k) / n) @ np.asarray(x, dtype=np.complex128)


# v3: one thread an output y[i] = sum_j x[j] h[i - j]; m FMAs and 2m loads each.
@cuda.jit(cache=True)
def conv1d_direct(x, h, y):
    i = cuda.grid(1)
    if i < y.size:
        acc = float32(0.0)
        for j in range(h.size):
            if 0 <= i - j < x.size:
                acc += x[i - j] * h[j]
        y[i] = acc


def conv1d_direct_launch(x, h, y, block=256):
    """y (n + m - 1,) = full convolution of x (n,) with h (m,): float32 device arrays.

    Raises (before launching): TypeError for a host array or another dtype,
    ValueError for an operand that is not 1-D or a y of the wrong length.
    """
    for a, name in ((x, "x"), (h, "h"), (y, "y")):
        require_device_array(a, name, 1, np.float32)
    if y.size != x.size + h.size - 1:
        raise ValueError(
            f"y must have x.size + h.size - 1 = {x.size + h.size - 1} elements, got {y.size}"
        )
    conv1d_direct[ceil_div(y.size, block), block](x, h, y)


def main(argv=None):
    args = script_parser(__doc__, "07_libraries").parse_args(argv)
    rng = np.random.default_rng(0)

    x = np.array([1.0, -1.0, 1.0, -1.0])
    spec = dft_by_hand(x)
    print(f"DFT of [1, -1, 1, -1] by hand: {np.round(spec, 12)}  (all energy at k = N/2)")
    check(spec.real, np.fft.fft(x).real, tol=1e-12, name="dft real")
    check(torch.fft.fft(torch.tensor(x)).numpy().real, spec.real, tol=1e-12, name="torch.fft")

    n = pick(gpu=1 << 20, simulator=40)
    lengths = pick(gpu=[3, 15, 63, 255, 1023], simulator=[3, 9])
    device = "cuda" if torch_cuda_available() else "cpu"
    xs = random_array(n, np.float32, rng)
    results, rows = [], []
    for m in lengths:
        hs = random_array(m, np.float32, rng)
        ref = np.convolve(xs.astype(np.float64), hs)
        dx, dh = cuda.to_device(xs), cuda.to_device(hs)
        dy = cuda.device_array(n + m - 1, np.float32)
        conv1d_direct_launch(dx, dh, dy)
        check(dy, ref, tol=1e-5, name=f"direct m={m}")
        tx, th = torch.from_numpy(xs).to(device), torch.from_numpy(hs).to(device)
        check(sol.fft_convolve_1d(tx, th), ref, tol=1e-4, name=f"fft m={m}")
        td = benchmark(partial(conv1d_direct_launch, dx, dh, dy), f"direct kernel n={n} m={m}")
        tf = benchmark(partial(sol.fft_convolve_1d, tx, th), f"torch.fft ({device}) n={n} m={m}")
        results += [td, tf]
        if td.measured:
            rows.append((m, td.median_ms, tf.median_ms))
    print(format_table(results, title="1-D convolution: direct kernel vs FFT"))
    if device == "cpu":
        print("SKIPPED: cuFFT timings (needs a GPU and CUDA torch); torch.fft ran on the CPU")
    wins = [m for m, d, f in rows if f < d]
    if rows:
        print(f"FFT is faster from filter length {wins[0] if wins else 'never (in this range)'}")
    save_results(results, args.out, "fft_conv", n=n, fft_wins_from=wins[0] if wins else None)
    return 0


if __name__ == "__main__":
    run_script(main)
