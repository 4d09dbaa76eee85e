"""Our kernels against PyTorch, same network, same start, same batches.

    python -m final_project.compare --dataset fashion-mnist --data-dir DIR --epochs 3
    python -m final_project.compare --timing-only --time-batch-sizes 64,256,1024

Three parts, one run:

1. Accuracy. Our model (``--kernels``/``--graph``: by default on a GPU the fast
   kernels, one CUDA graph a step) and its PyTorch twin (``TorchCNN``, eager,
   on CUDA when torch has it, else the CPU) start from the same weights
   (``init_params``) and train with plain SGD on the same batches in the same
   order (one shuffled host buffer per epoch, seeded). Printed side by side:
   the mean loss every ``--loss-every`` steps, each epoch's train loss and
   test accuracy, and each whole run's wall time (time to accuracy). The two
   drift apart slowly: float32 sums in another order give other rounding, and
   training amplifies it; the accuracies should agree to a few tenths of a point.
2. Time per training step, at each of ``--time-batch-sizes``, of every
   configuration: ours (naive kernels launched from Python, fast kernels
   launched from Python, fast kernels in one CUDA graph) and PyTorch's
   (:mod:`final_project.torch_configs`: eager, ``torch.compile``,
   ``mode="reduce-overhead"``, the whole step in ``torch.cuda.graph``). A step
   is batch copy host -> device (pinned) + forward + backward + SGD update.
   After ``--time-warmup`` untimed steps (20), each of ``--time-windows``
   windows (5) of ``--time-steps`` consecutive steps (50) is timed between two
   CUDA events; the median window divided by its steps is reported (the naive
   kernels: 3 windows of ``--naive-steps``). On a GPU each torch configuration
   runs twice, with cuDNN picking its convolution algorithms by its heuristics
   (``cudnn.benchmark`` off, torch's default) and by timing them
   (``+benchmark``), and the whole table twice (``--torch-precision``): torch in
   full FP32 (TF32 off, as our kernels), then with TF32 tensor cores on
   (cuDNN's default for convolutions); our kernels are FP32 in both. With
   ``--precision tf32`` (ours with conv2 in TF32; torch then in TF32 unless
   ``--torch-precision`` says otherwise) each torch configuration also runs in
   mixed precision, its forward and loss under BF16 autocast (``torch eager
   bf16-autocast``, ``torch eager bf16-autocast +benchmark``, ...), and "best
   torch" is the fastest torch row, TF32 or BF16.
3. On a GPU, the fast step stage by stage (:func:`stage_breakdown`): GPU time,
   GFLOP/s or GB/s, and the fraction of the device's measured peaks.

Written to ``--out``: ``compare.json`` (both histories, loss curves, the
timing table, the per-stage tables, the GPU's name) and ``compare.png`` (loss curves; ms per step
against batch size). In the simulator it runs the tiny configuration of
``final_project.train`` and says its timings say nothing about a GPU.
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
from common.harness import positive_ints
from common.runtime import device_name, torch_cuda_available
from common.timing import hold_stream

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba import cuda

from final_project import conv1_gram, datasets
from final_project import data as fdata
from final_project import train as ftrain
from final_project.fast_model import STAGES, FastCNN, Stage, default_conv1, uses_patch_gram
from final_project.model import NumbaCNN, init_params, param_shapes
from final_project.torch_configs import available_configs, make_torch_step
from final_project.torch_twin import TorchCNN, torch_train_step

DEFAULT_OUT = Path("runs") / "final_project"


def torch_device() -> torch.device:
    return torch.device("cuda" if torch_cuda_available() else "cpu")


def torch_evaluate(
    twin: TorchCNN, x: np.ndarray, y: np.ndarray, batch_size: int, device: torch.device
) -> float:
    """Test accuracy in percent, batchnorm in evaluation mode."""
    twin.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, len(y), batch_size):
            xb = torch.from_numpy(x[lo : lo + batch_size]).to(device)
            pred = twin(xb).argmax(1).cpu().numpy()
            correct += int((pred == y[lo : lo + batch_size]).sum())
    twin.train()
    return 100.0 * correct / len(y)


def train_torch(
    twin: TorchCNN,
    batches: fdata.EpochBatches,
    x_test: np.ndarray,
    y_test: np.ndarray,
    epochs: int,
    lr: float,
    seed: int,
    device: torch.device,
    max_steps: int | None = None,
    rows: slice = slice(None),
) -> list[dict[str, Any]]:
    """The twin's training loop, batch for batch the same as :func:`final_project.train.train`.

    Same seed, same ``EpochBatches``: the same permutation each epoch, hence the
    same batches in the same order. ``twin`` may be wrapped (PyTorch's
    ``DistributedDataParallel``: its ``.module`` is evaluated) and train on ``rows``
    of each batch only (a rank's shard). Returns one dict per epoch (epoch, steps,
    train_loss, test_accuracy, losses).
    """
    rng = np.random.default_rng(seed)
    opt = torch.optim.SGD(twin.parameters(), lr=lr)
    history, step = [], 0
    for epoch in range(1, epochs + 1):
        batches.prepare(rng)
        n_steps = ftrain.steps_this_epoch(batches, max_steps, step)
        if n_steps <= 0:
            break
        losses = []
        for i in range(n_steps):
            x, y = batches.host(i)
            xb = torch.from_numpy(x[rows]).to(device, non_blocking=True)
            yb = torch.from_numpy(y[rows]).to(device, non_blocking=True)
            losses.append(torch_train_step(twin, opt, xb, yb))
            step += 1
        epoch_losses = torch.stack(losses).float().cpu().numpy()
        evaluated = getattr(twin, "module", twin)
        acc = torch_evaluate(evaluated, x_test, y_test, batches.batch_size, device)
        history.append(
            {
                "epoch": epoch,
                "steps": n_steps,
                "train_loss": float(epoch_losses.mean()),
                "test_accuracy": acc,
                "losses": epoch_losses.tolist(),
            }
        )
    return history


def loss_curve(history: list[dict[str, Any]], every: int) -> list[tuple[int, float]]:
    """(step, mean loss of the ``every`` steps ending there) over the whole run."""
    losses = np.concatenate([np.asarray(h["losses"], np.float64) for h in history] or [[]])
    return [
        (int(hi), float(losses[hi - every : hi].mean()))
        for hi in range(every, len(losses) + 1, every)
    ]


# --------------------------------------------------------------------------
# Per-step timing
# --------------------------------------------------------------------------


OURS = ("numba naive eager", "numba fast eager", "numba fast graph")
# The timing protocol's defaults (the command line's, and the notebook's).
TIME_STEPS = 50  # steps per timed window
TIME_WINDOWS = 5  # timed windows; the median is kept
TIME_WARMUP = 20  # untimed steps first
NAIVE_STEPS = 3  # steps per window of the naive kernels (hundreds of ms a step)


# A torch configuration run with torch.backends.cudnn.benchmark on ends with this.
BENCHMARK = " +benchmark"
# A torch configuration whose forward and loss run under
# torch.autocast(dtype=torch.bfloat16) has this after its name, before any BENCHMARK:
# "torch eager bf16-autocast +benchmark".
AUTOCAST = " bf16-autocast"
# torch's precision in a timing table: "fp32" turns TF32 off for cuDNN and cuBLAS (our
# kernels are FP32 throughout); "tf32" turns it on for both (PyTorch's default is on
# for cuDNN convolutions, off for matmuls).
TORCH_PRECISIONS = ("fp32", "tf32")


def all_configs(device: torch.device, bf16_autocast: bool = False) -> list[str]:
    """Every configuration that runs here: OURS, then torch's on ``device``, each
    torch one also under BF16 autocast (``AUTOCAST``) if ``bf16_autocast``, and
    each of those also with ``cudnn.benchmark`` on where cuDNN runs (CUDA)."""
    names = ["torch " + c for c in available_configs(device)]
    if bf16_autocast:
        names = [n + a for n in names for a in ("", AUTOCAST)]
    if torch.device(device).type == "cuda":
        names = [n + b for n in names for b in ("", BENCHMARK)]
    return list(OURS) + names


def runnable_configs(device: torch.device, *, tiny: bool, precision: str) -> list[str]:
    """The configurations ``main`` may time, and times unless ``--configs`` picks.

    ``tiny`` (the simulator's run): "numba naive eager" and "torch eager" only,
    one a side (simulated fast kernels take minutes a step). Else
    :func:`all_configs`, with the BF16-autocast torch rows when our
    ``precision`` is "tf32": once ours leave FP32, torch races in its own
    reduced precisions too.
    """
    if tiny:
        return ["numba naive eager", "torch eager"]
    return all_configs(device, bf16_autocast=precision == "tf32")


def torch_step_args(name: str) -> tuple[str, bool, torch.dtype | None]:
    """("eager", True, torch.bfloat16) for "torch eager bf16-autocast +benchmark":
    the torch_configs name, whether cudnn.benchmark is on, and the dtype of the
    forward's autocast (None: no autocast); ``make_torch_step``'s arguments."""
    bench = name.endswith(BENCHMARK)
    name = name.removesuffix(BENCHMARK)
    amp = torch.bfloat16 if name.endswith(AUTOCAST) else None
    return name.removeprefix("torch ").removesuffix(AUTOCAST), bench, amp


def set_torch_precision(precision: str) -> None:
    """TF32 off ("fp32") or on ("tf32") for torch's cuDNN convolutions and cuBLAS
    matmuls, for everything torch runs after.

    Raises:
        ValueError: another precision.
    """
    if precision not in TORCH_PRECISIONS:
        raise ValueError(f"torch precision must be one of {TORCH_PRECISIONS}, got {precision!r}")
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """Add "best_torch" (the fastest torch configuration, in any precision: its
    BF16-autocast rows too) and "fast_graph_over_best_torch" to a timing row,
    where both sides were timed."""
    row.pop("best_torch", None)
    row.pop("fast_graph_over_best_torch", None)
    torch_ms = {k: v for k, v in row["ms"].items() if k.startswith("torch") and v}
    ours = row["ms"].get("numba fast graph")
    if torch_ms and ours:
        best = min(torch_ms, key=torch_ms.get)
        row["best_torch"] = best
        row["fast_graph_over_best_torch"] = ours / torch_ms[best]
    return row


def with_our_rows(
    rows: list[dict[str, Any]], ours_from: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``rows`` (torch only, in another precision) with our configurations' times
    taken from ``ours_from`` at the same batch sizes (ours do not change with
    torch's precision), summarised again."""
    ours = {r["batch_size"]: {k: v for k, v in r["ms"].items() if k in OURS} for r in ours_from}
    for r in rows:
        r["ms"] = {**ours.get(r["batch_size"], {}), **r["ms"]}
        summarise(r)
    return rows


def _our_stepper(
    name: str, config, init, batches: fdata.EpochBatches, lr: float, precision: str = "fp32"
):
    """(model, step(j)) for one of OURS: step(j) copies pinned batch j and trains on
    it. ``precision`` is the fast model's (the naive kernels are FP32 only)."""
    if name == "numba naive eager":
        model = NumbaCNN(config, max_batch=batches.batch_size, params=init)
        stream = cuda.stream()

        def step(j: int) -> None:
            x_dev, y_dev = batches.to_device(j, stream=stream)
            model.train_step(x_dev, y_dev, lr)

        return model, step
    # The simulator has no graphs: there "fast graph" runs the same launches eagerly.
    graph = name == "numba fast graph" and not common.is_simulator()
    model = FastCNN(
        config, max_batch=batches.batch_size, params=init, graph=graph, precision=precision
    )

    def fast_step(j: int) -> None:
        x, y = batches.host(j)
        model.train_step(x, y, lr)  # H2D into the static buffers, then the step

    return model, fast_step


def time_steps(
    config,
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    *,
    lr: float,
    seed: int,
    device: torch.device,
    configs: list[str],
    steps: int = TIME_STEPS,
    windows: int = TIME_WINDOWS,
    warmup: int = TIME_WARMUP,
    naive_steps: int = NAIVE_STEPS,
    n_batches: int = 8,
    precision: str = "fp32",
) -> dict[str, Any]:
    """ms per training step of every configuration in ``configs`` at one batch size.

    ``n_batches`` distinct batches wait in pinned host memory and are cycled:
    every configuration copies one to the device (into static buffers) and
    trains on it, so each step is copy + forward + backward + update. After
    ``warmup`` untimed steps (compilation, graph capture, cuDNN's choice of
    algorithm, the caching allocator's growth), ``windows`` windows of
    ``steps`` consecutive steps are timed with CUDA events and the median
    window / steps is kept. The naive kernels (hundreds of ms a step at large
    batches) get windows of ``naive_steps`` steps and 2 warm-up steps.
    ``precision``: our fast model's ("fp32" or "tf32").

    Returns:
        {"batch_size", "ms": {config: ms per step or None}, "window_ms": {...},
         "best_torch", "fast_graph_over_best_torch"}; the ms are None in the simulator.
    """
    n_batches = max(1, min(n_batches, len(labels) // batch_size))
    batches = fdata.EpochBatches(
        images[: n_batches * batch_size], labels[: n_batches * batch_size], batch_size
    )
    init = init_params(config, seed)
    xs = [torch.from_numpy(batches.host(i)[0]) for i in range(n_batches)]
    ys = [torch.from_numpy(batches.host(i)[1]) for i in range(n_batches)]
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "steps_per_window": steps,
        "windows": windows,
        "warmup_steps": warmup,
        "ms": {},
        "window_ms": {},
    }
    for name in configs:
        counter = iter(range(1 << 62))
        if name in OURS:
            _, step = _our_stepper(name, config, init, batches, lr, precision)

            def run(k: int, step=step, counter=counter) -> None:
                for _ in range(k):
                    step(next(counter) % n_batches)

            on_gpu = True
        else:
            x = torch.empty((batch_size, *images.shape[1:]), dtype=torch.float32, device=device)
            y = torch.empty(batch_size, dtype=torch.int64, device=device)
            x.copy_(xs[0])
            y.copy_(ys[0])
            mode, bench, amp = torch_step_args(name)
            ts = make_torch_step(
                mode, config, init, x, y, lr, device, cudnn_benchmark=bench, autocast=amp
            )

            def run(k: int, ts=ts, x=x, y=y, counter=counter) -> None:
                for _ in range(k):
                    j = next(counter) % n_batches
                    x.copy_(xs[j], non_blocking=True)
                    y.copy_(ys[j], non_blocking=True)
                    ts.run()

            on_gpu = device.type == "cuda"
        naive = name == "numba naive eager"
        k_steps = min(steps, naive_steps) if naive else steps
        window_ms = _time_windows(
            run,
            k_steps,
            windows if not naive else min(windows, 3),
            min(warmup, 2) if naive else warmup,
            on_gpu,
        )
        result["window_ms"][name] = window_ms
        result["ms"][name] = float(np.median(window_ms)) / k_steps if window_ms else None
    return summarise(result)


def time_batch_sizes(
    config,
    images: np.ndarray,
    labels: np.ndarray,
    batch_sizes: list[int],
    *,
    lr: float,
    seed: int,
    device: torch.device,
    configs: list[str] | None = None,
    steps: int = TIME_STEPS,
    windows: int = TIME_WINDOWS,
    warmup: int = TIME_WARMUP,
    naive_steps: int = NAIVE_STEPS,
    log: Callable[[str], None] = print,
    precision: str = "fp32",
) -> list[dict[str, Any]]:
    """The timing table: :func:`time_steps` at each of ``batch_sizes``, one row each
    (print it with :func:`format_timing_table`).

    ``configs`` defaults to :func:`all_configs`; a batch size larger than the
    images is skipped, with a line to ``log``.
    """
    configs = all_configs(device) if configs is None else configs
    rows = []
    for b in batch_sizes:
        if len(labels) < b:
            log(f"timing: skipping batch {b}: only {len(labels)} training images")
            continue
        rows.append(
            time_steps(
                config,
                images,
                labels,
                b,
                lr=lr,
                seed=seed,
                device=device,
                configs=configs,
                steps=steps,
                windows=windows,
                warmup=warmup,
                naive_steps=naive_steps,
                precision=precision,
            )
        )
    return rows


def stage_work(config, n: int) -> dict[str, tuple[int, int]]:
    """(flops, fewest bytes moved) of each stage of the fast step at batch n, by
    the names of :data:`final_project.fast_model.STAGES`, in that order.

    Bytes count each input read once and each output written once (float32:
    4 bytes, argmax: 1 byte); flops count a multiply-add as 2.

    Raises:
        RuntimeError: the stages here and STAGES differ (a stage added to the
            model without its work here, or one left here after it went).
    """
    c = config
    hw1, hw2, hw4 = (
        c.height * c.width,
        (c.height // 2) * (c.width // 2),
        (c.height // 4) * (c.width // 4),
    )
    x1, p1 = n * c.in_channels * hw1, n * c.c1 * hw2
    z2, p2 = n * c.c2 * hw2, n * c.c2 * hw4
    feat, hid, cls = c.flat_features, c.hidden, c.num_classes
    conv1 = 2 * n * hw1 * c.c1 * c.in_channels * 9
    conv2 = 2 * n * hw2 * c.c2 * c.c1 * 9
    # conv1 never in memory (FastCNN's default): one input channel takes the
    # patch Gram path (conv1_gram: the forward's sums and the weight gradient
    # from G, the backward reduce over the winners with the images), 2 or 3
    # compute conv1 again in the sums and backward kernels (first_conv)
    gram = uses_patch_gram(c, default_conv1(c))
    gram_flops = 2 * n * hw1 * conv1_gram.ENTRIES
    work = {
        Stage.CONV1_FORWARD: (gram_flops if gram else conv1, 4 * x1),
        Stage.BN1_STATISTICS: (0, 0),
        Stage.BN1_RELU_POOL1: (conv1, 4 * x1 + 4 * p1 + p1 + 4 * p1),
        Stage.CONV2_FORWARD: (conv2, 4 * (p1 + z2)),
        Stage.BN2_STATISTICS: (0, 0),
        Stage.BN2_RELU_POOL2: (0, 4 * z2 + 4 * p2 + p2 + 4 * p2),
        Stage.FC1_FORWARD: (2 * n * feat * hid, 4 * (n * feat + hid * feat + n * hid)),
        Stage.FC2_LOSS_GRADS: (4 * n * hid * cls, 4 * (2 * n * hid + 3 * n * cls)),
        Stage.LOSS_MEAN: (0, 4 * n),
        Stage.FC2_GRAD_WEIGHT: (2 * n * cls * (hid + 1), 4 * (n * cls + n * hid + cls * hid)),
        Stage.FC1_GRAD_WEIGHT: (2 * n * hid * (feat + 1), 4 * (n * hid + n * feat + hid * feat)),
        Stage.FC1_GRAD_INPUT: (2 * n * hid * feat, 4 * (n * hid + hid * feat + n * feat)),
        Stage.BN2_BACKWARD_REDUCE: (0, 4 * p2 + 4 * p2),
        Stage.BN2_BACKWARD_DX: (0, 4 * z2 + 4 * p2 + p2 + 4 * z2),
        Stage.CONV2_GRAD_WEIGHT: (conv2, 4 * (z2 + p1)),
        Stage.CONV2_GRAD_INPUT: (conv2, 4 * (z2 + p1)),
        Stage.BN1_BACKWARD_REDUCE: (0, 4 * x1 + 4 * p1 + p1 + 4 * p1)
        if gram
        else (0, 4 * p1 + 4 * p1),
        Stage.CONV1_GRAD_WEIGHT: (0, 0) if gram else (2 * conv1, 4 * x1 + 4 * p1 + p1 + 4 * p1),
        Stage.SGD_UPDATE: (0, 12 * sum(int(np.prod(s)) for s in param_shapes(c).values())),
    }
    if set(work) != set(STAGES):
        raise RuntimeError(
            f"stage_work and fast_model.STAGES disagree: {sorted(set(work) ^ set(STAGES))}"
        )
    return {name: work[name] for name in STAGES}


def stage_breakdown(
    config,
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    lr: float,
    seed: int,
    repeats: int,
    peaks: dict[str, Any],
    precision: str = "fp32",
) -> list[dict]:
    """Per-stage GPU time of the fast step (an event after each stage).

    A one-thread kernel first holds the model's stream for 40 ms while the host
    queues the step's launches behind it, with one CUDA event recorded after
    each stage of :data:`final_project.fast_model.STAGES` (``train_step``'s
    ``on_stage``); a stage's time is the gap to the previous event (GPU time
    only: no launch gaps), median of ``repeats`` steps after 3 warm-up steps.
    The batch waits in the model's static buffers, so no copy is timed. The
    stages add up to a little more than the graph step, whose launches need no
    event between them.
    Returns rows {stage, ms, gflops, gbps, pct_sgemm, pct_copy}; [] in the simulator.
    """
    if common.is_simulator():
        return []
    model = FastCNN(
        config,
        max_batch=batch_size,
        params=init_params(config, seed),
        graph=False,
        precision=precision,
    )
    x, y = model.static_batch(batch_size)
    x.copy_to_device(np.ascontiguousarray(images[:batch_size]), stream=model.stream)
    y.copy_to_device(np.ascontiguousarray(labels[:batch_size]), stream=model.stream)
    samples: dict[str, list[float]] = {k: [] for k in STAGES}
    for rep in range(repeats + 3):
        events = []

        def record(name: str, events=events) -> None:
            ev = cuda.event()
            ev.record(model.stream)
            events.append((name, ev))

        # Keep the stream busy while the host queues the whole step behind it, so
        # the events between stages time the GPU's work, not Python's launch cost.
        hold_stream(40, model.stream)
        first = cuda.event()
        first.record(model.stream)
        model.train_step(x, y, lr, on_stage=record)
        events[-1][1].synchronize()
        if rep < 3:
            continue
        prev = first
        for name, ev in events:
            samples[name].append(prev.elapsed_time(ev))
            prev = ev
    work = stage_work(config, batch_size)
    rows = []
    for name in STAGES:
        ms = float(np.median(samples[name]))
        flops, nbytes = work[name]
        gflops = flops / (ms * 1e-3) / 1e9 if flops else None
        gbps = nbytes / (ms * 1e-3) / 1e9 if nbytes else None
        rows.append(
            {
                "stage": name,
                "ms": ms,
                "gflops": gflops,
                "gbps": gbps,
                "pct_sgemm": gflops and 100 * gflops / 1e3 / peaks["sgemm_tflops"],
                "pct_copy": gbps and 100 * gbps / peaks["copy_gbps"],
            }
        )
    return rows


def _time_windows(run_steps, steps: int, windows: int, warmup: int, on_gpu: bool) -> list[float]:
    """ms of each of ``windows`` windows of ``steps`` steps, after ``warmup`` steps.

    On the GPU, CUDA events on the legacy default stream (where our kernels and
    torch's default stream both run) bracket each window, after a device-wide
    synchronise so the window starts empty. Torch on a CPU-only machine is
    timed with the host clock. In the simulator the warm-up steps run (so the
    path is exercised) and nothing is timed.
    """
    run_steps(warmup)
    if common.is_simulator():
        return []
    times = []
    for _ in range(windows):
        cuda.synchronize()
        if on_gpu:
            start, end = cuda.event(), cuda.event()
            start.record()
            run_steps(steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run_steps(steps)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


PRECISION_LABELS = {
    None: "",
    "fp32": "; torch in FP32 (TF32 off)",
    "tf32": "; torch with TF32 on (cuDNN convolutions and cuBLAS matmuls)",
}
OUR_PRECISION_LABELS = {"fp32": ", ours FP32", "tf32": ", ours with conv2 in TF32"}


def format_timing_table(
    rows: list[dict[str, Any]],
    device: str,
    torch_dev: str,
    precision: str | None = None,
    ours: str = "fp32",
) -> str:
    """ms per training step: one row per configuration, one column per batch size;
    ``precision`` ("fp32", "tf32") labels torch's arithmetic in the title, and
    ``ours`` our fast model's (said only with ``precision``)."""
    mine = OUR_PRECISION_LABELS[ours] if precision else ""
    lines = [
        f"ms per training step (copy + forward + backward + update), {device}; torch on "
        f"{torch_dev}{PRECISION_LABELS[precision]}{mine}"
    ]
    if not rows:
        return "\n".join(lines)
    if all(v is None for r in rows for v in r["ms"].values()):
        lines.append(f"  ({common.timing.SIMULATOR_NOTE})")
    sizes = [r["batch_size"] for r in rows]
    names = list(rows[0]["ms"])
    if any(AUTOCAST in n for n in names):
        lines.append(
            f"  ({AUTOCAST.strip()}: torch's forward and loss under "
            "torch.autocast(dtype=torch.bfloat16); best torch is the fastest torch row)"
        )
    # wide enough for the longest best-torch name ("compile-reduce-overhead") and a gap
    width = 2 + max(13, *(len(r.get("best_torch", "").removeprefix("torch ")) for r in rows))
    label = max([34] + [len(name) + 1 for name in names])  # the longest configuration name
    lines.append(
        f"  {'configuration':<{label}}" + "".join(f"{'batch ' + str(b):>{width}}" for b in sizes)
    )
    for name in names:
        cells = [r["ms"].get(name) for r in rows]
        lines.append(
            f"  {name:<{label}}"
            + "".join(f"{'-' if v is None else format(v, '.3f'):>{width}}" for v in cells)
        )
    ratios = [r.get("fast_graph_over_best_torch") for r in rows]
    if any(ratios):
        lines.append(
            f"  {'fast graph / best torch':<{label}}"
            + "".join(f"{'-' if v is None else format(v, '.2f') + 'x':>{width}}" for v in ratios)
        )
        lines.append(
            f"  {'(best torch configuration)':<{label}}"
            + "".join(f"{r.get('best_torch', '-').removeprefix('torch '):>{width}}" for r in rows)
        )
    return "\n".join(lines)


def format_breakdown(rows: list[dict[str, Any]], batch_size: int, device: str) -> str:
    """The per-stage table of :func:`stage_breakdown`."""
    total = sum(r["ms"] for r in rows)
    lines = [
        f"fast step by stage, batch {batch_size}, {device} (GPU time between CUDA events; "
        f"sum {total:.3f} ms)",
        f"  {'stage':<22} {'ms':>8} {'%step':>6} {'GFLOP/s':>9} {'%SGEMM':>7} "
        f"{'GB/s':>8} {'%copy':>6}",
    ]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"  {r['stage']:<22} {r['ms']:>8.4f} {100 * r['ms'] / total:>6.1f} "
            f"{f(r['gflops'], '.0f'):>9} {f(r['pct_sgemm'], '.1f'):>7} "
            f"{f(r['gbps'], '.0f'):>8} {f(r['pct_copy'], '.1f'):>6}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    for name, style in (("numba", "-"), ("torch", "--")):
        curve = result["accuracy_run"]["curves"].get(name) or []
        if curve:
            steps, losses = zip(*curve)
            ax1.plot(steps, losses, style, label=name)
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"train loss (mean of {result['accuracy_run']['loss_every']} steps)")
    ax1.set_title("same weights, same batches")
    if ax1.lines:
        ax1.legend()
    rows = [r for r in result["timing"] if any(r["ms"].values())]
    if rows:
        bs = [r["batch_size"] for r in rows]
        for name in rows[0]["ms"]:
            ms = [r["ms"].get(name) for r in rows]
            if all(ms):
                ax2.plot(bs, ms, "o-" if name.startswith("numba") else "s--", label=name)
        # with TF32 on, only torch's fastest configuration at each batch size
        tf32 = [
            r for r in result.get("timing_by_precision", {}).get("tf32", []) if "best_torch" in r
        ]
        if tf32 and len(tf32) == len(rows):
            best = [r["ms"][r["best_torch"]] for r in tf32]
            bf16 = any(AUTOCAST in r["best_torch"] for r in tf32)
            label = "best torch, TF32 on" + (" or BF16 autocast" if bf16 else "")
            ax2.plot(bs, best, "k:", marker="^", label=label)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    else:
        ax2.text(0.5, 0.5, "no timings (simulator)", ha="center", va="center")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("ms per training step")
    ax2.set_title(result["device"])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m final_project.compare", description=__doc__.splitlines()[0]
    )
    ftrain.add_common_args(p)
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for compare.json and compare.png (default {DEFAULT_OUT}/)",
    )
    p.add_argument(
        "--timing-only",
        action="store_true",
        help="skip the accuracy run (part 1): only time the steps",
    )
    p.add_argument(
        "--loss-every",
        type=int,
        default=None,
        metavar="K",
        help="loss curve: mean of every K steps (default 50; tiny: 2)",
    )
    p.add_argument(
        "--time-batch-sizes",
        type=positive_ints,
        default=None,
        metavar="B1,B2",
        help="batch sizes for the timing table (default 64,256,1024; tiny: 8)",
    )
    p.add_argument(
        "--time-steps",
        type=int,
        default=None,
        help=f"steps per timed window (default {TIME_STEPS}; tiny: 1)",
    )
    p.add_argument(
        "--time-windows",
        type=int,
        default=None,
        help=f"timed windows, median kept (default {TIME_WINDOWS}; tiny: 1)",
    )
    p.add_argument(
        "--time-warmup",
        type=int,
        default=None,
        help=f"untimed steps before the windows (default {TIME_WARMUP}; tiny: 1)",
    )
    p.add_argument(
        "--naive-steps",
        type=int,
        default=NAIVE_STEPS,
        help=f"steps per window for the naive kernels (slow: default {NAIVE_STEPS})",
    )
    p.add_argument(
        "--configs",
        default=None,
        metavar="A,B",
        help="configurations to time (default: all that run here): "
        + ", ".join(OURS)
        + ", torch eager, torch compile, "
        "torch compile-reduce-overhead, torch cuda-graph; with --precision tf32 each "
        f"torch one also with '{AUTOCAST.strip()}' after it (forward and loss under "
        "torch.autocast(dtype=torch.bfloat16)); and on a GPU each torch one also with "
        f"'{BENCHMARK.strip()}' last (cudnn.benchmark on), e.g. "
        f"'torch eager{AUTOCAST}{BENCHMARK}'",
    )
    p.add_argument(
        "--breakdown-repeats",
        type=int,
        default=20,
        help="steps behind each stage's median in the per-stage table",
    )
    p.add_argument(
        "--torch-precision",
        choices=("fp32", "tf32", "both"),
        default=None,
        help="torch's arithmetic in the timing tables: fp32 (TF32 off), "
        "tf32 (TF32 tensor cores on for cuDNN and cuBLAS; PyTorch's default is on for "
        "convolutions) or both, a table each (default: tf32 with --precision tf32, "
        "else both on a GPU, fp32 elsewhere). Ours follow --precision; with "
        "--precision tf32 each table also races torch under BF16 autocast",
    )
    p.add_argument(
        "--torch-tf32",
        action="store_true",
        help="the same as --torch-precision tf32 (also for the accuracy run)",
    )
    args = p.parse_args(argv)
    ftrain.resolve_args(args, p)
    if args.torch_tf32 and args.torch_precision not in (None, "tf32"):
        p.error(f"--torch-tf32 and --torch-precision {args.torch_precision} disagree")
    if args.torch_tf32:
        args.torch_precision = "tf32"
    if os.environ.get("WORLD_SIZE"):  # started by torchrun: ours data-parallel against torch DDP
        from final_project import distributed

        return distributed.compare_main(args, p)
    tiny = args.tiny
    loss_every = args.loss_every or (2 if tiny else 50)
    time_sizes = args.time_batch_sizes or ([8] if tiny else [64, 256, 1024])
    time_steps_n = args.time_steps if args.time_steps is not None else (1 if tiny else TIME_STEPS)
    warmup = args.time_warmup if args.time_warmup is not None else (1 if tiny else TIME_WARMUP)
    windows = args.time_windows if args.time_windows is not None else (1 if tiny else TIME_WINDOWS)
    if min(time_steps_n, windows, args.naive_steps) < 1 or warmup < 0:
        p.error("--time-steps, --time-windows and --naive-steps must be >= 1, --time-warmup >= 0")
    device = torch_device()
    runnable = runnable_configs(device, tiny=tiny, precision=args.precision)
    if args.configs:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in configs if c not in runnable]
        if unknown:
            why = ""
            if args.precision != "tf32" and any(AUTOCAST in c for c in unknown):
                why = f" ('{AUTOCAST.strip()}' rows come with --precision tf32)"
            p.error(f"--configs: {unknown} cannot run here{why}; choose from {runnable}")
    else:
        configs = runnable
    if args.torch_precision is None and args.precision == "tf32":
        args.torch_precision = "tf32"  # the race the TF32 kernels are for
    if args.torch_precision is None:
        args.torch_precision = "both" if device.type == "cuda" else "fp32"
    precisions = (
        list(TORCH_PRECISIONS) if args.torch_precision == "both" else [args.torch_precision]
    )
    # torch's default lets cuDNN convolutions use TF32 (10-bit mantissa); our
    # kernels are FP32, so the accuracy run and the first table turn TF32 off on
    # both paths (unless only tf32 is asked for).
    set_torch_precision(precisions[0])
    gpu = device_name()
    if common.is_simulator():
        print(
            f"simulator (no GPU): {ftrain.TINY.describe() if tiny else 'the full network'}; "
            f"torch on {device}; the timings say nothing about a GPU"
        )
    else:
        print(f"GPU: {gpu}; torch on {device}")
    try:
        ds = ftrain.load_data(args)
    except (datasets.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"data: {ds.source}: {len(ds.train_labels)} train / {len(ds.test_labels)} test")
    x_train, y_train = ftrain.images_for(ds, "train", args.image_size)
    x_test, y_test = ftrain.images_for(ds, "test", args.image_size)
    config = ftrain.net_config(args)
    init = init_params(config, args.seed)

    # 1. accuracy: same weights, same batches; wall time of each whole run
    numba_hist, torch_hist = [], []
    seconds: dict[str, float] = {}
    if not args.timing_only:
        try:
            batches = fdata.EpochBatches(x_train, y_train, args.batch_size)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        test_batches = fdata.EpochBatches(x_test, y_test, args.batch_size, drop_last=False)
        print(
            f"accuracy run: {args.epochs} epochs x {len(batches)} steps, batch "
            f"{args.batch_size}, SGD lr {args.lr}, seed {args.seed}"
        )
        print(f"numba (ours, {ftrain.describe_kernels(args)}):")
        t0 = time.perf_counter()
        job = ftrain.start_precompile(args, config, (batches, test_batches))
        model = ftrain.make_model(args, config, init)
        if job is not None:
            print("  " + job.wait())
        numba_hist = ftrain.train(
            model,
            batches,
            test_batches,
            args.epochs,
            args.lr,
            args.seed,
            max_steps=args.max_steps,
            progress=sys.stderr.isatty(),
            log=lambda s: print("  " + s),
        )
        seconds["numba"] = time.perf_counter() - t0
        print("torch (eager):")
        t0 = time.perf_counter()
        twin = TorchCNN.from_state_dict(config, init, device)
        torch_hist = train_torch(
            twin,
            batches,
            x_test,
            y_test,
            args.epochs,
            args.lr,
            args.seed,
            device,
            max_steps=args.max_steps,
        )
        seconds["torch"] = time.perf_counter() - t0
        for h in torch_hist:
            print(
                f"  epoch {h['epoch']}: train loss {h['train_loss']:.4f}, "
                f"test accuracy {h['test_accuracy']:.2f}%"
            )
        print(f"  {'step':>6} {'numba loss':>11} {'torch loss':>11}")
        curves = {
            "numba": loss_curve(numba_hist, loss_every),
            "torch": loss_curve(torch_hist, loss_every),
        }
        for (s, a), (_, b) in zip(curves["numba"], curves["torch"]):
            print(f"  {s:>6} {a:>11.4f} {b:>11.4f}")
        na, ta = numba_hist[-1]["test_accuracy"], torch_hist[-1]["test_accuracy"]
        print(f"test accuracy: numba {na:.2f}%, torch {ta:.2f}% (difference {na - ta:+.2f} points)")
        print(
            f"time to accuracy ({args.epochs} epochs, shuffling, copies, evaluation and "
            f"compilation included): numba {seconds['numba']:.1f} s, torch eager "
            f"{seconds['torch']:.1f} s"
        )
    else:
        curves = {"numba": [], "torch": []}

    # 2. time per step: a table for each torch precision; ours are timed in the
    # first and shown in each
    timings: dict[str, list[dict[str, Any]]] = {}
    for precision in precisions:
        first = precision == precisions[0]
        set_torch_precision(precision)
        rows = time_batch_sizes(
            config,
            x_train,
            y_train,
            time_sizes,
            lr=args.lr,
            seed=args.seed,
            device=device,
            configs=configs if first else [c for c in configs if c not in OURS],
            steps=time_steps_n,
            windows=windows,
            warmup=warmup,
            naive_steps=args.naive_steps,
            precision=args.precision,
        )
        timings[precision] = rows if first else with_our_rows(rows, timings[precisions[0]])
        print(format_timing_table(timings[precision], gpu, str(device), precision, args.precision))
    set_torch_precision(precisions[0])
    timing = timings[precisions[0]]
    breakdown = {}
    if not common.is_simulator():
        peaks = common.device_peaks()
        for b in [r["batch_size"] for r in timing]:
            breakdown[b] = stage_breakdown(
                config,
                x_train,
                y_train,
                b,
                args.lr,
                args.seed,
                args.breakdown_repeats,
                peaks,
                precision=args.precision,
            )
            print(format_breakdown(breakdown[b], b, gpu))

    result = {
        "device": gpu,
        "runtime": common.runtime_name(),
        "torch_device": str(device),
        "torch_version": torch.__version__,
        "torch_tf32": precisions[0] == "tf32",
        "precision": args.precision,
        "torch_precisions": precisions,
        "timing_by_precision": timings,
        "config": dataclasses.asdict(config),
        "dataset": ds.name,
        "source": ds.source,
        "is_sample": ds.is_sample,
        "accuracy_run": {
            "epochs": 0 if args.timing_only else args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "loss_every": loss_every,
            "curves": curves,
            "numba": numba_hist,
            "torch": torch_hist,
            "seconds": seconds,
            "kernels": ftrain.describe_kernels(args),
        },
        "timing": timing,
        "breakdown": breakdown,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "compare.png")
    print(f"wrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
