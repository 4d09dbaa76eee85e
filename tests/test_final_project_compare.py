"""final_project.compare's pieces that need no GPU: the per-stage work table
against the model's stage table, and the timing harness's calling convention
(the timings themselves need a GPU; tests/test_final_project_cli.py runs the
command's tiny path)."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

import inspect

import numpy as np
import pytest
import torch

from final_project import compare
from final_project.fast_model import STAGES
from final_project.model import NetConfig
from final_project.torch_configs import make_torch_step

TINY = NetConfig(height=8, width=8, c1=3, c2=5, hidden=7, num_classes=4)


def test_stage_work_has_the_model_stages_in_order():
    work = compare.stage_work(NetConfig(), 64)
    assert tuple(work) == STAGES
    flops, nbytes = work["conv2 forward"]
    assert flops == 2 * 64 * 14 * 14 * 64 * 32 * 9  # a multiply-add is 2 flops


def test_stage_work_refuses_a_stage_it_does_not_know(monkeypatch):
    """A stage added to the model's table without its work here is an error, not
    a row the roofline and the per-stage table silently lack."""
    monkeypatch.setattr(compare, "STAGES", (*STAGES, "fc3 forward"))
    with pytest.raises(RuntimeError, match="fc3 forward"):
        compare.stage_work(TINY, 2)


def test_time_steps_takes_its_protocol_by_keyword():
    """Only the data come by position: 50, 5, 20 in a call say nothing."""
    params = inspect.signature(compare.time_steps).parameters
    by_position = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in by_position] == ["config", "images", "labels", "batch_size"]
    with pytest.raises(TypeError):
        compare.time_steps(TINY, None, None, 4, 0.05, 0, 50, 5, 20, torch.device("cpu"), [])


def test_time_batch_sizes_times_each_size_the_data_fills(monkeypatch):
    calls, lines = [], []

    def fake_time_steps(config, images, labels, batch_size, **kw):
        calls.append((batch_size, kw))
        return {"batch_size": batch_size, "ms": {}}

    monkeypatch.setattr(compare, "time_steps", fake_time_steps)
    images = np.zeros((10, 1, 8, 8), np.float32)
    labels = np.zeros(10, np.int32)
    rows = compare.time_batch_sizes(
        TINY,
        images,
        labels,
        [2, 16, 10],
        lr=0.05,
        seed=3,
        device=torch.device("cpu"),
        log=lines.append,
    )
    assert [r["batch_size"] for r in rows] == [2, 10]
    assert lines == ["timing: skipping batch 16: only 10 training images"]
    kw = calls[0][1]
    assert (kw["lr"], kw["seed"], kw["configs"]) == (0.05, 3, compare.all_configs(kw["device"]))
    assert (kw["steps"], kw["windows"], kw["warmup"], kw["naive_steps"]) == (
        compare.TIME_STEPS,
        compare.TIME_WINDOWS,
        compare.TIME_WARMUP,
        compare.NAIVE_STEPS,
    )


def test_all_configs_lists_ours_then_torchs():
    configs = compare.all_configs(torch.device("cpu"))
    assert configs[: len(compare.OURS)] == list(compare.OURS)
    assert configs[len(compare.OURS) :] and all(
        c.startswith("torch ") for c in configs[len(compare.OURS) :]
    )


def test_benchmark_variants_only_where_cudnn_runs(monkeypatch):
    cpu = compare.all_configs(torch.device("cpu"))
    assert not any(c.endswith(compare.BENCHMARK) for c in cpu)
    monkeypatch.setattr(compare, "available_configs", lambda device: ("eager", "cuda-graph"))
    gpu = compare.all_configs(torch.device("cuda"))
    assert gpu[len(compare.OURS) :] == [
        "torch eager",
        "torch eager +benchmark",
        "torch cuda-graph",
        "torch cuda-graph +benchmark",
    ]
    assert [compare.torch_step_args(c) for c in gpu[len(compare.OURS) :]] == [
        ("eager", False, None),
        ("eager", True, None),
        ("cuda-graph", False, None),
        ("cuda-graph", True, None),
    ]


def test_bf16_autocast_rows_come_with_our_tf32(monkeypatch):
    """With ours in TF32, each torch configuration also runs under BF16 autocast,
    with and without +benchmark on a GPU; the names parse to make_torch_step's
    arguments. Ours in FP32, and the tiny run, have none."""
    cpu = torch.device("cpu")
    assert not any(compare.AUTOCAST in c for c in compare.all_configs(cpu))
    assert not any(
        compare.AUTOCAST in c for c in compare.runnable_configs(cpu, tiny=False, precision="fp32")
    )
    assert compare.runnable_configs(cpu, tiny=True, precision="tf32") == [
        "numba naive eager",
        "torch eager",
    ]
    assert "torch eager bf16-autocast" in compare.runnable_configs(
        cpu, tiny=False, precision="tf32"
    )
    monkeypatch.setattr(compare, "available_configs", lambda device: ("eager", "cuda-graph"))
    gpu = compare.runnable_configs(torch.device("cuda"), tiny=False, precision="tf32")
    torch_rows = gpu[len(compare.OURS) :]
    assert torch_rows == [
        "torch eager",
        "torch eager +benchmark",
        "torch eager bf16-autocast",
        "torch eager bf16-autocast +benchmark",
        "torch cuda-graph",
        "torch cuda-graph +benchmark",
        "torch cuda-graph bf16-autocast",
        "torch cuda-graph bf16-autocast +benchmark",
    ]
    bf16 = torch.bfloat16
    assert [compare.torch_step_args(c) for c in torch_rows] == [
        ("eager", False, None),
        ("eager", True, None),
        ("eager", False, bf16),
        ("eager", True, bf16),
        ("cuda-graph", False, None),
        ("cuda-graph", True, None),
        ("cuda-graph", False, bf16),
        ("cuda-graph", True, bf16),
    ]


def test_time_steps_builds_a_bf16_row_with_autocast(monkeypatch):
    """A bf16-autocast name reaches make_torch_step as autocast=torch.bfloat16 and
    its step runs (on the CPU; in the simulator only its warm-up step)."""
    built = []

    def recording(*args, **kw):
        built.append((args[0], kw["cudnn_benchmark"], kw["autocast"]))
        return make_torch_step(*args, **kw)

    monkeypatch.setattr(compare, "make_torch_step", recording)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, TINY.num_classes, 8).astype(np.int32)
    row = compare.time_steps(
        TINY,
        images,
        labels,
        4,
        lr=0.05,
        seed=0,
        device=torch.device("cpu"),
        configs=["torch eager", "torch eager bf16-autocast"],
        steps=1,
        windows=1,
        warmup=1,
    )
    assert built == [("eager", False, None), ("eager", False, torch.bfloat16)]
    assert list(row["ms"]) == ["torch eager", "torch eager bf16-autocast"]


def test_best_torch_is_a_bf16_row_when_it_is_fastest():
    row = compare.summarise(
        {
            "batch_size": 256,
            "ms": {
                "numba fast graph": 0.5,
                "torch cuda-graph": 1.1,
                "torch cuda-graph bf16-autocast": 0.8,
                "torch cuda-graph bf16-autocast +benchmark": 0.4,
            },
        }
    )
    assert row["best_torch"] == "torch cuda-graph bf16-autocast +benchmark"
    assert row["fast_graph_over_best_torch"] == pytest.approx(0.5 / 0.4)
    table = compare.format_timing_table([row], "GPU", "cuda", "tf32", "tf32").splitlines()
    assert "bf16-autocast: torch's forward and loss under torch.autocast" in table[1]
    assert table[-2].split()[-1] == "1.25x"
    assert table[-1].split()[-2:] == ["bf16-autocast", "+benchmark"]


def test_bf16_rows_without_our_tf32_are_refused_saying_why(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--timing-only", "--configs", "torch eager bf16-autocast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'torch eager bf16-autocast'" in err and "come with --precision tf32" in err


@pytest.mark.parametrize("precision,on", [("fp32", False), ("tf32", True)])
def test_set_torch_precision(precision, on):
    # torch.backends.cuda.matmul's flags are properties of a module object:
    # saved and put back by hand
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not on
        compare.set_torch_precision(precision)
        assert torch.backends.cudnn.allow_tf32 is on
        assert torch.backends.cuda.matmul.allow_tf32 is on
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_set_torch_precision_refuses_others():
    with pytest.raises(ValueError, match="fp32"):
        compare.set_torch_precision("bf16")


def test_a_second_precision_table_shows_our_times_and_its_own_best():
    fp32 = [
        {
            "batch_size": 64,
            "ms": {"numba fast graph": 0.3, "torch eager": 1.0, "torch compile": 0.5},
        },
        {
            "batch_size": 256,
            "ms": {"numba fast graph": 0.7, "torch eager": 2.0, "torch compile": 1.4},
        },
    ]
    for r in fp32:
        compare.summarise(r)
    tf32 = [
        {"batch_size": 64, "ms": {"torch eager": 0.9, "torch compile": 0.6}},
        {"batch_size": 256, "ms": {"torch eager": 1.0, "torch compile": 1.2}},
    ]
    merged = compare.with_our_rows(tf32, fp32)
    assert [r["ms"]["numba fast graph"] for r in merged] == [0.3, 0.7]
    assert [r["best_torch"] for r in merged] == ["torch compile", "torch eager"]
    assert merged[0]["fast_graph_over_best_torch"] == pytest.approx(0.3 / 0.6)
    assert merged[1]["fast_graph_over_best_torch"] == pytest.approx(0.7 / 1.0)
    table = compare.format_timing_table(merged, "GPU", "cuda", "tf32")
    assert "TF32 on" in table and "ours FP32" in table
    assert "0.70x" in table.splitlines()[-2]


def test_torch_tf32_and_another_precision_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--timing-only", "--torch-tf32", "--torch-precision", "fp32"])
    assert e.value.code == 2
    assert "disagree" in capsys.readouterr().err
