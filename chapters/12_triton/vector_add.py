"""Vector add, out[i] = a[i] + b[i] (float32), in Numba and in Triton, and what each compiler made.

Versions:
  numba (one thread an element): chapter 05's vector_add_naive, `if i < n` in every thread.
  numba (grid-stride): chapter 05's vector_add_grid_stride, a few blocks per SM loop over n.
  triton (masked block): add_kernel, one *program* a block of BLOCK elements:
      offsets = pid * BLOCK + tl.arange(0, BLOCK) is a vector, `mask = offsets < n`
      replaces the bounds check, and the compiler decides how the block's threads
      share the vector (no threadIdx, no syncthreads, no shared memory declared).
  torch eager (a + b): torch's own elementwise kernel, the baseline.

Every version reads a and b and writes out: 12 bytes an element, 1 FLOP, so the speed
of light is memory bandwidth; GB/s is reported as a fraction of a device-to-device copy.
compiled_code() shows the difference at the instruction level (GPU only): Triton's PTX
loads 4 floats an instruction (ld.global.v4.b32: 128-bit), Numba's loads one
(ld.global.f32).

This file also holds the chapter's two helpers its siblings import: require_tensor (the
input checks of a Triton launcher) and check_then_time (run_versions for torch outputs).

Run: python chapters/12_triton/vector_add.py [--out DIR]
Without a GPU, Numba runs in its simulator and Triton in its interpreter, at tiny sizes,
nothing timed.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator, pick
from common.checking import check, poison_value, require_device_array
from common.harness import run_script, save_results, script_parser
from common.internal.exercises import import_sibling, load_chapter_module
from common.runtime import sm_count
from common.timing import Timing, benchmark, device_peaks, format_table, timed_call

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

triton_env = import_sibling(__file__, "triton_env")
triton, tl = triton_env.triton, triton_env.tl
bridge = load_chapter_module("10_pytorch_extensions", "bridge")
ch05 = load_chapter_module("05_first_kernels", "vector_add")

import torch  # noqa: E402  (after triton_env, which sets TRITON_INTERPRET first)

BLOCK = 1024  # elements a Triton program; 4 warps x 32 threads x 4 floats x 2 (vectorised)


# ---------------------------------------------------------------- helpers of the chapter


def require_tensor(t: Any, name: str, ndim: int, dtype: torch.dtype = torch.float32) -> None:
    """Raise before a Triton launch unless ``t`` is a contiguous ``ndim``-D torch tensor
    of ``dtype`` on the device Triton runs on (CUDA, or the CPU in the interpreter).

    A Triton kernel takes a pointer and trusts it: a wrong dtype reinterprets bytes, a
    non-contiguous tensor is read as if it were contiguous, a CPU pointer on a GPU is
    an illegal address. None of them fails by itself, so the launcher checks.

    Raises:
        TypeError: not a torch tensor (a NumPy array: torch.from_numpy(...).to(device)),
            or the wrong dtype.
        ValueError: the wrong rank, not contiguous, or on the wrong device.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype} ({name}.to({dtype}))")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
        )
    want = bridge.device().type
    if t.device.type != want:
        raise ValueError(
            f"{name} is on {t.device}, Triton runs on {want} here: move it with {name}.to('{want}')"
        )


def as_numba(a: Any, name: str, ndim: int) -> Any:
    """A float32 Numba device array for a Numba launcher: a torch tensor is viewed
    without a copy (bridge.numba_view: contiguous, on the right device); a Numba
    device array passes; a NumPy array raises TypeError (copy it to the GPU first)."""
    if isinstance(a, torch.Tensor):
        a = bridge.numba_view(a.detach(), name, dtype=torch.float32)
    return require_device_array(a, name, ndim=ndim, dtype=np.float32)


# Calls are queued behind a GPU-side hold of this many ms (common.timing.hold_stream),
# so a call shorter than its launch from Python (Triton's launcher, torch.compile's
# guards: tens of microseconds) is timed as GPU time, not as the host's launch cost.
HOLD_MS = 50


