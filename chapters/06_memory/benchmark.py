"""Every version of every chapter 06 pattern, checked and timed, in one table and one plot.

Runs the ``run()`` of each pattern script (shared_memory, transpose, reduction,
histogram, scan, stencil, softmax, fusion) at its GPU size (256 MiB or more),
then prints one table of GB/s and fraction of the device's copy bandwidth
(``common.timing.device_peaks()["copy_gbps"]``, bytes read + written), reports
whether the best version of transpose, reduction, histogram on uniform data,
softmax and fusion reaches 80% of copy bandwidth, and writes ``benchmark.json``
and ``benchmark.png`` into ``--out``.

Run: python chapters/06_memory/benchmark.py [--out DIR] [--only transpose,softmax] [--smoke]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.harness import run_script, save_results, script_parser
from common.timing import Timing, device_peaks, format_table

from pathlib import Path

PATTERNS = [
    "shared_memory",
    "transpose",
    "reduction",
    "histogram",
    "scan",
    "stencil",
    "softmax",
    "fusion",
]
# pattern -> which result names count for the 80%-of-copy bar (the best of them)
BAR = {
    "transpose": lambda name: name.startswith("transpose v") and "copy" not in name,
    "reduction": lambda name: name.startswith("reduce v"),
    "histogram": lambda name: "(uniform)" in name,
    "scan": lambda name: name.startswith("scan v"),
    "softmax": lambda name: "softmax v" in name,
    "fusion": lambda name: "fused" in name and "unfused" not in name,
}
BAR_FRACTION = 0.80
# --smoke: tiny sizes, to check that everything runs (tests use it, on a GPU too)
SMOKE_SIZES = {
    "shared_memory": {"n": 3 * 128 + 7},
    "transpose": {"shape": (37, 70)},
    "reduction": {"n": 263},
    "histogram": {"n": 263},
    "scan": {"n": 521},  # one single-pass tile; the tests run many small ones
    "stencil": {"n": 261, "shape": (21, 19)},
    "softmax": {"shape": (2, 2085)},
    "fusion": {"n": 775},
}


def bar_report(by_pattern: dict[str, list[Timing]]) -> list[dict]:
    """For each pattern with a bar: its best qualifying version and whether it
    reaches BAR_FRACTION of copy bandwidth (None in the simulator)."""
    rows = []
    for pattern, qualifies in BAR.items():
        if pattern not in by_pattern:
            continue
        cands = [r for r in by_pattern[pattern] if qualifies(r.name)]
        measured = [r for r in cands if r.fraction_of_copy_peak is not None]
        best = max(measured, key=lambda r: r.fraction_of_copy_peak) if measured else None
        rows.append(
            {
                "pattern": pattern,
                "best_version": best.name if best else None,
                "gbps": best.gbps if best else None,
                "fraction_of_copy": best.fraction_of_copy_peak if best else None,
                "meets_bar": (best.fraction_of_copy_peak >= BAR_FRACTION) if best else None,
            }
        )
    return rows


def plot(results: list[Timing], path: Path, device: str) -> None:
    """Horizontal bars: each version's fraction of copy bandwidth, the 80% bar dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    frac = [100 * (r.fraction_of_copy_peak or 0.0) for r in results]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(results) + 1.5))
    ax.barh(range(len(results)), frac, color="tab:blue")
    ax.set_yticks(range(len(results)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(100 * BAR_FRACTION, color="tab:red", linestyle="--", label="80% of copy")
    ax.set_xlabel("% of measured device-to-device copy bandwidth (minimum bytes moved)")
    measured = any(r.measured for r in results)
    ax.set_title(
        f"chapter 06 memory patterns on {device}"
        + ("" if measured else " (simulator: not measured)")
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> None:
    parser = script_parser(__doc__, "06_memory")
    parser.add_argument(
        "--only", default=",".join(PATTERNS), help=f"comma-separated subset of {','.join(PATTERNS)}"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: check that every version runs, time nothing useful",
    )
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(chosen) - set(PATTERNS)
    if unknown:
        parser.error(f"unknown patterns {sorted(unknown)}; choose from {PATTERNS}")
    peaks = device_peaks()
    print(f"device: {peaks['device']}, copy bandwidth: {peaks['copy_gbps']} GB/s")
    by_pattern: dict[str, list[Timing]] = {}
    for pattern in chosen:
        module = common.import_sibling(__file__, pattern)
        print(f"\n== {pattern}")
        by_pattern[pattern] = module.run(**(SMOKE_SIZES[pattern] if args.smoke else {}))
        for r in by_pattern[pattern]:
            r.extra["pattern"] = pattern
    results = [r for rs in by_pattern.values() for r in rs]
    print()
    print(format_table(results, title=f"chapter 06, all versions ({peaks['device']})"))
    bar = bar_report(by_pattern)
    print("\nbar: best version >= 80% of copy bandwidth")
    for row in bar:
        frac = row["fraction_of_copy"]
        verdict = {True: "meets", False: "BELOW", None: "not measured"}[row["meets_bar"]]
        shown = "-" if frac is None else f"{100 * frac:.1f}%"
        print(f"  {row['pattern']:<10} {shown:>7}  {verdict:<12} {row['best_version']}")
    save_results(results, args.out, "benchmark", bar=bar)
    plot(results, args.out / "benchmark.png", peaks["device"])


if __name__ == "__main__":
    run_script(main)
