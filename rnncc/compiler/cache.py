"""Modules compiled on first use and kept on disk: a second process, or a restart, loads them.

A module is keyed by everything that changes its code: the cell (a built-in cell by name, a
cell file by its contents), the sizes, dtype, lengths, target and architecture, the GPU it
is compiled on (its tuning logs apply), the compile options, rnncc's version and source (its
Python files and its schedules', hashed once a process) and TVM's version.
The cache lives in ``$RNNCC_CACHE_DIR`` (default ``~/.cache/rnncc/modules``); files are
written whole and then renamed into place, so concurrent processes see a module or none, and
a file that does not load (damaged, or from another TVM build) is compiled again. A build
refused for good after compiling (a kernel that spills with every plan) is kept too, as a
``.refused.json`` beside where the module would be: the next process gets its BuildError at
once.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import time

from .._version import __version__
from ..errors import BuildError, ModuleFileError
from ..runtime.files import write_json

ENV = "RNNCC_CACHE_DIR"
#: A compile that takes longer than this many seconds is reported on stderr.
SLOW_SECONDS = 2.0

_loaded: dict = {}
_told: set = set()


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.environ.get(ENV) or os.path.join(base, "rnncc", "modules")


def _cell_identity(cell) -> str | None:
    """What identifies the cell's code: a built-in cell's name, a cell file's contents, or
    the source of its functions; None where none can be read (then nothing goes to disk)."""
    from .. import cells

    if cell.source:
        with open(cell.source, "rb") as f:
            return f"{cell.name}:{hashlib.sha256(f.read()).hexdigest()}"
    if cell.step.__module__.startswith(cells.__name__ + ".") and cells.get(cell.name) is cell:
        return cell.name  # built in: its code is rnncc's version's
    try:
        code = inspect.getsource(cell.step) + inspect.getsource(cell.reference)
    except (OSError, TypeError):
        return None
    return f"{cell.name}:{cell.gates}:{cell.states}:{hashlib.sha256(code.encode()).hexdigest()}"


@functools.cache
def _code_identity() -> str:
    """A hash of the source of rnncc and its schedules (the code that makes a module), so that
    a module compiled by other code of the same version (a working tree) is not reused.
    The schedules are found, not imported: the first call of an rnncc.nn module in training
    reaches here with its autograd graph on the stack, and TVMScript's parser, run by the
    import, keeps the frames it was called from in reference cycles (the graph's AccumulateGrad
    nodes alive until a collection, which a CUDA graph capture of the next step then refuses)."""
    schedules = importlib.util.find_spec(f"{__package__.rsplit('.', 1)[0]}.schedules")
    digest = hashlib.sha256()
    for root in (os.path.dirname(os.path.dirname(__file__)),
                 *schedules.submodule_search_locations):
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _key(cell_id: str, config: dict) -> str:
    import tvm

    text = json.dumps({"cell": cell_id, **config, "rnncc": __version__,
                       "code": _code_identity(), "tvm": tvm.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def compiled(cell, input_size: int, hidden_size: int, batch: int, *, dtype: str = "float32",
             target: str = "cuda", arch: str | None = None, lengths: bool = False,
             directions: int = 1, layers: int = 1, training: bool = False, **options):
    """The :class:`rnncc.Module` for this configuration: from this process's memory, the disk
    cache, or compiled now (and then cached). ``options`` go to
    :func:`rnncc.compiler.compile_module`."""
    from ..tuning.device import local_gpu
    from .driver import resolve_cell

    cell = resolve_cell(cell)
    gpu = local_gpu() if target == "cuda" else None
    config = {"input_size": input_size, "hidden_size": hidden_size, "batch": batch,
              "dtype": dtype, "target": target, "arch": arch, "lengths": lengths,
              "directions": directions, "layers": layers, "training": training,
              "gpu": gpu[1] if gpu else None, "options": options}
    cell_id = _cell_identity(cell)
    key = None if cell_id is None else _key(cell_id, config)
    memo = (id(cell), json.dumps(config, sort_keys=True)) if key is None else key
    if memo in _loaded:
        return _loaded[memo]
    path = None if key is None else os.path.join(
        cache_dir(), f"{cell.name}_c{input_size}_h{hidden_size}_n{batch}_d{directions}_"
                     f"l{layers}_{dtype}_{target}{'_train' if training else ''}_{key}.so")
    refused = None if path is None else path[:-len(".so")] + ".refused.json"
    if refused is not None and os.path.isfile(refused):
        _raise_refusal(refused)
    try:
        module = _load_or_compile(cell, config, path, refused)
    finally:
        # What runs here the first time in a process (TVMScript's parser in a compile, which
        # keeps ``inspect.stack()``; imports) leaves the caller's frames in reference
        # cycles: collected now, not at Python's next full collection, so that
        # what those frames hold is freed when they return (a torch training step whose
        # forward came here: its autograd graph, whose AccumulateGrad nodes a CUDA graph
        # capture of the next steps must not meet). About 0.1 s, once a configuration.
        gc.collect()
    _loaded[memo] = module
    return module


def _load_or_compile(cell, config: dict, path: str | None, refused: str | None):
    """The module from ``path`` in the disk cache, or compiled now and kept there."""
    from ..runtime.module import load_module
    from .driver import Spilled, compile_module

    if path is not None and os.path.isfile(path):
        try:
            return load_module(path)
        except (ModuleFileError, OSError):
            pass  # damaged or foreign: compiled again below
    start = time.monotonic()
    options = {k: v for k, v in config.items() if k not in ("gpu", "options")}
    try:
        module = compile_module(cell, **options, **config["options"])
    except Spilled as err:
        if refused is not None:
            _store_refusal(err, refused)
        raise
    seconds = time.monotonic() - start
    if path is not None:
        _store(module, path)
    if seconds > SLOW_SECONDS:
        _tell("slow", f"rnncc: compiled {module.metadata['cell']} C={config['input_size']} "
              f"H={config['hidden_size']} N={config['batch']} {config['dtype']} for "
              f"{config['target']} in {seconds:.0f} s (first use of these sizes; kept in "
              f"{cache_dir()} for later runs)")
    return module


def _store(module, path: str) -> None:
    """Write ``module`` to ``path`` (``Module.export`` writes whole, then renames into place);
    a cache that cannot be written is skipped, with a note."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        module.export(path)
    except (OSError, ModuleFileError) as err:
        _tell("unwritable", f"rnncc: cannot keep compiled modules in {folder} ({err}); set "
              f"{ENV} to a writable folder")


def _store_refusal(err: BuildError, path: str) -> None:
    """Keep a build that fails for every build of its configuration (a wavefront that spills
    with every plan) as a refusal, so that the next process is told at once instead of
    building it again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {"error": "BuildError", "message": str(err)})
    except (OSError, ModuleFileError):
        pass  # a cache that cannot be written: the build is tried again next time


def _raise_refusal(path: str) -> None:
    """The BuildError a refusal kept on disk records (a damaged record is removed)."""
    try:
        with open(path) as f:
            record = json.load(f)
        message = record["message"]
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    raise BuildError(f"{message} (a refusal kept in {path}; delete it to build again)")


def _tell(kind: str, message: str) -> None:
    """Say ``message`` on stderr, the first time of its ``kind`` only."""
    if kind not in _told:
        _told.add(kind)
        print(message, file=sys.stderr)
