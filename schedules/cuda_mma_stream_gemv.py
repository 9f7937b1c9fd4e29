"""CUDA: one step's recurrent projection in TF32 at batch 8-16 whose weights stream from
memory every step (48 MiB and more): tensor cores, h staged once, W read well ahead past L1.

out[n, o] = sum_k h[n, k] * W[o, k] + b[o], float32 storage, the products in TF32 (h and W
rounded as they are read, unless the component's callers rounded them,
:data:`._mma.TF32_ROUNDED_ATTR`), float32 sums. ``mma.sync`` m16n8k8: the batch is the
instruction's M (one tile, rows past N zero), 8 output rows of W its N, 8 k a step, in
:mod:`._mma`'s order of k (a lane's 16 bytes of a row, 4 values, feed two k-steps).

A block of :data:`K_SPLIT` x :data:`WARPS` warps (more where O in blocks of their rows would
take a second wave: :data:`MAX_BLOCKS`) stages all of h [16, K] in dynamic shared memory once
(rows padded to 64 bytes past a multiple of 128: a phase's 16-byte reads of rows g and g + 1
hit the 32 banks once); warp w of part s owns 8 output rows and multiplies them by part s of
K, lane (g, q) reading 16 bytes of row g a block of 16 k, past L1 (:mod:`._streaming`: past
40 MiB with the L2 policy that keeps 30 MiB of W from step to step), :data:`AHEAD` blocks
ahead of its products (fewer with more warps). No barrier after the staging; at the end the
other parts' sums reach part 0's warps through the staged h's memory.

Where cuda.mma_gemv stages h a chunk of K at a time between two barriers (its W one iteration
ahead), and cuda.small_batch_gemv (IEEE) reads h through L1 for every few rows, this streams W
at 2.8-3.4 TB/s whatever N. H200, kernel alone (``benchmarks/step_product_variants.cu``), us,
this / cuda.small_batch_gemv, N K O: 16 2048 6144 21.6 / 23.4; 16 2048 8192 24.3 / 27.1; 12
2048 8192 24.2 / 27.7; 9 2048 8192 24.1 / 29.9; 16 1536 6144 16.0 / 18.7; 16 2560 7680 27.3 /
31.7 (cuda.mma_gemv: 16 2048 6144 29.3, 16 2048 8192 39.1; 4 warps a block, or two tiles of 8
rows a warp, or 4 blocks ahead: 1.1-1.8x slower).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import s_tir
from tvm.script import tirx as T

from . import _mma, _streaming, cuda_small_batch_gemv
from ._common import LAUNCH_BOUNDS, has_wgmma, step_product
from ._rule import Rule

#: Warps a block along its rows (each 8 output rows) and blocks of 16 k a lane's W is loaded
#: ahead, where O in blocks of 8 * WARPS rows takes at most MAX_BLOCKS; k a block of two
#: k-steps.
WARPS, AHEAD, BLOCK_K = 8, 8, 16
#: Blocks a wave: one a multiprocessor of an H100/H200 SXM (132). Where O in blocks of 8 *
#: WARPS rows would take a second wave (GRU 3584 at batch 16, 168 blocks, 98.02 us a step
#: against cuDNN's 51.94), a block takes more warps (up to MAX_WARPS a part of K; those whose
#: rows divide O, the fewest waves times warps, each wave's time being its blocks' rows), each
#: fewer blocks ahead: a multiprocessor keeps IN_FLIGHT of its warps' blocks of W in flight,
#: as 16 warps 8 ahead do.
MAX_BLOCKS, MAX_WARPS, IN_FLIGHT = 132, 16, 128
#: Parts of K a block's warps split (K_SPLIT * WARPS warps, each part's sums
#: added through shared memory at the end): the loads of W in flight a multiprocessor bound
#: this kernel (one block a multiprocessor, its h filling shared memory; 8 warps of 32 lanes,
#: each lane AHEAD 16-byte loads ahead: 32 KiB, about 3 TB/s at HBM's latency). Two parts,
#: H200, TF32 layers, T = 100, us a step: GRU 2048 at batch 16 22.58 -> 17.48 (cuDNN 21.38),
#: LSTM 2048 25.18 -> 20.65 (33.97), GRU 2560 30.53 -> 25.95 (30.20). Four would take 1024
#: threads of at most 64 registers: W's loads ahead would not fit.
K_SPLIT = 2
#: Fewest and most batch rows (one tile of M): its time hardly depends on N. H200, TF32
#: layers, T = 100, us a step, cuda.small_batch_gemv -> this with K in two parts (cuDNN): LSTM
#: 2048 at batch 8 29.71 -> 18.78 (32.51), at 12 24.70 -> 19.72 (32.88), GRU 2048 at 12 22.52
#: -> 16.69 (19.99); but LSTM 2048 at batch 4 18.01 -> 17.95, at 1 14.92 -> 16.70 (one part of
#: K, batch 16 only, it had taken LSTM 2048 at 16 30.58 -> 28.41 and lost at 12, 27.05 ->
#: 28.10). The deepest K whose h [16, K] fits in a block's shared memory (227 KiB on sm_90).
MIN_BATCH, MAX_BATCH, MAX_DEPTH = 8, 16, 3584


@dataclass(frozen=True)
class Plan:
    """N batch rows, K deep, O outputs; ``rounded``: the operands ("a", "b") rounded to TF32
    already."""

    batch: int
    depth: int
    outputs: int
    rounded: str = ""
    #: the fraction of W an L2 policy keeps resident from step to step (:mod:`._streaming`), or
    #: None (plain loads past L1)
    keep: float | None = None
    #: parts of K, each ``warps`` warps of a block
    k_split: int = 1
    #: warps a part, each 8 output rows
    warps: int = WARPS
    #: blocks of 16 k a lane's W is loaded ahead
    ahead: int = AHEAD

    @property
    def rows(self) -> int:
        """Output rows a block."""
        return 8 * self.warps

    @property
    def stride(self) -> int:
        """Floats from one staged row of h to the next: 64 bytes past a multiple of 128."""
        return self.depth + (16 - self.depth) % 32


def plan(batch: int, depth: int, outputs: int, rounded: str = "") -> Plan | None:
    """The plan for a TF32 product h [N, K] x W [O, K], or None where this rule does not take
    it: batch 8-16 with weights the IEEE rule would stream (:func:`.cuda_small_batch_gemv.
    takes_tf32`: 48 MiB and more, K a multiple of 128, O at least K), K at most
    :data:`MAX_DEPTH`, O a multiple of a block's rows (see :data:`MAX_BLOCKS`); K in
    :data:`K_SPLIT` parts."""
    if not (MIN_BATCH <= batch <= MAX_BATCH and depth <= MAX_DEPTH
            and cuda_small_batch_gemv.takes_tf32(batch, depth, outputs)):
        return None
    warps = min((w for w in range(WARPS, MAX_WARPS + 1) if outputs % (8 * w) == 0),
                key=lambda w: -(-outputs // (8 * w) // MAX_BLOCKS) * w, default=None)
    if warps is None:
        return None
    blocks = depth // BLOCK_K // K_SPLIT  # a part's blocks of 16 k: a multiple of 4
    ahead = max(a for a in range(1, min(AHEAD, IN_FLIGHT // (K_SPLIT * warps)) + 1)
                if blocks % a == 0)
    return Plan(batch, depth, outputs, rounded, k_split=K_SPLIT, warps=warps, ahead=ahead)


def kernel(p: Plan):
    """The PrimFunc, with the gemm component's parameters (a, w, b, gemm_bias)."""
    n_, k_, o_, stride = p.batch, p.depth, p.outputs, p.stride
    threads, groups = p.k_split * p.warps * 32, p.depth // (BLOCK_K * p.ahead * p.k_split)
    part, ahead = p.warps * 32, p.ahead  # threads a part of K; blocks of 16 k ahead
    op = _mma.TF32
    load, source, extra = _streaming.load(True, p.keep)

    def rounded_a(value):
        return value if "a" in p.rounded else op.round(value)

    def rounded_w(value):
        return value if "b" in p.rounded else op.round(value)

    @T.macro
    def stage(a, hs, tx):
        """All of h into shared memory (TF32), rows N..15 zeros."""
        for e in T.serial(-(-(16 * k_ // 4) // threads)):
            if (e * threads + tx) * 4 < 16 * k_:
                for v in T.vectorized(4):
                    hs[(e * threads + tx) * 4 // k_ * stride + (e * threads + tx) * 4 % k_ + v] = (
                        T.if_then_else((e * threads + tx) * 4 // k_ < n_, rounded_a(a[T.min(
                            (e * threads + tx) * 4 // k_, n_ - 1), (e * threads + tx) * 4 % k_
                            + v]), T.float32(0)))

    @T.macro
    def load_w(w, wf, group, row, q):
        """The lane's 16 bytes of row ``row`` of each of the blocks ahead in ``group``."""
        for d in T.unroll(ahead):
            T.evaluate(T.cuda.func_call(
                load, T.address_of(wf[d * 4]),
                T.address_of(w[row, (group * ahead + d) * BLOCK_K + q * 4]), *extra,
                source_code=source))

    @T.macro
    def products(hs, acc, wf, hab, af, wb, group, g, q):
        """The blocks ahead in ``group``: two k-steps each."""
        for d in T.unroll(ahead):
            for r in T.unroll(2):  # batch rows g, g + 8
                for v in T.vectorized(4):
                    hab[r * 4 + v] = hs[(r * 8 + g) * stride + (group * ahead + d) * BLOCK_K
                                        + q * 4 + v]
            for s in T.unroll(2):
                _mma.a_fragment(op, af, hab, s)
                for v in T.unroll(2):
                    wb[v] = rounded_w(wf[d * 4 + s * 2 + v])
                _mma.mma(op, af, wb, acc, 0)

    @T.prim_func(s_tir=True)
    def mma_stream_gemv(a: T.Buffer((n_, k_), "float32"), w: T.Buffer((o_, k_), "float32"),
                        b: T.Buffer((o_,), "float32"),
                        gemm_bias: T.Buffer((n_, o_), "float32")):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            hs = T.sblock_alloc_buffer((16 * stride,), "float32", scope="shared.dyn")
            acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
            cur = T.sblock_alloc_buffer((ahead * 4,), "float32", scope="local")
            nxt = T.sblock_alloc_buffer((ahead * 4,), "float32", scope="local")
            hab = T.sblock_alloc_buffer((8,), "float32", scope="local")
            af = T.sblock_alloc_buffer((4,), "float32", scope="local")
            wb = T.sblock_alloc_buffer((2,), "float32", scope="local")
            for bx in T.thread_binding(o_ // p.rows, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    T.attr(0, LAUNCH_BOUNDS, 1)  # (one a multiprocessor: ptxas keeps W's loads
                    # ahead in registers; with 512 threads and no bound it took 38 and did not)
                    g, q = T.meta_var((tx % 32 // 4, tx % 4))
                    col0 = T.meta_var(bx * p.rows + tx % part // 32 * 8)
                    first = T.meta_var(tx // part * groups)  # the warp's part of K
                    for i in T.unroll(4):
                        acc[i] = T.float32(0)
                    load_w(w, cur, first, col0 + g, q)
                    stage(a, hs, tx)
                    T.tvm_storage_sync("shared")
                    for group in T.serial(groups):
                        if group + 1 < groups:
                            load_w(w, nxt, first + group + 1, col0 + g, q)
                        products(hs, acc, cur, hab, af, wb, first + group, g, q)
                        for i in T.unroll(ahead * 4):
                            cur[i] = nxt[i]
                    if p.k_split > 1:  # the other parts' sums to the first part's warps,
                        T.tvm_storage_sync("shared")  # through h's memory once all have read it
                        if tx >= part:
                            for i in T.unroll(4):
                                hs[(tx % part * (p.k_split - 1) + tx // part - 1) * 4 + i] = (
                                    acc[i])
                        T.tvm_storage_sync("shared")
                    if tx < part:
                        if p.k_split > 1:
                            for s in T.unroll(p.k_split - 1):
                                for i in T.unroll(4):
                                    acc[i] = acc[i] + hs[(tx * (p.k_split - 1) + s) * 4 + i]
                        for h in T.unroll(2):  # batch rows g, g + 8; output rows 2q + {0, 1}
                            if h * 8 + g < n_:
                                for v in T.unroll(2):
                                    gemm_bias[h * 8 + g, col0 + q * 2 + v] = (
                                        acc[h * 2 + v] + b[col0 + q * 2 + v])

    return mma_stream_gemv


def apply(func, target):
    product = step_product(func)
    if product is None:
        return None  # one step's product [N, K] x [O, K] only
    a_dtype, w_dtype, batch, outputs, depth = product
    op = _mma.operand(w_dtype, func)
    if op is None or not op.tf32 or a_dtype != "float32" or not has_wgmma(target):
        return None  # TF32 only; Hopper's 227 KiB of shared memory a block (measured there)
    found = plan(batch, depth, outputs, _mma.rounded(func))
    if found is None:
        return None
    keep = _streaming.keep_fraction(outputs * depth * 4, target)
    return s_tir.Schedule(kernel(replace(found, keep=keep)))


RULE = Rule("cuda.mma_stream_gemv", apply)
