"""The device a tuning log is for: a GPU kind ("h100", "h200", ...) or "llvm-<cpu>"."""

from __future__ import annotations

import re


def gpu_kind(name: str) -> str:
    """A short kind from a device name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" ->
    "h100", "NVIDIA A100-SXM4-40GB" -> "a100"; other names lower-cased and dashed."""
    low = name.lower()
    found = re.search(r"\b([ahlbv]\d{2,3}[a-z]?)\b", low.replace("-", " "))
    if found:
        return found.group(1)
    return re.sub(r"[^a-z0-9]+", "-", low.replace("nvidia", "")).strip("-") or "gpu"


def local_gpu():
    """(kind, name, multiprocessors) of this machine's CUDA device 0, or None."""
    from ..runtime import tvm_runtime

    if not tvm_runtime.cuda_available():
        return None
    import tvm

    dev = tvm.cuda(0)
    name = str(dev.device_name)
    return gpu_kind(name), name, int(dev.multi_processor_count)


def cpu_key(cpu: str | None) -> str:
    """The log directory of an llvm target: "llvm-" and the CPU name (this one's if None)."""
    if cpu is None:
        from tvm.target import codegen

        cpu = codegen.llvm_get_system_cpu()
    return f"llvm-{cpu}"
