"""conv1's statistics and weight gradient from the images' patch Gram matrix
(final_project/conv1_gram.py) against float64.

The references are the direct float64 sums (G = sum of v v^T over the pixels,
sum z and sum z^2 of the float64 convolution, and the weight gradient of the
batchnorm backward formula that tests/test_final_project_first_conv.py checks
first_conv's kernel against), so the rewrite into quadratic forms of G is
checked, not assumed. The batchnorm statistics are drawn at random (not the
batch's own), so db does not cancel to 0 and is checked too.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check, guarded, random_array, rounding_tolerance

import numpy as np
import pytest
from conv1_inputs import bn_backward_inputs
from mutants import mutant
from numba import cuda

from final_project import conv1_gram as G
from final_project import reference as ref


def _patches(x: np.ndarray) -> np.ndarray:
    """(pixels, 10) float64: each pixel's 3 x 3 zero-padded neighbourhood, then 1."""
    n, _, h, w = x.shape
    xp = np.pad(x[:, 0].astype(np.float64), ((0, 0), (1, 1), (1, 1)))
    taps = [xp[:, kh : kh + h, kw : kw + w].reshape(-1) for kh in range(3) for kw in range(3)]
    return np.stack(taps + [np.ones(n * h * w)], axis=1)


def _gram_on_device(x):
    n = x.shape[0]
    parts = guarded(G.gram_partials_shape(n), np.float64)
    gram = guarded(G.ENTRIES, np.float64)
    G.patch_gram(cuda.to_device(x), parts.array, gram.array)
    parts.check_untouched("gram partials")
    gram.check_untouched("gram")
    return gram


@pytest.mark.parametrize("n, h, w", [(1, 2, 2), (3, 6, 4), (2, 8, 12)])
def test_patch_gram_matches_float64(rng, n, h, w):
    x = random_array((n, 1, h, w), np.float32, rng)
    gram = _gram_on_device(x)
    v = _patches(x)
    want = v.T @ v
    got = G.gram_matrix(gram.array.copy_to_host())
    # exact products, float64 sums: float64 rounding only
    check(got, want, 1e-12, "G")


def test_gram_bn_sums_match_float64(rng):
    n, h, w, c_out = 3, 6, 4, 5
    x = random_array((n, 1, h, w), np.float32, rng)
    wt = random_array((c_out, 1, 3, 3), np.float32, rng)
    b = random_array(c_out, np.float32, rng)
    gram = _gram_on_device(x)
    parts = guarded((1, 2, c_out), np.float64)
    G.gram_bn_sums(gram.array, cuda.to_device(wt), cuda.to_device(b), parts.array)
    parts.check_untouched("bn partials")
    z, _ = ref.conv2d_forward(x.astype(np.float64), wt.astype(np.float64), b.astype(np.float64))
    got = parts.array.copy_to_host()[0]
    check(got[0], z.sum(axis=(0, 2, 3)), 1e-12, "sum of z")
    check(got[1], (z * z).sum(axis=(0, 2, 3)), 1e-12, "sum of z^2")


def _inputs(rng, n, h, w, c_out):
    return bn_backward_inputs(rng, n, 1, h, w, c_out, first_window_open=True)


