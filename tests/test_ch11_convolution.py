"""Chapter 11 convolution: every version against the float64 reference on hostile shapes,
broken kernels that must fail, bad inputs refused before any launch, cuDNN's kernel
names classified, and main at simulator size.

Shapes are tiny on purpose: the simulator runs a Python thread per CUDA thread. They
are still hostile: H and W are not multiples of a tile, K is 1 (no halo), even (the
asymmetric "same" padding), and as large as the image (a halo wider than the tile);
batch 1 and 2, one to three channels in and out.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array
from common.internal import racecheck
from common.internal.exercises import load_chapter_module
from common.internal.float32_purity import recording_launches
from common.internal.racecheck import RaceError
from common.runtime import is_simulator, pick

import json
from functools import partial

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

conv = load_chapter_module("11_fft_and_convolution", "convolution")
tools = load_chapter_module("11_fft_and_convolution", "tools")

FAILS = (CheckError, IndexError, AssertionError)
RACES = RaceError if is_simulator() and racecheck.ENABLED else FAILS

# (x shape (N, Ci, H, W), Co, K), each the wrong kernel it exists to fail. On a GPU the
# first two span several tiles, so a tile without its halo reads real neighbours' data.
CASES = {
    # ragged tiles: a missing bounds check
    "odd-HW-K3": (pick(gpu=(1, 2, 37, 45), simulator=(1, 2, 5, 6)), 2, 3),
    # "same" pads 1 before, 2 after: a symmetric pad
    "even-K4-batch2": (pick(gpu=(2, 1, 35, 33), simulator=(2, 1, 5, 5)), 3, 4),
    # halo wider than a simulator tile; 16 x 16 FFTs
    "K5-equals-H": ((2, 1, 5, 6), 1, 5),
    # no halo at all: an off-by-one pad
    "K1": ((2, 2, 3, 5), 2, 1),
}
# The simulator runs a Python thread per CUDA thread: FFT sizes stay at 8 x 8 there
# except in "K5-equals-H" (16 x 16, several passes of fft.py's kernels).
VERSIONS = {a.label: a for a in conv.ALGORITHMS}


def problem(rng, x_shape, c_out, k):
    """Device x, w, the float64 reference, and the host inputs."""
    x_h = random_array(x_shape, np.float32, rng)
    w_h = random_array((c_out, x_shape[1], k, k), np.float32, rng)
    ref = conv.conv2d_reference(x_h, w_h)
    return cuda.to_device(x_h), cuda.to_device(w_h), ref, x_h, w_h


def run_checked(launcher, rng, case="odd-HW-K3", tolerance="direct"):
    """Launch into a poisoned, guarded output; check against the reference with the
    version's derived tolerance, and that nothing outside the output was written."""
    x, w, ref, x_h, w_h = problem(rng, *CASES[case])
    tol = (conv.fft_tolerance if tolerance == "fft" else conv.direct_tolerance)(x_h, w_h, ref)
    out = guarded(ref.shape, np.float32)
    launcher(x, w, out.array)
    check(out.array, ref, tol=tol, name=f"{case}")
    out.check_untouched()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("label", VERSIONS)
def test_version_matches_float64_reference(label, case, rng):
    alg = VERSIONS[label]
    run_checked(alg.launcher, rng, case, alg.tolerance)


def test_reference_is_the_definition(rng):
    """The reference against the definition (torch's padding="same": (K-1)//2 before,
    K//2 after), one loop an index, at an even and an odd K."""
    for x_shape, c_out, k in (CASES["even-K4-batch2"], CASES["odd-HW-K3"]):
        x = rng.standard_normal(x_shape)
        w = rng.standard_normal((c_out, x_shape[1], k, k))
        n_b, c_in, h, wd = x_shape
        want = np.zeros((n_b, c_out, h, wd))
        for n, co, y, xx, ci, kh, kw in np.ndindex(n_b, c_out, h, wd, c_in, k, k):
            iy, ix = y + kh - (k - 1) // 2, xx + kw - (k - 1) // 2
            if 0 <= iy < h and 0 <= ix < wd:
                want[n, co, y, xx] += x[n, ci, iy, ix] * w[co, ci, kh, kw]
        np.testing.assert_allclose(conv.conv2d_reference(x, w), want, atol=1e-12)


# ---------------------------------------------------------------- broken kernels


