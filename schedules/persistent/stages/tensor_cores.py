"""Stage: the recurrent products on tensor cores (plans with ``mma``; planner: "Tensor cores").

A warp's products are ``mma.sync`` m16n8k16 instructions (float16 or bfloat16 operands, as the
weights, float32 sums): the warp's 8 rows are the instruction's N, the batch its M (rows past N
are zeros), 16 k a step. h_{t-1} is staged once a step in the weights' 16-bit type, in the A
fragment's order (``hs16``); lane l holds, of
each 16 k, the weights W[row l // 4][k0 + (l % 4)*2 + {0, 1, 8, 9}] (the B fragment: the
packing's order for ``mma``). k-step f adds into chain f % ``MMA_CHAINS`` (``dacc``), so that an
instruction does not wait for the previous one; the chains are summed in a fixed order. No
reduction over the lanes: lane l ends with batch row l // 4 of rows (l % 4)*2 + {0, 1}.

The operands are dedicated 4- and 8-element register arrays at offset 0: TVM types a local
buffer that only sees 8-wide vector accesses as ``uint4``, and a half offset into it would then
be wrong.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...cuda_mma_gemm import HALF
from ..planner import MMA_CHAINS, MMA_ROWS


@T.macro
def prepare(spec, hs16, af, tx):
    """Once: h's fragments zero (batch rows past N stay so), and so do the A registers of rows
    8-15; a block barrier orders the zeros before the first staging."""
    size, threads = T.meta_var((MMA_ROWS * spec.width, spec.plan.threads))
    for e in spec.spread(size):
        if e * threads + tx < size:
            hs16[e * threads + tx] = tirx.const(0, spec.dtype)
    for c in T.unroll(8):
        af[c] = tirx.const(0, spec.dtype)
    T.tvm_storage_sync("shared.dyn")


@T.macro
def store_h(spec, hs16, e, value):
    """Element e = n*KP + k of h_{t-1}, rounded to the weights' type, in A fragment order."""
    kp = T.meta_var(spec.width)
    hs16[(e % kp // 16 * 32 + e // kp * 4 + e % kp % 8 // 2) * 4 + e % kp % 16 // 8 * 2
         + e % kp % 2] = T.Cast(spec.dtype, value)


@T.macro
def zero(spec, dacc):
    for a in T.unroll(4 * MMA_CHAINS):
        dacc[a] = T.float32(0)


@T.macro
def chunk(spec, hs16, af, wb, wv, dacc, lane, i, read):
    """Chunk i (two k-steps of 16) of the warp's rows: ``read(q)`` puts the B fragments of row
    group q's two k-steps in ``wv``."""
    vec = T.meta_var(spec.plan.vec)
    for q in T.unroll(spec.plan.rows_per_warp):
        read(q)
        for s in T.unroll(2):
            for v in T.vectorized(2):
                af[v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + v]
            for v in T.vectorized(2):
                af[4 + v] = hs16[((i * (vec * 2) + q * 2 + s) * 32 + lane) * 4 + 2 + v]
            for v in T.vectorized(4):
                wb[v] = wv[s * 4 + v]
            T.evaluate(T.ptx_legacy.mma(
                "m16n8k16", "row", "col", HALF[spec.dtype], HALF[spec.dtype], "fp32", af.data, 0,
                wb.data, 0, dacc.data, (q * 2 + s) % MMA_CHAINS * 4, False, dtype="float32"))


def _chain_sum(dacc, c):
    total = dacc[c]
    for m in range(1, MMA_CHAINS):
        total = total + dacc[4 * m + c]
    return total


@T.macro
def store_sums(spec, hs, dacc, warp, lane):
    """The lane's sums of its batch row (lane // 4) and two rows into ``hs`` [Wn*RW, N/NG]."""
    rw, n_ = T.meta_var((spec.plan.rows_per_warp, spec.local_batch))
    if lane // 4 < n_:
        hs[(warp * rw + lane % 4 * 2 + 0) * n_ + lane // 4] = _chain_sum(dacc, 0)
        hs[(warp * rw + lane % 4 * 2 + 1) * n_ + lane // 4] = _chain_sum(dacc, 1)
