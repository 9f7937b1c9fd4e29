"""Small helpers shared by the rules: loop nests of a PrimFunc and their sizes, and the
parameters of the kernels that rules write in TVMScript."""

from __future__ import annotations

from tvm import s_tir
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

#: The attribute (of a device function, or an AttrStmt inside a kernel) that TVM prints as
#: ``__launch_bounds__``'s second argument: the blocks a multiprocessor must hold, which caps
#: ptxas's registers.
LAUNCH_BOUNDS = "tirx.launch_bounds_min_blocks_per_sm"
#: A kernel's attribute naming the parameters it reads as compact rows (a TMA tensor map's:
#: rows one after another), which :func:`rnncc.lowering.assemble.stage_block` checks of the
#: regions a sequence gives them.
COMPACT_ATTR = "rnncc.compact_params"


#: Values a slice of K of one step's product is a multiple of where S slices do not make K in
#: equal slices of whole 16 values (:func:`slice_depth`): the chunks of the tensor-core rules
#: (64 halves, 32 TF32 values) divide it.
SLICE_ALIGN = 64


def slice_depth(depth: int, parts: int) -> int:
    """K a slice of one step's product of K ``depth`` in S = ``parts`` slices (rnncc's
    gemm_parts component, and the rules that compute it): K / S where that is whole 16 values
    (every slice alike), else K / S rounded up to whole :data:`SLICE_ALIGN` values, the last
    slice ending at K (a rule that slices so keeps it from being empty)."""
    if depth % (parts * 16) == 0:
        return depth // parts
    return -(-depth // (parts * SLICE_ALIGN)) * SLICE_ALIGN


def buffer_parameters(specs: dict) -> list:
    """Inside a ``@T.prim_func`` being built: its buffer parameters, in the order of ``specs``
    (name: (shape, dtype)), each from a handle ``<name>_h`` and named ``name``."""
    buffers = []
    for name, (shape, dtype) in specs.items():
        buffer = T.match_buffer(T.arg(f"{name}_h", T.handle()), shape, dtype)
        IRBuilder.name(name, buffer)
        buffers.append(buffer)
    return buffers


def float32_parameters(shapes: dict) -> list:
    """:func:`buffer_parameters` of float32 buffers (name: shape)."""
    return buffer_parameters({name: (shape, "float32") for name, shape in shapes.items()})


def sm_at_least(target, version: int) -> bool:
    """Whether ``target`` is CUDA of SM architecture ``version`` (70: sm_70) or later."""
    arch = str(target.attrs.get("arch", ""))
    return arch.startswith("sm_") and int(arch[3:].rstrip("a")) >= version


def has_mma(target) -> bool:
    """Whether ``target`` has ``mma.sync`` m16n8k16 with float32 sums (sm_80 and later)."""
    return sm_at_least(target, 80)


def has_wgmma(target) -> bool:
    """Whether ``target`` has warpgroup MMA, ``wgmma.mma_async`` (Hopper: sm_90, built as
    sm_90a)."""
    return str(target.attrs.get("arch", "")) in ("sm_90", "sm_90a")


def loop_nests(sch: s_tir.Schedule):
    """The top-level loop nests: (outer loops, blocks in the nest) for each child of root."""
    root = sch.get_sblock("root")
    nests, seen = [], []
    for block in sch.get_child_blocks(root):
        loops = sch.get_loops(block)
        if not loops:
            nests.append(([], [block]))
            continue
        outer = sch.get_sref(loops[0])
        for i, key in enumerate(seen):
            if key.same_as(outer):
                nests[i][1].append(block)
                break
        else:
            seen.append(outer)
            nests.append((loops, [block]))
    return nests


def is_spatial(sch: s_tir.Schedule, block) -> bool:
    """True when every iteration variable of the block is spatial (no reduction)."""
    return all(int(iv.iter_type) == 0 for iv in sch.get(block).iter_vars)


def static_extent(sch: s_tir.Schedule, loop) -> int | None:
    """The loop's extent if it is a constant, else None."""
    extent = sch.get(loop).extent
    return int(extent.value) if hasattr(extent, "value") else None


def divisor(n: int | None, candidates) -> int:
    """The first candidate that divides n (1 if none does, or n is not known)."""
    if n is None:
        return 1
    for c in candidates:
        if n % c == 0:
            return c
    return 1


def block_named(sch: s_tir.Schedule, name: str):
    """The block called ``name``, or None when the PrimFunc has none."""
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - no such block
        return None


def gemm_blocks(sch: s_tir.Schedule):
    """(gemm, gemm_bias) blocks of rnncc's gemm component, or None for any other PrimFunc."""
    blocks = block_named(sch, "gemm"), block_named(sch, "gemm_bias")
    return None if None in blocks else blocks


def weights_are_rows(sch: s_tir.Schedule, gemm) -> bool:
    """True when the gemm block reads w as w[o, k] (PyTorch's [O, K] rows, rnncc's CUDA
    layout)."""
    block = sch.get(gemm)
    o_var = block.iter_vars[-2].var
    first = block.reads[1].region[0].min
    return first.same_as(o_var)


def step_product(func):
    """(h's dtype, W's dtype, N, O, K) of a gemm component that is one step's product
    h [N, K] x W [O, K] (W read as rows, every extent static), else None."""
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None or len(sch.get_loops(blocks[0])) != 3:
        return None
    if not weights_are_rows(sch, blocks[0]):
        return None
    extents = [static_extent(sch, x) for x in sch.get_loops(blocks[0])]
    if None in extents:
        return None
    a_dtype, w_dtype = (str(r.source.dtype) for r in sch.get(blocks[0]).reads[:2])
    return (a_dtype, w_dtype, *extents)
