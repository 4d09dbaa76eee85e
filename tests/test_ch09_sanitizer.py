"""Chapter 9: reading compute-sanitizer logs, the four sanitizer targets and their
fixed twins, and the sanitizer and debugging scripts run in the simulator."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import RaceError, is_simulator
from common.checking import check
from common.internal.exercises import chapter_dir, load_chapter_module
from common.internal.float32_purity import (
    assert_float32_pure,
    float32_pure_launches,
    recording_launches,
)

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

CH = "09_profiling"
san = load_chapter_module(CH, "sanitizer")
tools = load_chapter_module(CH, "tools")
dbg = load_chapter_module(CH, "debugging")
simulator_only = pytest.mark.skipif(not is_simulator(), reason="simulator behaviour")


# ------------------------------------------------------------------ the saved logs


@dataclass(frozen=True)
class Expected:
    errors: int  # the tool's summary count
    printed: int  # reports in the log (at most --print-limit)
    not_printed: int
    kinds: frozenset
    kernels: frozenset  # short names; None for reports outside a kernel
    first_thread: tuple | None
    first_block: tuple | None
    app_failed: bool


# What each log in chapters/09_profiling/saved/ holds: they come from the course's GPU
# run (H100, CUDA 13 compute-sanitizer 2025.3.1, --print-limit 5). When the logs are
# regenerated (python chapters/09_profiling/sanitizer.py --out chapters/09_profiling/saved
# on a GPU), this table is rewritten from the new logs.
SAVED_LOGS = {
    # 8 blocks of 128 threads on 1000 elements: threads 104..127 of block 7 write past
    # the allocation, one report each
    "oob": Expected(
        24,
        5,
        19,
        frozenset({"Invalid __global__ write of size 4 bytes"}),
        frozenset({"fill_index_unchecked"}),
        (104, 0, 0),
        (7, 0, 0),
        False,
    ),
    # racecheck reports one line for the hazards of one pair of instructions
    "race": Expected(
        1,
        1,
        0,
        frozenset({"Race reported between Write access and Read access"}),
        frozenset({"shift_left_smem_no_barrier"}),
        None,
        None,
        False,
    ),
    "uninit": Expected(
        1000,
        5,
        995,
        frozenset({"Uninitialized __global__ memory read of size 4 bytes"}),
        frozenset({"accumulate_into"}),
        (96, 0, 0),
        (0, 0, 0),
        False,
    ),
    # 16 threads of the first warp of each of the 8 blocks wait at the barrier
    "divergent-barrier": Expected(
        128,
        5,
        123,
        frozenset({"Barrier error detected. Divergent thread(s) in warp."}),
        frozenset({"shift_left_barrier_in_branch"}),
        (0, 0, 0),
        (4, 0, 0),
        False,
    ),
}


def _saved(target, fixed=False):
    return (tools.SAVED_DIR / san.log_name(target, fixed)).read_text()


def test_every_target_has_a_saved_log_and_an_expectation():
    assert set(SAVED_LOGS) == set(san.TARGETS)
    for target in san.TARGETS:
        assert (tools.SAVED_DIR / san.log_name(target)).is_file(), san.log_name(target)


@pytest.mark.parametrize("target", [t for t, e in SAVED_LOGS.items() if e is not None])
def test_saved_log_parses_to_its_counts_kinds_and_kernels(target):
    want = SAVED_LOGS[target]
    report = tools.parse_report(_saved(target), san.TARGETS[target].tool)
    assert report.tool == san.TARGETS[target].tool
    assert report.error_count == want.errors
    assert len(report.findings) == want.printed
    assert report.not_printed == want.not_printed
    assert {f.kind for f in report.findings} == want.kinds
    assert {f.kernel for f in report.findings} == want.kernels
    assert report.first.thread == want.first_thread
    assert report.first.block == want.first_block
    assert report.app_failed == want.app_failed
    if report.tool != "racecheck":  # racecheck reports one line for many hazards
        # every error counted is printed or counted as not printed
        assert report.error_count == len(report.findings) + report.not_printed


def test_log_cut_short_is_refused():
    # a run killed before compute-sanitizer printed its summary
    text = _saved("uninit")
    cut = text[: text.index("========= ERROR SUMMARY")]
    with pytest.raises(ValueError, match="cut short"):
        tools.parse_report(cut)


@pytest.mark.parametrize("target", list(san.TARGETS))
def test_saved_fixed_log_has_no_errors(target):
    path = tools.SAVED_DIR / san.log_name(target, fixed=True)
    if not path.is_file():
        pytest.skip(f"{path.name} not saved yet (written by the GPU run)")
    assert tools.parse_report(path.read_text()).error_count == 0


# ------------------------------------------------------------------ parse_report

MEMCHECK_TRUNCATED = """\
$ compute-sanitizer --tool memcheck --report-api-errors no --print-limit 2 python x.py
========= COMPUTE-SANITIZER
target oob (fill_index_unchecked) on NVIDIA H100 80GB HBM3
========= Invalid __global__ write of size 4 bytes
=========     at chapters::05_first_kernels::out_of_bounds::fill_index_unchecked[abi:v1,cw51cXT](Array<float, (int)1, C, mutable, aligned>)+0x90 in /repo/out_of_bounds.py:31
=========     by thread (104,0,0) in block (7,0,0)
=========     Address 0x7f0a12000fa0 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0a12000000 of size 4000 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: main in sanitizer.py:400
=========
========= Invalid __global__ write of size 4 bytes
=========     at chapters::05_first_kernels::out_of_bounds::fill_index_unchecked[abi:v1,cw51cXT](Array<float, (int)1, C, mutable, aligned>)+0x90 in /repo/out_of_bounds.py:31
=========     by thread (105,0,0) in block (7,0,0)
=========     Address 0x7f0a12000fa4 is out of bounds
=========
outcome: launch failed: [CUDA_ERROR_LAUNCH_FAILED] ERROR SUMMARY: 99 errors
========= ERROR SUMMARY: 24 errors
========= ERROR SUMMARY: 22 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at __main__::shift_left_smem_no_barrier[abi:v1,cw51](Array<float, (int)1, C, mutable, aligned>, Array<float, (int)1, C, mutable, aligned>)+0x150 in shared_memory.py:48
=========     and Read access at __main__::shift_left_smem_no_barrier[abi:v1,cw51](Array<float, (int)1, C, mutable, aligned>, Array<float, (int)1, C, mutable, aligned>)+0x1a0 in shared_memory.py:51 [1,536 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_parse_truncated_memcheck_log():
    report = tools.parse_report(MEMCHECK_TRUNCATED)
    assert report.tool == "memcheck"  # from the "$ compute-sanitizer --tool" line
    # the program's own line that mentions "ERROR SUMMARY" is not the tool's summary
    assert (report.error_count, report.not_printed, len(report.findings)) == (24, 22, 2)
    first, second = report.findings
    assert first.kind == "Invalid __global__ write of size 4 bytes"
    assert first.kernel == "fill_index_unchecked"
    assert (first.thread, first.block) == ((104, 0, 0), (7, 0, 0))
    assert first.address == 0x7F0A12000FA0
    assert (second.thread, second.address) == ((105, 0, 0), 0x7F0A12000FA4)
    assert "fill_index_unchecked, thread (104,0,0), block (7,0,0)" in first.describe()


def test_parse_racecheck_log():
    report = tools.parse_report(RACECHECK)
    assert report.tool == "racecheck"
    assert (report.error_count, report.warning_count) == (1, 0)
    (race,) = report.findings
    assert race.kind == "Race reported between Write access and Read access"
    assert race.kernel == "shift_left_smem_no_barrier"
    assert race.thread is None and race.block is None


def test_parse_clean_log():
    clean = "========= COMPUTE-SANITIZER\nfixed\n========= ERROR SUMMARY: 0 errors\n"
    report = tools.parse_report(clean, tool="synccheck")
    assert (report.tool, report.error_count, report.findings) == ("synccheck", 0, [])
    assert report.first is None
    assert tools.parse_report(clean).tool is None  # nothing in it names the tool


@pytest.mark.parametrize(
    "text",
    [
        "",
        "========= COMPUTE-SANITIZER\n========= Invalid __global__ write of size 4 bytes\n",
        "ERROR SUMMARY: 0 errors\n",  # printed by the program, not by the tool
    ],
)
def test_parse_log_without_summary_raises(text):
    with pytest.raises(ValueError, match="no 'ERROR SUMMARY'"):
        tools.parse_report(text)


def test_sanitizer_command_and_log_names():
    command = san.sanitizer_command("oob")
    assert command[:3] == ["compute-sanitizer", "--tool", "memcheck"]
    assert "--report-api-errors" in command and "no" in command
    assert "kns=fill_index_unchecked" in command
    assert command[-2:] == ["--target", "oob"]
    fixed = san.sanitizer_command("divergent-barrier", fixed=True)
    assert "kns=shift_left_barrier_for_all" in fixed and fixed[-1] == "--fixed"
    assert san.log_name("divergent-barrier") == "sanitizer_synccheck_divergent-barrier.txt"
    assert san.log_name("race", fixed=True) == "sanitizer_racecheck_race_fixed.txt"
    with pytest.raises(ValueError, match="unknown target"):
        san.launch("use-after-free")


# ------------------------------------------------------------------ the targets


@simulator_only
def test_oob_target_raises_index_error_in_simulator():
    with pytest.raises(IndexError, match="out of bounds"):
        san.launch("oob")


@simulator_only
def test_race_target_is_reported_by_the_race_detector():
    with pytest.raises(RaceError, match="shift_left_smem_no_barrier"):
        san.launch("race")


@simulator_only
def test_uninit_target_poisoned_buffer_fails_check():
    assert "1000 of 1000 elements are NaN" in san.poison_defence()


@pytest.mark.parametrize("target", list(san.TARGETS))
def test_fixed_targets_are_right(target):
    with recording_launches() as launches:
        out, ref = san.launch(target, fixed=True)
    assert out.shape == ref.shape and out.size > 1
    check(out, ref, tol=0.0, name=f"{target} fixed")
    # both twins take the fixed one's arguments; neither may compute in float64 (the
    # simulator stores float32 either way)
    ((_, argtypes, _),) = launches
    for kernel in (san.TARGETS[target].fixed, san.TARGETS[target].bug):
        assert_float32_pure(kernel, argtypes)


@simulator_only
def test_divergent_barrier_is_a_barrier_error_in_simulator():
    # In a child process with a time limit: a barrier that some threads never reach
    # could wait forever, and must not hang the suite. The simulator's barrier stops
    # waiting for threads that returned, so the launch ends, and the course's launch
    # checks report the threads that ended without reaching it (BarrierError).
    script = chapter_dir(CH) / "sanitizer.py"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run(
        [sys.executable, str(script), "--target", "divergent-barrier"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "outcome: BarrierError: in kernel shift_left_barrier_in_branch" in done.stdout


@simulator_only
def test_simulator_names_the_barrier_in_the_branch_and_a_thread_that_skipped_it():
    said = san.simulator_view("divergent-barrier")
    source = (chapter_dir(CH) / "sanitizer.py").read_text().splitlines()
    (line,) = [
        k + 1
        for k, text in enumerate(source)
        if text.strip() == "cuda.syncthreads()" and source[k - 1].strip() == "if t < 16:"
    ]
    assert said.startswith("BarrierError: in kernel shift_left_barrier_in_branch"), said
    assert f"sanitizer.py:{line}" in said and "thread (16,0,0) never reached" in said


# ------------------------------------------------------------------ the scripts


@simulator_only
def test_sanitizer_main_in_simulator(capsys, tmp_path):
    assert san.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for target in san.TARGETS:
        assert " ".join(san.sanitizer_command(target)) in out
    assert "skipped: we are in the simulator" in out
    assert "IndexError: tid=[104, 0, 0] ctaid=[7, 0, 0]" in out
    assert "RaceError: race in kernel shift_left_smem_no_barrier" in out
    assert "elements are NaN (never written?)" in out
    assert "BarrierError: in kernel shift_left_barrier_in_branch" in out
    assert "fixed versions: outputs right on the simulator  OK" in out
    assert not any(tmp_path.iterdir())  # nothing ran under a sanitizer, nothing saved


@simulator_only
def test_debugging_main_in_simulator(capsys):
    hook = sys.breakpointhook
    with float32_pure_launches():  # alpha reaches the kernels as a float32
        assert dbg.main([]) == 0
    out = capsys.readouterr().out
    assert "thread 0 : x[i] = 1.0 out[i] = 2.0" in out
    assert "stopped in thread 3 of block 0 with i = 3, x[i] = 4.0, out[i] = 8.0" in out
    assert out.count("ValueError: tid=[37, 0, 0] ctaid=[0, 0, 0]: negative input") == 2
    assert sys.breakpointhook is hook  # the recording hook is gone again


PTX = """\
.file 1 "/repo/chapters/06_memory/transpose.py"
    .loc 1 104 0
    ld.param.u64 %rd1, [param_0];
    ld.global.nc.f32 %f1, [%rd5];
    @%p1 ld.global.f32 %f3, [%rd6];
    st.shared.f32 [%r3], %f1;
    bar.sync 0;
    barrier.sync 0;
    ld.shared.f32 %f2, [%r7];
    @!%p2 st.global.f32 [%rd9], %f2;
    .loc 1 110 0
"""

SASS = """\
        /*0080*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0090*/              @!P0 LDG.E.128 R4, desc[UR4][R6.64] ;
        /*00a0*/                   STS [R0], R2 ;
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00c0*/                   LDS R5, [R3] ;
        /*00d0*/                   STG.E desc[UR4][R8.64], R5 ;
        /*00e0*/                   LDGSTS [R0], desc[UR4][R2.64] ;
"""


def test_count_ptx_and_sass():
    assert dbg.count_ptx(PTX) == {
        "ld.global": 2,
        "st.global": 1,
        "ld.shared": 1,
        "st.shared": 1,
        "bar.sync": 2,
        ".loc": 2,
        ".file": 1,
    }
    assert dbg.count_sass(SASS) == {"LDG": 2, "STG": 1, "LDS": 1, "STS": 1, "BAR": 1}


API_ERROR_LOG = """\
========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame:  [0xd4a2] in cydriver.cpython-312-x86_64-linux-gnu.so
=========
========= ERROR SUMMARY: 1 error
"""


def test_api_error_outside_a_kernel():
    # what a run without --report-api-errors no prints at start-up: the CUDA Python
    # bindings' probes of the driver, outside any kernel
    report = tools.parse_report(API_ERROR_LOG, "memcheck")
    assert report.error_count == 1
    (finding,) = report.findings
    assert finding.kind.startswith("Program hit CUDA_ERROR_INVALID_VALUE")
    assert finding.kernel is None and finding.thread is None
