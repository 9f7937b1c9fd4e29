"""Stage: the recurrent weights W_hh, resident on-chip for the whole sequence (planner: "Work
split", "Streaming").

Lane l of warp w of block b holds, of each of its RW rows, the 16-byte chunks i < KI of W_hh
packed [B/NG, Wn, KI, RW, 32, VEC]: chunks i < KR in registers (``wreg``), the next KS in
shared memory (``wsm``), the last KG (a streaming plan) in global memory, read from L2 every
step. :func:`load` puts them in place once; :func:`each_chunk` runs a product stage's body on
every chunk, with a reader that puts the chunk's row q in ``wv``.
"""

from __future__ import annotations

from functools import partial

from tvm.script import tirx as T


@T.macro
def load(spec, w, wreg, wsm, blk, warp, lane, tx):
    """Registers, then shared memory (the block's threads copy it together)."""
    p = T.meta_var(spec.plan)
    kr, ks, rw, vec = T.meta_var((p.reg_chunks, p.smem_chunks, p.rows_per_warp, p.vec))
    if kr > 0:
        for i in T.unroll(kr):
            for q in T.unroll(rw):
                for v in T.vectorized(vec):
                    wreg[(i * rw + q) * vec + v] = w[blk, warp, i, q, lane, v]
    if ks > 0:
        total, per = T.meta_var((p.warps * ks * rw * 32 * vec, rw * 32 * vec))
        for e in spec.spread(total // vec):
            for v in T.vectorized(vec):
                if (e * p.threads + tx) * vec < total:
                    wsm[(e * p.threads + tx) * vec + v] = w[
                        blk, (e * p.threads + tx) * vec // (ks * per),
                        kr + (e * p.threads + tx) * vec % (ks * per) // per,
                        (e * p.threads + tx) * vec % per // (32 * vec), (e * p.threads + tx) % 32,
                        v]


@T.macro
def from_registers(spec, wv, wreg, i, q):
    p = T.meta_var(spec.plan)
    for v in T.vectorized(p.vec):
        wv[v] = wreg[(i * p.rows_per_warp + q) * p.vec + v]


@T.macro
def from_shared(spec, wv, wsm, so, si, warp, lane, q):
    p = T.meta_var(spec.plan)
    for v in T.vectorized(p.vec):
        wv[v] = wsm[(((warp * p.smem_chunks + so * spec.smem_unroll + si) * p.rows_per_warp + q)
                     * 32 + lane) * p.vec + v]


@T.macro
def streamed(spec, wv, w, gc, blk, warp, lane, q):
    p = T.meta_var(spec.plan)
    for v in T.vectorized(p.vec):
        wv[v] = w[blk, warp, p.reg_chunks + p.smem_chunks + gc, q, lane, v]


def _chunk_index(first, i):
    """Chunk i of the warp's in all of K (``first``: its part's first chunk, None: no split)."""
    return i if first is None else first + i


@T.macro
def slice_chunks(spec, body, wv, wreg, wsm, sl, warp, lane):
    """``body(j, read)`` for the warp's chunks j of slice ``sl`` (a Python int; of its part
    of K; planner: "Slices of K"): those in registers, then those in shared memory."""
    lo, hi, kr = T.meta_var((sl * spec.plan.slice_chunks, (sl + 1) * spec.plan.slice_chunks,
                             spec.plan.reg_chunks))
    held = T.meta_var(max(0, min(hi, kr) - lo))
    if held > 0:
        for j in T.unroll(held):
            body(lo + j, partial(from_registers, spec, wv, wreg, lo + j))
    if held < hi - lo:
        for j in T.unroll(hi - lo - held):
            body(lo + held + j, partial(from_shared, spec, wv, wsm, 0, lo + held - kr + j,
                                        warp, lane))


@T.macro
def each_chunk(spec, body, wv, wreg, wsm, w, blk, warp, lane):
    """``body(i, read)`` for every chunk i of the warp's (with K split among KQ warps, those
    of its part, i counted in all of K), ``read(q)`` putting its row q in ``wv``. The
    shared-memory chunks are a loop unrolled by the plan's ``unroll`` (so that one chunk's
    loads overlap another's products); the streamed ones a loop, not unrolled: unrolled, ptxas
    hoisted all their loads (a plan streaming 6 of 7 chunks needed 255 registers and spilled,
    and before the launch bounds had a minimum it failed on an H200 with "unspecified launch
    failure" in 15 of 22 runs; as a loop 30 of 30 passed)."""
    p = T.meta_var(spec.plan)
    kr, ks, unroll = T.meta_var((p.reg_chunks, p.smem_chunks, spec.smem_unroll))
    first = T.meta_var(warp // p.row_groups * p.warp_chunks if p.k_parts > 1 else None)
    if kr > 0:
        for i in T.unroll(kr):
            body(_chunk_index(first, i), partial(from_registers, spec, wv, wreg, i))
    if ks > 0:
        for so in range(ks // unroll):
            for si in T.unroll(unroll):
                body(_chunk_index(first, kr + so * unroll + si),
                     partial(from_shared, spec, wv, wsm, so, si, warp, lane))
    if p.global_chunks > 0:
        for gc in range(p.global_chunks):
            body(kr + ks + gc, partial(streamed, spec, wv, w, gc, blk, warp, lane))
