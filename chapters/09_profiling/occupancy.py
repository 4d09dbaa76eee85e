"""Theoretical occupancy by hand, checked against the driver and Nsight Compute.

Occupancy is the fraction of an SM's warp slots a kernel can keep filled: the
warps of every block resident at once, over the SM's maximum (64 warps on an
H100). Four per-SM budgets decide how many blocks are resident; the tightest
one wins:

1. warps: ``max_threads_per_sm / 32`` warp slots, a block taking ceil(threads / 32);
2. blocks: at most ``max_blocks_per_sm`` (32 on an H100), however small;
3. registers: 65,536 a SM, split evenly over its 4 sub-partitions (SMSPs), a
   warp living on one of them. A warp takes ``registers_per_thread * 32``
   rounded up to 256; whole warps fit in an SMSP's 16,384;
4. shared memory: the block's static + dynamic bytes plus 1 KiB the system
   reserves per block (compute capability 8.0 and newer), rounded up to 128,
   out of the SM's shared memory (228 KiB on an H100).

The compiled kernel says how many registers and how much static shared memory
it uses (``kernel.get_regs_per_thread()``, ``kernel.get_shared_mem_per_block()``,
GPU only); the driver answers the same question
(``cuOccupancyMaxActiveBlocksPerMultiprocessor``); Nsight Compute prints it as
"Theoretical Occupancy" with a "Block Limit" per budget. This script computes all
three for the chapter's kernels (workloads.py). In the simulator, which compiles
nothing, it takes each kernel's registers and shared memory from the Nsight
Compute report saved from a GPU run (saved/ncu_*.csv) and checks the
calculator against ncu's figure from that same report.

Source of the rules: NVIDIA's CUDA Occupancy Calculator (``cuda_occupancy.h``
in the CUDA toolkit) and the CUDA C++ Programming Guide, "Compute
Capabilities" table of per-SM limits.

Run: python chapters/09_profiling/occupancy.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, import_sibling, is_simulator
from common.harness import run_script, save_results, script_parser
from common.timing import format_table

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from numba import cuda

nsight_compute = import_sibling(__file__, "nsight_compute")
tools = import_sibling(__file__, "tools")
workloads = import_sibling(__file__, "workloads")

WARP = 32
SUB_PARTITIONS = 4  # SMSPs per SM, each with a quarter of the register file (7.0 to 9.0)


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one compute capability (bytes, registers, threads)."""

    name: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    register_allocation_unit: int = 256  # registers, per warp
    shared_per_sm: int = 233472  # the largest carveout the driver can configure
    shared_allocation_unit: int = 128
    reserved_shared_per_block: int = 1024
    max_threads_per_block: int = 1024

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // WARP


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
KNOWN_LIMITS = {
    (7, 0): SMLimits("7.0 (V100)", 2048, 32, shared_per_sm=98304, reserved_shared_per_block=0),
    (7, 5): SMLimits(
        "7.5 (T4, RTX 20)", 1024, 16, shared_per_sm=65536, reserved_shared_per_block=0
    ),
    (8, 0): SMLimits("8.0 (A100)", 2048, 32, shared_per_sm=167936),
    (8, 6): SMLimits("8.6 (RTX 30, A10)", 1536, 16, shared_per_sm=102400),
    (8, 9): SMLimits("8.9 (RTX 40, L4, L40)", 1536, 24, shared_per_sm=102400),
    (9, 0): SMLimits("9.0 (H100, H200)", 2048, 32, shared_per_sm=233472),
}


@dataclass(frozen=True)
class Occupancy:
    """What :func:`theoretical_occupancy` finds for one launch configuration.

    block_limits: blocks per SM each budget allows ("warps", "blocks",
    "registers", "shared"); blocks_per_sm: the smallest of them; limiter: its
    name (the first in that order on a tie); warps_per_sm and occupancy
    (active warps over the SM's maximum, 0..1).
    """

    block_limits: dict[str, int]
    blocks_per_sm: int
    limiter: str
    warps_per_sm: int
    occupancy: float


def round_up(value: int, unit: int) -> int:
    return ceil_div(value, unit) * unit


