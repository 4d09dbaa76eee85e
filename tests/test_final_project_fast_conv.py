"""The fast convolution kernels (final_project/fast_conv.py) against torch.autograd in float64.

Same method as tests/test_final_project_layers.py and final_project/checks.py:
fresh random float32 inputs, the float64 truth from torch (F.conv2d, then
backward with a random upstream gradient), our kernels writing into poisoned,
guarded outputs (NaN everywhere, a poisoned margin that must stay untouched),
compared with common.checking.check. Shapes are hostile and tiny (the simulator
runs a Python thread per CUDA thread): batch 1, odd channel counts, pixel
counts that are and are not multiples of the tile, K = 1, 2, 3, 5, pad 0, a
1 x 1 image, output channels whose |mean| is 40 to 1000 times their std (the
batchnorm sums must not cancel). Most tests use the simulator tiles (8-thread
blocks); one test per kernel runs the GPU tile shape on a problem of one or two
blocks, so the code path a GPU takes is the one checked.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mutants import mutant
from numba import cuda

from final_project import fast_conv as FC

# float32 kernels against float64 truth. Every output is a sum of at most
# Ci*K*K products (grad weight: at most max_chunk per float32 partial, the
# partials added in float64), so float32 rounding leaves a relative error near
# 1e-7 to 1e-6; the capstone's bar of 1e-4 (final_project/checks.py) keeps a
# 100x margin, while a wrong index, a skipped tile or a race errs by ~1e-1 or more.
TOL = 1e-4


def _problem(rng, n, c_in, c_out, h, w, k, pad, large_mean=False):
    """Inputs (host and device) and the float64 torch references for one conv;
    ``large_mean``: a bias that moves the output channels' means far from 0
    (:func:`_large_mean_bias`)."""
    x = random_array((n, c_in, h, w), np.float32, rng)
    wt = random_array((c_out, c_in, k, k), np.float32, rng)
    b = _large_mean_bias(rng, x, wt, pad) if large_mean else random_array(c_out, np.float32, rng)
    tx, tw, tb = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (x, wt, b))
    out = F.conv2d(tx, tw, tb, padding=pad)
    dout = random_array(tuple(out.shape), np.float32, rng)
    out.backward(torch.from_numpy(dout.astype(np.float64)))
    return SimpleNamespace(
        n=n,
        c_in=c_in,
        c_out=c_out,
        k=k,
        pad=pad,
        h_out=out.shape[2],
        w_out=out.shape[3],
        x=x,
        w=wt,
        out=out.detach().numpy(),
        dx=tx.grad.numpy(),
        dw=tw.grad.numpy(),
        db=tb.grad.numpy(),
        x_=cuda.to_device(x),
        w_=cuda.to_device(wt),
        b_=cuda.to_device(b),
        dout_=cuda.to_device(dout),
    )


# The output channels' |mean| / std under _large_mean_bias: from 40, where a
# float32 E[x^2] - E[x]^2 starts to lose the variance (its rounding, about
# R^2 eps32 of var, reaches 1e-4), to 1000, where float32 data still resolve
# the spread (a value's rounding is 1e-4 of std).
MEAN_OVER_STD = (40.0, 1000.0)


def _large_mean_bias(rng, x, wt, pad):
    """A float32 bias that puts output channel c's mean at R_c times its std
    (random signs), R_c spread geometrically over MEAN_OVER_STD in random order,
    as a convolution before batchnorm can have (a large bias, or inputs all of
    one sign, as after a ReLU)."""
    out = F.conv2d(*(torch.from_numpy(a.astype(np.float64)) for a in (x, wt)), padding=pad)
    mean, std = out.mean((0, 2, 3)).numpy(), out.std((0, 2, 3), unbiased=False).numpy()
    ratio = rng.permutation(np.geomspace(*MEAN_OVER_STD, wt.shape[0]))
    sign = rng.choice([-1.0, 1.0], wt.shape[0])
    return (sign * ratio * std - mean).astype(np.float32)


def _block_sums(out, rows, block):
    """Reference bn_partials (rows, 2, Co): sums and sums of squares of out over
    each block of ``block`` consecutive output pixels (n, oh, ow)."""
    c_out = out.shape[1]
    per_pixel = out.transpose(0, 2, 3, 1).reshape(-1, c_out)
    padded = np.zeros((rows * block, c_out))
    padded[: per_pixel.shape[0]] = per_pixel
    blocks = padded.reshape(rows, block, c_out)
    return np.stack([blocks.sum(1), (blocks * blocks).sum(1)], axis=1)


def _check_forward(pb, launch, rows, block, name):
    out = guarded(pb.out.shape, np.float32)
    parts = guarded((rows, 2, pb.c_out), np.float64)
    launch(pb.x_, pb.w_, pb.b_, pb.pad, out.array, parts.array)
    out.check_untouched(f"{name} out")
    parts.check_untouched(f"{name} bn_partials")
    check(out.array, pb.out, TOL, f"{name} out")
    got = parts.array.copy_to_host()
    # The batch statistics (summed over p), then each block's own row.
    check(got.sum(0)[0], pb.out.sum((0, 2, 3)), TOL, f"{name} channel sums")
    check(got.sum(0)[1], (pb.out**2).sum((0, 2, 3)), TOL, f"{name} channel sums of squares")
    ref = _block_sums(pb.out, rows, block)
    check(got[:, 0], ref[:, 0], TOL, f"{name} per-block sums")
    check(got[:, 1], ref[:, 1], TOL, f"{name} per-block sums of squares")


def check_large_mean_statistics(pb, launch, rows, per_thread, name):
    """The batch variance that bn_stats_finalize will take from ``bn_partials``,
    sum x^2 / n - (sum x / n)^2 per channel, against the variance of the
    kernel's own float32 output (in float64), on channels whose |mean| is 40 to
    1000 times their std.

    The tolerance is the float32 rounding of sums taken around one of a
    thread's values (fast_conv.shifted_sums): each of a thread's ``per_thread``
    values x enters as d = x - shift, |d| <= 2D with D = max |x - mean| over
    the channel; the sums of d and d^2 and the d themselves round by at most
    about 4 (per_thread + 1) eps32 D^2 of var per value, averaged (Higham,
    sec. 2.2; the float64 steps add R^2 * 1e-16, far less). The same sums taken
    around 0 (x for d) err by about R^2 eps32 var / sqrt(n): at R = 1000 a
    thousand times more, so that kernel fails.
    """
    out = guarded(pb.out.shape, np.float32)
    parts = guarded((rows, 2, pb.c_out), np.float64)
    launch(pb.x_, pb.w_, pb.b_, pb.pad, out.array, parts.array)
    out.check_untouched(f"{name} out")
    parts.check_untouched(f"{name} bn_partials")
    check(out.array, pb.out, TOL, f"{name} out")
    z = out.array.copy_to_host().astype(np.float64)
    count = z.size // pb.c_out
    sums = parts.array.copy_to_host().sum(0)
    var = sums[1] / count - (sums[0] / count) ** 2
    var_ref = z.var((0, 2, 3))
    spread = np.abs(z - z.mean((0, 2, 3), keepdims=True)).max((0, 2, 3)) ** 2
    tol = rounding_tolerance(var_ref, spread, 4 * (per_thread + 1), 0.0)
    check(var, var_ref, tol, f"{name} channel variances (|mean| = 40 to 1000 std)")


# Large-mean checks: the simulator tiles on 20 and 24 pixels, and the GPU tiles
# on problems where some threads hold all 8 of their rows (igemm: 81 pixels
# in a 128-row tile; direct: 256 pixels, one block); at least two output
# channels, so R = 40 and R = 1000 both occur.
LARGE_MEAN_SHAPES = [(1, 3, 5, 4, 5, 3, 1), (2, 2, 3, 4, 3, 3, 1)]


@pytest.mark.parametrize(
    "tiles, shape",
    [(FC.SIM_IGEMM_TILES, s) for s in LARGE_MEAN_SHAPES]
    + [(FC.GPU_IGEMM_TILES, (1, 1, 3, 9, 9, 3, 1))],
    ids=["sim-batch1-odd", "sim-batch2", "gpu-tiles"],
)
def test_forward_igemm_large_mean_variance(rng, tiles, shape):
    pb = _problem(rng, *shape, large_mean=True)
    rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out, tiles)
    launch = lambda *a: FC.conv2d_forward_igemm(*a, tiles=tiles)  # noqa: E731
    check_large_mean_statistics(pb, launch, rows, tiles.tm, "igemm forward")


@pytest.mark.parametrize(
    "tiles, shape",
    [(FC.SIM_DIRECT_TILES, s) for s in LARGE_MEAN_SHAPES]
    + [(FC.GPU_DIRECT_TILES, (1, 1, 2, 16, 16, 3, 1))],
    ids=["sim-batch1-odd", "sim-batch2", "gpu-tiles"],
)
def test_forward_direct_large_mean_variance(rng, tiles, shape):
    pb = _problem(rng, *shape, large_mean=True)
    rows = FC.conv2d_forward_direct_partial_rows(pb.n, pb.h_out, pb.w_out, pb.c_out, tiles)
    launch = lambda *a: FC.conv2d_forward_direct(*a, tiles=tiles)  # noqa: E731
    check_large_mean_statistics(pb, launch, rows, tiles.tp, "direct forward")


def check_forward_igemm(rng, shape, tiles):
    pb = _problem(rng, *shape)
    rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out, tiles)
    _check_forward(
        pb, lambda *a: FC.conv2d_forward_igemm(*a, tiles=tiles), rows, tiles.bm, "igemm forward"
    )


def check_forward_direct(rng, shape, tiles):
    pb = _problem(rng, *shape)
    rows = FC.conv2d_forward_direct_partial_rows(pb.n, pb.h_out, pb.w_out, pb.c_out, tiles)
    _check_forward(
        pb,
        lambda *a: FC.conv2d_forward_direct(*a, tiles=tiles),
        rows,
        tiles.txp * tiles.tp,
        "direct forward",
    )


def check_grad_input(rng, shape, tiles):
    pb = _problem(rng, *shape)
    dx = guarded(pb.x.shape, np.float32)
    FC.conv2d_grad_input_igemm(pb.dout_, pb.w_, pb.pad, dx.array, tiles=tiles)
    dx.check_untouched("grad input")
    check(dx.array, pb.dx, TOL, "grad input")


def _grad_weight_buffers(pb, tiles):
    shape = FC.conv2d_grad_weight_igemm_partials_shape(
        pb.n, pb.h_out, pb.w_out, pb.c_out, pb.c_in, pb.k, tiles
    )
    return (
        guarded(pb.w.shape, np.float32),
        guarded(pb.c_out, np.float32),
        guarded(shape, np.float32),
    )


def check_grad_weight(rng, shape, tiles):
    pb = _problem(rng, *shape)
    dw, db, parts = _grad_weight_buffers(pb, tiles)
    FC.conv2d_grad_weight_igemm(
        pb.dout_, pb.x_, pb.pad, dw.array, db.array, parts.array, tiles=tiles
    )
    for g, name in ((dw, "dw"), (db, "db"), (parts, "split-K partials")):
        g.check_untouched(f"grad weight {name}")
    check(dw.array, pb.dw, TOL, "grad weight")
    check(db.array, pb.db, TOL, "grad bias")


# (n, c_in, c_out, h, w, k, pad). With the simulator's 8-row tiles:
SHAPES = [
    (1, 3, 5, 4, 5, 3, 1),  # batch 1, odd channels; 20 pixels: 2.5 tiles
    (2, 2, 3, 4, 4, 3, 1),  # 32 pixels: exactly 4 tiles
    (1, 2, 3, 5, 4, 5, 2),  # 5 x 5 kernel
    (2, 3, 2, 5, 4, 3, 0),  # no padding: the output shrinks to 3 x 2
    (3, 2, 3, 1, 1, 3, 1),  # 1 x 1 image: only the kernel's centre sees data
    (1, 2, 3, 3, 4, 2, 1),  # even kernel: the output grows to 4 x 5
]
IDS = ["batch1-odd", "exact-tiles", "k5", "pad0", "1x1", "k2"]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_forward_igemm(rng, shape):
    check_forward_igemm(rng, shape, FC.SIM_IGEMM_TILES)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_grad_input_igemm(rng, shape):
    check_grad_input(rng, shape, FC.SIM_IGEMM_TILES)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_grad_weight_igemm(rng, shape):
    check_grad_weight(rng, shape, FC.SIM_GRAD_WEIGHT_TILES)


@pytest.mark.parametrize(
    "shape",
    [
        (2, 1, 5, 6, 5, 3, 1),  # conv1: one input channel
        (1, 3, 4, 4, 5, 3, 1),  # 3 input channels: two staged weight chunks of 2
        (1, 1, 3, 5, 6, 5, 2),  # 5 x 5 kernel
        (2, 2, 3, 4, 4, 3, 0),  # 8 pixels: exactly one pixel block
        (3, 1, 2, 1, 1, 3, 1),  # 1 x 1 image
    ],
    ids=["ci1", "ci3", "k5", "exact-block", "1x1"],
)
def test_forward_direct(rng, shape):
    check_forward_direct(rng, shape, FC.SIM_DIRECT_TILES)


# Other tile shapes: whole 3 x 3 kernels in a K-tile of 2 channels (Ci = 3 leaves
# the last K-tile half empty); two threads per im2col row (R = 2); a 1 x 1 kernel.
@pytest.mark.parametrize(
    "tiles, shape",
    [
        (FC.IgemmTiles(8, 8, 2, 4, 18), (1, 3, 5, 4, 5, 3, 1)),
        (FC.IgemmTiles(4, 8, 2, 2, 8), (1, 3, 5, 3, 4, 3, 1)),
        (FC.IgemmTiles(8, 4, 2, 2, 6), (2, 5, 3, 3, 2, 1, 0)),
    ],
    ids=["whole-kernels", "two-threads-a-row", "k1"],
)
def test_igemm_other_tiles(rng, tiles, shape):
    check_forward_igemm(rng, shape, tiles)
    check_grad_input(rng, shape, tiles)


# The GPU tile shapes, on problems of one or two blocks.
def test_forward_igemm_gpu_tiles(rng):
    check_forward_igemm(rng, (1, 1, 5, 5, 6, 3, 1), FC.GPU_IGEMM_TILES)


@pytest.mark.parametrize(
    "tiles, shape",
    [
        (FC.GPU_IGEMM_TILES_NARROW, (1, 3, 2, 5, 6, 3, 1)),
        # weight loads by channel runs: 4 slots of 4 channels, Co = 5 leaves the
        # second K-tile's last three channels empty, Ci = 3 of 32 columns
        (FC.GPU_IGEMM_TILES_DGRAD_NARROW, (1, 3, 5, 5, 6, 3, 1)),
    ],
    ids=["narrow", "dgrad-narrow"],
)
def test_grad_input_igemm_gpu_tiles(rng, tiles, shape):
    check_grad_input(rng, shape, tiles)


def test_dgrad_tiles_are_chosen_for_the_grad_input(monkeypatch):
    """conv2's grad input at N = 1024 (Ci = 32 GEMM columns) takes the K-tiles of
    36 whose weight loads run by channel; conv1's forward (Co = 32) keeps K-tiles
    of 18 (36 would leave 3 of 4 channel slots empty for Ci = 1)."""
    for name in ("IGEMM_TILES", "IGEMM_TILES_NARROW", "IGEMM_TILES_DGRAD_NARROW"):
        monkeypatch.setattr(FC, name, getattr(FC, "GPU_" + name))
    monkeypatch.setattr(FC, "sm_count", lambda: 132)
    m = 1024 * 14 * 14
    assert FC.igemm_tiles(m, 32, forward=False) == FC.GPU_IGEMM_TILES_DGRAD_NARROW
    assert FC.igemm_tiles(m, 32) == FC.GPU_IGEMM_TILES_NARROW
    cb, _ = FC.igemm_k_tile(FC.GPU_IGEMM_TILES_DGRAD_NARROW, 3)
    t = FC.GPU_IGEMM_TILES_DGRAD_NARROW
    assert cb % (t.threads // t.bn) == 0, "the channel-run weight loads need whole channels a slot"


def test_forward_direct_gpu_tiles(rng):
    check_forward_direct(rng, (1, 1, 5, 6, 7, 3, 1), FC.GPU_DIRECT_TILES)


def test_grad_weight_igemm_gpu_tiles(rng):
    # The GPU tile shape with chunks of one K-tile, so the split-K path runs (2 chunks).
    tiles = dataclasses.replace(
        FC.GPU_GRAD_WEIGHT_TILES, max_chunk=16, min_chunk=16, blocks_per_sm=1
    )
    check_grad_weight(rng, (1, 2, 3, 5, 5, 3, 1), tiles)


def test_results_are_deterministic(rng):
    """No atomics, fixed summation orders: two runs agree bit for bit."""
    pb = _problem(rng, 2, 2, 3, 4, 3, 3, 1)
    rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out)
    runs = []
    for _ in range(2):
        out = cuda.device_array(pb.out.shape, np.float32)
        parts = cuda.device_array((rows, 2, pb.c_out), np.float64)
        FC.conv2d_forward_igemm(pb.x_, pb.w_, pb.b_, pb.pad, out, parts)
        dw, db, wparts = (g.array for g in _grad_weight_buffers(pb, None))
        FC.conv2d_grad_weight_igemm(pb.dout_, pb.x_, pb.pad, dw, db, wparts)
        runs.append([a.copy_to_host() for a in (out, parts, dw, db)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# Broken kernels must fail the checks (deterministically)
# ---------------------------------------------------------------------------


def test_check_catches_skipped_last_k_tile(rng):
    """The forward kernel from the factory, launched one K-tile short: the last
    kernel-row block of the last input channel is never added."""
    tiles = FC.SIM_IGEMM_TILES
    cb, kr = FC.igemm_k_tile(tiles, 3)
    kernel = FC.make_conv2d_igemm(tiles.bm, tiles.bn, tiles.tm, tiles.tn, 3, cb, kr, True)

    def broken(x, w, b, pad, out, bn_partials, tiles=None):
        k_tiles = -(-x.shape[1] // cb) * -(-3 // kr)
        FC.launch_conv2d_igemm(kernel, x, w, b, pad, out, bn_partials, k_tiles - 1)

    pb = _problem(rng, 1, 3, 5, 4, 5, 3, 1)
    rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out, tiles)
    with pytest.raises(CheckError, match="igemm forward out"):
        _check_forward(pb, broken, rows, tiles.bm, "igemm forward")


# The epilogue as it was: float32 sums of x and x^2 around 0, the one-pass
# E[x^2] - E[x]^2 that cancels when |mean| >> std.
UNSHIFTED = ("shift[j] = acc[0, j] + bias[j]", "shift[j] = float32(0.0)")


@pytest.mark.parametrize("kind", ["igemm", "direct"])
def test_large_mean_check_catches_sums_around_zero(rng, kind):
    pb = _problem(rng, *LARGE_MEAN_SHAPES[0], large_mean=True)
    if kind == "igemm":
        t = FC.SIM_IGEMM_TILES
        cb, kr = FC.igemm_k_tile(t, pb.k)
        kernel = mutant(FC.make_conv2d_igemm, UNSHIFTED)(t.bm, t.bn, t.tm, t.tn, pb.k, cb, kr, True)
        rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out, t)
        k_tiles = -(-pb.c_in // cb) * -(-pb.k // kr)

        def broken(x, w, b, pad, out, bn_partials):
            FC.launch_conv2d_igemm(kernel, x, w, b, pad, out, bn_partials, k_tiles)

        per_thread = t.tm
    else:
        t = FC.SIM_DIRECT_TILES
        kernel = mutant(FC.make_conv2d_direct, UNSHIFTED)(
            t.txp, t.tp, t.tyc, t.tc, pb.k, FC.direct_ci_chunk(t, pb.k)
        )
        rows = FC.conv2d_forward_direct_partial_rows(pb.n, pb.h_out, pb.w_out, pb.c_out, t)

        def broken(x, w, b, pad, out, bn_partials):
            flat = [a.reshape(a.size) for a in (x, w)]
            kernel[(rows, -(-pb.c_out // (t.tyc * t.tc))), kernel.threads](
                *flat,
                b,
                out.reshape(out.size),
                bn_partials,
                pb.n,
                pb.c_in,
                *x.shape[2:],
                pb.c_out,
                pb.h_out,
                pb.w_out,
                pad,
            )

        per_thread = t.tp
    with pytest.raises(CheckError, match="channel variances"):
        check_large_mean_statistics(pb, broken, rows, per_thread, kind)


# The grad input's channel-run weight loads (make_conv2d_igemm, B_RUNS) read a
# kernel row forwards: the kernel is not flipped.
UNFLIPPED = (
    "v = w[uint64(w_at + sl * KSPLIT * s_c - e)]",
    "v = w[uint64(w_at + sl * KSPLIT * s_c + e - (KK2 - 1) + 2 * kh0 * KSIZE)]",
)


def test_check_catches_unflipped_channel_run_weights(rng):
    tiles = FC.IgemmTiles(8, 8, 2, 4, 18)  # 8 threads, 8 columns: one slot, whole kernels
    cb, kr = FC.igemm_k_tile(tiles, 3)
    kernel = mutant(FC.make_conv2d_igemm, UNFLIPPED)(
        tiles.bm, tiles.bn, tiles.tm, tiles.tn, 3, cb, kr, False
    )
    pb = _problem(rng, 1, 3, 5, 4, 5, 3, 1)
    dx = guarded(pb.x.shape, np.float32)
    kernel[(-(-pb.n * 4 * 5 // tiles.bm), 1), kernel.threads](
        *(a.reshape(a.size) for a in (pb.dout_, pb.w_, pb.w_, dx.array)),
        dx.array.reshape(pb.n * pb.c_in, 4, 5),
        pb.n,
        pb.c_out,
        pb.h_out,
        pb.w_out,
        pb.c_in,
        4,
        5,
        3 - 1 - pb.pad,
        -(-pb.c_out // cb),
    )
    with pytest.raises(CheckError, match="grad input"):
        check(dx.array, pb.dx, TOL, "grad input")


def test_check_catches_dropped_split_k_chunk(rng):
    """The weight gradient with a reduction that stops one chunk short."""
    tiles = FC.SIM_GRAD_WEIGHT_TILES
    kernel = FC.make_conv2d_grad_weight_igemm(tiles.bm, tiles.bn, tiles.bk, tiles.tm, tiles.tn)
    pb = _problem(rng, 1, 2, 3, 4, 5, 3, 1)
    dw, db, parts = _grad_weight_buffers(pb, tiles)
    s_count, chunk = FC.grad_weight_split(
        pb.n * pb.h_out * pb.w_out, pb.c_out, pb.c_in * 9 + 1, tiles
    )
    assert s_count >= 2
    FC.launch_conv2d_grad_weight_igemm(
        kernel, pb.dout_, pb.x_, pb.pad, dw.array, db.array, parts.array, chunk, s_count - 1
    )
    with pytest.raises(CheckError, match="grad weight"):
        check(dw.array, pb.dw, TOL, "grad weight")


# ---------------------------------------------------------------------------
# Launch policy and argument checks (no kernels run)
# ---------------------------------------------------------------------------


# SM counts of the GPUs a learner meets: a T4 (40), an RTX 4090 (128), an H100 (132),
# and below and above them.
SM_COUNTS = [20, 40, 128, 132, 140]


@pytest.mark.parametrize("sms", SM_COUNTS)
@pytest.mark.parametrize("batch", [64, 256, 1024])
def test_grad_weight_split_fills_the_gpu(batch, sms, monkeypatch):
    """At the network's shapes, on a GPU of ``sms`` SMs, every chunk is a whole
    number of K-tiles, at most max_chunk pixels (short float32 sums), the chunks
    cover the batch exactly, and the grid has at least one block per SM."""
    monkeypatch.setattr(FC, "sm_count", lambda: sms)
    for c_out, c_in, size, tiles in (
        (64, 32, 14, FC.GPU_GRAD_WEIGHT_TILES),
        (32, 1, 28, FC.GPU_GRAD_WEIGHT_TILES_SMALL),
    ):
        m_total = batch * size * size
        n_cols = c_in * 9 + 1
        s_count, chunk = FC.grad_weight_split(m_total, c_out, n_cols, tiles)
        assert chunk % tiles.bk == 0 and chunk <= tiles.max_chunk
        assert (s_count - 1) * chunk < m_total <= s_count * chunk
        blocks = s_count * -(-c_out // tiles.bm) * -(-n_cols // tiles.bn)
        assert blocks >= sms
        assert FC.conv2d_grad_weight_igemm_partials_shape(
            batch, size, size, c_out, c_in, 3, tiles
        ) == (s_count, c_out, n_cols)


def test_grad_weight_split_follows_the_sm_count(monkeypatch):
    """The split-K grid is sized for the device it runs on: conv2's weight gradient
    at batch 64 (12,544 pixels, 5 tiles a chunk) is cut into about 4 blocks an SM,
    49 chunks on an H100 (capped by min_chunk), 32 on a T4's 40 SMs."""
    tiles = FC.GPU_GRAD_WEIGHT_TILES
    split = {}
    for sms in (40, 132):
        monkeypatch.setattr(FC, "sm_count", lambda sms=sms: sms)
        split[sms] = FC.grad_weight_split(64 * 14 * 14, 64, 32 * 9 + 1, tiles)[0]
    assert split == {40: 32, 132: 49}


