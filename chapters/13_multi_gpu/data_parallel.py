"""The capstone trained data-parallel: one step checked, the loss next to torch DDP's, the versions timed.

    torchrun --standalone --nproc-per-node 2 chapters/13_multi_gpu/data_parallel.py
    python chapters/13_multi_gpu/data_parallel.py    # starts one rank a GPU (2 gloo ranks in the simulator)

The step is final_project/distributed.py's ``DataParallelCNN``: every rank takes
rows [r B/N, (r+1) B/N) of the same global batch, runs the capstone's forward and
backward on them, all-reduces (sums) the flat gradient buffer in place, and
updates with lr / N.

    version 0   one GPU at batch B: the capstone's step, one CUDA graph
    version 1   N GPUs at B / N: graph(forward + backward) -> all_reduce(the whole
                1.7 MB gradient buffer) -> SGD(lr / N)
    version 2   the all-reduce in two buckets: the classifier's gradients (95% of
                the bytes) as soon as backward has them, overlapping the
                convolutions' backward; then the rest (DDP's bucketing)
    torch DDP   the twin (final_project/torch_twin.py) in DistributedDataParallel

1. Check: one step of v1 and one of v2 against the float64 reference in which each
   rank's shard has its own batchnorm statistics (``check_data_parallel_step``).
2. Same weights, same batches: --steps steps of ours and of the DDP twin on the
   shipped MNIST sample, the loss of every 10th step side by side.
3. ms per step of every version at global batch --batch-size (a GPU only).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling, load_chapter_module
from common.harness import positive_int, run_script, save_results, script_parser
from common.runtime import device_name, is_simulator

import sys

import numpy as np
import torch

from final_project import data as fdata
from final_project import datasets
from final_project import distributed as fdist
from final_project.model import NetConfig, init_params
from final_project.torch_twin import torch_train_step
from final_project.train import TINY, describe_config

tools = import_sibling(__file__, "tools")
bridge = load_chapter_module("10_pytorch_extensions", "bridge")  # full_float32
LR = 0.05
CONFIG = common.pick(NetConfig(), NetConfig(height=8, width=8, c1=TINY.c1, c2=TINY.c2, hidden=16))


def sample_images(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The shipped MNIST sample's training split, normalised float32 (N, 1, size, size)."""
    ds = datasets.load_sample()
    images = ds.train_images if size == 28 else fdata.shrink(ds.train_images, size)
    return fdata.normalise(images, ds.mean, ds.std), ds.train_labels.astype(np.int32)


def check_step(comm: fdist.Communicator, batch: int, rng: np.random.Generator) -> list[str]:
    """A step of v1 and of v2 on a random global batch, each checked; one line each.

    On a GPU the first step at a batch size runs eagerly and captures the graphs;
    the second, the one checked, replays them (the simulator has no graphs)."""
    x = rng.standard_normal((batch, 1, CONFIG.height, CONFIG.width)).astype(np.float32)
    y = rng.integers(0, CONFIG.num_classes, batch).astype(np.int32)
    lines = []
    for name, overlap in (("v1 one all-reduce", False), ("v2 two buckets", True)):
        model = fdist.DataParallelCNN(
            CONFIG, batch, comm, params=init_params(CONFIG, 0), overlap=overlap
        )
        model.train_step(x, y, LR)  # eager; captures the graphs on a GPU
        errs = fdist.check_data_parallel_step(model, x, y, lr=LR)
        worst = max(errs, key=errs.get)
        lines.append(f"  {name}: worst relative error {errs[worst]:.1e} ({worst})")
    return lines


def loss_side_by_side(comm: fdist.Communicator, batch: int, steps: int) -> list[tuple]:
    """(step, ours, DDP twin) every 10th step: the loss of the global batch (mean over ranks)."""
    images, labels = sample_images(CONFIG.height)
    batches = fdata.EpochBatches(images, labels, batch)
    init = init_params(CONFIG, 0)
    ours = fdist.DataParallelCNN(CONFIG, batch, comm, params=init)
    ddp, opt = fdist.ddp_twin(comm, CONFIG, init, LR)
    rows = fdist.shard_rows(batch, comm.rank, comm.world)
    mine, theirs = [], []
    for step in range(steps):
        x, y = batches.host(step % len(batches))
        ours.train_step(x, y, LR)
        ours.synchronize()
        mine.append(float(ours.loss.copy_to_host()[0]))
        xb, yb = (
            torch.from_numpy(x[rows]).to(comm.device),
            torch.from_numpy(y[rows]).to(comm.device),
        )
        theirs.append(float(torch_train_step(ddp, opt, xb, yb)))
    mine, theirs = comm.mean_over_ranks(np.array(mine)), comm.mean_over_ranks(np.array(theirs))
    every = max(1, min(10, steps // 4))
    return [(s + 1, mine[s], theirs[s]) for s in range(every - 1, steps, every)]


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, "13_multi_gpu")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=common.pick(2048, 4),
        help="global batch of the timing (default 2048; simulator: 4)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=common.pick(200, 4),
        help="steps of the loss side by side (default 200, at global batch 256; simulator: 4)",
    )
    args = parser.parse_args(argv)
    if not fdist.launched_by_torchrun():
        return tools.run_as_ranks(__file__, sys.argv[1:] if argv is None else argv)
    comm = tools.init_ranks(parser, args.batch_size)
    log = print if comm.rank == 0 else (lambda *a, **k: None)
    where = "the simulator" if is_simulator() else device_name()
    log(f"{comm.world} ranks ({comm.backend}) on {where}; network: {describe_config(CONFIG)}")
    with bridge.full_float32():
        small = common.pick(64, 2 * comm.world)
        log(
            f"1. a step at global batch {small} (the graphs' replay on a GPU), against the "
            "float64 reference with per-rank batchnorm:"
        )
        for line in check_step(comm, small, np.random.default_rng(comm.world)):
            log(line)
        batch = common.pick(256, 2 * comm.world)
        log(f"2. loss of the global batch ({batch}), ours and the torch DDP twin, same start:")
        curve = loss_side_by_side(comm, batch, args.steps)
        log(f"  {'step':>6} {'ours':>10} {'torch DDP':>10} {'difference':>11}")
        for step, a, b in curve:
            log(f"  {step:>6} {a:>10.5f} {b:>10.5f} {a - b:>+11.1e}")
        images, labels = sample_images(CONFIG.height)
        copies = -(-8 * args.batch_size // len(labels))  # 8 global batches of real digits
        images, labels = np.concatenate([images] * copies), np.concatenate([labels] * copies)
        rows = fdist.time_versions(comm, CONFIG, images, labels, args.batch_size, LR, seed=0)
    log(f"3. {fdist.format_versions(rows, f'{comm.world} x {where}')}")
    if comm.rank == 0 and rows:
        save_results(rows, args.out, "data_parallel", world=comm.world, loss_curve=curve)
    comm.close()
    return 0


if __name__ == "__main__":
    run_script(main)
