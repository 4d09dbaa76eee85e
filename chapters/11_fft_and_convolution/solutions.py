"""Chapter 11 exercises, solved: the FFT and convolution. Same functions as exercises.py.

Check yours with: python -m pytest tests/test_ch11_exercises.py -q

11.1 bit_reverse_permute   out[b, rev(i)] = x[b, i]: the order a decimation-in-time FFT reads
11.2 twiddle_table         exp(-2 pi i k / n) to float32 rounding: the angle folded to an octant
11.3 radix2_stage          one Cooley-Tukey butterfly stage in global memory, one launch a stage
11.4 fft_stockham_shared   a row's whole FFT in one block's shared memory, no bit reversal
11.5 complex_mac_channels  out[b, o, f] = sum_c X[b, c, f] conj(W[o, c, f]): a conv layer per frequency
11.6 fft_conv1d            "same" cross-correlation through 11.4: pad, transform, multiply, invert, crop

Before the exercises: what exercises.py imports from here and does not ask you to
write (argument checks, the host-made twiddle table, two device functions).
Every complex value is complex64 and every real one float32: a Python complex or
float in a kernel would be complex128/float64, at 1/2 to 1/64 of the float32 rate.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.runtime import ceil_div

import numpy as np
from numba import complex64, cuda, float32

BLOCK = 64  # threads per block of every kernel but 11.4's
MAX_SHARED_N = 1024  # 11.4: two (1024,) complex64 buffers = 16 KiB of shared memory, 512 threads
MAX_TWIDDLE_N = 1 << 22  # 11.2: the folded angle 8k < 4n must be an exact float32 (< 2**24)
MAX_GRID_YZ = 65535  # a grid's y and z extents (rows, batches) are at most this
ZERO = np.float32(0.0)
ZERO_C = np.complex64(0.0)
IMAG = np.complex64(1j)
QUARTER_PI = np.float32(np.pi / 4)
# Taylor coefficients of sin and cos, enough terms for float32 on [0, pi/4]: the
# first terms left out, (pi/4)**11 / 11! and (pi/4)**12 / 12!, are below 2e-9.
SIN_C = tuple(np.float32((-1) ** k / np.prod(np.arange(1.0, 2 * k + 2))) for k in range(1, 5))
COS_C = tuple(np.float32((-1) ** k / np.prod(np.arange(1.0, 2 * k + 1))) for k in range(1, 6))
S3, S5, S7, S9 = SIN_C
C2, C4, C6, C8, C10 = COS_C


# ---------------------------------------------------------------- given: argument checks
def is_power_of_two(n):
    return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def log2_exact(n):
    """log2 of a power of two, as an int (0 for 1)."""
    return int(n).bit_length() - 1


def next_power_of_two(m):
    """The smallest power of two >= m (1 for m <= 1)."""
    return 1 << max(int(m) - 1, 0).bit_length()


def require_power_of_two(n, what):
    """Raise ValueError unless ``n`` is 1, 2, 4, ...; ``what`` names it in the message."""
    if not is_power_of_two(n):
        raise ValueError(
            f"{what} must be a power of two (1, 2, 4, ...), got {n}; a radix-2 FFT halves "
            f"the length at every stage: pad with zeros to {next_power_of_two(n)}"
        )


def require_rows(a, name, dtype=np.complex64):
    """``a`` as a (batch, n) device array of ``dtype``, batch and n >= 1.

    Raises TypeError (a host array, another dtype) or ValueError (not 2-D, empty,
    more than MAX_GRID_YZ rows: the kernels put rows on the grid's y axis)."""
    a = require_device_array(a, name, ndim=2, dtype=dtype)
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name} must have at least one row and one column, got {a.shape}")
    if a.shape[0] > MAX_GRID_YZ:
        raise ValueError(f"{name} has {a.shape[0]} rows; at most {MAX_GRID_YZ} (the grid's y)")
    return a


def require_same_shape(x, out, x_name="x", out_name="out"):
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(
            f"{out_name} must have {x_name}'s shape {tuple(x.shape)}, got {tuple(out.shape)}"
        )


def _extent(a):
    """[first byte, last byte + 1) of a device array's elements."""
    iface = getattr(a, "__cuda_array_interface__", None)  # a GPU array
    if iface is None:
        iface = a.__array_interface__  # the simulator's device arrays are NumPy underneath
    start = iface["data"][0]
    low = sum(min(0, (s - 1) * st) for s, st in zip(a.shape, a.strides))
    high = sum(max(0, (s - 1) * st) for s, st in zip(a.shape, a.strides))
    return start + low, start + high + a.dtype.itemsize


def require_separate(x, out, why):
    """Raise ValueError if ``x`` and ``out`` share memory; ``why`` says what would go wrong."""
    (a0, a1), (b0, b1) = _extent(x), _extent(out)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"out overlaps x: {why}; write into a separate array")


