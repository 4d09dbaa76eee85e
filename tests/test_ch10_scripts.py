"""Chapter 10 scripts: the autograd.Function route, torch.compile and explain, numba_view's
refusals, and every script's main() in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError
from common.internal.exercises import load_chapter_module

import re

import numpy as np
import pytest
import torch
from mutants import mutant

CHAPTER = "10_pytorch_extensions"
ops = load_chapter_module(CHAPTER, "ops")
bridge = load_chapter_module(CHAPTER, "bridge")
af = load_chapter_module(CHAPTER, "autograd_function")
cg = load_chapter_module(CHAPTER, "compile_and_graphs")
DEVICE = bridge.device()


def _tensor(rng, *shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape)).to(DEVICE, dtype)


def check_function_equals_custom_op(x, b, dy):
    """(y, dx, db) of the autograd.Function: bit for bit the custom op's, and
    within float32 rounding of float64 torch."""
    ours = af.forward_backward(af.bias_gelu_function, x, b, dy)
    theirs = af.forward_backward(ops.bias_gelu, x, b, dy)
    ref = af.reference(x, b, dy)
    # float32 rounding, not a fixed 1e-5: a one-element draw near GELU'(z) = 0
    # (z = -0.75) or far down its left tail cancels (seed 2771527100 did).
    tols = ops.bias_gelu_tolerances(x, b, dy, ref)
    for name, a, c, r, tol in zip(("y", "dx", "db"), ours, theirs, ref, tols):
        assert torch.equal(a, c), name  # the same kernels, the same launch
        common.check(a, r, tol=tol, name=name)


# One element; columns that don't divide the block (8 in the simulator); rows that
# don't divide the row groups (3); more rows than row groups.
@pytest.mark.parametrize("m, n", [(1, 1), (1, 9), (4, 8), (7, 17)])
def test_autograd_function_equals_custom_op(rng, m, n):
    check_function_equals_custom_op(_tensor(rng, m, n), _tensor(rng, n), _tensor(rng, m, n))


def test_autograd_function_non_contiguous_input(rng):
    x, b, dy = _tensor(rng, 9, 4).t(), _tensor(rng, 9), _tensor(rng, 9, 4).t()
    assert not x.is_contiguous() and not dy.is_contiguous()
    check_function_equals_custom_op(x, b, dy)


@pytest.mark.parametrize("m, n", [(4, 8), (7, 17)])
def test_autograd_function_check_catches_a_dropped_term(rng, m, n, monkeypatch):
    # GELU'(z) without its z phi(z) term: off by |z| phi(z), far above the
    # rounding the tolerance allows (a one-element draw could sit at z = 0).
    wrong = mutant(
        ops.make_bias_gelu_kernels, (" + z * inv_sqrt_2pi * math.exp(-half * z * z)", "")
    )
    monkeypatch.setattr(ops, "make_bias_gelu_kernels", wrong)
    monkeypatch.setattr(ops, "_KERNELS", {})
    with pytest.raises(CheckError, match="dx"):
        check_function_equals_custom_op(_tensor(rng, m, n), _tensor(rng, n), _tensor(rng, m, n))


def test_autograd_function_gradcheck(rng):
    x = _tensor(rng, 3, 10, dtype=torch.float64).requires_grad_()
    b = _tensor(rng, 10, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(af.bias_gelu_function, (x, b))


def test_explain_custom_op_is_one_graph(capsys):
    # What Dynamo traces does not depend on the values: fixed inputs (a seed
    # sweep would repeat the same 10 s of tracing for nothing).
    inputs = cg.make_inputs(torch.Generator().manual_seed(0), DEVICE)
    report = cg.explain(cg.loss_custom_op, inputs, "custom op")
    assert (report.graph_count, report.graph_break_count) == (1, 0)
    report = cg.explain(cg.loss_autograd_function, inputs, "autograd.Function")
    assert report.graph_break_count > 0  # traced into forward: breaks at the Numba launch
    # each break names the file and function, not a line number that drifts
    # with every edit (the README quotes this output)
    breaks = [line for line in capsys.readouterr().out.splitlines() if "break:" in line]
    assert any("(in ops.py, " in line for line in breaks), breaks
    assert not any(re.search(r"\.py:\d", line) for line in breaks), breaks


def test_compile_aot_eager_matches_eager(rng):
    inputs = cg.make_inputs(torch.Generator().manual_seed(int(rng.integers(1 << 30))), DEVICE)
    eager = cg.loss_and_grads(cg.loss_custom_op, inputs)
    got = cg.loss_and_grads(cg.compiled(cg.loss_custom_op, "aot_eager"), inputs)
    for a, c in zip(got, eager):
        common.check(a, c, tol=1e-6)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        cg.loss_and_grads(cg.compiled(cg.loss_autograd_function, "aot_eager"), inputs)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: torch.randn(4, 3, requires_grad=True), ValueError, ["requires grad", ".detach()"]),
        (lambda: torch.randn(4, 3).t(), ValueError, ["not contiguous", ".contiguous()"]),
        (
            lambda: torch.randn(4, 3, dtype=torch.float64),
            TypeError,
            ["float64", ".to(torch.float32)"],
        ),
        (lambda: [1.0, 2.0], TypeError, ["torch.Tensor", "list"]),
    ],
)
def test_numba_view_refusals_name_the_fix(make, error, words):
    t = make()
    if isinstance(t, torch.Tensor):
        t = t.to(DEVICE) if not t.requires_grad else t.detach().to(DEVICE).requires_grad_()
    with pytest.raises(error) as info:
        bridge.numba_view(t, "t", dtype=torch.float32)
    for word in words:
        assert word in str(info.value)


def test_numba_view_shares_memory(rng):
    for cached in (True, False):
        t = _tensor(rng, 3, 4)
        bridge.numba_view(t, cached=cached)[1, 2] = 5.0
        assert float(t[1, 2]) == 5.0


def test_numba_view_is_made_once_per_address_shape_and_dtype(rng):
    t = _tensor(rng, 3, 4)
    view = bridge.numba_view(t)
    assert bridge.numba_view(t) is view  # the same tensor: the cached view
    assert bridge.numba_view(t.detach()) is view  # another tensor, the same memory
    assert bridge.numba_view(t, cached=False) is not view
    flat = bridge.numba_view(t.view(-1))  # the same address, another shape
    assert flat.shape == (12,) and view.shape == (3, 4)
    ints = bridge.numba_view(t.view(torch.int32))  # the same address, another dtype
    assert ints.dtype == np.int32 and view.dtype == np.float32
    np.testing.assert_array_equal(view.copy_to_host(), t.cpu().numpy())


def test_numba_view_cache_is_bounded_and_reads_the_current_tensor(rng, monkeypatch):
    monkeypatch.setattr(bridge, "VIEW_CACHE_SIZE", 3)
    monkeypatch.setattr(bridge, "_VIEWS", type(bridge._VIEWS)())
    first = _tensor(rng, 2, 5)
    view = bridge.numba_view(first)
    others = [_tensor(rng, 2, 5) for _ in range(3)]
    for t in others:
        bridge.numba_view(t)
    assert len(bridge._VIEWS) == 3
    assert bridge.numba_view(first) is not view  # dropped, least recently used
    # Memory freed and handed out again (torch's caching allocator on a GPU
    # often returns the same address): the view shows the new tensor's values.
    del first, others
    for _ in range(3):
        fresh = _tensor(rng, 2, 5)
        np.testing.assert_array_equal(bridge.numba_view(fresh).copy_to_host(), fresh.cpu().numpy())


@pytest.mark.parametrize(
    "script, argv",
    [
        ("autograd_function", []),
        ("dispatch_overhead", ["--out", "{tmp}"]),
        ("pitfalls", ["--out", "{tmp}"]),
        ("compile_and_graphs", ["--backend", "aot_eager"]),
    ],
)
def test_script_main_exits_0(script, argv, tmp_path, capsys):
    module = load_chapter_module(CHAPTER, script)
    assert module.main([a.format(tmp=tmp_path) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "CHECK FAILED" not in out
    if "--out" in argv:
        assert (tmp_path / f"{script}.json").is_file()
