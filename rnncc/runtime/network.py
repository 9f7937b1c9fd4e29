"""A whole network in one callable and one file: L layers of D directions run on their layer
modules, as ``torch.nn.LSTM(..., num_layers=L, bidirectional=D == 2)`` runs them.

    net = rnncc.compile_network("lstm", C, H, N, layers=3, directions=2)
    y, (h_n, c_n) = net(x, lstm.state_dict(), h0=None, c0=None, lengths=None)
    net.export("lstm3.rnet");  net = rnncc.load("lstm3.rnet")

Shapes: x [T, N, C], y [T, N, D*H] (the forward direction's H first), states [L*D, N, H]
(layer l, direction d at l*D + d, as torch lays them out), ``lengths`` [N] (1 to T). Weights
by torch's names (``weight_ih_l{k}[_reverse]`` [G*H, C or D*H], ``weight_hh_l{k}[_reverse]``
[G*H, H], ``bias_ih_l{k}[_reverse]``, ``bias_hh_l{k}[_reverse]`` [G*H]): a torch module's
``state_dict()``, the module itself, or :meth:`Network.pack`'s result.

The network runs as stages, in layer order (:class:`Stage`): a wavefront module of several
unidirectional layers (one persistent launch), a layer module of all its directions, or a
one-direction module run once a direction (the reverse one on each sample's steps reversed;
on CUDA with PyTorch on a second stream, beside the forward one).
A wavefront that cannot run on the device runs layer by layer on its stage's fallback module,
and says so. Arrays: NumPy (host; each module copies to its device), PyTorch or CuPy; results
come back as the kind ``x`` was.

The file is a zip archive: ``network.json`` (the configuration and the stages) and the layer
modules' shared libraries, each once. Loading needs only TVM's runtime.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass

from ..errors import InputError, ModuleFileError, warn
from . import metadata as md
from . import streams
from .arrays import family_of
from .files import write_atomically
from .module import Module, check_packed

FORMAT = 1
MANIFEST = "network.json"
KINDS = ("layers", "layer", "split")


@dataclass(frozen=True)
class Stage:
    """Layers ``first`` to ``first + count - 1`` on ``module``. ``kind``: "layers" (a wavefront
    module of ``count`` unidirectional layers; ``fallback`` a one-layer module of input H that
    runs them one after another where the wavefront cannot run), "layer" (one layer, all its
    directions in ``module``) or "split" (one bidirectional layer on a one-direction module,
    run once a direction)."""

    kind: str
    first: int
    count: int
    module: Module
    fallback: Module | None = None


class NetworkWeights:
    """A network's weights packed for its stages on one device (from :meth:`Network.pack`):
    copies, which later in-place changes of the weights do not reach (pack them again)."""

    def __init__(self, network_key: str, device: str, runs: list, packs: list):
        self._network_key = network_key
        self.device = device
        self._runs = runs  # each stage's runs (:meth:`Network._runs`)
        self._packs = packs  # and their PackedWeights, in the same order

    def __repr__(self):
        return f"<rnncc.NetworkWeights for {self._network_key} on {self.device}>"


class Network:
    """A network of ``layers`` layers and ``directions`` directions of one cell, for batch N,
    on its stages' layer modules (:func:`rnncc.compile_network`, :func:`rnncc.load`)."""

    def __init__(self, meta: dict, stages: list[Stage], shown: str | None = None):
        self.metadata = meta
        self.stages = tuple(stages)
        self.shown = shown
        self._key = (f"{meta['cell']} C={meta['input_size']} H={meta['hidden_size']} "
                     f"N={meta['batch']} {meta['dtype']} {meta['layers']} layers"
                     + (" bidirectional" if meta["directions"] == 2 else ""))
        self._said: set = set()

    # -- description ---------------------------------------------------------------------
    cell = property(lambda self: self.metadata["cell"])
    input_size = property(lambda self: self.metadata["input_size"])
    hidden_size = property(lambda self: self.metadata["hidden_size"])
    layers = property(lambda self: self.metadata["layers"])
    directions = property(lambda self: self.metadata["directions"])
    batch = property(lambda self: self.metadata["batch"])
    dtype = property(lambda self: self.metadata["dtype"])
    takes_lengths = property(lambda self: bool(self.metadata["lengths"]))
    target = property(lambda self: self.metadata["target"]["kind"])

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(self.metadata["states"])

    @property
    def _names(self) -> tuple[str, ...]:
        """A layer's weights (torch's, W_hr with a projection, then the cell's per-unit
        parameters), without suffix."""
        return md.layer_weights(self.metadata)

    @property
    def proj_size(self) -> int:
        """P: the width of h and of each direction's y (a projection), or 0 (none)."""
        return int(self.metadata.get("proj_size", 0))

    @property
    def allow_tf32(self) -> bool:
        """Whether float32 products may run in TF32 (``allow_tf32=True``); IEEE if not."""
        return bool(self.metadata.get("allow_tf32", False))

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The weights by torch's names, layer by layer, direction by direction."""
        suffixes = ("", "_reverse")[:self.directions]
        return tuple(f"{name}_l{layer}{suffix}" for layer in range(self.layers)
                     for suffix in suffixes for name in self._names)

    def __repr__(self):
        kinds = ", ".join(f"{s.kind} {s.first}" + (f"-{s.first + s.count - 1}" if s.count > 1
                                                   else "") for s in self.stages)
        return f"<rnncc.Network {self._key} ({kinds})>"

    # -- the file ------------------------------------------------------------------------
    def export(self, path: str) -> str:
        """Write the network to ``path`` (a zip archive: the configuration and each layer
        module once), whole, then renamed into place."""
        files, stages = {}, []
        for stage in self.stages:
            entry = {"kind": stage.kind, "first": stage.first, "count": stage.count}
            for role in ("module", "fallback"):
                module = getattr(stage, role)
                if module is not None:
                    entry[role] = files.setdefault(module.path, f"layer_module_{len(files)}.so")
            stages.append(entry)
        manifest = {**self.metadata, "format": FORMAT, "kind": "network", "stages": stages}

        def write(tmp):
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
                archive.writestr(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
                for source, name in files.items():
                    archive.write(source, name)
        return write_atomically(path, write)

    # -- weights -------------------------------------------------------------------------
    def _mapping(self, weights) -> dict:
        """``weights`` as a dict by torch's names, checked against the network's."""
        if hasattr(weights, "state_dict") and callable(weights.state_dict):
            if getattr(weights, "batch_first", False):
                raise InputError(f"weights is a {type(weights).__name__} with "
                                 "batch_first=True, but this network takes x as [T, N, C]: "
                                 "pass its state_dict() and x.transpose(0, 1)")
            weights = weights.state_dict()
        if not hasattr(weights, "keys"):
            raise InputError("weights must be a mapping by torch's names (weight_ih_l0 ...; a "
                             "state_dict works) or NetworkWeights, got "
                             f"{type(weights).__name__}")
        keys, names = set(weights.keys()), self.weight_names
        unexpected = sorted(keys - set(names))
        if unexpected:
            raise InputError(f"unexpected weights {unexpected}: this network has "
                             f"{self.layers} layer{'s' if self.layers > 1 else ''}"
                             f"{' of 2 directions' if self.directions == 2 else ''} and takes "
                             f"{', '.join(names)}")
        missing = [n for n in names if not n.startswith("bias_") and n not in keys]
        if missing:
            raise InputError(f"missing weight {missing[0]!r}; expected {', '.join(names)}")
        absent = [n for n in names if n.startswith("bias_") and n not in keys]
        if absent and any(n.startswith("bias_") for n in keys):
            absent = absent[0]
            raise InputError(f"missing weight {absent!r}: pass the biases of all layers and "
                             "directions or of none (none means zero biases)")
        return dict(weights)

    def _runs(self, family, layer_by_layer: bool) -> list:
        """Each stage's runs: a list of (module, layer, count, direction or None) (direction:
        a one-direction module of a split stage)."""
        out = []
        for stage in self.stages:
            if stage.kind == "split":
                out.append([(stage.module, stage.first, 1, d) for d in range(2)])
                continue
            if stage.kind == "layers" and not layer_by_layer:
                try:
                    stage.module.entry_for(family)
                except InputError as err:
                    self._say("unfit", f"rnncc: {err}; its layers run one after another")
                else:
                    out.append([(stage.module, stage.first, stage.count, None)])
                    continue
            module = stage.fallback or stage.module
            out.append([(module, stage.first + k, 1, None) for k in range(stage.count)])
        return out

    def _say(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            warn(message)

    def _given(self, weights: dict, run) -> dict:
        """The weights of one run, renamed as its module takes them."""
        module, layer, count, direction = run
        out = {}
        for k in range(count):
            for d in range(module.directions):
                suffix = ("", "_reverse")[d if direction is None else direction]
                for name in self._names:
                    source = f"{name}_l{layer + k}{suffix}"
                    if source in weights:
                        out[f"{name}_l{k}{('', '_reverse')[d]}"] = weights[source]
        return out

    def pack(self, weights, device: str | None = None, layer_by_layer: bool = False
             ) -> NetworkWeights:
        """Lay ``weights`` out for every stage on their device (or ``device``, for NumPy
        weights: "cuda:1"), once, for repeated calls. ``layer_by_layer``: for the layer
        modules a wavefront falls back to (one layer after another)."""
        if isinstance(weights, NetworkWeights):
            return weights
        weights = self._mapping(weights)
        first = self.stages[0].module
        family = first._family_for(weights[self.weight_names[0]], device)
        return self._pack(weights, family, layer_by_layer)

    def _pack(self, weights: dict, family, layer_by_layer: bool) -> NetworkWeights:
        runs = self._runs(family, layer_by_layer)
        packs = [[run[0].pack(self._given(weights, run), device=family.describe_device())
                  for run in stage_runs] for stage_runs in runs]
        return NetworkWeights(self._key, family.describe_device(), runs, packs)

    # -- running -------------------------------------------------------------------------
    def __call__(self, x, weights, h0=None, c0=None, lengths=None, **initial):
        given = {"h0": h0, "c0": c0, **initial}
        for key, value in given.items():
            if value is not None and (not key.endswith("0") or key[:-1] not in self.states):
                raise InputError(f"{key} is not an initial state of cell {self.cell!r}; "
                                 f"it takes {', '.join(s + '0' for s in self.states)}")
        if lengths is not None and not self.takes_lengths:
            raise InputError(f"this network ({self._key}) takes no lengths; compile it with "
                             "lengths=True (rnncc compile --lengths)")
        family = family_of(x, self.stages[0].module.device_kind)
        packed = self._packed(weights, family, x, False)
        states = [given[f"{s}0"] for s in self.states]
        y, finals = self.run(x, states, lengths, packed)
        return (y, finals[0]) if len(finals) == 1 else (y, tuple(finals))

    def _packed(self, weights, family, x, layer_by_layer: bool) -> NetworkWeights:
        if not isinstance(weights, NetworkWeights):
            return self._pack(self._mapping(weights), family, layer_by_layer)
        check_packed(weights, weights._network_key, "network", self._key, family)
        return weights

    def run(self, x, states: list, lengths, packed: NetworkWeights, between=None):
        """y [T, N, D*H] and the final states (a list, [L*D, N, H] each) on ``x`` [T, N, C]
        from ``states`` (a list in the cell's order, [L*D, N, H] each or None: zeros).
        ``between(y)`` is applied to each layer's output before the next layer takes it
        (dropout; ``packed`` must then be packed layer by layer)."""
        ops = _ops(family_of(x, self.stages[0].module.device_kind).name)
        rows = self.layers * self.directions
        for k, (name, state) in enumerate(zip(self.states, states)):
            shape = [rows, self.batch, (self.proj_size or self.hidden_size) if k == 0
                     else self.hidden_size]
            if state is not None and list(state.shape) != shape:
                raise InputError(f"{name}0 has shape {list(state.shape)}, expected {shape} "
                                 f"([L*D, N, {'P' if k == 0 and self.proj_size else 'H'}])")
        finals = [[] for _ in self.states]
        for stage_runs, packs in zip(packed._runs, packed._packs):
            if between is not None and any(run[2] > 1 for run in stage_runs):
                raise InputError("between() needs the weights packed layer by layer")
            outputs = []
            # a split stage: the reverse direction beside the forward one (where ops can)
            side = ops.fork(x) if stage_runs[-1][3] == 1 else None
            for run, pack in zip(stage_runs, packs):
                module, layer, count, direction = run
                first = layer * self.directions + (direction or 0)
                own = slice(first, first + count * module.directions)
                with ops.on(side if direction == 1 else None):
                    initial = {f"{n}0": None if s is None else ops.rows(s, own)
                               for n, s in zip(self.states, states)}
                    source = x if direction != 1 else ops.reverse(x, lengths)
                    y, ends = module(source, pack, lengths=lengths, **initial)
                    ends = ends if isinstance(ends, tuple) else (ends,)
                    outputs.append(y if direction != 1 else ops.reverse(y, lengths))
                for k, end in enumerate(ends):
                    finals[k].append(end)
                if direction is None:
                    x = outputs.pop()
                    if between is not None and layer < self.layers - 1:
                        x = between(x)
                elif direction == 1:
                    ops.join(side, [outputs[-1], *ends])
            if outputs:  # a split stage: the two directions side by side
                x = ops.cat(outputs, 2)
                if between is not None and stage_runs[0][1] < self.layers - 1:
                    x = between(x)
        return x, [ops.cat(f, 0) for f in finals]


class _Ops:
    """The array operations a network needs between its modules, for one array family."""

    def __init__(self, lib, take):
        self.lib, self._take = lib, take

    def fork(self, x):
        """Before a bidirectional layer's two runs: where its reverse direction runs beside
        the forward one (None: after it, on the same stream)."""
        return None

    def on(self, side):
        """A context in which work goes to ``side`` (:meth:`fork`'s), or where it goes."""
        return contextlib.nullcontext()

    def join(self, side, results: list) -> None:
        """After the reverse direction's run on ``side``: what follows waits for it, and its
        ``results`` are used there."""

    def rows(self, a, own: slice):
        return self.lib.ascontiguousarray(a[own])

    def cat(self, parts: list, axis: int):
        return parts[0] if len(parts) == 1 else self.lib.concatenate(parts, axis)

    def reverse(self, x, lengths):
        """Each sample's steps reversed within its length (``x[lengths[n] - 1 - t, n]`` for t <
        lengths[n]; the steps past it stay where they are): x [T, N, F]."""
        lib = self.lib
        if lengths is None:
            return lib.ascontiguousarray(x[::-1])
        lengths = lib.asarray(lengths).astype("int64")
        steps = lib.arange(x.shape[0])[:, None]
        index = lib.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
        return self._take(x, index)


class _TorchOps(_Ops):
    def __init__(self):
        import torch

        self.torch = torch

    def fork(self, x):
        """On CUDA the side stream (:func:`.streams.side_stream`), after the work queued so
        far on the current stream: per-step kernels that leave most of the GPU idle (a split
        stage's modules are not persistent) overlap with the other direction's."""
        return streams.fork(x.device) if x.is_cuda else None

    def on(self, side):
        return contextlib.nullcontext() if side is None else self.torch.cuda.stream(side)

    def join(self, side, results: list) -> None:
        if side is not None:
            streams.join(side, results)

    def rows(self, a, own: slice):
        return a[own].clone(memory_format=self.torch.contiguous_format)

    def cat(self, parts: list, axis: int):
        return parts[0] if len(parts) == 1 else self.torch.cat(parts, axis)

    def reverse(self, x, lengths):
        torch = self.torch
        if lengths is None:
            return torch.flip(x, [0])
        lengths = torch.as_tensor(lengths, device=x.device)
        steps = torch.arange(x.shape[0], device=x.device)[:, None]
        index = torch.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
        return torch.gather(x, 0, index[:, :, None].expand(-1, -1, x.shape[2]))


def _ops(family: str) -> _Ops:
    if family == "torch":
        return _TorchOps()
    if family in ("numpy", "cupy"):
        import importlib

        lib = importlib.import_module(family)
        return _Ops(lib, lambda x, index: lib.take_along_axis(x, index[:, :, None], 0))
    raise InputError("a network takes x as a NumPy array, a PyTorch tensor or a CuPy array "
                     f"(it joins its layers' results), got a {family} tensor")


def is_network_file(path: str) -> bool:
    """Whether ``path`` is a network file (a zip archive), not a layer module."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def read_manifest(path: str, shown: str | None = None) -> dict:
    """A network file's configuration and stages (``network.json``), checked; each stage's
    modules' metadata under "modules" (file name to metadata). Needs no TVM."""
    shown = shown or path
    try:
        with zipfile.ZipFile(path) as archive:
            manifest = json.loads(archive.read(MANIFEST).decode())
            names = set(archive.namelist())
            modules = {}
            for stage in manifest.get("stages", []):
                for role in ("module", "fallback"):
                    name = stage.get(role)
                    if name is not None and name not in modules:
                        if name not in names:
                            raise ModuleFileError(f"{shown!r}: stage module {name} is missing")
                        modules[name] = md.metadata_of(archive.read(name), f"{shown}:{name}")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        if isinstance(err, ModuleFileError):
            raise
        raise ModuleFileError(f"{shown!r} is not a readable rnncc network file "
                              f"({type(err).__name__}: {err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get(
            "kind") != "network":
        raise ModuleFileError(f"{shown!r}: not an rnncc network of format {FORMAT}")
    stages = manifest.get("stages")
    if not stages or any(s.get("kind") not in KINDS or "module" not in s for s in stages):
        raise ModuleFileError(f"{shown!r}: its stages are damaged")
    manifest["modules"] = modules
    return manifest


def load_network(path: str) -> Network:
    """A network from its file (see :func:`rnncc.load`): each layer module is copied out of
    the archive into a folder of its own that goes with it."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    loaded = {}
    with zipfile.ZipFile(path) as archive:
        for name, meta in manifest.pop("modules").items():
            folder = tempfile.mkdtemp(prefix="rnncc_module_")
            local = os.path.join(folder, name)
            try:
                with archive.open(name) as src, open(local, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except OSError as err:
                shutil.rmtree(folder, ignore_errors=True)
                raise ModuleFileError(f"cannot unpack {path!r}: {err}") from err
            loaded[name] = Module(local, meta, owned_dir=folder, shown=f"{path}:{name}")
    stages = [Stage(s["kind"], s["first"], s["count"], loaded[s["module"]],
                    loaded.get(s.get("fallback"))) for s in manifest.pop("stages")]
    for key in ("format", "kind"):
        manifest.pop(key)
    return Network(manifest, stages, shown=path)
