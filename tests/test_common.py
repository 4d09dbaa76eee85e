"""Tests of the foundation: runtime selection, launch checks, checking, timing, loaders."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import checking, runtime, timing
from common.checking import CheckError, check, guarded, poisoned, random_array, rel_error
from common.internal.exercises import REPO_ROOT, Implementation, load_chapter_module
from common.internal.simulator import LaunchConfigError, check_launch
from common.runtime import ceil_div, is_simulator, jit, pick

import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
from numba import cuda

sim_only = pytest.mark.skipif(not is_simulator(), reason="simulator behaviour")


# ---------------------------------------------------------------- runtime


def test_runtime_is_consistent_with_numba():
    assert runtime.runtime_name() in ("gpu", "simulator")
    assert is_simulator() == (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"))
    from numba.cuda import config

    assert bool(config.ENABLE_CUDASIM) == is_simulator()


def test_pick_follows_runtime():
    assert pick(gpu="big", simulator="small") == ("small" if is_simulator() else "big")


@pytest.mark.parametrize(
    "a,b,want", [(1, 1, 1), (1, 128, 1), (128, 128, 1), (129, 128, 2), (0, 7, 0), (1000, 3, 334)]
)
def test_ceil_div(a, b, want):
    assert ceil_div(a, b) == want


def test_ceil_div_rejects_zero_divisor():
    with pytest.raises(ValueError):
        ceil_div(3, 0)


def test_subprocess_without_gpu_selects_simulator_and_says_so():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if runtime.driver_gpu_count() > 0:
        pytest.skip("this machine has a GPU")
    out = subprocess.run(
        [sys.executable, "-c", "import common; print(common.runtime_name())"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    assert out.stdout.strip() == "simulator"
    # The "no GPU, simulator" line is for a person at a terminal; captured output
    # (pytest, a pipe) stays clean, and `python -m common.doctor` says it on demand.
    assert out.stderr.strip() == ""


@jit(lineinfo=True, max_registers=40, fastmath=False)
def _add_kernel(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


def test_jit_accepts_gpu_only_options_in_both_runtimes(rng):
    n = 300
    a, b = random_array(n, rng=rng), random_array(n, rng=rng)
    out = poisoned(n)
    _add_kernel[ceil_div(n, 64), 64](a, b, out)
    check(out, a.astype(np.float64) + b, tol=1e-7)


@pytest.mark.parametrize(
    "grid,block", [(1, 1025), (1, (32, 33)), (1, (1, 1, 65)), (0, 32), (1, 0), (1, (2048,))]
)
def test_check_launch_rejects_what_a_gpu_rejects(grid, block):
    with pytest.raises(LaunchConfigError):
        check_launch(grid, block)


@pytest.mark.parametrize(
    "grid,block", [(1, 1024), ((3, 2), (32, 32)), (1, (1, 1, 64)), (70000, 128)]
)
def test_check_launch_accepts_valid_shapes(grid, block):
    check_launch(grid, block)


@sim_only
def test_simulator_refuses_too_many_threads_per_block():
    with pytest.raises(LaunchConfigError, match="1024"):
        _add_kernel[1, (64, 32)](np.ones(1), np.ones(1), np.ones(1))


@cuda.jit
def _too_much_shared(out):
    # 2 x 6400 float32 = 51,200 bytes: over the 48 KiB static limit only together.
    s1 = cuda.shared.array(6400, dtype=np.float32)
    s2 = cuda.shared.array(6400, dtype=np.float32)
    s1[0] = 1.0
    s2[0] = 2.0
    out[0] = s1[0] + s2[0]


@cuda.jit
def _two_shared_arrays(out):
    # Two arrays on two lines must stay distinct (the simulator keys by line).
    s1 = cuda.shared.array(4, dtype=np.float32)
    s2 = cuda.shared.array(4, dtype=np.float32)
    t = cuda.threadIdx.x
    s1[t] = t
    s2[t] = 10 * t
    cuda.syncthreads()
    out[t] = s1[3 - t] + s2[t]


@sim_only
def test_simulator_refuses_more_than_48k_shared_memory():
    with pytest.raises(LaunchConfigError, match="shared memory"):
        _too_much_shared[1, 1](poisoned(1))


def test_shared_arrays_on_different_lines_do_not_alias():
    out = poisoned(4)
    _two_shared_arrays[1, 4](out)
    np.testing.assert_array_equal(out.copy_to_host(), [3 + 0, 2 + 10, 1 + 20, 0 + 30])


_TILE = 4
_TILE_PADDED = _TILE + 1


@cuda.jit
def _shared_shape_computed(out):
    s = cuda.shared.array((_TILE, _TILE + 1), dtype=np.float32)  # GPU: int64 shape, no compile
    s[0, 0] = 1.0
    out[0] = s[0, 0]


@cuda.jit
def _shared_shape_constant(out):
    s = cuda.shared.array((_TILE, _TILE_PADDED), dtype=np.float32)
    s[0, 0] = 1.0
    out[0] = s[0, 0]


@cuda.jit
def _local_shape_from_argument(out, n):
    s = cuda.local.array(n, dtype=np.float32)
    s[0] = 1.0
    out[0] = s[0]


def _closure_kernel(tile):
    @cuda.jit
    def kernel(out):
        s = cuda.shared.array(tile, dtype=np.float32)  # closure ints are constants
        s[0] = 1.0
        out[0] = s[0]

    return kernel


@sim_only
def test_simulator_refuses_shapes_a_gpu_cannot_compile():
    with pytest.raises(LaunchConfigError, match="computed inside the kernel"):
        _shared_shape_computed[1, 1](poisoned(1))
    with pytest.raises(LaunchConfigError, match="kernel argument"):
        _local_shape_from_argument[1, 1](poisoned(1), 4)


def test_constant_shapes_are_accepted():
    for kernel in (_shared_shape_constant, _closure_kernel(8)):
        out = poisoned(1)
        kernel[1, 1](out)
        assert out.copy_to_host()[0] == 1.0


# ---------------------------------------------------------------- checking


def test_rel_error_and_check(rng):
    ref = random_array((7, 5), np.float64, rng)
    assert rel_error(ref.astype(np.float32), ref) < 1e-7
    assert check(ref.astype(np.float32), ref) < 1e-7
    bad = ref.copy()
    bad[3, 2] += 1.0
    with pytest.raises(CheckError, match=r"first mismatch at index \(3, 2\)"):
        check(bad, ref)


def test_check_reports_unwritten_elements(rng):
    ref = random_array(10, np.float64, rng)
    out = ref.copy()
    out[4:] = np.nan
    with pytest.raises(CheckError, match="6 of 10 elements are NaN"):
        check(out, ref, tol=1e-3)


def test_check_integers_exactly():
    with pytest.raises(CheckError, match="1 of 3 elements differ"):
        check(np.array([1, 2, 4]), np.array([1, 2, 3]))
    assert check(np.array([1, 2, 3], np.int32), np.array([1, 2, 3])) == 0.0


def _check_message(out, ref, **kwargs):
    with pytest.raises(CheckError) as e:
        check(out, ref, **kwargs)
    return str(e.value)


def test_check_names_lost_increments_and_double_counts(rng):
    msg = _check_message(np.int64(229), np.int64(233), name="count")
    assert (
        msg.startswith("count: got 229, expected 233: 4 increments were lost")
        and "cuda.atomic.add" in msg
    )
    assert "4 too many" in _check_message(np.int64(237), np.int64(233))
    hist = rng.integers(1, 20, 16)
    lost = hist.copy()
    lost[[3, 7]] -= 1
    assert "the counts sum to" in _check_message(
        lost, hist
    ) and "increments were lost" in _check_message(lost, hist)


def test_check_names_unwritten_integer_elements(rng):
    ref = random_array(70, np.int32, rng)
    out = ref.copy()
    out[50:] = checking.poison_value(np.int32)
    msg = _check_message(out, ref)
    assert (
        "20 of 70 elements still hold the poison value" in msg
        and "elements 50 and up were never written" in msg
    )


def test_check_names_a_grid_that_stops_short(rng):
    ref = random_array(100, np.float64, rng)
    out = ref.copy()
    out[70:] = np.nan
    assert "elements 70 and up were never written" in _check_message(out, ref)
    ref2 = random_array((5, 7), np.float64, rng)
    rows, cols = ref2.copy(), ref2.copy()
    rows[3:] = np.nan
    cols[:, 4:] = np.nan
    assert "rows 3 and up were never written" in _check_message(rows, ref2)
    assert "columns 4 and up were never written" in _check_message(cols, ref2)


def test_check_names_index_patterns(rng):
    ref = random_array(100, np.float64, rng)
    assert "an index off by one" in _check_message(np.r_[ref[1:], ref[0]], ref)
    assert "an index off by one" in _check_message(np.r_[ref[1:], np.nan], ref)  # and a NaN tail
    assert "off by 32 (a block's worth?)" in _check_message(np.r_[ref[32:], np.ones(32)], ref)
    assert "every block of 32 threads redid block 0's elements" in _check_message(
        ref[np.arange(100) % 32], ref
    )
    square = random_array((6, 6), np.float64, rng)
    assert "transpose" in _check_message(square.T.copy(), square)
    assert "off by the same 0.5" in _check_message(ref + 0.5, ref)
    assert "every element is 2 times" in _check_message(2 * ref, ref)


def test_check_names_a_missing_per_block_term(rng):
    # An inclusive scan whose blocks of 32 never add the sums of the blocks before them.
    # Positive values: a block summing to 0 would make two runs share one constant
    # (seed 55 drew one), which is a different, also correct, diagnosis.
    x = np.abs(random_array(70, np.int32, rng)) + 1
    ref = np.cumsum(x).astype(np.int32)
    out = np.concatenate([np.cumsum(x[b : b + 32]) for b in range(0, 70, 32)]).astype(np.int32)
    assert "one constant for each run of 32 elements" in _check_message(out, ref)


@pytest.mark.parametrize("trial", range(5))
def test_check_claims_no_cause_for_random_errors(trial, rng):
    ref = random_array(200, np.float64, rng)
    msg = _check_message(ref + 0.1 * random_array(200, np.float64, rng), ref)
    causes = msg.split("mismatching elements)")[1]
    assert causes == "", msg
    counts = rng.integers(0, 5, 64)
    wrong = counts + rng.integers(-1, 2, 64)
    wrong[0] = counts[0] + 1
    wrong[1] = counts[1] - 1  # some too high, some too low: no single cause
    msg = _check_message(wrong, counts)
    assert "increments" not in msg and "too many" not in msg and "index off" not in msg, msg


def test_check_untouched_says_where(rng):
    g = guarded(10, pad=8)
    host = g._buffer.copy_to_host()
    host[-3:] = 1.0
    g._buffer.copy_to_device(host)
    with pytest.raises(
        CheckError, match=r"wrote outside the output array \(3 cells past its end\)"
    ):
        g.check_untouched()


def test_checker_frames_are_hidden_and_the_seed_replays(tmp_path, monkeypatch, capsys):
    """A failing test's report shows the test's line, not check()'s source, and the
    command that replays its random draw; --seed and COURSE_SEED replay it."""
    (tmp_path / "test_draw.py").write_text(
        "import numpy as np\nfrom common.checking import check\n\n\n"
        "def test_draw(rng):\n    x = rng.integers(1 << 30)\n    print('drew', x)\n"
        "    check(np.array([1.0, 2.0]), np.array([1.0, 3.0]))\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("COURSE_SEED", raising=False)
    args = [
        str(tmp_path),
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--tb=long",
        "-rN",
    ]
    pytest.main([*args, "--seed", "1234"])
    out = capsys.readouterr().out
    drawn = np.random.default_rng(1234).integers(1 << 30)
    assert f"drew {drawn}" in out and "CheckError: output: relative error" in out
    assert "def check(" not in out and "o = _to_host(out)" not in out
    # (the node id's folder depends on where pytest finds its rootdir)
    assert re.search(
        r'replay: python -m pytest "[^"]*test_draw\.py::test_draw" --seed 1234', out
    ), out
    monkeypatch.setenv("COURSE_SEED", "1234")
    pytest.main(args)
    assert f"drew {drawn}" in capsys.readouterr().out


def test_check_rejects_shape_mismatch_and_zero_reference():
    with pytest.raises(CheckError, match="shape"):
        check(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="all zeros"):
        rel_error(np.zeros(3), np.zeros(3))


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.complex64, np.complex128, np.int32, np.uint8]
)
def test_poisoned_is_poison(dtype):
    host = poisoned((3, 4), dtype).copy_to_host()
    assert host.shape == (3, 4) and host.dtype == dtype
    if np.dtype(dtype).kind == "f":
        assert np.isnan(host).all()
    elif np.dtype(dtype).kind == "c":  # both parts, with the float poison's payload
        part = checking.poison_value(host.real.dtype)
        for half in (host.real, host.imag):
            bits = np.ascontiguousarray(half).view(np.uint8).reshape(half.size, -1)
            assert (bits == np.atleast_1d(part).view(np.uint8)).all()
    else:
        assert (host == checking.poison_value(dtype)).all()


def test_a_complex_guard_sees_a_computed_nan_written_past_the_end():
    g = checking.guarded(3, np.complex64)
    assert g.outside_untouched()
    buffer = g._buffer.copy_to_host()
    buffer[g._stop] = complex(np.nan, 0.0)  # a computed NaN real part, a zero imaginary
    g._buffer.copy_to_device(buffer)
    assert not g.outside_untouched()


def test_random_array_never_all_zero(rng):
    for dtype in (np.float32, np.int32, np.uint8):
        assert np.any(random_array(50, dtype, rng) != 0)


@cuda.jit
def _copy_no_bounds_check(src, out):
    i = cuda.grid(1)
    out[i] = src[i % src.size]  # BUG: threads past the end write too


@cuda.jit
def _copy_with_bounds_check(src, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = src[i]


def test_guarded_accepts_a_correct_kernel(rng):
    n = 100
    src = random_array(n, rng=rng)
    g = guarded(n)
    _copy_with_bounds_check[ceil_div(n, 32), 32](src, g.array)
    g.check_untouched()
    check(g.array, src)


def test_guarded_nd_shape(rng):
    g = guarded((3, 5), np.float64)
    assert g.array.shape == (3, 5)
    assert g.outside_untouched()


def test_guarded_catches_missing_bounds_check(rng):
    # GPU: the stray writes land in the guard cells; simulator: IndexError.
    n = 100
    src = random_array(n, rng=rng)
    g = guarded(n)
    with pytest.raises((CheckError, IndexError)):
        _copy_no_bounds_check[ceil_div(n, 32), 32](src, g.array)
        cuda.synchronize()
        g.check_untouched()


# ---------------------------------------------------------------- timing


def test_benchmark_in_this_runtime(rng):
    calls = []
    t = timing.benchmark(lambda: calls.append(1), "noop", nbytes=100, warmup=2, repeats=3)
    if is_simulator():
        assert not t.measured and len(calls) == 1 and t.gbps is None
        assert timing.SIMULATOR_NOTE in timing.format_table([t])
    else:
        assert t.measured and len(calls) == 1 + 2 + 3 and t.median_ms >= 0


def test_timed_call_returns_the_value_and_a_first_call_benchmark_keeps():
    value, ms = timing.timed_call(lambda: 42)
    assert value == 42 and ms >= 0
    t = timing.benchmark(lambda: None, "x", repeats=2, first_call_ms=1234.5)
    if not is_simulator():  # the caller's first call is reported, not benchmark's own
        assert t.first_call_ms == 1234.5


def test_timing_rates_from_bytes_and_flops():
    t = timing.Timing(
        "x",
        median_ms=2.0,
        nbytes=4_000_000_000,
        flops=6_000_000_000_000,
        peak_gbps=4000.0,
        peak_tflops=50.0,
    )
    assert t.gbps == pytest.approx(2000.0)
    assert t.fraction_of_copy_peak == pytest.approx(0.5)
    assert t.tflops == pytest.approx(3000.0)
    assert t.fraction_of_sgemm_peak == pytest.approx(60.0)
    table = timing.format_table([t], title="T")
    assert "2000.0" in table and "50.0" in table


def test_benchmark_rejects_bad_counts():
    with pytest.raises(ValueError):
        timing.benchmark(lambda: None, "x", repeats=0)
    with pytest.raises(ValueError):
        timing.benchmark(lambda: None, "x", warmup=-1)
    with pytest.raises(ValueError):
        timing.benchmark(lambda: None, "x", hold_ms=-1)


def test_write_json(tmp_path):
    t = timing.Timing("v", median_ms=1.0, nbytes=1_000_000)
    timing.write_json([t, {"kernel": "k", "us": 2.5}], tmp_path / "r.json", device="test")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["results"][1] == {"kernel": "k", "us": 2.5}  # plain dicts pass through
    assert data["meta"]["device"] == "test" and data["results"][0]["gbps"] == pytest.approx(1.0)


def test_readme_figures_print_through_the_one_table_printer():
    caption = "Measured on an NVIDIA H100 (n = 3, " + "every version checked; " * 4 + "end):"
    header, rows = ["version", "ms"], [["1 naive", "2.5"], ["2 tiled", "0.75"]]
    figures = timing.ReadmeFigures("chapters/x/README.md", "NVIDIA H100", caption, header, rows)
    lines = figures.format().splitlines()
    # the caption wraps at 100 columns, its later lines indented like the table's
    assert lines[0].startswith("GPU figures from chapters/x/README.md: measured on an NVIDIA H100")
    assert len(lines) == 5 and all(len(line) <= 100 for line in lines)
    assert lines[1].startswith("  ") and lines[1].endswith("end):")
    assert lines[2:] == ["  version  ms", "  1 naive  2.5", "  2 tiled  0.75"]
    assert lines[2:] == timing.format_table(rows, header=header).splitlines()
    # a ragged row is refused, not cut to the header's width
    figures.rows = [["1 naive", "2.5", "a stray cell"]]
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        figures.format()


@pytest.mark.gpu
def test_device_peaks_are_plausible():
    peaks = timing.device_peaks()
    assert 100 < peaks["copy_gbps"] < 20_000
    assert peaks["sgemm_tflops"] is None or 1 < peaks["sgemm_tflops"] < 200


# ---------------------------------------------------------------- harness


def test_comma_names_parses_choices_and_names_them_on_a_bad_list():
    from common.harness import comma_names

    import argparse

    parse = comma_names(("tf32", "bf16", "f16"))
    assert parse(" bf16, tf32 ,") == ["bf16", "tf32"]
    assert comma_names(("a.py",), lambda s: s.strip() + ".py")("a") == ["a.py"]
    for bad in ("", " , ", "tf32,fp8", "TF32"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from tf32, bf16, f16"):
            parse(bad)


def _add(a, b, out, blocks=None):
    _add_kernel[blocks or ceil_div(out.size, 32), 32](a, b, out)


def test_run_versions_checks_every_version(rng):
    from common.harness import run_versions

    from functools import partial

    n = 70
    a = random_array(n, rng=rng)
    b = random_array(n, rng=rng)
    res = run_versions(
        {"good": _add},
        (a, b),
        a.astype(np.float64) + b,
        n,
        tol=1e-6,
        nbytes=12 * n,
        repeats=2,
        warmup=1,
        print_table=False,
    )
    assert res[0].extra["rel_error"] < 1e-6
    half = partial(_add, blocks=1)  # covers only 32 of 70
    with pytest.raises(CheckError, match="NaN"):
        run_versions({"half": half}, (a, b), a.astype(np.float64) + b, n, print_table=False)


# ---------------------------------------------------------------- exercises & loaders


def test_load_chapter_module_errors_name_the_chapters():
    with pytest.raises(FileNotFoundError, match="chapters are"):
        load_chapter_module("99_nope", "x")


def test_implementation_turns_not_implemented_into_skip(tmp_path, monkeypatch):
    chapter = tmp_path / "chapters" / "98_demo"
    chapter.mkdir(parents=True)
    (chapter / "exercises.py").write_text("def f(x):\n    raise NotImplementedError('do it')\n")
    monkeypatch.setattr("common.internal.exercises.CHAPTERS_DIR", tmp_path / "chapters")
    impl = Implementation("98_demo", "exercises")
    with pytest.raises(pytest.skip.Exception, match="not attempted yet"):
        impl.f(1)
    sys.modules.pop("chapters.98_demo.exercises", None)


# ---------------------------------------------------------------- packaging, docs, doctor


def _requirement_names(reqs):
    import re

    return {re.split(r"[\s<>=!\[;]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


def _environment_yml_packages(text):
    """Package names in environment.yml's dependencies, conda and pip alike."""
    names, in_deps = set(), False
    for line in text.splitlines():
        item = line.split("#")[0].rstrip()
        if item and not item.startswith(" "):
            in_deps = item.startswith("dependencies:")
        elif in_deps and item.strip().startswith("- ") and not item.endswith(":"):
            names.add(item.strip()[2:].strip())
    return _requirement_names(names)