def test_tile_without_halo_fails(rng):
    """v2 loading only its TILE x TILE inputs: the taps past the tile read cells no
    thread wrote."""
    broken = mutant(
        conv.make_conv2d_smem_tile,
        ("for yy in range(ty, HALO, TILE)", "for yy in range(ty, TILE, TILE)"),
        ("for xx in range(tx, HALO, TILE)", "for xx in range(tx, TILE, TILE)"),
    )(conv.TILE, 3)
    with pytest.raises(FAILS):
        run_checked(partial(conv.conv_smem_tile, kernel=broken), rng)


@pytest.mark.skipif(
    not is_simulator(), reason="a stale read needs warps out of step: the race detector finds it"
)
def test_tile_without_barrier_races(rng):
    broken = mutant(
        conv.make_conv2d_smem_tile, ("cuda.syncthreads()  # the halo comes from", "# the halo")
    )(conv.TILE, 3)
    with pytest.raises(RACES):
        run_checked(partial(conv.conv_smem_tile, kernel=broken), rng)


def test_flipped_kernel_fails(rng):
    """Convolution instead of cross-correlation: the kernel read flipped."""
    broken = mutant(conv.conv2d_direct, ("w[co, ci, kh, kw]", "w[co, ci, k - 1 - kh, k - 1 - kw]"))
    with pytest.raises(CheckError):
        run_checked(partial(conv.conv_direct, kernel=broken), rng)


def test_fft_without_conjugate_fails(rng):
    """X W instead of X conj(W): the FFT version's convolution, not correlation."""
    broken = mutant(conv.spectral_mac, ("wf[o, c, f].conjugate()", "wf[o, c, f]"))
    with pytest.raises(CheckError):
        run_checked(partial(conv.conv_fft, mac=broken), rng, tolerance="fft")


# ---------------------------------------------------------------- bad inputs


def _bad_inputs():
    """(name, x, w, out, error, message) that every version must refuse."""
    x_h = np.ones((1, 2, 5, 7), np.float32)
    x = cuda.to_device(x_h)
    w = cuda.to_device(np.ones((3, 2, 3, 3), np.float32))
    out = cuda.device_array((1, 3, 5, 7), np.float32)
    return [
        ("host x", x_h, w, out, TypeError, "host"),
        ("float64 x", cuda.to_device(x_h.astype(np.float64)), w, out, TypeError, "float32"),
        ("3-D x", cuda.to_device(x_h[0]), w, out, ValueError, "4-D"),
        ("strided x", cuda.to_device(np.ones((1, 2, 5, 14), np.float32))[:, :, :, ::2], w, out,
         ValueError, "C-contiguous"),
        ("channels", x, cuda.to_device(np.ones((3, 1, 3, 3), np.float32)), out, ValueError,
         "input channels"),
        ("K > image", x, cuda.to_device(np.ones((3, 2, 6, 6), np.float32)), out, ValueError,
         "larger than"),
        ("not square", x, cuda.to_device(np.ones((3, 2, 3, 1), np.float32)), out, ValueError,
         "square"),
        ("out shape", x, w, cuda.device_array((1, 3, 7, 5), np.float32), ValueError,
         "out must be"),
        ("host out", x, w, np.zeros((1, 3, 5, 7), np.float32), TypeError, "host"),
    ]  # fmt: skip


@pytest.mark.parametrize("label", VERSIONS)
def test_bad_inputs_raise_before_any_launch(label):
    launcher = VERSIONS[label].launcher
    for name, x, w, out, error, message in _bad_inputs():
        with recording_launches() as launches, pytest.raises(error, match=message):
            launcher(x, w, out)
        assert not launches, f"{label}: {name} launched {[f.__name__ for f, *_ in launches]}"


def test_version_limits_raise_before_any_launch(monkeypatch):
    """v2: K > SMEM_MAX_K; v3: the im2col matrix over budget; v4: K > 15."""
    big = conv.SMEM_MAX_K + 1
    monkeypatch.setattr(conv, "IM2COL_BUDGET_BYTES", 4 * 2 * 9 * 35 - 1)
    cases = [
        (conv.conv_smem_tile, big, 1, "shared memory"),
        (conv.conv_im2col, 3, 2, "GiB"),
        (conv.conv_implicit_gemm, 16, 1, "K = 16 > 15"),
    ]
    for launcher, k, c, message in cases:
        h = max(k, 5)
        x = cuda.device_array((1, c, h, h + 2), np.float32)
        w = cuda.device_array((1, c, k, k), np.float32)
        out = cuda.device_array((1, 1, h, h + 2), np.float32)
        with recording_launches() as launches, pytest.raises(ValueError, match=message):
            launcher(x, w, out)
        assert not launches
    for alg in conv.ALGORITHMS:  # the crossover skips the same problems
        assert (alg.limit((1, 1, big, big), big) is None) == (alg.number in (1, 5))


