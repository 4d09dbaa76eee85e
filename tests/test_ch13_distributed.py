"""Chapter 13 and the data-parallel capstone, on 2 ranks: gloo on the CPU, kernels in the simulator.

One spawn of 2 processes (``ranks`` fixture, bounded in time) checks everything that
needs a process group, each rank writing what it found to a JSON file:

* the hand-written ring all-reduce equals ``all_reduce`` bit for bit (a size the 2
  ranks divide and one they do not), and a ring with a step off by one does not;
* one data-parallel step (v1, one all-reduce; v2, two buckets) equals the float64
  reference in which each rank's shard has its own batchnorm statistics
  (``check_data_parallel_step``); a wrong shard and a missing 1/N fail that check;
* ranks that start from different weights are refused, on every rank.

The rest (errors before any work, shard arithmetic) runs in this process.
Run this file as a script with ``--child OUT`` to be one rank (the fixture does).

The torch DDP twin is not built here: constructing DistributedDataParallel
imports torch's compiler (2.5 CPU-seconds a rank). The GPU runs compare with it
(chapters/13_multi_gpu/data_parallel.py, ``torchrun ... -m final_project.compare``).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import load_chapter_module

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from final_project import distributed as fdist
from final_project.model import NetConfig, init_params

CHAPTER = "13_multi_gpu"
tools = load_chapter_module(CHAPTER, "tools")
WORLD = 2
TIMEOUT_S = 120  # a hung collective fails the test instead of blocking CI
# The smallest network the fast kernels take: 4x4 images, two channels, hidden 8.
CONFIG = NetConfig(height=4, width=4, c1=2, c2=2, hidden=8)
LR = 0.5  # large, so that a missing 1/N moves the parameters far outside the tolerance


# ---------------------------------------------------------------- what each rank runs


def _outcome(fn) -> dict:
    """{"ok": True} or {"ok": False, "error": "CheckError: ..."}."""
    try:
        fn()
        return {"ok": True}
    except Exception as e:  # noqa: BLE001  (reported to the parent, which asserts)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _child(out: Path) -> None:
    ring = load_chapter_module(CHAPTER, "ring_allreduce")
    comm = fdist.init(timeout_s=TIMEOUT_S / 2)
    rank, world = comm.rank, comm.world
    found: dict[str, dict] = {}

    # the ring: right, and off by one
    for size in (256 * 4, 257 * 4):
        found[f"ring {size} bytes"] = _outcome(lambda size=size: ring.check_ring(size, comm))

    def off_by_one(r, n):
        return [(p, s, (g + 1) % n) if p == "reduce-scatter" else (p, s, g)
                for p, s, g in ring.ring_schedule(r, n)]  # fmt: skip

    found["ring off by one"] = _outcome(lambda: ring.check_ring(256 * 4, comm, off_by_one))

    # one data-parallel step, against the float64 reference with per-rank batchnorm
    rng = np.random.default_rng(1234)  # the same global batch on every rank
    x = rng.standard_normal((2 * world, 1, CONFIG.height, CONFIG.width)).astype(np.float32)
    y = rng.permutation(np.arange(2 * world) % CONFIG.num_classes).astype(np.int32)
    init = init_params(CONFIG, 0)

    class WrongShard(fdist.DataParallelCNN):
        def shard(self, batch):  # every rank trains on rank 0's rows
            return fdist.shard_rows(batch, 0, self.comm.world)

    class NoFold(fdist.DataParallelCNN):
        def local_lr(self, lr):  # the summed gradients taken as the mean
            return float(lr)

    for name, cls, overlap in (
        ("v1", fdist.DataParallelCNN, False),
        ("v2", fdist.DataParallelCNN, True),
        ("wrong shard", WrongShard, False),
        ("missing 1/N", NoFold, False),
    ):
        model = cls(CONFIG, len(y), comm, params=init, overlap=overlap)
        found[f"step {name}"] = _outcome(
            lambda model=model: fdist.check_data_parallel_step(model, x, y, LR)
        )

    # ranks that start apart are refused on every rank
    found["different starts refused"] = _outcome(
        lambda: fdist.DataParallelCNN(CONFIG, len(y), comm, params=init_params(CONFIG, rank))
    )
    comm.close()
    (out / f"rank{rank}.json").write_text(json.dumps(found))


# ---------------------------------------------------------------- the spawn, once


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{rank: {check: outcome}} from one run of 2 gloo ranks in the simulator."""
    out = tmp_path_factory.mktemp("ranks")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", COURSE_RACECHECK="0")
    t0 = time.perf_counter()
    results = tools.start_ranks(
        [__file__, "--child", str(out)], WORLD, timeout_s=TIMEOUT_S, env=env, echo_rank0=False
    )
    seconds = time.perf_counter() - t0
    for r in results:
        assert r.returncode == 0, (
            f"rank {r.rank} exited with {r.returncode} after {seconds:.0f} s "
            f"(-9: killed at the {TIMEOUT_S} s limit, a collective never completed):\n"
            f"{r.output[-3000:]}"
        )
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}


