"""The simulator made strict: the checks a GPU makes and Numba's simulator does not.

Course machinery: nothing here is needed to follow the course. ``common`` calls
:func:`install` once, after all its modules are loaded, when the simulator is the
runtime. It patches the simulator's private kernel and API classes (numba-cuda
0.30.x; the range is pinned in pyproject.toml and checked by
``tests/test_internal_pin.py``):

* launch limits: at most 1024 threads per block (64 in z) and 48 KiB of static
  shared memory per block (CUDA C++ Programming Guide, "Technical
  Specifications per Compute Capability"), so a kernel that passes here also
  launches on a learner's GPU (:func:`check_launch`);
* compile-time constant shapes for ``cuda.shared.array`` and
  ``cuda.local.array``, judged from the source (AST) and, inside a device
  function, at its call site (:func:`check_constant_shape`);
* every launch goes through the race detector (:mod:`.racecheck`);
* barriers as a GPU needs them: every thread of a block that has not returned
  reaches the same ``cuda.syncthreads()`` (:class:`BarrierError`, from the
  block runners below; under ``common.runtime.interleaved_threads`` the
  simulator's own runner is used and this is not checked);
* launch configurations judged by Numba's own ``normalize_kernel_dimensions``
  first, so a bad one fails in Numba's words, then the course's hint; an empty
  ``forall`` launches nothing, as in Numba;
* speed: a block whose kernel has no barrier runs its threads one after another
  in one Python thread; a block with barriers runs them in turns in one Python
  thread too, the kernel rewritten as a generator that yields at each barrier
  (:func:`_run_in_turns`), or, where its source cannot be read, on one thread
  per CUDA thread meeting at a condition variable instead of the simulator's
  busy loop; ``common.runtime.interleaved_threads`` switches threads every
  microsecond where a demo wants the old behaviour; a cast in a kernel
  (``float32(x)``, a call of Numba's type object) skips the import and ABC check
  Numba's ``Type.__call__`` makes on every call (:func:`_install_fast_scalar_casts`);
  ``numba.cuda.random``'s host-side state set-up runs on Python ints instead of
  being compiled in object mode in every process (:func:`_install_fast_rng_states`);
  ``a.shape`` and ``a.size`` inside a kernel are properties instead of a failed
  lookup and two ``__getattr__`` hops (:func:`_install_fast_array_shapes`);
* warp-collective calls (the tensor cores' ``mma.sync``, ``common.tensor_cores``):
  a kernel that makes one runs in turns, and the call is a yield point where
  the 32 lanes of a warp meet; the runner then computes all of them at once,
  and a call reached by only part of a warp is an error (:func:`_partial_warp`).
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import linecache
import numbers
import os
import sys
import threading
import types
from typing import Any

import numpy as np

from ..errors import BarrierError, LaunchConfigError  # raised here; importable from here too
from ..runtime import (  # the GPU's limits, which learners use too
    MAX_BLOCK_DIM,
    MAX_GRID_DIM,
    MAX_STATIC_SHARED_BYTES,
    MAX_THREADS_PER_BLOCK,
    interleaving,
)
from . import racecheck

# A thread switch every microsecond instead of Python's default 5 ms, inside
# common.runtime.interleaved_threads(): simulated CUDA threads then interleave in
# the middle of read-modify-write sequences, so a race (a missing
# cuda.syncthreads, a `+=` that needed cuda.atomic.add) shows.
INTERLEAVED_SWITCH_INTERVAL_S = 1e-6

# --------------------------------------------------------------------------
# Simulator: the launch checks a GPU makes
# --------------------------------------------------------------------------

_shared_alloc_lock = threading.Lock()


def check_launch(griddim: Any, blockdim: Any, dynamic_shared_bytes: int = 0) -> None:
    """Raise LaunchConfigError for a launch configuration a GPU rejects.

    griddim, blockdim: int or tuple of up to 3 ints, as in ``kernel[grid, block]``.
    """

    def dims(d: Any, what: str) -> tuple[int, int, int]:
        t = (d,) if isinstance(d, numbers.Integral) else tuple(d)
        if not 1 <= len(t) <= 3 or not all(isinstance(v, numbers.Integral) for v in t):
            raise LaunchConfigError(f"{what} must be an int or 1-3 ints, got {d!r}")
        t = t + (1,) * (3 - len(t))
        if min(t) < 1:
            raise LaunchConfigError(
                f"{what} {d!r} has a dimension < 1: a grid needs at least one "
                "block and a block at least one thread, and a GPU refuses this launch "
                "(CUDA_ERROR_INVALID_VALUE); use ceil_div for grid sizes, and skip the "
                "launch when there is no work"
            )
        return t  # type: ignore[return-value]

    g = dims(griddim, "grid dimension")
    b = dims(blockdim, "block dimension")
    for axis, (v, limit) in enumerate(zip(b, MAX_BLOCK_DIM)):
        if v > limit:
            raise LaunchConfigError(
                f"block dimension {'xyz'[axis]} = {v} exceeds the GPU limit {limit}"
            )
    if b[0] * b[1] * b[2] > MAX_THREADS_PER_BLOCK:
        raise LaunchConfigError(
            f"{b[0] * b[1] * b[2]} threads per block ({blockdim!r}) exceeds the GPU "
            f"limit of {MAX_THREADS_PER_BLOCK}; a real GPU refuses this launch "
            "(CUDA_ERROR_INVALID_VALUE). Use smaller blocks and more of them."
        )
    for axis, (v, limit) in enumerate(zip(g, MAX_GRID_DIM)):
        if v > limit:
            raise LaunchConfigError(
                f"grid dimension {'xyz'[axis]} = {v} exceeds the GPU limit {limit}"
            )
    if dynamic_shared_bytes > MAX_STATIC_SHARED_BYTES:
        raise LaunchConfigError(
            f"{dynamic_shared_bytes} bytes of dynamic shared memory exceed "
            f"{MAX_STATIC_SHARED_BYTES} bytes per block"
        )


_shape_verdicts: dict[tuple[str, int], str | None] = {}
_parsed_files: dict[str, Any] = {}
_parse_lock = threading.Lock()


def _parse(filename: str) -> Any:
    """The AST of ``filename`` (cached), or None when it cannot be read or parsed."""
    # Simulated threads reach this together. CPython 3.11's ast.parse is not
    # safe to run in two threads at once ("AST constructor recursion depth
    # mismatch", seen here): one thread parses a file, the others wait.
    with _parse_lock:
        tree = _parsed_files.get(filename)
        if tree is None:
            # linecache also holds sources made in memory and registered there
            # (tests' mutant kernels), which no file on disk has.
            try:
                tree = ast.parse("".join(linecache.getlines(filename))) or False
            except SyntaxError:
                tree = False
            if tree is not False and not tree.body:
                tree = False
            _parsed_files[filename] = tree
    return tree or None


_SIMULATOR_FILES = (
    "simulator/kernel.py",
    "common/internal/simulator.py",
    "common/internal/racecheck.py",
    "simulator/kernelapi.py",
)


def _device_function_caller(frame: Any) -> Any:
    """The frame that called ``frame``'s function as a device function, or None
    when ``frame`` is a kernel launched from the host."""
    back = frame.f_back
    # Called by the simulator's FakeCUDAKernel.__call__, or by the course's own
    # `call` (install() below), which calls device functions directly.
    if (
        back is None
        or back.f_code.co_name not in ("__call__", "call")
        or not back.f_code.co_filename.replace("\\", "/").endswith(_SIMULATOR_FILES[:2])
    ):
        return None
    while back is not None and back.f_code.co_filename.replace("\\", "/").endswith(
        _SIMULATOR_FILES
    ):
        back = back.f_back
    return back


def _argument_at_call_site(name: str, frame: Any, caller: Any) -> Any:
    """The AST of the expression the caller passed for parameter ``name``, or None."""
    tree = _parse(caller.f_code.co_filename)
    if tree is None:
        return None
    code = frame.f_code
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    position = params.index(name)
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and node.lineno <= caller.f_lineno <= (node.end_lineno or node.lineno)
        ):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if called != code.co_name:
            continue
        for kw in node.keywords:
            if kw.arg == name:
                return kw.value
        if position < len(node.args) and not any(
            isinstance(a, ast.Starred) for a in node.args[: position + 1]
        ):
            return node.args[position]
    return None


def _shape_problem(node: Any, frame: Any) -> str | None:
    """Why the AST ``node`` of an array shape is not a compile-time constant, or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return None
    if isinstance(node, ast.Tuple):
        for elt in node.elts:
            problem = _shape_problem(elt, frame)
            if problem:
                return problem
        return None
    if isinstance(node, ast.Attribute):  # module.CONSTANT
        return None
    if isinstance(node, ast.Name):
        code = frame.f_code
        if node.id in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            caller = _device_function_caller(frame)
            if caller is None:
                return f"`{node.id}` is a kernel argument, known only at launch"
            # A device function is compiled for each call site: a parameter is a
            # compile-time constant when the caller passes one (a literal tuple, a
            # global), so judge the expression at the call site instead.
            passed = _argument_at_call_site(node.id, frame, caller)
            if passed is None:
                return None  # cannot tell from the source: do not refuse valid code
            return _shape_problem(passed, caller)
        return None  # a global or closure constant (or a local numba can fold)
    return f"`{ast.unparse(node)}` is computed inside the kernel"


