"""Row softmax of a float32 (M, N) matrix in Numba, in Triton and in torch, checked and timed.

Versions:
  numba (block a row, row in registers): chapter 06's best version
      (softmax_block_row_registers; rows over 4096 columns fall back to its online
      version): 256 threads a row, 16 values a thread, barrier trees for max and sum.
  triton (row a program): softmax_kernel, Triton's fused softmax (tutorial 02): one
      program a row, the whole row one vector of BLOCK = next power of two >= N,
      padded with -inf by the load's mask (exp(-inf) = 0: the padding adds nothing
      to the sum). tl.max and tl.sum are the block reductions chapter 06 wrote by hand.
  torch eager: torch's softmax kernel (aten._softmax.out, writing into our output).
  torch.compile: Inductor's generated Triton kernel for out.copy_(torch.softmax(x)).

Each reads x once and writes out once: GB/s counts 2 * M * N * 4 bytes. The naive
torch composite (x.max, x - max, exp, sum, divide) would read M N and write M N five
times over; every version here is fused into one pass.

Run: python chapters/12_triton/softmax.py [--out DIR]
Without a GPU, Numba runs in its simulator and Triton in its interpreter, at tiny sizes,
nothing timed; torch.compile needs a GPU and is left out there.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator, pick
from common.checking import rounding_tolerance
from common.harness import run_script, save_results, script_parser
from common.internal.exercises import import_sibling, load_chapter_module
from common.timing import Timing, device_peaks

import numpy as np

vector_add = import_sibling(__file__, "vector_add")  # the chapter's launch checks and harness
triton_env = vector_add.triton_env
triton, tl = triton_env.triton, triton_env.tl
bridge = vector_add.bridge
ch06 = load_chapter_module("06_memory", "softmax")

import torch  # noqa: E402  (after triton_env, which sets TRITON_INTERPRET first)

MAX_COLS = 32768  # a Triton program holds its row in registers: 128 KiB a row at most
# (irregular shape for the check, as tutorial 02; then shapes of 128 MiB with N growing)
SHAPES = pick(
    gpu=[(1823, 781), (32768, 1024), (8192, 4096), (2048, 16384)],
    simulator=[(3, 37), (1, 130)],
)


def softmax_reference(x: torch.Tensor) -> np.ndarray:
    """Row softmax in float64 on the host (chapter 06's softmax_cpu)."""
    return ch06.softmax_cpu(x.cpu().numpy())


def softmax_tolerance(x: torch.Tensor, ref: np.ndarray) -> float:
    """rounding_tolerance for a float32 softmax: x - max rounds by eps32 (|x| + |max|),
    which exp turns into that relative error of out; exp, the sum and the divide add a
    few roundings more (4 counted). A wrong or missing column errs by O(out) and fails."""
    z = np.abs(x.cpu().numpy().astype(np.float64))
    magnitude = ref * (z + z.max(axis=1, keepdims=True) + 1.0)
    return rounding_tolerance(ref, magnitude, roundings=4, tol=1e-5)


# ---------------------------------------------------------------- kernels

# numba: ch06.softmax_block_row_registers (see chapters/06_memory/softmax.py)

if triton is not None:
    # triton: one program a row; the row is one vector: read N floats, write N floats.
    @triton.jit
    def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * n_cols overflows int32 past 2**31
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf"))
        z = x - tl.max(x, axis=0)  # a reduction over the program's vector: no barrier to write
        num = tl.exp(z)
        den = tl.sum(num, axis=0)
        tl.store(out_ptr + row * n_cols + cols, num / den, mask=mask)


# ---------------------------------------------------------------- launchers


def _same_shape(x, out) -> None:
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")


def softmax_numba(x, out) -> None:
    """Row softmax of ``x`` float32 (M, N) into ``out`` (M, N) with chapter 06's version 4.

    x, out: torch tensors (GPU; CPU in the simulator) or Numba device arrays.
    Raises TypeError (NumPy host array, wrong dtype) or ValueError (rank, shape,
    non-contiguous, wrong device) before the launch.
    """
    x, out = vector_add.as_numba(x, "x", 2), vector_add.as_numba(out, "out", 2)
    ch06.softmax(ch06.softmax_block_row_registers, x, out)


def softmax_triton(x, out) -> None:
    """Row softmax of ``x`` float32 (M, N) into ``out`` with :func:`softmax_kernel`: M
    programs of BLOCK = next_power_of_2(N) lanes, 4 warps (8 from 2048 columns, 16
    from 8192, as tutorial 02 chooses), so each thread holds at most 16 values.

    x, out: contiguous float32 torch tensors on the GPU (CPU in the interpreter).
    Raises TypeError / ValueError (vector_add.require_tensor), or ValueError for
    N > MAX_COLS, before the launch.
    """
    triton_env.require()
    vector_add.require_tensor(x, "x", 2)
    vector_add.require_tensor(out, "out", 2)
    _same_shape(x, out)
    rows, cols = x.shape
    if cols > MAX_COLS:
        raise ValueError(f"rows of {cols} > {MAX_COLS} columns do not fit one program")
    block = triton.next_power_of_2(cols)
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
    softmax_kernel[(rows,)](x, out, cols, BLOCK=block, num_warps=num_warps)


def softmax_torch(x, out) -> None:
    """torch's eager softmax kernel over dim 1, writing ``out`` (the out= form of
    torch.softmax, so no copy is timed)."""
    torch.ops.aten._softmax.out(x, 1, False, out=out)


def softmax_into(x, out) -> None:
    """out = softmax(x, dim=1): what torch.compile compiles (Inductor writes ``out``
    from its fused kernel; eager it would be a softmax then a copy)."""
    out.copy_(torch.softmax(x, dim=1))


# ---------------------------------------------------------------- check, then time


def run(shapes=None) -> list[Timing]:
    """Check every version against float64 at each (M, N) of ``shapes`` (default
    SHAPES: 1823 x 781 first, then 128 MiB matrices with N from 1024 to 16384), then
    time it. Returns the Timings, named "numba ...", "triton ...", "torch eager ...",
    "torch.compile ..." and the shape."""
    gen = torch.Generator().manual_seed(0)
    versions = {"numba (block a row, row in registers)": softmax_numba}
    if triton is not None:
        versions["triton (row a program)"] = softmax_triton
    versions["torch eager"] = softmax_torch
    if not is_simulator():
        versions["torch.compile"] = torch.compile(softmax_into, dynamic=False)
    peaks = device_peaks()
    results = []
    for rows, cols in shapes or SHAPES:
        x = (16 * torch.rand(rows, cols, generator=gen) - 8).to(bridge.device())
        ref = softmax_reference(x)
        results += vector_add.check_then_time(
            {f"{name} {rows}x{cols}": fn for name, fn in versions.items()},
            (x,),
            ref,
            (rows, cols),
            tol=softmax_tolerance(x, ref),
            nbytes=2 * rows * cols * 4,  # read x once, write out once
            title=f"softmax {rows} x {cols} float32",
            peaks=peaks,
        )
    return results


def main(argv=None) -> int:
    args = script_parser(__doc__, "12_triton").parse_args(argv)
    if triton_env.MISSING:
        print(triton_env.MISSING)
        return 0
    if is_simulator():
        print("torch.compile: needs a GPU (Inductor generates Triton for CUDA); left out here")
    save_results(run(), args.out, "softmax", triton=triton_env.VERSION)
    return 0


if __name__ == "__main__":
    run_script(main)
