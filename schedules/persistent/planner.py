"""Does a recurrent layer's weight matrix fit on-chip, and with which grid?

Pure arithmetic, no TVM: unit-tested on the CPU machine for sizes that fit and do not.

Work split. A grid of B blocks (at most one a multiprocessor, all resident: the launch is
cooperative). Block b owns U hidden units, the rows of all G gates of those units (EcoRNN's
layout: the point-wise step needs no exchange between blocks), R = G*U rows of H weights. Its
Wn warps take RW rows each; lane l of a warp holds, of each of its rows, the 16-byte chunks
k = (i*32 + l)*VEC .. +VEC for i < KI (KI = H / (32*VEC), rounded up). Chunks i < KR live in
registers, the next KS in shared memory. Each step the block stages h_{t-1} [N, H] in shared
memory, every lane multiplies its chunks, a warp reduction sums the lanes, and the threads of
the block's (unit, batch) pairs apply the cell.

Fused input projection (:func:`fuse_input`): the block computes the input projections of
its own R = G*U rows for all steps itself, before its time loop and before it loads W_hh: a
small GEMM of x [T*N, C] (in groups of SN rows, staged in shared memory) by its rows of W_ih
(packed [B, KC, RL, 8, VEC], copied to shared memory once), its warps splitting K, each lane
RL rows of W_ih by SN/4 rows of x. No separate GEMM kernel, no chunk padding of T, and each
block reads its rows of W_ih once. Where W_ih's rows do not fit next to W_hh's chunks, they
go through the shared memory W_hh's chunks take later, in slabs of KSL K chunks: for each slab,
every group of x (that slab's columns) adds its products to xp. (Reading W_ih from global
memory every group instead was slower than the separate GEMM: H200, LSTM 1536.) With batch
groups a block computes its own group's rows of x.

Overlapped (:func:`overlap_input`, ``input_steps`` S > 0): the projection runs inside the time
loop, where the block would otherwise wait on the others. A group is S steps (SN = S*N rows of
x), and its K chunks are cut into S slabs. Step t copies slab t % S of group t // S + 1's
rows of x into shared memory of its own (``cp.async``, while the step runs); between
publishing h_t (the tagged stores, or its arrival at the counter barrier) and waiting for the
other blocks' h_t, the block adds that slab's products to the lane's accumulators (which stay
in registers from slab to slab), and after the last slab writes the group's xp, read from
step (t // S + 1) * S on. Only group 0 is computed before the loop. W_ih's rows stay in
shared memory for the whole run. float32 only.

Batch groups (``batch_groups`` NG, a divisor of N): the grid is NG groups of B/NG blocks, and
group g runs the batch rows n = g*N/NG .. (g+1)*N/NG - 1 as a grid of its own would at batch
N/NG: the same packed weights (block b holds those of block b % (B/NG)), h exchanged and
synchronised within the group only. Each group is the small-batch kernel, whose step is
shorter (fewer blocks to wait for, a shorter staging of h, fewer products a lane), at the cost
of NG copies of the weights on-chip. Chosen by default (``batch_groups=None``) where a group's
weights fit in its blocks' registers (measured on an H200: LSTM 256 batch 4 in 4 groups 1.74 ->
1.18 us a step, LSTM 512 2.36 -> 1.68, GRU 512 2.31 -> 1.68; where a group needs shared memory
for its weights, LSTM 1024 batch 4 in 2 groups, it was slower: 3.81 -> 4.15; but one batch
row a group, with the tagged exchange, won with up to 2 chunks of shared memory:
:func:`.knobs.one_row_groups`). Past
:data:`MAX_BATCH` a batch runs persistently only in groups, the most that fit (LSTM 256 batch
64 in 16 groups 3.59 us a step against 9.59 for the non-persistent schedule, GRU 512 in 8
groups 10.42 against 15.79).

Tensor cores (``plan(mma=True)``; float16 or bfloat16 weights, 8 rows a warp and at least
:data:`MMA_MIN_WARPS` warps, :data:`MMA_MIN_BATCH` to :data:`MMA_MAX_BATCH` batch rows a group,
at least :data:`MMA_MIN_CHUNKS` chunks of K (times the batch's tiles), no fused input
projection or streamed chunks): a warp's products are
``mma.sync`` m16n8k16 instructions (16-bit operands, float32 sums): the warp's 8 rows are the
instruction's N, the batch its M, 16 k a step. Up to 8 batch rows the instruction's rows 8-15
are zeros (half a tile: h staged for 8 rows); past 8, the batch is tiles of 16 rows, an
instruction a tile for each fragment of weights, so that a batch of 64 costs 4 instructions
where the CUDA cores' sums would need 64 times RW registers a lane. The plan is chosen for
tensor cores (its own register count and estimate), not converted from a CUDA-core one.
Lane l holds, of each 16 k, the weights W[row l // 4][k0 + (l % 4)*2 + {0, 1, 8, 9}] (the
instruction's B fragment; same registers and shared memory as the CUDA-core
layout, another order), h_{t-1} is staged in 16 bits in the fragment order of A, and the
instruction sums over k: no per-element conversion of the weights and no reduction over the
lanes, and the registers of the CUDA cores' accumulators hold weights instead. h is rounded to
the weights' type for the product (as cuDNN's half-precision RNNs keep it); the sums, the cell
and the states stay float32. float32 weights where the problem allows TF32 take the same
plans (whole tiles only, 9 batch rows or more): a vector of 16 bytes is one k-step's 4 values
(chunks of 128 k), packed rounded to TF32, and each k-step is two m16n8k8 instructions; h is
staged in float32, rounded to TF32. With the barriers in 16 bits the blocks publish h in
that order too, and staging copies it (:func:`publishes_staged_h`).

Directions (``directions`` D = 2, a bidirectional layer): the grid is D grids side by side,
one a direction, each planned as the layer alone would be on a D-th of the multiprocessors
(with its batch groups): block bx runs direction bx // (B/D) with that direction's weights and
its own h exchange and barrier; the reverse direction's step t is each sample's step
len - 1 - t (T - 1 - t without lengths). The two recurrences never wait for each other, so a
step costs what one direction's does, not two. No streaming. The input projections of both
directions are one GEMM before the launch, or fused (each grid its own, overlapped where
:func:`~.knobs.input_projection` says; the reverse grid's rows of x run back as its steps).

Layers as a wavefront (``layers`` L > 1, a stack of unidirectional layers whose input size is
their hidden size): the grid is L grids side by side, one a layer, each planned as the layer
alone would be on an L-th of the multiprocessors, with its own weights, h exchange and
barrier. Layer l > 0 computes its input projections itself, overlapped with its time loop
(:func:`overlap_input`, S steps a group, :func:`wavefront_steps`), from layer l - 1's
outputs: before it stages the rows of x of steps s .. s+S-1 it waits on layer l - 1's progress
counter (each of its blocks counts every step it has written, one counter a batch group).
So layer l runs step t while layer l - 1 runs a few steps ahead (about 2S + 1), and a stack of
L layers costs about what one layer does, plus (L - 1)(2S + 1) steps.

Backward through time (:func:`backward`, the training pass, :mod:`..backward`): the same
kernel shape run backwards over the steps with W_hh^T resident: block b owns U hidden units,
the U rows of W_hh^T [H, G*H] (the columns of W_hh of its units), K = G*H. Each step it stages
the gradients of the last step's recurrent projections, dGH_{t+1} [N, G*H], as the other
blocks published them, multiplies (dh_t through the recurrence, for its units), applies the
cell's derivative to its (unit, batch) pairs and publishes their G values of dGH_t. A step
stages G times the floats of a forward step. On tensor cores a row group's K may be split
among KQ warps (``k_parts``, "K split"), each a part of K's chunks, their sums added in shared
memory.

Slices of K (``k_slices`` KL > 1, ``plan(slices=True)``; on tensor cores in 16 bits, whole
tiles, with the barriers; tried only where no plan fits whole): where a group's staged vector
does not fit in shared memory next to the weights (the backward pass's dGH of bfloat16 LSTM
1024 at batch 64 in 2 groups: 32 rows x 4096 x 2 bytes = 256 KiB; the forward's h of LSTM 2048
at batch 32, 128 KiB, beside 128 KiB of W_hh), it is staged in KL slices, slice s being chunks
s*KI/(KQ*KL) .. of each part: two slices in shared memory, the next copied while the warps
multiply the one before. The blocks publish h (dGH) in the slices' order
(:mod:`.stages.tensor_cores`), so that a slice is one contiguous copy; the forward's step 0
stages h_0 slice by slice, element by element.

Small K on the CUDA cores: where K is under one 16-byte chunk of every lane (H under 256 in 16
bits, 128 in float32), most of a lane's chunk would be zeros (K = 32 in float16: 4 lanes of
8). Two ways out, both with a lane's products and registers of weights shrinking as K does,
neither with a fused input projection (its chunks are 16 bytes of every lane):

- Lane groups (``lane_groups`` LG > 1, the default): the warp's lanes split into LG groups of
  KL = 32 / LG lanes (the fewest that hold K in 16-byte chunks); group g's lanes hold rows
  g*RW .. g*RW + RW - 1 of the warp's LG*RW, lane g*KL + kl the k of (i*KL + kl)*VEC + v of
  chunk i. The sums over the lanes take log2(KL) exchanges of RW*N values, not 5 of LG times
  as many. H200, us a step, against narrow chunks: float16 GRU 24 N400 0.88 -> 0.59, LSTM 32
  N512 1.06 -> 0.59, GRU 64 N256 0.89 -> 0.64; float32 LSTM 32 N1 0.54 -> 0.40, GRU 64 N64
  0.56 -> 0.51; none slower (docs/benchmarks.md, "Seventy-third session").
- Narrow chunks (``lane_bytes`` < 16; the knob ``lane_groups=False``): every lane one chunk
  of the fewest elements (a power of two) that still hold K, all 32 lanes a row's.

One block a group (``sync="local"``): where a batch group is one block (small H, or many batch
groups) and h is staged whole, the block keeps its h_t in shared memory of its own (as
staging wants it, at most :data:`LOCAL_MAX_BYTES`), where after a block barrier the next
step's products read it (CUDA cores) or its staging copies it (tensor cores): no global
memory, no waiting on other blocks, two block barriers a step on the CUDA cores where four
were (:mod:`.stages.exchange`). Its shared memory is counted in every plan of one block a
group, and the estimate (:func:`estimate_ns`) takes :data:`LOCAL_NS` for its exchange.

Padded batch (``pad`` > 0, :func:`.knobs.plan_for`): past :data:`MAX_BATCH` a batch runs only in
groups of equal size, so a batch without a divisor that fits (a prime 67, or 255 = 15 x 17 where
17 groups of 15 rows do not fit) would leave the kernel. The kernel then runs N + pad rows, the
plan of that batch: the rows past N read zeros for their input projections (and lengths, x and
the initial states), compute and exchange like any other, and write nothing the caller sees.
One direction of one layer, inference only.

A cluster a group (``sync="cluster"``, Hopper on): where a batch group is 2 to 16 blocks (past
8 a non-portable cluster size, ``GPU.wide_cluster``: the runtime allows it at launch), the
group is a thread-block cluster, resident as one by its launch (no cooperative launch), and a
block's h_t goes straight into the shared memory of every block of the cluster (``st.async``
into two slots of h, a step's in slot (t+1) % 2, each store counting its bytes on the receiving
block's barrier of that slot); the next step's products wait for that barrier's phase and read
h there (:func:`clusters`, :mod:`.stages.exchange`). No global memory, no fence, no polling of
L2: H200, a step of 256 threads that put 32 values each into the cluster's blocks and wait,
clusters of 2 / 6 / 8 blocks 193 / 247 / 237 ns, tagged words in L2 among 2 / 4 / 8 blocks 513
/ 592 / 640 (docs/benchmarks.md). The exchange is chosen after the plan (the estimate ranks
plans with the tagged words' cost). H200, us a step, T 100, tagged words / the
cluster (cuDNN): float32 LSTM 72 at batch 3 (3 clusters of 6) 0.93 / 0.68 (0.77), LSTM 112
at 3 0.95 / 0.73 (1.91), GRU 106 at 4 0.95 / 0.67 (0.85), LSTM 87 at 7 0.98 / 0.74 (0.81), GRU
128 at 2 0.91 / 0.67 (1.06), tanh RNN 256 at 1 0.77 / 0.63 (2.20), float16 LSTM 128 at 4
0.87 / 0.62 (2.46); LSTM 128 at 1 (one cluster of 8) 0.79 / 0.79. Where the planner's groups
are larger (LSTM 384: 24 blocks), or more than :data:`CLUSTER_MAX_BLOCKS` in all,
:func:`.knobs.cluster_groups` narrows them to a cluster's blocks where those hold the weights
with little in shared memory, 8 where they can, else 16 (LSTM 384 at 1: 1.20 / 0.90). A wide
cluster's planner groups of 9 to 16 blocks beat the portable 8 they were narrowed to before:
us a step, 8 / the planner's (cuDNN), LSTM 256 at 2 0.79 / 0.74 (4.46), GRU 200 at 1 0.82 /
0.70 (13 blocks), GRU 256 at 4 0.83 / 0.75, float16 tanh RNN 448 at 4 0.78 / 0.68, GRU 200 at
4 0.78 / 0.66; tanh RNN 200 at 1 0.62 / 0.64 (10 blocks, cuDNN 1.01) the one loss.

Streaming (``stream=True``, tried only when no plan fits on-chip): the last KG chunks stay in
global memory and are read every step; they are the only weights read there, a few MB that
stay in L2 from step to step (the planner caps them at half the L2), so a layer slightly too
large for the registers and shared memory still runs persistently.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class GPU:
    """What the planner needs to know about a GPU."""

    name: str
    sms: int
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    smem_per_block: int = 232448  # bytes a block may opt in to (227 KiB on Hopper)
    l2_bytes: int = 50 * 2**20
    cluster: int = 1  # most blocks a thread-block cluster (1: none; see "A cluster a group")
    wide_cluster: int = 1  # most blocks a cluster of a non-portable size (1: none)


#: Planning defaults by architecture, the smallest common part of each; a module records the
#: GPU it was planned for, and the runtime checks the device it runs on before a launch.
_ARCH_GPUS = {
    "sm_90": GPU("H100/H200 SXM", 132, cluster=8, wide_cluster=16),
    "sm_90a": GPU("H100/H200 SXM", 132, cluster=8, wide_cluster=16),
    "sm_89": GPU("L40S", 142, smem_per_block=101376, l2_bytes=96 * 2**20),
    "sm_80": GPU("A100", 108, smem_per_block=166912, l2_bytes=40 * 2**20),
    "sm_86": GPU("RTX 30xx/A10", 28, smem_per_block=101376, l2_bytes=6 * 2**20),
}


def gpu_for_arch(arch: str, sms: int | None = None) -> GPU:
    """The planning GPU for an architecture (``sms`` overrides the multiprocessor count)."""
    base = _ARCH_GPUS.get(arch, GPU(f"unknown {arch}", 28, smem_per_block=49152,
                                    l2_bytes=4 * 2**20))
    return base if sms is None else replace(base, sms=sms)


class Unfit(Exception):
    """The configuration cannot run persistently; the message says why."""


@dataclass(frozen=True)
class Plan:
    """A persistent kernel's shape (see the module docstring for the letters)."""

    blocks: int        # B
    units: int         # U, hidden units a block
    warps: int         # Wn
    rows_per_warp: int  # RW
    vec: int           # VEC, elements a 16-byte chunk
    chunks: int        # KI
    reg_chunks: int    # KR
    smem_chunks: int   # KS = KI - KR - KG
    items: int         # IT, (unit, batch) pairs a thread applies the cell to
    reg_estimate: int  # registers a thread, estimated
    smem_bytes: int    # dynamic shared memory a block
    sync: str = "tagged"  # "tagged" h words; "barrier": a counter barrier; "grid": coop. groups;
    # "local": one block a group; "cluster": a cluster a group
    reg_margin: int = 0  # registers the plan keeps free under the per-thread limit
    unroll: int = 1  # shared-memory chunks a loop iteration (rounded down to a divisor of KS)
    global_chunks: int = 0  # KG, read from global memory (L2) every step; see "Streaming"
    input_rows: int = 0  # SN, rows of x a group of the fused input projection; 0: not fused
    input_chunks: int = 0  # KC, 16-byte chunks of a row of W_ih (fused input projection)
    input_slab: int = 0  # KSL, chunks of W_ih a slab through W_hh's shared memory; 0: resident
    input_steps: int = 0  # S, steps a group of the overlapped input projection; 0: not
    batch_groups: int = 1  # NG, groups of blocks a batch slice each (see "Batch groups")
    mma: bool = False  # products on tensor cores (see "Tensor cores")
    directions: int = 1  # D, one grid a direction side by side (see "Directions")
    layers: int = 1  # L, one grid a layer side by side (see "Layers as a wavefront")
    k_parts: int = 1  # KQ, warps that split each row group's K (tensor cores; "K split")
    k_slices: int = 1  # KL, slices of K staged one after another ("Slices of K")
    mean_partials: bool = False  # a step's means exchanged as a block's sums (stages.means)
    lane_bytes: int = 16  # bytes of a lane's chunk of a row (VEC elements; see "Narrow chunks")
    lane_groups: int = 1  # LG, groups of a warp's lanes, each its own rows ("Lane groups")
    pad: int = 0  # batch rows past N the kernel runs, zeros (see "Padded batch")

    @property
    def warp_chunks(self) -> int:
        """KI / KQ: the chunks of K a warp holds and multiplies (all of K but with a split)."""
        return self.chunks // self.k_parts

    @property
    def slice_chunks(self) -> int:
        """KI / (KQ*KL): the chunks of K a warp multiplies of one slice."""
        return self.warp_chunks // self.k_slices

    @property
    def packed_shape(self) -> tuple:
        """W_hh (or W_hh^T) packed for the plan, one grid's blocks of one batch group: [B/NG,
        Wn, KI/KQ, RW, 32, VEC] (:func:`rnncc.lowering.components.pack_persistent`)."""
        return (self.group_blocks, self.warps, self.warp_chunks, self.rows_per_warp, 32,
                self.vec)

    @property
    def row_groups(self) -> int:
        """Wn / KQ: the warps of distinct rows; warp w holds rows (w % (Wn / KQ))*RW .. and
        part w // (Wn / KQ) of K."""
        return self.warps // self.k_parts

    @property
    def grids(self) -> int:
        """Grids side by side: D directions, or L layers."""
        return self.directions * self.layers

    @property
    def group_blocks(self) -> int:
        """Blocks of one batch group of one grid (B / (D*L*NG)): the blocks one direction's or
        one layer's weights are packed for."""
        return self.blocks // (self.batch_groups * self.grids)

    @property
    def k_lanes(self) -> int:
        """KL = 32 / LG: the lanes that share a row's K (see "Lane groups")."""
        return 32 // self.lane_groups

    @property
    def warp_rows(self) -> int:
        """LG * RW: a warp's rows (RW: the rows a lane holds)."""
        return self.lane_groups * self.rows_per_warp

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk of every row of a block."""
        return _chunk_bytes(self.warps, self.rows_per_warp, self.lane_bytes)

    @property
    def streamed_bytes(self) -> int:
        """Bytes of weights the whole grid reads from global memory every step."""
        return self.blocks * self.chunk_bytes * self.global_chunks

    @property
    def fused(self) -> bool:
        """The block computes its own input projections (see "Fused input projection")."""
        return self.input_rows > 0

    @property
    def tagged_loads(self) -> str:
        """The order of the tagged exchange's loads (:data:`.device.TAGGED_LOADS`): "relaxed"
        where the block reads the input projections it computes itself (fused, and every
        layer of a wavefront), which an acquire's invalidation of L1 evicted every step; else
        "acquire". H200, us a step, acquire / relaxed: LSTM 512, 2 layers, batch 1 1.99 / 1.82,
        4 layers 2.40 / 2.20; with the separate GEMM the single layers moved both ways (LSTM
        256 batch 1 1.03 / 0.98, GRU 512 batch 1 1.33 / 1.38, LSTM 512 both directions
        batch 1 1.45 / 1.50)."""
        return "relaxed" if self.fused else "acquire"

    @property
    def input_width(self) -> int:
        """K chunks of W_ih a group's product takes at once: a slab of the overlapped
        projection, one through W_hh's shared memory, or all of them."""
        if self.input_steps:
            return -(-self.input_chunks // self.input_steps)
        return self.input_slab or self.input_chunks

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def as_dict(self) -> dict:
        return {**asdict(self), "threads": self.threads, "streamed_bytes": self.streamed_bytes}


#: Registers a thread needs besides weights and accumulators (indices, h chunk, the cell).
OVERHEAD_REGS = 48
#: Registers kept free under the per-thread limit, so that ptxas does not spill.
REG_MARGIN = 24
#: Largest batch the persistent kernel takes (accumulators are RW*N registers).
MAX_BATCH = 16
#: Largest grid that exchanges h as tagged words; larger grids use the counter barrier.
TAGGED_MAX_BLOCKS = 32
#: In batch groups, the tagged exchange only where a group's blocks times its batch rows are
#: at most this (H200, us a step, tagged / barrier: LSTM 512 at batch 64, 4 groups of 32
#: blocks and 16 rows, 14.81 / 8.99; GRU 512 at batch 16, 4 of 32 and 4, 3.76 / 3.09; LSTM 256
#: at batch 64, 16 of 8 and 4, 3.31 / 3.52; LSTM 512 at batch 4, 4 of 32 and 1, 1.60 / 2.02).
TAGGED_MAX_GROUP_LOAD = 32
#: Where the input projection is overlapped with the time loop (fused, and every layer of a
#: wavefront), whose blocks load the tagged words relaxed (:attr:`Plan.tagged_loads`), the
#: tagged exchange where a grid's blocks of a batch group times its batch rows are at most
#: this, whatever the grid. H200, us a step, tagged / barrier: LSTM 1024 batch 1, 128 blocks,
#: 1.47 / 1.86; GRU 1024 batch 1 1.60 / 1.87; 2 layers: LSTM 512 batch 4 (2 groups of 32
#: blocks, 2 rows) 2.35 / 2.89, GRU 512 batch 8 (32 and 4) 3.03 / 3.41, LSTM 256 batch 16 (16
#: and 4) 2.34 / 2.92. Past it: LSTM 1024 batch 2 (128 and 2) 2.77 / 2.32; GRU 768, 2 layers,
#: batch 4 (60 and 4) 4.63 / 4.05; LSTM 640 likewise (64 and 4) 4.02 / 3.80; LSTM 384, 4
#: layers, batch 8 (32 and 8) 5.77 / 5.47; 3 layers at batch 4 (40-43 blocks): GRU 640 4.82
#: / 4.30, RNN 1024 4.20 / 4.19, and the gains missed, LSTM 512 3.46 / 3.82, GRU 512 3.09 /
#: 3.57.
TAGGED_OVERLAPPED_MAX_LOAD = 128


#: Tensor cores in 16 bits exchange h (the backward pass: dGH) through the barrier, whatever
#: the grid: with tagged words each element is staged on its own, through the barrier copied
#: whole (:func:`publishes_staged_h`). H200, us a step, tagged / barrier (cuDNN): float16
#: LSTM 64 N64 (8 blocks, one batch group) 13.03 / 3.09 (1.20), LSTM 256 N64 (32) 28.33 /
#: 3.20, GRU 200 N64 (25) 28.58 / 3.34; a training step (forward and backward): float16 LSTM
#: 128 N32 (backward on 8 blocks) 24.7 / 4.1 (4.2), GRU 64 N64 (2 blocks) 31.2 / 10.5 (3.5),
#: bfloat16 GRU 256 N32 48.9 / 6.2 (10.6), float16 LSTM 256 N64 (32 groups of 4 blocks) 7.4 /
#: 7.1 (14.7), LSTM 512 N16 8.2 / 6.4 (5.3).
MMA_HALF_SYNC = "barrier"
#: The estimated cost of a step's exchange within one block (see "One block a group"): a
#: block barrier, against about 800 ns of a grid's; where the block holds at most
#: LOCAL_MAX_WEIGHTS bytes of weights (more, a whole layer's products on one multiprocessor
#: cost more than the estimate says). H200, us a step, several blocks / one: float32 GRU 64
#: at batch 8 (48 KiB) 0.89 / 0.55, RNN 64 at 32 0.76 / 0.38, LSTM 64 at 1 (64 KiB) 0.74 /
#: 0.62, RNN 128 at 1 (64 KiB) 0.66 / 0.49, bfloat16 LSTM 64 at 16 0.85 / 0.60; past it
#: float16 RNN 256 at 1 (128 KiB) 0.78 / 1.10, LSTM 96 at 1 (96 KiB) 0.88 / 0.94.
LOCAL_NS = 100
#: Most blocks of a grid of clusters: its clusters must all be resident at once, and a cluster
#: of 8 blocks a multiprocessor each needs 8 of one GPC's (H200, us a step: LSTM 200 at batch
#: 16, 16 clusters of 8, 1.62 against 1.11 tagged; 7 clusters of 8, LSTM 87 at batch 7, 0.74
#: against 0.98). cudaOccupancyMaxActiveClusters on an H200, blocks of 120 KiB of shared
#: memory (one a multiprocessor): 66 clusters of 2, 30 of 4, 15 of 8, 7 of 16 (non-portable).
CLUSTER_MAX_BLOCKS = 64
#: Shared memory a block of a cluster takes at least (its ``hs``), so that no two share a
#: multiprocessor: a cluster's launch places its blocks on the multiprocessors of one GPC as
#: their resources allow, several to one where they fit.
CLUSTER_BLOCK_SMEM = 120 << 10
LOCAL_MAX_WEIGHTS = 64 << 10
#: Most bytes of h the "local" exchange keeps: its buffer is static shared memory (TVM merges
#: the dynamic buffers into one, in which it took the cell's reads of the sums and its stores
#: of h_t for a hazard), which a block has 48 KiB of.
LOCAL_MAX_BYTES = 48 << 10


def exchange(p: Plan, batch: int) -> str:
    """How ``p`` (a whole plan at batch ``batch``) exchanges h unless a knob says: within the
    block where a batch group is one block and h is staged whole ("local", see "One block a
    group"); on tensor cores in 16 bits :data:`MMA_HALF_SYNC`; else "tagged" words on small
    grids, else "barrier" (a counter barrier), where every block polling every word of h
    would load L2 more than one counter: never with h staged in slices of K; where the input
    projection is overlapped, up to :data:`TAGGED_OVERLAPPED_MAX_LOAD` blocks times rows; else
    on at most :data:`TAGGED_MAX_BLOCKS` blocks a grid, in batch groups only where a group's
    blocks times its rows are at most :data:`TAGGED_MAX_GROUP_LOAD` (H200:
    docs/benchmarks.md)."""
    if local_bytes(p, batch // p.batch_groups):
        return "local"
    if p.mma and p.vec == 8:  # 16-bit operands, 8 a 16-byte vector
        return MMA_HALF_SYNC
    load = p.group_blocks * (batch // p.batch_groups)
    if p.k_slices > 1:
        return "barrier"
    if p.input_steps:
        tagged = load <= TAGGED_OVERLAPPED_MAX_LOAD
    else:
        tagged = p.group_blocks <= TAGGED_MAX_BLOCKS and (
            p.batch_groups == 1 or load <= TAGGED_MAX_GROUP_LOAD)
    return "tagged" if tagged else "barrier"


def _chunk_bytes(warps: int, rows_per_warp: int, lane_bytes: int = 16) -> int:
    return warps * rows_per_warp * 32 * lane_bytes  # 32 lanes, 16 bytes a lane or fewer


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def narrow_vec(width: int, elem_bytes: int) -> int:
    """VEC of the CUDA cores' plans for K = ``width`` (see "Narrow chunks"): a 16-byte chunk's
    elements, or where K is under one chunk of every lane, the fewest (a power of two) that
    still hold K in one."""
    return min(16 // elem_bytes, _next_pow2(-(-width // 32)))


def local_bytes(p: Plan, batch: int) -> int:
    """Shared memory of the "local" exchange's h_t (see "One block a group"): h as a block of
    ``p`` stages it for ``batch`` rows a group, in the staging's type, where a batch group is
    one block and h is not staged in slices of K; else 0."""
    if p.group_blocks != 1 or p.k_slices > 1:
        return 0
    rows = mma_staged_rows(batch) if p.mma else batch
    size = rows * p.chunks * p.k_lanes * p.vec * (p.lane_bytes // p.vec if p.mma else 4)
    return size if size <= LOCAL_MAX_BYTES else 0


def cluster_bytes(p: Plan, batch: int) -> int:
    """Shared memory of the "cluster" exchange's h (see "A cluster a group"): two slots of h as
    the CUDA cores' products read it, ``batch`` rows a group."""
    return 2 * batch * p.chunks * p.k_lanes * p.vec * 4


def clusters(p: Plan, batch: int, gpu: GPU) -> bool:
    """Whether ``p`` (a whole plan at batch ``batch``) may exchange h within clusters (see "A
    cluster a group"): a batch group of 2 to ``gpu.wide_cluster`` (or ``gpu.cluster``) blocks,
    at most :data:`CLUSTER_MAX_BLOCKS` in all, on the CUDA cores, h staged whole, one layer,
    with room for both slots of h in static shared memory."""
    local = batch // p.batch_groups
    return (2 <= p.group_blocks <= max(gpu.cluster, gpu.wide_cluster)
            and p.blocks <= CLUSTER_MAX_BLOCKS
            and not p.mma and p.k_slices == 1
            and p.layers == 1 and cluster_bytes(p, local) <= LOCAL_MAX_BYTES
            and p.smem_bytes + cluster_bytes(p, local) <= gpu.smem_per_block)


def _staging_bytes(batch: int, chunks: int, vec: int, warps: int, rpw: int,
                   groups: int = 1) -> int:
    """Shared memory for h_{t-1} (float32; ``groups`` LG of lanes), then in its place the
    gates' sums."""
    return 4 * max(batch * chunks * 32 // groups * vec, warps * groups * rpw * batch)


def _try(gates, hidden, batch, elem_bytes, gpu, units, warps, states, margin=REG_MARGIN,
         stream=False, width=None, pair_regs=None, mma=False, k_parts=1, slices=False,
         narrow=True, lane_groups=True):
    vec, groups = 16 // elem_bytes, 1
    if narrow and lane_groups and not mma:  # 16-byte chunks, K over the fewest lanes holding it
        groups = 32 // min(32, _next_pow2(-(-(width or hidden) // vec)))
    elif narrow and not mma:
        vec = narrow_vec(width or hidden, elem_bytes)
    chunks = -(-(width or hidden) // (32 // groups * vec))
    rows = gates * units
    if mma:  # MMA_ROWS rows a warp (the last warp's past R zero), K_PARTS warps a row group
        need = -(-rows // MMA_ROWS) * k_parts
        if (chunks % k_parts or not MMA_MIN_WARPS <= need <= 32
                or (warps or need) != need):
            return None
        warps = need
    elif k_parts != 1:
        return None
    rpw = MMA_ROWS if mma else -(-rows // (warps * groups))
    threads = 32 * warps
    items = -(-(units * batch) // threads)
    products = mma_regs(batch) if mma else _next_pow2(rpw * batch) + batch * 4
    fixed = OVERHEAD_REGS + products + items * (pair_regs or 2 * gates + states)
    limit = min(gpu.max_regs_per_thread, gpu.regs_per_sm // threads) - margin
    if limit <= fixed:
        return None
    per_chunk = rpw * -(-vec * elem_bytes // 4)  # 32-bit registers a chunk of every row takes
    reg_chunks = max(0, min(chunks // k_parts, (limit - fixed) // per_chunk))
    smem_chunks = chunks // k_parts - reg_chunks
    chunk_bytes = _chunk_bytes(warps, rpw, vec * elem_bytes)
    staging = (_mma_staging_bytes(batch, chunks, vec, warps, rpw) if mma
               else _staging_bytes(batch, chunks, vec, warps, rpw, groups))
    k_slices = 1
    if slices and mma and elem_bytes == 2 and batch > MMA_ROWS:
        held = smem_chunks * chunk_bytes  # the fewest slices that fit next to the weights
        for k_slices in (d for d in K_SLICES[1:] if (chunks // k_parts) % d == 0):
            staging = _mma_staging_bytes(batch, chunks, vec, warps, rpw, k_slices)
            if held + staging <= gpu.smem_per_block:
                break
    global_chunks = 0
    if stream:
        held = max(0, (gpu.smem_per_block - staging) // chunk_bytes)
        global_chunks = max(0, smem_chunks - held)
        smem_chunks -= global_chunks
    found = Plan(blocks=-(-hidden // units), units=units, warps=warps, rows_per_warp=rpw,
                 vec=vec, chunks=chunks, reg_chunks=reg_chunks, smem_chunks=smem_chunks,
                 items=items, reg_estimate=fixed + reg_chunks * per_chunk,
                 smem_bytes=smem_chunks * chunk_bytes + staging, reg_margin=margin,
                 global_chunks=global_chunks, mma=mma, k_parts=k_parts, k_slices=k_slices,
                 lane_bytes=vec * elem_bytes, lane_groups=groups)
    found = replace(found, smem_bytes=found.smem_bytes + local_bytes(found, batch))
    if found.smem_bytes > gpu.smem_per_block or found.streamed_bytes > gpu.l2_bytes // 2:
        return None
    return found


def estimate_ns(p: Plan, batch: int) -> float:
    """A rough per-step time: the grid barrier, the shared-memory weight reads, the FMAs and
    the staging of h. Only used to rank plans (measured times decide in tuning)."""
    clock = 1.9  # GHz
    held = (p.reg_chunks + p.smem_chunks + p.global_chunks) * p.chunk_bytes
    barrier = LOCAL_NS if p.blocks == 1 and held <= LOCAL_MAX_WEIGHTS else 800 + 4 * p.blocks
    smem_weights = p.smem_chunks * p.chunk_bytes
    if p.mma:  # an instruction: 2 clocks of the tensor cores, its A fragments from shared memory
        staged = mma_staged_rows(batch) // MMA_ROWS  # 8 or 16 rows: 256 or 512 bytes
        tf32 = 8 // p.vec  # TF32: two instructions of 8 k a 16, twice the bytes of A
        products = (p.row_groups * p.chunks * 2 * p.vec * mma_tiles(batch) * (2 + 2 * staged)
                    * tf32 / clock)
        if p.k_parts > 1:  # the parts' sums added through shared memory, and a barrier
            products += 100 + p.warps * p.rows_per_warp * batch * 4 / (128 * clock)
        products += (p.k_slices - 1) * SLICE_NS  # a barrier a slice, the first copy exposed
    else:
        products = p.threads * p.chunks * p.rows_per_warp * p.vec * batch / (128 * clock)
    stage = batch * p.chunks * p.k_lanes * p.vec * 4
    streamed = p.streamed_bytes / p.blocks  # from L2, about 20 bytes a clock a multiprocessor
    return (barrier + smem_weights / (128 * clock) + products + stage / (64 * clock)
            + streamed / (20 * clock))


#: Lanes of a warp in the fused input projection: 8 row groups (RL rows each) by 4 groups of
#: rows of x (lane = 8 * x group + row group), so a lane's loads of W_ih and x each serve
#: several products and a warp's loads hit 8 and 4 distinct addresses (no bank conflicts).
ROW_GROUPS, X_GROUPS = 8, 4
#: Accumulators a lane of the fused input projection aims at (RL * SN / 4).
FUSED_ACCUMULATORS = 64
#: Most rows of x a group of the fused input projection takes.
FUSED_MAX_ROWS = 64
#: Fewest rows of x a group takes (fewer: the block barriers and the sums across warps would
#: cost more than the products; the separate GEMM runs instead).
FUSED_MIN_ROWS = 8
#: Fewest K chunks a slab of W_ih takes where it goes through W_hh's shared memory.
FUSED_MIN_SLAB = 16


def fused_row_split(p: Plan, gates: int) -> int:
    """RL: the block's rows of W_ih (R = G*U) a lane of the fused input projection takes."""
    return -(-(gates * p.units) // ROW_GROUPS)


def fuse_input(p: Plan, gates: int, input_size: int, batch: int, gpu: GPU,
               rows: int | None = None) -> Plan | None:
    """``p`` with its input projection fused (see "Fused input projection"): W_ih's rows in
    shared memory next to W_hh's, or else in slabs of K chunks through W_hh's shared memory,
    and SN rows of x a group (``rows``, rounded up to a multiple of 4, or the most that
    :data:`FUSED_ACCUMULATORS` allows), fewer where shared memory holds fewer; None when it
    holds fewer than :data:`FUSED_MIN_ROWS`, slabs would be narrower than
    :data:`FUSED_MIN_SLAB`, the plan streams weights or its chunks are narrow."""
    if p.global_chunks or p.lane_bytes < 16 or p.lane_groups > 1:
        return None
    rl = fused_row_split(p, gates)
    in_chunks = -(-input_size // p.vec)  # 16-byte chunks of a row of x or of W_ih
    row_chunk = rl * ROW_GROUPS * 16  # bytes of one chunk of all the block's rows of W_ih
    w_hh = p.smem_chunks * p.chunk_bytes
    cap = X_GROUPS * max(1, min(FUSED_ACCUMULATORS // rl, FUSED_MAX_ROWS // X_GROUPS))
    want = min(cap, -(-rows // X_GROUPS) * X_GROUPS) if rows else cap
    staging = _staging_bytes(batch // p.batch_groups, p.chunks, p.vec, p.warps,
                             p.rows_per_warp, p.lane_groups)

    def rows_for(width, held):  # SN for staged rows of ``width`` chunks, or None
        # a staged row of x (float32, padded by 16 bytes), then in its place the warps' sums
        per_row = max(4 * (width * p.vec + 4), 4 * p.warps * (rl * ROW_GROUPS + 1))
        sn = min(want, (gpu.smem_per_block - held) // per_row // X_GROUPS * X_GROUPS)
        return (sn, held + max(staging, sn * per_row)) if sn >= min(want, FUSED_MIN_ROWS) else None

    found = rows_for(in_chunks, w_hh + in_chunks * row_chunk)  # W_ih next to W_hh
    slab = 0
    if found is None and w_hh // row_chunk >= FUSED_MIN_SLAB:
        slabs = -(-in_chunks // (w_hh // row_chunk))
        slab = -(-in_chunks // slabs)  # W_ih through W_hh's shared memory, even slabs
        found = rows_for(slab, w_hh)
    if found is None:
        return None
    return replace(p, input_rows=found[0], input_chunks=in_chunks, input_slab=slab,
                   smem_bytes=found[1] + local_bytes(p, batch // p.batch_groups))


#: Rows of x a group of the overlapped input projection aims at (S*N): more rows give each
#: load from shared memory more products (the slab's products are bound by those loads) but
#: keep more accumulators in registers for the whole run. H200, us/step, before the loop /
#: overlapped: GRU 1024 N=4 3.33 / S = 2, 4, 8: 3.65, 3.41, 3.06; LSTM 1024 N=4 3.61 / S = 4
#: 3.60 (all W_hh in registers), S = 8 3.30 (one chunk of W_hh in shared memory, to make room).
OVERLAP_ROWS = 32


#: Most steps, and most rows of x, a group of a wavefront's input projections takes: the layer
#: above waits about 2S + 1 steps for the one below, and fewer steps a group read more of
#: W_ih's rows from shared memory a step (all of them at S = 1). H200, LSTM 512, us a step, S =
#: 1 / 2 / 3 / 4: 4 layers batch 4 6.65 / - / - / 5.80, 2 layers batch 4 - / 3.63 / - / 3.04,
#: batch 8 4.70 / - / - / 4.09, batch 16 7.07 / - / 7.94 / -.
WAVEFRONT_STEPS, WAVEFRONT_ROWS = 4, 32


def wavefront_steps(batch: int) -> list[int]:
    """The steps S a group a layer of a wavefront tries (a group of the batch's ``batch``
    rows), best first: the most up to :data:`WAVEFRONT_STEPS` with S*N at most
    :data:`WAVEFRONT_ROWS`, then fewer; S*N a multiple of the lanes' x groups."""
    fits = [s for s in range(WAVEFRONT_STEPS, 0, -1) if s * batch % X_GROUPS == 0]
    return sorted(fits, key=lambda s: s * batch > WAVEFRONT_ROWS)  # S = 4 always fits


def overlap_steps(batch: int) -> int:
    """S for a group of the batch's ``batch`` rows: SN = S*N a multiple of the lanes' x
    groups, the largest not over :data:`OVERLAP_ROWS`, else the smallest over it."""
    fits = [s for s in range(1, OVERLAP_ROWS + 1) if s * batch % X_GROUPS == 0
            and s * batch <= OVERLAP_ROWS]
    return max(fits) if fits else X_GROUPS // math.gcd(batch, X_GROUPS)


def overlap_input(p: Plan, gates: int, input_size: int, batch: int, gpu: GPU,
                  steps: int | None = None) -> Plan | None:
    """``p`` (float32) with its input projection fused and overlapped (see "Overlapped"), S =
    ``steps`` steps a group (default :func:`overlap_steps`; S*N a multiple of 4): W_ih's rows
    resident in shared memory next to W_hh's chunks, h's staging and a slab of x, the
    accumulators kept in registers from slab to slab, in the registers the plan keeps free
    (its ``reg_margin``: plan with a larger one to make room). None where shared memory or the
    registers do not hold them, or the plan streams weights."""
    local = batch // p.batch_groups
    steps = steps or overlap_steps(local)
    if p.vec != 4 or p.global_chunks or p.lane_groups > 1 or steps * local % X_GROUPS:
        return None
    rl = fused_row_split(p, gates)
    sn = steps * local
    in_chunks = -(-input_size // p.vec)
    width = -(-in_chunks // steps)
    staged = max(_staging_bytes(local, p.chunks, p.vec, p.warps, p.rows_per_warp),
                 4 * sn * p.warps * (rl * ROW_GROUPS + 1))  # h, or the warps' sums
    smem = (p.smem_chunks * p.chunk_bytes + in_chunks * rl * ROW_GROUPS * 16 + staged
            + 4 * sn * (width * p.vec + 4) + local_bytes(p, local))  # and x's slab
    # the accumulators stay live through the step; x's and W_ih's values of a chunk take
    # the place of the products' sums and h's values
    regs = (p.reg_estimate + rl * sn // X_GROUPS
            + max(0, (sn // X_GROUPS + rl) * p.vec - _next_pow2(p.rows_per_warp * local)
                  - local * p.vec))
    if smem > gpu.smem_per_block or regs > min(gpu.max_regs_per_thread,
                                               gpu.regs_per_sm // p.threads):
        return None
    return replace(p, input_rows=sn, input_chunks=in_chunks, input_slab=0, input_steps=steps,
                   smem_bytes=smem, reg_estimate=regs)


#: Tensor-core products: a warp's rows (the mma's N), the batch rows of an instruction (its
#: M), and the most batch rows a group (4 tiles).
MMA_ROWS, MMA_TILE, MMA_MAX_BATCH = 8, 16, 64
#: Independent accumulators of the tensor-core products of one tile (k-step f adds into f %
#: chains, summed in a fixed order at the end): one chain would make each mma wait for the
#: previous. Tiles are independent of each other, so T tiles take MMA_CHAINS / T chains each.
MMA_CHAINS = 4
#: Fewest K chunks (of 256 float16 values) a row for tensor cores, times the batch's tiles:
#: with fewer, a warp's few mma instructions leave their latency exposed (H200, us/step, CUDA
#: cores / tensor cores: LSTM 2048 N=4 6.76 / 4.85 (8 chunks), LSTM 1024 N=4 2.88 / 2.61 (4);
#: LSTM 512 N=2 1.24 / 1.51 (2), LSTM 256 N=1 1.04 / 1.12 (1)).
MMA_MIN_CHUNKS = 4
#: Storage dtypes the tensor cores take; float32 in TF32, where the problem allows it (the
#: caller's choice: :func:`~.knobs.tensor_cores`).
MMA_DTYPES = ("float16", "bfloat16", "float32")
#: Fewest batch rows a group and warps a block on tensor cores: one row fills 1/16 of an
#: instruction, and 2-3 warps leave its latency and h's loads exposed (H200, float16, us a
#: step, CUDA cores / tensor cores: GRU 1024 N=1 2.05 / 2.20 (3 warps), GRU 2048 N=1 3.17 /
#: 3.72, LSTM 512 N=32 4.81 / 5.56 (2 warps); bfloat16 LSTM 1024 N=1 2.44 / 2.54).
MMA_MIN_BATCH, MMA_MIN_WARPS = 2, 4
#: Warps a row group's K may be split among on tensor cores (``Plan.k_parts``; "K split"):
#: a block of few units (the backward pass's rows of W_hh^T, K = G*H deep) then still has
#: warps enough, and each lane holds 1/KQ of its rows' weights.
K_PARTS = (1, 2, 4, 8)
#: Slices of K a staging of h (dGH) may take (``Plan.k_slices``; "Slices of K"), the fewest
#: that fit; and the estimated cost of each slice past the first (a block barrier, and the first
#: slice's copy, which no product hides).
K_SLICES, SLICE_NS = (1, 2, 3, 4, 6, 8), 150
#: Fewest batch rows a group in TF32: whole tiles only (half a tile's zero rows are the 16-bit
#: A fragments' layout), and up to 8 rows the CUDA cores' float32 plans are as fast.
TF32_MIN_BATCH = 9


def mma_min_batch(dtype: str) -> int:
    """Fewest batch rows a group on tensor cores for storage ``dtype``."""
    return TF32_MIN_BATCH if dtype == "float32" else MMA_MIN_BATCH


def mma_tiles(batch: int) -> int:
    """Tiles of :data:`MMA_TILE` batch rows a group of ``batch`` rows takes."""
    return -(-batch // MMA_TILE)


def mma_chains(batch: int) -> int:
    """Chains of sums a tile (:data:`MMA_CHAINS` over the tiles, at least one)."""
    return max(1, MMA_CHAINS // mma_tiles(batch))


def mma_staged_rows(batch: int) -> int:
    """Batch rows h is staged for: :data:`MMA_ROWS` (half a tile, the instruction's rows
    8-15 zero) up to 8, else whole tiles."""
    return MMA_ROWS if batch <= MMA_ROWS else MMA_TILE * mma_tiles(batch)


def mma_regs(batch: int) -> int:
    """Registers the tensor-core products need: the chains' 4 sums each of every tile, the A
    (4) and B (2) fragments and their addresses (2)."""
    return 4 * mma_chains(batch) * mma_tiles(batch) + 8


def _mma_staging_bytes(batch: int, chunks: int, vec: int, warps: int, rpw: int,
                       slices: int = 1) -> int:
    """Shared memory for h_{t-1} in the weights' type (16 // ``vec`` bytes) in fragment order
    (:func:`mma_staged_rows`, zeros past N), or two of its ``slices`` (see "Slices of K"), and
    the gates' sums (float32) in a buffer of their own."""
    staged = 16 * mma_staged_rows(batch) * chunks * 32
    return (staged if slices == 1 else 2 * staged // slices) + 4 * warps * rpw * batch


def publishes_staged_h(p: Plan, dtype: str) -> bool:
    """Whether the blocks of plan ``p`` (weights of ``dtype``) publish h a second time, as the
    next step's staging wants it, which then copies it (:mod:`.stages.exchange`): with the
    barriers, on tensor cores in 16 bits, where that halves the bytes and spares each element
    its fragment index. H100, us a step, staged element by element / copied: GRU 768 at batch
    64 float16 14.26 / 4.70, GRU 1024 N32 8.70 / 3.84, GRU 1000 N48 35.51 / 7.48, LSTM 1024 N64
    7.63 / 6.73, bfloat16 LSTM 1024 N16 3.42 / 3.26. Staged in float32 (CUDA cores, TF32) the
    copies were 1-5% slower: LSTM 512 N64 8.95-9.11 / 9.25-9.32, in TF32 6.88-6.95 /
    7.22-7.26, GRU 512 N64 TF32 6.02-6.11 / 6.26-6.27, GRU 1024 N16 8.17-8.24 / 8.06-8.14."""
    return p.mma and p.sync in ("barrier", "grid") and ELEMENT_BYTES[dtype] == 2


def mma_staging_bytes(p: Plan, batch: int) -> int:
    """:func:`_mma_staging_bytes` of plan ``p`` at ``batch`` rows a group."""
    return _mma_staging_bytes(batch, p.chunks, p.vec, p.warps, p.rows_per_warp, p.k_slices)


#: Fewest blocks of a 16-bit backward plan on tensor cores (a block takes at least 8 units,
#: and at small K = G*H the batch groups are few) that a training module takes; on fewer, the
#: CUDA cores' plan where one fits. H200, a training step, us a time step, tensor cores /
#: CUDA cores (docs/benchmarks.md, "Seventy-fourth session"): float16 GRU 64 N64 (2 blocks)
#: 5.5 / 1.7, GRU 64 N256 (8) 6.8 / 3.4, LSTM 128 N32 (8) 3.9 / 2.5, bfloat16 GRU 256 N32 (8)
#: 6.1 / 3.8, float16 LSTM 128 N40 (16) 4.2 / 2.8, GRU 128 N64 (16) 4.3 / 2.9, LSTM 257 N52
#: (18) 18.9 / 15.6, LSTM 96 N128 (24) 5.9 / 4.2; from 32 the tensor cores won: LSTM 128 N128
#: (32) 4.9 / 12.7, bfloat16 GRU 128 N128 (32) 4.6 / 10.9, float16 LSTM 256 N64 (128) 6.3 /
#: 7.1, LSTM 512 N16 (128) 6.4 / 8.4, GRU 1024 N16 (128) 7.5 / 14.2; but for LSTM 128 N256
#: (64) 6.5 / 5.5.
MMA_BACKWARD_MIN_BLOCKS = 32


def backward(gates: int, hidden: int, batch: int, dtype: str, gpu: GPU, states: int = 1,
             kept: int | None = None, reg_margin: int = REG_MARGIN,
             batch_groups: int | None = None, warps: int | None = None,
             max_blocks: int | None = None, params: int = 0, mma: bool = False,
             product: bool = False) -> Plan:
    """The plan of the backward recurrence of a layer of ``gates`` G (see "Backward through
    time"): one row a unit, K = G*H; a pair keeps ``kept`` P values of the step's projections
    (default G), the previous states, the gradients carried through the cell, dy and, for
    each of the cell's ``params`` per-unit parameters, its value and its gradient summed over
    the steps in registers. Batch groups as :func:`plan` decides them (default: chosen).
    ``mma``: the products on tensor cores, K split among a row group's warps where that fits
    better, dGH staged in slices of K where nothing fits whole (16-bit weights). ``product``:
    the step takes a recurrent product of a value (two exchanges a step; a pair keeps dh's
    recurrent part between them; dGH staged whole)."""
    return plan(1, hidden, batch, dtype, gpu, states, max_blocks, reg_margin, warps,
                batch_groups=batch_groups, width=gates * hidden,
                pair_regs=(kept or gates) + 2 * states + 2 + 2 * params + int(product), mma=mma,
                split_k=mma, slices=mma and not product)


#: Storage dtypes the kernel takes, and their bytes (products and sums are float32).
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

#: Warps a block the planner tries (threads = 32 * warps).
WARPS = (8, 16, 4)


def plan(gates: int, hidden: int, batch: int, dtype: str, gpu: GPU, states: int = 1,
         max_blocks: int | None = None, reg_margin: int = REG_MARGIN,
         warps: int | None = None, stream: bool = False, batch_groups: int | None = 1,
         directions: int = 1, layers: int = 1, width: int | None = None,
         pair_regs: int | None = None, mma: bool = False, split_k: bool = False,
         slices: bool = False, narrow: bool = True, lane_groups: bool = True) -> Plan:
    """The persistent plan of least estimated step time whose weights fit, or raise
    :class:`Unfit` saying why none does. ``max_blocks`` caps the grid, ``warps`` fixes the
    block size, ``reg_margin``: registers kept free under the limit (raised when ptxas reports
    spills for a plan; a larger margin moves weight chunks from registers to shared memory).
    ``stream``: weights that registers and shared memory do not hold may stay in global
    memory (L2), up to half the L2 (see "Streaming" above). ``batch_groups``: NG, a divisor
    of ``batch`` (see "Batch groups"; not with ``stream``), or None: up to :data:`MAX_BATCH`,
    the most groups whose weights fit in registers, else one; past it, the most groups that
    fit at all. ``directions``: D grids side by side (see "Directions"; not with ``stream``),
    each of at most ``max_blocks`` blocks; ``layers``: L grids side by side, one a layer (see
    "Layers as a wavefront"; one direction, not with ``stream``). ``width``: K, the length of
    the vector the products take, if not H (the backward pass, :func:`backward`);
    ``pair_regs``: registers a (unit, batch) pair needs, if not 2*G + states. ``mma``: the
    products on tensor cores (see "Tensor cores"; batch groups by default: the most whose
    weights fit in registers, else the fewest that fit); ``split_k``: there a row group's K
    may be split among warps (:data:`K_PARTS`; the backward pass's). ``slices``: where no
    plan fits whole, h staged in slices of K (:data:`K_SLICES`; see "Slices of K").
    ``narrow``: where K is small, fewer elements of K a lane (see "Small K on the CUDA
    cores"; never for a wavefront, whose layers fuse their input projections), 16-byte chunks
    over groups of lanes (``lane_groups``) or else narrower chunks."""
    if dtype not in ELEMENT_BYTES:
        raise Unfit(f"the persistent kernel takes {' or '.join(ELEMENT_BYTES)}, not {dtype}")
    elem = ELEMENT_BYTES[dtype]
    if mma and (dtype not in MMA_DTYPES or stream):
        raise Unfit(f"tensor-core products take {' or '.join(MMA_DTYPES)} weights held on-chip "
                    f"(not streamed), not {dtype}{' streamed' if stream else ''}")
    most = MMA_MAX_BATCH if mma else MAX_BATCH
    if batch_groups is None:
        args = (gates, hidden, batch, dtype, gpu, states, max_blocks, reg_margin, warps)
        more = {"directions": directions, "layers": layers, "width": width,
                "pair_regs": pair_regs, "mma": mma, "split_k": split_k, "slices": slices,
                "narrow": narrow, "lane_groups": lane_groups}
        divisors = [d for d in range(batch, 1, -1) if batch % d == 0]

        def fitting(tried):  # the plans that fit, up to the first with every weight in registers
            fits = []
            for groups in tried:
                try:
                    fits.append(plan(*args, batch_groups=groups, **more))
                except Unfit:
                    continue
                if fits[-1].smem_chunks == 0:
                    break
            return fits

        if mma:  # the first in registers, else the fewest groups that fit
            fits = fitting([d for d in divisors + [1]
                            if mma_min_batch(dtype) <= batch // d <= most])
            if fits:
                return fits[-1]
            if batch > most:
                raise Unfit(f"batch {batch} is over the tensor-core products' {most} a group, "
                            f"and no split into batch groups of at most {most} fits on-chip")
            return plan(*args, batch_groups=1, **more)
        if not stream and batch <= MAX_BATCH:
            fits = fitting(divisors)
            if fits and fits[-1].smem_chunks == 0:
                return fits[-1]
        elif not stream:  # past MAX_BATCH only in groups: the most that fit at all
            for groups in divisors:
                if batch // groups <= MAX_BATCH:
                    try:
                        return plan(*args, batch_groups=groups, **more)
                    except Unfit:
                        continue
            raise Unfit(f"batch {batch} is over the persistent kernel's {MAX_BATCH} (its "
                        "accumulators live in registers), and no split into batch groups of "
                        f"at most {MAX_BATCH} fits on-chip")
        return plan(*args, stream=stream, **more)
    if directions not in (1, 2):
        raise Unfit(f"directions must be 1 or 2, got {directions}")
    if layers < 1 or (layers > 1 and directions > 1):
        raise Unfit(f"layers side by side run one direction each, got {layers} layers of "
                    f"{directions} directions")
    if stream and directions * layers > 1:
        raise Unfit("a streaming plan runs one direction of one layer")
    if batch_groups < 1 or batch % batch_groups:
        raise Unfit(f"batch_groups must divide batch {batch}, got {batch_groups}")
    if stream and batch_groups > 1:
        raise Unfit("a streaming plan takes no batch groups")
    local = batch // batch_groups
    if local > most:
        raise Unfit(f"batch {local}{' a group' if batch_groups > 1 else ''} is over the "
                    f"persistent kernel's {most} ("
                    + ("tiles of tensor-core sums" if mma else "its accumulators live in registers")
                    + ")")
    if mma and local < mma_min_batch(dtype):
        raise Unfit(f"{dtype} tensor-core products take at least {mma_min_batch(dtype)} batch "
                    f"rows a group, got {local}")
    chunks = -(-(width or hidden) // (32 * 16 // elem))
    if mma and chunks * mma_tiles(local) < MMA_MIN_CHUNKS:
        raise Unfit(f"tensor-core products take at least {MMA_MIN_CHUNKS} chunks of K times "
                    f"tiles of batch; K = {width or hidden} is {chunks} of {32 * 16 // elem} "
                    f"at {mma_tiles(local)} tile(s) (batch {local})")
    grids = directions * layers
    cap = min(gpu.sms // grids, max_blocks or gpu.sms) // batch_groups
    best = None
    for sliced in (False, True) if slices else (False,):  # in slices only where none fits
        for units in sorted({-(-hidden // b) for b in range(1, cap + 1)}):
            for wn, parts in ([(warps, q) for q in (K_PARTS if split_k else (1,))] if mma
                              else [(wn, 1) for wn in ((warps,) if warps else WARPS)]):
                found = _try(gates, hidden, local, elem, gpu, units, wn, states, reg_margin,
                             stream, width, pair_regs, mma, parts, sliced,
                             narrow and layers == 1, lane_groups)
                if found is None or found.blocks > cap:
                    continue
                if best is None or estimate_ns(found, local) < estimate_ns(best, local):
                    best = found
        if best is not None:
            break
    if best is not None:
        best = replace(best, blocks=best.blocks * batch_groups * grids,
                       batch_groups=batch_groups, directions=directions, layers=layers)
        return replace(best, sync=exchange(best, batch))
    need = gates * hidden * (width or hidden) * elem / max(cap, 1)
    also = f", or than those and half the L2 ({gpu.l2_bytes // 2**21} MiB)" if stream else ""
    groups = f" ({batch_groups} batch groups)" if batch_groups > 1 else ""
    groups += f" (one of {directions} directions)" if directions > 1 else ""
    groups += f" (one of {layers} layers)" if layers > 1 else ""
    raise Unfit(
        f"{gates * hidden}x{width or hidden} {dtype} recurrent weights need {need / 1024:.0f} KiB "
        f"on each of {cap} multiprocessors of {gpu.name}{groups}, more than their registers "
        f"and shared memory hold (with h and batch {local} staged){also}")
