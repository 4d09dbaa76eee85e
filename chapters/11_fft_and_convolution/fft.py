"""Batched 1-D FFTs of complex64 rows, from the DFT's definition to most of cuFFT.

version 1  dft_one_thread_per_output: the DFT as a matrix-vector product, one thread an
           output, n complex multiply-adds each: O(n^2) a row
version 2  radix-2 Cooley-Tukey: a bit-reversal permutation, then one launch per stage
           (log2 n launches, each reading and writing every element in global memory)
version 3  stockham_radix2_smem: Stockham auto-sort, a whole row in one block's shared
           memory: no bit reversal, one read and one write of global memory, 2 barriers a stage
version 4  fft_stockham_radix8: 8 values a thread in registers, radix-8 butterflies (3 radix-2
           levels a shared-memory pass, so log2(n) / 3 passes), twiddles from a table laid out
           pass by pass (a warp's twiddle loads coalesced), several rows a block for small n
version 5  what a profiler points at in version 4: bank conflicts (an XOR swizzle of the
           shared-memory index), L1 wavefronts (8-byte loads and stores of complex64, not two
           4-byte ones), uncoalesced short rows (n < 256 staged through shared memory) and
           occupancy (a launch bound of 3 blocks an SM: 1536 threads, not 1024)
n > 4096   versions 4 and 5 as the four-step algorithm, from the same kernel factory:
           column FFTs with the twiddle multiply fused into their store, then row FFTs that
           store transposed (two launches, each one read and one write of the data)
baseline   cuFFT through torch.fft.fft on the same device memory, timed in the same run

Run:   python chapters/11_fft_and_convolution/fft.py [--sizes 256,4096,1048576]
           [--batch-mib 256] [--out DIR]

Every version is checked against numpy.fft in float64 by its relative L2 error, within
the bound that floating-point error analysis gives for it (:func:`tolerance`: log2(n)
levels of one rounded multiply and one add; :func:`dft_tolerance` for the O(n^2) sum),
on fresh random rows written into NaN-poisoned outputs, then by the identities a correct
FFT satisfies (the inverse against numpy.fft.ifft, ifft(fft(x)) = x, Parseval), then timed
with CUDA events. Rates count 16 bytes an element (one complex64 read, one written): an
FFT of n <= 4096 needs no other traffic, so the copy bandwidth is its speed of light.

The inverse is the conjugate trick: ifft(x) = conj(fft(conj(x))) / n, two sign flips and
an exact power-of-two scale, so every kernel has one table of forward twiddles
w[j] = exp(-2 pi i j / n), computed in float64 on the host and rounded once to complex64
(no angle is ever rounded in float32; an index (j * k) mod n is exact in integers).

Sources: J. W. Cooley, J. W. Tukey, "An algorithm for the machine calculation of complex
Fourier series", Math. Comp. 19 (1965); T. G. Stockham, "High-speed convolution and
correlation", AFIPS (1966), and C. Van Loan, "Computational Frameworks for the Fast
Fourier Transform", SIAM (1992), sec. 1.7 (the auto-sort framework); the pass formula of
versions 4-5 follows E. Bainville, "OpenCL Fast Fourier Transform" (2010); the four-step
algorithm is D. H. Bailey, "FFTs in external or hierarchical memory", J. Supercomputing
4 (1990); the error bound is N. J. Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., SIAM (2002), sec. 24.1, Theorem 24.2.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import EPS32, CheckError, check, poisoned, random_array, require_device_array
from common.harness import positive_float, positive_ints, run_script, save_results, script_parser
from common.runtime import ceil_div, is_simulator, jit, pick, torch_cuda_available
from common.timing import benchmark, device_peaks, format_table

import math
from dataclasses import dataclass
from functools import cache, partial

import numpy as np
from numba import complex64, cuda, float32, int32, int64, uint64

CHAPTER = "11_fft_and_convolution"

MAX_N = 1 << 20  # longest row fft() takes (four-step above MAX_BLOCK_N)
# Longest row one block transforms: versions 3-5 hold it in shared memory, and
# 4096 complex64 = 32 KiB stays under the 48 KiB a kernel may declare statically;
# 3 such blocks (version 5's launch bound) fit an H100 SM's 228 KiB.
MAX_BLOCK_N = 4096
RADIX = 8  # versions 4-5: values a thread holds and butterflies at once (2**3: 3 levels)
# Versions 4-5: complex values a block holds, so rows per block = BLOCK_ELEMS // n and
# every block has BLOCK_ELEMS / RADIX threads (512) whatever n: 64 bytes loaded a
# thread before its first barrier keep enough bytes in flight to saturate HBM. The
# simulator runs a Python thread per CUDA thread: 8 a block there.
BLOCK_ELEMS = pick(gpu=MAX_BLOCK_N, simulator=64)
THREADS = pick(gpu=256, simulator=16)  # versions 1-2: threads per block
THREADS_3 = pick(gpu=512, simulator=8)  # version 3: at most this many threads a row
V1_MAX_N = pick(gpu=MAX_BLOCK_N, simulator=64)  # main: version 1 is O(n^2) a row
# version 3: complex values a thread keeps between a pass's reads and its writes
V3_HELD = MAX_BLOCK_N // THREADS_3
# Version 5: blocks of 512 threads an SM must hold at once (a launch bound: ptxas caps
# registers at 65536 / (3 * 512) = 42). Swept over 2, 3 and 4 on a Hopper GPU at
# n = 256 ... 4096: 2 resident blocks leave HBM idle while both compute between their
# loads and stores; 3 was the fastest, 4 (32 registers) no faster. A GPU that fits
# fewer still runs it (the bound is capped by its threads per SM).
MIN_BLOCKS = 3
C8 = np.float32(math.sqrt(0.5))  # W8 = exp(-2 pi i / 8) = C8 (1 - i)
ZERO_C = np.complex64(0)
U32 = EPS32 / 2  # unit roundoff of float32: |fl(x) - x| <= U32 |x|
BEST = 5


# --------------------------------------------------------------------------
# Reference, error bounds, twiddles
# --------------------------------------------------------------------------


def fft_cpu(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """The float64 reference: numpy.fft over the last axis of ``x`` (any shape), in
    complex128. ``inverse`` gives numpy.fft.ifft (scaled by 1/n)."""
    x = np.asarray(x, dtype=np.complex128)
    return np.fft.ifft(x, axis=-1) if inverse else np.fft.fft(x, axis=-1)


def _eta() -> float:
    """Higham's eta = mu + gamma_4 (sqrt(2) + mu): the relative error one butterfly
    level adds. mu bounds a twiddle's error: each is exp(-2 pi i j / n) evaluated in
    float64 (a few ulps of 2**-53) and rounded once to complex64 (each part within
    U32 of itself, so |w_hat - w| <= U32 |w|)."""
    mu = U32 + 4 * 2.0**-53
    gamma4 = 4 * U32 / (1 - 4 * U32)
    return mu + gamma4 * (math.sqrt(2) + mu)


def tolerance(n: int) -> float:
    """The relative L2 error ||y_hat - y|| / ||y|| a correct float32 FFT of length n meets.

    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 24.1,
    Theorem 24.2: a radix-2 FFT in floating point (unit roundoff u, twiddles computed
    with error at most mu) has ||y_hat - y|| / ||y|| <= L eta / (1 - L eta), with
    L = log2 n levels and eta = mu + gamma_4 (sqrt(2) + mu), gamma_4 = 4u / (1 - 4u).
    Each level of every version here is one rounded complex multiply (or none: by 1 or
    -i, exact) and one complex add or subtract, as in the theorem's model: a radix-8
    butterfly is 3 such levels, and the four-step's twiddle multiply takes the place of
    the multiply its row FFT's first level does not need. So the bound holds for them
    all, and it grows like log2(n) * eps32 (about 8e-6 at n = 2**20); a wrong twiddle,
    index or missing stage errs by O(1). A batch of rows and a 2-D transform (log2 h +
    log2 w levels: pass n = h * w) obey the same bound. n = 1 is a copy: 0.

    Raises ValueError unless n is a power of two >= 1.
    """
    _require_power_of_two(n, "n")
    levels = int(n).bit_length() - 1
    le = levels * _eta()
    return le / (1 - le)


def dft_tolerance(n: int) -> float:
    """The relative L2 error bound of version 1, which sums n products per output.

    Each product is one complex multiply (error <= sqrt(2) gamma_2 |x||w| + mu |x|,
    Higham sec. 3.6) and the recursive sum of n terms adds gamma_(n-1) per part (sec.
    4.2), so |X_hat[k] - X[k]| <= c sum_j |x[j]| <= c sqrt(n) ||x||, with
    c = sqrt(2) gamma_(n+1) + mu; over n outputs, and with ||X|| = sqrt(n) ||x||, the
    relative error is at most c sqrt(n). Worst case: linear in n, not in log2 n. Raises
    ValueError unless n is a power of two >= 1.
    """
    _require_power_of_two(n, "n")
    gamma = (n + 1) * U32 / (1 - (n + 1) * U32)
    return math.sqrt(n) * (math.sqrt(2) * gamma + U32 + 4 * 2.0**-53)


def twiddles(n: int) -> np.ndarray:
    """w[j] = exp(-2 pi i j / n), j < n: (n,) complex64, computed in float64 and
    rounded once. The only place the forward transform's sign lives (the -i and
    C8 (1 - i) of the radix-8 butterfly follow from it)."""
    return np.exp(-2j * np.pi * np.arange(n) / n).astype(np.complex64)


@cache
def twiddle_table(n: int):
    """:func:`twiddles` of n on the device, made once per n (n = 2**20: 8 MiB)."""
    return cuda.to_device(twiddles(n))


def pass_twiddles(n: int) -> np.ndarray:
    """Versions 4-5's twiddles, pass by pass: entry r p + k - 1 is w_(p R)^(r k) =
    twiddles(n)[r k n / (p R)] for the pass of radix R after sub-transforms of length
    p (1 <= r < R, k < p). Butterfly k of a pass reads entries k - 1 + r p, so a
    warp's 32 consecutive k read 32 consecutive entries per r: coalesced, where
    twiddles(n)[r k n / (p R)] would be 32 loads up to 7 * 64 bytes apart. The passes
    tile [0, n - 1) exactly: (max(n - 1, 1),) complex64, the same values as
    :func:`twiddles` (so the same error bound)."""
    w = twiddles(n)
    out = np.ones(max(n - 1, 1), np.complex64)
    p = 1
    for radix in stockham_plan(n):
        r, k = np.meshgrid(np.arange(1, radix), np.arange(p), indexing="ij")
        out[r * p + k - 1] = w[r * k * (n // (p * radix))]
        p *= radix
    return out


@cache
def pass_twiddle_table(n: int):
    """:func:`pass_twiddles` of n on the device, made once per n."""
    return cuda.to_device(pass_twiddles(n))


# --------------------------------------------------------------------------
# Version 1: the definition
# --------------------------------------------------------------------------


# v1: X[k] = sum_j x[j] w[(j k) mod n]: n loads of x and of the table, n complex FMAs an
# output; a warp reads the same x[j] (broadcast) and 32 scattered table entries (cached)
@cuda.jit(cache=True)
def dft_one_thread_per_output(x, out, tw, sign, scale):
    idx = cuda.grid(1)
    n = x.shape[1]
    if idx < x.size:
        b = idx // n
        k = idx % n
        acc = ZERO_C
        for j in range(n):
            v = x[b, j]
            if sign < 0:  # the conjugate trick: ifft(x) = conj(fft(conj(x))) / n
                v = v.conjugate()
            acc += v * tw[(j * k) & (n - 1)]
        if sign < 0:
            acc = acc.conjugate()
        out[b, k] = acc * scale


# --------------------------------------------------------------------------
# Version 2: radix-2 Cooley-Tukey, one launch per stage
# --------------------------------------------------------------------------


# v2a: out[b, rev(j)] = x[b, j]: after it, each stage combines neighbours 2 * half apart
# in place; reads coalesced, writes scattered over the row
@cuda.jit(cache=True)
def bit_reverse_permute(x, out, log2n, sign):
    idx = cuda.grid(1)
    n = x.shape[1]
    if idx < x.size:
        b = idx // n
        j = idx % n
        r = 0
        v = j
        for _ in range(log2n):
            r = (r << 1) | (v & 1)
            v >>= 1
        value = x[b, j]
        out[b, r] = value.conjugate() if sign < 0 else value


# v2b: one butterfly a thread, (a, c) -> (a + w c, a - w c), halves `half` apart: every
# stage reads and writes the whole batch in global memory (log2 n round trips)
@cuda.jit(cache=True)
def radix2_stage(out, tw, half, sign, scale):
    idx = cuda.grid(1)
    n = out.shape[1]
    pairs = n // 2
    if idx < out.shape[0] * pairs:
        b = idx // pairs
        q = idx % pairs
        k = q & (half - 1)  # position in its group of 2 * half
        i = (q - k) * 2 + k
        c = out[b, i + half] * tw[k * (pairs // half)]  # w = exp(-2 pi i k / (2 half))
        a = out[b, i]
        y0 = a + c
        y1 = a - c
        if sign < 0:
            y0 = y0.conjugate()
            y1 = y1.conjugate()
        out[b, i] = y0 * scale
        out[b, i + half] = y1 * scale


# --------------------------------------------------------------------------
# Version 3: Stockham radix-2, a row in shared memory
# --------------------------------------------------------------------------


# v3: Stockham: pass p reads s[q] and s[q + n/2] and writes outputs j and j + p, with
# j = 2 (q - q mod p) + q mod p: the output order is natural, no bit reversal. One
# global read and write an element; per pass 2 shared reads and writes and 2 barriers
# (one buffer: 2 * 32 KiB would not fit), values kept in local memory in between
@cuda.jit(cache=True)
def stockham_radix2_smem(x, out, tw, sign, scale):
    s = cuda.shared.array(MAX_BLOCK_N, complex64)
    held = cuda.local.array(V3_HELD, complex64)
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    half = n // 2
    for e in range(t, n, threads):
        v = x[row, e]
        s[e] = v.conjugate() if sign < 0 else v
    cuda.syncthreads()
    p = 1
    while p < n:
        h = 0
        for q in range(t, half, threads):
            c = s[q + half] * tw[(q & (p - 1)) * (half // p)]  # exp(-2 pi i k / (2 p))
            a = s[q]
            held[h] = a + c
            held[h + 1] = a - c
            h += 2
        cuda.syncthreads()  # every input of this pass read before any is overwritten
        h = 0
        for q in range(t, half, threads):
            k = q & (p - 1)
            j = (q - k) * 2 + k
            s[j] = held[h]
            s[j + p] = held[h + 1]
            h += 2
        cuda.syncthreads()  # every output written before the next pass reads it
        p *= 2
    for e in range(t, n, threads):
        v = s[e]
        if sign < 0:
            v = v.conjugate()
        out[row, e] = v * scale


# --------------------------------------------------------------------------
# Versions 4-5: radix-8 Stockham in registers, one kernel a length
# --------------------------------------------------------------------------


def stockham_plan(n: int) -> tuple[int, ...]:
    """The radices of versions 4-5's passes for a row of n (a power of two): radix 8
    while it divides, the 2 or 4 left over last (so every global load and store is a
    radix-8 or unit-stride pattern, and the swizzle below removes every bank
    conflict). n <= 8: one pass of radix n. E.g. 4096: (8, 8, 8, 8); 2048: (8, 8, 8, 4)."""
    if n <= RADIX:
        return (n,)
    passes = []
    while n % RADIX == 0:
        passes.append(RADIX)
        n //= RADIX
    return tuple(passes) + ((n,) if n > 1 else ())


@jit(device=True, forceinline=True)
def reverse_bits(r, bits):
    out = 0
    for _ in range(bits):
        out = (out << 1) | (r & 1)
        r >>= 1
    return out


@jit(device=True, forceinline=True)
def dft_in_registers(vr, vi, base, step, radix):
    """DFT of the radix (1, 2, 4 or 8) values v[base + r * step] in place: log2(radix)
    radix-2 decimation-in-frequency levels, natural order in, bit-reversed order out.
    Their twiddles W8^t are 1, C8 (1 - i), -i, -C8 (1 + i): a multiply by -i is a swap
    (exact), by W8 or W8^3 two adds and two multiplies. Called with constants, so the
    loops unroll and vr / vi stay in registers."""
    for level in range(3):
        half = radix >> (level + 1)
        if half > 0:
            for q in range(radix // 2):
                j = q % half
                a = base + ((q - j) * 2 + j) * step
                b = a + half * step
                ar = vr[a]
                ai = vi[a]
                br = vr[b]
                bi = vi[b]
                vr[a] = ar + br
                vi[a] = ai + bi
                dr = ar - br
                di = ai - bi
                t = j * (4 // half)  # the level's twiddle is W8^t = exp(-2 pi i t / 8)
                if t == 0:
                    vr[b] = dr
                    vi[b] = di
                elif t == 1:
                    vr[b] = C8 * (dr + di)
                    vi[b] = C8 * (di - dr)
                elif t == 2:
                    vr[b] = di
                    vi[b] = -dr
                else:
                    vr[b] = C8 * (di - dr)
                    vi[b] = -C8 * (dr + di)


@jit(device=True, forceinline=True)
def twiddle_in_registers(vr, vi, tw, load, k, p, base, step, radix):
    """v[base + r * step] *= tw[k - 1 + r * p] for r = 1 .. radix - 1 (r = 0: times 1):
    the twiddles of butterfly k of a pass after sub-transforms of p (:func:`pass_twiddles`),
    read with ``load`` (:func:`load_complex` or :func:`load_complex_wide`)."""
    for r in range(1, radix):
        wr, wi = load(tw, k - 1 + r * p)
        e = base + r * step
        a = vr[e]
        b = vi[e]
        vr[e] = a * wr - b * wi
        vi[e] = a * wi + b * wr


@dataclass(frozen=True)
class RowLayout:
    """Where logical row ``r``'s element ``e`` lies in a flat complex64 array:
    ``(r // g) * outer + (r % g) * inner + e * step``.

    ``rows_fast``: consecutive threads take consecutive rows (for layouts whose
    rows, not elements, are adjacent in memory: the columns of a matrix), so a
    warp's loads or stores stay coalesced.
    """

    g: int
    outer: int
    inner: int
    step: int
    rows_fast: bool = False

    @staticmethod
    def rows(n: int) -> "RowLayout":
        """Contiguous rows of n: row r at r * n."""
        return RowLayout(1, n, 0, 1)

    @staticmethod
    def columns(h: int, w: int) -> "RowLayout":
        """The w columns of each (h, w) matrix of a batch, as rows of h: row
        r = b * w + c at b * h * w + c, elements w apart."""
        return RowLayout(w, h * w, 1, w, rows_fast=True)


if is_simulator():  # kernels run as Python there: NumPy views do the bit moves

    def int_as_float(i):
        return np.array(i, np.int32).view(np.float32)[()]

    def float_as_int(f):
        return np.array(f, np.float32).view(np.int32)[()]

else:  # one register move each (PTX mov.b32)
    from numba.cuda.libdevice import float_as_int, int_as_float


@jit(device=True, forceinline=True)
def load_complex(a, k):
    """(re, im) of complex element k of ``a``, a float32 view of complex64 data: two
    4-byte loads (what Numba emits for a complex64 element too)."""
    k = uint64(k)
    return a[2 * k], a[2 * k + 1]


@jit(device=True, forceinline=True)
def store_complex(a, k, re, im):
    k = uint64(k)
    a[2 * k] = re
    a[2 * k + 1] = im


@jit(device=True, forceinline=True)
def load_complex_wide(a, k):
    """(re, im) of complex element k of ``a``, an int64 view of complex64 data: one
    8-byte load (a warp: 256 contiguous bytes in 2 wavefronts, where two 4-byte loads
    8 bytes apart take 2 each), split into two float32 by register moves."""
    bits = a[uint64(k)]
    return int_as_float(int32(bits)), int_as_float(int32(bits >> 32))


@jit(device=True, forceinline=True)
def store_complex_wide(a, k, re, im):
    low = int64(float_as_int(re)) & 0xFFFFFFFF
    a[uint64(k)] = (int64(float_as_int(im)) << 32) | low


def rows_per_block(n: int) -> int:
    """Versions 4-5: rows a block transforms, so a block holds BLOCK_ELEMS values in
    BLOCK_ELEMS / RADIX threads (n < 8: one thread a row, BLOCK_ELEMS / RADIX rows)."""
    return max(1, min(BLOCK_ELEMS // n, BLOCK_ELEMS // RADIX))


def threads_per_block(n: int) -> int:
    """Versions 4-5: threads a block, one per RADIX values (one a row for n < 8)."""
    return rows_per_block(n) * (n // min(RADIX, n))


@cache
def make_fft_stockham_radix8(
    n: int,
    tuned: bool,
    load: RowLayout | None = None,
    store: RowLayout | None = None,
    twiddle_out: bool = False,
    min_blocks: int | None = None,
):
    """Versions 4 (``tuned=False``) and 5 (``tuned=True``): a kernel for rows of n.

    ``kernel[ceil_div(nrows, rows_per_block(n)), threads_per_block(n)](x, out, tw,
    tw_out, nrows, sign_in, sign_out, scale)``: x and out are flat views of complex64
    data (float32 views for version 4, int64 views for 5), ``load``/``store`` say where
    the rows lie (default: contiguous rows of n); tw = pass_twiddle_table(n) (viewed
    the same way); the input is conjugated when sign_in < 0, the output conjugated
    when sign_out < 0 and multiplied by scale. ``twiddle_out``: output element e of
    row r is multiplied by tw_out[(r % store.g) * e] (the four-step's twiddles).
    ``min_blocks``: blocks an SM must hold at once (launch bounds: caps registers).

    A thread holds E = min(8, n) values of one row in registers (T = n / E threads a
    row) and does the passes of :func:`stockham_plan`. Pass s (radix R, sub-transform
    length p so far) is, for butterfly i (Bainville 2010): inputs i + r n / R, times
    the twiddles w^(r (i mod p) n / (p R)), an R-point DFT in registers, outputs
    j + r p with j = R (i - i mod p) + i mod p. The first pass reads global memory
    and the last writes it, coalesced when T >= 32; the others go through shared
    memory, 2 barriers each: 3 barrier pairs for n = 4096 (version 3: 12).

    Version 5 adds what a profiler points at in version 4: (1) bank conflicts: the
    writes of the early passes are 8 and 64 values apart, 8- and 2-way conflicts; an
    XOR swizzle of the index (bits 3-7 into bits 0-4) spreads every pattern of every
    pass over the 32 banks, with no padding; (2) L1 wavefronts: every global access
    (data, twiddles) is one 8-byte load or store instead of two 4-byte ones, which
    halves the wavefronts of a warp's access; (3) rows shorter than a warp (T < 32,
    n < 256): a warp would touch 32 / T rows a load, so the block's rows, one
    contiguous run, are read and written through shared memory, 32 consecutive
    values a warp.
    """
    load = load or RowLayout.rows(n)
    store = store or RowLayout.rows(n)
    passes = stockham_plan(n)
    E = min(RADIX, n)  # values a thread holds
    T = n // E  # threads a row
    RB = rows_per_block(n)
    THREADS = RB * T
    MID = len(passes) - 1  # radix-8 passes that write shared memory
    LAST = passes[-1]
    LOG_LAST = LAST.bit_length() - 1
    GROUPS = E // LAST  # radix-LAST butterflies a thread does in the last pass
    P_LAST = n // LAST  # sub-transform length before the last pass
    plain = load == RowLayout.rows(n) and store == RowLayout.rows(n)
    STAGED = tuned and plain and 1 < n and T < 32
    # shared array sizes must be plain ints (compile-time constants)
    # (whole runs of 32 floats: the swizzle permutes each aligned run of 32)
    SMEM = ceil_div(RB * n, 32) * 32 if MID or STAGED else 32
    IN_G, IN_OUTER, IN_INNER, IN_STEP = load.g, load.outer, load.inner, load.step
    OUT_G, OUT_OUTER, OUT_INNER, OUT_STEP = store.g, store.outer, store.inner, store.step
    IN_ROWS_FAST, OUT_ROWS_FAST = load.rows_fast, store.rows_fast
    SWIZZLE, TWIDDLE_OUT = tuned, twiddle_out
    LOAD, STORE = (
        (load_complex_wide, store_complex_wide) if tuned else (load_complex, store_complex)
    )
    bounds = (THREADS, min_blocks) if min_blocks else None

    @jit(device=True, forceinline=True)
    def smem_index(c):
        if SWIZZLE:  # bits 3-7 into bits 0-4: a stride of 8 or 64 spans all 32 banks
            c ^= (c >> 3) & 31
        return uint64(c)

    @jit(launch_bounds=bounds, cache=True)
    def fft_stockham_radix8(x, out, tw, tw_out, nrows, sign_in, sign_out, scale):
        # Real and imaginary parts in separate arrays: a warp reading 32 consecutive
        # values reads 32 consecutive 4-byte words, one per bank (complex64 would be
        # read as two 4-byte loads 8 bytes apart: 2-way conflicts each).
        s_re = cuda.shared.array(SMEM, float32)
        s_im = cuda.shared.array(SMEM, float32)
        vr = cuda.local.array(E, float32)  # constant indices after unrolling: registers
        vi = cuda.local.array(E, float32)
        tid = cuda.threadIdx.x & 1023  # `&`: provably >= 0, no negative-index code
        block_row = cuda.blockIdx.x * RB
        first = block_row * n  # STAGED: the block's rows are values [first, first + RB n)
        size = nrows * n

        if STAGED:  # consecutive threads on consecutive values, into shared memory
            for e in range(E):
                c = tid + e * THREADS
                re = float32(0)
                im = float32(0)
                if first + c < size:
                    re, im = LOAD(x, first + c)
                s_re[smem_index(c)] = re
                s_im[smem_index(c)] = sign_in * im
            cuda.syncthreads()  # the block's rows all staged before any thread reads

        # the first pass's inputs: x[row, i + e T], e < E
        if IN_ROWS_FAST:
            rl = tid % RB
            i = tid // RB
        else:
            rl = tid // T
            i = tid % T
        row = block_row + rl
        if STAGED:
            for e in range(E):
                c = smem_index(rl * n + i + e * T)
                vr[e] = s_re[c]
                vi[e] = s_im[c]
        elif row < nrows:  # straight from global memory
            base = (row // IN_G) * IN_OUTER + (row % IN_G) * IN_INNER
            for e in range(E):
                re, im = LOAD(x, base + (i + e * T) * IN_STEP)
                vr[e] = re
                vi[e] = sign_in * im
        else:  # a row past the batch: its threads still reach every barrier
            for e in range(E):
                vr[e] = float32(0)
                vi[e] = float32(0)

        p = 1
        for s in range(MID):
            if s > 0:  # (the first pass's twiddles are all 1)
                twiddle_in_registers(vr, vi, tw, LOAD, i & (p - 1), p, 0, 1, RADIX)
            dft_in_registers(vr, vi, 0, 1, RADIX)
            if s > 0 or STAGED:
                cuda.syncthreads()  # every thread has read this pass's inputs
            k = i & (p - 1)
            j = (i - k) * RADIX + k
            for r in range(RADIX):
                c = smem_index(rl * n + j + r * p)
                src = reverse_bits(r, 3)  # the DIF butterfly leaves output r there
                s_re[c] = vr[src]
                s_im[c] = vi[src]
            cuda.syncthreads()  # every output written before anyone reads
            p *= RADIX
            if s == MID - 1 and OUT_ROWS_FAST:  # the last pass stores: map for its layout
                rl = tid % RB
                i = tid // RB
            else:
                rl = tid // T
                i = tid % T
            for e in range(E):  # next inputs i + e T: unit stride across the warp
                c = smem_index(rl * n + i + e * T)
                vr[e] = s_re[c]
                vi[e] = s_im[c]

        # last pass (radix LAST): GROUPS butterflies a thread, butterfly i + m T has its
        # inputs at registers m + r GROUPS; its output r is element i + m T + r P_LAST
        for m in range(GROUPS):
            if P_LAST > 1:
                twiddle_in_registers(vr, vi, tw, LOAD, i + m * T, P_LAST, m, GROUPS, LAST)
            dft_in_registers(vr, vi, m, GROUPS, LAST)
        row = block_row + rl
        if STAGED:  # back through shared memory, then 32 consecutive values a warp
            # (no barrier first: a thread's outputs i + m T + r P_LAST are the very
            # places i + e T it read its inputs from, since T divides P_LAST)
            for m in range(GROUPS):
                for r in range(LAST):
                    src = m + reverse_bits(r, LOG_LAST) * GROUPS
                    c = smem_index(rl * n + i + m * T + r * P_LAST)
                    s_re[c] = vr[src]
                    s_im[c] = vi[src]
            cuda.syncthreads()  # every output staged before the coalesced stores
            for e in range(E):
                c = tid + e * THREADS
                if first + c < size:
                    sc = smem_index(c)
                    STORE(out, first + c, s_re[sc] * scale, sign_out * s_im[sc] * scale)
        elif row < nrows:
            base = (row // OUT_G) * OUT_OUTER + (row % OUT_G) * OUT_INNER
            for m in range(GROUPS):
                for r in range(LAST):
                    e = i + m * T + r * P_LAST
                    src = m + reverse_bits(r, LOG_LAST) * GROUPS
                    yr = vr[src]
                    yi = vi[src]
                    if TWIDDLE_OUT:
                        wr, wi = LOAD(tw_out, (row % OUT_G) * e)
                        yr, yi = yr * wr - yi * wi, yr * wi + yi * wr
                    STORE(out, base + e * OUT_STEP, yr * scale, sign_out * yi * scale)

    return fft_stockham_radix8


def four_step_split(n: int) -> tuple[int, int]:
    """(n1, n2) with n1 * n2 = n, n1 <= n2 <= 2 n1: column FFTs of n1, row FFTs of n2.

    Raises ValueError if n2 > MAX_BLOCK_N (two levels of one block each: n <= 2**24).
    """
    n1 = 1 << ((int(n).bit_length() - 1) // 2)
    n2 = n // n1
    if n2 > MAX_BLOCK_N:
        raise ValueError(f"n = {n} needs row FFTs of {n2} > MAX_BLOCK_N = {MAX_BLOCK_N}")
    return n1, n2


_SCRATCH = {}


def _scratch(size: int):
    """A flat complex64 device buffer of ``size`` kept between calls (the four-step's
    intermediate), so a timed call pays no cudaMalloc."""
    if size not in _SCRATCH:
        _SCRATCH[size] = cuda.device_array(size, np.complex64)
    return _SCRATCH[size]


@cache
def _max_threads_per_sm():
    return cuda.get_current_device().MAX_THREADS_PER_MULTIPROCESSOR


@cache
def _twiddle_views(n, n_out, view):
    """(pass_twiddle_table(n), twiddle_table(n_out) or the first) viewed as ``view``,
    made once: a timed call should spend its host time on the launch alone."""
    tw = pass_twiddle_table(n).view(view)
    return tw, twiddle_table(n_out).view(view) if n_out else tw


def _launch_radix8(n, tuned, x_flat, out_flat, nrows, sign_in, sign_out, scale, **layout):
    """Launch version 4 or 5 (``tuned``) for ``nrows`` rows of n in flat complex64
    arrays laid out as ``layout`` says (keywords of :func:`make_fft_stockham_radix8`)."""
    min_blocks = None
    if tuned and not is_simulator():  # no more blocks than this GPU's SM holds (T4: 2)
        min_blocks = max(1, min(MIN_BLOCKS, _max_threads_per_sm() // threads_per_block(n)))
    kernel = make_fft_stockham_radix8(n, tuned, min_blocks=min_blocks, **layout)
    view = np.int64 if tuned else np.float32  # version 5: 8-byte accesses
    n_out = layout["load"].outer if layout.get("twiddle_out") else 0
    tw, tw_out = _twiddle_views(n, n_out, view)
    grid = ceil_div(nrows, rows_per_block(n))
    kernel[grid, threads_per_block(n)](
        x_flat.view(view), out_flat.view(view), tw, tw_out, nrows, sign_in, sign_out, scale
    )


def _fft_radix8(tuned, x, out, inverse):
    """Versions 4-5 on checked (batch, n) arrays: one launch for n <= MAX_BLOCK_N, else
    the four-step (Bailey 1990) on each row seen as an (n1, n2) matrix A[a, c] =
    x[n2 a + c]: (1) FFT each column (length n1) and multiply element (k1, c) by
    w_n^(c k1), into a scratch array; (2) FFT each row (length n2) and store element
    (k1, k2) at output k1 + n1 k2 (a transposed store). Both launches read and write
    every element once; the column loads and the transposed stores move
    rows_per_block adjacent values at a time."""
    batch, n = x.shape
    sign, scale = _signs(n, inverse)
    one = np.float32(1)
    if n <= MAX_BLOCK_N:
        _launch_radix8(n, tuned, x.reshape(-1), out.reshape(-1), batch, sign, sign, scale)
        return
    n1, n2 = four_step_split(n)
    scratch = _scratch(batch * n)
    cols = RowLayout(n2, n, 1, n2, rows_fast=True)  # column c of row b: b n + c, step n2
    _launch_radix8(
        n1,
        tuned,
        x.reshape(-1),
        scratch,
        batch * n2,
        sign,
        one,
        one,
        load=cols,
        store=cols,
        twiddle_out=True,
    )
    transposed = RowLayout(n1, n, 1, n1, rows_fast=True)  # (b, k1) row, k2-th at b n + k1 + n1 k2
    _launch_radix8(
        n2,
        tuned,
        scratch,
        out.reshape(-1),
        batch * n1,
        one,
        sign,
        scale,
        load=RowLayout.rows(n2),
        store=transposed,
    )


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------


def _require_power_of_two(n, what):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two (1, 2, 4, ...), got {n!r}")


def _data_range(a):
    """[first byte, one past the last byte) of a C-contiguous device array."""
    iface = getattr(a, "__cuda_array_interface__", None)
    if iface is None:  # the simulator's device arrays are NumPy arrays underneath
        iface = a.__array_interface__
    start = iface["data"][0]
    return start, start + a.size * a.dtype.itemsize


def _check_arrays(x, out, ndim):
    """x, out as C-contiguous complex64 device arrays of one shape with ``ndim`` dims."""
    x = require_device_array(x, "x", ndim=ndim, dtype=np.complex64)
    out = require_device_array(out, "out", ndim=ndim, dtype=np.complex64)
    for name, a in (("x", x), ("out", out)):
        if not a.is_c_contiguous():
            raise ValueError(
                f"{name} must be C-contiguous (a row's elements adjacent): pass "
                f"cuda.to_device(np.ascontiguousarray({name}))"
            )
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if min(x.shape) < 1:
        raise ValueError(f"x must have at least one element along every axis, got {x.shape}")
    (x0, x1), (o0, o1) = _data_range(x), _data_range(out)
    if x0 < o1 and o0 < x1:
        raise ValueError("out overlaps x: the transform is not in place; pass a separate out")
    return x, out


def _require_length(n, what, largest):
    if n < 1 or n & (n - 1) or n > largest:
        raise ValueError(
            f"{what} = {n} is not supported: the length must be a power of two from 1 to "
            f"{largest} (2**{largest.bit_length() - 1}); pad with zeros to "
            f"{1 << max(n - 1, 0).bit_length()}, or use numpy.fft / torch.fft for other "
            "lengths"
        )


def _signs(n, inverse):
    """(sign, scale) for the kernels: conjugate in and out, and 1/n, for the inverse."""
    if inverse:
        return np.float32(-1), np.float32(1.0 / n)  # 1/n: a power of two, exact
    return np.float32(1), np.float32(1)


def _fft_dft(x, out, inverse):
    batch, n = x.shape
    sign, scale = _signs(n, inverse)
    grid = ceil_div(batch * n, THREADS)
    dft_one_thread_per_output[grid, THREADS](x, out, twiddle_table(n), sign, scale)


def _fft_radix2(x, out, inverse):
    batch, n = x.shape
    sign, scale = _signs(n, inverse)
    log2n = n.bit_length() - 1
    # n = 1 has no stage to undo the conjugation: then none (conj(conj(x)) = x)
    bit_reverse_permute[ceil_div(batch * n, THREADS), THREADS](
        x, out, log2n, sign if log2n else np.float32(1)
    )
    tw = twiddle_table(n)
    one = np.float32(1)
    grid = ceil_div(batch * max(n // 2, 1), THREADS)
    for stage in range(log2n):
        last = stage == log2n - 1
        radix2_stage[grid, THREADS](
            out, tw, 1 << stage, sign if last else one, scale if last else one
        )


def _fft_stockham_radix2(x, out, inverse):
    batch, n = x.shape
    if n > MAX_BLOCK_N:
        raise ValueError(
            f"version 3 holds a row in one block's shared memory: n <= {MAX_BLOCK_N}, "
            f"got {n}; versions 4 and 5 take n up to {MAX_N} (four-step)"
        )
    sign, scale = _signs(n, inverse)
    threads = min(max(n // 2, 1), THREADS_3)
    stockham_radix2_smem[batch, threads](x, out, twiddle_table(n), sign, scale)


VERSIONS = {
    1: ("DFT, one thread an output", _fft_dft),
    2: ("radix-2, a launch a stage", _fft_radix2),
    3: ("Stockham radix-2 in shared memory", _fft_stockham_radix2),
    4: ("Stockham radix-8 in registers", partial(_fft_radix8, False)),
    5: ("radix-8, swizzle, 8-byte accesses", partial(_fft_radix8, True)),
}


def fft(x, out, inverse: bool = False, version: int = BEST) -> None:
    """out = FFT of each row of x (numpy.fft.fft), or its inverse (numpy.fft.ifft,
    scaled by 1/n), with ``version`` (1-5, see the module docstring).

    x, out: (batch, n) complex64 C-contiguous device arrays, separate, batch >= 1 and n
    a power of two from 1 to 2**20 (version 3: n <= 4096); n > 4096 runs the four-step
    (versions 4-5) or every stage in global memory (1-2). Accuracy: within
    :func:`tolerance` (n) of the exact transform (version 1: :func:`dft_tolerance`).

    Raises (before any launch): TypeError for a host array, not a device array, or a
    dtype other than complex64; ValueError for arrays not 2-D, not C-contiguous, of
    different shapes or overlapping, for n not a supported power of two, or an unknown
    version.
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {sorted(VERSIONS)}, got {version!r}")
    x, out = _check_arrays(x, out, ndim=2)
    _require_length(x.shape[1], "n = x.shape[1]", MAX_N)
    VERSIONS[version][1](x, out, inverse)


def fft2(x, out, inverse: bool = False) -> None:
    """out = 2-D FFT over the last two axes of x (numpy.fft.fft2), or its inverse
    (numpy.fft.ifft2, scaled by 1/(h w)), with version 5's kernels.

    x, out: (batch, h, w) complex64 C-contiguous device arrays, separate; h and w
    powers of two, w <= 2**20, h <= 4096. Row FFTs of x into out, then the column FFTs
    of out in place: a block reads rows_per_block(h) adjacent columns whole (strided
    reads, rows_fast mapping, rows_per_block * 8 contiguous bytes a row) and writes them
    back where they were, so no block touches another's columns. A transpose would
    read and write everything twice more (there and back) for the same effect.

    Raises (before any launch): TypeError / ValueError as :func:`fft`; ValueError for
    h > 4096 (a column must fit one block).
    """
    x, out = _check_arrays(x, out, ndim=3)
    batch, h, w = x.shape
    _require_length(w, "w = x.shape[2]", MAX_N)
    _require_length(h, "h = x.shape[1]", MAX_BLOCK_N)
    _fft_radix8(True, x.reshape(batch * h, w), out.reshape(batch * h, w), inverse)
    sign, scale = _signs(h, inverse)
    cols = RowLayout.columns(h, w)
    flat = out.reshape(-1)
    _launch_radix8(h, True, flat, flat, batch * w, sign, sign, scale, load=cols, store=cols)


# --------------------------------------------------------------------------
# main: check every version, then time it next to cuFFT
# --------------------------------------------------------------------------

CUFFT = "cuFFT (torch.fft.fft)"


class Cufft:
    """A launcher ``(x, out)`` running torch.fft.fft (cuFFT) on Numba device arrays
    without a copy (torch.as_tensor reads ``__cuda_array_interface__``); each
    array's torch view is made on its first call and kept, so a timed call pays
    for the FFT, not for wrapping."""

    def __init__(self):
        import torch

        self._torch = torch
        self._views = {}  # id(array) -> (array, its torch view)

    @staticmethod
    def available() -> bool:
        """True on a GPU with a CUDA build of torch."""
        return torch_cuda_available()

    def _view(self, a):
        if id(a) not in self._views:
            self._views[id(a)] = (a, self._torch.as_tensor(a, device="cuda"))
        return self._views[id(a)][1]

    def __call__(self, x, out):
        """out = fft(x), for the check (a transform, then a copy)."""
        self._view(out).copy_(self._torch.fft.fft(self._view(x)))

    def forward(self, x):
        """The transform alone, as timed: into a new tensor from torch's caching
        allocator (out= would add a copy: cuFFT writes a temporary, then out)."""
        return self._torch.fft.fft(self._view(x))


def as_pairs(a):
    """A complex array (host or device) on the host as real numbers, (re, im) pairs
    along the last axis: common.checking measures real arrays, and the relative L2
    error of the pairs is that of the complex values."""
    host = a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)
    real = np.float32 if host.dtype == np.complex64 else np.float64
    return np.ascontiguousarray(host).view(real)