def check_grad_weight(rng, n, h, w, c_out, kernel=None):
    """winners_reduce's dgamma and dbeta partials and S, then gram_grad_weight's
    dw and db, against the float64 chain: dz from the batchnorm backward formula
    (the kernel's mean: the batch mean of z, from G), dw = sum dz v."""
    a = _inputs(rng, n, h, w, c_out)
    f = {k: v.astype(np.float64) for k, v in a.items()}
    pc = lambda v: v[None, :, None, None]  # noqa: E731
    z, _ = ref.conv2d_forward(f["x"], f["w"], f["b"], 1)
    m = n * h * w
    mean = z.mean(axis=(0, 2, 3))  # the combination takes the mean from G
    xhat = (z - pc(mean)) * pc(f["invstd"])
    open_ = f["zwin"] * pc(f["scale"]) + pc(f["shift"]) > 0
    g = np.where(open_, f["dpooled"], 0.0)
    code = np.repeat(np.repeat(a["argmax"].astype(np.int64), 2, 2), 2, 3)
    pos = (np.arange(h)[:, None] % 2) * 2 + np.arange(w)[None, :] % 2
    dy = np.where(code == pos, np.repeat(np.repeat(g, 2, 2), 2, 3), 0.0)
    dz = pc(f["gamma"] * f["invstd"] / m) * (m * dy - pc(f["dbeta"]) - xhat * pc(f["dgamma"]))
    _, want_dw, want_db = ref.conv2d_backward(dz, (f["x"], f["w"], 1))
    xhat_win = (f["zwin"] - pc(f["mean"])) * pc(f["invstd"])
    want_dgamma = (g * xhat_win).sum(axis=(0, 2, 3))
    want_dbeta = g.sum(axis=(0, 2, 3))

    dev = {k: cuda.to_device(v) for k, v in a.items()}
    bn_shape, s_shape = G.winners_partials_shape(n, c_out, h, w)
    bn_parts, s_parts = guarded(bn_shape, np.float64), guarded(s_shape, np.float32)
    G.winners_reduce(
        *(dev[k] for k in ("x", "dpooled", "argmax", "zwin", "mean", "invstd", "scale", "shift")),
        bn_parts.array,
        s_parts.array,
        kernel=kernel,
    )
    bn_parts.check_untouched("bn partials")
    s_parts.check_untouched("S partials")
    sums = bn_parts.array.copy_to_host().sum(axis=0)
    mag = np.abs(g).sum(axis=(0, 2, 3))
    check(sums[1], want_dbeta, rounding_tolerance(want_dbeta, mag, 64, 1e-6), "dbeta")
    mag = (np.abs(g) * (np.abs(f["zwin"]) + np.abs(pc(f["mean"]))) * pc(f["invstd"])).sum((0, 2, 3))
    check(sums[0], want_dgamma, rounding_tolerance(want_dgamma, mag, 64, 1e-6), "dgamma")

    gram = _gram_on_device(a["x"])
    dw, db = guarded((c_out, 1, 3, 3), np.float32), guarded(c_out, np.float32)
    s_sum = cuda.device_array((c_out, 9), np.float32)
    s_bias = cuda.device_array(c_out, np.float32)
    G.gram_grad_weight(
        gram.array,
        s_parts.array,
        s_sum,
        s_bias,
        *(dev[k] for k in ("w", "b", "invstd", "gamma", "dgamma", "dbeta")),
        dw.array,
        db.array,
    )
    dw.check_untouched("dw")
    db.check_untouched("db")
    # S in float32 (a lane, a block, the sum rounded once): the rounding of
    # M |g| |v| terms a window; the rest float64
    v_abs = np.abs(_patches(a["x"]))
    s_mag = (np.abs(pc(f["gamma"] * f["invstd"])) * np.abs(dy)).reshape(n, c_out, -1)
    s_mag = np.einsum("ncp,ncpt->ct", s_mag, v_abs.reshape(n, 1, h * w, 10).repeat(c_out, 1))
    check(
        dw.array,
        want_dw,
        rounding_tolerance(want_dw, s_mag[:, :9].reshape(want_dw.shape), 128, 1e-6),
        "dw",
    )
    check(db.array, want_db, rounding_tolerance(want_db, s_mag[:, 9], 128, 1e-6), "db")


@pytest.mark.parametrize("n, h, w, c_out", [(1, 2, 2, 1), (3, 6, 4, 5), (2, 8, 12, 3)])
def test_grad_weight_matches_float64(rng, n, h, w, c_out):
    check_grad_weight(rng, n, h, w, c_out)


@pytest.mark.parametrize(
    "edit",
    [
        ("gj = g if j == win else", "gj = g if j != win else"),
        ("zw * sc[u] + sh[u] > float32(0.0)", "zw * sc[u] + sh[u] > -1e30"),
        ("acc[u * NS + V] += g * ((zw - mu[u]) * inv[u])", "acc[u * NS + V] += g * zw"),
        ("s += float64(sm[t * 32 + (el + t) % 32])", "s += float64(sm[t * 32 + (el + t) % 31])"),
    ],
    ids=["winner", "relu", "dgamma", "lane-sums"],
)
def test_check_catches_a_broken_winners_kernel(rng, edit):
    kernel = mutant(G.make_winners_reduce, edit)(2)
    with pytest.raises(CheckError):
        check_grad_weight(rng, 3, 8, 12, 5, kernel=kernel)


