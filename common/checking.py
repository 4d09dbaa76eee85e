"""Checking kernels against a float64 reference, the same way everywhere.

The measure is the relative error ``||out - ref|| / ||ref||`` (Frobenius norm
over all elements), computed in float64 against a float64 reference. For
float32 kernels a right answer lands far below 1e-5 for elementwise work and
near 1e-6 * sqrt(K) for a K-long sum; a wrong index, a missing element or a
race lands near 1.

Two habits make wrong kernels fail instead of passing by luck:

* **Poison** outputs before a launch (:func:`poisoned`): NaN for floats, an
  unlikely sentinel for integers. An element the kernel never wrote keeps its
  poison and fails the check; a zero-filled output would hide it whenever the
  right answer is near zero.
* **Guard** outputs (:func:`guarded`): the output is a view into a larger
  poisoned buffer, and the check also confirms the cells around it were not
  written. A kernel without a bounds check writes there on a GPU (where an
  out-of-bounds write is silent) and raises IndexError in the simulator.

A failed check says the symptom and, where the pattern of the wrong elements
gives it away, the likely cause: unwritten elements (NaN, or an integer
poison), a tail the grid did not reach, lost increments (a missing atomic),
an index off by one or by a block, every block redoing block 0, rows and
columns swapped, a per-block term missing. Its own frames are hidden from
pytest tracebacks (``__tracebackhide__``), so a failure points at the test
line that called it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from .errors import CheckError  # defined with the course's other errors; re-exported here
from .runtime import is_simulator


def _to_host(a: Any) -> np.ndarray:
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "detach"):  # torch tensor
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _as_real_pairs(o: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Complex outputs compared as (real, imaginary) float64 pairs, a trailing axis
    of 2: the norms are the complex norms, and a wrong imaginary part counts (a
    cast to float64 would drop it, with only a warning)."""
    if o.dtype.kind != "c" and r.dtype.kind != "c":
        return o, r

    def pairs(a: np.ndarray) -> np.ndarray:
        c = np.ascontiguousarray(a, dtype=np.complex128)
        return c.view(np.float64).reshape(*a.shape, 2)

    return pairs(o), pairs(r)


def require_device_array(a: Any, name: str, ndim: int | None = None, dtype: Any = None) -> Any:
    """Return ``a`` as a Numba device array of ``ndim``/``dtype``, or raise a clear error.

    Launchers call it before launching: a host NumPy array would be copied to the
    GPU and back behind the caller's back, and a wrong dtype or rank makes a
    kernel read garbage instead of failing. A GPU array of another library (a
    CUDA torch tensor: anything with ``__cuda_array_interface__``) is wrapped
    without a copy.

    Raises:
        TypeError: a host (NumPy) array, anything else that is not on the GPU,
            or the wrong dtype; the message says how to fix it.
        ValueError: the wrong number of dimensions.
    """
    __tracebackhide__ = True
    if isinstance(a, np.ndarray):
        raise TypeError(
            f"{name} is a host (NumPy) array; copy it to the GPU first: "
            f"{name}_dev = cuda.to_device(np.ascontiguousarray({name}))"
        )
    if not hasattr(a, "copy_to_host"):
        if not hasattr(a, "__cuda_array_interface__"):
            raise TypeError(
                f"{name} must be a device array (cuda.to_device(...)), got {type(a).__name__}"
            )
        a = cuda.as_cuda_array(a)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}; convert with .astype")
    return a


