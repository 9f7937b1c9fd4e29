"""A whole network run on layer modules: layers in turn, both directions, samples of their own
lengths, any batch.

Shapes: x [T, N, C] (time major), states [L*D, N, H] (layer l, direction d at l*D + d, as
torch lays them out), y [T, N, D*H] (the forward direction's H first). Each (layer,
direction) runs one compiled layer module (:mod:`rnncc.compiler.cache`: compiled on first use,
kept on disk) for a batch bucket: the next power of two of N, the rows past N padded (zero
inputs and states, length 1) and dropped from the results, so that a module serves every batch
up to its bucket. The reverse direction runs the module on each sample's steps reversed (its
last step first: ``x[lengths[n] - 1 - t, n]``) and reverses its outputs back. With lengths,
the modules take them (``lengths=True``): a sample's final states are those of its own last
step and its outputs past it are zero.
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

    def run(self, x, states, lengths, weights, between=None):
        """y [T, N, D*H] and the final states (a list, [L*D, N, H] each) of the network on
        ``x`` [T, N, C] from ``states`` (a list, [L*D, N, H] each). ``lengths``: [N] on x's
        device, or None (all T). ``weights(layer, direction)``: that layer's torch-named
        weights (``weight_ih_l0`` ...). ``between(y)``: applied to a layer's output before the
        next layer takes it (dropout)."""
        import torch

        lay = self.layout
        finals = [[None] * (lay.layers * lay.directions) for _ in states]
        layer_input = x
        for layer in range(lay.layers):
            outs = []
            for d in range(lay.directions):
                index = layer * lay.directions + d
                seq = layer_input if d == 0 else reverse(layer_input, lengths)
                y, ends = self._layer(layer, d, seq, [s[index] for s in states], lengths,
                                      weights(layer, d))
                outs.append(y if d == 0 else reverse(y, lengths))
                for k, end in enumerate(ends):
                    finals[k][index] = end
            layer_input = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0].contiguous()
            if between is not None and layer < lay.layers - 1:
                layer_input = between(layer_input)
        return layer_input, [torch.stack(f) for f in finals]

    def _layer(self, layer, direction, x, states, lengths, weights):
        """One layer, one direction: y [T, N, H] and its final states ([N, H] each)."""
        import torch

        steps, n, _ = x.shape
        rows = bucket(n)
        module = self._module(self.layout.layer_input(layer), rows, _dtype_name(x.dtype),
                              lengths is not None)
        if rows != n:
            x = torch.cat([x, x.new_zeros(steps, rows - n, x.shape[2])], dim=1)
            states = [torch.cat([s, s.new_zeros(rows - n, s.shape[1])]) for s in states]
            if lengths is not None:
                lengths = torch.cat([lengths, lengths.new_ones(rows - n)])
        initial = {f"{name}0": s[None].clone(memory_format=torch.contiguous_format)
                   for name, s in zip(module.states, states)}
        y, finals = module(_aligned(x), self._weights(layer, direction, module, weights),
                           lengths=None if lengths is None else _aligned(lengths), **initial)
        finals = finals if isinstance(finals, tuple) else (finals,)
        return y[:, :n], [f[0, :n] for f in finals]

    def _module(self, width: int, rows: int, dtype: str, lengths: bool):
        """The layer module of input width ``width`` for ``rows`` batch rows, looked up in the
        compile cache once (the cache hashes cell files and asks for the GPU)."""
        from ..compiler import cache

        key = (width, rows, dtype, lengths)
        if key not in self._modules:
            self._modules[key] = cache.compiled(
                self.layout.cell, width, self.layout.hidden_size, rows, dtype=dtype,
                target=self.target, arch=self.arch, lengths=lengths)
        return self._modules[key]

    def _weights(self, layer, direction, module, weights):
        """The layer's weights packed for ``module``, packed again when one changes (a new
        tensor, or an in-place change: torch counts those)."""
        stamp = tuple((w.data_ptr(), w._version, w.device) for w in weights.values())
        key = (layer, direction, module._key)
        found = self._packed.get(key)
        if found is None or found[0] != stamp:
            found = (stamp, module.pack({k: w.detach() for k, w in weights.items()}))
            self._packed[key] = found
        return found[1]


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
