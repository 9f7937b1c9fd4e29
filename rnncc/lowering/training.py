"""A layer's training entries: the forward that keeps every step's states, and the backward
pass through time (one direction, one layer; rnncc.nn composes networks of them).

train_forward(x [T,N,C], w_ih, w_hh, b_ih, b_hh, <s>0 [1,N,H] each, (lengths [N]),
              y [T,N,H], <s>_n [1,N,H] each, xp, hp, <s>_steps [T+1,N,H] each, ...)

as ``forward`` (:mod:`rnncc.lowering.sequence`), with the states of every step kept:
``<s>_steps[0]`` the initial ones, ``<s>_steps[t + 1]`` step t's (accumulation dtype), and
what the cell's derivative needs of every step's projections, ``pre`` [T, N, P*H]
(:func:`kept_parts`: gi[g] + gh[g] where the cell uses only that sum, else both).

backward(x, w_hh, <s>_steps each, pre, (lengths), dy [T,N,H], d<s>_n [1,N,H] each,
         d<s>0 [1,N,H] each, dweight_ih [G*H,C], dweight_hh [G*H,H], dbias_ih [G*H],
         dbias_hh [G*H], dgi [T,N,G*H], workspaces)
backward_input(dgi [T,N,G*H], w_ih, (lengths), dx [T,N,C], workspaces)

take the packed weight matrices ``forward`` takes (the biases are in ``pre``). For t = T-1
.. 0: the cell's derivative (its vector-Jacobian product, derived from the cell's step:
:func:`rnncc.lowering.components.cell_step_backward`) into the gradients of both projections,
dGI[t] and dGH[t] [N, G*H] (one buffer where every gate is kept as a sum: their gradients are
equal; in a 16-bit layer's dtype, else the accumulation dtype, where float32 dGI is written
over ``pre``), and dh_{t-1}'s part through the recurrent product, dGH[t] @ W_hh. After the loop, as
products over all T*N rows: dW_ih = dGI^T x, dW_hh = dGH^T h_{t-1}, and the biases'
gradients, the sums of dGI and dGH over the rows; and, in ``backward_input`` where x needs a
gradient, dx = dGI @ W_ih. The gates themselves are computed again from the kept states and
sums, as the backward pass reads them.

persistent_backward(the same parameters as ``backward``, its own workspaces), on CUDA where
the backward plan fits: the loop is one persistent kernel (W_hh^T resident on-chip,
:mod:`rnncc.schedules.persistent.backward`), which also writes d<s>0.
"""

from __future__ import annotations

from types import SimpleNamespace

from tvm import tirx

from .. import schedules
from ..cells import autodiff
from ..dtypes import accum_dtype, projection_grad_dtype
from . import components as comp
from .assemble import Region, Stage, sequence_function
from .components import ALL, i64

#: The smallest C whose half dW_ih is taken over x padded to whole tiles where C is off them
#: (the padding's products at most double the FLOPs)
WEIGHT_GRAD_PADDED_MIN_C = 64

#: The smallest batch whose dx leaves out the rows past the lengths: that product does not
#: split K, and smaller batches' T*N rows leave most of the GPU idle without the split (H200,
#: LSTM 1024 at batch 4, T = 100, lengths T to T/4: dx 474 us over the rows within them, 105
#: over all rows in slices of K; the weight gradients over the rows within them stay faster)
DX_ROWS_WITHIN_MIN_BATCH = 32


def kept_parts(cell) -> tuple:
    """What the training forward keeps of each step's projections for the backward pass, in
    ``pre`` [T, N, P*H], part by part: ``(g, "sum")``, gi[g] + gh[g], for a gate the cell uses
    only as that sum (all of LSTM's; GRU's r and z), else ``(g, "gi")`` and, unless the step
    takes the gate's recurrent product of a value instead, ``(g, "gh")`` (GRU's n, whose gh is
    multiplied by r first); then ``(k, "product")``, the value of the step's k-th recurrent
    product of a value (:func:`rnncc.cells.ops.recurrent`). That is all the cell's derivative
    needs of them: the backward pass computes no projection again."""
    graph = autodiff.trace(cell)
    instead = {node.value[0] for node in graph.products}
    parts = []
    for g, summed in enumerate(autodiff.summed_gates(graph)):
        parts += ([(g, "sum")] if summed else
                  [(g, "gi")] + ([(g, "gh")] if g not in instead else []))
    return tuple(parts) + tuple((k, "product") for k in range(len(graph.products)))


