"""The persistent kernel's buffers: its parameters, and what it keeps on-chip.

Both are declared while the kernel's TVMScript is parsed (:mod:`.kernel` calls
:func:`parameters` and :func:`on_chip`), from the plan alone: a buffer exists only where the
plan needs it (None otherwise). Register arrays (scope ``local``) are indexed only by unrolled
loop indices, so they stay in registers; the ``shared.dyn`` buffers share the block's dynamic
shared memory.
"""

from __future__ import annotations

from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from rnncc.dtypes import projection_grad_dtype

from . import planner
from .planner import Plan
from .spec import KernelSpec, staged_rows
from .stages import exchange


def input_weight_shape(p: Plan, gates: int) -> tuple:
    """Shape of W_ih packed for a fused input projection: [B, KC, RL, 8, VEC] (B: the blocks of
    one batch group; with L layers or D directions, L*B or D*B, grid l's at l*B), block b, chunk c,
    row q of the lane's RL, row group rg, element v holding W_ih[g*H + j, c*VEC + v] with
    r = rg*RL + q, g = r // U and j = b*U + r % U (zero outside)."""
    rl = planner.fused_row_split(p, gates)
    return (p.grids * p.group_blocks, p.input_chunks, rl, planner.ROW_GROUPS, p.vec)


