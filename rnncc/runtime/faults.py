"""What a failed CUDA kernel leaves behind, and how a call reports it.

A kernel that faults (an illegal access, or a persistent kernel's bounded wait that traps, see
``rnncc.schedules.persistent.device``) loses the process's CUDA context: every later CUDA call
in the process fails, torch's included. TVM then aborts the whole process (``std::terminate``
from a destructor) when it frees device memory it allocated before the loss. So a call that
meets a lost context raises :class:`~rnncc.errors.DeviceError` that says so plainly, and keeps
the TVM memory of that call and of the device's :class:`PackedWeights` allocated for the rest
of the process (the driver takes it back at exit), instead of letting a free abort it.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref

from ..errors import DeviceError, RnnccError
from . import tvm_runtime

#: Devices ("cuda:0") whose context this process lost, and the error that showed it.
_lost: dict[str, str] = {}
#: Packed weights that hold TVM memory, to keep allocated if their device is lost.
_packed: weakref.WeakSet = weakref.WeakSet()

ADVICE = ("no CUDA work can run in this process any more (PyTorch's neither): restart it. "
          "rnncc keeps the GPU memory it had allocated there (freeing it would abort the "
          "process). A persistent kernel stops so when a block waits on another for more than "
          "2^34 GPU cycles (about 9 s at 1.9 GHz): another process held the GPU that long, or "
          "a fault stopped a block; run it again under compute-sanitizer to see which")


def track(packed) -> None:
    """Remember ``packed`` (it holds TVM memory that must outlive a lost context)."""
    _packed.add(packed)


def _keep_forever(obj) -> None:
    """One reference to ``obj`` that is never released, so what it holds is never freed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _context_lost(kind: str, index: int) -> bool:
    try:
        tvm_runtime.device(kind, index).sync()
    except Exception:  # noqa: BLE001 - any failure to synchronise is a lost context
        return True
    return False


def check(family) -> None:
    """Raise :class:`DeviceError` at once where this process already lost ``family``'s device."""
    where = family.describe_device()
    if where in _lost:
        raise DeviceError(f"the CUDA context of this process on {where} was lost earlier "
                          f"({_lost[where]}); {ADVICE}")


@contextlib.contextmanager
def guard(family, what: str):
    """Run ``what`` (a module call on ``family``'s device); a failure that lost the CUDA context
    becomes :class:`DeviceError`, and the call's memory (held by the failure's frames) and the
    device's packed weights stay allocated."""
    check(family)
    try:
        yield
    except RnnccError:
        raise
    except Exception as err:
        if family.device_kind != "cuda" or not _context_lost(family.device_kind,
                                                             family.device_index):
            raise
        where = family.describe_device()
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _lost[where] = reason
        _keep_forever(err)  # its traceback's frames hold the call's tensors
        for packed in list(_packed):
            if packed.device == where:
                _keep_forever(packed)
        raise DeviceError(f"{what} failed on {where} and the CUDA context of this process is "
                          f"lost ({reason}); {ADVICE}") from err
