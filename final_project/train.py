"""Train the capstone CNN with our own kernels: ``python -m final_project.train``.

    python -m final_project.train                                  # MNIST (cache/download/sample)
    python -m final_project.train --dataset fashion-mnist --data-dir DIR --epochs 3
    python -m final_project.train --data-dir DIR --train-from-test 8000 --epochs 5
    python -m final_project.train --evaluate runs/final_project/run-001/checkpoint.npz

Each epoch the training images are shuffled with the seed (one permutation,
``numpy.random.default_rng(seed)``), gathered into one pinned host buffer, and
copied to the device one batch at a time on a stream, while the model's
kernels run on the default stream; a training step only launches kernels
(:class:`final_project.model.NumbaCNN`). The loss of every step is copied,
device to device, into an array read once per epoch, so the host never waits
on the GPU inside an epoch (except for ``--check`` and the loss shown as it
goes: every 50 steps on the progress bar, or a line every ``log_every`` steps
when stderr is not a terminal).

Printed per epoch: mean train loss, test accuracy, and ms per step measured
with CUDA events between the second step and the last (the first step compiles
every kernel). Test accuracy comes from our kernels on a GPU; in the simulator,
where they would take minutes for a few hundred images, from the NumPy float64
forward pass of :mod:`final_project.reference` with the trained weights.
Written to a fresh folder ``runs/final_project/run-NNN/`` (or ``--out DIR``,
which must not hold a checkpoint already unless ``--overwrite``):
``checkpoint.npz`` (the state dict by torch names plus a JSON ``__meta__``
entry: config, dataset, normalisation) and ``metrics.json``.

In the simulator the default run is tiny (``--tiny``, :data:`TINY`): real digits
shrunk to 8x8, channels 2/4, hidden 16, two epochs of 64 steps of 4 images,
the loss printed every 8 steps, test accuracy on 300 images. ``--no-tiny`` asks for the full network (hours there).
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.internal import racecheck

# isort: on
from common.checking import CheckError
from common.harness import positive_float, positive_int
from common.runtime import KERNEL_CACHE_DIR, device_name

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numba import cuda

from final_project import data as fdata
from final_project import datasets, precompile
from final_project.checks import check_train_step
from final_project.fast_model import PRECISIONS, FastCNN, tf32_refusal
from final_project.model import NetConfig, NumbaCNN, init_params
from final_project.tf32_conv import require_tf32_convs

DEFAULT_OUT = Path("runs") / "final_project"
DEFAULT_LR = 0.05
DEFAULT_EPOCHS = 3
DEFAULT_BATCH = 64
DEFAULT_CHECK_EVERY = 200
LOG_EVERY = 100  # steps between loss lines when stderr is not a terminal (no progress bar)


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """What the simulator runs by default: real digits, everything small.

    The simulator runs CUDA threads as Python code (a block of a barrier-free
    kernel as one loop), and a step of this network launches about 12,000 of
    them, nearly all in the first layer. The race detector checks each kernel's
    first launch. What it takes and reaches: the capstone README ("In the
    simulator").
    """

    image_size: int = 8
    n_train: int = 256
    n_test: int = 300
    batch_size: int = 4
    epochs: int = 2
    lr: float = 0.2
    c1: int = 2
    c2: int = 4
    hidden: int = 16
    check_every: int = 4
    log_every: int = 8

    def describe(self) -> str:
        return (
            f"tiny run: digits shrunk to {self.image_size}x{self.image_size}, "
            f"{self.n_train} training images, test on {self.n_test}"
        )


TINY = TinyRun()


class CheckFailed(RuntimeError):
    """``--check`` found a step that disagrees with the float64 reference
    (:func:`final_project.checks.check_train_step`), or the loss became non-finite."""


# --------------------------------------------------------------------------
# Options and data, shared with final_project.compare
# --------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options train and compare share: data, sizes, optimiser.

    Every size is validated as it is parsed (:func:`positive_int`): a bad value
    is an argparse error (exit status 2) before anything runs. A size left out
    is None here; :func:`resolve_args` fills it (GPU default or tiny run).
    """
    net, tiny = NetConfig(), TINY
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=sorted(datasets.DATASETS),
        default=None,
        help="mnist (default) or fashion-mnist",
    )
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding the four IDX files (.gz or raw), or torchvision's "
        "DIR/MNIST/raw layout; an error if they are not there",
    )
    g.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="download cache (default ~/.cache/cuda-python-course/<dataset>)",
    )
    g.add_argument(
        "--no-download",
        action="store_true",
        help="never touch the network (MNIST then falls back to the sample)",
    )
    g.add_argument(
        "--sample",
        action="store_true",
        help="train on the shipped sample of 2,000 real MNIST digits",
    )
    g.add_argument(
        "--train-from-test",
        type=positive_int,
        metavar="N",
        help="train on the first N images of the test split, test on the rest "
        "(for example 8000: no training images needed)",
    )
    t = p.add_argument_group("training (defaults: full run on a GPU / tiny run in the simulator)")
    t.add_argument(
        "--epochs",
        type=positive_int,
        metavar="N",
        help=f"passes over the training set (default {DEFAULT_EPOCHS} / {tiny.epochs})",
    )
    t.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="N",
        help=f"images per step (default {DEFAULT_BATCH} / {tiny.batch_size})",
    )
    t.add_argument(
        "--lr",
        type=positive_float,
        metavar="LR",
        help=f"plain SGD learning rate (default {DEFAULT_LR} / {tiny.lr})",
    )
    t.add_argument("--seed", type=int, default=0, help="initial weights and shuffling (default 0)")
    t.add_argument(
        "--max-steps", type=positive_int, metavar="N", help="stop after this many steps in all"
    )
    t.add_argument(
        "--c1",
        type=positive_int,
        metavar="N",
        help=f"conv1 channels (default {net.c1} / {tiny.c1})",
    )
    t.add_argument(
        "--c2",
        type=positive_int,
        metavar="N",
        help=f"conv2 channels (default {net.c2} / {tiny.c2})",
    )
    t.add_argument(
        "--hidden",
        type=positive_int,
        metavar="N",
        help=f"fc1 width (default {net.hidden} / {tiny.hidden})",
    )
    t.add_argument(
        "--kernels",
        choices=("fast", "naive"),
        default=None,
        help="fast: fused and tiled kernels (fast_model.FastCNN; default on a GPU); "
        "naive: one thread per output (model.NumbaCNN), the readable baseline "
        "(default in the simulator, where it runs 3x faster)",
    )
    t.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32: every kernel on the CUDA cores (default); tf32: conv2's forward "
        "and input gradient on the tensor cores in TF32 (fast kernels on a Hopper GPU)",
    )
    t.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay each training step as one CUDA graph (fast kernels; default "
        "on a GPU; the simulator has no graphs)",
    )
    t.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        metavar="N",
        help="compile the fast kernels before the first step in N processes "
        f"(default {precompile.default_workers()} here; 0: the first step compiles them). "
        f"Compiled kernels are kept in {KERNEL_CACHE_DIR} (NUMBA_CACHE_DIR moves it) and "
        "loaded by later runs; delete that folder to compile afresh",
    )
    t.add_argument(
        "--tiny",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"the simulator's small run: {tiny.image_size}x{tiny.image_size} "
        f"digits, {tiny.n_train} training and {tiny.n_test} test images "
        "(default: on in the simulator, off on a GPU)",
    )


