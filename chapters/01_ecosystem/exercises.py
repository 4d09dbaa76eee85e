"""Chapter 1 exercises: the roofline arithmetic behind "memory bandwidth is
the usual bottleneck". Replace each `raise NotImplementedError` with your code.

Source: Williams, Waterman, Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009.

Run the checks: python -m pytest tests/test_ch01_ecosystem.py -q
"""


def arithmetic_intensity(flops, nbytes):
    """Exercise 1.1: FLOPs done per byte moved to or from device memory (FLOP/byte).

    Example: float32 vector add does 1 FLOP per 12 bytes (two loads, one store): 1/12.

    Raises:
        ValueError: nbytes <= 0 or flops < 0.
    """
    raise NotImplementedError("Exercise 1.1: arithmetic_intensity")


def roofline_ms(flops, nbytes, peak_tflops, peak_gbps):
    """Exercise 1.2: the least time (ms) an operation can take on a device.

    The memory system moves at most ``peak_gbps`` GB/s (1e9 bytes/s) and the
    arithmetic units do at most ``peak_tflops`` TFLOP/s (1e12 FLOP/s); they work at
    the same time, so the bound is the larger of the two times, not their sum.
    """
    raise NotImplementedError("Exercise 1.2: roofline_ms")


def bound_by(flops, nbytes, peak_tflops, peak_gbps):
    """Exercise 1.3: "memory" if moving the bytes takes longer than the arithmetic
    at peak rates, else "compute" (ties count as "compute")."""
    raise NotImplementedError("Exercise 1.3: bound_by")
