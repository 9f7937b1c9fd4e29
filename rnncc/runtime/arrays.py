"""Arguments of a compiled module: NumPy arrays and DLPack tensors, checked and converted.

NumPy arrays are host data: they are copied to the module's device. DLPack tensors (PyTorch,
CuPy, TVM, ...) are used in place, without a copy, so they must already be on the device the
call runs on and C-contiguous. A PyTorch tensor with its negative or conjugate bit set (a lazy
``-x`` view) is resolved into a copy first: DLPack does not carry those bits. TVM's generated
code assumes 64-byte aligned data: a tensor that is not (a view at an offset, or
``torch.from_numpy`` of a small array) is copied, with a warning.
Results come back as the kind of array ``x`` was: NumPy for NumPy, a torch.Tensor for a
torch.Tensor, a CuPy array for a CuPy array, a TVM tensor otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, warn
from . import tvm_runtime

ALIGNMENT = 64
#: The attribute of a tensor type that gives tvm_ffi its C exchange API for DLPack (no stream
#: synchronisation; :func:`_from_dlpack`).
EXCHANGE_API = "__dlpack_c_exchange_api__"
_DL_DEVICE = {1: "cpu", 2: "cuda"}


def _describe_device(kind: str, index: int) -> str:
    return "cpu" if kind == "cpu" else f"{kind}:{index}"


def _from_dlpack(value, family: Family):
    """``value``, a DLPack tensor of ``family`` on its device, as a TVM tensor. A CUDA torch
    tensor with no stream synchronisation: rnncc launches on the caller's current stream
    (:meth:`Family.stream`), after the work that made it. tvm_ffi takes it so through torch's
    C exchange API where torch.Tensor has one; else through ``__dlpack__()``, whose default
    in older PyTorch (stream None) makes the legacy default stream wait for the current one,
    an operation that a CUDA graph capture refuses (``cudaErrorStreamCaptureImplicit``), and
    which refuses a tensor that requires grad: there it asks a detached view for DLPack's
    stream -1 (none)."""
    import tvm_ffi

    if (family.device_kind == "cuda" and family.name == "torch"
            and not hasattr(type(value), EXCHANGE_API)):
        return tvm_ffi.from_dlpack(value.detach().__dlpack__(stream=-1))
    return tvm_ffi.from_dlpack(value)


def _dlpack_device(value) -> tuple[str, int]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):  # its __dlpack_device__ took
        device = value.device  # 10 us, a tenth of a small call's time in Python
        if device.type in ("cpu", "cuda"):
            return device.type, device.index or 0
    dev_type, index = value.__dlpack_device__()
    return _DL_DEVICE.get(int(dev_type), f"dlpack device type {int(dev_type)}"), int(index)


#: :meth:`Family.zeros_to_read`'s tensors, by family, device, shape and dtype.
_ZEROS: dict = {}


@dataclass
class Family:
    """Where a call runs and how its results are made: the kind of array ``x`` was."""

    name: str
    device_kind: str
    device_index: int

    @property
    def device(self):
        return tvm_runtime.device(self.device_kind, self.device_index)

    def describe_device(self) -> str:
        return _describe_device(self.device_kind, self.device_index)

    def empty(self, shape, dtype: str):
        """A new array of this family: (what the caller gets, the tensor the module writes)."""
        if self.name == "torch":
            import torch

            arr = torch.empty(tuple(shape), dtype=getattr(torch, dtype),
                              device=self.describe_device())
            return arr, _from_dlpack(arr, self)
        if self.name == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_index):
                arr = cupy.empty(tuple(shape), dtype=dtype)
            return arr, _from_dlpack(arr, self)
        import tvm

        tensor = tvm.runtime.empty(tuple(shape), dtype, self.device)
        return tensor, tensor

    def poisoned(self, shape, dtype: str):
        """A new array filled with NaN (to show elements a kernel fails to write)."""
        if self.name in ("torch", "cupy"):
            arr, tensor = self.empty(shape, dtype)
            arr.fill_(float("nan")) if self.name == "torch" else arr.fill(float("nan"))
            return arr, tensor
        import tvm

        tensor = tvm.runtime.tensor(np.full(tuple(shape), np.nan, dtype), self.device)
        return tensor, tensor

    def zeros(self, shape, dtype: str):
        if self.name in ("torch", "cupy"):
            arr, tensor = self.empty(shape, dtype)
            arr.fill_(0) if self.name == "torch" else arr.fill(0)
            return arr, tensor
        import tvm

        tensor = tvm.runtime.tensor(np.zeros(tuple(shape), dtype), self.device)
        return tensor, tensor

    def zeros_to_read(self, shape, dtype: str):
        """A tensor of zeros that the module only reads (an initial state not given): one a
        family, shape and dtype, made once (a fill a call was two of the ten small kernels of
        an LSTM 512 x2 call at batch 4, H200). Made during a CUDA graph capture, whose fill
        runs only at replay, it is not kept; made on a CUDA stream, that stream finishes the
        fill before other streams may read it."""
        key = (self.name, self.device_kind, self.device_index, tuple(shape), dtype)
        found = _ZEROS.get(key)
        if found is not None:
            return found[1]
        made = self.zeros(shape, dtype)
        if self.device_kind == "cuda":
            if self.name != "torch":
                return made[1]
            import torch

            with torch.cuda.device(self.device_index):  # its stream, where it was filled
                if torch.cuda.is_current_stream_capturing():
                    return made[1]
                torch.cuda.current_stream().synchronize()
        _ZEROS[key] = made
        return made[1]

    def copy(self, tensor):
        """A new array of this family holding a copy of the TVM tensor ``tensor``, made on the
        caller's stream: (what the caller gets, the tensor the module reads)."""
        arr, out = self.empty(tensor.shape, str(tensor.dtype))
        if self.name == "torch":
            import torch

            arr.copy_(torch.from_dlpack(tensor))
        elif self.name == "cupy":
            import cupy

            arr[...] = cupy.from_dlpack(tensor)
        else:
            tensor.copyto(out)
        return arr, out

    def view(self, tensor):
        """The TVM tensor ``tensor`` as an array of this family, its memory shared (what
        :meth:`result` takes)."""
        if self.name == "torch":
            import torch

            return torch.from_dlpack(tensor)
        if self.name == "cupy":
            import cupy

            return cupy.from_dlpack(tensor)
        return tensor

    def result(self, arr):
        return arr.numpy() if self.name == "numpy" else arr

    def stream(self):
        """A context that makes TVM launch on the caller's current stream (torch, CuPy)."""
        import contextlib

        import tvm_ffi

        if self.device_kind != "cuda" or self.name not in ("torch", "cupy"):
            return contextlib.nullcontext()
        if self.name == "torch":
            import torch

            handle = torch.cuda.current_stream(self.device_index).cuda_stream
        else:
            import cupy

            with cupy.cuda.Device(self.device_index):
                handle = cupy.cuda.get_current_stream().ptr
        return tvm_ffi.use_raw_stream(tvm_ffi.device(self.describe_device()), handle)


