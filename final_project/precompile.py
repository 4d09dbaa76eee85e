"""Compile the capstone's kernels before the first step, in parallel processes.

Every capstone kernel is declared ``@cuda.jit(cache=True)``: a run keeps what it
compiles in the kernel cache (:data:`common.runtime.KERNEL_CACHE_DIR`) and the next
run loads it. The first run on a machine (or after a kernel's source changed)
still compiles, and numba compiles in the launching process, one kernel after
another: about ten seconds for a step's kernels. Here that work is split over
``workers`` processes: each builds the same model and runs its training step and
evaluation forward under :func:`common.kernel_cache.compile_only`, compiling its
share of the (kernel, argument types) pairs into the cache and launching nothing;
the run itself then loads every kernel. The run goes on (loading its data) while
they work.

A record of each finished precompile is kept in the cache folder, keyed by the
device, numba-cuda's version, the kernel sources and the shapes: a later run with
the same key starts no workers (its kernels are on disk already). Delete the
cache folder to start from nothing.

Usage::

    job = precompile.start(config, train_sizes=(64,), eval_sizes=(64, 16))
    ...                       # load data, build the model
    print(job.wait())         # "kernels: compiled in 8 processes in 3.1 s ..."

    python -m final_project.precompile --batch-sizes 64,256,1024   # fill the cache
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.harness import positive_ints
from common.runtime import KERNEL_CACHE_DIR, device_name, is_simulator

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from final_project.model import NetConfig

ROOT = Path(__file__).resolve().parent.parent
# What the compiled kernels depend on: their sources and the code that picks them.
SOURCES = (
    "final_project/kernels.py",
    "final_project/fast_layers.py",
    "final_project/fast_conv.py",
    "final_project/fast_model.py",
    "final_project/model.py",
    "common/runtime.py",
)
RECORDS = KERNEL_CACHE_DIR / "capstone-precompiled"


def default_workers() -> int:
    """Processes to compile in: one a core, at most 8 (more only adds start-up)."""
    return max(1, min(8, (os.cpu_count() or 1)))


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a run will launch: the network, conv1's kernel and the batch sizes of
    its training steps and evaluation forwards (the tiles, hence the kernels,
    depend on the batch size)."""

    config: NetConfig
    train_sizes: tuple[int, ...]
    eval_sizes: tuple[int, ...] = ()
    conv1: str = "direct"

    def to_json(self) -> str:
        return json.dumps(
            {
                "config": dataclasses.asdict(self.config),
                "train_sizes": list(self.train_sizes),
                "eval_sizes": list(self.eval_sizes),
                "conv1": self.conv1,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        d = json.loads(text)
        return cls(
            NetConfig(**d["config"]),
            tuple(d["train_sizes"]),
            tuple(d["eval_sizes"]),
            d["conv1"],
        )


def record_key(spec: Spec, device: str, numba_cuda_version: str) -> str:
    """The name of the record a finished precompile of ``spec`` leaves: a hash of
    the device, numba-cuda's version, the spec and the kernel sources."""
    h = hashlib.sha256()
    h.update(f"{device}\n{numba_cuda_version}\n{sys.version_info[:2]}\n".encode())
    h.update(spec.to_json().encode())
    for rel in SOURCES:
        h.update(rel.encode())
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()[:32]


def _numba_cuda_version() -> str:
    import numba_cuda

    return numba_cuda.__version__


def compile_share(spec: Spec, shard: int, shards: int) -> list[tuple[str, str, float]]:
    """In this process: the ``shard``-th share of the kernels ``spec``'s run launches,
    compiled into the cache (nothing runs on the GPU). Returns (kernel, argument
    types, seconds) of each kernel compiled or loaded here."""
    from common.kernel_cache import compile_only

    import numpy as np

    from final_project import checks
    from final_project.fast_model import FastCNN

    max_batch = max(spec.train_sizes + spec.eval_sizes)
    model = FastCNN(spec.config, max_batch=max_batch, seed=0, graph=False, conv1=spec.conv1)
    x, y = checks.random_batch(spec.config, max_batch, np.random.default_rng(0))
    with compile_only(shard, shards) as plan:
        for n in spec.train_sizes:
            model.train_step(x[:n], y[:n], lr=0.01)
        for n in spec.eval_sizes:
            model.predict(x[:n])
    model.synchronize()
    return [(name, str(types), seconds) for name, types, seconds in plan.compiled]


class Job:
    """Precompile workers started by :func:`start`; :meth:`wait` for them."""

    def __init__(self, spec: Spec, workers: int) -> None:
        self.spec = spec
        self.workers = workers
        self.t0 = time.perf_counter()
        self.record: Path | None = None
        self.procs: list[subprocess.Popen] = []
        self.skipped = ""
        if is_simulator():
            self.skipped = "kernels: the simulator compiles none"
            return
        if workers < 1:
            self.skipped = "kernels: compiled by the first step (--compile-workers 0)"
            return
        self.record = RECORDS / f"{record_key(spec, device_name(), _numba_cuda_version())}.json"
        if self.record.exists():
            self.skipped = f"kernels: loaded from the cache ({KERNEL_CACHE_DIR})"
            return
        for k in range(workers):
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "final_project.precompile",
                        "--worker",
                        f"{k}/{workers}",
                        "--spec",
                        spec.to_json(),
                    ],
                    cwd=ROOT,  # python -m puts the working folder on the path
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )

    def wait(self) -> str:
        """Wait for the workers; returns a line saying what happened. A worker that
        failed is reported (its last error line) and the run compiles what is
        missing itself."""
        if not self.procs:
            return self.skipped
        kernels, failed = [], []
        for proc in self.procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                last = (err.strip().splitlines() or ["no output"])[-1]
                failed.append(f"worker {proc.args[4]} exited {proc.returncode}: {last}")
                continue
            kernels += json.loads(out.strip().splitlines()[-1])
        seconds = time.perf_counter() - self.t0
        if failed:
            return (
                "kernels: precompile failed, the first step compiles them instead ("
                + "; ".join(failed)
                + ")"
            )
        record = {
            "spec": json.loads(self.spec.to_json()),
            "workers": self.workers,
            "seconds": seconds,
            "kernels": kernels,
        }
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            self.record.write_text(json.dumps(record, indent=1))
        except OSError as e:  # numba could not keep the kernels either: say so
            return (
                f"kernels: {len(kernels)} compiled in {self.workers} processes in "
                f"{seconds:.1f} s, but {KERNEL_CACHE_DIR} is not writable ({e.strerror}): "
                "set NUMBA_CACHE_DIR to a writable folder to keep them"
            )
        return (
            f"kernels: {len(kernels)} compiled in {self.workers} processes in {seconds:.1f} s, "
            f"kept in {KERNEL_CACHE_DIR}"
        )


