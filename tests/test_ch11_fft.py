"""Chapter 11: every FFT version against numpy.fft at simulator sizes, the identities a
correct FFT satisfies, broken butterflies that must fail, bad inputs refused before any
launch, and the script's main() once.

Sizes are tiny (the simulator runs a Python thread per CUDA thread) but hostile: n = 1
and 2 (no stage, one stage), every radix-8 plan (8s, then a 2 or a 4 left over), a batch
that is not a multiple of rows_per_block (a block with rows past the end), and the
four-step path with its threshold lowered so that n = 64 and 128 take it.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, poisoned
from common.internal import racecheck
from common.internal.exercises import load_chapter_module
from common.internal.racecheck import RaceError
from common.runtime import is_simulator
from common.targets import recording_launches

import inspect
import json
import math

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

CHAPTER = "11_fft_and_convolution"
fft = load_chapter_module(CHAPTER, "fft")
VERSIONS = sorted(fft.VERSIONS)
# A missing barrier: the simulator's race detector reports it on the launch that has
# it, every time; a value check would see it only when threads happen to interleave.
RACES = RaceError if is_simulator() and racecheck.ENABLED else (RaceError, CheckError)


def run_checked(version, host, x, inverse=False):
    """fft of device rows ``x`` (host copy ``host``) into a poisoned output, checked
    against numpy.fft within the version's bound; returns the relative error."""
    batch, n = host.shape
    out = poisoned((batch, n), np.complex64)
    fft.fft(x, out, inverse=inverse, version=version)
    tol = fft.dft_tolerance(n) if version == 1 else fft.tolerance(n)
    name = f"v{version} {'ifft' if inverse else 'fft'} ({batch}, {n})"
    return check(fft.as_pairs(out), fft.as_pairs(fft.fft_cpu(host, inverse)), tol=tol, name=name)


# ---------------------------------------------------------------- right answers

# (batch, n): n = 1, 2 (the smallest plans), 4, 8 (one radix-n pass), 16 (8 then 2),
# 32 (8 then 4), 64 (8 then 8); batches 1 and not multiples of rows_per_block
SHAPES = [(5, 1), (3, 2), (1, 4), (7, 8), (5, 16), (3, 32), (1, 64), (2, 64)]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_matches_numpy(version, rng):
    for batch, n in SHAPES:
        host, x = fft.random_rows(batch, n, rng)
        for inverse in (False, True):
            run_checked(version, host, x, inverse)


@pytest.mark.parametrize("version", [4, 5])
def test_longer_rows_and_partial_blocks(version, rng):
    # 128 = (8, 8, 2): two passes through shared memory, then 4 radix-2 butterflies a
    # thread; 3 rows of 16 where a block holds 4 (simulator) or 256 (GPU)
    for batch, n in [(1, 128), (3, 16), (rng.integers(1, 6), 32)]:
        host, x = fft.random_rows(int(batch), n, rng)
        run_checked(version, host, x, inverse=bool(rng.integers(2)))


@pytest.mark.parametrize("version", [4, 5])
def test_four_step_path(version, rng, monkeypatch):
    # lowered threshold: n = 64 is 8 x 8 and n = 128 is 8 x 16 (column FFTs with the
    # twiddle fused, then row FFTs stored transposed), as 2**20 is 1024 x 1024
    monkeypatch.setattr(fft, "MAX_BLOCK_N", 16)
    for batch, n in [(3, 64), (1, 128)]:
        assert fft.four_step_split(n)[1] <= 16
        host, x = fft.random_rows(batch, n, rng)
        for inverse in (False, True):
            run_checked(version, host, x, inverse)


def test_identities_round_trip_and_parseval(rng):
    for version in VERSIONS:
        for n in (2, 16):
            assert fft.check_identities(n, 3, rng, version) < 1e-6


def test_fft2_matches_numpy(rng, monkeypatch):
    monkeypatch.setattr(fft, "MAX_BLOCK_N", 16)  # w = 32: its row FFTs take the four-step
    for shape in [(2, 8, 4), (1, 4, 32), (2, 1, 8), (1, 16, 1)]:
        host = fft.random_rows(int(np.prod(shape[:-1])), shape[-1], rng)[0].reshape(shape)
        x = cuda.to_device(host)
        for inverse in (False, True):
            out = poisoned(shape, np.complex64)
            fft.fft2(x, out, inverse=inverse)
            ref = np.fft.ifft2(host.astype(np.complex128)) if inverse else np.fft.fft2(host)
            tol = fft.tolerance(shape[1] * shape[2])
            check(fft.as_pairs(out), fft.as_pairs(ref), tol=tol, name=f"fft2 {shape}")


