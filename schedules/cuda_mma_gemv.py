"""CUDA: one step's recurrent projection with float16 or bfloat16 weights, on tensor cores.

out[n, o] = sum_k h[n, k] * W[o, k] + b[o], W and b float16 (or bfloat16), h float32 or the
weights' type [N, K], out float32. h is rounded to the weights' type for the product (as
cuDNN's half-precision RNNs and rnncc's persistent kernel keep it); the sums are float32.
``mma.sync`` m16n8k16: the batch is the instruction's M (MT = ceil(N/16) tiles, rows past N
zero), 8 output rows of W its N, 16 k a step.

A block of W warps (:data:`WARPS`) owns W / S * NT * 8 output rows (NT n-tiles a warp, S warps
a column group). K goes through shared memory in chunks of KC: the block stages h[:, chunk]
there in 16 bits, row-major with rows padded by 16 bytes (a warp's 16-byte reads then hit every
bank group), and each warp multiplies its 1/S of the chunk by its rows of W, read straight from
global memory (L2: a step's weights, read once a step, fit there up to 4096 hidden units of an
LSTM in 16 bits); a group's first warp adds the others' sums at the end. S > 1 where O alone
gives few blocks: training's dh = dG W_hh (O = H, K = G*H; LSTM 1024 bfloat16 at batch 64: 55
us a step with S = 1 and 4 warps a block, H100).

Fragments. Any permutation of k that A and B share leaves the sums unchanged; this one lets a
lane take 16 contiguous bytes of W and of each of its two rows of h for two k-steps of 16: of
32 k from k0, lane l (q = l % 4, g = l // 4) reads W[row g][k0 + 8q .. +8] and h[g], h[g+8] at
the same k; k-step s uses the elements 4s .. 4s+3 of each, which the instruction takes as its
k = 2q + {0, 1} (elements 4s, 4s+1) and 8 + 2q + {0, 1} (4s+2, 4s+3). The sums land as the
instruction leaves them: lane l holds batch rows g and g + 8 of output rows 2q + {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ._common import gemm_blocks, has_mma, static_extent, weights_are_rows
from ._rule import Rule
from .cuda_mma_gemm import HALF

#: Warps a block: 8, else 4 where no plan of 8 fits (few outputs and a shallow K).
WARPS = (8, 4)
#: Fewest and most batch rows: below, a persistent plan or cuda.small_batch_gemv; the sums of
#: MT * NT tiles a lane (4 each, at most :data:`MAX_SUMS`) stay in registers.
MIN_BATCH, MAX_BATCH, MAX_SUMS = 9, 256, 64
#: Fewest blocks the grid should have (about one a multiprocessor): NT = 2 where O gives that
#: many without splitting K, else the fewest warps sharing a block's columns that give them.
TARGET_BLOCKS = 128
#: Static shared memory of a block: the staged chunk of h and the split sums.
SMEM_BYTES = 48 * 1024
PAD = 8  # halves after each staged row of h


@dataclass(frozen=True)
class Plan:
    """N batch rows, K deep, O outputs, h's dtype; NT n-tiles a warp, KC k a chunk; the
    weights' type; S warps that share a block's columns, each a 1/S of every chunk's K."""

    batch: int
    depth: int
    outputs: int
    a_dtype: str
    n_tiles: int
    chunk: int
    half: str = "float16"
    k_split: int = 1
    warps: int = WARPS[0]

    @property
    def m_tiles(self) -> int:
        return -(-self.batch // 16)

    @property
    def columns(self) -> int:
        """Output rows of W a block."""
        return self.warps // self.k_split * self.n_tiles * 8

    @property
    def stride(self) -> int:
        """Halves from one staged row of h to the next."""
        return self.chunk + PAD

    @property
    def sums(self) -> int:
        """Sums a lane holds."""
        return self.m_tiles * self.n_tiles * 4

    def split_bytes(self) -> int:
        """Shared memory for the partial sums of the warps past the first of each column
        group."""
        return (self.warps - self.warps // self.k_split) * 32 * self.sums * 4


def plan(batch: int, depth: int, outputs: int, a_dtype: str, half: str = "float16"
         ) -> Plan | None:
    """The plan for a product, or None where this rule does not take it (see the limits).

    A step's projection with few outputs (dh = dG W_hh in training: O = H, K = G*H) leaves
    few blocks of 8 columns a warp; there S warps share a block's columns and split each
    chunk's K, their sums added through shared memory at the end (S the fewest for
    :data:`TARGET_BLOCKS` blocks whose chunk and sums fit, else the most that fit)."""
    if not MIN_BATCH <= batch <= MAX_BATCH or depth % 32 or outputs % 8:
        return None
    rows = -(-batch // 16) * 16
    for warps in WARPS:
        n_tiles = 2 if (outputs % (warps * 16) == 0 and outputs // (warps * 16) >= TARGET_BLOCKS
                        and rows // 16 * 2 * 4 <= MAX_SUMS) else 1
        splits = [s for s in (1, 2, 4, 8)
                  if s <= warps and outputs % (warps // s * n_tiles * 8) == 0]
        enough = [s for s in splits if outputs // (warps // s * n_tiles * 8) >= TARGET_BLOCKS]
        order = enough[:1] + sorted(set(splits) - set(enough[:1]), reverse=True)
        for k_split in order:
            trial = Plan(batch, depth, outputs, a_dtype, n_tiles, 32, half, k_split, warps)
            chunk = next((c for c in (256, 128, 64, 32)
                          if depth % c == 0 and c % (32 * k_split) == 0
                          and rows * (c + PAD) * 2 + trial.split_bytes() <= SMEM_BYTES), None)
            if chunk is not None:
                return replace(trial, chunk=chunk)
    return None


def kernel(p: Plan):
    """The PrimFunc, with the gemm component's parameters (a, w, b, gemm_bias)."""
    n_, k_, o_, mt, nt, kc = p.batch, p.depth, p.outputs, p.m_tiles, p.n_tiles, p.chunk
    threads, rows, stride = p.warps * 32, mt * 16, p.stride
    ks_, groups, sums = p.k_split, p.warps // p.k_split, p.sums

    @T.macro
    def zero_padding(hs, tx):
        """Once: the staged rows past N are zeros (the staging never writes them)."""
        for e in T.serial((rows - n_) * kc // threads + 1):
            if e * threads + tx < (rows - n_) * kc:
                hs[(n_ + (e * threads + tx) // kc) * stride + (e * threads + tx) % kc] = (
                    tirx.const(0, p.half))

    @T.macro
    def stage(a, hs, c, tx):
        """h[:N, chunk c] into shared memory, in the weights' type."""
        for e in T.serial(-(-(n_ * kc // 4) // threads)):
            if (e * threads + tx) * 4 < n_ * kc:
                for v in T.vectorized(4):
                    hs[(e * threads + tx) * 4 // kc * stride + (e * threads + tx) * 4 % kc + v] = (
                        T.Cast(p.half, a[(e * threads + tx) * 4 // kc,
                                         c * kc + (e * threads + tx) * 4 % kc + v]))

    @T.macro
    def products(w, hs, acc, frags, c, col0, part, lane):
        """The warp's products of its part of chunk c: 32 k an iteration, two k-steps."""
        wf, ha, hb, af, wb = T.meta_var(frags)
        g, q = T.meta_var((lane // 4, lane % 4))
        for kk in T.unroll(kc // ks_ // 32):
            k0 = T.meta_var(part * (kc // ks_) + kk * 32 + q * 8)
            for j in T.unroll(nt):
                for v in T.vectorized(8):
                    wf[j * 8 + v] = w[col0 + j * 8 + g, c * kc + k0 + v]
            for m in T.unroll(mt):
                for v in T.vectorized(8):
                    ha[v] = hs[(m * 16 + g) * stride + k0 + v]
                for v in T.vectorized(8):
                    hb[v] = hs[(m * 16 + 8 + g) * stride + k0 + v]
                for s in T.unroll(2):
                    for v in T.vectorized(2):
                        af[v] = ha[s * 4 + v]
                    for v in T.vectorized(2):
                        af[2 + v] = hb[s * 4 + v]
                    for v in T.vectorized(2):
                        af[4 + v] = ha[s * 4 + 2 + v]
                    for v in T.vectorized(2):
                        af[6 + v] = hb[s * 4 + 2 + v]
                    for j in T.unroll(nt):
                        for v in T.vectorized(4):
                            wb[v] = wf[j * 8 + s * 4 + v]
                        T.evaluate(T.ptx_legacy.mma(
                            "m16n8k16", "row", "col", HALF[p.half], HALF[p.half], "fp32",
                            af.data, 0, wb.data, 0, acc.data, (m * nt + j) * 4, False,
                            dtype="float32"))

    @T.macro
    def add_parts(acc, split, group, part, lane):
        """The column group's first warp adds the other warps' sums (via shared memory, one
        word a lane a sum: no bank conflicts)."""
        if part > 0:
            for e in T.unroll(sums):
                split[(((part - 1) * groups + group) * sums + e) * 32 + lane] = acc[e]
        T.tvm_storage_sync("shared")
        if part == 0:
            for z in T.unroll(1, ks_):
                for e in T.unroll(sums):
                    acc[e] = acc[e] + split[(((z - 1) * groups + group) * sums + e) * 32 + lane]

    @T.macro
    def store(b, out, acc, col0, lane):
        """Lane l's sums: batch rows g and g + 8 of each m-tile, output rows 2q + {0, 1} of
        each n-tile, plus the bias."""
        g, q = T.meta_var((lane // 4, lane % 4))
        for m in T.unroll(mt):
            for j in T.unroll(nt):
                for h in T.unroll(2):
                    if m * 16 + h * 8 + g < n_:
                        for v in T.unroll(2):
                            out[m * 16 + h * 8 + g, col0 + j * 8 + q * 2 + v] = (
                                acc[(m * nt + j) * 4 + h * 2 + v]
                                + T.Cast("float32", b[col0 + j * 8 + q * 2 + v]))

    @T.prim_func(s_tir=True)
    def mma_gemv(a: T.Buffer((n_, k_), p.a_dtype), w: T.Buffer((o_, k_), p.half),
                 b: T.Buffer((o_,), p.half), gemm_bias: T.Buffer((n_, o_), "float32")):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            hs = T.sblock_alloc_buffer((rows * stride,), p.half, scope="shared")
            split = T.sblock_alloc_buffer((max(1, p.split_bytes() // 4),), "float32",
                                          scope="shared")
            acc = T.sblock_alloc_buffer((sums,), "float32", scope="local")
            wf = T.sblock_alloc_buffer((nt * 8,), p.half, scope="local")
            ha = T.sblock_alloc_buffer((8,), p.half, scope="local")
            hb = T.sblock_alloc_buffer((8,), p.half, scope="local")
            af = T.sblock_alloc_buffer((8,), p.half, scope="local")
            wb = T.sblock_alloc_buffer((4,), p.half, scope="local")
            for bx in T.thread_binding(o_ // p.columns, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    group, part = T.meta_var((tx // 32 // ks_, tx // 32 % ks_))
                    col0 = T.meta_var(bx * p.columns + group * nt * 8)
                    for i in T.unroll(sums):
                        acc[i] = T.float32(0)
                    if rows > n_:
                        zero_padding(hs, tx)
                    for c in T.serial(k_ // kc):
                        stage(a, hs, c, tx)
                        T.tvm_storage_sync("shared")
                        products(w, hs, acc, (wf, ha, hb, af, wb), c, col0, part, tx % 32)
                        T.tvm_storage_sync("shared")
                    if ks_ > 1:
                        add_parts(acc, split, group, part, tx % 32)
                    if part == 0:
                        store(b, gemm_bias, acc, col0, tx % 32)

    return mma_gemv


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None or len(sch.get_loops(blocks[0])) != 3:
        return None  # one step's product [N, K] x [O, K] only
    a_dtype, w_dtype = (str(r.source.dtype) for r in sch.get(blocks[0]).reads[:2])
    if w_dtype not in HALF or a_dtype not in (w_dtype, "float32"):
        return None
    if not weights_are_rows(sch, blocks[0]):
        return None
    if not has_mma(target):
        return None
    batch, outputs, depth = (static_extent(sch, x) for x in sch.get_loops(blocks[0]))
    if None in (batch, outputs, depth):
        return None
    found = plan(batch, depth, outputs, a_dtype, w_dtype)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.mma_gemv", apply)
