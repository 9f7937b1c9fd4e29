"""The persistent kernel's stages without a GPU: each stage's TIR, built for small plans, run on
a NumPy interpreter of the kernel (tests/tir_sim.py) and checked against NumPy, and whole
kernels so run against the float64 reference, for every variant of the plan."""

import dataclasses
import os
from functools import partial

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

import rnncc
from conftest import random_weights
from helpers import TOL, TOL_TF32, persistent_cells, round_tf32
from rnncc import reference
from rnncc.cells import autodiff, ops
from rnncc.cells.autodiff import one_round_levels
from rnncc.dtypes import projection_grad_dtype
from rnncc.lowering import components as comp
from rnncc.lowering.sequence import sums_in_place
from rnncc.lowering.training import kept_parts
from rnncc.schedules.persistent import backward as backward_kernel
from rnncc.schedules.persistent import buffers, fuse_input, gpu_for_arch, overlap_input, planner
from rnncc.schedules.persistent.kernel import kernel
from rnncc.schedules.persistent.spec import KernelSpec
from rnncc.schedules.persistent.stages import cell as cell_stage
from rnncc.schedules.persistent.stages import (
    cuda_cores,
    exchange,
    input_projection,
    reduction,
    tensor_cores,
    weights,
)
from rnncc.schedules.persistent.stages.exchange import EMPTY_TAG
from tir_sim import Deadlock, Simulator

H100 = gpu_for_arch("sm_90")


