"""Find float64 arithmetic in float32 kernels: what the simulator cannot show.

In the simulator a kernel runs as NumPy code and stores float32 results, so a
kernel that computes in float64 -- a bare literal (``x[i] * 2.0``), an
accumulator started as ``acc = 0.0``, a Python float passed at launch -- gives
the same numbers as a float32 one. On a GPU it runs float64 instructions and
conversions: 1/64 of the float32 rate on GeForce and workstation cards, 1/2 on
an H100, and twice the registers. This module types each kernel with Numba's
real CUDA compiler and names every line that makes a float64:

    line 42 of exercises.py: `acc = 0.0` makes acc float64; write acc = np.float32(0.0)

How: Numba's CUDA front end (type inference, then lowering to LLVM IR) runs in
llvmlite and needs neither a GPU nor NVVM; only PTX generation needs NVVM, and
nothing here asks for PTX. The types read are the compiled code's own
(``CUDACompileResult.type_annotation``), for the argument types of each real
launch. The simulator has replaced ``numba.cuda`` in a process that runs
kernels, so the typing runs in a helper process started with
``NUMBA_ENABLE_CUDASIM=0`` (one per test process, started on first use: about
1 s; then 0.2-0.9 s a kernel; results are cached on disk under
``.pytest_cache/float32_purity`` by file contents, kernel and argument types).
It runs the same on a GPU machine, where it never touches the device.

Where it cannot run: without ``numba-cuda``'s CUDA target (the course always
installs it), or for a kernel referring to a global it cannot send to the
helper (anything but numbers, NumPy scalars and dtypes, Numba types, modules,
importable functions and device functions). It then raises
:class:`Float32PurityUnavailable`, which :func:`float32_pure_launches` turns
into a warning (the values are still checked).

Use::

    with float32_pure_launches():          # every kernel launched inside is
        scaled_add(alpha, x, y, out)       # checked for float64 on leaving
    assert_float32_pure(kernel, (x, out))  # one kernel; example arguments or Numba types
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import hashlib
import linecache
import marshal
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import types as pytypes
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..checking import CheckError

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".pytest_cache" / "float32_purity"
_CACHE_VERSION = "3"  # bump when the analysis changes, so old cached verdicts are dropped
_TYPING_CC = (8, 0)  # any compute capability gives the same types; 8.0 has every intrinsic used
_REQUEST_TIMEOUT_S = 300.0
MAX_LINES_SHOWN = 6


class Float32PurityUnavailable(RuntimeError):
    """The float64 check could not run here (see the module docstring for when)."""


class Float64Use(NamedTuple):
    """One source line that makes a float64 value."""

    file: str
    line: int
    source: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line} of {Path(self.file).name}: `{self.source}` {self.message}"


# ----------------------------------------------------------------- the parent side


def _numba_type(value: Any) -> Any:
    """A Numba type from a Numba type, or from an example argument (host or device array,
    scalar): what a launch with that argument would compile for."""
    import numba
    from numba.core import types

    if isinstance(value, types.Type):
        return value
    if isinstance(value, type) and issubclass(value, np.generic):  # np.float32 as a type
        return numba.from_dtype(np.dtype(value))
    return numba.typeof(value)


def _is_jit_function(value: Any) -> bool:
    return type(value).__name__ in ("FakeCUDAKernel", "CUDADispatcher") and hasattr(
        value, "py_func"
    )


def _is_device_function(value: Any) -> bool:
    if hasattr(value, "_device"):  # simulator
        return bool(value._device)
    return bool(getattr(value, "targetoptions", {}).get("device"))


def _simple(value: Any) -> bool:
    from numba.core import types

    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, np.generic, np.dtype, types.Type)
    ):
        return True
    if isinstance(value, tuple):
        return all(_simple(v) for v in value)
    return False


def _importable(module: str) -> bool:
    # Chapter files load under names such as "chapters.05_first_kernels.x", and test
    # files by path: the helper process cannot import either by name.
    return (
        bool(module)
        and not module.startswith("chapters.")
        and module in sys.modules
        and (
            getattr(sys.modules[module], "__spec__", None) is not None
            and sys.modules[module].__spec__.origin is not None
            and not Path(sys.modules[module].__spec__.origin).name.startswith("test_")
        )
    )


def _names_used(code: pytypes.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            names |= _names_used(const)
    return names


def _value_spec(value: Any, memo: dict[int, Any]) -> Any:
    """How to rebuild ``value`` in the helper process, or None if it cannot be sent."""
    if isinstance(value, pytypes.ModuleType):
        return ("module", value.__name__)
    if _is_jit_function(value):
        py = value.py_func
        if not _is_device_function(value):
            return None  # a kernel cannot call a kernel: never used in typing
        if _importable(py.__module__) and py.__module__.startswith("numba"):
            return ("qualified", py.__module__, py.__qualname__)  # e.g. numba.cuda.random
        return ("device", _function_spec(py, memo))
    if _simple(value):
        return ("value", value)
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if (
        isinstance(module, str)
        and isinstance(qualname, str)
        and "<" not in qualname
        and _importable(module)
    ):
        return ("qualified", module, qualname)
    return None


def _function_spec(fn: pytypes.FunctionType, memo: dict[int, Any]) -> dict[str, Any]:
    if id(fn) in memo:
        return memo[id(fn)]
    code = fn.__code__
    spec: dict[str, Any] = {
        "code": marshal.dumps(code),
        "name": fn.__name__,
        "qualname": fn.__qualname__,
        "module": fn.__module__,
        "file": code.co_filename,
        "firstlineno": code.co_firstlineno,
        "globals": {},
        "unsent": [],
        "closure": [],
        "defaults": fn.__defaults__ if _simple(fn.__defaults__) else None,
    }
    memo[id(fn)] = spec
    for name in sorted(_names_used(code)):
        if name not in fn.__globals__:
            continue  # a builtin, or an attribute name
        vspec = _value_spec(fn.__globals__[name], memo)
        if vspec is None:
            spec["unsent"].append(name)
        else:
            spec["globals"][name] = vspec
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        vspec = _value_spec(cell.cell_contents, memo)
        if vspec is None:
            raise Float32PurityUnavailable(
                f"cannot check {fn.__qualname__} for float64: its closure variable {name!r} "
                f"is a {type(cell.cell_contents).__name__}, which the typing process cannot rebuild"
            )
        spec["closure"].append(vspec)
    return spec


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "?"


def _spec_key(spec: Any, seen: set[int]) -> Any:
    """A stable stand-in for a request in the cache key (marshal output is not stable)."""
    if isinstance(spec, dict):
        if id(spec) in seen:
            return ("recursive", spec["qualname"])
        seen = seen | {id(spec)}
        return (
            "fn",
            spec["file"],
            _file_digest(spec["file"]),
            spec["qualname"],
            spec["firstlineno"],
            _spec_key(spec["globals"].items(), seen),
            _spec_key(spec["closure"], seen),
            tuple(spec["unsent"]),
            repr(spec["defaults"]),
        )
    if isinstance(spec, (list, tuple)) or type(spec).__name__ in ("dict_items",):
        return tuple(_spec_key(s, seen) for s in spec)
    return repr(spec)


class _Helper:
    """The typing process: NUMBA_ENABLE_CUDASIM=0, fed pickled requests on stdin."""

    def __init__(self) -> None:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", COURSE_FLOAT32_PURITY_HELPER="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "common.internal.float32_purity", "--helper"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _died(self, what: str) -> Float32PurityUnavailable:
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-2000:]
        return Float32PurityUnavailable(f"the CUDA typing process {what}:\n{tail}")

    def ask(self, request: Any) -> Any:
        data = pickle.dumps(request)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died("exited") from None
        header = self._read(8)
        return pickle.loads(self._read(struct.unpack("<Q", header)[0]))

    def _read(self, n: int) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            ready, _, _ = select.select([fd], [], [], _REQUEST_TIMEOUT_S)
            if not ready:
                self.close()
                raise Float32PurityUnavailable(
                    f"the CUDA typing process gave no answer in {_REQUEST_TIMEOUT_S:.0f} s"
                )
            chunk = os.read(fd, n - got)
            if not chunk:
                raise self._died("exited")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_helper: _Helper | None = None
_helper_lock = threading.Lock()
_memory_cache: dict[str, Any] = {}


def _close_helper() -> None:
    if _helper is not None:
        _helper.close()


atexit.register(_close_helper)


def _ask_helper(requests: list[Any]) -> list[Any]:
    global _helper
    with _helper_lock:
        if _helper is None or not _helper.alive():
            _helper = _Helper()
        return _helper.ask(requests)


def _analyse(items: list[tuple[Any, tuple[Any, ...], tuple[str, int] | None]]) -> list[Any]:
    """Verdicts for (py_func, argtypes, launch site) items: cached, else one helper round trip."""
    keys, requests, todo = [], [], []
    for i, (fn, argtypes, _) in enumerate(items):
        spec = _function_spec(fn, {})
        key = hashlib.sha256(
            repr((_CACHE_VERSION, _spec_key(spec, set()), tuple(str(t) for t in argtypes))).encode()
        ).hexdigest()
        keys.append(key)
        if key in _memory_cache:
            continue
        path = CACHE_DIR / f"{key}.pickle"
        try:
            _memory_cache[key] = pickle.loads(path.read_bytes())
            continue
        except Exception:  # noqa: BLE001  (no cache entry, or a stale one: ask again)
            pass
        requests.append((spec, argtypes))
        todo.append(i)
    if requests:
        answers = _ask_helper(requests)
        for i, answer in zip(todo, answers):
            _memory_cache[keys[i]] = answer
            if answer[0] != "unavailable":
                with contextlib.suppress(OSError):
                    CACHE_DIR.mkdir(parents=True, exist_ok=True)
                    tmp = CACHE_DIR / f"{keys[i]}.{os.getpid()}.tmp"
                    tmp.write_bytes(pickle.dumps(answer))
                    tmp.replace(CACHE_DIR / f"{keys[i]}.pickle")
    return [_memory_cache[k] for k in keys]


def _arg_names(fn: pytypes.FunctionType) -> tuple[str, ...]:
    code = fn.__code__
    return code.co_varnames[: code.co_argcount]


def _uses_from(
    answer: Any, fn: pytypes.FunctionType, argtypes: tuple[Any, ...], site: tuple[str, int] | None
) -> list[Float64Use]:
    kind = answer[0]
    if kind == "unavailable":
        raise Float32PurityUnavailable(f"cannot check {fn.__qualname__} for float64: {answer[1]}")
    if kind == "does_not_compile":
        raise CheckError(
            f"{fn.__qualname__} does not compile for a GPU with arguments "
            f"({', '.join(map(str, argtypes))}), although the simulator runs it:\n{answer[1]}"
        )
    uses = []
    for finding in answer[1]:
        if finding["kind"] == "argument" and site is not None:
            file, line = site
            uses.append(
                Float64Use(
                    file,
                    line,
                    _source_line(file, line),
                    f"(the launch of {fn.__name__}) {finding['message']}",
                )
            )
        else:
            uses.append(
                Float64Use(finding["file"], finding["line"], finding["source"], finding["message"])
            )
    return uses


def float64_uses(kernel: Any, argtypes: Sequence[Any]) -> list[Float64Use]:
    """Every line of ``kernel`` (and the device functions it calls) that makes a float64.

    Args:
        kernel: a ``cuda.jit`` kernel or device function (simulator or GPU), or a
            plain Python function written for ``cuda.jit``.
        argtypes: one entry per parameter: a Numba type (``numba.float32[:]``), or an
            example argument (host or device array, NumPy or Python scalar), typed as
            a launch with it would be (a Python float is float64).

    Returns:
        The uses, in source order; empty for a float32-pure kernel.

    Raises:
        CheckError: the kernel does not compile for a GPU with these types.
        Float32PurityUnavailable: the check cannot run here (see the module docstring).
    """
    fn = kernel.py_func if _is_jit_function(kernel) else kernel
    types_ = tuple(_numba_type(a) for a in argtypes)
    if len(types_) != fn.__code__.co_argcount:
        raise TypeError(
            f"{fn.__name__} takes {fn.__code__.co_argcount} arguments, "
            f"got {len(types_)} argument types"
        )
    (answer,) = _analyse([(fn, types_, None)])
    return _uses_from(answer, fn, types_, None)


def _format(fn: pytypes.FunctionType, uses: list[Float64Use]) -> str:
    shown = "\n  ".join(str(u) for u in uses[:MAX_LINES_SHOWN])
    more = f"\n  ... and {len(uses) - MAX_LINES_SHOWN} more" if len(uses) > MAX_LINES_SHOWN else ""
    return (
        f"{fn.__name__} computes in float64 (the simulator cannot tell: it stores float32 "
        f"anyway; a GPU runs float64 at 1/2 to 1/64 of the float32 rate):\n  {shown}{more}"
    )


def assert_float32_pure(kernel: Any, argtypes: Sequence[Any]) -> None:
    """Raise CheckError naming each line of ``kernel`` that makes a float64.

    Arguments as :func:`float64_uses`. Raises Float32PurityUnavailable where the
    check cannot run.
    """
    uses = float64_uses(kernel, argtypes)
    if uses:
        fn = kernel.py_func if _is_jit_function(kernel) else kernel
        raise CheckError(_format(fn, uses))


def _launch_site() -> tuple[str, int] | None:
    """The first frame outside numba and the course's common/ package: the line
    that launched."""
    frame = sys._getframe(2)
    course_common = Path(__file__).resolve().parents[1]
    while frame is not None:
        file = frame.f_code.co_filename
        if "numba" not in Path(file).parts and course_common not in Path(file).resolve().parents:
            return file, frame.f_lineno
        frame = frame.f_back
    return None


@contextlib.contextmanager
def recording_launches() -> Iterator[list[tuple[Any, tuple[Any, ...], tuple[str, int] | None]]]:
    """Record (py_func, argument types, launch site) of every kernel launched inside.

    Works in the simulator (wraps ``FakeCUDAKernel.__call__``) and on a GPU (wraps
    ``CUDADispatcher.call``); device-function calls are not launches and are not recorded.
    """
    from ..runtime import is_simulator

    launches: list[tuple[Any, tuple[Any, ...], tuple[str, int] | None]] = []

    def record(py_func: Any, args: tuple[Any, ...]) -> None:
        try:
            launches.append((py_func, tuple(_numba_type(a) for a in args), _launch_site()))
        except Exception:  # noqa: BLE001  (an argument Numba cannot type: the launch will say)
            pass

    if is_simulator():
        from numba.cuda.simulator import kernel as sim_kernel

        cls, attr = sim_kernel.FakeCUDAKernel, "__call__"
        inner = cls.__call__

        def wrapper(self: Any, *args: Any) -> Any:
            if not (self._device or sim_kernel._kernel_context):
                record(self.fn, args)
            return inner(self, *args)
    else:
        from numba.cuda.dispatcher import CUDADispatcher

        cls, attr = CUDADispatcher, "call"
        inner = CUDADispatcher.call

        def wrapper(self: Any, args: Any, *rest: Any, **kw: Any) -> Any:
            record(self.py_func, tuple(args))
            return inner(self, args, *rest, **kw)

    setattr(cls, attr, wrapper)
    try:
        yield launches
    finally:
        setattr(cls, attr, inner)


@contextlib.contextmanager
def float32_pure_launches() -> Iterator[None]:
    """Check every kernel launched inside the block for float64, on leaving it.

    Each distinct (kernel, argument types) is typed once. Nothing is checked if
    the block raises (its error comes first).

    Raises:
        CheckError: a launched kernel computes in float64 (each line named), or does
            not compile for a GPU.

    Warns:
        UserWarning: the check cannot run here (Float32PurityUnavailable's message).
    """
    with recording_launches() as launches:
        yield
    unique: dict[tuple[Any, tuple[str, ...]], tuple[Any, tuple[Any, ...], Any]] = {}
    for fn, argtypes, site in launches:
        unique.setdefault((fn, tuple(map(str, argtypes))), (fn, argtypes, site))
    if not unique:
        return
    items = list(unique.values())
    try:
        answers = _analyse(items)
        problems = []
        for (fn, argtypes, site), answer in zip(items, answers):
            uses = _uses_from(answer, fn, argtypes, site)
            if uses:
                problems.append(_format(fn, uses))
    except Float32PurityUnavailable as e:
        warnings.warn(f"float64 check skipped: {e}", stacklevel=3)
        return
    if problems:  # one kernel factory called with other sizes gives the same text
        raise CheckError("\n".join(dict.fromkeys(problems)))


# ----------------------------------------------------------------- the helper process


def _ir() -> Any:
    """Numba's IR module as the CUDA compiler uses it: numba-cuda 0.2x+ carries its own copy."""
    try:
        from numba.cuda.core import ir
    except ImportError:  # older numba-cuda: the IR of numba itself
        from numba.core import ir
    return ir


# Names, not classes: numba-cuda has its own copies of Numba's type classes.
def _is_f64(ty: Any) -> bool:
    return str(ty) in ("float64", "complex128") or str(ty).startswith("Literal[float]")


def _single(ty: Any) -> tuple[str, str]:
    """(what ty is, the single-precision type to write instead): complex128 wants
    np.complex64, every other float64 np.float32."""
    return ("complex128", "np.complex64") if str(ty) == "complex128" else ("float64", "np.float32")


def _is_int(ty: Any) -> bool:
    return str(ty).startswith(("int", "uint", "bool", "Literal[int]", "Literal[bool]"))


def _helper_value(vspec: Any, memo: dict[int, Any]) -> Any:
    import importlib

    kind = vspec[0]
    if kind == "value":
        return vspec[1]
    if kind == "module":
        return importlib.import_module(vspec[1])
    if kind == "qualified":
        obj: Any = importlib.import_module(vspec[1])
        for part in vspec[2].split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "device":
        from numba import cuda

        spec = vspec[1]
        if id(spec) not in memo:
            memo[id(spec)] = None  # a recursive device function: typing will say
            memo[id(spec)] = cuda.jit(device=True)(_helper_function(spec, memo))
        return memo[id(spec)]
    raise ValueError(f"unknown value kind {kind!r}")


def _helper_function(spec: dict[str, Any], memo: dict[int, Any]) -> pytypes.FunctionType:
    g: dict[str, Any] = {"__builtins__": builtins, "__name__": spec["module"]}
    for name, vspec in spec["globals"].items():
        try:
            g[name] = _helper_value(vspec, memo)
        except Exception:  # noqa: BLE001  (unresolvable here: typing says if it is used)
            spec["unsent"].append(name)
    closure = tuple(pytypes.CellType(_helper_value(v, memo)) for v in spec["closure"])
    fn = pytypes.FunctionType(
        marshal.loads(spec["code"]), g, spec["name"], spec["defaults"], closure or None
    )
    fn.__qualname__ = spec["qualname"]
    return fn


def _describe(var: Any, defs: dict[str, Any], typemap: dict[str, Any], argnames: set[str]) -> str:
    ir = _ir()

    value = defs.get(var.name)
    if isinstance(value, ir.Const):
        return f"the literal {value.value!r}"
    if isinstance(value, ir.Arg) or var.name in argnames:
        return f"argument {getattr(value, 'name', var.name)}"
    if not var.name.startswith("$"):
        return var.name.split(".")[0]
    return "a float64 value"


def _source_line(file: str, line: int) -> str:
    text = linecache.getline(file, line)
    if "  #" in text:  # drop a trailing comment (never inside a string in kernel code)
        text = text[: text.index("  #")]
    return text.strip() or f"<line {line}>"


def _source(loc: Any) -> str:
    return _source_line(loc.filename, loc.line)


def _callee_name(callee_def: Any) -> str:
    """A called function's name from its definition in the IR: a global's name, a
    module attribute, or "a call". (An ir.Expr raises KeyError, not
    AttributeError, for a field it lacks, so getattr's default does not apply.)"""
    for field in ("name", "attr"):
        try:
            value = getattr(callee_def, field)
        except (AttributeError, KeyError):
            continue
        if value:
            return str(value)
    return "a call"


def _findings(cres: Any, where: str, seen: set[Any]) -> list[dict[str, Any]]:
    """float64 uses in one compiled function and the device functions it calls."""
    ir = _ir()

    ta = cres.type_annotation
    typemap, calltypes = ta.typemap, ta.calltypes
    defs: dict[str, Any] = {}
    for blk in ta.blocks.values():
        for st in blk.body:
            if isinstance(st, ir.Assign):
                defs.setdefault(st.target.name, st.value)
    argnames = {v.name for v in defs.values() if isinstance(v, ir.Arg)}
    found: list[tuple[int, dict[str, Any]]] = []  # (priority, finding): lower is the cause

    def add(priority: int, loc: Any, message: str, kind: str = "line") -> None:
        found.append(
            (
                priority,
                {
                    "kind": kind,
                    "file": loc.filename,
                    "line": loc.line,
                    "source": _source(loc),
                    "message": message + where,
                },
            )
        )

    for blk in ta.blocks.values():
        for st in blk.body:
            if not isinstance(st, ir.Assign):
                continue
            target, value, loc = st.target, st.value, st.loc
            ty = typemap.get(target.name)
            user_var = not target.name.startswith("$")
            name = target.name.split(".")[0]
            if isinstance(value, ir.Arg):
                if _is_f64(ty):
                    add(
                        0,
                        loc,
                        f"argument {value.name} is {ty}: the launch passes a Python float "
                        "or a float64 array; pass np.float32(...) or a float32 array",
                        "argument",
                    )
                continue
            if isinstance(value, ir.Const):
                if _is_f64(ty) and user_var:
                    wide, single = _single(ty)
                    add(1, loc, f"makes {name} {wide}; write {name} = {single}({value.value!r})")
                continue
            if isinstance(value, ir.Var):
                src = typemap.get(value.name)
                if _is_f64(ty) and user_var:
                    origin = defs.get(value.name)
                    if isinstance(origin, ir.Const):
                        wide, single = _single(ty)
                        add(
                            1,
                            loc,
                            f"makes {name} {wide}; write {name} = {single}({origin.value!r})",
                        )
                    elif not _is_f64(src):
                        add(
                            3,
                            loc,
                            f"makes {name} float64: it holds a {src} here and a float64 "
                            "elsewhere (e.g. one branch assigns a float literal or an int); use "
                            "np.float32 in every assignment",
                        )
                    # else: a copy of a float64 variable (loop headers, branch joins):
                    # the line that made the first one is reported
                elif _is_f64(ty) and not _is_f64(src):
                    add(
                        3,
                        loc,
                        f"mixes {src} with float64 in one value (an if/else or a loop "
                        "that assigns a float literal or an int in one place); use np.float32 "
                        "in every branch",
                    )
                continue
            if not isinstance(value, ir.Expr):
                continue
            if value.op == "call":
                fty = typemap.get(value.func.name)
                disp = getattr(fty, "dispatcher", None)
                sig = calltypes.get(value)
                library = str(getattr(getattr(disp, "py_func", None), "__module__", "")).startswith(
                    "numba"
                )  # e.g. numba.cuda.random: not the learner's
                if (
                    disp is not None
                    and sig is not None
                    and hasattr(disp, "overloads")
                    and not library
                ):
                    callee = disp.overloads.get(tuple(sig.args))
                    key = (id(disp), tuple(sig.args))
                    if callee is not None and key not in seen:
                        seen.add(key)
                        found.extend(
                            (4, f)
                            for f in _findings(
                                callee, f" (in device function {disp.py_func.__name__})", seen
                            )
                        )
                if _is_f64(ty):
                    callee_name = _callee_name(defs.get(value.func.name))
                    f64_args = [a for a in value.args if _is_f64(typemap.get(a.name))]
                    why = (
                        f"because {_describe(f64_args[0], defs, typemap, argnames)} is float64"
                        if f64_args
                        else "(a float64-only function, or a float() conversion)"
                    )
                    add(
                        4,
                        loc,
                        f"calls {callee_name}, which returns float64 here {why}; "
                        "give it float32 arguments",
                    )
                continue
            if value.op in ("binop", "inplace_binop", "unary"):
                operands = [value.value] if value.op == "unary" else [value.lhs, value.rhs]
                otypes = [typemap.get(v.name) for v in operands]
                f64_ops = [v for v, t in zip(operands, otypes) if _is_f64(t)]
                if not (f64_ops or _is_f64(ty)):
                    continue
                op = getattr(value.fn, "__name__", str(value.fn))
                if f64_ops:
                    what = _describe(f64_ops[0], defs, typemap, argnames)
                    wide, single = _single(typemap.get(f64_ops[0].name))
                    if what.startswith("the literal"):
                        v = defs[f64_ops[0].name].value
                        add(
                            1,
                            loc,
                            f"computes in float64: {what} is a {wide}; write {single}({v!r})",
                        )
                    elif what.startswith("argument"):
                        add(
                            2,
                            loc,
                            f"computes in float64: {what} is {wide} (a Python {wide.rstrip('0123456789')} "
                            f"passed at launch?); pass {single}(...) when launching",
                        )
                    else:
                        add(5, loc, f"computes in float64: {what} is {wide}")
                elif all(_is_int(t) for t in otypes):
                    add(
                        2,
                        loc,
                        f"divides integers ({op}), which gives a float64; write "
                        "np.float32(a) / np.float32(b)",
                    )
                else:
                    add(
                        2,
                        loc,
                        "computes in float64: an integer mixed with a float32 gives "
                        "float64 in Numba; convert the integer first, np.float32(i)",
                    )
                continue
            if _is_f64(ty) and user_var:
                add(5, loc, f"makes {name} float64")

    best: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
    for priority, f in found:
        k = (f["file"], f["line"])
        if k not in best or priority < best[k][0]:
            best[k] = (priority, f)
    return [
        f
        for _, f in sorted(
            best.values(),
            key=lambda pf: (pf[1]["kind"] != "argument", pf[1]["file"], pf[1]["line"]),
        )
    ]


def _helper_answer(spec: dict[str, Any], argtypes: tuple[Any, ...]) -> Any:
    from numba.core import types
    from numba.cuda import compiler

    try:
        fn = _helper_function(spec, {})
    except Exception as e:  # noqa: BLE001
        return ("unavailable", f"could not rebuild it for typing: {type(e).__name__}: {e}")
    try:
        cres = compiler.compile_cuda(fn, types.void, argtypes, cc=_TYPING_CC)
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
        unsent = [n for n in spec["unsent"] if f"'{n}'" in text]
        if unsent:
            return (
                "unavailable",
                f"it uses {', '.join(unsent)}, which cannot be sent to the "
                "typing process (only numbers, NumPy scalars, Numba types, modules, "
                "importable functions and device functions can)",
            )
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return ("does_not_compile", "\n".join(lines[:12]))
    return ("ok", _findings(cres, "", set()))


def _helper_main() -> int:
    import numba.cuda.dispatcher as cuda_dispatcher

    # Device functions ask the current device for its compute capability before
    # compiling; typing needs no device, so answer for one.
    cuda_dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(
        compute_capability=_TYPING_CC
    )
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the log, never into the channel
    warnings.simplefilter("ignore")
    while True:
        header = channel_in.read(8)
        if len(header) < 8:
            return 0
        requests = pickle.loads(channel_in.read(struct.unpack("<Q", header)[0]))
        answers = [_helper_answer(spec, argtypes) for spec, argtypes in requests]
        data = pickle.dumps(answers)
        channel_out.write(struct.pack("<Q", len(data)) + data)
        channel_out.flush()


if __name__ == "__main__" and "--helper" in sys.argv:
    sys.exit(_helper_main())
