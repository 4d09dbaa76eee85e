"""common.internal.float32_purity: every form of float64 promotion is named by its line, a
float32-pure kernel passes, and launches are recorded with their real argument types."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError
from common.internal.float32_purity import (
    assert_float32_pure,
    float32_pure_launches,
    float64_uses,
    recording_launches,
)

import math

import numba
import numpy as np
import pytest
from numba import cuda

F32_1D = numba.float32[::1]  # the type of a contiguous float32 device array


@cuda.jit
def pure(alpha, x, out):
    i = cuda.grid(1)
    if i < out.size:
        acc = np.float32(0.0)
        acc += alpha * x[i] + np.float32(2.0)
        out[i] = math.exp(acc) if acc < np.float32(1.0) else acc


@cuda.jit
def bare_literal(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * 2.0


@cuda.jit
def acc_float64(x, out):
    i = cuda.grid(1)
    acc = 0.0
    for k in range(x.size):
        acc += x[k]
    if i < out.size:
        out[i] = acc


@cuda.jit
def scalar_argument(alpha, x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = alpha * x[i]


@cuda.jit
def int_mixed(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] + i


@cuda.jit
def int_division(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * np.float32(i / out.size)


@cuda.jit
def literal_comparison(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] if x[i] > 0.5 else np.float32(0)


@cuda.jit(device=True)
def half_of(v):
    return v * 0.5


@cuda.jit
def calls_promoting_device_function(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = half_of(x[i])


def _lines(uses):
    return [(u.source, u.message) for u in uses]


def test_float32_pure_kernel_has_no_float64_uses():
    assert float64_uses(pure, (numba.float32, F32_1D, F32_1D)) == []


@pytest.mark.parametrize(
    "kernel, argtypes, source, message",
    [
        (
            bare_literal,
            (F32_1D, F32_1D),
            "out[i] = x[i] * 2.0",
            "the literal 2.0 is a float64; write np.float32(2.0)",
        ),
        (
            acc_float64,
            (F32_1D, F32_1D),
            "acc = 0.0",
            "makes acc float64; write acc = np.float32(0.0)",
        ),
        (scalar_argument, (1.5, F32_1D, F32_1D), "@cuda.jit", "argument alpha is float64"),
        (int_mixed, (F32_1D, F32_1D), "out[i] = x[i] + i", "an integer mixed with a float32"),
        (
            int_division,
            (F32_1D, F32_1D),
            "out[i] = x[i] * np.float32(i / out.size)",
            "divides integers",
        ),
        (
            literal_comparison,
            (F32_1D, F32_1D),
            "out[i] = x[i] if x[i] > 0.5 else np.float32(0)",
            "the literal 0.5 is a float64",
        ),
        (
            calls_promoting_device_function,
            (F32_1D, F32_1D),
            "return v * 0.5",
            "(in device function half_of)",
        ),
    ],
    ids=[
        "bare-literal",
        "acc-0.0",
        "python-float-argument",
        "int-mixed",
        "int-division",
        "literal-comparison",
        "device-function",
    ],
)
def test_each_promotion_is_named_by_its_line(kernel, argtypes, source, message):
    uses = float64_uses(kernel, argtypes)
    assert uses, f"{kernel.__name__}: no float64 found"
    first = uses[0]
    assert first.source == source and message in first.message, _lines(uses)
    assert first.file.endswith("test_float32_purity.py") and first.line > 0
    with pytest.raises(CheckError, match=rf"line {first.line} of test_float32_purity.py"):
        assert_float32_pure(kernel, argtypes)


def test_example_arguments_are_typed_as_a_launch_types_them():
    x = cuda.to_device(np.ones(4, np.float32))
    assert float64_uses(scalar_argument, (np.float32(1.5), x, x)) == []
    assert float64_uses(scalar_argument, (1.5, x, x))  # a Python float is a float64


def test_launches_are_checked_with_their_real_arguments():
    x = cuda.to_device(np.arange(8, dtype=np.float32))
    with float32_pure_launches():
        scalar_argument[1, 8](np.float32(2.0), x, x)
    with pytest.raises(CheckError, match=r"(?s)the launch of scalar_argument.*argument alpha"):
        with float32_pure_launches():
            scalar_argument[1, 8](2.0, x, x)  # the launch line is named


def test_launch_recording_skips_device_calls_and_restores_the_launcher():
    x = cuda.to_device(np.arange(8, dtype=np.float32))
    with recording_launches() as launches:
        calls_promoting_device_function[2, 4](x, x)
        calls_promoting_device_function[2, 4](x, x)
    assert len(launches) == 2
    assert [str(t) for t in launches[0][1]] == ["array(float32, 1d, C)"] * 2
    with recording_launches() as later:
        pass
    assert later == []


def test_nothing_is_checked_when_the_block_raises():
    x = cuda.to_device(np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="the block's own error"):  # not a float64 report
        with float32_pure_launches():
            bare_literal[1, 4](x, x)
            raise RuntimeError("the block's own error")


def test_wrong_number_of_argument_types_is_refused():
    with pytest.raises(TypeError, match="takes 2 arguments"):
        float64_uses(bare_literal, (F32_1D,))


def test_a_callee_defined_by_an_ir_expression_is_named_not_crashed_on():
    # numba-cuda's ir.Expr raises KeyError (not AttributeError) for a field it lacks;
    # the typing helper once died on such a definition with "KeyError: 'name'".
    from common.internal.float32_purity import _callee_name

    from numba.cuda.core import ir

    loc = ir.Loc("k.py", 1)
    attr = ir.Expr.getattr(ir.Var(ir.Scope(None, loc), "np", loc), "float64", loc)
    assert _callee_name(attr) == "float64"
    call = ir.Expr.call(ir.Var(ir.Scope(None, loc), "f", loc), (), (), loc)
    assert _callee_name(call) == "a call"
    assert _callee_name(None) == "a call"
