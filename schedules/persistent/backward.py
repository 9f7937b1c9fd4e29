"""The persistent backward kernel: the recurrence of a training step's backward pass, one
launch for all T steps, W_hh^T resident on-chip (planner: "Backward through time").

The forward kernel's stages with another cell stage: block b holds the U rows of W_hh^T of its
hidden units (K = G*H; ``weights``), and runs the steps backwards. Loop step t is sequence step
T - 1 - t; in it the block

1. prefetches its pairs' kept parts of the step's projections, previous states and dy
   (``cell_backward``);
2. stages dGH_{t+1} [N, G*H] as the other blocks published it (``exchange``; zeros at t = 0;
   on tensor cores in 16 bits a copy of dGH as published a second time in the staging's
   order and type, ``hx``, as the forward kernel stages h, zeros before the launch);
3. multiplies its rows of W_hh^T by it: dh_t's part through the recurrence, for its units
   (``cuda_cores``, ``reduction``; or ``tensor_cores`` for 16-bit weights, dGH staged in the
   A fragments' order and rounded to the weights' type, each row group's K split among
   ``plan.k_parts`` warps whose sums are added in shared memory), in shared memory; where
   the plan stages dGH in slices of K (``plan.k_slices``, :func:`.kernel.sliced_gate_sums`),
   2 and 3 go a slice at a time, the next slice copied while the warps multiply one;
4. applies the cell's derivative to its pairs (``cell_backward``): dGI (and dGH) of the step
   to global memory, dGH published for the next step, the states' gradients carried (and
   the per-unit parameters' gradients summed, in registers);
5. arrives at the exchange's barrier and waits for the other blocks' dGH.

After the last step one more product, dGH_0 by W_hh^T, completes dh_0 (``store_initial``,
which also writes the parameters' sums, a batch row each). The
weight gradients are products over all steps after the kernel (:mod:`rnncc.lowering.training`).

A step that takes a recurrent product of a value (``ops.recurrent``; the GRU that resets
before its product) exchanges twice: after 3, the derivative up to the product publishes the
gradient of its value dP (gate g's part of the vector, the others zero; ``cell_backward.
argument``), and 2 and 3 again give W_g^T dP for the block's units before 4. The exchange's
steps are then rounds, two a step (its slots, tags and counts go by the round).
"""

from __future__ import annotations

from functools import partial

from tvm.script import tirx as T

from rnncc.cells.autodiff import product_gates

from . import buffers
from .kernel import gate_sums, sliced_gate_sums
from .planner import Plan
from .spec import KernelSpec
from .stages import cell_backward, cuda_cores, exchange, tensor_cores, weights


@T.macro
def recurrent_sums(spec, b, g, staged, store, t, bx, tx, blk, warp, lane):
    """Steps 2 and 3: dGH_{t+1} staged (``store``: the products' ``store_h`` into ``staged``;
    copied from ``hx`` where the blocks publish it so, its slices one at a time where the plan
    has them), multiplied; the sums in ``hs``."""
    if spec.plan.k_slices > 1:
        sliced_gate_sums(spec, b, partial(exchange.copy_slice, spec, g.hx, b.hs16, t, bx=bx,
                                          tx=tx), warp, lane)
    elif spec.reads_hn:
        gate_sums(spec, b, g.w, blk, warp, lane, b.hn)
    else:
        if g.hx is not None:
            exchange.stage_copied(spec, g.hx, staged, t, bx, tx)
        else:
            exchange.stage_h(spec, g.xch, g.hw, b.tv, store, t, bx, tx, staged=staged,
                             hn=b.hn)
        T.tvm_storage_sync("shared.dyn")
        gate_sums(spec, b, g.w, blk, warp, lane)


def _argument_buffer(g):
    """Where the step's product's argument goes (its first's; None without one)."""
    return g.products[0][1] if g.products else None


