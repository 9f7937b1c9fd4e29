"""A whole network run on compiled networks: any batch, samples of their own lengths.

Shapes: x [T, N, C] (time major), states [L*D, N, H] (layer l, direction d at l*D + d, as
torch lays them out), y [T, N, D*H] (the forward direction's H first).

The layers run as :func:`rnncc.compiler.compile_network` plans them (stacked unidirectional
layers as one wavefront launch on CUDA, a bidirectional layer's two directions in one launch;
see there), on modules compiled on first use and kept on disk (:mod:`rnncc.compiler.cache`).
While dropout acts between layers (training) the layers run one after another.

A network is compiled for a batch bucket, the next power of two of N: the rows past N are
padded (zero inputs and states, length 1) and dropped from the results, so that it serves
every batch up to its bucket. With lengths, the modules take them (``lengths=True``): a
sample's final states are those of its own last step and its outputs past it are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.module import check_lengths_once, vouch_lengths
from ..spec import Options


def bucket(batch: int) -> int:
    """The batch a module is compiled for to serve ``batch`` rows: the next power of two."""
    return 1 << (batch - 1).bit_length()


@dataclass(frozen=True)
class Layout:
    """The network: the cell, C, H, L layers, D directions, the projection's P (0: none),
    whether its float32 products may run in TF32, and whether as three TF32 products
    (tf32x3)."""

    cell: object
    input_size: int
    hidden_size: int
    layers: int
    directions: int
    proj_size: int = 0
    allow_tf32: bool = False
    tf32x3: bool = Options.tf32x3

    def module_options(self, dtype: str) -> dict:
        """The options of its modules in ``dtype`` beyond the sizes and the defaults (TF32 and
        tf32x3 for float32 only: the half types' products are on tensor cores in their own
        precision)."""
        tf32 = {"allow_tf32": True} if self.allow_tf32 else (
            {"tf32x3": self.tf32x3} if self.tf32x3 != Options.tf32x3 else {})
        return ({"proj_size": self.proj_size} if self.proj_size else {}) | (
            tf32 if dtype == "float32" else {})

    @property
    def recurrent_size(self) -> int:
        """R: the width of h and of each direction's y (P with a projection, else H)."""
        return self.proj_size or self.hidden_size

    def layer_input(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.recurrent_size * self.directions

    def state_shapes(self, batch: int) -> list[tuple]:
        """Each state's shape, in the cell's order: [L*D, N, R] for h, [L*D, N, H] else."""
        rows = self.layers * self.directions
        return [(rows, batch, self.recurrent_size if k == 0 else self.hidden_size)
                for k in range(len(self.cell.states))]


class Network:
    """Runs :class:`Layout`'s network for one target: a compiled network
    (:func:`rnncc.compiler.compile_network`, its modules from the disk cache) for each batch
    bucket, dtype and whether lengths are given, and the weights packed for it until they
    change; and the layer modules a training call runs (:meth:`training_module`)."""

    def __init__(self, layout: Layout, target: str, arch: str | None):
        self.layout, self.target, self.arch = layout, target, arch
        self._compiled: dict = {}
        self._training: dict = {}
        self._packed: dict = {}

    def run(self, x, states, lengths, weights, between=None):
        """y [T, N, D*H] and the final states (a list, [L*D, N, H] each) of the network on
        ``x`` [T, N, C] from ``states`` (a list, [L*D, N, H] each; empty: zeros, made by the
        modules, not copied to them). ``lengths``: [N] on x's device, or None (all T).
        ``weights``: the parameters by torch's names. ``between(y)``: applied to a layer's
        output before the next layer takes it (dropout; the layers then run one after
        another)."""
        import torch

        steps, n, _ = x.shape
        rows = bucket(n)
        network = self.compiled(rows, _dtype_name(x.dtype), lengths is not None)
        if lengths is not None:  # checked here once, not again for the rows padded to ``rows``
            check_lengths_once(lengths, steps, n)
        if rows != n:
            x = torch.cat([x, x.new_zeros(steps, rows - n, x.shape[2])], dim=1)
            states = [torch.cat([s, s.new_zeros(s.shape[0], rows - n, s.shape[2])], dim=1)
                      for s in states]
            if lengths is not None:
                lengths = torch.cat([lengths, lengths.new_ones(rows - n)])
        if lengths is not None:
            lengths = aligned(lengths)
            vouch_lengths(lengths, steps)
        packed = self._weights((rows, str(x.dtype), lengths is not None, between is not None),
                               network, weights)
        y, finals = network.run(aligned(x), states or [None] * len(self.layout.cell.states),
                                lengths, packed, between)
        if rows == n:
            return y, finals
        return y[:, :n].contiguous(), [f[:, :n].contiguous() for f in finals]

    def compiled(self, rows: int, dtype: str, lengths: bool):
        """The compiled network for ``rows`` batch rows, looked up in the compile cache once
        (the cache hashes cell files and asks for the GPU)."""
        from ..compiler import cache, compile_network

        key = (rows, dtype, lengths)
        if key not in self._compiled:
            lay = self.layout
            self._compiled[key] = compile_network(
                lay.cell, lay.input_size, lay.hidden_size, rows, layers=lay.layers,
                directions=lay.directions, dtype=dtype, target=self.target, arch=self.arch,
                lengths=lengths, build=cache.compiled, **lay.module_options(dtype))
        return self._compiled[key]

    def training_module(self, width: int, rows: int, dtype: str, lengths: bool):
        """The layer module compiled for training (:mod:`.training`) of input width C =
        ``width`` for ``rows`` batch rows, looked up in the compile cache once."""
        from ..compiler import cache

        key = (width, rows, dtype, lengths)
        if key not in self._training:
            lay = self.layout
            self._training[key] = cache.compiled(
                lay.cell, width, lay.hidden_size, rows, dtype=dtype, target=self.target,
                arch=self.arch, lengths=lengths, training=True, **lay.module_options(dtype))
        return self._training[key]

    def _weights(self, key: tuple, network, weights: dict):
        """``weights`` packed for ``network`` (layer by layer where ``key``'s last item says
        so), kept for ``key`` and packed again when one changes (a new tensor, or an in-place
        change: torch counts those)."""
        stamp = tuple((w.data_ptr(), w._version, w.device) for w in weights.values())
        found = self._packed.get(key)
        if found is None or found[0] != stamp:
            found = (stamp, network.pack({k: w.detach() for k, w in weights.items()},
                                         layer_by_layer=key[-1]))
            self._packed[key] = found
        return found[1]


def aligned(t):
    """``t``, or a contiguous copy where it is not contiguous or not 64-byte aligned (as the
    modules' generated code assumes)."""
    import torch

    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