def test_refuses_what_it_cannot_take(rng):
    x = cuda.to_device(random_array((2, 3, 4, 4), np.float32, rng))
    with pytest.raises(ValueError, match="1 input channel"):
        G.patch_gram(x, cuda.device_array((2, G.ENTRIES)), cuda.device_array(G.ENTRIES))
    x = cuda.to_device(random_array((2, 1, 4, 4), np.float32, rng))
    with pytest.raises(ValueError, match="partials"):
        G.patch_gram(x, cuda.device_array((1, G.ENTRIES)), cuda.device_array(G.ENTRIES))


# -- broken kernels the checks above must catch -------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        ("float64(img[(h + kh) * wp + w + kw])", "float64(img[(h + kw) * wp + w + kh])"),
        ("v[V - 1] = 1.0", "v[V - 1] = 0.0"),
        ("if j >= i:", "if j > i:"),
    ],
    ids=["transposed-taps", "no-ones-column", "no-diagonal"],
)
def test_gram_check_catches_a_broken_kernel(rng, monkeypatch, edit):
    monkeypatch.setattr(G, "patch_gram_kernel", mutant(G.patch_gram_kernel, edit))
    with pytest.raises(CheckError, match="G"):
        test_patch_gram_matches_float64(rng, 2, 6, 4)


@pytest.mark.parametrize(
    "edit",
    [
        ("s1 += wi * _g(gram, i, V - 1)", "s1 += wi * _g(gram, i, i)"),
        ("s2 += wi * wj * _g(gram, i, j)", "s2 += wi * wi * _g(gram, i, j)"),
    ],
    ids=["sum-of-z", "sum-of-squares"],
)
def test_sums_check_catches_a_broken_kernel(rng, monkeypatch, edit):
    monkeypatch.setattr(G, "gram_bn_sums_kernel", mutant(G.gram_bn_sums_kernel, edit))
    with pytest.raises(CheckError, match="sum of z"):
        test_gram_bn_sums_match_float64(rng)


@pytest.mark.parametrize(
    "edit",
    [
        ("(gw - mean * xt)", "gw"),
        ("float64(dbeta[c]) * xt", "float64(dbeta[c])"),
        ("mean /= m", "mean /= 1.0"),
    ],
    ids=["uncentred", "dbeta-without-tap-sum", "mean"],
)
def test_grad_weight_check_catches_a_broken_combination(rng, monkeypatch, edit):
    monkeypatch.setattr(G, "gram_grad_weight_kernel", mutant(G.gram_grad_weight_kernel, edit))
    with pytest.raises(CheckError, match="dw|db"):
        check_grad_weight(rng, 3, 8, 12, 5)


def test_launchers_refuse_wrong_arrays(rng):
    n, h, w, c_out = 2, 4, 6, 3
    a = {k: cuda.to_device(v) for k, v in _inputs(rng, n, h, w, c_out).items()}
    bn_shape, s_shape = G.winners_partials_shape(n, c_out, h, w)
    bn_parts = cuda.device_array(bn_shape, np.float64)
    s_parts = cuda.device_array(s_shape, np.float32)
    stats = [a[k] for k in ("mean", "invstd", "scale", "shift")]
    with pytest.raises(TypeError, match="argmax"):
        G.winners_reduce(a["x"], a["dpooled"], a["zwin"], a["zwin"], *stats, bn_parts, s_parts)
    with pytest.raises(ValueError, match="s_partials"):
        G.winners_reduce(
            a["x"], a["dpooled"], a["argmax"], a["zwin"], *stats, bn_parts,
            cuda.device_array((1, c_out, G.V), np.float32),
        )  # fmt: skip
    gram = cuda.device_array(G.ENTRIES, np.float64)
    with pytest.raises(TypeError, match="gram"):
        G.gram_bn_sums(
            cuda.device_array(G.ENTRIES, np.float32), a["w"], a["b"],
            cuda.device_array((1, 2, c_out), np.float64),
        )  # fmt: skip
    with pytest.raises(ValueError, match="bn_partials"):
        G.gram_bn_sums(gram, a["w"], a["b"], cuda.device_array((2, 2, c_out), np.float64))
    with pytest.raises(ValueError, match="dw"):
        G.gram_grad_weight(
            gram, s_parts, cuda.device_array((c_out, 9), np.float32),
            cuda.device_array(c_out, np.float32), a["w"], a["b"],
            *(a[k] for k in ("invstd", "gamma", "dgamma", "dbeta")),
            cuda.device_array((c_out, 9), np.float32), cuda.device_array(c_out, np.float32),
        )  # fmt: skip
