"""CUDA: fits any of rnncc's gemm components; the last rule of the CUDA gemm role.

One thread an output element: the spatial loops are fused and spread over blocks of 128
threads, the k loop runs serially in each thread into a register, and the bias epilogue is
computed by the same thread. Not fast; it exists so that shapes the tiled rules refuse (tiny
H, odd C) still compile correctly. (dlight's Fallback rule is not used for gemm: it folds the
bias into the reduction's update, which adds it once per k.)
"""

from tvm import s_tir

from ._common import gemm_blocks
from ._rule import Rule

THREADS = 128


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None:
        return None
    gemm, bias = blocks
    loops = sch.get_loops(gemm)
    spatial = loops[:-1]
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    bx, tx = sch.split(fused, [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.reverse_compute_at(bias, tx)
    sch.set_scope(gemm, 0, "local")
    return sch


RULE = Rule("cuda.gemm_simple", apply)
