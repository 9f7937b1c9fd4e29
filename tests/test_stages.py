"""The persistent kernel's stages without a GPU: each stage's TIR, built for small plans, run on
a NumPy interpreter of the kernel (tests/tir_sim.py) and checked against NumPy, and whole
kernels so run against the float64 reference, for every variant of the plan."""

import dataclasses
import os

import numpy as np
import pytest
import tvm

import rnncc
from conftest import random_weights
from helpers import TOL
from rnncc import reference
from rnncc.lowering import components as comp
from rnncc.schedules.persistent import buffers, fuse_input, gpu_for_arch, overlap_input, planner
from rnncc.schedules.persistent.kernel import kernel
from rnncc.schedules.persistent.stages.exchange import EMPTY_TAG
from tir_sim import Simulator

H100 = gpu_for_arch("sm_90")


def crafted(gates, hidden, batch, dtype, units, warps, split=None, groups=1, **fields):
    """A plan of ``units`` a block and ``warps`` a block whose chunks of K are ``split`` (in
    registers, shared memory, global memory; default all in registers): the interpreter
    holds any split, whatever a GPU's registers and shared memory would."""
    vec = 16 // planner.ELEMENT_BYTES[dtype]
    chunks = -(-hidden // (32 * vec))
    kr, ks, kg = split or (chunks, 0, 0)
    assert kr + ks + kg == chunks
    return planner.Plan(
        blocks=-(-hidden // units) * groups, units=units, warps=warps,
        rows_per_warp=-(-gates * units // warps), vec=vec, chunks=chunks, reg_chunks=kr,
        smem_chunks=ks, global_chunks=kg, items=-(-units * (batch // groups) // (32 * warps)),
        reg_estimate=0, smem_bytes=0, batch_groups=groups, **fields)


def _llvm(func, *arrays):
    """Run a PrimFunc built for this CPU; the arrays it wrote."""
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    tvm.compile(func, target="llvm")(*tensors)
    return [t.numpy() for t in tensors]


def simulate(cell, p, x, weights, initial, dtype, chunk=1):
    """y and the final states of the persistent kernel of plan ``p`` on ``x`` [T, N, C], run
    on the interpreter with rnncc's own packings (built for this CPU)."""
    steps, n, c = x.shape
    g, h = cell.gates, weights["weight_hh_l0"].shape[1]
    w_hh = weights["weight_hh_l0"].astype(dtype)
    packed = np.zeros((p.group_blocks, p.warps, p.chunks, p.rows_per_warp, 32, p.vec), dtype)
    args = {"w": _llvm(comp.pack_persistent(g, h, p, dtype), w_hh, packed)[1],
            "b_hh": weights["bias_hh_l0"].astype(dtype),
            "y": np.full((steps, n, h), np.nan, dtype)}
    if p.fused:
        shape = buffers.input_weight_shape(p, g)
        w_ih = weights["weight_ih_l0"].astype(dtype)
        args["wi"] = _llvm(comp.pack_fused_input(g, h, c, shape, p, dtype), w_ih,
                           np.zeros(shape, dtype))[1]
        args.update(x=x.astype(dtype), b_ih=weights["bias_ih_l0"].astype(dtype),
                    xp=np.full((steps, n, g * h), np.nan, np.float32))
    else:
        xp = (x.astype(dtype).astype(np.float32) @ weights["weight_ih_l0"].astype(dtype).astype(
            np.float32).T + weights["bias_ih_l0"].astype(dtype).astype(np.float32))
        padded = np.zeros((-(-steps // chunk) * chunk, n, g * h), np.float32)
        padded[:steps] = xp
        args["xp"] = padded if chunk == 1 else padded.reshape(-1, chunk, n, g * h)
    for k, name in enumerate(cell.states):
        s = np.full((2, n, h), np.nan, np.float32)
        s[0] = initial[name][0].astype(dtype)
        args[f"s{k}"] = s
    if p.sync == "tagged":
        h0 = initial[cell.states[0]][0].astype(np.float32)
        args["hw"] = _llvm(comp.init_tagged(n, h, "float32", EMPTY_TAG), h0,
                           np.zeros((2, n, h), np.uint64))[1]
    else:
        args["cnt"] = np.zeros(p.batch_groups, np.uint32)
    func = kernel(cell, h, n, p, dtype=dtype, chunk=chunk, input_size=c if p.fused else 0)
    Simulator(func, args).run()
    return args["y"], {s: args[f"s{k}"][steps % 2][None] for k, s in enumerate(cell.states)}


def check_kernel(cell_name, p, input_size, hidden, batch, dtype, rng, steps=(1, 5), chunk=1):
    cell = rnncc.cells.get(cell_name)
    for t in steps:
        weights = {k: v.astype(dtype) for k, v in
                   random_weights(rng, cell.gates, input_size, hidden).items()}
        x = rng.standard_normal((t, batch, input_size)).astype(dtype)
        initial = {s: rng.standard_normal((1, batch, hidden)).astype(dtype)
                   for s in cell.states}
        y, finals = simulate(cell, p, x, weights, initial, dtype, chunk)
        ref_y, ref_states = reference.run(cell, x, weights, initial)
        errors = [reference.relative_error(y, ref_y)] + [
            reference.relative_error(finals[s], ref_states[s]) for s in cell.states]
        assert max(errors) < TOL[dtype], f"T={t}: relative errors {errors}"


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
    "tagged, chunks of steps": lambda: ("lstm", 5, 33, 3, "float32", planner.plan(
        4, 33, 3, "float32", H100, 2), 4),
    "barrier, K in registers, shared and global memory": lambda: (
        "gru", 7, 300, 2, "float32", crafted(3, 300, 2, "float32", 40, 4, (1, 1, 1),
                                             sync="barrier"), 1),
    "grid, shared-memory chunks unrolled": lambda: (
        "rnn_tanh", 3, 300, 1, "float32", crafted(1, 300, 1, "float32", 40, 4, (0, 3, 0),
                                                  sync="grid", unroll=3), 1),
    "batch groups": lambda: ("lstm", 4, 64, 4, "float32", crafted(
        4, 64, 4, "float32", 8, 4, groups=2, sync="barrier"), 16),
    "float16": lambda: ("gru", 6, 70, 2, "float16", crafted(3, 70, 2, "float16", 10, 2,
                                                             sync="barrier"), 1),
    "tensor cores": lambda: ("lstm", 5, 64, 3, "float16", crafted(4, 64, 3, "float16", 2, 1,
                                                                  mma=True), 1),
    "tensor cores, shared memory, batch groups": lambda: (
        "lstm", 5, 300, 4, "float16", crafted(4, 300, 4, "float16", 4, 2, (1, 1, 0), groups=2,
                                              mma=True, sync="barrier"), 1),
    "fused, odd C": lambda: ("gru", 37, 33, 2, "float32", _fused(
        crafted(3, 33, 2, "float32", 5, 2), 3, 37, 2, 8), 1),
    "fused in slabs": lambda: ("gru", 200, 33, 2, "float32", _fused(
        crafted(3, 33, 2, "float32", 5, 2, (0, 1, 0), sync="barrier"), 3, 200, 2, None,
        SMALL_SMEM), 1),
    "fused, batch groups": lambda: ("lstm", 33, 40, 6, "float32", _fused(
        crafted(4, 40, 6, "float32", 5, 2, groups=3), 4, 33, 6, 8), 1),
    "overlapped, asynchronous copies": lambda: ("lstm", 64, 33, 2, "float32", _overlapped(
        crafted(4, 33, 2, "float32", 5, 2), 4, 64, 2, 2), 1),
    "overlapped, staged x, barrier": lambda: ("gru", 37, 40, 4, "float32", _overlapped(
        crafted(3, 40, 4, "float32", 5, 2, sync="barrier"), 3, 37, 4, 3), 1),
    "overlapped, grid": lambda: ("rnn_relu", 16, 33, 4, "float32", _overlapped(
        crafted(1, 33, 4, "float32", 9, 1, sync="grid"), 1, 16, 4, 1), 1),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_variant_matches_reference(name, rng):
    """Every variant of the plan, as the interpreter runs its kernel, within the dtype's
    tolerance of float64 at T = 1 and 5 (over a chunk of steps, a group of the overlapped
    projection), with initial states."""
    cell, input_size, hidden, batch, dtype, p, chunk = KERNELS[name]()
    if name == "fused in slabs":
        assert p.input_slab > 0
    check_kernel(cell, p, input_size, hidden, batch, dtype, rng, chunk=chunk)


@pytest.mark.parametrize("cell", rnncc.cells.names())
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
