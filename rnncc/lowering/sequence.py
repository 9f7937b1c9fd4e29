"""The non-persistent sequence: cuDNN's first three optimisations as switchable stages.

``build(problem, options, target)`` returns an IRModule with

- ``pack_w_ih``, ``pack_w_hh``: PyTorch weights into the schedule's layout (run once, on the
  device, by ``Module.pack``);
- ``forward``: the whole sequence, one call for all T steps.

and the signature of each function (names, shapes with "T" for the run-time length, and what
each parameter is: "input", "output" or "workspace"), which goes into the module's metadata so
that the runtime can check arguments and allocate workspaces without the compiler.

forward(x [T,N,C], w_ih, w_hh, b_ih [G*H], b_hh [G*H], <s>0 [1,N,H] for each state s,
        y [T,N,H], <s>_n [1,N,H] for each state, xp, hp, <s>_ws [2,N,H] for each state)

The states ping-pong between two slots of their workspace (step t reads slot t % 2 and writes
slot (t+1) % 2), so a cell may read any previous state while writing the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

from .. import schedules
from ..spec import Options, Problem
from . import components as comp
from .assemble import ALL, Region, Stage, sequence_function, standalone_function
from .components import Layout, i64


@dataclass
class Lowered:
    """The IRModule, its functions' signatures and the schedule rule used for each stage."""

    mod: tvm.IRModule
    signatures: dict
    layout: Layout
    rules: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def layout_for(target, options: Options) -> Layout:
    """CUDA keeps PyTorch's [O, K] rows (coalesced along K); CPUs want [K, O] to vectorise."""
    return Layout(weights="rows" if target.kind.name == "cuda" else "cols",
                  gates="combined" if options.gate_gemm else "per_gate")


def _param(name, shape, dtype, kind, signature):
    signature.append({"name": name, "shape": [d if isinstance(d, int) else "T" for d in shape],
                      "dtype": dtype, "kind": kind})
    return tirx.decl_buffer(tuple(i64(d) if isinstance(d, int) else d for d in shape), dtype,
                            name)


