"""Which functions of a source file are kernels, and whether each asks numba to keep
its compiled code on disk (``@cuda.jit(cache=True)``), read from the AST alone.

Shared by the capstone's and the chapters' kernel cache tests (a helper module, not
a test module: test modules never import each other).
"""

import ast
from collections.abc import Iterator


def kernel_definitions(tree: ast.AST) -> Iterator[tuple[ast.FunctionDef, dict[str, ast.expr]]]:
    """(function node, the decorator's keywords) of every ``cuda.jit`` / ``jit``
    decorated function in ``tree`` (nested ones, as kernel factories make, included),
    device functions left out: ``device=True`` ones are compiled into their callers."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            name = ast.unparse(call.func if call else dec)
            if name not in ("cuda.jit", "jit"):
                continue
            keywords = {k.arg: k.value for k in call.keywords} if call else {}
            device = keywords.get("device")
            if isinstance(device, ast.Constant) and device.value:
                continue
            yield node, keywords


def jit_decorators(tree: ast.AST) -> Iterator[tuple[str, dict[str, ast.expr]]]:
    """(kernel name, the decorator's keywords) of every kernel in ``tree``, as
    :func:`kernel_definitions` finds them."""
    for node, keywords in kernel_definitions(tree):
        yield node.name, keywords


def asks_for_cache(keywords: dict[str, ast.expr]) -> bool:
    """Whether a decorator's keywords hold ``cache=True``, written as such."""
    cache = keywords.get("cache")
    return isinstance(cache, ast.Constant) and cache.value is True
