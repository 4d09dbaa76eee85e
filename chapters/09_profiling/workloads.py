"""The kernels this chapter profiles: three slow/fast pairs from chapters 06 and 08,
and the capstone's training step.

| pair | slow | fast | what the counters should show |
|---|---|---|---|
| transpose | v1 naive, v2 shared tile | v3 padded tile | 32 sectors a store request (v1), shared-memory bank conflicts (v2) |
| histogram | v1 one global atomic an element | v2 private shared histogram | atomics serialised in L2 |
| matmul | v3 naive, v4 coalesced, v5 shared tiles | v10 register tiles | bytes per FLOP, stalls on memory |

Every kernel runs through its own chapter's launcher and is checked against
that chapter's float64 (or exact) reference before anyone profiles it: a fast
wrong kernel is not a result. ``python chapters/09_profiling/workloads.py``
checks them all; the profiling scripts (``nsight_compute.py``,
``occupancy.py``, ``roofline.py``) import :func:`kernel_runs`.

Sizes: 4096 x 4096 transpose (64 MiB each way), 2**24-element histogram,
2048^3 matmul on a GPU; tiny and ragged in the simulator.

The capstone (final_project): its full network on a GPU (the simulator's is
``final_project.train.TINY``, :func:`capstone_net`), at ``CAPSTONE_BATCH`` images
a step for Nsight Compute and the roofline (torch_profile.py picks its own batch),
on random inputs (:func:`capstone_inputs`).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import check, is_simulator, load_chapter_module, pick, random_array
from common.harness import run_script
from common.timing import format_table

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from numba import cuda

from final_project import train as ftrain
from final_project.model import NetConfig

transpose = load_chapter_module("06_memory", "transpose")
histogram = load_chapter_module("06_memory", "histogram")
matmul = load_chapter_module("08_faster_matmul", "matmul")

TRANSPOSE_SHAPE = pick(gpu=(4096, 4096), simulator=(33, 20))  # ragged: 2 x 1 tiles of 32
HISTOGRAM_SIZE = pick(gpu=2**24, simulator=1000)
MATMUL_SIZE = pick(gpu=(2048, 2048, 2048), simulator=(19, 9, 7))
CAPSTONE_BATCH = 1024  # images a training step, as the capstone trains on a GPU


@dataclass(frozen=True)
class KernelRun:
    """One kernel of a pair, ready to launch on inputs made once.

    pair: "transpose", "histogram" or "matmul"; label: its row name, e.g.
    "transpose v1 naive". kernel: the Numba dispatcher whose compiled code is
    profiled (the one that does the work; launchers may add a small zeroing
    kernel). threads: threads per block it is launched with. run(): one launch
    (through its chapter's launcher) into its own output. check(): compares
    that output with the reference; raises common.CheckError. flops and nbytes:
    the work (an FMA counts 2) and the fewest bytes the operation must move
    through device memory, for the roofline.
    """

    pair: str
    label: str
    kernel: Any
    threads: int
    run: Callable[[], None]
    check: Callable[[], None]
    flops: int
    nbytes: int


def _transpose_runs(rng) -> list[KernelRun]:
    rows, cols = TRANSPOSE_SHAPE
    a_host = random_array((rows, cols), np.float32, rng)
    a = cuda.to_device(a_host)
    ref = a_host.T.astype(np.float64)
    runs = []
    for label, kernel in (
        ("transpose v1 naive", transpose.transpose_naive),
        ("transpose v2 shared tile", transpose.transpose_smem),
        ("transpose v3 padded tile", transpose.transpose_smem_padded),
    ):
        out = cuda.device_array((cols, rows), np.float32)
        runs.append(
            KernelRun(
                "transpose",
                label,
                kernel,
                transpose.TILE * transpose.ROWS,
                partial(transpose.transpose, kernel, a, out),
                partial(check, out, ref, name=label),
                0,
                2 * 4 * rows * cols,
            )
        )
    return runs


def _histogram_runs(rng) -> list[KernelRun]:
    n = HISTOGRAM_SIZE
    x_host = rng.random(n, dtype=np.float32)
    x = cuda.to_device(x_host)
    ref = histogram.histogram_cpu(x_host).astype(np.float64)
    runs = []
    for label, launcher, kernel in (
        ("histogram v1 global atomics", histogram.histogram_v1, histogram.histogram_global_atomic),
        ("histogram v2 shared private", histogram.histogram_v2, histogram.histogram_smem_atomic),
    ):
        bins = cuda.device_array(histogram.NBINS, np.int32)
        runs.append(
            KernelRun(
                "histogram",
                label,
                kernel,
                histogram.BLOCK,
                partial(launcher, x, bins),
                # Counts are exact integers: any difference is a lost update.
                partial(check, bins, ref, tol=0.0, name=label),
                0,
                4 * n + 4 * histogram.NBINS,
            )
        )
    return runs


def _matmul_runs(rng) -> list[KernelRun]:
    m, n, k = MATMUL_SIZE
    a_host, b_host, a, b = matmul.random_operands(m, n, k, rng)
    ref = matmul.matmul_reference(a_host, b_host)
    versions = {v.number: v for v in matmul.gpu_versions()}
    runs = []
    for number in (3, 4, 5, 10):
        v = versions[number]
        c = cuda.device_array((m, n), np.float32)
        if v.tile is not None:
            threads = v.tile.threads
        elif number == 5:
            threads = matmul.TILE_5**2
        else:
            threads = 16 * 16  # launch_one_per_thread's default block
        runs.append(
            KernelRun(
                "matmul",
                f"matmul v{v.label}",
                v.kernels[0],
                threads,
                partial(v.launcher, a, b, c),
                partial(check, c, ref, tol=matmul.TOL, name=f"matmul v{v.label}"),
                2 * m * n * k,
                4 * (m * k + k * n + m * n),
            )
        )
    return runs


def kernel_runs(pairs: tuple[str, ...] = ("transpose", "histogram", "matmul"), seed: int = 0):
    """The KernelRuns of ``pairs``, inputs on the device, nothing launched yet.

    Raises ValueError for an unknown pair name.
    """
    makers = {"transpose": _transpose_runs, "histogram": _histogram_runs, "matmul": _matmul_runs}
    unknown = set(pairs) - set(makers)
    if unknown:
        raise ValueError(f"unknown pair(s) {sorted(unknown)}; choose from {sorted(makers)}")
    rng = np.random.default_rng(seed)
    return [run for name in pairs for run in makers[name](rng)]


def capstone_net() -> NetConfig:
    """The capstone's network: the full one on a GPU; in the simulator the tiny one
    of ``final_project.train.TINY`` (8x8 images, channels 2/4, hidden 16)."""
    if not is_simulator():
        return NetConfig()
    t = ftrain.TINY
    return NetConfig(height=t.image_size, width=t.image_size, c1=t.c1, c2=t.c2, hidden=t.hidden)


def capstone_inputs(net: NetConfig, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs of one training step on the host: images float32 (batch,
    in_channels, height, width), standard normal; labels int32 (batch,) in
    [0, num_classes)."""
    rng = np.random.default_rng(seed)
    shape = (batch, net.in_channels, net.height, net.width)
    images = rng.standard_normal(shape).astype(np.float32)
    return images, rng.integers(0, net.num_classes, batch).astype(np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    rows = []
    for run in kernel_runs():
        run.run()
        run.check()
        rows.append([run.label, run.threads, "checked OK"])
    print(format_table(rows, header=["kernel", "threads a block", "check"], align="<><"))
    return 0


if __name__ == "__main__":
    run_script(main)