def check_constant_shape(frame: Any, what: str) -> None:
    """Raise LaunchConfigError if the array shape at ``frame``'s line is not constant.

    On a GPU, ``cuda.shared.array`` and ``cuda.local.array`` need shapes fixed at
    compile time: int literals, or module-level / closure ints, or tuples of
    them. An expression such as ``TILE + 1`` inside the kernel is an int64
    there and the kernel fails to compile, while the simulator would accept it.
    """
    key = racecheck.line_of(frame)
    caller = _device_function_caller(frame)
    # A device function's verdict depends on what its caller passes.
    cache_key = key if caller is None else key + racecheck.line_of(caller)
    if cache_key not in _shape_verdicts:
        verdict = None
        tree = _parse(key[0])
        if tree:
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "array"
                    and node.lineno <= key[1] <= (node.end_lineno or node.lineno)
                ):
                    shape = (
                        node.args[0]
                        if node.args
                        else next((k.value for k in node.keywords if k.arg == "shape"), None)
                    )
                    if shape is not None:
                        verdict = _shape_problem(shape, frame)
                        break
        _shape_verdicts[cache_key] = verdict
    problem = _shape_verdicts[cache_key]
    if problem:
        raise LaunchConfigError(
            f"{what} at {key[0]}:{key[1]}: the shape must be a compile-time constant on a "
            f"GPU, but {problem}. Use int literals or module-level constants "
            "(e.g. TILE_PADDED = TILE + 1 at the top of the file), or capture the ints "
            "in a kernel factory's closure."
        )


LAUNCH_HINT = (
    "the course: launch as kernel[blocks_per_grid, threads_per_block](...), each an int "
    "or a tuple of 1 to 3 ints, e.g. kernel[ceil_div(n, 128), 128] (n / 128 is a float: "
    "use ceil_div or //)"
)


def _launch_nothing(*args: Any) -> None:
    return None


