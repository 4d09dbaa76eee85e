"""A deterministic race detector for Numba's CUDA simulator.

On a GPU, ``compute-sanitizer --tool racecheck`` reports shared-memory hazards:
two threads of a block touch the same element between two barriers and at least
one of them writes. The simulator sees every array access a kernel makes, so it
can do the same, for shared *and* global memory, and it does it on every launch
(tests, exercises, chapter scripts), not only when someone thinks of asking.

How it works
------------
Each access to a kernel argument (global memory) or a ``cuda.shared.array`` is
recorded per element (by its byte address, so views and slices of one buffer
are the same memory) with the thread, its block, the thread's *epoch* (how many
``cuda.syncthreads()`` it has passed), whether it was part of a
``cuda.atomic.*`` call, and the source line. Two accesses by different threads
to one element *conflict* when at least one writes and they are not both
atomic. A conflict is a race unless the two are *ordered*:

* same block, different epochs: a barrier separates them;
* different blocks (or no barrier between): the writer ran
  ``cuda.threadfence()`` after its write and then it, or a thread of its block
  after a barrier, made an atomic call (a *release*), and the other thread made
  an atomic call after that release (an *acquire*), itself or a thread of its
  block before a barrier it then passed. This is the last-block pattern:
  partials, a fence, an atomic ticket, the last block reads them.

Accesses are only appended to a log while the block runs (no lock: hundreds of
simulated threads contending for one would cost more than the kernel); the
block's log is replayed in clock order when the block ends, and the replay
decides. The decision depends only on *which* accesses happen, never on the order the
simulated threads happened to run in, so a race is reported on every run, not
by luck: a plain ``h[b] += 1`` from two threads is two reads and two writes of
one element, unordered, and is reported however the threads interleave. Blocks
run one after another in the simulator, so their updates are never actually
lost there; the detector reports them anyway, because on a GPU they are.

The report names the kernel, the array, the element, the two threads (block and
thread index) and both source lines, and says what usually fixes it.

What it cannot see: races inside warp-synchronous code that relies on lanes
running in lockstep (the simulator has no warps; on a Volta or newer GPU such
code is racy without ``cuda.syncwarp()`` anyway), accesses through record
fields, and memory shared between two launches (those are ordered). Kernels
that race on purpose (a demonstration of a lost update) say so with
:func:`intentional_race`.

Switch it off for speed with ``COURSE_RACECHECK=0``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import linecache
import operator
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import (  # defined with the course's other errors; re-exported here
    DeadlockError,
    RaceError,
)

ENABLED = os.environ.get("COURSE_RACECHECK", "1").strip() not in ("0", "off", "no", "false")

_launch: _Launch | None = None
_allowed: list[str] = []
_state_lock = threading.Lock()
_first_launches_only = False
_checked_kernels: set[Any] = set()


@contextlib.contextmanager
def first_launch_of_each_kernel() -> Iterator[None]:
    """Inside this block only the first launch of each kernel is checked.

    For long runs of the same kernels (the capstone's training loop in the
    simulator): checking costs several times the launch itself, and a kernel's
    races show on its first launch unless they depend on the data.
    """
    global _first_launches_only
    previous = _first_launches_only
    _first_launches_only = True
    try:
        yield
    finally:
        _first_launches_only = previous


@contextlib.contextmanager
def intentional_race(reason: str) -> Iterator[None]:
    """Launches inside this block are not checked for races; ``reason`` says why.

    For demonstrations only (chapter 05's lost-update counter): a kernel the
    course wants to race, to show what a race does.
    """
    if not reason:
        raise ValueError("say why this launch may race")
    _allowed.append(reason)
    try:
        yield
    finally:
        _allowed.pop()


# --------------------------------------------------------------------------
# Per-launch state
# --------------------------------------------------------------------------


class _Thread:
    """What the detector knows about one simulated CUDA thread."""

    __slots__ = ("block", "thread", "epoch", "fences", "acquire", "launch", "spin_at", "spins")

    def __init__(self, block: tuple[int, int, int], thread: tuple[int, int, int]) -> None:
        self.block = block
        self.thread = thread
        self.epoch = 0
        self.fences: list[tuple[int, int]] = []  # (time, epoch) of each threadfence
        self.acquire = -1  # time of the latest atomic this thread is ordered after
        self.launch: _Launch | None = None
        self.spin_at: tuple[int, Any] | None = None  # (address, value) of the last unchanged atomic
        self.spins = 0  # how many atomics in a row read that value there and left it

    def name(self) -> str:
        b, t = self.block, self.thread
        return f"thread ({t[0]},{t[1]},{t[2]}) of block ({b[0]},{b[1]},{b[2]})"


class _Block:
    __slots__ = ("releases", "barrier_acquire")

    def __init__(self) -> None:
        self.releases: list[tuple[_Thread, int, int]] = []  # (thread, epoch, time)
        self.barrier_acquire: dict[int, int] = {}


class _Access:
    __slots__ = ("who", "time", "epoch", "atomic", "line", "write", "update")

    def __init__(
        self,
        who: _Thread,
        time: int,
        epoch: int,
        atomic: bool,
        line: tuple[str, int],
        write: bool,
        update: bool = False,
    ) -> None:
        self.who = who
        self.time = time
        self.epoch = epoch
        self.atomic = atomic
        self.line = line
        self.write = write
        self.update = update  # a write by a thread that read the element first


class _Element:
    __slots__ = ("write", "reads")

    def __init__(self) -> None:
        self.write: _Access | None = None
        self.reads: dict[_Thread, _Access] = {}


class _Launch:
    def __init__(self, kernel: Any) -> None:
        self.kernel = getattr(kernel, "__name__", str(kernel))
        self.clock = itertools.count()
        self.lock = threading.Lock()  # for the rare events: barriers, fences, atomics
        self.log: list[tuple[Any, ...]] = []
        self.global_mem: dict[int, _Element] = {}
        self.shared_mem: dict[int, _Element] = {}
        self.blocks: dict[tuple[int, int, int], _Block] = {}
        # id(array) -> (array, data address, shape, strides), for _address
        self.bases: dict[int, tuple[Any, int, tuple[int, ...], tuple[int, ...]]] = {}

    def base(self, ary: np.ndarray) -> int:
        return self.layout(ary)[1]

    def release(self) -> None:
        """Drop the records once the launch is decided. They hold its threads,
        which hold the launch: cycles that reference counting alone never frees."""
        self.log = []
        self.global_mem.clear()
        self.shared_mem.clear()
        self.blocks.clear()
        self.bases.clear()

    def layout(self, ary: np.ndarray) -> tuple[Any, int, tuple[int, ...], tuple[int, ...]]:
        """(ary, its data address, shape, strides), read once a launch: the
        detector asks for them at every element access."""
        key = id(ary)
        hit = self.bases.get(key)
        if hit is None:
            hit = (ary, ary.__array_interface__["data"][0], ary.shape, ary.strides)
            self.bases[key] = hit  # keeps `ary` alive, so its id is not reused
        return hit

    def block(self, who: _Thread) -> _Block:
        b = self.blocks.get(who.block)
        if b is None:
            b = self.blocks[who.block] = _Block()
        return b


def _host_array(arg: Any) -> np.ndarray | None:
    if isinstance(arg, np.ndarray):
        return arg
    ary = getattr(arg, "_ary", None)
    return ary if isinstance(ary, np.ndarray) else None


_current_thread = threading.current_thread


def _me() -> _Thread | None:
    """The calling simulated thread's state in the current launch, or None (the host,
    or a thread left over from an earlier launch that raised)."""
    t = threading.current_thread()
    state = getattr(t, "_race_state", None)
    if state is None:
        idx = getattr(t, "threadIdx", None)
        if idx is None or _launch is None:
            return None
        state = _Thread(tuple(t.blockIdx), tuple(idx))
        state.launch = _launch
        t._race_state = state
    return state if state.launch is _launch else None


def _address(launch: _Launch, ary: np.ndarray, idx: Any) -> int | None:
    """Byte address of ``ary[idx]`` for an integer index; None for anything else."""
    hit = launch.bases.get(id(ary))
    if hit is None:
        hit = launch.layout(ary)
    _, addr, shape, strides = hit
    try:
        if type(idx) is not tuple:  # a 1-D array's element, the common case
            if len(shape) != 1:
                return None
            i = int(idx)
            return addr + (i + shape[0] if i < 0 else i) * strides[0]
        if len(idx) != len(shape):
            return None
        if len(idx) == 2:  # the next most common: unrolled
            i, j = idx
            i, j = int(i), int(j)
            if i < 0:
                i += shape[0]
            if j < 0:
                j += shape[1]
            return addr + i * strides[0] + j * strides[1]
        for i, n, s in zip(idx, shape, strides):
            i = int(i)
            addr += (i + n if i < 0 else i) * s
    except TypeError:  # a slice or an array index: not one element
        return None
    return addr


def _ordered(p: _Access, a_who: _Thread, a_epoch: int, a_acquire: int, launch: _Launch) -> bool:
    """True if access ``p`` happens before an access by ``a_who`` in ``a_epoch``,
    made when ``a_who`` was ordered after the atomics up to time ``a_acquire``."""
    if p.who is a_who:
        return True
    if p.who.block == a_who.block and p.epoch != a_epoch:
        return True  # a barrier between them
    if a_acquire < 0:
        return False
    # Released: the writer fenced after p, then it (or, after a barrier, a thread of
    # its block) made an atomic call before the other thread's acquire.
    for f_time, f_epoch in p.who.fences:
        if f_time <= p.time:
            continue
        for releaser, r_epoch, r_time in launch.block(p.who).releases:
            if r_time >= a_acquire:
                break
            if r_time > f_time and (releaser is p.who or r_epoch > f_epoch):
                return True
        return False
    return False


# id(code) -> (code, {instruction offset: (file, line)}), for line_of
_lines: dict[int, tuple[Any, dict[int, tuple[str, int]]]] = {}


def line_of(frame: Any) -> tuple[str, int]:
    """(file, line) of the instruction ``frame`` is at: ``frame.f_lineno``, which
    decodes the code's line table from its start on every read (over a
    microsecond in a long kernel, as much as the rest of a recorded access),
    read once per instruction. Keyed by the code's id: hashing a code object
    hashes its contents; the table holds the code, so its id is not reused."""
    code, offset = frame.f_code, frame.f_lasti
    table = _lines.get(id(code))
    if table is None or table[0] is not code:
        table = _lines[id(code)] = (code, {})
    line = table[1].get(offset)
    if line is None:
        line = table[1][offset] = (code.co_filename, frame.f_lineno)
    return line


def record(ary: np.ndarray, idx: Any, write: bool, shared: bool, depth: int = 3) -> None:
    """Log one access to ``ary[idx]`` by the calling simulated thread.

    Only a log entry here, without a lock: hundreds of simulated threads take turns
    under the GIL, and a lock they all contend for would cost more than the kernel.
    The block's log is replayed in clock order when the block ends
    (:func:`on_block_end`), which decides and reports.
    """
    launch = _launch
    if launch is None or _allowed:
        return
    t = _current_thread()
    who = getattr(t, "_race_state", None)
    if who is None:
        who = _me()  # the thread's first access in this launch
        if who is None:
            return
    elif who.launch is not launch:
        return
    addr = _address(launch, ary, idx)
    if addr is None:
        return
    atomic = getattr(t, "_race_atomic", False)
    if atomic:
        depth += 2  # the atomic's own two frames
    frame = sys._getframe(depth - 1)  # the kernel's line (depth counts from a helper)
    line = line_of(frame)
    launch.log.append(
        (
            next(launch.clock),
            who,
            who.epoch,
            who.acquire,
            addr,
            shared,
            write,
            atomic,
            line,
            frame,
            ary,
            idx,
        )
    )


_clock_of = operator.itemgetter(0)


def on_block_end() -> None:
    """Replay the block's accesses in the order they happened; raise RaceError on
    the first race. The verdict does not depend on that order: two unordered
    conflicting accesses are reported whichever came first."""
    __tracebackhide__ = True
    launch = _launch
    if launch is None:
        return
    log, launch.log = launch.log, []
    log.sort(key=_clock_of)
    for entry in log:
        _check(launch, *entry)


def _check(
    launch: _Launch,
    now: int,
    who: _Thread,
    epoch: int,
    acquire: int,
    addr: int,
    shared: bool,
    write: bool,
    atomic: bool,
    line: tuple[str, int],
    frame: Any,
    ary: np.ndarray,
    idx: Any,
) -> None:
    __tracebackhide__ = True
    mem = launch.shared_mem if shared else launch.global_mem
    el = mem.get(addr)
    if el is None:
        el = mem[addr] = _Element()
    w = el.write
    mine = el.reads.get(who)
    update = write and mine is not None and mine.epoch == epoch
    if (
        w is not None
        and w.who is not who
        and not (w.atomic and atomic)
        and (shared or not write or w.update or update)
        and not _ordered(w, who, epoch, acquire, launch)
    ):
        # In global memory two plain stores to one element are reported only
        # when one of them is an update (a lost `+=`): the same value stored by
        # many threads (a flag) is a common, benign pattern there.
        _report(launch, w, who, line, write, update, frame, addr, shared, ary, idx)
    if write:
        for r in el.reads.values():
            if (
                r.who is not who
                and not (r.atomic and atomic)
                and not _ordered(r, who, epoch, acquire, launch)
            ):
                _report(launch, r, who, line, write, update, frame, addr, shared, ary, idx)
        el.write = _Access(who, now, epoch, atomic, line, True, update)
        el.reads = {}
    else:
        el.reads[who] = _Access(who, now, epoch, atomic, line, False)


def _array_of(value: Any) -> np.ndarray | None:
    if isinstance(value, SharedArray):
        return value._ary
    item = getattr(value, "_item", None)  # the simulator's in-kernel array wrapper
    if item is not None:
        return _host_array(item)
    return value if isinstance(value, np.ndarray) else None


def _where(frame: Any, addr: int, ary: np.ndarray, idx: Any, shared: bool) -> str:
    """``name[i, j]``: the kernel's variable holding the element, found in its frame."""
    index = idx if type(idx) is tuple else (idx,)
    candidates = []
    while frame is not None and len(candidates) < 1:
        for name, value in frame.f_locals.items():
            a = _array_of(value)
            if a is None or not a.size:
                continue
            start = a.__array_interface__["data"][0]
            if a is ary:
                return f"{name}[{', '.join(str(int(i)) for i in index)}]"
            if start <= addr < start + a.nbytes and a.flags.c_contiguous:
                k = (addr - start) // a.itemsize
                pos = np.unravel_index(k, a.shape)
                candidates.append(f"{name}[{', '.join(str(int(v)) for v in pos)}]")
        frame = frame.f_back
    if candidates:
        return candidates[0]
    kind = "a shared array" if shared else "an array"
    return f"{kind}[{', '.join(str(int(i)) for i in index)}]"


