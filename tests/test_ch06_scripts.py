"""Chapter 06 scripts: every version of every pattern is checked at simulator sizes
(the scripts raise CheckError on a wrong version), the JSON/PNG outputs are written,
public launchers refuse bad inputs, and the README's code blocks match the chapter."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import check, guarded
from common.internal.exercises import chapter_dir, load_chapter_module
from common.internal.racecheck import RaceError
from common.internal.readme_sync import sync_readme
from common.runtime import pick

import json

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

CH = "06_memory"
PATTERNS = [
    "shared_memory",
    "transpose",
    "reduction",
    "histogram",
    "scan",
    "stencil",
    "softmax",
    "fusion",
]


@pytest.mark.parametrize("name", PATTERNS)
def test_script_run_checks_every_version(name):
    # the smoke sizes: a few blocks, ragged edges; the same on a GPU (fast there too)
    sizes = load_chapter_module(CH, "benchmark").SMOKE_SIZES[name]
    results = load_chapter_module(CH, name).run(**sizes)
    assert results and all(
        r.extra["rel_error"] == 0 or r.extra["rel_error"] < 1e-5 for r in results
    )


@pytest.mark.skipif(not common.is_simulator(), reason="main() runs the full GPU size")
def test_script_main_writes_json(tmp_path):
    load_chapter_module(CH, "fusion").main(["--out", str(tmp_path)])
    payload = json.loads((tmp_path / "fusion.json").read_text())
    assert [r["name"] for r in payload["results"]][0].startswith("fusion v1")


def test_benchmark_writes_table_json_and_plot(tmp_path):
    bench = load_chapter_module(CH, "benchmark")
    bench.main(["--out", str(tmp_path), "--only", "fusion,reduction", "--smoke"])
    payload = json.loads((tmp_path / "benchmark.json").read_text())
    assert {r["extra"]["pattern"] for r in payload["results"]} == {"fusion", "reduction"}
    assert {row["pattern"] for row in payload["meta"]["bar"]} == {"fusion", "reduction"}
    assert (tmp_path / "benchmark.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--only", "nonsense"])


def test_shift_left_without_barrier_goes_wrong():
    # default sizes: a few blocks in the simulator, 2**22 elements on a GPU, where only
    # a read across two warps can go stale (see race_demo's docstring)
    wrong = load_chapter_module(CH, "shared_memory").race_demo(trials=pick(gpu=5, simulator=2))
    assert any(w > 0 for w in wrong), f"no run went wrong: {wrong}"


def test_two_pass_reduction_is_deterministic():
    red = load_chapter_module(CH, "reduction")
    assert red.determinism_demo(300, runs=2)["v6 two-pass"] == 1


def test_reduction_large_grid_stride_paths(rng):
    # several grid-stride iterations per thread, including the 4-way unrolled body
    red = load_chapter_module(CH, "reduction")
    n = 4 * red.launch.grid_stride_blocks(10**9, red.BLOCK) * red.BLOCK + 13
    x_host = rng.integers(-8, 9, n).astype(np.float32)
    x = cuda.to_device(x_host)
    for fn in (red.reduce_grid_stride_atomic, red.reduce_two_pass):
        out = cuda.device_array(1, np.float32)
        fn(x, out)
        assert out.copy_to_host()[0] == x_host.astype(np.float64).sum()


def test_histogram_v4_unrolled_body(rng):
    # enough elements that every thread runs the UNROLL-way body and the tail loop
    hist = load_chapter_module(CH, "histogram")
    n = (hist.UNROLL + 1) * hist.BLOCK + 13
    x_host = rng.random(n, dtype=np.float32)
    bins = cuda.device_array(hist.NBINS, np.int32)
    hist.histogram_v4(cuda.to_device(x_host), bins)
    np.testing.assert_array_equal(bins.copy_to_host(), hist.histogram_cpu(x_host))


@pytest.mark.parametrize("shape", [(1, 1), (33, 31), (5, 70)])
def test_transpose_v4_and_copy_v0w_ragged(rng, shape):
    from common.checking import guarded

    tr = load_chapter_module(CH, "transpose")
    a_host = rng.random(shape, dtype=np.float32)
    a = cuda.to_device(a_host)
    for kernel, want in [(tr.transpose_smem_unsigned, a_host.T), (tr.copy_2d_loads_first, a_host)]:
        g = guarded(want.shape, np.float32)
        tr.transpose(kernel, a, g.array)
        np.testing.assert_array_equal(g.array.copy_to_host(), want)
        g.check_untouched()


@pytest.mark.parametrize("cols", [1, 300])
def test_softmax_v4_short_rows(rng, cols):
    sm = load_chapter_module(CH, "softmax")
    x_host = rng.uniform(-8, 8, (2, cols)).astype(np.float32)
    out = cuda.device_array(x_host.shape, np.float32)
    sm.softmax(sm.softmax_block_row_registers, cuda.to_device(x_host), out)
    np.testing.assert_allclose(out.copy_to_host(), sm.softmax_cpu(x_host), rtol=1e-5, atol=1e-7)


def test_softmax_v4_falls_back_for_long_rows(rng):
    sm = load_chapter_module(CH, "softmax")
    x_host = rng.uniform(-8, 8, (1, sm.MAX_REGISTER_COLS + 5)).astype(np.float32)
    out = cuda.device_array(x_host.shape, np.float32)
    sm.softmax(sm.softmax_block_row_registers, cuda.to_device(x_host), out)
    np.testing.assert_allclose(out.copy_to_host(), sm.softmax_cpu(x_host), rtol=1e-5, atol=1e-9)


def test_launchers_refuse_bad_inputs():
    red = load_chapter_module(CH, "reduction")
    tr = load_chapter_module(CH, "transpose")
    sm = load_chapter_module(CH, "softmax")
    hist = load_chapter_module(CH, "histogram")
    f64 = cuda.to_device(np.ones(8))
    out1 = cuda.device_array(1, np.float32)
    with pytest.raises(TypeError, match="float32"):
        red.reduce_two_pass(f64, out1)
    with pytest.raises(TypeError, match="host"):
        red.reduce_two_pass(np.ones(8, np.float32), out1)
    with pytest.raises(ValueError, match="shape"):
        tr.transpose(
            tr.transpose_smem_padded,
            cuda.to_device(np.ones((2, 3), np.float32)),
            cuda.device_array((2, 3), np.float32),
        )
    with pytest.raises(ValueError, match="2-D"):
        sm.softmax(
            sm.softmax_block_row_online,
            cuda.to_device(np.ones(4, np.float32)),
            cuda.device_array(4, np.float32),
        )
    with pytest.raises(TypeError, match="int32"):
        hist.histogram_v3(
            cuda.to_device(np.ones(4, np.float32)), cuda.device_array(hist.NBINS, np.float32)
        )


def test_readme_code_matches_chapter():
    problems = sync_readme(chapter_dir(CH) / "README.md", write=False)
    assert not problems, "\n".join(problems) + "\nrun: python -m common.internal.readme_sync"


# ---------------------------------------------------------------- single-pass scan
# Small kernels of the same factory: tiles of 32 x 5 = 160 elements, a look-back
# window of 4, so a few hundred elements make many tiles and several rounds.
SMALL_BLOCK, SMALL_ITEMS, SMALL_WINDOW = 32, 5, 4
SMALL_TILE = SMALL_BLOCK * SMALL_ITEMS


def _small_scan(decoupled: bool, window: int = SMALL_WINDOW):
    scan = load_chapter_module(CH, "scan")
    return scan.make_scan_single_pass(SMALL_BLOCK, SMALL_ITEMS, window, decoupled)


@pytest.mark.parametrize("decoupled", [False, True], ids=["chained", "look-back"])
def test_single_pass_scan_on_hostile_sizes(decoupled, rng):
    scan = load_chapter_module(CH, "scan")
    kernel = _small_scan(decoupled, SMALL_WINDOW if decoupled else 1)
    sizes = [1, SMALL_TILE - 1, SMALL_TILE, SMALL_TILE + 1, 7 * SMALL_TILE + 5]
    sizes.append(int(rng.integers(2 * SMALL_TILE, 12 * SMALL_TILE)))
    for n in sizes:
        x = rng.integers(-50, 51, n).astype(np.int32)
        out = guarded(n, np.int32)
        scan.scan_single_pass(kernel, cuda.to_device(x), out.array, SMALL_BLOCK, SMALL_ITEMS)
        check(out.array, np.cumsum(x).astype(np.int32), name=f"single-pass scan n={n}")
        out.check_untouched()


def _staged_lookback(kernel, flags, aggregates, prefixes, x, tile):
    """Run tile ``tile`` alone (one block, the ticket set to it) over status that
    earlier tiles left mid-flight, as blocks on a GPU do; return its output and
    the status after it."""
    out = cuda.to_device(np.full(x.size, -7, np.int32))
    status = [cuda.to_device(a) for a in (flags, aggregates, prefixes)]
    ticket = cuda.to_device(np.array([tile], np.int32))
    kernel[1, SMALL_BLOCK](cuda.to_device(x), out, *status, ticket)
    return out.copy_to_host(), [a.copy_to_host() for a in status]


def test_lookback_sums_aggregates_back_to_the_nearest_prefix(rng):
    scan = load_chapter_module(CH, "scan")
    tiles, me = 11, 10
    x = rng.integers(-50, 51, tiles * SMALL_TILE - 5).astype(np.int32)
    ref = np.cumsum(x).astype(np.int32)
    totals = np.add.reduceat(x, np.arange(0, x.size, SMALL_TILE)).astype(np.int32)
    inclusive = np.cumsum(totals).astype(np.int32)
    junk = np.int32(1_000_003)
    # Tiles 0-2 published wrong prefixes (a look-back that goes past tile 3 adds
    # them), tile 3 its prefix but a wrong aggregate (using the aggregate there is
    # wrong), tiles 4-9 their aggregates only, with wrong prefixes: six
    # predecessors to sum, over two rounds of the window of 4.
    flags = np.full(tiles, scan.FLAG_AGGREGATE, np.int32)
    flags[:4] = scan.FLAG_PREFIX
    flags[me] = scan.FLAG_NONE
    aggregates = np.where(np.arange(tiles) >= 4, totals, junk).astype(np.int32)
    prefixes = np.where(np.arange(tiles) == 3, inclusive, junk).astype(np.int32)
    out, (flags_after, _, prefixes_after) = _staged_lookback(
        _small_scan(decoupled=True), flags, aggregates, prefixes, x, me
    )
    mine = slice(me * SMALL_TILE, x.size)
    np.testing.assert_array_equal(out[mine], ref[mine])
    assert (out[: me * SMALL_TILE] == -7).all()  # no other tile's elements
    assert flags_after[me] == scan.FLAG_PREFIX and prefixes_after[me] == inclusive[me]


def test_chained_scan_uses_the_predecessors_prefix_only(rng):
    scan = load_chapter_module(CH, "scan")
    tiles, me = 4, 3
    x = rng.integers(-50, 51, tiles * SMALL_TILE).astype(np.int32)
    ref = np.cumsum(x).astype(np.int32)
    totals = np.add.reduceat(x, np.arange(0, x.size, SMALL_TILE)).astype(np.int32)
    flags = np.array([scan.FLAG_PREFIX] * 3 + [scan.FLAG_NONE], np.int32)
    aggregates = np.full(tiles, 1_000_003, np.int32)
    prefixes = np.cumsum(totals).astype(np.int32)
    prefixes[:2] = 1_000_003
    out, _ = _staged_lookback(
        _small_scan(decoupled=False, window=1), flags, aggregates, prefixes, x, me
    )
    np.testing.assert_array_equal(out[me * SMALL_TILE :], ref[me * SMALL_TILE :])


@pytest.mark.skipif(
    not common.is_simulator(),
    reason="the race detector and the spin check are the simulator's; on a GPU this kernel may pass by luck",
)
def test_race_detector_catches_a_prefix_published_without_the_fence(rng):
    # The simulator runs blocks one after another, so a tile finds its
    # predecessor's prefix published and reads it: a prefix written without the
    # fence before its flag is reported. (A missing fence before the aggregate's
    # flag cannot show there: no tile ever finds an aggregate-only predecessor.)
    scan = load_chapter_module(CH, "scan")
    no_fence = (
        "prefixes[tile] = exclusive + runs[block - 1]\n            cuda.threadfence()\n",
        "prefixes[tile] = exclusive + runs[block - 1]\n",
    )
    factory = mutant(scan.make_scan_single_pass, no_fence, name="scan_no_fence")
    kernel = factory(SMALL_BLOCK, SMALL_ITEMS, SMALL_WINDOW, True)
    n = 3 * SMALL_TILE + 1
    x = cuda.to_device(rng.integers(-50, 51, n).astype(np.int32))
    out = cuda.device_array(n, np.int32)
    with pytest.raises(RaceError, match="threadfence"):
        scan.scan_single_pass(kernel, x, out, SMALL_BLOCK, SMALL_ITEMS)


@pytest.mark.skipif(
    not common.is_simulator(),
    reason="the race detector and the spin check are the simulator's; on a GPU this kernel hangs",
)
def test_a_tile_that_never_publishes_its_prefix_is_a_deadlock_not_a_hang(rng):
    # Chained: tile 2 waits for tile 1's prefix. Without the publish it would
    # spin for ever on a GPU; the simulator reports the spin.
    from common import DeadlockError

    scan = load_chapter_module(CH, "scan")
    no_publish = ("            cuda.atomic.exch(flags, tile, FLAG_PREFIX)\n", "            pass\n")
    factory = mutant(scan.make_scan_single_pass, no_publish, name="scan_no_publish")
    kernel = factory(SMALL_BLOCK, SMALL_ITEMS, 1, False)
    n = 2 * SMALL_TILE + 3
    x = cuda.to_device(rng.integers(-50, 51, n).astype(np.int32))
    with pytest.raises(DeadlockError, match=r"flags|never published"):
        scan.scan_single_pass(kernel, x, cuda.device_array(n, np.int32), SMALL_BLOCK, SMALL_ITEMS)