def kernel(graph, kept: tuple, hidden: int, batch: int, plan: Plan, dtype: str = "float32",
           lengths: bool = False):
    """The backward kernel of a cell's traced step ``graph`` (:mod:`rnncc.cells.autodiff`) for
    ``plan`` (:func:`.planner.backward`), a PrimFunc named "persistent_backward"
    whose parameters :func:`.buffers.backward_parameters` lists. ``kept``: the parts of the
    projections the training forward kept (:func:`rnncc.lowering.training.kept_parts`);
    ``dtype``: the storage dtype of the weights, dy and the states' gradients; ``batch``: N,
    all batch groups together; ``lengths``: the samples' lengths are a parameter."""
    cell = graph.cell
    if plan.fused or plan.grids > 1 or plan.global_chunks:
        raise ValueError("the backward kernel runs one direction of one layer, its weights "
                         "on-chip")
    taken = product_gates(graph)
    if len(taken) > 1 or (taken and plan.k_slices > 1):
        raise ValueError(f"cell {cell.name!r} takes {len(taken)} recurrent products of its "
                         "values; the backward kernel takes one, dGH staged whole")
    spec = KernelSpec(plan, 1, len(cell.states), hidden, batch, dtype, lengths=lengths,
                      exchanged=cell.gates * hidden, params=len(cell.params))
    summed = all(which == "sum" for _, which in kept)
    p, products = plan, tensor_cores if plan.mma else cuda_cores
    rounds = 2 if taken else 1  # the exchange's rounds a step

    @T.prim_func(s_tir=True)
    def persistent_backward():
        T.func_attr({"tirx.noalias": True})
        g = T.meta_var(buffers.backward_parameters(spec, cell.gates, len(kept), summed,
                                                   len(taken)))
        with T.sblock("root"):
            b = T.meta_var(buffers.on_chip(spec, pairs=False))
            r = T.meta_var(buffers.backward_pairs(spec, len(kept), bool(taken)))
            staged = T.meta_var(b.hs16 if p.mma else b.hs)
            store = T.meta_var(partial(products.store_h, spec, staged, 0))
            published = T.meta_var(exchange.published_by(spec, products, g.hx, b.hn))
            for bx in T.thread_binding(p.blocks, thread="blockIdx.x"):
                for tx in T.thread_binding(p.threads, thread="threadIdx.x"):
                    warp, lane, blk = T.meta_var((tx // 32, tx % 32, spec.weights_of(bx)))
                    weights.load(spec, g.w, b.wreg, b.wsm, blk, warp, lane, tx)
                    if p.mma:
                        tensor_cores.prepare(spec, b.hs16, b.af, tx)
                    cell_backward.load_constants(spec, g.d_final, g.lengths, g.params, r, b.ln,
                                                 bx, tx)
                    if spec.local:
                        exchange.init_local(spec, None, b.hn, None, bx, tx)
                    for t in range(g.T_len):
                        v = T.meta_var(rounds * t)  # the exchange's round
                        cell_backward.prefetch(spec, len(kept), g.pre, g.s, g.dy, r, t,
                                               g.T_len, bx, tx)
                        recurrent_sums(spec, b, g, staged, store, v, bx, tx, blk, warp, lane)
                        if len(taken) > 0:
                            cell_backward.argument(
                                spec, graph, kept, taken[0], g.products[0][0], b.hs, r, b.ln,
                                partial(exchange.publish, spec, g.xch, g.hw, v,
                                        published=published), t, g.T_len, bx, tx)
                            exchange.arrive_and_wait(spec, g.cnt, v, bx, tx)
                            recurrent_sums(spec, b, g, staged, store, v + 1, bx, tx, blk, warp,
                                           lane)
                        cell_backward.apply(spec, graph, kept, g.dgi, g.dgh, b.hs, r, b.ln,
                                            partial(exchange.publish, spec, g.xch, g.hw,
                                                    v + rounds - 1, published=published), t,
                                            g.T_len, bx, tx, _argument_buffer(g))
                        exchange.arrive_and_wait(spec, g.cnt, v + rounds - 1, bx, tx)
                    recurrent_sums(spec, b, g, staged, store, rounds * g.T_len, bx, tx, blk,
                                   warp, lane)
                    cell_backward.store_initial(spec, g.d_initial, g.dps, b.hs, r, bx, tx)

    return persistent_backward