def build(problem: Problem, options: Options, target) -> Lowered:
    cell, dtype = problem.cell, problem.dtype
    n, c, h, g = problem.batch, problem.input_size, problem.hidden_size, problem.gates
    gh_ = g * h
    layout = layout_for(target, options)
    lowered = Lowered(tvm.IRModule(), {}, layout)

    def scheduled(key: str, func, role: str):
        result = schedules.schedule(func, target, role)
        lowered.rules[key] = result.rule
        lowered.notes += [f"{key}: {note}" for note in result.notes]
        return result.func

    # Packing: one function a weight.
    for which, k in (("ih", c), ("hh", h)):
        sig = []
        src = _param(f"weight_{which}_l0", (gh_, k), dtype, "input", sig)
        dst = _param(f"w_{which}", layout.weight_shape(g, h, k), dtype, "output", sig)
        func = scheduled(f"pack_w_{which}", comp.pack_weight(g, h, k, layout, dtype), "elementwise")
        lowered.mod[f"pack_w_{which}"] = standalone_function(
            f"pack_w_{which}", _rename_params(func, [src, dst]))
        lowered.signatures[f"pack_w_{which}"] = sig

    t_len = tirx.Var("T", "int64")
    t = tirx.Var("t", "int64")
    sig = []
    x = _param("x", (t_len, n, c), dtype, "input", sig)
    w_ih = _param("w_ih", layout.weight_shape(g, h, c), dtype, "input", sig)
    w_hh = _param("w_hh", layout.weight_shape(g, h, h), dtype, "input", sig)
    b_ih = _param("b_ih", (gh_,), dtype, "input", sig)
    b_hh = _param("b_hh", (gh_,), dtype, "input", sig)
    s0 = [_param(f"{s}0", (1, n, h), dtype, "input", sig) for s in cell.states]
    y = _param("y", (t_len, n, h), dtype, "output", sig)
    sn = [_param(f"{s}_n", (1, n, h), dtype, "output", sig) for s in cell.states]
    per_gate = layout.gates == "per_gate"
    if options.input_gemm:
        xp_shape = (g, t_len, n, h) if per_gate else (t_len, n, gh_)
    else:
        xp_shape = (g, n, h) if per_gate else (n, gh_)
    xp = _param("xp", xp_shape, dtype, "workspace", sig)
    hp = _param("hp", (g, n, h) if per_gate else (n, gh_), dtype, "workspace", sig)
    sw = [_param(f"{s}_ws", (2, n, h), dtype, "workspace", sig) for s in cell.states]

    def projections(name, a_region, lead, k, w, b, out_region_of_gate, out_whole):
        """One GEMM over all gates, or one a gate (gate_gemm off)."""
        if not per_gate:
            func = scheduled(name, comp.gemm(lead, k, gh_, layout.weights, dtype), "gemm")
            return [Stage(name, func, [a_region, Region(w, (ALL,) * len(w.shape)),
                                       Region(b, (ALL,)), out_whole], 1)]
        func = scheduled(name, comp.gemm(lead, k, h, layout.weights, dtype), "gemm")
        return [Stage(f"{name}_g{i}", func,
                      [a_region, Region(w, (i, ALL, ALL)),
                       Region(b, (slice(i * h, (i + 1) * h),)), out_region_of_gate(i)], 1)
                for i in range(g)]

    prologue = [Stage("init_states", scheduled("init_states",
                                               comp.copy(len(s0), n, h, dtype),
                                               "elementwise"),
                      [Region(s, (0, ALL, ALL)) for s in s0]
                      + [Region(s, (0, ALL, ALL)) for s in sw], len(sw))]
    steps = []
    if options.input_gemm:
        prologue += projections(
            "input_gemm", Region(x, (ALL, ALL, ALL)), (t_len, n), c, w_ih, b_ih,
            lambda i: Region(xp, (i, ALL, ALL, ALL)), Region(xp, (ALL, ALL, ALL)))
        gi = ([Region(xp, (i, t, ALL, ALL)) for i in range(g)] if per_gate
              else [Region(xp, (t, ALL, ALL))])
    else:
        steps += projections(
            "input_gemm", Region(x, (t, ALL, ALL)), (n,), c, w_ih, b_ih,
            lambda i: Region(xp, (i, ALL, ALL)), Region(xp, (ALL, ALL)))
        gi = ([Region(xp, (i, ALL, ALL)) for i in range(g)] if per_gate
              else [Region(xp, (ALL, ALL))])
    slot = tirx.floormod(t, i64(2))
    nxt = tirx.floormod(t + i64(1), i64(2))
    steps += projections(
        "recurrent_gemm", Region(sw[0], (slot, ALL, ALL)), (n,), h, w_hh, b_hh,
        lambda i: Region(hp, (i, ALL, ALL)), Region(hp, (ALL, ALL)))
    step_func = scheduled(
        "cell_step",
        comp.cell_step(cell, n, h, dtype, layout.gates, options.fuse_pointwise), "elementwise")
    steps.append(Stage(
        "cell_step", step_func,
        gi + ([Region(hp, (i, ALL, ALL)) for i in range(g)] if per_gate
              else [Region(hp, (ALL, ALL))])
        + [Region(s, (slot, ALL, ALL)) for s in sw]
        + [Region(y, (t, ALL, ALL))] + [Region(s, (nxt, ALL, ALL)) for s in sw],
        1 + len(sw)))
    final = tirx.floormod(t_len, i64(2))
    epilogue = [Stage("final_states", scheduled("final_states",
                                                comp.copy(len(sw), n, h, dtype),
                                                "elementwise"),
                      [Region(s, (final, ALL, ALL)) for s in sw]
                      + [Region(s, (0, ALL, ALL)) for s in sn], len(sn))]
    params = [x, w_ih, w_hh, b_ih, b_hh, *s0, y, *sn, xp, hp, *sw]
    lowered.mod["forward"] = sequence_function("forward", params, prologue, t, t_len, steps,
                                               epilogue)
    lowered.signatures["forward"] = sig
    return lowered


def _rename_params(func, buffers):
    """``func`` with its parameters replaced by ``buffers`` (same shapes), so the module's
    functions name their parameters as the signature does."""
    remap = dict(zip(func.params, buffers))
    body = tvm_ffi.structural_map(func.body, (tvm.ir.Var, lambda v: remap.get(v, v)),
                                  order="pre")
    return tirx.PrimFunc(list(buffers), body, attrs=func.attrs)