def _short(line: tuple[str, int]) -> str:
    return f"{os.path.basename(line[0])}:{line[1]}"


def _tid(t: _Thread) -> str:
    return "({},{},{})".format(*t.thread)


def _report(
    launch: _Launch,
    p: _Access,
    who: _Thread,
    line: tuple[str, int],
    write: bool,
    update: bool,
    frame: Any,
    addr: int,
    shared: bool,
    ary: np.ndarray,
    idx: Any,
) -> None:
    __tracebackhide__ = True
    where = _where(frame, addr, ary, idx, shared)
    same_block = p.who.block == who.block
    if same_block:
        threads = (
            f"threads {_tid(p.who)} and {_tid(who)} of block ({','.join(map(str, who.block))})"
        )
    else:
        threads = f"{p.who.name()} and {who.name()}"
    lines = _short(p.line) if p.line == line else f"{_short(p.line)} and {_short(line)}"
    updates = (p.update or _is_update(p.line)) and (update or _is_update(line))
    if updates or (p.write and write):
        verb = "updated" if updates else "wrote"
        barrier = " between two barriers" if same_block and shared else ""
        what = f"{threads} both {verb} {where} without an atomic{barrier} ({lines})"
        if updates:
            hint = "a `+=` from several threads loses updates: use cuda.atomic.add"
            if shared:
                hint += (
                    ", or give each thread its own element and combine them after "
                    "cuda.syncthreads()"
                )
        else:
            hint = (
                "each element should have one writer: check the index arithmetic, "
                "or use cuda.atomic.* if several threads must combine into it"
            )
    else:
        first, second = ("wrote", "read") if p.write else ("read", "wrote")
        what = f"{threads}: the first {first} {where}, the second {second} it ({lines})"
        if same_block:
            hint = (
                "with no cuda.syncthreads() between the two, the read may see the old "
                "or the new value: put a barrier between the write and the read (and "
                "one before the element is overwritten)"
            )
        else:
            hint = (
                "blocks run in any order on a GPU, so a block cannot rely on what "
                "another block writes in the same launch: split the work into two "
                "launches, or publish with cuda.threadfence() and an atomic ticket"
            )
    kind = "shared" if shared else "global"
    raise RaceError(f"race in kernel {launch.kernel} ({kind} memory): {what}; {hint}")


