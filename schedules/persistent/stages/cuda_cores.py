"""Stage: the recurrent products on CUDA cores (every plan without ``mma``).

h_{t-1} is staged in shared memory as float32 [N, KP] (``hs``, zeros past H). For each of its
chunks i (the weights stage says where each lives), lane l loads the chunk of h of every batch
row (``hv``), then for each of its RW rows the chunk of weights (``wv``) and adds the products
to its sums ``acc`` [RW*N] (float32). The sums over the 32 lanes are the reduction stage's.
With lane groups (planner: "Lane groups") lane l's chunk i of h is k = (i*KL + l % KL)*VEC ..,
its rows those of its group, and the sums run over the group's KL lanes.
"""

from __future__ import annotations

from tvm.script import tirx as T


@T.macro
def store_h(spec, hs, base, e, value):
    """Element e = n*KP + k of h_{t-1}, as the products read it, at ``base`` of ``hs`` (the
    staged h, or a group's published one: :mod:`.exchange`)."""
    hs[base + e] = value


@T.macro
def zero(spec, acc):
    for a in T.unroll(spec.accumulators):
        acc[a] = T.float32(0)


@T.macro
def chunk(spec, hs, hv, wv, acc, lane, i, read, base=0):
    """Chunk i of the lane's rows (``read(q)`` puts row q's in ``wv``) by h's (h from ``base``
    of ``hs``)."""
    n_, vec, kl = T.meta_var((spec.local_batch, spec.plan.vec, spec.plan.k_lanes))
    for n in T.unroll(n_):
        for v in T.vectorized(vec):
            hv[n * vec + v] = hs[base + n * spec.width + (i * kl + lane % kl) * vec + v]
    for q in T.unroll(spec.plan.rows_per_warp):
        read(q)
        for n in T.unroll(n_):
            for v in T.unroll(vec):
                acc[q * n_ + n] = acc[q * n_ + n] + T.Cast("float32", wv[v]) * hv[n * vec + v]
