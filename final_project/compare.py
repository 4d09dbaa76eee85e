"""Our kernels against PyTorch, same network, same start, same batches.

    python -m final_project.compare --dataset fashion-mnist --data-dir DIR --epochs 3
    python -m final_project.compare --epochs 0 --time-batch-sizes 64,256,1024   # timing only

Two parts, one run:

1. Accuracy. ``NumbaCNN`` and its PyTorch twin (``TorchCNN``, on CUDA when
   torch has it, else the CPU) start from the same weights (``init_params``)
   and train with plain SGD on the same batches in the same order (one
   shuffled host buffer per epoch, seeded). Printed side by side: the mean
   loss every ``--loss-every`` steps, each epoch's train loss and test accuracy.
   The two drift apart slowly: float32 sums in another order give other
   rounding, and training amplifies it; the accuracies should agree to a few
   tenths of a point.
2. Time per training step, at each of ``--time-batch-sizes``: batch copy
   host -> device (pinned) + forward + backward + SGD update (+ zero-grad for
   torch; our kernels overwrite the gradients instead), for each
   implementation. After ``--time-warmup`` untimed steps (10), each of
   ``--time-windows`` windows (2) of ``--time-steps`` consecutive steps (100)
   is timed between two CUDA events; the median window divided by its steps
   is reported. Torch runs in full FP32 (TF32 off, as our kernels) unless
   ``--torch-tf32``; cuDNN picks its algorithms by its heuristics
   (``cudnn.benchmark`` off, torch's default).

Written to ``--out``: ``compare.json`` (both histories, loss curves, the
timing table, the GPU's name) and ``compare.png`` (loss curves; ms per step
against batch size). In the simulator it runs the tiny configuration of
``final_project.train`` and says the timings are meaningless.
"""

from __future__ import annotations

# isort: off
import common  # (first: picks GPU or simulator before numba is imported)
# isort: on
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba import cuda

from final_project import data as fdata
from final_project import train as ftrain
from final_project.model import NumbaCNN, init_params
from final_project.torch_twin import TorchCNN, torch_train_step

DEFAULT_OUT = Path("runs") / "final_project"


def torch_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not common.is_simulator()
                        else "cpu")


def _pinned(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if device.type == "cuda" else t


def torch_evaluate(twin: TorchCNN, x: np.ndarray, y: np.ndarray, batch_size: int,
                   device: torch.device) -> float:
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
) -> list[dict[str, Any]]:
    """The twin's training loop, batch for batch the same as :func:`final_project.train.train`.

    Same seed, same ``EpochBatches``: the same permutation each epoch, hence the
    same batches in the same order. Returns one dict per epoch (epoch, steps,
    train_loss, test_accuracy, losses).
    """
    rng = np.random.default_rng(seed)
    opt = torch.optim.SGD(twin.parameters(), lr=lr)
    history, step = [], 0
    for epoch in range(1, epochs + 1):
        batches.prepare(rng)
        n_steps = len(batches)
        if max_steps is not None:
            n_steps = min(n_steps, max_steps - step)
        if n_steps <= 0:
            break
        losses = []
        for i in range(n_steps):
            x, y = batches.host(i)
            xb = torch.from_numpy(x).to(device, non_blocking=True)
            yb = torch.from_numpy(y).to(device, non_blocking=True)
            losses.append(torch_train_step(twin, opt, xb, yb))
            step += 1
        epoch_losses = torch.stack(losses).float().cpu().numpy()
        acc = torch_evaluate(twin, x_test, y_test, batches.batch_size, device)
        history.append({"epoch": epoch, "steps": n_steps,
                        "train_loss": float(epoch_losses.mean()), "test_accuracy": acc,
                        "losses": epoch_losses.tolist()})
    return history


def loss_curve(history: list[dict[str, Any]], every: int) -> list[tuple[int, float]]:
    """(step, mean loss of the ``every`` steps ending there) over the whole run."""
    losses = np.concatenate([np.asarray(h["losses"], np.float64) for h in history] or [[]])
    return [(int(hi), float(losses[hi - every : hi].mean()))
            for hi in range(every, len(losses) + 1, every)]


# --------------------------------------------------------------------------
# Per-step timing
# --------------------------------------------------------------------------