def resolve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the defaults that depend on the runtime (the tiny run in the simulator).

    Sizes and rates are already checked by their ``type=``; this checks the
    combinations, through ``parser.error`` (exit status 2, before anything runs).
    """
    if args.tiny is None:
        args.tiny = common.is_simulator()
    if args.dataset is None:
        args.dataset = "mnist"
    tiny = TINY if args.tiny else None
    net = NetConfig()

    def default(name: str, full: Any) -> None:
        if getattr(args, name) is None:
            setattr(args, name, getattr(tiny, name) if tiny else full)

    default("epochs", DEFAULT_EPOCHS)
    default("batch_size", DEFAULT_BATCH)
    default("lr", DEFAULT_LR)
    default("c1", net.c1)
    default("c2", net.c2)
    default("hidden", net.hidden)
    args.image_size = tiny.image_size if tiny else 28
    if args.sample and args.data_dir:
        parser.error("give either --sample or --data-dir, not both")
    if args.kernels is None:
        args.kernels = "naive" if common.is_simulator() else "fast"
    if args.graph and args.kernels == "naive":
        parser.error("--graph needs --kernels fast (the naive model launches from Python)")
    if args.graph and common.is_simulator():
        parser.error("--graph needs a GPU: the simulator has no CUDA graphs")
    if args.graph is None:
        args.graph = args.kernels == "fast" and not common.is_simulator()
    if args.precision == "tf32":
        try:  # first: without a Hopper GPU nothing else matters
            require_tf32_convs()
        except RuntimeError as e:
            parser.error(str(e))
        if args.kernels != "fast":
            parser.error("--precision tf32 needs --kernels fast (the tensor-core kernels)")
        reason = tf32_refusal(net_config(args))
        if reason:
            parser.error(f"--precision tf32: {reason}")
    if args.compile_workers is not None and args.compile_workers < 0:
        parser.error(f"--compile-workers must be 0 or more, got {args.compile_workers}")
    return args


def start_precompile(
    args: argparse.Namespace,
    config: NetConfig,
    batches: Sequence[fdata.EpochBatches],
    extra_train_sizes: Sequence[int] = (),
) -> precompile.Job | None:
    """Start compiling the fast kernels for these training and evaluation batches
    (the first of ``batches`` trains, the rest evaluate) in ``--compile-workers``
    processes (:mod:`final_project.precompile`); None for the naive kernels."""
    if args.kernels != "fast":
        return None
    train_sizes = [*batches[0].batch_sizes(), *extra_train_sizes]
    eval_sizes = [n for b in batches[1:] for n in b.batch_sizes()]
    return precompile.start(config, train_sizes, eval_sizes, workers=args.compile_workers)


def describe_kernels(args: argparse.Namespace) -> str:
    """What runs the step, in words: "fast kernels, one CUDA graph a step", ..."""
    if args.kernels == "naive":
        return "naive kernels, eager launches"
    tf32 = ", conv2 in TF32 on the tensor cores" if args.precision == "tf32" else ""
    return "fast kernels, " + ("one CUDA graph a step" if args.graph else "eager launches") + tf32


def make_model(
    args: argparse.Namespace, config: NetConfig, params: dict, max_batch: int | None = None
) -> NumbaCNN | FastCNN:
    """The model ``--kernels`` and ``--graph`` ask for, holding ``params``."""
    max_batch = max_batch or args.batch_size
    if args.kernels == "naive":
        return NumbaCNN(config, max_batch=max_batch, params=params)
    return FastCNN(
        config, max_batch=max_batch, params=params, graph=args.graph, precision=args.precision
    )


def load_data(args: argparse.Namespace, log=print) -> datasets.Dataset:
    """The dataset the options ask for, split and shrunk as they say.

    Raises:
        datasets.DataError: see :func:`final_project.datasets.load_dataset`.
        ValueError: a --train-from-test that leaves no images on one side.
    """
    ds = datasets.load_dataset(
        args.dataset,
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        allow_download=not args.no_download,
        use_sample=args.sample,
        test_only=args.train_from_test is not None,
        log=log,
        progress=sys.stderr.isatty(),
    )
    if args.train_from_test is not None:
        ds = ds.train_from_test(args.train_from_test)
    if args.tiny:
        ds = ds.subset(TINY.n_train, TINY.n_test)
    return ds


def images_for(ds: datasets.Dataset, split: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Normalised float32 (N, 1, S, S) images and int32 labels of ``split``."""
    images = getattr(ds, f"{split}_images")
    labels = getattr(ds, f"{split}_labels")
    if image_size != images.shape[1]:
        images = fdata.shrink(images, image_size)
    return fdata.normalise(images, ds.mean, ds.std), labels.astype(np.int32)