def test_igemm_small_grid_follows_the_sm_count(monkeypatch):
    """conv2's forward at batch 64 is 98 row tiles of 128: fewer than 2 an SM on an
    H100 (64-row tiles, so more SMs get work), more than 2 an SM on a T4."""
    for name in ("IGEMM_TILES", "IGEMM_TILES_SMALL_M"):
        monkeypatch.setattr(FC, name, getattr(FC, "GPU_" + name))
    chosen = {}
    for sms in (40, 132):
        monkeypatch.setattr(FC, "sm_count", lambda sms=sms: sms)
        chosen[sms] = FC.igemm_tiles(64 * 14 * 14, 64)
    assert chosen == {40: FC.GPU_IGEMM_TILES, 132: FC.GPU_IGEMM_TILES_SMALL_M}


@pytest.mark.parametrize("sms", [1, 30])
def test_grad_weight_igemm_on_other_sm_counts(rng, monkeypatch, sms):
    """Another SM count, another split of the 40 pixels (5 chunks of 8 on 1 SM,
    where max_chunk binds; 10 of 4 on 30 SMs): the same gradient."""
    monkeypatch.setattr(FC, "sm_count", lambda: sms)
    tiles = FC.SIM_GRAD_WEIGHT_TILES
    s_count, _ = FC.grad_weight_split(2 * 4 * 5, 3, 2 * 9 + 1, tiles)
    assert s_count == {1: 5, 30: 10}[sms]
    check_grad_weight(rng, (2, 2, 3, 4, 5, 3, 1), tiles)


