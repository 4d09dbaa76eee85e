"""MNIST and Fashion-MNIST on disk: IDX files, checksums, mirrors, the cache.

Where the images come from, in the order ``load_dataset`` tries them:

1. ``data_dir=DIR`` (``--data-dir``): files already on disk, either directly in
   DIR (``.gz`` or raw) or in torchvision's layout ``DIR/MNIST/raw/``
   (``DIR/FashionMNIST/raw/``). Anything missing or invalid there is an error,
   never a silent fallback.
2. The cache folder (``common.runtime.cache_dir(<dataset>)``:
   ``~/.cache/cuda-python-course/<dataset>``), or ``cache_dir``: files
   downloaded before.
3. A download from the standard mirrors, tried in order; each ``.gz`` must match
   its official MD5 and is written atomically (temp file, then ``os.replace``).
4. MNIST only: the small real sample shipped in ``final_project/data/`` (1,700
   training + 300 test digits taken from the MNIST test set), with one line
   saying so and naming the command that fetches the full set.

The file format is IDX (Yann LeCun's MNIST page, "FILE FORMATS FOR THE MNIST
DATABASE"): a big-endian 4-byte magic ``0x0000 TT DD`` (TT = 0x08 for uint8,
DD = number of dimensions), DD big-endian uint32 sizes, then the payload, row
major. Images are (N, 28, 28) uint8, labels (N,) uint8. What feeds the GPU
(normalising, batches) is in :mod:`final_project.data`.

Command line (fetch or verify the full sets)::

    python -m final_project.datasets --download mnist
    python -m final_project.datasets --verify DIR --dataset fashion-mnist
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
from common.runtime import cache_dir as course_cache_dir

import argparse
import gzip
import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------
# What the datasets are
# --------------------------------------------------------------------------

SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SPLIT_SIZES = {"train": 60_000, "test": 10_000}
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
SAMPLE_PATH = Path(__file__).resolve().parent / "data" / "mnist_sample.npz"


@dataclass(frozen=True)
class DatasetInfo:
    """Where a dataset lives and how to recognise its files.

    gz_md5: the official MD5 of each ``.gz`` as the mirrors serve it.
    payload_md5: MD5 of the decompressed IDX bytes, where known. It lets us
        verify files that were recompressed (Debian ships Fashion-MNIST that
        way: other ``.gz`` bytes, the same IDX payload).
    mean, std: of the training images scaled to [0, 1] (standard constants).
    """

    name: str
    mirrors: tuple[str, ...]
    gz_md5: dict[str, str]
    payload_md5: dict[str, str]
    torchvision_folder: str
    mean: float
    std: float
    classes: tuple[str, ...]
    licence: str


DATASETS = {
    "mnist": DatasetInfo(
        name="mnist",
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
            "http://yann.lecun.com/exdb/mnist/",
        ),
        gz_md5={
            "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        # Computed from the official files; train-images' payload MD5 is not
        # recorded here, so a raw (uncompressed) copy of it is checked by
        # structure only (magic, sizes, length).
        payload_md5={
            "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
            "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
            "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
        },
        torchvision_folder="MNIST",
        mean=0.1307,
        std=0.3081,
        classes=tuple(str(d) for d in range(10)),
        licence="MNIST (Yann LeCun, Corinna Cortes, Christopher J.C. Burges), CC BY-SA 3.0",
    ),
    "fashion-mnist": DatasetInfo(
        name="fashion-mnist",
        mirrors=(
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ),
        gz_md5={
            "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        payload_md5={
            "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
            "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
            "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
        },
        torchvision_folder="FashionMNIST",
        mean=0.2860,
        std=0.3530,
        classes=(
            "T-shirt/top",
            "Trouser",
            "Pullover",
            "Dress",
            "Coat",
            "Sandal",
            "Shirt",
            "Sneaker",
            "Bag",
            "Ankle boot",
        ),
        licence="Fashion-MNIST (Zalando SE), MIT licence",
    ),
}

FETCH_COMMAND = "python -m final_project.datasets --download {dataset}"


class DataError(RuntimeError):
    """Base class: the data could not be read, found, verified or downloaded."""


class IdxFormatError(DataError, ValueError):
    """A file is not a valid IDX file (bad magic, wrong sizes, truncated)."""


class ChecksumError(DataError):
    """A file's MD5 is not the official one."""


