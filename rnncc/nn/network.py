"""A whole network run on layer modules: layers in turn, both directions, samples of their own
lengths, any batch.

Shapes: x [T, N, C] (time major), states [L*D, N, H] (layer l, direction d at l*D + d, as
torch lays them out), y [T, N, D*H] (the forward direction's H first).

Each layer runs one compiled layer module of both its directions (:mod:`rnncc.compiler.cache`:
compiled on first use, kept on disk; ``directions=2``: one launch of the persistent kernel runs
the two recurrences side by side, the reverse one from each sample's own last step). Where
that kernel does not fit (at large batches, where one direction takes all the GPU's batch
groups), each direction runs a module of its own in turn, the reverse one on each sample's
steps reversed (``x[lengths[n] - 1 - t, n]``, and its outputs back).

Stacked unidirectional layers run as a wavefront on CUDA (a module of several layers,
``layers=L``: one persistent launch, layer l at step t while layer l - 1 runs a few steps
ahead): all the layers where C = H, else the layers above the first; where that kernel does
not fit or cannot run on the device, and while dropout acts between layers (training), the
layers run in turn.

A module is compiled for a batch bucket, the next power of two of N: the rows past N are
padded (zero inputs and states, length 1) and dropped from the results, so that a module
serves every batch up to its bucket. With lengths, the modules take them (``lengths=True``): a
sample's final states are those of its own last step and its outputs past it are zero.
"""

from __future__ import annotations

from dataclasses import dataclass


def bucket(batch: int) -> int:
    """The batch a module is compiled for to serve ``batch`` rows: the next power of two."""
    return 1 << (batch - 1).bit_length()