def theoretical_occupancy(
    threads_per_block: int,
    registers_per_thread: int,
    shared_bytes_per_block: int,
    limits: SMLimits,
) -> Occupancy:
    """Blocks and warps per SM that fit, and which budget stops the next block.

    threads_per_block: 1..limits.max_threads_per_block; registers_per_thread:
    1..limits.max_registers_per_thread (as the compiler reports it);
    shared_bytes_per_block: static + dynamic shared memory, bytes, >= 0.
    Raises ValueError for values outside those ranges, or a block whose shared
    memory alone exceeds the SM's (it cannot launch at all).
    """
    if not 1 <= threads_per_block <= limits.max_threads_per_block:
        raise ValueError(
            f"threads_per_block must be in 1..{limits.max_threads_per_block}, got {threads_per_block}"
        )
    if not 1 <= registers_per_thread <= limits.max_registers_per_thread:
        raise ValueError(
            f"registers_per_thread must be in 1..{limits.max_registers_per_thread}, "
            f"got {registers_per_thread}"
        )
    if shared_bytes_per_block < 0:
        raise ValueError(f"shared_bytes_per_block must be >= 0, got {shared_bytes_per_block}")
    warps_per_block = ceil_div(threads_per_block, WARP)
    warp_registers = round_up(registers_per_thread * WARP, limits.register_allocation_unit)
    warps_per_partition = (limits.registers_per_sm // SUB_PARTITIONS) // warp_registers
    shared = round_up(
        shared_bytes_per_block + limits.reserved_shared_per_block, limits.shared_allocation_unit
    )
    if shared > limits.shared_per_sm:
        raise ValueError(
            f"a block needs {shared} bytes of shared memory, more than the SM's "
            f"{limits.shared_per_sm}: it cannot launch"
        )
    block_limits = {
        "warps": limits.max_warps_per_sm // warps_per_block,
        "blocks": limits.max_blocks_per_sm,
        "registers": (warps_per_partition * SUB_PARTITIONS) // warps_per_block,
        "shared": limits.shared_per_sm // shared if shared else limits.max_blocks_per_sm,
    }
    limiter = min(block_limits, key=block_limits.get)
    blocks = block_limits[limiter]
    warps = blocks * warps_per_block
    return Occupancy(block_limits, blocks, limiter, warps, warps / limits.max_warps_per_sm)


def device_limits() -> SMLimits:
    """The current GPU's limits, from its device attributes (GPU only).

    Raises RuntimeError in the simulator, and for a compute capability the
    course has no allocation rules for (the attributes give sizes, not rules).
    """
    if is_simulator():
        raise RuntimeError("the simulator has no SM: use KNOWN_LIMITS[(9, 0)] or another entry")
    dev = cuda.get_current_device()
    cc = dev.compute_capability
    if cc not in KNOWN_LIMITS:
        raise RuntimeError(
            f"no occupancy rules for compute capability {cc}; known: {sorted(KNOWN_LIMITS)}"
        )
    known = KNOWN_LIMITS[cc]
    return SMLimits(
        f"{cc[0]}.{cc[1]} ({dev.name.decode() if isinstance(dev.name, bytes) else dev.name})",
        dev.MAX_THREADS_PER_MULTIPROCESSOR,
        dev.MAX_BLOCKS_PER_MULTIPROCESSOR,
        registers_per_sm=dev.MAX_REGISTERS_PER_MULTIPROCESSOR,
        shared_per_sm=dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        reserved_shared_per_block=dev.RESERVED_SHARED_MEMORY_PER_BLOCK,
        register_allocation_unit=known.register_allocation_unit,
        shared_allocation_unit=known.shared_allocation_unit,
    )


def compiled_resources(kernel) -> dict[str, int]:
    """Registers per thread, static shared and local (spilled) bytes of a
    kernel's one compiled signature (GPU only: launch it once first).

    Raises ValueError if the kernel was compiled for no or several signatures."""
    if len(kernel.overloads) != 1:
        raise ValueError(
            f"{kernel.py_func.__name__} has {len(kernel.overloads)} compiled signatures; "
            "launch it once, with one set of argument types"
        )

    def one(value) -> int:  # numba-cuda: {signature: value}, or the value itself for a
        if isinstance(value, dict):  # kernel compiled eagerly from a signature
            (value,) = value.values()
        return value

    return {
        "registers": one(kernel.get_regs_per_thread()),
        "shared": one(kernel.get_shared_mem_per_block()),
        "local": one(kernel.get_local_mem_per_thread()),
    }


def driver_blocks_per_sm(kernel, threads: int, dynamic_shared: int = 0) -> int:
    """The driver's answer: cuOccupancyMaxActiveBlocksPerMultiprocessor for the
    kernel's one compiled signature (GPU only), with ``dynamic_shared`` bytes of
    dynamic shared memory a block.

    Above 48 KiB of dynamic shared memory a kernel must opt in
    (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; CUDA C++ Programming
    Guide, "Shared Memory"); until it does, the driver answers 0: it could not
    launch.
    """
    (compiled,) = kernel.overloads.values()
    cufunc = compiled._codelibrary.get_cufunc()  # numba-cuda 0.30: the CUfunction wrapper
    return cuda.current_context().get_active_blocks_per_multiprocessor(
        cufunc, threads, dynamic_shared
    )


def saved_launch_stats(path: Path) -> list[dict[str, Any]]:
    """From a saved ``ncu --csv --page details`` report: per profiled kernel its
    name, block size, registers, static shared bytes and ncu's theoretical
    occupancy (%), in profiling order."""
    rows = []
    for k in nsight_compute.parse_ncu_csv(path.read_text()):
        rows.append(
            {
                "kernel": k.name,
                "threads": k.block_threads,
                "registers": int(k.value("Registers Per Thread")),
                "shared": int(k.value("Static Shared Memory Per Block"))
                + int(k.value("Dynamic Shared Memory Per Block")),
                "ncu_pct": k.value("Theoretical Occupancy"),
            }
        )
    return rows


def _row(label, threads, registers, shared, occ: Occupancy, **more) -> dict[str, Any]:
    return {
        "kernel": label,
        "threads": threads,
        "registers": registers,
        "shared": shared,
        "limiter": occ.limiter,
        "blocks_per_sm": occ.blocks_per_sm,
        "theoretical_pct": 100 * occ.occupancy,
        **more,
    }


def format_rows(rows: list[dict[str, Any]], witness: str) -> str:
    """The rows of :func:`main` as a table; ``witness`` heads the column of the
    figure the calculator is checked against ("ncu %", "driver %")."""
    cells = [
        [
            r["kernel"],
            r["threads"],
            r["registers"],
            r["shared"],
            r["limiter"],
            r["blocks_per_sm"],
            f"{r['theoretical_pct']:.2f}",
            f"{r['witness_pct']:.2f}",
        ]
        for r in rows
    ]
    header = ["kernel", "thr", "regs", "smem B", "limiter", "blk/SM", "ours %", witness]
    return format_table(cells, header=header, align="<>>><>>>")


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    args = parser.parse_args(argv)
    rows = []
    if is_simulator():
        limits = KNOWN_LIMITS[(9, 0)]
        for path in sorted(tools.SAVED_DIR.glob("ncu_*.csv")):
            for s in saved_launch_stats(path):
                occ = theoretical_occupancy(s["threads"], s["registers"], s["shared"], limits)
                rows.append(
                    _row(
                        s["kernel"],
                        s["threads"],
                        s["registers"],
                        s["shared"],
                        occ,
                        witness_pct=s["ncu_pct"],
                        source=path.name,
                    )
                )
        print(
            f"simulator: no compiled kernels here; resources and ncu's figures from the GPU "
            f"run's reports in {tools.SAVED_DIR.relative_to(tools.REPO_ROOT)}/, "
            f"limits of compute capability {limits.name}"
        )
        print(format_rows(rows, "ncu %"))
    else:
        limits = device_limits()
        for run in workloads.kernel_runs():
            run.run()  # compiles the kernel for its signature
            run.check()
            res = compiled_resources(run.kernel)
            occ = theoretical_occupancy(run.threads, res["registers"], res["shared"], limits)
            driver = driver_blocks_per_sm(run.kernel, run.threads)
            warps = driver * ceil_div(run.threads, WARP)
            rows.append(
                _row(
                    run.label,
                    run.threads,
                    res["registers"],
                    res["shared"],
                    occ,
                    local=res["local"],
                    driver_blocks=driver,
                    witness_pct=100 * warps / limits.max_warps_per_sm,
                )
            )
        print(f"limits: {limits}")
        print(format_rows(rows, "driver %"))
    wrong = [r for r in rows if abs(r["theoretical_pct"] - r["witness_pct"]) > 0.01]
    save_results(rows, args.out, "occupancy", limits=asdict(limits))
    if wrong:
        print(f"MISMATCH: the calculator disagrees on {[r['kernel'] for r in wrong]}")
        return 1
    print(
        f"the calculator agrees with the {'saved ncu reports' if is_simulator() else 'driver'} "
        f"on all {len(rows)} kernels"
    )
    return 0


if __name__ == "__main__":
    run_script(main)