def rel_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64; ``inf`` if ``out`` holds NaN or inf.

    Args:
        out: array-like (NumPy, Numba device array, torch tensor), any shape.
        ref: array-like of the same shape; its norm must be non-zero (never
            check against all zeros: it hides unwritten outputs).

    Raises:
        ValueError: shapes differ, or ``ref`` is all zeros.
    """
    __tracebackhide__ = True
    o, r = _to_host(out), _to_host(ref)
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: out {o.shape} vs reference {r.shape}")
    o, r = _as_real_pairs(o, r)
    o, r = o.astype(np.float64), r.astype(np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    norm = np.linalg.norm(r)
    if norm == 0:
        raise ValueError(
            "the reference is all zeros, so a relative error means nothing; "
            "draw random non-zero inputs"
        )
    return float(np.linalg.norm(o - r) / norm)


EPS32 = float(np.finfo(np.float32).eps)
"""float32 machine epsilon, 2**-23: the gap between 1 and the next float32."""


def rounding_tolerance(ref: Any, magnitude: Any, roundings: float, tol: float) -> float:
    """The relative tolerance a correct float32 result needs where its terms cancel.

    Each float32 operation rounds by at most eps32 / 2 of its operands' size,
    so an element computed in k operations from terms of total size M
    (``|a| + |b|`` for ``a + b``) is off by at most about k * eps32 * M,
    whatever its own size. Relative to ``||ref||`` that is tiny, except where
    the terms nearly cancel (a one-element draw near a root, a confident
    softmax row, a batchnorm channel of equal values); there a fixed ``tol``
    fails a correct kernel now and then. This returns ``max(tol, roundings *
    eps32 * ||M|| / ||ref||)``: rounding is allowed exactly, and a wrong index,
    sign or term, which errs by O(M), still fails.

    Args:
        ref: the float64 reference, any shape (NumPy array or torch tensor).
        magnitude: M, the size of the rounded terms, per element (same shape
            as ``ref``) or one number for every element.
        roundings: k, the float32 roundings an element takes, counted from the
            kernel (a product and a sum: 2; a log-sum-exp: about 4).
        tol: the tolerance used where nothing cancels.

    Method: the standard model of floating-point arithmetic, fl(a op b) =
    (a op b)(1 + d) with |d| <= eps/2 (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., sec. 2.2).
    """
    r = _to_host(ref).astype(np.float64)
    m = np.broadcast_to(np.abs(_to_host(magnitude).astype(np.float64)), r.shape)
    norm = float(np.linalg.norm(r))
    if norm == 0:
        raise ValueError("the reference is all zeros: draw random non-zero inputs")
    return max(tol, roundings * EPS32 * float(np.linalg.norm(m)) / norm)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(1, max(limit, 1).bit_length()) if (1 << k) <= limit]


def _tail_start(mask: np.ndarray) -> int | None:
    """k if ``mask`` (1-D) is False before index k and True from k on, with 0 < k."""
    hits = np.flatnonzero(mask)
    if hits.size and 0 < hits[0] and hits.size == mask.size - hits[0]:
        return int(hits[0])
    return None


def _unwritten_causes(unwritten: np.ndarray) -> list[str]:
    """Causes from where the unwritten (still poisoned) elements lie."""
    if unwritten.all():
        return ["nothing was written: was the kernel launched, and does it write this output?"]
    flat = unwritten.reshape(-1)
    if unwritten.ndim == 2:
        rows, cols = unwritten.all(axis=1), unwritten.all(axis=0)
        if unwritten.sum() == rows.sum() * unwritten.shape[1]:
            k = _tail_start(rows)
            if k is not None:
                return [
                    f"rows {k} and up were never written: the grid does not cover "
                    "every row (ceil_div for the y blocks? rows are the y index)"
                ]
        if unwritten.sum() == cols.sum() * unwritten.shape[0]:
            k = _tail_start(cols)
            if k is not None:
                return [
                    f"columns {k} and up were never written: the grid does not cover "
                    "every column (ceil_div for the x blocks? columns are the x index)"
                ]
    k = _tail_start(flat)
    if k is not None:
        return [
            f"elements {k} and up were never written: the grid stops short "
            "(launch ceil_div(n, threads) blocks, or loop with a grid stride)"
        ]
    return []


def _pattern_causes(o: np.ndarray, r: np.ndarray, rtol: float, atol: float) -> list[str]:
    """Likely causes of a mismatch, from cheap tests of its pattern (float64 arrays).

    Each test is one the wrong answer fits exactly and a random right answer
    does not; none is run on fewer than 4 elements.
    """

    def close(a: np.ndarray, b: np.ndarray) -> bool:
        return a.size > 0 and bool(np.all(np.isclose(a, b, rtol=rtol, atol=atol)))

    if o.size < 4 or not np.all(np.isfinite(o)) or close(o, r):
        return []
    if o.ndim == 2 and o.shape[0] == o.shape[1] and close(o, r.T):
        return [
            "the output is the transpose of the expected one: rows and columns "
            "swapped? (cuda.grid(2) returns (x, y): x walks columns, y rows)"
        ]
    diff = o - r
    if close(diff, np.full_like(diff, diff.flat[0])):
        return [
            f"every element is off by the same {diff.flat[0]:.6g}: a constant term wrong or missing?"
        ]
    nonzero = np.abs(r) > atol
    if nonzero.sum() >= 2:
        ratio = o[nonzero] / r[nonzero]
        if close(ratio, np.full_like(ratio, ratio[0])) and close(o, ratio[0] * r):
            return [
                f"every element is {ratio[0]:.6g} times the expected one: a scale factor wrong or missing?"
            ]
    if o.ndim != 1:
        return []
    # Below, a pattern counts only if the reference does not have it too (a
    # constant or periodic reference would match a shifted copy of itself).
    n = o.size
    for p in _powers_of_two(n - 1):
        repeat = np.arange(n) % p
        if p >= 4 and close(o, r[repeat]) and not close(r, r[repeat]):
            return [
                f"out[i] equals the expected out[i % {p}]: every block of {p} threads redid "
                "block 0's elements (an index from cuda.threadIdx.x alone? use cuda.grid(1))"
            ]
    for s in [1, -1, 2, -2] + [v for p in _powers_of_two(n // 2) if p > 2 for v in (p, -p)]:
        if n - abs(s) >= max(2, n // 2):
            a = abs(s)
            shifted = close(o[:-a], r[a:]) if s > 0 else close(o[a:], r[:-a])
            if shifted and not close(r[:-a], r[a:]):
                what = "off by one" if a == 1 else f"off by {a} (a block's worth?)"
                return [
                    f"out[i] holds the expected out[i {'+' if s > 0 else '-'} {a}]: an index {what}"
                ]
    for p in reversed(_powers_of_two(n - 1)):
        if p < 8:
            break
        # diff constant within each run of p elements (the last run may be short)
        starts = diff[np.arange(n) // p * p]
        if close(diff, starts):
            return [
                f"the error is one constant for each run of {p} elements (one per block of "
                f"{p}?): a per-block term is missing or wrong (the sum of the earlier blocks?)"
            ]
    return []


def _count_causes(o: np.ndarray, r: np.ndarray) -> list[str]:
    """Causes for integer counts (no negative values) that come out too low or too high."""
    if o.min() < 0 or r.min() < 0:
        return []
    got, want = int(o.sum()), int(r.sum())
    bad = o != r
    total = "" if o.size == 1 else f"the counts sum to {got}, expected {want}: "
    if np.all(o[bad] < r[bad]):
        return [
            f"{total}{want - got} increments were lost or never made: a race (use "
            "cuda.atomic.add)? or elements the grid never reached?"
        ]
    if np.all(o[bad] > r[bad]):
        return [
            f"{total}{got - want} too many: elements counted twice (overlapping "
            "grid-stride ranges? a wrong comparison?)"
        ]
    return []


def likely_cause(error: BaseException) -> str | None:
    """The likely cause of an exception a kernel raised, when its kind gives it away.

    An ``IndexError`` from the simulator (its message names the thread:
    ``tid=[..] ctaid=[..]``) is a thread past the end of an array: on a GPU
    the same kernel writes out of bounds silently.
    """
    if isinstance(error, IndexError) and "tid=" in str(error):
        return (
            "likely cause: a thread indexed past the end of an array; threads "
            "past the end must do nothing (a bounds check such as `if i < out.size:`)"
        )
    return None


def check(out: Any, ref: Any, tol: float = 1e-5, name: str = "output") -> float:
    """Assert ``rel_error(out, ref) <= tol``; return the error.

    Integer and boolean outputs must match exactly (``tol`` ignored). A scalar
    works too: ``check(count, expected)``. Complex arrays are compared as
    (real, imaginary) pairs: a mismatch's index ends in 0 (real) or 1 (imaginary).

    Raises:
        CheckError: with the relative error, the number of unwritten (NaN or
            integer poison) elements, the first mismatching index with both
            values and, when the pattern of the mismatch shows it, the likely
            cause ("1 of 17 elements are NaN (never written?)"; "got 229,
            expected 233: 4 increments were lost ...: a race (use
            cuda.atomic.add)?"; "an index off by one").
    """
    __tracebackhide__ = True
    o = _to_host(out)
    r = _to_host(ref)
    if o.shape != r.shape:
        raise CheckError(f"{name}: shape {o.shape}, expected {r.shape}")
    o, r = _as_real_pairs(o, r)  # complex: (real, imaginary) pairs, index [..., 0 or 1]
    if o.dtype.kind in "iub" or r.dtype.kind in "iub":
        bad = o != r
        if not bad.any():
            return 0.0
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        if o.size == 1:
            msg = f"{name}: got {o[idx].item()!r}, expected {r[idx].item()!r}"
        else:
            msg = (
                f"{name}: {int(bad.sum())} of {o.size} elements differ; first at index "
                f"{idx}: got {o[idx].item()!r}, expected {r[idx].item()!r}"
            )
        causes: list[str] = []
        if o.dtype.kind in "iu":
            unwritten = o == poison_value(o.dtype)
            if unwritten.any() and not (r == poison_value(o.dtype)).any():
                msg += (
                    f"; {int(unwritten.sum())} of {o.size} elements still hold the poison "
                    f"value {poison_value(o.dtype)} (never written?)"
                )
                causes = _unwritten_causes(unwritten)
            elif r.dtype.kind in "iu":
                causes = _count_causes(o.astype(np.int64), r.astype(np.int64))
                causes += _pattern_causes(o.astype(np.float64), r.astype(np.float64), 0.0, 0.0)
        if o.size == 1 and causes:  # "got 229, expected 233: 4 increments were lost ..."
            raise CheckError(f"{msg}: {'; '.join(causes)}")
        raise CheckError("; ".join([msg, *causes]))
    err = rel_error(o, r)
    if err <= tol:
        return err
    o64, r64 = o.astype(np.float64), r.astype(np.float64)
    scale = np.abs(r64).max()
    bad = ~np.isclose(o64, r64, rtol=tol, atol=tol * scale) | ~np.isfinite(o64)
    nan = np.isnan(o64)
    msg = f"{name}: relative error {err:.3g} > tolerance {tol:.1g}"
    if nan.any():
        msg += f"; {int(nan.sum())} of {o.size} elements are NaN (never written?)"
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        msg += (
            f"; first mismatch at index {idx}: got {o64[idx].item()!r}, expected "
            f"{r64[idx].item()!r} ({int(bad.sum())} mismatching elements)"
        )
    causes = []
    if not nan.any():
        causes = _pattern_causes(o64, r64, tol, tol * scale)
    elif np.all(np.isfinite(r64)):
        causes = _unwritten_causes(nan)
        k = _tail_start(nan.reshape(-1)) if o64.ndim == 1 else None
        if k is not None:  # the written part may show why the tail was left out
            causes = _pattern_causes(o64[:k], r64[:k], tol, tol * scale) or causes
    raise CheckError("; ".join([msg, *causes]))


# A quiet NaN with a payload no arithmetic produces (a GPU returns its canonical
# NaN from any operation on NaNs). Guard cells compare bit patterns, so a kernel
# that writes a computed NaN out of bounds -- say, after reading someone else's
# poisoned cells -- is still caught.
_POISON_BITS = {
    np.dtype(np.float16): np.uint16(0x7E5A),
    np.dtype(np.float32): np.uint32(0x7FC0DEAD),
    np.dtype(np.float64): np.uint64(0x7FF80000DEADBEEF),
}


def poison_value(dtype: Any) -> Any:
    """A NaN with a distinctive payload for floats (both parts of a complex: an
    unwritten imaginary part is NaN too); the minimum (signed) or maximum
    (unsigned) for integers; True for booleans."""
    dt = np.dtype(dtype)
    if dt in _POISON_BITS:
        return _POISON_BITS[dt].view(dt)
    if dt.kind == "c" and np.dtype(f"f{dt.itemsize // 2}") in _POISON_BITS:
        part = poison_value(np.dtype(f"f{dt.itemsize // 2}"))
        return np.array([part, part]).view(dt)[0]
    if dt.kind in "fc":
        return np.nan
    if dt.kind == "i":
        return np.iinfo(dt).min
    if dt.kind == "u":
        return np.iinfo(dt).max
    if dt.kind == "b":
        return True
    raise TypeError(f"cannot poison dtype {dt}")


def poisoned(shape: int | Sequence[int], dtype: Any = np.float32) -> Any:
    """A device array filled with poison (see :func:`poison_value`)."""
    return cuda.to_device(np.full(shape, poison_value(dtype), dtype=dtype))


@dataclass
class Guarded:
    """An output view inside a larger poisoned buffer; see :func:`guarded`."""

    array: Any  # the device array to pass to the kernel
    _buffer: Any
    _start: int
    _stop: int

    def outside_values(self) -> np.ndarray:
        """The guard cells (both sides, copied to the host): all poison unless written."""
        host = self._buffer.copy_to_host()
        return np.concatenate([host[: self._start], host[self._stop :]])

    def outside_untouched(self) -> bool:
        outside = self.outside_values()
        poison = np.full(1, poison_value(outside.dtype), dtype=outside.dtype)
        # Compare bits, not values: NaN != NaN, and a computed NaN is not poison.
        return bool(
            np.all(outside.view(np.uint8).reshape(outside.size, -1) == poison.view(np.uint8))
        )

    def check_untouched(self, name: str = "output") -> None:
        """Raise CheckError if the kernel wrote outside ``array``, saying where."""
        __tracebackhide__ = True
        if self.outside_untouched():
            return
        outside = self.outside_values()
        poison = np.full(1, poison_value(outside.dtype), dtype=outside.dtype)
        written = ~np.all(
            outside.view(np.uint8).reshape(outside.size, -1) == poison.view(np.uint8), axis=1
        )
        before = int(written[: self._start].sum())
        after = int(written[self._start :].sum())
        where = ", ".join(
            part
            for part in (
                f"{before} cells before its start" if before else "",
                f"{after} cells past its end" if after else "",
            )
            if part
        )
        raise CheckError(
            f"{name}: the kernel wrote outside the output array ({where}): missing "
            "bounds check? threads past the end must do nothing"
        )


def guarded(shape: int | Sequence[int], dtype: Any = np.float32, pad: int = 64) -> Guarded:
    """A poisoned, C-contiguous device output with ``pad`` poisoned cells on each side.

    ``g.array`` has the requested shape; after the launch, ``g.check_untouched()``
    raises if anything outside it was written.
    """
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape_t))
    buf = cuda.to_device(np.full(n + 2 * pad, poison_value(dtype), dtype=dtype))
    view = buf[pad : pad + n]
    if len(shape_t) != 1:
        view = view.reshape(shape_t)
    return Guarded(array=view, _buffer=buf, _start=pad, _stop=pad + n)


def random_array(
    shape: int | Sequence[int],
    dtype: Any = np.float32,
    rng: np.random.Generator | None = None,
    low: float | None = None,
    high: float | None = None,
) -> np.ndarray:
    """Fresh random host data, never all zeros: standard normal, or uniform in
    [low, high) for floats; uniform integers in [low, high) for ints (default
    [-100, 100), or [0, 100) for unsigned)."""
    rng = rng if rng is not None else np.random.default_rng()
    dt = np.dtype(dtype)
    if dt.kind == "f":
        if low is None and high is None:
            return rng.standard_normal(shape).astype(dt)
        return rng.uniform(low or 0.0, 1.0 if high is None else high, shape).astype(dt)
    if dt.kind in "iu":
        lo = low if low is not None else (0 if dt.kind == "u" else -100)
        hi = high if high is not None else 100
        return rng.integers(lo, hi, shape).astype(dt)
    raise TypeError(f"random_array does not handle dtype {dt}")


def hostile_sizes(block: int, rng: np.random.Generator | None = None) -> list[int]:
    """1-D problem sizes that catch indexing bugs for a block (or tile) of ``block``.

    One element, one short of a block, one past a block, several blocks plus
    a remainder, and one random size. Simulator-friendly (a few blocks at most).
    """
    rng = rng if rng is not None else np.random.default_rng()
    sizes = [1, max(block - 1, 1), block + 1, 3 * block + 7, int(rng.integers(2, 4 * block))]
    if not is_simulator():
        sizes.append(1000 * block + 13)
    return sizes