def crafted(gates, hidden, batch, dtype, units, warps, split=None, groups=1, width=None,
            vec=None, lane_groups=1, **fields):
    """A plan of ``units`` a block and ``warps`` a block whose chunks of K (``width``,
    default H) are ``split`` (in registers, shared memory, global memory; default all in
    registers): the interpreter holds any split, whatever a GPU's registers and shared memory
    would. ``rows_per_warp`` may exceed the block's rows (the last warp's past them zero).
    ``vec``: a lane's elements of a chunk, if not 16 bytes' (planner: "Narrow chunks");
    ``lane_groups``: groups of a warp's lanes, each its own rows (planner: "Lane groups")."""
    vec = vec or 16 // planner.ELEMENT_BYTES[dtype]
    fields.setdefault("lane_bytes", vec * planner.ELEMENT_BYTES[dtype])
    chunks = -(-(width or hidden) // (32 // lane_groups * vec))
    kr, ks, kg = split or (chunks, 0, 0)
    assert kr + ks + kg == chunks
    return planner.Plan(
        blocks=-(-hidden // units) * groups * fields.get("directions", 1), units=units, warps=warps,
        rows_per_warp=fields.pop("rows_per_warp", -(-gates * units // (warps * lane_groups))),
        vec=vec, lane_groups=lane_groups,
        chunks=chunks, reg_chunks=kr,
        smem_chunks=ks, global_chunks=kg, items=-(-units * (batch // groups) // (32 * warps)),
        reg_estimate=0, smem_bytes=0, batch_groups=groups, **fields)


def tagged(gates, hidden, batch, **fields):
    """A float32 plan of 12 units a block (H 33: three blocks, the last of 9) that exchanges
    tagged words: the planner's own plan at such H is one block a group, which keeps h to
    itself (``"local"``)."""
    return crafted(gates, hidden, batch, "float32", 12, 2, sync="tagged", **fields)


def padded(p, pad: int):
    """Plan ``p`` (made for N + ``pad`` rows) for a batch of N, its last ``pad`` rows
    padding."""
    return dataclasses.replace(p, pad=pad)


def split_k(p, parts: int):
    """Plan ``p`` (on tensor cores) with each row group's K split among ``parts`` warps: the
    same rows, ``parts`` times the warps, each a part of every place's chunks."""
    assert p.reg_chunks % parts == 0 and p.smem_chunks % parts == 0
    return dataclasses.replace(p, warps=p.warps * parts, k_parts=parts,
                               reg_chunks=p.reg_chunks // parts,
                               smem_chunks=p.smem_chunks // parts)


def in_slices(p, slices: int):
    """Plan ``p`` (on tensor cores, whole tiles) with h (dGH) staged in ``slices`` slices of
    K."""
    assert p.warp_chunks % slices == 0
    return dataclasses.replace(p, k_slices=slices)


def _llvm(func, *arrays):
    """Run a PrimFunc built for this CPU; the arrays it wrote."""
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    tvm.compile(func, target="llvm")(*tensors)
    return [t.numpy() for t in tensors]


def simulate(cell, p, x, weights, initial, dtype, lengths=None, kept=()):
    """y and the final states of the persistent kernel of plan ``p`` on ``x`` [T, N, C], run
    on the interpreter with rnncc's own packings (built for this CPU); ``lengths``: the
    kernel takes the samples' lengths. With two directions (``p.directions``), ``weights``
    has the ``_reverse`` ones too, initial states are [2, N, H] and y [T, N, 2*H]. ``kept``:
    a training forward's parts; then also the states of every step and ``pre``. With
    ``weight_hr_l0`` (a projection), as the module's entry runs it: W_hh W_hr
    folded into the kernel's matrix, its recurrence h' from zero, W_hh h0 added to the first
    step's projections; then y is h' [T, N, H] and the final h h'_T."""
    steps, n, c = x.shape
    g, dirs = cell.gates, p.directions
    h = weights["weight_ih_l0"].shape[0] // g
    suffixes = ("", "_reverse")[:dirs]
    shape = (p.group_blocks, p.warps, p.warp_chunks, p.rows_per_warp, 32, p.vec)
    w_hr = weights.get("weight_hr_l0")
    folded = w_hr.shape[0] if w_hr is not None else 0
    packing = comp.pack_persistent(g, h, p, dtype, folded=folded)

    def extra(d):
        return [weights["weight_hr_l0" + d].astype(dtype)] if folded else []

    args = {"w": np.concatenate([_llvm(packing, weights["weight_hh_l0" + d].astype(dtype),
                                       *extra(d), np.zeros(shape, dtype))[-1]
                                 for d in suffixes]),
            "b_hh": np.concatenate([weights["bias_hh_l0" + d].astype(dtype) for d in suffixes]),
            "y": np.full((steps, n, dirs * h), np.nan, dtype)}
    for k, name in enumerate(cell.params):  # the cell's per-unit parameters, [D*H] each
        args[f"p{k}"] = np.concatenate([weights[f"{name}_l0{d}"].astype(dtype)
                                        for d in suffixes])
    if p.fused:  # a direction's W_ih packed as the entry packs it, the reverse one's after
        shape = (p.group_blocks, *buffers.input_weight_shape(p, g)[1:])
        pack = comp.pack_fused_input(g, h, c, shape, p, dtype)
        args["wi"] = np.concatenate([_llvm(pack, weights["weight_ih_l0" + d].astype(dtype),
                                           np.zeros(shape, dtype))[1] for d in suffixes])
        args.update(x=x.astype(dtype), b_ih=np.concatenate([
            weights["bias_ih_l0" + d].astype(dtype) for d in suffixes]),
            xp=np.full((steps, n, dirs * g * h), np.nan, np.float32))
    else:
        xp = np.concatenate([x.astype(dtype).astype(np.float32) @ weights[
            "weight_ih_l0" + d].astype(dtype).astype(np.float32).T + weights[
            "bias_ih_l0" + d].astype(dtype).astype(np.float32) for d in suffixes], axis=2)
        args["xp"] = xp.astype(np.float32)
    if folded:  # [N, D*G*H]
        args["first"] = np.concatenate([initial["h"][k].astype(dtype).astype(
            np.float32) @ weights["weight_hh_l0" + d].astype(dtype).astype(np.float32).T
            for k, d in enumerate(suffixes)], axis=1)
    graph = autodiff.trace(cell)  # the values a step reduces, exchanged as h is
    values = sum(node.op == "mean" for node in graph.order) or len(graph.products)
    # the states' workspaces and the tagged words, as the entry's first kernel makes them
    count, words = len(cell.states), (1 + values if p.sync == "tagged" else 0)
    run = n + p.pad  # the rows the kernel runs (a padded batch's past N)
    made = _llvm(comp.init_persistent(count, dirs, n, h, dtype, "float32", words, EMPTY_TAG,
                                      zero_h=bool(folded), rows=run),
                 *[initial[s].astype(dtype) for s in cell.states[bool(folded):]],
                 *[np.full((2, dirs * run, h), np.nan, np.float32) for _ in range(count)],
                 *[np.zeros((2, dirs * run, h), np.uint64) for _ in range(words)])[-count - words:]
    args.update({f"s{k}": made[k] for k in range(count)})
    if p.sync == "tagged":
        args.update({"hw": made[count], **{f"aw{r}": made[count + 1 + r] for r in range(values)}})
    else:
        if p.sync not in ("local", "cluster"):
            args["cnt"] = np.zeros(dirs * p.batch_groups, np.uint32)
        args.update({f"aw{r}": np.full((2, dirs * run, h), np.nan, np.float32)
                     for r in range(values)})
    if not folded:  # the kernel writes the final states
        args.update({f"s{k}_n": np.full((dirs, n, h), np.nan, dtype) for k in range(count)})
    if buffers.published_h(p, run, dtype):  # NaN: the kernel zeroes what none publishes
        shape, hx_dtype = buffers.published_h(p, run, dtype)
        args["hx"] = np.full(shape, np.nan, hx_dtype)
    if lengths is not None:
        args["lengths"] = np.asarray(lengths, np.int32)
    for k in range(len(cell.states)) if kept else ():
        args[f"s{k}_steps"] = np.full((steps + 1, n, h), np.nan, np.float32)
    if kept:  # the sums over the input projections, where the entry keeps them there
        args["pre"] = (args["xp"] if not p.fused and sums_in_place(kept)
                       else np.full((steps, n, len(kept) * h), np.nan, np.float32))
    func = kernel(cell, h, n, p, dtype=dtype, input_size=c if p.fused else 0,
                  lengths=lengths is not None, kept=kept, first=bool(folded), finals=not folded)
    Simulator(func, args).run()
    finals = {s: args[f"s{k}"][steps % 2].reshape(dirs, n, h) if folded else args[f"s{k}_n"]
              for k, s in enumerate(cell.states)}
    if kept:
        return args["y"], finals, [args[f"s{k}_steps"] for k in range(len(cell.states))], \
            args["pre"]
    return args["y"], finals


def check_kernel(cell_name, p, input_size, hidden, batch, dtype, rng, steps=(1, 5),
                 lengths=False, offset=0.0, tol=None):
    """The kernel of plan ``p`` against float64 at each T of ``steps``, with initial states;
    ``lengths``: random lengths (one sample of 1 step, one of all T); ``offset``: added to
    b_hh (the recurrent gate sums far from 0); ``tol``: the dtype's unless given."""
    cell = rnncc.cells.get(cell_name)
    dirs = p.directions
    for t in steps:
        weights = {}
        for suffix in ("", "_reverse")[:dirs]:
            weights.update({k + suffix: v.astype(dtype) for k, v in
                            random_weights(rng, cell.gates, input_size, hidden,
                                           params=cell.params).items()})
            weights["bias_hh_l0" + suffix] += np.asarray(offset, dtype)
        x = rng.standard_normal((t, batch, input_size)).astype(dtype)
        initial = {s: rng.standard_normal((dirs, batch, hidden)).astype(dtype)
                   for s in cell.states}
        ln = None
        if lengths:
            ln = rng.integers(1, t + 1, batch)
            ln[0], ln[-1] = 1, t
        y, finals = simulate(cell, p, x, weights, initial, dtype, ln)
        ref_y, ref_states = reference.run_module(cell, x, weights, dirs, 1, initial, ln)
        errors = [reference.relative_error(y, ref_y)] + [
            reference.relative_error(finals[s], ref_states[s]) for s in cell.states]
        bound = tol or (TOL_TF32 if p.mma and dtype == "float32" else TOL[dtype])
        assert max(errors) < bound, f"T={t}: relative errors {errors}"


@pytest.mark.parametrize("variant", ["one direction", "fused input", "two directions",
                                     "two directions, overlapped"])
def test_kernel_of_a_projection_folds_w_hr_and_adds_the_initial_h_first(variant, rng):
    """LSTMP as its persistent entry runs it (rnncc.lowering.sequence, ``_folded``): the kernel
    holds W_hh W_hr (pack_persistent's fold), runs the cell on h' from zero, and adds W_hh h0 to
    the first step's input projections (its own, with a fused input projection; the reverse
    direction's first is each sample's last step); y = W_hr h' and h_T = W_hr h'_T against the
    float64 reference with h0, c0 and lengths, T 1 and 6."""
    cell, c, h, proj, n = rnncc.cells.get("lstm"), 6, 33, 7, 3
    p = {"one direction": lambda: planner.plan(4, h, n, "float32", H100, 2),
         "fused input": lambda: _fused(crafted(4, h, n, "float32", 5, 2), 4, c, n, 8),
         "two directions": lambda: planner.plan(4, h, n, "float32", H100, 2, directions=2),
         "two directions, overlapped": lambda: _overlapped(
             crafted(4, h, n, "float32", 5, 2, directions=2), 4, c, n, 4),
         }[variant]()
    dirs, suffixes = p.directions, ("", "_reverse")[:p.directions]
    for steps in (1, 6):
        weights = {}
        for d in suffixes:
            w = random_weights(rng, 4, c, h, "float32")
            w["weight_hh_l0"] = w["weight_hh_l0"][:, :proj] * np.sqrt(h / proj)
            w["weight_hr_l0"] = rng.uniform(-1, 1, (proj, h)) / np.sqrt(h)
            weights.update({k + d: v.astype("float32") for k, v in w.items()})
        x = rng.standard_normal((steps, n, c)).astype("float32")
        initial = {"h": rng.standard_normal((dirs, n, proj)).astype("float32"),
                   "c": rng.standard_normal((dirs, n, h)).astype("float32")}
        ln = np.array([steps, 1, max(1, steps - 2)])
        y_cell, finals = simulate(cell, p, x, weights, initial, "float32", lengths=ln)
        ref_y, ref = reference.run_module(cell, x, weights, dirs, 1, initial, ln)
        w_hr = [weights["weight_hr_l0" + d].astype(np.float64) for d in suffixes]
        y = np.concatenate([y_cell[:, :, k * h:(k + 1) * h].astype(np.float64) @ w.T
                            for k, w in enumerate(w_hr)], axis=2)
        h_n = np.stack([finals["h"][k].astype(np.float64) @ w.T for k, w in enumerate(w_hr)])
        errors = [reference.relative_error(y, ref_y), reference.relative_error(h_n, ref["h"]),
                  reference.relative_error(finals["c"], ref["c"])]
        assert max(errors) < TOL["float32"], f"T={steps}: {errors}"


# -- whole kernels --------------------------------------------------------------------------

def _fused(base, gates, input_size, batch, rows, gpu=H100):
    found = fuse_input(base, gates, input_size, batch, gpu, rows)
    assert found is not None
    return found


def _overlapped(base, gates, input_size, batch, steps):
    found = overlap_input(base, gates, input_size, batch, H100, steps)
    assert found is not None and found.input_steps == steps
    return found


#: A GPU whose shared memory holds W_hh's chunk of the slab plan below but not W_ih beside it.
SMALL_SMEM = dataclasses.replace(H100, smem_per_block=16000)

KERNELS = {
    "tagged": lambda: ("lstm", 5, 33, 3, "float32", tagged(4, 33, 3)),
    "local, the planner's, narrow chunks": lambda: ("lstm", 5, 33, 3, "float32", planner.plan(
        4, 33, 3, "float32", H100, 2)),
    "local, batch groups, chunks of one element": lambda: ("gru", 6, 20, 6, "float16", crafted(
        3, 20, 6, "float16", 20, 2, groups=3, vec=1, sync="local")),
    "local, tensor cores, tiles": lambda: ("lstm", 5, 16, 20, "float16", crafted(
        4, 16, 20, "float16", 16, 8, mma=True, sync="local", rows_per_warp=8)),
    "local, fused": lambda: ("gru", 37, 70, 2, "float32", _fused(crafted(
        3, 70, 2, "float32", 70, 8, sync="local"), 3, 37, 2, 8)),
    "local, overlapped": lambda: ("lstm", 64, 70, 2, "float32", _overlapped(crafted(
        4, 70, 2, "float32", 70, 8, sync="local"), 4, 64, 2, 2)),
    # lanes in groups (planner: "Lane groups"): K over 4, 16 and 1 lanes of each group
    "lane groups of 4 lanes, float16, local": lambda: ("gru", 6, 20, 6, "float16", crafted(
        3, 20, 6, "float16", 20, 2, groups=3, lane_groups=8, sync="local")),
    "lane groups of 16 lanes, tagged": lambda: ("lstm", 5, 40, 3, "float32", crafted(
        4, 40, 3, "float32", 20, 2, lane_groups=2, sync="tagged")),
    "lane groups of one lane, local": lambda: ("lstm", 2, 3, 2, "float32", crafted(
        4, 3, 2, "float32", 3, 1, lane_groups=32, sync="local")),
    "barrier, K in registers, shared and global memory": lambda: (
        "gru", 7, 300, 2, "float32", crafted(3, 300, 2, "float32", 40, 4, (1, 1, 1),
                                             sync="barrier")),
    "grid, shared-memory chunks unrolled": lambda: (
        "rnn_tanh", 3, 300, 1, "float32", crafted(1, 300, 1, "float32", 40, 4, (0, 3, 0),
                                                  sync="grid", unroll=3)),
    "batch groups": lambda: ("lstm", 4, 64, 4, "float32", crafted(
        4, 64, 4, "float32", 8, 4, groups=2, sync="barrier")),
    "float16": lambda: ("gru", 6, 70, 2, "float16", crafted(3, 70, 2, "float16", 10, 2,
                                                             sync="barrier")),
    "bfloat16": lambda: ("lstm", 6, 70, 2, "bfloat16", crafted(4, 70, 2, "bfloat16", 10, 2,
                                                                sync="barrier")),
    "tensor cores": lambda: ("lstm", 5, 64, 3, "float16", crafted(4, 64, 3, "float16", 2, 1,
                                                                  mma=True)),
    "tensor cores, tiles of batch rows": lambda: ("gru", 5, 64, 21, "float16", crafted(
        3, 64, 21, "float16", 8, 3, mma=True, sync="barrier")),
    "tensor cores in TF32, tiles of batch rows": lambda: ("lstm", 5, 64, 21, "float32", crafted(
        4, 64, 21, "float32", 8, 4, mma=True, sync="barrier")),
    "tensor cores, shared memory, batch groups": lambda: (
        "lstm", 5, 300, 4, "float16", crafted(4, 300, 4, "float16", 4, 2, (1, 1, 0), groups=2,
                                              mma=True, sync="barrier")),
    "fused, odd C": lambda: ("gru", 37, 33, 2, "float32", _fused(
        crafted(3, 33, 2, "float32", 5, 2), 3, 37, 2, 8)),
    "fused in slabs": lambda: ("gru", 200, 33, 2, "float32", _fused(
        crafted(3, 33, 2, "float32", 5, 2, (0, 1, 0), sync="barrier"), 3, 200, 2, None,
        SMALL_SMEM)),
    "fused, batch groups": lambda: ("lstm", 33, 40, 6, "float32", _fused(
        crafted(4, 40, 6, "float32", 5, 2, groups=3), 4, 33, 6, 8)),
    "fused, float16, vectors of 8 x": lambda: ("gru", 64, 33, 2, "float16", _fused(
        crafted(3, 33, 2, "float16", 5, 2), 3, 64, 2, 8)),
    "overlapped, asynchronous copies": lambda: ("lstm", 64, 33, 2, "float32", _overlapped(
        crafted(4, 33, 2, "float32", 5, 2), 4, 64, 2, 2)),
    "overlapped, staged x, barrier": lambda: ("gru", 37, 40, 4, "float32", _overlapped(
        crafted(3, 40, 4, "float32", 5, 2, sync="barrier"), 3, 37, 4, 3)),
    "overlapped, grid": lambda: ("rnn_relu", 16, 33, 4, "float32", _overlapped(
        crafted(1, 33, 4, "float32", 9, 1, sync="grid"), 1, 16, 4, 1)),
    "bidirectional, local": lambda: ("lstm", 5, 33, 3, "float32", planner.plan(
        4, 33, 3, "float32", H100, 2, directions=2)),
    "bidirectional, overlapped, asynchronous copies": lambda: ("lstm", 64, 33, 2, "float32",
                                                               _overlapped(crafted(
        4, 33, 2, "float32", 5, 2, directions=2), 4, 64, 2, 2)),
    "bidirectional, overlapped, staged x, batch groups": lambda: ("gru", 37, 40, 4, "float32",
                                                                  _overlapped(crafted(
        3, 40, 4, "float32", 5, 2, groups=2, sync="barrier", directions=2), 3, 37, 4, 2)),
    "bidirectional, barrier, batch groups, K in three places": lambda: (
        "gru", 7, 300, 4, "float32", crafted(3, 300, 4, "float32", 40, 4, (1, 1, 1), groups=2,
                                             sync="barrier", directions=2)),
    # (11 such groups at H 132, batch 33 fail on an H200, timing-dependent: docs/benchmarks.md)
    "bidirectional, tagged, batch groups": lambda: ("lstm", 5, 12, 6, "float32", crafted(
        4, 12, 6, "float32", 6, 2, groups=3, sync="tagged", directions=2)),
    "bidirectional, tensor cores": lambda: ("lstm", 5, 64, 3, "float16", crafted(
        4, 64, 3, "float16", 2, 1, mma=True, directions=2)),
    "tensor cores, K split among warps": lambda: ("gru", 5, 300, 21, "float16", split_k(
        crafted(3, 300, 21, "float16", 8, 3, mma=True, sync="barrier"), 2)),
    "tensor cores, K split, shared memory": lambda: ("lstm", 5, 520, 3, "bfloat16", split_k(
        crafted(4, 520, 3, "bfloat16", 2, 1, (0, 3, 0), mma=True), 3)),
    # h in slices of K (planner: "Slices of K"): slices 0-1 in registers, 2 in shared memory
    "tensor cores, h in slices": lambda: ("lstm", 5, 768, 17, "bfloat16", in_slices(crafted(
        4, 768, 17, "bfloat16", 16, 8, (2, 1, 0), mma=True, sync="barrier"), 3)),
    "bidirectional, tensor cores, h in 3 slices": lambda: ("gru", 3, 700, 18, "float16",
                                                           in_slices(crafted(
        3, 700, 18, "float16", 32, 12, (2, 1, 0), mma=True, sync="barrier", directions=2), 3)),
    # a batch group a cluster (planner: "A cluster a group"): h put into each block's shared
    # memory, two slots of it
    "cluster": lambda: ("lstm", 5, 33, 3, "float32", crafted(4, 33, 3, "float32", 12, 2,
                                                             sync="cluster")),
    "cluster, batch groups, narrow chunks": lambda: ("gru", 6, 20, 6, "float16", crafted(
        3, 20, 6, "float16", 10, 2, groups=3, vec=1, sync="cluster")),
    "cluster, overlapped": lambda: ("lstm", 64, 70, 2, "float32", _overlapped(crafted(
        4, 70, 2, "float32", 24, 8, sync="cluster"), 4, 64, 2, 2)),
    "bidirectional, cluster, batch groups": lambda: ("gru", 7, 40, 4, "float32", crafted(
        3, 40, 4, "float32", 20, 2, groups=2, sync="cluster", directions=2)),
    # a padded batch (planner: "Padded batch"): the rows past N read zeros and write nothing
    "padded batch, tagged, batch groups": lambda: ("lstm", 5, 33, 5, "float32", padded(
        tagged(4, 33, 6, groups=2), 1)),
    "padded batch, local, fused, batch groups": lambda: ("gru", 37, 70, 3, "float32", padded(
        _fused(crafted(3, 70, 4, "float32", 70, 8, groups=2, sync="local"), 3, 37, 4, 8), 1)),
    "padded batch, overlapped, asynchronous copies": lambda: ("lstm", 64, 33, 3, "float32",
                                                              padded(_overlapped(crafted(
        4, 33, 4, "float32", 5, 2, groups=2), 4, 64, 4, 2), 1)),
    "padded batch, tensor cores, tiles of batch rows": lambda: ("gru", 5, 64, 19, "float16",
                                                                padded(crafted(
        3, 64, 21, "float16", 8, 3, mma=True, sync="barrier"), 2)),
}


def _slow(*names):
    """``names`` as parameters, those marked slow for the default run (2 cores): each kind of
    variant stays there once (tensor cores, barrier, lengths ... each in another test)."""
    return lambda values: [pytest.param(v, marks=pytest.mark.slow) if v in names else v
                           for v in values]


@pytest.mark.parametrize("name", _slow("overlapped, grid",
                                        "bidirectional, overlapped, staged x, batch groups",
                                        "bidirectional, tensor cores, h in 3 slices",
                                        "bidirectional, barrier, batch groups, K in three places",
                                        "overlapped, staged x, barrier", "fused, batch groups",
                                        "tensor cores, K split, shared memory",
                                        "tagged", "tensor cores, h in slices",
                                        "local, overlapped",
                                        "padded batch, local, fused, batch groups",
                                        "bidirectional, overlapped, asynchronous copies")(
    list(KERNELS)))
def test_kernel_variant_matches_reference(name, rng):
    """Every variant of the plan, as the interpreter runs its kernel, within the dtype's
    tolerance of float64 at T = 1 and 5 (over a group of the overlapped projection), with
    initial states."""
    cell, input_size, hidden, batch, dtype, p = KERNELS[name]()
    if name == "fused in slabs":
        assert p.input_slab > 0
    assert (p.sync == "local") == ("local" in name)
    assert (p.sync == "cluster") == ("cluster" in name)
    check_kernel(cell, p, input_size, hidden, batch, dtype, rng)


@pytest.mark.parametrize("name", _slow(
    "barrier, K in registers, shared and global memory",
    "bidirectional, barrier, batch groups, K in three places")([
        "tagged", "barrier, K in registers, shared and global memory",
        "batch groups", "tensor cores", "fused, odd C", "overlapped, staged x, barrier",
        "bidirectional, local", "bidirectional, overlapped, asynchronous copies",
        "local, batch groups, chunks of one element", "local, tensor cores, tiles",
        "bidirectional, overlapped, staged x, batch groups",
        "bidirectional, barrier, batch groups, K in three places",
        "padded batch, tagged, batch groups", "cluster", "bidirectional, cluster, batch groups"]))
def test_kernel_with_lengths_matches_reference(name, rng):
    """Samples of their own lengths: each pair keeps its states past its sample's length,
    publishes them, and writes zero to y (T = 1 and 5, lengths 1 to T)."""
    cell, input_size, hidden, batch, dtype, p = KERNELS[name]()
    check_kernel(cell, p, input_size, hidden, batch, dtype, rng, lengths=True)


@pytest.mark.parametrize("cell", persistent_cells())
def test_kernel_of_every_cell_matches_reference(cell, rng):
    """Each registered cell through the planner's own plan (batch groups, tagged words)."""
    gates = rnncc.cells.get(cell).gates
    p = planner.plan(gates, 33, 4, "float32", H100, len(rnncc.cells.get(cell).states),
                     batch_groups=None)
    check_kernel(cell, p, 6, 33, 4, "float32", rng)


def test_kernel_of_a_cell_whose_new_state_reads_the_previous_h(rng):
    """tests/data/coupled.py: c' reads the previous h. The kernel keeps the states in
    registers and stores the new ones in order, so c' must read h before h_t replaces it (it
    read h_t, relative error 0.56, before the kernel bound c' first)."""
    (cell,) = rnncc.cells.load_file(os.path.join(os.path.dirname(__file__), "data",
                                                 "coupled.py"))
    p = crafted(3, 40, 3, "float32", 5, 2)
    check_kernel(cell.name, p, 6, 40, 3, "float32", rng)


@pytest.mark.parametrize("name", ["tagged", "tensor cores", "fused, batch groups",
                                  "overlapped, asynchronous copies",
                                  "bidirectional, local"])
def test_kernel_of_a_cell_with_per_unit_parameters(name, rng):
    """The peephole LSTM, whose step reads its peephole weights (one register a pair and
    parameter, loaded once): LSTM-shaped plan variants, lengths included."""
    cell = rnncc.cells.get("peephole")
    lstm, input_size, hidden, batch, dtype, p = KERNELS[name]()
    assert lstm == "lstm"
    check_kernel(cell.name, p, input_size, hidden, batch, dtype, rng,
                 lengths=True)


@pytest.mark.parametrize("name", _slow("fused", "grid", "overlapped, barrier", "tagged")([
    "tagged", "local", "tensor cores", "fused", "bidirectional", "barrier, batch groups", "grid",
    "overlapped, barrier"]))
def test_kernel_of_a_step_that_takes_a_product_of_its_value(name, rng):
    """The GRU that resets before its product: each step evaluates the cell up to r * h,
    exchanges it as h is exchanged (tagged words, or plain and a second round of the barrier),
    multiplies the weights by it and then applies the cell (W_hn's rows the product), lengths
    included (T = 1 and 5)."""
    input_size, hidden, batch, dtype, p = {
        "tagged": lambda: (6, 33, 3, "float32", tagged(3, 33, 3)),
        "local": lambda: (6, 33, 3, "float32", planner.plan(3, 33, 3, "float32", H100, 1,
                                                             batch_groups=None)),
        "tensor cores": lambda: (6, 64, 3, "float16", crafted(3, 64, 3, "float16", 8, 3,
                                                              mma=True)),
        "fused": lambda: (37, 33, 3, "float32", _fused(crafted(3, 33, 3, "float32", 5, 2), 3,
                                                       37, 3, 8)),
        "bidirectional": lambda: (6, 33, 3, "float32", planner.plan(3, 33, 3, "float32", H100,
                                                                     1, directions=2)),
        "barrier, batch groups": lambda: (6, 33, 4, "float32", crafted(
            3, 33, 4, "float32", 5, 2, groups=2, sync="barrier")),
        "grid": lambda: (6, 33, 3, "float32", crafted(3, 33, 3, "float32", 5, 2, sync="grid")),
        "overlapped, barrier": lambda: (37, 40, 4, "float32", _overlapped(crafted(
            3, 40, 4, "float32", 5, 2, sync="barrier"), 3, 37, 4, 3)),
    }[name]()
    check_kernel("gru_reset_before", p, input_size, hidden, batch, dtype, rng, lengths=True)


@pytest.mark.parametrize("cell, name", [
    ("ln_lstm", name) for name in ("tagged", "local", "barrier, batch groups", "tensor cores")
] + [pytest.param("ln_lstm", name, marks=pytest.mark.slow) for name in (
    "tensor cores, more batch rows than threads", "bidirectional")] + [("ln_gru", "tagged")] + [
    pytest.param("ln_gru", name, marks=pytest.mark.slow) for name in (
    "barrier, batch groups", "tensor cores", "tensor cores, more batch rows than threads",
    "bidirectional")])
def test_kernel_of_a_step_that_takes_means(cell, name, rng):
    """The layer-normalised cells: a level of a step's means a round, a layer norm's variance
    in its mean's (their arguments exchanged as h is, summed over the row by every block; the
    mean's again for the variance), lengths included (T = 1 and 5)."""
    gates = rnncc.cells.get(cell).gates
    states = len(rnncc.cells.get(cell).states)
    input_size, hidden, batch, dtype, p = {
        "tagged": lambda: (6, 33, 3, "float32", tagged(gates, 33, 3)),
        "local": lambda: (6, 33, 3, "float32", planner.plan(gates, 33, 3, "float32", H100,
                                                             states, batch_groups=None)),
        "barrier, batch groups": lambda: (6, 33, 4, "float32", crafted(
            gates, 33, 4, "float32", 8, 2, groups=2, sync="barrier")),
        "tensor cores": lambda: (6, 64, 3, "float16", crafted(gates, 64, 3, "float16", 8,
                                                              gates, mma=True)),
        "tensor cores, more batch rows than threads": lambda: (6, 64, 40, "float16", crafted(
            gates, 64, 40, "float16", 2, 1, mma=True, sync="barrier", rows_per_warp=8)),
        "bidirectional": lambda: (6, 33, 3, "float32", planner.plan(
            gates, 33, 3, "float32", H100, states, directions=2)),
    }[name]()
    check_kernel(cell, p, input_size, hidden, batch, dtype, rng, lengths=True)


@pytest.mark.parametrize("cell, name", [("ln_gru", "tagged"), ("ln_lstm", "barrier")])
def test_kernel_takes_a_variance_exactly_far_from_zero(cell, name, rng):
    """A layer norm's variance where its values are far from 0 against their spread (b_hh
    300): each block's sums are about a value of the row (its first unit's), as exact as the
    two rounds of mean then variance (2-6e-5 here, the float32 sums' own rounding at 300),
    where a mean of squares less the square of the mean gave 4e-3 to 6e-2."""
    gates = rnncc.cells.get(cell).gates
    p = {"tagged": lambda: tagged(gates, 33, 3),
         "barrier": lambda: crafted(gates, 33, 4, "float32", 8, 2, groups=2, sync="barrier"),
         }[name]()
    check_kernel(cell, p, 6, 33, 4 if name == "barrier" else 3, "float32", rng, steps=(3,),
                 offset=300.0, tol=2e-4)


@pytest.mark.parametrize("cell, name", [
    ("ln_gru", "tagged"), ("ln_lstm", "barrier, batch groups"),
    pytest.param("ln_lstm", "tagged", marks=pytest.mark.slow),
    pytest.param("ln_gru", "bidirectional", marks=pytest.mark.slow),
    pytest.param("ln_lstm", "tensor cores", marks=pytest.mark.slow)])
def test_kernel_takes_means_from_each_blocks_sums(cell, name, rng):
    """``mean_partials``: a round exchanges each block's mean of its units' arguments and
    their squares about it (one word a block, not a unit), weighted by the block's units
    (the last block's fewer at H 33), summed about the block's own mean: against float64
    with lengths, and with b_hh 300 as exact as the units' values."""
    gates = rnncc.cells.get(cell).gates
    p = {"tagged": lambda: tagged(gates, 33, 3),
         "barrier, batch groups": lambda: crafted(gates, 33, 4, "float32", 8, 2, groups=2,
                                                  sync="barrier"),
         "bidirectional": lambda: tagged(gates, 33, 3, directions=2),
         "tensor cores": lambda: crafted(gates, 64, 3, "float16", 8, gates, mma=True)}[name]()
    p = dataclasses.replace(p, mean_partials=True)
    if p.mma:  # float16 on tensor cores, H 64 in blocks of 8 units
        check_kernel(cell, p, 6, 64, 3, "float16", rng, lengths=True)
        return
    assert p.group_blocks * p.units > 33  # a block of fewer units
    batch = 4 if "batch groups" in name else 3
    check_kernel(cell, p, 6, 33, batch, "float32", rng, lengths=True)
    check_kernel(cell, p, 6, 33, batch, "float32", rng, steps=(3,), offset=300.0, tol=2e-4)


def _many_norms_step(gi, gh, state):
    """Five layer norms of two values a unit that need none of each other: one round of ten
    exchanged vectors (more than a batch of tagged words holds)."""
    pairs = [(gi[0], gi[1]), (gh[0], gh[1]), (gi[0] * gh[0], gi[1]), (gi[0] + gh[1], gh[0]),
             (gi[1] * gi[1], gh[1])]
    total = None
    for a, b in pairs:
        x, y = ops.layer_norm([a, b])
        total = x - y if total is None else total + x * y
    return (ops.tanh(total + state[0]),)


def _many_norms_reference(gi, gh, state):
    from rnncc.cells.ln_lstm import layer_norm

    pairs = [(gi[0], gi[1]), (gh[0], gh[1]), (gi[0] * gh[0], gi[1]), (gi[0] + gh[1], gh[0]),
             (gi[1] * gi[1], gh[1])]
    total = None
    for a, b in pairs:
        x, y = np.split(layer_norm(np.concatenate([a, b], -1)), 2, -1)
        total = x - y if total is None else total + x * y
    return (np.tanh(total + state[0]),)


@pytest.mark.parametrize("name", ["tagged", "barrier"])
def test_kernel_takes_a_round_of_more_vectors_than_a_batch_of_words(name, rng):
    """A step of five independent layer norms: one round of ten vectors, staged in groups of
    :data:`exchange.WAIT_BATCH` (tagged) or in one loop (behind the barrier)."""
    from rnncc.cells._base import Cell

    cell = rnncc.cells.register(Cell(name="many_norms", gates=2, states=("h",),
                                     step=_many_norms_step, reference=_many_norms_reference,
                                     params=()), replace=True)
    try:
        levels, _ = one_round_levels(cell)
        assert len(levels) == 1 and len(levels[0]) == 10
        p = {"tagged": lambda: tagged(2, 33, 3),
             "barrier": lambda: crafted(2, 33, 3, "float32", 8, 2, sync="barrier")}[name]()
        assert p.sync == name
        check_kernel("many_norms", p, 6, 33, 3, "float32", rng, steps=(3,))
        check_kernel("many_norms", dataclasses.replace(p, mean_partials=True), 6, 33, 3,
                     "float32", rng, steps=(3,))
    finally:
        rnncc.cells.unregister("many_norms")


# -- one stage at a time --------------------------------------------------------------------

def run_stage(spec, body, args, preset=None, extra=None):
    """Run ``body(g, b, bx, tx, out)`` for every thread of every block of ``spec``'s plan on
    the interpreter: the stage calls it makes see the kernel's parameters ``g`` (arrays in
    ``args``, by name) and on-chip buffers ``b`` (``preset`` gives some starting values);
    ``extra`` declares further float32 parameters by name and shape (``out``, arrays in
    ``args`` too). The Simulator, whose ``chip`` holds the on-chip buffers after the run."""
    extra = extra or {}

    @T.prim_func(s_tir=True)
    def stage():
        g = T.meta_var(buffers.parameters(spec))
        out = T.meta_var(_declare(extra))
        with T.sblock("root"):
            b = T.meta_var(buffers.on_chip(spec))
            for bx in T.thread_binding(spec.plan.blocks, thread="blockIdx.x"):
                for tx in T.thread_binding(spec.plan.threads, thread="threadIdx.x"):
                    body(g, b, bx, tx, out)

    return Simulator(stage, args, preset).run()


def _declare(extra):
    out = {}
    for name, shape in extra.items():
        out[name] = T.match_buffer(T.arg(name, T.handle()), shape, "float32")
        IRBuilder.name(name, out[name])
    return out


def kernel_args(spec, steps):
    """NaN-filled arrays for every parameter of the kernel of ``spec``."""
    p, n, h, gh = spec.plan, spec.batch, spec.hidden, spec.gate_rows
    args = {"w": np.full((p.group_blocks, p.warps, p.warp_chunks, p.rows_per_warp, 32, p.vec),
                         np.nan, spec.dtype),
            "b_hh": np.full(gh, np.nan, spec.dtype), "y": np.full((steps, n, h), np.nan,
                                                                  spec.dtype)}
    if p.fused:
        args.update(x=np.full((steps, n, spec.input_size), np.nan, spec.dtype),
                    wi=np.full(buffers.input_weight_shape(p, spec.gates), np.nan, spec.dtype),
                    b_ih=np.full(gh, np.nan, spec.dtype),
                    xp=np.full((steps, n, gh), np.nan, np.float32))
    else:
        args["xp"] = np.full((steps, n, gh), np.nan, np.float32)
    for k in range(spec.states):
        args[f"s{k}"] = np.full((2, n, h), np.nan, np.float32)
        if spec.finals:
            args[f"s{k}_n"] = np.full((1, n, h), np.nan, spec.dtype)
    if spec.tagged:
        args["hw"] = np.zeros((2, n, h), np.uint64)
    elif not spec.local:
        args["cnt"] = np.zeros(p.batch_groups, np.uint32)
    if buffers.published_h(p, n, spec.dtype):
        shape, hx_dtype = buffers.published_h(p, n, spec.dtype)
        args["hx"] = np.full(shape, np.nan, hx_dtype)
    return args


def packed_w_hh(spec, w_hh):
    p = spec.plan
    out = np.zeros((p.group_blocks, p.warps, p.warp_chunks, p.rows_per_warp, 32, p.vec),
                   spec.dtype)
    return _llvm(comp.pack_persistent(spec.gates, spec.hidden, p, spec.dtype), w_hh, out)[1]


def block_rows(spec, w_hh, b):
    """The rows of W_hh that block ``b`` holds, [Wn*RW, H]: row r is W_hh[g*H + j] with g =
    r // U and j = b*U + r % U (zero outside)."""
    p = spec.plan
    out = np.zeros((p.warps * p.warp_rows, spec.hidden), np.float64)
    for r in range(min(spec.gates * p.units, len(out))):
        j = b % p.group_blocks * p.units + r % p.units
        if j < spec.hidden:
            out[r] = w_hh[r // p.units * spec.hidden + j]
    return out


def staged_h(spec, h):
    """h [N, H] as staged for the CUDA-core products, each block its group's rows:
    [blocks, N/NG * KP]."""
    p, n = spec.plan, spec.local_batch
    out = np.zeros((p.blocks, n, spec.width), np.float32)
    for b in range(p.blocks):
        group = b // p.group_blocks
        out[b, :, :spec.hidden] = h[group * n:(group + 1) * n]
    return out.reshape(p.blocks, -1)


@T.macro
def _record(spec, out, wv, bx, tx, i, read):
    for q in T.unroll(spec.plan.rows_per_warp):
        read(q)
        for v in T.vectorized(spec.plan.vec):
            out[bx, tx, i, q, v] = T.Cast("float32", wv[v])


PLACEMENTS = {
    "registers, shared, global": lambda: crafted(3, 300, 2, "float32", 40, 4, (1, 1, 1)),
    "shared, unrolled by 3": lambda: crafted(1, 300, 1, "float32", 40, 4, (0, 3, 0), unroll=3),
    "registers, batch groups": lambda: crafted(4, 64, 4, "float32", 8, 4, groups=2),
    "float16, shared": lambda: crafted(4, 300, 3, "float16", 4, 2, (1, 1, 0)),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_weights_stage_puts_every_chunk_where_its_readers_look(name, rng):
    """``load`` then ``each_chunk``: the chunk (i, row q) that lane l of warp w reads is
    W_hh's packed [block, w, i, q, l], from registers, shared memory or global memory alike;
    block b holds block b % (B/NG)'s."""
    p = PLACEMENTS[name]()
    spec = KernelSpec(p, 4, 1, p.units * p.blocks // p.batch_groups, 4, "float32"
                      if p.vec == 4 else "float16")
    args = kernel_args(spec, 1)
    args["w"] = rng.standard_normal(args["w"].shape).astype(spec.dtype)
    args["out"] = np.full((p.blocks, p.threads, p.chunks, p.rows_per_warp, p.vec), np.nan,
                          np.float32)

    def body(g, b, bx, tx, out):
        warp, lane, blk = tx // 32, tx % 32, spec.weights_of(bx)
        weights.load(spec, g.w, b.wreg, b.wsm, blk, warp, lane, tx)
        weights.each_chunk(spec, partial(_record, spec, out["out"], b.wv, bx, tx), b.wv,
                           b.wreg, b.wsm, g.w, blk, warp, lane)

    run_stage(spec, body, args, extra={"out": args["out"].shape})
    tx = np.arange(p.threads)
    for bx in range(p.blocks):
        expect = args["w"][bx % p.group_blocks][tx // 32, :, :, tx % 32]  # [T, KI, RW, VEC]
        np.testing.assert_array_equal(args["out"][bx], expect.astype(np.float32))


PRODUCTS = {  # gates, batch, plan
    "15 sums a lane, padded to 16": (3, 3, lambda: crafted(3, 300, 3, "float32", 40, 4,
                                                           (1, 1, 1))),
    "one sum a lane": (1, 1, lambda: crafted(1, 40, 1, "float32", 4, 4)),
    "32 sums a lane, batch groups": (4, 16, lambda: crafted(4, 64, 16, "float32", 8, 4,
                                                            groups=2)),
    "groups of 8 lanes, 2 sums a lane each": (3, 2, lambda: crafted(3, 30, 2, "float32", 30, 3,
                                                                   lane_groups=4)),
}


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_cuda_core_products_and_reduction(name, rng):
    """``cuda_cores.chunk`` over every chunk, the butterfly over the lanes and the sums into
    shared memory: hs[w*RW + q, n] is row w*RW + q of the block's W_hh rows by h[n]."""
    g, n, make = PRODUCTS[name]
    p = make()
    h = p.units * p.blocks // p.batch_groups
    spec = KernelSpec(p, g, 1, h, n, "float32")
    w_hh = rng.standard_normal((g * h, h)).astype(np.float32)
    hv = rng.standard_normal((n, h)).astype(np.float32)
    args = kernel_args(spec, 1)
    args["w"] = packed_w_hh(spec, w_hh)

    def body(gl, b, bx, tx, out):
        warp, lane, blk = tx // 32, tx % 32, spec.weights_of(bx)
        weights.load(spec, gl.w, b.wreg, b.wsm, blk, warp, lane, tx)
        cuda_cores.zero(spec, b.acc)
        weights.each_chunk(spec, partial(cuda_cores.chunk, spec, b.hs, b.hv, b.wv, b.acc, lane),
                           b.wv, b.wreg, b.wsm, gl.w, blk, warp, lane)
        reduction.butterfly(spec, b.acc, lane)
        reduction.store_sums(spec, b.hs, b.acc, warp, lane)

    sim = run_stage(spec, body, args, preset={"hs": staged_h(spec, hv)})
    _check_sums(spec, sim.chip["hs"], w_hh, hv, rtol=1e-5)


def _check_sums(spec, hs, w_hh, hv, rtol):
    """Each block's gate sums in ``hs`` [Wn*RW, N/NG] against its W_hh rows by h."""
    p, n = spec.plan, spec.local_batch
    rows = p.warps * p.warp_rows
    for b in range(p.blocks):
        group = b // p.group_blocks
        expect = block_rows(spec, w_hh, b) @ hv[group * n:(group + 1) * n].astype(np.float64).T
        got = hs[b, :rows * n].reshape(rows, n)
        np.testing.assert_allclose(got, expect, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("batch, groups, dtype", [
    (3, 1, "float16"), (16, 2, "float16"), (5, 1, "bfloat16"), (9, 1, "float16"),
    (16, 1, "bfloat16"), (37, 1, "float16"), (64, 1, "float16"), (96, 2, "bfloat16"),
    (9, 1, "tf32"), (40, 2, "tf32")])
def test_tensor_core_products(batch, groups, dtype, rng):
    """h staged in fragments (``tensor_cores.store_h`` through the exchange's staging), then
    ``chunk`` as mma.sync over every chunk (registers and shared memory) and the chains' sums
    into shared memory: the block's W_hh rows by h rounded to the weights' type (float32
    weights: both rounded to TF32). Half a tile (up to 8 batch rows a group) and tiles of 16
    (a partial last one)."""
    tf32 = dtype == "tf32"
    dtype = "float32" if tf32 else dtype
    p = crafted(4, 300, batch, dtype, 4, 2, (2, 1, 0) if tf32 else (1, 1, 0), groups=groups,
                mma=True, sync="barrier")
    spec = KernelSpec(p, 4, 1, 300, batch, dtype)
    w_hh = rng.standard_normal((4 * 300, 300)).astype(dtype)
    hv = rng.standard_normal((batch, 300)).astype(np.float32)
    args = kernel_args(spec, 1)
    args["w"] = packed_w_hh(spec, w_hh)
    args["s0"][0] = hv

    def body(g, b, bx, tx, out):
        warp, lane, blk = tx // 32, tx % 32, spec.weights_of(bx)
        weights.load(spec, g.w, b.wreg, b.wsm, blk, warp, lane, tx)
        tensor_cores.prepare(spec, b.hs16, b.af, tx)
        exchange.stage_h(spec, g.s[0], g.hw, b.tv,
                         partial(tensor_cores.store_h, spec, b.hs16, 0), 0, bx, tx)
        tensor_cores.zero(spec, b.dacc)
        weights.each_chunk(spec, partial(tensor_cores.chunk, spec, b.hs16, b.af, b.wb, b.wv,
                                         b.dacc, lane), b.wv, b.wreg, b.wsm, g.w, blk, warp,
                           lane)
        tensor_cores.store_sums(spec, b.hs, b.dacc, warp, lane)

    sim = run_stage(spec, body, args)
    if tf32:
        _check_sums(spec, sim.chip["hs"], round_tf32(w_hh), round_tf32(hv), 1e-4)
    else:
        _check_sums(spec, sim.chip["hs"], w_hh.astype(np.float32), hv.astype(dtype), 1e-4)


@pytest.mark.parametrize("sync", ["tagged", "barrier"])
def test_exchange_stages_h_as_published(sync, rng):
    """Step 3 stages h_2 (slot 1): from the tagged words of step 3, or the states' buffer
    read past L1; zeros past H; each block its batch group's rows."""
    p = crafted(3, 40, 6, "float32", 5, 2, groups=2, sync=sync)
    spec = KernelSpec(p, 3, 1, 40, 6, "float32")
    hv = rng.standard_normal((6, 40)).astype(np.float32)
    args = kernel_args(spec, 1)
    if sync == "tagged":
        args["hw"][1] = (np.uint64(3) << np.uint64(32)) | hv.view(np.uint32).astype(np.uint64)
    else:
        args["s0"][1] = hv

    def body(g, b, bx, tx, out):
        exchange.stage_h(spec, g.s[0], g.hw, b.tv, partial(cuda_cores.store_h, spec, b.hs, 0), 3,
                         bx, tx)

    sim = run_stage(spec, body, args)
    staged = staged_h(spec, hv)
    np.testing.assert_array_equal(sim.chip["hs"][:, :staged.shape[1]], staged)
    if sync == "tagged":  # a word of another step is waited on, never taken
        args["hw"][1, 4, 7] = np.uint64(2) << np.uint64(32)
        with pytest.raises(Deadlock, match="tag is not step 3"):
            run_stage(spec, body, args)


@pytest.mark.parametrize("batch, dtype", [(6, "float16"), (40, "bfloat16"), (20, "float16")])
def test_exchange_copies_h_as_published(batch, dtype, rng):
    """The barriers' staging after step 0 on tensor cores in 16 bits: each block publishes its
    pairs' h_2 where step 3 copies it from (``hx``, NaN before; the elements none publishes
    zeroed by each group's first block), and the copy stages exactly what staging h_2 element
    by element from the states' buffer does: 2 batch groups, H = 40 short of KP, half a tile
    (3 rows a group) and tiles (20, 10 rows)."""
    p = crafted(3, 40, batch, dtype, 5, 2, groups=2, sync="barrier", mma=True,
                rows_per_warp=8)
    spec = KernelSpec(p, 3, 1, 40, batch, dtype)
    store_h = tensor_cores.store_h
    args = kernel_args(spec, 1)
    args["s0"][:] = rng.standard_normal((batch, 40)).astype(np.float32)

    def by_element(g, b, bx, tx, out):
        tensor_cores.prepare(spec, b.hs16, b.af, tx)
        exchange.stage_h(spec, g.s[0], g.hw, b.tv, partial(store_h, spec, b.hs16, 0), 3, bx,
                         tx)

    def copied(g, b, bx, tx, out):
        published = partial(store_h, spec, g.hx)
        exchange.zero_unpublished(spec, published, bx, tx)
        for it in range(p.items):
            valid, n, j = spec.pair(it, bx, tx)
            with T.If(valid):
                with T.Then():
                    row = spec.state_row(bx, n)
                    exchange.publish(spec, g.s[0], g.hw, 2, g.s[0][0, row, j], row, j,
                                     published=published)
        exchange.stage_h(spec, g.s[0], g.hw, b.tv, partial(store_h, spec, b.hs16, 0), 3, bx,
                         tx, g.hx, b.hs16)

    expect = run_stage(spec, by_element, {k: v.copy() for k, v in args.items()}).chip["hs16"]
    got = run_stage(spec, copied, args).chip["hs16"]
    assert not np.isnan(got[:, :spec.staged_size]).any()
    np.testing.assert_array_equal(got[:, :spec.staged_size], expect[:, :spec.staged_size])


@pytest.mark.parametrize("sync", ["tagged", "barrier", "grid"])
def test_exchange_publishes_h_and_counts_arrivals(sync):
    """``publish``: h_t into slot (t+1) % 2 of the states' buffer and, tagged, as the word of
    step t + 1; the counter barrier counts every block of a group once a step (a wait for a
    count never reached is a deadlock)."""
    p = crafted(3, 40, 4, "float32", 5, 2, groups=2, sync=sync)
    spec = KernelSpec(p, 3, 1, 40, 4, "float32")
    args = kernel_args(spec, 1)

    def body(g, b, bx, tx, out):
        valid, n, j = spec.pair(0, bx, tx)
        with T.If(valid):
            with T.Then():
                exchange.publish(spec, g.s[0], g.hw, 4, T.Cast("float32", j) + T.float32(0.5),
                                 spec.batch_row(bx, n), j)
        exchange.arrive_and_wait(spec, g.cnt, 0, bx, tx)

    run_stage(spec, body, args)
    expect = np.broadcast_to(np.arange(40, dtype=np.float32) + 0.5, (4, 40))
    np.testing.assert_array_equal(args["s0"][1], expect)
    if sync == "tagged":
        words = (np.uint64(5) << np.uint64(32)) | expect.view(np.uint32).astype(np.uint64)
        np.testing.assert_array_equal(args["hw"][1], words)
    elif sync == "barrier":  # step 0: every block of each group arrived once
        np.testing.assert_array_equal(args["cnt"], [p.group_blocks] * 2)
        with pytest.raises(Deadlock, match="stays under"):  # step 1's wait, with no arrival
            run_stage(spec, lambda g, b, bx, tx, out: exchange.wait(spec, g.cnt, 1, bx, tx),
                      args)


def _cell_stage_run(cell, rng, batch=5, hidden=33, dtype="float32"):
    """The cell stage on one step: constants, per-unit parameters and initial states in, the
    step's input projections prefetched, the gate sums preset where the products leave them;
    y, h_1 published and the final states (written by the kernel), against the cell's
    float64 reference."""
    g, s_count = cell.gates, len(cell.states)
    p = crafted(g, hidden, batch, dtype, 5, 2)
    spec = KernelSpec(p, g, s_count, hidden, batch, dtype, params=len(cell.params),
                      finals=True)
    args = kernel_args(spec, 1)
    xp = rng.standard_normal((batch, g * hidden)).astype(np.float32)
    b_hh = rng.standard_normal(g * hidden).astype(dtype)
    params = [rng.standard_normal(hidden).astype(dtype) for _ in cell.params]
    args.update({f"p{k}": v for k, v in enumerate(params)})
    states = [rng.standard_normal((batch, hidden)).astype(np.float32) for _ in cell.states]
    gh = rng.standard_normal((batch, g * hidden)).astype(np.float32)  # W_hh h, without b_hh
    args.update(xp=xp[None], b_hh=b_hh)
    for k, value in enumerate(states):
        args[f"s{k}"][0] = value
    sums = np.zeros((p.blocks, p.warps * p.rows_per_warp * batch), np.float32)
    for b in range(p.blocks):  # hs: row g*U + u, batch row n
        for r in range(g * p.units):
            j = b * p.units + r % p.units
            if j < hidden:
                sums[b, r * batch:(r + 1) * batch] = gh[:, r // p.units * hidden + j]

    def body(gl, b, bx, tx, out):
        cell_stage.load_constants(spec, gl.b_hh, gl.s, gl.lengths, b.bh, b.st, b.ln, bx, tx,
                                  gl.params, b.pv)
        cell_stage.prefetch(spec, gl.xp, b.gi, b.ln, 0, 1, bx, tx)
        cell_stage.apply(spec, cell, gl.y, b.hs, b.gi, b.bh, b.st, b.ln,
                         partial(exchange.publish, spec, gl.s[0], gl.hw, 0), 0, 1, bx, tx,
                         pv=b.pv)
        cell_stage.store_final_states(spec, gl.s, gl.finals, b.st, 1, bx, tx)

    run_stage(spec, body, args, preset={"hs": sums})
    parts = [slice(i * hidden, (i + 1) * hidden) for i in range(g)]
    gh64 = gh.astype(np.float64) + b_hh.astype(np.float64)
    expect = cell.reference_step([xp[:, s].astype(np.float64) for s in parts],
                                 [gh64[:, s] for s in parts],
                                 [v.astype(np.float64) for v in states],
                                 [v.astype(np.float64) for v in params])
    tol = TOL[dtype]
    assert reference.relative_error(args["y"][0], expect[0]) < tol
    for k, value in enumerate(expect):
        assert reference.relative_error(args[f"s{k}_n"][0], value) < tol
    word = args["hw"][1]
    assert (word >> np.uint64(32) == 1).all()  # h_1 published as the word of step 1
    np.testing.assert_array_equal((word & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(
        np.float32), args["s0"][1])


@pytest.mark.parametrize("cell", persistent_cells())
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cell_stage_of_every_cell(cell, dtype, rng):
    _cell_stage_run(rnncc.cells.get(cell), rng, dtype=dtype)


def test_cell_stage_binds_a_new_state_that_reads_a_previous_one(rng):
    (cell,) = rnncc.cells.load_file(os.path.join(os.path.dirname(__file__), "data",
                                                 "coupled.py"))
    _cell_stage_run(cell, rng)


PROJECTIONS = {
    "resident, odd C": lambda: _fused(crafted(3, 33, 2, "float32", 5, 2), 3, 37, 2, 8),
    "slabs through W_hh's shared memory": lambda: _fused(
        crafted(3, 33, 2, "float32", 5, 2, (0, 1, 0)), 3, 200, 2, None, SMALL_SMEM),
    "batch groups": lambda: _fused(crafted(4, 40, 6, "float32", 5, 2, groups=3), 4, 33, 6, 8),
    "overlapped, copies": lambda: _overlapped(crafted(4, 33, 2, "float32", 5, 2), 4, 64, 2, 2),
    "overlapped, staged": lambda: _overlapped(crafted(3, 40, 4, "float32", 5, 2), 3, 37, 4, 3),
}


@pytest.mark.parametrize("name", list(PROJECTIONS))
@pytest.mark.parametrize("steps", [1, 7])
def test_input_projection_stage(name, steps, rng):
    """Before the loop, and overlapped each step's slab: xp = x W_ih^T + b_ih for every step
    and batch row, groups of rows of x that pass T*N included."""
    p = PROJECTIONS[name]()
    g = {"resident, odd C": 3, "slabs through W_hh's shared memory": 3,
         "overlapped, staged": 3}.get(name, 4)
    c = {"resident, odd C": 37, "slabs through W_hh's shared memory": 200, "batch groups": 33,
         "overlapped, copies": 64, "overlapped, staged": 37}[name]
    hidden, batch = (40, 6) if name == "batch groups" else (40, 4) if "staged" in name else (33, 2)
    spec = KernelSpec(p, g, 1, hidden, batch, "float32", input_size=c)
    args = kernel_args(spec, steps)
    w_ih = rng.standard_normal((g * hidden, c)).astype(np.float32)
    args["x"] = rng.standard_normal((steps, batch, c)).astype(np.float32)
    args["b_ih"] = rng.standard_normal(g * hidden).astype(np.float32)
    shape = buffers.input_weight_shape(p, g)
    args["wi"] = _llvm(comp.pack_fused_input(g, hidden, c, shape, p, "float32"), w_ih,
                       np.zeros(shape, np.float32))[1]

    def body(gl, b, bx, tx, out):
        io, warp, lane = buffers.projection(gl, b), tx // 32, tx % 32
        input_projection.before_loop(spec, io, gl.T_len, warp, lane, bx, tx)
        if p.input_steps:
            with T.serial(0, gl.T_len) as t:
                input_projection.start_copies(spec, io, t, gl.T_len, bx, tx)
                input_projection.wait_copies(spec)
                input_projection.in_loop(spec, io, t, gl.T_len, warp, lane, bx, tx)

    run_stage(spec, body, args)
    expect = args["x"].astype(np.float64) @ w_ih.T.astype(np.float64) + args["b_ih"]
    np.testing.assert_allclose(args["xp"], expect, rtol=1e-5, atol=1e-5)


# -- training: the forward that keeps, the backward kernel ------------------------------------

@pytest.mark.parametrize("name", ["tagged", "batch groups", "tensor cores",
                                  "overlapped, staged x, barrier", "tensor cores, h in slices"])
def test_training_forward_keeps_every_steps_states_and_parts(name, rng):
    """With ``kept`` the kernel also stores the states of every step (the initial ones first)
    and the parts of each step's projections the backward pass takes (for GRU's n gate gi and
    gh apart), as the float64 step computes them, with random lengths (states past a sample's
    length are the last ones)."""
    cell, input_size, hidden, batch, dtype, p = KERNELS[name]()
    cell = rnncc.cells.get(cell)
    if p.fused:  # the training forward runs the input GEMM before the kernel
        p = dataclasses.replace(p, input_rows=0, input_chunks=0, input_slab=0, input_steps=0)
    kept = kept_parts(cell)
    steps = 4
    weights = {k: v.astype(dtype) for k, v in
               random_weights(rng, cell.gates, input_size, hidden).items()}
    x = rng.standard_normal((steps, batch, input_size)).astype(dtype)
    initial = {s: rng.standard_normal((1, batch, hidden)).astype(dtype) for s in cell.states}
    ln = rng.integers(1, steps + 1, batch)
    ln[0], ln[-1] = 1, steps
    y, _, kept_states, pre = simulate(cell, p, x, weights, initial, dtype, ln, kept)
    f64 = {k: v.astype(np.float64) for k, v in weights.items()}
    graph, backend, h = autodiff.trace(cell), autodiff.NumPy(), hidden
    states = [initial[s][0].astype(np.float64) for s in cell.states]
    for t in range(steps):
        assert max(reference.relative_error(kept_states[k][t], states[k])
                   for k in range(len(states))) < TOL[dtype]
        gi = x[t].astype(np.float64) @ f64["weight_ih_l0"].T + f64["bias_ih_l0"]
        gh = states[0] @ f64["weight_hh_l0"].T + f64["bias_hh_l0"]
        gis = [gi[:, g * h:(g + 1) * h] for g in range(cell.gates)]
        ghs = [gh[:, g * h:(g + 1) * h] for g in range(cell.gates)]
        parts = {"sum": [i + j for i, j in zip(gis, ghs)], "gi": gis, "gh": ghs}
        want = np.concatenate([parts[part][g] for g, part in kept], axis=1)
        assert reference.relative_error(pre[t], want) < TOL[dtype], f"step {t}"
        value = autodiff.forward(graph, gis + ghs + states, backend)
        live = (t < ln)[:, None]
        states = [np.where(live, value[id(o)], s) for o, s in zip(graph.outputs, states)]
    assert max(reference.relative_error(kept_states[k][steps], states[k])
               for k in range(len(states))) < TOL[dtype]


@pytest.mark.parametrize("cell_name, name", [
    ("ln_lstm", "tagged"), ("ln_gru", "barrier, batch groups"),
    ("gru_reset_before", "tagged"), ("gru_reset_before", "barrier, batch groups"),
    pytest.param("ln_gru", "tagged, block sums", marks=pytest.mark.slow)])
def test_training_forward_of_a_step_that_reduces_keeps_its_states_and_parts(
        cell_name, name, rng):
    """The training forward on the persistent kernel of the layer-normalised cells (their
    rounds of means as in inference) and of a step that takes a recurrent product of a value
    (its second round): y, every step's states and the projections' parts the backward pass
    takes (the product's value among them), against float64 with random lengths."""
    cell = rnncc.cells.get(cell_name)
    gates = cell.gates
    p = {"tagged": lambda: tagged(gates, 33, 4),
         "barrier, batch groups": lambda: crafted(gates, 33, 4, "float32", 8, 2, groups=2,
                                                  sync="barrier"),
         "tagged, block sums": lambda: dataclasses.replace(tagged(gates, 33, 4),
                                                           mean_partials=True),
         }[name]()
    kept, steps, batch, h = kept_parts(cell), 4, 4, 33
    weights = {k: v.astype("float32") for k, v in
               random_weights(rng, gates, 6, h, params=cell.params).items()}
    x = rng.standard_normal((steps, batch, 6)).astype("float32")
    initial = {s: rng.standard_normal((1, batch, h)).astype("float32") for s in cell.states}
    ln = rng.integers(1, steps + 1, batch)
    ln[0], ln[-1] = 1, steps
    y, _, kept_states, pre = simulate(cell, p, x, weights, initial, "float32", ln, kept)
    ref_y, _ = reference.run_module(cell, x, weights, 1, 1, initial, ln)
    assert reference.relative_error(y, ref_y) < TOL["float32"]
    f64 = {k: v.astype(np.float64) for k, v in weights.items()}
    for t in range(steps + 1):
        found = ({s: initial[s][0] for s in cell.states} if t == 0 else {
            s: v[0] for s, v in reference.run_module(cell, x[:t], weights, 1, 1, initial,
                                                     np.minimum(ln, t))[1].items()})
        for k, s in enumerate(cell.states):
            assert reference.relative_error(kept_states[k][t], found[s]) < TOL["float32"], t
        if t == steps:
            break
        gi = x[t].astype(np.float64) @ f64["weight_ih_l0"].T + f64["bias_ih_l0"]
        gh = found[cell.states[0]] @ f64["weight_hh_l0"].T + f64["bias_hh_l0"]
        graph = autodiff.trace(cell)
        values = autodiff.forward(graph, [gi[:, g * h:(g + 1) * h] for g in range(gates)] + [
            gh[:, g * h:(g + 1) * h] for g in range(gates)] + [found[s] for s in cell.states] + [
            np.broadcast_to(f64[f"{name}_l0"], (batch, h)) for name in cell.params],
            autodiff.NumPy(f64["weight_hh_l0"], f64["bias_hh_l0"]))
        parts = {"sum": gi + gh, "gi": gi, "gh": gh}
        want = np.concatenate([values[id(graph.products[g])] if part == "product" else
                               parts[part][:, g * h:(g + 1) * h] for g, part in kept], axis=1)
        assert reference.relative_error(pre[t], want) < TOL["float32"], f"step {t}"


# -- the backward kernel ----------------------------------------------------------------------

def backward_reference(cell, kept, pre, states, w_hh, dy, d_final, lengths, params=()):
    """dGI, dGH [T, N, G*H], the initial states' gradients, the per-unit parameters' (of
    ``params`` [H] each) summed over the steps [N, H] each and, for each recurrent product of
    a value the step takes, the gradient of its value and its argument [T, N, H] each, in
    float64: the steps backwards, the cell's derivative (autodiff, NumPy) from the kept parts
    ``pre`` and the previous states, dh through the recurrence dGH_t W_hh."""
    graph, backend = autodiff.trace(cell), autodiff.NumPy(w_hh, np.zeros(len(w_hh)))
    steps, n, h = dy.shape
    g = cell.gates
    carry = [d[0] for d in d_final]
    rec = np.zeros((n, h))
    dgi, dgh = np.zeros((steps, n, g * h)), np.zeros((steps, n, g * h))
    sums = [np.zeros((n, h)) for _ in params]
    gates = autodiff.product_gates(graph)
    products = [(np.zeros((steps, n, h)), np.zeros((steps, n, h))) for _ in gates]
    for t in reversed(range(steps)):
        found = {}
        proj, prev, of_params = autodiff.kept_vjp(
            graph, kept, lambda i, t=t: pre[t][:, i * h:(i + 1) * h], [s[t] for s in states],
            [dy[t] + rec + carry[0]] + carry[1:], backend, [np.broadcast_to(v, (n, h))
                                                            for v in params], found)
        live = (t < np.asarray(lengths))[:, None] if lengths is not None else np.True_
        for k, gate in enumerate(gates):  # dP: gi's gradient (p is summed with gi)
            products[k][0][t] = np.where(live, proj[gate], 0.0)
            products[k][1][t] = found[k]
        proj = [np.where(live, v, 0.0) for v in proj]
        sums = [s + np.where(live, v, 0.0) for s, v in zip(sums, of_params)]
        carry = [np.where(live, v, p) for v, p in zip(prev, [rec + carry[0]] + carry[1:])]
        dgi[t] = np.concatenate(proj[:g], axis=1)
        dgh[t] = np.concatenate(proj[g:] or proj[:g], axis=1)
        rec = dgh[t] @ w_hh
    return dgi, dgh, [carry[0] + rec] + carry[1:], sums, products


def check_backward_kernel(cell_name, p, hidden, batch, dtype, rng, steps=(1, 5), lengths=False):
    """The backward kernel of plan ``p`` on the interpreter against
    :func:`backward_reference`, on random kept values, dy, final gradients and per-unit
    parameters (where the cell has them)."""
    cell = rnncc.cells.get(cell_name)
    count = len(cell.params)
    g, h, n, kept = cell.gates, hidden, batch, kept_parts(cell)
    summed = all(which == "sum" for _, which in kept)
    shape = (p.group_blocks, p.warps, p.warp_chunks, p.rows_per_warp, 32, p.vec)
    w_hh = (rng.standard_normal((g * h, h)) / np.sqrt(h)).astype(dtype)
    w = _llvm(comp.pack_persistent(g, h, p, dtype, transposed=True), w_hh,
              np.zeros(shape, dtype))[1]
    for t_len in steps:
        pre = rng.standard_normal((t_len, n, len(kept) * h)).astype(np.float32)
        states = [rng.standard_normal((t_len + 1, n, h)).astype(np.float32) for _ in cell.states]
        dy = rng.standard_normal((t_len, n, h)).astype(dtype)
        d_final = [rng.standard_normal((1, n, h)).astype(dtype) for _ in cell.states]
        ln = None
        if lengths:
            ln = rng.integers(1, t_len + 1, n)
            ln[0], ln[-1] = 1, t_len
        args = {"w": w, "pre": pre.copy(), "dy": dy}
        if buffers.published_h(p, n, dtype):  # zeros, as the entry leaves it
            shape, hx_dtype = buffers.published_h(p, n, dtype)
            args["hx"] = np.zeros(shape, hx_dtype)
        else:
            args["xch"] = np.zeros((2, n, g * h), np.float32)
            args["xch"][1] = np.nan
        grads = projection_grad_dtype(dtype)
        if summed and grads == "float32":  # dGI written over the sums, as the entry has it
            args["dgi"] = args["pre"]
        else:  # a half layer's in its dtype
            args["dgi"] = np.full((t_len, n, g * h), np.nan, grads)
            if not summed:
                args["dgh"] = np.full((t_len, n, g * h), np.nan, grads)
        for k in range(len(cell.states)):
            args[f"s{k}_steps"] = states[k]
            args[f"d{k}_n"] = d_final[k]
            args[f"d{k}_0"] = np.full((1, n, h), np.nan, dtype)
        if p.sync == "tagged":
            args["hw"] = _llvm(comp.init_persistent(1, 1, n, g * h, "float32", "float32", 1,
                                                    EMPTY_TAG, zero_h=True),
                               np.zeros((2, n, g * h), np.float32),
                               np.zeros((2, n, g * h), np.uint64))[1]
        elif p.sync != "local":
            args["cnt"] = np.zeros(p.batch_groups, np.uint32)
        if ln is not None:
            args["lengths"] = ln.astype(np.int32)
        params = [rng.standard_normal(h).astype(dtype) for _ in range(count)]
        args.update({f"p{k}": v for k, v in enumerate(params)})
        if count:
            args["dps"] = np.full((count, n, h), np.nan, np.float32)
        taken = autodiff.product_gates(autodiff.trace(cell))
        for k in range(len(taken)):
            args[f"dprod{k}"] = np.full((t_len, n, h), np.nan, np.float32)
            args[f"parg{k}"] = np.full((t_len, n, h), np.nan, np.float32)
        func = backward_kernel.kernel(autodiff.trace(cell), kept, h, n, p, dtype, ln is not None)
        Simulator(func, args).run()
        f64 = [a.astype(np.float64) for a in states]
        dgi, dgh, d0, dps, products = backward_reference(
            cell, kept, pre.astype(np.float64), f64, w_hh.astype(np.float64),
            dy.astype(np.float64), [d.astype(np.float64) for d in d_final], ln,
            [v.astype(np.float64) for v in params])
        errors = [reference.relative_error(args["dgi"], dgi)]
        errors += [] if summed else [reference.relative_error(args["dgh"], dgh)]
        errors += [reference.relative_error(args[f"d{k}_0"], d0[k])
                   for k in range(len(cell.states))]
        errors += [reference.relative_error(args["dps"][k], dps[k]) for k in range(count)]
        errors += [reference.relative_error(args[f"{a}{k}"], want) for k, pair in
                   enumerate(products) for a, want in zip(("dprod", "parg"), pair)]
        assert max(errors) < TOL[dtype], f"T={t_len}: relative errors {errors}"


BACKWARD_KERNELS = {
    "tagged": lambda: ("lstm", 33, 3, "float32", crafted(1, 33, 3, "float32", 12, 2,
                                                         width=132, sync="tagged")),
    "local, planned": lambda: ("lstm", 33, 3, "float32", planner.backward(
        4, 33, 3, "float32", H100, 2, batch_groups=1)),
    "local, chunks of two elements": lambda: ("gru", 20, 3, "float16", crafted(
        1, 20, 3, "float16", 20, 2, width=60, vec=2, sync="local")),
    "local, tensor cores, tiles": lambda: ("lstm", 16, 20, "float16", crafted(
        1, 16, 20, "float16", 16, 2, width=64, sync="local", mma=True, rows_per_warp=8)),
    "local, lane groups": lambda: ("gru", 20, 3, "float16", crafted(
        1, 20, 3, "float16", 20, 2, width=60, lane_groups=4, sync="local")),
    "barrier, K in registers and shared memory": lambda: (
        "gru", 50, 2, "float32", crafted(1, 50, 2, "float32", 8, 2, (1, 1, 0), width=150,
                                         sync="barrier")),
    "shared-memory chunks unrolled, grid": lambda: (
        "rnn_tanh", 150, 1, "float32", crafted(1, 150, 1, "float32", 40, 4, (0, 2, 0),
                                               width=150, sync="grid", unroll=2)),
    "batch groups": lambda: ("lstm", 24, 4, "float32", crafted(
        1, 24, 4, "float32", 5, 2, groups=2, width=96, sync="barrier")),

    "float16": lambda: ("gru", 30, 2, "float16", crafted(1, 30, 2, "float16", 7, 2, width=90,
                                                         sync="barrier")),
    "tensor cores, half a tile": lambda: ("lstm", 32, 3, "bfloat16", crafted(
        1, 32, 3, "bfloat16", 16, 2, width=128, sync="barrier", mma=True, rows_per_warp=8)),
    "tensor cores, tiles": lambda: ("gru", 24, 20, "float16", crafted(
        1, 24, 20, "float16", 8, 1, width=72, sync="barrier", mma=True, rows_per_warp=8)),
    # below, K = G*H reaches every part's chunks: each part's products count
    "tensor cores, K split among warps": lambda: ("lstm", 256, 3, "bfloat16", split_k(crafted(
        1, 256, 3, "bfloat16", 16, 2, width=1024, sync="barrier", mma=True, rows_per_warp=8), 4)),
    "tensor cores, tiles, K split": lambda: ("gru", 160, 20, "float16", split_k(crafted(
        1, 160, 20, "float16", 16, 2, width=480, sync="barrier", mma=True, rows_per_warp=8), 2)),
    # dGH staged in slices of K, each slice a chunk of each part (planner: "Slices of K")
    "tensor cores, tiles, K split, in slices": lambda: ("lstm", 256, 20, "bfloat16", in_slices(
        split_k(crafted(1, 256, 20, "bfloat16", 16, 2, width=1024, sync="barrier", mma=True,
                        rows_per_warp=8), 2), 2)),
    "tensor cores, tiles, 4 slices": lambda: ("gru", 300, 10, "float16", in_slices(crafted(
        1, 300, 10, "float16", 32, 4, width=900, sync="barrier", mma=True, rows_per_warp=8), 4)),
    "tensor cores, planned": lambda: ("lstm", 256, 12, "bfloat16", planner.backward(
        4, 256, 12, "bfloat16", H100, 2, mma=True, max_blocks=8)),
}


@pytest.mark.parametrize("name", _slow("tensor cores, tiles", "tensor cores, tiles, K split",
                                        "tensor cores, K split among warps",
                                        "tensor cores, tiles, 4 slices")(
    list(BACKWARD_KERNELS)))
def test_backward_kernel_matches_reference(name, rng):
    """Every variant of a backward plan, on the interpreter: dGI (dGH) of every step and the
    initial states' gradients within the dtype's tolerance of float64 at T = 1 and 5."""
    cell, hidden, batch, dtype, p = BACKWARD_KERNELS[name]()
    check_backward_kernel(cell, p, hidden, batch, dtype, rng)


@pytest.mark.parametrize("name", ["tagged", "local, planned",
                                  "barrier, K in registers and shared memory", "batch groups"])
def test_backward_kernel_with_lengths_matches_reference(name, rng):
    """Past its sample's length a pair's projections get no gradient and its states' pass
    through (lengths 1 to T)."""
    cell, hidden, batch, dtype, p = BACKWARD_KERNELS[name]()
    check_backward_kernel(cell, p, hidden, batch, dtype, rng, lengths=True)


@pytest.mark.parametrize("name", ["local, planned", "batch groups"])
def test_backward_kernel_of_a_cell_with_per_unit_parameters(name, rng):
    """The peephole LSTM: the parameters' gradients summed over the steps (a batch row each)
    and the other gradients through them, lengths 1 to T."""
    cell = rnncc.cells.get("peephole")
    lstm, hidden, batch, dtype, p = BACKWARD_KERNELS[name]()
    assert lstm == "lstm"
    check_backward_kernel(cell.name, p, hidden, batch, dtype, rng, lengths=True)


THREE_GATES = {  # backward plans of GRUs, as BACKWARD_KERNELS' of LSTMs
    "tagged, three gates": lambda: ("gru", 33, 3, "float32", crafted(
        1, 33, 3, "float32", 12, 2, width=99, sync="tagged")),
    "batch groups, three gates": lambda: ("gru", 24, 4, "float32", crafted(
        1, 24, 4, "float32", 6, 2, groups=2, width=72, sync="barrier")),
}


@pytest.mark.parametrize("name, lengths", [
    ("barrier, K in registers and shared memory", True), ("tagged, three gates", True),
    ("local, chunks of two elements", False), ("tensor cores, tiles", True),
    pytest.param("batch groups, three gates", True, marks=pytest.mark.slow),
    pytest.param("tensor cores, tiles, K split", False, marks=pytest.mark.slow)])
def test_backward_kernel_of_a_step_that_takes_a_product_of_a_value(name, lengths, rng):
    """The GRU that resets before its product: two exchanges a step (dP, then dGH), W_hn^T dP
    through the second product; dGI, dGH, the initial state's gradient and, for W_hn's
    gradient, dP and the product's argument r * h of every step, lengths 1 to T."""
    gru, hidden, batch, dtype, p = {**BACKWARD_KERNELS, **THREE_GATES}[name]()
    assert gru == "gru"
    check_backward_kernel("gru_reset_before", p, hidden, batch, dtype, rng, lengths=lengths)


@pytest.mark.parametrize("cell", persistent_cells())
def test_backward_kernel_of_every_cell_matches_reference(cell, rng):
    """Each registered cell's derivative through the planner's backward plan."""
    c = rnncc.cells.get(cell)
    p = planner.backward(c.gates, 17, 3, "float32", H100, len(c.states), len(kept_parts(c)))
    check_backward_kernel(cell, p, 17, 3, "float32", rng, steps=(4,))