def build(builder, backward_plan=None) -> None:
    """Add ``train_forward``, ``backward`` and ``backward_input`` to ``builder``'s module (a
    :class:`rnncc.lowering.sequence._Builder` of one direction and one layer), and
    ``persistent_backward`` where a plan of the backward kernel is given
    (:func:`rnncc.schedules.persistent.planner.backward`)."""
    builder.sequence_entry("train_forward", history=True)
    backward = _Backward(builder)
    backward.add()
    if backward_plan is not None:
        backward.add_persistent(backward_plan)
    backward.add_input_gradient()


class _Backward:
    def __init__(self, builder):
        self.b, self.p, self.layout = builder, builder.p, builder.layout
        self.acc = accum_dtype(self.p.dtype)
        #: the projections' gradients' dtype (a half layer's in its storage dtype)
        self.dg = projection_grad_dtype(self.p.dtype)

    def gemm(self, key, lead, k, o, a_dtype, args, weights=None, lengths=False):
        """A stage: a product of the layout's weights (or of ``weights``: "rows", "cols");
        ``lengths``: of the rows within the samples' lengths (:func:`comp.gemm`)."""
        func = self.b.scheduled(key, comp.gemm(lead, k, o, weights or self.layout.weights,
                                               self.p.dtype, a_dtype, lengths=lengths), "gemm")
        return Stage(key, func, args, 1)

    def elementwise(self, key, func, args, outputs=1):
        return Stage(key, self.b.scheduled(key, func, "elementwise"), args, outputs)

    def reduction(self, key, func, args):
        return Stage(key, self.b.scheduled(key, func, "reduction"), args, 1)

    def transposed(self, name, packed, out, depth):
        """A stage: a packed weight [G*H, K] (or [K, G*H]) in the other orientation."""
        shape = self.layout.weight_shape(self.p.gates, self.p.hidden_size, depth)
        return self.elementwise(f"transpose_{name}", comp.transpose(*shape, self.p.dtype),
                                [Region(packed, (ALL, ALL)), Region(out, (ALL, ALL))])

    def add_input_gradient(self):
        """``backward_input``: dx [T, N, C] = dGI @ W_ih, from ``backward``'s dgi (a call
        whose x needs no gradient skips it); given the samples' lengths, on CUDA in IEEE
        float32 from batch :data:`DX_ROWS_WITHIN_MIN_BATCH`, the product computes only the rows
        within them and dx is zero past them (smaller, the product of all rows: dGI is zero
        past the lengths, and so is their product). Where W_ih is packed with K padded
        (:func:`rnncc.lowering.sequence.padded_input_size`), the product's O is too: dx's
        first C columns of it are copied out."""
        b, p, layout, acc = self.b, self.p, self.layout, self.acc
        n, c, h, g, k = p.batch, p.input_size, p.hidden_size, p.gates, b.input_k
        t_len = tirx.Var("T", "int64")
        sig = []
        dgi = b.param(sig, "dgi", (t_len, n, g * h), "input", self.dg)
        w_ih = b.param(sig, "w_ih", layout.weight_shape(g, h, k), "input")
        lengths = (b.param(sig, "lengths", (n,), "input", "int32") if p.lengths
                   and b.sums_rows_within_lengths() and n >= DX_ROWS_WITHIN_MIN_BATCH else None)
        dx = b.param(sig, "dx", (t_len, n, c), "output")
        zero = b.param(sig, "zero_bias_c", (k,), "workspace")
        dx_acc = (b.param(sig, "dx_acc", (t_len, n, k), "workspace", acc)
                  if acc != p.dtype or k != c else None)
        out = dx_acc if dx_acc is not None else dx  # the product's
        stages = [self.elementwise("zero_bias_c", comp.zeros((k,), p.dtype),
                                   [Region(zero, (ALL,))])]
        given, ends = [], None
        if lengths is not None:  # dx's rows past the lengths are zeros, the others the product's
            ends, stage = b.length_ends(sig, dgi, lengths, "length_ends_dgi")
            stages += [stage, self.elementwise("zero_dx", comp.zeros((t_len, n, k), out.dtype),
                                               [Region(out, (ALL,) * 3)])]
            given = [Region(lengths, (ALL,)), Region(ends, (ALL,))]
        # W_ih as the product's [O, K] (C, G*H): packed so, or as rows [G*H, C] transposed
        # first where the product is on tensor cores but for warpgroup MMA's 16-bit operands
        # (cuda.mma_gemm's pipelined kernel and TF32 take k last in both operands; H200,
        # bfloat16 LSTM 1024, T*N = 6400: 451 us -> 161, and 26 for the copy; float32 split
        # in three TF32 products where its batch has enough rows; and warpgroup MMA's where C
        # is off whole tiles: it takes those past its edges with k last in both, where they
        # fell to cuda.matmul); else read as packed, [K, O]
        w_t = None
        split = (b.options.tf32x3 and n >= schedules.cuda_mma_gemm.SPLIT_ALL_STEPS_BATCH
                 and lengths is None)  # (a split product declines the lengths)
        tails = k % schedules.cuda_mma_gemm.TILE != 0
        if layout.weights == "rows" and schedules.has_mma(b.target) and (
                (p.allow_tf32 or split) if p.dtype == "float32"
                else not schedules.has_wgmma(b.target) or tails):
            w_t = b.param(sig, "w_ih_t", (k, g * h), "workspace")
            stages.append(self.transposed("w_ih", w_ih, w_t, k))
        stages.append(self.gemm(
            "input_gemm_backward" + ("_lengths" if given else ""), (t_len, n), g * h, k, self.dg,
            [Region(dgi, (ALL, ALL, ALL)), Region(w_t if w_t is not None else w_ih, (ALL, ALL)),
             Region(zero, (ALL,)), *given, Region(out, (ALL, ALL, ALL))],
            "rows" if w_t is not None or layout.weights == "cols" else "cols", bool(given)))
        if dx_acc is not None:
            stages.append(self.elementwise("dx_cast", comp.copy_steps(n, c, acc, t_len, p.dtype),
                                           [Region(dx_acc, (ALL, ALL, slice(0, c))),
                                            Region(dx, (ALL,) * 3)]))
        params = [dgi, w_ih, *([lengths] if lengths is not None else []), dx, zero,
                  *([dx_acc] if dx_acc is not None else []),
                  *([ends] if ends is not None else []), *([w_t] if w_t is not None else [])]
        b.add("backward_input", sequence_function("backward_input", params, stages, None, None,
                                                  []), sig)

    def _io(self, sig):
        """The backward entries' parameters, as both take them (inputs, then outputs)."""
        b, p, layout, acc = self.b, self.p, self.layout, self.acc
        n, c, h, g = p.batch, p.input_size, p.hidden_size, p.gates
        gh, states, r, proj = g * h, p.cell.states, p.recurrent_size, p.proj_size
        widths = p.state_widths  # h's is P wide with a projection
        t_len = tirx.Var("T", "int64")
        io = SimpleNamespace(t_len=t_len, parts=kept_parts(p.cell), widths=widths)
        io.summed = all(part == "sum" for _, part in io.parts)  # one gradient for gi and gh
        io.x = b.param(sig, "x", (t_len, n, c), "input")
        io.w_hh = b.param(sig, "w_hh", layout.weight_shape(g, h, r), "input")
        io.w_hr = (b.param(sig, "w_hr", layout.matrix.weight_shape(1, proj, h),
                           "input") if proj else None)
        io.per_unit = [b.param(sig, f"p_{name}", (h,), "input") for name in p.cell.params]
        io.kept = [b.param(sig, f"{s}_steps", (t_len + i64(1), n, w), "input", acc)
                   for s, w in zip(states, widths)]
        io.h_cell = (b.param(sig, "h_cell_steps", (t_len, n, h), "input") if proj
                     else None)
        # where every gate is kept as its sum, pre [T, N, G*H] is laid out as dGI: the pass
        # writes dGI over it (an "inout": the caller's pre is consumed), but where dGI is in
        # a 16-bit dtype (its own buffer, read by the products with half the bytes)
        in_place = io.summed and self.dg == acc
        io.pre = b.param(sig, "pre", (t_len, n, len(io.parts) * h),
                         "inout" if in_place else "input", acc)
        io.lengths = b.param(sig, "lengths", (n,), "input", "int32") if p.lengths else None
        io.dy = b.param(sig, "dy", (t_len, n, r), "input")
        io.d_final = [b.param(sig, f"d{s}_n", (1, n, w), "input") for s, w in zip(states, widths)]
        io.d_initial = [b.param(sig, f"d{s}0", (1, n, w), "output")
                        for s, w in zip(states, widths)]
        io.dw = {which: b.param(sig, f"dweight_{which}", (gh, k), "output")
                 for which, k in (("ih", c), ("hh", r))}
        if proj:
            io.dw["hr"] = b.param(sig, "dweight_hr", (proj, h), "output")
        io.db = {which: b.param(sig, f"dbias_{which}", (gh,), "output") for which in ("ih", "hh")}
        io.dparams = [b.param(sig, f"d{name}", (h,), "output") for name in p.cell.params]
        io.dgi = io.pre if in_place else b.param(sig, "dgi", (t_len, n, gh), "output", self.dg)
        io.dgh = (io.dgi if io.summed
                  else b.param(sig, "dgh", (t_len, n, gh), "workspace", self.dg))
        io.given = [io.lengths] if io.lengths is not None else []
        # the step's recurrent products of its values: each step's gradient of each, and the
        # value of its argument (W_hh's gradient, that gate's rows, takes them)
        io.products = [(gate, b.param(sig, f"dproduct{gate}", (t_len, n, h), "workspace", acc),
                        b.param(sig, f"product_arg{gate}", (t_len, n, h), "workspace", acc))
                       for gate in autodiff.product_gates(autodiff.trace(p.cell))]
        projected = [io.w_hr] if proj else []
        io.params = [io.x, io.w_hh, *projected, *io.per_unit, *io.kept,
                     *([io.h_cell] if proj else []), io.pre, *io.given, io.dy,
                     *io.d_final, *io.d_initial, *io.dw.values(), io.db["ih"],
                     io.db["hh"], *io.dparams, *([] if in_place else [io.dgi]),
                     *([] if io.summed else [io.dgh]),
                     *(buffer for _, *pair in io.products for buffer in pair)]
        return io

    def _weight_grads(self, io, sig, dh_projected=None):
        """After the recurrence, products over all T*N rows: dW_ih = dGI^T x, dW_hh = dGH^T
        h_{t-1} (given the samples' lengths, on CUDA in IEEE float32, over the rows within
        them only), the biases' gradients as column sums; with a projection dW_hr = dHP^T h'
        (``dh_projected`` [T, N, P], the gradients of every step's W_hr h'). Returns (stages,
        views, workspaces)."""
        b, p = self.b, self.p
        n, c, gh = p.batch, p.input_size, p.gates * p.hidden_size
        h, rows = p.recurrent_size, io.t_len * i64(n)

        def view(buffer, shape, name):  # the buffer's memory in another shape
            return tirx.decl_buffer(shape, buffer.dtype, name)

        # the samples' lengths: dW_ih and dW_hh sum only the rows within them
        stages, workspaces, given = [], [], []
        if io.lengths is not None and b.sums_rows_within_lengths():
            ends, stage = b.length_ends(sig, io.x, io.lengths)
            stages.append(stage)
            workspaces.append(ends)
            given = [Region(io.lengths, (ALL,)), Region(ends, (ALL,))]
        dgi_rows = view(io.dgi, (rows, gh), "dgi_rows")
        dgh_rows = dgi_rows if io.summed else view(io.dgh, (rows, gh), "dgh_rows")
        x_rows = view(io.x, (rows, c), "x_rows")
        views = [(dgi_rows, io.dgi)] + ([(dgh_rows, io.dgh)] if not io.summed else [])
        if self.dg != self.acc and schedules.has_mma(b.target):
            # a half layer's h_{t-1} in its dtype first, as the tensor cores read it: copied
            # by dW_hh's kernel, not converted there (H200, bfloat16 LSTM 1024, T*N = 6400:
            # float32 h through registers 191 us; 20 for this copy and 81 for the product)
            h_half = b.param(sig, "h_half", (io.t_len, n, h), "workspace")
            stages.append(self.elementwise("h_half", comp.copy_steps(
                n, h, self.acc, io.t_len, p.dtype), [
                Region(io.kept[0], (slice(0, io.t_len), ALL, ALL)), Region(h_half, (ALL,) * 3)]))
            h_rows = view(h_half, (rows, h), "h_rows")
            views.append((h_rows, h_half))
            workspaces.append(h_half)
        else:
            h_rows = view(io.kept[0], (rows + i64(n), h), "h_rows")
            views.append((h_rows, io.kept[0]))
        views.append((x_rows, io.x))
        m = tirx.Var("M", "int64")
        # dW_ih of a half layer whose C is off whole tiles: over x padded to them, on warpgroup
        # MMA, its first C columns copied out (else the CUDA cores' cuda.weight_grad: H200,
        # float16 LSTM 161 -> 1024, T*N = 6400, 400 us)
        tiles = schedules.cuda_mma_gemm.TILE
        dw_ih = io.dw["ih"]
        if (self.dg != self.acc and schedules.has_wgmma(b.target) and not given
                and gh % tiles == 0 and c % tiles and c >= WEIGHT_GRAD_PADDED_MIN_C):
            padded = -(-c // tiles) * tiles
            x_padded = b.param(sig, "x_padded", (io.t_len, n, padded), "workspace")
            dw_ih = b.param(sig, "dweight_ih_padded", (gh, padded), "workspace")
            workspaces += [x_padded, dw_ih]
            stages.append(self.elementwise("pad_x_grad", comp.padded_steps(
                n, c, padded, p.dtype, io.t_len), [Region(io.x, (ALL,) * 3),
                                                   Region(x_padded, (ALL,) * 3)]))
            x_rows = view(x_padded, (rows, padded), "x_rows_padded")
            views.append((x_rows, x_padded))
        for which, grads, inputs, out in (("ih", dgi_rows, x_rows, dw_ih),
                                          ("hh", dgh_rows, h_rows, io.dw["hh"])):
            k = int(inputs.shape[1])
            stages.append(self.reduction(
                f"weight_grad_{which}" + ("_lengths" if given else ""), comp.weight_gradient(
                    m, gh, k, p.dtype, inputs.dtype, grads.dtype, n if given else None),
                [Region(grads, (ALL, ALL)), Region(inputs, (slice(0, rows), ALL)), *given,
                 Region(out, (ALL, ALL))]))
            if which == "hh" and io.summed:  # dGH is dGI: db_hh is db_ih, copied (a column
                # sum over the T*N rows: H200, bfloat16 LSTM 1024 N64, 26 us)
                stages.append(self.elementwise("bias_grad_hh", comp.cast(gh, p.dtype, p.dtype),
                                               [Region(io.db["ih"], (ALL,)),
                                                Region(io.db["hh"], (ALL,))]))
                continue
            stages.append(self.reduction(f"bias_grad_{which}",
                                         comp.column_sum(m, gh, p.dtype, grads.dtype),
                                         [Region(grads, (ALL, ALL)),
                                          Region(io.db[which], (ALL,))]))
        if not dw_ih.same_as(io.dw["ih"]):  # its first C columns
            stages.append(self.elementwise("dweight_ih_copy", comp.copy(1, gh, c, p.dtype,
                                                                        p.dtype), [
                Region(dw_ih, (ALL, slice(0, c))), Region(io.dw["ih"], (ALL, ALL))]))
        h_ = p.hidden_size
        for gate, grads, args in io.products:
            # the gate's rows of dW_hh and db_hh (zero from dGH: the step does not use its gh)
            g_rows, a_rows = (view(grads, (rows, h_), f"dproduct{gate}_rows"),
                              view(args, (rows, h_), f"product_arg{gate}_rows"))
            views += [(g_rows, grads), (a_rows, args)]
            gate_rows = slice(gate * h_, (gate + 1) * h_)
            stages.append(self.reduction("weight_grad_product", comp.weight_gradient(
                m, h_, h_, p.dtype, a_rows.dtype), [
                Region(g_rows, (ALL, ALL)), Region(a_rows, (ALL, ALL)),
                Region(io.dw["hh"], (gate_rows, ALL))]))
            stages.append(self.reduction("bias_grad_product", comp.column_sum(m, h_, p.dtype),
                                         [Region(g_rows, (ALL, ALL)),
                                          Region(io.db["hh"], (gate_rows,))]))
        if dh_projected is not None:
            dhp_rows = view(dh_projected, (rows, p.proj_size), "dh_projected_rows")
            cell_rows = view(io.h_cell, (rows, p.hidden_size), "h_cell_rows")
            views += [(dhp_rows, dh_projected), (cell_rows, io.h_cell)]
            stages.append(self.reduction("weight_grad_hr", comp.weight_gradient(
                m, p.proj_size, p.hidden_size, p.dtype, cell_rows.dtype), [
                Region(dhp_rows, (ALL, ALL)), Region(cell_rows, (ALL, ALL)),
                Region(io.dw["hr"], (ALL, ALL))]))
        return stages, views, workspaces

    def add(self):
        b, p, acc = self.b, self.p, self.acc
        n, h, g, r, proj = p.batch, p.hidden_size, p.gates, p.recurrent_size, p.proj_size
        gh, states = g * h, p.cell.states
        t = tirx.Var("t", "int64")
        sig = []
        io = self._io(sig)
        t_len, parts, summed = io.t_len, io.parts, io.summed
        step = t_len - i64(1) - t  # the loop runs the steps backwards
        carry = [b.param(sig, f"d{s}_carry", (2, n, w), "workspace", acc)
                 for s, w in zip(states, io.widths)]
        # dh through the recurrent product: its K slices where the product is left in them
        rec_parts = b.product_parts("recurrent_gemm_backward", comp.gemm(
            (n,), gh, r, self.layout.weights, p.dtype, self.dg))
        rec_shape = comp.parts_shape(rec_parts, (n, r))
        dh_rec = b.param(sig, "dh_rec", rec_shape, "workspace", acc)
        dh_all = Region(dh_rec, (ALL,) * len(rec_shape))
        w_hh_t = b.param(sig, "w_hh_t", tuple(reversed(self.layout.weight_shape(g, h, r))),
                         "workspace")
        # the product's bias (none: zeros), where its reader does not add the slices
        zero = b.param(sig, "zero_bias", (r,), "workspace") if rec_parts == 1 else None
        active = (b.param(sig, "active", (t_len, n), "workspace", "int32")
                  if io.lengths is not None else None)
        # the cell's per-unit parameters: their gradients summed over the steps, a row of the
        # batch each, then over the rows
        count = len(io.per_unit)
        sums = b.param(sig, "dparam_sums", (count, n, h), "workspace", acc) if count else None
        # and the parameters themselves as comp.cell_step_backward reads them
        read_params, converted, casts = b.in_accumulation(sig, io.per_unit)
        # a projection: every step's dHP (the gradient of W_hr h'), then dh' = dHP W_hr
        dhp = dh_cell = zero_h = None
        if proj:
            dhp = b.param(sig, "dh_projected", (t_len, n, proj), "workspace", acc)
            dh_cell = b.param(sig, "dh_cell", (n, h), "workspace", acc)
            zero_h = b.param(sig, "zero_bias_h", (h,), "workspace")
        # the step's recurrent products of its values: their arguments' gradients, a zero bias
        # and each gate's block of W_hh transposed
        zero_p = dx_products = blocks_t = None
        if io.products:
            zero_p = b.param(sig, "zero_bias_products", (h,), "workspace")
            dx_products = b.param(sig, "dx_products", (len(io.products), n, h), "workspace", acc)
            blocks_t = b.param(sig, "w_hh_products_t", (len(io.products), h, h), "workspace")

        prologue = [self.transposed("w_hh", io.w_hh, w_hh_t, r)]
        prologue += [self.elementwise(f"transpose_w_hh_product{gate}", comp.transpose(
            h, h, p.dtype), [Region(io.w_hh, self.layout.gate_block(0, gate, g, h)),
                             Region(blocks_t, (k, ALL, ALL))])
            for k, (gate, _, _) in enumerate(io.products)]
        for buffer, width in ((zero, r), (zero_h, h), (zero_p, h)):
            if buffer is not None:
                prologue.append(self.elementwise(buffer.name, comp.zeros((width,), p.dtype),
                                                 [Region(buffer, (ALL,))]))
        prologue.append(self.elementwise("zero_dh_rec", comp.zeros(rec_shape, acc), [dh_all]))
        if sums is not None:
            prologue.append(self.elementwise("zero_dparam_sums", comp.zeros((count, n, h), acc),
                                             [Region(sums, (ALL,) * 3)]))
        prologue += casts
        prologue += b.states_copy("grad_init", [Region(d, (0, ALL, ALL)) for d in io.d_final],
                                  [Region(cr, (0, ALL, ALL)) for cr in carry])
        if active is not None:
            prologue.append(self.elementwise("activity", comp.activity(n, t_len), [
                Region(io.lengths, (ALL,)), Region(active, (ALL, ALL))]))
        slot, nxt = tirx.floormod(t, i64(2)), tirx.floormod(t + i64(1), i64(2))
        steps, pre_step, copy = [], Region(io.pre, (step, ALL, ALL)), None
        if io.dgi.same_as(io.pre):  # the cell's derivative reads every gate's sums before any
            # dGI is written over them
            copy = b.param(sig, "pre_step", (n, gh), "workspace", acc)
            steps.append(self.elementwise("pre_step", comp.copy(g, n, h, acc, acc), [
                Region(io.pre, (step, ALL, slice(i * h, (i + 1) * h))) for i in range(g)] + [
                Region(copy, (ALL, slice(i * h, (i + 1) * h))) for i in range(g)], g))
            pre_step = Region(copy, (ALL, ALL))
        masked = [Region(active, (step, ALL))] if active is not None else []
        skip = 1 if proj else 0  # with a projection h is not the cell's: its carry is apart
        seeds = [Region(io.dy, (step, ALL, ALL)), dh_all]
        if proj:  # dHP, h's carry, then dh' = dHP W_hr (W_hr as packed: the product's [K, O])
            steps.append(self.elementwise("projection_backward", comp.projection_backward(
                n, proj, p.dtype, active is not None, rec_parts), [
                Region(io.dy, (step, ALL, ALL)), dh_all, Region(carry[0], (slot, ALL, ALL)),
                *masked, Region(dhp, (step, ALL, ALL)), Region(carry[0], (nxt, ALL, ALL))], 2))
            steps.append(self.gemm("projection_gemm_backward", (n,), proj, h, acc, [
                Region(dhp, (step, ALL, ALL)), Region(io.w_hr, (ALL, ALL)),
                Region(zero_h, (ALL,)), Region(dh_cell, (ALL, ALL))],
                "cols" if self.layout.weights == "rows" else "rows"))
            seeds = [Region(dh_cell, (ALL, ALL))]
        own = carry[skip:]
        inputs = ([pre_step] + [Region(s, (step, ALL, ALL)) for s in io.kept[skip:]]
                  + seeds + [Region(cr, (slot, ALL, ALL)) for cr in own] + masked
                  + [Region(v, (ALL,)) for v in read_params])
        # the step's products of its values, last first: the gradient of each, then its
        # argument's, a GEMM by the gate's block of W_hh transposed
        given = []
        for k, (gate, dproduct, _) in reversed(list(enumerate(io.products))):
            steps += [self.elementwise(f"product_backward{gate}", comp.cell_step_backward(
                p.cell, n, h, p.dtype, parts, active is not None, rec_parts, upto=gate),
                inputs + given + [Region(dproduct, (step, ALL, ALL))]),
                self.gemm("product_gemm_backward", (n,), h, h, acc, [
                    Region(dproduct, (step, ALL, ALL)), Region(blocks_t, (k, ALL, ALL)),
                    Region(zero_p, (ALL,)), Region(dx_products, (k, ALL, ALL))])]
            given.append(Region(dx_products, (k, ALL, ALL)))
        cell = self.elementwise(
            "cell_backward", comp.cell_step_backward(p.cell, n, h, p.dtype, parts,
                                                     active is not None, rec_parts, bool(proj),
                                                     grad_dtype=self.dg,
                                                     selects=self.b.target.kind.name == "cuda"),
            inputs + given
            + [Region(sums, (i, ALL, ALL)) for i in range(count)]
            + [Region(d, (step, ALL, slice(i * h, (i + 1) * h)))
               for d in ((io.dgi,) if summed else (io.dgi, io.dgh)) for i in range(g)]
            + [Region(cr, (nxt, ALL, ALL)) for cr in own]
            + [Region(sums, (i, ALL, ALL)) for i in range(count)]
            + [Region(argument, (step, ALL, ALL)) for _, _, argument in io.products],
            (1 if summed else 2) * g + len(own) + count + len(io.products))
        dgh_step = Region(io.dgh, (step, ALL, ALL))
        if rec_parts > 1:
            steps += [cell, Stage("recurrent_gemm_backward", b.scheduled(
                "recurrent_gemm_backward_parts", comp.gemm_parts(
                    n, gh, r, rec_parts, self.layout.weights, p.dtype, self.dg), "gemm"),
                [dgh_step, Region(w_hh_t, (ALL, ALL)), dh_all], 1)]
        else:
            steps += [cell, self.gemm("recurrent_gemm_backward", (n,), gh, r, self.dg, [
                dgh_step, Region(w_hh_t, (ALL, ALL)), Region(zero, (ALL,)), dh_all])]

        final = tirx.floormod(t_len, i64(2))
        finals = [Region(cr, (final, ALL, ALL)) for cr in carry]
        initial = [Region(d, (0, ALL, ALL)) for d in io.d_initial]
        if proj:  # h's (P wide, with dh_rec) and the others' (a cast) apart
            epilogue = [self.elementwise("initial_grads_h", comp.initial_state_grads(
                1, n, r, p.dtype, rec_parts), [finals[0], dh_all, initial[0]])]
            epilogue += [self.elementwise("initial_grads", comp.copy(
                len(states) - 1, n, h, acc, p.dtype), finals[1:] + initial[1:],
                len(states) - 1)] if len(states) > 1 else []
        else:
            epilogue = [self.elementwise(
                "initial_grads", comp.initial_state_grads(len(states), n, h, p.dtype,
                                                          rec_parts),
                finals + [dh_all] + initial, len(states))]
        epilogue += self._param_sums(io, sums)
        grads, views, spaces = self._weight_grads(io, sig, dhp)
        params = [*io.params, *carry, dh_rec, w_hh_t, *([zero] if zero is not None else []),
                  *([active] if active is not None else []),
                  *([sums] if sums is not None else []), *converted,
                  *([dhp, dh_cell, zero_h] if proj else []), *([copy] if copy is not None else []),
                  *([zero_p, dx_products, blocks_t] if io.products else []), *spaces]
        b.add("backward", sequence_function("backward", params, prologue, t, t_len, steps,
                                            epilogue + grads, views), sig)

    def _param_sums(self, io, sums):
        """The per-unit parameters' gradients: ``sums`` [P, N, H] summed over the rows."""
        n, h, dtype = self.p.batch, self.p.hidden_size, self.p.dtype
        return [self.reduction(f"dparam_{i}", comp.column_sum(i64(n), h, dtype), [
            Region(sums, (i, ALL, ALL)), Region(d, (ALL,))]) for i, d in enumerate(io.dparams)]

    def add_persistent(self, plan):
        """``persistent_backward``: the recurrence as one persistent kernel (W_hh^T packed for
        it each call, from the packed W_hh the entry takes), then the weights' gradients as
        ``backward``'s."""
        from ..schedules.persistent import backward, buffers
        from ..schedules.persistent.stages.exchange import EMPTY_TAG

        b, p = self.b, self.p
        n, h, g = p.batch, p.hidden_size, p.gates
        gh = g * h
        sig = []
        io = self._io(sig)
        w_t = b.param(sig, "w_hh_t_packed", plan.packed_shape, "workspace")
        prologue = [self.elementwise("persistent_pack_w_hh_t", comp.pack_persistent(
            g, h, plan, p.dtype, transposed=True), [Region(io.w_hh, (ALL, ALL)),
                                                     Region(w_t, (ALL,) * 6)])]
        # dGH exchanged in float32, or as the next step's staging copies it (``hx``): zeros
        published = buffers.published_h(plan, n, p.dtype)
        name, (shape, dtype) = (("dgh_published", published) if published
                                else ("dgh_exchanged", ((2, n, gh), "float32")))
        xch = b.param(sig, name, shape, "workspace", dtype)
        if plan.sync == "tagged":  # zeros, and tagged as step 0 (the tagged never publish)
            sync = b.param(sig, "dgh_tagged", (2, n, gh), "workspace", "uint64")
            prologue.append(self.elementwise("init_tagged_backward", comp.init_persistent(
                1, 1, n, gh, "float32", "float32", 1, EMPTY_TAG, zero_h=True),
                [Region(xch, (ALL,) * 3), Region(sync, (ALL,) * 3)], 2))
        else:
            prologue.append(self.elementwise("zero_exchanged", comp.zeros(shape, dtype),
                                             [Region(xch, (ALL,) * len(shape))]))
            sync = None  # the "local" exchange keeps dGH within the block
            if plan.sync != "local":
                sync = b.param(sig, "counter", (plan.batch_groups,), "workspace", "uint32")
                prologue.append(self.elementwise("zero_counter_backward", comp.zeros(
                    (plan.batch_groups,), "uint32"), [Region(sync, (ALL,))]))
        exchanges = [xch] + ([] if sync is None else [sync])
        func = backward.kernel(autodiff.trace(p.cell), io.parts, h, n, plan, p.dtype,
                               io.lengths is not None)
        self.b.lowered.rules["persistent_backward"] = f"persistent.{plan.sync}"
        inputs = [Region(w_t, (ALL,) * 6), Region(io.pre, (ALL,) * 3)]
        inputs += [Region(s, (ALL,) * 3) for s in io.kept]
        inputs += [Region(io.lengths, (ALL,))] if io.lengths is not None else []
        inputs += [Region(io.dy, (ALL,) * 3)] + [Region(d, (ALL,) * 3) for d in io.d_final]
        inputs += [Region(v, (ALL,)) for v in io.per_unit]
        outputs = [Region(d, (ALL,) * 3) for d in io.d_initial]
        outputs += [Region(d, (ALL,) * 3) for d in ((io.dgi,) if io.summed else (io.dgi, io.dgh))]
        outputs += [Region(d, (ALL,) * 3) for _, *pair in io.products for d in pair]
        # the per-unit parameters' gradients, summed over the steps a batch row each
        sums = (b.param(sig, "dparam_sums", (len(io.per_unit), n, h), "workspace", "float32")
                if io.per_unit else None)
        outputs += [Region(sums, (ALL,) * 3)] if sums is not None else []
        outputs += [Region(v, (ALL,) * len(v.shape)) for v in exchanges]
        prologue.append(Stage("persistent_backward", func, inputs + outputs, len(outputs)))
        grads, views, spaces = self._weight_grads(io, sig)
        grads = self._param_sums(io, sums) + grads
        params = [*io.params, w_t, *exchanges, *([sums] if sums is not None else []), *spaces]
        b.add("persistent_backward", sequence_function(
            "persistent_backward", params, prologue, None, None, [], grads, views), sig)