_UPDATE = re.compile(r"(\+=|-=|\*=|/=|\|=|&=|\^=|max\(|min\()")


def _is_update(line: tuple[str, int]) -> bool:
    return bool(_UPDATE.search(linecache.getline(*line)))


# --------------------------------------------------------------------------
# Events: barriers, fences, atomics, block starts, launches
# --------------------------------------------------------------------------


def on_barrier_arrive() -> None:
    launch, who = _launch, _me()
    if launch is None or who is None:
        return
    with launch.lock:
        blk = launch.block(who)
        prev = blk.barrier_acquire.get(who.epoch, -1)
        blk.barrier_acquire[who.epoch] = max(prev, who.acquire)


def on_barrier_leave() -> None:
    launch, who = _launch, _me()
    if launch is None or who is None:
        return
    with launch.lock:
        blk = launch.block(who)
        who.acquire = max(who.acquire, blk.barrier_acquire.get(who.epoch, -1))
        who.epoch += 1


def on_fence() -> None:
    launch, who = _launch, _me()
    if launch is None or who is None:
        return
    with launch.lock:
        who.fences.append((next(launch.clock), who.epoch))


def on_atomic_done() -> None:
    launch, who = _launch, _me()
    if launch is None or who is None:
        return
    with launch.lock:
        now = next(launch.clock)
        who.acquire = now
        # Every atomic may release what this thread (or its block, before a barrier)
        # fenced; _ordered decides whether a given write was covered.
        launch.block(who).releases.append((who, who.epoch, now))


