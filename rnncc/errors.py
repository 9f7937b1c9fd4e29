"""rnncc's errors: each says what was given and what is allowed."""


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