# ---------------------------------------------------------------- cuDNN's pick

CUDNN_NAMES = {
    "void fft2d_r2c_32x32<float, bool=0, unsigned int=1, bool=0>(float2*, float const*)": "FFT",
    "maxwell_scudnn_winograd_128x128_ldg1_ldg4_relu_tile418n_nt": "Winograd",
    "void cudnn::detail::implicit_convolve_sgemm<float, float, int=128, int=5>(int, int)": (
        "implicit GEMM"
    ),
    "volta_scudnn_128x64_relu_interior_nn_v1": "implicit precomp GEMM",
    "sm90_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize64x32x8": (
        "implicit precomp GEMM"
    ),
    "void cudnn::detail::explicit_convolve_sgemm<float, int, int=512>(int, int)": (
        "GEMM (explicit im2col)"
    ),
    "void conv2d_grouped_direct_kernel<float, float>(cudnnTensorStruct)": "direct",
}


@pytest.mark.parametrize("name", CUDNN_NAMES)
def test_cudnn_kernel_names_classified(name):
    helper = "void nchwToNhwcKernel<float, float, float, bool=1, bool=0>(int, int)"
    assert tools.classify_cudnn_kernels([helper, name]) == CUDNN_NAMES[name]


def test_cudnn_transform_kernels_decide_over_their_gemm():
    """FFT runs a cgemm for its products, non-fused Winograd an sgemm: still FFT/Winograd."""
    fft_call = ["volta_cgemm_32x32_tn", "void fft2d_c2r_32x32<float, bool=0>(float*)"]
    assert tools.classify_cudnn_kernels(fft_call) == "FFT"
    wino = ["volta_sgemm_128x64_nn", "void winogradForwardData4x4<float, float>(int)"]
    assert tools.classify_cudnn_kernels(wino) == "Winograd"
    assert tools.classify_cudnn_kernels(["void at::native::fill_kernel(float)"]) == "none"
    assert tools.classify_cudnn_kernels(["mystery_kernel"]) == "other"


# ---------------------------------------------------------------- the script


def test_fft_shape_holds_the_linear_correlation():
    for h, w, k in [(5, 7, 3), (2048, 2048, 128), (8, 8, 1), (9, 1, 1)]:
        p, q = conv.fft_shape(h, w, k)
        assert p >= h + k - 1 and q >= w + k - 1 and p & (p - 1) == 0 and q & (q - 1) == 0
        assert p < 2 * (h + k - 1) and q < 2 * (w + k - 1)


def test_capstone_problems_follow_the_network():
    problems = conv.capstone_problems()
    conv1 = [p for p in problems if p[0].startswith("conv1")]
    conv2 = [p for p in problems if p[0].startswith("conv2")]
    assert conv1 and len(conv1) == len(conv2)
    for (_, x1, c1, k1), (_, x2, _, k2) in zip(conv1, conv2):
        assert x2[1] == c1 and x2[2:] == (x1[2] // 2, x1[3] // 2) and k1 == k2


def test_main_writes_json_and_plot(tmp_path, capsys):
    conv.main(["--out", str(tmp_path), "--parts", "crossover,claim", "--kernel-sizes", "3"])
    payload = json.loads((tmp_path / "convolution.json").read_text())
    (row,) = payload["meta"]["crossover"]
    assert row["k"] == 3 and set(row["ms"]) | set(row["skipped"]) >= set(VERSIONS)
    assert payload["meta"]["claim"]["claimed"] == conv.CLAIMED_RATIO
    names = {r["name"] for r in payload["results"]}
    assert {f"{label} K=3" for label in VERSIONS} <= names
    assert (tmp_path / "convolution_crossover.png").stat().st_size > 0
    assert "claim" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--image", "0"], ["--repeats", "0"], ["--kernel-sizes", "3,0"], ["--kernel-sizes", "x"]],
)
def test_main_refuses_bad_options_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as e:
        conv.main(argv)
    assert e.value.code == 2 and "error: argument" in capsys.readouterr().err