# Atomics in a row that find one element at one value and leave it there before
# a waiting thread is reported: far more than any look-back or ticket loop needs
# when what it waits for has been written (the simulator runs a block's
# predecessors to the end before it starts).
SPIN_LIMIT = 1_000


def on_atomic_result(array: Any, index: Any, old: Any) -> None:
    """Report a thread that spins: SPIN_LIMIT atomics in a row on one element that
    each found ``old`` there and left it unchanged (``atomic.add(flags, j, 0)``
    in a loop waiting for another block's flag). In the simulator that block has
    finished (or never runs before this one ends), so the wait never ends."""
    launch, who = _launch, _me()
    ary = _array_of(array)
    if launch is None or who is None or ary is None:
        return
    addr = _address(launch, ary, index)
    if addr is None:
        return
    try:
        unchanged = bool(ary[index] == old)
    except (TypeError, ValueError):
        return
    key = (addr, old.item() if hasattr(old, "item") else old)
    if not unchanged or who.spin_at != key:
        who.spin_at, who.spins = (key if unchanged else None), 1
        return
    who.spins += 1
    if who.spins >= SPIN_LIMIT:
        frame = sys._getframe(2)  # the kernel's line: this, the atomic wrapper, the kernel
        element = ", ".join(str(int(i)) for i in (index if isinstance(index, tuple) else (index,)))
        raise DeadlockError(
            f"{who.name()} of kernel {launch.kernel} read element [{element}] "
            f"{who.spins} times in a row with an atomic and found {key[1]!r} every "
            f"time ({_short((frame.f_code.co_filename, frame.f_lineno))}): it waits for a value "
            "that no thread will write. The simulator runs blocks one after another, so "
            "every block this one could wait for has finished: the flag or ticket it "
            "waits for was never published (a missing write, or one behind a condition "
            "that is never true). On a GPU this kernel hangs."
        )


