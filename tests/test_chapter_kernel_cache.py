"""The chapters' compiled kernels are kept on disk (``@cuda.jit(cache=True)``) in the
course's kernel cache, as the capstone's are (tests/test_final_project_kernel_cache.py),
so a second run of a script or of the tests loads them instead of compiling.

NOT_CACHED lists the kernels that must not be cached, each with the reason its
decorator's comment gives: numba's cache key is the kernel's own file (its
timestamp), its bytecode, the pickled values of its closure, the argument types,
the GPU and numba-cuda's version. It holds no compile options (``launch_bounds``)
and nothing of another file, so a kernel that calls a device function or reads a
constant of another file would keep running the old code after an edit there.

What runs here: an AST scan of chapters/*/*.py (no kernel is compiled or imported).
What only a GPU shows (the simulator compiles nothing, and ignores ``cache``): that
a second process loads the kernels, factory kernels whose closures hold a device
function included (chapter 10's ops.py, chapter 11's fft.py).
"""

import ast
from pathlib import Path

from kernel_decorators import asks_for_cache, kernel_definitions

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"

# 190 kernels in chapters/*/*.py when this was written; a scan that finds far fewer
# no longer sees them (files moved, or a decorator the scan does not know).
MIN_KERNELS = 180

_OTHER_FILE = "whose edits numba's cache does not see (it keys on the kernel's own file)"
_SOLUTIONS = f"uses solutions.py's constants, {_OTHER_FILE}"
_BOUNDS = "launch_bounds is not in numba's cache key, and autotune varies min_blocks alone"

# (file under chapters/, kernel name): why the kernel is compiled in every process
NOT_CACHED = {
    ("03_python_for_kernels/float64_promotion.py", "fma_chain_f32"): (
        "chapter 04's timing_mistakes.py times its first call to show the JIT compile"
    ),
    ("06_memory/softmax.py", "softmax_block_row"): (
        f"calls reduction.py's block_reduce_sum and block_reduce_max, {_OTHER_FILE}"
    ),
    ("08_faster_matmul/matmul.py", "matmul_double_buffered"): _BOUNDS,
    ("08_faster_matmul/matmul.py", "matmul_unguarded"): _BOUNDS,
    ("08_faster_matmul/matmul.py", "matmul_warptiled"): _BOUNDS,
    ("08_faster_matmul/matmul.py", "matmul_warptiled_guarded"): _BOUNDS,
    ("09_profiling/case_study.py", "bn_relu_maxpool_backward_reduce_divisions"): (
        f"calls final_project/fast_layers.py's tree_sum_pair, {_OTHER_FILE}"
    ),
    ("09_profiling/case_study.py", "bn_relu_maxpool_backward_reduce_carried"): (
        f"calls final_project/fast_layers.py's tree_sum_pair, {_OTHER_FILE}"
    ),
    ("09_profiling/sanitizer.py", "shift_left_barrier_in_branch"): (
        f"its BLOCK is chapter 06's shared_memory.BLOCK, {_OTHER_FILE}"
    ),
    ("09_profiling/sanitizer.py", "shift_left_barrier_for_all"): (
        f"its BLOCK is chapter 06's shared_memory.BLOCK, {_OTHER_FILE}"
    ),
    ("11_fft_and_convolution/exercises.py", "bit_reverse_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "twiddle_kernel"): (
        f"uses solutions.py's constants and sin_cos_octant, {_OTHER_FILE}"
    ),
    ("11_fft_and_convolution/exercises.py", "radix2_stage_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "fft_stockham_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "complex_mac_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "pad_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "correlate_spectra_kernel"): _SOLUTIONS,
    ("11_fft_and_convolution/exercises.py", "crop_kernel"): _SOLUTIONS,
    ("08_faster_matmul/tensor_cores.py", "mma_warp_tile"): (
        f"its mma and cvt instructions come from common/tensor_cores.py, {_OTHER_FILE}"
    ),
    ("08_faster_matmul/tensor_cores.py", "mma_block_tile"): (
        f"its mma and cvt instructions come from common/tensor_cores.py, {_OTHER_FILE}"
    ),
    ("08_faster_matmul/tensor_cores.py", "wgmma_block_tile"): (
        f"its wgmma, cp.async and fence instructions come from common/wgmma.py, {_OTHER_FILE}"
    ),
    ("08_faster_matmul/tensor_cores.py", "_to_half_bits"): (
        f"its cvt instructions come from common/tensor_cores.py, {_OTHER_FILE}"
    ),
    ("12_triton/layernorm.py", "layernorm_forward_block_row"): (
        f"calls chapter 06's reduction.block_reduce_sum, {_OTHER_FILE}"
    ),
    ("12_triton/layernorm.py", "layernorm_backward_dx_block_row"): (
        f"calls chapter 06's reduction.block_reduce_sum, {_OTHER_FILE}"
    ),
}


