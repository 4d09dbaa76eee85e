"""Chapter 06 exercises: hostile checks, run on the solutions and on yours.

Each ``check_*`` takes the exercise's host function and raises (CheckError,
IndexError, AssertionError) on a wrong kernel. The ``test_broken_*`` tests prove
the checks bite: a kernel missing a barrier, a bounds check or an atomic fails.

A missing ``cuda.syncthreads()`` is a race, and a race shows only when a thread
reads a slot before its writer has stored it. In the simulator (threads
interleaved) that happens at any size. On a GPU the 32 threads of a warp execute
in step, and warps leave a barrier together, so a read goes stale only when it
crosses into ANOTHER warp that has fallen behind (its global load came back
later). The broken-barrier tests therefore add, on a GPU, a large input (many
blocks in flight, several warps each) and repeat it; where even that cannot show
the bug on a GPU, the test runs in the simulator only and says why.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import (
    CheckError,
    check,
    guarded,
    hostile_sizes,
    random_array,
    rounding_tolerance,
)
from common.internal import racecheck
from common.internal.exercises import implementations, load_chapter_module
from common.internal.float32_purity import float32_pure_launches
from common.internal.racecheck import RaceError
from common.runtime import ceil_div, is_simulator, pick

import inspect
import types

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

sol = load_chapter_module("06_memory", "solutions")
BLOCK, TILE, ROWS, NBINS, RADIUS = sol.BLOCK, sol.TILE, sol.ROWS, sol.NBINS, sol.RADIUS
FAILS = (CheckError, IndexError, AssertionError)
IMPLS = implementations("06_memory")
# GPU only: sizes and repeats that give warps time to drift apart (see the docstring);
# 2**22 elements = 65536 blocks of BLOCK threads, a fraction of a second a trial
RACE_SIZES = [] if is_simulator() else [1 << 22]
RACE_TRIALS = 8
# Simulator: the race detector reports a race on the launch that has it, every time,
# so one trial is enough there; what a racy kernel must fail with:
SIM_TRIALS = 1
RACES = RaceError if is_simulator() and racecheck.ENABLED else FAILS


def fails_in_some_trial(check_fn, fn, rng):
    """Run ``check_fn(fn, rng)`` at its hostile sizes (SIM_TRIALS times in the
    simulator), then on a GPU RACE_TRIALS times at RACE_SIZES; the first wrong
    result raises out of here."""
    for _ in range(SIM_TRIALS if is_simulator() else 1):
        check_fn(fn, rng)
    for _ in range(RACE_TRIALS if RACE_SIZES else 0):
        check_fn(fn, rng, sizes=RACE_SIZES)


def with_junk_after(host: np.ndarray, junk: float = 1e6):
    """A device view of ``host`` followed (in the same allocation) by large junk,
    so a kernel reading past the end gets a visibly wrong value on a GPU too."""
    buf = np.concatenate([host, np.full(4 * BLOCK, junk, dtype=host.dtype)])
    return cuda.to_device(buf)[: host.size]


# ---------------------------------------------------------------- checks
def sizes_1d(rng):
    """hostile_sizes plus exact multiples of BLOCK: a grid of n // BLOCK + 1 blocks
    (one too many) is wrong only there."""
    return hostile_sizes(BLOCK, rng) + [BLOCK, 2 * BLOCK]


def check_shift_left(fn, rng, sizes=None):
    with float32_pure_launches():
        for n in sizes or [2] + [max(n, 2) for n in sizes_1d(rng)]:
            x = random_array(n, np.float32, rng)
            out = guarded(n - 1)
            fn(cuda.to_device(x), out.array)
            check(out.array, x[1:].astype(np.float64), tol=0.0, name=f"shift_left n={n}")
            out.check_untouched()


def check_block_sums(fn, rng, sizes=None):
    with float32_pure_launches():
        for n in sizes or sizes_1d(rng):
            x = random_array(n, np.float32, rng)
            nb = ceil_div(n, BLOCK)
            blocks = [x[b * BLOCK : (b + 1) * BLOCK].astype(np.float64) for b in range(nb)]
            ref = np.array([block.sum() for block in blocks])
            out = guarded(nb)
            fn(with_junk_after(x), out.array)
            # A tree of log2(BLOCK) additions rounds each sum by ~log2(BLOCK) eps32 of
            # its terms' size, which is all of it where the terms cancel (seed 353).
            magnitude = np.array([np.abs(block).sum() for block in blocks])
            tol = rounding_tolerance(ref, magnitude, BLOCK.bit_length() - 1, 1e-6)
            check(out.array, ref, tol=tol, name=f"block_sums n={n}")
            out.check_untouched()


def check_dot(fn, rng):
    with float32_pure_launches():
        for n in sizes_1d(rng):
            for blocks in (1, 3):
                a = random_array(n, np.float32, rng, 0.5, 1.5)
                b = random_array(n, np.float32, rng, 0.5, 1.5)
                out = guarded(1)
                fn(with_junk_after(a), with_junk_after(b), out.array, blocks=blocks)
                ref = np.array([(a.astype(np.float64) * b).sum()])
                check(out.array, ref, tol=1e-5, name=f"dot n={n} blocks={blocks}")
                out.check_untouched()


def _argmax_cases(rng):
    """(name, x): random small integers (many ties), and the edge cases by construction."""
    for n in sizes_1d(rng):
        yield f"n={n}", rng.integers(-5, 6, n).astype(np.float32)
    yield "all equal", np.full(BLOCK + 3, 2.5, np.float32)  # index 0 must win
    # The maximum in three blocks, at a smaller offset inside each later block: the
    # first GLOBAL index wins, not the first block-local one, nor the last block.
    x = rng.integers(-5, 5, 3 * BLOCK + 7).astype(np.float32)
    x[[BLOCK + 5, 2 * BLOCK + 1, 3 * BLOCK + 2]] = 10
    yield "tied maxima across blocks", x
    # All negative, with a partial last block: padding threads must hold -inf, not 0.
    yield "all negative", -random_array(BLOCK + 9, np.float32, rng, 1.0, 2.0)


def check_argmax(fn, rng):
    with float32_pure_launches():
        for name, x in _argmax_cases(rng):
            value, index = fn(with_junk_after(x, junk=1e9))
            assert (value, index) == (float(x.max()), int(np.argmax(x))), (
                f"argmax {name}: got ({value}, {index}), expected ({x.max()}, {np.argmax(x)})"
                " (ties: the first index wins, as np.argmax)"
            )


def check_transpose(fn, rng):
    shapes = [
        (1, 1),
        (TILE - 1, TILE + 1),
        (2 * TILE + 3, TILE + 5),
        (TILE, 2 * TILE),
        (int(rng.integers(1, 3 * TILE)), int(rng.integers(1, 3 * TILE))),
    ]
    if not is_simulator():  # many blocks in flight: a missing barrier shows on a GPU too
        shapes.append((2048 + 3, 3072 + 5))
    with float32_pure_launches():
        for rows, cols in shapes:
            a = random_array((rows, cols), np.float32, rng)
            out = guarded((cols, rows))
            fn(cuda.to_device(a), out.array)
            check(out.array, a.T.astype(np.float64), tol=0.0, name=f"transpose {rows}x{cols}")
            out.check_untouched()


def check_histogram(fn, rng, sizes=None):
    sizes = sizes or hostile_sizes(BLOCK, rng) + [40 * BLOCK]
    for n in sizes:
        for blocks in (1, 3):
            x = rng.integers(0, NBINS, n).astype(np.int32)
            bins = guarded(NBINS, np.int32)
            fn(cuda.to_device(x), bins.array, blocks=blocks)
            ref = np.bincount(x, minlength=NBINS).astype(np.int32)
            check(bins.array, ref, name=f"histogram n={n} blocks={blocks}")
            bins.check_untouched()


def check_scan(fn, rng, sizes=None):
    for n in sizes or hostile_sizes(BLOCK, rng):
        x = rng.integers(-50, 51, n).astype(np.int32)
        out = guarded(n, np.int32)
        fn(cuda.to_device(x), out.array)
        check(out.array, np.cumsum(x).astype(np.int32), name=f"scan n={n}")
        out.check_untouched()


def _staged_tile(kernel, x, tile, flags, aggregates, prefixes):
    """Run tile ``tile`` alone (one block, the ticket set to it) over status the
    earlier tiles left mid-flight, as on a GPU; return out and the status after."""
    out = cuda.to_device(np.full(x.size, -7, np.int32))
    status = [cuda.to_device(np.asarray(a, np.int32)) for a in (flags, aggregates, prefixes)]
    kernel[1, BLOCK](cuda.to_device(x), out, *status, cuda.to_device(np.array([tile], np.int32)))
    return out.copy_to_host(), [a.copy_to_host() for a in status]


def check_scan_lookback(fn, rng):
    check_scan(fn, rng, hostile_sizes(BLOCK, rng) + [BLOCK, 2 * BLOCK])
    # One tile whose predecessors are mid-flight: tiles 0-1 published wrong
    # prefixes (going past tile 2 adds them), tile 2 its prefix and a wrong
    # aggregate, tiles 3-5 their aggregates only, with wrong prefixes.
    kernel = inspect.unwrap(fn).__globals__["lookback_scan_kernel"]  # the same file's kernel
    tiles, me, junk = 7, 6, 1_000_003
    x = rng.integers(-50, 51, tiles * BLOCK - 3).astype(np.int32)
    ref = np.cumsum(x).astype(np.int32)
    totals = np.add.reduceat(x, np.arange(0, x.size, BLOCK))
    inclusive = np.cumsum(totals).astype(np.int32)
    k = np.arange(tiles)
    flags = np.where(k <= 2, sol.FLAG_PREFIX, sol.FLAG_AGGREGATE)
    flags[me] = sol.FLAG_NONE
    out, (flags_after, _, prefixes_after) = _staged_tile(
        kernel, x, me, flags, np.where(k >= 3, totals, junk), np.where(k == 2, inclusive, junk)
    )
    check(out[me * BLOCK :], ref[me * BLOCK :], name="the last tile after a look-back")
    assert (out[: me * BLOCK] == -7).all(), "the tile wrote outside its elements"
    assert flags_after[me] == sol.FLAG_PREFIX, "the tile did not publish FLAG_PREFIX"
    assert prefixes_after[me] == inclusive[me], "the tile published a wrong inclusive prefix"


def check_stencil(fn, rng):
    with float32_pure_launches():
        for n in sizes_1d(rng):
            x = random_array(n, np.float32, rng)
            w = random_array(2 * RADIUS + 1, np.float32, rng)
            xp = np.pad(x.astype(np.float64), RADIUS)
            ref = sum(w[k] * xp[k : k + n] for k in range(2 * RADIUS + 1))
            out = guarded(n)
            fn(with_junk_after(x), cuda.to_device(w), out.array)
            check(out.array, ref, tol=1e-5, name=f"stencil n={n}")
            out.check_untouched()


def _softmax_inputs(rng):
    shapes = [
        (1, 1),
        (2, BLOCK - 1),
        (2, 3 * BLOCK + 7),
        (int(rng.integers(1, 4)), int(rng.integers(2, 2 * BLOCK))),
    ]
    for rows, cols in shapes:
        yield f"{rows}x{cols}", random_array((rows, cols), np.float32, rng, -6.0, 6.0)
    # Without subtracting the row's max, exp overflows: float32 exp past 88 on a GPU
    # (the simulator's exp is float64, but its float32 sum overflows the same way),
    # float64 exp past 709 too. Rows of very negative values underflow every exp to
    # 0 unless the max is subtracted, and a max started at 0 instead of -inf keeps
    # them there.
    yield "values near 95", random_array((2, BLOCK + 5), np.float32, rng, 90.0, 100.0)
    yield "values near 730", random_array((1, 2 * BLOCK), np.float32, rng, 710.0, 750.0)
    yield "values near -275", random_array((2, BLOCK + 5), np.float32, rng, -300.0, -250.0)


def check_softmax(fn, rng):
    with float32_pure_launches():
        for name, x in _softmax_inputs(rng):
            z = x.astype(np.float64)
            e = np.exp(z - z.max(axis=1, keepdims=True))
            out = guarded(x.shape)
            fn(cuda.to_device(x), out.array)
            check(out.array, e / e.sum(axis=1, keepdims=True), tol=1e-5, name=f"softmax {name}")
            out.check_untouched()


# ---------------------------------------------------------------- exercise tests
EXERCISES = [  # (the exercise's host function, its check), in the exercises' order
    ("shift_left", check_shift_left),
    ("block_sums", check_block_sums),
    ("dot", check_dot),
    ("argmax", check_argmax),
    ("transpose_tiled", check_transpose),
    ("histogram_global", check_histogram),
    ("histogram_privatised", check_histogram),
    ("scan_inclusive", check_scan),
    ("stencil_1d", check_stencil),
    ("softmax_rows", check_softmax),
    ("scan_lookback", check_scan_lookback),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "check_fn"), EXERCISES, ids=[name for name, _ in EXERCISES])
def test_exercise(name, check_fn, impl, rng):
    check_fn(getattr(impl, name), rng)


def test_bad_shapes_are_refused():
    x = cuda.to_device(np.ones(10, np.float32))
    with pytest.raises(ValueError, match="x.size - 1"):
        sol.shift_left(x, cuda.device_array(10, np.float32))
    with pytest.raises(ValueError, match="cols, rows"):
        sol.transpose_tiled(
            cuda.to_device(np.ones((3, 4), np.float32)), cuda.device_array((3, 4), np.float32)
        )


# ---------------------------------------------------------------- broken kernels fail
shift_left_no_barrier = mutant(
    sol.shift_left_kernel,
    # no barrier: thread t reads tile[t + 1] before thread t + 1 may have written it
    ("    cuda.syncthreads()\n", ""),
    name="shift_left_no_barrier",
)


def test_broken_shift_left_without_barrier_fails(rng):
    # on a GPU only thread 31 of each warp reads another warp's slot: many blocks needed
    def shift_left(x, out):
        shift_left_no_barrier[ceil_div(x.size, BLOCK), BLOCK](x, out)

    with pytest.raises(RACES):
        fails_in_some_trial(check_shift_left, shift_left, rng)


block_sums_no_bounds = mutant(
    sol.block_sums_kernel,
    (
        "s[t] = x[i] if i < x.size else ZERO",
        "s[t] = x[i]  # no bounds check: the last block reads past the end",
    ),
    name="block_sums_no_bounds",
)


block_sums_no_barrier = mutant(
    sol.block_sums_kernel,  # no barrier after the load, none between tree levels
    ("    cuda.syncthreads()\n    stride = BLOCK // 2", "    stride = BLOCK // 2"),
    ("        cuda.syncthreads()\n        stride //= 2", "        stride //= 2"),
    name="block_sums_no_barrier",
)


def test_broken_block_sums_one_block_too_many_fails(rng):
    def block_sums(x, out):  # n // BLOCK + 1 is ceil(n / BLOCK) except for exact multiples
        sol.block_sums_kernel[x.size // BLOCK + 1, BLOCK](x, out)

    with pytest.raises(FAILS):
        check_block_sums(block_sums, rng)


@pytest.mark.parametrize(
    "kernel", [block_sums_no_bounds, block_sums_no_barrier], ids=["no-bounds-check", "no-barrier"]
)
def test_broken_block_sums_fail(kernel, rng):
    def block_sums(x, out):
        kernel[out.size, BLOCK](x, out)

    with pytest.raises(FAILS):
        fails_in_some_trial(check_block_sums, block_sums, rng)


dot_plain_add = mutant(
    sol.dot_kernel,
    (
        "cuda.atomic.add(out, 0, s[0])",
        "out[0] += s[0]  # not atomic: blocks racing on out[0] lose sums",
    ),
    name="dot_plain_add",
)


def test_broken_dot_without_atomic_fails(rng):
    # Blocks racing on out[0]: the simulator runs blocks one after another and never
    # loses a sum, but its race detector reports the unordered updates.
    def dot(a, b, out, blocks):
        out.copy_to_device(np.zeros(1, np.float32))
        dot_plain_add[pick(gpu=blocks * 64, simulator=2), BLOCK](a, b, out)

    with pytest.raises(RACES):
        for _ in range(5):
            check_dot(dot, rng)


argmax_no_barrier = mutant(
    sol.argmax_kernel,  # no barriers: reads partners' slots before they are final
    ("    cuda.syncthreads()\n    stride = BLOCK // 2", "    stride = BLOCK // 2"),
    ("        cuda.syncthreads()\n        stride //= 2", "        stride //= 2"),
    name="argmax_no_barrier",
)


@pytest.mark.skipif(
    not is_simulator(),
    reason="simulator only: on a GPU a stale read (warp 0 reading warp 1's slots before "
    "warp 1 stored them) corrupts only its own block's partial result, and the "
    "check sees one (value, index) for the whole array, decided by a single block: "
    "that block would have to be the one hit, which a GPU run rarely makes happen",
)
def test_broken_argmax_without_barrier_fails(rng, monkeypatch):
    monkeypatch.setattr(sol, "argmax_kernel", argmax_no_barrier)
    with pytest.raises(RACES):
        for _ in range(SIM_TRIALS):
            check_argmax(sol.argmax, rng)


argmax_pads_with_zero = mutant(
    sol.argmax_kernel,
    (
        "if i < x.size else NEG_INF",
        "if i < x.size else ZERO  # wrong: 0 beats every negative value",
    ),
    name="argmax_pads_with_zero",
)


argmax_keeps_later_ties = mutant(
    sol.argmax_kernel,
    (
        "if v > sv[t] or (v == sv[t] and j < si[t]):",
        "if v >= sv[t]:  # wrong: a tie takes the later index",
    ),
    name="argmax_keeps_later_ties",
)


@pytest.mark.parametrize(
    "kernel",
    [argmax_pads_with_zero, argmax_keeps_later_ties],
    ids=["pads-with-zero", "later-index-wins-ties"],
)
def test_broken_argmax_kernel_fails(kernel, rng, monkeypatch):
    monkeypatch.setattr(sol, "argmax_kernel", kernel)
    with pytest.raises(FAILS):
        check_argmax(sol.argmax, rng)


def test_broken_argmax_last_block_wins_fails(rng):
    def argmax(x):
        blocks = ceil_div(x.size, BLOCK)
        vals = cuda.device_array(blocks, np.float32)
        idxs = cuda.device_array(blocks, np.int32)
        sol.argmax_kernel[blocks, BLOCK](x, vals, idxs)
        v, j = vals.copy_to_host(), idxs.copy_to_host()
        best = max(range(blocks), key=lambda b: (v[b], b))  # wrong: the LAST block of the max
        return float(v[best]), int(j[best])

    with pytest.raises(FAILS):
        check_argmax(argmax, rng)


transpose_no_bounds = mutant(
    sol.transpose_kernel,  # no bounds check on the write
    (
        "        if y + k < out.shape[0] and x < out.shape[1]:\n            out[y + k, x]",
        "        out[y + k, x]",
    ),
    name="transpose_no_bounds",
)


transpose_no_barrier = mutant(
    sol.transpose_kernel,  # reads tile columns other threads write
    ("    cuda.syncthreads()\n", ""),
    name="transpose_no_barrier",
)


@pytest.mark.parametrize(
    "kernel", [transpose_no_bounds, transpose_no_barrier], ids=["no-bounds-check", "no-barrier"]
)
def test_broken_transpose_fails(kernel, rng):
    def transpose(a, out):
        kernel[(ceil_div(a.shape[1], TILE), ceil_div(a.shape[0], TILE)), (TILE, ROWS)](a, out)

    with pytest.raises(FAILS):
        for _ in range(SIM_TRIALS if is_simulator() else RACE_TRIALS):  # GPU: a big shape too
            check_transpose(transpose, rng)


histogram_plain_add = mutant(
    sol.histogram_global_kernel,
    (
        "cuda.atomic.add(bins, x[i], ONE_I32)",
        "bins[x[i]] += 1  # not atomic: two threads on one bin lose a count",
    ),
    name="histogram_plain_add",
)


def test_broken_histogram_without_atomic_fails(rng):
    def histogram(x, bins, blocks):
        bins.copy_to_device(np.zeros(NBINS, np.int32))
        histogram_plain_add[blocks, BLOCK](x, bins)

    with pytest.raises(RACES):
        for _ in range(pick(gpu=4, simulator=1)):  # GPU: a lost update is likely, not certain
            check_histogram(histogram, rng, sizes=[pick(gpu=40 * BLOCK, simulator=2 * BLOCK)])


histogram_private_plain_add = mutant(
    sol.histogram_private_kernel,
    ("cuda.atomic.add(h, x[i], ONE_I32)", "h[x[i]] += 1  # not atomic, in shared memory"),
    name="histogram_private_plain_add",
)


def test_broken_private_histogram_without_atomic_fails(rng):
    # A Python `+=` on a NumPy array never yields mid-update in the simulator, so no
    # count is lost there; the race detector reports it instead.
    def histogram(x, bins, blocks):
        bins.copy_to_device(np.zeros(NBINS, np.int32))
        histogram_private_plain_add[blocks, BLOCK](x, bins)

    with pytest.raises(RACES):
        check_histogram(histogram, rng, sizes=[pick(gpu=1 << 20, simulator=2 * BLOCK)])


block_scan_no_load_barrier = mutant(
    sol.block_scan_kernel,
    # the first step reads s[t - 1], maybe before thread t - 1 stored it (on a GPU:
    # thread 32 reading warp 0's last slot)
    ("    cuda.syncthreads()\n    offset = 1", "    offset = 1"),
    name="block_scan_no_load_barrier",
)


block_scan_one_barrier = mutant(
    sol.block_scan_kernel,  # no barrier between the read and the write
    ("        cuda.syncthreads()\n        s[t] += v", "        s[t] += v"),
    name="block_scan_one_barrier",
)


@pytest.mark.parametrize(
    "kernel",
    [
        block_scan_no_load_barrier,
        pytest.param(
            block_scan_one_barrier,
            marks=pytest.mark.skipif(
                not is_simulator(),
                reason="simulator only: on a GPU every warp leaves the previous barrier at the same "
                "moment and the racing read and write are a few instructions apart, so a "
                "warp almost never overwrites a slot before another warp has read it",
            ),
        ),
    ],
    ids=["no-barrier-after-load", "no-barrier-between-read-and-write"],
)
def test_broken_scan_without_barrier_fails(kernel, rng, monkeypatch):
    monkeypatch.setattr(sol, "block_scan_kernel", kernel)
    with pytest.raises(RACES):
        fails_in_some_trial(check_scan, sol.scan_inclusive, rng)


stencil_no_halo = mutant(
    sol.stencil_kernel,
    ("    if t < RADIUS:", "    if t < 0:  # wrong: the halo cells are never loaded"),
    name="stencil_no_halo",
)


def test_broken_stencil_without_halo_fails(rng, monkeypatch):
    monkeypatch.setattr(sol, "stencil_kernel", stencil_no_halo)
    with pytest.raises(FAILS):
        check_stencil(sol.stencil_1d, rng)


softmax_no_tree_barrier = mutant(
    sol.softmax_kernel,  # no barrier between tree levels
    (
        "s[t] = max(s[t], s[t + stride])\n        cuda.syncthreads()\n",
        "s[t] = max(s[t], s[t + stride])\n",
    ),
    ("s[t] += s[t + stride]\n        cuda.syncthreads()\n", "s[t] += s[t + stride]\n"),
    name="softmax_no_tree_barrier",
)


softmax_no_max_subtraction = mutant(
    sol.softmax_kernel,
    (
        "    m = s[0]\n",
        "    m = ZERO  # wrong: exp(x) overflows for large x; exp(x - max) cannot\n",
    ),
    name="softmax_no_max_subtraction",
)


softmax_max_starts_at_zero = mutant(
    sol.softmax_kernel,
    ("    m = NEG_INF\n", "    m = ZERO  # wrong: the max of an all-negative row comes out as 0\n"),
    name="softmax_max_starts_at_zero",
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the broken kernels overflow: the point
@pytest.mark.parametrize(
    "kernel",
    [softmax_no_max_subtraction, softmax_max_starts_at_zero],
    ids=["no-max-subtraction", "max-starts-at-zero"],
)
def test_broken_softmax_edge_values_fail(kernel, rng, monkeypatch):
    monkeypatch.setattr(sol, "softmax_kernel", kernel)
    # OverflowError: the simulator's float64 math.exp past 709 (a GPU returns inf)
    with np.errstate(all="ignore"), pytest.raises(FAILS + (OverflowError,)):
        check_softmax(sol.softmax_rows, rng)


def test_broken_softmax_without_barrier_fails(rng, monkeypatch):
    monkeypatch.setattr(sol, "softmax_kernel", softmax_no_tree_barrier)
    with pytest.raises(RACES):
        check_softmax(sol.softmax_rows, rng)


@pytest.mark.skipif(not is_simulator(), reason="the race detector is the simulator's")
def test_lookback_exercise_catches_a_prefix_published_without_its_fence(rng):
    no_fence = mutant(
        sol.lookback_scan_kernel,
        (
            "prefixes[tile] = exclusive + total\n        cuda.threadfence()\n",
            "prefixes[tile] = exclusive + total\n",
        ),
        name="lookback_no_fence",
    )
    n = 3 * BLOCK + 5
    x = cuda.to_device(rng.integers(-50, 51, n).astype(np.int32))
    status = [cuda.to_device(np.zeros(3, np.int32)) for _ in range(3)]
    with pytest.raises(RaceError, match="threadfence"):
        no_fence[3, BLOCK](
            x, cuda.device_array(n, np.int32), *status, cuda.to_device(np.zeros(1, np.int32))
        )


@pytest.mark.parametrize(
    "edit",
    [
        ("exclusive += prefixes[j]\n", "exclusive += aggregates[j]\n"),  # a prefix tile's aggregate
        ("                    break\n", ""),  # walks on past the prefix
        ("                j -= 1\n", "                j -= 2\n"),  # skips a tile
    ],
    ids=["aggregate-of-prefix-tile", "past-the-prefix", "skips-a-tile"],
)
def test_lookback_check_catches_a_wrong_walk(edit, rng):
    wrong = mutant(sol.lookback_scan_kernel, edit)
    launcher = types.FunctionType(
        sol.scan_lookback.__code__, {**sol.scan_lookback.__globals__, "lookback_scan_kernel": wrong}
    )
    with pytest.raises(CheckError):
        check_scan_lookback(launcher, rng)
