"""2-D convolution (NCHW, float32, stride 1, "same" padding): five algorithms against cuDNN.

version 1  conv2d_direct: one thread an output (n, co, y, x); loops ci, kh, kw over global
           memory: Ci*K*K FMAs and 2 Ci*K*K loads a thread (the cache catches most of them)
version 2  conv2d_smem_tile: a block stages its (TILE + K - 1)^2 input tile, halo included,
           in shared memory, one input channel at a time (chapter 06's stencil grown to 2-D
           and channels): one global load an input value per block; K <= SMEM_MAX_K
version 3  im2col + SGEMM: the image unrolled into a (Ci*K*K, N*H*W) matrix, times the
           (Co, Ci*K*K) weights by chapter 08's fastest SGEMM (version 10); K*K times the
           image's memory: skipped where the matrix would pass IM2COL_BUDGET_BYTES
version 4  implicit GEMM: the capstone's conv2d_igemm (final_project/fast_conv.py): the
           same GEMM, im2col tiles gathered into shared memory on the fly; K <= 15
version 5  FFT: image and weights zero-padded to P x Q (powers of two >= H+K-1, W+K-1),
           2-D FFTs (this chapter's fft.py), a pointwise multiply-accumulate over input
           channels with the conjugate weight spectrum, one inverse FFT, a crop:
           O(PQ log PQ) a plane, whatever K
baseline   cuDNN through torch.nn.functional.conv2d(padding="same"), TF32 off, with
           cudnn.benchmark off and on; the algorithm it ran is read from the names of the
           kernels it launched (torch.profiler)

Run:   python chapters/11_fft_and_convolution/convolution.py [--parts crossover,capstone,claim]
           [--kernel-sizes 3,5,9,17] [--image 2048] [--out DIR]

"same" padding follows PyTorch (padding="same"): the output is H x W and the input is
padded by (K-1)//2 on the top and left and K//2 on the bottom and right, so an even K
works too. Cross-correlation, as torch's conv2d: out[n, co, y, x] = sum_{ci, kh, kw}
w[co, ci, kh, kw] * x[n, ci, y + kh - (K-1)//2, x + kw - (K-1)//2] (zero outside).

Every version is checked against a float64 reference (torch's conv2d in float64 on the
GPU, the same sum by NumPy on the CPU) with a tolerance derived from its arithmetic
(:func:`direct_tolerance`, :func:`fft_tolerance`), then timed. Three parts: the
crossover (ms against K at one large image: which algorithm wins where, and which one
cuDNN picks), the capstone's layer shapes, and the notes' claim that FFT convolution is
about 208x faster than a direct kernel at batch 1, one channel, 2048 x 2048, K = 128
(measured here, not assumed).

The plumbing is in tools.py beside this file: reading which algorithm cuDNN ran
(torch.profiler and its kernel names), the crossover's table and plot.

Sources: im2col: Chellapilla, Puri and Simard, "High Performance Convolutional Neural
Networks for Document Processing" (2006); implicit GEMM: Chetlur et al., "cuDNN:
Efficient Primitives for Deep Learning" (2014), section 3; FFT convolution: Mathieu,
Henaff and LeCun, "Fast Training of Convolutional Networks through FFTs" (2014), and
Vasilache et al., "Fast Convolutional Nets With fbfft: A GPU Performance Evaluation"
(2015); halo tiles: Kirk and Hwu, "Programming Massively Parallel Processors" (4th ed.),
ch. 7-8.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, load_chapter_module
from common.checking import (
    EPS32,
    check,
    poisoned,
    random_array,
    require_device_array,
    rounding_tolerance,
)
from common.harness import positive_int, positive_ints, run_versions, save_results, script_parser
from common.runtime import (
    MAX_GRID_DIM,
    MAX_STATIC_SHARED_BYTES,
    ceil_div,
    is_simulator,
    pick,
    torch_cuda_available,
)
from common.timing import Timing, benchmark, device_peaks, format_table

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from numba import complex64, cuda, float32

from final_project import fast_conv
from final_project.model import NetConfig

fft = import_sibling(__file__, "fft")  # this chapter's FFT: fft2(x, out, inverse=False)
tools = import_sibling(__file__, "tools")  # cuDNN's pick, the crossover's table and plot
matmul = load_chapter_module("08_faster_matmul", "matmul")

CHAPTER = "11_fft_and_convolution"
ZERO = np.float32(0.0)

BLOCK_2D = pick(gpu=(32, 8), simulator=(4, 2))  # v1: a warp spans 32 consecutive x
TILE = pick(gpu=16, simulator=4)  # v2: outputs per block along each axis
# v2's haloed tile must fit the 48 KiB of static shared memory a block may have:
# (TILE + K - 1)^2 floats, so K <= 95 for 16 x 16 tiles.
SMEM_MAX_K = math.isqrt(MAX_STATIC_SHARED_BYTES // 4) - TILE + 1
THREADS_1D = pick(gpu=256, simulator=64)  # the element-wise kernels (im2col, pad, crop, MAC)
# v3's column matrix is Ci*K*K times the image: past this size it is not built.
IM2COL_BUDGET_BYTES = pick(gpu=2 << 30, simulator=1 << 20)


# --------------------------------------------------------------------------
# The float64 reference and the tolerances
# --------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_even_same() -> Iterator[None]:
    """Silence torch's warning that padding="same" with an even K copies the input
    padded first: expected here, and said in the docstring."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using padding='same' with even kernel")
        yield


