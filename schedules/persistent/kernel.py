"""The persistent kernel: one launch runs all T steps, the recurrent weights resident on-chip.

The kernel is TVMScript composed from stages (:mod:`.stages`), each a ``@T.macro`` or a Python
function that builds TIR, each with one job, each taking the :class:`~.spec.KernelSpec` (the
plan and the layer's sizes) and the buffers it needs (:mod:`.buffers`). The skeleton below is
the whole kernel: block b runs its rows of all T steps; with a fused input projection it first
computes its own input projections (all of them, or overlapped: the first group of steps);
then, per step, it

1. prefetches the input projections of its (unit, batch) pairs for step t (``cell``);
2. stages h_{t-1} [N, H] in shared memory, as the other blocks published it (``exchange``;
   a batch group of one block from its own shared memory), in the layout its products read
   (``cuda_cores`` or ``tensor_cores``); in slices of K where the plan says so
   (:func:`sliced_gate_sums`: 2 to 4 a slice at a time);
3. multiplies every chunk of its weights (``weights`` says where each lives: registers, shared
   memory, or global memory for a streaming plan) by h's, accumulating in float32;
4. sums over the lanes (``reduction``; tensor cores sum in the instruction) into shared memory,
   where h_{t-1} was;
5. applies the cell to its pairs (``cell``): y[t], and h_t handed to the exchange; a cell
   that takes a recurrent product of a value of its step (``ops.recurrent``, the GRU that
   resets before its product) first evaluates the step up to that value, exchanges it as h
   is exchanged, and multiplies the weights by it (3 and 4 again: the product is its gate's
   rows) before it applies the cell;
6. arrives at the exchange's barrier and waits for the other blocks' h_t (``exchange``); an
   overlapped input projection computes a slab of a later group of steps between the two.

Block-wide barriers are TVM storage syncs, written here in the skeleton (and in the stages that
need one of their own). Every variant but ``"local"`` (a batch group of one block) waits on
other blocks, so the launch is cooperative: all blocks resident, or the driver refuses the
launch (never a hang). With batch groups (planner:
"Batch groups") block bx holds the weights of block bx % (B/NG) and runs batch rows
bx // (B/NG) * N/NG + n: staging, the tagged words and the counter stay within its group.
With layers (planner: "Layers as a wavefront") the grid is one grid a layer, and layer l > 0
reads layer l - 1's y as its x, a group of steps once the layer below has written them
(``wavefront``).

A new per-step operation is a stage: a file in :mod:`.stages` with its macros, its buffers in
:mod:`.buffers` if it needs any, and a call in the skeleton where it runs.
"""

from __future__ import annotations

from functools import partial

from tvm.script import tirx as T

from rnncc.cells.autodiff import one_round_levels, product_gates, trace

from . import buffers, device
from .planner import Plan
from .spec import KernelSpec
from .stages import cell as cell_stage
from .stages import (
    cuda_cores,
    exchange,
    history,
    input_projection,
    means,
    reduction,
    tensor_cores,
    wavefront,
    weights,
)


@T.macro
def gate_sums(spec, b, w, blk, warp, lane, h=None, base=0):
    """Steps 3 and 4: the block's gate sums [Wn*RW, N/NG] in ``hs``, from h_{t-1} staged
    (``b``: the on-chip buffers; ``w``: W_hh, whose streamed chunks are read every step), or
    on the CUDA cores from ``h`` where it is kept, from ``base`` (:attr:`.spec.KernelSpec.
    reads_hn`; the sums then need not wait for every warp to have read it)."""
    if spec.plan.mma:
        tensor_cores.zero(spec, b.dacc)
        weights.each_chunk(spec, partial(tensor_cores.chunk, spec, b.hs16, b.af, b.wb, b.wv,
                                         b.dacc, lane), b.wv, b.wreg, b.wsm, w, blk, warp, lane)
        T.tvm_storage_sync("shared.dyn")  # the sums go where h_{t-1} was (hs16 shares memory)
        tensor_cores.store_sums(spec, b.hs, b.dacc, warp, lane)
        if spec.plan.k_parts > 1:
            T.tvm_storage_sync("shared.dyn")
            tensor_cores.add_parts(spec, b.hs, warp * 32 + lane)
    else:
        cuda_cores.zero(spec, b.acc)
        weights.each_chunk(spec, partial(cuda_cores.chunk, spec, b.hs if h is None else h, b.hv,
                                         b.wv, b.acc, lane, base=base), b.wv, b.wreg, b.wsm, w,
                           blk, warp, lane)
        reduction.butterfly(spec, b.acc, lane)
        if h is None:
            T.tvm_storage_sync("shared.dyn")  # every warp has read h_{t-1}: the sums take its place
        reduction.store_sums(spec, b.hs, b.acc, warp, lane)
    T.tvm_storage_sync("shared.dyn")


