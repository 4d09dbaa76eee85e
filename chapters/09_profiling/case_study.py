"""Case study: the capstone's batchnorm-backward reduction, profiled and fixed twice.

The kernel: ``bn_relu_maxpool_backward_reduce`` (final_project/fast_layers.py),
the per-block partial sums of dgamma = sum(dy * xhat) and dbeta = sum(dy)
behind a BN -> ReLU -> 2x2 max-pool block. One block per (channel, group of
images); each thread walks the pooled positions j = t, t + 256, ... of its
group, gathers the window winner's z through the argmax, and adds.

The symptom: in the capstone's stage table (batch 1024) the bn1 reduction moved
its bytes far below copy bandwidth, the slowest memory-bound stage of the step.
The README's section 6 gives the figures of each version (times, Nsight Compute's
counters); this header says what each version changes and why.

Version 1, as the capstone had it. Nsight Compute: the SM is busier than
memory ("Compute (SM) Throughput" against "DRAM Throughput") for a kernel that
does one multiply-add per 9 bytes. The instructions are the cause: every
element decodes its flat index j into (image, row, column) with four integer
divisions by sizes known only at run time (``j // plane``, ``j % plane``,
``q // w_out``, ``q % w_out``); a 32-bit integer division is a sequence of
about 20 instructions.

Version 2: decode j once, then step it by the constant BLOCK = dn * plane +
dh * w_out + dw with carries, as the capstone's direct convolution does for its
pixels. Warp instructions and SM throughput fall, the time much less: the
counters now name the next limit. More registers a thread, so lower occupancy,
and warps wait longer on memory ("long scoreboard" stalls): each thread's loop
is a chain, argmax load -> z load (its address depends on the argmax) -> add,
one element at a time.

Version 3: two elements in flight per iteration (both argmax loads, then both
gathers, then the adds, in the same order as before) and ``launch_bounds``
holding registers at 48 (5 blocks of 256 threads an SM). DRAM throughput rises
and the kernel is the fastest of the three at both shapes. The partial sums of
all three versions are bit-identical: same loads, same additions in the same
order. The capstone runs version 3 now.

The script checks every version against a float64 reference and against each
other, times them with CUDA events at the capstone's bn1 and bn2 shapes
(batch 1024; the launches queued behind a sleeping kernel, since each takes
the host about as long as the GPU), and, where ncu is on the PATH, profiles
them (saved/ncu_case_study.csv is that report from the course's GPU run).

Run: python chapters/09_profiling/case_study.py
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import ceil_div, check, import_sibling, is_simulator, pick, random_array
from common.harness import run_script, save_results, script_parser
from common.timing import benchmark, format_table

from functools import partial
from pathlib import Path

import numpy as np
from numba import cuda, float32, float64, int32

from final_project import fast_layers

nsight_compute = import_sibling(__file__, "nsight_compute")

BLOCK = fast_layers.BN_REDUCE_BLOCK
# (N, C, H, W) of the convolution outputs feeding bn1 and bn2 at batch 1024;
# in the simulator, small shapes whose planes neither divide nor fill a block.
SHAPES = pick(
    gpu={"bn1": (1024, 32, 28, 28), "bn2": (1024, 64, 14, 14)},
    simulator={"bn1": (3, 2, 10, 6), "bn2": (5, 3, 4, 4)},
)


# version 1: the capstone's kernel as it was before this case study
def make_bn_backward_reduce_divisions(BLOCK):
    """Block per (channel, group of images): partial sums of dy*xhat and dy,
    each element's flat index decoded with four divisions."""

    @cuda.jit  # not cached: calls fast_layers.tree_sum_pair, whose edits numba's cache does not see
    def bn_relu_maxpool_backward_reduce_divisions(
        dpooled, argmax, z, mean, invstd, scale, shift, images_per_block, partials
    ):
        c = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = cuda.threadIdx.x
        batch = int32(z.shape[0])
        w_out = int32(dpooled.shape[3])
        plane = int32(dpooled.shape[2]) * w_out
        n0 = int32(p) * int32(images_per_block)
        n1 = min(batch, n0 + int32(images_per_block))
        mu = mean[c]
        inv = invstd[c]
        sc = scale[c]
        sh = shift[c]
        a = float32(0.0)
        b = float32(0.0)
        # Only the window winners carry a gradient: walk the pooled grid (a
        # quarter of the conv output) and gather the winner's z.
        for j in range(int32(t), (n1 - n0) * plane, int32(BLOCK)):
            n = n0 + j // plane
            q = j % plane
            ph = q // w_out
            pw = q % w_out
            k = argmax[n, c, ph, pw]
            zv = z[n, c, 2 * ph + k // 2, 2 * pw + k % 2]
            if zv * sc + sh > float32(0.0):  # 0.0 would make it a float64 compare
                g = dpooled[n, c, ph, pw]
                a += g * (zv - mu) * inv
                b += g
        s0 = cuda.shared.array(BLOCK, float64)
        s1 = cuda.shared.array(BLOCK, float64)
        s0[t] = a
        s1[t] = b
        cuda.syncthreads()
        fast_layers.tree_sum_pair(s0, s1, t, BLOCK)
        if t == 0:
            partials[p, 0, c] = s0[0]
            partials[p, 1, c] = s1[0]

    return bn_relu_maxpool_backward_reduce_divisions


before = make_bn_backward_reduce_divisions(BLOCK)


# version 2: the flat index decoded once, then advanced with carries
def make_bn_backward_reduce_carried(BLOCK):
    """Block per (channel, group of images): partial sums of dy*xhat and dy,
    the index j of each thread advanced by BLOCK with carries instead of
    decoded with divisions. Arguments and results as version 1's."""

    @cuda.jit  # not cached: calls fast_layers.tree_sum_pair, whose edits numba's cache does not see
    def bn_relu_maxpool_backward_reduce_carried(
        dpooled, argmax, z, mean, invstd, scale, shift, images_per_block, partials
    ):
        c = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = int32(cuda.threadIdx.x)
        batch = int32(z.shape[0])
        h_out = int32(dpooled.shape[2])
        w_out = int32(dpooled.shape[3])
        plane = h_out * w_out
        n0 = int32(p) * int32(images_per_block)
        n1 = min(batch, n0 + int32(images_per_block))
        total = (n1 - n0) * plane
        mu = mean[c]
        inv = invstd[c]
        sc = scale[c]
        sh = shift[c]
        # BLOCK = dn images + dh rows + dw columns of the pooled grid: the step
        # every thread takes, split once per block (4 divisions in all).
        dn = int32(BLOCK) // plane
        dq = int32(BLOCK) - dn * plane
        dh = dq // w_out
        dw = dq - dh * w_out
        # This thread's first element, decoded once.
        n = n0 + t // plane
        q = t - (t // plane) * plane
        ph = q // w_out
        pw = q - ph * w_out
        a = float32(0.0)
        b = float32(0.0)
        j = t
        while j < total:
            k = argmax[n, c, ph, pw]
            zv = z[n, c, 2 * ph + (k >> 1), 2 * pw + (k & 1)]
            if zv * sc + sh > float32(0.0):  # 0.0 would make it a float64 compare
                g = dpooled[n, c, ph, pw]
                a += g * (zv - mu) * inv
                b += g
            j += int32(BLOCK)
            n += dn
            ph += dh
            pw += dw
            if pw >= w_out:  # dw < w_out and pw < w_out: at most one carry
                pw -= w_out
                ph += 1
            if ph >= h_out:
                ph -= h_out
                n += 1
        s0 = cuda.shared.array(BLOCK, float64)
        s1 = cuda.shared.array(BLOCK, float64)
        s0[t] = a
        s1[t] = b
        cuda.syncthreads()
        fast_layers.tree_sum_pair(s0, s1, t, BLOCK)
        if t == 0:
            partials[p, 0, c] = s0[0]
            partials[p, 1, c] = s1[0]

    return bn_relu_maxpool_backward_reduce_carried


after = make_bn_backward_reduce_carried(BLOCK)


# version 3: version 2 with two elements in flight per thread and at most 48
# registers (5 blocks of 256 threads an SM): what the capstone runs now
# (final_project/fast_layers.py, make_bn_backward_reduce).
in_flight = fast_layers.bn_relu_maxpool_backward_reduce_kernel
VERSIONS = {"v1 divisions": before, "v2 carries": after, "v3 two in flight": in_flight}


class Inputs:
    """A BN -> ReLU -> pool block's backward inputs at z shape (N, C, H, W):
    random z, mean, invstd, scale, shift; argmax and pooled from the
    capstone's own forward kernel; random dpooled. ``partials`` (P, 2, C)
    float64 for the kernels to fill, ``images_per_block`` as the capstone picks it."""

    def __init__(self, shape, rng):
        n, c, h, w = shape
        self.shape = shape
        self.host = {
            "z": random_array((n, c, h, w), np.float32, rng),
            "mean": random_array((c,), np.float32, rng) * np.float32(0.1),
            "invstd": (rng.random(c, dtype=np.float32) + np.float32(0.5)),
            "dpooled": random_array((n, c, h // 2, w // 2), np.float32, rng),
        }
        # Every channel gets one window whose ReLU is surely open (z - mean >= 2.9,
        # scale >= 0.25, |shift| small), so no channel's sums are zero by chance:
        # a one-window plane would otherwise close with probability about 1/16.
        self.host["z"][0, :, 0, 0] = np.float32(3.0)
        gamma = rng.random(c, dtype=np.float32) + np.float32(0.5)
        beta = random_array((c,), np.float32, rng) * np.float32(0.1)
        self.host["scale"] = gamma * self.host["invstd"]
        self.host["shift"] = beta - self.host["mean"] * self.host["scale"]
        self.dev = {k: cuda.to_device(v) for k, v in self.host.items()}
        self.dev["argmax"] = cuda.device_array((n, c, h // 2, w // 2), np.int8)
        pooled = cuda.device_array((n, c, h // 2, w // 2), np.float32)
        fast_layers.bn_relu_maxpool_forward(
            self.dev["z"], self.dev["scale"], self.dev["shift"], pooled, self.dev["argmax"]
        )
        self.host["argmax"] = self.dev["argmax"].copy_to_host()
        self.images_per_block = fast_layers.bn_backward_images_per_block(n, h // 2, w // 2)
        rows = fast_layers.bn_backward_partial_rows(n, h // 2, w // 2)
        self.partials = cuda.to_device(np.full((rows, 2, c), np.nan))

    def launch(self, kernel) -> None:
        n, c = self.shape[:2]
        d = self.dev
        kernel[(c, ceil_div(n, self.images_per_block)), BLOCK](
            d["dpooled"],
            d["argmax"],
            d["z"],
            d["mean"],
            d["invstd"],
            d["scale"],
            d["shift"],
            self.images_per_block,
            self.partials,
        )

    def reference(self) -> np.ndarray:
        """(2, C) float64: sum over the batch of dy*xhat and of dy, per channel."""
        h = {k: v.astype(np.float64) for k, v in self.host.items() if k != "argmax"}
        n, c, hh, ww = self.shape
        k = self.host["argmax"].astype(np.int64)
        ni, ci, ph, pw = np.indices(k.shape)
        zv = h["z"][ni, ci, 2 * ph + k // 2, 2 * pw + k % 2]
        sc, sh = h["scale"][None, :, None, None], h["shift"][None, :, None, None]
        open_ = zv * sc + sh > 0
        g = np.where(open_, h["dpooled"], 0.0)
        xhat = (zv - h["mean"][None, :, None, None]) * h["invstd"][None, :, None, None]
        return np.stack([(g * xhat).sum(axis=(0, 2, 3)), g.sum(axis=(0, 2, 3))])

    def result(self) -> np.ndarray:
        return self.partials.copy_to_host().sum(axis=0)

    def nbytes(self) -> int:
        """Fewest bytes: dpooled (4) and argmax (1) of every window, the winner's z (4)."""
        n, c, h, w = self.shape
        return n * c * (h // 2) * (w // 2) * 9


def check_versions(inputs: Inputs) -> dict[str, np.ndarray]:
    """Every version against the float64 reference; their partials must be
    bit-identical (same loads, same order of additions).

    Returns {version name: its partial sums, float64 (P, 2, C)}. Raises
    common.CheckError for a version off the reference, AssertionError for
    partials that differ from version 1's."""
    ref = inputs.reference()
    got = {}
    for name, kernel in VERSIONS.items():
        inputs.partials.copy_to_device(np.full(inputs.partials.shape, np.nan))
        inputs.launch(kernel)
        check(inputs.result(), ref, tol=1e-5, name=f"{name} at {inputs.shape}")
        got[name] = inputs.partials.copy_to_host()
    for name, partials in got.items():
        if not np.array_equal(partials, got["v1 divisions"]):
            raise AssertionError(f"{name}'s partial sums differ from version 1's: not the same sum")
    return got


def run_target(rng) -> None:
    """What ncu wraps: both versions at each shape, once each, in the profiled range."""
    cases = [Inputs(shape, rng) for shape in SHAPES.values()]
    for inputs in cases:
        check_versions(inputs)
    cuda.synchronize()
    cuda.profile_start()
    for inputs in cases:
        for kernel in VERSIONS.values():
            inputs.launch(kernel)
    cuda.synchronize()
    cuda.profile_stop()


def main(argv=None) -> int:
    parser = script_parser(__doc__, "09_profiling")
    parser.add_argument(
        "--target", action="store_true", help="(what ncu runs) launch each version once"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.target:
        run_target(rng)
        return 0
    timings = []
    for layer, shape in SHAPES.items():
        inputs = Inputs(shape, rng)
        check_versions(inputs)
        print(
            f"{layer} {shape}: every version matches the float64 reference, bit-identical partials"
        )
        for name, kernel in VERSIONS.items():
            timings.append(
                benchmark(
                    partial(inputs.launch, kernel),
                    f"{layer} {name}",
                    nbytes=inputs.nbytes(),
                    repeats=200,
                    # A launch with 9 arguments costs the host about as long as
                    # the kernel runs: queue all 200 behind a sleeping kernel so
                    # the events time the GPU, not Python.
                    hold_ms=100,
                )
            )
    if not is_simulator():
        print(format_table(timings, f"bn backward reduce, {common.runtime.device_name()}"))
        for layer in SHAPES:
            v = [t for t in timings if t.name.startswith(layer)]
            print(
                f"{layer}: "
                + " -> ".join(f"{t.median_ms * 1e3:.1f} us" for t in v)
                + f" ({v[0].median_ms / v[-1].median_ms:.2f}x)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    text, source = nsight_compute.profile_or_saved(
        args.out / "ncu_case_study.csv", [str(Path(__file__).resolve()), "--target"]
    )
    kernels = nsight_compute.parse_ncu_csv(text)
    rows = [nsight_compute.summary(k) for k in kernels]
    labels = [f"{layer} {v.split()[0]}" for layer in SHAPES for v in VERSIONS]
    if len(kernels) != len(labels):
        raise ValueError(
            f"{source} profiles {len(kernels)} launches, expected {len(labels)} "
            f"({', '.join(labels)}): rerun this script on a GPU to remake it"
        )
    for label, k, r in zip(labels, kernels, rows):
        r["kernel"] = f"{label} {k.name}"
    print(nsight_compute.format_summary(rows, f"\nNsight Compute, from {source}:"))
    cells = [
        [
            r["kernel"],
            f"{k.value('Compute (SM) Throughput'):.1f}",
            f"{r['dram_pct']:.1f}",
            f"{k.value('smsp__inst_executed.sum'):,.0f}",
        ]
        for k, r in zip(kernels, rows)
    ]
    header = ["kernel", "SM %", "DRAM %", "warp instructions"]
    print(format_table(cells, header=header, align="<>>>"))
    save_results(timings, args.out, "case_study")
    return 0


if __name__ == "__main__":
    run_script(main)
