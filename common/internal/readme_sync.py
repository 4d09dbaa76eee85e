"""Keep code shown in READMEs identical to the chapter's code.

A README shows a function or class from a chapter file by putting a marker line
right before a fenced code block::

    <!-- include: vector_add.py::vector_add_naive -->
    ```python
    ...the source of vector_add_naive, decorators included...
    ```

The path is relative to the README's folder. ``python -m common.internal.readme_sync``
rewrites every such block from the source; ``--check`` (used by the tests)
exits 1 and names each block that differs. So the code in the notes is the code
the tests run (numba-cuda's own docs work the same way).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from .exercises import REPO_ROOT

MARKER = re.compile(r"^<!-- include: (?P<file>[^:\s]+)::(?P<name>[\w.]+) -->\s*$")


def extract(path: Path, name: str) -> str:
    """Source of the top-level function or class ``name`` in ``path``, with decorators.

    Raises:
        LookupError: no such top-level definition.
    """
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in tree.body:
        if (
            isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.name == name
        ):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            return "\n".join(lines[start : node.end_lineno])
    raise LookupError(f"{path}: no top-level function or class named {name!r}")


def sync_readme(readme: Path, write: bool) -> list[str]:
    """Return a problem per stale or broken include; rewrite the file if ``write``."""
    lines = readme.read_text().splitlines()
    out: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        m = MARKER.match(line)
        i += 1
        if not m:
            continue
        where = f"{readme.relative_to(REPO_ROOT)}:{i}"
        if i >= len(lines) or not lines[i].startswith("```"):
            problems.append(f"{where}: include marker not followed by a ``` block")
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end >= len(lines):
            problems.append(f"{where}: unterminated code block")
            continue
        try:
            source = extract(readme.parent / m["file"], m["name"])
        except (OSError, LookupError, SyntaxError) as exc:
            problems.append(f"{where}: {exc}")
            out.extend(lines[i : end + 1])
            i = end + 1
            continue
        if "\n".join(lines[i + 1 : end]) != source:
            problems.append(f"{where}: block differs from {m['file']}::{m['name']}")
        out.append(lines[i])
        out.extend(source.splitlines())
        out.append(lines[end])
        i = end + 1
    if write:
        readme.write_text("\n".join(out) + "\n")
    return problems


def all_readmes() -> list[Path]:
    return sorted(REPO_ROOT.glob("chapters/*/README.md")) + [
        p
        for p in [REPO_ROOT / "final_project" / "README.md", REPO_ROOT / "README.md"]
        if p.exists()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="only report stale blocks; exit 1 if any"
    )
    args = parser.parse_args(argv)
    problems = []
    for readme in all_readmes():
        problems += sync_readme(readme, write=not args.check)
    for p in problems:
        print(p)
    if args.check and problems:
        print("run: python -m common.internal.readme_sync", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
