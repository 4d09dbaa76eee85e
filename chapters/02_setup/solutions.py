"""Chapter 2 exercises, solved: read device limits, and use them before launching.
Same functions as exercises.py; tests check both.

Run the checks: python -m pytest tests/test_ch02_setup.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime

from numba import cuda


def max_threads_per_block():
    """Exercise 2.1: the largest block this device accepts, as an int.

    On a GPU: the attribute MAX_THREADS_PER_BLOCK of ``cuda.get_current_device()``.
    In the simulator (``runtime.is_simulator()``): ``runtime.MAX_THREADS_PER_BLOCK``.
    """
    if runtime.is_simulator():
        return runtime.MAX_THREADS_PER_BLOCK
    return int(cuda.get_current_device().MAX_THREADS_PER_BLOCK)


def launch_config(n, threads_per_block):
    """Exercise 2.2: (blocks, threads_per_block) covering n elements, one thread each.

    Raises:
        ValueError: n < 1; threads_per_block < 1 or above :func:`max_threads_per_block`
            (say the limit in the message: a GPU would refuse the launch).
    """
    limit = max_threads_per_block()
    if n < 1:
        raise ValueError(f"need n >= 1 elements, got {n}")
    if not 1 <= threads_per_block <= limit:
        raise ValueError(
            f"threads_per_block={threads_per_block} is outside 1..{limit}, the device's limit"
        )
    return (n + threads_per_block - 1) // threads_per_block, threads_per_block
