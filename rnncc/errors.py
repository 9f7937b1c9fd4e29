"""rnncc's errors: each says what was given and what is allowed."""

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category=UserWarning) -> None:
    """Warn, naming the caller's first line outside rnncc (where the user called it)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class RnnccError(Exception):
    """Base class of every error rnncc raises on purpose."""


class ConfigError(RnnccError, ValueError):
    """An unsupported or malformed configuration: sizes, dtype, target, cell, schedule."""


class InputError(RnnccError, ValueError):
    """A wrong argument to a compiled module: shape, dtype, device, layout or a missing weight."""


class CellError(RnnccError, ValueError):
    """A cell definition that rnncc cannot compile (wrong arity, not element-wise, ...)."""


class BuildError(RnnccError, RuntimeError):
    """Compilation failed (a TVM pass, the CUDA compiler or the linker)."""


class ModuleFileError(RnnccError, OSError):
    """A module file that is missing, unreadable or not an rnncc module."""


class DeviceError(RnnccError, RuntimeError):
    """The GPU failed a call (a faulted kernel): the process's CUDA context is lost."""