CONDA_TO_PIP = {"pytorch": "torch"}


def test_environment_yml_matches_pyproject():
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pip_names = _requirement_names(
        project["dependencies"] + project["optional-dependencies"]["dev"]
    )
    conda = _environment_yml_packages((REPO_ROOT / "environment.yml").read_text())
    conda = {CONDA_TO_PIP.get(n, n) for n in conda} - {"python", "pip"}
    assert conda == pip_names, (
        f"only in environment.yml: {conda - pip_names}; only in pyproject: {pip_names - conda}"
    )


def test_numpy_pin_excludes_2_5():
    import tomllib

    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("numpy") and "<2.5" in d for d in deps)


def test_readme_code_blocks_match_the_code():
    from common.internal import readme_sync

    problems = []
    for readme in readme_sync.all_readmes():
        problems += readme_sync.sync_readme(readme, write=False)
    assert not problems, "\n".join(problems) + "\nrun: python -m common.internal.readme_sync"


def test_readme_sync_extracts_decorated_functions(tmp_path):
    from common.internal import readme_sync

    src = tmp_path / "k.py"
    src.write_text("import x\n\n@deco\ndef f(a):\n    return a\n\n\ndef g():\n    pass\n")
    assert readme_sync.extract(src, "f") == "@deco\ndef f(a):\n    return a"
    with pytest.raises(LookupError):
        readme_sync.extract(src, "h")


