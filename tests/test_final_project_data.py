"""The capstone's data layer: IDX reading, verification, download, sample, batches.

The network is never reached: downloads are served by a local http.server on
127.0.0.1 or by a replaced ``fetch``. Checksums of the real files cannot be
met by made-up bytes, so the tests that download swap in a small fake dataset
(its own MD5s, 40 train / 20 test images) with ``monkeypatch``.
"""

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
import dataclasses
import functools
import gzip
import http.server
import threading
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from final_project import data, datasets
from final_project.data import EpochBatches
from final_project.datasets import (
    ChecksumError,
    DataError,
    DownloadError,
    IdxFormatError,
    MissingDataError,
)

STEMS = [s for pair in datasets.SPLITS.values() for s in pair]
FAKE_SIZES = {"train": 40, "test": 20}


def _write_split_files(folder: Path, rng, compress=True, sizes=FAKE_SIZES) -> dict[str, bytes]:
    """Write the four IDX files of a made-up dataset; return each file's bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    blobs = {}
    for split, (img, lab) in datasets.SPLITS.items():
        n = sizes[split]
        arrays = {
            img: rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
            lab: rng.integers(0, 10, size=(n,), dtype=np.uint8),
        }
        for stem, a in arrays.items():
            path = folder / (stem + (".gz" if compress else ""))
            datasets.write_idx(path, a, compress=compress)
            blobs[stem] = path.read_bytes()
    return blobs


@pytest.fixture
def fake_mnist(tmp_path, rng, monkeypatch):
    """A small made-up "mnist" whose official MD5s are those of files we wrote."""
    served = tmp_path / "served"
    blobs = _write_split_files(served, rng)
    info = dataclasses.replace(
        datasets.DATASETS["mnist"],
        gz_md5={s: datasets.md5_hex(b) for s, b in blobs.items()},
        payload_md5={s: datasets.md5_hex(gzip.decompress(b)) for s, b in blobs.items()},
    )
    monkeypatch.setitem(datasets.DATASETS, "mnist", info)
    monkeypatch.setattr(datasets, "SPLIT_SIZES", FAKE_SIZES)
    return served, blobs


@pytest.fixture
def http_root(tmp_path, monkeypatch):
    """A local HTTP server on 127.0.0.1 serving tmp_path/www; yields its base URL."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _no_network(url, dest, **kwargs):
    raise urllib.error.URLError("network disabled in tests")


# --------------------------------------------------------------------------
# IDX reader
# --------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("shape", [(1,), (7,), (1, 28, 28), (5, 28, 28), (3, 4, 5)])
def test_idx_round_trip(tmp_path, rng, compress, shape):
    a = rng.integers(0, 256, size=shape, dtype=np.uint8)
    path = tmp_path / "x.idx"
    datasets.write_idx(path, a, compress=compress)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == compress
    b = datasets.read_idx(path)
    assert b.dtype == np.uint8 and b.shape == shape
    np.testing.assert_array_equal(a, b)


def test_idx_round_trip_on_real_digits(tmp_path):
    sample = datasets.load_sample()
    for compress in (False, True):
        datasets.write_idx(tmp_path / "img", sample.test_images, compress=compress)
        datasets.write_idx(tmp_path / "lab", sample.test_labels, compress=compress)
        np.testing.assert_array_equal(datasets.read_idx(tmp_path / "img"), sample.test_images)
        np.testing.assert_array_equal(datasets.read_idx(tmp_path / "lab"), sample.test_labels)
    raw = (tmp_path / "img").read_bytes()
    assert gzip.decompress(raw)[:4] == bytes([0, 0, 8, 3])  # the images' IDX magic