def start(
    config: NetConfig,
    train_sizes: Sequence[int],
    eval_sizes: Sequence[int] = (),
    conv1: str = "direct",
    workers: int | None = None,
) -> Job:
    """Start compiling the kernels a run of ``config`` at these batch sizes needs,
    in ``workers`` processes (default :func:`default_workers`; 0: none, the first
    step compiles). Returns at once; ``Job.wait()`` waits. Starts nothing in the
    simulator or when a record says the cache holds these kernels already."""
    spec = Spec(config, tuple(sorted(set(train_sizes))), tuple(sorted(set(eval_sizes))), conv1)
    return Job(spec, default_workers() if workers is None else workers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m final_project.precompile",
        description="Compile the capstone's fast kernels into the kernel cache "
        f"({KERNEL_CACHE_DIR}; NUMBA_CACHE_DIR overrides it; delete it to start afresh), "
        "in parallel processes, so that a later run loads them instead of compiling.",
    )
    p.add_argument(
        "--batch-sizes",
        type=positive_ints,
        default=(64,),
        metavar="B1,B2",
        help="training batch sizes (default 64)",
    )
    p.add_argument(
        "--eval-batch-sizes",
        type=positive_ints,
        default=None,
        metavar="B1,B2",
        help="evaluation batch sizes (default: the training ones)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help=f"processes (default {default_workers()} here)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # "k/W": one worker's share
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if is_simulator():
        print(
            "error: precompiling needs a GPU: the simulator runs kernels as Python "
            "and compiles none",
            file=sys.stderr,
        )
        return 2
    if args.worker:
        shard, shards = (int(s) for s in args.worker.split("/"))
        print(json.dumps(compile_share(Spec.from_json(args.spec), shard, shards)))
        return 0
    job = start(
        NetConfig(),
        args.batch_sizes,
        args.eval_batch_sizes or args.batch_sizes,
        workers=args.workers,
    )
    print(job.wait())
    return 0


if __name__ == "__main__":
    sys.exit(main())