@T.macro
def _slice(spec, b, start, sl, warp, lane):
    """Slice ``sl`` of :func:`sliced_gate_sums` (a Python int): once it is in (the thread's
    copies, then a block barrier, after which no warp reads slice sl - 1), start slice sl +
    1 in the other half, and multiply the warps' chunks of slice sl."""
    device.wait_copies()
    T.tvm_storage_sync("shared.dyn")
    if sl + 1 < spec.plan.k_slices:
        start(sl + 1)
    weights.slice_chunks(spec, partial(tensor_cores.slice_chunk, spec, b.hs16, b.af, b.wb, b.wv,
                                       b.dacc, warp, lane, sl % 2), b.wv, b.wreg, b.wsm, sl,
                         warp, lane)


def _each_slice(spec, b, start, warp, lane):
    """:func:`_slice` for every slice, in order (builds TIR; a slice's chunks sit in
    registers or shared memory, which the slice's number, a Python int, decides)."""
    for sl in range(spec.plan.k_slices):
        _slice(spec, b, start, sl, warp, lane)


@T.macro
def sliced_gate_sums(spec, b, start, warp, lane):
    """Steps 2 to 4 with h_{t-1} staged in slices of K (planner: "Slices of K"): ``start(sl)``
    starts staging slice sl into half sl % 2 of ``hs16`` (asynchronous copies of the published
    h, or stores); slice sl + 1 comes in while the warps multiply slice sl. The sums in
    ``hs`` as :func:`gate_sums` leaves them."""
    tensor_cores.zero(spec, b.dacc)
    start(0)
    _each_slice(spec, b, start, warp, lane)
    tensor_cores.store_sums(spec, b.hs, b.dacc, warp, lane)
    if spec.plan.k_parts > 1:
        T.tvm_storage_sync("shared.dyn")
        tensor_cores.add_parts(spec, b.hs, warp * 32 + lane)
    T.tvm_storage_sync("shared.dyn")


