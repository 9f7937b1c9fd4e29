"""A layer's IRModule: the packing functions and one or two ways to run the sequence.

Entries (function names; each has a signature in the module's metadata: parameter names,
shapes with "T" for the run-time length and "T+1" for one more, and "input", "output" or
"workspace"):

- ``pack_w_ih``, ``pack_w_hh``, ``forward``: the non-persistent schedule, cuDNN's first three
  optimisations as switchable stages (input GEMM of all steps, one GEMM over all gates, fused
  point-wise step). Always present: it fits every size, and is the fallback.
- ``persistent_pack_w_hh``, ``persistent_forward``: the persistent kernel (CUDA, when its
  planner says the weights fit on-chip): the input GEMM of all steps, then one kernel for
  all T steps (cooperative, unless each batch group is one block). It shares ``pack_w_ih``
  (PyTorch's [G*H, C] rows), or, with the input projection fused into the kernel (the plan's
  ``input_rows``), has its own ``persistent_pack_w_ih`` and no input GEMM.

forward(x [T,N,C], w_ih, w_hh, b_ih [G*H], b_hh [G*H], <s>0 [1,N,H] for each state s,
        y [T,N,H], <s>_n [1,N,H] for each state, xp, hp, <s>_ws [2,N,H] for each state)

In half precision or with TF32 allowed on CUDA, ``h_operand`` [2,N,H] follows the states: h
again, as the recurrent products' tensor cores take it (:func:`h_for_products`); [2,N,H'] with
w_hh packed [G*H,H'], zeros past H, where K is padded (:meth:`_Builder.recurrent_depth`).

xp holds the input projections of all steps at once, [T, N, G*H] (:class:`Layout`).

The states ping-pong between two slots of their workspace (step t reads slot t % 2 and writes
slot (t+1) % 2), so a cell may read any previous state while writing the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import tvm
import tvm_ffi
from tvm import tirx

from .. import schedules
from ..cells import autodiff
from ..dtypes import accum_dtype
from ..spec import Options, Problem
from . import components as comp
from . import training
from .assemble import Region, Stage, scratch_signature, sequence_function, standalone_function
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


#: Bytes a row of an operand is copied in by the GEMM rules (cp.async, the TMA engine)
COPY_BYTES = 16


def padded_input_size(target, options: Options, problem: Problem) -> int:
    """K of the input projection of all steps: C, or, on CUDA where a row of C values is not
    a whole count of 16-byte copies (C = 13, 161 or 257 in float32, any odd C in 16 bits: the
    sizes of speech features), C rounded up to one: W_ih is packed [G*H, C'] with zeros past
    C, and x copied so before the product (each call; memory T*N*C'). Unaligned, the product
    fell to cuda.matmul (dlight's generic rule), forward and dx. One layer, gates combined."""
    per_copy = COPY_BYTES * 8 // tvm.DataType(problem.dtype).bits
    c = problem.input_size
    if (target.kind.name != "cuda" or not options.input_gemm or not options.gate_gemm
            or problem.layers > 1 or c % per_copy == 0):
        return c
    return -(-c // per_copy) * per_copy


def layout_for(target, options: Options, problem: Problem) -> Layout:
    """CUDA keeps PyTorch's [O, K] rows (coalesced along K); CPUs want [K, O] to vectorise.
    On CUDA the input projections of all steps in half precision go as flat rows where
    dlight's rule then puts their product on tensor cores (not with TF32 allowed where
    cuda.mma_gemm takes it)."""
    cuda = target.kind.name == "cuda"
    combined = options.gate_gemm
    flat = False
    tf32 = problem.allow_tf32 and schedules.cuda_mma_gemm.fits(
        problem.gates * problem.hidden_size, problem.input_size, schedules.TF32)
    if cuda and combined and options.input_gemm and not tf32:
        flat = schedules.cuda_matmul.wants_flat_rows(
            problem.dtype, problem.input_size, problem.gates * problem.hidden_size)
    return Layout(weights="rows" if cuda else "cols",
                  gates="combined" if combined else "per_gate", flat_rows=flat)


class _Builder:
    def __init__(self, problem: Problem, options: Options, target, database=None):
        self.p, self.options, self.target = problem, options, target
        self.database = database
        self.layout = layout_for(target, options, problem)
        #: K of the input projections of all steps (:func:`padded_input_size`)
        self.input_k = padded_input_size(target, options, problem)
        self.lowered = Lowered(tvm.IRModule(), {}, self.layout)
        self._done = {}
        #: gemm components (by key) whose TF32 operands their callers round ("a", "b", "ab")
        self.rounded = {}

    def marked(self, key: str, func, role: str):
        """Component ``func`` with the attributes that let rules take its products in TF32
        (``allow_tf32``; its operands' rounding as :attr:`rounded` says) or as three TF32
        products (``tf32x3``)."""
        if self.p.allow_tf32 and role == "gemm" and self.target.kind.name == "cuda":
            # a rule may put it on tensor cores in TF32
            func = func.with_attr(schedules.TF32_ATTR, True)
            if key in self.rounded:
                func = func.with_attr(schedules.TF32_ROUNDED_ATTR, self.rounded[key])
        elif self.options.tf32x3 and self.p.dtype == "float32" and role in (
                "gemm", "reduction") and self.target.kind.name == "cuda":
            func = func.with_attr(schedules.TF32X3_ATTR, True)  # or as three TF32 products
        return func

    def scheduled(self, key: str, func, role: str):
        if key in self._done:  # the same component in both entries (the input GEMM)
            return self._done[key]
        func = self.marked(key, func, role)
        self.lowered.components[key] = (func, role)
        result = schedules.schedule(func, self.target, role, self.database)
        self._done[key] = result.func
        self.lowered.rules[key] = result.rule
        self.lowered.notes += [f"{key}: {note}" for note in result.notes]
        return result.func

    def product_parts(self, key: str, func) -> int:
        """The slices S > 1 that one step's product ``func`` (gemm component ``key``) is left
        in for its reader to add (:func:`comp.gemm_parts`): where tensor cores take it in
        slices of K (:func:`schedules.product_parts`: their grids need them), or where the rule
        that schedules it splits K anyway (cuda.sgemm: its own sum kernel is then saved), else
        1."""
        if self.target.kind.name != "cuda" or self.layout.gates != "combined":
            return 1
        self.scheduled(key, func, "gemm")
        marked, _ = self.lowered.components[key]  # (allowing TF32 where the problem does)
        tensor_cores = schedules.product_parts(marked, self.target)
        if tensor_cores > 1:
            return tensor_cores
        return schedules.cuda_sgemm.parts(func) if self.lowered.rules[key] == "cuda.sgemm" else 1

    def param(self, sig, name, shape, kind, dtype=None):
        dtype = dtype or self.p.dtype
        sig.append({"name": name, "shape": [_signature_dim(d) for d in shape],
                    "dtype": dtype, "kind": kind})
        return tirx.decl_buffer(tuple(i64(d) if isinstance(d, int) else d for d in shape),
                                dtype, name)

    def add(self, name, func, sig):
        """Entry ``name``: ``func``, whose parameters the runtime passes by position as ``sig``
        lists them (checked here: a swap would pass one buffer for another)."""
        names = [str(v.name) for v in func.params[:len(sig)]]
        if names != [s["name"] for s in sig]:
            raise AssertionError(f"entry {name}: parameters {names} against the signature's "
                                 f"{[s['name'] for s in sig]}")
        sig += scratch_signature(func, len(sig))
        self.lowered.mod[name] = func
        self.lowered.signatures[name] = sig

    def pack(self, name, which, k, layout_or_func, rule_key=None, rows=None, tf32=False,
             padded=None):
        """The entry that packs a [G*H, K] weight (``rows``: (G, H) if not the cell's; with two
        directions, ``_reverse``'s too, stacked along the packed shape's first dimension;
        ``tf32``: rounded to TF32 as packed; ``padded``: K' > K, zeros past K)."""
        p = self.p
        g, h = rows or (p.gates, p.hidden_size)
        if isinstance(layout_or_func, Layout):
            func = comp.pack_weight(g, h, k, layout_or_func, p.dtype, tf32, padded)
        else:
            func = layout_or_func
        shape = tuple(int(d) for d in func.params[1].shape)
        func = self.scheduled(rule_key or name, func, "elementwise")
        sig = []
        tags = _grid_tags(p)
        srcs = [self.param(sig, f"weight_{which}_{tag}", (g * h, k), "input") for tag in tags]
        dst = self.param(sig, f"w_{which}", (len(tags) * shape[0], *shape[1:]), "output")
        if (len(tags) == 1 and isinstance(layout_or_func, Layout)
                and layout_or_func.packs_as_given and not tf32 and padded in (None, k)):
            sig[-1]["same_as"] = sig[0]["name"]  # a copy: the runtime may use the given one
        if len(tags) == 1:
            self.add(name, standalone_function(name, _rename_params(func, [*srcs, dst])), sig)
            return
        stages = [Stage(f"{name}_{tags[d]}", func, [Region(src, (ALL, ALL)),
                                                    _part(dst, d, len(tags))], 1)
                  for d, src in enumerate(srcs)]
        self.add(name, sequence_function(name, [*srcs, dst], stages, None, None, []), sig)

    def in_accumulation(self, sig, vectors):
        """The vectors [W] a step reads (b_hh, the cell's per-unit parameters) as it reads
        them, in the accumulation dtype (:func:`comp.cell_step`: a conversion from 16 bits
        inside a step keeps nvcc from sharing its outputs' values): a half layer's copied into
        workspaces once before the steps. Returns (what the step reads, a buffer a vector; the
        new workspaces; the stages that fill them)."""
        p, acc = self.p, accum_dtype(self.p.dtype)
        if p.dtype == acc:
            return list(vectors), [], []
        copies = [self.param(sig, f"{v.name}_{acc}", (int(v.shape[0]),), "workspace", acc)
                  for v in vectors]
        stages = [Stage(f"cast_{v.name}", self.scheduled(f"cast_{int(v.shape[0])}", comp.cast(
            int(v.shape[0]), p.dtype, acc), "elementwise"), [Region(v, (ALL,)),
                                                              Region(w, (ALL,))], 1)
                  for v, w in zip(vectors, copies)]
        return copies, copies, stages

    def pack_folded(self, plan):
        """The persistent entry's packing with a projection (LSTMP): W_hh W_hr [G*H, H] in the
        kernel's layout (``w_hh``: the kernel runs the cell on h' as it runs it on h), and W_hh
        [G*H, P] as the sequence packs it (``w_hh_rows``: the first step's product by the
        initial h); with two directions, ``_reverse``'s after, along the first dimension."""
        p, layout = self.p, self.layout
        g, h, proj = p.gates, p.hidden_size, p.proj_size
        fold = self.scheduled("persistent_pack_folded", comp.pack_persistent(
            g, h, plan, p.dtype, folded=proj), "elementwise")
        rows = self.scheduled("pack_w_hh", comp.pack_weight(g, h, proj, layout, p.dtype),
                              "elementwise")
        sig, tags = [], _grid_tags(p)
        w_hh = [self.param(sig, f"weight_hh_{tag}", (g * h, proj), "input") for tag in tags]
        w_hr = [self.param(sig, f"weight_hr_{tag}", (proj, h), "input") for tag in tags]
        shapes = [tuple(int(d) for d in f.params[-1].shape) for f in (fold, rows)]
        packed, given = (self.param(sig, name, (len(tags) * shape[0], *shape[1:]), "output")
                         for name, shape in zip(("w_hh", "w_hh_rows"), shapes))
        stages = []
        for d, tag in enumerate(tags):
            stages += [Stage(f"fold_{tag}", fold, [Region(w_hh[d], (ALL, ALL)),
                                                   Region(w_hr[d], (ALL, ALL)),
                                                   _part(packed, d, len(tags))], 1),
                       Stage(f"rows_{tag}", rows, [Region(w_hh[d], (ALL, ALL)),
                                                   _part(given, d, len(tags))], 1)]
        self.add("persistent_pack_w_hh", sequence_function(
            "persistent_pack_w_hh", [*w_hh, *w_hr, packed, given], stages, None, None, []), sig)

    def pack_biases(self):
        """With two directions or layers, the entry that puts their biases side by side:
        b_ih and b_hh [D*G*H] (or [L*G*H]), and the cell's per-unit parameters, p_<name>
        [D*H] each."""
        p = self.p
        gh, h, tags = p.gates * p.hidden_size, p.hidden_size, _grid_tags(p)
        vectors = [(f"bias_{which}", f"b_{which}", gh) for which in ("ih", "hh")]
        vectors += [(name, f"p_{name}", h) for name in p.cell.params]
        sig, srcs, dsts, stages = [], [], [], []
        for given, packed, width in vectors:
            func = self.scheduled(f"pack_{width}", comp.concat(len(tags), width, p.dtype),
                                  "elementwise")
            ins = [self.param(sig, f"{given}_{tag}", (width,), "input") for tag in tags]
            srcs += ins
            dsts.append(self.param(sig, packed, (len(tags) * width,), "output"))
            stages.append(Stage(f"pack_{packed}", func, [Region(b, (ALL,)) for b in ins]
                                + [Region(dsts[-1], (ALL,))], 1))
        sig.sort(key=lambda entry: entry["kind"] == "output")  # the inputs first
        self.add("pack_biases", sequence_function("pack_biases", [*srcs, *dsts], stages, None,
                                                  None, []), sig)

    def io(self, sig, t_len, w_hh_shape, w_ih_shape=None):
        """The parameters both forward functions start with (``lengths`` [N] int32, the
        samples' lengths, where the problem takes them, else None). With D directions: the
        weights stacked along their first dimension, the biases [D*G*H], the cell's per-unit
        parameters [D*H] each (``p_<name>``), with a projection W_hr packed (``w_hr``, else
        None), the states [D, N, H] and y [T, N, D*H] (h's state and y R = P wide with a
        projection)."""
        p, layout = self.p, self.layout
        n, c, h, g, d = p.batch, p.input_size, p.hidden_size, p.gates, len(_grid_tags(p))
        widths = p.state_widths

        def stacked(shape):
            return (d * shape[0], *shape[1:])

        x = self.param(sig, "x", (t_len, n, c), "input")
        w_ih = self.param(sig, "w_ih", stacked(w_ih_shape or layout.weight_shape(
            g, h, self.input_k)), "input")
        w_hh = self.param(sig, "w_hh", stacked(w_hh_shape), "input")
        b_ih = self.param(sig, "b_ih", (d * g * h,), "input")
        b_hh = self.param(sig, "b_hh", (d * g * h,), "input")
        per_unit = [self.param(sig, f"p_{name}", (d * h,), "input") for name in p.cell.params]
        w_hr = (self.param(sig, "w_hr", stacked(layout.matrix.weight_shape(
            1, p.proj_size, h)), "input") if p.proj_size else None)
        s0 = [self.param(sig, f"{s}0", (d, n, w), "input") for s, w in zip(p.cell.states,
                                                                            widths)]
        lengths = self.param(sig, "lengths", (n,), "input", "int32") if p.lengths else None
        y = self.param(sig, "y", (t_len, n, p.directions * widths[0]), "output")
        sn = [self.param(sig, f"{s}_n", (d, n, w), "output") for s, w in zip(p.cell.states,
                                                                              widths)]
        return x, w_ih, w_hh, b_ih, b_hh, per_unit, w_hr, s0, lengths, y, sn

    def states_copy(self, key, src, dst, name=None, tf32=False):
        """Stages that copy the states' regions ``src`` [N, width] to ``dst`` (``tf32``:
        rounded to TF32): one, or with a projection (h P wide, the others H) one for h and one
        for the others."""
        name = name or key
        widths = [int(r.buffer.shape[-1]) for r in src]
        if len(set(widths)) > 1:
            return (self.states_copy(f"{key}_h", src[:1], dst[:1], f"{name}_h")
                    + self.states_copy(key, src[1:], dst[1:], name))
        func = self.scheduled(key, comp.copy(len(src), self.p.batch, widths[0],
                                             src[0].buffer.dtype, dst[0].buffer.dtype, tf32),
                              "elementwise")
        return [Stage(name, func, src + dst, len(dst))]

    def reversed_steps(self, name, src, dst, lengths):
        """A stage: each sample's steps of ``src`` reversed into ``dst`` (regions [T, N, F])."""
        p = self.p
        t_len, width = src.buffer.shape[0], src.kept()[-1][0]
        func = self.scheduled(f"reverse_{name}", comp.reverse_steps(
            p.batch, int(width), src.buffer.dtype, t_len, lengths is not None), "elementwise")
        given = [Region(lengths, (ALL,))] if lengths is not None else []
        return Stage(f"reverse_{name}", func, [src, *given, dst], 1)

    def projections(self, name, a_region, lead, k, w, b, out_of_gate, out_whole, d=None,
                    gates=None, lengths=None):
        """One GEMM over all gates, or one a gate (gate_gemm off), of direction ``d``'s
        weights (their part of the stacked ``w`` and ``b``), or of all directions' at once
        (``d`` None); with ``gates`` (and ``d``), of the first ones only. ``lengths``: the
        samples' (lengths, ends) buffers (:meth:`row_ends`), for a GEMM of all steps that
        leaves out the rows past the lengths."""
        p, layout = self.p, self.layout
        h, count_gates = p.hidden_size, gates or p.gates
        g = p.gates
        a_dtype = a_region.buffer.dtype
        count = p.directions if d is None else 1
        first = 0 if d is None else d
        if layout.gates == "combined":
            rows = int(w.shape[0]) // p.directions
            width = count * count_gates * h
            func = self.scheduled(
                name + ("_lengths" if lengths else ""), comp.gemm(
                    lead, k, width, layout.weights, p.dtype, a_dtype, bool(lengths)),
                "gemm")
            w_part = Region(w, (slice(first * rows, first * rows + width), ALL)
                            if layout.weights == "rows"  # cols: every gate (gates is None)
                            else (slice(first * rows, (first + count) * rows), ALL))
            b_part = Region(b, (slice(first * g * h, first * g * h + width),))
            given = [Region(v, (ALL,)) for v in lengths] if lengths else []
            return [Stage(name, func, [a_region, w_part, b_part, *given, out_whole], 1)]
        func = self.scheduled(name, comp.gemm(lead, k, h, layout.weights, p.dtype, a_dtype),
                              "gemm")
        return [Stage(f"{name}_g{i}", func,
                      [a_region, Region(w, (first * g + i, ALL, ALL)),
                       Region(b, (slice((first * g + i) * h, (first * g + i + 1) * h),)),
                       out_of_gate(i)], 1)
                for i in range(count_gates)]

    def step_plan(self, func, h_form: str | None):
        """The plan of one step as one kernel (:mod:`rnncc.schedules.cuda_wgmma_step`: the
        recurrent product, gemm component ``func``, on warpgroup MMA, the cell as its
        epilogue), or None: where the ``fused_step`` option is on, h is the products' copy
        (``h_form``), the gates combined in rows and the warpgroup-MMA rule takes the step's
        product (else its kernel and the cell step's, as before)."""
        p, layout = self.p, self.layout
        if (not self.options.fused_step or not h_form or layout.gates != "combined"
                or layout.weights != "rows" or not schedules.has_wgmma(self.target)
                or schedules.cuda_wgmma_step.takes(p.cell) is not None):
            return None
        found = schedules.cuda_mma_gemm.product_of(
            self.marked("recurrent_gemm", func, "gemm"), self.target)
        if found is None or schedules.cuda_wgmma_gemm.one_step(found) is None:
            return None
        return schedules.cuda_wgmma_step.plan_of(found, p.gates)

    def recurrent_depth(self, h_form: str | None) -> int:
        """K of each step's recurrent product in the non-persistent entry: R, or R' past it
        (:func:`padded_recurrent_size`) where the step is then the one-step kernel in swapped
        tiles (an inference layer: W_hh packed [G*H, R'] and h's copy [2, N, R'], zeros past
        R, the copy's set each call; a training module's backward reads W_hh as packed)."""
        p, r = self.p, self.p.recurrent_size
        padded = padded_recurrent_size(p, h_form)
        if padded == r or p.training:
            return r
        dtype = "float32" if h_form == "tf32" else p.dtype
        plan = self.step_plan(comp.gemm((p.batch,), padded, p.gates * p.hidden_size, "rows",
                                        p.dtype, dtype), h_form)
        return padded if plan is not None and plan.swapped else r

    def fused_step(self, plan, masked: bool):
        """The kernel of one step (:meth:`step_plan`'s ``plan``; ``masked``: it reads the
        samples' activity), built once for every direction."""
        if "step" not in self._done:
            self._done["step"] = schedules.cuda_wgmma_step.kernel(
                schedules.cuda_wgmma_step.Step(plan, self.p.cell, masked))
            self.lowered.rules["step"] = "cuda.wgmma_step"
        return self._done["step"]

    def row_ends(self, sig, x, lengths, lead):
        """With the samples' ``lengths``: (lengths, ``ends`` [N] int32) for the input GEMM
        of all steps (of ``lead``) to leave out the rows past the lengths, and the stage
        computing ``ends`` (:meth:`length_ends`); where cuda.sgemm takes such a product (on
        CUDA, IEEE float32 products of the combined gates), else
        (None, []). The rows left out are read only by masked steps (in training too: the
        backward pass selects zeros for their gradients, whatever they hold)."""
        p, layout = self.p, self.layout
        if (lengths is None or len(lead) != 2 or not self.sums_rows_within_lengths()
                or layout.gates != "combined"
                or (layout.flat_rows and p.directions == 1)):
            return None, []
        ends, stage = self.length_ends(sig, x, lengths)
        return (lengths, ends), [stage]

    def sums_rows_within_lengths(self) -> bool:
        """Whether the products over the rows of all steps leave out the rows past the
        samples' lengths where the layer takes them: on CUDA in IEEE float32 (cuda.sgemm's
        and cuda.weight_grad's kernels)."""
        p = self.p
        return self.target.kind.name == "cuda" and p.dtype == "float32" and not p.allow_tf32

    def length_ends(self, sig, a, lengths, key="length_ends"):
        """A workspace ``ends`` [N] int32 and the stage that computes it from ``lengths``
        (:func:`comp.length_ends`, component ``key``, T from ``a`` [T, N, F])."""
        p = self.p
        ends = self.param(sig, "ends", (p.batch,), "workspace", "int32")
        func = self.scheduled(key, comp.length_ends(
            p.batch, a.shape[0], int(a.shape[2]), a.dtype), "elementwise")
        return ends, Stage("length_ends", func, [
            Region(a, (ALL,) * 3), Region(lengths, (ALL,)), Region(ends, (ALL,))], 1)

    def tiles_steps(self, history: bool, lengths) -> bool:
        """Whether the input GEMM of all steps goes in tiles of whole steps
        (:meth:`step_tiles`): CPU inference at batch 1 or 2, gates combined, no lengths."""
        p = self.p
        rows = schedules.cpu_gemm.TILE_ROWS
        return (self.target.kind.name == "llvm" and not history and lengths is None
                and self.layout.gates == "combined" and p.batch < rows
                and rows % p.batch == 0)

    def input_operands(self, x, xp, flat=True):
        """(x's region, the GEMM's lead, xp's region, views to declare) for the input GEMM of
        all steps: x and xp whole, or, with flat rows (where ``flat``), [T*N, C] and
        [T*N, G*H] views of them."""
        t_len, n = x.shape[0], self.p.batch
        if not (flat and self.layout.flat_rows):
            return (Region(x, (ALL,) * 3), (t_len, n), Region(xp, (ALL,) * len(xp.shape)), [])
        x_rows, xp_rows = (tirx.decl_buffer((t_len * i64(n), b.shape[-1]), b.dtype,
                                            f"{b.name}_rows") for b in (x, xp))
        return (Region(x_rows, (ALL,) * 2), (tirx.Var("M", "int64"),),
                Region(xp_rows, (ALL,) * 2), [(x_rows, x), (xp_rows, xp)])

    def padded_x(self, sig, x):
        """(what the input GEMM of all steps reads of x, the stages that make it): x itself,
        or, where its K is padded (:attr:`input_k`), a workspace [T, N, C'] that a stage
        copies x into, zeros past C."""
        p, c, k = self.p, self.p.input_size, self.input_k
        if k == c:
            return x, []
        padded = self.param(sig, "x_padded", (x.shape[0], p.batch, k), "workspace")
        func = self.scheduled("pad_x", comp.padded_steps(p.batch, c, k, p.dtype, x.shape[0]),
                              "elementwise")
        return padded, [Stage("pad_x", func, [Region(x, (ALL,) * 3),
                                              Region(padded, (ALL,) * 3)], 1)]

    def step_tiles(self, x, xp, d: int):
        """CPU modules at batch N of 1 or 2: direction ``d``'s input GEMM of all steps in two
        parts, the first T - T mod S steps as [T/S, R, C] and [T/S, R, G*H] views of x and of
        xp's direction d (R = :data:`cpu_gemm.TILE_ROWS` rows, S = R / N steps: register tiles
        of whole steps, with no bound on each row), then the last T mod S steps as they are:
        ((x's region, lead, xp's region, component) of each part, the views to declare). The
        products of all steps at batch 1 otherwise take tiles of one row (one step) or bound
        each row by the run-time T, which kept a tile's sums in memory (docs/benchmarks.md,
        fifty-fifth session)."""
        t_len, n, dirs = x.shape[0], self.p.batch, self.p.directions
        rows, width = schedules.cpu_gemm.TILE_ROWS, xp.shape[-1]
        steps = i64(rows // n)
        whole = tirx.floordiv(t_len, steps) * steps
        x_tiles = tirx.decl_buffer((tirx.floordiv(t_len, steps), i64(rows), x.shape[-1]),
                                   x.dtype, f"{x.name}_tiles")
        xp_tiles = tirx.decl_buffer((tirx.floordiv(t_len, steps), i64(rows), width), xp.dtype,
                                    f"{xp.name}_tiles{_SUFFIX[d]}",
                                    elem_offset=i64(d) * t_len * i64(n) * width)
        rest = (slice(whole, None), slice(None), slice(None))
        return ([(Region(x_tiles, (ALL,) * 3), (tirx.Var("S", "int64"), rows),
                  Region(xp_tiles, (ALL,) * 3), "input_gemm_tiles"),
                 (Region(x, rest), (tirx.Var("R", "int64"), n),
                  Region(xp, rest if dirs == 1 else (d, *rest)), "input_gemm_rest")],
                [(x_tiles, x), (xp_tiles, xp)])

    def sequence_entry(self, name: str = "forward", history: bool = False):
        """The non-persistent entry. With two directions, the reverse one runs the same steps
        on each sample's steps reversed (x reversed first, its y reversed back into y's
        second half at the end); the workspaces have a leading direction dimension.
        ``history`` (one direction; the training forward, ``name`` "train_forward"): the
        states of every step are outputs, ``<s>_steps`` [T+1, N, H] (the initial ones at 0,
        step t's new ones at t + 1), and what the backward entry needs of every step's
        projections, ``pre`` [T, N, P*H] (:func:`rnncc.lowering.training.kept_parts`).
        With a projection (``proj_size`` P) the cell's h' [N, H] goes to a workspace and each
        step's h [N, P] is W_hr h' (:meth:`projection`)."""
        p, options, layout = self.p, self.options, self.layout
        n, c, h, g, dirs = p.batch, p.input_size, p.hidden_size, p.gates, p.directions
        r, proj = p.recurrent_size, p.proj_size
        per_gate = layout.gates == "per_gate"
        h_form = h_for_products(self.target, p, options)
        k_rec = self.recurrent_depth(h_form)  # K of the step's recurrent product
        if not history:  # the training forward takes the same packed weights
            self.pack("pack_w_ih", "ih", c, layout, tf32=h_form == "tf32", padded=self.input_k)
            self.pack("pack_w_hh", "hh", r, layout, tf32=h_form == "tf32", padded=k_rec)
        if proj:
            self.pack("pack_w_hr", "hr", h, layout.matrix, rows=(1, proj))
        if dirs > 1:
            self.pack_biases()
        t_len, t = tirx.Var("T", "int64"), tirx.Var("t", "int64")
        sig = []
        x, w_ih, w_hh, b_ih, b_hh, per_unit, w_hr, s0, lengths, y, sn = self.io(
            sig, t_len, layout.weight_shape(g, h, k_rec))
        x_in, padding = self.padded_x(sig, x)
        c_in = self.input_k

        def per_direction(shape):
            return shape if dirs == 1 else (dirs, *shape)

        def at(d, index):
            return index if dirs == 1 else (d, *index)

        if options.input_gemm:
            xp_shape = (g, t_len, n, h) if per_gate else (t_len, n, g * h)
        else:
            xp_shape = (g, n, h) if per_gate else (n, g * h)
        acc = accum_dtype(p.dtype)
        h_dtype = p.dtype if h_form and h_form != "tf32" else acc
        if h_form == "tf32":  # the products of h and of x by weights rounded as packed
            self.rounded.update(recurrent_gemm="ab", recurrent_gemm_parts="ab", input_gemm="b")
        products = autodiff.product_gates(autodiff.trace(p.cell))
        # the gates whose recurrent products of h the step reads: all but the last ones whose
        # products it takes of another value (where the packed rows of those are contiguous)
        rec_gates = g
        while rec_gates - 1 in products and (per_gate or layout.weights == "rows"):
            rec_gates -= 1
        recurrent = comp.gemm((n,), k_rec, rec_gates * h, layout.weights, p.dtype, h_dtype)
        # one step as one kernel (the product's sums never stored), where it takes the step
        step_plan = None if history or proj or products else self.step_plan(recurrent, h_form)
        rec_parts = 1 if step_plan else self.product_parts("recurrent_gemm", recurrent)
        kept_parts = training.kept_parts(p.cell) if history else ()
        in_place = (history and options.input_gemm and not per_gate
                    and sums_in_place(kept_parts))
        xp = None if in_place else self.param(sig, "xp", per_direction(xp_shape), "workspace",
                                              acc)
        hp_shape = (g, n, h) if per_gate else comp.parts_shape(rec_parts, (n, rec_gates * h))
        hp = (None if step_plan else
              self.param(sig, "hp", per_direction(hp_shape), "workspace", acc))
        # the step's recurrent products of its values: the argument of one, then all of them
        argument = (self.param(sig, "product_argument", per_direction((n, h)), "workspace", acc)
                    if products else None)
        products_ws = (self.param(sig, "products", per_direction((len(products), n, h)),
                                  "workspace", acc) if products else None)
        pre = None
        widths = p.state_widths  # h's is P wide with a projection
        if history:
            sw = [self.param(sig, f"{s}_steps", (t_len + i64(1), n, w), "output", acc)
                  for s, w in zip(p.cell.states, widths)]
            pre = self.param(sig, "pre", (t_len, n, len(kept_parts) * h), "output", acc)
            xp = pre if in_place else xp
        else:
            sw = [self.param(sig, f"{s}_ws", per_direction((2, n, w)), "workspace", acc)
                  for s, w in zip(p.cell.states, widths)]
        h_operand = (self.param(sig, "h_operand", per_direction((2, n, k_rec)), "workspace",
                                h_dtype) if h_form else None)
        h_cols = ALL if k_rec == r else slice(0, r)  # a slot's columns the steps write
        # the vectors the cell step reads, in the accumulation dtype
        given_vectors = ([b_hh] if rec_parts > 1 else []) + per_unit
        read, vector_copies, casts = self.in_accumulation(sig, given_vectors)
        vectors = {v.name: r for v, r in zip(given_vectors, read)}
        x_rev = y_rev = None
        if dirs > 1:
            x_rev = self.param(sig, "x_reversed", (t_len, n, c_in), "workspace")
            y_rev = self.param(sig, "y_reversed", (t_len, n, r), "workspace")
        # with a projection: the cell's h' (its y; the training forward keeps every step's,
        # ``h_cell_steps`` [T, N, H]), then W_hr h'
        # (left in slices where its product splits K: the projected state adds them)
        hf = hr = zero = None
        proj_parts, hr_shape = 1, ()
        if proj:
            hf = (self.param(sig, "h_cell_steps", (t_len, n, h), "output") if history
                  else self.param(sig, "h_cell", per_direction((n, h)), "workspace"))
            proj_parts = self.product_parts("projection_gemm", self._projection_gemm())
            hr_shape = comp.parts_shape(proj_parts, (n, proj))
            hr = self.param(sig, "h_projected", per_direction(hr_shape), "workspace", acc)
            if proj_parts == 1:
                zero = self.param(sig, "zero_bias", (proj,), "workspace")

        prologue = [stage for d in range(dirs) for stage in self.states_copy(
            "init_states", [Region(s, (d, ALL, ALL)) for s in s0],
            [Region(s, at(d, (0, ALL, ALL))) for s in sw], f"init_states{_SUFFIX[d]}")]
        if h_operand is not None:
            if k_rec != r:  # its columns past R, which the steps leave, zeros
                shape = per_direction((2, n, k_rec))
                prologue.append(Stage("zero_h_operand", self.scheduled(
                    "zero_h_operand", comp.zeros(shape, h_dtype), "elementwise"),
                    [Region(h_operand, (ALL,) * len(shape))], 1))
            prologue += [stage for d in range(dirs) for stage in self.states_copy(
                "init_h_operand", [Region(s0[0], (d, ALL, ALL))],
                [Region(h_operand, at(d, (0, ALL, h_cols)))], f"init_h_operand{_SUFFIX[d]}",
                tf32=h_form == "tf32")]
        prologue += casts + padding
        active = []
        if lengths is not None:  # active[t, n]: step t within sample n's length
            active = [self.param(sig, "active", (t_len, n), "workspace", "int32")]
            func = self.scheduled("activity", comp.activity(n, t_len), "elementwise")
            prologue.append(Stage("activity", func, [Region(lengths, (ALL,)),
                                                     Region(active[0], (ALL, ALL))], 1))
        skipping, stages = (self.row_ends(sig, x, lengths, (t_len, n)) if options.input_gemm
                            else (None, []))
        prologue += stages
        if x_rev is not None:
            prologue.append(self.reversed_steps("x", Region(x_in, (ALL,) * 3),
                                                Region(x_rev, (ALL,) * 3), lengths))
        if zero is not None:
            prologue.append(Stage("zero_bias", self.scheduled(
                "zero_bias", comp.zeros((proj,), p.dtype), "elementwise"),
                [Region(zero, (ALL,))], 1))
        steps, views = [], []
        slot = t if history else tirx.floormod(t, i64(2))
        nxt = t + i64(1) if history else tirx.floormod(t + i64(1), i64(2))
        for d in range(dirs):
            xs, suffix = (x_in, "") if d == 0 else (x_rev, _SUFFIX[d])
            if options.input_gemm and self.tiles_steps(history, skipping):
                parts, more = self.step_tiles(xs, xp, d)
                views += more
                for x_region, lead, xp_region, key in parts:
                    prologue += _named(self.projections(key, x_region, lead, c_in, w_ih,
                                                        b_ih, None, xp_region, d), suffix)
                gi = [Region(xp, at(d, (t, ALL, ALL)))]
            elif options.input_gemm:
                x_region, lead, xp_region, more = self.input_operands(xs, xp, flat=dirs == 1)
                views += more
                if dirs > 1:
                    xp_region = Region(xp, at(d, (ALL,) * len(xp_shape)))
                prologue += _named(self.projections(
                    "input_gemm", x_region, lead, c_in, w_ih, b_ih,
                    lambda i, d=d: Region(xp, at(d, (i, ALL, ALL, ALL))), xp_region, d,
                    lengths=skipping), suffix)
                gi = ([Region(xp, at(d, (i, t, ALL, ALL))) for i in range(g)] if per_gate
                      else [Region(xp, at(d, (t, ALL, ALL)))])
            else:
                steps += _named(self.projections(
                    "input_gemm", Region(xs, (t, ALL, ALL)), (n,), c_in, w_ih, b_ih,
                    lambda i, d=d: Region(xp, at(d, (i, ALL, ALL))),
                    Region(xp, at(d, (ALL, ALL))), d), suffix)
                gi = ([Region(xp, at(d, (i, ALL, ALL))) for i in range(g)] if per_gate
                      else [Region(xp, at(d, (ALL, ALL)))])
            h_prev = (Region(h_operand, at(d, (tirx.floormod(t, i64(2)), ALL, ALL)))
                      if h_form else Region(sw[0], at(d, (slot, ALL, ALL))))
            own = sw[1:] if proj else sw  # with a projection, h is the projection's to write
            per_unit_d = [Region(vectors[v.name], (slice(d * h, (d + 1) * h),))
                          for v in per_unit]
            out = (Region(y, (t, ALL, ALL)) if dirs == 1 else Region(y, (t, ALL, slice(0, r)))
                   if d == 0 else Region(y_rev, (t, ALL, ALL)))
            h_next = ([Region(h_operand, at(d, (tirx.floormod(t + i64(1), i64(2)), ALL,
                                                 h_cols)))] if h_form else [])
            if step_plan is not None:  # the product and the cell in one kernel
                rows = slice(d * g * h, (d + 1) * g * h)
                steps.append(Stage(f"step{suffix}", self.fused_step(step_plan, bool(active)), [
                    h_prev, Region(w_hh, (rows, ALL)), Region(b_hh, (rows,)), *gi, *per_unit_d,
                    *[Region(s, at(d, (slot, ALL, ALL))) for s in own],
                    *[Region(a, (t, ALL)) for a in active], out,
                    *[Region(s, at(d, (nxt, ALL, ALL))) for s in own], *h_next],
                    2 + len(own)))
                continue
            if rec_parts > 1:  # the slices of K into hp; the cell step adds them and b_hh
                parts_func = self.scheduled("recurrent_gemm_parts", comp.gemm_parts(
                    n, k_rec, rec_gates * h, rec_parts, layout.weights, p.dtype, h_dtype),
                    "gemm")
                steps.append(Stage(f"recurrent_gemm{suffix}", parts_func, [
                    h_prev, Region(w_hh, (slice(d * g * h, (d * g + rec_gates) * h), ALL)),
                    Region(hp, at(d, (ALL, ALL, ALL)))], 1))
                gh = [Region(hp, at(d, (ALL, ALL, ALL))),
                      Region(vectors[b_hh.name], (slice(d * g * h, (d + 1) * g * h),))]
            else:
                steps += _named(self.projections(
                    "recurrent_gemm", h_prev, (n,), k_rec, w_hh, b_hh,
                    lambda i, d=d: Region(hp, at(d, (i, ALL, ALL))),
                    Region(hp, at(d, (ALL, ALL))), d, rec_gates), suffix)
                gh = ([Region(hp, at(d, (i, ALL, ALL))) for i in range(g)] if per_gate
                      else [Region(hp, at(d, (ALL, ALL)))])
            taken = []  # the step's products of its values so far
            for k, gate in enumerate(products):
                steps += self.recurrent_product(
                    gate, rec_parts, rec_gates, gi + gh + taken + per_unit_d
                    + [Region(s, at(d, (slot, ALL, ALL))) for s in own],
                    Region(argument, at(d, (ALL, ALL))), w_hh, b_hh, d,
                    Region(products_ws, at(d, (k, ALL, ALL))), suffix)
                taken.append(Region(products_ws, at(d, (k, ALL, ALL))))
            step_func = self.scheduled(
                "cell_step_kept" if history else "cell_step",
                comp.cell_step(p.cell, n, h, p.dtype, layout.gates, options.fuse_pointwise,
                               masked=bool(active), kept=kept_parts, rec_parts=rec_parts,
                               projected=bool(proj), recurrent_gates=rec_gates,
                               h_copy=h_form, selects=self.target.kind.name == "cuda"),
                "elementwise")
            kept = [Region(pre, (t, ALL, slice(i * h, (i + 1) * h)))
                    for i in range(len(kept_parts))]
            h_cell = None
            if proj:  # the cell's h' to hf
                h_cell = (Region(hf, (t, ALL, ALL)) if history
                          else Region(hf, at(d, (ALL, ALL))))
            steps.append(Stage(
                f"cell_step{suffix}", step_func,
                gi + gh + taken + per_unit_d + [Region(s, at(d, (slot, ALL, ALL))) for s in own]
                + [Region(a, (t, ALL)) for a in active]
                + [h_cell if proj else out] + [Region(s, at(d, (nxt, ALL, ALL))) for s in own]
                + h_next + kept, 1 + len(own) + len(kept) + len(h_next)))
            if proj:
                steps += _named(self.projection(
                    h_cell, w_hr, d, zero, proj_parts,
                    Region(hr, at(d, (ALL,) * len(hr_shape))),
                    Region(sw[0], at(d, (slot, ALL, ALL))), [Region(a, (t, ALL)) for a in active],
                    out, Region(sw[0], at(d, (nxt, ALL, ALL)))), suffix)
        final = t_len if history else tirx.floormod(t_len, i64(2))
        epilogue = [stage for d in range(dirs) for stage in self.states_copy(
            "final_states", [Region(s, at(d, (final, ALL, ALL))) for s in sw],
            [Region(s, (d, ALL, ALL)) for s in sn], f"final_states{_SUFFIX[d]}")]
        if y_rev is not None:
            epilogue.append(self.reversed_steps("y", Region(y_rev, (ALL,) * 3),
                                                Region(y, (ALL, ALL, slice(r, 2 * r))), lengths))
        given = [lengths] if lengths is not None else []
        reversed_ = [x_rev, y_rev] if x_rev is not None else []
        projected = [w_hr] if proj else []
        params = [x, w_ih, w_hh, b_ih, b_hh, *per_unit, *projected, *s0, *given, y, *sn,
                  *([x_in] if padding else []), *([] if in_place else [xp]),
                  *([hp] if hp is not None else []),
                  *([argument, products_ws] if products else []),
                  *sw, *([pre] if pre is not None else []), *([h_operand] if h_form else []),
                  *vector_copies,
                  *reversed_,
                  *([hf, hr] if proj else []), *([zero] if zero is not None else []),
                  *active, *(skipping or ())[1:]]
        self.add(name, sequence_function(name, params, prologue, t, t_len, steps, epilogue,
                                         views), sig)

    def recurrent_product(self, gate, rec_parts, rec_gates, inputs, argument, w_hh, b_hh, d, out,
                          suffix):
        """A step's recurrent product of one of its values (the cell's ``ops.recurrent`` of
        ``gate``): the value, from the step's ``inputs`` (as the cell step reads them, up to the
        products before), into ``argument`` [N, H]; then ``out`` [N, H] = it times direction
        ``d``'s rows of the gate in the packed W_hh, plus b_hh's."""
        p, layout = self.p, self.layout
        n, h, g = p.batch, p.hidden_size, p.gates
        value = self.scheduled(f"product_argument{gate}", comp.cell_step(
            p.cell, n, h, p.dtype, layout.gates, self.options.fuse_pointwise,
            rec_parts=rec_parts, upto=gate, recurrent_gates=rec_gates), "elementwise")
        gemm = self.scheduled("product_gemm", comp.gemm(
            (n,), h, h, layout.weights, p.dtype, accum_dtype(p.dtype)), "gemm")
        row = d * g + gate
        return [Stage(f"product_argument{gate}{suffix}", value, inputs + [argument], 1),
                Stage(f"product_gemm{gate}{suffix}", gemm, [
                    argument, Region(w_hh, layout.gate_block(d, gate, g, h)),
                    Region(b_hh, (slice(row * h, (row + 1) * h),)), out], 1)]

    def _projection_gemm(self):
        """The projection's product (LSTMP): h' [N, H] by W_hr [P, H] (rows) with a bias."""
        p = self.p
        return comp.gemm((p.batch,), p.hidden_size, p.proj_size, self.layout.weights, p.dtype,
                         p.dtype)

    def projection(self, h_cell, w_hr, d, zero, parts, hr, h_prev, active, y, h_next):
        """A step's projection (LSTMP): ``hr`` = ``h_cell`` [N, H] (the cell's h', zero past a
        sample's length) by direction ``d``'s rows of the stacked packed W_hr (``zero``: its
        bias), then y [N, P] and the new h (the previous one past the sample's length). With
        ``parts`` S > 1 ``hr`` is the product's slices of K [S, N, P] (:func:`comp.gemm_parts`,
        no bias), which the projected state adds."""
        p = self.p
        w = _part(w_hr, d, p.directions)
        if parts > 1:
            gemm = self.scheduled("projection_gemm_parts", comp.gemm_parts(
                p.batch, p.hidden_size, p.proj_size, parts, self.layout.weights, p.dtype,
                p.dtype), "gemm")
            product = Stage("projection_gemm", gemm, [h_cell, w, hr], 1)
        else:
            gemm = self.scheduled("projection_gemm", self._projection_gemm(), "gemm")
            product = Stage("projection_gemm", gemm, [h_cell, w, Region(zero, (ALL,)), hr], 1)
        select = self.scheduled("projected_state", comp.projected_state(
            p.batch, p.proj_size, p.dtype, bool(active), parts), "elementwise")
        return [product, Stage("projected_state", select, [hr, h_prev, *active, y, h_next], 2)]

    def persistent_entry(self, plan, history: bool = False):
        """The persistent entry: one kernel that readies the states' workspaces and the tagged
        words (or the counters; nothing of the kind for the "local" exchange), the input GEMM
        of all steps (both directions' at once), then the kernel, which writes y and the final
        states. With two directions the states' workspaces and the tagged h are [2, D*N, H]
        (direction d's sample n at row d*N + n) and the kernel runs the reverse direction
        backwards. With L layers (a wavefront) the same with L for D, the y of the layers below
        the last in a workspace [T, N, (L-1)*H]. Where the plan pads the batch (planner:
        "Padded batch") the workspaces and the tagged h have N + pad rows. ``history`` (one
        direction, one layer): ``persistent_train_forward``, the training forward on the
        kernel: it takes ``train_forward``'s packed weights (W_hh packed for the kernel each
        call; the input GEMM before the kernel, whatever the plan says) and has its outputs.
        With a projection (LSTMP, inference) the kernel runs on the cell's h' with W_hh W_hr
        folded (:meth:`_folded`)."""
        from ..schedules.persistent import buffers, kernel
        from ..schedules.persistent.stages.exchange import EMPTY_TAG

        p = self.p
        n, c, h, g = p.batch, p.input_size, p.hidden_size, p.gates
        tags, layers = _grid_tags(p), p.layers
        dirs = len(tags)  # the grids: D directions or L layers
        name = "persistent_train_forward" if history else "persistent_forward"
        proj = p.proj_size  # inference (the driver's rule)
        if history:
            plan = replace(plan, input_rows=0, input_chunks=0, input_slab=0, input_steps=0)
        elif proj:
            self.pack_folded(plan)
        else:
            self.pack("persistent_pack_w_hh", "hh", h,
                      comp.pack_persistent(g, h, plan, p.dtype), "persistent_pack_w_hh")
        if layers > 1:
            self.pack_biases()
        w_ih_shape = None
        if plan.fused:  # W_ih packed for the kernel too (planner: "Fused input projection")
            w_ih_shape = (plan.group_blocks, *buffers.input_weight_shape(plan, g)[1:])
            self.pack("persistent_pack_w_ih", "ih", c,
                      comp.pack_fused_input(g, h, c, w_ih_shape, plan, p.dtype),
                      "persistent_pack_w_ih")
        t_len = tirx.Var("T", "int64")
        sig = []
        w_shape = plan.packed_shape
        x, w_ih, w_hh, b_ih, b_hh, per_unit, w_hr, s0, lengths, y, sn = self.io(
            sig, t_len, self.layout.weight_shape(g, h, h) if history else w_shape, w_ih_shape)
        acc = accum_dtype(p.dtype)
        parts, kept, packed = (), [], w_hh
        if history:
            parts = training.kept_parts(p.cell)
            kept = [self.param(sig, f"{s}_steps", (t_len + i64(1), n, h), "output", acc)
                    for s in p.cell.states]
            kept.append(self.param(sig, "pre", (t_len, n, len(parts) * h), "output", acc))
            packed = self.param(sig, "w_hh_packed", w_shape, "workspace")
        xp_shape = (t_len, n, dirs * g * h)
        in_place = history and not plan.fused and sums_in_place(parts)
        xp = kept[-1] if in_place else self.param(sig, "xp", xp_shape, "workspace", acc)
        run = n + plan.pad  # the rows the kernel runs (planner: "Padded batch")
        rows = dirs * run
        sw = [self.param(sig, f"{s}_ws", (2, rows, h), "workspace", acc) for s in p.cell.states]

        folded = self._folded(sig, t_len, w_hr, s0, sw) if proj else None

        graph = autodiff.trace(p.cell)  # values of a step exchanged before h: its reductions'
        values = sum(node.op == "mean" for node in graph.order) or len(graph.products)

        def exchanged(kind, dtype):  # the values' workspaces, one a value
            return [self.param(sig, f"value{k}_{kind}", (2, rows, h), "workspace", dtype)
                    for k in range(values)]

        if plan.sync == "tagged":  # h, and each value, tagged as h before step 0
            sync = self.param(sig, "h_tagged", (2, rows, h), "workspace", "uint64")
            more_sync = exchanged("tagged", "uint64")
            sync_stages, words = [], [sync, *more_sync]
        elif plan.sync in ("local", "cluster"):  # h within the block or cluster
            sync, more_sync = None, exchanged("exchanged", "float32")
            sync_stages, words = [], []
        else:
            counters = dirs * plan.batch_groups
            sync = self.param(sig, "counter", (counters,), "workspace", "uint32")
            zero = self.scheduled("zero_counter", comp.zeros((counters,), "uint32"),
                                  "elementwise")
            sync_stages = [Stage("zero_counter", zero, [Region(sync, (ALL,))], 1)]
            published = buffers.published_h(plan, run, p.dtype)  # h for the next staging
            more_sync = []
            if published:
                shape, dtype = published
                more_sync.append(self.param(sig, "h_published", shape, "workspace", dtype))
            more_sync += exchanged("exchanged", "float32")  # the counter orders them
            words = []
        # the states' workspaces (a projection's h': zero) and the tagged words, every grid's
        init = self.scheduled("init_persistent", comp.init_persistent(
            len(sw), dirs, n, h, p.dtype, acc, len(words), EMPTY_TAG, zero_h=bool(proj),
            rows=run),
            "elementwise")
        prologue = (folded.prologue if proj else []) + [Stage("init_persistent", init, [
            Region(s, (ALL,) * 3) for s in s0[bool(proj):]] + [
            Region(b, (ALL,) * 3) for b in (*sw, *words)], len(sw) + len(words))]
        if history:
            func = self.scheduled("persistent_pack_w_hh_train",
                                  comp.pack_persistent(g, h, plan, p.dtype), "elementwise")
            prologue.append(Stage("persistent_pack_w_hh_train", func, [
                Region(w_hh, (ALL, ALL)), Region(packed, (ALL,) * 6)], 1))
        views = []
        recurrent = [Region(packed, (ALL,) * 6), Region(b_hh, (ALL,))]
        recurrent += [Region(v, (ALL,)) for v in per_unit]
        if proj:  # W_hh h0, for the kernel to add to the first step's input projections
            prologue += folded.initial
            recurrent.append(Region(folded.first, (ALL, ALL)))
        xp_whole = Region(xp, (ALL,) * len(xp_shape))
        skipping, x_in, padding = None, x, []
        if plan.fused:  # the kernel reads x and W_ih and writes xp
            inputs = [Region(x, (ALL,) * 3), Region(w_ih, (ALL,) * 5), Region(b_ih, (ALL,)),
                      *recurrent, xp_whole]
        else:
            x_in, padding = self.padded_x(sig, x)
            x_region, lead, xp_region, views = self.input_operands(x_in, xp)
            skipping, stages = self.row_ends(sig, x, lengths, lead)
            prologue += padding + stages + self.projections(
                "persistent_input_gemm" if dirs > 1 else "input_gemm", x_region, lead,
                self.input_k, w_ih, b_ih, None, xp_region, lengths=skipping)
            inputs = [xp_whole, *recurrent]
        if lengths is not None:
            inputs.append(Region(lengths, (ALL,)))
        prologue += sync_stages
        k_func = kernel.kernel(p.cell, h, n, plan, dtype=p.dtype, input_size=c,
                               lengths=lengths is not None, kept=parts, first=bool(proj),
                               finals=not proj)
        self.lowered.rules[name.removesuffix("_forward")] = f"persistent.{plan.sync}" + (
            "+input" if plan.fused else "") + ("+wavefront" if layers > 1 else "")
        below, more = [], []
        if layers > 1:  # the y of the layers below the last (their next one's x), and the
            # layers' progress counters
            below = [self.param(sig, "y_below", (t_len, n, (layers - 1) * h), "workspace")]
            progress = self.param(sig, "progress", (layers * plan.batch_groups,), "workspace",
                                  "uint32")
            zero = self.scheduled("zero_progress", comp.zeros((layers * plan.batch_groups,),
                                                              "uint32"), "elementwise")
            prologue.append(Stage("zero_progress", zero, [Region(progress, (ALL,))], 1))
            more = [progress]
        outputs = [Region(b, (ALL,) * 3) for b in (
            folded.h_cell if proj else y, *below, *sw, *([] if proj else sn), *kept)]
        synced = ([] if sync is None else [sync]) + more_sync
        outputs += [Region(b, (ALL,) * len(b.shape)) for b in (*synced, *more)]
        prologue.append(Stage("persistent", k_func, inputs + outputs,
                              len(outputs) + plan.fused))
        # the kernel writes the final states (with a projection, h'_T: W_hr h'_T after it)
        epilogue = folded.epilogue(tirx.floormod(t_len, i64(2)), y, sn) if proj else []
        given = [lengths] if lengths is not None else []
        params = [x, w_ih, w_hh, b_ih, b_hh, *per_unit, *([w_hr] if proj else []), *s0,
                  *given, y, *sn, *kept, *([packed] if history else []),
                  *([] if in_place else [xp]), *sw, *(folded.params if proj else []),
                  *synced, *([x_in] if padding else []), *(skipping or ())[1:],
                  *below, *more]
        self.add(name, sequence_function(name, params, prologue, None, None, [], epilogue,
                                         views), sig)


    def _folded(self, sig, t_len, w_hr, s0, sw) -> SimpleNamespace:
        """The persistent kernel's stages around it with a projection (LSTMP), W_hh W_hr
        folded into the matrix it holds (:meth:`pack_folded`): its recurrence is the cell's
        h' [N, H] (zero before step 0), so h0 enters as ``first`` = W_hh h0 [N, D*G*H] (the
        stages ``initial``, one a direction), which the kernel adds to the first step's input
        projections; the kernel writes every step's h' to ``h_cell`` [T, N, D*H] (zero past a
        sample's length), and after it y = W_hr h' (one GEMM of all steps a direction) and the
        final h = W_hr h'_T (``epilogue(final, y, sn)``). Returns also ``prologue`` (a bias
        of zeros for those GEMMs) and ``params`` (its buffers, in ``sig``'s order)."""
        p, layout = self.p, self.layout
        n, h, g, proj, dirs = p.batch, p.hidden_size, p.gates, p.proj_size, p.directions
        acc = accum_dtype(p.dtype)
        rows_shape = layout.weight_shape(g, h, proj)
        w_rows = self.param(sig, "w_hh_rows", (dirs * rows_shape[0], *rows_shape[1:]), "input")
        h_cell = self.param(sig, "h_cell", (t_len, n, dirs * h), "workspace")
        gh0 = self.param(sig, "gh_initial", (n, dirs * g * h), "workspace", acc)
        zero = self.param(sig, "zero_bias", (g * h,), "workspace")
        rounded = p.dtype != acc  # the products in the accumulation dtype, then y and h in P's
        y_acc = (self.param(sig, "y_projected", (t_len, n, dirs * proj), "workspace", acc)
                 if rounded else None)
        h_acc = (self.param(sig, "h_projected", (dirs, n, proj), "workspace", acc)
                 if rounded else None)

        def of(d):  # direction d's rows of the kernel's states
            return slice(d * n, (d + 1) * n)

        prologue = [Stage("zero_bias", self.scheduled("zero_gates_bias", comp.zeros(
            (g * h,), p.dtype), "elementwise"), [Region(zero, (ALL,))], 1)]
        product = self.scheduled("initial_gemm", comp.gemm(
            (n,), proj, g * h, layout.weights, p.dtype), "gemm")
        initial = [Stage(f"initial_gemm{_SUFFIX[d]}", product, [
            Region(s0[0], (d, ALL, ALL)), _part(w_rows, d, dirs), Region(zero, (ALL,)),
            _part(gh0, d, dirs, axis=-1)], 1) for d in range(dirs)]
        b_proj = Region(zero, (slice(0, proj),))

        def epilogue(final, y, sn):
            steps = self.scheduled("projection_steps", comp.gemm(
                (t_len, n), h, proj, layout.weights, p.dtype), "gemm")
            last = self.scheduled("projection_final", comp.gemm(
                (n,), h, proj, layout.weights, p.dtype, acc), "gemm")
            stages = []
            for d in range(dirs):
                h_out = (Region(h_acc, (d, ALL, ALL)) if rounded
                         else Region(sn[0], (d, ALL, ALL)))
                stages += [
                    Stage(f"projection_steps{_SUFFIX[d]}", steps, [
                        _part(h_cell, d, dirs, axis=-1), _part(w_hr, d, dirs), b_proj,
                        _part(y_acc if rounded else y, d, dirs, axis=-1)], 1),
                    Stage(f"projection_final{_SUFFIX[d]}", last, [
                        Region(sw[0], (final, of(d), ALL)), _part(w_hr, d, dirs), b_proj, h_out],
                        1)]
                if rounded:
                    stages += self.states_copy("round_h", [h_out],
                                               [Region(sn[0], (d, ALL, ALL))],
                                               f"round_h{_SUFFIX[d]}")
                stages += self.states_copy(
                    "final_states", [Region(s, (final, of(d), ALL)) for s in sw[1:]],
                    [Region(s, (d, ALL, ALL)) for s in sn[1:]], f"final_states{_SUFFIX[d]}")
            if rounded:
                stages.append(Stage("round_y", self.scheduled("round_y", comp.copy_steps(
                    n, dirs * proj, acc, t_len, p.dtype), "elementwise"),
                    [Region(y_acc, (ALL,) * 3), Region(y, (ALL,) * 3)], 1))
            return stages

        return SimpleNamespace(
            prologue=prologue, initial=initial, first=gh0, epilogue=epilogue, h_cell=h_cell,
            params=[w_rows, h_cell, gh0, zero] + ([y_acc, h_acc] if rounded else []))


def _part(buffer, d: int, count: int, axis: int = 0) -> Region:
    """Part d of ``count`` equal parts of ``buffer`` along ``axis`` (a direction's rows of a
    stacked weight, its columns of y), the other dimensions whole."""
    size = int(buffer.shape[axis]) // count
    index = [ALL] * len(buffer.shape)
    index[axis] = slice(d * size, (d + 1) * size)
    return Region(buffer, tuple(index))


def padded_recurrent_size(problem: Problem, h_form: str | None) -> int:
    """R (H, or P with a projection) rounded up to whole 128-byte rows of h's copy for the
    products (``h_form``: 16-bit or TF32; H 1000 in 16 bits: 2000 bytes -> 1024 values); R
    where it is whole or where the products read h as the float32 state. Where the step is
    the one-step kernel in swapped tiles (:meth:`_Builder.recurrent_depth`) its K: rows off
    128-byte lines cost that kernel a third (H200, float16 LSTM N128, the step alone, us:
    H 1000 9.88, H 1024 6.40; ncu at H 1000: 33% of its global sectors and 48% of its
    shared-memory wavefronts excess)."""
    r = problem.recurrent_size
    if not h_form:
        return r
    per_row = schedules.cuda_wgmma_gemm.ROW_BYTES * 8 // (
        32 if h_form == "tf32" else tvm.DataType(problem.dtype).bits)
    return -(-r // per_row) * per_row


def h_for_products(target, problem: Problem, options: Options) -> str | None:
    """How the non-persistent entry's recurrent products read h, where not as the float32
    state: on CUDA, from a copy the fused cell step writes, ``h_operand`` [2, N, H] (slots
    as the states'), as their tensor cores take it: the layer's half dtype (half the bytes a
    block re-reads; H200, us a step, float32 h before: float16 LSTM 1024 N256 26.0 -> 19.8,
    N128 18.7 -> 13.4, GRU 2048 N256 58.0 -> 40.3, LSTM 2048 N32 32.7 -> 22.9), or "tf32"
    with ``allow_tf32`` (float32 rounded to TF32 once, not by every tile that reads it; the
    packed weights too); else None. Not with a projection (h is W_hr h', its own stage's)."""
    if target.kind.name != "cuda" or problem.proj_size or not options.fuse_pointwise:
        return None
    if problem.dtype != accum_dtype(problem.dtype):
        return problem.dtype
    return "tf32" if problem.allow_tf32 else None


def sums_in_place(parts: tuple) -> bool:
    """Whether the training forward keeps each step's projection sums ``pre`` [T, N, G*H]
    where its input projections were: where every gate is kept as its sum (:func:`rnncc.
    lowering.training.kept_parts`), a gate's sum goes where its input projection was, which
    the cell reads first (one thread an element, the sums stored last; the persistent kernel
    prefetches a step's projections), and the backward pass writes the projections'
    gradients there in turn."""
    return len(parts) > 0 and all(part == "sum" for _, part in parts)


#: Suffix of direction d's weights (torch's names) and stages.
_SUFFIX = ("", "_reverse")


def _grid_tags(p: Problem) -> list[str]:
    """What torch's weight names end with, a grid of the persistent kernel each: "l0" and
    "l0_reverse" for the directions, or "l0" .. "l{L-1}" for the layers."""
    if p.layers > 1:
        return [f"l{k}" for k in range(p.layers)]
    return [f"l0{_SUFFIX[d]}" for d in range(p.directions)]


def _named(stages: list, suffix: str) -> list:
    """``stages`` with ``suffix`` on their names (the reverse direction's)."""
    return [replace(stage, name=stage.name + suffix) for stage in stages]


def build(problem: Problem, options: Options, target, persistent_plan=None,
          database=None, backward_plan=None) -> Lowered:
    """The layer's IRModule: always the non-persistent entry, plus the persistent one when a
    plan is given (CUDA only; its input GEMM always runs over all steps at once), plus the
    training entries where the problem asks for them (with ``persistent_backward`` where
    ``backward_plan`` is given). ``database``: a MetaSchedule database whose records schedule
    the components they match."""
    builder = _Builder(problem, options, target, database)
    if problem.layers == 1:  # a wavefront of layers runs only as the persistent kernel
        builder.sequence_entry()
    if problem.training:
        training.build(builder, backward_plan)
    if persistent_plan is not None:
        builder.persistent_entry(persistent_plan)
        if problem.training:
            builder.persistent_entry(persistent_plan, history=True)
    return builder.lowered


def _signature_dim(dim):
    """A dimension as signatures write it: an int, "T" or "T+1"."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, tvm.ir.Var):
        return "T"
    if isinstance(dim, tirx.Add):
        return "T+1"
    raise ValueError(f"a signature's dimension is an int, T or T + 1, got {dim}")


def _rename_params(func, buffers):
    """``func`` with its parameters replaced by ``buffers`` (same shapes), so the module's
    functions name their parameters as the signature does."""
    remap = dict(zip(func.params, buffers))
    body = tvm_ffi.structural_map(func.body, (tvm.ir.Var, lambda v: remap.get(v, v)),
                                  order="pre")
    return tirx.PrimFunc(list(buffers), body, attrs=func.attrs)
