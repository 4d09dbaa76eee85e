"""Can this machine run the course? ``python -m common.doctor``

Prints a deviceQuery-style table of the GPU (after the CUDA samples'
``deviceQuery``), the versions that matter, the active runtime, and then runs
one tiny kernel end to end. It recognises the known ways an install breaks and
prints the command that fixes each:

* numpy >= 2.5 with numba-cuda 0.30 (``np.row_stack`` was removed);
* numba's deprecated built-in ``numba.cuda`` loaded instead of numba-cuda;
* a driver older than the CUDA toolkit numba-cuda compiles with (PTX errors);
* NVRTC, NVVM or nvJitLink missing (the CUDA toolkit pieces numba-cuda needs).

It also says what the GPU lacks of what the course uses (one table,
:data:`common.targets.FEATURES`): below the course's minimum, compute capability
7.5, the toolkits and wheels the course installs do not build for it at all;
below 8.0 the TF32 comparisons (chapter 07, the capstone's ``compare.py
--torch-tf32``) show nothing.
``python -m common.targets`` checks every kernel against each architecture's
limits.

Exit status: 0 when kernels run (on the GPU or in the simulator), 1 otherwise.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from dataclasses import dataclass
from typing import Any

# isort: off
from . import runtime  # first: decides GPU or simulator before numba loads
from .targets import ARCHS, MIN_CC, capability_report
import numpy as np
from numba import cuda
# isort: on

CU_EXTRA = 'pip install -U "numba-cuda[cu12]"   (or [cu13] for a CUDA 13 driver: see nvidia-smi)'


@dataclass
class Finding:
    problem: str
    fix: str
    fatal: bool = True


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of Python and the packages the course depends on (None if absent)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("numba", "numba-cuda", "llvmlite", "numpy", "torch", "cuda-bindings"):
        out[dist] = _version(dist)
    return out


# Attributes a kernel writer uses, in the order deviceQuery prints them:
# (CUDA attribute name without CU_DEVICE_ATTRIBUTE_, label, unit conversion)
_ATTRIBUTES: list[tuple[str, str]] = [
    ("MULTIPROCESSOR_COUNT", "streaming multiprocessors (SMs)"),
    ("MAX_THREADS_PER_BLOCK", "max threads per block"),
    ("MAX_BLOCK_DIM_X", "max block dim x"),
    ("MAX_BLOCK_DIM_Y", "max block dim y"),
    ("MAX_BLOCK_DIM_Z", "max block dim z"),
    ("MAX_GRID_DIM_X", "max grid dim x"),
    ("MAX_GRID_DIM_Y", "max grid dim y"),
    ("MAX_GRID_DIM_Z", "max grid dim z"),
    ("WARP_SIZE", "warp size"),
    ("MAX_THREADS_PER_MULTIPROCESSOR", "max threads per SM"),
    ("MAX_BLOCKS_PER_MULTIPROCESSOR", "max blocks per SM"),
    ("MAX_SHARED_MEMORY_PER_BLOCK", "shared memory per block (bytes)"),
    ("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "shared memory per block, opt-in (bytes)"),
    ("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", "shared memory per SM (bytes)"),
    ("MAX_REGISTERS_PER_BLOCK", "32-bit registers per block"),
    ("MAX_REGISTERS_PER_MULTIPROCESSOR", "32-bit registers per SM"),
    ("L2_CACHE_SIZE", "L2 cache (bytes)"),
    ("CLOCK_RATE", "SM clock (kHz)"),
    ("MEMORY_CLOCK_RATE", "memory clock (kHz)"),
    ("GLOBAL_MEMORY_BUS_WIDTH", "memory bus width (bits)"),
    ("TOTAL_CONSTANT_MEMORY", "constant memory (bytes)"),
    ("ASYNC_ENGINE_COUNT", "copy engines"),
    ("CONCURRENT_KERNELS", "concurrent kernels"),
    ("UNIFIED_ADDRESSING", "unified addressing"),
    ("ECC_ENABLED", "ECC enabled"),
]


def device_attributes() -> dict[str, Any]:
    """Attributes of the current GPU, keyed by CUDA name (``"WARP_SIZE"``, ...).

    Also ``"name"``, ``"compute_capability"`` (tuple), ``"total_memory_bytes"``,
    ``"uuid"`` and ``"theoretical_bandwidth_gbps"`` (2 x memory clock x bus
    width: DDR transfers twice a clock; a datasheet-style ceiling, above what a
    copy achieves). Units are the driver's: clocks in kHz, sizes in bytes.

    Raises:
        RuntimeError: in the simulator, which has no device attributes.
    """
    if runtime.is_simulator():
        raise RuntimeError("the CUDA simulator has no device attributes")
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    attrs: dict[str, Any] = {
        "name": name,
        "compute_capability": tuple(dev.compute_capability),
        "uuid": getattr(dev, "uuid", ""),
    }
    for key, _ in _ATTRIBUTES:
        try:
            attrs[key] = int(getattr(dev, key))
        except Exception:  # an attribute this driver does not know
            attrs[key] = None
    _, total = cuda.current_context().get_memory_info()
    attrs["total_memory_bytes"] = int(total)
    if attrs.get("MEMORY_CLOCK_RATE") and attrs.get("GLOBAL_MEMORY_BUS_WIDTH"):
        attrs["theoretical_bandwidth_gbps"] = (
            2 * attrs["MEMORY_CLOCK_RATE"] * 1e3 * attrs["GLOBAL_MEMORY_BUS_WIDTH"] / 8 / 1e9
        )
    return attrs


def _driver_and_toolkit() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    driver_v = toolkit_v = None
    try:
        from numba.cuda.cudadrv import driver

        driver_v = tuple(driver.driver.get_version())
    except Exception:
        pass
    try:
        from numba.cuda.cudadrv import runtime as cuda_runtime

        toolkit_v = tuple(cuda_runtime.get_version())
    except Exception:
        pass
    return driver_v, toolkit_v  # type: ignore[return-value]


def static_findings(vers: dict[str, str | None]) -> list[Finding]:
    """Breakages visible from versions and imports alone."""
    found: list[Finding] = []
    np_v, nc_v = vers.get("numpy"), vers.get("numba-cuda")
    if (
        np_v
        and nc_v
        and nc_v.startswith("0.30")
        and tuple(int(x) for x in np_v.split(".")[:2]) >= (2, 5)
    ):
        found.append(
            Finding(
                f"numpy {np_v} with numba-cuda {nc_v}: numba-cuda 0.30 uses np.row_stack, "
                "removed in numpy 2.5, so no kernel compiles",
                'pip install "numpy>=2.0,<2.5"',
            )
        )
    if nc_v is None:
        found.append(
            Finding(
                "numba-cuda is not installed: numba's built-in numba.cuda is deprecated "
                "and not what this course targets",
                'pip install "numba-cuda>=0.30,<0.31"   (GPU: ' + CU_EXTRA + ")",
            )
        )
    else:
        if "numba_cuda" not in (cuda.__file__ or ""):
            found.append(
                Finding(
                    f"numba.cuda was loaded from {cuda.__file__}, numba's built-in "
                    "(deprecated) copy, instead of the numba-cuda package",
                    'pip uninstall -y numba-cuda && pip install "numba-cuda>=0.30,<0.31"',
                )
            )
    return found


def toolkit_findings() -> list[Finding]:
    """GPU only: NVRTC / NVVM / nvJitLink present, driver new enough for the toolkit."""
    found: list[Finding] = []
    try:
        from cuda import pathfinder
    except ImportError:
        return [Finding("cuda-pathfinder (a numba-cuda dependency) is missing", CU_EXTRA)]
    for lib, why in (
        ("nvrtc", "compiles CUDA C++ and reports the toolkit version"),
        ("nvvm", "turns Numba's LLVM IR into PTX"),
        ("nvJitLink", "links PTX and LTO-IR"),
    ):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception as exc:  # pathfinder raises its own DynamicLibNotFound
            found.append(
                Finding(
                    f"{lib} not found ({why}): {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                    CU_EXTRA,
                    fatal=lib != "nvJitLink",
                )
            )
    driver_v, toolkit_v = _driver_and_toolkit()
    if driver_v and toolkit_v and driver_v < toolkit_v:
        found.append(
            Finding(
                f"the driver supports CUDA {driver_v[0]}.{driver_v[1]} but the toolkit is "
                f"{toolkit_v[0]}.{toolkit_v[1]}: PTX it produces may be refused "
                "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
                f'update the NVIDIA driver, or install the toolkit matching it: pip install -U "numba-cuda[cu{driver_v[0]}]"',
                fatal=False,
            )
        )
    return found


def _cc_text(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def minimum_line(cc: tuple[int, int] | None = None) -> str:
    """The course's minimum compute capability and, given a GPU's, where it stands."""
    arch = ARCHS[MIN_CC]
    text = (
        f"course minimum: compute capability {_cc_text(MIN_CC)} ({arch.family}: {arch.examples}; "
        "the oldest that CUDA 13 and PyTorch's CUDA 12.8/13.0 wheels build for)"
    )
    if cc is None:
        return text
    if tuple(cc) < MIN_CC:
        return text + f"; this GPU: {_cc_text(cc)}, below it"
    _, missing = capability_report(cc)
    lacks = f", lacks {len(missing)} feature(s) named below" if missing else ", has all it uses"
    return text + f"; this GPU: {_cc_text(cc)}, meets it{lacks}"


def capability_findings(cc: tuple[int, int]) -> list[Finding]:
    """What a GPU of compute capability ``cc`` lacks of what the course uses.

    One warning when it is below :data:`~common.targets.MIN_CC` (listing every
    feature it lacks for that reason and what to do), then one per feature it
    lacks above that (:data:`~common.targets.FEATURES`: which chapter, and what
    that chapter then shows). Warnings, not fatal: kernels that compile and run
    are the smoke test's verdict, not this one's.
    """
    below, missing = capability_report(cc)
    found = []
    if below:
        found.append(
            Finding(
                f"compute capability {_cc_text(cc)} is below the course's minimum, "
                f"{_cc_text(MIN_CC)}: " + "; ".join(below),
                "use a GPU of compute capability 7.5 or newer (the free T4 of Google Colab or "
                "Kaggle is 7.5), or run every chapter in the simulator (NUMBA_ENABLE_CUDASIM=1). "
                "Untested by the course: numba-cuda[cu12] and PyTorch's CUDA 12.6 wheels "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu126) still "
                "build for 5.0 to 7.0",
                fatal=False,
            )
        )
    for line in missing:
        found.append(
            Finding(
                f"compute capability {_cc_text(cc)} has no {line}",
                "nothing to fix: the chapter runs; its figures differ from the notes' H100 ones",
                fatal=False,
            )
        )
    return found


def device_lines(attrs: dict[str, Any]) -> list[str]:
    """The device part of the report: name, compute capability, the attributes."""
    cc = attrs["compute_capability"]
    lines = [f"device 0: {attrs['name']}  (compute capability {_cc_text(cc)}, {attrs['uuid']})"]
    lines.append(f"  {'global memory':<42} {attrs['total_memory_bytes'] / 2**30:.1f} GiB")
    for key, label in _ATTRIBUTES:
        lines.append(f"  {label:<42} {_fmt_value(key, attrs.get(key))}")
    if "theoretical_bandwidth_gbps" in attrs:
        lines.append(
            f"  {'theoretical memory bandwidth (GB/s)':<42} "
            f"{attrs['theoretical_bandwidth_gbps']:,.0f}"
        )
    lines.append("  " + minimum_line(cc))
    return lines


def _classify(exc: BaseException) -> Finding:
    text = f"{type(exc).__name__}: {exc}"
    first = text.splitlines()[0][:300]
    if "row_stack" in text:
        return Finding(f"kernel compile failed: {first}", 'pip install "numpy>=2.0,<2.5"')
    if "PTX" in text and ("VERSION" in text.upper() or "unsupported" in text.lower()):
        return Finding(
            f"the driver refused the compiled PTX: {first}",
            "update the NVIDIA driver, or install the toolkit matching it: " + CU_EXTRA,
        )
    if any(k in text for k in ("nvrtc", "NVRTC", "nvvm", "NVVM", "nvJitLink", "libdevice")):
        return Finding(f"a CUDA toolkit library is missing: {first}", CU_EXTRA)
    if "CUDA_ERROR_NO_DEVICE" in text or "no CUDA-capable device" in text:
        return Finding(
            f"no GPU visible: {first}",
            "check nvidia-smi; or run without a GPU: NUMBA_ENABLE_CUDASIM=1",
        )
    return Finding(
        f"a test kernel failed: {first}", "run with NUMBA_CUDA_LOG_LEVEL=DEBUG and read the error"
    )


# Module level, not nested in smoke_test: the simulator runs a kernel by swapping
# the `cuda` name in the kernel's module globals, which a closure would bypass.
@cuda.jit
def _add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


def smoke_test() -> Finding | None:
    """Compile and run a vector add of 1000 elements; None if the result is right."""
    try:
        a = np.arange(1000, dtype=np.float32)
        b = np.full(1000, 0.5, dtype=np.float32)
        out = cuda.to_device(np.full(1000, np.nan, dtype=np.float32))
        _add[8, 128](cuda.to_device(a), cuda.to_device(b), out)
        got = out.copy_to_host()
        if not np.array_equal(got, a + b):
            return Finding(
                "a test kernel ran but gave wrong results", "report this with the doctor's output"
            )
    except Exception as exc:
        return _classify(exc)
    return None


_BYTE_VALUED = {
    "MAX_SHARED_MEMORY_PER_BLOCK",
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "L2_CACHE_SIZE",
    "TOTAL_CONSTANT_MEMORY",
}


def _fmt_version(v: tuple[int, ...] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "unknown"


def _fmt_value(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if key in _BYTE_VALUED:
        return f"{v:,} ({v / 1024:,.0f} KiB)"
    return f"{v:,}" if isinstance(v, int) else str(v)


def report() -> int:
    """Print the doctor's report; return the exit status."""
    vers = versions()
    lines = ["CUDA course doctor", "=" * 60]
    lines.append(f"runtime: {runtime.runtime_name()} ({runtime.REASON})")
    lines.append("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in vers.items()))
    findings = static_findings(vers)
    below_minimum = False
    if runtime.is_simulator():
        lines.append("device: none -- the Numba CUDA simulator runs kernels as Python threads")
        lines.append(
            f"  limits the course enforces there, as a GPU would: "
            f"{runtime.MAX_THREADS_PER_BLOCK} threads per block, "
            f"{runtime.MAX_STATIC_SHARED_BYTES // 1024} KiB shared memory per block"
        )
        lines.append("  " + minimum_line())
    else:
        try:
            attrs = device_attributes()
        except Exception as exc:
            findings.append(_classify(exc))
            attrs = None
        if attrs:
            lines += device_lines(attrs)
            findings += capability_findings(attrs["compute_capability"])
            below_minimum = attrs["compute_capability"] < MIN_CC
        driver_v, toolkit_v = _driver_and_toolkit()
        lines.append(f"  {'CUDA driver version':<42} {_fmt_version(driver_v)}")
        lines.append(f"  {'CUDA toolkit (NVRTC) version':<42} {_fmt_version(toolkit_v)}")
        findings += toolkit_findings()
    failure = smoke_test()
    if failure:
        findings.append(failure)
    lines.append(f"test kernel (vector add, 1000 elements): {'FAILED' if failure else 'ok'}")
    for f in findings:
        lines.append(("PROBLEM: " if f.fatal else "warning: ") + f.problem)
        lines.append("  fix: " + f.fix)
    ok = failure is None and not any(f.fatal for f in findings)
    if not ok:
        verdict = "kernels cannot run; apply the fixes above"
    elif below_minimum:
        verdict = (
            f"kernels run, but this GPU is below the course's minimum (compute capability "
            f"{_cc_text(MIN_CC)}): see the warning above"
        )
    else:
        verdict = "ready -- kernels run on " + runtime.runtime_name()
    lines.append("verdict: " + verdict)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(report())
