"""Prefix sum (inclusive scan) of an int32 vector: out[i] = x[0] + ... + x[i].

Versions (each scans one chunk per block, writes the chunk's total to `sums`;
the launcher scans `sums` the same way, recursively, and adds each chunk's
offset: scan-then-propagate):
  version 1 (scan_hillis_steele): BLOCK elements a block; log2(BLOCK) steps,
      step k adds the value 2**k to the left: O(n log n) additions, simple.
  version 2 (scan_blelloch): 2 * BLOCK elements a block; an up-sweep builds
      partial sums in a tree, a down-sweep pushes prefixes back down: O(n)
      additions (work-efficient), twice the elements a thread.
Both read the input twice and write the output twice (scan, then add offsets).
Single pass (one launch, each element read once and written once; blocks take
tiles of TILE = BLOCK * ITEMS elements in the order they start, from an atomic
ticket, and pass prefixes on through status flags in global memory):
  version 3 (scan_chained): each tile waits for its predecessor's inclusive
      prefix: the prefixes travel down the tiles one after another.
  version 4 (scan_lookback): decoupled look-back: a tile publishes its own total
      (aggregate) at once, then sums the aggregates of its predecessors, a
      window of WINDOW at a time, back to the first one whose inclusive prefix
      is published; no tile waits for another's look-back.

Source: Hillis & Steele, "Data parallel algorithms", CACM 29(12), 1986;
G. Blelloch, "Prefix sums and their applications", CMU-CS-90-190 (1990);
M. Harris, S. Sengupta, J. Owens, GPU Gems 3, ch. 39 (2007);
D. Merrill, M. Garland, "Single-pass Parallel Prefix Scan with Decoupled
Look-back", NVIDIA Technical Report NVR-2016-002 (2016).

Run: python chapters/06_memory/scan.py [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array
from common.harness import run_script, run_versions, save_results, script_parser
from common.runtime import ceil_div, pick

import functools

import numpy as np
from numba import cuda, int32

launch = common.import_sibling(__file__, "launch")

BLOCK = 256  # threads per block (a power of two: both trees halve evenly)
# Blelloch: elements a block. A module-level int because a shared array's shape must
# be a compile-time constant: `2 * BLOCK` written inside a kernel is a runtime int64
CHUNK = 2 * BLOCK


def scan_cpu(x: np.ndarray) -> np.ndarray:
    """Inclusive prefix sum, int64 -> cast to int32 (the inputs keep it in range)."""
    return np.cumsum(x, dtype=np.int64).astype(np.int32)


# version 1: Hillis-Steele: read the neighbour 2**k to the left, barrier, add, barrier
@cuda.jit(cache=True)
def scan_hillis_steele(x, out, sums):
    s = cuda.shared.array(BLOCK, int32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s[t] = x[i] if i < x.size else 0
    cuda.syncthreads()
    offset = 1
    while offset < BLOCK:
        v = s[t - offset] if t >= offset else 0
        cuda.syncthreads()  # everyone has read before anyone overwrites
        s[t] += v
        cuda.syncthreads()  # everyone has written before the next read
        offset *= 2
    if i < out.size:
        out[i] = s[t]
    if t == BLOCK - 1:
        sums[cuda.blockIdx.x] = s[t]


# version 2: Blelloch: work-efficient exclusive scan of 2 * BLOCK elements, then + x
@cuda.jit(cache=True)
def scan_blelloch(x, out, sums):
    s = cuda.shared.array(CHUNK, int32)
    t = cuda.threadIdx.x
    base = cuda.blockIdx.x * CHUNK
    i0 = base + t
    i1 = base + t + BLOCK
    x0 = x[i0] if i0 < x.size else 0
    x1 = x[i1] if i1 < x.size else 0
    s[t] = x0
    s[t + BLOCK] = x1
    offset = 1
    d = BLOCK
    while d > 0:  # up-sweep: s[last of each pair-group] += s[last of the left group]
        cuda.syncthreads()
        if t < d:
            a = offset * (2 * t + 1) - 1
            b = offset * (2 * t + 2) - 1
            s[b] += s[a]
        offset *= 2
        d //= 2
    if t == 0:
        sums[cuda.blockIdx.x] = s[CHUNK - 1]
        s[CHUNK - 1] = 0
    d = 1
    while d < CHUNK:  # down-sweep: swap-and-add turns the tree into prefixes
        offset //= 2
        cuda.syncthreads()
        if t < d:
            a = offset * (2 * t + 1) - 1
            b = offset * (2 * t + 2) - 1
            left = s[a]
            s[a] = s[b]
            s[b] += left
        d *= 2
    cuda.syncthreads()
    if i0 < out.size:
        out[i0] = s[t] + x0  # exclusive + own element = inclusive
    if i1 < out.size:
        out[i1] = s[t + BLOCK] + x1


# propagate: chunk b > 0 adds the inclusive scan of the chunk totals up to b - 1
@cuda.jit(cache=True)
def add_chunk_offsets(out, scanned_sums, chunk):
    i = cuda.grid(1)
    if i < out.size:
        b = i // chunk
        if b > 0:
            out[i] += scanned_sums[b - 1]


def _scan_arrays(x, out):
    """``x`` and ``out`` checked: int32 device arrays, 1-D, one length."""
    x = require_device_array(x, "x", ndim=1, dtype=np.int32)
    out = require_device_array(out, "out", ndim=1, dtype=np.int32)
    if out.shape != x.shape:
        raise ValueError(f"x and out must have one length, got {x.shape} and {out.shape}")
    return x, out


def scan(kernel, x, out, level: int = 0) -> None:
    """Inclusive scan of ``x`` int32 (n,) into ``out`` int32 (n,) with ``kernel``
    (:func:`scan_hillis_steele` or :func:`scan_blelloch`), any n >= 1.

    Raises:
        TypeError: not int32 device arrays.
        ValueError: not 1-D arrays of one length.
    """
    x, out = _scan_arrays(x, out)
    chunk = CHUNK if kernel is scan_blelloch else BLOCK
    blocks = ceil_div(x.size, chunk)
    sums = launch.scratch(blocks, np.int32, f"scan sums {level}")
    kernel[blocks, BLOCK](x, out, sums)
    if blocks > 1:
        scanned = launch.scratch(blocks, np.int32, f"scan scanned {level}")
        scan(kernel, sums, scanned, level + 1)
        add_chunk_offsets[ceil_div(x.size, BLOCK), BLOCK](out, scanned, chunk)


# ---------------------------------------------------------------- single pass
# Status of a tile in `flags` (one int32 a tile): nothing published yet, its
# aggregate (the sum of its own elements) in `aggregates`, or its inclusive
# prefix (the sum of every element up to its end) in `prefixes`.
FLAG_NONE, FLAG_AGGREGATE, FLAG_PREFIX = 0, 1, 2
# Elements a thread: odd, so the runs of a warp's 32 threads start in 32 different
# shared-memory banks (35 t mod 32), and a multiple of LOADS. Fewer in the
# simulator: same code, smaller tiles.
ITEMS = pick(gpu=35, simulator=5)
# Loads a thread has in flight: the load loop's body issues LOADS loads before it
# stores the first (the README's scan section measures what that gains).
LOADS = 5
WINDOW = 32  # predecessors whose flags one look-back round reads, one a thread


def make_scan_single_pass(block: int, items: int, window: int, decoupled: bool):
    """A single-pass inclusive scan kernel ``kernel(x, out, flags, aggregates,
    prefixes, ticket)`` over tiles of ``block * items`` int32 elements.

    Launch it with ``block`` threads and one block a tile, after zeroing
    ``flags`` (one int32 a tile) and ``ticket`` (one int32). ``decoupled``:
    False waits for the predecessor's inclusive prefix (version 3, ``window``
    must be 1); True looks back through the aggregates (version 4).
    ``items`` must be a multiple of LOADS (ValueError).
    """
    if items % LOADS:
        raise ValueError(f"items must be a multiple of LOADS={LOADS}, got {items}")
    tile_size = block * items

    @cuda.jit(cache=True)
    def single_pass_scan(x, out, flags, aggregates, prefixes, ticket):
        tile_s = cuda.shared.array(tile_size, int32)
        runs = cuda.shared.array(block, int32)  # inclusive scan of the threads' run totals
        seen = cuda.shared.array(window, int32)  # flags read in one look-back round
        values = cuda.shared.array(window, int32)
        # [0] tile, [1] exclusive prefix so far, [2] next predecessor to read (-1: done)
        state = cuda.shared.array(3, int32)
        t = cuda.threadIdx.x
        if t == 0:
            # Tiles go out in the order blocks start, so every predecessor of a
            # tile has started: waiting for one cannot wait for a block that the
            # GPU has not scheduled (blockIdx carries no such promise).
            state[0] = cuda.atomic.add(ticket, 0, 1)
        cuda.syncthreads()
        tile = state[0]
        base = tile * tile_size
        n = x.size
        for k in range(0, items, LOADS):  # coalesced: consecutive threads, consecutive elements
            e = k * block + t
            i = base + e
            v0 = x[i] if i < n else 0  # five independent loads, then five stores
            v1 = x[i + block] if i + block < n else 0
            v2 = x[i + 2 * block] if i + 2 * block < n else 0
            v3 = x[i + 3 * block] if i + 3 * block < n else 0
            v4 = x[i + 4 * block] if i + 4 * block < n else 0
            tile_s[e] = v0
            tile_s[e + block] = v1
            tile_s[e + 2 * block] = v2
            tile_s[e + 3 * block] = v3
            tile_s[e + 4 * block] = v4
        cuda.syncthreads()
        acc = 0  # each thread scans its own run of `items` consecutive elements
        for k in range(items):
            acc += tile_s[t * items + k]
            tile_s[t * items + k] = acc
        runs[t] = acc
        offset = 1
        while offset < block:  # Hillis-Steele over the run totals
            cuda.syncthreads()
            v = runs[t - offset] if t >= offset else 0
            cuda.syncthreads()
            runs[t] += v
            offset *= 2
        cuda.syncthreads()
        if t == 0:
            state[1] = 0
            state[2] = tile - 1
            if tile == 0:
                prefixes[0] = runs[block - 1]
                cuda.threadfence()  # the value lands before the flag that announces it
                cuda.atomic.exch(flags, 0, FLAG_PREFIX)
            elif decoupled:
                aggregates[tile] = runs[block - 1]
                cuda.threadfence()
                cuda.atomic.exch(flags, tile, FLAG_AGGREGATE)
        cuda.syncthreads()
        while state[2] >= 0:  # the look-back; every thread reads state after a barrier
            first = state[2]
            if t < window:
                j = first - t
                f = FLAG_NONE
                v = 0
                if j >= 0:
                    f = cuda.atomic.add(flags, j, 0)  # an atomic read: never a stale copy
                    cuda.threadfence()  # and the value read after it is the one it announces
                    if f == FLAG_PREFIX:
                        v = prefixes[j]
                    elif f == FLAG_AGGREGATE:
                        v = aggregates[j]
                seen[t] = f
                values[t] = v
            cuda.syncthreads()
            if t == 0:
                acc = state[1]
                nxt = first - window
                for w in range(window):  # nearest first; stop at a gap or a prefix
                    f = seen[w]
                    if f == FLAG_NONE or (f == FLAG_AGGREGATE and not decoupled):
                        nxt = first - w  # not published yet: read it again next round
                        break
                    acc += values[w]
                    if f == FLAG_PREFIX:
                        nxt = -1
                        break
                state[1] = acc
                state[2] = nxt
            cuda.syncthreads()
        exclusive = state[1]
        if t == 0 and tile > 0:
            prefixes[tile] = exclusive + runs[block - 1]
            cuda.threadfence()
            cuda.atomic.exch(flags, tile, FLAG_PREFIX)
        for k in range(items):  # coalesced store; element e is in run e // items
            e = k * block + t
            i = base + e
            if i < n:
                r = e // items
                out[i] = tile_s[e] + exclusive + (runs[r - 1] if r > 0 else 0)

    return single_pass_scan


# version 3: chained: a tile waits for its predecessor's inclusive prefix
scan_chained = make_scan_single_pass(BLOCK, ITEMS, 1, decoupled=False)
# version 4: decoupled look-back over a window of WINDOW predecessors
scan_lookback = make_scan_single_pass(BLOCK, ITEMS, WINDOW, decoupled=True)


@cuda.jit(cache=True)
def reset_status(flags, ticket):
    """Zero the status flags and the ticket before a single-pass scan."""
    i = cuda.grid(1)
    if i < flags.size:
        flags[i] = FLAG_NONE
    if i == 0:
        ticket[0] = 0


def scan_single_pass(kernel, x, out, block: int = BLOCK, items: int = ITEMS) -> None:
    """Inclusive scan of ``x`` int32 (n,) into ``out`` int32 (n,) in one pass with
    ``kernel`` (:data:`scan_chained`, :data:`scan_lookback`, or a kernel of
    :func:`make_scan_single_pass` built for ``block`` and ``items``), any n >= 1.
    Sums wrap around in int32 as the other versions' do.

    Raises:
        TypeError: not int32 device arrays.
        ValueError: not 1-D arrays of one length.
    """
    x, out = _scan_arrays(x, out)
    tiles = ceil_div(x.size, block * items)
    flags = launch.scratch(tiles, np.int32, "scan flags")
    aggregates = launch.scratch(tiles, np.int32, "scan aggregates")
    prefixes = launch.scratch(tiles, np.int32, "scan prefixes")
    ticket = launch.scratch(1, np.int32, "scan ticket")
    reset_status[ceil_div(tiles, BLOCK), BLOCK](flags, ticket)
    kernel[tiles, block](x, out, flags, aggregates, prefixes, ticket)


def run(n: int | None = None) -> list:
    """Check and time every version (default n = 2**26 int32, 256 MiB, on a GPU).
    ``nbytes`` = 8 n: read the input once, write the output once (what a single
    pass moves; versions 1 and 2 move about twice that)."""
    n = n or pick(gpu=1 << 26, simulator=2 * BLOCK + 9)
    x_host = np.random.default_rng(8).integers(-100, 101, n).astype(np.int32)
    x = cuda.to_device(x_host)
    return run_versions(
        {
            "scan v1 Hillis-Steele": functools.partial(scan, scan_hillis_steele),
            "scan v2 Blelloch": functools.partial(scan, scan_blelloch),
            "scan v3 single pass, chained": functools.partial(scan_single_pass, scan_chained),
            "scan v4 single pass, decoupled look-back": functools.partial(
                scan_single_pass, scan_lookback
            ),
        },
        (x,),
        reference=scan_cpu(x_host),
        out_shape=n,
        out_dtype=np.int32,
        nbytes=8 * n,
        title=f"inclusive scan of {n} int32",
        warmup=2,
        repeats=10,
    )


def main(argv=None) -> None:
    args = script_parser(__doc__, "06_memory").parse_args(argv)
    save_results(run(), args.out, "scan")


if __name__ == "__main__":
    run_script(main)
