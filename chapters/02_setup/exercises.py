"""Chapter 2 exercises: read device limits, and use them before launching.
Replace each `raise NotImplementedError` with your code.

Run the checks: python -m pytest tests/test_ch02_setup.py -q
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime  # noqa: F401  (for your answer)

from numba import cuda  # noqa: F401  (for your answer)


def max_threads_per_block():
    """Exercise 2.1: the largest block this device accepts, as an int.

    On a GPU: the attribute MAX_THREADS_PER_BLOCK of ``cuda.get_current_device()``.
    In the simulator (``runtime.is_simulator()``): ``runtime.MAX_THREADS_PER_BLOCK``.
    """
    raise NotImplementedError("Exercise 2.1: max_threads_per_block")


def launch_config(n, threads_per_block):
    """Exercise 2.2: (blocks, threads_per_block) covering n elements, one thread each.

    Raises:
        ValueError: n < 1; threads_per_block < 1 or above :func:`max_threads_per_block`
            (say the limit in the message: a GPU would refuse the launch).
    """
    raise NotImplementedError("Exercise 2.2: launch_config")