def _every_rank(ranks, name):
    return [ranks[r][name] for r in range(WORLD)]


@pytest.mark.parametrize("size", [256 * 4, 257 * 4])
def test_ring_all_reduce_equals_all_reduce(ranks, size):
    for got in _every_rank(ranks, f"ring {size} bytes"):
        assert got["ok"], got


def test_a_ring_step_off_by_one_fails(ranks):
    outcomes = _every_rank(ranks, "ring off by one")
    assert not any(o["ok"] for o in outcomes), "the ring check passed a wrong schedule"
    assert all("CheckError" in o["error"] and "differ" in o["error"] for o in outcomes), outcomes


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_data_parallel_step_equals_per_rank_batchnorm_reference(ranks, version):
    for got in _every_rank(ranks, f"step {version}"):
        assert got["ok"], got


@pytest.mark.parametrize(
    "broken, symptom",
    [("wrong shard", "all-reduced grad"), ("missing 1/N", "after the step")],
)
def test_the_step_check_catches(ranks, broken, symptom):
    outcomes = _every_rank(ranks, f"step {broken}")
    assert not any(o["ok"] for o in outcomes), f"check_data_parallel_step passed a {broken}"
    assert all(o["error"].startswith("CheckError") for o in outcomes), outcomes
    assert any(symptom in o["error"] for o in outcomes), outcomes


def test_ranks_with_different_weights_are_refused_everywhere(ranks):
    for got in _every_rank(ranks, "different starts refused"):
        assert not got["ok"] and "different weights" in got["error"], got


# ---------------------------------------------------------------- in this process


def test_shards_tile_the_global_batch():
    for world in (1, 2, 3, 8):
        batch = 24
        rows = [fdist.shard_rows(batch, r, world) for r in range(world)]
        covered = np.concatenate([np.arange(batch)[s] for s in rows])
        assert covered.tolist() == list(range(batch))
        assert {s.stop - s.start for s in rows} == {batch // world}


def test_bad_inputs_are_refused_before_any_work(monkeypatch):
    with pytest.raises(ValueError, match="does not split into 3 equal shards"):
        fdist.shard_rows(64, 0, 3)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        fdist.shard_rows(64, 2, 2)
    comm = fdist.Communicator(rank=0, world=3, local_rank=0, backend="gloo")
    with pytest.raises(ValueError, match="--batch-size that 3 divides"):
        fdist.DataParallelCNN(CONFIG, 64, comm)  # refused before any allocation
    for name in fdist.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not fdist.launched_by_torchrun()
    with pytest.raises(RuntimeError, match="torchrun --standalone --nproc-per-node"):
        fdist.init()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="needs one NVIDIA GPU a rank.*backend='gloo'"):
        fdist.init(backend="nccl")
    with pytest.raises(ValueError, match="backend must be"):
        fdist.init(backend="mpi")


@pytest.mark.parametrize("module", ["train", "compare"])
def test_under_torchrun_train_and_compare_refuse_a_batch_the_ranks_do_not_split(
    module, monkeypatch, capsys
):
    import importlib

    main = importlib.import_module(f"final_project.{module}").main
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:  # argparse's error, before any process group
        main(["--kernels", "fast", "--sample", "--batch-size", "64"])
    assert exit_.value.code == 2
    assert "does not split into 3 equal shards" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sample", "--batch-size", "63"])  # the simulator's default kernels: naive
    assert "--kernels fast" in capsys.readouterr().err


def test_under_torchrun_compare_refuses_two_torch_precisions(monkeypatch, capsys):
    from final_project import compare

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = ["--kernels", "fast", "--sample", "--batch-size", "64", "--timing-only"]
    with pytest.raises(SystemExit) as exit_:  # before any process group
        compare.main([*argv, "--torch-precision", "both"])
    assert exit_.value.code == 2
    assert "one precision" in capsys.readouterr().err


def test_a_torch_without_nccl_is_named(monkeypatch):
    monkeypatch.setattr(fdist, "is_simulator", lambda: False)
    monkeypatch.setattr(fdist.dist, "is_nccl_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="has no NCCL.*CUDA build of torch"):
        fdist.init(backend="nccl")


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(Path(sys.argv[2]))