def install() -> None:
    """Patch Numba's CUDA simulator with the checks above and the race detector;
    a second call does nothing. Only in the simulator: numba imports its
    simulator modules here, never on a GPU."""
    from numba.cuda.errors import normalize_kernel_dimensions
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi as sim_api

    kernel_cls = sim_kernel.FakeCUDAKernel
    if getattr(kernel_cls, "_course_checks", False):
        return
    original_getitem = kernel_cls.__getitem__
    original_call = kernel_cls.__call__

    def getitem(self: Any, configuration: Any) -> Any:
        # Numba's own checks and words first (a learner searches for those), then
        # the course's hint; then the limits a GPU adds (check_launch).
        if not isinstance(configuration, tuple) or len(configuration) not in (2, 3, 4):
            raise LaunchConfigError(
                f"must specify at least the griddim and blockdim; {LAUNCH_HINT}"
            )
        try:
            normalize_kernel_dimensions(*configuration[:2])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{str(e).strip()}; {LAUNCH_HINT}") from None
        dyn = configuration[3] if len(configuration) == 4 else 0
        check_launch(configuration[0], configuration[1], dyn)
        return original_getitem(self, configuration)

    def forall(self: Any, ntasks: int, tpb: int = 0, stream: Any = 0, sharedmem: int = 0) -> Any:
        if ntasks == 0:  # as numba-cuda's ForAll: no work, so no launch at all
            return _launch_nothing
        return original_forall(self, ntasks, tpb, stream, sharedmem)

    def call(self: Any, *args: Any) -> Any:
        __tracebackhide__ = True
        if self._device and sim_api._swap_refcount.get(id(self.fn.__globals__)):
            # A device function whose module the running kernel has already
            # pointed at the fake cuda module: call it directly. The simulator's
            # own path takes a lock and counts references on every call, which
            # made a kernel that calls a small device function 3x slower.
            return self.fn(*args)
        if self._device or sim_kernel._kernel_context:
            return original_call(self, *args)
        with racecheck.launch(self.fn, args):
            if not interleaving():
                return original_call(self, *args)
            old = sys.getswitchinterval()
            sys.setswitchinterval(INTERLEAVED_SWITCH_INTERVAL_S)
            try:
                return original_call(self, *args)
            finally:
                sys.setswitchinterval(old)

    original_forall = kernel_cls.forall
    kernel_cls.__getitem__ = getitem
    kernel_cls.forall = forall
    kernel_cls.__call__ = call
    racecheck.install()
    _install_sequential_blocks(sim_kernel)
    _install_fast_scalar_casts()
    _install_fast_rng_states()
    _install_fast_array_shapes()

    def shared_array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        # Same behaviour as the simulator's FakeCUDAShared.array (one allocation
        # per source line, shared by the block), plus the GPU's rules: a
        # compile-time constant shape and at most 48 KiB per block. `alignment`
        # only steers code generation, so it is accepted and ignored here (the
        # simulator's own version raises). The caller's frame is taken
        # explicitly because the simulator keys allocations on it.
        frame = sys._getframe(1)
        check_constant_shape(frame, "cuda.shared.array")
        from numba.core import types as numba_types
        from numba.np import numpy_support

        if isinstance(dtype, numba_types.Type):
            dtype = numpy_support.as_dtype(dtype)
        dtype = np.dtype(dtype)
        caller = racecheck.line_of(frame)
        if shape == 0:
            count = self._dynshared_size // dtype.itemsize
            ary = np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        else:
            # The simulator's own version checks and creates without a lock: with
            # fine thread switching two threads of a block could each create
            # "their" shared array and never see each other's writes.
            with _shared_alloc_lock:
                ary = _get_or_create(self, caller, shape, dtype)
        return racecheck.SharedArray(ary) if racecheck.ENABLED else ary

    def _get_or_create(self: Any, caller: tuple[str, int], shape: Any, dtype: Any) -> Any:
        res = self._allocations.get(caller)
        if res is None:
            res = np.empty(shape, dtype)
            used = sum(a.nbytes for a in self._allocations.values())
            total = used + res.nbytes + self._dynshared_size
            if total > MAX_STATIC_SHARED_BYTES:
                raise LaunchConfigError(
                    f"this block asks for {total} bytes of shared memory "
                    f"({caller[0]}:{caller[1]} adds {res.nbytes}); a GPU allows "
                    f"{MAX_STATIC_SHARED_BYTES} bytes of static shared memory per "
                    "block, so this kernel would not compile for it. Use smaller tiles."
                )
            self._allocations[caller] = res
        return res

    def local_array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        check_constant_shape(sys._getframe(1), "cuda.local.array")
        return original_local_array(self, shape, dtype)

    original_local_array = sim_api.FakeCUDALocal.array
    sim_api.FakeCUDAShared.array = shared_array
    sim_api.FakeCUDALocal.array = local_array
    kernel_cls._course_checks = True


# --------------------------------------------------------------------------
# Simulator speed: barrier-free blocks run their threads one after another
# --------------------------------------------------------------------------

# Names whose use in a kernel (or anything it calls) means its threads must run
# side by side, as the simulator does, to meet at a barrier.
_BARRIER_NAMES = frozenset(
    {
        "syncthreads",
        "syncthreads_count",
        "syncthreads_and",
        "syncthreads_or",
        "syncwarp",
        "this_grid",
        "sync",
    }
)
_barrier_verdicts: dict[Any, bool] = {}
# The attribute that marks a simulator function as warp-collective (the tensor
# cores' mma.sync, common/tensor_cores.py): every lane of a warp meets there,
# so its kernel runs in turns (:func:`_run_in_turns`), where the call is a
# yield point; the function's ``collective(lanes)`` then computes all 32
# lanes' results at once.
WARP_COLLECTIVE = "_course_warp_collective"
WARP_SIZE = 32


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _uses_barrier(fn: Any, seen: set[int] | None = None, collective_only: bool = False) -> bool:
    """True if ``fn`` (a kernel's Python function) or any function it can call may
    reach a barrier; True too whenever that cannot be told from the code.
    ``collective_only``: warp-collective calls count, block barriers do not."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    code = getattr(fn, "__code__", None)
    if code is None:
        return not collective_only
    names = _code_names(code)
    if names & _BARRIER_NAMES and not collective_only:
        return True
    candidates = [fn.__globals__[n] for n in names if n in fn.__globals__]
    candidates += [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    for obj in candidates:
        if isinstance(obj, types.ModuleType):
            if obj.__name__.split(".")[0] in ("numpy", "math", "numba", "cmath"):
                continue
            # module.function: look at the attributes this code names
            obj_candidates = [getattr(obj, n) for n in names if hasattr(obj, n)]
        else:
            obj_candidates = [obj]
        for target in obj_candidates:
            if getattr(target, WARP_COLLECTIVE, False):
                return True
            inner = getattr(target, "py_func", None) or getattr(target, "fn", None)
            if inner is not None and getattr(inner, "__code__", None) is not None:
                target = inner
            if isinstance(target, types.FunctionType) and _uses_barrier(
                target, seen, collective_only
            ):
                return True
    return False


_collective_verdicts: dict[Any, bool] = {}


def _uses_warp_collective(fn: Any) -> bool:
    """True if ``fn`` (a kernel's Python function) may reach a warp-collective call."""
    verdict = _collective_verdicts.get(fn)
    if verdict is None:
        verdict = _collective_verdicts[fn] = _uses_barrier(fn, collective_only=True)
    return verdict


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _barrier_free(fn: Any) -> bool:
    verdict = _barrier_verdicts.get(fn)
    if verdict is None:
        verdict = _barrier_verdicts[fn] = not _uses_barrier(fn)
    return verdict


def _install_fast_scalar_casts() -> None:
    """``float32(x)``, ``uint64(i)`` in a kernel: in the simulator a call of
    Numba's type object, which casts a value with NumPy (``np.float32(x)``), or
    makes a signature of types (``float32(float32, int32)``). Numba's
    ``Type.__call__`` imports its signature helper and runs an ABC isinstance
    check on every call, twice the cost of the cast: an eighth of a capstone
    training step in the simulator (the fast kernels' shared-memory indices are
    ``uint64(...)``). The same two outcomes, the check made once per argument class."""
    from numba.core.types import abstract
    from numba.core.typing import signature

    type_cls = abstract.Type
    if getattr(type_cls, "_course_fast_call", False):
        return
    is_type: dict[type, bool] = {}  # argument's class -> isinstance(argument, Type)

    def call(self: Any, *args: Any) -> Any:
        if len(args) == 1:
            cls = type(args[0])
            verdict = is_type.get(cls)
            if verdict is None:
                verdict = is_type[cls] = isinstance(args[0], type_cls)
            if not verdict:
                return self.cast_python_value(args[0])
        return signature(self, *args)

    type_cls.__call__ = call
    type_cls._course_fast_call = True


def _install_fast_array_shapes() -> None:
    """``a.shape`` and ``a.size`` of an array argument inside a kernel: Numba's
    simulator finds them only after a failed attribute lookup (an AttributeError
    made and dropped), through two ``__getattr__`` hops: 2.6 and 1.7 us, six times
    an element read. A naive kernel reads several at its start
    (``_, c, h, w = out.shape``). Here they are properties of the in-kernel
    wrapper, with the same results (``shape`` a FakeShape, which refuses negative
    indices, as FakeCUDAArray.shape gives; ``size`` the ndarray's)."""
    from numba.cuda.simulator.cudadrv import devicearray as sim_da

    wrapper = sim_da.FakeWithinKernelCUDAArray
    if getattr(wrapper, "_course_fast_shapes", False):
        return
    fake_array, fake_shape = sim_da.FakeCUDAArray, sim_da.FakeShape
    original_getattr = wrapper.__getattr__

    def shape(self: Any) -> Any:
        item = self._item
        if type(item) is fake_array:  # (a subclass may define its own)
            return fake_shape(item._ary.shape)
        return original_getattr(self, "shape")

    def size(self: Any) -> Any:
        item = self._item
        if type(item) is fake_array:
            return item._ary.size
        return original_getattr(self, "size")

    wrapper.shape = property(shape)
    wrapper.size = property(size)
    wrapper._course_fast_shapes = True


_MASK64 = (1 << 64) - 1
# xoroshiro128+'s jump polynomial: 2**64 steps ahead (numba.cuda.random.xoroshiro128p_jump)
_XOROSHIRO_JUMP = (0xBEAC0467EBA5FACB, 0xD86B048B86AA9922)


def _xoroshiro128p_states(n: int, seed: int, subsequence_start: int) -> list[tuple[int, int]]:
    """(s0, s1) of ``n`` xoroshiro128+ generators as numba.cuda.random sets them
    up: state 0 from SplitMix64(seed) jumped ``subsequence_start`` times, state i
    state i - 1 jumped once (2**64 steps). In Python ints, masked to 64 bits."""

    def jump(s0: int, s1: int) -> tuple[int, int]:
        a0 = a1 = 0
        for word in _XOROSHIRO_JUMP:
            for b in range(64):
                if word >> b & 1:
                    a0 ^= s0
                    a1 ^= s1
                s1 ^= s0  # one step of xoroshiro128+ (its output s0 + s1 is not needed)
                s0 = ((s0 << 55 | s0 >> 9) & _MASK64) ^ s1 ^ (s1 << 14 & _MASK64)
                s1 = (s1 << 36 | s1 >> 28) & _MASK64
        return a0, a1

    z = (seed + 0x9E3779B97F4A7C15) & _MASK64  # SplitMix64
    z = ((z ^ z >> 30) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ z >> 27) * 0x94D049BB133111EB) & _MASK64
    state = (z ^ z >> 31, z ^ z >> 31)
    for _ in range(subsequence_start):
        state = jump(*state)
    states = []
    for i in range(n):
        if i:
            state = jump(*state)
        states.append(state)
    return states