def check_then_time(
    versions: Mapping[str, Callable[..., Any]],
    args: Sequence[Any],
    reference: Any,
    out_shape: Sequence[int],
    *,
    tol: float,
    nbytes: int,
    title: str,
    peaks: dict[str, Any] | None = None,
    repeats: int = 20,
) -> list[Timing]:
    """common.harness.run_versions with torch outputs: each ``launcher(*args, out)``
    writes a freshly NaN-poisoned float32 tensor ``out``, is checked against the float64
    ``reference`` (check: relative error <= ``tol``), then timed (benchmark, GB/s from
    ``nbytes``). A torch output is the one every version can write: Triton and torch
    take it as it is, Numba through a zero-copy view. Raises CheckError; prints the
    table and returns one Timing a version, its ``first_call_ms`` the checked call's
    (the version's first at this shape: compile included where the shape needs one)."""
    results = []
    for name, launcher in versions.items():
        out = torch.full(tuple(out_shape), poison_value(np.float32), device=bridge.device())
        _, first_ms = timed_call(partial(launcher, *args, out))  # compiles, where it does
        err = check(out, reference, tol=tol, name=name)
        t = benchmark(
            partial(launcher, *args, out),
            name,
            nbytes=nbytes,
            repeats=repeats,
            peaks=peaks,
            first_call_ms=first_ms,
            hold_ms=HOLD_MS,
        )
        t.extra["rel_error"] = err
        results.append(t)
    print(format_table(results, title=title))
    return results


# ---------------------------------------------------------------- float64 reference


def vector_add_reference(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """a + b in float64 on the host: exact for float32 inputs."""
    return a.cpu().double().numpy() + b.cpu().double().numpy()


# ---------------------------------------------------------------- kernels

# The Numba kernels are chapter 05's (ch05.vector_add_naive, ch05.vector_add_grid_stride).


# triton: one program a BLOCK of elements; every line works on a BLOCK-long vector.
# 2 masked vector loads, 1 add, 1 masked vector store; the last program's mask is
# partly False, every other program's all True.
if triton is not None:

    @triton.jit
    def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n  # the `if i < n` of every thread, as one vector
        a = tl.load(a_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, a + b, mask=mask)


# ---------------------------------------------------------------- launchers


def _same_shape(a, b, out) -> None:
    if not tuple(a.shape) == tuple(b.shape) == tuple(out.shape):
        raise ValueError(
            f"a, b, out must have one shape, got {tuple(a.shape)}, {tuple(b.shape)}, {tuple(out.shape)}"
        )


def add_numba(a, b, out, threads_per_block: int = 256) -> None:
    """out = a + b with chapter 05's one-thread-an-element kernel.

    a, b, out: float32 (n,) torch tensors (on the GPU; the CPU in the simulator) or
    Numba device arrays. Raises TypeError (host NumPy array, wrong dtype) or
    ValueError (rank, shape, non-contiguous, wrong device) before the launch.
    """
    a, b, out = as_numba(a, "a", 1), as_numba(b, "b", 1), as_numba(out, "out", 1)
    ch05.add_naive(a, b, out, threads_per_block)


def add_numba_grid_stride(a, b, out, threads_per_block: int = 256) -> None:
    """out = a + b with chapter 05's grid-stride kernel, 4 blocks an SM; as :func:`add_numba`."""
    a, b, out = as_numba(a, "a", 1), as_numba(b, "b", 1), as_numba(out, "out", 1)
    ch05.add_grid_stride(a, b, out, 4 * sm_count(), threads_per_block)


def add_triton(a, b, out, block: int = BLOCK) -> Any:
    """out = a + b with :func:`add_kernel`: cdiv(n, block) programs of ``block`` elements.

    a, b, out: float32 (n,) contiguous torch tensors on the GPU (the CPU in the
    interpreter). Returns what the launch returns (the compiled kernel on a GPU).
    Raises TypeError / ValueError (require_tensor) before the launch.
    """
    triton_env.require()
    for t, name in ((a, "a"), (b, "b"), (out, "out")):
        require_tensor(t, name, 1)
    _same_shape(a, b, out)
    n = out.numel()
    return add_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block)


