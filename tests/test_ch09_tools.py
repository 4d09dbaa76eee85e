"""Chapter 09's plumbing (tools.py) and what the scripts share: running a command
under a time limit, one launch said in one line, reading a sanitizer log from a
file, the course's one table printer as the chapter's scripts call it, the
capstone's inputs, and torch_profile's stage ranges through FastCNN's public hook."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import BarrierError, RaceError, load_chapter_module
from common.timing import format_table

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

CHAPTER = "09_profiling"
tools = load_chapter_module(CHAPTER, "tools")
workloads = load_chapter_module(CHAPTER, "workloads")


# ------------------------------------------------------------------ running a command


def _gone(pid: int) -> bool:
    """The process no longer runs (it was reaped, or only its zombie is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to see the grandchild")
def test_run_command_kills_the_whole_process_group_on_timeout():
    # a child that starts a grandchild (as compute-sanitizer starts Python) and hangs:
    # killing the child alone would leave the grandchild running
    script = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print('grandchild', p.pid, flush=True); time.sleep(60)"
    )
    t0 = time.monotonic()
    output, problem = tools.run_command([sys.executable, "-c", script], timeout=3)
    assert time.monotonic() - t0 < 30
    assert problem == "did not finish in 3 s (killed)"
    pid = int(output.split("grandchild")[1].split()[0])  # what it printed before the kill
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"grandchild {pid} still runs"


def test_run_command_returns_output_and_no_problem():
    output, problem = tools.run_command([sys.executable, "-c", "print('hi'); print('err')"], 60)
    assert (output.split(), problem) == (["hi", "err"], None)
    # the repository root is the working directory: the paths a command names are the
    # paths a reader types
    output, _ = tools.run_command([sys.executable, "-c", "import os; print(os.getcwd())"], 60)
    assert Path(output.strip()) == tools.REPO_ROOT


def test_outcome_in_child_reads_the_last_outcome_line():
    said = tools.outcome_in_child(
        [sys.executable, "-c", "print('outcome: first'); print('outcome: last'); print('x')"], 60
    )
    assert said == "last"
    assert tools.outcome_in_child([sys.executable, "-c", "print('no outcome')"], 60) == "no outcome"


def test_run_logged_writes_the_command_then_the_output(tmp_path):
    path = tools.run_logged(
        [sys.executable, "-c", "print('========= ERROR SUMMARY: 0 errors')"],
        ["compute-sanitizer", "--tool", "racecheck", "python", "x.py"],
        "a device",
        tmp_path / "logs" / "log.txt",
        60,
    )
    lines = path.read_text().splitlines()
    assert lines[:2] == ["$ compute-sanitizer --tool racecheck python x.py", "# device: a device"]
    report = tools.parse_report(path.read_text())
    assert (report.tool, report.error_count) == ("racecheck", 0)  # the tool from line 1


# ------------------------------------------------------------------ launches and logs


def test_describe_outcome_names_each_way_a_launch_ends():
    ref = np.arange(4.0)

    def raises(exc):
        def launch():
            raise exc

        return launch

    race = RaceError("race in kernel k (shared memory): threads 0 and 1; more detail")
    assert tools.describe_outcome(raises(race)) == (
        "RaceError: race in kernel k (shared memory): threads 0 and 1"
    )
    barrier = BarrierError("in kernel k, block (0,0,0): thread (16,0,0) never reached")
    assert tools.describe_outcome(raises(barrier)).startswith("BarrierError: in kernel k")
    assert (
        tools.describe_outcome(raises(IndexError("index 9\nsecond line"))) == "IndexError: index 9"
    )
    assert tools.describe_outcome(lambda: (ref.copy(), ref)) == (
        "no error raised; all 4 outputs right"
    )
    wrong = ref.copy()
    wrong[[0, 3]] += 1e-3  # off by far more than 1e-6 relative
    assert tools.describe_outcome(lambda: (wrong, ref)) == "no error raised; 2 of 4 outputs wrong"


def test_read_report_says_why_a_log_cannot_be_read(tmp_path):
    assert tools.read_report(tmp_path / "missing.txt", "memcheck") == (None, "no log")
    cut = tmp_path / "cut.txt"
    cut.write_text("========= COMPUTE-SANITIZER\n========= Invalid __global__ write\n")
    assert tools.read_report(cut, "memcheck") == (None, "log has no summary (run cut short)")
    whole = tmp_path / "whole.txt"
    whole.write_text("========= ERROR SUMMARY: 3 errors\n")
    report, why = tools.read_report(whole, "initcheck")
    assert (report.tool, report.error_count, why) == ("initcheck", 3, "")


