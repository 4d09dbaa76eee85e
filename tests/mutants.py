"""Deliberately broken copies of a kernel, for tests that a check catches the bug.

Shared by several test modules (a helper module, not a test module: test
modules never import each other).
"""

import inspect
import itertools
import linecache
import textwrap

_serial = itertools.count(1)


def mutant(kernel, *edits: tuple[str, str], name: str | None = None):
    """A copy of ``kernel`` (a ``@cuda.jit`` kernel or a kernel factory) with each
    (old, new) source edit applied: the small bug a check must catch (``>=`` for
    ``>``, a dropped ``+ eps``), kept in step with the real kernel's source.
    Each ``old`` must occur exactly once. ``name`` renames the copy, so that
    reports (race, barrier, traceback) name it ``{name}.py:<line>``."""
    fn = getattr(kernel, "py_func", kernel)
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        assert src.count(old) == 1, f"{old!r} occurs {src.count(old)} times in {fn.__name__}"
        src = src.replace(old, new)
    # A mutant has no source file for numba's disk cache to key on (numba refuses:
    # "no locator available"), and must never be mistaken for the cached original.
    src = src.replace("cache=True", "cache=False")
    namespace = dict(fn.__globals__)
    if name is None:
        name, filename = fn.__name__, f"<mutant {next(_serial)} of {fn.__name__}>"
    else:
        src = src.replace(f"def {fn.__name__}(", f"def {name}(", 1)
        filename = f"<mutant {next(_serial)} of {fn.__name__}>/{name}.py"
    # Registered as a source, so reports can quote its lines and the simulator's
    # checks that read a kernel's source (shapes, barriers) see the mutant's.
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]