@dataclass(frozen=True)
class Layout:
    """The network: the cell, C, H, L layers, D directions."""

    cell: object
    input_size: int
    hidden_size: int
    layers: int
    directions: int

    def layer_input(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.hidden_size * self.directions


class Network:
    """Runs :class:`Layout`'s network on layer modules for one target; keeps each (layer,
    direction)'s weights packed for its module until they change."""

    def __init__(self, layout: Layout, target: str, arch: str | None):
        self.layout, self.target, self.arch = layout, target, arch
        self._packed: dict = {}
        self._modules: dict = {}
        self._waves: dict = {}

    def run(self, x, states, lengths, weights, between=None):
        """y [T, N, D*H] and the final states (a list, [L*D, N, H] each) of the network on
        ``x`` [T, N, C] from ``states`` (a list, [L*D, N, H] each). ``lengths``: [N] on x's
        device, or None (all T). ``weights(layer, direction)``: that layer's torch-named
        weights (``weight_ih_l0`` ...). ``between(y)``: applied to a layer's output before the
        next layer takes it (dropout)."""
        import torch

        lay = self.layout
        dirs = lay.directions
        finals = [[] for _ in states]
        layer_input = x
        wave = None if between is not None else self._wavefront(x, lengths)
        for layer in range(lay.layers):
            if wave is not None and layer >= wave[0]:
                if layer == wave[0]:
                    layer_input, ends = self._run_wavefront(wave, layer_input, states, lengths,
                                                            weights)
                    for k, end in enumerate(ends):
                        finals[k].append(end)
                continue
            own = slice(layer * dirs, (layer + 1) * dirs)
            layer_input, ends = self._layer(layer, layer_input, [s[own] for s in states],
                                            lengths, weights)
            for k, end in enumerate(ends):
                finals[k].append(end)
            if between is not None and layer < lay.layers - 1:
                layer_input = between(layer_input)
        return layer_input.contiguous(), [torch.cat(f) for f in finals]

    def _wavefront(self, x, lengths):
        """(first layer, module) of the wavefront that runs the layers from the first on, or
        None where the layers run in turn (see the module docstring)."""
        from ..compiler import cache
        from ..errors import BuildError, ConfigError, InputError
        from ..runtime.arrays import family_of

        lay = self.layout
        first = 0 if lay.input_size == lay.hidden_size else 1
        count = lay.layers - first
        if self.target != "cuda" or lay.directions != 1 or count < 2:
            return None
        key = (bucket(x.shape[1]), _dtype_name(x.dtype), lengths is not None, count)
        if key not in self._waves:
            try:
                module = cache.compiled(self.layout.cell, lay.hidden_size, lay.hidden_size,
                                        key[0], dtype=key[1], target=self.target,
                                        arch=self.arch, lengths=key[2], layers=count)
                module.entry_for(family_of(x, "cuda"))  # its grid runs on this device
            except (ConfigError, BuildError, InputError):
                module = None
            self._waves[key] = module
        return None if self._waves[key] is None else (first, self._waves[key])

    def _run_wavefront(self, wave, x, states, lengths, weights):
        """The layers from ``wave``'s first on, in its module: y [T, N, H] and their final
        states ([L - first, N, H] each)."""
        first, module = wave
        given = {}
        for layer in range(first, self.layout.layers):
            given.update({name.replace("_l0", f"_l{layer - first}"): w
                          for name, w in weights(layer, 0).items()})
        return self._run(module, ("wavefront", first), x, [s[first:] for s in states],
                         lengths, given)

    def _layer(self, layer, x, states, lengths, weights):
        """One layer, all its directions: y [T, N, D*H] and its final states ([D, N, H]
        each)."""
        import torch

        key = (self.layout.layer_input(layer), bucket(x.shape[1]), _dtype_name(x.dtype),
               lengths is not None)
        module = self._module(*key, self.layout.directions)
        if module.directions == self.layout.directions:
            given = {}
            for d in range(module.directions):
                suffix = "_reverse" if d else ""
                given.update({name + suffix: w for name, w in weights(layer, d).items()})
            return self._run(module, (layer, None), x, states, lengths, given)
        y, ends = self._run(module, (layer, 0), x, [s[:1] for s in states], lengths,
                            weights(layer, 0))
        back, back_ends = self._run(module, (layer, 1), reverse(x, lengths),
                                    [s[1:] for s in states], lengths, weights(layer, 1))
        return (torch.cat([y, reverse(back, lengths)], dim=2),
                [torch.cat(pair) for pair in zip(ends, back_ends)])

    def _run(self, module, which, x, states, lengths, weights):
        """``module`` on x [T, N, C] and states ([D, N, H] each), padded to its batch, with
        ``weights`` (torch-named, packed once for ``which``: (layer, direction)): y [T, N,
        D*H] and the final states ([D, N, H] each)."""
        import torch

        steps, n, _ = x.shape
        rows = module.batch
        if rows != n:
            x = torch.cat([x, x.new_zeros(steps, rows - n, x.shape[2])], dim=1)
            states = [torch.cat([s, s.new_zeros(s.shape[0], rows - n, s.shape[2])], dim=1)
                      for s in states]
            if lengths is not None:
                lengths = torch.cat([lengths, lengths.new_ones(rows - n)])
        initial = {f"{name}0": s.clone(memory_format=torch.contiguous_format)
                   for name, s in zip(module.states, states)}
        y, finals = module(_aligned(x), self._weights(which, module, weights),
                           lengths=None if lengths is None else _aligned(lengths), **initial)
        finals = finals if isinstance(finals, tuple) else (finals,)
        return y[:, :n], [f[:, :n] for f in finals]

    def _module(self, width: int, rows: int, dtype: str, lengths: bool, directions: int):
        """The layer module of input width ``width`` for ``rows`` batch rows and
        ``directions``, looked up in the compile cache once (the cache hashes cell files and
        asks for the GPU). For two directions on CUDA: the one-direction module instead where
        the two-direction one has no persistent kernel (measured on an H200: where neither
        has, LSTM 1024 at batch 64, the two one-direction modules took 277 us a step for three
        layers, the two-direction ones 300)."""
        from ..compiler import cache

        key = (width, rows, dtype, lengths, directions)
        if key not in self._modules:
            module = cache.compiled(
                self.layout.cell, width, self.layout.hidden_size, rows, dtype=dtype,
                target=self.target, arch=self.arch, lengths=lengths, directions=directions)
            if directions == 2 and self.target == "cuda" and not _persistent(module):
                module = self._module(width, rows, dtype, lengths, 1)
            self._modules[key] = module
        return self._modules[key]

    def _weights(self, which, module, weights):
        """``weights`` (torch-named) packed for ``module``, kept for ``which`` and packed
        again when one changes (a new tensor, or an in-place change: torch counts those)."""
        stamp = tuple((w.data_ptr(), w._version, w.device) for w in weights.values())
        key = (which, module._key)
        found = self._packed.get(key)
        if found is None or found[0] != stamp:
            found = (stamp, module.pack({k: w.detach() for k, w in weights.items()}))
            self._packed[key] = found
        return found[1]


def _persistent(module) -> bool:
    return module.metadata["schedule"]["kind"] == "persistent"


def reverse(x, lengths):
    """Each sample's steps reversed within its length (``x[lengths[n] - 1 - t, n]`` for t <
    lengths[n]; the steps past it stay where they are): x [T, N, F]."""
    import torch

    if lengths is None:
        return torch.flip(x, [0])
    steps = torch.arange(x.shape[0], device=x.device)[:, None]
    index = torch.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return torch.gather(x, 0, index[:, :, None].expand(-1, -1, x.shape[2]))


def _aligned(t):
    """``t``, or a contiguous copy where it is not contiguous or not 64-byte aligned (as the
    modules' generated code assumes)."""
    import torch

    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
