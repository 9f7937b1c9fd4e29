"""A layer's IRModule: the packing functions and one or two ways to run the sequence.

Entries (function names; each has a signature in the module's metadata: parameter names,
shapes with "T" for the run-time length and "T/S" for ceil(T/S) chunks of S steps, and
"input", "output" or "workspace"):

- ``pack_w_ih``, ``pack_w_hh``, ``forward``: the non-persistent schedule, cuDNN's first three
  optimisations as switchable stages (input GEMM of all steps, one GEMM over all gates, fused
  point-wise step). Always present: it fits every size, and is the fallback.
- ``persistent_pack_w_hh``, ``persistent_forward``: the persistent kernel (CUDA, when its
  planner says the weights fit on-chip): the input GEMM of all steps, then one cooperative
  kernel for all T steps. It shares ``pack_w_ih`` (PyTorch's [G*H, C] rows), or, with the
  input projection fused into the kernel (the plan's ``input_rows``), has its own
  ``persistent_pack_w_ih`` and no input GEMM.

forward(x [T,N,C], w_ih, w_hh, b_ih [G*H], b_hh [G*H], <s>0 [1,N,H] for each state s,
        y [T,N,H], <s>_n [1,N,H] for each state, xp, hp, <s>_ws [2,N,H] for each state)

xp holds the input projections; of all steps at once, it is laid out by :class:`Layout`
(in chunks of steps on CUDA at a small batch, so that the input GEMM tiles).

The states ping-pong between two slots of their workspace (step t reads slot t % 2 and writes
slot (t+1) % 2), so a cell may read any previous state while writing the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

from .. import schedules
from ..dtypes import accum_dtype
from ..spec import Options, Problem
from . import components as comp
from .assemble import Region, Stage, sequence_function, standalone_function
from .components import ALL, Layout, i64


@dataclass
class Lowered:
    """The IRModule, its functions' signatures and the schedule rule used for each stage."""

    mod: tvm.IRModule
    signatures: dict
    layout: Layout
    rules: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    #: The components before scheduling, by key: (PrimFunc, role); what tuning tunes.
    components: dict = field(default_factory=dict)


def layout_for(target, options: Options, problem: Problem) -> Layout:
    """CUDA keeps PyTorch's [O, K] rows (coalesced along K); CPUs want [K, O] to vectorise.
    On CUDA the input projections of all steps go in chunks of steps where that lets the
    tiled GEMM rule take their product (float32 at a batch of 1 to 8); in float16, as flat rows
    where dlight's rule then puts their product on tensor cores."""
    cuda = target.kind.name == "cuda"
    combined = options.gate_gemm
    chunk, flat = 1, False
    if cuda and combined and options.input_gemm:
        chunk = schedules.cuda_tiled_gemm.chunk_steps(
            problem.batch, problem.gates * problem.hidden_size, problem.input_size,
            problem.dtype)
        flat = chunk == 1 and schedules.cuda_matmul.wants_flat_rows(
            problem.dtype, problem.input_size, problem.gates * problem.hidden_size)
    return Layout(weights="rows" if cuda else "cols",
                  gates="combined" if combined else "per_gate", chunk=chunk, flat_rows=flat)


