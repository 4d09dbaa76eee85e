"""Numba kernel names as the profilers print them, made short enough to read.

A Numba kernel reaches the driver under a C++-style mangled name that carries
its module, any factory it was made in, an ABI tag and its argument types.
Each tool prints it its own way:

* Nsight Compute (``ncu --print-kernel-base function``)::

      transpose_naive[abi:v1,cw51cXTLSU...3d_3d]

* compute-sanitizer, the demangled name and the offset of the instruction::

      __main__::racy[abi:v1,cw51cXTLSU...](Array<float, (int)1, C, mutable, aligned>)+0x1b0

* torch.profiler (CUPTI's demangled name)::

      final_project::fast_conv::make_conv2d_igemm::_3clocals_3e::conv2d_igemm[abi:v22][abi:cw51c...](Array<...

* the mangled form itself (``_ZN8chapters10_06_memory9transpose15transpose_naiveB2v1...E5ArrayIfLi2E...``),
  in PTX, ``cuobjdump`` and raw profiler exports.

:func:`short_kernel_name` turns any of them into ``transpose_naive`` (or, with
``qualified=True``, ``final_project.fast_conv.conv2d_igemm``), which is what the
course's tables show and what a ``-k regex:`` filter should match.

Run: python chapters/09_profiling/kernel_names.py NAME...
"""

import re
import sys

# Numba escapes every character outside [A-Za-z0-9_] in a name as _XX (hex):
# "<locals>" becomes "_3clocals_3e", "$" "_24". The escape is ambiguous ("_ba" in
# "divergent_barrier" reads as hex too), so only _XX that decodes to printable
# punctuation is undone.
_ESCAPE = re.compile(r"_([0-9a-f]{2})")
# Components that are not part of a kernel's own name: Numba's "<locals>" of a
# factory function and the "cudapy" namespace of older versions.
_NOISE = {"<locals>", "cudapy"}


def _unescape(part: str) -> str:
    def undo(m: re.Match) -> str:
        char = chr(int(m.group(1), 16))
        punctuation = char.isprintable() and char.isascii() and not (char.isalnum() or char == "_")
        return char if punctuation else m.group(0)

    return _ESCAPE.sub(undo, part)


def _demangle_components(name: str) -> list[str]:
    """The nested name of an Itanium-mangled ``_ZN...E`` symbol, component by component.

    Numba mangles as ``_ZN`` then ``<length><identifier>`` pairs, ABI tags as
    ``B<length><tag>``, and ``E`` before the argument types. Raises ValueError
    for a string that is not such a name.
    """
    if not name.startswith("_ZN"):
        raise ValueError(f"not a mangled name: {name[:40]!r}")
    parts, i = [], 3
    while i < len(name) and name[i] != "E":
        tag = name[i] == "B"
        i += tag
        m = re.match(r"\d+", name[i:])
        if m is None:
            raise ValueError(f"malformed mangled name at offset {i}: {name[:60]!r}")
        length = int(m.group())
        i += len(m.group())
        if not tag:
            parts.append(name[i : i + length])
        i += length
    if i >= len(name):
        raise ValueError(f"mangled name has no end of its nested name: {name[:60]!r}")
    return parts


def kernel_path(name: str) -> list[str]:
    """The components of a kernel's name, outermost first, without arguments,
    ABI tags, escapes or factory ``<locals>``: e.g. ``["final_project",
    "fast_conv", "make_conv2d_igemm", "conv2d_igemm"]``.

    Accepts every form in this module's docstring. Raises ValueError for an
    empty name.
    """
    name = name.strip()
    if not name:
        raise ValueError("empty kernel name")
    if name.startswith("_ZN"):
        parts = _demangle_components(name)
    else:
        # Drop the argument list, the ABI tags and an instruction offset; what is
        # left is the ::-separated path.
        head = re.split(r"[\[(]", name, maxsplit=1)[0]
        head = re.sub(r"\+0x[0-9a-f]+$", "", head)
        parts = head.strip().split("::")
    # A module named like "06_memory" is mangled with a leading "_".
    parts = [re.sub(r"^_(?=\d)", "", _unescape(p)) for p in parts]
    return [p for p in parts if p and p not in _NOISE]


def short_kernel_name(name: str, qualified: bool = False) -> str:
    """``transpose_naive`` from any printed or mangled form of a Numba kernel's name.

    qualified: prefix the module path, dotted (``chapters.06_memory.transpose.
    transpose_naive``); a factory function's name is dropped, as it is not part
    of the kernel's identity. Names that are not Numba's (cuBLAS's, torch's
    ``Memcpy DtoD``) come back unchanged apart from their argument list.
    """
    parts = kernel_path(name)
    if not qualified or len(parts) == 1:
        return parts[-1]
    modules = [p for p in parts[:-1] if not p.startswith("make_")]
    return ".".join(modules + parts[-1:])


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["--help"]:
        if arg in ("-h", "--help"):
            print(__doc__)
            break
        print(short_kernel_name(arg, qualified=True))