def _install_fast_rng_states() -> None:
    """numba.cuda.random sets its generator states up on the host with functions
    it compiles for the CPU; in the simulator they fall back to object mode: 4 s
    of compiling in every process that draws, then 5 ms a state (uint64 NumPy
    scalars, one operation at a time). The same states from Python ints
    (:func:`_xoroshiro128p_states`), pinned to Numba's by
    tests/test_ch07_libraries.py::test_simulator_rng_states_are_numbas. The draws
    inside kernels are Numba's own, unchanged."""
    from numba.cuda import random as cuda_random

    if getattr(cuda_random, "_course_fast_states", False):
        return
    uint64 = cuda_random.uint64

    def init_xoroshiro128p_states_cpu(states: Any, seed: Any, subsequence_start: Any) -> None:
        # Numba's casts first, so a seed it refuses (negative, too large) is refused alike.
        seed, start = int(uint64(seed)), int(uint64(subsequence_start))
        pairs = _xoroshiro128p_states(states.shape[0], seed, start)
        if pairs:
            states["s0"] = np.array([p[0] for p in pairs], np.uint64)
            states["s1"] = np.array([p[1] for p in pairs], np.uint64)

    cuda_random.init_xoroshiro128p_states_cpu = init_xoroshiro128p_states_cpu
    cuda_random._course_fast_states = True


def _install_sequential_blocks(sim_kernel: Any) -> None:
    """The simulator starts one OS thread per CUDA thread (about 0.1 ms each) so
    that threads can meet at barriers. A kernel that never reaches a barrier does
    not need that: its threads may run in any order, one after another, in one
    thread per block, which makes naive kernels several times faster to simulate.
    Races are still found: the race detector judges accesses, not timing.
    Under ``common.runtime.interleaved_threads`` (race demonstrations) blocks keep
    the simulator's own threads."""
    from numba.cuda.simulator.kernelapi import Dim3

    manager_cls = sim_kernel.BlockManager
    threaded_run = manager_cls.run

    def run(self: Any, grid_point: Any, *args: Any) -> Any:
        __tracebackhide__ = True
        # A warp-collective call needs the turns runner, interleaved or not.
        if interleaving() and not _uses_warp_collective(self._f):
            return threaded_run(self, grid_point, *args)
        if not _barrier_free(self._f):
            turns = _turns_version(self._f, kernel=True)
            if turns is not None:
                return _run_in_turns(self, turns, grid_point, args)
            return _run_with_barriers(self, sim_kernel, grid_point, args)
        racecheck.on_block_start()
        block_dim = self._block_dim
        failure: list[Any] = []

        def one_after_another() -> None:
            if self._debug:  # as the simulator's own threads do for @cuda.jit(debug=True)
                np.seterr(divide="raise")
            t = threading.current_thread()
            t.blockIdx = Dim3(*grid_point)
            for point in np.ndindex(*block_dim):
                t.threadIdx = Dim3(*point)
                t.thread_id = point[0] + block_dim[0] * (point[1] + block_dim[1] * point[2])
                t._race_state = None
                try:
                    self._f(*args)
                except Exception as e:  # noqa: BLE001  (re-raised below, as the simulator does)
                    tid, ctaid = list(point), list(grid_point)
                    msg = f"tid={tid} ctaid={ctaid}" + (f": {e}" if str(e) else "")
                    failure.append((type(e)(msg), sys.exc_info()[2]))
                    return

        worker = threading.Thread(target=one_after_another, daemon=True)
        worker.syncthreads = _no_barrier  # type: ignore[attr-defined]
        worker.start()
        worker.join()
        if failure:
            raise failure[0][0].with_traceback(failure[0][1])
        racecheck.on_block_end()
        return None

    manager_cls.run = run


