"""Chapter 12's closing table: every kernel in both languages, from one run.

For each row that a chapter-12 script times (vector_add, softmax, layernorm, matmul,
inductor: their ``run()``), one line: the kernels behind it and their lines of code,
the first call (compile + run: Numba's JIT and the driver, or Triton's compiler and,
for the autotuned matmul, its search), the steady-state median, the rate and its
fraction of the device's measured peak (a device-to-device copy for GB/s, cuBLAS FP32
SGEMM for TFLOP/s: TF32 and FP16 rows pass 100% because tensor cores are faster than
the FP32 units that peak was measured on).

Lines of code are counted from the source (``inspect.getsource``) of each
``@triton.jit`` function and ``@cuda.jit`` kernel: lines that are neither blank nor
only a comment, decorator and signature included. A script that is not there, or
that cannot be imported, is skipped with a note; a failed check stops the run.

Run:   python chapters/12_triton/summary.py [--only matmul,softmax] [--out DIR]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import import_sibling
from common.harness import comma_names, run_script, save_results, script_parser
from common.timing import format_table

import inspect
import re
import types
from pathlib import Path

# The chapter's scripts, in the order the chapter teaches them.
SCRIPTS = ("vector_add", "softmax", "layernorm", "matmul", "inductor")

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------
# Kernels and their lines of code
# --------------------------------------------------------------------------


def kernel_language(obj):
    """ "triton" for a ``@triton.jit`` function (or an autotuned one), "numba" for a
    ``@cuda.jit`` kernel, else None."""
    # JITFunction, or InterpretedFunction under TRITON_INTERPRET=1, or an Autotuner
    if type(obj).__module__.startswith("triton.runtime") and hasattr(obj, "fn"):
        return "triton"
    if hasattr(obj, "py_func") and type(obj).__module__.startswith("numba"):
        return "numba"
    return None


def kernel_function(obj):
    """The Python function a kernel object was made from."""
    while hasattr(obj, "fn") and kernel_language(obj) == "triton":
        obj = obj.fn
    return getattr(obj, "py_func", obj)


def lines_of_code(source):
    """Lines of ``source`` that are neither blank nor only a comment."""
    return sum(
        1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#")
    )


def script_kernels(module):
    """{name: (language, lines of code)} of the kernels a script uses: its own
    (module globals, and the ``.kernels`` of a global that lists them, as chapter 08's
    Version does), and those it reaches as ``alias.name`` in its source through a
    module it imported (``ch05.vector_add_naive``)."""
    found = {}

    def add(name, obj):
        lang = kernel_language(obj)
        if lang and name not in found:
            fn = kernel_function(obj)
            try:
                found[name] = (lang, lines_of_code(inspect.getsource(fn)))
            except (OSError, TypeError):  # source not available (built in a string)
                pass

    for name, obj in vars(module).items():
        add(name, obj)
        listed = getattr(obj, "kernels", None)  # chapter 08's Version lists its kernels
        if isinstance(listed, (list, tuple)):  # (numba.cuda.kernels, on a GPU, is a module)
            for kernel in listed:
                add(getattr(kernel, "py_func", kernel).__name__, kernel)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return found
    for alias, mod in vars(module).items():
        # a chapter's or the capstone's module, not a library (tl.sum is a Triton function)
        if isinstance(mod, types.ModuleType) and not mod.__name__.startswith(LIBRARIES):
            for attr in set(re.findall(rf"\b{re.escape(alias)}\.(\w+)", source)):
                add(attr, getattr(mod, attr, None))
    return found


LIBRARIES = ("triton", "numba", "torch", "numpy")


def _words(text):
    # crude stemming, so that a row's "atomics" names a kernel's "atomic"
    return {w.removesuffix("s") for w in re.findall(r"[a-z0-9]+", text.lower())}


def assign_kernels(rows, kernels):
    """For each row (a Timing) the names of the kernels behind it.

    A row's ``extra["kernel"]`` (a name or a list) says it exactly. Otherwise the row's
    language is its first word ("numba", "triton"); the words that every row of that
    language shares (the version's description) are dropped, and the row gets the
    kernels of its language whose names contain one of its remaining words ("forward",
    "grid-stride" -> vector_add_grid_stride). A row that matches none gets the kernels
    no other such row claimed (all of them if every one is claimed). Rows of other
    languages (torch) get []."""
    shared = {}
    for r in rows:
        if r.extra.get("kernel"):
            continue
        lang = r.name.split()[0].lower()
        words = _words(r.name) - {lang}
        shared[lang] = shared[lang] & words if lang in shared else words
    picked = []
    for r in rows:
        named = r.extra.get("kernel")
        if named:
            picked.append([named] if isinstance(named, str) else list(named))
            continue
        lang = r.name.split()[0].lower()
        words = _words(r.name) - {lang} - shared.get(lang, set())
        pool = [k for k, (kl, _) in kernels.items() if kl == lang]
        picked.append([k for k in pool if _words(k) & words] or None)
    claimed = {k for p, r in zip(picked, rows) if p and not r.extra.get("kernel") for k in p}
    for i, r in enumerate(rows):
        if picked[i] is None:
            lang = r.name.split()[0].lower()
            pool = [k for k, (kl, _) in kernels.items() if kl == lang]
            picked[i] = [k for k in pool if k not in claimed] or pool
    return picked


# --------------------------------------------------------------------------
# The run and the table
# --------------------------------------------------------------------------


def load_script(name):
    """The chapter script ``name`` as a module, or (None, why not)."""
    if not (HERE / f"{name}.py").exists():
        return None, f"{name}.py is not there yet"
    try:
        return import_sibling(__file__, name), None
    except Exception as exc:  # noqa: BLE001  (a sibling being written: note it, go on)
        return None, f"{name}.py does not import: {type(exc).__name__}: {exc}"


def rows_of(script, results, kernels):
    """The table's rows (lists of cells) and JSON records for one script's Timings."""
    rows, records = [], []
    for t, names in zip(results, assign_kernels(results, kernels)):
        loc = None
        if t.extra.get("kernel_source"):  # generated code (inductor's), not a function
            loc = lines_of_code(t.extra["kernel_source"])
        elif names:
            loc = sum(kernels[k][1] for k in names if k in kernels) or None
        if t.tflops is not None:
            rate, frac, kind = f"{t.tflops:.2f} TFLOP/s", t.fraction_of_sgemm_peak, "SGEMM"
        elif t.gbps is not None:
            rate, frac, kind = f"{t.gbps:.0f} GB/s", t.fraction_of_copy_peak, "copy"
        else:
            rate, frac, kind = "-", None, ""
        pct = "-" if frac is None else f"{100 * frac:.0f}% {kind}"
        rows.append(
            [
                script,
                t.name,
                ", ".join(names) or "-",
                "-" if loc is None else str(loc),
                "-" if t.first_call_ms is None else f"{t.first_call_ms:.0f}",
                "-" if t.median_ms is None else f"{t.median_ms:.4g}",
                rate,
                pct,
            ]
        )
        records.append({"script": script, "kernels": names, "loc": loc, **t.as_dict()})
    return rows, records


HEADER = ["script", "version", "kernels", "LOC", "1st call ms", "median ms", "rate", "% peak"]


def summarize(scripts=SCRIPTS, runners=None):
    """Run each script's ``run()`` (``runners``: name -> callable returning Timings, in
    place of the script's own, for tests), print the closing table; returns (rows,
    records, notes)."""
    rows, records, notes = [], [], []
    for name in scripts:
        module, why = load_script(name)
        if module is None:
            notes.append(f"skipped {why}")
            continue
        run = (runners or {}).get(name, getattr(module, "run", None))
        if run is None:
            notes.append(f"skipped {name}.py: it has no run()")
            continue
        print(f"=== {name}.py")
        r, rec = rows_of(name, run(), script_kernels(module))
        rows += r
        records += rec
    title = "chapter 12: every kernel in both languages, one run"
    print(format_table(rows, title, header=HEADER, align="<<<>>>><"))
    for note in notes:
        print(f"  ({note})")
    return rows, records, notes


def main(argv=None):
    parser = script_parser(__doc__, "12_triton")
    parser.add_argument(
        "--only",
        type=comma_names(tuple(SCRIPTS), lambda s: s.strip().removesuffix(".py")),
        default=list(SCRIPTS),
        help=f"comma list of scripts to run (default all: {','.join(SCRIPTS)})",
    )
    args = parser.parse_args(argv)
    triton_env = import_sibling(__file__, "triton_env")
    if triton_env.MISSING:
        print(f"SKIPPED: {triton_env.MISSING}")
        return 0
    _, records, notes = summarize(args.only)
    save_results(records, args.out, "summary", triton=triton_env.VERSION, notes=notes)
    return 0


if __name__ == "__main__":
    run_script(main)