def _root_module(value) -> str:
    return type(value).__module__.split(".")[0]


def family_of(x, module_device: str) -> Family:
    """The family of ``x``; numpy runs on the module's device (cuda:0 for CUDA modules)."""
    if isinstance(x, np.ndarray):
        return Family("numpy", module_device, 0)
    if not hasattr(x, "__dlpack_device__"):
        raise InputError(f"x must be a NumPy array or a DLPack tensor (PyTorch, CuPy, ...), "
                         f"got {type(x).__name__}")
    kind, index = _dlpack_device(x)
    if kind != module_device:
        raise InputError(f"x is on {_describe_device(kind, index)}, but this module runs on "
                         f"{module_device}; "
                         + ("move it to the GPU (e.g. x.cuda()) or pass a NumPy array"
                            if module_device == "cuda" else "move it to the CPU"))
    root = _root_module(x)
    name = root if root in ("torch", "cupy") and root in sys.modules else "dlpack"
    return Family(name, kind, index)


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_shape(name: str, shape, expected) -> None:
    if len(shape) != len(expected) or any(e is not None and int(s) != int(e)
                                          for s, e in zip(shape, expected)):
        raise InputError(f"{name} has shape {_shape_str(shape)}, expected "
                         f"{_shape_str(['T' if e is None else e for e in expected])}")


def _resolved(value):
    """A PyTorch tensor with its lazy negative or conjugate bit applied (a copy); anything
    else as it is."""
    for bit, resolve in (("is_neg", "resolve_neg"), ("is_conj", "resolve_conj")):
        check = getattr(value, bit, None)
        if callable(check) and check():
            value = getattr(value, resolve)()
    return value


def to_tensor(name: str, value, expected, dtype: str, family: Family):
    """``value`` as a TVM tensor on the family's device, after checking it.

    ``expected`` is the shape, with None for a free (the T) dimension.
    """
    import tvm
    import tvm_ffi

    if isinstance(value, np.ndarray):
        if str(value.dtype) != dtype:
            raise InputError(f"{name} has dtype {value.dtype}, expected {dtype} "
                             f"(convert with .astype({dtype!r}))")
        check_shape(name, value.shape, expected)
        if not value.flags.c_contiguous:
            raise InputError(f"{name} is not C-contiguous; pass np.ascontiguousarray({name})")
        return tvm.runtime.tensor(value, family.device)
    if not hasattr(value, "__dlpack__"):
        raise InputError(f"{name} must be a NumPy array or a DLPack tensor (PyTorch, CuPy, ...), "
                         f"got {type(value).__name__}")
    kind, index = _dlpack_device(value)
    if (kind, index) != (family.device_kind, family.device_index):
        raise InputError(f"{name} is on {_describe_device(kind, index)}, but this call runs on "
                         f"{family.describe_device()} (where x is); put all tensors on one device")
    value = _resolved(value)
    try:
        tensor = value if isinstance(value, tvm_ffi.Tensor) else _from_dlpack(value, family)
    except Exception as err:  # noqa: BLE001 - reported with the argument's name
        raise InputError(f"{name}: cannot be passed through DLPack: {err}") from err
    if str(tensor.dtype) != dtype:
        raise InputError(f"{name} has dtype {tensor.dtype}, expected {dtype}")
    check_shape(name, tensor.shape, expected)
    if not tensor.is_contiguous():
        raise InputError(f"{name} is not contiguous (strides {tuple(tensor.strides)}); pass "
                         f"{name}.contiguous()")
    if tensor.data_ptr() % ALIGNMENT:
        warn(f"rnncc: {name}'s data is not {ALIGNMENT}-byte aligned (a view at an "
                      "offset, or torch.from_numpy?); it is copied for this call")
        aligned = tvm.runtime.empty(tuple(tensor.shape), dtype, family.device)
        tensor.copyto(aligned)
        return aligned
    return tensor
