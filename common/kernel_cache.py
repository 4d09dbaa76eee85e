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

The share is by source function, not by kernel: numba keeps every compiled
version of one function (each argument type, each closure of a kernel factory)
in one index file, which a process rewrites whole (read, add its entry, write)
without a lock, so two processes saving versions of the same function at once
can lose an entry or pair one version's name with the other's code. A function
and all its versions are therefore compiled by one process.

Usage (in each of W worker processes, shard = 0 .. W - 1)::

    with compile_only(shard, W) as plan:
        model.train_step(x, y, lr)      # launches nothing, compiles this share
    plan.compiled                       # [(kernel name, argument types), ...]
"""

from __future__ import annotations

from common.runtime import KERNEL_CACHE_DIR

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KERNEL_CACHE_DIR", "CompilePlan", "compile_only"]


@dataclass
class CompilePlan:
    """What one process of :func:`compile_only` met and compiled.

    functions: every source function launched (file, first line), numbered in
        the order first met: function i is compiled by shard i % shards.
    seen: every distinct (dispatcher id, argument types) launched.
    compiled: (kernel name, argument types, seconds) of this process's share.
    """

    shard: int
    shards: int
    functions: dict[tuple[str, int], int] = field(default_factory=dict)
    seen: set[tuple[int, tuple]] = field(default_factory=set)
    compiled: list[tuple[str, tuple, float]] = field(default_factory=list)

    def launch(self, dispatcher: Any, args: tuple) -> None:
        """Stands in for a launch of ``dispatcher`` with ``args``: compiles it
        (loading it from the disk cache if it is there) when its source function
        is this shard's, else nothing."""
        types = tuple(dispatcher.typeof_pyval(a) for a in args)
        key = (id(dispatcher), types)
        if key in self.seen:
            return
        self.seen.add(key)
        code = dispatcher.py_func.__code__
        function = (code.co_filename, code.co_firstlineno)
        index = self.functions.setdefault(function, len(self.functions))
        if index % self.shards == self.shard:
            t0 = time.perf_counter()
            dispatcher.compile(types)
            name = getattr(dispatcher, "__name__", None) or dispatcher.py_func.__name__
            self.compiled.append((name, types, time.perf_counter() - t0))


@contextlib.contextmanager
def compile_only(shard: int, shards: int, dispatcher_class: Any = None) -> Iterator[CompilePlan]:
    """Inside the block, a kernel launch compiles instead of running (see the module
    docstring): this process compiles every version of the ``shard``-th of every
    ``shards`` source functions, in the order the launches first meet them, and
    skips the others.

    Host code inside must not depend on a kernel's results (nothing is computed).

    dispatcher_class: the class whose launches are replaced (numba-cuda's
        ``CUDADispatcher``; tests pass a stand-in).

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
    plan = CompilePlan(shard, shards)
    real_call = dispatcher_class.call

    def call(self: Any, args: tuple, launch_config: Any = None) -> None:
        plan.launch(self, tuple(args))

    dispatcher_class.call = call
    try:
        yield plan
    finally:
        dispatcher_class.call = real_call
