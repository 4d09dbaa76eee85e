"""Chapter 3 exercises: flat indices, strides, ceil_div, a float32-pure kernel.
Replace each `raise NotImplementedError` with your code.

Run the checks: python -m pytest tests/test_ch03_python_for_kernels.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

import numpy as np
from numba import cuda

# ---------------------------------------------------------------- 3.1 flat index


def flat_index(i, j, ncols):
    """Exercise 3.1a: position of element (i, j) of a row-major (C-order) matrix
    with ``ncols`` columns in its flat buffer. Same as ``np.ravel_multi_index((i, j), (nrows, ncols))``.

    Args: i, j, ncols: non-negative Python ints, j < ncols. Returns: int.
    """
    raise NotImplementedError("Exercise 3.1a: flat_index")


def unflat_index(k, ncols):
    """Exercise 3.1b: the inverse of :func:`flat_index`: flat position k -> (i, j).

    Same as ``np.unravel_index(k, (nrows, ncols))``. Returns: a tuple of two ints.
    """
    raise NotImplementedError("Exercise 3.1b: unflat_index")


# ---------------------------------------------------------------- 3.2 strides


def byte_offset(index, strides):
    """Exercise 3.2: how many bytes past an array's first element ``arr[index]`` lies.

    Works for any NumPy view (transposed, sliced with steps) given its ``strides``:
    ``arr.strides`` is the number of bytes to step in each dimension.

    Args:
        index: tuple of non-negative ints, one per dimension.
        strides: tuple of ints (bytes), same length.

    Returns:
        int, in bytes.

    Raises:
        ValueError: index and strides have different lengths.
    """
    raise NotImplementedError("Exercise 3.2: byte_offset")


# ---------------------------------------------------------------- 3.3 ceil_div


def ceil_div(a, b):
    """Exercise 3.3: the smallest integer >= a / b, for ints a >= 0, b >= 1.

    The number of blocks of b threads needed to cover a elements. Use integer
    arithmetic only: float division is wrong above 2**53.

    Raises:
        ValueError: b < 1 or a < 0.
    """
    raise NotImplementedError("Exercise 3.3: ceil_div")


# ---------------------------------------------------------------- 3.4 float32-pure kernel

# p(x) = 0.5 x^3 - 1.25 x^2 + 2 x - 3, coefficients as float32 so no float64 creeps in.
C3, C2, C1, C0 = np.float32(0.5), np.float32(-1.25), np.float32(2.0), np.float32(-3.0)


def horner_f32(x):
    """Exercise 3.4a: p(x) = 0.5 x^3 - 1.25 x^2 + 2 x - 3 by Horner's rule, all in float32.

    A plain function that the kernel below compiles as a device function. Given a
    float32 x, every operation and the result must be float32: a bare literal such
    as ``0.5`` is a float64 in Numba and turns the whole expression into float64.
    """
    # TODO: Horner's rule with C3, C2, C1, C0 (already float32)
    raise NotImplementedError("Exercise 3.4a: horner_f32")


horner_f32_device = cuda.jit(device=True)(horner_f32)


@cuda.jit(cache=True)
def poly_kernel(x, out):
    i = cuda.grid(1)
    if i < out.size:
        # TODO: out[i] = horner_f32_device(x[i])
        pass


def poly_f32(x, out, threads_per_block=128):
    """Exercise 3.4b: ``out[i] = p(x[i])`` with :func:`horner_f32`, one thread an element.

    Args:
        x, out: float32 device arrays of shape (n,).

    Raises:
        TypeError: a non-float32 array (a float64 array would hide the promotion).
    """
    if x.dtype != np.float32 or out.dtype != np.float32:
        raise TypeError(f"x and out must be float32, got {x.dtype} and {out.dtype}")
    raise NotImplementedError("Exercise 3.4b: fill poly_kernel's TODO, then delete this line")
    blocks = (out.size + threads_per_block - 1) // threads_per_block
    poly_kernel[blocks, threads_per_block](x, out)
