"""The metadata a module file carries, in ELF sections of the shared library.

``.rnncc_meta`` holds JSON: cell, sizes, dtype, target, schedule, the functions' signatures,
versions. ``.rnncc_cuda`` and ``.rnncc_tir`` hold the generated CUDA source and TIR for
``rnncc inspect``. Reading needs no TVM at all (the sections are read from the file), so a
CUDA module can be inspected on a machine without a GPU.
"""

from __future__ import annotations

import json
import struct

from ..errors import ModuleFileError

FORMAT = 1
META, CUDA, TIR = ".rnncc_meta", ".rnncc_cuda", ".rnncc_tir"


#: Each byte as it stands in a C string literal: printable ASCII as itself (but the quote, the
#: backslash and "?", which could start a trigraph), the others as three octal digits
_C_CHARS = [chr(b) if 32 <= b < 127 and chr(b) not in '\\"?' else f"\\{b:03o}"
            for b in range(256)]


def c_bytes(data: bytes, width: int = 96) -> str:
    """``data`` as C string literals, one a line of ``width`` bytes (adjacent literals join):
    it initialises an array of len(data) + 1 bytes (the last a zero) in C and C++. The
    compiler reads it far faster than a list of numbers (g++, 1.4 MB: 3.3 s -> 0.1 s)."""
    get = _C_CHARS.__getitem__
    return "\n".join('"' + "".join(map(get, data[i:i + width])) + '"'
                     for i in range(0, len(data), width)) or '""'


def c_source(sections: dict[str, bytes]) -> str:
    """C source that places each payload in its own section of the library, a zero after it."""
    lines = ["/* rnncc module metadata; see rnncc/runtime/metadata.py */"]
    for i, (name, payload) in enumerate(sections.items()):
        lines.append(f'__attribute__((used, section("{name}")))\n'
                     f"const unsigned char rnncc_section_{i}[{len(payload) + 1}] =\n"
                     f"{c_bytes(payload)};")
    return "\n".join(lines) + "\n"


#: A layer's weights every cell has, by torch's names without the layer suffix.
WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def layer_weights(meta: dict) -> tuple[str, ...]:
    """A layer's weights by torch's names without the layer suffix, in torch's order: W_ih,
    W_hh, the biases, W_hr where it projects (``proj_size``), then the cell's per-unit
    parameters (a module's or a network's metadata)."""
    return (WEIGHTS + (("weight_hr",) if meta.get("proj_size") else ())
            + tuple(meta.get("params", ())))


#: Metadata every module file has (what loading, calling and inspecting a module read).
REQUIRED = ("cell", "states", "gates", "input_size", "hidden_size", "batch", "dtype", "target",
            "schedule", "functions")


def read_sections(path: str, shown: str | None = None) -> dict[str, bytes]:
    """The rnncc sections of an ELF shared library (name to payload, without the final NUL);
    ModuleFileError for a file that is not one, or is damaged (errors name ``shown``, the
    caller's name of the file, where given)."""
    shown = shown or path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ModuleFileError(f"cannot read module file {shown!r}: {err.strerror}") from err
    return sections_of(data, shown)


def sections_of(data: bytes, shown: str) -> dict[str, bytes]:
    """:func:`read_sections` of a library's bytes."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ModuleFileError(f"{shown!r} is not a 64-bit little-endian ELF shared library")
    try:
        return _sections(data)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as err:
        raise ModuleFileError(f"{shown!r} is a damaged ELF file (truncated or not a module: "
                              f"{type(err).__name__})") from err


def _sections(data: bytes) -> dict[str, bytes]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(shnum):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        headers.append((name, offset, size))
    str_off, str_size = headers[shstrndx][1], headers[shstrndx][2]
    strtab = data[str_off:str_off + str_size]
    out = {}
    for name_off, offset, size in headers:
        name = strtab[name_off:strtab.index(b"\0", name_off)].decode()
        if name.startswith(".rnncc_"):
            out[name] = data[offset:offset + size].rstrip(b"\0")
    return out


def read_metadata(path: str, shown: str | None = None) -> dict:
    """The module's metadata, or ModuleFileError if the file is not an rnncc module (errors
    name ``shown``, the caller's name of the file, where given)."""
    return _checked(read_sections(path, shown), shown or path)


def metadata_of(data: bytes, shown: str) -> dict:
    """:func:`read_metadata` of a module file's bytes."""
    return _checked(sections_of(data, shown), shown)


def _checked(sections: dict[str, bytes], shown: str) -> dict:
    if META not in sections:
        raise ModuleFileError(f"{shown!r} is a shared library but not an rnncc module "
                              "(no .rnncc_meta section)")
    try:
        meta = json.loads(sections[META].decode())
    except ValueError as err:
        raise ModuleFileError(f"{shown!r}: corrupt rnncc metadata ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ModuleFileError(f"{shown!r}: metadata format {found!r}, this rnncc reads format "
                              f"{FORMAT}")
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise ModuleFileError(f"{shown!r}: its rnncc metadata lacks {', '.join(missing)} (a "
                              "damaged module)")
    return meta


def concrete_dim(dim, steps: int) -> int:
    """A signature's dimension for a run of ``steps`` steps: an int as it is, "T" the steps,
    "T+1" one more (the states of every step and the initial ones), "T/S" the chunks of S
    steps that hold them (ceil(T/S); module files written before rnncc stopped laying out the
    input projections of small batches in chunks of steps have such dimensions)."""
    if isinstance(dim, int):
        return dim
    if dim == "T":
        return steps
    if dim == "T+1":
        return steps + 1
    chunk = int(dim.split("/")[1])
    return -(-steps // chunk)
