"""A compiled rnncc module: one recurrent layer (or a wavefront of layers), called like
``torch.nn.LSTM/GRU/RNN``.

    y, (h_n, c_n) = m(x, weights, h0=None, c0=None)   # cells with states h and c (LSTM)
    y, h_n = m(x, weights, h0=None)                    # cells with one state (GRU, RNN)
    y, h_n = m(x, weights, lengths=lengths)            # a module compiled with lengths=True

x is [T, N, C], y [T, N, D*H], states [D, N, H] (D = 2 directions for a bidirectional module,
else 1); ``lengths`` [N] (1 to T) stops each sample at its own length (final states of its own
last step, y zero past it; the reverse direction starts at it); ``weights`` is a mapping with
PyTorch's names (``weight_ih_l0`` [G*H, C], ``weight_hh_l0`` [G*H, H], ``bias_ih_l0``,
``bias_hh_l0`` [G*H], a cell's per-unit parameters ``<name>_l0`` [H] (its ``params``), with
a projection (``proj_size`` P: LSTMP) ``weight_hr_l0`` [P, H] (then W_hh is [G*H, P], y
[T, N, D*P] and h [D, N, P]), and the same with ``_reverse`` for a bidirectional module; a
``state_dict()`` of a one-layer torch module works as it is, and so does the torch module
itself), or the result of :meth:`Module.pack`, which lays the weights out for the kernels once
and keeps them on the device. A module of L > 1 layers (``layers=L``: unidirectional, C = H)
takes ``weight_ih_l{k}`` ... for k < L, states [L, N, H], and gives the last layer's y [T, N, H].
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref

import numpy as np

from ..errors import InputError, ModuleFileError, warn
from . import faults, tvm_runtime
from . import metadata as md
from .arrays import ALIGNMENT, Family, family_of, to_tensor
from .files import write_atomically

WEIGHTS = tuple(f"{name}_l0" for name in md.WEIGHTS)



def check_packed(packed, packed_for: str, owner: str, key: str, family: Family) -> None:
    """Raise :class:`InputError` unless ``packed`` (PackedWeights or NetworkWeights, packed for
    the key ``packed_for``) was packed for this ``owner`` ("module" or "network", its ``key``)
    and lies on x's device."""
    if packed_for != key:
        raise InputError(f"these {type(packed).__name__} were packed for {packed_for}, "
                         f"not for this {owner} ({key})")
    if packed.device != family.describe_device():
        raise InputError(f"weights are packed on {packed.device}, but x is on "
                         f"{family.describe_device()}")


class PackedWeights:
    """Weights laid out for one module's entry ("persistent" or "sequence") on one device
    (from :meth:`Module.pack`): a copy, which later in-place changes of the weights it was
    packed from do not reach (pack them again), unless packed with ``copy=False``."""

    def __init__(self, module: Module, family: Family, entry: str, tensors: dict, keep: list):
        self._module_key = module._key
        self.device = family.describe_device()
        self.entry = entry
        self.tensors = tensors
        self._keep = keep  # the arrays that own the tensors' memory
        faults.track(self)

    def __repr__(self):
        return f"<rnncc.PackedWeights for {self._module_key} on {self.device}>"