def test_corrupt_magic_is_a_clear_error(tmp_path, rng):
    a = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    path = tmp_path / "bad-idx3-ubyte"
    datasets.write_idx(path, a)
    raw = bytearray(path.read_bytes())
    raw[2] = 0x0D  # float32 type code: not uint8
    path.write_bytes(bytes(raw))
    with pytest.raises(IdxFormatError, match=r"bad-idx3-ubyte: bad IDX magic number 0x00000d03"):
        datasets.read_idx(path)
    path.write_bytes(b"PK\x03\x04" + bytes(100))  # a zip file, not IDX
    with pytest.raises(IdxFormatError, match="magic"):
        datasets.read_idx(path)
    path.write_bytes(b"\x00\x00")
    with pytest.raises(IdxFormatError, match="too short"):
        datasets.read_idx(path)


@pytest.mark.parametrize("cut", [1, 784, 784 * 3 + 5])
def test_truncated_idx_is_a_clear_error(tmp_path, rng, cut):
    a = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    path = tmp_path / "t10k-images-idx3-ubyte"
    datasets.write_idx(path, a)
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(IdxFormatError, match=r"truncated.*\(4, 28, 28\)"):
        datasets.read_idx(path)
    # Too long is wrong too: the header and the payload disagree.
    datasets.write_idx(path, a)
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(IdxFormatError, match="longer than its header"):
        datasets.read_idx(path)


def test_truncated_gzip_is_a_clear_error(tmp_path, rng):
    a = rng.integers(0, 256, size=(20, 28, 28), dtype=np.uint8)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    datasets.write_idx(path, a, compress=True)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(IdxFormatError, match=r"gzip stream is truncated or corrupt"):
        datasets.read_idx(path)


# --------------------------------------------------------------------------
# Files on disk: --data-dir
# --------------------------------------------------------------------------


def test_missing_data_dir_is_an_error(tmp_path):
    with pytest.raises(MissingDataError, match="no such directory"):
        datasets.load_dataset("mnist", data_dir=tmp_path / "nope")