def published_h(p: Plan, batch: int, dtype: str) -> tuple | None:
    """(shape, dtype) of ``hx``, h as the blocks publish it for the next step's staging to
    copy, where the planner says so (:func:`.planner.publishes_staged_h`): a block's staging
    of h_{t-1} ([S]: :func:`.spec.staged_rows` rows of KP in the products' order,
    :mod:`.stages.exchange`) for each step slot, grid and batch group, [2*D*NG*S], in the
    weights' (16-bit) type; else None."""
    if not planner.publishes_staged_h(p, dtype):
        return None
    size = staged_rows(p, batch // p.batch_groups) * p.chunks * 32 * p.vec
    return (2 * p.grids * p.batch_groups * size,), dtype


def parameters(spec: KernelSpec) -> SimpleNamespace:
    """Declare the kernel's parameters, inputs first, outputs last: (with a fused input
    projection: x [T,N,C], W_ih packed (:func:`input_weight_shape`), b_ih [G*H]), xp [T,N,G*H]
    (written by a fused projection, read otherwise; after the per-unit parameters where it is
    written), W_hh packed [B/NG, Wn, KI, RW, 32, VEC], b_hh [G*H], (the cell's per-unit
    parameters p0 ... [H] each, where it has them), (``spec.first``: the addition to the first
    step's projections [N,G*H] float32), (with lengths: the samples' lengths [N] int32), y
    [T,N,H], one [2,N,H] float32 ping-pong buffer a state (h first), (``spec.finals``: the
    final states [1,N,H] each, in the kernel's dtype), (a training forward's,
    ``spec.kept``: the states of every step [T+1,N,H] each and the kept parts ``pre`` [T,N,P*H],
    float32), then the tagged h [2,N,H] uint64, or the barrier counters [NG] uint32, one a batch
    group (neither with the ``"local"`` exchange), (h as published for the next step's
    staging ``hx``, where the planner says so: :func:`published_h`), (the values of the step
    it exchanges before h, its product's argument or each of its means', [2,N,H] each, uint64
    tagged as h, else float32). T is the symbolic length ``T_len``.
    With D = 2 directions (planner: "Directions"), both directions side by side: xp [T,N,D*G*H],
    W_hh [D*B/(D*NG), ...], b_hh [D*G*H], y [T,N,D*H], the states and the tagged h [2,D*N,H],
    the final states [D,N,H], the counters [D*NG] (with a fused input projection W_ih
    [D*B/(D*NG), ...], b_ih [D*G*H]). With L layers (planner: "Layers as a wavefront") the
    same with L for D (W_ih and b_ih too), but y: the last layer's [T,N,H], then the others'
    ``ys`` [T,N,(L-1)*H] (layer l > 0 reads layer l - 1's as its x); and last the layers'
    progress counters ``prog`` [L*NG] uint32. Where the plan pads the batch (planner: "Padded
    batch") the states, the tagged h and the values have N + pad rows, the rest N."""
    p, dt, n = spec.plan, spec.dtype, spec.given_batch
    d, gh, rows = spec.grids, spec.grids * spec.gate_rows, spec.state_rows
    per_unit = [f"p{k}" for k in range(spec.params)]
    first = ["first"] if spec.first else []
    names = (["x", "wi", "bi", "w", "b", *per_unit, *first, "xp"] if p.fused
             else ["xp", "w", "b", *per_unit, *first])
    names += ["len"] if spec.lengths else []
    names += ["y"] + (["ys"] if spec.layers > 1 else [])
    names += [f"s{k}" for k in range(spec.states)]
    names += [f"n{k}" for k in range(spec.states)] if spec.finals else []
    names += [f"steps{k}" for k in range(spec.states)] + ["pre"] if spec.kept else []
    names += ["hw"] if spec.tagged else [] if spec.local or spec.cluster else ["cnt"]
    published = published_h(p, spec.batch, dt)
    names += ["hx"] if published else []
    values = spec.means or spec.rounds  # a buffer a mean, or the product's
    names += [f"aw{r}" for r in range(values)]
    names += ["prog"] if spec.layers > 1 else []
    handles = {a: T.arg(f"{a}_h", T.handle()) for a in names}
    t_len = tirx.Var("T_len", "int64")
    out = SimpleNamespace(T_len=t_len, x=None, wi=None, b_ih=None, lengths=None, hw=None,
                          cnt=None, hx=None, prog=None, steps=None, pre=None, first=None,
                          aw=None, ys=None, finals=None)

    def match(name: str, handle: str, shape, dtype: str):
        buffer = T.match_buffer(handles[handle], shape, dtype)
        IRBuilder.name(name, buffer)
        setattr(out, name, buffer)
        return buffer

    if p.fused:
        match("x", "x", (t_len, n, spec.input_size), dt)
        match("wi", "wi", input_weight_shape(p, spec.gates), dt)
        match("b_ih", "bi", (gh,), dt)
    match("xp", "xp", (t_len, n, gh), "float32")
    match("w", "w", (d * p.group_blocks, *p.packed_shape[1:]), dt)
    match("b_hh", "b", (gh,), dt)
    out.params = [match(f"p{k}", f"p{k}", (d * spec.hidden,), dt) for k in range(spec.params)]
    if spec.first:
        match("first", "first", (n, gh), "float32")
    if spec.lengths:
        match("lengths", "len", (n,), "int32")
    if spec.layers > 1:
        match("y", "y", (t_len, n, spec.hidden), dt)
        match("ys", "ys", (t_len, n, (d - 1) * spec.hidden), dt)
    else:
        match("y", "y", (t_len, n, d * spec.hidden), dt)
    out.s = [match(f"s{k}", f"s{k}", (2, rows, spec.hidden), "float32")
             for k in range(spec.states)]
    if spec.finals:
        out.finals = [match(f"s{k}_n", f"n{k}", (d, n, spec.hidden), dt)
                      for k in range(spec.states)]
    if spec.kept:
        out.steps = [match(f"s{k}_steps", f"steps{k}", (t_len + 1, n, spec.hidden), "float32")
                     for k in range(spec.states)]
        match("pre", "pre", (t_len, n, len(spec.kept) * spec.hidden), "float32")
    if spec.tagged:
        match("hw", "hw", (2, rows, spec.hidden), "uint64")
    elif not (spec.local or spec.cluster):
        match("cnt", "cnt", (d * p.batch_groups,), "uint32")
    if published:
        match("hx", "hx", *published)
    out.aw = [match(f"aw{r}", f"aw{r}", (2, rows, spec.hidden),
                    "uint64" if spec.tagged else "float32") for r in range(values)]
    if spec.layers > 1:
        match("prog", "prog", (d * p.batch_groups,), "uint32")
    return out


def backward_parameters(spec: KernelSpec, gates: int, parts: int, summed: bool,
                        products: int = 0) -> SimpleNamespace:
    """Declare the backward kernel's parameters (:mod:`..backward`; ``spec``: one row a unit,
    K = G*H), inputs first: W_hh^T packed [B/NG, Wn, KI, RW, 32, VEC], ``pre`` [T,N,P*H]
    (``parts`` P), the states of every step [T+1,N,H] each (float32), (the samples' lengths
    [N] int32), dy [T,N,H], the final states' gradients [1,N,H] each, (the cell's per-unit
    parameters p0 ... [H] each, where it has them); then the outputs: the initial states'
    gradients [1,N,H] each, dGI [T,N,G*H] (16-bit where the weights are, else float32; and
    dGH, unless ``summed``: every gate kept as a sum, where the two are equal), (for each of
    the step's ``products`` recurrent products of a value, the gradient of its value dP and its
    argument X [T,N,H] float32, as W_hh's gradient takes them), (the per-unit
    parameters' gradients summed over the steps, a batch row each, ``dps`` [params, N, H]
    float32), and the exchange: the published dGH [2,N,G*H] float32 (``xch``; or, where the
    planner says so, dGH as published for the next step's staging ``hx``, :func:`published_h`,
    all zeros before the launch), then the tagged words [2,N,G*H] uint64 or the barrier
    counters [NG] uint32 (neither with the ``"local"`` exchange)."""
    p, dt, n, h = spec.plan, spec.dtype, spec.batch, spec.hidden
    states, gh = spec.states, gates * h
    per_unit = [f"p{k}" for k in range(spec.params)]
    names = ["w", "pre", *[f"s{k}" for k in range(states)]] + (["len"] if spec.lengths else [])
    names += ["dy", *[f"dn{k}" for k in range(states)], *per_unit]
    names += [f"d0{k}" for k in range(states)] + ["dgi"] + ([] if summed else ["dgh"])
    names += [f"{a}{k}" for k in range(products) for a in ("dprod", "parg")]
    published = published_h(p, n, dt)
    names += (["dps"] if spec.params else []) + (["hx"] if published else ["xch"])
    names += ["hw"] if spec.tagged else [] if spec.local else ["cnt"]
    handles = {a: T.arg(f"{a}_h", T.handle()) for a in names}
    t_len = tirx.Var("T_len", "int64")
    out = SimpleNamespace(T_len=t_len, lengths=None, dgh=None, dps=None, xch=None, hw=None,
                          cnt=None, hx=None)

    def match(name: str, handle: str, shape, dtype: str):
        buffer = T.match_buffer(handles[handle], shape, dtype)
        IRBuilder.name(name, buffer)
        return buffer

    out.w = match("w", "w", p.packed_shape, dt)
    out.pre = match("pre", "pre", (t_len, n, parts * h), "float32")
    out.s = [match(f"s{k}_steps", f"s{k}", (t_len + 1, n, h), "float32") for k in range(states)]
    if spec.lengths:
        out.lengths = match("lengths", "len", (n,), "int32")
    out.dy = match("dy", "dy", (t_len, n, h), dt)
    out.d_final = [match(f"d{k}_n", f"dn{k}", (1, n, h), dt) for k in range(states)]
    out.params = [match(name, name, (h,), dt) for name in per_unit]
    out.d_initial = [match(f"d{k}_0", f"d0{k}", (1, n, h), dt) for k in range(states)]
    grads = projection_grad_dtype(dt)
    out.dgi = match("dgi", "dgi", (t_len, n, gh), grads)
    out.dgh = out.dgi if summed else match("dgh", "dgh", (t_len, n, gh), grads)
    out.products = [tuple(match(f"{a}{k}", f"{a}{k}", (t_len, n, h), "float32")
                          for a in ("dprod", "parg")) for k in range(products)]
    if spec.params:
        out.dps = match("dps", "dps", (spec.params, n, h), "float32")
    if published:
        out.hx = match("hx", "hx", *published)
    else:
        out.xch = match("xch", "xch", (2, n, gh), "float32")
    if spec.tagged:
        out.hw = match("hw", "hw", (2, n, gh), "uint64")
    elif not spec.local:
        out.cnt = match("cnt", "cnt", (p.batch_groups,), "uint32")
    return out


def backward_pairs(spec: KernelSpec, parts: int, product: bool = False) -> SimpleNamespace:
    """The backward kernel's registers for a thread's pairs: ``pre`` (P values a pair),
    ``sp`` (the previous states), ``dy``, ``carry`` (the states' gradients through the cell,
    from step to step), for a step that takes a recurrent product of a value (``product``)
    ``rec`` (dh's part through the recurrence, kept while the product's transposed is taken)
    and, for a cell with per-unit parameters, ``pv`` (their values at the pair's unit) and
    ``dp`` (their gradients summed over the steps so far)."""
    out = SimpleNamespace(pv=None, dp=None, rec=None)
    items, states, params = spec.plan.items, spec.states, spec.params
    regs = (("pre", parts), ("sp", states), ("dy", 1), ("carry", states))
    regs += (("rec", 1),) if product else ()
    for name, per in regs + ((("pv", params), ("dp", params)) if params else ()):
        buffer = T.sblock_alloc_buffer((items * per,), "float32", scope="local")
        IRBuilder.name(f"{name}_r", buffer)
        setattr(out, name, buffer)
    return out


def on_chip(spec: KernelSpec, pairs: bool = True) -> SimpleNamespace:
    """Allocate the block's registers and shared memory, in the root block:

    - ``wreg``: the weight chunks held in registers; ``wsm``: those in shared memory;
    - ``acc`` (a lane's sums) and ``hv`` (its chunk of h, every batch row) for the CUDA-core
      products, or for tensor cores ``af`` / ``wb`` (the mma's A and B fragments), ``dacc``
      (the chains' sums) and ``hs16`` (h staged in the weights' 16-bit type, fragment order);
    - ``wv``: one chunk of a row of weights; ``gi``, ``bh``, ``st``: the thread's pairs'
      input projections, b_hh and states (unless ``pairs`` is False: the backward kernel's
      are :func:`backward_pairs`); ``pv``: their units' per-unit parameters of the cell;
      ``ln``: their samples' lengths; ``tv``: tagged words in flight; ``gs``: the pairs'
      recurrent gate sums of h, kept while a step's product of a value is taken; ``mv``: the
      step's row means (``red``, ``racc``: their sums in the making, about ``shift``); ``hn``:
      h_t as the ``"local"`` exchange keeps it for the next step's staging (the
      ``"cluster"`` exchange's two slots of it, and ``cb`` their barriers);
    - the fused input projection's ``pacc``, ``xv``, ``wq``, ``xs`` (registers), ``wis``
      (W_ih's rows, unless they go through ``wsm`` in slabs) and ``xsl`` (x's slab,
      overlapped);
    - ``hs``: h_{t-1} for the products, then the gate sums (and the fused projection's rows of
      x and its warps' sums).
    """
    p, dt, n = spec.plan, spec.dtype, spec.local_batch
    rw, vec, g = p.rows_per_warp, p.vec, spec.gates
    out = SimpleNamespace()

    def alloc(name, size, dtype, scope="local"):
        buffer = T.sblock_alloc_buffer((size,), dtype, scope=scope)
        IRBuilder.name(name, buffer)
        setattr(out, name, buffer)

    names = ("wreg", "af", "wb", "dacc", "hs16", "acc", "hv", "ln", "tv", "wsm", "pacc", "xv",
             "wq", "xs", "wis", "xsl", "pv", "hn")
    for name in names:
        setattr(out, name, None)
    if p.reg_chunks:
        alloc("wreg", p.reg_chunks * rw * vec, dt)
    if p.mma:
        alloc("af", 8, dt)
        alloc("wb", 4, dt)
        alloc("dacc", 4 * spec.mma_chains * spec.mma_tiles, "float32")
        # h; or two slices of it ("Slices of K")
        alloc("hs16", spec.staged_size if p.k_slices == 1 else 2 * spec.slice_size, dt,
              "shared.dyn")
    else:
        alloc("acc", spec.accumulators, "float32")
        alloc("hv", n * vec, "float32")
    alloc("wv", vec, dt)
    for name, per in (("gi", g), ("bh", g), ("st", spec.states)) if pairs else ():
        alloc(name, p.items * per, "float32")
    if pairs and spec.params:
        alloc("pv", p.items * spec.params, "float32")
    out.gs = out.mv = out.red = out.racc = out.shift = out.pw = None
    if pairs and spec.product >= 0:
        alloc("gs", p.items * g, "float32")
    if pairs and spec.means:
        widest = max(map(len, spec.levels))  # a sum a mean or variance of a round
        alloc("mv", spec.means * n, "float32", "shared")
        alloc("shift", spec.means * n, "float32", "shared")
        if p.mean_partials:  # a round's arguments of the block's units, to sum
            alloc("pw", widest * n * p.units, "float32", "shared")
        alloc("red", p.warps * widest * n, "float32", "shared")
        alloc("racc", widest * n, "float32")
    if spec.lengths:
        alloc("ln", p.items, "int32")
    if spec.tagged:
        alloc("tv", exchange.WAIT_BATCH, "uint64")
    if spec.local:  # h_t for the next step's staging, in its order and type
        alloc("hn", spec.staged_size, dt if p.mma else "float32", "shared")
    out.cb = None
    if spec.cluster:  # two slots of h as the products read it, each with its barrier
        alloc("hn", 2 * spec.staged_size, "float32", "shared")
        alloc("cb", 2, "uint64", "shared")
    if p.smem_chunks:
        alloc("wsm", p.warps * p.smem_chunks * rw * 32 * vec, dt, "shared.dyn")
    fused_floats = _fused(spec, alloc) if p.fused else 0
    staged = 0 if p.mma else n * spec.width  # with tensor cores, h goes to hs16 instead
    # a cluster's blocks one a multiprocessor (its launch would pack them where they fit)
    alone = max(0, planner.CLUSTER_BLOCK_SMEM - p.smem_bytes) // 4 if spec.cluster else 0
    alloc("hs", max(staged, p.warps * p.warp_rows * n, fused_floats) + alone, "float32",
          "shared.dyn")
    return out


def _fused(spec: KernelSpec, alloc) -> int:
    """Allocate the fused input projection's buffers; the floats it needs of ``hs``."""
    p, vec = spec.plan, spec.plan.vec
    rl, sn = planner.fused_row_split(p, spec.gates), p.input_rows
    snl = sn // planner.X_GROUPS
    alloc("pacc", rl * snl, "float32")
    alloc("xv", snl * vec, "float32")
    alloc("wq", rl * vec, spec.dtype)
    alloc("xs", 1, "float32")
    if not p.input_slab:  # else W_ih goes through wsm
        alloc("wis", p.input_chunks * rl * planner.ROW_GROUPS * vec, spec.dtype, "shared.dyn")
    sums = sn * p.warps * (rl * planner.ROW_GROUPS + 1)
    if p.input_steps:  # x's slabs in a buffer of their own
        alloc("xsl", sn * (p.input_width * vec + 4), "float32", "shared.dyn")
        return sums
    return max(sn * (p.input_width * vec + 4), sums)


def projection(params: SimpleNamespace, chips: SimpleNamespace) -> SimpleNamespace:
    """The fused input projection's buffers: x (with layers, ``below`` and the progress
    counters: layer l > 0 reads layer l - 1's outputs; with lengths, the samples': the reverse
    direction's rows run back from each one's last step), W_ih (``wi``, packed; ``w_ih`` its
    rows in shared memory: ``wis``, or ``wsm`` in slabs), b_ih, xp; x's staged rows (``x_staged``:
    ``xsl`` overlapped, else ``hs``), the warps' sums (``hs``) and its registers."""
    return SimpleNamespace(
        x=params.x, below=params.ys, prog=params.prog, lengths=params.lengths, wi=params.wi,
        b_ih=params.b_ih, xp=params.xp, hs=chips.hs,
        w_ih=chips.wis if chips.wis is not None else chips.wsm, xsl=chips.xsl,
        x_staged=chips.xsl if chips.xsl is not None else chips.hs, pacc=chips.pacc,
        xv=chips.xv, wq=chips.wq, xs=chips.xs)
