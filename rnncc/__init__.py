"""rnncc: a TVM-based compiler for recurrent neural networks.

    import rnncc
    m = rnncc.compile("lstm", input_size=C, hidden_size=H, batch=N, target="cuda")
    y, (h_n, c_n) = m(x, lstm.state_dict())
    m.export("lstm.so");  m = rnncc.load("lstm.so")
    net = rnncc.compile_network("lstm", C, H, N, layers=3, directions=2)   # a whole network
    y, (h_n, c_n) = net(x, torch_lstm.state_dict());  net.export("lstm3.rnet")

Loading and calling a module needs only TVM's runtime; compiling imports the compiler lazily.
"""

from __future__ import annotations

import os as _os

from ._version import __version__
from .errors import (
    BuildError,
    CellError,
    ConfigError,
    DeviceError,
    InputError,
    ModuleFileError,
    RnnccError,
)

# In a source checkout schedules/ and cli/ sit beside this package; installed, they are
# rnncc.schedules and rnncc.cli. Let the checkout resolve them the same way.
_top = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "schedules")) and _os.path.isfile(
    _os.path.join(_top, "schedules", "__init__.py")
):
    __path__.append(_top)  # noqa: F821 - the package's own __path__

__all__ = [
    "__version__",
    "compile",
    "compile_network",
    "load",
    "Module",
    "PackedWeights",
    "Network",
    "NetworkWeights",
    "cells",
    "nn",
    "RnnccError",
    "ConfigError",
    "InputError",
    "CellError",
    "BuildError",
    "ModuleFileError",
    "DeviceError",
]


def compile(cell, input_size: int, hidden_size: int, batch: int,  # noqa: A001
            dtype: str = "float32", target: str = "cuda", arch: str | None = None,
            cpu: str | None = None, sms: int | None = None, knobs: dict | None = None,
            gpu: str | None = None, tuning: str = "auto", lengths: bool = False,
            directions: int = 1, layers: int = 1, **options):
    """Compile one recurrent layer (or a wavefront of layers) into a :class:`Module`.

    ``cell`` is a registered cell name, a :class:`rnncc.cells.Cell`, or the path of a cell
    file. ``options`` are :class:`rnncc.spec.Options` fields (cuDNN's optimisations, each on by
    default). A matching tuning log applies unless ``tuning="off"``. ``lengths=True``: the
    module takes each sample's length at run time; ``directions=2``: a bidirectional layer
    (y [T, N, 2*H], states [2, N, H], torch's ``_reverse`` weights too); ``layers=L``: L
    unidirectional layers of input size H in one persistent launch, layer l at step t while
    the layer below runs a few steps ahead (CUDA; states [L, N, H], weights ``_l0`` to
    ``_l{L-1}``). ``proj_size=P`` (one of ``options``): an LSTM with projections (LSTMP, as
    torch's ``proj_size``: ``weight_hr_l0`` [P, H], h and y P wide). See
    :func:`rnncc.compiler.compile_module`.
    """
    from .compiler import compile_module

    return compile_module(cell, input_size, hidden_size, batch, dtype=dtype, target=target,
                          arch=arch, cpu=cpu, sms=sms, knobs=knobs, gpu=gpu, tuning=tuning,
                          lengths=lengths, directions=directions, layers=layers, **options)


def compile_network(cell, input_size: int, hidden_size: int, batch: int, layers: int = 1,
                    directions: int = 1, dtype: str = "float32", target: str = "cuda",
                    arch: str | None = None, lengths: bool = False, **options):
    """Compile a whole network into a :class:`Network`: ``layers`` layers of ``directions``
    directions, as ``torch.nn.LSTM(C, H, num_layers=layers, bidirectional=directions == 2)``
    (x [T, N, C], y [T, N, D*H], states [L*D, N, H], torch's weight names), for batch N.
    ``options`` as :func:`compile` takes them, for every layer module. Stacked
    unidirectional layers of input H run as one wavefront launch on CUDA where it fits. See
    :func:`rnncc.compiler.compile_network`."""
    from .compiler import compile_network as build

    return build(cell, input_size, hidden_size, batch, layers=layers, directions=directions,
                 dtype=dtype, target=target, arch=arch, lengths=lengths, **options)


def load(path: str):
    """Load a module exported by :meth:`Module.export`, or a network by
    :meth:`Network.export` (needs only TVM's runtime)."""
    from .runtime.module import load_module
    from .runtime.network import is_network_file, load_network

    return load_network(path) if is_network_file(path) else load_module(path)


def __getattr__(name):
    if name in ("Module", "PackedWeights"):
        from .runtime import module

        return getattr(module, name)
    if name in ("Network", "NetworkWeights"):
        from .runtime import network

        return getattr(network, name)
    if name in ("cells", "nn"):  # rnncc.nn needs PyTorch: imported on first use
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'rnncc' has no attribute {name!r}")