def gpu_reference() -> bool:
    """Whether the float64 reference runs on the GPU (torch's float64 cuDNN and cuFFT):
    on a GPU with CUDA torch, where a 2048 x 2048 image with K = 128 is 7e10
    multiply-adds. Else NumPy on the CPU (and torch is never imported)."""
    return torch_cuda_available()


def conv2d_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 "same" cross-correlation: x (N, Ci, H, W), w (Co, Ci, K, K) host arrays
    -> (N, Co, H, W) float64: torch.nn.functional.conv2d(padding="same") in float64 on
    the GPU (:func:`gpu_reference`), else one BLAS contraction over Ci per tap (kh, kw)
    of the padded image.

    Raises:
        ValueError: not 4-D, or channel counts that differ.
    """
    if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x (N, Ci, H, W) and w (Co, Ci, K, K), got {x.shape}, {w.shape}")
    if gpu_reference():
        import torch
        import torch.nn.functional as F

        xt = torch.from_numpy(np.ascontiguousarray(x)).to("cuda", torch.float64)
        wt = torch.from_numpy(np.ascontiguousarray(w)).to("cuda", torch.float64)
        with quiet_even_same():
            return F.conv2d(xt, wt, padding="same").cpu().numpy()
    _, _, h, wd = x.shape
    k = w.shape[2]
    before, after = (k - 1) // 2, k // 2
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (before, after), (before, after)))
    w64 = w.astype(np.float64)
    out = 0.0
    for kh in range(k):
        for kw in range(k):
            patch = xp[:, :, kh : kh + h, kw : kw + wd]
            # (Co, Ci) . (N, Ci, H, W) over Ci -> (Co, N, H, W)
            out = out + np.tensordot(w64[:, :, kh, kw], patch, axes=([1], [1]))
    return np.ascontiguousarray(np.transpose(out, (1, 0, 2, 3)))


def direct_tolerance(x: np.ndarray, w: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 tolerance of versions 1-4: each output is a float32 sum of Ci*K*K
    products, accumulated one after the other (in whatever order), so its error is at
    most Ci*K*K * eps32 * M with M = sum |x| |w| over its window (recursive summation,
    Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 4.2).
    M is the same convolution of |x| with |w|. A worst-case bound: loose for large K,
    but a wrong tap, a flipped kernel or a missing halo errs by O(1)."""
    c, k = w.shape[1], w.shape[2]
    magnitude = conv2d_reference(np.abs(x), np.abs(w))
    return rounding_tolerance(ref, magnitude, c * k * k, EPS32)


def fft_shape(h: int, w: int, k: int) -> tuple[int, int]:
    """(P, Q): the powers of two >= H + K - 1 and W + K - 1 that version 5 pads to, so the
    circular correlation of the padded planes holds the linear one without wrap-around."""
    return 1 << (h + k - 2).bit_length(), 1 << (w + k - 2).bit_length()


def spectra(a: np.ndarray, p: int, q: int) -> np.ndarray:
    """float64 2-D FFTs of the planes of ``a`` (.., h, w) zero-padded to P x Q, as
    (a.shape[0], a.shape[1], P*Q) complex128: torch.fft on the GPU, else NumPy."""
    if gpu_reference():
        import torch

        at = torch.from_numpy(np.ascontiguousarray(a)).to("cuda", torch.float64)
        spec = torch.fft.fft2(at, s=(p, q)).cpu().numpy()
    else:
        spec = np.fft.fft2(a.astype(np.float64), s=(p, q))
    return spec.reshape(a.shape[0], a.shape[1], p * q)


