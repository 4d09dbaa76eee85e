"""Check-then-time every version of an operation against one reference.

The pattern of every chapter script (after llm.c's ``dev/cuda``): a float64
reference, then each kernel version in order; each writes into a freshly
poisoned output, is checked against the reference, then timed by the same
harness, and one table shows them side by side.

    results = run_versions(
        {"naive": add_naive,                                  # add_naive(a, b, out)
         "naive, block 1024": partial(add_naive, threads_per_block=1024),
         "grid-stride": add_grid_stride},
        (a, b),
        reference=a_host.astype(np.float64) + b_host,
        out_shape=n, out_dtype=np.float32, tol=1e-6, nbytes=3 * 4 * n,
        title="vector add",
    )

Each version is a *launcher*: a function that takes the inputs and then the
output, and launches (``launcher(*args, out)``). A version that needs other
launch settings is the same launcher with them bound by ``functools.partial``.

A failed check raises :class:`common.checking.CheckError`, so a script exits
non-zero when any version is wrong.

Every chapter script also shares its command line and its ending:
:func:`script_parser` (the ``--out DIR`` option), :func:`save_results` (the
JSON written there) and :func:`run_script` (exit code; a failed check is one
``CHECK FAILED`` line, not a traceback).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .checking import CheckError, check, poisoned
from .runtime import runtime_name
from .timing import Timing, benchmark, device_peaks, format_table, write_json


def run_versions(
    versions: Mapping[str, Callable[..., Any]],
    args: Sequence[Any],
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
    hold_ms: int = 0,
) -> list[Timing]:
    """Check each ``launcher(*args, out)`` against ``reference``, then time it.

    Args:
        versions: name -> launcher; ``launcher(*args, out)`` writes the result
            into the device array ``out`` (launch only; no synchronize needed).
        args: the inputs every launcher takes before ``out`` (device arrays,
            scalars), the same for every version.
        reference: float64 (or exact integer) expected result, shape ``out_shape``.
        out_shape, out_dtype: the output buffer each version writes; poisoned
            (NaN / sentinel) before the checked run.
        tol: largest accepted ``||out - ref|| / ||ref||``.
        nbytes, flops: per call, for GB/s and TFLOP/s (see :func:`common.timing.benchmark`).
        hold_ms: > 0 times GPU time only: the timed calls are queued behind a kernel
            that holds the GPU this long (:func:`common.timing.hold_stream`), so a
            launcher whose host-side cost rivals its kernels' run time (several
            Numba launches of tens of microseconds) is not timed by its host.

    Returns:
        One :class:`Timing` per version, with ``extra["rel_error"]`` set.

    Raises:
        CheckError: the first version whose output is wrong.
    """
    results = []
    for name, launcher in versions.items():
        out = poisoned(out_shape, out_dtype)
        launcher(*args, out)
        err = check(out, reference, tol=tol, name=name)
        t = benchmark(
            partial(launcher, *args, out),
            name,
            nbytes=nbytes,
            flops=flops,
            warmup=warmup,
            repeats=repeats,
            peaks=peaks,
            hold_ms=hold_ms,
        )
        t.extra["rel_error"] = err
        results.append(t)
    if print_table:
        print(format_table(results, title=title))
    return results


def positive_int(text: str) -> int:
    """argparse ``type=``: an int >= 1, else the error argparse prints (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite float > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse ``type=``: a comma list of ints >= 1 ("64,256,1024"), else the
    error argparse prints (exit status 2)."""
    values = [positive_int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of whole numbers >= 1, got {text!r}"
        )
    return values


def comma_names(
    choices: Sequence[str], normalize: Callable[[str], str] = str.strip
) -> Callable[[str], list[str]]:
    """An argparse ``type=`` for a comma list of names from ``choices``
    ("tf32,bf16" -> ["tf32", "bf16"]); each name passes through ``normalize``
    first (default: strip spaces). An empty list or an unknown name is the
    error argparse prints (exit status 2), naming the choices."""

    def parse(text: str) -> list[str]:
        names = [normalize(part) for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"bad list {text!r}: choose from {', '.join(choices)} (comma-separated)"
            )
        return names

    return parse


def script_parser(doc: str, chapter: str) -> argparse.ArgumentParser:
    """The parser every chapter script starts from: its description is the
    first line of ``doc`` (the script's docstring) and it has ``--out DIR``
    (default ``runs/<chapter>``). Add the script's own options, then parse."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    default = Path("runs") / chapter
    parser.add_argument(
        "--out", type=Path, default=default, help=f"folder for the JSON results (default {default})"
    )
    return parser


def save_results(
    results: Sequence[Timing | dict[str, Any]], out: str | Path, name: str, **meta: Any
) -> Path:
    """Write ``results`` (Timings, or dicts of JSON values) to ``out/<name>.json``
    with the device, its copy bandwidth and the runtime; print and return the path."""
    path = Path(out) / f"{name}.json"
    peaks = device_peaks()
    write_json(
        results,
        path,
        device=peaks.get("device"),
        copy_gbps=peaks.get("copy_gbps"),
        runtime=runtime_name(),
        **meta,
    )
    print(f"wrote {path}")
    return path


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's ``main()`` and exit with its return code (None is 0). A
    failed check prints ``CHECK FAILED: <what failed>`` and exits 1: the check's
    message says what is wrong, and a traceback through the harness would not."""
    try:
        code = main()
    except CheckError as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)
