"""NCCL's four collectives on buffers our Numba kernels write: each checked, then timed by size.

    torchrun --standalone --nproc-per-node 2 chapters/13_multi_gpu/collectives.py
    python chapters/13_multi_gpu/collectives.py      # starts one rank a GPU (2 gloo ranks in the simulator)

Every rank fills its buffer (a Numba device array) with ``fill_pattern``, our
kernel, on a stream of ours, and runs the collective through ``torch.distributed``
on a torch tensor sharing that memory, with torch told that our stream is its
current one (``Communicator.ordered_on``, as the capstone does): NCCL's stream
waits for the fill, and ours waits for NCCL. It checks the result exactly:
the values are small multiples of 1/256, so every sum is exact in float32 in any
order. Then each collective is timed at sizes from 4 KiB to 1 GiB (median of 3
windows of 20 calls between CUDA events; the slowest rank's) and turned into the
two bandwidths nccl-tests reports (its doc/PERFORMANCE.md):

    algbw = S / t          S the collective's size in bytes, t the time of one call
    busbw = algbw * factor the bytes each GPU's link carries / t: the figure to hold
                           against the link's peak, whatever the collective and N

    collective       rank r ends with                    S                    factor
    all-reduce       the sum of every rank's buffer       the buffer           2 (N-1) / N
    all-gather       every rank's buffer, in rank order   N x the input        (N-1) / N
    reduce-scatter   block r of that sum                  N x the output       (N-1) / N
    broadcast        rank 0's buffer                      the buffer           1

The all-reduce factor: a ring all-reduce is a reduce-scatter then an all-gather,
and each sends (N-1)/N of the buffer out of every GPU (ring_allreduce.py builds it).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.harness import positive_ints, run_script, save_results, script_parser
from common.runtime import device_name, is_simulator

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from numba import cuda, float32

from final_project.distributed import Communicator, launched_by_torchrun

tools = import_sibling(__file__, "tools")

THREADS = 256
SIZES = [1 << k for k in range(12, 31, 2)]  # bytes: 4 KiB, 16 KiB, ..., 1 GiB
SIMULATOR_SIZES = [1 << 10, 1 << 12]  # bytes: the simulator checks, it does not time
WARMUP, CALLS, WINDOWS = 5, 20, 3
PERIOD = 251  # a prime: a chunk off by any power-of-two stride reads other values
STEP = np.float32(1 / 256)


@cuda.jit(cache=True)
def fill_pattern(buf, rank, offset):
    # buf[i] = rank + 1 + ((offset + i) % 251) / 256: exact in float32, and a sum
    # of a few ranks' values is too
    i = cuda.grid(1)
    if i < buf.size:
        buf[i] = float32(rank + 1) + float32((offset + i) % PERIOD) * STEP


def pattern(n: int, rank: int, offset: int = 0) -> np.ndarray:
    """What ``fill_pattern`` writes, in float64: (n,) values."""
    return (rank + 1) + ((offset + np.arange(n)) % PERIOD) / 256.0


def fill(buf, rank: int, stream, offset: int = 0) -> None:
    """Launch fill_pattern over the device array ``buf`` on ``stream``."""
    fill_pattern[(buf.size + THREADS - 1) // THREADS, THREADS, stream](buf, rank, offset)


class Buffer:
    """A float32 device array of ours and the torch tensor over the same memory."""

    def __init__(self, n: int, comm: Communicator) -> None:
        self.array = cuda.device_array(n, np.float32)
        self.tensor = comm.tensor(self.array)


@dataclass
class Collective:
    """One row of the table above: how to run it on a buffer of ``S`` bytes, what
    each rank must hold after, and its bus factor."""

    name: str
    factor: Callable[[int], float]  # N -> busbw / algbw
    run: Callable[[int, Communicator, object], Callable[[], torch.Tensor]]
    expect: Callable[[int, int, int], np.ndarray]  # (floats S/4, rank, N) -> result


# Each returns call(): fill, then the collective; called inside comm.ordered_on(stream).
def _all_reduce(n, comm, stream):
    buf = Buffer(n, comm)

    def call():
        fill(buf.array, comm.rank, stream)
        dist.all_reduce(buf.tensor)
        return buf.tensor

    return call


def _all_gather(n, comm, stream):
    inp, out = Buffer(n // comm.world, comm), Buffer(n, comm)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def call():
        fill(inp.array, comm.rank, stream, comm.rank * (n // comm.world))
        gather(out.tensor, inp.tensor)
        return out.tensor

    return call


def _reduce_scatter(n, comm, stream):
    inp, out = Buffer(n, comm), Buffer(n // comm.world, comm)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def call():
        fill(inp.array, comm.rank, stream)
        scatter(out.tensor, inp.tensor)
        return out.tensor

    return call


def _broadcast(n, comm, stream):
    buf = Buffer(n, comm)

    def call():
        fill(buf.array, comm.rank, stream)
        dist.broadcast(buf.tensor, src=0)
        return buf.tensor

    return call


def _summed(n, world):
    return sum(pattern(n, r) for r in range(world))


COLLECTIVES = [
    Collective("all-reduce", lambda w: 2 * (w - 1) / w, _all_reduce, lambda n, r, w: _summed(n, w)),
    Collective(
        "all-gather",
        lambda w: (w - 1) / w,
        _all_gather,
        lambda n, r, w: np.concatenate([pattern(n // w, q, q * (n // w)) for q in range(w)]),
    ),
    Collective(
        "reduce-scatter",
        lambda w: (w - 1) / w,
        _reduce_scatter,
        lambda n, r, w: _summed(n, w)[r * (n // w) : (r + 1) * (n // w)],
    ),
    Collective("broadcast", lambda w: 1.0, _broadcast, lambda n, r, w: pattern(n, 0)),
]


def check(c: Collective, call: Callable[[], torch.Tensor], n: int, rank: int, world: int) -> None:
    """Run once and compare exactly; raises CheckError on any rank that differs."""
    got = call().cpu().numpy()
    want = c.expect(n, rank, world)
    bad = int(np.count_nonzero(got != want))
    if bad:
        first = int(np.argmax(got != want))
        raise common.CheckError(
            f"{c.name}, {n * 4} bytes, rank {rank}: {bad} of {got.size} elements wrong "
            f"(first at {first}: {got[first]} instead of {want[first]})"
        )


def time_call(call: Callable[[], torch.Tensor]) -> float:
    """Microseconds a call: median of WINDOWS windows of CALLS calls, after WARMUP,
    between CUDA events on torch's current stream (call it inside ``ordered_on``);
    the slowest rank's (one all-reduce of it)."""
    for _ in range(WARMUP):
        call()
    windows = []
    for _ in range(WINDOWS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        end.synchronize()
        windows.append(start.elapsed_time(end) * 1e3 / CALLS)
    slowest = torch.tensor([float(np.median(windows))], device=torch.cuda.current_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def measure(comm: Communicator, sizes: list[int]) -> list[dict]:
    """Check every collective at every size, and time it on a GPU. One row each:
    {name, bytes S, us, algbw, busbw} (us and bandwidths None in the simulator)."""
    rows, stream = [], cuda.stream()
    for c in COLLECTIVES:
        for size in sizes:
            n = size // 4
            with comm.ordered_on(stream):
                call = c.run(n, comm, stream)
                check(c, call, n, comm.rank, comm.world)
                us = None if is_simulator() else time_call(call)
            algbw = None if us is None else size / (us * 1e-6) / 1e9
            rows.append(
                {
                    "name": c.name,
                    "bytes": size,
                    "us": us,
                    "algbw": algbw,
                    "busbw": None if algbw is None else algbw * c.factor(comm.world),
                }
            )
            del call
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, "13_multi_gpu")
    parser.add_argument(
        "--sizes",
        type=positive_ints,
        default=None,
        metavar="B1,B2",
        help="message sizes in bytes, multiples of 4 x the ranks (default 4 KiB ... 1 GiB)",
    )
    args = parser.parse_args(argv)
    if not launched_by_torchrun():
        return tools.run_as_ranks(__file__, sys.argv[1:] if argv is None else argv)
    comm = tools.init_ranks(parser)
    rank, world = comm.rank, comm.world
    sizes = args.sizes or (SIMULATOR_SIZES if is_simulator() else SIZES)
    for s in sizes:
        if s % (4 * world):
            parser.error(
                f"--sizes: {s} bytes is not a whole number of floats on each of {world} ranks"
            )
    rows = measure(comm, sizes)
    if rank == 0:
        names = [c.name for c in COLLECTIVES]
        print(
            f"{', '.join(names)} checked exactly on {world} ranks ({comm.backend}) at "
            f"{len(sizes)} sizes, every buffer written by fill_pattern on our stream"
        )
        if is_simulator():
            print(f"  ({common.timing.SIMULATOR_NOTE}; the README holds the GPU's figures)")
        else:
            gpu = device_name()
            peak = tools.nvlink_peak()
            title = f"{world} x {gpu}: time of one call and bus bandwidth (nccl-tests' busbw)"
            print(tools.bandwidth_table(rows, title, names))
            if peak is not None:
                print(f"  NVLink: {peak.describe()}")
                best = max(rows, key=lambda r: r["busbw"])
                print(
                    f"  best busbw {best['busbw']:.0f} GB/s ({best['name']}, "
                    f"{tools.human_bytes(best['bytes'])}): {100 * best['busbw'] / peak.total:.0f}% "
                    "of the NVLink peak"
                )
            png = tools.plot_bandwidth(
                rows, Path(args.out) / "collectives.png", f"NCCL on {world} x {gpu}", peak
            )
            print(f"wrote {png}")
            save_results(
                rows, args.out, "collectives", world=world, nvlink=peak and peak.describe()
            )
    comm.close()
    return 0


if __name__ == "__main__":
    run_script(main)
