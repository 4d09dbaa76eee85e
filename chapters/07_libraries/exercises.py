# ruff: noqa: F401  (stubs: the TODO lines will use these names)
"""Chapter 07 exercises: cuBLAS on Numba arrays, FFT convolution, reproducible RNG.

Fill the lines marked TODO, delete the `raise NotImplementedError` lines, and
run `python -m pytest tests/test_ch07_libraries.py -q`.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, is_simulator
from common.checking import require_device_array

import numpy as np
import torch
from numba import cuda
from numba.cuda.random import create_xoroshiro128p_states, xoroshiro128p_uniform_float32


def as_torch(x):
    """A torch tensor sharing memory with Numba device array ``x`` (no copy).

    On a GPU torch reads ``x.__cuda_array_interface__``. In the simulator a
    "device" array is a NumPy array underneath, shared through from_numpy.
    """
    if is_simulator():
        return torch.from_numpy(x._ary)
    return torch.as_tensor(x, device="cuda")


# ---------------------------------------------------------------- Exercise 7.1


def matmul_torch_zero_copy(a, b, c):
    """Exercise 7.1: C = A @ B by cuBLAS (torch.matmul), on Numba arrays, no copy.

    a: (M, K), b: (K, N), c: (M, N) float32 Numba device arrays. Wrap each
    with :func:`as_torch` and call ``torch.matmul(ta, tb, out=tc)`` so cuBLAS
    writes straight into c's memory. TF32 must be off (FP32 accuracy).

    Raises (before any work):
        TypeError: an operand that is not a float32 device array (a host NumPy
            array, a float64 one).
        ValueError: an operand that is not 2-D, or shapes that do not chain
            (a (M, K) @ b (K, N) -> c (M, N)).
    """
    for name, x, dims in (("a", a, "(M, K)"), ("b", b, "(K, N)"), ("c", c, "(M, N)")):
        require_device_array(x, name, dtype=np.float32)
        if len(x.shape) != 2:
            raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(x.shape)}")
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"shapes do not chain: a {a.shape} @ b {b.shape} -> c {c.shape}")
    raise NotImplementedError("Exercise 7.1: wrap a, b, c with as_torch and call torch.matmul")
    torch.backends.cuda.matmul.allow_tf32 = False
    # TODO: torch.matmul(..., out=...) on the three wrapped arrays


# ---------------------------------------------------------------- Exercise 7.2


def fft_convolve_1d(x, h):
    """Exercise 7.2: full linear convolution of 1-D tensors by FFT.

    x: (n,), h: (m,) float32 torch tensors on any device. Returns the (n + m - 1,)
    float32 tensor y[i] = sum_j x[j] h[i - j] (same as np.convolve(x, h)).
    Method (convolution theorem): zero-pad both to L = n + m - 1 (torch.fft.rfft's
    n=L argument does it), multiply the spectra, inverse with irfft(n=L).

    Raises (before any work):
        TypeError: x or h is not float32 (a float64 input would give a float64 result).
        ValueError: x or h is not 1-D, or is empty.
    """
    for name, t in (("x", x), ("h", h)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}; convert with {name}.float()")
        if t.ndim != 1 or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
    raise NotImplementedError("Exercise 7.2: rfft both (padded), multiply, irfft")
    length = x.numel() + h.numel() - 1
    spectrum = None  # TODO: product of the two padded spectra
    return torch.fft.irfft(spectrum, n=length)


# ---------------------------------------------------------------- Exercise 7.3


@cuda.jit(cache=True)
def uniform_fill(states, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 0.5  # TODO: draw from generator state i


def random_uniform(n, seed, block=128):
    """Exercise 7.3: n float32 numbers uniform in [0, 1) from Numba's xoroshiro128+.

    Thread i draws element i from its own generator state i; the states come
    from ``create_xoroshiro128p_states(n, seed=seed)``, which gives state i the
    subsequence i (2**64 steps apart), so the numbers depend on (seed, i) only,
    not on the block size. Returns a NumPy array. Raises ValueError if n < 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    raise NotImplementedError("Exercise 7.3: fill the TODO in uniform_fill")
    states = create_xoroshiro128p_states(n, seed=seed)
    out = cuda.device_array(n, np.float32)
    uniform_fill[ceil_div(n, block), block](states, out)
    return out.copy_to_host()
