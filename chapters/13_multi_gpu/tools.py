"""The plumbing around chapter 13's scripts: starting the ranks, the NVLink peak, tables, plots.

* :func:`ranks_here` / :func:`start_ranks`: a script run as ``python x.py`` (not under
  torchrun) starts its own ranks, one a GPU (NCCL), or two in the simulator (gloo),
  each with the environment torchrun would give it, and waits for them with a
  time limit; the tests start their ranks the same way.
* :func:`nvlink_peak`: the GPU's NVLink links and their speed, as ``nvidia-smi
  nvlink -s`` reports them; their sum is the bandwidth one way that a collective's
  bus bandwidth approaches.
* :func:`bandwidth_table` and :func:`plot_bandwidth`: what ``collectives.py`` and
  ``ring_allreduce.py`` print and draw.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import driver_gpu_count, is_simulator
from common.timing import format_table

import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIMULATOR_RANKS = 2  # gloo processes a script starts in the simulator
RANK_TIMEOUT_S = 600  # a rank that runs longer is killed: a collective that never completes


def ranks_here() -> int:
    """How many ranks a script starts on this machine: one a GPU, or 2 in the simulator."""
    return SIMULATOR_RANKS if is_simulator() else max(1, driver_gpu_count())


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    """One rank's exit status and everything it printed (stdout and stderr)."""

    rank: int
    returncode: int
    output: str


def start_ranks(
    argv: Sequence[str],
    world: int,
    timeout_s: float = RANK_TIMEOUT_S,
    env: dict[str, str] | None = None,
    echo_rank0: bool = True,
) -> list[RankResult]:
    """Run ``python argv...`` as ``world`` ranks on this machine, as torchrun would
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and wait for all.

    Rank 0's output is echoed as it comes when ``echo_rank0``; every rank's is
    returned. A rank still running after ``timeout_s`` (a hung collective) is
    killed, and so are the others, and its returncode is -9.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        child = dict(os.environ if env is None else env)
        child.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=child,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs: list[list[str]] = [[] for _ in procs]
    import threading

    def pump(i: int) -> None:
        for line in procs[i].stdout:
            outputs[i].append(line)
            if i == 0 and echo_rank0:
                print(line, end="", flush=True)

    threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(-9)
    for p in procs[len(codes) :]:
        codes.append(p.wait())
    for t in threads:
        t.join(timeout=5)
    return [RankResult(r, c, "".join(o)) for r, (c, o) in enumerate(zip(codes, outputs))]


def run_as_ranks(script: str, argv: Sequence[str]) -> int:
    """What a chapter script does when run as plain ``python script.py``: start
    :func:`ranks_here` ranks of itself, echo rank 0, and print any failing rank's
    output. Returns 0 when every rank succeeded, else 1."""
    world = ranks_here()
    how = "gloo, the simulator" if is_simulator() else "NCCL, one a GPU"
    print(f"starting {world} ranks ({how}); torchrun --nproc-per-node {world} does the same")
    results = start_ranks([script, *argv], world)
    failed = [r for r in results if r.returncode != 0]
    for r in failed:
        print(f"--- rank {r.rank} exited with {r.returncode}:\n{r.output[-4000:]}", file=sys.stderr)
    return 1 if failed else 0


def show_ranks(script: str | Path, argv: Sequence[str] = (), world: int | None = None) -> str:
    """Run a chapter script as :func:`ranks_here` ranks (or ``world``), print rank 0's
    output once they are done, and return it: how the notebook runs them (a
    notebook cell shows what its own process prints, not a thread's echo).

    Raises:
        RuntimeError: a rank failed; the message holds the end of its output.
    """
    results = start_ranks([str(script), *argv], world or ranks_here(), echo_rank0=False)
    print(results[0].output, end="")
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"rank {r.rank} exited with {r.returncode}:\n{r.output[-4000:]}")
    return results[0].output


def init_ranks(parser: Any, batch: int | None = None) -> Any:
    """Join the ranks (``final_project.distributed.init``), refusing through
    ``parser.error`` a global ``batch`` the ranks do not divide (before anything
    starts) or a machine that cannot run them (no GPU for NCCL, no NCCL).
    Returns the Communicator."""
    from final_project import distributed

    try:
        if batch is not None:
            distributed.shard_size(batch, distributed.world_size())
        return distributed.init()
    except (RuntimeError, ValueError) as e:
        parser.error(str(e))


# --------------------------------------------------------------------------
# The NVLink peak
# --------------------------------------------------------------------------


@dataclass
class NvlinkPeak:
    """links: active NVLink links of one GPU; gbps_per_link: each one's speed one way
    (GB/s); total: their sum, the most one GPU can send (or receive) at once."""

    links: int
    gbps_per_link: float

    @property
    def total(self) -> float:
        return self.links * self.gbps_per_link

    def describe(self) -> str:
        return f"{self.links} NVLink links x {self.gbps_per_link:.2f} GB/s = {self.total:.0f} GB/s each way"


def nvlink_peak(gpu: int = 0) -> NvlinkPeak | None:
    """GPU ``gpu``'s NVLink links and speed from ``nvidia-smi nvlink -s`` ("Link 0:
    26.562 GB/s" a line); None without nvidia-smi or NVLink (PCIe only, the simulator)."""
    if is_simulator():
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", "nvlink", "-s", "-i", str(gpu)],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    speeds = [float(m) for m in re.findall(r"Link \d+: ([\d.]+) GB/s", text)]
    if not speeds:
        return None
    return NvlinkPeak(len(speeds), min(speeds))


# --------------------------------------------------------------------------
# Tables and plots
# --------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """4096 -> "4 KiB", 1 << 30 -> "1 GiB"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def bandwidth_table(rows: list[dict[str, Any]], title: str, names: Sequence[str]) -> str:
    """One line a message size; for each of ``names``: time (us) and bus bandwidth (GB/s).

    rows: {"bytes", "name", "us", "algbw", "busbw"} as the scripts measure them."""
    sizes = sorted({r["bytes"] for r in rows})
    cell = {(r["name"], r["bytes"]): r for r in rows}
    header = ["size"]
    for name in names:
        header += [f"{name} us", "busbw GB/s"]
    table = []
    for size in sizes:
        line = [human_bytes(size)]
        for name in names:
            r = cell.get((name, size))
            line += ["-", "-"] if r is None else [f"{r['us']:.1f}", f"{r['busbw']:.1f}"]
        table.append(line)
    return format_table(table, title=title, header=header, align="<" + ">" * (len(header) - 1))


def plot_bandwidth(
    rows: list[dict[str, Any]], path: Path, title: str, peak: NvlinkPeak | None
) -> Path:
    """Bus bandwidth against message size, one line a collective, the NVLink peak dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["bytes"], r["busbw"]) for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name, ms=4)
    if peak is not None:
        ax.axhline(
            peak.total, ls="--", c="grey", label=f"NVLink peak one way, {peak.total:.0f} GB/s"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
