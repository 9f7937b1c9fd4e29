"""CUDA: the recurrent projection at small batch (N <= 31), one weight read for all N.

out[n, o] = sum_k h[n, k] * W[o, k] + b[o]. A warp owns RW output rows: lane l reads the
16-byte chunks k = (c*32 + l)*4 .. +4 of each of its rows once (coalesced across the warp) and
of every batch row of h, keeps RW*N partial sums in registers (an rfactor over the lanes), and
a shuffle reduction across the warp finishes each sum. The weights stream through once a step,
which is what bounds this kernel at large H: G*H*H*4 bytes per step from L2/HBM (past 40 MiB
with an L2 policy that keeps 30 MiB of them resident from step to step, :mod:`._streaming`).
More rows a warp (:func:`rows_per_warp`) let each load of h serve RW products and keep RW loads
of the weights in flight; with one row a warp each chunk of the weights took N loads of h, and
those bound the kernel instead (H200, LSTM 2048 at batch 16: 178.9 us a step in all, against
cuDNN's 79). At batch 1 it streams the weights at 4.1 TB/s on an H200 (LSTM 4096: 66.0 us,
kernel alone), where dlight's GEMV, the rule it replaced there, took 89.4 and cuBLAS 76.2. K
need not be a multiple of 128 (the last chunk's lanes past K masked; 16-byte vectors where K is
a multiple of 4): LSTM 1500 at batch 4, 10.4 us where dlight's Matmul took 94.4. Where the
rows are few and K long (the backward's dh = dGH W_hh: O = H, K = G*H), several warps share a
row's K (:func:`k_split`), so that no warp runs a long chain of dependent loads.

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
from tvm.script import tirx as T

from . import _streaming
from ._common import gemm_blocks, sm_at_least, static_extent
from ._rule import Rule

#: Largest batch: from 32 on, :mod:`.cuda_sgemm` tiles one step's product (H200, us a step in
#: all, LSTM 2048 at batch 24: 163.9 with dlight's Matmul, which took 17-31 before).
MAX_BATCH = 31
WARPS = 8
#: Warps a block at batch 16 and more where h is not staged (no chunk to share): 64 sums a
#: lane leave room for two blocks of 8 warps a multiprocessor, so a grid of 1.5 such waves
#: loads some twice; 4-warp blocks spread evenly. H200, kernel alone, us, 8 -> 4 warps (N K
#: O): 16 2048 6144 24.0 -> 21.9, 16 1536 6144 17.9 -> 16.1, 16 2048 8192 and 16 2560 7680
#: the same; layers (T = 100, us a step): GRU 2048 at batch 16 35.5 -> 34.0 (TF32 27.6 ->
#: 26.1), LSTM 1536 28.0 -> 25.9, GRU 1536 25.3 -> 23.4, LSTM 2048 41.1 both. At batch 8-12
#: it lost (12 2048 6144 20.7 -> 22.2, 8 1536 6144 12.1 -> 13.2, 8 1024 4096 8.0 -> 8.8).
UNSTAGED_WARPS, UNSTAGED_WARPS_MIN_BATCH = 4, 16
#: Most rows a warp, and most partial sums (RW*N) a lane holds in registers.
MAX_ROWS_PER_WARP, MAX_SUMS = 8, 64
#: Fewest blocks the grid should have (about one a multiprocessor of an H100/H200, which
#: holds two): fewer rows a warp where more would leave the grid smaller.
TARGET_BLOCKS = 128
#: Chunks of K a warp takes where the grid is small, past which K is split among warps, and
#: the most it then takes (:func:`k_split`).
SPLIT_MIN_CHUNKS, MAX_WARP_CHUNKS = 16, 8
#: Bytes of h past which a block stages its chunks in shared memory (module docstring).
SHARED_H_MIN_BYTES = 128 * 1024

#: Each lane's 16 bytes of the weights loaded past L1 (``ld.global.nc.L1::no_allocate``) where
#: h is at least STREAM_MIN_H_BYTES and W at least STREAM_MIN_W_BYTES (K a multiple of 128):
#: W is read once a step, and through L1 it evicted h, which every warp reads. H200, IEEE
#: float32, kernel alone, us, through L1 -> past it (N K O): 16 2048 8192 35.3 -> 25.3; 16 2048
#: 6144 29.6 -> 24.1; 8 2048 8192 27.2 -> 25.2; 24 2048 8192 58.5 -> 55.2. In the layer (T =
#: 100, us a step, old and new modules alternated in one process) LSTM 2048 at batch 16 44.4 ->
#: 41.0 and at 12 36.0 -> 35.2, GRU 2048 at 16 35.5 both; but LSTM 2048 at batch 8 37.1 -> 38.9
#: and LSTM 1536 at 16 28.0 -> 29.6, hence the thresholds.
STREAM_MIN_H_BYTES, STREAM_MIN_W_BYTES = 96 * 1024, 48 << 20
#: TF32 products at batch 16 and less whose weights are at least TF32_MIN_W_BYTES (K a multiple
#: of 128, O at least K: the forward's; the backward's dh, O = H < K = G*H, is not measured) are
#: streamed: on tensor cores by cuda.mma_stream_gemv at batch 8-16 where h fits its shared
#: memory (K up to 3584), else by this rule in IEEE float32 (cuda.mma_gemm and cuda.mma_gemv
#: decline them, :func:`takes_tf32`): it streams W faster than they do. H200, kernel alone, us, TF32
#: (cuda.mma_gemv) against this rule (N K O): 16 2048 8192 39.1 against 25.3; 16 2048 6144 29.3
#: against 24.0; but 16 1024 4096 7.8 against 12.6, 24 2048 8192 53.9 against 55.2 (W of
#: 16-48 MiB not measured: left to the tensor cores).
TF32_MIN_W_BYTES, TF32_MAX_BATCH = 48 << 20, 16
#: W larger than L2 is loaded with :mod:`._streaming`'s L2 policy (30 MiB of it kept from step to
#: step), past L1 where it is streamed, else through it where a warp has at most
#: L2_POLICY_ROWS_PER_WARP rows (at RW = 8, batch 8, the device function's loads lost as the loads
#: past L1 did, above). H200, IEEE float32, T = 100, us a step, plain -> policy (cuDNN): LSTM 2048
#: at batch 1 20.41 -> 15.82 (27.91), at 4 25.01 -> 21.19 (36.52), at 16 (streamed) 40.92 -> 39.24,
#: at 8 36.23 -> 38.83; GRU 2048 at 16 33.54 -> 32.99; LSTM 4096 at 1 68.54 -> 65.81, at 4 83.26 ->
#: 78.33; GRU 4096 at 4 63.31 -> 59.09.
L2_POLICY_ROWS_PER_WARP = 4


def _load_intrin(past_l1: bool, keep: float | None) -> str:
    """The tensor intrinsic (registered on first use) that loads a lane's 4 values of W with
    :func:`._streaming.load`'s device function (past L1 or through it; with the L2 policy that
    keeps the fraction ``keep`` of W, or none)."""
    function, source, extra = _streaming.load(past_l1, keep)
    name = f"rnncc_small_batch_gemv_{function}" + ("" if keep is None else f"_{keep * 1000:.0f}")
    if s_tir.TensorIntrin.get(name, allow_missing=True) is not None:
        return name

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle):
        src = T.match_buffer(a, (4,), "float32", offset_factor=1)
        dst = T.match_buffer(b, (4,), "float32", scope="local", offset_factor=1)
        with T.sblock("root"):
            T.reads(src[0:4])
            T.writes(dst[0:4])
            for i in T.serial(4):
                with T.sblock("load"):
                    v = T.axis.remap("S", [i])
                    dst[v] = src[v]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle):
        src = T.match_buffer(a, (4,), "float32", offset_factor=1)
        dst = T.match_buffer(b, (4,), "float32", scope="local", offset_factor=1)
        with T.sblock("root"):
            T.reads(src[0:4])
            T.writes(dst[0:4])
            T.evaluate(T.cuda.func_call(function, dst.access_ptr("w"), src.access_ptr("r"),
                                        *extra, source_code=source))

    s_tir.TensorIntrin.register(name, desc, impl)
    return name


def takes_tf32(batch: int, depth: int, rows: int) -> bool:
    """Whether a TF32 product h [N, K] x W [O, K] is streamed (cuda.mma_stream_gemv, else this
    rule), not left to the tensor-core rules that stage h a chunk at a time
    (N ``batch``, K ``depth``, O ``rows``): see :data:`TF32_MIN_W_BYTES`. H200, TF32 layers,
    T = 100, us a step, tensor-core products -> this rule (cuDNN in TF32): LSTM 2048 at batch
    16 48.1 -> 30.4 (33.3), at batch 12 52.4 -> 27.1 (33.2); LSTM 2048 with C = 1024 at batch
    9 73.0 -> 31.5 (32.1); GRU 2560 at 16 44.7 -> 38.0 (30.2); GRU 2048 at 16 27.6 both."""
    return (batch <= TF32_MAX_BATCH and depth % 128 == 0 and rows >= depth
            and rows * depth * 4 >= TF32_MIN_W_BYTES)


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


#: Warps a block may take where O has no factor of :data:`WARPS` (G*H with H odd), the most
#: first, where one warp a block (32 threads, each block staging all of h) was the rule before.
#: H200, us a step, T 100, one warp a block -> these (cuDNN): float32 LSTM 4029 at batch 17
#: 610.7 -> 248.2 (282.0; 2 rows, 6 warps), LSTM 3001 at 4 79.6 -> 64.7 (77.1; 2 rows, 2
#: warps), GRU 2731 at 8 73.0 -> 71.3 (76.1; 1 row, 3 warps).
UNEVEN_WARPS = (7, 6, 5, 4, 3, 2)


def uneven_rows(batch: int, rows: int) -> tuple[int, int]:
    """(RW, warps a block) where O = ``rows`` has no factor of :data:`WARPS`: the most rows a
    warp (as :func:`rows_per_warp` caps them) for which one of :data:`UNEVEN_WARPS` divides
    the rows into at least :data:`TARGET_BLOCKS` blocks, else one row a warp and the most
    warps that divide them (1: none)."""
    rw = 1
    while rw * 2 <= min(batch, MAX_SUMS // batch, MAX_ROWS_PER_WARP):
        rw *= 2
    for r in (1 << i for i in range(rw.bit_length() - 1, -1, -1)):
        for w in UNEVEN_WARPS:
            if rows % (w * r) == 0 and rows // (w * r) >= TARGET_BLOCKS:
                return r, w
    return 1, next((w for w in UNEVEN_WARPS if rows % w == 0), 1)


def k_split(rows: int, depth: int, rw: int, vec: int) -> int:
    """S, the warps that share a row's K (each its own chunks, their sums added across them
    as the lanes' are), where the grid at one warp a row group is at most about one block a
    multiprocessor (:data:`TARGET_BLOCKS`) and a warp would take more than
    :data:`SPLIT_MIN_CHUNKS` chunks of K: the fewest warps to a block's row group, up to
    :data:`WARPS`, that bring a warp's chunks to :data:`MAX_WARP_CHUNKS` (1: none; h is not
    staged then, :func:`apply`). The backward's dh = dGH W_hh (O = H rows, K = G*H) was
    latency-bound so. H200, kernel alone, us, S = 1 -> split (N K O): 4 4096 1024 11.5 -> 5.5
    (S = 4), 8 4096 1024 13.2 -> 8.2, 4 3072 1024 9.1 -> 4.7, 1 4096 1024 4.1 -> 3.6, 4 8192
    2048 29.0 -> 17.1; but 16 4096 1024 (h staged) 17.9 -> 25.0, and 1 2048 512 (16 chunks)
    3.2 -> 3.8."""
    chunks, split = -(-depth // (32 * vec)), 1
    if rows // (WARPS * rw) > TARGET_BLOCKS or chunks <= SPLIT_MIN_CHUNKS:
        return 1
    while (split < WARPS and -(-chunks // split) > MAX_WARP_CHUNKS
           and rows % (WARPS // (2 * split) * rw) == 0):
        split *= 2
    return split


def apply(func, target, rw: int | None = None, split: int | None = None):
    """The rule; ``rw`` and ``split`` fix the rows a warp and the warps a row's K (benchmarks),
    else :func:`rows_per_warp` and :func:`k_split`."""
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
    given = rw is not None
    rw = rw or rows_per_warp(batch, rows)
    h_bytes = batch * depth * tvm.DataType(str(func.params[0].ty.dtype)).bits // 8
    staged = h_bytes > SHARED_H_MIN_BYTES
    small = not staged and batch >= UNSTAGED_WARPS_MIN_BATCH
    warps = next((w for w in ((UNSTAGED_WARPS, WARPS) if small else (WARPS,))
                  if rows % (w * rw) == 0), 1)
    if warps == 1 and not given:  # O without a factor of 8 (odd H): another count of warps
        rw, warps = uneven_rows(batch, rows)
    if rows % (warps * rw):
        return None
    split = split or (k_split(rows, depth, rw, vec) if warps == WARPS and not staged else 1)
    warps //= split  # warps a block along O; each of them ``split`` warps along K
    k_outer, lane, v = sch.split(k, [None, 32 * split, vec])
    rf = sch.rfactor(lane, factor_axis=0)
    n_rf, o_rf, ko_rf, lane_rf, v_rf = sch.get_loops(rf)
    o_b, o_t, *o_r = sch.split(o_rf, [None, warps, rw] if rw > 1 else [None, warps])
    sch.reorder(o_b, o_t, lane_rf, ko_rf, n_rf, *o_r, v_rf)
    sch.bind(o_b, "blockIdx.x")
    sch.bind(o_t, "threadIdx.y")
    sch.bind(lane_rf, "threadIdx.x")
    weights_dtype = str(func.params[1].ty.dtype)
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
                                             [None, warps, 32 * split, vec])
            sch.bind(warp, "threadIdx.y")
            sch.bind(thread, "threadIdx.x")
            if vec > 1:
                sch.vectorize(v_s)
    # (tensorize takes no block under a mask: where K is not a multiple of 128, plain loads;
    # the load's L1 eviction hint is sm_70's)
    whole = vec > 1 and weights_dtype == "float32" and depth % (32 * vec) == 0
    streamed = (whole and h_bytes >= STREAM_MIN_H_BYTES and rows * depth * 4 >= STREAM_MIN_W_BYTES
                and sm_at_least(target, 70))
    keep = _streaming.keep_fraction(rows * depth * 4, target)
    if not streamed and rw > L2_POLICY_ROWS_PER_WARP:
        keep = None
    load = _load_intrin(streamed, keep) if streamed or (whole and keep is not None) else None
    if vec > 1:
        if load is None:
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
    if load is not None:
        sch.tensorize(sch.get_loops(w_local)[-1], load)
    return sch


RULE = Rule("cuda.small_batch_gemv", apply)