@T.macro
def block(spec, cell, g, b, io, staged, held, published, bx, tx):
    """Thread ``tx`` of block ``bx``: the whole run (``g``: the parameters; ``b``: the on-chip
    buffers; ``io``: the fused input projection's; ``staged``: where h_{t-1} is staged;
    ``held``: where the products read it where it is kept; ``published``: where h_t goes for
    the next step's staging, :func:`.exchange.published_by`)."""
    p, products = T.meta_var((spec.plan, tensor_cores if spec.plan.mma else cuda_cores))
    warp, lane, blk = T.meta_var((tx // 32, tx % 32, spec.weights_of(bx)))
    if p.fused:
        input_projection.before_loop(spec, io, g.T_len, warp, lane, bx, tx)
    weights.load(spec, g.w, b.wreg, b.wsm, blk, warp, lane, tx)
    if p.mma:
        tensor_cores.prepare(spec, b.hs16, b.af, tx)
    if g.hx is not None:
        exchange.zero_unpublished(spec, published, bx, tx)
    if spec.local:
        exchange.init_local(spec, g.s[0], b.hn, partial(products.store_h, spec, b.hn, 0), bx,
                            tx)
    if spec.cluster:
        exchange.init_cluster(spec, g.s[0], b.hn, b.cb, partial(products.store_h, spec, b.hn, 0),
                              bx, tx)
    cell_stage.load_constants(spec, g.b_hh, g.s, g.lengths, b.bh, b.st, b.ln, bx, tx, g.params,
                              b.pv)
    if len(spec.kept) > 0:
        history.keep_initial(spec, g.steps, b.st, bx, tx)
    if spec.means > 0:
        means.clear(spec, b.shift, tx)
    for t in range(g.T_len):
        cell_stage.prefetch(spec, g.xp, b.gi, b.ln, t, g.T_len, bx, tx, g.first)
        if p.input_steps > 0:
            input_projection.start_copies(spec, io, t, g.T_len, bx, tx)
        if p.k_slices > 1:
            sliced_gate_sums(spec, b, partial(
                exchange.start_slice, spec, g.s[0], g.hx, staged,
                partial(products.store_h, spec, staged), t, bx=bx, tx=tx), warp, lane)
        elif spec.reads_hn:
            if spec.cluster:
                exchange.wait_cluster(spec, b.cb, t, tx)
            gate_sums(spec, b, g.w, blk, warp, lane, held, spec.hn_slot(t))
        else:
            exchange.stage_h(spec, g.s[0], g.hw, b.tv, partial(products.store_h, spec, staged, 0),
                             t, bx, tx, g.hx, staged, b.hn)
            T.tvm_storage_sync("shared.dyn")
            gate_sums(spec, b, g.w, blk, warp, lane)
        if spec.product >= 0:
            cell_stage.argument(spec, cell, b.hs, b.gi, b.bh, b.st, b.pv, b.gs,
                                partial(exchange.publish_value, spec, g.aw[0], t), bx, tx)
            exchange.value_barrier(spec, g.cnt, t, 0, bx, tx)
            exchange.stage_values(spec, [g.aw[0]], b.tv, [partial(
                products.store_h, spec, staged, 0)], t, bx, tx)
            T.tvm_storage_sync("shared.dyn")
            gate_sums(spec, b, g.w, blk, warp, lane, held)
        means.rounds(spec, cell, g, b, t, bx, tx, warp, lane)
        cell_stage.apply(spec, cell, g.y, b.hs, b.gi, b.bh, b.st, b.ln, partial(
            exchange.publish, spec, g.s[0], g.hw, t, published=published), t, g.T_len, bx, tx,
            history.keeper(spec, g.pre, g.steps), b.pv, b.gs, b.mv, g.ys)
        if p.input_steps > 0:
            input_projection.wait_copies(spec)
            exchange.arrive(spec, g.cnt, bx, tx)
            wavefront.publish(spec, g.prog, bx, tx)
            input_projection.in_loop(spec, io, t, g.T_len, warp, lane, bx, tx)
            exchange.wait(spec, g.cnt, t, bx, tx)
        else:
            exchange.arrive_and_wait(spec, g.cnt, t, bx, tx)
    if spec.cluster:
        exchange.drain_cluster(spec, b.cb, g.T_len)
    cell_stage.store_final_states(spec, g.s, g.finals, b.st, g.T_len, bx, tx)


def kernel(cell, hidden: int, batch: int, plan: Plan, dtype: str = "float32",
           input_size: int = 0, lengths: bool = False, kept: tuple = (), first: bool = False,
           finals: bool = False):
    """The persistent kernel of ``cell`` (an :class:`rnncc.cells.Cell`) for ``plan``, a
    PrimFunc named "persistent" whose parameters :func:`.buffers.parameters` lists. ``dtype``:
    the storage dtype of the weights, the biases and y; ``input_size`` C: for a fused input
    projection; ``batch``: N, all batch groups together (the kernel runs N + ``plan.pad``
    rows: planner, "Padded batch"); ``lengths``: the samples' lengths are a parameter;
    ``kept``: a training forward's, which keeps every step's states and these
    parts of its projections (:mod:`.stages.history`); ``first``: the first step's input
    projections take an addition (a projection's W_hh h0); ``finals``: it writes the final
    states (:class:`~.spec.KernelSpec`)."""
    taken = product_gates(trace(cell))
    if len(taken) > 1:
        raise ValueError(f"cell {cell.name!r} takes {len(taken)} recurrent products of its "
                         "values; the persistent kernel takes one")
    levels, variances = one_round_levels(cell)
    if plan.k_slices > 1 and (taken or levels):
        raise ValueError(f"cell {cell.name!r} exchanges values of its step before h; h in "
                         "slices of K takes a step of one product, of h")
    spec = KernelSpec(plan, cell.gates, len(cell.states), hidden, batch + plan.pad, dtype,
                      input_size,
                      lengths, kept=kept, params=len(cell.params), first=first, finals=finals,
                      product=taken[0] if taken else -1,
                      levels=tuple(tuple(level) for level in levels),
                      variances=tuple((k, m, alone) for k, (m, alone) in
                                      sorted(variances.items())),
                      samples=batch)
    p = plan

    @T.prim_func(s_tir=True)
    def persistent():
        T.func_attr({"tirx.noalias": True})
        g = T.meta_var(buffers.parameters(spec))
        with T.sblock("root"):
            b = T.meta_var(buffers.on_chip(spec))
            io = T.meta_var(buffers.projection(g, b) if p.fused else None)
            staged = T.meta_var(b.hn if spec.reads_hn else b.hs16 if p.mma else b.hs)
            held = T.meta_var(b.hn if spec.reads_hn else None)  # where the products read h
            published = T.meta_var(exchange.published_by(
                spec, tensor_cores if p.mma else cuda_cores, g.hx, b.hn, b.cb))
            if spec.cluster:  # a batch group a cluster (planner: "A cluster a group")
                for bx in T.thread_binding(p.blocks, thread="blockIdx.x"):
                    for _rank in T.thread_binding(spec.cluster_blocks, thread="clusterCtaIdx.x"):
                        for tx in T.thread_binding(p.threads, thread="threadIdx.x"):
                            block(spec, cell, g, b, io, staged, held, published, bx, tx)
            else:
                for bx in T.thread_binding(p.blocks, thread="blockIdx.x"):
                    for tx in T.thread_binding(p.threads, thread="threadIdx.x"):
                        block(spec, cell, g, b, io, staged, held, published, bx, tx)

    return persistent
