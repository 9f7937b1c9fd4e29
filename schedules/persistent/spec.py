"""What the persistent kernel's stages see: the plan and the layer it was made for.

The planner decides (:mod:`.planner`); a :class:`KernelSpec` carries its plan with the layer's
sizes and derives the index arithmetic that several stages share: which block's weights a block
holds, which batch rows it runs, and which (unit, batch) pairs a thread applies the cell to.
Letters as in the planner: B blocks (all batch groups), U units a block, Wn warps, RW rows a
warp, VEC elements a 16-byte chunk, KI chunks of K, IT pairs a thread, NG batch groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from . import planner
from .planner import Plan


def staged_rows(plan: Plan, local_batch: int) -> int:
    """Batch rows a block stages h_{t-1} for: on tensor cores those of whole instructions
    (:func:`.planner.mma_staged_rows`), else the group's N/NG."""
    return planner.mma_staged_rows(local_batch) if plan.mma else local_batch


@dataclass(frozen=True)
class KernelSpec:
    """One persistent kernel: ``plan`` for a layer of ``gates`` G and ``states`` (h first),
    ``hidden`` H, ``batch`` N (all batch groups together). ``dtype`` is the storage dtype of
    the weights, the biases and y (products, sums, the cell and the states are float32);
    ``input_size`` C, which a fused input projection needs; ``lengths``: the kernel takes each
    sample's length and stops its states there (outputs past it zero); ``exchanged``: the
    length of the vector the blocks exchange each step (the products' K), if not H (the
    backward pass's G*H, planner: "Backward through time"); ``kept``: a training forward's, the
    parts of the projections it keeps (:mod:`.stages.history`; one grid); ``params``: the
    cell's per-unit parameters (vectors [H], a grid's side by side); ``first``: the first
    step's input projections take an addition [N, D*G*H] (one layer; a projection's W_hh h0,
    where the kernel's recurrence is h'); ``product``: the gate whose recurrent product the
    cell takes of a value of its step (``ops.recurrent``; -1: none), exchanged and multiplied
    in a second round of the step (:mod:`.stages.cell`); ``levels``: the row means the cell's
    step takes (``ops.mean``, numbered in the order it takes them) in levels, a round of the
    step each: their arguments exchanged and summed over the row (:mod:`.stages.means`,
    :func:`rnncc.cells.autodiff.one_round_levels`); ``variances``: (k, m, alone), mean k the
    variance about mean m, of m's round (taken from m's values as well; ``alone``: a unit has
    one value, so k's own argument is 0, not exchanged); ``finals``: the
    kernel writes the final states [grids, N, H] in ``dtype`` (else they are where the last
    step left them, in the states' float32 workspaces); ``samples``: where the plan pads the
    batch (planner: "Padded batch"), the caller's N, ``batch`` being N + pad: x, the input
    projections, the lengths, y and the final states have N rows, the states' workspaces and
    the exchange N + pad."""

    plan: Plan
    gates: int
    states: int
    hidden: int
    batch: int
    dtype: str = "float32"
    input_size: int = 0
    lengths: bool = False
    exchanged: int = 0
    kept: tuple = ()
    params: int = 0
    first: bool = False
    product: int = -1
    levels: tuple = ()
    finals: bool = False
    variances: tuple = ()
    samples: int = 0

    def __post_init__(self):
        p = self.plan
        if self.padded and (p.grids > 1 or self.kept or self.first):
            raise ValueError("a padded batch runs one direction of one layer, inference, without "
                             "a projection")
        if (self.product >= 0 or self.means) and p.layers > 1:
            raise ValueError("a step that reduces over the hidden units runs one layer")
        if self.product >= 0 and self.means:
            raise ValueError("a step takes means or a recurrent product of a value here, not "
                             "both")
        if self.kept and p.grids > 1:
            raise ValueError("a training forward runs one direction of one layer")
        if self.first and p.layers > 1:
            raise ValueError("an addition to the first step's input projections runs one layer")
        if p.layers > 1 and (not p.input_steps or self.input_size != self.hidden):
            raise ValueError(
                f"a wavefront of {p.layers} layers takes C = H and overlapped input projections, "
                f"got C = {self.input_size}, H = {self.hidden}, input_steps {p.input_steps}")
        if p.fused and (self.input_size < 1 or (p.input_slab and not p.smem_chunks)):
            raise ValueError(
                f"a fused input projection needs an input size and, in slabs, shared memory "
                f"for W_hh, got input size {self.input_size} and {p.smem_chunks} chunks of W_hh "
                "in shared memory")

    @property
    def padded(self) -> bool:
        """The kernel runs rows past the caller's batch (planner: "Padded batch")."""
        return 0 < self.samples < self.batch

    @property
    def given_batch(self) -> int:
        """N: the rows of x, the input projections, the lengths, y and the final states."""
        return self.samples if self.padded else self.batch

    def given(self, bx, n):
        """(whether block ``bx``'s batch row n is one of the caller's, or None where every row
        is; its row of the caller's buffers, the last one for padding rows, which read it only
        under that condition)."""
        row = self.batch_row(bx, n)
        if not self.padded:
            return None, row
        return row < self.samples, T.min(row, self.samples - 1)

    @property
    def local_batch(self) -> int:
        """N/NG: the batch rows of one batch group."""
        return self.batch // self.plan.batch_groups

    @property
    def exchange_width(self) -> int:
        """K: the length of a batch row of the vector the blocks exchange (h: H)."""
        return self.exchanged or self.hidden

    @property
    def width(self) -> int:
        """KP = KI*KL*VEC: a row of h (the exchanged vector) as staged, K padded to whole
        chunks (KL = 32 lanes a chunk, fewer with lane groups)."""
        return self.plan.chunks * self.plan.k_lanes * self.plan.vec

    @property
    def gate_rows(self) -> int:
        """G*H: the rows of W_hh, and the width of a row of input projections."""
        return self.gates * self.hidden

    @property
    def accumulators(self) -> int:
        """A lane's sums of the CUDA-core products, RW*N rounded up to a power of two."""
        return 1 << max(0, math.ceil(math.log2(self.plan.rows_per_warp * self.local_batch)))

    @property
    def mma_tiles(self) -> int:
        """Tiles of 16 batch rows of the tensor-core products (planner: "Tensor cores")."""
        return planner.mma_tiles(self.local_batch)

    @property
    def mma_chains(self) -> int:
        """Chains of sums a tile of the tensor-core products."""
        return planner.mma_chains(self.local_batch)

    @property
    def mma_rows(self) -> int:
        """Batch rows h is staged for on tensor cores: 8 (half a tile) or whole tiles."""
        return planner.mma_staged_rows(self.local_batch)

    @property
    def staged_rows(self) -> int:
        """Batch rows h_{t-1} is staged for (:func:`staged_rows`)."""
        return staged_rows(self.plan, self.local_batch)

    @property
    def staged_size(self) -> int:
        """Elements of h_{t-1} as a block stages it (:attr:`staged_rows` rows of KP)."""
        return self.staged_rows * self.width

    @property
    def slice_width(self) -> int:
        """KP / KL: the k of a row of h in one slice of K (planner: "Slices of K"; all of KP
        without slices)."""
        return self.width // self.plan.k_slices

    @property
    def slice_size(self) -> int:
        """Elements of one slice of h as a block stages it (:attr:`staged_rows` rows of
        :attr:`slice_width`)."""
        return self.staged_rows * self.slice_width

    @property
    def replicas(self) -> int:
        """D*NG or L*NG: the batch groups of every grid, each exchanging its own h."""
        return self.grids * self.plan.batch_groups

    @property
    def tagged(self) -> bool:
        """h travels between blocks as tagged words (planner: ``sync="tagged"``)."""
        return self.plan.sync == "tagged"

    @property
    def local(self) -> bool:
        """A batch group of one block keeps h in its shared memory (planner: ``sync="local"``)."""
        return self.plan.sync == "local"

    @property
    def cluster(self) -> bool:
        """A batch group is a thread-block cluster, whose blocks put h into each other's shared
        memory (planner: "A cluster a group")."""
        return self.plan.sync == "cluster"

    @property
    def cluster_blocks(self) -> int:
        """Blocks of a cluster (a batch group of a grid; 1 without clusters)."""
        return self.plan.group_blocks if self.cluster else 1

    @property
    def reads_hn(self) -> bool:
        """The products read h_{t-1} where the ``"local"`` or ``"cluster"`` exchange keeps it
        (``hn``; the cluster's in two slots, step t's h_{t-1} in slot t % 2), not from a
        staging: on the CUDA cores, whose staging is a plain copy."""
        return (self.local or self.cluster) and not self.plan.mma

    def hn_slot(self, t):
        """Where h_{t-1} starts in ``hn``: 0, or in the cluster's slot t % 2."""
        return t % 2 * self.staged_size if self.cluster else 0

    @property
    def means(self) -> int:
        """How many row means the step takes."""
        return sum(len(level) for level in self.levels)

    @property
    def centres(self) -> dict:
        """Each variance's mean: {k: m} of ``variances``."""
        return {k: m for k, m, _ in self.variances}

    @property
    def alone(self) -> set:
        """The variances of one value a unit (its own squares 0: nothing of theirs to sum)."""
        return {k for k, _, alone in self.variances if alone}

    @property
    def rounds(self) -> int:
        """R: the rounds of values of its step the blocks exchange each step before h (the
        means' arguments, a level of them a round, or the product's)."""
        return len(self.levels) if self.means else (1 if self.product >= 0 else 0)

    def arrivals(self, t, value: int = -1):
        """The count of a batch group's counter barrier once its blocks have arrived after
        step t's h (or its round ``value``'s value, exchanged first: R + 1 arrivals a
        step)."""
        if not self.rounds:
            return (t + 1) * self.plan.group_blocks
        step = self.rounds + 1
        return (step * t + (value + 1 if value >= 0 else step)) * self.plan.group_blocks

    @property
    def directions(self) -> int:
        """D: grids side by side, one a direction (planner: "Directions")."""
        return self.plan.directions

    @property
    def layers(self) -> int:
        """L: grids side by side, one a layer (planner: "Layers as a wavefront")."""
        return self.plan.layers

    @property
    def grids(self) -> int:
        """D directions or L layers: grids side by side."""
        return self.plan.grids

    @property
    def state_rows(self) -> int:
        """D*N or L*N: rows of the states and of the exchanged h (grid d's sample n at
        d*N + n)."""
        return self.grids * self.batch

    @property
    def layer_blocks(self) -> int:
        """Blocks of one grid (all its batch groups)."""
        return self.plan.blocks // self.grids

    def _replica(self, bx):
        """d*NG + g: block ``bx``'s grid and batch group as one index."""
        return bx // self.plan.group_blocks

    def grid(self, bx):
        """The grid block ``bx`` runs in: its direction, or its layer."""
        return 0 if self.grids == 1 else bx // self.layer_blocks

    def direction(self, bx):
        """The direction block ``bx`` runs (0: forward, 1: reverse)."""
        return 0 if self.directions == 1 else self.grid(bx)

    def layer(self, bx):
        """The layer block ``bx`` runs (0: the first)."""
        return 0 if self.layers == 1 else self.grid(bx)

    def place(self, bx):
        """Block ``bx``'s place in its grid (its hidden units are place*U ...)."""
        replicas = self.plan.batch_groups * self.grids
        return bx if replicas == 1 else bx % self.plan.group_blocks

    def weights_of(self, bx):
        """The block of packed weights block ``bx`` holds (its place, in its grid's)."""
        if self.grids == 1:
            return self.place(bx)
        return self.grid(bx) * self.plan.group_blocks + self.place(bx)

    def batch_group(self, bx):
        """The batch group block ``bx`` runs (0 without batch groups)."""
        if self.plan.batch_groups == 1:
            return 0
        group = self._replica(bx)
        return group % self.plan.batch_groups if self.grids > 1 else group

    def batch_row(self, bx, n):
        """Sample (row of x, y and the input projections) that block ``bx``'s batch row n is."""
        if self.plan.batch_groups == 1:
            return n
        return self.batch_group(bx) * self.local_batch + n

    def state_row(self, bx, n):
        """Row of the states and of the exchanged h that block ``bx``'s batch row n is."""
        if self.grids == 1:
            return self.batch_row(bx, n)
        return self.grid(bx) * self.batch + self.batch_row(bx, n)

    def gate_column(self, bx, g: int, j):
        """Column of gate g, unit j in a row of the input projections and in the biases (the
        grids' G*H side by side)."""
        column = g * self.hidden + j
        return column if self.grids == 1 else self.grid(bx) * self.gate_rows + column

    def output_column(self, bx, j):
        """Column of unit j in a row of y (the grids' H side by side)."""
        return j if self.grids == 1 else self.grid(bx) * self.hidden + j

    def step(self, bx, t, t_len, length=None):
        """The step of the sequence that loop step t is for block ``bx``: t, or in the reverse
        direction, the sample's len - 1 - t (``length``: its length in a register; T - 1 - t
        without lengths; t past its length, where nothing is live)."""
        if self.directions == 1:
            return t
        if length is None:
            back = t_len - 1 - t
        else:
            back = T.if_then_else(t < T.Cast("int64", length), T.Cast("int64", length) - 1 - t, t)
        return T.if_then_else(self.direction(bx) == 1, back, t)

    def pair(self, it: int, bx, tx):
        """(valid, n, j) of thread ``tx``'s pair ``it`` of block ``bx``: batch row n (of the
        group) and hidden unit j, valid where the pair exists."""
        p = self.plan
        e = it * p.threads + tx
        j = self.place(bx) * p.units + e % p.units
        valid = tirx.And(e < p.units * self.local_batch, j < self.hidden)
        return valid, e // p.units, j

    def group_of(self, bx):
        """The barrier counter of block ``bx``: one a batch group of a grid (and, with
        layers, its layer's progress counter)."""
        if self.plan.batch_groups * self.grids == 1:
            return 0
        return self._replica(bx)

    def spread(self, count: int, unroll: bool = False):
        """A loop over ``count`` items spread over the block's threads (item e * threads + tx
        of iteration e), unrolled when ``unroll`` and at most 32 a thread."""
        per = -(-count // self.plan.threads)
        return T.unroll(per) if unroll and per <= 32 else T.serial(0, per)

    @property
    def smem_unroll(self) -> int:
        """Shared-memory weight chunks an iteration of their loop: the plan's ``unroll``
        rounded down to a divisor of KS."""
        ks = self.plan.smem_chunks
        return max(d for d in range(1, min(self.plan.unroll, ks) + 1) if ks % d == 0) if ks else 1