def test_every_kernel_size_fits_the_gpu_tiles():
    """Each GPU tile shape builds (shared memory within 48 KiB) for K = 1..15."""
    igemm = (
        FC.GPU_IGEMM_TILES,
        FC.GPU_IGEMM_TILES_NARROW,
        FC.GPU_IGEMM_TILES_SMALL_M,
        FC.GPU_IGEMM_TILES_SMALL_M_NARROW,
    )
    t = FC.GPU_DIRECT_TILES
    for k in range(1, FC.MAX_KERNEL_SIZE + 1):
        for tiles in igemm:
            cb, kr = FC.igemm_k_tile(tiles, k)
            for forward in (True, False):
                FC.make_conv2d_igemm(tiles.bm, tiles.bn, tiles.tm, tiles.tn, k, cb, kr, forward)
        tiles = FC.GPU_IGEMM_TILES_DGRAD_NARROW  # the grad input's only
        cb, kr = FC.igemm_k_tile(tiles, k)
        FC.make_conv2d_igemm(tiles.bm, tiles.bn, tiles.tm, tiles.tn, k, cb, kr, False)
        FC.make_conv2d_direct(t.txp, t.tp, t.tyc, t.tc, k, FC.direct_ci_chunk(t, k))


def test_bad_arguments_are_refused(rng):
    pb = _problem(rng, 1, 2, 3, 4, 4, 3, 1)
    rows = FC.conv2d_forward_igemm_partial_rows(pb.n, pb.h_out, pb.w_out)
    out = cuda.device_array(pb.out.shape, np.float32)
    with pytest.raises(ValueError, match="bn_partials"):
        FC.conv2d_forward_igemm(
            pb.x_, pb.w_, pb.b_, pb.pad, out, cuda.device_array((rows + 1, 2, pb.c_out), np.float64)
        )
    with pytest.raises(TypeError):  # float32 partials
        FC.conv2d_forward_direct(
            pb.x_, pb.w_, pb.b_, pb.pad, out, cuda.device_array((rows, 2, pb.c_out), np.float32)
        )
    with pytest.raises(TypeError):  # a host array
        FC.conv2d_grad_input_igemm(pb.dout_, pb.w, pb.pad, cuda.device_array(pb.x.shape))
    with pytest.raises(ValueError, match="out must be"):  # wrong padding for out's shape
        FC.conv2d_forward_igemm(
            pb.x_, pb.w_, pb.b_, 0, out, cuda.device_array((rows, 2, pb.c_out), np.float64)
        )
    big = cuda.to_device(np.zeros((3, 2, 16, 16), np.float32))
    with pytest.raises(ValueError, match="kernel size"):
        FC.conv2d_grad_weight_igemm(
            pb.dout_,
            pb.x_,
            pb.pad,
            big,
            cuda.device_array(3, np.float32),
            cuda.device_array((1, 3, 513), np.float32),
        )
