"""A ring all-reduce written by hand, checked against NCCL's and timed beside it.

    torchrun --standalone --nproc-per-node 2 chapters/13_multi_gpu/ring_allreduce.py
    python chapters/13_multi_gpu/ring_allreduce.py   # starts one rank a GPU (2 gloo ranks in the simulator)

version 1 ring_all_reduce   the buffer cut into N chunks; N-1 steps of reduce-scatter
                            (send one chunk to the right neighbour, receive one from
                            the left into a scratch buffer, add it in with our
                            ``add_into`` kernel), after which rank r holds the whole
                            sum of chunk r+1; then N-1 steps of all-gather (pass the
                            finished chunks on round the ring, no adds). Every GPU
                            sends 2 (N-1) chunks of S/N bytes: the 2 (N-1)/N of the
                            bus-bandwidth factor. A step is one ``batch_isend_irecv``
                            (both posted at once: a blocking send on every rank
                            would wait forever for a receive nobody posted yet).
NCCL all_reduce             the same ring (or a tree), each chunk cut into slices
                            pipelined over several channels (thread blocks), the add
                            fused into the receive: no step waits for a whole chunk.

Expected, for N = 2 at large S: our ring moves the same bytes, one step at a time,
plus an add that reads two half-buffers and writes one (1.5 S through device
memory, about 10x faster than the link): about 1.2x NCCL's time. Small messages
pay 2 (N-1) send/recv calls and N-1 launches: several times NCCL's floor. Each result is checked exactly (the values are multiples of 1/256).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.harness import positive_ints, run_script, save_results, script_parser
from common.runtime import device_name, is_simulator

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from numba import cuda

from final_project.distributed import Communicator, launched_by_torchrun

tools = import_sibling(__file__, "tools")
collectives = import_sibling(__file__, "collectives")  # fill_pattern, buffers, the sum, timing

THREADS = 256
SIZES = [1 << k for k in range(12, 31, 2)]  # bytes: 4 KiB ... 1 GiB
SIMULATOR_SIZES = [1 << 10, 1000 * 4]  # bytes: one chunk size that N divides, one it may not


@cuda.jit(cache=True)
def add_into(dst, src):
    # the reduce of a reduce-scatter step: reads 2 floats, writes 1 an element
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] += src[i]


def ring_schedule(rank: int, world: int) -> list[tuple[str, int, int]]:
    """The 2 (N-1) steps of ``rank``'s ring: (phase, chunk it sends right, chunk it
    receives from the left).

    Reduce-scatter step s: send chunk (r - s) mod N, the one it added into at step
    s - 1 (its own at s = 0); receive chunk (r - s - 1) mod N and add it in. After N-1
    steps chunk (r + 1) mod N holds every rank's share. All-gather step s: send chunk
    (r + 1 - s) mod N (finished here, or received at step s - 1), receive chunk
    (r - s) mod N, which the left neighbour finished. N = 2: [("reduce-scatter", 0,
    1), ("all-gather", 1, 0)] on rank 0.
    """
    steps = [
        ("reduce-scatter", (rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)
    ]
    steps += [("all-gather", (rank + 1 - s) % world, (rank - s) % world) for s in range(world - 1)]
    return steps


def chunk_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """(start, stop) of each of the ``world`` chunks of an n-element buffer: sizes
    differ by at most one where ``world`` does not divide n."""
    return [(k * n // world, (k + 1) * n // world) for k in range(world)]


def ring_all_reduce(buf, scratch, comm: Communicator, stream, schedule=ring_schedule) -> None:
    """Sum ``buf`` over the ranks, in place (call inside ``comm.ordered_on(stream)``).

    buf, scratch: :class:`collectives.Buffer` (a float32 device array and a torch
    tensor over it); scratch holds at least ceil(n / N) floats (where a received
    chunk lands before it is added). schedule: the steps (tests pass broken
    ones). Every rank calls it with the same n. The transfers are
    ``torch.distributed`` point-to-point operations on the tensors; the add is our
    kernel on ``stream``, which ``work.wait()`` has made wait for the receive.

    Raises:
        ValueError: scratch too small.
    """
    n, rank, world = buf.array.size, comm.rank, comm.world
    bounds = chunk_bounds(n, world)
    longest = max(hi - lo for lo, hi in bounds)
    if scratch.array.size < longest:
        raise ValueError(f"scratch holds {scratch.array.size} floats; the ring needs {longest}")
    right, left = (rank + 1) % world, (rank - 1) % world
    t = buf.tensor
    for phase, send, recv in schedule(rank, world):
        (s_lo, s_hi), (r_lo, r_hi) = bounds[send], bounds[recv]
        size = r_hi - r_lo
        land = scratch.tensor[:size] if phase == "reduce-scatter" else t[r_lo:r_hi]
        ops = [dist.P2POp(dist.isend, t[s_lo:s_hi], right), dist.P2POp(dist.irecv, land, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if phase == "reduce-scatter" and size:
            add_into[(size + THREADS - 1) // THREADS, THREADS, stream](
                buf.array[r_lo:r_hi], scratch.array[:size]
            )


def run_ring(size: int, comm: Communicator, stream, schedule=ring_schedule):
    """(ring call, NCCL call): each fills a buffer of ``size`` bytes with the rank's
    pattern and all-reduces it; both return the buffer's tensor."""
    n = size // 4
    mine, theirs = collectives.Buffer(n, comm), collectives.Buffer(n, comm)
    scratch = collectives.Buffer(max(1, -(-n // comm.world)), comm)

    def ring():
        collectives.fill(mine.array, comm.rank, stream)
        ring_all_reduce(mine, scratch, comm, stream, schedule)
        return mine.tensor

    def nccl():
        collectives.fill(theirs.array, comm.rank, stream)
        dist.all_reduce(theirs.tensor)
        return theirs.tensor

    return ring, nccl


def check_ring(size: int, comm: Communicator, schedule=ring_schedule) -> None:
    """The ring's result against the exact sum and against all_reduce's, bit for bit.

    Raises:
        common.CheckError: on the rank where they differ (the message says where).
    """
    rank, world, stream = comm.rank, comm.world, cuda.stream()
    with comm.ordered_on(stream):
        ring, nccl = run_ring(size, comm, stream, schedule)
        got, want = ring().cpu().numpy().copy(), nccl().cpu().numpy()
    exact = collectives.COLLECTIVES[0].expect(size // 4, rank, world)
    for name, other in (("all_reduce", want), ("the exact sum", exact)):
        bad = np.flatnonzero(got != other)
        if bad.size:
            chunk = [
                k for k, (lo, hi) in enumerate(chunk_bounds(got.size, world)) if lo <= bad[0] < hi
            ]
            raise common.CheckError(
                f"ring all-reduce of {size} bytes, rank {rank}: {bad.size} of {got.size} "
                f"elements differ from {name} (first at {bad[0]}, chunk {chunk[0]}: "
                f"{got[bad[0]]} instead of {other[bad[0]]})"
            )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, "13_multi_gpu")
    parser.add_argument(
        "--sizes", type=positive_ints, default=None, metavar="B1,B2", help="message sizes in bytes"
    )
    args = parser.parse_args(argv)
    if not launched_by_torchrun():
        return tools.run_as_ranks(__file__, sys.argv[1:] if argv is None else argv)
    comm = tools.init_ranks(parser)
    rank, world, stream = comm.rank, comm.world, cuda.stream()
    sizes = args.sizes or (SIMULATOR_SIZES if is_simulator() else SIZES)
    rows = []
    for size in sizes:
        if size % 4:
            parser.error(f"--sizes: {size} bytes is not a whole number of float32s")
        check_ring(size, comm)
        if is_simulator():
            continue
        factor = 2 * (world - 1) / world
        with comm.ordered_on(stream):
            ring, nccl = run_ring(size, comm, stream)
            for name, call in (("ring (ours)", ring), ("NCCL all_reduce", nccl)):
                us = collectives.time_call(call)
                algbw = size / (us * 1e-6) / 1e9
                rows.append(
                    {"name": name, "bytes": size, "us": us, "algbw": algbw, "busbw": algbw * factor}
                )
    if rank == 0:
        print(
            f"ring all-reduce on {world} ranks ({comm.backend}): equal to all_reduce and to the "
            f"exact sum, bit for bit, at {len(sizes)} sizes"
        )
        if is_simulator():
            print(f"  ({common.timing.SIMULATOR_NOTE}; the README holds the GPU's figures)")
        else:
            gpu = device_name()
            title = f"{world} x {gpu}: our ring against NCCL's all-reduce"
            print(tools.bandwidth_table(rows, title, ["ring (ours)", "NCCL all_reduce"]))
            us = {(r["name"], r["bytes"]): r["us"] for r in rows}
            ratios = [us["ring (ours)", s] / us["NCCL all_reduce", s] for s in sizes]
            print(
                "  ring / NCCL time: "
                + ", ".join(f"{tools.human_bytes(s)} {x:.2f}x" for s, x in zip(sizes, ratios))
            )
            png = tools.plot_bandwidth(
                rows, Path(args.out) / "ring_allreduce.png", f"ring vs NCCL, {world} x {gpu}", None
            )
            print(f"wrote {png}")
            save_results(rows, args.out, "ring_allreduce", world=world)
    comm.close()
    return 0


if __name__ == "__main__":
    run_script(main)
