"""The capstone trained data-parallel: one process a GPU, one all-reduce of the gradients a step.

    torchrun --standalone --nproc-per-node 2 -m final_project.train --batch-size 2048 ...
    torchrun --standalone --nproc-per-node 2 -m final_project.compare --batch-size 2048 ...

The pattern is llm.c's (``train_gpt2.cu``, multi-GPU), written in Python:

1. **One process a GPU.** ``torchrun`` starts N copies of the program and gives
   each its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. :func:`init` picks the
   GPU ``LOCAL_RANK`` (for Numba and torch) *before* the communicator is made,
   then makes it: NCCL on GPUs, gloo in the simulator (CPU tensors, the same calls).
2. **Same start everywhere.** Every rank builds :class:`DataParallelCNN` from the
   same seed; the constructor checks that every rank holds rank 0's weights.
3. **A shard of every global batch.** Every rank shuffles with the same seed, so
   all see the same global batch of B images; rank r trains on rows
   ``[r B/N, (r+1) B/N)`` (:func:`shard_rows`).
4. **Forward and backward on the shard** (the capstone's kernels, one CUDA graph):
   each rank's gradient buffer then holds the gradient of the *mean* loss over its
   B/N images.
5. **One all-reduce (sum) of the whole flat gradient buffer**, in place, through
   ``torch.distributed`` on a torch tensor that shares the Numba buffer's memory.
   It is ordered on the model's own stream: torch is told that stream is its
   current one (``torch.cuda.ExternalStream``), so NCCL's stream waits for the
   backward and the model's stream waits for NCCL before the update.
6. **SGD with lr / N.** The mean loss over B images is the mean of the N shard
   means, so its gradient is (sum over ranks) / N: the 1/N is folded into the
   learning rate of the one SGD launch (no extra pass over the gradients).

Batchnorm keeps per-rank statistics (each rank normalises its shard by the
shard's own mean and variance), as PyTorch's ``DistributedDataParallel`` without
``SyncBatchNorm`` does: N GPUs at global batch B are *not* one GPU at batch B,
they are the DDP twin at B. The running statistics each rank keeps come from its
own shards; rank 0's are the ones saved (DDP, with ``broadcast_buffers=True``,
evaluates rank 0's too).

Versions of the step (:meth:`DataParallelCNN.train_step`; ``compare`` times both):

    v1 one all-reduce   graph(forward + backward) -> all_reduce(whole buffer) -> SGD
    v2 two buckets      graph(forward .. fc1's weight gradient) -> all_reduce(fc1 + fc2
                        gradients, 95% of the bytes) on NCCL's stream, overlapping
                        graph(the rest of backward) -> all_reduce(conv + bn gradients)
                        -> SGD: DDP's bucketing, with the bucket boundary where the
                        backward has finished the classifier

The model's own stream is captured (a CUDA graph cannot capture the legacy default
stream), so torch is pointed at it rather than the kernels at torch's default stream.
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
from common.checking import CheckError, check
from common.runtime import device_name, is_simulator

import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numba import cuda

from final_project import kernels as naive
from final_project import reference as ref
from final_project.fast_model import FastCNN, Stage
from final_project.graph import CudaGraph, _check, _stream_handle
from final_project.model import PARAM_NAMES, NetConfig, init_params

# The environment torchrun gives every process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# v2's bucket boundary: after this stage the gradients of fc1 and fc2 (the flat
# buffer's tail, from fc1.weight on) are final; the rest of backward writes only the
# head (conv and batchnorm gradients).
TAIL_BUCKET_READY = Stage.FC1_GRAD_WEIGHT
TAIL_BUCKET_FIRST = "fc1.weight"
DEFAULT_TIMEOUT_S = 600  # a collective that waits longer than this fails (a rank died)


# --------------------------------------------------------------------------
# Ranks and the communicator
# --------------------------------------------------------------------------


def launched_by_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (WORLD_SIZE is set), as
    ``final_project.train`` and ``compare`` decide."""
    return bool(os.environ.get("WORLD_SIZE"))


def world_size() -> int:
    """WORLD_SIZE, the number of ranks torchrun started, read before anything is
    initialised (to refuse a bad batch size first).

    Raises:
        RuntimeError: not set (not under torchrun), or not a whole number.
    """
    return _env_int("WORLD_SIZE")


def _env_int(name: str) -> int:
    text = os.environ.get(name)
    if text is None:
        raise RuntimeError(
            f"{name} is not set: start the program with torchrun, for example "
            "torchrun --standalone --nproc-per-node 2 -m final_project.train ..."
        )
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"{name}={text!r} is not a whole number") from None