def fft_tolerance(x: np.ndarray, w: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 tolerance of version 5, from its arithmetic, on the inputs themselves.

    With X_c, W_oc the exact spectra of the padded planes and t = fft.tolerance(P*Q),
    each computed spectrum is off by at most t ||X_c|| (normwise). Per (n, o):
      forward  sum_c t (||X_c|| max|W_oc| + max|X_c| ||W_oc||): an erring spectrum
               times an exact one;
      product  (Ci + 3) eps32 ||S||, S = sum_c |X_c| |W_oc|: the complex multiply-adds;
      inverse  t ||S||: the inverse FFT of a spectrum no larger than S;
    all divided by sqrt(P*Q) (Parseval, unnormalized forward FFT). The bound is their
    root sum of squares over (n, o), relative to ||ref||.
    """
    _, c, h, wd = x.shape
    p, q = fft_shape(h, wd, w.shape[2])
    xa, wa = np.abs(spectra(x, p, q)), np.abs(spectra(w, p, q))  # (N, Ci, F), (Co, Ci, F)
    t = fft.tolerance(p * q)  # relative L2 bound of one 2-D FFT of P*Q points
    x2, xinf = np.linalg.norm(xa, axis=2), xa.max(axis=2)  # (N, Ci)
    w2, winf = np.linalg.norm(wa, axis=2), wa.max(axis=2)  # (Co, Ci)
    forward = t * (x2 @ winf.T + xinf @ w2.T)  # (N, Co)
    s = sum(xa[:, ci, None, :] * wa[None, :, ci, :] for ci in range(c))  # S: (N, Co, F)
    s_norm = np.linalg.norm(s, axis=2)
    err = (forward + ((c + 3) * EPS32 + t) * s_norm) / math.sqrt(p * q)
    return max(EPS32, float(np.linalg.norm(err)) / float(np.linalg.norm(ref)))


# --------------------------------------------------------------------------
# Operands
# --------------------------------------------------------------------------


def check_operands(x, w, out):
    """Return x (N, Ci, H, W), w (Co, Ci, K, K), out (N, Co, H, W) as Numba device arrays.

    Each must be a float32 C-contiguous device array (a CUDA torch tensor is wrapped
    without a copy); K square, 1 <= K <= min(H, W). Every launcher calls it before any
    launch.

    Raises:
        TypeError: a host (NumPy) array, not a device array, or not float32.
        ValueError: not 4-D (NCHW / OIHW), not C-contiguous, input channels of x and w
            that differ, a kernel that is not square or larger than the image, or an
            ``out`` of the wrong shape; each message says what to pass instead.
    """
    arrays = []
    for a, name, layout in ((x, "x", "NCHW"), (w, "w", "OIHW"), (out, "out", "NCHW")):
        a = require_device_array(a, name, dtype=np.float32)
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {a.shape}")
        if not a.is_c_contiguous():
            raise ValueError(
                f"{name} must be C-contiguous ({layout} without strides): pass "
                f"cuda.to_device(np.ascontiguousarray({name}))"
            )
        arrays.append(a)
    x, w, out = arrays
    n, c, h, wd = x.shape
    c_out, c_w, kh, kw = w.shape
    if c_w != c:
        raise ValueError(
            f"x has {c} input channels but w {w.shape} has {c_w}: w must be "
            f"(C_out, C_in, K, K) with C_in = x.shape[1] = {c}"
        )
    if kh != kw:
        raise ValueError(f"the kernel must be square (K x K), got w {w.shape}")
    if not 1 <= kh <= min(h, wd):
        raise ValueError(
            f"kernel size K = {kh} is larger than the {h} x {wd} image: with 'same' "
            "padding most taps would read padding; crop the kernel or pad the image first"
        )
    if out.shape != (n, c_out, h, wd):
        raise ValueError(f"out must be (N, C_out, H, W) = {(n, c_out, h, wd)}, got {out.shape}")
    return x, w, out


_SCRATCH: dict[str, Any] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """A device buffer kept between calls (im2col matrix, spectra, ...), so that timed
    calls measure the kernels, not cudaMalloc; replaced when the shape changes."""
    buf = _SCRATCH.get(name)
    if buf is None or buf.shape != tuple(shape) or buf.dtype != np.dtype(dtype):
        _SCRATCH.pop(name, None)  # free the old one first: the large ones are GiBs
        buf = _SCRATCH[name] = cuda.device_array(shape, dtype)
    return buf


def free_scratch() -> None:
    """Drop every scratch buffer (between problem sizes)."""
    _SCRATCH.clear()


def _launch_flat(kernel, total: int, *args) -> None:
    """One thread an element of a ``total``-element output, THREADS_1D a block."""
    kernel[ceil_div(total, THREADS_1D), THREADS_1D](*args)


# --------------------------------------------------------------------------
# Version 1: direct, one thread an output
# --------------------------------------------------------------------------


# v1: Ci*K*K FMAs a thread; x loads of a warp are 32 consecutive floats of a row
# (coalesced), and every thread of a block reads the same w[co, ci, kh, kw] (broadcast).
@cuda.jit(cache=True)
def conv2d_direct(x, w, out):
    ox = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    oy = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    c_out = w.shape[0]
    n = cuda.blockIdx.z // c_out
    co = cuda.blockIdx.z - n * c_out
    h = x.shape[2]
    wd = x.shape[3]
    k = w.shape[2]
    pad = (k - 1) // 2  # "same": (K-1)//2 before, K//2 after
    if oy < h and ox < wd:
        acc = float32(0.0)
        for ci in range(x.shape[1]):
            for kh in range(k):
                iy = oy + kh - pad
                if 0 <= iy < h:
                    for kw in range(k):
                        ix = ox + kw - pad
                        if 0 <= ix < wd:
                            acc += x[n, ci, iy, ix] * w[co, ci, kh, kw]
        out[n, co, oy, ox] = acc


# --------------------------------------------------------------------------
# Version 2: a haloed input tile in shared memory
# --------------------------------------------------------------------------


def make_conv2d_smem_tile(TILE, K):
    """v2 factory: TILE x TILE threads, one output each; per input channel the block
    loads the (TILE + K - 1)^2 inputs its outputs read (tile + halo of K - 1) once, in
    TILE-strided sweeps, and every thread reads its K*K taps from shared memory. Global
    loads per output: (1 + (K - 1)/TILE)^2 per channel, against K*K in v1. K is a
    compile-time constant (the shared array's shape); the block recomputes the tile for
    each output channel (grid z = N*Co)."""
    HALO = TILE + K - 1
    PAD = (K - 1) // 2
    assert 4 * HALO * HALO <= MAX_STATIC_SHARED_BYTES, f"K = {K} needs {HALO}^2 floats"

    @cuda.jit(cache=True)
    def conv2d_smem_tile(x, w, out):
        tile = cuda.shared.array((HALO, HALO), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        c_out = w.shape[0]
        n = cuda.blockIdx.z // c_out
        co = cuda.blockIdx.z - n * c_out
        h = x.shape[2]
        wd = x.shape[3]
        y0 = cuda.blockIdx.y * TILE - PAD  # top-left input of the haloed tile
        x0 = cuda.blockIdx.x * TILE - PAD
        acc = float32(0.0)
        for ci in range(x.shape[1]):
            for yy in range(ty, HALO, TILE):
                for xx in range(tx, HALO, TILE):
                    gy = y0 + yy
                    gx = x0 + xx
                    inside = 0 <= gy < h and 0 <= gx < wd
                    tile[yy, xx] = x[n, ci, gy, gx] if inside else ZERO
            cuda.syncthreads()  # the halo comes from other threads' loads
            for kh in range(K):
                for kw in range(K):
                    acc += w[co, ci, kh, kw] * tile[ty + kh, tx + kw]
            cuda.syncthreads()  # all reads done before the next channel overwrites the tile
        oy = cuda.blockIdx.y * TILE + ty
        ox = cuda.blockIdx.x * TILE + tx
        if oy < h and ox < wd:
            out[n, co, oy, ox] = acc

    return conv2d_smem_tile


@cache
def smem_tile_kernel(k: int):
    """v2 built for K = ``k`` at this runtime's TILE (one compile per K)."""
    return make_conv2d_smem_tile(TILE, k)


# --------------------------------------------------------------------------
# Version 3: im2col, then chapter 08's SGEMM
# --------------------------------------------------------------------------


# v3a: col[(ci, kh, kw), (n, y, x)] = x[n, ci, y + kh - pad, x + kw - pad] (0 outside).
# Consecutive threads take consecutive pixels: coalesced writes, and reads one tap apart.
# Writes Ci*K*K*N*H*W floats: K*K times the image, the price of an explicit GEMM.
@cuda.jit(cache=True)
def im2col(x, k, col):
    t = cuda.grid(1)
    if t < col.size:
        m_total = col.shape[1]
        r = t // m_total
        m = t - r * m_total
        kk = k * k
        ci = r // kk
        kh = (r - ci * kk) // k
        kw = r - ci * kk - kh * k
        h = x.shape[2]
        wd = x.shape[3]
        n = m // (h * wd)
        p = m - n * h * wd
        oy = p // wd
        ox = p - oy * wd
        iy = oy + kh - (k - 1) // 2
        ix = ox + kw - (k - 1) // 2
        v = ZERO
        if 0 <= iy < h and 0 <= ix < wd:
            v = x[n, ci, iy, ix]
        col[r, m] = v


# The (b, i, j) of flat index t in a C-ordered 3-D array a: the kernels below run one
# thread an element of their output.
@cuda.jit(device=True)
def unflatten_3d(t, a):
    plane = a.shape[1] * a.shape[2]
    b = t // plane
    r = t - b * plane
    i = r // a.shape[2]
    return b, i, r - i * a.shape[2]


# v3b: the GEMM's (Co, N*H*W) product -> NCHW (batch > 1 only): out[n, co, p] = src[co, n*HW + p].
@cuda.jit(cache=True)
def nchw_from_channel_rows(src, out):
    t = cuda.grid(1)
    if t < out.size:
        n, co, p = unflatten_3d(t, out)
        out[n, co, p] = src[co, n * out.shape[2] + p]


# --------------------------------------------------------------------------
# Version 5: FFT (version 4 is the capstone's kernel, launched below)
# --------------------------------------------------------------------------


# v5a: dst[b, i, j] = src[b, i, j] inside src, 0 in the padding (a complex64 plane).
@cuda.jit(cache=True)
def pad_complex(src, dst):
    t = cuda.grid(1)
    if t < dst.size:
        b, i, j = unflatten_3d(t, dst)
        v = ZERO
        if i < src.shape[1] and j < src.shape[2]:
            v = src[b, i, j]
        dst[b, i, j] = v


# v5b: yf[n, o, f] = sum_c xf[n, c, f] conj(wf[o, c, f]): a correlation is a product with
# the conjugate spectrum (w real). Ci complex MACs per 2 Ci complex loads: memory-bound.
@cuda.jit(cache=True)
def spectral_mac(xf, wf, yf):
    f = cuda.grid(1)
    o = cuda.blockIdx.y
    n = cuda.blockIdx.z
    if f < yf.shape[2]:
        acc = complex64(0)
        for c in range(xf.shape[1]):
            acc += xf[n, c, f] * wf[o, c, f].conjugate()
        yf[n, o, f] = acc


# v5c: out[b, i, j] = Re y[b, (i - top) mod P, (j - left) mod Q]: the circular
# correlation holds output (i, j) at lag (i - top, j - left), negative lags wrapped.
@cuda.jit(cache=True)
def crop_real(y, top, left, out):
    t = cuda.grid(1)
    if t < out.size:
        b, i, j = unflatten_3d(t, out)
        yi = i - top
        yj = j - left
        if yi < 0:
            yi += y.shape[1]
        if yj < 0:
            yj += y.shape[2]
        out[b, i, j] = y[b, yi, yj].real


# v4 helper: out[b, i, j] = src[b, i + dy, j + dx] (the even-K window of a larger output).
@cuda.jit(cache=True)
def crop_window(src, dy, dx, out):
    t = cuda.grid(1)
    if t < out.size:
        b, i, j = unflatten_3d(t, out)
        out[b, i, j] = src[b, i + dy, j + dx]


# --------------------------------------------------------------------------
# Launchers: out = conv(x, w), each a (x, w, out) function
# --------------------------------------------------------------------------


# What each version cannot run, read by its launcher (which raises) and by the
# crossover (which skips it): the reason, or None. x_shape is (N, Ci, H, W).


def no_limit(x_shape: Sequence[int], k: int) -> None:
    return None


def smem_limit(x_shape: Sequence[int], k: int) -> str | None:
    if k <= SMEM_MAX_K:
        return None
    return (
        f"K = {k} > {SMEM_MAX_K}: the ({TILE} + K - 1)^2 haloed tile would not fit "
        f"{MAX_STATIC_SHARED_BYTES // 1024} KiB of shared memory"
    )


def im2col_bytes(x_shape: Sequence[int], k: int) -> int:
    """Bytes of version 3's column matrix: Ci*K*K*N*H*W floats."""
    n, c, h, wd = x_shape
    return 4 * c * k * k * n * h * wd


def im2col_limit(x_shape: Sequence[int], k: int) -> str | None:
    need = im2col_bytes(x_shape, k)
    if need <= IM2COL_BUDGET_BYTES:
        return None
    return (
        f"the im2col matrix would take {need / 2**30:.3g} GiB, over the "
        f"{IM2COL_BUDGET_BYTES / 2**30:.3g} GiB budget"
    )


def igemm_limit(x_shape: Sequence[int], k: int) -> str | None:
    if k <= fast_conv.MAX_KERNEL_SIZE:
        return None
    return f"K = {k} > {fast_conv.MAX_KERNEL_SIZE}, fast_conv's largest (K-tiles in shared memory)"


def fft_limit(x_shape: Sequence[int], k: int) -> str | None:
    p, q = fft_shape(x_shape[2], x_shape[3], k)
    if p <= fft.MAX_BLOCK_N and q <= fft.MAX_N:
        return None
    return f"FFT size {p} x {q}: fft2 takes h <= {fft.MAX_BLOCK_N}, w <= {fft.MAX_N}"


def _refuse(why: str | None, advice: str) -> None:
    if why:
        raise ValueError(f"{why}: {advice}")


def _check_grid_z(n: int, c_out: int) -> None:
    if n * c_out > MAX_GRID_DIM[2]:
        raise ValueError(
            f"N * C_out = {n * c_out} blocks along z is more than a grid allows "
            f"({MAX_GRID_DIM[2]}): split the batch"
        )


def conv_direct(x, w, out, kernel=conv2d_direct, block=BLOCK_2D) -> None:
    """Version 1: out (N, Co, H, W) = same-padded cross-correlation of x (N, Ci, H, W)
    with w (Co, Ci, K, K), float32 device arrays; one thread an output, blocks of
    ``block`` = (x, y) threads. Raises as :func:`check_operands`, and ValueError for
    N*Co > 65535."""
    x, w, out = check_operands(x, w, out)
    n, _, h, wd = x.shape
    _check_grid_z(n, w.shape[0])
    grid = (ceil_div(wd, block[0]), ceil_div(h, block[1]), n * w.shape[0])
    kernel[grid, block](x, w, out)


def conv_smem_tile(x, w, out, kernel=None) -> None:
    """Version 2: as :func:`conv_direct`, by haloed TILE x TILE tiles in shared memory
    (``kernel``: one from ``make_conv2d_smem_tile(TILE, K)``, by default built for w's K).

    Raises:
        ValueError: K > SMEM_MAX_K (the haloed tile would not fit 48 KiB of shared
            memory), N*Co > 65535, and as :func:`check_operands`.
    """
    x, w, out = check_operands(x, w, out)
    n, _, h, wd = x.shape
    k = w.shape[2]
    _refuse(smem_limit(x.shape, k), "use another version")
    _check_grid_z(n, w.shape[0])
    kernel = kernel or smem_tile_kernel(k)
    kernel[(ceil_div(wd, TILE), ceil_div(h, TILE), n * w.shape[0]), (TILE, TILE)](x, w, out)


def conv_im2col(x, w, out) -> None:
    """Version 3: im2col then SGEMM: out[n] (Co, H*W) = w (Co, Ci*K*K) @ col (Ci*K*K, H*W).

    One GEMM for the whole batch: col is (Ci*K*K, N*H*W), the product (Co, N*H*W) is
    written straight into out for N = 1, else into scratch and permuted to NCHW. The
    GEMM is chapter 08's ``matmul_best`` (version 10, any M, N, K). Explicit GEMM:
    Chellapilla et al. 2006.

    Raises:
        ValueError: a column matrix over IM2COL_BUDGET_BYTES, and as :func:`check_operands`.
    """
    x, w, out = check_operands(x, w, out)
    n, c, h, wd = x.shape
    c_out, _, k, _ = w.shape
    _refuse(im2col_limit(x.shape, k), "use the implicit GEMM or the FFT version")
    col = scratch("im2col", (c * k * k, n * h * wd), np.float32)
    _launch_flat(im2col, col.size, x, k, col)
    w2 = w.reshape(c_out, c * k * k)
    if n == 1:
        matmul.matmul_best(w2, col, out.reshape(c_out, h * wd))
        return
    prod = scratch("im2col_product", (c_out, n * h * wd), np.float32)
    matmul.matmul_best(w2, col, prod)
    _launch_flat(nchw_from_channel_rows, out.size, prod, out.reshape(n, c_out, h * wd))


def conv_implicit_gemm(x, w, out) -> None:
    """Version 4: the capstone's implicit-GEMM forward kernel
    (``fast_conv.conv2d_forward_igemm``) with a zero bias.

    fast_conv takes square K <= 15 and one symmetric padding: odd K is "same" at pad
    (K-1)/2; even K runs at pad K/2 into an (H+1) x (W+1) scratch output whose
    window [1:, 1:] is "same" (one more pass over the output). Its epilogue also
    writes the batchnorm partial sums the capstone needs (into scratch): part of its
    time here. (Chetlur et al. 2014, section 3; CUTLASS "Implicit GEMM Convolution".)

    Raises:
        ValueError: K > 15, and as :func:`check_operands`.
    """
    x, w, out = check_operands(x, w, out)
    n, _, h, wd = x.shape
    c_out, _, k, _ = w.shape
    _refuse(igemm_limit(x.shape, k), "use the FFT version")
    bias = _SCRATCH.get("igemm_zero_bias")
    if bias is None or bias.shape != (c_out,):  # zeroed once, not on every (timed) call
        bias = _SCRATCH["igemm_zero_bias"] = cuda.to_device(np.zeros(c_out, np.float32))
    pad = k // 2  # odd K: (K-1)/2, "same"; even K: one more than "same" on the top/left
    target = out if k % 2 else scratch("igemm_full", (n, c_out, h + 1, wd + 1), np.float32)
    rows = fast_conv.conv2d_forward_igemm_partial_rows(n, target.shape[2], target.shape[3])
    partials = scratch("igemm_bn_partials", (rows, 2, c_out), np.float64)
    fast_conv.conv2d_forward_igemm(x, w, bias, pad, target, partials)
    if k % 2 == 0:
        src = target.reshape(n * c_out, h + 1, wd + 1)
        _launch_flat(crop_window, out.size, src, 1, 1, out.reshape(n * c_out, h, wd))


def conv_fft(x, w, out, mac=spectral_mac) -> None:
    """Version 5: FFT convolution with this chapter's fft.py.

    x (N, Ci, H, W) and w (Co, Ci, K, K) are zero-padded to complex64 (.., P, Q) planes
    (:func:`fft_shape`), transformed by ``fft.fft2`` (the weights on every call: a
    layer that keeps its weights would transform them once), multiplied and summed
    over Ci by ``mac`` (:func:`spectral_mac`), transformed back, and cropped. Costs
    O(PQ log PQ) a plane whatever K; spectra need 8 PQ bytes a plane (scratch). A
    real-to-complex FFT would halve the work; fft.py is complex-to-complex.
    (Mathieu, Henaff and LeCun 2014; Vasilache et al. 2015.)

    Raises:
        ValueError: P > 4096 (fft2 transforms a column in one block), and as
            :func:`check_operands`.
    """
    x, w, out = check_operands(x, w, out)
    n, c, h, wd = x.shape
    c_out, _, k, _ = w.shape
    _refuse(fft_limit(x.shape, k), "use the direct or GEMM versions, or tile the image")
    p, q = fft_shape(h, wd, k)
    planes = {"x": n * c, "w": c_out * c, "y": n * c_out}
    xp, xf = (scratch(f"fft_{s}", (planes["x"], p, q), np.complex64) for s in ("x", "xf"))
    wp, wf = (scratch(f"fft_{s}", (planes["w"], p, q), np.complex64) for s in ("w", "wf"))
    yf, y = (scratch(f"fft_{s}", (planes["y"], p, q), np.complex64) for s in ("yf", "y"))
    _launch_flat(pad_complex, xp.size, x.reshape(n * c, h, wd), xp)
    _launch_flat(pad_complex, wp.size, w.reshape(c_out * c, k, k), wp)
    fft.fft2(xp, xf)
    fft.fft2(wp, wf)
    mac[(ceil_div(p * q, THREADS_1D), c_out, n), THREADS_1D](
        xf.reshape(n, c, p * q), wf.reshape(c_out, c, p * q), yf.reshape(n, c_out, p * q)
    )
    fft.fft2(yf, y, inverse=True)  # numpy.fft.ifft2: scaled by 1 / (P Q) already
    top, left = (k - 1) // 2, (k - 1) // 2
    _launch_flat(crop_real, out.size, y, top, left, out.reshape(n * c_out, h, wd))


# --------------------------------------------------------------------------
# The versions, in order
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Algorithm:
    """One version: its number, name, launcher ``(x, w, out)``, which tolerance checks
    it ("direct" or "fft"), and ``limit(x_shape, k)``: why it does not run a problem
    (None where it does)."""

    number: int
    name: str
    launcher: Callable[..., None]
    tolerance: str
    limit: Callable[[Sequence[int], int], str | None]

    @property
    def label(self) -> str:
        return f"{self.number} {self.name}"


ALGORITHMS = (
    Algorithm(1, "direct", conv_direct, "direct", no_limit),
    Algorithm(2, "smem halo tile", conv_smem_tile, "direct", smem_limit),
    Algorithm(3, "im2col + SGEMM v10", conv_im2col, "direct", im2col_limit),
    Algorithm(4, "implicit GEMM (capstone)", conv_implicit_gemm, "direct", igemm_limit),
    Algorithm(5, "FFT", conv_fft, "fft", fft_limit),
)


# --------------------------------------------------------------------------
# The baseline: cuDNN through torch (which algorithm it ran: tools.cudnn_pick)
# --------------------------------------------------------------------------


class CudnnConv:
    """torch.nn.functional.conv2d(x, w, padding="same") on Numba device arrays (no copy:
    torch reads ``__cuda_array_interface__``), TF32 off, ``cudnn.benchmark`` as given.
    ``forward(x, w)`` returns torch's new tensor (what is timed); calling it as a
    launcher ``(x, w, out)`` also copies the result into ``out`` (what is checked)."""

    def __init__(self, benchmark: bool):
        import torch

        torch.backends.cudnn.allow_tf32 = False
        self.benchmark = benchmark
        self._torch = torch
        self._views: dict[int, tuple[Any, Any]] = {}  # id -> (array, its torch view)

    def _view(self, a):
        if id(a) not in self._views:
            self._views[id(a)] = (a, self._torch.as_tensor(a, device="cuda"))
        return self._views[id(a)][1]

    def forward(self, x, w):
        import torch.nn.functional as F

        self._torch.backends.cudnn.benchmark = self.benchmark
        return F.conv2d(self._view(x), self._view(w), padding="same")

    def __call__(self, x, w, out):
        self._view(out).copy_(self.forward(x, w))


def cudnn_available() -> bool:
    """True on a GPU with a CUDA build of torch."""
    return torch_cuda_available()


# --------------------------------------------------------------------------
# Measuring: one problem, the crossover, the capstone's shapes, the 208x claim
# --------------------------------------------------------------------------


def conv_flops(x_shape: Sequence[int], c_out: int, k: int) -> int:
    """2 N Co H W Ci K^2: the direct method's FLOPs (the FFT does fewer; its TFLOP/s
    are "direct-equivalent")."""
    n, c, h, wd = x_shape
    return 2 * n * c_out * h * wd * c * k * k


def run_problem(
    x_shape: Sequence[int],
    c_out: int,
    k: int,
    rng: np.random.Generator,
    *,
    numbers: Sequence[int] | None = None,
    with_cudnn: bool = True,
    repeats: int = 20,
    title: str = "",
) -> tuple[list[Timing], dict[str, Any]]:
    """Check, then time, every version that runs x (N, Ci, H, W) * w (Co, Ci, K, K), and
    cuDNN (``with_cudnn`` and a GPU) with benchmark off and on, and what it picked.

    ``numbers``: the versions to run (default all). Returns (Timings, a row for the
    JSON: {"x", "c_out", "k", "ms": {label: ms}, "skipped": {label: why}, "tolerance":
    {...}, "cudnn": {label: {"ms", "algorithm", "kernels"}}}). Raises CheckError at the
    first wrong version.
    """
    x_h = random_array(tuple(x_shape), np.float32, rng)
    w_h = random_array((c_out, x_shape[1], k, k), np.float32, rng)
    ref = conv2d_reference(x_h, w_h)
    tols = {"direct": direct_tolerance(x_h, w_h, ref), "fft": None}
    x, w = cuda.to_device(x_h), cuda.to_device(w_h)
    flops = conv_flops(x_shape, c_out, k)
    nbytes = 4 * (x_h.size + w_h.size + ref.size)
    row: dict[str, Any] = {"x": list(x_shape), "c_out": c_out, "k": k, "ms": {}, "skipped": {}}
    results = []
    slow = flops > 10**11  # one direct call takes ms: fewer repeats
    for alg in ALGORITHMS:
        if numbers is not None and alg.number not in numbers:
            continue
        why = alg.limit(x_shape, k)
        if why:
            row["skipped"][alg.label] = why
            continue
        if alg.tolerance == "fft" and tols["fft"] is None:
            tols["fft"] = fft_tolerance(x_h, w_h, ref)
        (t,) = run_versions(
            {f"{alg.label} K={k}": alg.launcher},
            (x, w),
            ref,
            ref.shape,
            tol=tols[alg.tolerance],
            flops=flops,
            nbytes=nbytes,
            warmup=1 if slow else 3,
            repeats=min(repeats, 5) if slow else repeats,
            print_table=False,
        )
        t.extra.update(algorithm=alg.label, k=k, x=list(x_shape), c_out=c_out, title=title)
        results.append(t)
        row["ms"][alg.label] = t.median_ms
    row["tolerance"] = tols
    if with_cudnn and cudnn_available():
        row["cudnn"] = {}
        # cuDNN may run FFT, Winograd or a GEMM: the looser of the two bounds, at least
        # chapter 07's 1e-4 (Winograd's transforms scale rounding by constants not modeled here)
        if tols["fft"] is None:
            tols["fft"] = fft_tolerance(x_h, w_h, ref)
        tol = max(tols["direct"], tols["fft"], 1e-4)
        for bench in (False, True):
            conv = CudnnConv(bench)
            label = f"cuDNN benchmark={'on' if bench else 'off'}"
            out = poisoned(ref.shape, np.float32)
            conv(x, w, out)
            check(out, ref, tol=tol, name=label)
            t = benchmark(
                partial(conv.forward, x, w),
                f"{label} K={k}",
                flops=flops,
                nbytes=nbytes,
                repeats=repeats,
            )
            algorithm, kernels = tools.cudnn_pick(conv, x, w)
            t.extra.update(algorithm=label, k=k, x=list(x_shape), c_out=c_out, title=title)
            t.extra.update(cudnn_algorithm=algorithm, cudnn_kernels=kernels)
            results.append(t)
            row["ms"][label] = t.median_ms
            row["cudnn"][label] = {"ms": t.median_ms, "algorithm": algorithm, "kernels": kernels}
    free_scratch()
    return results, row


CROSSOVER_IMAGE = pick(gpu=(1, 1, 2048, 2048), simulator=(1, 1, 5, 6))
CROSSOVER_K = pick(gpu=[3, 5, 7, 9, 11, 15, 21, 31, 45, 63, 91, 129], simulator=[3, 4])


def crossover(
    kernel_sizes: Sequence[int] | None = None,
    x_shape: Sequence[int] | None = None,
    c_out: int = 1,
    rng: np.random.Generator | None = None,
    repeats: int = 20,
) -> tuple[list[Timing], list[dict[str, Any]]]:
    """ms of every version and of cuDNN against K, at one image (default: batch 1, one
    channel, 2048 x 2048 on a GPU; 5 x 6 in the simulator, which times nothing).

    Versions that do not apply at a K are skipped, with the reason in the row
    (v2: K > SMEM_MAX_K; v3: im2col matrix over budget; v4: K > 15). Returns
    (Timings, one row per K: see :func:`run_problem`).
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    x_shape = tuple(x_shape or CROSSOVER_IMAGE)
    results, rows = [], []
    for k in kernel_sizes or CROSSOVER_K:
        res, row = run_problem(x_shape, c_out, k, rng, repeats=repeats, title="crossover")
        results += res
        rows.append(row)
    return results, rows


def capstone_problems() -> list[tuple[str, tuple[int, int, int, int], int, int]]:
    """(name, x shape, Co, K) of the capstone's two conv layers (final_project.model's
    NetConfig: conv1 Ci -> c1 at H x W, conv2 c1 -> c2 after a 2x2 pool), at batch 64
    and 256 and K = 3 (the capstone's) and 5; tiny in the simulator."""
    cfg = pick(gpu=NetConfig(), simulator=NetConfig(height=8, width=8, c1=2, c2=3))
    batches = pick(gpu=(64, 256), simulator=(1,))
    sizes = pick(gpu=(3, 5), simulator=(3,))
    out = []
    for b in batches:
        for k in sizes:
            out.append((f"conv1 b{b}", (b, cfg.in_channels, cfg.height, cfg.width), cfg.c1, k))
            h2, w2 = cfg.height // 2, cfg.width // 2
            out.append((f"conv2 b{b}", (b, cfg.c1, h2, w2), cfg.c2, k))
    return out


CLAIM = pick(gpu=((1, 1, 2048, 2048), 128), simulator=((1, 1, 5, 5), 4))
CLAIMED_RATIO = 208


def claim_direct_vs_fft(rng: np.random.Generator, repeats: int = 5) -> dict[str, Any]:
    """The notes' claim: FFT convolution ~208x faster than a direct kernel at batch 1,
    one channel, 2048 x 2048, K = 128 (even: "same" padding 63 before, 64 after).
    Checks and times version 1 and version 5 there; returns {"direct_ms", "fft_ms",
    "ratio", "claimed"} (ms None in the simulator)."""
    x_shape, k = CLAIM
    res, _ = run_problem(
        x_shape, 1, k, rng, numbers=(1, 5), with_cudnn=False, repeats=repeats, title="claim"
    )
    direct_ms, fft_ms = res[0].median_ms, res[1].median_ms
    ratio = direct_ms / fft_ms if direct_ms and fft_ms else None
    return {
        "x": list(x_shape),
        "k": k,
        "direct_ms": direct_ms,
        "fft_ms": fft_ms,
        "ratio": ratio,
        "claimed": CLAIMED_RATIO,
        "timings": res,
    }


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

PARTS = ("crossover", "capstone", "claim")


def _parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


def main(argv=None):
    parser = script_parser(__doc__, CHAPTER)
    parser.add_argument(
        "--parts",
        type=_parse_parts,
        default=PARTS,
        help="comma list of crossover, capstone, claim (default: all three)",
    )
    parser.add_argument(
        "--kernel-sizes",
        type=positive_ints,
        default=None,
        help=f"the crossover's K values (default {','.join(map(str, CROSSOVER_K))})",
    )
    parser.add_argument(
        "--image",
        type=positive_int,
        default=None,
        help=f"the crossover's square image edge (default {CROSSOVER_IMAGE[2]})",
    )
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls a version")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    device = device_peaks().get("device", "?")
    print(
        f"device: {device}; cuDNN {'available' if cudnn_available() else 'NOT available'}"
        + (" (simulator: correctness only)" if is_simulator() else "")
    )
    print(
        "every version is checked against a float64 reference (torch's conv2d on the GPU, "
        "NumPy on the CPU), then timed"
    )
    results, meta = [], {}
    with quiet_even_same():
        if "crossover" in args.parts:
            x_shape = CROSSOVER_IMAGE
            if args.image:
                x_shape = (1, 1, args.image, args.image)
            res, rows = crossover(args.kernel_sizes, x_shape, rng=rng, repeats=args.repeats)
            results += res
            meta["crossover"] = rows
            versions = [a.label for a in ALGORITHMS]
            title = f"crossover: ms against K, x {x_shape}, 1 output channel"
            print(tools.crossover_table(rows, title, versions))
            png_path = Path(args.out) / "convolution_crossover.png"
            png = tools.plot_crossover(rows, png_path, device, versions)
            if png:
                print(f"wrote {png}")
        if "capstone" in args.parts:
            rows = []
            for name, x_shape, c_out, k in capstone_problems():
                res, row = run_problem(x_shape, c_out, k, rng, repeats=args.repeats, title=name)
                row["name"] = name
                results += res
                rows.append(row)
                print(format_table(res, title=f"capstone {name}: x {x_shape} -> Co {c_out}, K {k}"))
            meta["capstone"] = rows
        if "claim" in args.parts:
            claim = claim_direct_vs_fft(rng, repeats=min(args.repeats, 5))
            results += claim.pop("timings")
            meta["claim"] = claim
            x_shape, k = CLAIM
            if claim["ratio"] is None:
                print(f"claim (x {x_shape}, K {k}): direct and FFT checked; ratio needs a GPU")
            else:
                print(
                    f"claim (x {x_shape}, K {k}): direct {claim['direct_ms']:.3g} ms, FFT "
                    f"{claim['fft_ms']:.3g} ms: FFT is {claim['ratio']:.1f}x faster "
                    f"(the notes claim about {CLAIMED_RATIO}x)"
                )
    if not cudnn_available():
        print("SKIPPED: cuDNN timings and its algorithm picks (need a GPU and CUDA torch)")
    save_results(results, args.out, "convolution", **meta)
    return 0


if __name__ == "__main__":
    # torch's profiler, once it has recorded CUDA activity (tools.cudnn_pick), can crash
    # the interpreter's teardown: exit with main()'s code without it (chapter 09's tools).
    load_chapter_module("09_profiling", "tools").run_script_skipping_teardown(main)