class Module:
    """A compiled module file and its metadata; the library loads on first use.

    ``Module.poison`` (off by default) fills every output and workspace with NaN before each
    call, so that an element a kernel does not write shows up; the test suite turns it on.
    """

    poison = False

    def __init__(self, path: str, metadata: dict, *, owned_dir: str | None = None,
                 shown: str | None = None):
        self.path = path
        self.shown = shown or path  # the file as the caller named it (errors say that)
        self.metadata = metadata
        self._lib = None
        self._entries: dict = {}
        self._shapes: dict = {}
        self._key = (f"{metadata['cell']} C={metadata['input_size']} H={metadata['hidden_size']} "
                     f"N={metadata['batch']} {metadata['dtype']} {metadata['target']['kind']}"
                     + (" bidirectional" if metadata.get("directions", 1) == 2 else "")
                     + (f" {metadata['layers']} layers" if metadata.get("layers", 1) > 1
                        else ""))
        if owned_dir is not None:  # a freshly compiled module owns its temporary file
            self._cleanup = weakref.finalize(self, shutil.rmtree, owned_dir, True)

    # -- description ---------------------------------------------------------------------
    @property
    def cell(self) -> str:
        return self.metadata["cell"]

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(self.metadata["states"])

    @property
    def input_size(self) -> int:
        return self.metadata["input_size"]

    @property
    def hidden_size(self) -> int:
        return self.metadata["hidden_size"]

    @property
    def batch(self) -> int:
        return self.metadata["batch"]

    @property
    def dtype(self) -> str:
        return self.metadata["dtype"]

    @property
    def takes_lengths(self) -> bool:
        """Whether the module takes the samples' lengths (compiled with ``lengths=True``)."""
        return bool(self.metadata.get("lengths"))

    @property
    def directions(self) -> int:
        """D: 2 for a bidirectional module (``directions=2``), else 1."""
        return int(self.metadata.get("directions", 1))

    @property
    def layers(self) -> int:
        """L: the layers of a wavefront module (``layers=L``), else 1."""
        return int(self.metadata.get("layers", 1))

    @property
    def params(self) -> tuple[str, ...]:
        """The cell's per-unit parameters (each a weight ``<name>_l0`` [H])."""
        return tuple(self.metadata.get("params", ()))

    @property
    def proj_size(self) -> int:
        """P: the width of h and y (a projection ``weight_hr_l0`` [P, H]), or 0 (none)."""
        return int(self.metadata.get("proj_size", 0))

    @property
    def allow_tf32(self) -> bool:
        """Whether float32 products may run in TF32 (``allow_tf32=True``); IEEE if not."""
        return bool(self.metadata.get("allow_tf32", False))

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The weights the module takes, by PyTorch's names."""
        return sum(self._weight_groups(), ())

    def _weight_groups(self) -> list[tuple[str, ...]]:
        """The weights of each direction, or of each layer."""
        own = tuple(f"{name}_l0" for name in md.layer_weights(self.metadata))
        if self.layers > 1:
            return [tuple(name.replace("_l0", f"_l{k}") for name in own)
                    for k in range(self.layers)]
        return [own, tuple(f"{name}_reverse" for name in own)][:self.directions]

    @property
    def target(self) -> str:
        return self.metadata["target"]["kind"]

    @property
    def device_kind(self) -> str:
        return "cuda" if self.target == "cuda" else "cpu"

    def __repr__(self):
        return f"<rnncc.Module {self._key} ({self.metadata['schedule']['kind']})>"

    def source(self, which: str = "cuda") -> str:
        """The generated CUDA source ("cuda") or the scheduled TIR ("tir") of the module."""
        section = {"cuda": md.CUDA, "tir": md.TIR}.get(which)
        if section is None:
            raise ValueError(f"source() takes 'cuda' or 'tir', got {which!r}")
        sections = md.read_sections(self.path, self.shown)
        if section not in sections:
            raise ModuleFileError(f"this {self.target} module has no {which} source")
        return sections[section].decode()

    def export(self, path: str) -> str:
        """Write the module to ``path`` (one shared library, metadata included): whole, then
        renamed into place, so that a reader, or another writer, never sees half of one."""
        return write_atomically(path, lambda tmp: shutil.copyfile(self.path, tmp))

    # -- running -------------------------------------------------------------------------
    def _library(self):
        if self._lib is None:
            self._lib = tvm_runtime.load_library(self.path, self.target, self.shown)
        return self._lib

    def _signature(self, function: str):
        return self.metadata["functions"][function]

    def _function(self, entry: str, name: str) -> str:
        """The module function ``name`` of an entry (persistent functions are prefixed)."""
        prefixed = f"{entry}_{name}"
        return prefixed if entry != "sequence" and prefixed in self.metadata["functions"] else name

    def entry_for(self, family: Family) -> str:
        """"persistent" where the module has the persistent kernel and this device can run its
        grid at once (a cooperative launch needs every block resident), else "sequence"."""
        key = (family.device_kind, family.device_index)
        if key not in self._entries:
            self._library()  # a module that cannot load here says so before anything else
            self._entries[key] = "sequence"
            persistent = self.metadata["schedule"].get("persistent", {})
            if "persistent_forward" in self.metadata["functions"] and key[0] == "cuda":
                why = tvm_runtime.persistent_unfit(persistent["plan"], self.metadata["target"],
                                                   key[1])
                if why is None:
                    self._entries[key] = "persistent"
                elif "forward" not in self.metadata["functions"]:
                    raise InputError(f"this module ({self._key}) runs only as its persistent "
                                     f"kernel, and {why}")
                else:
                    warn(f"rnncc: {why}; this module runs its non-persistent schedule "
                                  f"on {family.describe_device()}")
        return self._entries[key]

    def _weights_mapping(self, weights) -> dict:
        if isinstance(weights, PackedWeights):
            return weights
        if hasattr(weights, "state_dict") and callable(weights.state_dict):
            if getattr(weights, "batch_first", False):
                raise InputError(f"weights is a {type(weights).__name__} with "
                                 "batch_first=True, but this module takes x as [T, N, C]: pass "
                                 "its state_dict() and x.transpose(0, 1), or use "
                                 "rnncc.nn.from_torch for the whole module")
            weights = weights.state_dict()
        if not hasattr(weights, "keys"):
            raise InputError(f"weights must be a mapping with {', '.join(WEIGHTS)} (a PyTorch "
                             f"state_dict works) or PackedWeights, got {type(weights).__name__}")
        keys, names = set(weights.keys()), self.weight_names
        unexpected = sorted(keys - set(names))
        if unexpected:
            what = ("one bidirectional layer" if self.directions == 2
                    else f"{self.layers} unidirectional layers" if self.layers > 1
                    else "one unidirectional layer")
            raise InputError(f"unexpected weights {unexpected}: this module is {what} and "
                             f"takes {', '.join(names)}")
        groups = self._weight_groups()
        for group in groups:
            missing = [k for k in group[:2] + group[4:] if k not in keys]
            biases = [k for k in group[2:4] if k in keys]
            if missing:
                raise InputError(f"missing weight {missing[0]!r}; expected {', '.join(names)}")
            if len(biases) == 1:
                other = ({*group[2:4]} - {*biases}).pop()
                raise InputError(f"missing weight {other!r}: pass both biases or neither "
                                 "(neither means zero biases)")
        if len({group[2] in keys for group in groups}) > 1:
            what = "layers" if self.layers > 1 else "directions"
            raise InputError(f"pass the biases of all {what} or of none (none means zero "
                             "biases)")
        return dict(weights)

    def pack(self, weights, device: str | None = None, entry: str | None = None,
             copy: bool = True) -> PackedWeights:
        """Lay ``weights`` out for this module, on the device of the weights (or ``device``,
        for NumPy weights: "cuda:1"), once, for repeated calls. ``entry`` forces "sequence"
        (the non-persistent schedule) or "persistent" (for comparisons); by default the
        module picks the persistent kernel where it has one that this device can run.
        ``copy=False``: where a packed weight is the given one as it is, use the given memory
        (no copy; later in-place changes of the weights then reach the packed ones)."""
        weights = self._weights_mapping(weights)
        if isinstance(weights, PackedWeights):
            return weights
        family = self._family_for(weights[self.weight_names[0]], device)
        chosen = self.entry_for(family)
        if entry is not None:
            if entry not in ("sequence", "persistent"):
                raise InputError(f"entry must be 'sequence' or 'persistent', got {entry!r}")
            if entry == "persistent" and chosen != "persistent":
                raise InputError(f"this module cannot run its persistent kernel on "
                                 f"{family.describe_device()} (see its metadata)")
            chosen = entry
        with faults.guard(family, f"packing the weights of {self._key}"):
            return self._pack(weights, family, chosen, copy)

    def _family_for(self, first, device: str | None) -> Family:
        family = family_of(first, self.device_kind)
        if device is not None and family.name == "numpy":
            kind, _, index = device.partition(":")
            if kind != self.device_kind:
                raise InputError(f"device {device!r}: this module runs on {self.device_kind}")
            family = Family("numpy", kind, int(index or 0))
        return family

    def _pack(self, weights: dict, family: Family, entry: str, copy: bool = True
              ) -> PackedWeights:
        lib = self._library()
        dtype, gh = self.dtype, self.metadata["gates"] * self.hidden_size
        tensors, keep = {}, []

        def run(function, ready=None):  # a module function on the weights, into new outputs
            args, sig = [], self._signature(function)
            same = [p for p in sig if p.get("same_as")]
            if not copy and same:  # the given weight as it is (a pack with one input)
                given = same[0]["same_as"]
                tensors[same[0]["name"]] = to_tensor(given, weights[given], sig[0]["shape"],
                                                     dtype, family)
                keep.append(weights[given])
                return
            for p in sig:
                name = p["name"]
                if ready and name in ready:
                    args.append(ready[name])
                elif p["kind"] == "input":
                    args.append(to_tensor(name, weights[name], p["shape"], dtype, family))
                elif p["kind"] == "output":
                    arr, tensors[name] = family.empty(p["shape"], p["dtype"])
                    args.append(tensors[name])
                    keep.append(arr)
                else:  # a workspace of the packing (W_hh W_hr before its layout), for this
                    # call only: freed after it in the stream's order (torch, CuPy), or by a
                    # free that waits for the device
                    args.append(family.empty(p["shape"], p["dtype"])[1])
            with family.stream():
                lib[function](*args)

        for which in ("ih", "hh", "hr")[:3 if self.proj_size else 2]:
            run(self._function(entry, f"pack_w_{which}"))
        zeros = {}  # biases not given: zero
        for name in self.weight_names:
            if name.startswith("bias_") and name not in weights:
                arr, zeros[name] = family.zeros([gh], dtype)
                keep.append(arr)
        if len(self._weight_groups()) > 1:
            run("pack_biases", zeros)
            return PackedWeights(self, family, entry, tensors, keep)
        vectors = [(f"bias_{which}_l0", f"b_{which}", gh) for which in ("ih", "hh")]
        vectors += [(f"{p}_l0", f"p_{p}", self.hidden_size) for p in self.params]
        for name, packed, width in vectors:
            if name in zeros:
                tensors[packed] = zeros[name]
            else:  # a copy, as the packed matrices are (unless not copied)
                given = to_tensor(name, weights[name], [width], dtype, family)
                if copy:
                    with family.stream():
                        arr, given = family.copy(given)
                keep.append(arr if copy else weights[name])
                tensors[packed] = given
        return PackedWeights(self, family, entry, tensors, keep)

    _said_no_grad = False

    def _check_grad(self, family: Family, x, given) -> None:
        """Say, once, that a call whose input or initial states require grad gets none (a
        module's call is inference only; rnncc.nn's modules and :meth:`train_forward` /
        :meth:`backward` give gradients)."""
        if self._said_no_grad or family.name != "torch":
            return
        import torch

        if torch.is_grad_enabled() and any(getattr(v, "requires_grad", False)
                                           for v in (x, *given.values())):
            self._said_no_grad = True
            warn("rnncc modules compute no gradients when called: the results do not require "
                 "grad and have no grad_fn; train through rnncc.nn's modules (or a module "
                 "compiled with training=True: train_forward, backward), or call under "
                 "torch.no_grad() to say that none is needed")

    def __call__(self, x, weights, h0=None, c0=None, lengths=None, **initial):
        family = family_of(x, self.device_kind)
        given = self._initial(h0, c0, lengths, initial)
        with faults.guard(family, f"a call of {self._key}"):
            return self._call(family, x, weights, given, lengths)

    def _initial(self, h0, c0, lengths, initial) -> dict:
        """The initial states given, by their parameter names, checked against the cell's."""
        if lengths is not None and not self.takes_lengths:
            raise InputError(f"this module ({self._key}) takes no lengths; compile it with "
                             "lengths=True (rnncc compile --lengths)")
        given = {"h0": h0, "c0": c0, **initial}
        for key, value in given.items():
            if value is not None and (not key.endswith("0") or key[:-1] not in self.states):
                raise InputError(f"{key} is not an initial state of cell {self.cell!r}; "
                                 f"it takes {', '.join(s + '0' for s in self.states)}")
        return given

    def _packed_for(self, family: Family, weights, entry: str | None) -> PackedWeights:
        """``weights`` packed for ``entry`` (default: the entry this device runs), or checked
        to be packed for this module, this device and ``entry``."""
        if not isinstance(weights, PackedWeights):
            return self._pack(self._weights_mapping(weights), family,
                              entry or self.entry_for(family))
        check_packed(weights, weights._module_key, "module", self._key, family)
        if entry is not None and weights.entry != entry:
            raise InputError(f"these weights are packed for the {weights.entry} entry; a "
                             f"training step takes them packed with entry={entry!r}")
        return weights

    def _call(self, family: Family, x, weights, given: dict, lengths):
        packed = self._packed_for(family, weights, None)
        self._check_grad(family, x, given)
        results = self._invoke(family, self._function(packed.entry, "forward"), x, packed,
                               given, lengths)
        return self._forward_results(results)

    def _forward_results(self, results: dict):
        finals = tuple(results[f"{s}_n"] for s in self.states)
        return (results["y"], finals[0]) if len(finals) == 1 else (results["y"], finals)

    def _invoke(self, family: Family, function: str, x, packed: PackedWeights, given: dict,
                lengths, lent=None) -> dict:
        """Run the module function ``function`` on x [T, N, C] and the packed weights; the
        other inputs from ``given`` by name (an absent initial state, or gradient of one, is
        zero), outputs and workspaces made here, or by ``lent(steps)`` (a dict of outputs by
        name, the caller's arrays, contiguous and aligned). Returns the outputs by name, as the
        caller's kind of array (read here, while this frame holds the call's memory: a kernel
        that faulted is seen before any of it is freed, see :mod:`.faults`)."""
        sig = self._signature(function)
        shapes = {p["name"]: p["shape"] for p in sig}
        if "x" in shapes:
            x_t = to_tensor("x", x, [None if d == "T" else d for d in shapes["x"]], self.dtype,
                            family)
            steps = int(x_t.shape[0])
        else:  # T from the first input that has it
            steps = next(int(given[p["name"]].shape[0]) for p in sig
                         if p["kind"] == "input" and p["shape"][:1] == ["T"])
        if steps < 1:
            raise InputError("x has 0 time steps; it needs at least 1")
        if function.startswith("persistent"):
            kernel = "persistent_backward" if function.endswith("backward") else "persistent"
            limit = (2**32 - 1) // self.metadata["schedule"][kernel]["plan"]["blocks"]
            if steps > limit:
                raise InputError(f"x has {steps} time steps; the persistent kernel of this "
                                 f"module takes at most {limit} (its barrier counter is 32-bit)")

        concrete = self._concrete_shapes(function, steps)
        args, results = [], {}
        lent = lent(steps) if lent else {}
        for p, shape in zip(sig, concrete):
            name, kind = p["name"], p["kind"]
            if name in lent:
                args.append(to_tensor(name, lent[name], shape, p["dtype"], family))
                results[name] = lent[name]
            elif name == "x":
                args.append(x_t)
            elif name == "lengths":
                args.append(_lengths(lengths, steps, self.batch, family))
            elif name in packed.tensors:
                args.append(packed.tensors[name])
            elif kind in ("input", "inout"):  # a state, a kept state or a gradient
                value = given.get(name)
                if value is None and kind == "input" and "T" not in p["shape"]:
                    args.append(family.zeros_to_read(shape, p["dtype"]))
                elif value is None:
                    args.append(family.zeros(shape, p["dtype"])[1])
                else:
                    args.append(to_tensor(name, value, shape, p["dtype"], family))
                if kind == "inout":  # the call overwrites it: returned, as it is after
                    results[name] = family.view(args[-1])
            else:
                float_out = p["dtype"].startswith("float")
                alloc = family.poisoned if self.poison and float_out else family.empty
                arr, tensor = alloc(shape, p["dtype"])
                args.append(tensor)
                if kind == "output":
                    results[name] = arr
        lib = self._library()
        with family.stream():
            lib[function](*args)
        return {name: family.result(arr) for name, arr in results.items()}

    def _concrete_shapes(self, function: str, steps: int) -> list:
        """The shapes of ``function``'s parameters for a run of ``steps`` steps, in its
        signature's order (kept for the last steps each function ran)."""
        found = self._shapes.get(function)
        if found is None or found[0] != steps:
            found = (steps, [tuple(md.concrete_dim(d, steps) for d in p["shape"])
                             for p in self._signature(function)])
            self._shapes[function] = found
        return found[1]

    # -- training ------------------------------------------------------------------------
    def _check_training(self) -> None:
        if "backward" not in self.metadata["functions"]:
            raise InputError(f"this module ({self._key}) was compiled without training "
                             "entries; compile it with training=True")

    def _training_function(self, family: Family, name: str) -> str:
        """``name`` ("train_forward" or "backward") or its persistent kernel's entry where the
        module has it and this device can run its grid at once (said once where it cannot)."""
        key = (name, family.device_kind, family.device_index)
        if key not in self._entries:
            self._entries[key] = name
            entry, kernel = {"train_forward": ("persistent_train_forward", "persistent"),
                             "backward": ("persistent_backward", "persistent_backward")}[name]
            plan = self.metadata["schedule"].get(kernel, {}).get("plan")
            if entry in self.metadata["functions"] and family.device_kind == "cuda":
                why = tvm_runtime.persistent_unfit(plan, self.metadata["target"],
                                                   family.device_index)
                if why is None:
                    self._entries[key] = entry
                else:
                    warn(f"rnncc: {why}; this module's {name} runs its non-persistent schedule "
                         f"on {family.describe_device()}")
        return self._entries[key]

    @property
    def consumed(self) -> list[str]:
        """The tensors of train_forward's ``kept`` that :meth:`backward` overwrites."""
        self._check_training()
        return [p["name"] for p in self._signature("backward") if p["kind"] == "inout"]

    def _kept_names(self) -> list[str]:
        """What train_forward keeps for backward: its outputs that backward takes."""
        taken = {p["name"] for p in self._signature("backward")
                 if p["kind"] in ("input", "inout")}
        return [p["name"] for p in self._signature("train_forward")
                if p["kind"] == "output" and p["name"] in taken]

    def train_forward(self, x, weights, h0=None, c0=None, lengths=None, **initial):
        """A training step's forward pass (a module compiled with ``training=True``): as a
        call, plus what :meth:`backward` takes, the states of every step (``<s>_steps``
        [T+1, N, H] each, the initial ones first, in the accumulation dtype; and ``pre`` [T, N,
        G*H], each step's projection sums, for cells whose step needs no more of them).
        Returns ``(y, finals, kept)``: finals as a call gives them, kept a dict by name.
        ``weights``: as for a call, or PackedWeights of ``pack(weights, entry="sequence")``."""
        self._check_training()
        family = family_of(x, self.device_kind)
        given = self._initial(h0, c0, lengths, initial)
        with faults.guard(family, f"a training step of {self._key}"):
            packed = self._packed_for(family, weights, "sequence")
            function = self._training_function(family, "train_forward")
            results = self._invoke(family, function, x, packed, given, lengths,
                                   self._y_in_h_steps(family, function, lengths))
            y, finals = self._forward_results(results)
            kept = {k: v for k, v in results.items() if k in self._kept_names()}
        return y, finals, kept

    def _y_in_h_steps(self, family: Family, function: str, lengths):
        """Where y [T, N, H] holds what h_steps [T+1, N, H] holds from its step 1 on (no
        lengths: no zeros past a sample's end; one dtype), a function of T that makes h_steps
        and lends y as its view there (one [T, N, H] buffer less for the backward pass to
        keep), else None. PyTorch tensors only, where the view is aligned."""
        sig = {p["name"]: p for p in self._signature(function)}
        if (family.name != "torch" or lengths is not None or "h_steps" not in sig
                or sig["h_steps"]["dtype"] != sig["y"]["dtype"]):
            return None
        dtype = sig["y"]["dtype"]
        width = self.proj_size or self.hidden_size
        if self.batch * width * np.dtype(dtype).itemsize % ALIGNMENT:
            return None

        def lent(steps):
            alloc = family.poisoned if self.poison else family.empty
            h_steps, _ = alloc([steps + 1, self.batch, width], dtype)
            return {"h_steps": h_steps, "y": h_steps[1:]}

        return lent

    def backward(self, x, weights, kept: dict, dy=None, finals_grad=None, lengths=None,
                 input_grad: bool = True) -> dict:
        """The gradients of a training step (a module compiled with ``training=True``):
        ``x``, ``weights`` and ``lengths`` as given to :meth:`train_forward`, ``kept`` what
        it returned, ``dy`` [T, N, H] the gradient of y, ``finals_grad`` those of the final
        states (one tensor, or a tuple in the cell's state order; None or a None item: zero).
        Returns a dict: ``x`` [T, N, C] (unless ``input_grad`` is False: then it is not
        computed), ``<s>0`` [1, N, H] each, and the weights' by torch's names (``weight_ih_l0``
        [G*H, C], ``weight_hh_l0`` [G*H, H], ``bias_ih_l0``, ``bias_hh_l0`` [G*H]; with a
        projection ``weight_hr_l0`` [P, H], and h's and W_hh's H is P).
        The tensors of ``kept`` that :attr:`consumed` names are overwritten (the projections'
        gradients take their memory): pass a step's kept to one backward."""
        self._check_training()
        family = family_of(x, self.device_kind)
        if finals_grad is None or not isinstance(finals_grad, (tuple, list)):
            finals_grad = (finals_grad,) + (None,) * (len(self.states) - 1)
        if len(finals_grad) != len(self.states):
            raise InputError(f"finals_grad has {len(finals_grad)} tensors; this cell has "
                             f"{len(self.states)} states ({', '.join(self.states)})")
        missing = [name for name in self._kept_names() if name not in kept]
        if missing:
            raise InputError(f"kept lacks {', '.join(missing)}: pass what train_forward "
                             "returned")
        given = {**kept, "dy": dy, **{f"d{s}_n": g for s, g in zip(self.states, finals_grad)}}
        with faults.guard(family, f"a training step of {self._key}"):
            packed = self._packed_for(family, weights, "sequence")
            results = self._invoke(family, self._training_function(family, "backward"), x,
                                   packed, given, lengths)
            # the projections' gradients, for dx: written over pre where it is laid out so
            dgi = results.pop("dgi") if "dgi" in results else results.pop("pre")
            if input_grad:
                results.update(self._invoke(family, "backward_input", None, packed,
                                            {"dgi": dgi}, lengths))
        names = {"dx": "x", "dweight_ih": "weight_ih_l0", "dweight_hh": "weight_hh_l0",
                 "dweight_hr": "weight_hr_l0",
                 "dbias_ih": "bias_ih_l0", "dbias_hh": "bias_hh_l0",
                 **{f"d{p}": f"{p}_l0" for p in self.params},
                 **{f"d{s}0": f"{s}0" for s in self.states}}
        return {names[k]: v for k, v in results.items()}


