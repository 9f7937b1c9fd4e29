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

Tile m's k-step f adds into its chain f % C (``dacc`` [tiles, C, 4], C =
:func:`~..planner.mma_chains`), so that an instruction does not wait for the previous one; the
chains are summed in a fixed order. No reduction over the lanes: lane l ends with batch rows
m*16 + l // 4 (+ 8) of rows (l % 4)*2 + {0, 1}.

The operands are dedicated 4- and 8-element register arrays at offset 0: TVM types a local
buffer that only sees 8-wide vector accesses as ``uint4``, and a half offset into it would then
be wrong.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...cuda_mma_gemm import HALF
from ..planner import MMA_ROWS, MMA_TILE


@T.macro
def prepare(spec, hs16, af, tx):
    """Once: h's fragments zero (batch rows past N stay so), and with half a tile so do the A
    registers of rows 8-15; a block barrier orders the zeros before the first staging."""
    size, threads = T.meta_var((spec.mma_rows * spec.width, spec.plan.threads))
    for e in spec.spread(size):
        if e * threads + tx < size:
            hs16[e * threads + tx] = tirx.const(0, spec.dtype)
    if spec.mma_rows == MMA_ROWS:
        for c in T.unroll(8):
            af[c] = tirx.const(0, spec.dtype)
    T.tvm_storage_sync("shared.dyn")


@T.macro
def store_h(spec, hs16, e, value):
    """Element e = n*KP + k of h_{t-1}, rounded to the weights' type, in A fragment order."""
    kp = T.meta_var(spec.width)
    if spec.mma_rows == MMA_ROWS:
        hs16[(e % kp // 16 * 32 + e // kp * 4 + e % kp % 8 // 2) * 4 + e % kp % 16 // 8 * 2
             + e % kp % 2] = T.Cast(spec.dtype, value)
    else:
        hs16[(((e // kp // MMA_TILE * (kp // 16) + e % kp // 16) * 32 + e // kp % 8 * 4
               + e % kp % 8 // 2) * 8) + e % kp % 16 // 8 * 4 + e // kp % MMA_TILE // 8 * 2
             + e % kp % 2] = T.Cast(spec.dtype, value)


@T.macro
def zero(spec, dacc):
    for a in T.unroll(4 * spec.mma_chains * spec.mma_tiles):
        dacc[a] = T.float32(0)


@T.macro
def chunk(spec, hs16, af, wb, wv, dacc, lane, i, read):
    """Chunk i (two k-steps of 16) of the warp's rows: ``read(q)`` puts the B fragments of row
    group q's two k-steps in ``wv``. k-step f = i*2*VEC + q*2 + s goes to chain (q*2 + s) % C
    (f % C: 2*VEC is a multiple of C)."""
    vec, chains, steps = T.meta_var((spec.plan.vec, spec.mma_chains, spec.width // 16))
    for q in T.unroll(spec.plan.rows_per_warp):
        read(q)
        for s in T.unroll(2):
            if spec.mma_rows == MMA_ROWS:
                for v in T.vectorized(2):
                    af[v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + v]
                for v in T.vectorized(2):
                    af[4 + v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + 2 + v]
                for v in T.vectorized(4):
                    wb[v] = wv[s * 4 + v]
                T.evaluate(T.ptx_legacy.mma(
                    "m16n8k16", "row", "col", HALF[spec.dtype], HALF[spec.dtype], "fp32",
                    af.data, 0, wb.data, 0, dacc.data, (q * 2 + s) % chains * 4, False,
                    dtype="float32"))
            else:
                for v in T.vectorized(4):
                    wb[v] = wv[s * 4 + v]
                for m in T.unroll(spec.mma_tiles):
                    for v in T.vectorized(8):
                        af[v] = hs16[((m * steps + i * (vec * 2) + q * 2 + s) * 32 + lane) * 8
                                     + v]
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", HALF[spec.dtype], HALF[spec.dtype], "fp32",
                        af.data, 0, wb.data, 0, dacc.data, (m * chains + (q * 2 + s) % chains)
                        * 4, False, dtype="float32"))


def _chain_sum(spec, dacc, m, c):
    chains = spec.mma_chains
    total = dacc[m * chains * 4 + c]
    for k in range(1, chains):
        total = total + dacc[(m * chains + k) * 4 + c]
    return total


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