def twiddles_device(n):
    """The (max(n // 2, 1),) complex64 device table w[k] = exp(-2 pi i k / n), made
    on the host in float64 and rounded once (what a real FFT library precomputes)."""
    k = np.arange(max(n // 2, 1))
    return cuda.to_device(np.exp(-2j * np.pi * k / n).astype(np.complex64))


# ---------------------------------------------------------------- given: device functions
@cuda.jit(device=True)
def cplx(re, im):
    """re + i im as complex64 from two float32 (``complex(re, im)`` is complex128)."""
    return re + im * IMAG


@cuda.jit(device=True)
def sin_cos_octant(a):
    """(sin a, cos a) in float32 for a float32 a in [0, pi/4]: Taylor polynomials in
    Horner form, 2 to 3 float32 roundings. math.sin would do, but its large-argument
    path (Payne-Hanek reduction) puts float64 instructions into every kernel using it."""
    a2 = a * a
    s = a + a * a2 * (S3 + a2 * (S5 + a2 * (S7 + a2 * S9)))
    c = float32(1.0) + a2 * (C2 + a2 * (C4 + a2 * (C6 + a2 * (C8 + a2 * C10))))
    return s, c


# ---------------------------------------------------------------- 11.1 bit reversal
@cuda.jit(cache=True)
def bit_reverse_kernel(x, out, bits):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < x.shape[1]:
        r = 0
        v = i
        for _ in range(bits):
            r = (r << 1) | (v & 1)
            v >>= 1
        out[b, r] = x[b, i]


def bit_reverse_permute(x, out):
    """Exercise 11.1: out[b, rev(i)] = x[b, i] (spec: exercises.py)."""
    x, out = require_rows(x, "x"), require_rows(out, "out")
    require_same_shape(x, out)
    n = x.shape[1]
    require_power_of_two(n, "n = x.shape[1]")
    require_separate(x, out, "thread i writes out[rev(i)] while thread rev(i) reads x[rev(i)]")
    bit_reverse_kernel[(ceil_div(n, BLOCK), x.shape[0]), BLOCK](x, out, log2_exact(n))


# ---------------------------------------------------------------- 11.2 twiddle table
@cuda.jit(cache=True)
def twiddle_kernel(out, n):
    k = cuda.grid(1)
    if k < out.size:
        # theta = 2 pi k / n = (pi / 4) (j / n) with j = 8k, an integer: pi is j = 4n,
        # pi / 2 is 2n, pi / 4 is n. Fold in integers (exact), round once at the end.
        j = 8 * k
        flip = j > 2 * n
        if flip:  # theta in (pi/2, pi): cos theta = -cos(pi - theta), sin theta = sin(pi - theta)
            j = 4 * n - j
        swap = j > n
        if swap:  # theta in (pi/4, pi/2]: cos theta = sin(pi/2 - theta) and back
            j = 2 * n - j
        a = QUARTER_PI * (float32(j) / float32(n))  # j / n: exact (n a power of two)
        s, c = sin_cos_octant(a)
        if swap:
            s, c = c, s
        if flip:
            c = -c
        out[k] = cplx(c, -s)


def twiddle_table(n, out):
    """Exercise 11.2: out[k] = exp(-2 pi i k / n), k < n / 2 (spec: exercises.py)."""
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
@cuda.jit(cache=True)
def radix2_stage_kernel(x, out, twiddles, half):
    p = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x  # this thread's butterfly
    b = cuda.blockIdx.y
    n = x.shape[1]
    if p < n // 2:
        j = p % half  # its place in its group of 2 * half elements
        i0 = (p // half) * 2 * half + j
        i1 = i0 + half
        w = twiddles[j * (n // (2 * half))]  # exp(-2 pi i j / (2 half))
        t = w * x[b, i1]
        u = x[b, i0]
        out[b, i0] = u + t
        out[b, i1] = u - t


def radix2_stage(x, out, stage):
    """Exercise 11.3: stage ``stage`` of a radix-2 DIT FFT (spec: exercises.py)."""
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
@cuda.jit(cache=True)
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
            a = buf[src, t]
            b = buf[src, t + half] * twiddles[m * (half // ns)]  # exp(-2 pi i m / (2 ns))
            d = (t - m) * 2 + m  # (t // ns) * 2 ns + m
            buf[1 - src, d] = a + b
            buf[1 - src, d + ns] = a - b
        cuda.syncthreads()
        src = 1 - src
        ns *= 2
    for i in range(t, n, cuda.blockDim.x):
        out[row, i] = buf[src, i]


def fft_stockham_shared(x, out):
    """Exercise 11.4: out = fft(x) row by row, a block a row (spec: exercises.py)."""
    x, out = require_rows(x, "x"), require_rows(out, "out")
    require_same_shape(x, out)
    n = x.shape[1]
    require_power_of_two(n, "n = x.shape[1]")
    if n > MAX_SHARED_N:
        raise ValueError(f"n = {n} does not fit one block's shared buffers (n <= {MAX_SHARED_N})")
    fft_stockham_kernel[x.shape[0], max(n // 2, 1)](x, out, twiddles_device(n))


# ---------------------------------------------------------------- 11.5 channel sum per frequency
@cuda.jit(cache=True)
def complex_mac_kernel(X, W, out):
    f = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    o = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if f < X.shape[2]:
        acc = ZERO_C
        for c in range(X.shape[1]):
            acc += X[b, c, f] * W[o, c, f].conjugate()
        out[b, o, f] = acc


def complex_mac_channels(X, W, out):
    """Exercise 11.5: out[b, o, f] = sum_c X[b, c, f] conj(W[o, c, f]) (spec: exercises.py)."""
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
@cuda.jit(cache=True)
def pad_kernel(x, out):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < out.shape[1]:
        if i < x.shape[1]:
            out[b, i] = cplx(x[b, i], ZERO)
        else:
            out[b, i] = ZERO_C


@cuda.jit(cache=True)
def correlate_spectra_kernel(X, Wf, Z):
    f = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if f < X.shape[1]:
        # conj(X conj(Wf)): a forward FFT of the conjugate is n times the
        # conjugate of the inverse FFT, so 11.4 serves both ways
        Z[b, f] = X[b, f].conjugate() * Wf[0, f]


@cuda.jit(cache=True)
def crop_kernel(c, out, shift, scale):
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if i < out.shape[1]:
        n = c.shape[1]
        out[b, i] = c[b, (i - shift + n) % n].real * scale  # lag i - shift; negative lags wrap


def fft_conv1d(x, w, out):
    """Exercise 11.6: "same" cross-correlation of each row of x with w (spec: exercises.py)."""
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