def test_data_dir_without_the_files_is_an_error_not_a_fallback(tmp_path, rng, fake_mnist):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingDataError, match="t10k-labels-idx1-ubyte") as e:
        datasets.load_dataset("mnist", data_dir=tmp_path / "empty")
    assert "MNIST/raw" in str(e.value)  # says where it looked
    served, _ = fake_mnist
    (served / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(MissingDataError, match=r"train-labels-idx1-ubyte\[\.gz\]") as e:
        datasets.load_dataset("mnist", data_dir=served)
    assert "t10k" not in str(e.value).split("(looked")[0]  # names only what is missing


def test_test_only_needs_only_the_t10k_files(tmp_path, rng, fake_mnist):
    served, _ = fake_mnist
    for stem in datasets.SPLITS["train"]:
        (served / (stem + ".gz")).unlink()
    with pytest.raises(MissingDataError, match="needs only the two t10k files"):
        datasets.load_dataset("mnist", data_dir=served)
    ds = datasets.load_dataset("mnist", data_dir=served, test_only=True).train_from_test(15)
    assert ds.train_images.shape == (15, 28, 28) and ds.test_labels.shape == (5,)


def test_data_dir_flat_gz_raw_and_torchvision_layouts(tmp_path, rng, fake_mnist):
    served, blobs = fake_mnist
    ds = datasets.load_dataset("mnist", data_dir=served)
    assert ds.train_images.shape == (40, 28, 28) and ds.test_labels.shape == (20,)
    np.testing.assert_array_equal(
        ds.test_labels,
        np.frombuffer(gzip.decompress(blobs["t10k-labels-idx1-ubyte"])[8:], np.uint8),
    )
    # torchvision: DIR/MNIST/raw/ holding raw (decompressed) files
    raw_dir = tmp_path / "tv" / "MNIST" / "raw"
    raw_dir.mkdir(parents=True)
    for stem, blob in blobs.items():
        (raw_dir / stem).write_bytes(gzip.decompress(blob))
    ds2 = datasets.load_dataset("mnist", data_dir=tmp_path / "tv")
    np.testing.assert_array_equal(ds.train_images, ds2.train_images)
    # Recompressed (other .gz bytes, same payload) is accepted through the payload MD5.
    re_dir = tmp_path / "recompressed"
    re_dir.mkdir()
    for stem, blob in blobs.items():
        (re_dir / (stem + ".gz")).write_bytes(gzip.compress(gzip.decompress(blob), 1, mtime=7))
        assert (re_dir / (stem + ".gz")).read_bytes() != blob
    ds3 = datasets.load_dataset("mnist", data_dir=re_dir)
    np.testing.assert_array_equal(ds.train_labels, ds3.train_labels)


def test_data_dir_checksum_mismatch_is_an_error(tmp_path, rng, fake_mnist):
    served, _ = fake_mnist
    # Structurally perfect (20 labels 0-9) but not the official bytes.
    datasets.write_idx(
        served / "t10k-labels-idx1-ubyte.gz",
        rng.integers(0, 10, size=20, dtype=np.uint8),
        compress=True,
    )
    with pytest.raises(ChecksumError, match=r"t10k-labels-idx1-ubyte\.gz: checksum mismatch"):
        datasets.load_dataset("mnist", data_dir=served)


def test_data_dir_wrong_shapes_are_errors(tmp_path, rng, monkeypatch):
    # MNIST train-images has no payload MD5 here, so only its structure can be checked.
    monkeypatch.setattr(datasets, "SPLIT_SIZES", FAKE_SIZES)
    info = datasets.DATASETS["mnist"]
    path = tmp_path / "train-images-idx3-ubyte"
    datasets.write_idx(path, rng.integers(0, 256, size=(40, 28, 27), dtype=np.uint8))
    with pytest.raises(IdxFormatError, match=r"shape \(40, 28, 27\), expected \(40, 28, 28\)"):
        datasets.verify_and_read(path, info, "train-images-idx3-ubyte")
    datasets.write_idx(path, rng.integers(0, 256, size=(39, 28, 28), dtype=np.uint8))
    with pytest.raises(IdxFormatError, match="expected"):
        datasets.verify_and_read(path, info, "train-images-idx3-ubyte")
    datasets.write_idx(path, rng.integers(0, 256, size=(40, 28, 28), dtype=np.uint8))
    assert datasets.verify_and_read(path, info, "train-images-idx3-ubyte").shape == (40, 28, 28)


def test_real_payload_checksums_reject_a_swapped_dataset(tmp_path):
    # The real MNIST test labels' payload MD5 is known: the sample's labels
    # written as a 10,000-long file must not pass for it.
    labels = np.resize(datasets.load_sample().test_labels, 10_000)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    datasets.write_idx(path, labels)
    with pytest.raises(ChecksumError, match="official mnist t10k-labels"):
        datasets.verify_and_read(path, datasets.DATASETS["mnist"], "t10k-labels-idx1-ubyte")
    with pytest.raises(ChecksumError):
        datasets.verify_and_read(path, datasets.DATASETS["fashion-mnist"], "t10k-labels-idx1-ubyte")


# --------------------------------------------------------------------------
# Download: mirrors, MD5, atomic writes (network mocked)
# --------------------------------------------------------------------------


def test_download_falls_back_across_mirrors_over_http(tmp_path, fake_mnist, http_root, monkeypatch):
    served, blobs = fake_mnist
    www, base = http_root
    (www / "good").mkdir()
    (www / "corrupt").mkdir()
    for stem, blob in blobs.items():
        (www / "good" / (stem + ".gz")).write_bytes(blob)
        (www / "corrupt" / (stem + ".gz")).write_bytes(blob[:-10] + bytes(10))
    mirrors = (base + "missing/", base + "corrupt/", base + "good/")
    info = dataclasses.replace(datasets.DATASETS["mnist"], mirrors=mirrors)
    monkeypatch.setitem(datasets.DATASETS, "mnist", info)
    cache = tmp_path / "cache"
    ds = datasets.load_dataset(
        "mnist",
        cache_dir=cache,
        progress=False,
        log=lambda s: pytest.fail(f"fell back to the sample: {s}"),
    )
    assert not ds.is_sample and "cache" in ds.source
    assert sorted(p.name for p in cache.iterdir()) == sorted(s + ".gz" for s in STEMS)
    for stem, blob in blobs.items():
        assert (cache / (stem + ".gz")).read_bytes() == blob


def test_download_error_lists_every_mirror_and_leaves_no_file(tmp_path, fake_mnist, http_root):
    _, blobs = fake_mnist
    www, base = http_root
    (www / "corrupt").mkdir()
    stem = "t10k-labels-idx1-ubyte"
    (www / "corrupt" / (stem + ".gz")).write_bytes(blobs[stem][::-1])
    info = datasets.DATASETS["mnist"]
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError) as e:
        datasets.download_file(
            info, stem, cache, mirrors=(base + "missing/", base + "corrupt/"), progress=False
        )
    msg = str(e.value)
    assert "404" in msg and "checksum mismatch" in msg and "--data-dir" in msg
    assert list(cache.iterdir()) == []  # neither the corrupt file nor a temp file remains


