"""The capstone's command lines and training loop, in the simulator at tiny sizes.

``final_project.train``'s simulator default (real digits shrunk to 8x8, 16
steps; run once for the module) must print a falling loss step by step and an
accuracy above chance on 300 test images, and write a checkpoint into a fresh
run folder that ``--evaluate`` loads; an earlier checkpoint is never
overwritten; ``final_project.compare`` must run and write its JSON; ``--check``
must catch a broken kernel; bad inputs must give argparse errors before any
work. The network is never reached (``fetch`` is replaced).
"""

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
from common.checking import CheckError
from common.internal import racecheck
from common.runtime import is_simulator

import json
import urllib.error

import numpy as np
import pytest
from numba import cuda

from final_project import checks, data, datasets, kernels
from final_project import compare as fcompare
from final_project import train as ftrain
from final_project.model import NetConfig, NumbaCNN, init_params

# The simulator's default run's sizes: a step is about 12,000 simulated threads.
TINY_CONFIG = NetConfig(
    height=ftrain.TINY.image_size,
    width=ftrain.TINY.image_size,
    c1=ftrain.TINY.c1,
    c2=ftrain.TINY.c2,
    hidden=ftrain.TINY.hidden,
)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, an empty cache: MNIST falls back to the shipped sample."""

    monkeypatch.setattr(datasets, "fetch", _no_network)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _tiny_batch(n: int, offset: int = 0):
    ds = datasets.load_sample()
    x = data.normalise(
        data.shrink(ds.train_images[offset : offset + n], TINY_CONFIG.height), ds.mean, ds.std
    )
    return np.ascontiguousarray(x), ds.train_labels[offset : offset + n].astype(np.int32)


def _no_network(url, dest, **kwargs):
    raise urllib.error.URLError("network disabled in tests")


def _must_not_run(*args, **kwargs):
    raise AssertionError("work started before the options were checked")


# --------------------------------------------------------------------------
# train: the default run, checkpoints, --evaluate
# --------------------------------------------------------------------------


@pytest.fixture
def default_run(tmp_path_factory):
    """``python -m final_project.train`` with no options, once for the module.

    Offline (the shipped sample), from an empty folder holding an earlier run's
    ``runs/final_project/run-001/``, which must survive untouched. Returns
    (what it printed, the folder it ran in).
    """
    import contextlib
    import io
    import os

    root = tmp_path_factory.mktemp("default_run")
    earlier = root / "runs" / "final_project" / "run-001"
    earlier.mkdir(parents=True)
    (earlier / "checkpoint.npz").write_bytes(b"an earlier run")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets, "fetch", _no_network)
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        mp.chdir(root)
        with contextlib.redirect_stdout(printed):
            code = ftrain.main([] if is_simulator() else ["--tiny"])
    assert code == 0, printed.getvalue()
    assert os.path.isdir(root / "runs" / "final_project" / "run-002")
    return printed.getvalue(), root


def test_default_run(default_run, capsys):
    """The quick start's run, once (30 s of simulator time): what it prints, then
    its folder and checkpoint. One test, so that -n auto never runs it twice."""
    check_default_run_prints_a_falling_loss_and_a_believable_accuracy(default_run)
    check_default_run_gets_a_fresh_folder_that_evaluate_loads(default_run, capsys)


def check_default_run_prints_a_falling_loss_and_a_believable_accuracy(default_run):
    printed, _ = default_run
    steps = ftrain.TINY.epochs * (ftrain.TINY.n_train // ftrain.TINY.batch_size)
    losses = [
        float(line.rsplit("mean loss ", 1)[1])
        for line in printed.splitlines()
        if line.startswith("steps ")
    ]
    # a line every log_every steps, though stdout is no terminal
    assert len(losses) == steps // ftrain.TINY.log_every, printed
    # Falls: the last quarter's mean is clearly below the first quarter's.
    q = len(losses) // 4
    assert np.mean(losses[-q:]) < np.mean(losses[:q]) - 0.05, losses
    accuracy = float(printed.split("test accuracy ")[-1].split("%")[0])
    # On 300 images, 10% is chance (binomial std 1.7 points); the run is
    # deterministic and ends near 44%, so 30% is far above chance and below it.
    assert f"on {ftrain.TINY.n_test} images" in printed
    assert accuracy >= 30, printed
    assert (
        "shipped sample" in printed
        and "python -m final_project.datasets --download mnist" in printed
    )
    assert printed.count("python -m final_project.datasets --download mnist") == 1
    assert "NetConfig(" not in printed and "simulator (simulator)" not in printed


def check_default_run_gets_a_fresh_folder_that_evaluate_loads(default_run, capsys):
    printed, root = default_run
    earlier = root / "runs" / "final_project" / "run-001" / "checkpoint.npz"
    assert earlier.read_bytes() == b"an earlier run"  # not overwritten
    out = root / "runs" / "final_project" / "run-002"
    assert f"--evaluate {out.relative_to(root) / 'checkpoint.npz'}" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, ftrain.TINY.epochs + 1))
    assert all(np.isfinite(h["train_loss"]) for h in metrics["history"])
    assert metrics["is_sample"] and metrics["config"]["height"] == ftrain.TINY.image_size

    config, state, meta = ftrain.load_checkpoint(out / "checkpoint.npz")
    assert config == NetConfig(**metrics["config"]) and meta["tiny"]
    assert state["conv1.weight"].shape == (ftrain.TINY.c1, 1, 3, 3)
    assert not np.allclose(state["conv1.weight"], init_params(config, 0)["conv1.weight"])

    assert ftrain.main(["--sample", "--evaluate", str(out / "checkpoint.npz")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # Evaluation is deterministic: the same accuracy as at the end of training.
    assert f"test accuracy {metrics['history'][-1]['test_accuracy']:.2f}%" in line
    assert f"on {ftrain.TINY.n_test} images" in line


def test_fresh_run_dir_numbers_after_the_highest(tmp_path):
    assert ftrain.fresh_run_dir(tmp_path / "runs").name == "run-001"  # creates the parent
    (tmp_path / "runs" / "run-007").mkdir()
    (tmp_path / "runs" / "run-notes").mkdir()
    assert ftrain.fresh_run_dir(tmp_path / "runs").name == "run-008"
    assert (tmp_path / "runs" / "run-008").is_dir()


def test_an_earlier_checkpoint_in_out_is_refused_before_anything_runs(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "checkpoint.npz").write_bytes(b"an earlier run")
    monkeypatch.setattr(ftrain, "load_data", _must_not_run)
    with pytest.raises(SystemExit) as e:
        ftrain.main(["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "earlier run" in err and "--overwrite" in err
    assert (tmp_path / "checkpoint.npz").read_bytes() == b"an earlier run"


def test_checkpoint_round_trip_and_bad_checkpoints(tmp_path):
    model = NumbaCNN(TINY_CONFIG, max_batch=2, seed=3)
    ftrain.save_checkpoint(tmp_path / "c.npz", model, {"dataset": "mnist"})
    assert not list(tmp_path.glob("*.part*"))  # written atomically
    config, state, meta = ftrain.load_checkpoint(tmp_path / "c.npz")
    assert config == TINY_CONFIG and meta["dataset"] == "mnist"
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(state[name], value)
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a final_project checkpoint"):
        ftrain.load_checkpoint(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ftrain.load_checkpoint(tmp_path / "missing.npz")
    assert ftrain.main(["--evaluate", str(tmp_path / "missing.npz")]) == 1


def test_loss_falls_on_the_shipped_real_digits():
    # Four plain-SGD steps on the same 8 real digits: the loss must drop
    # clearly (a model whose update or gradients are wrong does not).
    x, y = _tiny_batch(8)
    model = NumbaCNN(TINY_CONFIG, max_batch=8, seed=0)
    x_dev, y_dev = cuda.to_device(x), cuda.to_device(y)
    losses = []
    with racecheck.first_launch_of_each_kernel():  # about learning, as in the training loop
        for _ in range(5):
            model.train_step(x_dev, y_dev, lr=0.2)
            losses.append(float(model.loss.copy_to_host()[0]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses


# --------------------------------------------------------------------------
# --check: the step against the float64 reference
# --------------------------------------------------------------------------


def test_check_step_passes_for_the_real_kernels():
    x, y = _tiny_batch(4, offset=100)
    model = NumbaCNN(TINY_CONFIG, max_batch=4, seed=1)
    errors = checks.check_train_step(model, x, y, lr=0.1)
    assert max(errors.values()) < checks.TOL and "grad conv1.weight" in errors, errors


def test_train_cli_check_path(offline, capsys, monkeypatch):
    checked = []
    real = ftrain.check_train_step

    def spy(*args, **kwargs):
        checked.append(real(*args, **kwargs))
        return checked[-1]

    monkeypatch.setattr(ftrain, "check_train_step", spy)
    argv = [
        "--out",
        str(offline / "c"),
        "--sample",
        "--check",
        "--check-every",
        "2",
        "--max-steps",
        "2",
        "--tiny",
    ]
    assert ftrain.main(argv) == 0
    assert len(checked) == 1  # step 0 checked, step 1 plain
    assert "checked every 2 steps" in capsys.readouterr().out
    history = json.loads((offline / "c" / "metrics.json").read_text())["history"]
    assert history[0]["steps"] == 2 and len(history[0]["losses"]) == 2
    assert all(np.isfinite(history[0]["losses"]))


def _relu_backward_without_mask(dy, x, dx):
    dx.copy_to_device(dy)  # passes every gradient through


def _sgd_update_that_does_nothing(params, grads, lr):
    pass


def test_check_step_catches_a_broken_gradient(monkeypatch):
    monkeypatch.setattr(kernels, "relu_backward", _relu_backward_without_mask)
    x, y = _tiny_batch(4, offset=200)
    model = NumbaCNN(TINY_CONFIG, max_batch=4, seed=1)
    with pytest.raises(CheckError, match="grad "):
        checks.check_train_step(model, x, y, lr=0.1)


def test_check_step_catches_a_missing_update(monkeypatch):
    monkeypatch.setattr(kernels, "sgd_update", _sgd_update_that_does_nothing)
    x, y = _tiny_batch(4, offset=300)
    model = NumbaCNN(TINY_CONFIG, max_batch=4, seed=1)
    with pytest.raises(CheckError, match="after step"):
        checks.check_train_step(model, x, y, lr=0.1)


def test_train_cli_check_stops_on_a_broken_kernel(offline, capsys, monkeypatch):
    monkeypatch.setattr(kernels, "relu_backward", _relu_backward_without_mask)
    argv = [
        "--out",
        str(offline / "c"),
        "--sample",
        "--check",
        "--check-every",
        "2",
        "--max-steps",
        "1",
        "--tiny",
        "--kernels",
        "naive",  # the broken kernel is a naive one (a GPU's default is the fast set)
    ]
    assert ftrain.main(argv) == 1
    assert "--check failed: step 1 disagrees with the float64 reference" in capsys.readouterr().err


# --------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------


def test_compare_tiny_writes_json_and_plot(offline, capsys):
    out = offline / "cmp"
    argv = [
        "--out",
        str(out),
        "--sample",
        "--epochs",
        "1",
        "--max-steps",
        "2",
        "--time-steps",
        "1",
        "--time-batch-sizes",
        "8",
        "--loss-every",
        "1",
    ]
    assert fcompare.main(argv + ([] if is_simulator() else ["--tiny"])) == 0
    printed = capsys.readouterr().out
    assert "the timings say nothing about a GPU" in printed or not is_simulator()
    result = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").stat().st_size > 1000
    run = result["accuracy_run"]
    assert [len(run["curves"][k]) for k in ("numba", "torch")] == [2, 2]
    # Same weights, same first batch: the same first loss (before any update).
    (s0, numba0), (_, torch0) = run["curves"]["numba"][0], run["curves"]["torch"][0]
    assert s0 == 1 and abs(numba0 - torch0) < 1e-4 * abs(torch0)
    for k in ("numba", "torch"):
        assert 0 <= run[k][-1]["test_accuracy"] <= 100
    assert [r["batch_size"] for r in result["timing"]] == [8]
    if is_simulator():
        assert result["timing"][0]["ms"] == {"numba naive eager": None, "torch eager": None}
    assert result["device"] and result["config"]["c1"] == ftrain.TINY.c1


def test_compare_bad_batch_sizes_are_rejected():
    for argv in (["--time-batch-sizes", "64,zero"], ["--time-batch-sizes", "0"], ["--epochs", "0"]):
        with pytest.raises(SystemExit) as e:
            fcompare.main(argv)
        assert e.value.code == 2


def test_compare_timing_only_skips_the_accuracy_run(offline, monkeypatch, capsys):
    # Only the path through main: training must not start, timing must.
    timed = []
    monkeypatch.setattr(ftrain, "train", _must_not_run)
    monkeypatch.setattr(
        fcompare, "time_steps", lambda *a, **k: timed.append(a[3]) or {"batch_size": a[3], "ms": {}}
    )
    out = offline / "cmp"
    argv = ["--timing-only", "--sample", "--out", str(out), "--time-batch-sizes", "8"]
    assert fcompare.main(argv + ([] if is_simulator() else ["--tiny"])) == 0
    result = json.loads((out / "compare.json").read_text())
    assert timed == [8] and result["accuracy_run"]["epochs"] == 0
    assert result["accuracy_run"]["curves"] == {"numba": [], "torch": []}


# --------------------------------------------------------------------------
# Bad inputs: clear errors, before any kernel runs
# --------------------------------------------------------------------------


def test_wrong_batches_into_the_model_are_clear_errors():
    model = NumbaCNN(TINY_CONFIG, max_batch=4, seed=0)
    x, y = _tiny_batch(4)
    x_dev, y_dev = cuda.to_device(x), cuda.to_device(y)
    cases = [
        ((cuda.to_device(x[:, 0]), y_dev), "NCHW"),  # no channel axis
        ((cuda.to_device(np.zeros((4, 1, 28, 28), np.float32)), y_dev), r"expected \(N, 1, 8, 8\)"),
        ((cuda.to_device(x.astype(np.float64)), y_dev), "float32"),
        ((x_dev, cuda.to_device(y.astype(np.int64))), "int32"),
        ((x_dev, y_dev[:3]), "one label per image"),
        (
            (cuda.to_device(np.concatenate([x, x])), cuda.to_device(np.concatenate([y, y]))),
            "max_batch",
        ),
    ]
    for (xb, yb), message in cases:
        with pytest.raises(ValueError, match=message):
            model.train_step(xb, yb, lr=0.1)
    with pytest.raises(TypeError, match="host"):  # NumPy, not on the device
        model.train_step(x, y, lr=0.1)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--data-dir", "/nonexistent/mnist"], "no such directory"),
        (["--dataset", "fashion-mnist"], "--data-dir"),
        (["--sample", "--train-from-test", "300"], "need 0 < N < 300"),
        (["--sample", "--batch-size", "5000", "--no-tiny"], "smaller --batch-size"),
    ],
)
def test_train_cli_errors(offline, capsys, argv, message):
    assert ftrain.main(argv) == 1
    assert message in capsys.readouterr().err


def test_train_cli_data_dir_without_files_is_an_error(offline, capsys):
    (offline / "empty").mkdir()
    assert ftrain.main(["--data-dir", str(offline / "empty")]) == 1
    err = capsys.readouterr().err
    assert "does not hold the mnist files" in err and "train-images-idx3-ubyte" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
        (["--epochs", "-1"], "argument --epochs: must be >= 1, got -1"),
        (["--c1", "0"], "argument --c1: must be >= 1, got 0"),
        (["--c2", "0"], "argument --c2: must be >= 1, got 0"),
        (["--hidden", "0"], "argument --hidden: must be >= 1, got 0"),
        (["--max-steps", "0"], "argument --max-steps: must be >= 1, got 0"),
        (["--check", "--check-every", "0"], "argument --check-every: must be >= 1, got 0"),
        (["--sample", "--train-from-test", "0"], "argument --train-from-test: must be >= 1"),
        (["--batch-size", "8.5"], "expected a whole number >= 1, got '8.5'"),
        (["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
        (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
        (["--sample", "--data-dir", "x"], "give either --sample or --data-dir, not both"),
    ],
)
def test_train_cli_rejects_bad_options_before_any_work(argv, message, capsys, monkeypatch):
    # A bad value is an argparse error (exit status 2) that names the option and
    # what it accepts; it is never replaced by a default, and nothing runs.
    monkeypatch.setattr(ftrain, "load_data", _must_not_run)
    with pytest.raises(SystemExit) as e:
        ftrain.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "python -m final_project.train: error:" in err and message in err, err


def test_train_help_shows_both_defaults_without_markup(capsys):
    with pytest.raises(SystemExit) as e:
        ftrain.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text
    assert f"(default {ftrain.DEFAULT_BATCH} / {ftrain.TINY.batch_size})" in text


def test_compare_timing_windows_path(monkeypatch):
    # The GPU branch of the timing loop, exercised here (the simulator's events
    # return meaningless times; only the path and the bookkeeping are checked).
    monkeypatch.setattr(common, "is_simulator", lambda: False)
    calls = []
    times = fcompare._time_windows(calls.append, steps=3, windows=2, warmup=1, on_gpu=True)
    assert calls == [1, 3, 3] and len(times) == 2
    calls.clear()
    times = fcompare._time_windows(calls.append, steps=2, windows=3, warmup=0, on_gpu=False)
    assert calls == [0, 2, 2, 2] and all(t >= 0 for t in times) and len(times) == 3
    rows = [
        {
            "batch_size": b,
            "ms": {"numba fast graph": ms, "torch eager": 2 * ms, "torch cuda-graph": None},
            "best_torch": "torch eager",
            "fast_graph_over_best_torch": 0.5,
        }
        for b, ms in ((64, 0.25), (1024, 2.5))
    ]
    table = fcompare.format_timing_table(rows, "H100", "cuda").splitlines()
    assert "batch 64" in table[1] and "batch 1024" in table[1]
    assert table[2].split() == ["numba", "fast", "graph", "0.250", "2.500"]
    assert table[4].split() == ["torch", "cuda-graph", "-", "-"]  # not run: a dash
    assert table[5].split()[-2:] == ["0.50x", "0.50x"] and table[6].split()[-1] == "eager"
