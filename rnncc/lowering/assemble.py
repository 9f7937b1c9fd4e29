"""Nest scheduled components into one PrimFunc that runs the whole sequence.

Each scheduled component becomes a block whose buffers are matched (``match_buffer``) to
regions of the sequence's buffers, e.g. the cell step's ``y`` [N, H] to ``Y[t, :, :]``. The
loop over time is a serial loop of the function itself, so the compiled module runs all T steps
in one call: on CUDA the host loop launches each step's kernels, on CPUs it is one native loop.

This is one of the two places that build TIR by hand (the other is the persistent kernel): the
TIR node constructors and ``tvm_ffi.structural_map`` are TVM internals that changed in 0.27.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tvm
import tvm.sym
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Range

from ..schedules._common import COMPACT_ATTR
from .components import i64


@dataclass(frozen=True)
class Region:
    """A region of a sequence buffer. ``index`` has one entry a dimension: an integer or
    PrimExpr selects one position and drops the dimension, a ``slice`` keeps it (``ALL`` of
    :mod:`rnncc.lowering.components`: the whole dimension)."""

    buffer: tvm.ir.Var
    index: tuple

    def ranges(self) -> list[Range]:
        out = []
        for dim, idx in zip(self.buffer.shape, self.index):
            if isinstance(idx, slice):
                start = i64(0) if idx.start is None else _as_i64(idx.start)
                stop = dim if idx.stop is None else _as_i64(idx.stop)
                out.append(Range.from_min_extent(start, stop - start))
            else:
                out.append(Range.from_min_extent(_as_i64(idx), i64(1)))
        return out

    def kept(self) -> list[tuple]:
        """(extent, stride) of each kept dimension, strides of the compact source buffer."""
        strides, acc = [], i64(1)
        for dim in reversed(self.buffer.shape):
            strides.append(acc)
            acc = acc * dim
        strides.reverse()
        return [(r.extent, st) for r, st, idx in zip(self.ranges(), strides, self.index)
                if isinstance(idx, slice)]

    def tensor_region(self):
        return tirx.BufferRegion(self.buffer, self.ranges())


@dataclass(frozen=True)
class Stage:
    """One scheduled component and the regions its parameters bind to (outputs last)."""

    name: str
    func: tirx.PrimFunc
    args: Sequence[Region]
    n_outputs: int


def _as_i64(value):
    if isinstance(value, int):
        return i64(value)
    return value if str(value.ty.dtype) == "int64" else value.astype("int64")


def _remapped(expr, remap: dict):
    return tvm_ffi.structural_map(expr, (tvm.ir.Var, lambda v: remap.get(v, v)), order="pre")


def _bound_buffer(param, region: Region, remap: dict):
    """A buffer like ``param`` whose shape, strides and offset are those of ``region``.

    ``remap`` maps the symbolic dimensions of the component's parameters (its own T) to the
    region's; a dimension that is an expression of them (T + 1) must equal the region's
    extent.
    """
    kept = region.kept()
    shape = list(param.shape)
    analyzer = tvm.sym.Analyzer()
    if len(kept) != len(shape) or not all(analyzer.can_prove_equal(ext, _remapped(dim, remap))
                                          for dim, (ext, _) in zip(shape, kept)):
        raise ValueError(f"cannot bind {param.name} {shape} to a region of {region.buffer.name} "
                         f"with extents {[e for e, _ in kept]}")
    shape = [ext for ext, _ in kept]
    compact, acc = [], i64(1)
    for dim in reversed(shape):
        compact.append(acc)
        acc = acc * dim
    compact.reverse()
    strides = [st for _, st in kept]
    if all(analyzer.can_prove_equal(a, b) for a, b in zip(strides, compact)):
        strides = []
    return tirx.decl_buffer(shape, param.dtype, param.name, strides=strides, offset_factor=1)


def _is_scratch(buffer) -> bool:
    """A stage's own global buffer of a static size (a split product's slices)."""
    return buffer.scope() == "global" and all(isinstance(d, tirx.IntImm) for d in buffer.shape)


def stage_block(stage: Stage, scratch: list | None = None):
    """The stage's component as a block over regions of the sequence buffers. Its own global
    buffers of a static size go to ``scratch`` (when given) instead of the block, for the
    caller to pass in."""
    func = s_tir.renew_defs(stage.func)  # a component may serve several stages (one a gate)
    params = list(func.params)
    if len(params) != len(stage.args):
        raise ValueError(f"stage {stage.name}: {len(params)} parameters, {len(stage.args)} regions")
    remap = {}
    for p, r in zip(params, stage.args):  # the component's run-time sizes, from any parameter
        for dim, (ext, _) in zip(p.shape, r.kept()):
            if isinstance(dim, tvm.ir.Var):
                remap[dim] = ext
    compact = [str(name) for name in (func.attrs or {}).get(COMPACT_ATTR, [])]
    for p, r in zip(params, stage.args):
        remap[p] = _bound_buffer(p, r, remap)
        if p.name in compact and len(remap[p].strides):
            raise ValueError(f"stage {stage.name}: its kernel reads {p.name} as compact rows, "
                             f"given a strided region of {r.buffer.name}")
    root = _remapped(func.body.block, remap)
    allocs = list(root.alloc_buffers)
    if scratch is not None:
        scratch += [b for b in allocs if _is_scratch(b)]
        allocs = [b for b in allocs if not _is_scratch(b)]
    regions = [r.tensor_region() for r in stage.args]
    n_in = len(regions) - stage.n_outputs
    block = s_tir.SBlock(
        [], regions[:n_in], regions[n_in:], stage.name, root.body, alloc_buffers=allocs,
        match_buffers=[s_tir.MatchBufferRegion(remap[p], r) for p, r in zip(params, regions)],
    )
    return s_tir.SBlockRealize([], True, block)


def _seq(stmts: list):
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def sequence_function(name: str, params: Sequence, prologue: Sequence[Stage],
                      t_var: tvm.ir.Var, t_extent, steps: Sequence[Stage],
                      epilogue: Sequence[Stage] = (), views: Sequence = ()) -> tirx.PrimFunc:
    """``prologue`` once, ``steps`` for t_var in [0, t_extent) (if any), then ``epilogue``,
    as one PrimFunc. ``views``: (view, buffer) pairs, a view being a buffer declared on another
    buffer's memory in another shape (e.g. x [T, N, C] seen as [T*N, C]); stages' regions may
    use it. The stages' own global buffers of a static size (a split product's slices) become
    parameters after ``params``, for the caller to allocate (see :func:`scratch_signature`):
    TVM would take them from its own workspace pool, whose memory a thread that is not Python's
    main one (torch's autograd) frees only as the process exits, after CUDA has shut down."""
    scratch = []
    blocks = [stage_block(s, scratch) for s in prologue]
    loop = [tirx.For(t_var, i64(0), t_extent, tirx.ForKind.SERIAL,
                     _seq([stage_block(s, scratch) for s in steps]))] if steps else []
    blocks += loop + [stage_block(s, scratch) for s in epilogue]
    body = _seq([tirx.DeclBuffer(view, data=of.data) for view, of in views] + blocks)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    func = tirx.PrimFunc(list(params) + scratch, root)
    return func.with_attr("global_symbol", name).with_attr("tirx.noalias", True)


def scratch_signature(func: tirx.PrimFunc, signed: int) -> list[dict]:
    """Signature entries (workspaces) of ``func``'s parameters after the first ``signed``: the
    stages' scratch buffers that :func:`sequence_function` made parameters."""
    return [{"name": f"scratch_{i}_{buffer.name}", "shape": [int(d) for d in buffer.shape],
             "dtype": str(buffer.dtype), "kind": "workspace"}
            for i, buffer in enumerate(func.params[signed:])]


def standalone_function(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A scheduled component as a function of the module, under ``name``."""
    return func.with_attr("global_symbol", name)
