"""The few TVM runtime details rnncc relies on when it loads a module, in one place.

A module must load with TVM's runtime alone (``TVM_USE_RUNTIME_LIB=1``). In that mode
``import tvm`` does not register the CUDA module loader; :func:`load_library` registers it
(through ``tvm.backend.loader`` where that works, else by loading TVM's CUDA runtime library,
which is what the loader does) before it loads a CUDA module.
"""

from __future__ import annotations

from ..errors import ModuleFileError
from . import threads

_CUDA_READY = False


def _ensure_cuda_loader() -> None:
    global _CUDA_READY
    if _CUDA_READY:
        return
    import tvm
    import tvm_ffi

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is None:
        try:
            tvm.backend.loader.load("cuda")
        except Exception:  # noqa: BLE001 - runtime-only TVM: load the CUDA runtime directly
            from pathlib import Path

            from tvm.base import _LOADED_LIBS
            from tvm_ffi.libinfo import load_lib_ctypes

            runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
            _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[runtime_dir],
                mode="RTLD_LOCAL")
    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is None:
        raise ModuleFileError("TVM's CUDA runtime could not be loaded (no CUDA driver here?)")
    _CUDA_READY = True


def cuda_available(device_id: int = 0) -> bool:
    """Whether a CUDA device with that index is usable here."""
    import tvm

    try:
        return bool(tvm.cuda(device_id).exist)
    except Exception:  # noqa: BLE001 - no driver at all
        return False


def load_library(path: str, kind: str, shown: str | None = None):
    """Load a module library with TVM's runtime; ``kind`` is "cuda" or "llvm" (errors name
    ``shown``, the caller's name of the file, where given)."""
    shown = shown or path
    import tvm

    if kind == "cuda":
        try:
            _ensure_cuda_loader()
        except ModuleFileError:
            pass
        if not cuda_available(0):
            raise ModuleFileError(
                f"{shown!r} is a CUDA module and this machine has no usable CUDA device; "
                "load it on a GPU machine (rnncc inspect reads it anywhere)")
    else:
        threads.configure()  # before the module's first parallel work
    try:
        return tvm.runtime.load_module(path)
    except Exception as err:  # noqa: BLE001 - surfaced as a module-file error
        raise ModuleFileError(f"TVM could not load {shown!r}: {str(err).splitlines()[-1]}") from err


def persistent_unfit(plan: dict, target: dict, index: int) -> str | None:
    """Why the persistent kernel cannot run on CUDA device ``index`` (None if it can): its
    cooperative grid needs ``blocks`` multiprocessors and the module's architecture."""
    dev = device("cuda", index)
    try:
        sms = int(dev.multi_processor_count)
        version = str(dev.compute_version)
    except Exception as err:  # noqa: BLE001 - no device: reported, not raised
        return f"cannot query cuda:{index} ({err})"
    arch = "sm_" + version.replace(".", "")
    if not target["arch"].startswith(arch):
        return f"the module is built for {target['arch']}, cuda:{index} is {arch}"
    if sms < plan["blocks"]:
        return (f"the persistent kernel needs {plan['blocks']} multiprocessors resident at once, "
                f"cuda:{index} has {sms}")
    return None


def device(kind: str, index: int):
    """A tvm Device."""
    import tvm

    return tvm.cuda(index) if kind == "cuda" else tvm.cpu(index)
