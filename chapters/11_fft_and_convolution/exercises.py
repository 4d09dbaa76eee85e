# ruff: noqa: F841, B007  (stubs: the TODO lines will use these names)
"""Chapter 11 exercises: the FFT, by hand, and convolution through it.

Each exercise is a host function whose docstring is the spec. The kernel stub sits
right above it: fill the lines marked ``# TODO``, then delete the
``raise NotImplementedError`` line of the host function (the launch below it is
written for you). Check your work with

    python -m pytest tests/test_ch11_exercises.py -q

11.1 bit_reverse_permute   out[b, rev(i)] = x[b, i]: the order a decimation-in-time FFT reads
11.2 twiddle_table         exp(-2 pi i k / n) to float32 rounding: the angle folded to an octant
11.3 radix2_stage          one Cooley-Tukey butterfly stage in global memory, one launch a stage
11.4 fft_stockham_shared   a row's whole FFT in one block's shared memory, no bit reversal
11.5 complex_mac_channels  out[b, o, f] = sum_c X[b, c, f] conj(W[o, c, f]): a conv layer per frequency
11.6 fft_conv1d            "same" cross-correlation through your 11.4: pad, transform, multiply, crop

The checks compare with numpy.fft in float64, within the rounding error a
float32 FFT is allowed (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., Theorem 24.2: about log2 n roundings), on sizes 1, 2 and
several powers of two, one row and an odd number of rows, fresh random data and
outputs poisoned with NaN. In the simulator every launch runs under a race
detector: a missing ``cuda.syncthreads()`` fails every time.

All arrays are Numba device arrays (``cuda.to_device``); complex values are
complex64 and real ones float32 (a Python ``1j`` or ``2.0`` in a kernel is
complex128/float64: use the constants below). The argument checks, the host-made
twiddle table and two device functions are given: they come from solutions.py,
where each has its docstring (read only those there).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling
from common.checking import require_device_array

import numpy as np
from numba import complex64, cuda, float32  # noqa: F401

solutions = import_sibling(__file__, "solutions")

BLOCK = solutions.BLOCK  # threads per block (every kernel but 11.4's)
MAX_SHARED_N = solutions.MAX_SHARED_N  # the longest row 11.4 transforms in one block
MAX_TWIDDLE_N, MAX_GRID_YZ = solutions.MAX_TWIDDLE_N, solutions.MAX_GRID_YZ
ZERO, ZERO_C, IMAG = solutions.ZERO, solutions.ZERO_C, solutions.IMAG  # 0, 0 + 0i, 1i
QUARTER_PI = solutions.QUARTER_PI  # pi / 4 as a float32

# Given (solutions.py): argument checks that raise TypeError / ValueError before a launch.
require_rows, require_same_shape = solutions.require_rows, solutions.require_same_shape
require_power_of_two, require_separate = solutions.require_power_of_two, solutions.require_separate
log2_exact, next_power_of_two = solutions.log2_exact, solutions.next_power_of_two
# Given: the (n // 2,) table exp(-2 pi i k / n) made on the host, for 11.3 and 11.4.
twiddles_device = solutions.twiddles_device
# Given device functions: cplx(re, im) -> complex64; sin_cos_octant(a) -> (sin a, cos a)
# in float32 for a float32 a in [0, pi/4].
cplx, sin_cos_octant = solutions.cplx, solutions.sin_cos_octant


# ---------------------------------------------------------------- 11.1 bit reversal
@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def bit_reverse_kernel(x, out, bits):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < x.shape[1]:
        r = 0
        v = i
        for _ in range(bits):
            pass  # TODO: shift r left by one, move v's lowest bit into it, shift v right
        out[b, r] = ZERO_C  # TODO: x[b, i]


def bit_reverse_permute(x, out):
    """Exercise 11.1: ``out[b, rev(i)] = x[b, i]``, rev reversing the log2(n) bits of i.

    x, out: complex64 (batch, n) device arrays, n a power of two (n = 8: 1 = 001
    goes to 100 = 4, 6 = 110 to 011 = 3); out must not overlap x (thread i writes
    out[rev(i)] while thread rev(i) reads x[rev(i)]). Launch: a grid of
    (ceil(n / BLOCK), batch) blocks of BLOCK threads, thread i of row b moves one
    element. A decimation-in-time FFT reads its input in this order, so that its
    butterflies write in natural order (Cooley & Tukey 1965; Cormen et al.,
    "Introduction to Algorithms", 3rd ed., sec. 30.3, BIT-REVERSE-COPY).
    Raises TypeError (a host array, not complex64), ValueError (a shape, n not a
    power of two, out overlapping x), all before any launch.
    """
    raise NotImplementedError("Exercise 11.1: fill the TODOs in bit_reverse_kernel")
    x, out = require_rows(x, "x"), require_rows(out, "out")
    require_same_shape(x, out)
    n = x.shape[1]
    require_power_of_two(n, "n = x.shape[1]")
    require_separate(x, out, "thread i writes out[rev(i)] while thread rev(i) reads x[rev(i)]")
    bit_reverse_kernel[(ceil_div(n, BLOCK), x.shape[0]), BLOCK](x, out, log2_exact(n))


# ---------------------------------------------------------------- 11.2 twiddle table
@cuda.jit  # not cached: uses solutions.py's constants and sin_cos_octant, whose edits numba's cache does not see
def twiddle_kernel(out, n):
    k = cuda.grid(1)
    if k < out.size:
        # theta = 2 pi k / n = (pi / 4) (j / n) with j = 8k, an integer: pi is j = 4n,
        # pi / 2 is 2n, pi / 4 is n.
        j = 8 * k
        flip = False  # TODO: theta > pi/2? then j = 4n - j (cos changes sign, sin does not)
        swap = False  # TODO: now theta > pi/4? then j = 2n - j (cos and sin trade places)
        a = ZERO  # TODO: the folded angle (pi / 4) (j / n) in float32 (j / n is exact)
        s, c = sin_cos_octant(a)
        pass  # TODO: undo the folds on s and c
        out[k] = ZERO_C  # TODO: exp(-i theta) = cos theta - i sin theta, with cplx


def twiddle_table(n, out):
    """Exercise 11.2: ``out[k] = exp(-2 pi i k / n)`` for k < n / 2, to float32 rounding.

    n: an int, a power of two in [2, MAX_TWIDDLE_N]. out: complex64 (n // 2,).
    Launch: ceil((n / 2) / BLOCK) blocks of BLOCK threads, one a k. Every real and
    imaginary part must be within 4 eps32 of its own size (cos(pi/2) exactly 0).
    ``math.cos(float32(2 pi) * k / n)`` is not: that float32 angle is off by up
    to ~0.75 eps32 * theta (2.8e-7 near pi), which is all of a part near 0
    (cos(pi/2) comes out -4.4e-8). So fold theta = 2 pi k / n into [0, pi/4] in
    integers, where the folds are exact (theta = (pi / 4) (8k / n): pi - theta is
    4n - 8k, pi/2 - theta is 2n - 8k), round one angle in [0, pi/4], and take
    sin_cos_octant of it (given; math.sin and math.cos of the folded angle are
    accurate enough too, but their large-argument path brings float64 into the
    kernel). FFTW makes its tables the same way (kernel/trig.c, real_cexp:
    "reducing x to range [0..1/8] before multiplication by 2 * PI").
    Raises TypeError (n not an int, out a host array or not complex64), ValueError
    (n not a power of two or out of range, a wrong out shape), before any launch.
    """
    raise NotImplementedError("Exercise 11.2: fill the TODOs in twiddle_kernel")
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    require_power_of_two(n, "n")
    if not 2 <= n <= MAX_TWIDDLE_N:
        raise ValueError(
            f"n must be in [2, {MAX_TWIDDLE_N}] (8k must be exact in float32), got {n}"
        )
    out = require_device_array(out, "out", ndim=1, dtype=np.complex64)
    if out.shape[0] != n // 2:
        raise ValueError(f"out must have n // 2 = {n // 2} elements, got {out.shape[0]}")
    twiddle_kernel[ceil_div(n // 2, BLOCK), BLOCK](out, n)


# ---------------------------------------------------------------- 11.3 one radix-2 stage
@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def radix2_stage_kernel(x, out, twiddles, half):
    p = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x  # this thread's butterfly
    b = cuda.blockIdx.y
    n = x.shape[1]
    if p < n // 2:
        j = p % half  # its place in its group of 2 * half elements
        i0 = 0  # TODO: the top element: group p // half starts at (p // half) * 2 * half
        i1 = 0  # TODO: its partner, half further on
        w = ZERO_C  # TODO: exp(-2 pi i j / (2 half)), from twiddles[k] = exp(-2 pi i k / n)
        t = w * x[b, i1]
        u = x[b, i0]
        pass  # TODO: out[b, i0] = u + t and out[b, i1] = u - t


def radix2_stage(x, out, stage):
    """Exercise 11.3: stage ``stage`` of a radix-2 decimation-in-time FFT.

    x, out: complex64 (batch, n) device arrays, n a power of two >= 2; stage an int
    in [0, log2 n). With half = 2**stage, the stage joins pairs of half-point DFTs
    into 2 half-point ones: for group g and j < half, with i0 = g * 2 half + j,
    i1 = i0 + half and w = exp(-2 pi i j / (2 half)),
        out[b, i0] = x[b, i0] + w x[b, i1],   out[b, i1] = x[b, i0] - w x[b, i1].
    Bit-reverse x (11.1), then run stages 0, 1, ..., log2 n - 1, each into a fresh
    array: the result is numpy.fft.fft(x, axis=1) (Cormen et al., sec. 30.3,
    ITERATIVE-FFT; one launch a stage, every element read and written once a stage:
    2 log2 n passes over global memory, which 11.4 replaces with one).
    Launch: a grid of (ceil((n / 2) / BLOCK), batch) blocks of BLOCK threads, one
    butterfly a thread; twiddles come from the given table w[k] = exp(-2 pi i k / n):
    exp(-2 pi i j / (2 half)) is w[j * n / (2 half)].
    Raises TypeError / ValueError (as 11.1; a stage out of range), before any launch.
    """
    raise NotImplementedError("Exercise 11.3: fill the TODOs in radix2_stage_kernel")
    x, out = require_rows(x, "x"), require_rows(out, "out")
    require_same_shape(x, out)
    n = x.shape[1]
    require_power_of_two(n, "n = x.shape[1]")
    stages = log2_exact(n)
    if not isinstance(stage, (int, np.integer)) or not 0 <= stage < stages:
        raise ValueError(f"stage must be an int in [0, log2 n = {stages}), got {stage!r}")
    half = 1 << int(stage)
    grid = (ceil_div(n // 2, BLOCK), x.shape[0])
    radix2_stage_kernel[grid, BLOCK](x, out, twiddles_device(n), half)


# ---------------------------------------------------------------- 11.4 Stockham in shared memory
@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def fft_stockham_kernel(x, out, twiddles):
    buf = cuda.shared.array((2, MAX_SHARED_N), complex64)  # ping-pong: read one, write other
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = x.shape[1]
    half = n // 2
    for i in range(t, n, cuda.blockDim.x):
        buf[0, i] = x[row, i]  # t and t + n/2: its first pair, no barrier yet
    src = 0
    ns = 1  # the length of the sub-transforms done so far
    while ns < n:
        if t < half:
            m = t % ns
            a = ZERO_C  # TODO: buf[src, t]
            b = ZERO_C  # TODO: buf[src, t + half] times exp(-2 pi i m / (2 ns)) from the table
            d = 0  # TODO: where the pair goes: (t // ns) * 2 ns + m
            pass  # TODO: buf[1 - src, d] = a + b; buf[1 - src, d + ns] = a - b
        pass  # TODO: a barrier between stages (one is enough: why, with two buffers?)
        src = 1 - src
        ns *= 2
    for i in range(t, n, cuda.blockDim.x):
        out[row, i] = buf[src, i]


def fft_stockham_shared(x, out):
    """Exercise 11.4: ``out = numpy.fft.fft(x, axis=1)``, one block a row, in shared memory.

    x, out: complex64 (batch, n) device arrays, n a power of two <= MAX_SHARED_N
    (out may be x). Launch: batch blocks of max(n / 2, 1) threads. The block
    loads its row into buf[0] (thread t loads elements t and t + n/2, the pair
    its first butterfly reads: no barrier yet), then runs log2 n radix-2 stages between two
    shared buffers, reading one and writing the other, with a barrier after
    each; the result is in natural order, with no bit reversal: Stockham's
    auto-sort (Van Loan, "Computational Frameworks for the Fast Fourier
    Transform", 1992, sec. 1.7; the GPU form: Govindaraju et al., "High
    Performance Discrete Fourier Transforms on Graphics Processors", SC 2008,
    FftIteration with R = 2). At the stage with sub-transforms of length ns,
    thread t < n / 2 takes a = buf[src, t] and b = buf[src, t + n/2] w, with
    m = t % ns and w = exp(-2 pi i m / (2 ns)) (the table's w[m * (n/2) / ns]),
    and writes a + b to d = (t // ns) * 2 ns + m and a - b to d + ns.
    Raises TypeError / ValueError (as 11.1; n > MAX_SHARED_N), before any launch.
    """
    raise NotImplementedError("Exercise 11.4: fill the TODOs in fft_stockham_kernel")
    x, out = require_rows(x, "x"), require_rows(out, "out")
    require_same_shape(x, out)
    n = x.shape[1]
    require_power_of_two(n, "n = x.shape[1]")
    if n > MAX_SHARED_N:
        raise ValueError(f"n = {n} does not fit one block's shared buffers (n <= {MAX_SHARED_N})")
    fft_stockham_kernel[x.shape[0], max(n // 2, 1)](x, out, twiddles_device(n))


# ---------------------------------------------------------------- 11.5 channel sum per frequency
@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def complex_mac_kernel(X, W, out):
    f = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    o = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if f < X.shape[2]:
        acc = ZERO_C
        for c in range(X.shape[1]):
            pass  # TODO: acc += X[b, c, f] times the conjugate of W[o, c, f]
        out[b, o, f] = acc


def complex_mac_channels(X, W, out):
    """Exercise 11.5: ``out[b, o, f] = sum_c X[b, c, f] * conj(W[o, c, f])``.

    X: complex64 (B, C, F) spectra of B inputs of C channels; W: complex64
    (O, C, F) spectra of O filters; out: complex64 (B, O, F). The frequency-domain
    step of an FFT convolution layer: a conv layer (which cross-correlates) is, per
    frequency, a (B, C) x (C, O) complex matrix product with the filters'
    spectra conjugated (the correlation theorem; Mathieu, Henaff & LeCun, "Fast
    Training of Convolutional Networks through FFTs", ICLR 2014).
    Launch: a grid of (ceil(F / BLOCK), O, B) blocks of BLOCK threads, one output a
    thread, a loop over the C channels (w.conjugate() conjugates a complex64).
    Raises TypeError (host arrays, not complex64) or ValueError (shapes that do not
    chain, a size < 1, B or O > MAX_GRID_YZ), before any launch.
    """
    raise NotImplementedError("Exercise 11.5: fill the TODO in complex_mac_kernel")
    X = require_device_array(X, "X", ndim=3, dtype=np.complex64)
    W = require_device_array(W, "W", ndim=3, dtype=np.complex64)
    out = require_device_array(out, "out", ndim=3, dtype=np.complex64)
    (batch, channels, freqs), outs = X.shape, W.shape[0]
    if W.shape[1:] != (channels, freqs) or out.shape != (batch, outs, freqs):
        raise ValueError(
            f"need X (B, C, F), W (O, C, F), out (B, O, F); got X {X.shape}, W {W.shape}, "
            f"out {out.shape}"
        )
    if min(batch, channels, freqs, outs) < 1 or max(batch, outs) > MAX_GRID_YZ:
        raise ValueError(f"every size must be >= 1 and B, O <= {MAX_GRID_YZ}")
    complex_mac_kernel[(ceil_div(freqs, BLOCK), outs, batch), BLOCK](X, W, out)


# ---------------------------------------------------------------- 11.6 FFT cross-correlation
@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def pad_kernel(x, out):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < out.shape[1]:
        out[b, i] = ZERO_C  # TODO: x[b, i] as a complex64 inside x's row, 0 past its end


@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def correlate_spectra_kernel(X, Wf, Z):
    f = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if f < X.shape[1]:
        Z[b, f] = ZERO_C  # TODO: conj(X[b, f] conj(Wf[0, f])), ready for a forward FFT


@cuda.jit  # not cached: uses solutions.py's constants, whose edits numba's cache does not see
def crop_kernel(c, out, shift, scale):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < out.shape[1]:
        n = c.shape[1]
        out[b, i] = ZERO  # TODO: scale times the real part of lag i - shift of row b
        # (a negative lag m sits at n + m)


def fft_conv1d(x, w, out):
    """Exercise 11.6: ``out[b, i] = sum_k w[k] x[b, i + k - (K - 1) // 2]``, by FFT.

    x, out: float32 (batch, L) device arrays; w: float32 (K,), contiguous; x is 0
    outside [0, L). The "same" cross-correlation a conv layer computes
    (torch.nn.functional.conv1d(x, w, padding="same") for one channel). Via the
    FFT (your 11.4): pad x's rows and w with zeros to n = the next power of two
    >= L + K - 1, so that every lag from -(K - 1) to L - 1 has its own slot and
    no lag wraps onto another (cyclic convolution is what the DFT multiplies);
    transform both; the correlation's spectrum is X conj(W) (the correlation
    theorem); invert it with the forward transform, ifft(Y) = conj(fft(conj Y)) / n,
    which is why correlate_spectra_kernel stores conj(X conj(W)); keep the real
    part, scaled by 1 / n, of lags -(K - 1) // 2 ... L - 1 - (K - 1) // 2.
    Cost: 3 FFTs of n log2 n butterflies, against L K multiply-adds directly
    (Cooley, Lewis & Welch 1969, "The fast Fourier transform and its applications").
    Launch (written): each small kernel a grid of (ceil(n / BLOCK), rows) blocks.
    Raises TypeError (host arrays, not float32) or ValueError (shapes, w empty or
    not contiguous, n > MAX_SHARED_N), before any launch.
    """
    raise NotImplementedError("Exercise 11.6: fill the TODOs in the three kernels above")
    x, out = require_rows(x, "x", np.float32), require_rows(out, "out", np.float32)
    w = require_device_array(w, "w", ndim=1, dtype=np.float32)
    require_same_shape(x, out)
    (batch, length), taps = x.shape, w.shape[0]
    if taps < 1:
        raise ValueError("w is empty")
    if not w.is_c_contiguous():
        raise ValueError("w must be contiguous (cuda.to_device(np.ascontiguousarray(w)))")
    # Every lag from -(taps - 1) to length - 1 gets its own slot: no wrap-around.
    n_fft = next_power_of_two(length + taps - 1)
    if n_fft > MAX_SHARED_N:
        raise ValueError(
            f"length + taps - 1 = {length + taps - 1} needs an FFT of {n_fft} > {MAX_SHARED_N}"
        )
    rows = ceil_div(n_fft, BLOCK)
    xs = cuda.device_array((batch, n_fft), np.complex64)
    ws = cuda.device_array((1, n_fft), np.complex64)
    spectrum_x = cuda.device_array((batch, n_fft), np.complex64)
    spectrum_w = cuda.device_array((1, n_fft), np.complex64)
    pad_kernel[(rows, batch), BLOCK](x, xs)
    pad_kernel[(rows, 1), BLOCK](w.reshape(1, taps), ws)
    fft_stockham_shared(xs, spectrum_x)
    fft_stockham_shared(ws, spectrum_w)
    correlate_spectra_kernel[(rows, batch), BLOCK](spectrum_x, spectrum_w, xs)
    fft_stockham_shared(xs, spectrum_x)  # n times the (conjugated) correlation
    shift = (taps - 1) // 2
    crop_kernel[(ceil_div(length, BLOCK), batch), BLOCK](
        spectrum_x, out, shift, np.float32(1.0 / n_fft)
    )