def test_tolerance_is_the_derived_bound():
    u = 2.0**-24
    assert fft.tolerance(1) == 0  # no level: a copy
    for k in (1, 10, 20):
        eta = u + 4 * 2.0**-53 + 4 * u / (1 - 4 * u) * (math.sqrt(2) + u + 4 * 2.0**-53)
        assert fft.tolerance(2**k) == pytest.approx(k * eta / (1 - k * eta))
    assert fft.tolerance(2**20) < 1e-5  # grows like log2(n) eps32: far below a wrong answer
    assert fft.dft_tolerance(4096) > 100 * fft.tolerance(4096)  # the O(n^2) sum's own bound
    for bad in (0, 3, 12, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            fft.tolerance(bad)


def test_pass_twiddles_match_the_table():
    for n in (1, 2, 16, 32, 64, 128):
        w = fft.pass_twiddles(n)
        assert w.shape == (max(n - 1, 1),) and w.dtype == np.complex64
        p = 1
        for radix in fft.stockham_plan(n):
            for r in range(1, radix):
                for k in range(p):
                    assert w[r * p + k - 1] == fft.twiddles(n)[r * k * n // (p * radix)]
            p *= radix
        assert p == n


# ---------------------------------------------------------------- broken butterflies

# Each mutant is the one bug its test names, applied to the real kernel's source; the
# check must fail on every run: a wrong twiddle or a missing stage errs by O(1) for n >= 4
# (W_4 = -i is the first twiddle whose sign matters), and the race detector reports a
# missing barrier on the launch that has it, whatever the interleaving.


def _uncached_factory(monkeypatch):
    """Rebuild version 4-5 kernels on every call, so patched helpers are picked up: from
    the factory's source (tests/mutants.py), with the module's globals of that moment
    and without the disk cache, which would load the kernel compiled with the real
    helpers (numba's cache key holds the kernel's file, code and closure, no global)."""
    factory = fft.make_fft_stockham_radix8.__wrapped__
    monkeypatch.setattr(
        fft, "make_fft_stockham_radix8", lambda *args, **kw: mutant(factory)(*args, **kw)
    )


def _fails(version, rng, exc=CheckError, sizes=((3, 4), (2, 16), (1, 64))):
    for batch, n in sizes:
        host, x = fft.random_rows(batch, n, rng)
        with pytest.raises(exc):
            run_checked(version, host, x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_wrong_twiddle_sign_fails(rng, monkeypatch):
    conj = ".conjugate()"
    monkeypatch.setattr(
        fft,
        "radix2_stage",
        mutant(fft.radix2_stage, ("tw[k * (pairs // half)]", f"tw[k * (pairs // half)]{conj}")),
    )
    _fails(2, rng)
    monkeypatch.setattr(
        fft,
        "stockham_radix2_smem",
        mutant(fft.stockham_radix2_smem, ("* (half // p)]", f"* (half // p)]{conj}")),
    )
    _fails(3, rng)
    _uncached_factory(monkeypatch)
    monkeypatch.setattr(  # the -i of the radix-8 butterfly as +i
        fft,
        "dft_in_registers",
        mutant(
            fft.dft_in_registers, ("vr[b] = di\n", "vr[b] = -di\n"), ("vi[b] = -dr", "vi[b] = dr")
        ),
    )
    for version in (4, 5):
        _fails(version, rng)
    monkeypatch.undo()
    _uncached_factory(monkeypatch)
    monkeypatch.setattr(  # conj(w) for the table's twiddles (n = 64: the 8-point passes')
        fft,
        "twiddle_in_registers",
        mutant(
            fft.twiddle_in_registers,
            ("a * wi + b * wr", "b * wr - a * wi"),
            ("a * wr - b * wi", "a * wr + b * wi"),
        ),
    )
    for version in (4, 5):
        _fails(version, rng, sizes=((2, 16), (1, 64)))


def test_one_stage_too_few_fails(rng, monkeypatch):
    name, launcher = fft.VERSIONS[2]
    short = mutant(launcher, ("range(log2n):", "range(log2n - 1):"))
    monkeypatch.setitem(fft.VERSIONS, 2, (name, short))
    _fails(2, rng)
    monkeypatch.setattr(
        fft,
        "stockham_radix2_smem",
        mutant(fft.stockham_radix2_smem, ("while p < n:", "while 2 * p < n:")),
    )
    _fails(3, rng)
    monkeypatch.setattr(
        fft,
        "make_fft_stockham_radix8",
        mutant(
            fft.make_fft_stockham_radix8.__wrapped__,
            ("for s in range(MID):", "for s in range(MID - 1):"),
        ),
    )
    for version in (4, 5):
        _fails(version, rng, sizes=((2, 16), (1, 128)))


@pytest.mark.skipif(not is_simulator(), reason="the race detector is the simulator's")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_missing_barrier_is_a_race(rng, monkeypatch):
    for comment in ("every input of this pass read", "every output written before"):
        line = next(s for s in _source_lines(fft.stockham_radix2_smem) if comment in s)
        monkeypatch.setattr(
            fft, "stockham_radix2_smem", mutant(fft.stockham_radix2_smem, (line.strip(), "pass"))
        )
        _fails(3, rng, RACES, sizes=((2, 8),))
        monkeypatch.undo()
    factory = fft.make_fft_stockham_radix8.__wrapped__
    barriers = [
        ("every thread has read this pass's inputs", (4, 5), (1, 128)),
        ("every output written before anyone reads", (4, 5), (1, 128)),
        # version 5 stages rows shorter than a warp (n = 16: 2 threads a row)
        ("the block's rows all staged", (5,), (3, 16)),
        ("every output staged before", (5,), (3, 16)),
    ]
    for comment, versions, shape in barriers:
        line = next(s for s in _source_lines(factory) if comment in s)
        monkeypatch.setattr(
            fft, "make_fft_stockham_radix8", mutant(factory, (line.strip(), "pass"))
        )
        for version in versions:
            _fails(version, rng, RACES, sizes=(shape,))
        monkeypatch.undo()


def _source_lines(fn):
    return inspect.getsource(getattr(fn, "py_func", fn)).splitlines()


# ---------------------------------------------------------------- bad inputs


def _refused(call, exc, match):
    """``call()`` raises ``exc`` matching ``match`` and launched no kernel."""
    with recording_launches() as launched:
        with pytest.raises(exc, match=match):
            call()
    assert not launched, f"launched {list(launched.values())} before refusing"


def test_bad_inputs_are_refused_before_any_launch(rng):
    x = cuda.to_device(fft.random_rows(2, 16, rng)[0])
    out = cuda.device_array((2, 16), np.complex64)
    cases = [
        (
            (cuda.device_array((2, 12), np.complex64), cuda.device_array((2, 12), np.complex64)),
            ValueError,
            "power of two",
        ),
        (
            (
                cuda.device_array((1, 2**21), np.complex64),
                cuda.device_array((1, 2**21), np.complex64),
            ),
            ValueError,
            "1048576",
        ),
        ((cuda.device_array((2, 16), np.float32), out), TypeError, "complex64"),
        ((x, cuda.device_array((2, 16), np.complex128)), TypeError, "complex64"),
        ((x.copy_to_host(), out), TypeError, "host"),
        ((x, out.copy_to_host()), TypeError, "host"),
        ((x[:, ::2], cuda.device_array((2, 8), np.complex64)), ValueError, "C-contiguous"),
        ((x, cuda.device_array((2, 8), np.complex64)), ValueError, "shape"),
        ((x, cuda.device_array((1, 16), np.complex64)), ValueError, "shape"),
        ((x.reshape(32), out.reshape(32)), ValueError, "2-D"),
        ((x, x), ValueError, "overlaps"),
    ]
    for version in VERSIONS:
        for args, exc, match in cases:
            _refused(lambda a=args, v=version: fft.fft(*a, version=v), exc, match)
    big = cuda.device_array((1, 8192), np.complex64)
    _refused(
        lambda: fft.fft(big, cuda.device_array((1, 8192), np.complex64), version=3),
        ValueError,
        "version 3",
    )
    _refused(lambda: fft.fft(x, out, version=6), ValueError, "version")
    x3 = cuda.device_array((1, 8, 8), np.complex64)
    _refused(lambda: fft.fft2(x3, cuda.device_array((1, 8, 6), np.complex64)), ValueError, "shape")
    for shape, match in [
        ((1, 6, 8), "power of two"),
        ((1, 8192, 2), "4096"),
        ((1, 8, 3), "power of two"),
    ]:
        _refused(
            lambda s=shape: fft.fft2(
                cuda.device_array(s, np.complex64), cuda.device_array(s, np.complex64)
            ),
            ValueError,
            match,
        )


# ---------------------------------------------------------------- the script


def test_main_checks_every_version_and_writes_json(tmp_path):
    assert fft.main(["--out", str(tmp_path), "--sizes", "1,16", "--batch-mib", "0.0005"]) == 0
    payload = json.loads((tmp_path / "fft.json").read_text())
    names = [r["name"] for r in payload["results"]]
    assert [name.split()[0] for name in names if name[0].isdigit()] == ["1", "2", "3", "4", "5"] * 2
    assert all(
        r["extra"]["rel_error"] <= fft.tolerance(r["extra"]["n"]) or r["name"][0] == "1"
        for r in payload["results"]
    )


@pytest.mark.parametrize("argv", [["--batch-mib", "0"], ["--sizes", "64,-4"], ["--sizes", ","]])
def test_main_refuses_bad_options_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as e:
        fft.main(argv)
    assert e.value.code == 2 and "error: argument" in capsys.readouterr().err