class _BlockBarrier:
    """``cuda.syncthreads()`` for one simulated block: threads wait on a condition
    until every thread still running has arrived (a thread that has returned no
    longer counts, as on a GPU). The simulator's own version polls its threads
    from a busy loop that holds the GIL for whole switch intervals; waiting here
    costs nothing while the others run.

    It also keeps what a GPU's barrier needs and the simulator never checked:
    where each thread arrived (:class:`_BarrierSite`), so that threads meeting at
    two different barriers, or a thread that skips one, are reported
    (:func:`_divergent_barrier`, :func:`_skipped_barrier`)."""

    def __init__(self, parties: int) -> None:
        self.live = parties
        self.waiting = 0
        self.generation = 0
        self.aborted = False
        self.problem: str | None = None
        self.arrived: dict[tuple[int, ...], _BarrierSite] = {}  # this generation's
        self.history: dict[tuple[int, ...], list[_BarrierSite]] = {}  # every thread's
        self.cond = threading.Condition()

    def wait(self, who: tuple[int, ...], site: _BarrierSite) -> None:
        with self.cond:
            if self.aborted:
                raise RuntimeError("another thread of the block failed")
            generation = self.generation
            self.waiting += 1
            self.arrived[who] = site
            self.history.setdefault(who, []).append(site)
            if self.waiting == self.live:
                self._release()
            while generation == self.generation and not self.aborted:
                self.cond.wait()
            if self.aborted:
                raise RuntimeError("another thread of the block failed")

    def leave(self) -> None:
        with self.cond:
            self.live -= 1
            if self.waiting and self.waiting == self.live:
                self._release()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def _release(self) -> None:
        problem = _divergent_barrier(self.arrived)
        if problem:
            self.problem = problem
            self.aborted = True
        self.arrived = {}
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


class _BarrierSite(tuple):
    """Where a thread reached a barrier: ``(file, line, kernel_line)``, the barrier's
    own line (maybe in a device function) and the kernel's line that led to it."""

    def where(self) -> str:
        return f"{os.path.basename(self[0])}:{self[1]}"


_BARRIER_HINT = (
    "every thread of a block that has not returned must reach the same "
    "cuda.syncthreads(): a barrier inside a branch that only some threads take (`if t < "
    "stride: ... cuda.syncthreads()`) is undefined behaviour on a GPU (it may hang or give "
    "wrong results; compute-sanitizer --tool synccheck reports it). Keep the barrier out "
    "of the branch: guard the work, not the barrier."
)


def _tid(point: tuple[int, ...]) -> str:
    return "({})".format(",".join(str(int(v)) for v in point))


def _divergent_barrier(arrived: dict[tuple[int, ...], _BarrierSite]) -> str | None:
    """Why the threads released together are not at one barrier, or None."""
    sites = sorted(set(arrived.values()), key=lambda site: site[1:])
    if len(sites) < 2:
        return None
    first = [min(p for p, s in arrived.items() if s == site) for site in sites[:2]]
    return (
        f"threads {_tid(first[0])} and {_tid(first[1])} wait at different barriers "
        f"({sites[0].where()} and {sites[1].where()})"
    )


def _barrier_site(kernel_code: Any) -> _BarrierSite:
    """The calling simulated thread's barrier: the first frame outside the simulator,
    and the kernel's own line above it."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(
        _SIMULATOR_FILES
    ):
        frame = frame.f_back
    inner = frame
    while frame is not None and frame.f_code is not kernel_code:
        frame = frame.f_back
    outer = frame or inner
    return _BarrierSite((inner.f_code.co_filename, inner.f_lineno, outer.f_lineno))


def _kernel_returns(code: Any) -> tuple[frozenset[int], list[tuple[int, int]]] | None:
    """The lines of the kernel's own ``return`` statements and the line spans of its
    loops, from its source; None when the source cannot be read."""
    if code not in _return_verdicts:
        _return_verdicts[code] = _find_returns(code)
    return _return_verdicts[code]


_return_verdicts: dict[Any, Any] = {}


def _definition(code: Any) -> Any:
    """The ``def`` (AST) that compiled to ``code``, from its file's source, or None."""
    tree = _parse(code.co_filename)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == code.co_name:
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if first == code.co_firstlineno:
                return node
    return None


def _find_returns(code: Any) -> tuple[frozenset[int], list[tuple[int, int]]] | None:
    node = _definition(code)
    if node is None:
        return None
    returns, loops = set(), []
    todo = list(node.body)
    while todo:  # the function's own statements, not those of nested defs
        stmt = todo.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.Return):
            returns.add(stmt.lineno)
        if isinstance(stmt, (ast.For, ast.While)):
            loops.append((stmt.lineno, stmt.end_lineno or stmt.lineno))
        todo.extend(ast.iter_child_nodes(stmt))
    return frozenset(returns), loops


def _skipped_barrier(
    structure: tuple[frozenset[int], list[tuple[int, int]]] | None,
    history: dict[tuple[int, ...], list[_BarrierSite]],
    exits: dict[tuple[int, ...], int | None],
    points: list[tuple[int, ...]],
) -> str | None:
    """The first thread (in thread order) that went past a barrier other threads of
    its block waited at, without returning first; None when there is none.

    structure: the kernel's ``return`` lines and loop spans (:func:`_kernel_returns`);
    exits: the line each thread's kernel frame returned from, where traced.
    A thread may leave early by returning (``if i >= n: return`` before the
    barrier): on a GPU a thread that has exited no longer counts. Anything else
    that ends a thread with fewer barriers than its block's other threads means it
    stepped over one: a barrier inside a branch or in a loop it ran fewer times.
    """
    longest = max((history.get(p, []) for p in points), key=len)
    if not longest or structure is None:  # no source: an early return cannot be told
        return None
    returns, loops = structure
    for point in points:
        mine = history.get(point, [])
        if len(mine) == len(longest):
            continue
        missed = longest[len(mine)]
        returned_at = exits.get(point)
        explicit = returned_at in returns
        if explicit and (
            returned_at < missed[2]
            or any(a <= returned_at <= b and a <= missed[2] <= b for a, b in loops)
        ):
            continue  # returned before reaching it: an early exit, as on a GPU
        other = next(p for p in points if len(history.get(p, [])) > len(mine))
        ending = f"returned at line {returned_at}" if explicit else "ran to the end of the kernel"
        return (
            f"thread {_tid(point)} never reached the barrier at {missed.where()} that "
            f"thread {_tid(other)} waited at (it passed {len(mine)} barrier(s), then {ending})"
        )
    return None


def _exit_line_tracer(kernel_code: Any, exits: dict[Any, int | None], who: Any) -> Any:
    """A ``sys.settrace`` function that records the line of the kernel frame's return
    (only call and return events of that one frame: no line events)."""

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            exits[who] = frame.f_lineno
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is kernel_code:
            frame.f_trace_lines = False
            return local
        return None

    return on_call