@functools.cache
def _checked():
    """The torch lengths checked already, with their version (a write in place changes it), T
    and N: a network's modules take the same lengths one after another, and each check waits
    for the device (a copy to the host)."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def _lengths(value, steps: int, batch: int, family: Family):
    """The samples' lengths as an int32 tensor on the call's device (all ``steps`` where
    ``value`` is None: made there for torch, so that a CUDA graph may capture the call), each
    checked to be 1 to T (a device tensor is read for the check, except while a CUDA graph is
    being captured, and once: :func:`_checked`)."""
    import numpy as np

    if value is None:
        if family.name == "torch":
            import torch

            value = torch.full((batch,), steps, dtype=torch.int32,
                               device=family.describe_device())
            return to_tensor("lengths", value, [batch], "int32", family)
        return to_tensor("lengths", np.full(batch, steps, np.int32), [batch], "int32", family)
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise InputError(f"lengths must be integers, got dtype {value.dtype}")
        _check_lengths(value.shape, int(value.min(initial=1)), int(value.max(initial=1)),
                       steps, batch)
        return to_tensor("lengths", np.ascontiguousarray(value, np.int32), [batch], "int32",
                         family)
    if family.name == "torch" and type(value).__module__.startswith("torch"):
        import torch

        if value.is_floating_point() or value.is_complex():
            raise InputError(f"lengths must be integers, got {value.dtype}")
        if value.device != torch.device(family.describe_device()):
            raise InputError(f"lengths is on {value.device}, but this call runs on "
                             f"{family.describe_device()} (where x is)")
        check_lengths_once(value, steps, batch)
        value = value.to(torch.int32).contiguous()
    return to_tensor("lengths", value, [batch], "int32", family)


def check_lengths_once(value, steps: int, batch: int) -> None:
    """An InputError unless torch lengths ``value`` [``batch``] (1-D: other shapes are left to
    the caller) has values from 1 to T = ``steps``; read on the host once for a tensor and its
    version (:func:`_checked`), not while a CUDA graph is being captured. An inference tensor
    has no version (written in place, it would not show): checked every call."""
    import torch

    seen = None if value.is_inference() else (value._version, steps, batch)
    if value.dim() == 1 and value.numel() and not (
            value.is_cuda and torch.cuda.is_current_stream_capturing()) and (
            seen is None or _checked().get(value) != seen):
        low, high = torch.stack(torch.aminmax(value)).tolist()  # one copy to the host
        _check_lengths(tuple(value.shape), low, high, steps, batch)
        if seen is not None:
            _checked()[value] = seen


def vouch_lengths(value, steps: int) -> None:
    """Record torch lengths [N] made from lengths known to be 1 to T = ``steps`` (checked by
    :func:`check_lengths_once`, or a PackedSequence's), so that the calls taking them do not
    read them back to check them."""
    if not value.is_inference():
        _checked()[value] = (value._version, steps, value.shape[0])


def _check_lengths(shape, low: int, high: int, steps: int, batch: int) -> None:
    if tuple(shape) != (batch,):
        raise InputError(f"lengths has shape {list(shape)}, expected [{batch}] (one a sample)")
    if low < 1 or high > steps:
        raise InputError(f"lengths must be from 1 to T = {steps} (the steps of x), got values "
                         f"from {low} to {high}")


def load_module(path: str) -> Module:
    """A module from its file (see :func:`rnncc.load`). The file is copied first, and the
    metadata and the library both come from the copy: the caller may overwrite or delete the
    file while the module is in use, and a file replaced meanwhile gives one module or the
    other, never a mix."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModuleFileError(f"module file {path!r} does not exist")
    tmp = tempfile.mkdtemp(prefix="rnncc_module_")
    local = os.path.join(tmp, os.path.basename(path))
    try:
        try:
            shutil.copyfile(path, local)
        except OSError as err:
            raise ModuleFileError(f"cannot read module file {path!r}: {err.strerror}") from err
        meta = md.read_metadata(local, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Module(local, meta, owned_dir=tmp, shown=path)
