"""CUDA: the recurrent projection at small batch (N <= 31), one weight read for all N.

out[n, o] = sum_k h[n, k] * W[o, k] + b[o]. A warp owns RW output rows: lane l reads the
16-byte chunks k = (c*32 + l)*4 .. +4 of each of its rows once (coalesced across the warp)
and of every batch row of h, keeps RW*N partial sums in registers (an rfactor over the lanes),
and a shuffle reduction across the warp finishes each sum. The weights stream through once a
step, which is what bounds this kernel at large H: G*H*H*4 bytes per step from L2/HBM. More
rows a warp (:func:`rows_per_warp`) let each load of h serve RW products and keep RW loads of
the weights in flight; with one row a warp each chunk of the weights took N loads of h, and
those bound the kernel instead (H200, LSTM 2048 at batch 16: 178.9 us a step in all, against
cuDNN's 79). At batch 1 it streams the weights at 4.1 TB/s on an H200 (LSTM 4096: 66.0 us,
kernel alone), where dlight's GEMV, the rule it replaced there, took 89.4 and cuBLAS 76.2. K
need not be a multiple of 128 (the last chunk's lanes past K masked; 16-byte vectors where K
is a multiple of 4): LSTM 1500 at batch 4, 10.4 us where dlight's Matmul took 94.4.

Where h is larger than L1 keeps beside the weights streaming through it (N*K values over
:data:`SHARED_H_MIN_BYTES`), the block stages each chunk of K of h in shared memory (N * 128
values, loaded once by all its warps) and the lanes read h from there; through L1 their N loads
of h a chunk missed. H200, IEEE float32, us a step at T = 100, through L1 -> staged: LSTM 4096
at batch 16 163.1 -> 145.5, GRU 4096 141.3 -> 124.9; at K = 2048 (h 128 KiB) it did not pay:
LSTM 2048 43.3 -> 43.1, GRU 2048 35.7 -> 38.3. The kernel alone (N K O, us): 24 2048 8192
76.9 -> 58.7; 12 2048 8192 24.0 -> 24.7.
"""

import tvm
from tvm import s_tir

from ._common import gemm_blocks, static_extent
from ._rule import Rule

#: Largest batch: from 32 on, :mod:`.cuda_sgemm` tiles one step's product (H200, us a step in
#: all, LSTM 2048 at batch 24: 163.9 with dlight's Matmul, which took 17-31 before).
MAX_BATCH = 31
WARPS = 8
#: Most rows a warp, and most partial sums (RW*N) a lane holds in registers.
MAX_ROWS_PER_WARP, MAX_SUMS = 8, 64
#: Fewest blocks the grid should have (about one a multiprocessor of an H100/H200, which
#: holds two): fewer rows a warp where more would leave the grid smaller.
TARGET_BLOCKS = 128
#: Bytes of h past which a block stages its chunks in shared memory (module docstring).
SHARED_H_MIN_BYTES = 128 * 1024


def rows_per_warp(batch: int, rows: int) -> int:
    """RW for ``rows`` output rows at batch ``batch``: the largest power of two at most N,
    :data:`MAX_SUMS` / N and :data:`MAX_ROWS_PER_WARP`, halved until the rows divide into
    blocks of :data:`WARPS` warps and at least :data:`TARGET_BLOCKS` of them. Measured on an
    H200 (kernel alone, K = 1024-4096, O = 4K-16K): RW = 2 best at N = 2, 4 at N = 4 and
    16, 8 at N = 8 with O >= 8192 (LSTM 4096: 70.6 us against 107.5 at RW = 1); at N = 16
    RW = 8 (128 sums) spilled and took twice as long."""
    rw = 1
    while rw * 2 <= min(batch, MAX_SUMS // batch, MAX_ROWS_PER_WARP):
        rw *= 2
    while rw > 1 and (rows % (WARPS * rw) or rows // (WARPS * rw) < TARGET_BLOCKS):
        rw //= 2
    return rw


def apply(func, target, rw: int | None = None):
    """The rule; ``rw`` fixes the rows a warp (benchmarks), else :func:`rows_per_warp`."""
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
    if None in (batch, rows, depth) or batch > MAX_BATCH:
        return None
    vec = 4 if depth % 4 == 0 else 1  # K not a multiple of 32 * vec: the last chunk masked
    rw = rw or rows_per_warp(batch, rows)
    warps = WARPS if rows % (WARPS * rw) == 0 else 1
    if rows % (warps * rw):
        return None
    k_outer, lane, v = sch.split(k, [None, 32, vec])
    rf = sch.rfactor(lane, factor_axis=0)
    n_rf, o_rf, ko_rf, lane_rf, v_rf = sch.get_loops(rf)
    o_b, o_t, *o_r = sch.split(o_rf, [None, warps, rw] if rw > 1 else [None, warps])
    sch.reorder(o_b, o_t, lane_rf, ko_rf, n_rf, *o_r, v_rf)
    sch.bind(o_b, "blockIdx.x")
    sch.bind(o_t, "threadIdx.y")
    sch.bind(lane_rf, "threadIdx.x")
    h_bytes = batch * depth * tvm.DataType(str(func.params[0].ty.dtype)).bits // 8
    staged = h_bytes > SHARED_H_MIN_BYTES
    h_shared = sch.cache_read(rf, 0, "shared") if staged else None
    w_local = sch.cache_read(rf, 1, "local")
    h_local = sch.cache_read(rf, 0, "local")
    sch.compute_at(w_local, ko_rf)  # RW chunks of the weights, loaded once a chunk of K
    sch.compute_at(h_local, n_rf)  # a chunk of one batch row of h, serving RW rows
    if h_shared is not None:  # the block's chunk of h: all N rows, loaded by all its threads
        sch.compute_at(h_shared, ko_rf)
        copy = sch.get_loops(h_shared)[4:]  # under o_b, o_t, lane_rf and ko_rf
        if copy:  # (none where the chunk is one value)
            _, warp, thread, v_s = sch.split(sch.fuse(*copy) if len(copy) > 1 else copy[0],
                                             [None, warps, 32, vec])
            sch.bind(warp, "threadIdx.y")
            sch.bind(thread, "threadIdx.x")
            if vec > 1:
                sch.vectorize(v_s)
    if vec > 1:
        sch.vectorize(sch.get_loops(w_local)[-1])
        sch.vectorize(sch.get_loops(h_local)[-1])
    for loop in (n_rf, *o_r, v_rf):
        sch.unroll(loop)
    sch.set_scope(rf, 0, "local")
    sch.decompose_reduction(rf, ko_rf)
    sch.reverse_compute_at(gemm, o_t)
    # lanes[, batch rows][, unit rows]: TVM leaves out loops of one trip
    inner = sch.get_loops(gemm)[-(1 + (batch > 1) + (rw > 1)):]
    sch.reorder(*inner[1:], inner[0])
    sch.bind(inner[0], "threadIdx.x")  # a cross-thread (shuffle) reduction
    sch.set_scope(gemm, 0, "local")
    sch.reverse_compute_at(bias, o_t)
    bias_loops = sch.get_loops(bias)
    for loop in bias_loops[len(bias_loops) - len(inner) + 1:]:  # [batch rows][, unit rows]
        sch.unroll(loop)
    return sch


RULE = Rule("cuda.small_batch_gemv", apply)
