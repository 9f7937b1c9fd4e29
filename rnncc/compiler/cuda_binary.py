"""CUDA machine code for modules: nvcc builds a cubin, which the exported library carries.

TVM 0.27 keeps CUDA *source* in a module built where no GPU driver is, and compiles it when the
module is loaded (NVRTC, with fast math). A deployable rnncc module instead carries a cubin for
its architecture, compiled here by nvcc with IEEE-accurate math (no ``--use_fast_math``; a
schedule that wants a fast form calls it by name, as the persistent kernel's cell does), and
the ptxas report (registers, spills) goes into the module's metadata.

This file touches two TVM internals, kept here only:
- the ``tvm_callback_cuda_compile`` hook (used at build time where a GPU driver is present);
- the layout of the packed import blob (``__tvm_ffi__library_bin``: import tree, then for each
  module its kind and payload) and of the CUDA module payload ([fmt][function map][code]).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import subprocess
import tempfile

from ..errors import BuildError
from ..runtime.metadata import c_bytes

_NVCC_FLAGS = [
    "-O3", "-std=c++17", "-Xptxas", "-v", "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
]


def find_nvcc() -> str:
    """Path of nvcc, from PATH or CUDA_HOME; BuildError if there is none."""
    found = shutil.which("nvcc")
    if found is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = os.path.join(home, "bin", "nvcc")
        found = candidate if os.path.isfile(candidate) else None
    if found is None:
        raise BuildError("a cuda module needs nvcc (the CUDA toolkit) to build its cubin; none "
                         "on PATH or in CUDA_HOME. Install the toolkit or build for --target llvm")
    return found


def parse_ptxas(report: str) -> dict:
    """Per-kernel registers, stack frame, spill bytes and shared memory from ``ptxas -v``;
    ``wgmma_serialized``: True where ptxas says it serialized a kernel's warpgroup MMA
    (C7515: each instruction then waits for the one before)."""
    kernels: dict[str, dict] = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"wgmma.mma_async instructions are serialized .* function '([\w$]+)'",
                      line)
        if m:
            kernels.setdefault(m.group(1), {})["wgmma_serialized"] = True
            continue
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            current["smem"] = int(m.group(1))
    return kernels


def kernel_bodies(source: str) -> dict[str, str]:
    """Each kernel defined in CUDA ``source`` (as TVM 0.27 writes it) by name: its body."""
    heads = list(re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\([\d, ]+\) )?'
                             r'(\w+)\([^;{]*\)\s*{', source))
    return {head.group(1): source[head.end():after.start() if after else len(source)]
            for head, after in zip(heads, heads[1:] + [None])}


#: What marks a kernel that waits on other blocks: rnncc's grid exchange or barrier, or
#: cooperative groups' grid sync (which TVM 0.27 calls through a helper of its own).
COOPERATIVE_MARKS = ("rnncc_grid_", "this_grid().sync()", "tvm_builtin_cuda_grid_sync()")
#: What marks a persistent kernel whose batch groups wait on no block outside their cluster:
#: the shared memory that holds h (``hn``: the "local" exchange's, a block's own, and the
#: "cluster" exchange's slots, which the cluster's blocks put h into).
LOCAL_MARK = " hn_ptr["


def cooperative_kernels(source: str) -> list[str]:
    """Names of the kernels in CUDA ``source`` that wait on other blocks: the persistent
    kernels but those of the "local" exchange."""
    return [name for name, body in kernel_bodies(source).items()
            if any(m in body for m in COOPERATIVE_MARKS)]


def persistent_kernels(source: str) -> list[str]:
    """Names of the persistent kernels in CUDA ``source``: the cooperative ones and those
    whose batch groups keep h to themselves (one block, or a cluster, a group)."""
    return [name for name, body in kernel_bodies(source).items()
            if LOCAL_MARK in body or any(m in body for m in COOPERATIVE_MARKS)]


def compile_cubin(source: str, arch: str) -> tuple[bytes, dict]:
    """nvcc ``source`` to a cubin for ``arch`` (e.g. sm_90); returns (cubin, ptxas report).
    sm_90 is built as sm_90a (the same GPUs; its warpgroup MMA needs the arch-specific
    target)."""
    nvcc = find_nvcc()
    arch = "sm_90a" if arch == "sm_90" else arch
    with tempfile.TemporaryDirectory(prefix="rnncc_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", *_NVCC_FLAGS, "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
        with open(out, "rb") as f:
            return f.read(), parse_ptxas(proc.stdout + proc.stderr)


@contextlib.contextmanager
def nvcc_callback(arch: str, reports: dict):
    """Within the block, TVM compiles CUDA source with :func:`compile_cubin` (this matters
    where a GPU driver is present: there TVM compiles at build time)."""
    import tvm_ffi

    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)

    def callback(code, *_):
        cubin, report = compile_cubin(code, arch)
        reports.update(report)
        return bytearray(cubin)

    tvm_ffi.register_global_func(name, callback, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)


# --- the packed import blob ------------------------------------------------------------------

def _u64(data: bytes, off: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", data, off)[0], off + 8


def _str(data: bytes, off: int) -> tuple[bytes, int]:
    n, off = _u64(data, off)
    return data[off:off + n], off + n


def _put_str(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def split_blob(blob: bytes) -> tuple[bytes, list[tuple[bytes, bytes | None]]]:
    """(import tree bytes, [(kind, payload or None for the host library)])."""
    nbytes, off = _u64(blob, 0)
    if nbytes + 8 != len(blob):
        raise BuildError(f"unexpected import blob: header says {nbytes} bytes, has {len(blob) - 8}")
    start = off
    for _ in range(2):  # indptr, child indices: vec<u64>
        count, off = _u64(blob, off)
        off += 8 * count
    indptr_count = struct.unpack_from("<Q", blob, start)[0]
    tree = blob[start:off]
    modules = []
    for _ in range(indptr_count - 1):
        kind, off = _str(blob, off)
        payload = None
        if kind != b"_lib":
            payload, off = _str(blob, off)
        modules.append((kind, payload))
    if off != len(blob):
        raise BuildError("unexpected import blob: trailing bytes")
    return tree, modules


def join_blob(tree: bytes, modules: list[tuple[bytes, bytes | None]]) -> bytes:
    body = tree + b"".join(_put_str(k) + (b"" if p is None else _put_str(p)) for k, p in modules)
    return struct.pack("<Q", len(body)) + body


def cuda_payload_with_cubin(payload: bytes, source: str, arch: str) -> tuple[bytes, dict]:
    """Replace a CUDA module payload that holds source ([b"cuda"][fmap][source]) by one that
    holds the cubin ([b"cubin"][fmap][cubin])."""
    fmt, off = _str(payload, 0)
    code = source.encode()
    tail = _put_str(code)
    if fmt != b"cuda" or not payload.endswith(tail):
        raise BuildError(f"unexpected CUDA module payload (format {fmt!r})")
    fmap = payload[off:len(payload) - len(tail)]
    cubin, report = compile_cubin(source, arch)
    return _put_str(b"cubin") + fmap + _put_str(cubin), report


def pack_imports_with_cubin(arch: str, reports: dict):
    """An ``fpack_imports`` for ``export_library``: the import blob as C, with every CUDA
    module that still holds source compiled to a cubin."""
    from tvm.runtime import _ffi_api

    def fpack(mod, is_system_lib, prefix, workspace_dir):
        c_text = _ffi_api.ModulePackImportsToC(mod, is_system_lib, prefix)
        blob = bytes(_ffi_api.ModulePackImportsToTensor(mod).numpy().tobytes())
        tree, modules = split_blob(blob)
        sources = [m.inspect_source() for m in mod.imports if m.kind == "cuda"]
        patched, k = [], 0
        for kind, payload in modules:
            if kind == b"cuda":
                fmt, _ = _str(payload, 0)
                if fmt == b"cuda":
                    payload, report = cuda_payload_with_cubin(payload, sources[k], arch)
                    reports.update(report)
                k += 1
            patched.append((kind, payload))
        new_blob = join_blob(tree, patched)
        m = re.search(r"const unsigned char (\w+)\[\d+\] = \{.*?\};", c_text, re.S)
        if m is None:
            raise BuildError("unexpected output of ModulePackImportsToC")
        # as string literals, a zero after them (nvcc's cubin: 1.4 MB, LSTM 1024 training)
        c_text = (c_text[:m.start()] + f"const unsigned char {m.group(1)}[{len(new_blob) + 1}]"
                  f" =\n{c_bytes(new_blob)};" + c_text[m.end():])
        path = os.path.join(workspace_dir, f"{prefix}devc.c")
        with open(path, "w") as f:
            f.write(c_text)
        return path

    return fpack


def library_device_code(path: str) -> list[tuple[str, str]]:
    """(module kind, format) of each device module packed into a library file, e.g.
    [("cuda", "cubin")], read from its ``__tvm_ffi__library_bin`` symbol."""
    with open(path, "rb") as f:
        data = f.read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    addr_to_offset = [(s[3], s[4], s[5]) for s in sections if s[3]]
    for sec in sections:
        if sec[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sec[6]]
        for off in range(sec[4], sec[4] + sec[5], 24):
            name_off, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, off)
            end = data.index(b"\0", strtab[4] + name_off)
            if data[strtab[4] + name_off:end] != b"__tvm_ffi__library_bin":
                continue
            for addr, offset, size in addr_to_offset:
                if addr <= value < addr + size:
                    start = offset + value - addr
                    nbytes, _ = _u64(data, start)
                    _, modules = split_blob(data[start:start + 8 + nbytes])
                    return [(k.decode(), _str(p, 0)[0].decode()) for k, p in modules
                            if p is not None]
    return []