class _Builder:
    def __init__(self, problem: Problem, options: Options, target, database=None):
        self.p, self.options, self.target = problem, options, target
        self.database = database
        self.layout = layout_for(target, options, problem)
        self.lowered = Lowered(tvm.IRModule(), {}, self.layout)
        self._done = {}

    def scheduled(self, key: str, func, role: str):
        if key in self._done:  # the same component in both entries (the input GEMM)
            return self._done[key]
        self.lowered.components[key] = (func, role)
        result = schedules.schedule(func, self.target, role, self.database)
        self._done[key] = result.func
        self.lowered.rules[key] = result.rule
        self.lowered.notes += [f"{key}: {note}" for note in result.notes]
        return result.func

    def param(self, sig, name, shape, kind, dtype=None):
        dtype = dtype or self.p.dtype
        sig.append({"name": name, "shape": [_signature_dim(d) for d in shape],
                    "dtype": dtype, "kind": kind})
        return tirx.decl_buffer(tuple(i64(d) if isinstance(d, int) else d for d in shape),
                                dtype, name)

    def add(self, name, func, sig):
        self.lowered.mod[name] = func
        self.lowered.signatures[name] = sig

    def pack(self, name, which, k, layout_or_func, rule_key=None):
        p = self.p
        g, h = p.gates, p.hidden_size
        sig = []
        src = self.param(sig, f"weight_{which}_l0", (g * h, k), "input")
        if isinstance(layout_or_func, Layout):
            func = comp.pack_weight(g, h, k, layout_or_func, p.dtype)
        else:
            func = layout_or_func
        dst_shape = tuple(int(d) for d in func.params[1].shape)
        dst = self.param(sig, f"w_{which}", dst_shape, "output")
        func = self.scheduled(rule_key or name, func, "elementwise")
        self.add(name, standalone_function(name, _rename_params(func, [src, dst])), sig)

    def io(self, sig, t_len, w_hh_shape, w_ih_shape=None):
        """The parameters both forward functions start with (``lengths`` [N] int32, the
        samples' lengths, where the problem takes them, else None)."""
        p, layout = self.p, self.layout
        n, c, h, g = p.batch, p.input_size, p.hidden_size, p.gates
        x = self.param(sig, "x", (t_len, n, c), "input")
        w_ih = self.param(sig, "w_ih", w_ih_shape or layout.weight_shape(g, h, c), "input")
        w_hh = self.param(sig, "w_hh", w_hh_shape, "input")
        b_ih = self.param(sig, "b_ih", (g * h,), "input")
        b_hh = self.param(sig, "b_hh", (g * h,), "input")
        s0 = [self.param(sig, f"{s}0", (1, n, h), "input") for s in p.cell.states]
        lengths = self.param(sig, "lengths", (n,), "input", "int32") if p.lengths else None
        y = self.param(sig, "y", (t_len, n, h), "output")
        sn = [self.param(sig, f"{s}_n", (1, n, h), "output") for s in p.cell.states]
        return x, w_ih, w_hh, b_ih, b_hh, s0, lengths, y, sn

    def states_copy(self, key, src, dst):
        p = self.p
        func = self.scheduled(key, comp.copy(len(src), p.batch, p.hidden_size,
                                             src[0].buffer.dtype, dst[0].buffer.dtype),
                              "elementwise")
        return Stage(key, func, src + dst, len(dst))

    def projections(self, name, a_region, lead, k, w, b, out_of_gate, out_whole):
        """One GEMM over all gates, or one a gate (gate_gemm off)."""
        p, layout = self.p, self.layout
        g, h = p.gates, p.hidden_size
        a_dtype = a_region.buffer.dtype
        if layout.gates == "combined":
            chunk = layout.chunk if len(lead) == 2 else 1  # chunks of the steps of x
            func = self.scheduled(
                name, comp.gemm(lead, k, g * h, layout.weights, p.dtype, a_dtype, chunk), "gemm")
            return [Stage(name, func, [a_region, Region(w, (ALL,) * len(w.shape)),
                                       Region(b, (ALL,)), out_whole], 1)]
        func = self.scheduled(name, comp.gemm(lead, k, h, layout.weights, p.dtype, a_dtype),
                              "gemm")
        return [Stage(f"{name}_g{i}", func,
                      [a_region, Region(w, (i, ALL, ALL)),
                       Region(b, (slice(i * h, (i + 1) * h),)), out_of_gate(i)], 1)
                for i in range(g)]

    def input_operands(self, x, xp):
        """(x's region, the GEMM's lead, xp's region, views to declare) for the input GEMM of
        all steps: x and xp whole, or, with flat rows, [T*N, C] and [T*N, G*H] views of them."""
        t_len, n = x.shape[0], self.p.batch
        if not self.layout.flat_rows:
            return (Region(x, (ALL,) * 3), (t_len, n), Region(xp, (ALL,) * len(xp.shape)), [])
        x_rows, xp_rows = (tirx.decl_buffer((t_len * i64(n), b.shape[-1]), b.dtype,
                                            f"{b.name}_rows") for b in (x, xp))
        return (Region(x_rows, (ALL, ALL)), (tirx.Var("M", "int64"),),
                Region(xp_rows, (ALL, ALL)), [(x_rows, x), (xp_rows, xp)])

    def sequence_entry(self):
        p, options, layout = self.p, self.options, self.layout
        n, c, h, g = p.batch, p.input_size, p.hidden_size, p.gates
        per_gate = layout.gates == "per_gate"
        self.pack("pack_w_ih", "ih", c, layout)
        self.pack("pack_w_hh", "hh", h, layout)
        t_len, t = tirx.Var("T", "int64"), tirx.Var("t", "int64")
        sig = []
        x, w_ih, w_hh, b_ih, b_hh, s0, lengths, y, sn = self.io(sig, t_len,
                                                                layout.weight_shape(g, h, h))
        if options.input_gemm:
            xp_shape = (g, t_len, n, h) if per_gate else layout.projections_shape(t_len, n, g, h)
        else:
            xp_shape = (g, n, h) if per_gate else (n, g * h)
        acc = accum_dtype(p.dtype)
        xp = self.param(sig, "xp", xp_shape, "workspace", acc)
        hp = self.param(sig, "hp", (g, n, h) if per_gate else (n, g * h), "workspace", acc)
        sw = [self.param(sig, f"{s}_ws", (2, n, h), "workspace", acc) for s in p.cell.states]

        prologue = [self.states_copy("init_states", [Region(s, (0, ALL, ALL)) for s in s0],
                                     [Region(s, (0, ALL, ALL)) for s in sw])]
        active = []
        if lengths is not None:  # active[t, n]: step t within sample n's length
            active = [self.param(sig, "active", (t_len, n), "workspace", "int32")]
            func = self.scheduled("activity", comp.activity(n, t_len), "elementwise")
            prologue.append(Stage("activity", func, [Region(lengths, (ALL,)),
                                                     Region(active[0], (ALL, ALL))], 1))
        steps, views = [], []
        if options.input_gemm:
            x_region, lead, xp_region, views = self.input_operands(x, xp)
            prologue += self.projections(
                "input_gemm", x_region, lead, c, w_ih, b_ih,
                lambda i: Region(xp, (i, ALL, ALL, ALL)), xp_region)
            gi = ([Region(xp, (i, t, ALL, ALL)) for i in range(g)] if per_gate
                  else [Region(xp, layout.projections_at(t))])
        else:
            steps += self.projections(
                "input_gemm", Region(x, (t, ALL, ALL)), (n,), c, w_ih, b_ih,
                lambda i: Region(xp, (i, ALL, ALL)), Region(xp, (ALL, ALL)))
            gi = ([Region(xp, (i, ALL, ALL)) for i in range(g)] if per_gate
                  else [Region(xp, (ALL, ALL))])
        slot = tirx.floormod(t, i64(2))
        nxt = tirx.floormod(t + i64(1), i64(2))
        steps += self.projections(
            "recurrent_gemm", Region(sw[0], (slot, ALL, ALL)), (n,), h, w_hh, b_hh,
            lambda i: Region(hp, (i, ALL, ALL)), Region(hp, (ALL, ALL)))
        step_func = self.scheduled(
            "cell_step",
            comp.cell_step(p.cell, n, h, p.dtype, layout.gates, options.fuse_pointwise,
                           masked=bool(active)),
            "elementwise")
        steps.append(Stage(
            "cell_step", step_func,
            gi + ([Region(hp, (i, ALL, ALL)) for i in range(g)] if per_gate
                  else [Region(hp, (ALL, ALL))])
            + [Region(s, (slot, ALL, ALL)) for s in sw]
            + [Region(a, (t, ALL)) for a in active]
            + [Region(y, (t, ALL, ALL))] + [Region(s, (nxt, ALL, ALL)) for s in sw],
            1 + len(sw)))
        final = tirx.floormod(t_len, i64(2))
        epilogue = [self.states_copy("final_states", [Region(s, (final, ALL, ALL)) for s in sw],
                                     [Region(s, (0, ALL, ALL)) for s in sn])]
        given = [lengths] if lengths is not None else []
        params = [x, w_ih, w_hh, b_ih, b_hh, *s0, *given, y, *sn, xp, hp, *sw, *active]
        self.add("forward", sequence_function("forward", params, prologue, t, t_len, steps,
                                              epilogue, views), sig)

    def persistent_entry(self, plan):
        from ..schedules.persistent import buffers, kernel
        from ..schedules.persistent.stages.exchange import EMPTY_TAG

        p = self.p
        n, c, h, g = p.batch, p.input_size, p.hidden_size, p.gates
        self.pack("persistent_pack_w_hh", "hh", h,
                  comp.pack_persistent(g, h, plan, p.dtype), "persistent_pack_w_hh")
        w_ih_shape = None
        if plan.fused:  # W_ih packed for the kernel too (planner: "Fused input projection")
            w_ih_shape = buffers.input_weight_shape(plan, g)
            self.pack("persistent_pack_w_ih", "ih", c,
                      comp.pack_fused_input(g, h, c, w_ih_shape, plan, p.dtype),
                      "persistent_pack_w_ih")
        t_len = tirx.Var("T", "int64")
        sig = []
        w_shape = (plan.group_blocks, plan.warps, plan.chunks, plan.rows_per_warp, 32, plan.vec)
        x, w_ih, w_hh, b_ih, b_hh, s0, lengths, y, sn = self.io(sig, t_len, w_shape, w_ih_shape)
        acc = accum_dtype(p.dtype)
        chunk = 1 if plan.fused else self.layout.chunk
        xp_shape = (t_len, n, g * h) if plan.fused else self.layout.projections_shape(
            t_len, n, g, h)
        xp = self.param(sig, "xp", xp_shape, "workspace", acc)
        sw = [self.param(sig, f"{s}_ws", (2, n, h), "workspace", acc) for s in p.cell.states]
        if plan.sync == "tagged":
            sync = self.param(sig, "h_tagged", (2, n, h), "workspace", "uint64")
            init = self.scheduled("init_tagged", comp.init_tagged(n, h, p.dtype, EMPTY_TAG),
                                  "elementwise")
            sync_stage = Stage("init_tagged", init, [Region(s0[0], (0, ALL, ALL)),
                                                     Region(sync, (ALL, ALL, ALL))], 1)
        else:
            sync = self.param(sig, "counter", (plan.batch_groups,), "workspace", "uint32")
            zero = self.scheduled("zero_counter", comp.zero_counter(plan.batch_groups),
                                  "elementwise")
            sync_stage = Stage("zero_counter", zero, [Region(sync, (ALL,))], 1)
        prologue = [self.states_copy("init_states", [Region(s, (0, ALL, ALL)) for s in s0],
                                     [Region(s, (0, ALL, ALL)) for s in sw])]
        views = []
        recurrent = [Region(w_hh, (ALL,) * 6), Region(b_hh, (ALL,))]
        xp_whole = Region(xp, (ALL,) * len(xp_shape))
        if plan.fused:  # the kernel reads x and W_ih and writes xp
            inputs = [Region(x, (ALL,) * 3), Region(w_ih, (ALL,) * 5), Region(b_ih, (ALL,)),
                      *recurrent, xp_whole]
        else:
            x_region, lead, xp_region, views = self.input_operands(x, xp)
            prologue += self.projections("input_gemm", x_region, lead, c, w_ih, b_ih, None,
                                         xp_region)
            inputs = [xp_whole, *recurrent]
        if lengths is not None:
            inputs.append(Region(lengths, (ALL,)))
        prologue.append(sync_stage)
        k_func = kernel.kernel(p.cell, h, n, plan, dtype=p.dtype, chunk=chunk, input_size=c,
                               lengths=lengths is not None)
        self.lowered.rules["persistent"] = f"persistent.{plan.sync}" + (
            "+input" if plan.fused else "")
        outputs = [Region(y, (ALL, ALL, ALL))] + [Region(s, (ALL, ALL, ALL)) for s in sw]
        outputs.append(Region(sync, (ALL,) * len(sync.shape)))
        prologue.append(Stage("persistent", k_func, inputs + outputs,
                              len(outputs) + plan.fused))
        final = tirx.floormod(t_len, i64(2))
        epilogue = [self.states_copy("final_states", [Region(s, (final, ALL, ALL)) for s in sw],
                                     [Region(s, (0, ALL, ALL)) for s in sn])]
        given = [lengths] if lengths is not None else []
        params = [x, w_ih, w_hh, b_ih, b_hh, *s0, *given, y, *sn, xp, *sw, sync]
        self.add("persistent_forward", sequence_function(
            "persistent_forward", params, prologue, None, None, [], epilogue, views), sig)


def build(problem: Problem, options: Options, target, persistent_plan=None,
          database=None) -> Lowered:
    """The layer's IRModule: always the non-persistent entry, plus the persistent one when a
    plan is given (CUDA only; its input GEMM always runs over all steps at once). ``database``:
    a MetaSchedule database whose records schedule the components they match."""
    builder = _Builder(problem, options, target, database)
    builder.sequence_entry()
    if persistent_plan is not None:
        builder.persistent_entry(persistent_plan)
    return builder.lowered


def _signature_dim(dim):
    """A dimension as signatures write it: an int, "T", or "T/S" (comp.chunks(T, S))."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, tvm.ir.Var):
        return "T"
    return f"T/{int(dim.b)}"


def _rename_params(func, buffers):
    """``func`` with its parameters replaced by ``buffers`` (same shapes), so the module's
    functions name their parameters as the signature does."""
    remap = dict(zip(func.params, buffers))
    body = tvm_ffi.structural_map(func.body, (tvm.ir.Var, lambda v: remap.get(v, v)),
                                  order="pre")
    return tirx.PrimFunc(list(buffers), body, attrs=func.attrs)
