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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .runtime import is_simulator


class CheckError(AssertionError):
    """A kernel's output does not match its reference."""


def _to_host(a: Any) -> np.ndarray:
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "detach"):  # torch tensor
        return a.detach().cpu().numpy()
    return np.asarray(a)


def require_device_array(a: Any, name: str, ndim: int | None = None, dtype: Any = None) -> None:
    """Raise a clear error unless ``a`` is a Numba device array of ``ndim``/``dtype``.

    Launchers call it before launching: a host NumPy array would be copied to the
    GPU and back behind the caller's back, and a wrong dtype or rank makes a
    kernel read garbage instead of failing.

    Raises:
        TypeError: not a device array (NumPy arrays have no ``copy_to_host``),
            or the wrong dtype.
        ValueError: the wrong number of dimensions.
    """
    if not hasattr(a, "copy_to_host"):
        raise TypeError(f"{name} must be a device array (cuda.to_device(...)), got {type(a)}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}; convert with .astype")


def rel_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64; ``inf`` if ``out`` holds NaN or inf.

    Args:
        out: array-like (NumPy, Numba device array, torch tensor), any shape.
        ref: array-like of the same shape; its norm must be non-zero (never
            check against all zeros: it hides unwritten outputs).

    Raises:
        ValueError: shapes differ, or ``ref`` is all zeros.
    """
    o = _to_host(out).astype(np.float64)
    r = _to_host(ref).astype(np.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: out {o.shape} vs reference {r.shape}")
    if not np.all(np.isfinite(o)):
        return float("inf")
    norm = np.linalg.norm(r)
    if norm == 0:
        raise ValueError(
            "the reference is all zeros, so a relative error means nothing; "
            "draw random non-zero inputs"
        )
    return float(np.linalg.norm(o - r) / norm)


def check(out: Any, ref: Any, tol: float = 1e-5, name: str = "output") -> float:
    """Assert ``rel_error(out, ref) <= tol``; return the error.

    Integer and boolean outputs must match exactly (``tol`` ignored).

    Raises:
        CheckError: with the relative error, the number of unwritten (NaN)
            elements and the first mismatching index with both values.
    """
    o = _to_host(out)
    r = _to_host(ref)
    if o.shape != r.shape:
        raise CheckError(f"{name}: shape {o.shape}, expected {r.shape}")
    if o.dtype.kind in "iub" or r.dtype.kind in "iub":
        bad = o != r
        if not bad.any():
            return 0.0
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckError(
            f"{name}: {int(bad.sum())} of {o.size} elements differ; first at index "
            f"{idx}: got {o[idx]!r}, expected {r[idx]!r}"
        )
    err = rel_error(o, r)
    if err <= tol:
        return err
    o64, r64 = o.astype(np.float64), r.astype(np.float64)
    scale = np.abs(r64).max()
    bad = ~np.isclose(o64, r64, rtol=tol, atol=tol * scale) | ~np.isfinite(o64)
    nan_count = int(np.isnan(o64).sum())
    msg = f"{name}: relative error {err:.3g} > tolerance {tol:.1g}"
    if nan_count:
        msg += f"; {nan_count} of {o.size} elements are NaN (never written?)"
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        msg += (
            f"; first mismatch at index {idx}: got {o64[idx]!r}, expected "
            f"{r64[idx]!r} ({int(bad.sum())} mismatching elements)"
        )
    raise CheckError(msg)


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
    """A NaN with a distinctive payload for floats; the minimum (signed) or
    maximum (unsigned) for integers; True for booleans."""
    dt = np.dtype(dtype)
    if dt in _POISON_BITS:
        return _POISON_BITS[dt].view(dt)
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
    from numba import cuda

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
        return bool(np.all(outside.view(np.uint8).reshape(outside.size, -1)
                           == poison.view(np.uint8)))

    def check_untouched(self, name: str = "output") -> None:
        """Raise CheckError if the kernel wrote outside ``array``."""
        if not self.outside_untouched():
            raise CheckError(
                f"{name}: the kernel wrote outside the output array (missing "
                "bounds check? threads past the end must do nothing)"
            )


def guarded(shape: int | Sequence[int], dtype: Any = np.float32, pad: int = 64) -> Guarded:
    """A poisoned, C-contiguous device output with ``pad`` poisoned cells on each side.

    ``g.array`` has the requested shape; after the launch, ``g.check_untouched()``
    raises if anything outside it was written.
    """
    from numba import cuda

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