def random_rows(batch, n, rng):
    """(host, device): fresh random complex64 rows (standard normal parts), never zeros."""
    host = (
        random_array((batch, n), np.float32, rng) + 1j * random_array((batch, n), np.float32, rng)
    ).astype(np.complex64)
    return host, cuda.to_device(host)


def check_identities(n, batch, rng, version=BEST):
    """Check ``version`` at (batch, n) beyond the forward transform: the inverse
    against numpy.fft.ifft, ifft(fft(x)) = x, and Parseval (||X||^2 = n ||x||^2),
    each within the bound that tolerance(n) implies (2 t + t^2 for two transforms).
    Returns the largest relative error; raises CheckError."""
    tol = dft_tolerance(n) if version == 1 else tolerance(n)
    host, x = random_rows(batch, n, rng)
    spectrum = poisoned((batch, n), np.complex64)
    back = poisoned((batch, n), np.complex64)
    inv = poisoned((batch, n), np.complex64)
    fft(x, spectrum, version=version)
    fft(x, inv, inverse=True, version=version)
    fft(spectrum, back, inverse=True, version=version)
    errors = [
        check(
            as_pairs(inv),
            as_pairs(fft_cpu(host, inverse=True)),
            tol=tol,
            name=f"v{version} ifft n={n}",
        ),
        check(
            as_pairs(back),
            as_pairs(host),
            tol=2 * tol + tol * tol,
            name=f"v{version} ifft(fft(x)) n={n}",
        ),
    ]
    spec = spectrum.copy_to_host().astype(np.complex128)
    energy = np.sum(np.abs(host.astype(np.complex128)) ** 2)
    parseval = abs(np.sum(np.abs(spec) ** 2) / n - energy) / energy
    if not parseval <= 2 * tol + tol * tol:
        raise CheckError(
            f"v{version} n={n}: Parseval off by {parseval:.3g} (||X||^2 / n vs ||x||^2)"
        )
    return max(errors + [parseval])