def on_block_start() -> None:
    """Shared memory is per block: a new block starts with none recorded."""
    launch = _launch
    if launch is not None:
        with launch.lock:
            launch.shared_mem.clear()


@contextlib.contextmanager
def launch(kernel: Any, args: tuple[Any, ...]) -> Iterator[None]:
    """Check one top-level kernel launch for races (no-op when switched off)."""
    global _launch
    if not ENABLED or _allowed:
        yield
        return
    if _first_launches_only:
        if kernel in _checked_kernels:
            yield
            return
        _checked_kernels.add(kernel)
    with _state_lock:
        _launch = current = _Launch(kernel)
    # The launch's records (an object or two per element access, alive until the
    # launch ends) are what Python's cyclic collector would walk again and again
    # while the kernel runs: up to a fifth of a racechecked launch's time. None of
    # them is cyclic garbage, so the collector waits until the launch ends, when
    # current.release() hands them back to reference counting.
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _launch = None
        current.release()
        if collecting:
            gc.enable()


# --------------------------------------------------------------------------
# Shared arrays: a thin proxy that records element accesses
# --------------------------------------------------------------------------


class SharedArray:
    """A block's ``cuda.shared.array`` in the simulator: an ndarray whose element
    reads and writes are recorded for the race detector."""

    __slots__ = ("_ary",)

    def __init__(self, ary: np.ndarray) -> None:
        self._ary = ary

    def __getitem__(self, idx: Any) -> Any:
        __tracebackhide__ = True
        ret = self._ary[idx]
        if type(ret) is np.ndarray:
            return SharedArray(ret)
        record(self._ary, idx, False, True)
        return ret

    def __setitem__(self, idx: Any, value: Any) -> None:
        __tracebackhide__ = True
        self._ary[idx] = value
        record(self._ary, idx, True, True)

    def __len__(self) -> int:
        return len(self._ary)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._ary if dtype is None else self._ary.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ary, name)

    def __repr__(self) -> str:
        return f"SharedArray({self._ary!r})"