@dataclasses.dataclass
class Communicator:
    """This process's place among the ranks, and the collectives it calls.

    rank: 0..world-1; world: the number of processes (one a GPU); local_rank:
    the GPU index on this machine; backend: "nccl" (GPUs) or "gloo" (the
    simulator's CPU tensors). Made by :func:`init`; a test may build one by hand
    for the checks that need no process group.
    """

    rank: int
    world: int
    local_rank: int
    backend: str
    _streams: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: its GPU, or the CPU with gloo."""
        return (
            torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", self.local_rank)
        )

    def tensor(self, array: Any) -> torch.Tensor:
        """A torch tensor sharing the memory of a contiguous Numba device array (no copy).

        On a GPU through the CUDA Array Interface (``torch.as_tensor``); in the
        simulator the device array wraps a NumPy array, which ``torch.from_numpy``
        shares. A collective on the tensor reads and writes the Numba buffer.
        """
        if is_simulator():
            return torch.from_numpy(array._ary)  # the simulator's device memory is NumPy's
        return torch.as_tensor(array, device=self.device)

    @contextlib.contextmanager
    def ordered_on(self, stream: Any) -> Iterator[None]:
        """Inside the block, torch's current stream is the Numba ``stream``: a
        collective queued there starts after the work queued on ``stream`` before
        it, and ``work.wait()`` makes ``stream`` wait for the collective. Nothing
        to order in the simulator, where kernels and gloo run synchronously."""
        if self.backend == "gloo":
            yield
            return
        ptr = int(_stream_handle(stream))
        ext = self._streams.get(ptr)
        if ext is None:
            ext = self._streams[ptr] = torch.cuda.ExternalStream(ptr, device=self.device)
        with torch.cuda.stream(ext):
            yield

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``tensor`` over the ranks, in place (call inside :meth:`ordered_on`).
        Returns the work handle when ``async_op`` (its ``wait()`` orders the current
        stream after it), else None."""
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def mean_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """The element-wise mean over the ranks of a host array (float64 result)."""
        t = torch.as_tensor(np.asarray(values, np.float64), device=self.device).clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().numpy() / self.world

    def close(self) -> None:
        """Destroy the process group (every rank, at the end)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """Join the ranks torchrun started: pick this rank's GPU, then make the communicator.

    backend: "nccl" (default on a GPU) or "gloo" (default in the simulator, where
    tensors live on the CPU). timeout_s: a collective that waits longer fails
    (a rank that died or took another path), instead of hanging.

    Every check runs before anything is initialised.

    Raises:
        RuntimeError: RANK, WORLD_SIZE or LOCAL_RANK missing (not under torchrun),
            nccl asked for without a GPU (the simulator), a torch without NCCL or
            without CUDA, or LOCAL_RANK beyond this machine's GPUs; each message
            says what to do.
        ValueError: an unknown backend.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = int(os.environ.get("LOCAL_RANK", rank))
    backend = backend or ("gloo" if is_simulator() else "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        if is_simulator():
            raise RuntimeError(
                "the nccl backend needs one NVIDIA GPU a rank, and this process runs in the "
                "Numba CUDA simulator (no GPU): run on a machine with GPUs, or use "
                "backend='gloo' (CPU tensors), which the simulator runs"
            )
        if not dist.is_nccl_available():
            raise RuntimeError(
                f"this PyTorch ({torch.__version__}) has no NCCL "
                "(torch.distributed.is_nccl_available() is False): install a CUDA build of "
                "torch (https://pytorch.org/get-started/locally/)"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "torch sees no CUDA device, so NCCL cannot run: install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if local >= count:
            raise RuntimeError(
                f"LOCAL_RANK {local} but this machine has {count} GPU(s): start at most "
                f"{count} processes (torchrun --nproc-per-node {count})"
            )
        # The device first, for Numba and torch (one primary context), then the
        # communicator, bound to that device.
        torch.cuda.set_device(local)
        cuda.select_device(local)
        dist.init_process_group(
            "nccl",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", local),
        )
    else:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return Communicator(rank, world, local, backend)


# --------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------


def shard_size(batch: int, world: int) -> int:
    """Images a rank trains on when ``world`` ranks share a global batch of ``batch``.

    Raises:
        ValueError: world < 1, or ``world`` does not divide ``batch`` (ranks with
            unequal shards would weigh their images unequally in the mean).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if batch % world:
        raise ValueError(
            f"the global batch {batch} does not split into {world} equal shards: use a "
            f"--batch-size that {world} divides (e.g. {max(world, batch // world * world)})"
        )
    return batch // world


def shard_rows(batch: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s rows of a global batch: ``slice(rank * s, (rank + 1) * s)``, s = batch / world.

    Contiguous shards in rank order: concatenated, they are the global batch.

    Raises:
        ValueError: as :func:`shard_size`, or rank outside 0..world-1.
    """
    size = shard_size(batch, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return slice(rank * size, (rank + 1) * size)


# --------------------------------------------------------------------------
# CUDA graphs in segments
# --------------------------------------------------------------------------


def capture_segments(
    stream: Any, launches: Callable[[Callable[[str], None]], None], split_after: set[str]
) -> list[CudaGraph]:
    """Capture what ``launches(mark)`` queues on ``stream`` into consecutive graphs,
    a new graph after each stage named in ``split_after`` (``mark(stage)`` is
    called after each stage's launches, as FastCNN's step does).

    The pieces replay in order with host code between them (v2 queues an
    all-reduce there). Same rules as :class:`final_project.graph.CudaGraphBackend`.

    Raises:
        RuntimeError: a driver call failed.
    """
    from cuda.bindings import driver as drv

    handle = _stream_handle(stream)
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    graphs: list[CudaGraph] = []

    def end() -> None:
        graph = _check(drv.cuStreamEndCapture(handle), "cuStreamEndCapture")
        graphs.append(CudaGraph(graph, _check(drv.cuGraphInstantiate(graph, 0), "instantiate")))

    def mark(stage: str) -> None:
        if stage in split_after:
            end()
            _check(drv.cuStreamBeginCapture(handle, mode), "cuStreamBeginCapture")

    _check(drv.cuStreamBeginCapture(handle, mode), "cuStreamBeginCapture")
    try:
        launches(mark)
    finally:
        end()
    return graphs


# --------------------------------------------------------------------------
# The data-parallel model
# --------------------------------------------------------------------------


class DataParallelCNN(FastCNN):
    """FastCNN, one replica of N: trains on its shard, all-reduces the gradients.

    Args:
        config: the network's sizes (:class:`~final_project.model.NetConfig`).
        global_batch: B, the images of one step over all ranks; every buffer is
            allocated for this rank's B / N.
        comm: this rank's :class:`Communicator`.
        seed, params: the initial weights, as FastCNN (the same on every rank).
        graph: capture forward + backward as CUDA graphs (default on a GPU).
        overlap: v2, two buckets, the classifier's all-reduce overlapping the
            convolutions' backward; False is v1, one all-reduce of the whole buffer.
        check_replicas: check at construction that every rank holds rank 0's
            weights (a collective: every rank must construct its model).

    Raises:
        ValueError: N does not divide B (before anything is allocated), or as FastCNN.
        RuntimeError: the ranks' initial weights differ.
    """

    def __init__(
        self,
        config: NetConfig,
        global_batch: int,
        comm: Communicator,
        seed: int = 0,
        params: dict | None = None,
        graph: bool | None = None,
        overlap: bool = False,
        check_replicas: bool = True,
    ) -> None:
        per_rank = shard_size(global_batch, comm.world)
        super().__init__(config, max_batch=per_rank, seed=seed, params=params, graph=graph)
        self.comm = comm
        self.global_batch = global_batch
        self.overlap = overlap
        whole = comm.tensor(self.grads.flat)
        split = self.grads.offsets[TAIL_BUCKET_FIRST][0]
        # (stage after which the bucket is final, the bucket): in launch order
        self.buckets = (
            [(TAIL_BUCKET_READY, whole[split:]), (None, whole[:split])]
            if overlap
            else [(None, whole)]
        )
        self._segments: dict[int, list[CudaGraph]] = {}
        if check_replicas:
            self.check_replicas()

    # -- the arithmetic of data parallelism ----------------------------------------

    def shard(self, batch: int) -> slice:
        """This rank's rows of a global batch of ``batch`` images (:func:`shard_rows`)."""
        return shard_rows(batch, self.comm.rank, self.comm.world)

    def local_lr(self, lr: float) -> float:
        """The learning rate of this rank's SGD launch: lr / N, since the gradient
        buffer holds the *sum* over N ranks of shard-mean gradients."""
        return float(lr) / self.comm.world

    def check_replicas(self) -> None:
        """Raise RuntimeError on every rank unless every rank holds rank 0's
        parameters and running statistics, bit for bit (a collective)."""
        self.synchronize()
        with self.comm.ordered_on(self.stream):
            mismatched = 0
            for store in (self.params, self.buffers):
                mine = self.comm.tensor(store.flat)
                theirs = mine.clone()
                dist.broadcast(theirs, src=0)
                mismatched += int(not torch.equal(mine, theirs))
            flag = torch.tensor([mismatched], dtype=torch.int64, device=self.comm.device)
            dist.all_reduce(flag)
        if int(flag.item()):
            raise RuntimeError(
                f"the ranks start from different weights ({int(flag.item())} mismatches "
                "with rank 0): every rank must build its model from the same seed or "
                "checkpoint"
            )

    # -- the step ------------------------------------------------------------------

    def _sgd(self, lr: float) -> None:
        size = self.params.flat.size
        naive.sgd_update_naive[naive._grid(size)[0], naive.THREADS_PER_BLOCK, self.stream](
            self.params.flat, self.grads.flat, self.local_lr(lr)
        )

    def _eager_step(self, n: int, lr: float, mark: Callable[[str], None]) -> None:
        """Forward, backward, the all-reduces queued where their buckets are final, SGD."""
        works = []
        with self.comm.ordered_on(self.stream):

            def at_stage(stage: str) -> None:
                mark(stage)
                for ready, bucket in self.buckets:
                    if ready == stage:
                        works.append(self.comm.all_reduce_sum(bucket, async_op=True))

            self._loss_and_grads(n, at_stage)
            for ready, bucket in self.buckets:
                if ready is None:
                    works.append(self.comm.all_reduce_sum(bucket, async_op=True))
            for work in works:
                work.wait()
            self._sgd(lr)
        mark(Stage.SGD_UPDATE)

    def _replay(self, segments: list[CudaGraph], lr: float) -> None:
        with self.comm.ordered_on(self.stream):
            works = []
            for graph, (_, bucket) in zip(segments, self.buckets):
                graph.launch(self.stream)
                works.append(self.comm.all_reduce_sum(bucket, async_op=True))
            for work in works:
                work.wait()
            self._sgd(lr)

    def train_step(
        self, x: Any, y: Any, lr: float, *, on_stage: Callable[[str], None] | None = None
    ) -> None:
        """One data-parallel SGD step on the global batch (x, y): this rank's shard,
        the all-reduce, the update with lr / N. Queues work only (no host wait).

        x (B, C, H, W) float32 and y (B,) int32, host (pinned for an asynchronous
        copy) or device, the same global batch on every rank; B may be any multiple
        of N up to ``global_batch``. With graphs, the first step at a batch size runs
        eagerly and captures forward + backward (v2: two pieces, split at the bucket
        boundary); later steps replay them. on_stage: as FastCNN (eager launches).

        Raises:
            ValueError: N does not divide B, or a batch of the wrong shape or dtype.
        """
        rows = self.shard(len(y))
        n = self._stage(x[rows], y[rows])
        self.num_batches_tracked += 1
        if on_stage is not None or self.graph_backend is None:
            self._eager_step(n, lr, on_stage or (lambda stage: None))
            return
        segments = self._segments.get(n)
        if segments is None:
            self._eager_step(n, lr, lambda stage: None)  # compiles and warms every kernel
            split = {ready for ready, _ in self.buckets if ready is not None}
            self._segments[n] = capture_segments(
                self.stream, lambda mark: self._loss_and_grads(n, mark), split
            )
        else:
            self._replay(segments, lr)


# --------------------------------------------------------------------------
# The check of one step
# --------------------------------------------------------------------------


def check_data_parallel_step(
    model: DataParallelCNN, x: np.ndarray, y: np.ndarray, lr: float, tol: float = 1e-4
) -> dict[str, float]:
    """Take one data-parallel step on the global batch (x, y) and check it, on every
    rank, against the float64 reference with per-rank batchnorm (a collective).

    The reference (:mod:`final_project.reference`) runs each rank's shard alone
    (its own batchnorm statistics), from the state before the step, and averages
    the N shard gradients. Checked, as relative errors within ``tol`` (the 1e-4 of
    :func:`final_project.checks.check_train_step`): this rank's loss, the
    all-reduced gradient buffer divided by N against that mean (the conv biases,
    whose true gradient is 0 under batchnorm, against the weight gradient's norm),
    every parameter after the update, and this rank's running statistics. Each
    rank's max-pool choices are shared (``all_gather_object``), so the reference
    takes the same window elements at near-ties.

    x (B, C, H, W) float32, y (B,) int32 host arrays, the same on every rank.

    Returns:
        name -> relative error (this rank's).

    Raises:
        CheckError: the first quantity off (a wrong shard, a missing 1/N, a missing
            or doubled all-reduce are off by O(1)).
    """
    comm, config = model.comm, model.config
    world = comm.world
    model.synchronize()
    before = model.state_dict()
    model.train_step(x, y, lr)
    model.synchronize()
    loss = float(model.loss.copy_to_host()[0])
    grads_sum = model.grads.download()
    after = model.state_dict()
    rows = [shard_rows(len(y), r, world) for r in range(world)]
    windows = [None] * world
    dist.all_gather_object(windows, model.pool_windows(rows[0].stop - rows[0].start))

    shard_grads, mine = [], None
    for r, part in enumerate(rows):
        logits, caches, new_buffers = ref.reference_forward(
            before, x[part], config, training=True, pool_windows=windows[r]
        )
        shard_loss, grads = ref.reference_backward(logits, caches, y[part])
        shard_grads.append(grads)
        if r == comm.rank:
            mine = (shard_loss, new_buffers)
    want_grads = {k: np.mean([g[k] for g in shard_grads], axis=0) for k in PARAM_NAMES}
    want_loss, want_buffers = mine
    if not math.isfinite(loss):
        raise CheckError(f"rank {comm.rank}: the loss is {loss} (reference {want_loss:.6g})")
    errs = {"loss": check(np.array([loss]), np.array([want_loss]), tol, "shard loss")}
    for name in PARAM_NAMES:
        got = grads_sum[name].astype(np.float64) / world
        if name in ("conv1.bias", "conv2.bias"):  # batchnorm follows: only rounding noise
            w_norm = float(np.linalg.norm(grads_sum[name.replace("bias", "weight")] / world))
            noise = float(np.linalg.norm(got))
            if not noise <= tol * w_norm:
                raise CheckError(
                    f"rank {comm.rank}: all-reduced grad {name}: norm {noise:.3g}, expected ~0 "
                    f"(at most {tol:g} x the weight gradient's {w_norm:.3g})"
                )
            continue
        errs[f"grad {name}"] = check(got, want_grads[name], tol, f"all-reduced grad {name} / N")
    for name in PARAM_NAMES:
        want = before[name].astype(np.float64) - lr * want_grads[name]
        errs[f"after {name}"] = check(after[name], want, tol, f"{name} after the step")
    for name, want in want_buffers.items():
        errs[f"after {name}"] = check(after[name], want, tol, f"{name} after the step")
    return errs


# --------------------------------------------------------------------------
# Training and racing, under torchrun
# --------------------------------------------------------------------------


def _rank0_log(comm: Communicator) -> Callable[[str], None]:
    return print if comm.rank == 0 else (lambda *args, **kwargs: None)


def _load_images(comm: Communicator, args: Any, log: Callable[[str], None]) -> tuple | None:
    """(dataset, x_train, y_train, x_test, y_test) as ``train`` prepares them; rank 0
    loads (and downloads) first, the others then read its cache. None, after printing
    the error, where the data cannot be had."""
    from final_project import datasets
    from final_project import train as ftrain

    if comm.rank != 0:
        comm.barrier()
    try:
        ds = ftrain.load_data(args, log=log)
    except (datasets.DataError, ValueError) as e:
        print(f"error (rank {comm.rank}): {e}", file=sys.stderr)
        return None
    finally:
        if comm.rank == 0:
            comm.barrier()
    return (
        ds,
        *ftrain.images_for(ds, "train", args.image_size),
        *ftrain.images_for(ds, "test", args.image_size),
    )


def global_history(comm: Communicator, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train``'s per-epoch rows with every step's loss replaced by its mean over the
    ranks (the loss of the global batch: each rank's is its shard's mean) and
    ``train_loss`` recomputed; test accuracy stays rank 0's. One collective."""
    flat = np.concatenate([np.asarray(h["losses"], np.float64) for h in history] or [[]])
    mean = comm.mean_over_ranks(flat)
    out, lo = [], 0
    for h in history:
        k = len(h["losses"])
        losses = mean[lo : lo + k]
        lo += k
        out.append({**h, "losses": losses.tolist(), "train_loss": float(losses.mean())})
    return out


def _check_args(world: int, args: Any, parser: Any) -> None:
    """Refuse, through ``parser.error``, what data parallelism cannot run, before any work."""
    if args.kernels == "naive":
        parser.error(
            "data parallelism runs the fast kernels (final_project.fast_model): give "
            "--kernels fast (the simulator's default is naive)"
        )
    if getattr(args, "precision", "fp32") != "fp32":
        parser.error(
            "data parallelism runs the FP32 kernels: --precision tf32 is for one GPU "
            "(python -m final_project.train or compare without torchrun)"
        )
    if getattr(args, "check", False):
        parser.error(
            "--check runs on one GPU (python -m final_project.train --check); under "
            "torchrun, chapters/13_multi_gpu/data_parallel.py checks the data-parallel step"
        )
    try:
        shard_size(args.batch_size, world)
    except ValueError as e:
        parser.error(str(e))


def train_main(args: Any, parser: Any) -> int:
    """``torchrun ... -m final_project.train``: the training run, data-parallel.

    ``args`` as :func:`final_project.train.main` parsed and resolved them; the
    global batch is ``--batch-size``. Rank 0 prints, evaluates (with its own
    running statistics) and writes checkpoint.npz and metrics.json; the loss
    history is the mean over the ranks (:func:`global_history`).
    """
    from final_project import data as fdata
    from final_project import train as ftrain

    _check_args(world_size(), args, parser)
    try:
        comm = init()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log = _rank0_log(comm)
    if comm.rank == 0 and args.out is not None and (args.out / "checkpoint.npz").exists():
        if not args.overwrite:
            parser.error(
                f"{args.out / 'checkpoint.npz'} is there: give another --out or --overwrite"
            )
    per_rank = shard_size(args.batch_size, comm.world)
    log(
        f"data parallel: {comm.world} ranks ({comm.backend}), "
        + (f"GPU: {device_name()}" if comm.backend == "nccl" else "the simulator")
        + f"; global batch {args.batch_size} = {comm.world} x {per_rank}"
    )
    loaded = _load_images(comm, args, log)
    if loaded is None:
        return 1
    ds, x_train, y_train, x_test, y_test = loaded
    train_batches = fdata.EpochBatches(x_train, y_train, args.batch_size)
    test_batches = fdata.EpochBatches(x_test, y_test, per_rank, drop_last=False)
    config = ftrain.net_config(args)
    model = DataParallelCNN(
        config, args.batch_size, comm, params=init_params(config, args.seed), graph=args.graph
    )
    log(
        f"model: {ftrain.describe_config(config)}; {ftrain.describe_kernels(args)}, one "
        f"all-reduce a step; SGD lr {args.lr} (lr / {comm.world} on the summed gradients); "
        f"{args.epochs} epochs of {len(train_batches)} steps; rank 0's lines follow"
    )
    history = ftrain.train(
        model,
        train_batches,
        test_batches,
        args.epochs,
        args.lr,
        args.seed,
        max_steps=args.max_steps,
        log=lambda s: log("  rank 0: " + s),
        progress=False,
        log_every=ftrain.TINY.log_every if args.tiny else ftrain.LOG_EVERY,
    )
    history = global_history(comm, history)
    for h in history:
        log(
            f"epoch {h['epoch']}: train loss {h['train_loss']:.4f} (mean over the ranks), "
            f"test accuracy {h['test_accuracy']:.2f}%"
            + (f", {h['ms_per_step']:.3f} ms/step" if h["ms_per_step"] else "")
        )
    if comm.rank == 0:
        meta = {
            "dataset": ds.name,
            "is_sample": ds.is_sample,
            "mean": ds.mean,
            "std": ds.std,
            "kernels": ftrain.describe_kernels(args) + f", data parallel over {comm.world}",
            "train_from_test": args.train_from_test,
            "tiny": args.tiny,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "world_size": comm.world,
            "seed": args.seed,
            "epochs": len(history),
            "source": ds.source,
        }
        out = args.out if args.out is not None else ftrain.fresh_run_dir(ftrain.DEFAULT_OUT)
        ftrain.save_checkpoint(out / "checkpoint.npz", model, meta)
        metrics = {**meta, "runtime": common.runtime_name(), "device": device_name()}
        metrics.update(config=dataclasses.asdict(config), history=history)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        log(
            f"test accuracy {history[-1]['test_accuracy']:.2f}% (rank 0); wrote "
            f"{out / 'checkpoint.npz'} and metrics.json"
        )
    comm.close()
    return 0


# ---- the DDP twin ---------------------------------------------------------------


def ddp_twin(comm: Communicator, config: NetConfig, init: dict, lr: float) -> tuple[Any, Any]:
    """(DDP-wrapped TorchCNN holding ``init``, its SGD optimizer) on this rank's device.

    DistributedDataParallel's defaults: gradients averaged over the ranks in
    buckets during backward (one 25 MB bucket holds the whole 1.7 MB here),
    rank 0's batchnorm buffers broadcast before each forward, no SyncBatchNorm.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from final_project.torch_twin import TorchCNN

    twin = TorchCNN.from_state_dict(config, init, comm.device)
    ids = [comm.local_rank] if comm.backend == "nccl" else None
    ddp = DDP(twin, device_ids=ids)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=lr)


def train_side_by_side(
    comm: Communicator,
    config: NetConfig,
    batches: Any,
    test_batches: Any,
    x_test: np.ndarray,
    y_test: np.ndarray,
    epochs: int,
    lr: float,
    seed: int,
    max_steps: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Train from the same weights on the same global batches: rank 0 alone (one GPU,
    batch B, the capstone's FastCNN), ours data-parallel, and the torch DDP twin.

    Returns {"1 GPU": history, "ours": history, "torch DDP": history}, losses
    averaged over the ranks (one GPU: rank 0's; the others wait at a barrier).
    """
    from final_project import compare as fcompare
    from final_project import data as fdata
    from final_project import train as ftrain

    init = init_params(config, seed)
    quiet = lambda s: None  # noqa: E731
    out: dict[str, list[dict[str, Any]]] = {}
    if comm.rank == 0:
        t0 = time.perf_counter()
        one = FastCNN(config, max_batch=batches.batch_size, params=init)
        full_test = fdata.EpochBatches(x_test, y_test, batches.batch_size, drop_last=False)
        out["1 GPU"] = ftrain.train(
            one,
            batches,
            full_test,
            epochs,
            lr,
            seed,
            max_steps=max_steps,
            log=quiet,
            progress=False,
        )
        log(f"  1 GPU (rank 0 alone), batch {batches.batch_size}: {time.perf_counter() - t0:.1f} s")
    comm.barrier()
    t0 = time.perf_counter()
    model = DataParallelCNN(config, batches.batch_size, comm, params=init)
    out["ours"] = global_history(
        comm,
        ftrain.train(
            model,
            batches,
            test_batches,
            epochs,
            lr,
            seed,
            max_steps=max_steps,
            log=quiet,
            progress=False,
        ),
    )
    log(f"  ours, {comm.world} ranks: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    ddp, _ = ddp_twin(comm, config, init, lr)
    history = fcompare.train_torch(
        ddp,
        batches,
        x_test,
        y_test,
        epochs,
        lr,
        seed,
        comm.device,
        max_steps=max_steps,
        rows=shard_rows(batches.batch_size, comm.rank, comm.world),
    )
    out["torch DDP"] = global_history(comm, history)
    log(f"  torch DDP twin, {comm.world} ranks: {time.perf_counter() - t0:.1f} s")
    return out


# ---- timing ------------------------------------------------------------------------


def time_versions(
    comm: Communicator,
    config: NetConfig,
    images: np.ndarray,
    labels: np.ndarray,
    batch: int,
    lr: float,
    seed: int,
    steps: int = 50,
    windows: int = 5,
    warmup: int = 20,
    n_batches: int = 8,
) -> list[dict[str, Any]]:
    """ms per training step of every version at global batch ``batch`` (GPU only).

    Rows: "1 GPU, ours (one CUDA graph)" and "1 GPU, torch eager twin" (rank 0
    alone, batch B), then on all N ranks "ours v1: one all-reduce", "ours v2: two
    buckets, overlapped", "torch DDP twin (eager)", and "all-reduce of the
    gradients alone". A step is the copy of this rank's shard from pinned host
    memory + forward + backward + all-reduce + update, ``n_batches`` global
    batches cycled; after ``warmup`` steps, ``windows`` windows of ``steps``
    steps are timed between CUDA events on rank 0 (every rank runs them), the
    median window / steps kept (the protocol of ``final_project.compare``).

    Returns rows {name, gpus, ms, images_per_s, speedup (over "1 GPU, ours")};
    [] in the simulator (nothing is timed there).
    """
    from final_project import data as fdata
    from final_project.torch_twin import TorchCNN, torch_train_step

    if is_simulator():
        return []
    n_batches = max(1, min(n_batches, len(labels) // batch))
    batches = fdata.EpochBatches(images[: n_batches * batch], labels[: n_batches * batch], batch)
    hosts = [batches.host(i) for i in range(n_batches)]
    init = init_params(config, seed)
    rows = shard_rows(batch, comm.rank, comm.world)
    per_rank = rows.stop - rows.start

    def timed(step: Callable[[int], None]) -> float:
        for j in range(warmup):
            step(j % n_batches)
        times = []
        for _ in range(windows):
            cuda.synchronize()
            start, end = cuda.event(), cuda.event()
            start.record()
            for j in range(steps):
                step(j % n_batches)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / steps)
        return float(np.median(times))

    def torch_stepper(model: Any, n_rows: slice) -> Callable[[int], None]:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x = torch.empty((n_rows.stop - n_rows.start, *images.shape[1:]), device=comm.device)
        y = torch.empty(n_rows.stop - n_rows.start, dtype=torch.int64, device=comm.device)
        xs = [torch.from_numpy(h[0][n_rows]) for h in hosts]
        ys = [torch.from_numpy(h[1][n_rows]) for h in hosts]

        def step(j: int) -> None:
            x.copy_(xs[j], non_blocking=True)
            y.copy_(ys[j], non_blocking=True)
            torch_train_step(model, opt, x, y)

        return step

    results: list[tuple[str, int, float]] = []
    if comm.rank == 0:
        one = FastCNN(config, max_batch=batch, params=init, graph=True)
        results.append(
            ("1 GPU, ours (one CUDA graph)", 1, timed(lambda j: one.train_step(*hosts[j], lr)))
        )
        del one
        twin = TorchCNN.from_state_dict(config, init, comm.device)
        results.append(("1 GPU, torch eager twin", 1, timed(torch_stepper(twin, slice(0, batch)))))
        del twin
    comm.barrier()
    for name, overlap in (
        ("ours v1: one all-reduce", False),
        ("ours v2: two buckets, overlapped", True),
    ):
        model = DataParallelCNN(config, batch, comm, params=init, graph=True, overlap=overlap)
        results.append((name, comm.world, timed(lambda j, m=model: m.train_step(*hosts[j], lr))))
        del model
    ddp, _ = ddp_twin(comm, config, init, lr)
    results.append(("torch DDP twin (eager)", comm.world, timed(torch_stepper(ddp, rows))))
    del ddp
    grads = torch.empty(sum(int(np.prod(s)) for s in _param_sizes(config)), device=comm.device)
    grads.normal_()
    results.append(
        ("all-reduce of the gradients alone", comm.world, timed(lambda j: dist.all_reduce(grads)))
    )
    comm.barrier()
    base = results[0][2] if comm.rank == 0 else None
    table = []
    for name, gpus, ms in results:
        images_per_s = batch / (ms * 1e-3) if "alone" not in name else None
        table.append(
            {
                "name": name,
                "gpus": gpus,
                "global_batch": batch,
                "per_rank": per_rank if gpus > 1 else batch,
                "ms": ms,
                "images_per_s": images_per_s,
                "speedup": base / ms if base and images_per_s else None,
            }
        )
    return table


def _param_sizes(config: NetConfig) -> list[tuple[int, ...]]:
    from final_project.model import param_shapes

    shapes = param_shapes(config)
    return [shapes[k] for k in PARAM_NAMES]


def format_versions(rows: list[dict[str, Any]], gpu: str) -> str:
    """The table of :func:`time_versions`."""
    from common.timing import format_table

    if not rows:
        return "timing: skipped (the simulator times nothing)"
    cells = [
        [
            r["name"],
            r["gpus"],
            f"{r['global_batch']} ({r['per_rank']} a GPU)",
            f"{r['ms']:.3f}",
            "-" if r["images_per_s"] is None else f"{r['images_per_s']:,.0f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
        ]
        for r in rows
    ]
    return format_table(
        cells,
        title=f"ms per training step at global batch {rows[0]['global_batch']}, {gpu}",
        header=["version", "GPUs", "batch", "ms/step", "images/s", "vs 1 GPU ours"],
        align="<>>>>>",
    )


def compare_main(args: Any, parser: Any) -> int:
    """``torchrun ... -m final_project.compare``: ours data-parallel against the torch
    DDP twin (and one GPU) at the same global batch ``--batch-size``.

    1. Accuracy (unless --timing-only): :func:`train_side_by_side`, loss curves and
       test accuracies. 2. Time per step of every version (:func:`time_versions`)
       at each of --time-batch-sizes (default: --batch-size). Rank 0 writes
       ``compare_data_parallel.json`` to --out.
    """
    from final_project import compare as fcompare
    from final_project import data as fdata
    from final_project import train as ftrain

    _check_args(world_size(), args, parser)
    if args.torch_precision == "both":
        parser.error("under torchrun, compare times one precision: --torch-precision fp32 or tf32")
    sizes = args.time_batch_sizes or [args.batch_size]
    for b in sizes:
        try:
            shard_size(b, world_size())
        except ValueError as e:
            parser.error(f"--time-batch-sizes: {e}")
    try:
        comm = init()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log = _rank0_log(comm)
    fcompare.set_torch_precision(args.torch_precision or "fp32")
    gpu = device_name()
    log(f"data parallel compare: {comm.world} ranks ({comm.backend}) on {gpu}")
    loaded = _load_images(comm, args, log)
    if loaded is None:
        return 1
    ds, x_train, y_train, x_test, y_test = loaded
    config = ftrain.net_config(args)
    result: dict[str, Any] = {
        "device": gpu,
        "world_size": comm.world,
        "config": dataclasses.asdict(config),
        "dataset": ds.name,
        "source": ds.source,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "torch_version": torch.__version__,
    }
    if not args.timing_only:
        per_rank = shard_size(args.batch_size, comm.world)
        batches = fdata.EpochBatches(x_train, y_train, args.batch_size)
        test_batches = fdata.EpochBatches(x_test, y_test, per_rank, drop_last=False)
        log(
            f"accuracy: {args.epochs} epochs x {len(batches)} steps at global batch "
            f"{args.batch_size}, SGD lr {args.lr}, seed {args.seed}; same weights, same batches"
        )
        runs = train_side_by_side(
            comm, config, batches, test_batches, x_test, y_test, args.epochs, args.lr,
            args.seed, args.max_steps, log,
        )  # fmt: skip
        if comm.rank == 0:
            log(format_accuracy(runs, args.loss_every or 10))
        result["accuracy"] = {k: v for k, v in runs.items()}
    result["timing"] = []
    protocol = {
        "steps": args.time_steps or 50,
        "windows": args.time_windows or 5,
        "warmup": 20 if args.time_warmup is None else args.time_warmup,
    }
    for b in sizes:
        rows = time_versions(comm, config, x_train, y_train, b, args.lr, args.seed, **protocol)
        log(format_versions(rows, f"{comm.world} x {gpu}"))
        result["timing"].append(rows)
    if comm.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "compare_data_parallel.json"
        path.write_text(json.dumps(result, indent=2, default=_json_default))
        log(f"wrote {path}")
    comm.close()
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"not JSON: {type(v).__name__}")


def format_accuracy(runs: dict[str, list[dict[str, Any]]], every: int) -> str:
    """Loss curves (mean of every ``every`` steps) side by side, then test accuracies."""
    from final_project.compare import loss_curve

    names = list(runs)
    curves = {k: loss_curve(v, every) for k, v in runs.items()}
    lines = [f"  {'step':>6}" + "".join(f"{k:>14}" for k in names)]
    for i, (s, _) in enumerate(curves[names[0]]):
        lines.append(f"  {s:>6}" + "".join(f"{curves[k][i][1]:>14.4f}" for k in names))
    for k in names:
        lines.append(
            f"  {k}: test accuracy "
            + ", ".join(f"epoch {h['epoch']} {h['test_accuracy']:.2f}%" for h in runs[k])
        )
    return "\n".join(lines)
