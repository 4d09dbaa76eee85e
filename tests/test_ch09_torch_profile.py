"""Chapter 09, torch_profile.py: the kernel table, the launch gaps, the stage ranges,
and the script in the simulator (CPU activity only)."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.internal.exercises import load_chapter_module

import json
import math

import pytest
from torch.profiler import ProfilerActivity, profile

CHAPTER = "09_profiling"
tp = load_chapter_module(CHAPTER, "torch_profile")
tools = load_chapter_module(CHAPTER, "tools")
SAVED = sorted(tools.SAVED_DIR.glob("torch_profile_kernels_*.json"))

TAG = "[abi:cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3Cw6igA9duC0hkwnNGiHEkYkrqQBFBTDEwCyQe21eqwcFW3UoDGjzpQEsgzrtUEAA_3d_3d]"
IGEMM_A = f"final_project::fast_conv::make_conv2d_igemm::_3clocals_3e::conv2d_igemm[abi:v22]{TAG}(Array<float, 4, C"
IGEMM_B = f"final_project::fast_conv::make_conv2d_igemm::_3clocals_3e::conv2d_igemm[abi:v35]{TAG}(Array<float, 4, C"
SGD = f"final_project::kernels::sgd_update_naive[abi:v26]{TAG}(Array<float, 1, C, mutable, aligned>"


# ------------------------------------------------------------------ kernel_table


def test_kernel_table_groups_sorts_and_sums_to_100():
    records = [
        (IGEMM_A, 0.0, 10.0),
        ("Memcpy DtoD (Device -> Device)", 10.0, 13.0),
        (SGD, 40.0, 41.0),
        (IGEMM_B, 20.0, 30.0),  # another specialisation of the same kernel
    ]
    rows = tools.kernel_table(records)
    assert [r.name for r in rows] == ["conv2d_igemm", "Memcpy DtoD", "sgd_update_naive"]
    igemm, copy, sgd = rows
    assert (igemm.calls, igemm.total_us, igemm.mean_us) == (2, 20.0, 10.0)
    assert (copy.calls, copy.total_us) == (1, 3.0)
    assert (sgd.calls, sgd.total_us, sgd.mean_us) == (1, 1.0, 1.0)
    assert igemm.percent == pytest.approx(100 * 20 / 24)
    assert copy.percent == pytest.approx(100 * 3 / 24)
    assert sum(r.percent for r in rows) == pytest.approx(100.0)


def test_kernel_table_orders_by_total_not_by_calls_or_mean():
    # "many" has most calls and the smallest mean; "long" the largest mean; "mid" the
    # largest total: a sort by calls, by mean or by first appearance each gets it wrong.
    records = [("long", 0, 7), ("many", 10, 12), ("many", 12, 14), ("many", 14, 16)]
    records += [("mid", 20, 24), ("mid", 30, 34)]
    rows = tools.kernel_table(records)
    assert [r.name for r in rows] == ["mid", "long", "many"]
    assert [r.total_us for r in rows] == [8, 7, 6]
    assert [r.calls for r in rows] == [2, 1, 3]


def test_kernel_table_single_kernel_and_ties_by_name():
    (row,) = tools.kernel_table([(SGD, 5.0, 5.5)])
    assert row == tools.KernelRow("sgd_update_naive", 1, 0.5, 0.5, 100.0)
    rows = tools.kernel_table([("b", 0, 2), ("a", 3, 5)])
    assert [r.name for r in rows] == ["a", "b"]
    assert [r.percent for r in rows] == [50.0, 50.0]


def test_kernel_table_rejects_empty_and_backwards_records():
    with pytest.raises(ValueError, match="no kernel records"):
        tools.kernel_table([])
    with pytest.raises(ValueError, match="end before they start"):
        tools.kernel_table([("a", 0, 1), ("b", 5, 4)])


# ------------------------------------------------------------------ launch_gaps


@pytest.mark.parametrize(
    "intervals, expected",
    [
        # overlap: merged to (0, 15) and (20, 30)
        ([(0, 10), (5, 15), (20, 30)], (25, 30, 5, 1, 5)),
        # touching intervals leave no gap
        ([(0, 10), (10, 20)], (20, 20, 0, 0, 0)),
        # one kernel inside another, given out of order: the span ends at 160, not 20
        ([(150, 160), (10, 20), (0, 100)], (110, 160, 50, 1, 50)),
        # a kernel inside a longer one that started first, ending last
        ([(0, 100), (10, 20)], (100, 100, 0, 0, 0)),
        # several gaps, the largest not the first
        ([(0, 1), (3, 4), (10, 11)], (3, 11, 8, 2, 6)),
        # a single kernel
        ([(3.5, 7.25)], (3.75, 3.75, 0, 0, 0)),
    ],
)
def test_launch_gaps_known_answers(intervals, expected):
    got = tools.launch_gaps(intervals)
    assert tuple(got) == pytest.approx(expected)
    assert got.busy_us + got.idle_us == pytest.approx(got.span_us)


def test_launch_gaps_idle_percent_and_errors():
    assert tools.launch_gaps([(0, 10), (30, 40)]).idle_percent == pytest.approx(50.0)
    assert tools.launch_gaps([(2, 2)]).idle_percent == 0.0
    with pytest.raises(ValueError, match="no kernel records"):
        tools.launch_gaps([])
    with pytest.raises(ValueError, match="end before they start"):
        tools.launch_gaps([(0, 1), (9, 3)])


def test_gap_line_reports_busy_span_and_idle():
    line = tp.gap_line(tools.launch_gaps([(0, 10), (30, 40)]))
    assert line.startswith("GPU busy 20.0 us of a 40.0 us step (50.0% idle between kernels")


# ------------------------------------------------------------------ saved profiles


def test_saved_profiles_exist_for_every_config():
    assert {p.stem.removeprefix("torch_profile_kernels_") for p in SAVED} >= set(tp.CONFIGS)


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_saved_profile_tables_match_their_records(path):
    data = json.loads(path.read_text())
    records = [tools.KernelRecord(**r) for r in data["kernels"]]
    assert records, f"{path.name} has no device records"
    table = [tools.KernelRow(**r) for r in data["kernel_table"]]
    again = tools.kernel_table(records)
    assert [(r.name, r.calls) for r in table] == [(r.name, r.calls) for r in again]
    assert [r[2:] for r in table] == [pytest.approx(r[2:]) for r in again]
    assert math.fsum(r.percent for r in table) == pytest.approx(100.0)
    totals = [r.total_us for r in table]
    assert totals == sorted(totals, reverse=True)
    assert sum(r.calls for r in table) == len(records)
    gaps = tools.GapStats(**data["gaps"])
    assert tuple(gaps) == pytest.approx(
        tuple(tools.launch_gaps((r.start_us, r.end_us) for r in records))
    )
    assert 0 < gaps.busy_us <= gaps.span_us
    # the short names are what the tables print: no template arguments or ABI tags left
    assert all("[" not in r.name and "::" not in r.name for r in table)


# ------------------------------------------------------------------ stage ranges


def _range_names(prof, names):
    return [r.name for r in tools.host_records(prof.events(), names)]


def test_stage_ranges_open_one_range_a_stage_in_order():
    stages = ("a", "b", "c")
    ranges = tools.StageRanges(stages)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with ranges.stages():
            for name in stages:
                ranges.mark(name)
    assert _range_names(prof, stages) == list(stages)
    spans = tools.host_records(prof.events(), stages)
    assert all(x.end_us <= y.start_us for x, y in zip(spans, spans[1:]))


def test_stage_ranges_reject_out_of_order_marks():
    ranges = tools.StageRanges(("a", "b", "c"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="'c' arrived where 'b' was expected"):
            with ranges.stages():
                ranges.mark("a")
                ranges.mark("c")
    # the range of "b" was opened and closed; nothing is left open
    assert _range_names(prof, ("a", "b", "c")) == ["a", "b"]
    with ranges.stages():  # usable again after the error
        for name in ("a", "b", "c"):
            ranges.mark(name)


def test_stage_ranges_reject_a_step_that_misses_marks_and_stray_marks():
    ranges = tools.StageRanges(("a", "b"))
    with pytest.raises(RuntimeError, match="after 1 of 2 stage marks"):
        with ranges.stages():
            ranges.mark("a")
    with pytest.raises(RuntimeError, match="outside"):
        ranges.mark("a")


# ------------------------------------------------------------------ the script


@pytest.mark.skipif(not common.is_simulator(), reason="main() runs the full network on a GPU")
def test_main_in_the_simulator(tmp_path, capsys):
    from final_project.fast_model import STAGES

    assert tp.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("CPU time per range") == 2
    assert out.count("GPU part skipped") == 2
    assert "conv1 backward" in out and "conv1 grad weight" in out
    for config, names in (("naive", tools.numba_range_names()), ("fast", list(STAGES))):
        trace = json.loads((tmp_path / f"trace_{config}.json").read_text())
        traced = {e["name"] for e in trace["traceEvents"]}
        assert set(names) | {tools.STEP_RANGE} <= traced
        data = json.loads((tmp_path / f"torch_profile_kernels_{config}.json").read_text())
        assert data["kernels"] == [] and data["gaps"] is None
        assert sorted(r["name"] for r in data["range_table"]) == sorted(names)
        assert all(r["calls"] == 1 for r in data["range_table"])
        assert math.fsum(r["percent"] for r in data["range_table"]) == pytest.approx(100.0)
        # the ranges lie inside the step and do not overlap (one stage at a time)
        ranges = [tools.KernelRecord(**r) for r in data["ranges"]]
        step = next(r for r in ranges if r.name == tools.STEP_RANGE)
        inner = sorted((r for r in ranges if r.name != tools.STEP_RANGE), key=lambda r: r.start_us)
        assert step.start_us <= inner[0].start_us and inner[-1].end_us <= step.end_us
        assert all(x.end_us <= y.start_us for x, y in zip(inner, inner[1:]))


@pytest.mark.skipif(not common.is_simulator(), reason="checks the simulator's refusal")
def test_main_refuses_graphs_in_the_simulator(capsys):
    with pytest.raises(SystemExit) as exc:
        tp.main(["--configs", "naive,graph"])
    assert exc.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err