def time_steps(
    config, images: np.ndarray, labels: np.ndarray, batch_size: int, lr: float, seed: int,
    steps: int, windows: int, warmup: int, device: torch.device, n_batches: int = 8,
) -> dict[str, Any]:
    """ms per training step for both implementations at one batch size.

    ``n_batches`` distinct batches are prepared in pinned host memory and
    cycled; each step copies one to the device and trains on it. After
    ``warmup`` untimed steps (compilation, cuDNN's choice of algorithm, the
    caching allocator's growth), ``windows`` windows of ``steps`` consecutive
    steps are timed; the median window / steps is reported.

    Returns:
        {"batch_size", "numba_ms_per_step", "torch_ms_per_step",
         "numba_window_ms", "torch_window_ms", "numba_over_torch", ...};
        the ms are None in the simulator.
    """
    n_batches = max(1, min(n_batches, len(labels) // batch_size))
    batches = fdata.EpochBatches(images[: n_batches * batch_size],
                                 labels[: n_batches * batch_size], batch_size)
    init = init_params(config, seed)
    model = NumbaCNN(config, max_batch=batch_size, params=init)
    stream = cuda.stream()

    def numba_steps(k: int) -> None:
        for i in range(k):
            x_dev, y_dev = batches.to_device(i % n_batches, stream=stream)
            model.train_step(x_dev, y_dev, lr)

    twin = TorchCNN.from_state_dict(config, init, device)
    opt = torch.optim.SGD(twin.parameters(), lr=lr)
    xs = [_pinned(batches.host(i)[0], device) for i in range(n_batches)]
    ys = [_pinned(batches.host(i)[1], device) for i in range(n_batches)]

    def torch_steps(k: int) -> None:
        for i in range(k):
            j = i % n_batches
            torch_train_step(twin, opt, xs[j].to(device, non_blocking=True),
                             ys[j].to(device, non_blocking=True))

    results: dict[str, Any] = {"batch_size": batch_size, "steps_per_window": steps,
                               "windows": windows, "warmup_steps": warmup}
    for name, run, on_gpu in (("numba", numba_steps, True),
                              ("torch", torch_steps, device.type == "cuda")):
        window_ms = _time_windows(run, steps, windows, warmup, on_gpu)
        results[f"{name}_window_ms"] = window_ms
        results[f"{name}_ms_per_step"] = (
            float(np.median(window_ms)) / steps if window_ms else None)
    if results["numba_ms_per_step"] and results["torch_ms_per_step"]:
        results["numba_over_torch"] = results["numba_ms_per_step"] / results["torch_ms_per_step"]
    return results


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


def format_timing_table(rows: list[dict[str, Any]], device: str, torch_dev: str) -> str:
    lines = [f"time per training step (copy + forward + backward + update), {device}; "
             f"torch on {torch_dev}"]
    if rows and rows[0]["numba_ms_per_step"] is None:
        lines.append(f"  ({common.timing.SIMULATOR_NOTE})")
    lines.append(f"  {'batch':>6} {'numba ms':>10} {'torch ms':>10} {'numba/torch':>12} "
                 f"{'numba img/s':>12} {'torch img/s':>12}")
    for r in rows:
        b, n, t = r["batch_size"], r["numba_ms_per_step"], r["torch_ms_per_step"]

        def f(v, spec):
            return "-" if v is None else format(v, spec)

        lines.append(
            f"  {b:>6} {f(n, '.3f'):>10} {f(t, '.3f'):>10} "
            f"{f(r.get('numba_over_torch'), '.1f'):>12} "
            f"{f(n and b / n * 1e3, '.0f'):>12} {f(t and b / t * 1e3, '.0f'):>12}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("numba", "-"), ("torch", "--")):
        curve = result["accuracy_run"]["curves"].get(name) or []
        if curve:
            steps, losses = zip(*curve)
            ax1.plot(steps, losses, style, label=name)
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"train loss (mean of {result['accuracy_run']['loss_every']} steps)")
    ax1.set_title("same weights, same batches")
    ax1.legend()
    rows = [r for r in result["timing"] if r["numba_ms_per_step"] is not None]
    if rows:
        bs = [r["batch_size"] for r in rows]
        ax2.plot(bs, [r["numba_ms_per_step"] for r in rows], "o-", label="numba (ours)")
        ax2.plot(bs, [r["torch_ms_per_step"] for r in rows], "s-", label="torch")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.legend()
    else:
        ax2.text(0.5, 0.5, "no timings (simulator)", ha="center", va="center")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("ms per training step")
    ax2.set_title(result["device"])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive ints, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m final_project.compare",
                                description=__doc__.splitlines()[0])
    ftrain.add_common_args(p)
    p.set_defaults(out=DEFAULT_OUT)
    p.add_argument("--loss-every", type=int, default=None, metavar="K",
                   help="loss curve: mean of every K steps (default 50; tiny: 2)")
    p.add_argument("--time-batch-sizes", type=_batch_sizes, default=None, metavar="B1,B2",
                   help="batch sizes for the timing table (default 64,256,1024; tiny: 8)")
    p.add_argument("--time-steps", type=int, default=None,
                   help="steps per timed window (default 100; tiny: 1)")
    p.add_argument("--time-windows", type=int, default=2, help="timed windows (median kept)")
    p.add_argument("--time-warmup", type=int, default=None,
                   help="untimed steps before the windows (default 10; tiny: 1)")
    p.add_argument("--torch-tf32", action="store_true",
                   help="let torch use TF32 tensor cores (default off: both sides full FP32)")
    args = p.parse_args(argv)
    timing_only = args.epochs == 0
    ftrain.resolve_args(args)  # (turns --epochs 0 into the default)
    if timing_only:
        args.epochs = 0
    tiny = args.tiny
    loss_every = args.loss_every or (2 if tiny else 50)
    time_sizes = args.time_batch_sizes or ([8] if tiny else [64, 256, 1024])
    time_steps_n = args.time_steps or (1 if tiny else 100)
    warmup = args.time_warmup if args.time_warmup is not None else (1 if tiny else 10)
    windows = args.time_windows
    if min(time_steps_n, windows) < 1 or warmup < 0:
        p.error("--time-steps and --time-windows must be >= 1, --time-warmup >= 0")
    # torch's default lets cuDNN convolutions use TF32 (10-bit mantissa); our
    # kernels are FP32, so the default comparison turns TF32 off on both paths.
    torch.backends.cudnn.allow_tf32 = args.torch_tf32
    torch.backends.cuda.matmul.allow_tf32 = args.torch_tf32
    device = torch_device()
    gpu = ftrain.device_name()
    print(f"runtime: {common.runtime_name()} ({gpu}); torch on {device}")
    if tiny:
        print(f"{common.runtime_name()}: {ftrain.TINY.describe()}; timings are meaningless here")
    try:
        ds = ftrain.load_data(args)
    except (fdata.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"data: {ds.source}: {len(ds.train_labels)} train / {len(ds.test_labels)} test")
    x_train, y_train = ftrain.images_for(ds, "train", args.image_size)
    x_test, y_test = ftrain.images_for(ds, "test", args.image_size)
    config = ftrain.net_config(args)
    init = init_params(config, args.seed)

    # 1. accuracy: same weights, same batches
    numba_hist, torch_hist = [], []
    if args.epochs > 0:
        try:
            batches = fdata.EpochBatches(x_train, y_train, args.batch_size)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        test_batches = fdata.EpochBatches(x_test, y_test, args.batch_size, drop_last=False)
        print(f"accuracy run: {args.epochs} epochs x {len(batches)} steps, batch "
              f"{args.batch_size}, SGD lr {args.lr}, seed {args.seed}")
        print("numba (ours):")
        model = NumbaCNN(config, max_batch=args.batch_size, params=init)
        numba_hist = ftrain.train(model, batches, test_batches, args.epochs, args.lr, args.seed,
                                  max_steps=args.max_steps, progress=sys.stderr.isatty(),
                                  log=lambda s: print("  " + s))
        print("torch:")
        twin = TorchCNN.from_state_dict(config, init, device)
        torch_hist = train_torch(twin, batches, x_test, y_test, args.epochs, args.lr, args.seed,
                                 device, max_steps=args.max_steps)
        for h in torch_hist:
            print(f"  epoch {h['epoch']}: train loss {h['train_loss']:.4f}, "
                  f"test accuracy {h['test_accuracy']:.2f}%")
        print(f"  {'step':>6} {'numba loss':>11} {'torch loss':>11}")
        curves = {"numba": loss_curve(numba_hist, loss_every),
                  "torch": loss_curve(torch_hist, loss_every)}
        for (s, a), (_, b) in zip(curves["numba"], curves["torch"]):
            print(f"  {s:>6} {a:>11.4f} {b:>11.4f}")
        na, ta = numba_hist[-1]["test_accuracy"], torch_hist[-1]["test_accuracy"]
        print(f"test accuracy: numba {na:.2f}%, torch {ta:.2f}% (difference {na - ta:+.2f} "
              "points)")
    else:
        curves = {"numba": [], "torch": []}

    # 2. time per step
    timing = []
    for b in time_sizes:
        if len(y_train) < b:
            print(f"timing: skipping batch {b}: only {len(y_train)} training images")
            continue
        timing.append(time_steps(config, x_train, y_train, b, args.lr, args.seed,
                                 time_steps_n, windows, warmup, device))
    print(format_timing_table(timing, gpu, str(device)))

    result = {
        "device": gpu, "runtime": common.runtime_name(), "torch_device": str(device),
        "torch_version": torch.__version__, "torch_tf32": args.torch_tf32,
        "config": dataclasses.asdict(config),
        "dataset": ds.name, "source": ds.source, "is_sample": ds.is_sample,
        "accuracy_run": {
            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "loss_every": loss_every, "curves": curves,
            "numba": numba_hist, "torch": torch_hist,
        },
        "timing": timing,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "compare.png")
    print(f"wrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