class MissingDataError(DataError, FileNotFoundError):
    """A data directory is missing, or lacks some of the four files."""


class DownloadError(DataError):
    """No mirror delivered a file with the right checksum."""


# --------------------------------------------------------------------------
# IDX reader
# --------------------------------------------------------------------------

GZIP_MAGIC = b"\x1f\x8b"
IDX_UBYTE = 0x08


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The IDX bytes of ``path``, decompressed if it starts with the gzip magic.

    Raises:
        IdxFormatError: a truncated or corrupt gzip stream.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise IdxFormatError(
            f"{path}: the gzip stream is truncated or corrupt ({e}). Delete the file "
            "and download it again, or point --data-dir at a good copy."
        ) from e


def parse_idx(raw: bytes, name: str = "<bytes>") -> np.ndarray:
    """Decode IDX bytes into a uint8 array of the shape the header gives.

    Args:
        raw: the whole decompressed file.
        name: used in error messages (usually the file path).

    Returns:
        A read-only-free uint8 ndarray, e.g. (N, 28, 28) for images.

    Raises:
        IdxFormatError: bad magic number, a data type other than uint8, a
            header shorter than it claims, or a payload whose length does not
            match the sizes in the header (a truncated file).
    """
    fix = "Delete it and download it again, or point --data-dir at a good copy."
    if len(raw) < 4:
        raise IdxFormatError(f"{name}: {len(raw)} bytes is too short for an IDX header. {fix}")
    zero, dtype_code, ndim = int.from_bytes(raw[:2], "big"), raw[2], raw[3]
    if zero != 0 or dtype_code != IDX_UBYTE or not 1 <= ndim <= 4:
        raise IdxFormatError(
            f"{name}: bad IDX magic number 0x{raw[:4].hex()} (expected 0x00000801 for "
            f"labels or 0x00000803 for images). This is not an MNIST-style IDX file. {fix}"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(f"{name}: the IDX header is truncated ({len(raw)} bytes). {fix}")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64))
    payload = len(raw) - header
    if payload != expected:
        what = "truncated" if payload < expected else "longer than its header says"
        raise IdxFormatError(
            f"{name}: the file is {what}: the header says shape {shape} "
            f"({expected} bytes of data) but {payload} bytes follow. {fix}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, gzip-compressed or raw (told apart by the magic bytes)."""
    return parse_idx(read_bytes(path), str(path))


def write_idx(path: str | os.PathLike[str], array: np.ndarray, compress: bool = False) -> None:
    """Write a uint8 array as IDX (gzip-compressed if ``compress``); the inverse of read_idx."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, IDX_UBYTE, a.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in a.shape)
    data = header + a.tobytes()
    Path(path).write_bytes(gzip.compress(data, mtime=0) if compress else data)


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


# --------------------------------------------------------------------------
# Finding and verifying files on disk
# --------------------------------------------------------------------------


def _candidates(folder: Path, stem: str) -> list[Path]:
    return [folder / (stem + ".gz"), folder / stem]


def find_file(folder: Path, stem: str) -> Path | None:
    """The .gz or raw copy of ``stem`` in ``folder``, or None."""
    for p in _candidates(folder, stem):
        if p.is_file():
            return p
    return None


def verify_and_read(path: Path, info: DatasetInfo, stem: str) -> np.ndarray:
    """Read one of the four files, checking its checksum and structure.

    A ``.gz`` whose bytes match the official MD5 is accepted. Otherwise (a raw
    file, or a recompressed one) the MD5 of the decompressed payload must match
    where we know it; where we do not (MNIST train-images), the structure
    alone is checked. Structure is always checked: magic number, 28x28 images,
    the official number of items, labels below 10.

    Raises:
        IdxFormatError, ChecksumError: with the file, what is wrong and the fix.
    """
    blob = path.read_bytes()
    official_gz = blob[:2] == GZIP_MAGIC and md5_hex(blob) == info.gz_md5[stem]
    raw = read_bytes(path) if blob[:2] == GZIP_MAGIC else blob
    if not official_gz and stem in info.payload_md5:
        got = md5_hex(raw)
        if got != info.payload_md5[stem]:
            raise ChecksumError(
                f"{path}: checksum mismatch: the IDX payload has MD5 {got}, the official "
                f"{info.name} {stem} has {info.payload_md5[stem]} (the official .gz: "
                f"{info.gz_md5[stem]}). The file is corrupt or is another dataset; delete "
                f"it and fetch it again ({FETCH_COMMAND.format(dataset=info.name)})."
            )
    array = parse_idx(raw, str(path))
    split = "train" if stem.startswith("train") else "test"
    is_images = "images" in stem
    expected = (SPLIT_SIZES[split], *IMAGE_SHAPE) if is_images else (SPLIT_SIZES[split],)
    if array.shape != expected:
        raise IdxFormatError(
            f"{path}: shape {array.shape}, expected {expected} for {info.name} {stem}. "
            "The file is from another dataset or was cut; use the official files."
        )
    if not is_images and array.max() >= NUM_CLASSES:
        raise IdxFormatError(f"{path}: a label is {array.max()}, expected 0-9.")
    return array


def locate_files(
    data_dir: str | os.PathLike[str], info: DatasetInfo, splits: tuple[str, ...] = ("train", "test")
) -> dict[str, Path]:
    """The files of ``splits`` of ``info`` in ``data_dir`` (flat or torchvision layout).

    Raises:
        MissingDataError: ``data_dir`` does not exist, or some files are in
            neither layout; the message lists what is missing and where we looked.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise MissingDataError(
            f"--data-dir {root}: no such directory. Give a folder holding the four "
            f"{info.name} IDX files (.gz or raw), or leave --data-dir out to use the "
            "cache / download."
        )
    folders = [root, root / info.torchvision_folder / "raw"]
    found: dict[str, Path] = {}
    missing = []
    for split in splits:
        for stem in SPLITS[split]:
            hit = next((p for f in folders if (p := find_file(f, stem)) is not None), None)
            if hit is None:
                missing.append(stem)
            else:
                found[stem] = hit
    if missing:
        looked = " and ".join(str(f) for f in folders)
        raise MissingDataError(
            f"--data-dir {root} does not hold the {info.name} files "
            f"{', '.join(m + '[.gz]' for m in missing)} (looked in {looked}). "
            f"Put all four files there, or fetch them with "
            f"`{FETCH_COMMAND.format(dataset=info.name)}` and leave --data-dir out."
            + (
                " (--train-from-test N needs only the two t10k files.)"
                if all(m.startswith("train") for m in missing)
                else ""
            )
        )
    return found


# --------------------------------------------------------------------------
# Download, with mirrors, MD5 and atomic writes
# --------------------------------------------------------------------------


def fetch(url: str, dest, timeout: float = 30.0, progress: bool = True) -> None:
    """Stream ``url`` into the open binary file ``dest``; raise OSError on failure.

    Kept as one small function so tests can replace it (the network is mocked
    there, never reached).
    """
    with urllib.request.urlopen(url, timeout=timeout) as response:
        total = int(response.headers.get("Content-Length") or 0) or None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=url.rsplit("/", 1)[-1],
                leave=False,
                file=sys.stderr,
            )
        try:
            while chunk := response.read(1 << 16):
                dest.write(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()


def download_file(
    info: DatasetInfo,
    stem: str,
    cache_dir: Path,
    mirrors: tuple[str, ...] | None = None,
    progress: bool = True,
) -> Path:
    """Download ``stem.gz`` into ``cache_dir``, trying each mirror in turn.

    Each attempt writes to a temporary file in ``cache_dir``; only a file whose
    MD5 is the official one is moved into place (``os.replace``, atomic on one
    file system), so an interrupted or corrupt download never leaves a file
    that looks complete.

    Returns:
        The path of the verified ``.gz``.

    Raises:
        DownloadError: every mirror failed; the message lists why for each.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / (stem + ".gz")
    failures = []
    for mirror in mirrors if mirrors is not None else info.mirrors:
        url = mirror + stem + ".gz"
        fd, tmp_name = tempfile.mkstemp(prefix=stem + ".", suffix=".part", dir=cache_dir)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                fetch(url, f, progress=progress)
            got = md5_hex(tmp.read_bytes())
            if got != info.gz_md5[stem]:
                failures.append(
                    f"{url}: checksum mismatch (MD5 {got}, expected {info.gz_md5[stem]})"
                )
                continue
            os.replace(tmp, target)
            return target
        except (OSError, urllib.error.URLError, ValueError) as e:
            failures.append(f"{url}: {e}")
        finally:
            tmp.unlink(missing_ok=True)
    raise DownloadError(
        f"could not download {info.name} {stem}.gz from any mirror:\n  "
        + "\n  ".join(failures)
        + "\nWith no network, put the files in a folder and pass --data-dir FOLDER "
        "(see final_project/README.md)."
    )


def download(
    dataset: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    splits: tuple[str, ...] = ("train", "test"),
) -> Path:
    """Make sure the files of ``dataset`` (both splits) are in the cache; return the folder.

    Files already there with the right MD5 are kept; others are (re)downloaded.

    Raises:
        DownloadError: a file could not be fetched from any mirror.
    """
    info = DATASETS[dataset]
    folder = Path(cache_dir) if cache_dir is not None else course_cache_dir(dataset)
    for split in splits:
        for stem in SPLITS[split]:
            path = folder / (stem + ".gz")
            if path.is_file() and md5_hex(path.read_bytes()) == info.gz_md5[stem]:
                continue
            download_file(info, stem, folder, progress=progress)
    return folder


# --------------------------------------------------------------------------
# Loading a dataset
# --------------------------------------------------------------------------


@dataclass
class Dataset:
    """Images (N, 28, 28) uint8 and labels (N,) uint8 for both splits.

    source: one line saying where the data came from (printed by the CLIs).
    mean, std: the normalisation constants (of the training images in [0, 1]).
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str
    mean: float
    std: float
    is_sample: bool = False

    def train_from_test(self, n_train: int) -> Dataset:
        """Train on the first ``n_train`` test images, test on the rest.

        A way to train on real digits without the MNIST training images (the
        test split is 10,000 images: e.g. 8,000 to train, 2,000 to test).

        Raises:
            ValueError: ``n_train`` leaves no training or no test images.
        """
        n = len(self.test_labels)
        if not 0 < n_train < n:
            raise ValueError(
                f"--train-from-test {n_train}: need 0 < N < {n} (the test split has {n} "
                "images; the first N train, the rest test)"
            )
        return Dataset(
            name=self.name,
            train_images=self.test_images[:n_train],
            train_labels=self.test_labels[:n_train],
            test_images=self.test_images[n_train:],
            test_labels=self.test_labels[n_train:],
            source=f"{self.source}; test split cut into {n_train} train / {n - n_train} test",
            mean=self.mean,
            std=self.std,
            is_sample=self.is_sample,
        )

    def subset(self, n_train: int, n_test: int) -> Dataset:
        """The first ``n_train`` training and ``n_test`` test images (for tiny runs).

        ``source`` stays the same: it says where the images came from, and the
        arrays' lengths say how many are used."""
        return Dataset(
            self.name,
            self.train_images[:n_train],
            self.train_labels[:n_train],
            self.test_images[:n_test],
            self.test_labels[:n_test],
            self.source,
            self.mean,
            self.std,
            self.is_sample,
        )


def _from_files(info: DatasetInfo, files: dict[str, Path], where: str) -> Dataset:
    arrays = {stem: verify_and_read(path, info, stem) for stem, path in files.items()}
    (tri, trl), (tei, tel) = SPLITS["train"], SPLITS["test"]
    none = np.zeros((0, *IMAGE_SHAPE), np.uint8)  # the train split was not asked for
    return Dataset(
        info.name,
        arrays.get(tri, none),
        arrays.get(trl, none[:, 0, 0]),
        arrays[tei],
        arrays[tel],
        source=f"{info.name} from {where}",
        mean=info.mean,
        std=info.std,
    )


def load_sample() -> Dataset:
    """The shipped sample: 1,700 train + 300 test real MNIST digits (test-set images).

    Raises:
        MissingDataError: the sample file is missing (a broken install).
    """
    if not SAMPLE_PATH.is_file():
        raise MissingDataError(
            f"{SAMPLE_PATH} is missing: reinstall the course (pip install -e .) or "
            "regenerate it with final_project/data/make_sample.py"
        )
    with np.load(SAMPLE_PATH, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    info = DATASETS["mnist"]
    return Dataset(
        "mnist",
        arrays["train_images"],
        arrays["train_labels"],
        arrays["test_images"],
        arrays["test_labels"],
        source=(
            f"the shipped MNIST sample ({len(arrays['train_labels'])} train / "
            f"{len(arrays['test_labels'])} test digits from the MNIST test set)"
        ),
        mean=info.mean,
        std=info.std,
        is_sample=True,
    )


def load_dataset(
    dataset: str = "mnist",
    data_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    allow_download: bool = True,
    use_sample: bool = False,
    progress: bool = True,
    log=print,
    test_only: bool = False,
) -> Dataset:
    """Load ``dataset`` ("mnist" | "fashion-mnist") from the first place that has it.

    Order: ``data_dir`` (errors are fatal), the cache, a download, and for MNIST
    the shipped sample (``log`` prints one line saying so, with the command that
    fetches the full set). ``use_sample=True`` takes the sample directly.
    ``test_only=True`` needs only the test split's two files (for
    :meth:`Dataset.train_from_test`); the train arrays are then empty.

    Raises:
        ValueError: unknown dataset, or the sample asked for a dataset other than MNIST.
        MissingDataError, IdxFormatError, ChecksumError: bad ``data_dir`` files.
        DownloadError: Fashion-MNIST is neither cached nor downloadable.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}")
    info = DATASETS[dataset]
    if use_sample:
        if dataset != "mnist":
            raise ValueError(f"the shipped sample is MNIST; it cannot stand in for {dataset}")
        return load_sample()
    splits = ("test",) if test_only else ("train", "test")
    if data_dir is not None:
        files = locate_files(data_dir, info, splits)
        return _from_files(info, files, str(Path(data_dir).expanduser()))
    folder = Path(cache_dir) if cache_dir is not None else course_cache_dir(dataset)
    try:
        if allow_download:
            download(dataset, folder, progress=progress, splits=splits)
        files = locate_files(folder, info, splits)
    except (DownloadError, MissingDataError) as e:
        if dataset != "mnist":
            raise DownloadError(
                f"{dataset} is not in the cache ({folder}) and could not be downloaded. "
                f"Pass --data-dir FOLDER holding its four IDX files.\n{e}"
            ) from e
        log(
            f"data: full MNIST is not in {folder} and could not be downloaded; training on "
            f"the shipped sample of real digits. Fetch the full set with: "
            f"{FETCH_COMMAND.format(dataset=dataset)}"
        )
        return load_sample()
    return _from_files(info, files, f"the cache {folder}")


# --------------------------------------------------------------------------
# Command line: fetch or verify
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m final_project.datasets",
        description="Download MNIST / Fashion-MNIST into the cache, or verify files on disk.",
    )
    p.add_argument("--download", choices=sorted(DATASETS), help="fetch this dataset")
    p.add_argument("--verify", metavar="DIR", help="check the files in DIR (see --dataset)")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="mnist")
    p.add_argument("--cache-dir", help="cache folder (default ~/.cache/cuda-python-course/<ds>)")
    args = p.parse_args(argv)
    if not args.download and not args.verify:
        p.error("give --download DATASET or --verify DIR")
    try:
        if args.download:
            folder = download(args.download, args.cache_dir)
            ds = load_dataset(args.download, data_dir=folder)
        else:
            ds = load_dataset(args.dataset, data_dir=args.verify)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"ok: {ds.source}: {len(ds.train_labels)} train / {len(ds.test_labels)} test "
        f"images, licence: {DATASETS[ds.name].licence}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