def net_config(args: argparse.Namespace) -> NetConfig:
    s = args.image_size
    return NetConfig(height=s, width=s, c1=args.c1, c2=args.c2, hidden=args.hidden)


def describe_config(config: NetConfig) -> str:
    """The sizes a learner chose, in words: "channels 2/4, hidden 16, 8x8 input"."""
    return (
        f"channels {config.c1}/{config.c2}, hidden {config.hidden}, "
        f"{config.height}x{config.width} input"
    )


def describe_evaluation() -> str:
    """What computes the test accuracy here (see :func:`evaluate`)."""
    return (
        "our kernels"
        if not common.is_simulator()
        else "the NumPy float64 forward pass of the trained weights"
    )


# --------------------------------------------------------------------------
# Evaluation, checks, checkpoints
# --------------------------------------------------------------------------


def evaluate(model: NumbaCNN | FastCNN, batches: fdata.EpochBatches) -> float:
    """Test accuracy in percent (batchnorm in evaluation mode) over every image of ``batches``.

    On a GPU the model's own kernels run the forward pass. In the simulator
    they would take minutes for a few hundred images (one Python thread per
    output element), so there the same network runs in NumPy float64
    (:func:`final_project.reference.reference_forward`) with the model's
    trained weights and running statistics; tests/test_final_project_layers.py
    checks every kernel against that reference.
    """
    if common.is_simulator():
        from final_project.reference import reference_forward

        cuda.synchronize()
        logits, _, _ = reference_forward(model.state_dict(), batches.images, model.config)
        return 100.0 * float(np.mean(logits.argmax(axis=1) == batches.labels))
    correct = 0
    for i in range(len(batches)):
        x_dev, y_dev = batches.to_device(i)
        pred = model.predict(x_dev).copy_to_host()
        correct += int((pred == batches.host(i)[1]).sum())
    return 100.0 * correct / batches.count


