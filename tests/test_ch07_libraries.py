"""Chapter 07: libraries through torch, FFT convolution, reproducible RNG, interop."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches

import numpy as np
import pytest
import torch
from numba import cuda

CHAPTER = "07_libraries"


def check_matmul_torch_zero_copy(fn, rng):
    for m, n, k in [(17, 13, 9), (1, 1, 1), tuple(int(x) for x in rng.integers(2, 30, 3))]:
        a_h = random_array((m, k), np.float32, rng)
        b_h = random_array((k, n), np.float32, rng)
        out = guarded((m, n), np.float32)
        fn(cuda.to_device(a_h), cuda.to_device(b_h), out.array)
        check(out.array, a_h.astype(np.float64) @ b_h, tol=1e-5, name=f"{m}x{n}x{k}")
        out.check_untouched()
    with pytest.raises(TypeError):
        fn(
            cuda.to_device(np.ones((2, 2))),
            cuda.to_device(np.ones((2, 2), np.float32)),
            cuda.device_array((2, 2), np.float32),
        )
    with pytest.raises(ValueError):
        fn(
            cuda.to_device(np.ones((2, 3), np.float32)),
            cuda.to_device(np.ones((2, 2), np.float32)),
            cuda.device_array((2, 2), np.float32),
        )


def check_fft_convolve_1d(fn, rng):
    for n, m in [(1, 1), (17, 5), (5, 17), (int(rng.integers(2, 300)), int(rng.integers(1, 50)))]:
        x = random_array(n, np.float32, rng)
        h = random_array(m, np.float32, rng)
        y = fn(torch.from_numpy(x), torch.from_numpy(h))
        assert tuple(y.shape) == (n + m - 1,)
        check(y, np.convolve(x.astype(np.float64), h), tol=1e-5, name=f"n={n} m={m}")
    with pytest.raises(ValueError):
        fn(torch.zeros(0), torch.ones(3))


def uniform_reference(n, seed):
    """Element i = the first float32 draw of generator state i (xoroshiro128+:
    output s0 + s1, top 53 bits scaled to [0, 1), rounded to float32), on the host."""
    from numba.cuda.random import create_xoroshiro128p_states

    states = create_xoroshiro128p_states(n, seed=seed).copy_to_host()
    with np.errstate(over="ignore"):  # uint64 addition wraps, as on the GPU
        x = states["s0"] + states["s1"]
    return ((x >> np.uint64(11)).astype(np.float64) * 2.0**-53).astype(np.float32)


def check_random_uniform(fn, rng):
    n = int(rng.integers(50, 300))
    with float32_pure_launches():  # a float64 draw stored as float32 looks just as random
        a = fn(n, seed=7, block=64)
    b = fn(n, seed=7, block=32)
    assert a.dtype == np.float32 and a.shape == (n,)
    # Exactly each thread's own first draw: one state shared by all threads gives
    # distinct, plausible numbers too (each thread advances it), so only this tells.
    check(a, uniform_reference(n, 7), tol=0, name="element i: first draw of state i")
    check(b, a, tol=0, name="same seed, other block")  # bit-identical
    assert np.all((a >= 0) & (a < 1))
    assert len(np.unique(a)) > 0.95 * n, "threads drew the same numbers"
    assert not np.array_equal(a, fn(n, seed=8)), "the seed is ignored"
    assert abs(a.mean() - 0.5) < 0.15
    with pytest.raises(ValueError):
        fn(0, seed=1)


# exercise function -> its check; each runs on solutions.py and on exercises.py
# (select one with -k, e.g. -k "fft_convolve_1d and learner").
CHECKS = {
    "matmul_torch_zero_copy": check_matmul_torch_zero_copy,
    "fft_convolve_1d": check_fft_convolve_1d,
    "random_uniform": check_random_uniform,
}


@pytest.mark.parametrize("impl", implementations(CHAPTER))
@pytest.mark.parametrize("exercise", CHECKS)
def test_exercise(exercise, impl, rng):
    CHECKS[exercise](getattr(impl, exercise), rng)


# ---------------------------------------------------- wrong answers must fail


def test_matmul_with_a_copy_fails(rng):
    def copies(a, b, c):  # computes the right numbers into a copy: c never changes
        torch.matmul(torch.from_numpy(a.copy_to_host()), torch.from_numpy(b.copy_to_host()))

    with pytest.raises(CheckError):
        check_matmul_torch_zero_copy(copies, rng)


def test_circular_convolution_fails(rng):
    def circular(x, h):  # no zero padding: the tail wraps around onto the head
        n = max(x.numel(), h.numel())
        return torch.fft.irfft(torch.fft.rfft(x, n=n) * torch.fft.rfft(h, n=n), n=n)

    with pytest.raises((CheckError, AssertionError)):
        check_fft_convolve_1d(circular, rng)


def test_one_state_for_all_threads_fails(rng):
    sol = load_chapter_module(CHAPTER, "solutions")
    from numba.cuda.random import create_xoroshiro128p_states, xoroshiro128p_uniform_float32

    @cuda.jit
    def shared_state(states, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = xoroshiro128p_uniform_float32(states, 0)  # every thread: state 0

    def bad(n, seed, block=128):
        if n < 1:
            raise ValueError
        st = create_xoroshiro128p_states(n, seed=seed)
        out = cuda.device_array(n, np.float32)
        shared_state[(n + block - 1) // block, block](st, out)
        return out.copy_to_host()

    assert sol.random_uniform(5, seed=1) is not None
    with pytest.raises((CheckError, AssertionError)):
        check_random_uniform(bad, rng)


# ------------------------------------------------------------- chapter scripts


@pytest.mark.parametrize("script", ["cublas", "fft_conv", "rng", "interop", "cudnn_conv"])
def test_script_main_runs(script, tmp_path):
    mod = load_chapter_module(CHAPTER, script)
    argv = [] if script == "rng" else ["--out", str(tmp_path)]  # rng.py writes no results
    assert mod.main(argv) == 0


def test_dft_by_hand_on_alternating_signal():
    fc = load_chapter_module(CHAPTER, "fft_conv")
    spec = fc.dft_by_hand([1, -1, 1, -1])
    np.testing.assert_allclose(spec, [0, 0, 4, 0], atol=1e-12)


def test_transpose_trick(rng):
    cb = load_chapter_module(CHAPTER, "cublas")
    a, b = random_array((5, 3), np.float32, rng), random_array((3, 7), np.float32, rng)
    check(cb.transpose_trick(a, b), a.astype(np.float64) @ b, tol=1e-6)


def test_requires_grad_is_refused():
    io = load_chapter_module(CHAPTER, "interop")
    with pytest.raises(ValueError, match="detach"):
        io.wrap_for_numba(torch.ones(3, requires_grad=True))


@pytest.mark.gpu
def test_external_stream_ordering():
    io = load_chapter_module(CHAPTER, "interop")
    io.main(["--out", "/tmp/interop_test"])


def test_readme_code_is_the_chapter_code():
    from common.internal.readme_sync import REPO_ROOT, sync_readme

    assert sync_readme(REPO_ROOT / "chapters" / "07_libraries" / "README.md", write=False) == []
