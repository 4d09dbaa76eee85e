"""deviceQuery in Python: every device attribute a kernel writer uses, one line each.

On a GPU it reads the attributes through common.doctor.device_attributes() (the
driver's cuDeviceGetAttribute, CUDA Driver API section 6.5) and says what each
limits. In the simulator there is no device: it prints the limits the course's
simulator enforces instead (common.runtime), which match a real GPU's.
For install problems run `python -m common.doctor`: it names the failure and the fix.

Run: python chapters/02_setup/device_query.py [--out runs/02_setup]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import runtime
from common.harness import run_script, script_parser

import json

# (attribute, unit, why a kernel writer cares) in the order a kernel meets them.
EXPLAINED = [
    (
        "compute_capability",
        "",
        "the SM architecture (9.0 = Hopper): decides instructions and limits",
    ),
    (
        "MULTIPROCESSOR_COUNT",
        "SMs",
        "how many blocks run at once, roughly; size grids to several x this",
    ),
    (
        "WARP_SIZE",
        "threads",
        "threads that execute one instruction together; make blocks a multiple",
    ),
    ("MAX_THREADS_PER_BLOCK", "threads", "largest block; a launch with more fails"),
    ("MAX_BLOCK_DIM_X", "threads", "largest block size along x"),
    ("MAX_BLOCK_DIM_Y", "threads", "largest block size along y"),
    ("MAX_BLOCK_DIM_Z", "threads", "largest block size along z (only 64)"),
    ("MAX_GRID_DIM_X", "blocks", "largest grid along x"),
    ("MAX_GRID_DIM_Y", "blocks", "largest grid along y (65535: a 2-D grid caps rows of blocks)"),
    ("MAX_GRID_DIM_Z", "blocks", "largest grid along z"),
    ("MAX_THREADS_PER_MULTIPROCESSOR", "threads", "resident threads per SM: the occupancy ceiling"),
    (
        "MAX_BLOCKS_PER_MULTIPROCESSOR",
        "blocks",
        "resident blocks per SM: tiny blocks hit this first",
    ),
    ("MAX_REGISTERS_PER_BLOCK", "32-bit regs", "registers one block may use in total"),
    (
        "MAX_REGISTERS_PER_MULTIPROCESSOR",
        "32-bit regs",
        "register file of an SM; regs/thread x threads <= this",
    ),
    ("MAX_SHARED_MEMORY_PER_BLOCK", "bytes", "static shared memory per block (cuda.shared.array)"),
    ("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "bytes", "dynamic shared memory a block may opt in to"),
    (
        "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
        "bytes",
        "shared memory of an SM, split among its blocks",
    ),
    (
        "TOTAL_CONSTANT_MEMORY",
        "bytes",
        "constant memory (cuda.const.array_like), cached, read-only",
    ),
    (
        "L2_CACHE_SIZE",
        "bytes",
        "last-level cache shared by all SMs; data reused within it is cheap",
    ),
    ("total_memory_bytes", "bytes", "global memory (HBM): what cuda.device_array allocates from"),
    ("CLOCK_RATE", "kHz", "SM clock: peak FLOP/s = SMs x FP32 units/SM x 2 x clock"),
    (
        "MEMORY_CLOCK_RATE",
        "kHz",
        "memory clock; with the bus width gives the theoretical bandwidth",
    ),
    ("GLOBAL_MEMORY_BUS_WIDTH", "bits", "memory bus width"),
    (
        "theoretical_bandwidth_gbps",
        "GB/s",
        "2 x memory clock x bus width / 8: a ceiling no copy reaches",
    ),
    (
        "ASYNC_ENGINE_COUNT",
        "engines",
        "copy engines: host<->device copies can overlap kernels (streams)",
    ),
    ("CONCURRENT_KERNELS", "bool", "kernels from different streams may run at the same time"),
    ("UNIFIED_ADDRESSING", "bool", "host and device share one virtual address space"),
    ("ECC_ENABLED", "bool", "error-correcting memory on (costs a little bandwidth on some GPUs)"),
]


def simulator_limits():
    """The launch limits the course's simulator enforces (common.runtime), as a dict."""
    return {
        "MAX_THREADS_PER_BLOCK": runtime.MAX_THREADS_PER_BLOCK,
        "MAX_BLOCK_DIM_X": runtime.MAX_BLOCK_DIM[0],
        "MAX_BLOCK_DIM_Y": runtime.MAX_BLOCK_DIM[1],
        "MAX_BLOCK_DIM_Z": runtime.MAX_BLOCK_DIM[2],
        "MAX_GRID_DIM_X": runtime.MAX_GRID_DIM[0],
        "MAX_GRID_DIM_Y": runtime.MAX_GRID_DIM[1],
        "MAX_GRID_DIM_Z": runtime.MAX_GRID_DIM[2],
        "MAX_SHARED_MEMORY_PER_BLOCK": runtime.MAX_STATIC_SHARED_BYTES,
    }


def query():
    """({attribute: value}, source): the GPU's attributes, or the simulator's limits."""
    if runtime.is_simulator():
        return (
            simulator_limits(),
            "simulator (no device): the limits the course's simulator enforces",
        )
    from common.doctor import device_attributes

    attrs = device_attributes()
    return attrs, attrs["name"]


def _fmt(value, unit):
    if value is None:
        return "n/a"
    if isinstance(value, tuple):
        return ".".join(map(str, value))
    if isinstance(value, float):
        return f"{value:,.0f} {unit}"
    if unit == "bytes" and value >= 1024:
        return f"{value:,} bytes ({value / 1024:,.0f} KiB)"
    if unit == "bool":
        return "yes" if value else "no"
    return f"{value:,} {unit}"


def main(argv=None):
    args = script_parser(__doc__, "02_setup").parse_args(argv)
    attrs, source = query()
    print(f"device: {source}")
    for key, unit, why in EXPLAINED:
        if key in attrs:
            print(f"  {key:<37} {_fmt(attrs[key], unit):>28}  {why}")
    if runtime.is_simulator():
        print("The simulator runs each CUDA thread as a Python thread: no SMs, clocks or")
        print("caches to report. Launches beyond these limits raise LaunchConfigError, as")
        print("a GPU would refuse them. On a GPU this script lists every attribute.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_query.json").write_text(
        json.dumps(
            {"source": source, "attributes": {k: v for k, v in attrs.items() if k != "uuid"}},
            indent=2,
            default=str,
        )
    )
    print(f"wrote {args.out / 'device_query.json'}")
    return 0


if __name__ == "__main__":
    run_script(main)
