"""Chapter 1 exercises, solved: the roofline arithmetic behind "memory bandwidth is
the usual bottleneck". Same functions as exercises.py; tests check both.

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
    if nbytes <= 0 or flops < 0:
        raise ValueError(f"need nbytes > 0 and flops >= 0, got {nbytes}, {flops}")
    return flops / nbytes


def roofline_ms(flops, nbytes, peak_tflops, peak_gbps):
    """Exercise 1.2: the least time (ms) an operation can take on a device.

    The memory system moves at most ``peak_gbps`` GB/s (1e9 bytes/s) and the
    arithmetic units do at most ``peak_tflops`` TFLOP/s (1e12 FLOP/s); they work at
    the same time, so the bound is the larger of the two times, not their sum.
    """
    return max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)) * 1e3


def bound_by(flops, nbytes, peak_tflops, peak_gbps):
    """Exercise 1.3: "memory" if moving the bytes takes longer than the arithmetic
    at peak rates, else "compute" (ties count as "compute")."""
    memory_s = nbytes / (peak_gbps * 1e9)
    compute_s = flops / (peak_tflops * 1e12)
    return "memory" if memory_s > compute_s else "compute"
