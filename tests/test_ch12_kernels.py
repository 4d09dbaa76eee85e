"""Chapter 12: vector add, softmax and layer norm in Numba and in Triton against float64
on hostile small shapes (N not a power of two, not a multiple of the block, one element,
one row), the broken Triton kernels those checks exist to fail (a forgotten mask, a
wrong offset), and the launchers' refusals before any launch.

Without a GPU, Triton runs in its interpreter, which does not fault on an out-of-range
access: an unmasked load reads whatever lies past the tensor and an unmasked store
writes there. So outputs are views inside NaN-padded buffers (guarded): the pad must
stay NaN; and inputs sit inside buffers padded with 1e30, so a stray read spoils the
result (and what a stray store writes is not NaN). The interpreter runs one program at a time in Python: grids stay tiny.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check
from common.internal.exercises import load_chapter_module

import numpy as np
import pytest

triton_env = load_chapter_module("12_triton", "triton_env")
if triton_env.MISSING:
    pytest.skip(triton_env.MISSING, allow_module_level=True)

import torch  # noqa: E402
from mutants import mutant  # noqa: E402

vector_add = load_chapter_module("12_triton", "vector_add")
softmax = load_chapter_module("12_triton", "softmax")
layernorm = load_chapter_module("12_triton", "layernorm")
DEV = vector_add.bridge.device()
PAD = 64
INPUT_PAD = 1e30  # around inputs: a stray read makes a result no right answer is near


def padded(values: np.ndarray, pad_value: float = INPUT_PAD) -> torch.Tensor:
    """``values`` as a float32 tensor inside a buffer with PAD cells of ``pad_value``
    either side."""
    flat = np.full(values.size + 2 * PAD, pad_value, dtype=np.float32)
    flat[PAD : PAD + values.size] = values.ravel()
    return torch.from_numpy(flat).to(DEV)[PAD : PAD + values.size].view(values.shape)


def guarded(*shape: int) -> torch.Tensor:
    """A NaN-poisoned output inside a NaN-padded buffer (see :func:`untouched`)."""
    return padded(np.full(shape, np.nan, dtype=np.float32), np.nan)


def untouched(out: torch.Tensor) -> None:
    """Raise CheckError if a kernel wrote into the pad around ``out`` (from :func:`guarded`)."""
    base = out.untyped_storage()
    whole = torch.tensor([], dtype=torch.float32, device=out.device).set_(base)
    n = out.numel()
    outside = torch.cat([whole[:PAD], whole[PAD + n :]])
    written = int((~torch.isnan(outside)).sum())
    if written:
        raise CheckError(f"{written} cells outside the output were written (a missing mask?)")


def randn(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- vector add


def vector_add_case(rng, launcher, n, **kw):
    a_h, b_h = randn(rng, n), randn(rng, n)
    out = guarded(n)
    launcher(padded(a_h), padded(b_h), out, **kw)
    untouched(out)
    check(out, a_h.astype(np.float64) + b_h, tol=1e-7)


@pytest.mark.parametrize("n", [1, 37, 70])
def test_vector_add_triton(rng, n):
    vector_add_case(rng, vector_add.add_triton, n, block=32)  # 37, 70: a partial last block


@pytest.mark.parametrize("n", [1, 37])
def test_vector_add_numba(rng, n):
    vector_add_case(rng, vector_add.add_numba, n, threads_per_block=32)


def test_vector_add_triton_without_mask_fails(rng):
    # the loads past n read the inputs' pad (1e30), the stores past n land in out's pad
    kernel = mutant(
        vector_add.add_kernel.fn,
        ("a_ptr + offsets, mask=mask)", "a_ptr + offsets)"),
        ("b_ptr + offsets, mask=mask)", "b_ptr + offsets)"),
        ("a + b, mask=mask)", "a + b)"),
    )
    a, out = padded(randn(rng, 37)), guarded(37)
    kernel[(2,)](a, a, out, 37, BLOCK=32)
    check(out, 2 * a.cpu().double(), tol=1e-7)  # in range: right; the harm is outside
    with pytest.raises(CheckError, match="outside the output"):
        untouched(out)


def test_vector_add_triton_wrong_offset_fails(rng):
    # every program starts at pid instead of pid * BLOCK: elements 33.. never written
    kernel = mutant(vector_add.add_kernel.fn, ("pid * BLOCK + tl.arange", "pid + tl.arange"))
    a, out = padded(randn(rng, 37)), guarded(37)
    kernel[(2,)](a, a, out, 37, BLOCK=32)
    with pytest.raises(CheckError, match="NaN"):
        check(out, 2 * a.cpu().double(), tol=1e-7)


# ---------------------------------------------------------------- softmax


def softmax_case(rng, launcher, rows, cols):
    x_h = randn(rng, rows, cols) * 4
    x, out = padded(x_h), guarded(rows, cols)
    launcher(x, out)
    untouched(out)
    ref = softmax.softmax_reference(x)
    check(out, ref, tol=softmax.softmax_tolerance(x, ref))


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (1, 130)])
def test_softmax_triton(rng, shape):
    softmax_case(rng, softmax.softmax_triton, *shape)


@pytest.mark.parametrize("shape", [(1, 1), (2, 37)])
def test_softmax_numba(rng, shape):
    softmax_case(rng, softmax.softmax_numba, *shape)


def test_softmax_triton_without_load_mask_fails(rng):
    # BLOCK = 64 > 37: a row's padding lanes read the next row (past the last row, the
    # 1e30 pad) into its max and sum instead of -inf: every row comes out wrong, though
    # only its own columns are stored
    kernel = mutant(softmax.softmax_kernel.fn, ('mask=mask, other=-float("inf"))', ")"))
    x, out = padded(randn(rng, 3, 37)), guarded(3, 37)
    kernel[(3,)](x, out, 37, BLOCK=64)
    untouched(out)
    with pytest.raises(CheckError):
        check(out, softmax.softmax_reference(x), tol=1e-5)


# ---------------------------------------------------------------- layer norm


def layernorm_case(rng, forward, backward, m, n):
    x, dy = padded(randn(rng, m, n)), padded(randn(rng, m, n))
    w, b = padded(randn(rng, n)), padded(randn(rng, n))
    y, mean, rstd = guarded(m, n), guarded(m), guarded(m)
    dx, dw, db = guarded(m, n), guarded(n), guarded(n)
    forward(x, w, b, y, mean, rstd)
    backward(dy, x, w, mean, rstd, dx, dw, db)
    ref = layernorm.layernorm_reference(x, w, b, dy)
    tols = layernorm.layernorm_tolerances(x, w, b, dy, ref)
    for what, got, r, tol in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), ref, tols):
        untouched(got)
        check(got, r, tol, name=what)


@pytest.mark.parametrize("shape", [(1, 37), (7, 37), (2, 130)])
def test_layernorm_triton(rng, shape):
    # 7 rows on 3 programs: rows 0, 3, 6 / 1, 4 / 2, 5; 3 partial rows for dw, db
    layernorm_case(rng, layernorm.forward_triton, layernorm.backward_triton, *shape)


@pytest.mark.parametrize("shape", [(1, 37), (2, 130)])
def test_layernorm_numba(rng, shape):
    # 130 columns on 128 threads: two columns wrap round to threads 0 and 1
    layernorm_case(rng, layernorm.forward_numba, layernorm.backward_numba, *shape)


def test_layernorm_triton_variance_with_padding_fails(rng):
    # without tl.where the padded lanes hold -mean, and their mean**2 joins the variance
    kernel = mutant(
        layernorm.layernorm_forward_kernel.fn,
        ("d = tl.where(mask, x - mu, 0.0)", "d = x - mu"),
    )
    x, w, b = padded(randn(rng, 2, 37) + 1), padded(randn(rng, 37)), padded(randn(rng, 37))
    y, mean, rstd = guarded(2, 37), guarded(2), guarded(2)
    kernel[(2,)](x, w, b, y, mean, rstd, 37, 1e-5, BLOCK=64)
    with pytest.raises(CheckError):
        check(y, layernorm.layernorm_reference(x, w, b, x)[0], tol=1e-5)


# ---------------------------------------------------------------- refused before a launch


HOST = "NumPy|ndarray"  # the message for a host array: Numba's and Triton's launchers


def bad_inputs():
    """(launcher, inputs, output index, error, message) for each refusal."""
    f32 = torch.ones(4, 8, device=DEV)
    row, col = torch.ones(4, device=DEV), torch.ones(8, device=DEV)
    f64 = torch.ones(4, 8, dtype=torch.float64, device=DEV)
    strided = torch.ones(8, 4, device=DEV).t()
    host = np.ones((4, 8), np.float32)
    v = torch.ones(8, device=DEV)
    cases = []
    for add in (vector_add.add_triton, vector_add.add_numba):
        cases += [
            (add, (v.double(), v, v.clone()), TypeError, "float"),
            (add, (v, torch.ones(9, device=DEV), v.clone()), ValueError, "shape"),
            (add, (torch.ones(16, device=DEV)[::2], v, v.clone()), ValueError, "contiguous"),
            (add, (host[0], v, v.clone()), TypeError, HOST),
        ]
    for sm in (softmax.softmax_triton, softmax.softmax_numba):
        cases += [
            (sm, (f64, f32.clone()), TypeError, "float"),
            (sm, (strided, f32.clone()), ValueError, "contiguous"),
            (sm, (f32, torch.ones(4, 9, device=DEV)), ValueError, "shape"),
            (sm, (row, row.clone()), ValueError, "2-D"),
            (sm, (host, f32.clone()), TypeError, HOST),
        ]
    for fw in (layernorm.forward_triton, layernorm.forward_numba):
        ok = (f32, col, col, f32.clone(), row.clone(), row.clone())
        cases += [
            (fw, (f64, *ok[1:]), TypeError, "float"),
            (fw, (strided, *ok[1:]), ValueError, "contiguous"),
            (fw, (f32, row, *ok[2:]), ValueError, "shape"),
            (fw, (f32, col, col, f32.clone(), col.clone(), row.clone()), ValueError, "shape"),
            (fw, (host, *ok[1:]), TypeError, HOST),
        ]
    for bw in (layernorm.backward_triton, layernorm.backward_numba):
        ok = (f32, f32, col, row, row, f32.clone(), col.clone(), col.clone())
        cases += [
            (bw, (f64, *ok[1:]), TypeError, "float"),
            (bw, (*ok[:6], row.clone(), col.clone()), ValueError, "shape"),
            (bw, (ok[0], strided, *ok[2:]), ValueError, "contiguous"),
        ]
    return cases


def test_bad_inputs_raise_before_any_launch():
    for launcher, args, error, message in bad_inputs():  # fresh tensors: NaN-filled below
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for t in tensors:
            t.fill_(float("nan"))  # a launch would write numbers into some output
        with pytest.raises(error, match=message):
            launcher(*args)
        for t in tensors:
            assert t.isnan().all(), f"{launcher.__name__} launched before refusing"


def test_tensor_on_the_wrong_device_is_refused(monkeypatch):
    # a CPU tensor given to Triton on a GPU: faked here by making the GPU the expected device
    monkeypatch.setattr(vector_add.bridge, "device", lambda: torch.device("cuda"))
    v = torch.ones(8)
    with pytest.raises(ValueError, match="move it"):
        vector_add.add_triton(v, v, v.clone())


@pytest.mark.skipif(not common.is_simulator(), reason="the interpreter is the simulator's")
def test_triton_imported_before_the_interpreter_was_chosen_is_refused():
    # Triton makes its own tl.sum, tl.max ... as @triton.jit functions when it is first
    # imported: imported without TRITON_INTERPRET=1 (torch.compile does), chapter 12's
    # kernels fail inside the interpreter with "Cannot call @triton.jit'd outside of the
    # scope of a kernel". triton_env says what happened and what to do instead.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import triton, common\n"
        "from common.internal.exercises import load_chapter_module\n"
        "load_chapter_module('12_triton', 'triton_env')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "Triton was imported before chapter 12" in done.stderr, done.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in done.stderr
