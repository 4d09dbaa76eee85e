"""Compiling a program's kernels without running them, a share per process.

Numba compiles a kernel the first time it is launched with new argument types,
in the launching process, one kernel after another. Kernels declared
``@cuda.jit(cache=True)`` are then saved under :data:`KERNEL_CACHE_DIR`, and a
later process loads them instead of compiling. :func:`compile_only` turns that
into a way to compile in parallel: W processes each run the same host code (say,
one training step) with launches replaced by compiles of their share of the
kernels they meet. Nothing runs on the GPU there; between them the W processes
fill the cache with every kernel the code launches, and the real run then loads
them all.

The share is by kernel: kernel i (the i-th distinct kernel and argument types
the host code launches, the same order in every process) is compiled by process
i % W. Numba keeps every compiled version of one function (each argument type,
each closure of a kernel factory) in one index file, which a process rewrites
whole (read, add its entry, write) without a lock: two processes saving versions
of one function at once could lose an entry, or give two versions the same data
file, so that one version's name points at the other's code (numba issues #4807
and #10128). Inside :func:`compile_only` a save holds an exclusive lock on the
index (``fcntl.flock``, POSIX); where there is no ``fcntl`` (Windows), the share
falls back to one source function a process, all its versions together.

Usage (in each of W worker processes, shard = 0 .. W - 1)::

    with compile_only(shard, W) as plan:
        model.train_step(x, y, lr)      # launches nothing, compiles this share
    plan.compiled                       # [(kernel name, argument types, seconds), ...]
"""

from __future__ import annotations

from common.runtime import KERNEL_CACHE_DIR

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; compile_only shares by source function
    fcntl = None

__all__ = ["KERNEL_CACHE_DIR", "CompilePlan", "compile_only", "locked_cache_saves"]


@dataclass
class CompilePlan:
    """What one process of :func:`compile_only` met and compiled.

    by: "kernel" (the i-th distinct kernel met is shard i % shards's) or
        "function" (the i-th source function met, with all its versions).
    units: every kernel (dispatcher id, argument types) or source function (file,
        first line) met, numbered in the order first met.
    seen: every distinct (dispatcher id, argument types) launched.
    compiled: (kernel name, argument types, seconds) of this process's share.
    """

    shard: int
    shards: int
    by: str = "kernel"
    units: dict[Any, int] = field(default_factory=dict)
    seen: set[tuple[int, tuple]] = field(default_factory=set)
    compiled: list[tuple[str, tuple, float]] = field(default_factory=list)

    def launch(self, dispatcher: Any, args: tuple) -> None:
        """Stands in for a launch of ``dispatcher`` with ``args``: compiles it
        (loading it from the disk cache if it is there) when it is this shard's,
        else nothing."""
        types = tuple(dispatcher.typeof_pyval(a) for a in args)
        key = (id(dispatcher), types)
        if key in self.seen:
            return
        self.seen.add(key)
        if self.by == "kernel":
            unit: Any = key
        else:
            code = dispatcher.py_func.__code__
            unit = (code.co_filename, code.co_firstlineno)
        index = self.units.setdefault(unit, len(self.units))
        if index % self.shards == self.shard:
            t0 = time.perf_counter()
            dispatcher.compile(types)
            name = getattr(dispatcher, "__name__", None) or dispatcher.py_func.__name__
            self.compiled.append((name, types, time.perf_counter() - t0))


def _locked(save: Any) -> Any:
    """``IndexDataCacheFile.save`` under an exclusive lock on ``<index>.lock``: the
    read-add-write of the index and the data file it names happen in one process
    at a time."""

    def locked_save(self: Any, key: Any, data: Any) -> None:
        # numba made the cache folder before it saves (locator.ensure_cache_path)
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            save(self, key, data)

    return locked_save


@contextlib.contextmanager
def locked_cache_saves(index_file_class: Any = None) -> Iterator[bool]:
    """Inside the block, numba's cache saves its index and data files under a
    file lock (see the module docstring). Yields False, and locks nothing, where
    the platform has no ``fcntl``."""
    if fcntl is None:
        yield False
        return
    if index_file_class is None:
        from numba.cuda.core.caching import IndexDataCacheFile as index_file_class
    real_save = index_file_class.save
    index_file_class.save = _locked(real_save)
    try:
        yield True
    finally:
        index_file_class.save = real_save


@contextlib.contextmanager
def compile_only(
    shard: int, shards: int, dispatcher_class: Any = None, index_file_class: Any = None
) -> Iterator[CompilePlan]:
    """Inside the block, a kernel launch compiles instead of running (see the module
    docstring): this process compiles the ``shard``-th of every ``shards``
    kernels (or, without ``fcntl``, source functions), in the order the launches
    first meet them, and skips the others; its cache saves hold a file lock.

    Host code inside must not depend on a kernel's results (nothing is computed).

    dispatcher_class: the class whose launches are replaced (numba-cuda's
        ``CUDADispatcher``; tests pass a stand-in).
    index_file_class: the class whose saves are locked (numba-cuda's
        ``IndexDataCacheFile``; tests pass a stand-in).

    Raises:
        ValueError: shards < 1 or shard not in 0 .. shards - 1.
        RuntimeError: in the simulator, which compiles nothing.
    """
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"shard must be in 0 .. shards - 1, got shard {shard} of {shards}")
    if dispatcher_class is None:
        from common.runtime import is_simulator

        if is_simulator():
            raise RuntimeError(
                "compile_only needs a GPU: the simulator runs kernels as Python and "
                "compiles nothing"
            )
        from numba.cuda.dispatcher import CUDADispatcher as dispatcher_class
    with contextlib.ExitStack() as stack:
        locked = stack.enter_context(locked_cache_saves(index_file_class))
        plan = CompilePlan(shard, shards, by="kernel" if locked else "function")
        real_call = dispatcher_class.call

        def call(self: Any, args: tuple, launch_config: Any = None) -> None:
            plan.launch(self, tuple(args))

        dispatcher_class.call = call
        stack.callback(setattr, dispatcher_class, "call", real_call)
        yield plan
