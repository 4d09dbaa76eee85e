"""Chapter 1: roofline arithmetic exercises, broken versions that must fail, and
the chapter scripts at simulator sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError
from common.internal.exercises import implementations, load_chapter_module

import math

import pytest

CHAPTER = "01_ecosystem"


def _cases(rng):
    # (flops, nbytes, TFLOP/s, GB/s): vector add, SGEMM 4096 on an H100, and random ones.
    cases = [(1e6, 12e6, 51.7, 3014.0), (2 * 4096**3, 3 * 4 * 4096**2, 51.7, 3014.0)]
    for _ in range(10):
        cases.append(
            tuple(
                float(v)
                for v in (
                    10 ** rng.uniform(3, 12),
                    10 ** rng.uniform(3, 10),
                    rng.uniform(1, 100),
                    rng.uniform(100, 5000),
                )
            )
        )
    return cases


def check_roofline(arithmetic_intensity, roofline_ms, bound_by, rng):
    for flops, nbytes, tf, gbps in _cases(rng):
        ai = arithmetic_intensity(flops, nbytes)
        if not math.isclose(ai, flops / nbytes, rel_tol=1e-12):
            raise CheckError(f"arithmetic_intensity({flops}, {nbytes}) = {ai}")
        t_mem, t_cmp = nbytes / (gbps * 1e9) * 1e3, flops / (tf * 1e12) * 1e3
        got = roofline_ms(flops, nbytes, tf, gbps)
        if not math.isclose(got, max(t_mem, t_cmp), rel_tol=1e-9):
            raise CheckError(
                f"roofline_ms{(flops, nbytes, tf, gbps)} = {got} ms, "
                f"expected {max(t_mem, t_cmp)} ms"
            )
        expected = "memory" if t_mem > t_cmp else "compute"
        if bound_by(flops, nbytes, tf, gbps) != expected:
            raise CheckError(f"bound_by{(flops, nbytes, tf, gbps)} should be {expected!r}")
    with pytest.raises(ValueError):
        arithmetic_intensity(1.0, 0)


@pytest.mark.parametrize("impl", implementations(CHAPTER))
def test_roofline(impl, rng):
    check_roofline(impl.arithmetic_intensity, impl.roofline_ms, impl.bound_by, rng)


def _roofline_summed(f, b, tf, g):
    return (f / (tf * 1e12) + b / (g * 1e9)) * 1e3  # wrong: the sum, not the max


def _roofline_wrong_units(f, b, tf, g):
    return max(f / tf, b / g)  # wrong: forgot 1e12, 1e9 and ms


def _bound_by_inverted(f, b, tf, g):
    return "compute" if b / (g * 1e9) > f / (tf * 1e12) else "memory"  # wrong: swapped


def test_broken_roofline_fails(rng):
    sol = load_chapter_module(CHAPTER, "solutions")
    for broken in (_roofline_summed, _roofline_wrong_units):
        with pytest.raises(CheckError):
            check_roofline(sol.arithmetic_intensity, broken, sol.bound_by, rng)
    with pytest.raises(CheckError):
        check_roofline(sol.arithmetic_intensity, sol.roofline_ms, _bound_by_inverted, rng)


@pytest.mark.parametrize(
    "script", ["stack_report"]
)  # loop_to_kernel: test_scripts_simulator_output
def test_script_main(script, tmp_path):
    assert load_chapter_module(CHAPTER, script).main(["--out", str(tmp_path)]) == 0


def test_stack_report_lists_numba_cuda():
    r = load_chapter_module(CHAPTER, "stack_report").report()
    versions = {row["package"]: row["version"] for row in r["stack"]}
    assert versions["numba-cuda"] is not None and versions["numpy"] is not None