def test_doctor_runs_and_recognises_known_breakages(capsys):
    from common import doctor

    assert doctor.report() == 0
    out = capsys.readouterr().out
    assert (
        f"runtime: {runtime.runtime_name()}" in out
        and "test kernel (vector add, 1000 elements): ok" in out
    )
    found = doctor.static_findings({"numpy": "2.5.1", "numba-cuda": "0.30.4"})
    assert any("numpy>=2.0,<2.5" in f.fix for f in found)
    found = doctor.static_findings({"numpy": "2.4.0", "numba-cuda": None})
    assert any("numba-cuda" in f.fix for f in found)
    ptx = doctor._classify(
        RuntimeError(
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with an unsupported toolchain"
        )
    )
    assert "driver" in ptx.fix
    assert (
        "row_stack"
        in doctor._classify(AttributeError("module 'numpy' has no attribute 'row_stack'")).problem
    )


def test_doctor_command_exit_status():
    out = subprocess.run(
        [sys.executable, "-m", "common.doctor"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: ready" in out.stdout


# progress: tests/test_progress.py


def test_require_device_array_names_the_fix():
    from common.checking import require_device_array

    dev = cuda.to_device(np.ones((2, 3), np.float32))
    require_device_array(dev, "x", 2, np.float32)
    with pytest.raises(TypeError, match=r"cuda.to_device"):
        require_device_array(np.ones(3, np.float32), "x")
    with pytest.raises(ValueError, match="must be 1-D"):
        require_device_array(dev, "x", ndim=1)
    with pytest.raises(TypeError, match=r"float64.*astype"):
        require_device_array(dev, "x", dtype=np.float64)


def test_check_compares_complex_values_whole():
    # A cast to float64 keeps only the real parts: a wrong imaginary part passed.
    ref = np.array([1 + 1j, 2 - 1j, -3 + 0.5j])
    wrong_imag = np.conj(ref).astype(np.complex64)
    with pytest.raises(CheckError, match=r"index \(0, 1\)"):
        check(wrong_imag, ref, tol=1e-5, name="spectrum")
    assert rel_error(wrong_imag, ref) > 0.5
    assert check(ref.astype(np.complex64), ref, tol=1e-6) < 1e-6


def test_torch_cuda_available_is_false_in_the_simulator_even_where_torch_sees_a_gpu(
    monkeypatch,
):
    # A machine with a GPU can run the course in the simulator: the libraries'
    # baselines must not be timed then (nothing of ours is).
    if not is_simulator():
        pytest.skip("simulator behaviour")
    sees_a_gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", sees_a_gpu)
    assert runtime.torch_cuda_available() is False
    monkeypatch.setattr(runtime, "is_simulator", lambda: False)
    assert runtime.torch_cuda_available() is True
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed: import fails
    assert runtime.torch_cuda_available() is False