def _run_with_barriers(manager: Any, sim_kernel: Any, grid_point: Any, args: Any) -> None:
    """Run one block whose threads meet at barriers: one OS thread per CUDA thread,
    as the simulator does, but waiting on a condition instead of being polled, and
    checking that every thread reaches the same barriers (:class:`BarrierError`)."""
    __tracebackhide__ = True
    racecheck.on_block_start()
    block_dim = manager._block_dim
    points = list(np.ndindex(*block_dim))
    barrier = _BlockBarrier(len(points))
    failures: list[tuple[int, Any, Any]] = []
    kernel = manager._f
    kernel_code = kernel.__code__
    structure = _kernel_returns(kernel_code)
    # Which line a thread returned from matters only if the kernel has a `return`.
    trace_exits = structure is not None and bool(structure[0])
    exits: dict[tuple[int, ...], int | None] = {}

    class _Thread(sim_kernel.BlockThread):
        def syncthreads(self) -> None:
            site = _barrier_site(kernel_code)
            racecheck.on_barrier_arrive()
            barrier.wait(self._point, site)
            racecheck.on_barrier_leave()

        def run(self) -> None:
            if manager._debug:  # as the simulator's own threads do for @cuda.jit(debug=True)
                np.seterr(divide="raise")
            if trace_exits:
                sys.settrace(_exit_line_tracer(kernel_code, exits, self._point))
            try:
                kernel(*args)
            except Exception as e:  # noqa: BLE001  (re-raised by the launching thread)
                if not barrier.aborted:
                    tid, ctaid = list(self.threadIdx), list(self.blockIdx)
                    msg = f"tid={tid} ctaid={ctaid}" + (f": {e}" if str(e) else "")
                    failures.append((self.thread_id, type(e)(msg), sys.exc_info()[2]))
                barrier.abort()
            finally:
                if trace_exits:
                    sys.settrace(None)
                barrier.leave()

    threads = []
    for point in points:
        t = _Thread(None, manager, grid_point, point, False)
        t._point = point
        threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    name = getattr(kernel, "__qualname__", kernel.__name__)
    block = _tid(tuple(grid_point))
    if barrier.problem:
        raise BarrierError(f"in kernel {name}, block {block}: {barrier.problem}; {_BARRIER_HINT}")
    if failures:
        _, exc, tb = min(failures, key=lambda f: f[0])
        raise exc.with_traceback(tb)
    problem = _skipped_barrier(structure, barrier.history, exits, points)
    if problem:
        raise BarrierError(f"in kernel {name}, block {block}: {problem}; {_BARRIER_HINT}")
    racecheck.on_block_end()


def _no_barrier(*_: Any) -> None:
    raise RuntimeError(
        "internal error: a kernel judged barrier-free reached a barrier; "
        "set COURSE_RACECHECK=0 and report it"
    )


# --------------------------------------------------------------------------
# Simulator speed: a block with barriers runs its threads in turns
# --------------------------------------------------------------------------

# The barriers a kernel may reach, as the transformed code hands them to the runner.
_PRIMITIVES = {
    "syncthreads": "sync",
    "syncthreads_count": "count",
    "syncthreads_and": "and",
    "syncthreads_or": "or",
}
# Names the turns runner does not handle: such kernels keep one OS thread per CUDA thread.
_THREADS_ONLY = _BARRIER_NAMES - set(_PRIMITIVES)
_DEVICE = "__course_device__"
_turn_versions: dict[Any, Any] = {}


class _CannotTakeTurns(Exception):
    """The kernel's source cannot be turned into a generator (no source, a barrier
    where ``yield`` is not allowed, a callee that cannot be resolved): its blocks
    run on threads instead."""


def _turns_version(fn: Any, kernel: bool) -> Any:
    """``fn`` (a kernel's or a device function's Python function) rewritten as a
    generator that yields at each barrier (:class:`_YieldAtBarriers`), or None
    when it cannot be (cached)."""
    key = (fn, kernel)
    if key not in _turn_versions:
        _turn_versions[key] = None  # a device function that calls itself: threads
        try:
            _turn_versions[key] = _make_turns_version(fn, kernel)
        except _CannotTakeTurns:
            pass
    return _turn_versions[key]


def _resolve(node: Any, fn: Any) -> Any:
    """The object a callee expression (a name or a dotted name) stands for in ``fn``,
    or raise _CannotTakeTurns."""
    if isinstance(node, ast.Name):
        code = fn.__code__
        if node.id in code.co_freevars:
            cell = fn.__closure__[code.co_freevars.index(node.id)]
            if _filled(cell):
                return cell.cell_contents
        elif node.id in fn.__globals__:
            return fn.__globals__[node.id]
        elif hasattr(builtins, node.id):
            return getattr(builtins, node.id)
        raise _CannotTakeTurns(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, fn)
        if hasattr(owner, node.attr):
            return getattr(owner, node.attr)
    raise _CannotTakeTurns(type(node).__name__)


def _callee_kind(node: Any, fn: Any) -> str | None:
    """What calling ``node`` does with barriers: a primitive's kind ("sync",
    "count", ...), "device" (a device function that reaches one), or None."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    if name in _PRIMITIVES:
        return _PRIMITIVES[name]
    if name in _THREADS_ONLY:
        raise _CannotTakeTurns(name)
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    try:
        target = _resolve(node, fn)
    except _CannotTakeTurns:
        return None  # a local, a method: not something _uses_barrier follows either
    if getattr(target, WARP_COLLECTIVE, False):
        return "warp"
    inner = getattr(target, "py_func", None)
    if inner is None or getattr(inner, "__code__", None) is None or not _uses_barrier(inner):
        return None
    if _turns_version(inner, kernel=False) is None:
        raise _CannotTakeTurns(name)
    return "device"


def _make_turns_version(fn: Any, kernel: bool) -> Any:
    """See :func:`_turns_version`; raises _CannotTakeTurns."""
    code = getattr(fn, "__code__", None)
    node = _definition(code) if code is not None else None
    if node is None:
        raise _CannotTakeTurns("no source")
    plain = copy.deepcopy(node)
    plain.decorator_list = []
    # The source read now must be the one the function was compiled from (a file
    # edited since would put the wrong lines into the generator). Not co_code:
    # CPython 3.11 compiles `cuda.f()` differently when `cuda` is imported at
    # module level, as it is in the kernel's file and is not here.
    if _fingerprint(_compile_in_closure(plain, code, fn)) != _fingerprint(code):
        raise _CannotTakeTurns("source changed")
    changed = _YieldAtBarriers(fn, kernel).visit(copy.deepcopy(plain))
    gen_code = _compile_in_closure(changed, code, fn, extra=(_DEVICE,))
    if not gen_code.co_flags & inspect.CO_GENERATOR:  # no barrier found in the source
        raise _CannotTakeTurns("no barrier in the source")
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    cells[_DEVICE] = types.CellType(_device_turns)
    gen = types.FunctionType(
        gen_code,
        fn.__globals__,
        code.co_name,
        fn.__defaults__,
        tuple(cells[name] for name in gen_code.co_freevars),
    )
    gen.__kwdefaults__ = fn.__kwdefaults__
    return gen


def _fingerprint(code: Any) -> tuple[Any, ...]:
    """What a function's code must share with a recompilation of its source."""
    consts = tuple(c for c in code.co_consts if not hasattr(c, "co_code"))
    # the body's lines (the first line is the decorator's, if any)
    lines = sorted({line for *_, line in code.co_lines() if (line or 0) > code.co_firstlineno})
    return code.co_varnames, code.co_freevars, sorted(set(code.co_names)), consts, lines