def chapter_kernels(root: Path = CHAPTERS):
    """(file under ``root``, kernel name, asks for the cache, its decorator's source
    line) of every kernel in ``root``/*/*.py."""
    for path in sorted(root.glob("*/*.py")):
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(root).as_posix()
        for node, keywords in kernel_definitions(ast.parse(text, filename=str(path))):
            decorator = lines[node.decorator_list[0].lineno - 1]
            yield rel, node.name, asks_for_cache(keywords), decorator


def cache_problems(kernels, not_cached) -> list[str]:
    """One line per kernel that is neither cached nor in ``not_cached``, per listed
    kernel that is cached after all or gone, and per listed kernel whose decorator
    line does not say ``# not cached:`` why."""
    problems, seen = [], set()
    for rel, name, cached, decorator in kernels:
        seen.add((rel, name))
        if (rel, name) in not_cached:
            if cached:
                problems.append(f"{rel}: {name} asks for the cache: take it off NOT_CACHED")
            elif "# not cached:" not in decorator:
                problems.append(f"{rel}: {name}: its decorator line must say '# not cached: why'")
        elif not cached:
            problems.append(f"{rel}: {name} is compiled again in every process: cache=True")
    for rel, name in sorted(set(not_cached) - seen):
        problems.append(f"{rel}: no kernel {name}: take it off NOT_CACHED")
    return problems


def test_every_chapter_kernel_asks_to_be_cached_or_says_why_not():
    kernels = list(chapter_kernels())
    assert len(kernels) >= MIN_KERNELS, f"only {len(kernels)} kernels found: did files move?"
    problems = cache_problems(kernels, NOT_CACHED)
    assert not problems, "\n".join(problems)


def test_the_scan_catches_a_kernel_without_cache(tmp_path):
    (tmp_path / "98_demo").mkdir()
    (tmp_path / "98_demo" / "x.py").write_text(
        "@cuda.jit(cache=True)\ndef cached(a): pass\n"
        "@cuda.jit\ndef forgotten(a): pass\n"
        "@cuda.jit(device=True)\ndef helper(a): pass\n"
        "@cuda.jit  # not cached: a reason\ndef excused(a): pass\n"
        "@cuda.jit\ndef excused_silently(a): pass\n"
        "@cuda.jit(cache=True)\ndef excused_but_cached(a): pass\n"
        "def make(n):\n"
        "    @jit(launch_bounds=(n, 2))\n"
        "    def nested(a): pass\n"
        "    return nested\n"
    )
    kernels = list(chapter_kernels(tmp_path))
    assert {name for _, name, _, _ in kernels} == {
        "cached",
        "forgotten",
        "excused",
        "excused_silently",
        "excused_but_cached",
        "nested",
    }
    listed = {("98_demo/x.py", name): "why" for name in ("excused", "excused_silently")}
    listed[("98_demo/x.py", "excused_but_cached")] = "why"
    listed[("98_demo/x.py", "gone")] = "why"
    problems = cache_problems(kernels, listed)
    assert len(problems) == 5, problems
    for name, says in [
        ("forgotten", "compiled again in every process"),
        ("nested", "compiled again in every process"),
        ("excused_silently", "must say"),
        ("excused_but_cached", "take it off"),
        ("gone", "take it off"),
    ]:
        assert any(name in p and says in p for p in problems), (name, problems)