def add_torch(a, b, out) -> None:
    """out = a + b, torch's elementwise kernel (eager)."""
    torch.add(a, b, out=out)


# ---------------------------------------------------------------- what the compilers made


def compiled_code(n: int = 1 << 20) -> dict[str, str] | None:
    """The code each compiler generated for vector add, as text (GPU only).

    Returns ``{"triton ptx", "triton ttgir", "numba ptx"}``: Triton's PTX and its GPU
    dialect of MLIR (TTGIR: the ``#blocked`` layout says how many elements each thread
    holds, ``sizePerThread = [4]`` for vector loads) from the CompiledKernel a launch
    returns (``compiled.asm["ptx"]``, ``compiled.asm["ttgir"]``, the same keys in
    Triton 3.6 and 3.9), and Numba's PTX of chapter 05's kernel
    (``kernel.inspect_asm()``, by signature). None in the simulator / interpreter:
    there is no compiler there, the kernels run as Python.
    """
    if is_simulator() or triton_env.INTERPRETED:
        return None
    a = torch.ones(n, device="cuda")
    out = torch.empty_like(a)
    compiled = add_triton(a, a, out)
    add_numba(a, a, out)
    (numba_ptx,) = ch05.vector_add_naive.inspect_asm().values()
    return {
        "triton ptx": compiled.asm["ptx"],
        "triton ttgir": compiled.asm["ttgir"],
        "numba ptx": numba_ptx,
    }


def excerpt(text: str, words: Sequence[str], limit: int = 6) -> list[str]:
    """The first ``limit`` lines of ``text`` that contain any of ``words``, stripped."""
    hits = [line.strip() for line in text.splitlines() if any(w in line for w in words)]
    return hits[:limit]


# ---------------------------------------------------------------- check, then time


def run(n: int | None = None) -> list[Timing]:
    """Check every version against float64 on n elements (default 2**26 on a GPU, an
    irregular 1024 + 53 without one), then time it; returns the Timings (named
    "numba ...", "triton ...", "torch eager ...")."""
    n = n or pick(gpu=1 << 26, simulator=1077)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, generator=gen).to(bridge.device())
    b = torch.randn(n, generator=gen).to(bridge.device())
    versions = {
        "numba (thread an element)": add_numba,
        "numba (grid-stride)": add_numba_grid_stride,
    }
    if triton is not None:
        versions["triton (masked block)"] = add_triton
    versions["torch eager (a + b)"] = add_torch
    return check_then_time(
        versions,
        (a, b),
        vector_add_reference(a, b),
        (n,),
        tol=1e-7,  # one rounding an element: ||error|| <= eps32 / 2 ||ref||
        nbytes=3 * 4 * n,  # read a, read b, write out
        title=f"vector add, n = {n} float32 ({12 * n / 1e6:.3g} MB moved)",
        peaks=device_peaks(),
    )


def main(argv=None) -> int:
    parser = script_parser(__doc__, "12_triton")
    args = parser.parse_args(argv)
    if triton_env.MISSING:
        print(triton_env.MISSING)
        return 0
    results = run()
    save_results(results, args.out, "vector_add", triton=triton_env.VERSION)
    code = compiled_code()
    if code is None:
        print(
            "compiled code: needs a GPU (the simulator and Triton's interpreter run the "
            "kernels as Python; nothing is compiled to PTX)"
        )
        return 0
    loads = ("ld.global", "st.global")
    for what, words in (
        ("triton ptx", loads),
        ("triton ttgir", ("#blocked", "tt.load", "tt.store")),
        ("numba ptx", loads),
    ):
        print(f"{what} ({len(code[what].splitlines())} lines), loads and stores:")
        print("\n".join(f"  {line}" for line in excerpt(code[what], words)))
    return 0


if __name__ == "__main__":
    run_script(main)