def test_interrupted_download_leaves_no_partial_file(tmp_path, fake_mnist, monkeypatch):
    _, blobs = fake_mnist
    stem = "train-images-idx3-ubyte"
    calls = []

    def flaky_fetch(url, dest, **kwargs):
        calls.append(url)
        dest.write(blobs[stem][:1000])  # half a file, then the connection drops
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(datasets, "fetch", flaky_fetch)
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match="connection reset"):
        datasets.download_file(datasets.DATASETS["mnist"], stem, cache, progress=False)
    assert len(calls) == len(datasets.DATASETS["mnist"].mirrors)  # every mirror was tried
    assert list(cache.iterdir()) == []


def test_downloaded_checksum_mismatch_is_rejected(tmp_path, monkeypatch):
    # The real MD5s: a "download" serving anything else must fail.
    def wrong_bytes(url, dest, **kwargs):
        dest.write(gzip.compress(b"\x00\x00\x08\x01" + (3).to_bytes(4, "big") + b"\x01\x02\x03"))

    monkeypatch.setattr(datasets, "fetch", wrong_bytes)
    with pytest.raises(DownloadError, match="checksum mismatch") as e:
        datasets.download("fashion-mnist", tmp_path / "cache", progress=False)
    assert "ec29112d" not in str(e.value) and "8d4fb7e6c68d591d4c3dfef9ec88bf0d" in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_no_network_falls_back_to_the_sample_and_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "fetch", _no_network)
    lines = []
    ds = datasets.load_dataset("mnist", cache_dir=tmp_path / "cache", log=lines.append)
    assert ds.is_sample and len(lines) == 1
    assert "python -m final_project.datasets --download mnist" in lines[0]
    # Fashion-MNIST has no sample to fall back on: an error that says what to do.
    with pytest.raises(DownloadError, match="--data-dir"):
        datasets.load_dataset("fashion-mnist", cache_dir=tmp_path / "cache2", log=lines.append)


def test_cached_files_are_used_without_network(tmp_path, fake_mnist, monkeypatch):
    served, _ = fake_mnist
    monkeypatch.setattr(datasets, "fetch", _no_network)
    ds = datasets.load_dataset("mnist", cache_dir=served, log=pytest.fail)
    assert not ds.is_sample and len(ds.train_labels) == 40