def test_log_table_reads_each_bug_and_its_fixed_twin_and_names_the_surprises(tmp_path):
    saved = tools.SAVED_DIR
    (tmp_path / "clean.txt").write_text("========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "dirty.txt").write_text("========= ERROR SUMMARY: 2 errors\n")
    logs = [
        # the saved oob logs: 24 errors, 19 of them not printed; the fixed twin clean
        ("oob", "memcheck", saved / "sanitizer_memcheck_oob.txt", tmp_path / "clean.txt"),
        ("quiet", "racecheck", tmp_path / "clean.txt", tmp_path / "dirty.txt"),
        ("lost", "initcheck", tmp_path / "missing.txt", tmp_path / "missing.txt"),
    ]
    table, surprises = tools.log_table(logs)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["bug", "tool", "errors", "fixed"]
    assert (
        "24 (19 not printed)" in lines[1] and "fill_index_unchecked, thread (104,0,0)" in lines[1]
    )
    assert lines[2].split()[:4] == ["quiet", "racecheck", "0", "2"]
    assert lines[3].split() == ["lost", "initcheck", "no", "log", "no", "log"]
    assert surprises == [
        "racecheck found nothing in quiet",
        "racecheck found 2 errors in fixed quiet",
    ]


def test_python_name_and_first_line():
    sanitizer = load_chapter_module(CHAPTER, "sanitizer")
    assert tools.python_name(sanitizer.accumulate_into) == "accumulate_into"
    assert tools.first_line("  one\ntwo") == "one"
    assert tools.first_line("x" * 200, limit=10) == "xxxxxxx..."
    assert tools.first_line("") == ""


# ------------------------------------------------------------------ the table printer


def test_format_table_rows_with_a_header_align_each_column():
    rows = [["oob", "memcheck", 24], ["divergent-barrier", "synccheck", 128]]
    text = format_table(rows, "title", header=["bug", "tool", "errors"], align="<<>")
    assert text.splitlines() == [
        "title",
        "  bug                tool       errors",
        "  oob                memcheck       24",
        "  divergent-barrier  synccheck     128",
    ]
    # default: every column left-aligned, no title line, no trailing spaces
    assert format_table([["a", "bb"], ["ccc", "d"]], header=["x", "y"]).splitlines() == [
        "  x    y",
        "  a    bb",
        "  ccc  d",
    ]
    assert format_table([], header=["only"]) == "  only"


@pytest.mark.parametrize(
    "rows, align",
    [([["a", "b", "c"]], None), ([["a"]], None), ([["a", "b"]], "<"), ([["a", "b"]], "<^")],
)
def test_format_table_refuses_rows_or_align_that_do_not_fit_the_header(rows, align):
    with pytest.raises(ValueError):
        format_table(rows, header=["x", "y"], align=align)


def test_kernel_table_printer_sums_the_rows_left_out():
    tp = load_chapter_module(CHAPTER, "torch_profile")
    rows = tools.kernel_table([("a", 0, 5), ("b", 5, 8), ("c", 8, 10), ("d", 10, 11)])
    lines = tp.format_kernel_table(rows, "T", top=2).splitlines()
    assert lines[0] == "T" and lines[1].split() == [
        "name",
        "calls",
        "total",
        "us",
        "mean",
        "us",
        "%",
    ]
    assert lines[2].split() == ["a", "1", "5.0", "5.0", "45.5"]
    assert lines[-1] == "  ... 2 more: 3.0 us (27.3%)"
    assert len(lines) == 5


# ------------------------------------------------------------------ the capstone workload


def test_capstone_inputs_follow_the_network():
    net = workloads.capstone_net()
    images, labels = workloads.capstone_inputs(net, 3, seed=1)
    assert images.shape == (3, net.in_channels, net.height, net.width)
    assert (images.dtype, labels.dtype, labels.shape) == (np.float32, np.int32, (3,))
    assert labels.min() >= 0 and labels.max() < net.num_classes
    again, _ = workloads.capstone_inputs(net, 3, seed=1)
    assert np.array_equal(images, again)  # the same seed, the same batch
    if common.is_simulator():
        assert net.height == 8  # final_project.train.TINY: a step in seconds, not hours


@pytest.mark.skipif(not common.is_simulator(), reason="a full-size step on a GPU is another test")
def test_fast_stages_come_from_the_public_hook():
    from torch.profiler import ProfilerActivity, profile

    from final_project.fast_model import STAGES

    tp = load_chapter_module(CHAPTER, "torch_profile")
    stepper = tp.make_stepper("fast", workloads.capstone_net(), 2, nvtx=False)
    # the model is FastCNN itself: nothing of it is patched (its private _step least)
    assert not {"_step", "train_step"} & set(vars(stepper.model))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stepper.step()
    ranges = tools.host_records(prof.events(), STAGES)
    assert [r.name for r in ranges] == list(STAGES) and stepper.ranges == STAGES
    assert all(x.end_us <= y.start_us for x, y in zip(ranges, ranges[1:]))


def test_saved_dir_is_the_one_folder_the_scripts_read():
    assert tools.SAVED_DIR.is_dir() and tools.SAVED_DIR.name == "saved"
    roofline = load_chapter_module(CHAPTER, "roofline")
    assert roofline.SAVED_POINTS.parent == tools.SAVED_DIR and roofline.SAVED_POINTS.is_file()
    assert os.path.samefile(tools.REPO_ROOT / "chapters" / CHAPTER / "saved", tools.SAVED_DIR)
