"""Host <-> device transfers vs compute: at which size does the GPU start to win?

For growing n we time, for two operations:
  CPU   : NumPy on the host
  H2D   : copying the inputs to the device (cuda.to_device into a preallocated array)
  kernel: the kernel alone (CUDA events)
  D2H   : copying the result back (copy_to_host)
The GPU wins a one-off call only when H2D + kernel + D2H < CPU.

operation 1 vector_add: 1 FLOP per 12 bytes; the copies (over PCIe/NVLink-C2C) always lose to NumPy
operation 2 poly_eval: POLY_ITERS FMAs an element; enough work per byte for the GPU to win

Writes transfer_vs_compute.json and transfer_vs_compute.png (time vs n, log-log) to --out.

Run: python chapters/04_gpu_intro/transfer_vs_compute.py [--out runs/04_gpu_intro]
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, load_chapter_module, pick
from common.checking import check
from common.harness import run_script, script_parser
from common.timing import REPO_ROOT, SIMULATOR_NOTE, benchmark, cpu_ms, readme_figures

import json
from functools import partial
from pathlib import Path

import numpy as np
from numba import cuda

POLY_ITERS = 64
MUL, ADD = np.float32(0.999), np.float32(0.001)

# 2 loads, 1 add, 1 store an element: chapter 5's first kernel, one thread an element.
vector_add = load_chapter_module("05_first_kernels", "vector_add").vector_add_naive


# POLY_ITERS FMAs an element on two loads and one store: 10.7 FLOP/byte. It takes the
# same inputs as vector_add (a, b) so that both operations copy the same bytes.
@cuda.jit(cache=True)
def poly_eval(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        v = a[i]
        for _ in range(POLY_ITERS):
            v = v * MUL + ADD
        out[i] = v + b[i]


def poly_eval_numpy(a, b):
    v = a.copy()
    for _ in range(POLY_ITERS):
        v *= MUL
        v += ADD
    return v + b


OPERATIONS = {
    "vector_add": (vector_add, np.add),
    "poly_eval": (poly_eval, poly_eval_numpy),
}


def measure(op, n, rng):
    """Check the kernel for op at size n against NumPy in float64.

    Returns (relative error, a row of ms); the row is None in the simulator.
    """
    kernel, cpu_fn = OPERATIONS[op]
    a_host = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b_host = rng.uniform(0.5, 1.5, n).astype(np.float32)
    a, b = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    out = cuda.device_array(n, np.float32)
    out_host = np.empty(n, np.float32)
    grid, threads = ceil_div(n, 256), 256

    def h2d():
        cuda.to_device(a_host, to=a)
        cuda.to_device(b_host, to=b)

    h2d()
    kernel[grid, threads](a, b, out)
    out.copy_to_host(out_host)
    err = check(
        out_host,
        cpu_fn(a_host.astype(np.float64), b_host.astype(np.float64)),
        tol=1e-5,
        name=f"{op} n={n}",
    )
    t_h2d = benchmark(h2d, "H2D", repeats=5)
    t_kernel = benchmark(partial(kernel[grid, threads], a, b, out), "kernel", repeats=10)
    t_d2h = benchmark(partial(out.copy_to_host, out_host), "D2H", repeats=5)
    if not t_kernel.measured:
        return err, None
    return err, {
        "op": op,
        "n": n,
        "cpu_ms": cpu_ms(partial(cpu_fn, a_host, b_host)),
        "h2d_ms": t_h2d.median_ms,
        "kernel_ms": t_kernel.median_ms,
        "d2h_ms": t_d2h.median_ms,
    }


def crossover(rows):
    """Smallest n where H2D + kernel + D2H beats the CPU, or None."""
    for r in rows:
        if r["h2d_ms"] + r["kernel_ms"] + r["d2h_ms"] < r["cpu_ms"]:
            return r["n"]
    return None


def plot(rows, path):
    """Log-log plot of CPU, GPU-with-transfers and kernel-only time vs n, one panel an op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rs = [r for r in rows if r["op"] == op]
        n = [r["n"] for r in rs]
        ax.loglog(n, [r["cpu_ms"] for r in rs], "o-", label="CPU (NumPy)")
        ax.loglog(
            n,
            [r["h2d_ms"] + r["kernel_ms"] + r["d2h_ms"] for r in rs],
            "s-",
            label="GPU: copy in + kernel + copy out",
        )
        ax.loglog(n, [r["kernel_ms"] for r in rs], "^--", label="GPU: kernel only")
        ax.loglog(n, [r["h2d_ms"] + r["d2h_ms"] for r in rs], ":", label="GPU: copies only")
        ax.set_title(op)
        ax.set_xlabel("elements n (float32)")
        ax.set_ylabel("time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = script_parser(__doc__, "04_gpu_intro").parse_args(argv)
    sizes = pick(gpu=[1 << k for k in range(10, 25, 2)], simulator=[1, 100, 300])
    rng = np.random.default_rng(0)
    rows = []
    for op in OPERATIONS:
        errors = []
        for n in sizes:
            err, row = measure(op, n, rng)
            errors.append(err)
            if row is not None:
                rows.append(row)
        print(
            f"{op}: kernel checked against NumPy in float64 at n = "
            f"{', '.join(f'{n:,}' for n in sizes)}: rel. error <= {max(errors):.2g} "
            "(tolerance 1e-5)"
        )
    if not rows:
        print(f"({SIMULATOR_NOTE}, so no plot)")
        print(readme_figures(__file__).format())
        plot_file = Path(__file__).resolve().with_name("transfer_vs_compute_h100.png")
        print(f"  the plot of that run: {plot_file.relative_to(REPO_ROOT)}")
        return 0
    print(f"  {'op':<11} {'n':>12} {'CPU ms':>9} {'H2D ms':>9} {'kernel ms':>10} {'D2H ms':>9}")
    for r in rows:
        print(
            f"  {r['op']:<11} {r['n']:>12,} {r['cpu_ms']:9.3f} {r['h2d_ms']:9.3f} "
            f"{r['kernel_ms']:10.4f} {r['d2h_ms']:9.3f}"
        )
    for op in OPERATIONS:
        n = crossover([r for r in rows if r["op"] == op])
        print(
            f"  {op}: the GPU, transfers included, wins from n = "
            + (f"{n:,}" if n else "never (in this range)")
        )
    # One row an (operation, n), not one timing a version: written as it is.
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer_vs_compute.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "transfer_vs_compute.png")
    print(f"wrote {args.out / 'transfer_vs_compute.json'} and transfer_vs_compute.png")
    return 0


if __name__ == "__main__":
    run_script(main)
