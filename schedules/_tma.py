"""The TMA engine (Hopper's tensor memory accelerator) as the feed of a warpgroup-MMA product
(:mod:`.cuda_wgmma_gemm`): the stages of a kernel in which one thread copies every chunk of
both operands and the warpgroups only multiply.

Each operand has a tensor map: its rows of K elements as a 2-D tensor, encoded on the host as
the kernel is launched (a ``__grid_constant__`` parameter), a box of ``bk`` (128 bytes) by the
tile's rows, copied into shared memory in the 128-byte swizzle the matrix descriptors name,
rows past the tensor's read as zeros. The producer (the first thread of a warp after the
warpgroups) copies chunk c of both operands into stage c % S with ``cp.async.bulk.tensor``;
the consumers wait for it, multiply, and give the stage back. In a cluster of two blocks (the
two row tiles of one step's product, which read the same columns of the weights) each block
copies half of the weights' tile and multicasts it into both, a third less read from L2. A
tile of B whose rows are gates' (one fused step: :attr:`.cuda_wgmma_gemm.Plan.unit`) is
copied a box a gate (or half a gate).

Two mbarriers a stage. ``full[s]`` (one arrival, the producer's, with the stage's bytes as its
transaction count) completes once both tiles have landed. ``empty[s]`` completes once every
warpgroup of every block of the cluster (each writes into the others' stages) has finished the
products that read the stage: one thread of each arrives once its warpgroup has waited for all
but its last group of products. Chunk c is the (c // S)-th use of its stage: the consumers
wait for ``full`` phase parity c // S % 2, the producer (c >= S) for the ``empty`` phase of
chunk c - S, parity (c // S - 1) % 2. A block's barriers are initialised, fenced and the
cluster synchronised before any copy; the cluster synchronises again before a block exits
(a peer may still arrive on its barriers).
"""

from __future__ import annotations

from tvm.script import tirx as T

#: CU_TENSOR_MAP_SWIZZLE_128B, and the L2 promotion of 128 bytes
SWIZZLE, L2_PROMOTION = 3, 2

LOAD = T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"]
LOAD_MULTICAST = T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global"
                       ".mbarrier::complete_tx::bytes.multicast::cluster"]

WAIT, WAIT_SOURCE = "rnncc_tma_wait", r"""
__device__ __forceinline__ void rnncc_tma_wait(void* bar, int parity) {
  unsigned int addr = (unsigned int)__cvta_generic_to_shared(bar);
  asm volatile("{\n.reg .pred p;\nRNNCC_TMA_WAIT_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra RNNCC_TMA_WAIT_%=;\n}" :: "r"(addr), "r"(parity) : "memory");
}
"""
#: An arrival on the barrier at ``bar``'s offset in block ``cta`` of the cluster (itself too).
#: Not ``.release.cluster``: ptxas makes that a fence of the whole GPU at every arrival (H200,
#: float16 256 x 2048 x 8192 in 2 slices, the kernel alone: 27.2 us with it and TVM's waits
#: with a suspend-time hint, 20.9 without either).
ARRIVE, ARRIVE_SOURCE = "rnncc_tma_arrive", """
__device__ __forceinline__ void rnncc_tma_arrive(void* bar, unsigned int cta) {
  unsigned int local = (unsigned int)__cvta_generic_to_shared(bar);
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}
"""
#: The cluster's blocks wait for each other (no memory order: the barriers' initialisation is
#: fenced for the cluster before it, and nothing else is shared; ``.release`` would be a fence
#: of the whole GPU).
CLUSTER_SYNC, CLUSTER_SYNC_SOURCE = "rnncc_cluster_sync", """
__device__ __forceinline__ void rnncc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
  asm volatile("barrier.cluster.wait;" ::: "memory");
}
"""


def encode(tensor_map, address, depth, rows, box_k, box_rows, dtype, esize):
    """The host's encoding of ``tensor_map``: rows [``rows``, ``depth``] (k contiguous) from
    ``address``, boxes of ``box_k`` x ``box_rows``, 128-byte swizzled."""
    return T.tensormap_encode_tiled(
        tensor_map, address, depth, rows, depth * esize, box_k, box_rows, 1, 1,
        descriptor_dtype=dtype, rank=2, interleave=0, swizzle=SWIZZLE,
        l2_promotion=L2_PROMOTION, oob_fill=0, force_cu_dtype=-1)


@T.macro
def wait(bar, index, parity):
    """Wait for the phase of parity ``parity`` of barrier ``bar[index]``."""
    T.cuda.func_call(WAIT, T.address_of(bar[index]), parity, source_code=WAIT_SOURCE)


@T.macro
def start(p, bar, tx):
    """The block's barriers initialised (full: the producer; empty: every warpgroup of the
    cluster), made visible to the cluster, and the cluster (or block) synchronised."""
    if tx == 0:
        for s in T.unroll(p.stages):
            T.ptx.mbarrier.init.shared.b64(T.address_of(bar[s]), 1)
            T.ptx.mbarrier.init.shared.b64(T.address_of(bar[p.stages + s]),
                                           p.cluster * p.warpgroups)
    T.ptx.fence.mbarrier_init.release.cluster()
    if p.cluster > 1:
        T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)
    else:
        T.tvm_storage_sync("shared")


@T.macro
def finish(p):
    """Where blocks share barriers: none exits before the cluster's arrivals are done."""
    if p.cluster > 1:
        T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)


@T.macro
def produce(p, maps, smem, bar, k0, row0, bj, rank, first):
    """The producer, a tile: its chunk c (k from ``k0``) of A's rows from ``row0`` and of B's
    column tile ``bj`` (its rows as ``p.row_of`` says, boxes of ``p.box`` rows), the block's
    ``first`` + c-th chunk g, into stage g % S once that is free; in a cluster this block's
    part of B (``rank``: its part) multicast into every block of the cluster."""
    for c in range(p.chunks):
        g = T.meta_var(first + c)
        if g >= p.stages:
            wait(bar, p.stages + g % p.stages, (g // p.stages - 1) % 2)
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bar[g % p.stages]),
                                                   p.stage_bytes)
        LOAD(smem.access_ptr("w", offset=p.slot(0, g % p.stages, 0, 0)), T.address_of(maps[0]),
             T.Cast("int32", k0 + c * p.bk), T.Cast("int32", row0),
             T.address_of(bar[g % p.stages]))
        for q in T.unroll(p.b_rows // p.box):
            r = T.meta_var((rank * p.b_rows if p.cluster > 1 else 0) + q * p.box)
            if p.cluster > 1:
                LOAD_MULTICAST(
                    smem.access_ptr("w", offset=p.slot(1, g % p.stages, r, 0)),
                    T.address_of(maps[1]), T.Cast("int32", k0 + c * p.bk),
                    T.Cast("int32", p.row_of(1, bj, r)), T.address_of(bar[g % p.stages]),
                    T.uint16((1 << p.cluster) - 1))
            else:
                LOAD(smem.access_ptr("w", offset=p.slot(1, g % p.stages, r, 0)),
                     T.address_of(maps[1]), T.Cast("int32", k0 + c * p.bk),
                     T.Cast("int32", p.row_of(1, bj, r)), T.address_of(bar[g % p.stages]))


@T.macro
def release(p, bar, c, tx):
    """Chunk ``c``'s stage given back by the thread's warpgroup (its products of it done), in
    every block of the cluster."""
    if tx % 128 == 0:
        for r in T.unroll(p.cluster):
            T.cuda.func_call(ARRIVE, T.address_of(bar[p.stages + c % p.stages]), T.uint32(r),
                             source_code=ARRIVE_SOURCE)