def _compile_in_closure(node: Any, code: Any, fn: Any, extra: tuple[str, ...] = ()) -> Any:
    """Compile the function definition ``node`` where ``code``'s free variables
    (and ``extra``) are free too, at its own file and lines; its code object."""
    outer = ast.FunctionDef(
        name="__course_outer__",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=v) for v in (*code.co_freevars, *extra)],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[node, ast.Return(value=ast.Name(id=node.name, ctx=ast.Load()))],
        decorator_list=[],
    )
    for made in (outer, outer.body[1], outer.body[1].value):
        ast.copy_location(made, node)  # on the definition's lines, like the rest
    module = ast.fix_missing_locations(ast.Module(body=[outer], type_ignores=[]))
    import __future__  # the module itself, for a flag; not a future statement

    future = code.co_flags & __future__.annotations.compiler_flag
    compiled = compile(module, code.co_filename, "exec", flags=future, dont_inherit=True)
    outer_code = next(c for c in compiled.co_consts if hasattr(c, "co_code"))
    return next(c for c in outer_code.co_consts if getattr(c, "co_name", None) == node.name)


class _YieldAtBarriers:
    """Rewrites a function's barrier calls as ``yield``: ``cuda.syncthreads()``
    becomes ``(yield ("sync", None))``, ``cuda.syncthreads_count(p)`` becomes
    ``(yield ("count", p))``, and a call of a device function that reaches a
    barrier becomes ``(yield from __course_device__(f)(...))``, and a call of a
    warp-collective function (:data:`WARP_COLLECTIVE`) ``f(x, y)`` becomes
    ``(yield ("warp", (f, (x, y))))``. In a kernel, ``return`` becomes ``return <its line>``, so the runner knows where each
    thread left (see :func:`_skipped_barrier`)."""

    def __init__(self, fn: Any, is_kernel: bool) -> None:
        self.fn = fn
        self.is_kernel = is_kernel

    def visit(self, node: Any) -> Any:
        fn, is_kernel = self.fn, self.is_kernel

        def refuse_barriers_in(nested: Any) -> Any:
            # `yield` is not allowed there, or would make that scope the generator
            for call in (n for n in ast.walk(nested) if isinstance(n, ast.Call)):
                if _callee_kind(call.func, fn) is not None:
                    raise _CannotTakeTurns("a barrier in a nested scope")
            return nested

        class Transformer(ast.NodeTransformer):
            def visit_Call(self, call: Any) -> Any:
                self.generic_visit(call)
                kind = _callee_kind(call.func, fn)
                if kind is None:
                    return call
                if kind == "device":
                    device = ast.Call(
                        func=ast.Name(id=_DEVICE, ctx=ast.Load()), args=[call.func], keywords=[]
                    )
                    new = ast.YieldFrom(
                        value=ast.Call(func=device, args=call.args, keywords=call.keywords)
                    )
                elif kind == "warp":
                    # (yield ("warp", (f, (args...)))): the runner gathers the warp
                    if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
                        raise _CannotTakeTurns(kind)
                    operands = ast.Tuple(elts=list(call.args), ctx=ast.Load())
                    request = ast.Tuple(elts=[call.func, operands], ctx=ast.Load())
                    new = ast.Yield(
                        value=ast.Tuple(elts=[ast.Constant(value=kind), request], ctx=ast.Load())
                    )
                else:
                    if call.keywords or len(call.args) > 1:
                        raise _CannotTakeTurns(kind)
                    value = call.args[0] if call.args else ast.Constant(value=None)
                    new = ast.Yield(
                        value=ast.Tuple(elts=[ast.Constant(value=kind), value], ctx=ast.Load())
                    )
                return ast.copy_location(new, call)

            def visit_Return(self, ret: Any) -> Any:
                self.generic_visit(ret)
                if is_kernel and ret.value is None:
                    ret.value = ast.copy_location(ast.Constant(value=ret.lineno), ret)
                return ret

            def visit_FunctionDef(self, nested: Any) -> Any:
                return refuse_barriers_in(nested)

            visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef
            visit_ListComp = visit_SetComp = visit_DictComp = visit_FunctionDef
            visit_GeneratorExp = visit_FunctionDef

        transformer = Transformer()
        node.body = [transformer.visit(stmt) for stmt in node.body]
        return node


def _device_turns(device_function: Any) -> Any:
    """What a rewritten call of a device function that reaches a barrier calls:
    its generator version, run with the fake ``cuda`` module in its globals, as
    the simulator's own call does. Named ``call`` so that
    :func:`_device_function_caller` sees a device-function call."""
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.kernelapi import _swap_refcount, swapped_cuda_module

    fn = device_function.py_func
    gen = _turns_version(fn, kernel=False)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _swap_refcount.get(id(fn.__globals__)):
            return (yield from gen(*args, **kwargs))
        with swapped_cuda_module(fn, sim_kernel._get_kernel_context()):
            return (yield from gen(*args, **kwargs))

    return call


