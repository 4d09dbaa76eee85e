"""Chapter 13 exercises: hostile checks, run on the solutions and on yours.

Each ``check_*`` takes the exercise's function and raises (CheckError,
AssertionError) on a wrong one. The ring is checked by what it computes: a
symbolic run of the schedule (which ranks' shares each chunk holds after each
step) must end with every chunk complete on every rank, and the in-process ring
must equal the float64 sum within float32 rounding, for N = 1 to 5 and lengths
N does not divide. The ``test_broken_*`` tests prove each check bites: an
all-reduce bus factor of (N-1)/N, overlapping shards, a ring step off by one, a
copy where the add belongs, a missing 1/N.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, random_array, rounding_tolerance
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches

import math

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

CHAPTER = "13_multi_gpu"
sol = load_chapter_module(CHAPTER, "solutions")
IMPLS = implementations(CHAPTER)
FAILS = (CheckError, AssertionError)


# ---------------------------------------------------------------- 13.1
def check_collective_bandwidth(fn, rng):
    gib = 1 << 30
    cases = [  # (collective, bytes, seconds, N, algbw, busbw)
        ("all-reduce", gib, 6.5e-3, 2, gib / 6.5e-3 / 1e9, gib / 6.5e-3 / 1e9),
        ("all-reduce", gib, 6.5e-3, 8, gib / 6.5e-3 / 1e9, 1.75 * gib / 6.5e-3 / 1e9),
        ("all-reduce", 4096, 40e-6, 1, 4096 / 40e-6 / 1e9, 0.0),
        ("all-gather", 3 << 20, 1e-4, 3, (3 << 20) / 1e-4 / 1e9, 2 / 3 * (3 << 20) / 1e-4 / 1e9),
        ("reduce-scatter", 1 << 20, 2e-5, 4, (1 << 20) / 2e-5 / 1e9, 0.75 * (1 << 20) / 2e-5 / 1e9),
        ("broadcast", 1 << 24, 1e-4, 8, (1 << 24) / 1e-4 / 1e9, (1 << 24) / 1e-4 / 1e9),
        ("reduce", 1 << 24, 1e-4, 5, (1 << 24) / 1e-4 / 1e9, (1 << 24) / 1e-4 / 1e9),
    ]
    for name, nbytes, seconds, world, algbw, busbw in cases:
        got = fn(name, nbytes, seconds, world)
        assert len(got) == 2, f"{name}: expected (algbw, busbw), got {got!r}"
        for what, value, want in (("algbw", got[0], algbw), ("busbw", got[1], busbw)):
            assert math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12), (
                f"{name}, {nbytes} bytes in {seconds} s on {world} ranks: {what} {value} GB/s, "
                f"expected {want} GB/s"
            )
    for bad in (("all-to-all", 1, 1.0, 2), ("broadcast", -1, 1.0, 2), ("broadcast", 8, 0.0, 2),
                ("broadcast", 8, 1.0, 0)):  # fmt: skip
        with pytest.raises(ValueError):
            fn(*bad)


# ---------------------------------------------------------------- 13.2
def check_shard_rows(fn, rng):
    for world in (1, 2, 3, 4, 5, 8):
        for batch in (world, 6 * world, int(rng.integers(1, 40)) * world):
            parts = [fn(batch, r, world) for r in range(world)]
            rows = np.concatenate([np.arange(batch)[p] for p in parts])
            assert rows.tolist() == list(range(batch)), (
                f"batch {batch}, {world} ranks: shards in rank order give rows {rows.tolist()}, "
                "not each row once in order"
            )
            sizes = {len(np.arange(batch)[p]) for p in parts}
            assert sizes == {batch // world}, f"batch {batch}, {world} ranks: shard sizes {sizes}"
    with pytest.raises(ValueError, match="3"):
        fn(64, 0, 3)
    for bad in ((64, 2, 2), (64, -1, 2), (64, 0, 0)):
        with pytest.raises(ValueError):
            fn(*bad)


# ---------------------------------------------------------------- 13.3
def run_schedule_symbolically(schedule, world):
    """For each rank and chunk, the set of ranks whose share it holds after the ring."""
    held = [[{r} for _ in range(world)] for r in range(world)]
    plans = [schedule(r, world) for r in range(world)]
    for r, plan in enumerate(plans):
        assert len(plan) == 2 * (world - 1), f"rank {r} of {world}: {len(plan)} steps"
        phases = [p for p, _, _ in plan]
        assert phases == ["reduce-scatter"] * (world - 1) + ["all-gather"] * (world - 1), phases
    for step in range(2 * (world - 1)):
        before = [[set(c) for c in rank] for rank in held]
        for r in range(world):
            phase, _, recv = plans[r][step]
            left = (r - 1) % world
            _, sent, _ = plans[left][step]
            assert sent == recv, (
                f"{world} ranks, step {step}: rank {r} receives chunk {recv} but rank {left} "
                f"sends chunk {sent}"
            )
            if phase == "reduce-scatter":
                assert not before[r][recv] & before[left][recv], (
                    f"{world} ranks, step {step}: rank {r} adds chunk {recv} from rank {left}, "
                    "which already holds some of the same shares (counted twice)"
                )
                held[r][recv] = before[r][recv] | before[left][recv]
            else:
                held[r][recv] = before[left][recv]
    return held


def check_ring_schedule(fn, rng):
    assert fn(0, 2) == [("reduce-scatter", 0, 1), ("all-gather", 1, 0)], fn(0, 2)
    assert fn(0, 1) == [], "one rank: nothing to send"
    for world in range(2, 7):
        held = run_schedule_symbolically(fn, world)
        for r in range(world):
            for c in range(world):
                assert held[r][c] == set(range(world)), (
                    f"{world} ranks: after the ring, rank {r}'s chunk {c} holds the shares of "
                    f"ranks {sorted(held[r][c])}, not of all"
                )


# ---------------------------------------------------------------- 13.4
def check_ring_in_process(fn, rng, schedule=None):
    for world in (1, 2, 3, 5):
        for n in (1, 7, 64, int(rng.integers(2, 200))):
            host = [random_array(n, np.float32, rng) for _ in range(world)]
            bufs = [cuda.to_device(h) for h in host]
            fn(bufs, schedule) if schedule is not None else fn(bufs)
            want = np.sum([h.astype(np.float64) for h in host], axis=0)
            magnitude = np.sum([np.abs(h.astype(np.float64)) for h in host], axis=0)
            tol = rounding_tolerance(want, magnitude, max(world - 1, 1), 1e-6)
            for r, b in enumerate(bufs):
                check(b, want, tol, f"ring over {world} buffers of {n}: buffer {r}")
    with pytest.raises(ValueError):
        fn([cuda.to_device(np.ones(4, np.float32)), cuda.to_device(np.ones(5, np.float32))])
    with pytest.raises(TypeError):
        fn([np.ones(4, np.float32)])


# ---------------------------------------------------------------- 13.5
def check_sgd_after_all_reduce(fn, rng):
    for n in (1, 255, 257, int(rng.integers(300, 2000))):
        for world in (1, 2, 8):
            lr = float(rng.uniform(0.01, 1.0))
            p, g = random_array(n, np.float32, rng), random_array(n, np.float32, rng) * world
            params = cuda.to_device(p)
            fn(params, cuda.to_device(g), lr, world)
            want = p.astype(np.float64) - lr / world * g.astype(np.float64)
            magnitude = np.abs(p) + np.abs(lr / world * g.astype(np.float64))
            check(params, want, rounding_tolerance(want, magnitude, 3, 1e-6),
                  f"sgd after all-reduce, n={n}, world={world}")  # fmt: skip
    ones = cuda.to_device(np.ones(8, np.float32))
    for args, error in (
        ((ones, cuda.to_device(np.ones(9, np.float32)), 0.1, 2), ValueError),
        ((ones, ones, 0.1, 0), ValueError),
        ((ones, ones, 0.0, 2), ValueError),
        ((ones, ones, float("nan"), 2), ValueError),
        ((np.ones(8, np.float32), ones, 0.1, 2), TypeError),
        ((ones, cuda.to_device(np.ones(8)), 0.1, 2), TypeError),
    ):
        with pytest.raises(error):
            fn(*args)


# ---------------------------------------------------------------- the exercises
EXERCISES = [
    ("collective_bandwidth", check_collective_bandwidth),
    ("shard_rows", check_shard_rows),
    ("ring_schedule", check_ring_schedule),
    ("ring_all_reduce_in_process", check_ring_in_process),
    ("sgd_after_all_reduce", check_sgd_after_all_reduce),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "check_fn"), EXERCISES, ids=[name for name, _ in EXERCISES])
def test_exercise(name, check_fn, impl, rng):
    if name == "sgd_after_all_reduce":
        with float32_pure_launches():  # a Python float lr is float64 in the kernel
            check_fn(getattr(impl, name), rng)
    else:
        check_fn(getattr(impl, name), rng)


@pytest.mark.parametrize("impl", IMPLS)
def test_your_ring_runs_your_schedule(impl, rng):
    check_ring_in_process(impl.ring_all_reduce_in_process, rng, schedule=impl.ring_schedule)


# ---------------------------------------------------------------- the checks bite
def test_broken_bus_factor_fails(rng):
    def half_factor(collective, nbytes, seconds, world):
        algbw, busbw = sol.collective_bandwidth(collective, nbytes, seconds, world)
        return algbw, busbw / 2 if collective == "all-reduce" else busbw

    with pytest.raises(FAILS):
        check_collective_bandwidth(half_factor, rng)


def test_broken_shards_fail(rng):
    def overlapping(batch, rank, world):
        s = sol.shard_rows(batch, rank, world)
        return slice(s.start, s.stop + (1 if rank < world - 1 else 0))

    def interleaved(batch, rank, world):
        sol.shard_rows(batch, rank, world)  # same checks
        return slice(rank, batch, world)

    for broken in (overlapping, interleaved):
        with pytest.raises(FAILS):
            check_shard_rows(broken, rng)


def off_by_one(rank, world):
    """The reduce-scatter receiving the chunk one past the one the left neighbour sends."""
    return [(p, s, (r + 1) % world) if p == "reduce-scatter" else (p, s, r)
            for p, s, r in sol.ring_schedule(rank, world)]  # fmt: skip


def test_broken_ring_step_fails(rng):
    with pytest.raises(FAILS):
        check_ring_schedule(off_by_one, rng)
    with pytest.raises(FAILS):
        check_ring_in_process(sol.ring_all_reduce_in_process, rng, schedule=off_by_one)


def test_broken_ring_add_fails(rng, monkeypatch):
    copy = mutant(sol.accumulate, ("dst[i] += src[i]", "dst[i] = src[i]"))
    monkeypatch.setattr(sol, "accumulate", copy)
    with pytest.raises(FAILS):
        check_ring_in_process(sol.ring_all_reduce_in_process, rng)


def test_broken_missing_fold_fails(rng):
    def no_fold(params, grad_sum, lr, world):
        sol.sgd_after_all_reduce(params, grad_sum, lr, 1)

    with pytest.raises(FAILS):
        check_sgd_after_all_reduce(no_fold, rng)
