"""Stage: the recurrent products on tensor cores (plans with ``mma``; planner: "Tensor cores").

A warp's products are ``mma.sync`` m16n8k16 instructions (float16 or bfloat16 operands, as the
weights, float32 sums): the warp's 8 rows are the instruction's N, the batch its M, 16 k a
step. Lane l holds, of each 16 k, the weights W[row l // 4][k0 + (l % 4)*2 + {0, 1, 8, 9}]
(the B fragment: the packing's order for ``mma``). h_{t-1} is staged once a step in the
weights' 16-bit type, in the A fragment's order (``hs16``), one of two ways
(``spec.mma_rows``):

- half a tile (batch up to 8): 8 rows, lane l's 4 values of a k-step (row l // 4, k (l % 4)*2
  + {0, 1, 8, 9}) at (k-step*32 + l)*4; the A registers of rows 8-15 stay zero;
- tiles (batch 9 to 64): 16 rows a tile, lane l's 8 values of a k-step (rows l // 4 and
  l // 4 + 8) at ((tile*KS + k-step)*32 + l)*8, KS = KP / 16 k-steps a row: one 16-byte load
  a fragment; each fragment of weights multiplies every tile.

In slices of K (:attr:`~..planner.Plan.k_slices` KL > 1; planner: "Slices of K"), the
tiles' fragments are ordered by slice first: slice s holds, of each of the KQ parts of K, the
k-steps of its chunks s*CL .. (s+1)*CL - 1 (CL = KI/(KQ*KL)), lane l's at (((s*tiles +
m)*KS/KL + f)*32 + l)*8, f = (part*CL + chunk in the slice)*2*VEC + k-step in the chunk: a
slice is one contiguous range, and staged it is read as the whole of K is, with KS/KL k-steps
a row.

Tile m's k-step f adds into its chain f % C (``dacc`` [tiles, C, 4], C =
:func:`~..planner.mma_chains`), so that an instruction does not wait for the previous one; the
chains are summed in a fixed order. No reduction over the lanes: lane l ends with batch rows
m*16 + l // 4 (+ 8) of rows (l % 4)*2 + {0, 1}.

TF32 (float32 weights where the problem allows it; tiles only): lane l's vector of 16 bytes
holds one k-step's 4 values (W[row l // 4][k0 + (l % 4)*2 + {0, 1, 8, 9}], rounded to TF32 when
packed), and the k-step is two m16n8k8 instructions, of k0 + (l % 4)*2 + {0, 1} and of 8
more, whose instruction k l % 4 and l % 4 + 4 are those two. h is staged in float32 rounded to
TF32, each instruction's A registers a lane's 16 contiguous bytes (a warp's load hits every
bank once a phase): (row, k) (g, 2q), (g + 8, 2q), (g, 2q + 1), (g + 8, 2q + 1) at ((tile*KS
+ k-step)*2 + s)*32 + l)*4, s = 0 for k 2q + {0, 1}, 1 for 8 more (g = l // 4, q = l % 4).

The operands are dedicated 4- and 8-element register arrays at offset 0: TVM types a local
buffer that only sees 8-wide vector accesses as ``uint4``, and a half offset into it would then
be wrong.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ... import _mma
from ..planner import MMA_ROWS, MMA_TILE


@T.macro
def prepare(spec, hs16, af, tx):
    """Once: h's fragments zero (batch rows past N stay so), and with half a tile so do the A
    registers of rows 8-15; a block barrier orders the zeros before the first staging."""
    size, threads = T.meta_var((int(hs16.shape[0]), spec.plan.threads))
    for e in spec.spread(size):
        if e * threads + tx < size:
            hs16[e * threads + tx] = tirx.const(0, spec.dtype)
    if spec.mma_rows == MMA_ROWS:
        for c in T.unroll(8):
            af[c] = tirx.const(0, spec.dtype)
    T.tvm_storage_sync("shared.dyn")


def _tile_step(spec, m, f):
    """The place of tile m's k-step f among the staged tiles' k-steps (32 lanes' 8 values
    each): m*KS + f, or in slices of K (KL > 1) slice first (see above)."""
    if spec.plan.k_slices == 1:
        return m * (spec.width // 16) + f
    per = 2 * spec.plan.vec  # k-steps a chunk
    chunk, cl = f // per, spec.plan.slice_chunks
    part, own = chunk // spec.plan.warp_chunks, chunk % spec.plan.warp_chunks
    return ((own // cl * spec.mma_tiles + m) * (spec.slice_width // 16)
            + (part * cl + own % cl) * per + f % per)


@T.macro
def store_h(spec, hs16, base, e, value):
    """Element e = n*KP + k of h_{t-1}, rounded to the weights' type, in A fragment order, at
    ``base`` of ``hs16`` (the staged h, or a group's published one: :mod:`.exchange`)."""
    kp, op = T.meta_var((spec.width, _mma.Operand(spec.dtype)))
    if spec.mma_rows == MMA_ROWS:
        hs16[base + (e % kp // 16 * 32 + e // kp * 4 + e % kp % 8 // 2) * 4 + e % kp % 16 // 8
             * 2 + e % kp % 2] = op.round(value)
    elif op.tf32:  # an instruction's 4 values a lane, 16 bytes: rows g, g + 8 inner to k
        hs16[base + ((((e // kp // MMA_TILE * (kp // 16) + e % kp // 16) * 2 + e % kp % 16 // 8)
                      * 32 + e // kp % 8 * 4 + e % kp % 8 // 2) * 4) + e % kp % 2 * 2
             + e // kp % MMA_TILE // 8] = op.round(value)
    else:
        hs16[base + ((_tile_step(spec, e // kp // MMA_TILE, e % kp // 16) * 32
                      + e // kp % 8 * 4 + e % kp % 8 // 2) * 8) + e % kp % 16 // 8 * 4
             + e // kp % MMA_TILE // 8 * 2 + e % kp % 2] = op.round(value)


@T.macro
def zero(spec, dacc):
    for a in T.unroll(4 * spec.mma_chains * spec.mma_tiles):
        dacc[a] = T.float32(0)


@T.macro
def chunk(spec, hs16, af, wb, wv, dacc, lane, i, read, base=0, row_steps=0):
    """Chunk i (2*VEC k-steps of 16) of the warp's rows: ``read(q)`` puts vector q's B
    fragments in ``wv``, two k-steps' (16-bit weights) or one's (TF32). In 16 bits k-step f =
    i*2*VEC + q*2 + s goes to chain (q*2 + s) % C (f % C: 2*VEC is a multiple of C); in TF32
    k-step f = i*2*VEC + q, its instruction s (8 k each) to chain (q*2 + s) % C. A slice of K
    (:func:`slice_chunk`): its fragments at ``base``, ``row_steps`` k-steps a row (all of K's
    without)."""
    vec, chains, steps = T.meta_var((spec.plan.vec, spec.mma_chains,
                                     row_steps or spec.width // 16))
    op = T.meta_var(_mma.Operand(spec.dtype))
    for q in T.unroll(spec.plan.rows_per_warp):
        read(q)
        for s in T.unroll(2):
            if op.tf32:
                for v in T.vectorized(2):
                    wb[v] = wv[s * 2 + v]
                for m in T.unroll(spec.mma_tiles):
                    for v in T.vectorized(4):
                        af[v] = hs16[(((m * steps + i * (vec * 2) + q) * 2 + s) * 32 + lane) * 4
                                     + v]
                    _mma.mma(op, af, wb, dacc, (m * chains + (q * 2 + s) % chains) * 4)
            elif spec.mma_rows == MMA_ROWS:
                for v in T.vectorized(2):
                    af[v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + v]
                for v in T.vectorized(2):
                    af[4 + v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + 2 + v]
                for v in T.vectorized(4):
                    wb[v] = wv[s * 4 + v]
                _mma.mma(op, af, wb, dacc, (q * 2 + s) % chains * 4)
            else:
                for v in T.vectorized(4):
                    wb[v] = wv[s * 4 + v]
                for m in T.unroll(spec.mma_tiles):
                    for v in T.vectorized(8):
                        af[v] = hs16[base + ((m * steps + i * (vec * 2) + q * 2 + s) * 32 + lane)
                                     * 8 + v]
                    _mma.mma(op, af, wb, dacc, (m * chains + (q * 2 + s) % chains) * 4)


@T.macro
def slice_chunk(spec, hs16, af, wb, wv, dacc, warp, lane, slot, j, read):
    """The warp's chunk j (of its part of K) from its slice, staged in ``slot`` (0 or 1) of
    ``hs16``: its place in the slice is the CL chunks of each part before the warp's, then
    j's among the slice's CL."""
    cl = T.meta_var(spec.plan.slice_chunks)
    chunk(spec, hs16, af, wb, wv, dacc, lane, warp // spec.plan.row_groups * cl + j % cl, read,
          base=slot * spec.slice_size, row_steps=spec.slice_width // 16)


def _chain_sum(spec, dacc, m, c):
    chains = spec.mma_chains
    total = dacc[m * chains * 4 + c]
    for k in range(1, chains):
        total = total + dacc[(m * chains + k) * 4 + c]
    return total


def _parts_sum(hs, e, size, parts):
    total = hs[e]
    for q in range(1, parts):
        total = total + hs[q * size + e]
    return total


@T.macro
def add_parts(spec, hs, tx):
    """With K split among KQ warps (:attr:`~..planner.Plan.k_parts`): each part's sums are
    [RG*RW, N/NG] in ``hs`` one after another (:func:`store_sums` by warp); the first part's
    become the sums of all, added in the parts' order."""
    size, parts, threads = T.meta_var((spec.plan.row_groups * spec.plan.rows_per_warp
                                       * spec.local_batch, spec.plan.k_parts, spec.plan.threads))
    for e in spec.spread(size):
        if e * threads + tx < size:
            hs[e * threads + tx] = _parts_sum(hs, e * threads + tx, size, parts)


@T.macro
def store_sums(spec, hs, dacc, warp, lane):
    """The lane's sums into ``hs`` [Wn*RW, N/NG]: of tile m, sum c is batch row m*16 + lane //
    4 + 8*(c // 2) of row (lane % 4)*2 + c % 2 (c < 2 with half a tile)."""
    rw, n_ = T.meta_var((spec.plan.rows_per_warp, spec.local_batch))
    if spec.mma_rows == MMA_ROWS:
        if lane // 4 < n_:
            hs[(warp * rw + lane % 4 * 2 + 0) * n_ + lane // 4] = _chain_sum(spec, dacc, 0, 0)
            hs[(warp * rw + lane % 4 * 2 + 1) * n_ + lane // 4] = _chain_sum(spec, dacc, 0, 1)
    else:
        for m in T.unroll(spec.mma_tiles):
            for c in T.unroll(4):
                if m * MMA_TILE + lane // 4 + c // 2 * 8 < n_:
                    hs[(warp * rw + lane % 4 * 2 + c % 2) * n_ + m * MMA_TILE + lane // 4
                       + c // 2 * 8] = _chain_sum(spec, dacc, m, c)
