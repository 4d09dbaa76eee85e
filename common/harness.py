"""Check-then-time every version of an operation against one reference.

The pattern of every chapter script (after llm.c's ``dev/cuda``): a float64
reference, then each kernel version in order; each writes into a freshly
poisoned output, is checked against the reference, then timed by the same
harness, and one table shows them side by side.

    results = run_versions(
        {"naive": lambda out: add_naive[grid, block](a, b, out),
         "grid-stride": lambda out: add_stride[sms * 4, 256](a, b, out)},
        reference=a_host.astype(np.float64) + b_host,
        out_shape=n, out_dtype=np.float32, tol=1e-6, nbytes=3 * 4 * n,
        title="vector add",
    )

A failed check raises :class:`common.checking.CheckError`, so a script exits
non-zero when any version is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .checking import check, poisoned
from .timing import Timing, benchmark, format_table


def run_versions(
    versions: Mapping[str, Callable[[Any], Any]],
    reference: np.ndarray,
    out_shape: int | Sequence[int],
    out_dtype: Any = np.float32,
    *,
    tol: float = 1e-5,
    nbytes: int | None = None,
    flops: int | None = None,
    title: str | None = None,
    warmup: int = 3,
    repeats: int = 20,
    peaks: dict[str, Any] | None = None,
    print_table: bool = True,
) -> list[Timing]:
    """Check each ``version(out)`` against ``reference``, then time it.

    Args:
        versions: name -> function writing the result into the device array
            ``out`` it is given (launch only; no synchronize needed).
        reference: float64 (or exact integer) expected result, shape ``out_shape``.
        out_shape, out_dtype: the output buffer each version writes; poisoned
            (NaN / sentinel) before the checked run.
        tol: largest accepted ``||out - ref|| / ||ref||``.
        nbytes, flops: per call, for GB/s and TFLOP/s (see :func:`common.timing.benchmark`).

    Returns:
        One :class:`Timing` per version, with ``extra["rel_error"]`` set.

    Raises:
        CheckError: the first version whose output is wrong.
    """
    results = []
    for name, fn in versions.items():
        out = poisoned(out_shape, out_dtype)
        fn(out)
        err = check(out, reference, tol=tol, name=name)
        t = benchmark(lambda: fn(out), name, nbytes=nbytes, flops=flops,
                      warmup=warmup, repeats=repeats, peaks=peaks)
        t.extra["rel_error"] = err
        results.append(t)
    if print_table:
        print(format_table(results, title=title))
    return results
