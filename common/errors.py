"""The errors the course's checks raise, in a module that imports nothing of the course.

Every module of ``common`` that reports a wrong kernel raises one of these, so they
live below all of them: ``checking``, the simulator's checks and the race detector
import them from here, and none of those has to import another only for its errors.
Import them from ``common`` (``from common import CheckError``); ``common.checking``,
``common.internal.racecheck`` and ``common.internal.simulator`` re-export the ones
they raise, so older imports keep working.

* :class:`CheckError` -- an output does not match its reference
  (``common.checking.check``, ``Guarded``).
* :class:`RaceError` -- two threads of one launch touched one element, unordered,
  and one wrote (the simulator's race detector, ``common.internal.racecheck``).
* :class:`BarrierError` -- the threads of a block did not all reach the same
  ``cuda.syncthreads()`` (the simulator's block runners, ``common.internal.simulator``).
* :class:`DeadlockError` -- a thread spins on an atomic read of a value that no
  other thread will ever change (the simulator's race detector).
* :class:`LaunchConfigError` -- a launch configuration a GPU refuses (too many
  threads per block, too much shared memory, a non-constant shared-array shape).

``RaceError``, ``BarrierError`` and ``DeadlockError`` subclass ``CheckError``: a test that expects a
broken kernel to fail its check (``pytest.raises(CheckError)``) also accepts the
simulator finding the bug first. ``LaunchConfigError`` is a ``ValueError``, as Numba's own
launch-configuration errors are.
"""

from __future__ import annotations

import re

__all__ = ["BarrierError", "CheckError", "DeadlockError", "LaunchConfigError", "RaceError"]


class CheckError(AssertionError):
    """A kernel's output does not match its reference."""


class _NamesItsThreads(CheckError):
    """A report that names the threads itself."""

    def __init__(self, message: str = "") -> None:
        # The simulator re-raises a thread's exception as type(e)("tid=[..] ctaid=[..]: "
        # + message); the report names the threads already.
        super().__init__(re.sub(r"^tid=\[[^]]*\] ctaid=\[[^]]*\]: ", "", message))


class RaceError(_NamesItsThreads):
    """Two threads of one launch touched the same element, unordered, and one wrote."""


class BarrierError(CheckError):
    """The threads of a block did not all reach the same ``cuda.syncthreads()``.

    On a GPU, every thread of a block that has not returned must reach the same
    barrier; a barrier inside a branch that only some threads take is undefined
    behaviour (a hang, or wrong results), and ``compute-sanitizer --tool
    synccheck`` reports it as a divergent barrier. The simulator's own barrier
    waits for whichever threads are still running, so it would let such a
    kernel pass.
    """


class DeadlockError(_NamesItsThreads):
    """A thread waits, spinning on an atomic read, for a value nothing will write.

    The simulator runs the blocks of a launch one after another, so a block can
    only wait for blocks that started before it, and those have finished:
    a value that has not appeared by then never will. On a GPU the kernel hangs.
    """


class LaunchConfigError(ValueError):
    """A launch a real GPU would refuse (too many threads, too much shared memory)."""
