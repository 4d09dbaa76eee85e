"""Make the shipped MNIST sample (mnist_sample.npz) from the official MNIST test files.

Run once by a maintainer, not by the course (the course only reads the .npz):

    python final_project/data/make_sample.py --src ../shared/data/mnist

Takes 2,000 of the 10,000 test digits, chosen by a seeded permutation
(numpy default_rng(0)), so all ten classes and both halves of the test set
(its writers differ) are represented: the first 1,700 become the sample's
training split, the last 300 its test split. The indices into the test set
are stored too, so the sample can be traced back to the official files.
"""

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
import argparse
from pathlib import Path

import numpy as np

from final_project.datasets import SAMPLE_PATH, read_idx

N_TRAIN, N_TEST, SEED = 1700, 300, 0


def make_sample(src: Path, out: Path = SAMPLE_PATH) -> None:
    images = read_idx(src / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(src / "t10k-labels-idx1-ubyte.gz")
    if images.shape != (10_000, 28, 28) or labels.shape != (10_000,):
        raise SystemExit(f"{src}: expected the MNIST test split, got {images.shape}")
    idx = np.random.default_rng(SEED).permutation(len(labels))[: N_TRAIN + N_TEST]
    tr, te = idx[:N_TRAIN], idx[N_TRAIN:]
    np.savez_compressed(
        out,
        train_images=images[tr],
        train_labels=labels[tr],
        test_images=images[te],
        test_labels=labels[te],
        train_index=tr.astype(np.uint16),
        test_index=te.astype(np.uint16),
    )
    print(
        f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB): {N_TRAIN} train / {N_TEST} "
        f"test digits; train class counts {np.bincount(labels[tr], minlength=10).tolist()}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--src",
        type=Path,
        required=True,
        help="folder with t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz",
    )
    make_sample(p.parse_args().src)
