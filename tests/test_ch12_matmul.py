"""Chapter 12: the Triton matmul (one fixed config, interpreted), its checks, the
closing summary and inductor's capture, at interpreter sizes."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check
from common.internal.exercises import load_chapter_module
from common.timing import Timing

import numpy as np
import pytest

CHAPTER = "12_triton"
triton_env = load_chapter_module(CHAPTER, "triton_env")
if triton_env.MISSING:
    pytest.skip(triton_env.MISSING, allow_module_level=True)

import torch  # noqa: E402
from mutants import mutant  # noqa: E402

mm = load_chapter_module(CHAPTER, "matmul")
summary = load_chapter_module(CHAPTER, "summary")
inductor = load_chapter_module(CHAPTER, "inductor")

DEVICE = "cpu" if triton_env.INTERPRETED else "cuda"
PAD = 16  # one BLOCK_K of FIXED_CONFIG: what a kernel without its K mask reads past K


def _operands(m, n, k, dtype, gen):
    """A (M, K) and B (K, N) as views into larger buffers whose extra cells hold random
    non-zero values (so reading past K adds wrong terms instead of zeros, and stays in
    memory), A transposed in memory (strides (1, M + PAD)); and the float64 product."""
    a_buf = torch.randn(k + PAD, m, generator=gen).to(dtype)
    b_buf = torch.randn(k + PAD, n + PAD, generator=gen).to(dtype)
    a, b = a_buf.T[:, :k], b_buf[:k, :n]
    ref = a.double().numpy() @ b.double().numpy()
    mag = np.abs(a.double().numpy()) @ np.abs(b.double().numpy())
    return a.to(DEVICE), b.to(DEVICE), ref, mag


def _run(m, n, k, precision, gen, kernel=None):
    """The Triton matmul into a guarded C (a view into a NaN buffer one cell wider on
    every side); checks C against float64 and that nothing around it was written."""
    p = mm.PRECISIONS[precision]
    dtype = getattr(torch, p.dtype)
    a, b, ref, mag = _operands(m, n, k, dtype, gen)
    big = torch.full((m + 2, n + 2), float("nan"), dtype=dtype, device=DEVICE)
    c = big[1 : m + 1, 1 : n + 1]
    mm.matmul(a, b, c, precision, config=mm.FIXED_CONFIG, kernel=kernel)
    check(c, ref, tol=mm.tolerance(ref, mag, k, p), name=f"{precision} {m}x{n}x{k}")
    around = big.clone()
    around[1 : m + 1, 1 : n + 1] = 0
    assert torch.isnan(around).sum() == big.numel() - m * n, "wrote outside C"


# M, N, K: none a multiple of 16, 1x1x1, K = 1, exact multiples, and 3 tile rows with
# GROUP_M = 2 (the last group of the swizzle is short).
SHAPES = [(33, 47, 29), (1, 1, 1), (17, 5, 1), (16, 32, 16), (40, 3, 33)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_triton_matmul_fp32_hostile_shapes(m, n, k, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    _run(m, n, k, "fp32", gen)


def test_triton_matmul_fp16(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    _run(33, 20, 29, "fp16", gen)


# Each broken copy is a bug the check above must catch.
MUTANTS = {
    # reads past K: adds the padding's products
    "forgotten K mask": [
        ("(offs_m[:, None] < M) & (offs_k[None, :] < K - k0)", "(offs_m[:, None] < M)"),
        ("(offs_k[:, None] < K - k0) & (offs_n[None, :] < N)", "(offs_n[None, :] < N)"),
    ],
    # B advances along N instead of K: the second K step multiplies the wrong B rows
    "wrong offset": [("b_ptrs += BLOCK_K * stride_bk", "b_ptrs += BLOCK_K * stride_bn")],
    # the short last group of the swizzle maps past the last tile row: rows never written
    "swizzle without the short last group": [
        ("% group_size_m\n", "% GROUP_M\n"),
    ],
}


@pytest.mark.parametrize("bug", MUTANTS)
def test_broken_kernels_fail(bug, rng):
    broken = triton_env.triton.jit(mutant(mm._matmul_kernel, *MUTANTS[bug]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    with pytest.raises((CheckError, AssertionError)):
        _run(40, 47, 29, "fp32", gen, kernel=broken)


def test_bad_operands_raise_before_launch():
    a, b, c = (torch.ones(shape, device=DEVICE) for shape in ((3, 4), (4, 5), (3, 5)))

    def no_launch(*args, **kw):
        raise AssertionError("launched")

    with pytest.raises(TypeError, match="torch tensor"):
        mm.matmul(a.cpu().numpy(), b, c, kernel=no_launch)
    with pytest.raises(ValueError, match="do not chain"):
        mm.matmul(a, b.T, c, kernel=no_launch)
    with pytest.raises(TypeError, match="float32 or all float16"):
        mm.matmul(a, b.double(), c, kernel=no_launch)
    with pytest.raises(ValueError, match="needs float16"):
        mm.matmul(a, b, c, "fp16", kernel=no_launch)
    with pytest.raises(ValueError, match="precision must be"):
        mm.matmul(a, b, c, "bf16", kernel=no_launch)
    with pytest.raises(ValueError, match=">= 1"):
        mm.matmul(a[:, :0], b[:0], c, kernel=no_launch)


def test_tolerances_tell_precisions_apart(rng):
    # A product whose operands were rounded to FP16 (what a kernel that quietly used
    # tensor cores would give) fails the FP32 tolerance and passes the FP16 one.
    a = rng.standard_normal((24, 31)).astype(np.float32)
    b = rng.standard_normal((31, 18)).astype(np.float32)
    ref = a.astype(np.float64) @ b
    mag = np.abs(a.astype(np.float64)) @ np.abs(b)
    half = a.astype(np.float16).astype(np.float64) @ b.astype(np.float16)
    with pytest.raises(CheckError):
        check(half, ref, tol=mm.tolerance(ref, mag, 31, mm.PRECISIONS["fp32"]))
    check(half, ref, tol=mm.tolerance(ref, mag, 31, mm.PRECISIONS["fp16"]))


def test_bad_command_line_fails_before_running():
    with pytest.raises(SystemExit):
        mm.main(["--sizes", "0x3x4"])
    with pytest.raises(SystemExit):
        mm.main(["--precisions", "fp8"])
    with pytest.raises(SystemExit):
        summary.main(["--only", "matmul,nope"])


# --------------------------------------------------------------------------- summary


def test_summary_runs_and_counts_lines(capsys):
    def tiny():
        return mm.run(sizes=[(17, 19, 5)], precisions=["fp32"])

    rows, records, notes = summary.summarize(["matmul", "no_such_script"], {"matmul": tiny})
    out = capsys.readouterr().out
    assert "chapter 12: every kernel in both languages" in out
    assert notes == ["skipped no_such_script.py is not there yet"]
    by_name = {r["name"]: r for r in records}
    assert by_name["triton FP32"]["kernels"] == ["matmul_kernel"]
    assert by_name["triton FP32"]["loc"] > 20
    assert by_name[mm.NUMBA]["kernels"] == ["matmul_unguarded", "matmul_double_buffered"]
    assert by_name[mm.NUMBA]["loc"] > by_name["triton FP32"]["loc"]


def test_summary_assigns_kernels_by_name():
    kernels = {"add_naive": ("numba", 5), "add_grid_stride": ("numba", 7), "add": ("triton", 6)}
    rows = [
        Timing("numba (thread an element)"),
        Timing("numba (grid-stride)"),
        Timing("triton (masked block)"),
        Timing("torch eager"),
        Timing("numba exact", extra={"kernel": "add_naive"}),
    ]
    assert summary.assign_kernels(rows, kernels) == [
        ["add_naive"],
        ["add_grid_stride"],
        ["add"],
        [],
        ["add_naive"],
    ]
    assert summary.lines_of_code("def f():\n\n    # note\n    return 1\n") == 2


def test_script_kernels_reads_only_lists_of_kernels():
    # On a GPU, numba.cuda has a `kernels` attribute too (a module): not a kernel list
    import types

    script = types.ModuleType("script")
    script.cuda = types.SimpleNamespace(kernels=types.ModuleType("numba.cuda.kernels"))
    script.matmul_kernel = mm.matmul_kernel
    assert set(summary.script_kernels(script)) == {"matmul_kernel"}


def test_layernorm_rows_name_kernels_the_script_has():
    # The closing table's line counts for layer norm come from these names: each must
    # be one of the script's kernels, in the language of its row.
    layernorm = load_chapter_module(CHAPTER, "layernorm")
    kernels = summary.script_kernels(layernorm)
    for version, labels in layernorm.KERNELS.items():
        assert version in layernorm.versions()
        for names in labels.values():
            assert {kernels[k][0] for k in names} == {version.split()[0]}, (version, names)


# -------------------------------------------------------------------------- inductor

TRITON_OUTPUT = """
triton_poi_fused_relu_0 = async_compile.triton('triton_poi_fused_relu_0', '''
import triton
import triton.language as tl

@triton_heuristics.pointwise(size_hints={'x': 1024})
@triton.jit
def triton_poi_fused_relu_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = tl.full([1], 0, tl.int32)
    tmp2 = triton_helpers.maximum(tmp1, tmp0)
    tl.store(out_ptr0 + (x0), tmp2, xmask)
''', device_str='cuda')
"""

CPP_OUTPUT = """
cpp_fused_relu_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0) { }
''')
"""


def test_inductor_reads_generated_kernels():
    (k,) = inductor.generated_kernels(TRITON_OUTPUT)
    assert (k.name, k.language) == ("triton_poi_fused_relu_0", "triton")
    assert k.source.startswith("@triton.jit\ndef triton_poi_fused_relu_0(")
    assert "triton_heuristics" not in k.source
    text = inductor.annotate(k.source)
    assert "tmp2 = triton_helpers.maximum(tmp1, tmp0)" in text
    assert text.count("# <- ") == 7  # every line below the signature has a counterpart
    lines = {line.split("#")[0].strip(): line for line in text.splitlines()}
    assert "an element of the input" in lines["tmp0 = tl.load(in_ptr0 + (x0), xmask)"]
    # a kernel that does not pool writes an intermediate: the round trip fusion removes
    assert inductor.STORE_WITHOUT_POOL in lines["tl.store(out_ptr0 + (x0), tmp2, xmask)"]
    per_channel = "    tmp1 = tl.load(in_ptr1 + (x1), None, eviction_policy='evict_last')"
    assert "per-channel parameter" in inductor.annotate(per_channel)
    window = "    tmp3 = tl.load(in_ptr0 + (28 + 2*x0 + 56*x1), None, eviction_policy='evict_last')"
    assert "2x2 window" in inductor.annotate(window)
    (c,) = inductor.generated_kernels(CPP_OUTPUT)
    assert (c.name, c.language) == ("cpp_fused_relu_0", "c++")
    assert 'extern "C"' in c.source
    assert inductor.generated_kernels("def call(args):\n    pass\n") == []


@pytest.mark.skipif(not common.is_simulator(), reason="the CPU path")
def test_inductor_without_gpu_says_so(capsys):
    assert inductor.main([]) == 0
    assert inductor.NEEDS_GPU in capsys.readouterr().out