def run(sizes=None, batch_bytes=None) -> list:
    """Check every version at each n of ``sizes``, then time it next to cuFFT.

    sizes: powers of two (default every one from 1 to 4096 and 2**20 on a GPU; a few
    small ones in the simulator). batch_bytes: complex64 bytes of one batch (default
    256 MiB on a GPU): batch = batch_bytes // (8 n) rows. Returns the Timings (each
    with ``extra``: n, batch, rel_error and, when cuFFT ran, fraction_of_cufft).
    Raises CheckError for a wrong version, ValueError for a bad size.
    """
    sizes = sizes or pick(gpu=[1 << k for k in range(13)] + [1 << 20], simulator=[1, 2, 16, 64])
    # simulator: 191 rows of n = 1, 95 of 2, 11 of 16: no multiple of rows_per_block
    batch_bytes = batch_bytes or pick(gpu=256 << 20, simulator=191 * 8)
    rng = np.random.default_rng()
    peaks = device_peaks()
    cufft = Cufft() if Cufft.available() else None
    results = []
    for n in sizes:
        _require_length(n, "n", MAX_N)
        batch = max(1, batch_bytes // (8 * n))
        host, x = random_rows(batch, n, rng)
        ref = fft_cpu(host)
        timed = [
            (f"{v} {name}", partial(fft, version=v), v, None)
            for v, (name, _) in VERSIONS.items()
            # version 1 is O(n^2); version 3 holds a row in one block
            if not (v == 1 and n > V1_MAX_N) and not (v == 3 and n > MAX_BLOCK_N)
        ]
        if cufft is not None:
            timed.append((CUFFT, cufft, None, cufft.forward))
        rows = []
        for name, launcher, v, timed_call in timed:
            out = poisoned((batch, n), np.complex64)
            launcher(x, out)
            tol = dft_tolerance(n) if v == 1 else tolerance(n)
            err = check(as_pairs(out), as_pairs(ref), tol=tol, name=f"{name}, n = {n}")
            if v is not None:
                check_identities(n, min(batch, 4), rng, v)
            slow = v == 1 and n >= 1024  # seconds a call: 1 warm-up, 3 timed
            t = benchmark(
                partial(timed_call, x) if timed_call else partial(launcher, x, out),
                name,
                nbytes=16 * batch * n,  # read and write each complex64 once
                warmup=1 if slow else 3,
                repeats=3 if slow else 20,
                peaks=peaks,
                # a call is 0.2 ms at 256 MiB, about what a Numba launch takes on the
                # host: keep the GPU busy while the 20 calls are queued, so the events
                # time the GPU's work, not the host's
                hold_ms=50,
            )
            t.extra["rel_error"] = err
            rows.append(t)
        cufft_gbps = next((r.gbps for r in rows if r.name == CUFFT), None)
        for r in rows:
            r.extra.update(n=n, batch=batch)
            if cufft_gbps and r.gbps:
                r.extra["fraction_of_cufft"] = r.gbps / cufft_gbps
        print(format_table(rows, title=f"FFT n = {n}, batch {batch} (complex64, 16 B an element)"))
        if cufft_gbps:
            for r in rows:
                print(
                    f"    {r.name:<44} {r.gbps:8.1f} GB/s  {100 * r.extra['fraction_of_cufft']:6.1f} % of cuFFT"
                )
        results += rows
    return results


def main(argv=None):
    parser = script_parser(__doc__, CHAPTER)
    parser.add_argument(
        "--sizes",
        type=positive_ints,
        default=None,
        help="comma list of row lengths n (powers of two up to 2**20); default 1, 2, 4, "
        "..., 4096 and 1048576 on a GPU, 1,2,16,64 in the simulator",
    )
    parser.add_argument(
        "--batch-mib",
        type=positive_float,
        default=None,
        help="MiB of complex64 data per size (batch = that / (8 n) rows); default 256 on a GPU",
    )
    args = parser.parse_args(argv)
    print(
        f"device: {device_peaks().get('device', '?')}; cuFFT "
        f"{'available' if Cufft.available() else 'NOT available'}"
        + (" (simulator: correctness only)" if is_simulator() else "")
    )
    batch_bytes = int(args.batch_mib * 2**20) if args.batch_mib else None
    results = run(args.sizes, batch_bytes)
    save_results(results, args.out, "fft", best=BEST, radix=RADIX, block_elems=BLOCK_ELEMS)
    return 0


if __name__ == "__main__":
    run_script(main)
