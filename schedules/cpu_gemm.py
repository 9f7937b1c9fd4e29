"""CPU: the projections, as a register-blocked GEMM.

Expects rnncc's gemm component with weights in "cols" layout (W^T [K, O], outputs
contiguous). Batch rows are tiled by a divisor of N (up to 4) and outputs by a vector width;
for each tile the k loop accumulates a [rows, vec] block, the bias epilogue runs on the tile
while it is hot, and tiles (over T, N and the outputs) run in parallel.
"""

from tvm import s_tir

from ._common import divisor, gemm_blocks, static_extent
from ._rule import Rule


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None:
        return None
    gemm, bias = blocks
    loops = sch.get_loops(gemm)
    if len(loops) < 3:
        return None
    outer, n, o, k = loops[:-3], loops[-3], loops[-2], loops[-1]
    if static_extent(sch, n) is None:
        return None
    n_o, n_i = sch.split(n, [None, divisor(static_extent(sch, n), (4, 3, 2))])
    vec = divisor(static_extent(sch, o), (16, 8, 4))
    o_o, o_i = sch.split(o, [None, vec])
    sch.reorder(*outer, n_o, o_o, k, n_i, o_i)
    tile = sch.fuse(*outer, n_o, o_o)
    sch.parallel(tile)
    sch.unroll(n_i)
    if vec > 1:
        sch.vectorize(o_i)
    sch.decompose_reduction(gemm, k)
    sch.reverse_compute_at(bias, tile)
    if vec > 1:
        sch.vectorize(sch.get_loops(bias)[-1])
    return sch


RULE = Rule("cpu.gemm", apply)
