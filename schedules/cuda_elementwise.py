"""CUDA: element-wise components (the cell's step, state copies, weight packing).

Each loop nest (one kernel; the blocks of a multi-output step share it) is fused into one loop
and split over blocks of up to 256 threads, so thread i of the kernel handles element i:
consecutive threads touch consecutive elements of every [N, H] tensor (coalesced), and one
thread computes all gates of its hidden unit.
"""

from tvm import s_tir

from ._common import is_spatial, loop_nests, static_extent
from ._rule import Rule

THREADS = 256


def apply(func, target):
    sch = s_tir.Schedule(func)
    nests = loop_nests(sch)
    if not nests or any(not is_spatial(sch, b) for _, blocks in nests for b in blocks):
        return None
    for loops, _ in nests:
        if not loops:
            return None
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        total = static_extent(sch, fused)
        threads = THREADS if total is None else min(THREADS, max(32, -(-total // 32) * 32))
        bx, tx = sch.split(fused, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch


RULE = Rule("cuda.elementwise", apply)
