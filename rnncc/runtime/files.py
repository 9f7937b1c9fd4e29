"""Files rnncc writes: whole, then renamed into place, so that a reader, or another writer,
never sees half of one."""

from __future__ import annotations

import json
import os
import tempfile

from ..errors import ModuleFileError


def write_atomically(path: str, write) -> str:
    """``write(tmp)`` fills a temporary file beside ``path``, which then replaces ``path``;
    ModuleFileError naming ``path`` when it cannot be written (the temporary file is
    removed)."""
    path = os.fspath(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=".rnncc_", suffix=os.path.splitext(path)[1])
        os.close(fd)
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise ModuleFileError(f"cannot write {path!r}: {err.strerror}") from err
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json(path: str, value) -> str:
    """``value`` as JSON (indented) into ``path``, atomically (:func:`write_atomically`)."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
            f.write("\n")

    return write_atomically(path, write)
