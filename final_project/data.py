"""What feeds the GPU: images normalised to float32 and copied to the device batch by batch.

Images arrive as uint8 (N, H, W) from :mod:`final_project.datasets` (files,
checksums, downloads); :func:`normalise` makes them float32 (N, 1, H, W),
:func:`shrink` makes small real images for simulator runs, and
:class:`EpochBatches` shuffles an epoch into pinned host memory and copies one
batch at a time to device buffers allocated once.
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
import numpy as np
from numba import cuda

# --------------------------------------------------------------------------
# From uint8 images to normalised float32 batches
# --------------------------------------------------------------------------


def normalise(images: np.ndarray, mean: float, std: float) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28): ``(x / 255 - mean) / std``.

    A 256-entry lookup table makes it one gather, and the result is the same
    float32 for a pixel value wherever it is computed.
    """
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(
            f"normalise wants uint8 images (N, H, W), got {images.dtype} {images.shape}"
        )
    lut = ((np.arange(256, dtype=np.float64) / 255.0 - mean) / std).astype(np.float32)
    return lut[images][:, None, :, :]


def shrink(images: np.ndarray, size: int = 12) -> np.ndarray:
    """Smaller real images for simulator runs: uint8 (N, H, W) -> (N, size, size).

    Keeps the centre ``size * k`` square, ``k = min(H, W) // size``, and
    averages its k x k blocks (rounding to nearest): for MNIST's 28x28 digits,
    size 12 averages 2x2 blocks of the centre 24x24, size 8 averages 3x3 blocks
    of the same 24x24 (the digits sit in the centre 20x20 box). The simulator
    runs one Python thread per CUDA thread, so 64 pixels instead of 784 make a
    training step about twelve times cheaper there.

    Raises:
        ValueError: not uint8 (N, H, W), or ``size`` not in 1..min(H, W).
    """
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"shrink wants uint8 images (N, H, W); got {images.dtype} {images.shape}")
    n, h, w = images.shape
    if not 0 < size <= min(h, w):
        raise ValueError(f"shrink size must be in 1..{min(h, w)}, got {size}")
    k = min(h, w) // size
    side = size * k
    top, left = (h - side) // 2, (w - side) // 2
    blocks = images[:, top : top + side, left : left + side].reshape(n, size, k, size, k)
    sums = blocks.astype(np.uint32).sum(axis=(2, 4))
    return ((sums + k * k // 2) // (k * k)).astype(np.uint8)


class EpochBatches:
    """One epoch's batches, gathered in host memory, then copied to the device per step.

    ``prepare(rng)`` shuffles (``rng.permutation``) and gathers all the epoch's
    images into one host buffer (pinned when ``pinned``: the copy to the
    device then runs by DMA without a staging copy). ``to_device(i)`` copies
    batch ``i`` into device buffers allocated once, and returns device views
    (x float32 (B, 1, H, W) contiguous, y int32 (B,)).

    drop_last: leave out the last, smaller batch (training keeps a fixed batch
    size, as PyTorch's ``DataLoader(drop_last=True)``); evaluation keeps it.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        drop_last: bool = True,
        pinned: bool = True,
    ) -> None:
        if images.dtype != np.float32 or images.ndim != 4:
            raise ValueError(
                f"images must be float32 (N, C, H, W), got {images.dtype} "
                f"{images.shape}; use normalise() first"
            )
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        n = len(images)
        self.images = images
        self.labels = labels.astype(np.int32)
        self.batch_size = batch_size
        self.num_batches = n // batch_size if drop_last else -(-n // batch_size)
        if self.num_batches == 0:
            raise ValueError(
                f"{n} images make no full batch of {batch_size}; use a smaller --batch-size"
            )
        self.count = self.num_batches * batch_size if drop_last else n
        shape = (self.count, *images.shape[1:])
        if pinned:
            self.x_host = cuda.pinned_array(shape, dtype=np.float32)
            self.y_host = cuda.pinned_array((self.count,), dtype=np.int32)
        else:
            self.x_host = np.empty(shape, np.float32)
            self.y_host = np.empty((self.count,), np.int32)
        self.x_dev = cuda.device_array((batch_size, *images.shape[1:]), np.float32)
        self.y_dev = cuda.device_array((batch_size,), np.int32)
        self.order = np.arange(n)
        self.prepare(None)

    def prepare(self, rng: np.random.Generator | None) -> None:
        """Shuffle with ``rng`` (None: keep the order) and gather the epoch."""
        n = len(self.images)
        self.order = rng.permutation(n) if rng is not None else np.arange(n)
        idx = self.order[: self.count]
        np.take(self.images, idx, axis=0, out=self.x_host)
        np.take(self.labels, idx, axis=0, out=self.y_host)

    def __len__(self) -> int:
        return self.num_batches

    def batch_sizes(self) -> tuple[int, ...]:
        """The distinct batch sizes of an epoch: (batch_size,), and the last,
        smaller batch's size when it is kept."""
        last = self.count - (self.num_batches - 1) * self.batch_size
        full = (self.batch_size,) if self.num_batches > 1 and last != self.batch_size else ()
        return (*full, last)

    def host(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``i`` in host memory: x (b, C, H, W) float32, y (b,) int32."""
        lo = i * self.batch_size
        hi = min(lo + self.batch_size, self.count)
        return self.x_host[lo:hi], self.y_host[lo:hi]

    def to_device(self, i: int, stream=0):
        """Copy batch ``i`` into the device buffers; return device views (x, y).

        With a ``stream`` (``cuda.stream()``) and pinned memory the copy is
        asynchronous: the host goes on queueing kernels. Ordering stays right
        because such a stream synchronises with the legacy default stream the
        kernels run on. Do not ``prepare`` the next epoch before synchronising.
        """
        x, y = self.host(i)
        b = len(y)
        x_dev, y_dev = self.x_dev[:b], self.y_dev[:b]
        x_dev.copy_to_device(x, stream=stream)
        y_dev.copy_to_device(y, stream=stream)
        return x_dev, y_dev