def _run_in_turns(manager: Any, gen: Any, grid_point: Any, args: Any) -> None:
    """Run one block of a kernel that meets at barriers, in one OS thread: each
    CUDA thread is a generator (:func:`_turns_version`) that runs until its next
    barrier or its end; when every thread still running waits at a barrier, it is
    released and the threads take their turns again, in thread order.

    Threads only ever switch at barriers, so a run is the same every time; the
    race detector judges accesses, not timing, and sees the same barriers as on
    threads. Checks as :func:`_run_with_barriers`: threads released together
    must wait at one barrier, and none may skip one (:class:`BarrierError`)."""
    __tracebackhide__ = True
    from numba.cuda.simulator.kernelapi import Dim3

    racecheck.on_block_start()
    block_dim = manager._block_dim
    kernel = manager._f
    points = list(np.ndindex(*block_dim))
    history: dict[tuple[int, ...], list[_BarrierSite]] = {}
    exits: dict[tuple[int, ...], int | None] = {}
    failure: list[Any] = []
    problem: list[str] = []
    warp_problem: list[str] = []
    name = getattr(kernel, "__qualname__", kernel.__name__)
    block = _tid(tuple(grid_point))

    def take_turns() -> None:
        if manager._debug:  # as the simulator's own threads do for @cuda.jit(debug=True)
            np.seterr(divide="raise")
        t = threading.current_thread()
        t.blockIdx = Dim3(*grid_point)
        live = []  # [point, Dim3, thread id, generator, race state, value to send, from a barrier]
        for point in points:
            tid = point[0] + block_dim[0] * (point[1] + block_dim[1] * point[2])
            live.append([point, Dim3(*point), tid, gen(*args), None, None, False])
        threads = list(live)
        try:
            run_turns(t, live)
        finally:
            # Threads left waiting when another failed: close them now, so that a
            # device function's swap of the fake cuda module into its globals is
            # undone now, not whenever the traceback that holds them is dropped.
            for thread in threads:
                thread[3].close()

    def run_turns(t: Any, runnable: list[Any]) -> None:
        at_barrier: list[Any] = []  # waiting at a block barrier, in thread order
        arrived: dict[tuple[int, ...], _BarrierSite] = {}
        at_warp: dict[int, list[Any]] = {}  # warp -> its lanes waiting at a collective
        while runnable:
            for thread in runnable:
                point, t.threadIdx, t.thread_id, g, t._race_state, value, released = thread
                try:
                    if released:
                        racecheck.on_barrier_leave()
                    request = g.send(value)
                except StopIteration as stop:
                    exits[point] = stop.value
                    continue
                except Exception as e:  # noqa: BLE001  (re-raised below, as the simulator does)
                    msg = f"tid={list(point)} ctaid={list(grid_point)}" + (
                        f": {e}" if str(e) else ""
                    )
                    failure.append((type(e)(msg), sys.exc_info()[2]))
                    return
                thread[4] = t._race_state
                thread[5] = request
                if request[0] == "warp":  # a register exchange, not a memory barrier
                    at_warp.setdefault(thread[2] // WARP_SIZE, []).append(thread)
                    continue
                racecheck.on_barrier_arrive()
                site = _turn_site(g)
                arrived[point] = site
                history.setdefault(point, []).append(site)
                at_barrier.append(thread)
            # Every thread still running now waits at a warp collective or a barrier.
            if at_warp:
                runnable = []
                for warp, lanes in sorted(at_warp.items()):
                    lanes.sort(key=lambda lane: lane[2])  # lane i at index i
                    found = _partial_warp(warp, lanes, len(points))
                    if found:
                        warp_problem.append(found)
                        return
                    function, _ = lanes[0][5][1]
                    results = function.collective([lane[5][1][1] for lane in lanes])
                    for lane, result in zip(lanes, results):
                        lane[5], lane[6] = result, False
                    runnable += lanes
                at_warp = {}
                continue
            if at_barrier:
                found = _divergent_barrier(arrived)
                if found:
                    problem.append(found)
                    return
                kind = at_barrier[0][5][0]
                votes = [bool(thread[5][1]) for thread in at_barrier]
                result = {
                    "sync": None,
                    "count": sum(votes),
                    "and": int(all(votes)),
                    "or": int(any(votes)),
                }[kind]
                for thread in at_barrier:
                    thread[5], thread[6] = result, True
            runnable, at_barrier, arrived = at_barrier, [], {}

    worker = threading.Thread(target=take_turns, daemon=True)
    worker.syncthreads = _unseen_barrier  # type: ignore[attr-defined]
    worker.start()
    worker.join()
    if problem:
        raise BarrierError(f"in kernel {name}, block {block}: {problem[0]}; {_BARRIER_HINT}")
    if warp_problem:
        raise BarrierError(f"in kernel {name}, block {block}: {warp_problem[0]}")
    if failure:
        raise failure[0][0].with_traceback(failure[0][1])
    structure = _kernel_returns(kernel.__code__)
    skipped = _skipped_barrier(structure, history, exits, points)
    if skipped:
        raise BarrierError(f"in kernel {name}, block {block}: {skipped}; {_BARRIER_HINT}")
    racecheck.on_block_end()


def _partial_warp(warp: int, lanes: list[Any], block_threads: int) -> str | None:
    """Why the ``lanes`` (turn runner entries, in lane order) waiting at a warp
    collective of warp ``warp`` cannot run it, or None: mma.sync.aligned needs all
    32 lanes of the warp at the same instruction (PTX ISA, "Warp-level Matrix
    Multiply-Accumulate Instructions": .aligned)."""
    sites = {_turn_site(lane[3]) for lane in lanes}
    name = lanes[0][5][1][0].__name__
    first = warp * WARP_SIZE
    if len(lanes) < WARP_SIZE:
        in_block = min(WARP_SIZE, block_threads - first)
        missing = sorted(set(range(first, first + in_block)) - {lane[2] for lane in lanes})
        why = (
            f"the block has {block_threads} threads, so warp {warp} has only {in_block} lanes: "
            "use a multiple of 32 threads per block"
            if in_block < WARP_SIZE
            else f"threads {missing[:4]}{' ...' if len(missing) > 4 else ''} of that warp "
            "returned or wait at a cuda.syncthreads() instead"
        )
        return (
            f"{name} (a warp-collective mma.sync) was reached by {len(lanes)} of the 32 lanes "
            f"of warp {warp}; mma.sync.aligned needs all 32 lanes at the same instruction "
            f"({why}; guard the loads and stores, not the mma)"
        )
    if len(sites) > 1:
        where = sorted(site.where() for site in sites)
        return (
            f"the lanes of warp {warp} reach {name} at different lines ({where[0]} and "
            f"{where[1]}); mma.sync.aligned needs all 32 lanes at the same instruction"
        )
    return None


def _turn_site(outer: Any) -> _BarrierSite:
    """Where the generator ``outer`` (a kernel) waits: the innermost frame of its
    ``yield from`` chain outside this file, and the kernel's own line."""
    inner = outer
    while inner.gi_yieldfrom is not None:  # the one that yielded is never a wrapper
        inner = inner.gi_yieldfrom
    return _BarrierSite(racecheck.line_of(inner.gi_frame) + racecheck.line_of(outer.gi_frame)[1:])


def _unseen_barrier(*_: Any) -> None:
    raise RuntimeError(
        "internal error: a kernel reached a barrier through a call the simulator could "
        "not follow in its source; set COURSE_RACECHECK=0 and report it"
    )