def test_data_cli_verify(tmp_path, fake_mnist, capsys):
    served, _ = fake_mnist
    assert datasets.main(["--verify", str(served)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert datasets.main(["--verify", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err


# --------------------------------------------------------------------------
# The shipped sample, splits, normalisation, batches
# --------------------------------------------------------------------------


def test_shipped_sample_is_real_mnist():
    ds = datasets.load_sample()
    assert ds.is_sample and ds.name == "mnist"
    assert ds.train_images.shape == (1700, 28, 28) and ds.test_images.shape == (300, 28, 28)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.uint8
    assert np.bincount(ds.train_labels, minlength=10).min() > 100  # every class present
    assert set(np.unique(ds.test_labels)) == set(range(10))
    # Real digits: dark background, bright strokes, mean near MNIST's 0.1307.
    assert abs(ds.train_images.mean() / 255 - 0.1307) < 0.01
    assert (ds.train_images[:, 0, :] == 0).mean() > 0.99
    with np.load(datasets.SAMPLE_PATH) as z:
        idx = np.concatenate([z["train_index"], z["test_index"]])
    assert len(np.unique(idx)) == 2000 and idx.max() < 10_000


def test_train_from_test_split():
    ds = datasets.load_sample()
    cut = ds.train_from_test(200)
    np.testing.assert_array_equal(cut.train_images, ds.test_images[:200])
    np.testing.assert_array_equal(cut.test_labels, ds.test_labels[200:])
    assert "200 train / 100 test" in cut.source
    for bad in (0, 300, 1000, -5):
        with pytest.raises(ValueError, match="--train-from-test"):
            ds.train_from_test(bad)


def test_normalise():
    ds = datasets.load_sample()
    x = data.normalise(ds.train_images, ds.mean, ds.std)
    assert x.dtype == np.float32 and x.shape == (1700, 1, 28, 28)
    ref = (ds.train_images.astype(np.float64) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x[:, 0], ref, rtol=1e-6, atol=1e-6)
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05
    with pytest.raises(ValueError, match="uint8"):
        data.normalise(ds.train_images.astype(np.float32), 0.1, 0.3)


@pytest.mark.parametrize("batch_size,drop_last", [(7, True), (7, False), (30, True), (1, True)])
def test_epoch_batches_shuffle_and_copy(rng, batch_size, drop_last):
    n = 30
    images = rng.standard_normal((n, 1, 4, 5)).astype(np.float32)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    eb = EpochBatches(images, labels, batch_size, drop_last=drop_last)
    expected_batches = n // batch_size if drop_last else -(-n // batch_size)
    assert len(eb) == expected_batches
    seen = []
    for epoch_seed in (1, 2):
        eb.prepare(np.random.default_rng(epoch_seed))
        order = eb.order.copy()
        for i in range(len(eb)):
            x_dev, y_dev = eb.to_device(i)
            x, y = x_dev.copy_to_host(), y_dev.copy_to_host()
            idx = order[i * batch_size : i * batch_size + len(y)]
            np.testing.assert_array_equal(x, images[idx])
            np.testing.assert_array_equal(y, labels[idx].astype(np.int32))
            assert y.dtype == np.int32 and x.flags.c_contiguous
        seen.append(order)
        assert sorted(order) == list(range(n))  # a permutation: each image once per epoch
    assert not np.array_equal(seen[0], seen[1])
    # The same seed gives the same batches (the twin comparison relies on it).
    eb.prepare(np.random.default_rng(1))
    np.testing.assert_array_equal(eb.order, seen[0])


def test_epoch_batches_bad_inputs(rng):
    images = rng.standard_normal((10, 1, 4, 4)).astype(np.float32)
    labels = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="normalise"):
        EpochBatches(images.astype(np.float64), labels, 4)
    with pytest.raises(ValueError, match="labels"):
        EpochBatches(images, labels[:9], 4)
    with pytest.raises(ValueError, match="smaller --batch-size"):
        EpochBatches(images, labels, 11)


def test_data_errors_share_a_base_class():
    for cls in (IdxFormatError, ChecksumError, MissingDataError, DownloadError):
        assert issubclass(cls, DataError)
