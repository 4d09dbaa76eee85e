"""Chapter 07: libraries through torch, FFT convolution, reproducible RNG, interop."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches

import numpy as np
import pytest
import torch
from mutants import mutant
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
    _check_matmul_refuses_bad_operands(fn, rng)


def _check_matmul_refuses_bad_operands(fn, rng):
    """Each bad operand is refused before any work: c stays poisoned."""

    def dev(shape, dtype=np.float32):
        return cuda.to_device(random_array(shape, dtype, rng))

    bad = [
        (TypeError, "float32", (dev((2, 2), np.float64), dev((2, 2)))),  # float64 a
        (TypeError, "host", (random_array((2, 2), np.float32, rng), dev((2, 2)))),  # NumPy a
        (ValueError, "2-D", (dev(4), dev((2, 2)))),  # 1-D a: a vector, not (M, K)
        (ValueError, "2-D", (dev((2, 2)), dev((1, 2, 2)))),  # 3-D b: a batch, not (K, N)
        (ValueError, "chain", (dev((2, 3)), dev((2, 2)))),  # K of a != K of b
    ]
    for error, match, (a, b) in bad:
        out = guarded((2, 2), np.float32)
        with pytest.raises(error, match=match):
            fn(a, b, out.array)
        assert np.isnan(out.array.copy_to_host()).all(), (
            "c written before the operands were checked"
        )
    with pytest.raises(ValueError, match="2-D"):  # 3-D c
        fn(dev((2, 2)), dev((2, 2)), cuda.device_array((1, 2, 2), np.float32))


def check_fft_convolve_1d(fn, rng):
    for n, m in [(1, 1), (17, 5), (5, 17), (int(rng.integers(2, 300)), int(rng.integers(1, 50)))]:
        x = random_array(n, np.float32, rng)
        h = random_array(m, np.float32, rng)
        y = fn(torch.from_numpy(x), torch.from_numpy(h))
        assert tuple(y.shape) == (n + m - 1,)
        # The docstring promises float32: a version that computes in float64 is
        # more accurate and passes the value check, so only this catches it.
        assert y.dtype == torch.float32, f"result is {y.dtype}, the docstring promises float32"
        check(y, np.convolve(x.astype(np.float64), h), tol=1e-5, name=f"n={n} m={m}")
    x, h = (torch.from_numpy(random_array(k, np.float32, rng)) for k in (5, 3))
    for error, match, args in [
        (ValueError, "non-empty", (torch.zeros(0), h)),  # empty x
        (ValueError, "non-empty", (x, torch.zeros(0))),  # empty h
        (ValueError, "1-D", (x.reshape(1, 5), h)),  # 2-D x: a batch of one signal
        (ValueError, "1-D", (x, h.reshape(1, 1, 3))),  # 3-D h
        (ValueError, "1-D", (x[0], h)),  # 0-D x: a scalar
        (TypeError, "float32", (x.double(), h)),  # float64 x would make a float64 result
    ]:
        with pytest.raises(error, match=match):
            fn(*args)


def uniform_reference(n, seed):
    """Element i = the first float32 draw of generator state i (xoroshiro128+:
    output s0 + s1, top 53 bits scaled to [0, 1), rounded to float32), on the host."""
    from numba.cuda.random import create_xoroshiro128p_states

    states = create_xoroshiro128p_states(n, seed=seed).copy_to_host()
    with np.errstate(over="ignore"):  # uint64 addition wraps, as on the GPU
        x = states["s0"] + states["s1"]
    return ((x >> np.uint64(11)).astype(np.float64) * 2.0**-53).astype(np.float32)


# numba.cuda.random's states, from Numba's own host set-up (compiled for the CPU):
# (seed, n, subsequence_start) -> [(s0, s1) of state i]. SplitMix64(0)'s first
# output is 0xE220A8397B1DCDAF, as in its reference C code.
NUMBA_STATES = {
    (0, 2, 0): [
        (0xE220A8397B1DCDAF, 0xE220A8397B1DCDAF),
        (0x12513CE25BE05EB1, 0x70D189C276BA17A4),
    ],
    (7, 3, 0): [
        (0x63CBE1E459320DD7, 0x63CBE1E459320DD7),
        (0x081EF7A3B2B2C321, 0x10891EB18B0BA67C),
        (0xDFEBDF22D32720EB, 0x18B031B2E4DADD36),
    ],
    (42, 3, 2): [
        (0xA67324E5ECCCB8DC, 0x4A81BBD6C315729E),
        (0xEF6261E44FD8ABC9, 0x0C6EBFA4759A0F22),
        (0x965712E7AC28B9B1, 0xC5FDD9C6A44F58A6),
    ],
    (2**64 - 1, 2, 1): [
        (0xF06E5493D9197688, 0x5D1905E55C940204),
        (0x451FC10B7CD06B84, 0xC2C48037AD7BEC7F),
    ],
}


@pytest.mark.parametrize("seed, n, start", list(NUMBA_STATES))
def test_simulator_rng_states_are_numbas(seed, n, start):
    # In the simulator the states come from Python ints (common.internal.simulator,
    # _install_fast_rng_states) instead of Numba's object-mode set-up: the same ones.
    from numba.cuda.random import create_xoroshiro128p_states

    states = create_xoroshiro128p_states(n, seed=seed, subsequence_start=start).copy_to_host()
    assert [(int(a), int(b)) for a, b in zip(states["s0"], states["s1"])] == NUMBA_STATES[
        seed, n, start
    ]


def check_random_uniform(fn, rng):
    # 65..95: never a multiple of either block (32 or 64), 2 and 3 blocks; ~1 s of
    # simulator per 50 (the old 40..130 drew 64, 96 and 128 at times)
    n = 64 + int(rng.integers(1, 32))
    with float32_pure_launches():  # a float64 draw stored as float32 looks just as random
        a = fn(n, seed=7, block=64)
    b = fn(n, seed=7, block=32)
    assert a.dtype == np.float32, f"result is {a.dtype}, the docstring promises float32"
    assert a.shape == (n,)
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


def test_float64_convolution_fails(rng):
    sol = load_chapter_module(CHAPTER, "solutions")

    def float64_result(x, h):  # right values, computed and returned in float64
        return sol.fft_convolve_1d(x, h).double()

    sol.fft_convolve_1d(torch.ones(2), torch.ones(2))  # the solution itself is fine
    with pytest.raises(AssertionError, match="promises float32"):
        check_fft_convolve_1d(float64_result, rng)


def test_fft_convolve_without_rank_check_fails(rng):
    def no_rank_check(x, h):  # a 2-D x passes: torch.fft transforms its last axis
        if x.numel() == 0 or h.numel() == 0:
            raise ValueError("x and h must be non-empty")
        n = x.shape[-1] + h.shape[-1] - 1
        return torch.fft.irfft(torch.fft.rfft(x, n=n) * torch.fft.rfft(h, n=n), n=n)

    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_fft_convolve_1d(no_rank_check, rng)


def test_float64_draws_fail(rng):
    sol = load_chapter_module(CHAPTER, "solutions")

    def float64_result(n, seed, block=128):  # the same numbers, returned as float64
        return sol.random_uniform(n, seed, block).astype(np.float64)

    with pytest.raises(AssertionError, match="promises float32"):
        check_random_uniform(float64_result, rng)


def test_matmul_without_rank_check_fails(rng):
    sol = load_chapter_module(CHAPTER, "solutions")

    def no_rank_check(a, b, c):  # checks the dtypes, not the ranks: torch gets a 1-D a
        from common.checking import require_device_array

        for name, x in (("a", a), ("b", b), ("c", c)):
            require_device_array(x, name, dtype=np.float32)
        torch.matmul(sol.as_torch(a), sol.as_torch(b), out=sol.as_torch(c))

    # torch's own error (RuntimeError: shapes cannot be multiplied) is not the
    # clear ValueError the check asks for, so the check fails.
    with pytest.raises(RuntimeError):
        _check_matmul_refuses_bad_operands(no_rank_check, rng)


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
    c = cb.transpose_trick(a, b)
    assert c.dtype == np.float32, f"result is {c.dtype}, the docstring promises a's dtype"
    check(c, a.astype(np.float64) @ b, tol=1e-6)


# A wrong-rank operand for every chapter-script function that takes arrays, and
# the error it must raise before any work: (script, function, operand shapes,
# operands on the device?, error, message). Without the check, a 2-D x makes
# dft_by_hand transform its columns and a 1-D a makes transpose_trick return
# a vector, silently.
SCRIPT_BAD_INPUTS = [
    ("cublas", "transpose_trick", [(5,), (5, 3)], False, ValueError, "a must be 2-D"),
    ("cublas", "transpose_trick", [(5, 3), (1, 3, 7)], False, ValueError, "b must be 2-D"),
    ("cublas", "transpose_trick", [(5, 3), (4, 7)], False, ValueError, "chain"),
    ("fft_conv", "dft_by_hand", [(4, 2)], False, ValueError, "1-D"),
    ("fft_conv", "dft_by_hand", [()], False, ValueError, "1-D"),
    ("fft_conv", "conv1d_direct_launch", [(4, 2), (3,), (10,)], True, ValueError, "x must be 1-D"),
    ("fft_conv", "conv1d_direct_launch", [(8,), (3,), (2, 5)], True, ValueError, "y must be 1-D"),
    ("fft_conv", "conv1d_direct_launch", [(8,), (3,), (9,)], True, ValueError, "10 elements"),
    ("fft_conv", "conv1d_direct_launch", [(8,), (3,), (10,)], False, TypeError, "host"),
    ("cudnn_conv", "conv2d_reference", [(2, 5, 5), (2, 2, 3, 3)], False, ValueError, "NCHW"),
    (
        "cudnn_conv",
        "conv2d_direct_launch",
        [(2, 5, 5), (2, 2, 3, 3), (1, 2, 3, 3)],
        True,
        ValueError,
        "x must be 4-D",
    ),
    (
        "cudnn_conv",
        "conv2d_direct_launch",
        [(1, 2, 5, 5), (2, 2, 3, 3), (2, 3, 3)],
        True,
        ValueError,
        "y must be 4-D",
    ),
    (
        "cudnn_conv",
        "conv2d_direct_launch",
        [(1, 2, 5, 5), (2, 2, 3, 3), (1, 2, 5, 5)],
        True,
        ValueError,
        r"y \(N, K, H-R\+1",
    ),
]


def check_refuses(fn, shapes, on_device, error, match, rng):
    args = [random_array(s, np.float32, rng) for s in shapes]
    if on_device:
        args = [cuda.to_device(a) for a in args]
    with pytest.raises(error, match=match):
        fn(*args)


@pytest.mark.parametrize(
    "script, name, shapes, on_device, error, match",
    SCRIPT_BAD_INPUTS,
    ids=[f"{c[1]}-{i}" for i, c in enumerate(SCRIPT_BAD_INPUTS)],
)
def test_script_functions_refuse_bad_operands(script, name, shapes, on_device, error, match, rng):
    fn = getattr(load_chapter_module(CHAPTER, script), name)
    check_refuses(fn, shapes, on_device, error, match, rng)


# The functions as they were before their rank checks: each returns silently.
@pytest.mark.parametrize(
    "script, name, edits, shapes",
    [
        ("fft_conv", "dft_by_hand", [("if x.ndim != 1 or", "if")], [(4, 2)]),
        (
            "cublas",
            "transpose_trick",
            [("if x.ndim != 2:", "if False:"), ("if a.shape[1] != b.shape[0]:", "if False:")],
            [(5,), (5, 3)],
        ),
    ],
)
def test_wrong_rank_check_catches_missing_rank_check(script, name, edits, shapes, rng):
    fn = mutant(getattr(load_chapter_module(CHAPTER, script), name), *edits)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_refuses(fn, shapes, False, ValueError, "2-D|1-D", rng)


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