def save_checkpoint(path: Path, model: NumbaCNN, meta: dict[str, Any]) -> None:
    """``.npz``: the state dict by torch names plus ``__meta__`` (JSON: config, data)."""
    meta = {**meta, "config": dataclasses.asdict(model.config)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part.npz")
    np.savez(tmp, **model.state_dict(), __meta__=np.array(json.dumps(meta)))
    tmp.replace(path)


def load_checkpoint(path: str | Path) -> tuple[NetConfig, dict[str, np.ndarray], dict]:
    """(config, state dict, meta) from a checkpoint written by :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a checkpoint of this course (no ``__meta__``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such checkpoint (train writes {DEFAULT_OUT}/checkpoint.npz)"
        )
    with np.load(path, allow_pickle=False) as z:
        if "__meta__" not in z.files:
            raise ValueError(f"{path} is not a final_project checkpoint (no __meta__ entry)")
        meta = json.loads(str(z["__meta__"]))
        state = {k: z[k] for k in z.files if k != "__meta__"}
    return NetConfig(**meta["config"]), state, meta


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def steps_this_epoch(batches: fdata.EpochBatches, max_steps: int | None, done: int) -> int:
    """Steps to run this epoch: one per batch, or fewer where ``max_steps``
    (counting the ``done`` steps of the epochs before) ends the run first."""
    return len(batches) if max_steps is None else min(len(batches), max_steps - done)


def train(
    model: NumbaCNN,
    train_batches: fdata.EpochBatches,
    test_batches: fdata.EpochBatches,
    epochs: int,
    lr: float,
    seed: int,
    max_steps: int | None = None,
    check_every: int | None = None,
    log=print,
    progress: bool = True,
    log_every: int | None = None,
) -> list[dict[str, Any]]:
    """Train for ``epochs`` (or ``max_steps``); one dict per epoch of what was measured.

    Each dict: epoch, steps, train_loss (mean over the epoch's steps),
    test_accuracy (%, :func:`evaluate`), ms_per_step (CUDA events, first step
    of the run excluded; None in the simulator), seconds (host wall time),
    losses (every step's loss).

    progress: a tqdm bar on stderr (for a terminal). log_every: also ``log`` a
    line with the mean loss of the last that many steps (read from the device
    then), so a run whose output goes to a file or a pipe shows the loss as it goes.

    Raises:
        CheckFailed: with ``check_every``, a non-finite loss or a step that
            disagrees with the float64 reference.
    """
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    # The fast model queues everything on its own stream and copies pinned host
    # batches itself; the naive one runs on the default stream, fed by a copy stream.
    fast = isinstance(model, FastCNN)
    stream = model.stream if fast else cuda.stream()
    losses = cuda.device_array(len(train_batches), np.float32)
    history = []
    step = 0
    first_step_s = None
    # on a GPU the first step compiles the kernels (or loads them from the cache)
    first_step_note = "" if common.is_simulator() else ": it compiles or loads every kernel"
    total = (
        epochs * len(train_batches)
        if max_steps is None
        else min(max_steps, epochs * len(train_batches))
    )
    for epoch in range(1, epochs + 1):
        train_batches.prepare(rng)
        n_steps = steps_this_epoch(train_batches, max_steps, step)
        if n_steps <= 0:
            break
        t0 = time.perf_counter()
        start, end = cuda.event(), cuda.event()
        timed_from = 1 if step == 0 else 0  # the run's first step compiles every kernel
        bar = tqdm(
            range(n_steps),
            desc=f"epoch {epoch}/{epochs}",
            leave=False,
            disable=not progress,
            file=sys.stderr,
        )
        logged = 0  # this epoch's steps already in a log line
        for i in bar:
            if i == timed_from:
                start.record()
            if check_every and step % check_every == 0:
                x, y = train_batches.host(i)
                cuda.synchronize()
                try:
                    errors = check_train_step(model, np.array(x), np.array(y), lr)
                except CheckError as e:
                    raise CheckFailed(
                        f"step {step + 1} disagrees with the float64 reference: {e}"
                    ) from e
                losses[i : i + 1].copy_to_device(model.loss, stream=stream)
                bar.set_postfix_str(f"check ok (worst {max(errors.values()):.1e})")
            elif fast:
                x, y = train_batches.host(i)
                model.train_step(x, y, lr)
                losses[i : i + 1].copy_to_device(model.loss, stream=stream)
            else:
                x_dev, y_dev = train_batches.to_device(i, stream=stream)
                model.train_step(x_dev, y_dev, lr)
                losses[i : i + 1].copy_to_device(model.loss)
            step += 1
            if step == 1:
                cuda.synchronize()
                first_step_s = time.perf_counter() - t0
            if progress and (i % 50 == 49 or i == n_steps - 1):
                bar.set_postfix(loss=f"{float(losses[i : i + 1].copy_to_host()[0]):.4f}")
            if log_every and (step % log_every == 0 or step == total):
                # the mean since the last line: one small batch's loss is too noisy to
                # show the trend
                recent = losses[logged : i + 1].copy_to_host()
                log(
                    f"steps {step - len(recent) + 1}-{step} of {total}: "
                    f"mean loss {float(recent.mean()):.4f}"
                )
                logged = i + 1
        end.record()
        end.synchronize()
        bar.close()
        epoch_losses = losses[:n_steps].copy_to_host()
        if not np.all(np.isfinite(epoch_losses)):
            bad = int(np.argmin(np.isfinite(epoch_losses)))
            raise CheckFailed(
                f"epoch {epoch}: the loss became {epoch_losses[bad]} at step "
                f"{bad + 1}; try a smaller --lr"
            )
        timed = n_steps - timed_from
        ms = start.elapsed_time(end) / timed if timed > 0 and not common.is_simulator() else None
        acc = evaluate(model, test_batches)
        row = {
            "epoch": epoch,
            "steps": n_steps,
            "train_loss": float(epoch_losses.mean()),
            "test_accuracy": acc,
            "ms_per_step": ms,
            "seconds": time.perf_counter() - t0,
            "first_step_seconds": first_step_s if epoch == 1 else None,
            "losses": epoch_losses.tolist(),
        }
        history.append(row)
        log(
            f"epoch {epoch}: train loss {row['train_loss']:.4f} (mean of {n_steps} steps), "
            f"test accuracy {acc:.2f}% on {test_batches.count} images, "
            + (f"{ms:.3f} ms/step, " if ms is not None else "")
            + f"{row['seconds']:.1f} s"
            + (f" (the first step {first_step_s:.2f} s{first_step_note})" if epoch == 1 else "")
        )
    return history


def run_evaluate(args: argparse.Namespace) -> int:
    config, state, meta = load_checkpoint(args.evaluate)
    model = NumbaCNN(config, max_batch=args.batch_size or DEFAULT_BATCH)
    model.load_state_dict(state)
    args.dataset = args.dataset or meta["dataset"]
    if args.train_from_test is None:
        args.train_from_test = meta.get("train_from_test")
    if not args.data_dir and meta.get("is_sample"):
        args.sample = True
    args.tiny = bool(meta.get("tiny"))
    args.image_size = config.height
    ds = load_data(args)
    x, y = images_for(ds, "test", config.height)
    acc = evaluate(model, fdata.EpochBatches(x, y, model.max_batch, drop_last=False))
    print(
        f"{args.evaluate}: test accuracy {acc:.2f}% on {len(y)} images ({ds.source}; "
        f"computed by {describe_evaluation()})"
    )
    return 0


def fresh_run_dir(parent: Path) -> Path:
    """Create and return ``parent/run-NNN``, NNN one more than the highest there (from 001).

    Each run gets its own folder, so a run never replaces an earlier checkpoint.
    """
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[4:]) for p in parent.glob("run-*") if p.name[4:].isdigit()]
    n = max(taken, default=0) + 1
    while True:
        path = parent / f"run-{n:03d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:  # another run took it meanwhile
            n += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m final_project.train",
        description="Train the capstone CNN (MNIST) with the course's own CUDA kernels. On a "
        "GPU: the full network; in the simulator (no GPU): a tiny run of 128 steps.",
    )
    add_common_args(p)
    o = p.add_argument_group("output and checks")
    o.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"folder for checkpoint.npz and metrics.json (default: a new "
        f"{DEFAULT_OUT}/run-NNN/ each run)",
    )
    o.add_argument(
        "--overwrite",
        action="store_true",
        help="let --out replace the checkpoint of an earlier run",
    )
    o.add_argument(
        "--check",
        action="store_true",
        help="every --check-every steps, check the step against the NumPy float64 "
        "reference (relative error 1e-4) and stop on a mismatch or a "
        "non-finite loss",
    )
    o.add_argument(
        "--check-every",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"steps between checks with --check (default {DEFAULT_CHECK_EVERY} / "
        f"{TINY.check_every})",
    )
    o.add_argument(
        "--evaluate",
        metavar="CHECKPOINT",
        help="load a checkpoint .npz and print its test accuracy; no training",
    )
    args = p.parse_args(argv)

    if args.evaluate:
        try:
            return run_evaluate(args)
        except (datasets.DataError, FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    resolve_args(args, p)
    if os.environ.get("WORLD_SIZE"):  # started by torchrun: data parallel, one process a GPU
        from final_project import distributed

        return distributed.train_main(args, p)
    if args.out is not None and (args.out / "checkpoint.npz").exists() and not args.overwrite:
        p.error(
            f"{args.out / 'checkpoint.npz'} is there from an earlier run; give another "
            f"--out, add --overwrite to replace it, or leave --out out (each run then "
            f"gets a new {DEFAULT_OUT}/run-NNN/)"
        )
    if common.is_simulator():
        print(
            f"simulator: {TINY.describe()}; --no-tiny runs the full network (hours here)"
            if args.tiny
            else "simulator: the full network (--no-tiny): expect hours"
        )
    else:
        print(f"GPU: {device_name()}")
    try:
        ds = load_data(args)
    except (datasets.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"data: {ds.source}; this run: {len(ds.train_labels)} train / "
        f"{len(ds.test_labels)} test images"
    )
    x_train, y_train = images_for(ds, "train", args.image_size)
    x_test, y_test = images_for(ds, "test", args.image_size)
    try:
        train_batches = fdata.EpochBatches(x_train, y_train, args.batch_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    test_batches = fdata.EpochBatches(x_test, y_test, args.batch_size, drop_last=False)

    config = net_config(args)
    job = start_precompile(args, config, (train_batches, test_batches))
    model = make_model(args, config, init_params(config, args.seed))
    if job is not None:
        print(job.wait())
    check_every = None
    if args.check:
        check_every = args.check_every or (TINY.check_every if args.tiny else DEFAULT_CHECK_EVERY)
    print(
        f"model: {describe_config(config)}; {describe_kernels(args)}; SGD lr {args.lr}, "
        f"batch {args.batch_size}, {args.epochs} epoch{'s' if args.epochs > 1 else ''} of "
        f"{len(train_batches)} steps"
        + (f", checked every {check_every} steps" if check_every else "")
    )
    progress = sys.stderr.isatty() and not args.tiny
    log_every = TINY.log_every if args.tiny else (None if progress else LOG_EVERY)
    try:
        # Simulator: the race detector checks each kernel's first launch (a step's
        # worth); checking every step would make the run several times slower.
        with racecheck.first_launch_of_each_kernel():
            history = train(
                model,
                train_batches,
                test_batches,
                args.epochs,
                args.lr,
                args.seed,
                max_steps=args.max_steps,
                check_every=check_every,
                progress=progress,
                log_every=log_every,
            )
    except CheckFailed as e:
        print(f"error: --check failed: {e}", file=sys.stderr)
        return 1

    meta = {
        "dataset": ds.name,
        "is_sample": ds.is_sample,
        "mean": ds.mean,
        "std": ds.std,
        "kernels": describe_kernels(args),
        "train_from_test": args.train_from_test,
        "tiny": args.tiny,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "epochs": len(history),
        "source": ds.source,
    }
    out = args.out if args.out is not None else fresh_run_dir(DEFAULT_OUT)
    save_checkpoint(out / "checkpoint.npz", model, meta)
    metrics = {
        **meta,
        "runtime": common.runtime_name(),
        "device": device_name(),
        "config": dataclasses.asdict(config),
        "history": history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(
        f"test accuracy {history[-1]['test_accuracy']:.2f}% ({describe_evaluation()}); "
        f"wrote {out / 'checkpoint.npz'} and metrics.json; evaluate it again with "
        f"python -m final_project.train --evaluate {out / 'checkpoint.npz'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
