"""Chapter 4 exercises: the typical GPU program, and timing it right.
Replace each `raise NotImplementedError` with your code.

Run the checks: python -m pytest tests/test_ch04_gpu_intro.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div  # noqa: F401  (for your launch)

import numpy as np
from numba import cuda


@cuda.jit(cache=True)
def scale_kernel(x, alpha, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = alpha * x[i]


# ---------------------------------------------------------------- 4.1 the typical program


def gpu_roundtrip(x_host, alpha, threads_per_block=128):
    """Exercise 4.1: the four steps of every GPU program, for ``alpha * x_host``.

    1. copy the input to the device (cuda.to_device), 2. allocate the output on the
    device (cuda.device_array), 3. launch ``scale_kernel`` with one thread an element,
    4. copy the result back (copy_to_host) and return it.

    Args:
        x_host: float32 NumPy array (n,), n >= 1; must not be modified.
        alpha: Python float, converted to float32.

    Returns:
        float32 NumPy array (n,) on the host.

    Raises:
        TypeError: x_host is not a float32 NumPy array.
    """
    if not isinstance(x_host, np.ndarray) or x_host.dtype != np.float32:
        raise TypeError("x_host must be a float32 NumPy array; use np.asarray(x, np.float32)")
    # TODO: copy in, allocate the output, launch scale_kernel, copy out
    raise NotImplementedError("Exercise 4.1: gpu_roundtrip")


# ---------------------------------------------------------------- 4.2 timing with events


def time_with_events(fn, repeats=10):
    """Exercise 4.2: GPU time of each of ``repeats`` calls of ``fn()``, in ms.

    ``fn`` launches work and returns at once (asynchronously). Record a CUDA event
    before and after each call, wait for the second, and read the time between
    them (cuda.event(), .record(), .synchronize(), .elapsed_time). Call ``fn`` once
    first, untimed, so the JIT compile is not counted.

    Returns:
        list of ``repeats`` floats (ms). In the simulator events hold no times;
        return what elapsed_time gives.
    """
    # TODO: warm up once, then record events around each call and read elapsed_time
    raise NotImplementedError("Exercise 4.2: time_with_events")
