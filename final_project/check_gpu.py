"""Check every capstone kernel at full size against the float64 reference, then time a step.

    python -m final_project.check_gpu [--out runs/final_project] [--batches 64 256 1024]

1. Each layer's forward and backward at the network's real shapes (batch 64,
   28x28, 32/64 channels, 128 hidden) against the NumPy float64 reference
   (final_project.reference, through final_project.checks), rel error < 1e-4;
   prints every error. The sums
   over a whole batch (conv and batchnorm weight and bias gradients, naive and
   fast) again at batch 1024, held to SUM_TOL = 2e-6: a float32 accumulator
   over 800k terms fails there, and passes 1e-4.
2. One full NumbaCNN training step against the float64 reference (loss, every
   gradient, parameters and running statistics after the update:
   final_project.checks.check_train_step, the check ``train --check`` runs), and
   the evaluation-mode forward; the same for FastCNN at batch 64 and 1024, and
   on a Hopper GPU for FastCNN(precision="tf32") against the reference's TF32
   model (checks.tf32_step_tolerance).
3. Times, with CUDA events (common.timing.benchmark), the forward (with loss),
   backward, SGD update and whole step at each batch size, and each layer's
   forward and backward, so we see where the time goes. Writes
   ``check_gpu.json`` under --out.

Exits non-zero if any check fails. In the simulator the same code runs at tiny
sizes (timings are not measured there).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array
from common.runtime import is_simulator, pick
from common.timing import benchmark, device_peaks, format_table, write_json
from common.wgmma import has_wgmma

import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda

from final_project import checks, reference
from final_project import fast_conv as FC
from final_project.fast_model import FastCNN
from final_project.model import NetConfig, NumbaCNN

# Sums over a batch's pixels: N*H*W terms, 802,816 a conv1 weight (and a bn1
# channel) at batch 1024, 200,704 a conv2 weight. The naive kernels add them in
# float64, the fast ones in float32 chunks of <= 2048 added in float64. A kernel
# with one float32 accumulator errs by about eps32 * sqrt(terms) / 2, which the
# layer tolerance 1e-4 lets through. Emulated on the CPU on check_conv2d's
# random float32 inputs at batch 1024 (relative error of dw, of db):
#   one float32 accumulator          conv1 1.5e-5, 2.6e-5   conv2 7.2e-6, 1.0e-5
#   float32 chunks + float64 (fast)  conv1 4.6e-7, 5.2e-7   conv2 7.2e-7, 8.4e-7
#   float64 accumulator (naive)      conv1 2.5e-8, 2.1e-8   conv2 2.5e-8, 2.9e-8
# (at batch 64 the float32 accumulator gives only 4.1e-6). SUM_TOL sits about a
# factor 3 from the worst correct kernel and from the best wrong one.
SUM_TOL = 2e-6
LONG_SUMS = (
    "conv2d grad weight",
    "conv2d grad bias",
    "batchnorm grad weight",
    "batchnorm grad bias",
)


def _hold_long_sums(errs: dict[str, float], where: str) -> dict[str, float]:
    """Raise CheckError if a batch-long sum in ``errs`` errs by more than SUM_TOL."""
    for name, err in errs.items():
        if name in LONG_SUMS and err > SUM_TOL:
            raise CheckError(
                f"{where} {name}: relative error {err:.3g} > {SUM_TOL:g}, the "
                "bound for sums over the batch (a float32 accumulator?)"
            )
    return errs


def check_fast_conv_grad_weight(
    rng, n: int, c_in: int, c_out: int, h: int, w: int
) -> dict[str, float]:
    """FastCNN's weight-gradient kernel (split-K implicit GEMM, default tiles)
    for a 3x3 'same' convolution of x (n, c_in, h, w), against the float64
    reference, held to SUM_TOL."""
    x = random_array((n, c_in, h, w), np.float32, rng)
    dout = random_array((n, c_out, h, w), np.float32, rng)
    _, cache = reference.conv2d_forward(
        x.astype(np.float64), np.zeros((c_out, c_in, 3, 3)), np.zeros(c_out), 1
    )
    _, want_dw, want_db = reference.conv2d_backward(dout.astype(np.float64), cache)
    dw, db = guarded(want_dw.shape, np.float32), guarded(c_out, np.float32)
    partials = cuda.device_array(
        FC.conv2d_grad_weight_igemm_partials_shape(n, h, w, c_out, c_in, 3), np.float32
    )
    FC.conv2d_grad_weight_igemm(
        cuda.to_device(dout), cuda.to_device(x), 1, dw.array, db.array, partials
    )
    dw.check_untouched("fast conv grad weight")
    db.check_untouched("fast conv grad bias")
    return {
        "fast conv grad weight": check(dw.array, want_dw, SUM_TOL, "fast conv grad weight"),
        "fast conv grad bias": check(db.array, want_db, SUM_TOL, "fast conv grad bias"),
    }


def check_all(config: NetConfig, n: int, rng) -> dict[str, float]:
    """Every layer check at this config's shapes, the train step and eval forward."""
    h, w = config.height, config.width
    big = pick(gpu=1024, simulator=n)  # the largest batch: the longest sums
    errs: dict[str, float] = {}
    for batch in sorted({n, big}):
        b = "" if batch == n else f" b{batch}"
        for name, layer_errs in (
            ("conv1", checks.check_conv2d(rng, batch, config.in_channels, config.c1, h, w)),
            ("conv2", checks.check_conv2d(rng, batch, config.c1, config.c2, h // 2, w // 2)),
            ("bn1", checks.check_batchnorm(rng, batch, config.c1, h, w)),
            ("bn2", checks.check_batchnorm(rng, batch, config.c2, h // 2, w // 2)),
        ):
            errs.update(
                {f"{name}{b} {k}": v for k, v in _hold_long_sums(layer_errs, f"{name}{b}").items()}
            )
    errs.update(
        {
            f"conv1 b{big} {k}": v
            for k, v in check_fast_conv_grad_weight(
                rng, big, config.in_channels, config.c1, h, w
            ).items()
        }
    )
    errs.update(
        {
            f"conv2 b{big} {k}": v
            for k, v in check_fast_conv_grad_weight(
                rng, big, config.c1, config.c2, h // 2, w // 2
            ).items()
        }
    )
    errs.update(checks.check_relu(rng, (n, config.c1, h, w)))
    errs.update({f"pool1 {k}": v for k, v in checks.check_maxpool(rng, n, config.c1, h, w).items()})
    errs.update(
        {
            f"fc1 {k}": v
            for k, v in checks.check_linear(rng, n, config.flat_features, config.hidden).items()
        }
    )
    errs.update(
        {
            f"fc2 {k}": v
            for k, v in checks.check_linear(rng, n, config.hidden, config.num_classes).items()
        }
    )
    errs.update(checks.check_log_softmax_nll(rng, n, config.num_classes))
    errs.update(checks.check_sgd(rng, pick(gpu=500_000, simulator=100)))
    x, y = checks.random_batch(config, n, rng)
    model = NumbaCNN(config, max_batch=n, seed=0)
    errs.update({f"step {k}": v for k, v in checks.check_train_step(model, x, y, 0.1).items()})
    errs.update(checks.check_eval_forward(config, n, rng))
    # The fast model (fused and tiled kernels, CUDA graph) against the same
    # reference, at the check batch and at the largest one: its batch-long sums
    # (weight gradients over N*H*W = 800k terms at 1024) are only exercised at
    # full size.
    for batch in sorted({n, big}):
        x, y = checks.random_batch(config, batch, rng)
        model = FastCNN(config, max_batch=batch, seed=0)
        errs.update(
            {
                f"fast step b{batch} {k}": v
                for k, v in checks.check_train_step(model, x, y, 0.1).items()
            }
        )
    errs.update(
        {
            f"fast {k}": v
            for k, v in checks.check_eval_forward(config, n, rng, model_cls=FastCNN).items()
        }
    )
    if has_wgmma():  # precision "tf32": conv2 on the tensor cores (Hopper)
        for batch in sorted({n, big}):
            x, y = checks.random_batch(config, batch, rng)
            model = FastCNN(config, max_batch=batch, seed=0, precision="tf32")
            errs.update(
                {
                    f"fast tf32 step b{batch} {k}": v
                    for k, v in checks.check_train_step(model, x, y, 0.1).items()
                }
            )
    return errs


def time_step(config: NetConfig, batch: int, rng, repeats: int) -> list:
    """Timings (ms) of forward+loss, backward, update, the whole step, and each layer."""
    model = NumbaCNN(config, max_batch=batch, seed=0)
    x, y = checks.random_batch(config, batch, rng)
    x, y = cuda.to_device(x), cuda.to_device(y)
    model.train_step(x, y, 0.01)  # compiles every kernel

    def forward():
        model.criterion.forward(model._forward(x, True), y)

    def update():
        from final_project import kernels

        kernels.sgd_update(model.params.flat, model.grads.flat, 0.01)

    kw = dict(warmup=2, repeats=repeats)
    results = [
        benchmark(forward, f"b{batch} forward + loss", **kw),
        benchmark(model._backward, f"b{batch} backward", **kw),
        benchmark(update, f"b{batch} SGD update", nbytes=12 * model.params.flat.size, **kw),
        benchmark(lambda: model.train_step(x, y, 0.01), f"b{batch} whole train step", **kw),
    ]
    # Per layer: run forward once so every layer holds its inputs, then time each
    # layer's forward and backward on those same tensors.
    forward()
    d = {"dlogits": model.criterion.backward()}
    layers = [
        ("conv1", model.conv1),
        ("bn1", model.bn1),
        ("relu1", model.relu1),
        ("pool1", model.pool1),
        ("conv2", model.conv2),
        ("bn2", model.bn2),
        ("relu2", model.relu2),
        ("pool2", model.pool2),
        ("fc1", model.fc1),
        ("relu3", model.relu3),
        ("fc2", model.fc2),
    ]
    inputs = [
        x,
        model.conv1.out[:batch],
        model.bn1.out[:batch],
        model.relu1.out[:batch],
        model.pool1.out[:batch],
        model.conv2.out[:batch],
        model.bn2.out[:batch],
        model.relu2.out[:batch],
        model.pool2.out[:batch].reshape((batch, config.flat_features)),
        model.fc1.out[:batch],
        model.relu3.out[:batch],
    ]
    outs = [
        model.conv1.out,
        model.bn1.out,
        model.relu1.out,
        model.pool1.out,
        model.conv2.out,
        model.bn2.out,
        model.relu2.out,
        model.pool2.out,
        model.fc1.out,
        model.relu3.out,
        model.fc2.out,
    ]
    d["douts"] = [
        cuda.to_device(rng.standard_normal(o[:batch].shape).astype(np.float32)) for o in outs
    ]
    for (name, layer), inp, dout in zip(layers, inputs, d["douts"]):
        fwd = (
            (lambda layer=layer, inp=inp: layer.forward(inp, True))
            if name.startswith("bn")
            else (lambda layer=layer, inp=inp: layer.forward(inp))
        )
        results.append(benchmark(fwd, f"b{batch} {name} forward", **kw))
        fwd()
        results.append(
            benchmark(
                lambda layer=layer, dout=dout: layer.backward(dout),
                f"b{batch} {name} backward",
                **kw,
            )
        )
    results.append(
        benchmark(
            lambda: model.criterion.forward(model.fc2.out[:batch], y),
            f"b{batch} log-softmax NLL forward",
            **kw,
        )
    )
    results.append(benchmark(model.criterion.backward, f"b{batch} log-softmax NLL backward", **kw))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/final_project", help="folder for check_gpu.json")
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes to time (default 64 256 1024; simulator: 2)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    config = pick(
        gpu=NetConfig(), simulator=NetConfig(height=8, width=8, c1=3, c2=4, hidden=8, num_classes=5)
    )
    n = pick(gpu=64, simulator=2)
    batches = args.batches or pick(gpu=[64, 256, 1024], simulator=[2])
    print(f"checking every layer and one train step at batch {n}, {config}")
    try:
        errs = check_all(config, n, rng)
    except CheckError as e:
        print(f"FAILED: {e}")
        return 1
    width = max(len(k) for k in errs)
    for k, v in errs.items():
        print(f"  {k:<{width}}  {v:.2e}")
    # relative errors by tolerance; the max-pool tie gaps (absolute) have their own rule
    fp32 = [v for k, v in errs.items() if "tf32" not in k and "below window max" not in k]
    tf32 = [v for k, v in errs.items() if "tf32" in k and "below window max" not in k]
    line = f"all {len(errs)} checks passed: largest relative error {max(fp32):.2e} (tolerance {checks.TOL})"
    if tf32:
        tol = checks.tf32_step_tolerance(checks.TOL)
        line += f", TF32 steps {max(tf32):.2e} (tolerance {tol:.2g})"
    print(line)

    results = []
    for b in batches:
        t = time_step(config, b, rng, args.repeats)
        print(format_table(t, title=f"NumbaCNN naive kernels, batch {b} (ms per call)"))
        results.extend(t)
    if not is_simulator():
        print("\nms per step by batch size:")
        for b in batches:
            step = next(r for r in results if r.name == f"b{b} whole train step")
            print(
                f"  batch {b:>5}: {step.median_ms:8.3f} ms/step, "
                f"{b / step.median_ms * 1e3:10.0f} images/s"
            )
    out = Path(args.out) / "check_gpu.json"
    write_json(
        results, out, device=device_peaks()["device"], config=repr(config), check_errors=errs
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
