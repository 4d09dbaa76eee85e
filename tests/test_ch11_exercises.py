"""Chapter 11 exercises: hostile checks, run on the solutions and on yours.

Each ``check_*`` takes the exercise's host function and raises (CheckError,
IndexError, AssertionError) on a wrong one. Results are compared with float64
NumPy (numpy.fft for the transforms) by relative L2 error, within the rounding
a float32 computation is allowed: for a radix-2 FFT, Higham's bound (Theorem
24.2 of "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002), about
log2 n roundings; a wrong index, twiddle, sign or term errs by O(1). Sizes: 1, 2,
several powers of two on either side of a block, one row and an odd number of
rows; outputs are poisoned with NaN inside guard cells (a skipped element or a
write past the end fails); the data is fresh every run (``--seed`` replays it).

The ``test_broken_*`` tests prove each check bites: a bit count off by one, a
twiddle with the wrong sign or from an unreduced float32 angle, a wrong twiddle
stride, a missing barrier (the simulator's race detector), a missing conjugate
or channel, a crop off by one, an FFT too short for linear correlation.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import (
    EPS32,
    CheckError,
    check,
    guarded,
    random_array,
    rel_error,
    rounding_tolerance,
)
from common.internal import racecheck
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches
from common.internal.racecheck import RaceError
from common.runtime import is_simulator
from common.targets import recording_launches

import math

import numpy as np
import pytest
from mutants import mutant
from numba import cuda, float32

CHAPTER = "11_fft_and_convolution"
sol = load_chapter_module(CHAPTER, "solutions")
IMPLS = implementations(CHAPTER)
BLOCK = sol.BLOCK
FAILS = (CheckError, IndexError, AssertionError)
# Simulator: the race detector reports a missing barrier on the launch that has it.
RACES = RaceError if is_simulator() and racecheck.ENABLED else FAILS
U = EPS32 / 2  # unit roundoff of float32, 2**-24: a rounding errs by at most this, relatively


# ---------------------------------------------------------------- references and tolerances
def random_complex(shape, rng):
    return (
        random_array(shape, np.float32, rng) + 1j * random_array(shape, np.float32, rng)
    ).astype(np.complex64)


def bit_reversal(n):
    """rev(i) for i < n (n a power of two), as NumPy indices."""
    bits = n.bit_length() - 1
    return np.array([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(n)])


def as_pairs(a):
    """A complex array as float pairs (..., n, 2), last index 0 real and 1 imaginary:
    common.checking measures and reports real arrays."""
    host = a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)
    real = np.float32 if host.dtype == np.complex64 else np.float64
    return np.ascontiguousarray(host).view(real).reshape(*host.shape, 2)


def check_complex(out, ref, tol, name):
    """common.checking.check on complex data (its index's last entry: 0 real, 1 imaginary)."""
    __tracebackhide__ = True
    return check(as_pairs(out), as_pairs(ref.astype(np.complex128)), tol=tol, name=name)


def fft_tolerance(n, mu=U):
    """Relative L2 error allowed to a float32 radix-2 FFT of length n.

    Higham (2002), Theorem 24.2: with twiddles within mu of exact, the computed
    y = fft(x) has ||y_hat - y|| / ||y|| <= L eta / (1 - L eta), L = log2 n and
    eta = mu + gamma_4 (sqrt 2 + mu), gamma_4 = 4u / (1 - 4u). Each of the L
    stages adds one complex product and one sum to every element. Twiddles made in
    float64 and rounded once are within u (mu = u). A worst case: correct kernels
    land 3 to 10 times below it; a wrong twiddle or index errs by O(1).
    """
    levels = n.bit_length() - 1
    gamma4 = 4 * U / (1 - 4 * U)
    eta = mu + gamma4 * (math.sqrt(2) + mu)
    return levels * eta / (1 - levels * eta)


def radix2_stage_reference(x, stage):
    """One decimation-in-time stage of a (batch, n) complex array, in float64, and
    each output's |x[i0]| + |x[i1]|: the size of the terms it was rounded from."""
    x = x.astype(np.complex128)
    n, half = x.shape[1], 1 << stage
    p = np.arange(n // 2)
    j = p % half
    i0 = (p // half) * 2 * half + j
    i1 = i0 + half
    t = np.exp(-2j * np.pi * j / (2 * half)) * x[:, i1]
    out, magnitude = np.empty_like(x), np.empty(x.shape)
    out[:, i0], out[:, i1] = x[:, i0] + t, x[:, i0] - t
    magnitude[:, i0] = magnitude[:, i1] = np.abs(x[:, i0]) + np.abs(x[:, i1])
    return out, magnitude


def correlate_same_reference(x, w):
    """out[b, i] = sum_k w[k] x[b, i + k - (K - 1) // 2], x = 0 outside: in float64."""
    length, taps = x.shape[1], w.size
    left = (taps - 1) // 2
    xp = np.pad(x.astype(np.float64), ((0, 0), (left, taps - 1 - left)))
    return sum(float(w[k]) * xp[:, k : k + length] for k in range(taps))


def conv_tolerance(x, w, ref):
    """Relative L2 error allowed to fft_conv1d: three FFTs of n = next power of two
    >= L + K - 1 and a product, bounded through Higham's Theorem 24.2.

    Per row, |X_f| <= ||x||_1 and ||X|| = sqrt(n) ||x||_2 (Parseval), so the product
    X conj(W) errs by at most e (||x||_1 ||w||_2 + ||w||_1 ||x||_2) sqrt(n), e =
    fft_tolerance(n) (plus sqrt 2 gamma_2 for the product: e covers it), and the
    inverse transform (1 / sqrt(n) in L2) adds as much again: 3 e (...) in all.
    """
    n_fft = sol.next_power_of_two(x.shape[1] + w.size - 1)
    e = max(fft_tolerance(n_fft), fft_tolerance(2))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    l1, l2 = np.abs(x64).sum(axis=1), np.sqrt((x64 * x64).sum(axis=1))
    per_row = 3 * e * (l1 * np.linalg.norm(w64) + np.abs(w64).sum() * l2)
    return float(np.linalg.norm(per_row) / np.linalg.norm(ref))


def sizes_pow2(rng, largest=2 * BLOCK):
    """1, 2, 4, 8, a block and past it, and one random power of two."""
    return [1, 2, 4, 8, BLOCK, largest, 1 << int(rng.integers(4, 7))]


def batches(rng):
    """One row, and an odd number of them."""
    return (1, int(rng.choice([3, 5])))


# ---------------------------------------------------------------- checks
def explain_permutation(got, x, name):
    """Raise CheckError saying which x[b, i] landed in the first wrong out[b, j],
    in binary, and how many elements were never written."""
    __tracebackhide__ = True
    batch, n = x.shape
    bits = max(n.bit_length() - 1, 1)
    rev = bit_reversal(n)
    wrong = np.argwhere(got != x[:, rev])
    if not wrong.size:
        return
    b, j = (int(v) for v in wrong[0])
    held = np.flatnonzero(x[b] == got[b, j])
    what = f"x[{b}, {int(held[0]):0{bits}b}]" if held.size else f"{got[b, j]} (in no x slot)"
    unwritten = int(np.isnan(got.real).sum())
    raise CheckError(
        f"{name}: out[{b}, {j:0{bits}b}] holds {what}, expected x[{b}, {int(rev[j]):0{bits}b}] "
        f"(indices in binary: out[rev(i)] = x[i] reverses all {n.bit_length() - 1} bits of i); "
        f"{len(wrong)} of {x.size} elements wrong, {unwritten} never written (still NaN)"
    )


def check_bit_reverse(fn, rng):
    for n in sizes_pow2(rng):
        for batch in batches(rng):
            x = random_complex((batch, n), rng)
            out = guarded((batch, n), np.complex64)
            fn(cuda.to_device(x), out.array)
            name = f"bit_reverse_permute {batch}x{n}"
            explain_permutation(out.array.copy_to_host(), x, name)
            out.check_untouched(name)


def check_twiddles_componentwise(out, ref, rel, name):
    """Each real and imaginary part within ``rel`` of its own size: float32
    rounding, where the L2 check allows errors as large as the largest part."""
    __tracebackhide__ = True
    host = out.copy_to_host()
    for part, label in ((np.real, "real"), (np.imag, "imag")):
        got, want = part(host).astype(np.float64), part(ref)
        # 1e-15: float64 sin(pi) is 1.2e-16, not 0; a float32 result is 0 or >= 1e-45 off
        allowed = rel * np.abs(want) + 1e-15
        err = np.abs(got - want)
        if np.all(err <= allowed):
            continue
        k = int(np.argmax(err / allowed))
        exact_zero = abs(want[k]) < 1e-15
        expected = "exactly 0" if exact_zero else f"{want[k]:.9g}"
        size = "" if exact_zero else f" ({err[k] / abs(want[k]) / EPS32:.3g} eps32 of its size)"
        raise CheckError(
            f"{name}: out[{k}].{label} = {got[k]:.9g}, expected {expected}: off by "
            f"{err[k]:.3g}{size}, allowed {rel / EPS32:g} eps32 of its size; "
            f"{int((err > allowed).sum())} of {err.size} {label} parts are off. A part near 0 is "
            "accurate only if the angle is: fold theta into [0, pi/4] in integers, then round"
        )


# Folded to [0, pi/4]: the angle rounds twice (pi/4 and the product, 1.5 u), sin and cos
# of it add 1 to 2 ulp (sin_cos_octant; CUDA's sinf/cosf: 2 ulp), each ulp up to 2u of
# the value: under 8u = 4 eps32 of each part's own size. Unfolded, a part near 0 is off
# by the angle's whole error, ~1e-7, millions of eps32 of its size.
TWIDDLE_EPS32 = 4


def check_twiddle_table(fn, rng):
    for n in [2, 4, 8, 2 * BLOCK, 4 * BLOCK, 1024, 1 << int(rng.integers(4, 13))]:
        out = guarded(n // 2, np.complex64)
        fn(n, out.array)
        ref = np.exp(-2j * np.pi * np.arange(n // 2) / n)
        check_complex(out.array, ref, TWIDDLE_EPS32 * EPS32, f"twiddle_table n={n}")  # a sign
        check_twiddles_componentwise(out.array, ref, TWIDDLE_EPS32 * EPS32, f"twiddle_table n={n}")
        out.check_untouched()


def check_radix2_stage(fn, rng):
    """Every stage of a bit-reversed input, each against one float64 stage of its
    own input, then the last against numpy.fft.fft."""
    for n in [2, 4, 8, 4 * BLOCK, 1 << int(rng.integers(4, 7))]:
        for batch in batches(rng):
            x = random_complex((batch, n), rng)
            current = x[:, bit_reversal(n)]
            for stage in range(n.bit_length() - 1):
                out = guarded((batch, n), np.complex64)
                fn(cuda.to_device(current), out.array, stage)
                ref, magnitude = radix2_stage_reference(current, stage)
                # a complex product, a sum and a twiddle rounded once: under 4 eps32
                # of |x0| + |x1| (Higham sec. 3.6)
                tol = rounding_tolerance(
                    as_pairs(ref), np.stack([magnitude, magnitude], axis=-1), 4, 0.0
                )
                check_complex(out.array, ref, tol, f"radix2_stage {batch}x{n} stage {stage}")
                out.check_untouched()
                current = out.array.copy_to_host()
            ref = np.fft.fft(x.astype(np.complex128), axis=1)
            check_complex(current, ref, fft_tolerance(n), f"all stages {batch}x{n} vs numpy.fft")


def check_fft_from_pieces(bit_reverse, stage, rng):
    """Your whole radix-2 FFT: 11.1, then 11.3 for each stage."""
    for n in [1, 2, 8, 2 * BLOCK]:
        for batch in batches(rng):
            x = random_complex((batch, n), rng)
            current = cuda.device_array((batch, n), np.complex64)
            bit_reverse(cuda.to_device(x), current)
            for s in range(n.bit_length() - 1):
                nxt = cuda.device_array((batch, n), np.complex64)
                stage(current, nxt, s)
                current = nxt
            ref = np.fft.fft(x.astype(np.complex128), axis=1)
            check_complex(current, ref, fft_tolerance(n), f"11.1 + 11.3 {batch}x{n}")


def check_fft_stockham(fn, rng):
    for n in sizes_pow2(rng):
        for batch in batches(rng):
            x = random_complex((batch, n), rng)
            ref = np.fft.fft(x.astype(np.complex128), axis=1)
            out = guarded((batch, n), np.complex64)
            fn(cuda.to_device(x), out.array)
            check_complex(out.array, ref, fft_tolerance(n), f"fft_stockham_shared {batch}x{n}")
            out.check_untouched()
    x = random_complex((3, 16), rng)  # in place: out is x
    x_dev = cuda.to_device(x)
    fn(x_dev, x_dev)
    ref = np.fft.fft(x.astype(np.complex128), axis=1)
    check_complex(x_dev, ref, fft_tolerance(16), "fft_stockham_shared in place")


def check_complex_mac(fn, rng):
    shapes = [  # (B, C, O, F)
        (1, 1, 1, 1),
        (3, 5, 2, BLOCK + 3),
        (2, 3, 4, 7),
        (1, 2, 3, 2 * BLOCK),
        tuple(int(v) for v in rng.integers(1, 6, 3)) + (int(rng.integers(1, 2 * BLOCK)),),
    ]
    for b, c, o, f in shapes:
        X, W = random_complex((b, c, f), rng), random_complex((o, c, f), rng)
        ref = np.einsum("bcf,ocf->bof", X.astype(np.complex128), np.conj(W.astype(np.complex128)))
        magnitude = np.einsum("bcf,ocf->bof", np.abs(X.astype(np.complex128)), np.abs(W))
        out = guarded((b, o, f), np.complex64)
        fn(cuda.to_device(X), cuda.to_device(W), out.array)
        # c complex products and c sums: (c + 2) eps32 of sum |X| |W| covers them
        tol = rounding_tolerance(as_pairs(ref), np.stack([magnitude] * 2, -1), c + 2, 1e-6)
        what = f"complex_mac_channels B={b} C={c} O={o} F={f}"
        unconjugated = np.einsum("bcf,ocf->bof", X.astype(np.complex128), W)
        got = out.array.copy_to_host()
        if np.all(np.isfinite(got)) and rel_error(as_pairs(got), as_pairs(unconjugated)) <= tol:
            raise AssertionError(f"{what}: out = sum_c X * W, without the conjugate of W")
        check_complex(out.array, ref, tol, what)
        out.check_untouched()


def check_fft_conv1d(fn, rng):
    cases = [  # (batch, L, K)
        (1, 1, 1),
        (3, 50, 7),
        (1, 3, 8),  # a filter longer than the signal, of even length
        (3, 70, 4),  # n = 128: more than one block of the small kernels
        (2, 33, 32),
        (1, int(rng.integers(1, 60)), int(rng.integers(1, 12))),
    ]
    for batch, length, taps in cases:
        x = random_array((batch, length), np.float32, rng)
        w = random_array(taps, np.float32, rng)
        ref = correlate_same_reference(x, w)
        out = guarded((batch, length), np.float32)
        fn(cuda.to_device(x), cuda.to_device(w), out.array)
        check(out.array, ref, conv_tolerance(x, w, ref), f"fft_conv1d {batch}x{length} K={taps}")
        out.check_untouched()


# ---------------------------------------------------------------- exercise tests
EXERCISES = [  # (the exercise's host function, its check), in the exercises' order
    ("bit_reverse_permute", check_bit_reverse),
    ("twiddle_table", check_twiddle_table),
    ("radix2_stage", check_radix2_stage),
    ("fft_stockham_shared", check_fft_stockham),
    ("complex_mac_channels", check_complex_mac),
    ("fft_conv1d", check_fft_conv1d),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "check_fn"), EXERCISES, ids=[name for name, _ in EXERCISES])
def test_exercise(name, check_fn, impl, rng):
    with float32_pure_launches():
        check_fn(getattr(impl, name), rng)


@pytest.mark.parametrize("impl", IMPLS)
def test_fft_from_your_bit_reversal_and_stages(impl, rng):
    check_fft_from_pieces(impl.bit_reverse_permute, impl.radix2_stage, rng)


def _complex_rows(shape, dtype=np.complex64):
    return cuda.to_device(np.ones(shape, dtype))


def _refusals(impl):
    """(exercise, call, error) triples: each call must raise error before a launch."""
    c8 = _complex_rows
    f4 = cuda.to_device(np.ones((2, 5), np.float32))
    w = cuda.to_device(np.ones(3, np.float32))
    shared = _complex_rows((2, 8))
    return {
        "bit_reverse_permute": [
            (
                lambda: impl.bit_reverse_permute(np.ones((2, 8), np.complex64), c8((2, 8))),
                TypeError,
            ),
            (lambda: impl.bit_reverse_permute(c8((2, 8), np.complex128), c8((2, 8))), TypeError),
            (lambda: impl.bit_reverse_permute(c8((2, 6)), c8((2, 6))), ValueError),
            (lambda: impl.bit_reverse_permute(c8((2, 8)), c8((2, 4))), ValueError),
            (lambda: impl.bit_reverse_permute(c8(8), c8(8)), ValueError),
            (lambda: impl.bit_reverse_permute(shared, shared), ValueError),
            (lambda: impl.bit_reverse_permute(shared[:, :4], shared[:, 2:6]), ValueError),
        ],
        "twiddle_table": [
            (lambda: impl.twiddle_table(6, c8(3)), ValueError),
            (lambda: impl.twiddle_table(1, c8(1)), ValueError),
            (lambda: impl.twiddle_table(1 << 23, c8(1)), ValueError),
            (lambda: impl.twiddle_table(8.0, c8(4)), TypeError),
            (lambda: impl.twiddle_table(8, np.ones(4, np.complex64)), TypeError),
            (lambda: impl.twiddle_table(8, c8(4, np.complex128)), TypeError),
            (lambda: impl.twiddle_table(8, c8(8)), ValueError),
        ],
        "radix2_stage": [
            (lambda: impl.radix2_stage(c8((2, 12)), c8((2, 12)), 0), ValueError),
            (lambda: impl.radix2_stage(c8((2, 8)), c8((2, 8)), 3), ValueError),
            (lambda: impl.radix2_stage(c8((2, 8)), c8((2, 8)), -1), ValueError),
            (lambda: impl.radix2_stage(c8((2, 1)), c8((2, 1)), 0), ValueError),
            (lambda: impl.radix2_stage(np.ones((2, 8), np.complex64), c8((2, 8)), 0), TypeError),
            (lambda: impl.radix2_stage(c8((2, 8), np.complex128), c8((2, 8)), 0), TypeError),
        ],
        "fft_stockham_shared": [
            (lambda: impl.fft_stockham_shared(c8((1, 2048)), c8((1, 2048))), ValueError),
            (lambda: impl.fft_stockham_shared(c8((1, 24)), c8((1, 24))), ValueError),
            (
                lambda: impl.fft_stockham_shared(np.ones((1, 8), np.complex64), c8((1, 8))),
                TypeError,
            ),
            (lambda: impl.fft_stockham_shared(c8((1, 8)), c8((1, 8), np.complex128)), TypeError),
            (lambda: impl.fft_stockham_shared(c8((1, 8)), c8((2, 8))), ValueError),
        ],
        "complex_mac_channels": [
            (
                lambda: impl.complex_mac_channels(c8((2, 3, 5)), c8((4, 2, 5)), c8((2, 4, 5))),
                ValueError,
            ),
            (
                lambda: impl.complex_mac_channels(c8((2, 3, 5)), c8((4, 3, 5)), c8((2, 3, 5))),
                ValueError,
            ),
            (
                lambda: impl.complex_mac_channels(
                    c8((2, 3, 5)), c8((4, 3, 5), np.complex128), c8((2, 4, 5))
                ),
                TypeError,
            ),
            (
                lambda: impl.complex_mac_channels(
                    np.ones((2, 3, 5), np.complex64), c8((4, 3, 5)), c8((2, 4, 5))
                ),
                TypeError,
            ),
        ],
        "fft_conv1d": [
            (lambda: impl.fft_conv1d(np.ones((2, 5), np.float32), w, f4), TypeError),
            (lambda: impl.fft_conv1d(c8((2, 5), np.float64), w, f4), TypeError),
            (lambda: impl.fft_conv1d(f4, np.ones(3, np.float32), f4), TypeError),
            (
                lambda: impl.fft_conv1d(f4, w, cuda.to_device(np.ones((2, 4), np.float32))),
                ValueError,
            ),
            (
                lambda: impl.fft_conv1d(f4, cuda.to_device(np.ones((1, 3), np.float32)), f4),
                ValueError,
            ),
            (
                lambda: impl.fft_conv1d(f4, cuda.to_device(np.ones(8, np.float32))[::2], f4),
                ValueError,
            ),
            (
                lambda: impl.fft_conv1d(
                    cuda.to_device(np.ones((1, 1000), np.float32)),
                    cuda.to_device(np.ones(30, np.float32)),
                    cuda.to_device(np.ones((1, 1000), np.float32)),
                ),
                ValueError,
            ),
        ],
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", [name for name, _ in EXERCISES])
def test_bad_arguments_are_refused_before_any_launch(name, impl):
    for k, (call, error) in enumerate(_refusals(impl)[name]):
        with recording_launches() as launched, pytest.raises(error):
            call()
        assert not launched, (
            f"{name}: bad call {k} launched a kernel before raising {error.__name__}"
        )


# ---------------------------------------------------------------- broken kernels fail
@pytest.mark.parametrize("edit", ["range(bits - 1)", "range(bits + 1)"], ids=["bits-1", "bits+1"])
def test_broken_bit_reversal_with_a_wrong_bit_count_fails(edit, rng, monkeypatch):
    wrong = mutant(sol.bit_reverse_kernel, ("range(bits)", edit))
    monkeypatch.setattr(sol, "bit_reverse_kernel", wrong)
    with pytest.raises(FAILS):
        check_bit_reverse(sol.bit_reverse_permute, rng)


@pytest.mark.parametrize(
    "edit",
    [
        ("out[k] = cplx(c, -s)", "out[k] = cplx(c, s)  # wrong: exp(+i theta)"),
        ("            c = -c\n", "            pass  # wrong: cos keeps its sign past pi/2\n"),
        ("j = 2 * n - j", "j = n - j  # wrong: folded about pi/8"),
    ],
    ids=["sign", "no-flip", "wrong-fold"],
)
def test_broken_twiddle_table_fails(edit, rng, monkeypatch):
    monkeypatch.setattr(sol, "twiddle_kernel", mutant(sol.twiddle_kernel, edit))
    with pytest.raises(FAILS):
        check_twiddle_table(sol.twiddle_table, rng)


TWO_PI = np.float32(2 * np.pi)
cplx = sol.cplx


@cuda.jit
def twiddle_unreduced_kernel(out, n):
    # wrong: a float32 angle up to pi, off by ~1.5 eps32 * theta; cos(pi/2) = -4.4e-8
    k = cuda.grid(1)
    if k < out.size:
        a = TWO_PI * (float32(k) / float32(n))
        out[k] = cplx(math.cos(a), -math.sin(a))


def test_broken_twiddle_table_from_an_unreduced_angle_fails(rng, monkeypatch):
    monkeypatch.setattr(sol, "twiddle_kernel", twiddle_unreduced_kernel)
    with pytest.raises(CheckError, match="fold theta"):
        check_twiddle_table(sol.twiddle_table, rng)


@pytest.mark.parametrize(
    "edit",
    [
        ("twiddles[j * (n // (2 * half))]", "twiddles[j]  # wrong: the stride of the last stage"),
        ("twiddles[j * (n // (2 * half))]", "twiddles[j * (n // half)]  # wrong: twice the stride"),
        ("i1 = i0 + half", "i1 = i0 + 1  # wrong: the partner next door"),
    ],
    ids=["stride-1", "stride-doubled", "partner-next-door"],
)
def test_broken_radix2_stage_fails(edit, rng, monkeypatch):
    monkeypatch.setattr(sol, "radix2_stage_kernel", mutant(sol.radix2_stage_kernel, edit))
    with pytest.raises(FAILS):
        check_radix2_stage(sol.radix2_stage, rng)


@pytest.mark.skipif(
    not is_simulator(),
    reason="a missing barrier is caught every time only by the simulator's race detector; "
    "on a GPU a value check sees it by chance (compute-sanitizer --tool racecheck finds it)",
)
def test_broken_stockham_without_barrier_fails(rng, monkeypatch):
    no_barrier = mutant(
        sol.fft_stockham_kernel,
        # a stage reads what other threads wrote in the stage before
        ("        cuda.syncthreads()\n        src = 1 - src", "        src = 1 - src"),
        name="fft_stockham_no_barrier",
    )
    monkeypatch.setattr(sol, "fft_stockham_kernel", no_barrier)
    with pytest.raises(RACES):
        check_fft_stockham(sol.fft_stockham_shared, rng)


def test_broken_stockham_with_a_wrong_twiddle_fails(rng, monkeypatch):
    wrong = mutant(sol.fft_stockham_kernel, ("twiddles[m * (half // ns)]", "twiddles[m]"))
    monkeypatch.setattr(sol, "fft_stockham_kernel", wrong)
    with pytest.raises(FAILS):
        check_fft_stockham(sol.fft_stockham_shared, rng)


@pytest.mark.parametrize(
    "edit",
    [
        ("W[o, c, f].conjugate()", "W[o, c, f]  # wrong: convolution, not correlation"),
        ("range(X.shape[1]):", "range(X.shape[1] - 1):  # wrong: the last channel left out"),
    ],
    ids=["no-conjugate", "missing-channel"],
)
def test_broken_complex_mac_fails(edit, rng, monkeypatch):
    monkeypatch.setattr(sol, "complex_mac_kernel", mutant(sol.complex_mac_kernel, edit))
    with pytest.raises(FAILS):
        check_complex_mac(sol.complex_mac_channels, rng)


@pytest.mark.parametrize(
    ("kernel", "edit"),
    [
        ("correlate_spectra_kernel", ("X[b, f].conjugate() * Wf[0, f]", "X[b, f] * Wf[0, f]")),
        ("crop_kernel", ("(i - shift + n) % n", "(i - shift + 1 + n) % n")),
        ("crop_kernel", (".real * scale", ".real  # wrong: n times too large")),
    ],
    ids=["no-conjugate", "crop-off-by-one", "no-1/n"],
)
def test_broken_fft_conv1d_kernel_fails(kernel, edit, rng, monkeypatch):
    monkeypatch.setattr(sol, kernel, mutant(getattr(sol, kernel), edit))
    with pytest.raises(FAILS):
        check_fft_conv1d(sol.fft_conv1d, rng)


def test_broken_fft_conv1d_too_short_to_be_linear_fails(rng):
    # n >= L only: lags past the end wrap around onto the first ones (cyclic correlation)
    cyclic = mutant(
        sol.fft_conv1d, ("next_power_of_two(length + taps - 1)", "next_power_of_two(length)")
    )
    with pytest.raises(FAILS):
        check_fft_conv1d(cyclic, rng)


def test_references_match_their_definitions():
    """The checks are only as good as their references."""
    assert list(bit_reversal(8)) == [0, 4, 2, 6, 1, 5, 3, 7]
    x = np.arange(8) + 1j
    stage = x[bit_reversal(8)]
    for s in range(3):
        stage = radix2_stage_reference(stage[None], s)[0][0]
    np.testing.assert_allclose(stage, np.fft.fft(x), atol=1e-12)
    w, xx = np.array([1.0, 2.0, 3.0, 4.0]), np.arange(5.0)[None]
    np.testing.assert_allclose(
        correlate_same_reference(xx, w)[0], np.correlate(np.pad(xx[0], (1, 2)), w, "valid")
    )
