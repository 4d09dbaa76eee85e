"""Chapter 3: flat indices, strides, ceil_div and a float32-pure kernel; broken
versions that must fail the checks; the chapter scripts at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div
from common.checking import CheckError, guarded, hostile_sizes, random_array
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches

import math
import re

import numba
import numpy as np
import pytest
from numba import cuda

CHAPTER = "03_python_for_kernels"
# float64 arithmetic in LLVM IR (the CPython wrapper only converts, it never computes).
F64_ARITHMETIC = re.compile(
    r"= (fadd|fsub|fmul|fdiv|frem|fneg)( \w+)* double|call( \w+)* double @llvm\."
)


def check_flat_index(flat_index, unflat_index, rng):
    shapes = [
        (1, 1),
        (1, 7),
        (7, 1),
        (5, 9),
        tuple(int(v) for v in rng.integers(1, 1000, 2)),
        (70_000, 70_000),
    ]  # flat indices past 2**32: Python ints, no overflow
    for nrows, ncols in shapes:
        for i, j in {
            (0, 0),
            (nrows - 1, ncols - 1),
            (nrows - 1, 0),
            (0, ncols - 1),
            (int(rng.integers(nrows)), int(rng.integers(ncols))),
        }:
            expected = int(np.ravel_multi_index((i, j), (nrows, ncols)))
            got = flat_index(i, j, ncols)
            if got != expected:
                raise CheckError(f"flat_index({i}, {j}, {ncols}) = {got}, expected {expected}")
            back = unflat_index(expected, ncols)
            if tuple(back) != (i, j):
                raise CheckError(f"unflat_index({expected}, {ncols}) = {back}, expected {(i, j)}")


def check_byte_offset(byte_offset, rng):
    base = rng.standard_normal((6, 10, 4)).astype(np.float32)
    views = [
        base,
        base.transpose(2, 0, 1),
        base[1:, ::3, 1:],
        base[::2].swapaxes(0, 1),
        base.astype(np.float64)[:, 2, ::2],
        base[:, :, 0],
    ]
    for v in views:
        raw = np.frombuffer(v.base if v.base is not None else v, dtype=np.uint8)
        start = v.__array_interface__["data"][0] - raw.__array_interface__["data"][0]
        for _ in range(5):
            idx = tuple(int(rng.integers(d)) for d in v.shape)
            off = byte_offset(idx, v.strides)
            got = raw[start + off : start + off + v.itemsize].view(v.dtype)[0]
            if got != v[idx]:
                raise CheckError(
                    f"byte_offset({idx}, {v.strides}) = {off} points at {got}, "
                    f"not at v{list(idx)} = {v[idx]}"
                )


def check_ceil_div(ceil_div, rng):
    cases = [
        (0, 1),
        (1, 1),
        (1, 256),
        (255, 256),
        (256, 256),
        (257, 256),
        (10**6, 7),
        (2**53 + 1, 1),
        (2**60 + 1, 2**30),
    ]  # float division rounds these wrong
    cases += [
        (int(a), int(b)) for a, b in zip(rng.integers(0, 10**9, 20), rng.integers(1, 2000, 20))
    ]
    for a, b in cases:
        expected = -(-a // b)
        got = ceil_div(a, b)
        if got != expected:
            raise CheckError(f"ceil_div({a}, {b}) = {got}, expected {expected}")
    with pytest.raises(ValueError):
        ceil_div(5, 0)


def check_float32_pure(horner, rng):
    """horner(np.float32) must return float32 and contain no float64 arithmetic."""
    horner(np.float32(1.0))  # a skip if not attempted yet
    jitted = numba.njit(horner)
    jitted(np.float32(1.5))
    sig = jitted.signatures[0]
    ret = jitted.overloads[sig].signature.return_type
    if ret != numba.float32:
        raise CheckError(f"{horner.__name__}(float32) returns {ret}: a float64 crept in")
    f64 = F64_ARITHMETIC.findall(jitted.inspect_llvm(sig))
    if f64:
        raise CheckError(
            f"{horner.__name__} does {len(f64)} float64 operations "
            "(a bare Python float literal? use np.float32 constants)"
        )


COEFFS = (
    0.5,
    -1.25,
    2.0,
    -3.0,
)  # p(x) = 0.5 x^3 - 1.25 x^2 + 2 x - 3 = (x - 2)(0.5 x^2 - 0.25 x + 1.5)


def poly_reference(x):
    x = x.astype(np.float64)
    return ((COEFFS[0] * x + COEFFS[1]) * x + COEFFS[2]) * x + COEFFS[3]


def horner_error_bound(x):
    """Largest error of float32 Horner's rule for p at x (float64, elementwise).

    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. (5.3):
    |fl(p(x)) - p(x)| <= gamma_2n * sum |a_i| |x|^i with n = 3, gamma_6 ~ 6u (u the
    float32 unit roundoff); doubled for the final rounding and an FMA-contracted GPU
    build. A relative error against |p(x)| cannot be used: p has a root at x = 2,
    where |p(x)| is far below that bound, and a one-element draw near 2 failed a
    correct kernel about one seed in fifty.
    """
    ax = np.abs(x.astype(np.float64))
    terms = ((abs(COEFFS[0]) * ax + abs(COEFFS[1])) * ax + abs(COEFFS[2])) * ax + abs(COEFFS[3])
    return 12 * (np.finfo(np.float32).eps / 2) * terms


def check_poly_f32(poly_f32, rng):
    with float32_pure_launches():  # no float64 in the kernel nor in what it calls
        for threads in (32, 128):
            for n in hostile_sizes(threads, rng) + [2 * threads]:
                x = random_array(n, rng=rng, low=-3, high=3)
                out = guarded(n)
                poly_f32(cuda.to_device(x), out.array, threads_per_block=threads)
                got = out.array.copy_to_host().astype(np.float64)
                ref = poly_reference(x)
                bad = ~(np.abs(got - ref) <= horner_error_bound(x))  # NaN counts as bad
                if bad.any():
                    i = int(np.argmax(bad))
                    raise CheckError(
                        f"poly_f32 n={n} block={threads}: {int(bad.sum())} of {n} elements "
                        f"beyond float32 rounding; first at {i}: p({x[i]!r}) = {ref[i]!r}, got "
                        f"{got[i]!r}" + (" (never written?)" if np.isnan(got[i]) else "")
                    )
                out.check_untouched("poly_f32")


# exercise function -> its check; each runs on solutions.py and on exercises.py
# (select one with -k, e.g. -k "ceil_div and learner").
CHECKS = {
    "byte_offset": check_byte_offset,
    "ceil_div": check_ceil_div,
    "poly_f32": check_poly_f32,
}


@pytest.mark.parametrize("impl", implementations(CHAPTER))
@pytest.mark.parametrize("exercise", CHECKS)
def test_exercise(exercise, impl, rng):
    CHECKS[exercise](getattr(impl, exercise), rng)


# Two exercises whose checks take more than one function:


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_flat_index(impl, rng):
    check_flat_index(impl.flat_index, impl.unflat_index, rng)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_horner_is_float32_pure(impl, rng):
    impl.horner_f32(np.float32(1.0))  # a skip if not attempted yet
    check_float32_pure(impl.module.horner_f32, rng)  # the plain function, for numba.njit


def test_poly_f32_rejects_float64():
    sol = load_chapter_module(CHAPTER, "solutions")
    x = cuda.to_device(np.ones(4))
    with pytest.raises(TypeError, match="float32"):
        sol.poly_f32(x, x)


# ------------------------------------------------------------------ broken versions must fail


def _horner_promoted(x):
    return ((0.5 * x - 1.25) * x + 2.0) * x - 3.0  # bare literals: float64


def _horner_cast_back(x):
    return np.float32(((0.5 * x - 1.25) * x + 2.0) * x - 3.0)  # float32 result, float64 math


@pytest.mark.parametrize("broken", [_horner_promoted, _horner_cast_back])
def test_float64_promotion_is_caught(broken, rng):
    with pytest.raises(CheckError):
        check_float32_pure(broken, rng)


@cuda.jit
def _poly_kernel_bare_literals(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ((0.5 * x[i] - 1.25) * x[i] + 2.0) * x[i] - 3.0  # bare literals: float64


def _poly_f32_bare_literals(x, out, threads_per_block=128):
    _poly_kernel_bare_literals[ceil_div(out.size, threads_per_block), threads_per_block](x, out)


def test_poly_kernel_with_bare_literals_fails(rng):
    # Right values (the simulator stores float32 anyway), float64 arithmetic: the
    # check names the line.
    with pytest.raises(
        CheckError,
        match=r"_poly_kernel_bare_literals.*\n.*line \d+ of "
        r"test_ch03_python_for_kernels.py: `out\[i\] = \(\(0.5 .*literal 0.5",
    ):
        check_poly_f32(_poly_f32_bare_literals, rng)


def test_broken_index_helpers_fail(rng):
    with pytest.raises(CheckError):  # column-major by mistake
        check_flat_index(lambda i, j, ncols: j * ncols + i, lambda k, ncols: divmod(k, ncols), rng)
    with pytest.raises(CheckError):  # assumes contiguity: ignores the strides
        check_byte_offset(lambda idx, strides: sum(idx) * 4, rng)
    with pytest.raises(CheckError):  # float division: wrong above 2**53
        check_ceil_div(lambda a, b: math.ceil(a / b) if b else 1 // b, rng)
    with pytest.raises(CheckError):  # floor instead of ceil
        check_ceil_div(lambda a, b: a // b if b else 1 // b, rng)


# The chapter's scripts run once, in tests/test_scripts_simulator_output.py.


def test_float64_promotion_typing():
    script = load_chapter_module(CHAPTER, "float64_promotion")
    assert dict(script.typing_report()) == {"step_promoted": "float64", "step_f32": "float32"}