# The simulator's cuda.atomic.* functions the detector wraps (each one orders,
# and is recorded as an atomic access).
ATOMIC_METHODS = (
    "add", "sub", "and_", "or_", "xor", "inc", "dec", "exch",
    "max", "min", "nanmax", "nanmin", "compare_and_swap", "cas",
)  # fmt: skip


def install() -> None:
    """Hook the detector into the simulator's arrays, barriers, fences and atomics."""
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi as sim_api
    from numba.cuda.simulator.cudadrv import devicearray as sim_da

    wrapper = sim_da.FakeWithinKernelCUDAArray
    if getattr(wrapper, "_course_racecheck", False):
        return
    fake_array = sim_da.FakeCUDAArray

    def getitem(self: Any, idx: Any) -> Any:
        __tracebackhide__ = True
        item = self._item
        ret = item._ary[idx]
        t = type(ret)
        if t is np.ndarray or t is np.void:
            return wrapper(fake_array(ret, stream=item.stream))
        if _launch is not None:
            record(item._ary, idx, False, False)
        return ret

    def setitem(self: Any, idx: Any, value: Any) -> None:
        __tracebackhide__ = True
        ary = self._item._ary
        ary[idx] = value
        if _launch is not None:
            record(ary, idx, True, False)

    wrapper.__getitem__ = getitem
    wrapper.__setitem__ = setitem

    thread_cls = sim_kernel.BlockThread
    original_sync = thread_cls.syncthreads

    def syncthreads(self: Any) -> None:
        __tracebackhide__ = True
        on_barrier_arrive()
        original_sync(self)
        on_barrier_leave()

    thread_cls.syncthreads = syncthreads

    original_run = sim_kernel.BlockManager.run

    def run(self: Any, grid_point: Any, *args: Any) -> Any:
        __tracebackhide__ = True
        on_block_start()
        before = set(threading.enumerate())
        try:
            result = original_run(self, grid_point, *args)
            on_block_end()
            return result
        except BaseException:
            # The simulator leaves the other threads of a failed block running (its
            # abort only stops them at their next barrier). Let them finish, so they
            # cannot touch the next launch's arrays, state, or swapped `cuda` module.
            for t in set(threading.enumerate()) - before:
                if isinstance(t, thread_cls):
                    t.join(timeout=10)
            raise

    sim_kernel.BlockManager.run = run

    module_cls = sim_api.FakeCUDAModule
    original_fence = module_cls.threadfence

    def threadfence(self: Any) -> None:
        __tracebackhide__ = True
        original_fence(self)
        on_fence()

    module_cls.threadfence = threadfence

    atomic_cls = sim_api.FakeCUDAAtomic
    for name in ATOMIC_METHODS:
        original = getattr(atomic_cls, name)

        # compare_and_swap(array, old, val) works on array[0]; every other takes an index
        def atomic(
            self: Any,
            *args: Any,
            _original: Any = original,
            _cas0: bool = name == "compare_and_swap",
        ) -> Any:
            __tracebackhide__ = True
            t = threading.current_thread()
            t._race_atomic = True
            try:
                old = _original(self, *args)
            finally:
                t._race_atomic = False
                on_atomic_done()
            on_atomic_result(args[0], 0 if _cas0 else args[1], old)
            return old

        setattr(atomic_cls, name, atomic)
    wrapper._course_racecheck = True
