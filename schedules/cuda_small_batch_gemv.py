"""CUDA: the recurrent projection at small batch (2 <= N <= 16), one weight read for all N.

out[n, o] = sum_k h[n, k] * W[o, k] + b[o]. A warp owns an output row o: lane l reads the
16-byte chunks k = (c*32 + l)*4 .. +4 of W's row once (coalesced across the warp) and of every
batch row of h, keeps N partial sums in registers (an rfactor over the lanes), and a shuffle
reduction across the warp finishes each sum. The weights stream through once a step, which is
what bounds this kernel: G*H*H*4 bytes per step from L2/HBM.
"""

from tvm import s_tir

from ._common import gemm_blocks, static_extent
from ._rule import Rule

MAX_BATCH = 16
ROWS_PER_BLOCK = 8


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None:
        return None
    gemm, bias = blocks
    loops = sch.get_loops(gemm)
    if len(loops) != 3:
        return None  # only the per-step projection [N, K] x [O, K]
    n, o, k = loops
    batch, rows, depth = (static_extent(sch, x) for x in (n, o, k))
    if None in (batch, rows, depth) or not 2 <= batch <= MAX_BATCH:
        return None  # batch 1 is dlight's GEMV rule's (this one's unit loop trips TVM)
    vec = 4 if depth % 128 == 0 else 1
    if depth % (32 * vec):
        return None
    k_outer, lane, v = sch.split(k, [None, 32, vec])
    rf = sch.rfactor(lane, factor_axis=0)
    n_rf, o_rf, ko_rf, lane_rf, v_rf = sch.get_loops(rf)
    sch.reorder(o_rf, lane_rf, ko_rf, v_rf, n_rf)
    per_block = ROWS_PER_BLOCK if rows % ROWS_PER_BLOCK == 0 else 1
    o_b, o_t = sch.split(o_rf, [None, per_block])
    sch.bind(o_b, "blockIdx.x")
    sch.bind(o_t, "threadIdx.y")
    sch.bind(lane_rf, "threadIdx.x")
    w_local = sch.cache_read(rf, 1, "local")
    h_local = sch.cache_read(rf, 0, "local")
    sch.compute_at(w_local, ko_rf)
    sch.compute_at(h_local, ko_rf)
    if vec > 1:
        sch.vectorize(sch.get_loops(w_local)[-1])
        sch.vectorize(sch.get_loops(h_local)[-1])
    sch.unroll(v_rf)
    sch.unroll(n_rf)
    sch.set_scope(rf, 0, "local")
    sch.decompose_reduction(rf, ko_rf)
    sch.reverse_compute_at(gemm, o_t)
    lanes, batch_rows = sch.get_loops(gemm)[-2:]
    sch.reorder(batch_rows, lanes)
    sch.bind(lanes, "threadIdx.x")  # a cross-thread (shuffle) reduction
    sch.set_scope(gemm, 0, "local")
    sch.reverse_compute_at(bias, o_t)
    sch.unroll(sch.get_loops(bias)[-1])
    return sch


RULE = Rule("cuda.small_batch_gemv", apply)
