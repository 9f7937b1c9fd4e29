"""A NumPy interpreter of the persistent kernel's TIR, for testing its stages without a GPU.

Every thread of every block runs at once, in lockstep: each statement reads for all threads,
then writes (as a warp executes an instruction), and a condition masks the threads it does not
hold for. It knows the TIR the kernel's stages build (as parsed, before TVM lowers it): loops
(serial, unrolled and vectorized loops run in order), thread bindings, conditions, buffer loads
and stores, integer, float and bit arithmetic, and the CUDA device functions and intrinsics the
kernel calls: shuffles within a warp, acquire loads and waits of tagged words (a wait whose tag
never comes is an error, not a hang), the counter barrier (an error where it would wait
forever), asynchronous copies (done at once), ``mma.sync`` m16n8k16 (row.col, f16 x f16 + f32)
and m16n8k8 (tf32 x tf32 + f32), Hopper's ``wgmma.mma_async`` (both operands in shared memory
through matrix descriptors, done at once) and the GPU's fast exponential and division. Block
barriers and fences are no-ops: in lockstep every store is seen at once, so this checks the
arithmetic and the layouts, not the synchronisation.

The TMA engine's copies (``cp.async.bulk.tensor`` of a box of a host-encoded tensor map, the
128-byte swizzle, zeros past the tensor, multicast into blocks of a cluster) are queued on
their mbarrier and made when a thread first waits for that barrier's phase: a producer that
runs ahead of its consumers (as one thread in lockstep does, its waits for free stages
no-ops) does not overwrite a stage before they read it.

A kernel made by schedule primitives (blocks, a reduction across a warp's lanes) runs once
:func:`lowered` has taken its blocks out: threads launched by ``thread_extent`` attributes,
``threadIdx.x``, ``.y`` and ``.z``, and ``tvm_thread_allreduce`` (a sum) across threads.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from helpers import round_tf32

_INT = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}


def lowered(mod):
    """PrimFunc "main" of IRModule ``mod`` (a scheduled component) with its blocks lowered
    (TVM's passes that precede the device code: cross-thread reductions, blocks' inits and
    allocations), the form :class:`Simulator` runs."""
    passes = s_tir.transform
    return tvm.transform.Sequential([
        passes.LowerCrossThreadReduction(), passes.LowerInitBlock(),
        passes.PlanAndUpdateBufferAllocationLocation(), passes.ConvertBlocksToOpaque(),
        passes.CompactBufferAllocation(), passes.LowerMatchBuffer(),
        passes.LowerOpaqueBlock()])(mod)["main"]


class Deadlock(AssertionError):
    """The kernel would wait forever (a tag that never comes, a count never reached)."""


def _swizzled(addr):
    """Byte address ``addr`` of shared memory in the 128-byte swizzle (the matrix descriptors'
    and the TMA engine's): bits 4-6 ^= bits 7-9."""
    return addr ^ ((addr >> 7 & 7) << 4)


class _TensorMap:
    """A tensor map as the host encodes it: rows of a buffer from element ``flat``."""

    def __init__(self):
        self.buffer = self.flat = self.depth = self.rows = self.row = self.box = None


class _Pointer:
    def __init__(self, buffer, flat):
        self.buffer, self.flat = buffer, flat


def _dtype(node) -> str:
    return str(node.ty.dtype)


def _np_dtype(dtype) -> np.dtype:
    return np.dtype("bool" if str(dtype) == "bool" else str(dtype))


def _thread_tag(node) -> str:
    """The thread tag of a binding: a loop's or a ``thread_extent`` attribute's."""
    binding = node.thread_binding if isinstance(node, tirx.For) else node.node
    return str(binding.thread_tag)


def _thread_extent(node):
    return node.extent if isinstance(node, tirx.For) else node.value


def _scope(buffer) -> str:
    return str(buffer.ty.storage_scope) or "global"


class Simulator:
    """Runs PrimFunc ``func`` once. ``args``: NumPy arrays for its buffer parameters, by
    buffer name (updated in place); symbolic sizes are bound from their shapes. On-chip
    buffers live in :attr:`chip` by name: [lanes, size] for registers (``local``), [blocks,
    size] for shared memory; ``preset`` gives some of them starting values, by name: their
    first elements, for every thread or block (a row) or each (an array of rows)."""

    def __init__(self, func, args: dict, preset: dict | None = None):
        self.func, self.env, self.store = func, {}, {}
        for buffer in func.params:
            for dim, size in zip(buffer.ty.shape, args[buffer.name].shape):
                if isinstance(dim, tirx.Var):
                    self.env[dim] = int(size)
        self.grid, self.threads = self._grid(func.body)
        self.blocks = int(np.prod(self.grid))
        self.lanes = self.blocks * self.threads
        self.lane = np.arange(self.lanes)
        self.chip = {}
        for buffer in func.params:
            array = args[buffer.name]
            for dim, size in zip(buffer.ty.shape, array.shape):
                assert int(self._expr(dim)) == size, (buffer.name, buffer.ty.shape, array.shape)
            assert array.dtype == _np_dtype(buffer.ty.dtype), (buffer.name, array.dtype)
            self.store[buffer] = ("global", array.reshape(-1))
        self.preset = preset or {}
        self.cluster = 1
        #: TMA copies queued by (block, barrier element): [(phase, copy)]; the phases each
        #: (block, barrier) has begun (an expected transaction) and been waited for; the
        #: arrivals a phase of each takes (its initial count) and the arrivals it had
        self.queued, self.begun, self.waited = {}, {}, {}
        self.counts, self.arrivals = {}, {}
        #: bytes each (block, barrier element) expected (arrive.expect_tx) and received
        #: (asynchronous stores into the block from its cluster)
        self.expected, self.received = {}, {}
        self.described = None  # the shared memory buffer the matrix descriptors name

    def run(self):
        self.mask = np.ones(self.lanes, bool)
        self._stmt(self.func.body, self.mask)
        self._check_arrivals()
        return self

    # -- the grid and the buffers ------------------------------------------------------------

    def _grid(self, body):
        """(grid, threads): the extents of blockIdx.x, .y and .z, and the threads of a block
        (:attr:`block_dims`: threadIdx.x, .y and .z; of run-time sizes too, bound from the
        arguments' shapes), the most of any kernel's. A function of several kernels of
        different grids runs each on its own (:attr:`kernels`: a kernel's outermost binding,
        its grid and block), its threads a block's first lanes numbered as its own block
        (:attr:`dims`: x fastest, so that its warps are 32 consecutive lanes), the lanes past
        them masked off."""
        def bindings(node):
            found = []
            tvm_ffi.structural_walk(node, (tirx.For, lambda inner: found.append(inner) if (
                inner.thread_binding is not None) else None))
            tvm_ffi.structural_walk(node, (tirx.AttrStmt, lambda inner: found.append(inner) if (
                inner.attr_key == "thread_extent") else None))
            return found

        def extents(kernel, nested):
            found = {}
            for node in [kernel, *nested]:
                tag, extent = _thread_tag(node), int(self._expr(_thread_extent(node)))
                if found.setdefault(tag, extent) != extent:
                    raise NotImplementedError(f"a kernel of two extents of {tag}")
            return (tuple(found.get(f"blockIdx.{axis}", 1) for axis in "xyz"),
                    tuple(found.get(f"threadIdx.{axis}", 1) for axis in "xyz"))

        inner, self.kernels = set(), {}
        for node in bindings(body):  # each kernel's subtree walked once, where it is found
            if node not in inner:
                nested = bindings(node.body)
                inner.update(nested)
                self.kernels[node] = extents(node, nested)
        self.kernels = {k: v for k, v in self.kernels.items() if k not in inner}
        grids = list(self.kernels.values()) or [((1, 1, 1), (1, 1, 1))]
        grid = tuple(max(g[axis] for g, _ in grids) for axis in range(3))
        self.block_dims = tuple(max(t[axis] for _, t in grids) for axis in range(3))
        self.dims = self.block_dims  # the running kernel's (:meth:`_launch`)
        return grid, int(np.prod(self.block_dims))

    def _thread_index(self, axis: int):
        """Each lane's threadIdx along ``axis`` (0, 1, 2: x, y, z)."""
        below = int(np.prod(self.dims[:axis]))
        return self.lane % self.threads // below % self.dims[axis]

    def _allocate(self, buffer):
        size = int(np.prod([int(d) for d in buffer.ty.shape]))
        if _scope(buffer) == "global":  # a workspace in device memory, poisoned
            self.store[buffer] = ("global", np.full(size, np.nan, _np_dtype(buffer.ty.dtype)))
            return
        rows = self.lanes if _scope(buffer) == "local" else self.blocks
        array = np.zeros((rows, size), _np_dtype(buffer.ty.dtype))
        if buffer.name in self.preset:  # its first elements
            value = np.asarray(self.preset[buffer.name])
            array[..., :value.shape[-1]] = value
        self.chip[buffer.name] = array
        self.store[buffer] = (_scope(buffer), array)

    def _load(self, buffer, flat):
        """Element ``flat`` of ``buffer`` for every thread the current mask holds (an index
        out of the buffer is an error there; the other threads read element 0)."""
        scope, array = self.store[buffer]
        flat = np.broadcast_to(np.asarray(flat, np.int64), (self.lanes,))
        size = array.shape[-1]
        bad = self.mask & ((flat < 0) | (flat >= size))
        if bad.any():
            lane = int(np.argmax(bad))
            raise IndexError(f"thread {lane % self.threads} of block {lane // self.threads} reads "
                             f"{buffer.name}[{flat[lane]}], past its {size} elements")
        flat = np.where(self.mask, flat, 0)
        if scope == "global":
            return array[flat]
        row = self.lane if scope == "local" else self.lane // self.threads
        return array[row, flat]

    def _write(self, buffer, flat, value, mask):
        scope, array = self.store[buffer]
        flat = np.broadcast_to(np.asarray(flat, np.int64), (self.lanes,))[mask]
        if flat.size and (flat.min() < 0 or flat.max() >= array.shape[-1]):
            raise IndexError(f"a thread writes {buffer.name}[{flat.min()}..{flat.max()}], past "
                             f"its {array.shape[-1]} elements")
        value = np.broadcast_to(np.asarray(value).astype(array.dtype), (self.lanes,))[mask]
        if scope == "global":
            array[flat] = value
        else:
            row = self.lane if scope == "local" else self.lane // self.threads
            array[row[mask], flat] = value

    def _flat_index(self, buffer, indices):
        flat = 0
        for dim, index in zip(buffer.ty.shape, indices):
            flat = flat * int(self._expr(dim)) + index
        return flat

    # -- statements ----------------------------------------------------------------------------

    def _stmt(self, node, mask):
        if not mask.any():
            return
        self.mask = mask
        kind = type(node).__name__
        if kind == "SeqStmt":
            for s in node.seq:
                self._stmt(s, mask)
        elif kind == "SBlockRealize":
            self._stmt(node.block, mask)
        elif kind == "SBlock":
            for buffer in node.alloc_buffers:
                self._allocate(buffer)
            self._stmt(node.body, mask)
        elif kind == "For":
            self._for(node, mask)
        elif kind == "IfThenElse":
            cond = np.broadcast_to(np.asarray(self._expr(node.condition), bool), (self.lanes,))
            self._stmt(node.then_case, mask & cond)
            if node.else_case is not None:
                self._stmt(node.else_case, mask & ~cond)
            self.mask = mask
        elif kind in ("BufferStore", "TensorStore"):
            flat = self._flat_index(node.buffer, [self._expr(i) for i in node.indices])
            self._write(node.buffer, flat, self._expr(node.value), mask)
        elif kind == "Bind":
            self.env[node.var] = self._expr(node.value)
        elif kind == "Evaluate":
            if type(node.value).__name__ == "Call":  # else a no-op: evaluate(0)
                self._call(node.value, mask)
        elif kind == "AllocBuffer":
            self._allocate(node.buffer)
        elif kind == "AttrStmt" and node.attr_key == "thread_extent":
            self._launch(node, node.node.var, mask)
        elif kind == "AttrStmt":  # launch bounds, a reduction's scope and the like
            self._stmt(node.body, mask)
        else:
            raise NotImplementedError(f"statement {kind}")

    def _launch(self, node, var, mask):
        """A thread binding (a loop's or a ``thread_extent`` attribute's): ``var`` each
        lane's index, the body run for the lanes of the kernel."""
        outer = mask
        if node in self.kernels:  # a kernel's grid: its lanes (a block's first threads, as
            # the hardware numbers them: x fastest), the others masked off
            self.kernel, self.dims = self.kernels[node]
            self._check_arrivals()  # the last kernel's barriers, then this one's anew
            self.queued, self.begun, self.waited, self.counts, self.arrivals = ({} for _ in
                                                                                range(5))
            mask = mask & (self.lane // self.threads < int(np.prod(self.kernel)))
            mask = mask & (self.lane % self.threads < int(np.prod(self.dims)))
        tag = _thread_tag(node)
        axis = "xyz".index(tag[-1])
        if tag == "clusterCtaIdx.x":  # clusters of consecutive blocks
            self.cluster = int(self._expr(_thread_extent(node)))
            value = self.lane // self.threads % self.cluster
        elif tag.startswith("blockIdx."):  # x fastest, then y, then z
            below = int(np.prod(self.kernel[:axis]))
            value = self.lane // self.threads // below % self.kernel[axis]
        else:
            value = self._thread_index(axis)
        self.env[var] = value
        self._stmt(node.body, mask)
        self.mask = outer

    def _for(self, node, mask):
        if node.thread_binding is not None:
            self._launch(node, node.loop_var, mask)
            return
        start, extent = (self._bound(self._expr(e), mask) for e in (node.min, node.extent))
        for i in range(int(start), int(start) + int(extent)):
            self.env[node.loop_var] = i
            self._stmt(node.body, mask)
        self.mask = mask

    @staticmethod
    def _bound(value, mask):
        """A loop bound: one value for every lane the loop runs on (read from memory by each,
        it must be the same in all of them; none run it: 0)."""
        if np.ndim(value) == 0:
            return value
        values = np.broadcast_to(value, np.shape(mask))[mask]
        assert (values == values[:1]).all(), "loop bounds differ by thread"
        return values[0] if values.size else 0

    # -- expressions ---------------------------------------------------------------------------

    _BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Min": np.minimum,
               "Max": np.maximum, "EQ": np.equal, "NE": np.not_equal, "LT": np.less,
               "LE": np.less_equal, "GT": np.greater, "GE": np.greater_equal,
               "And": np.logical_and, "Or": np.logical_or, "FloorDiv": np.floor_divide,
               "FloorMod": np.mod, "BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or,
               "LShift": np.left_shift, "RShift": np.right_shift, "BitwiseXor": np.bitwise_xor}

    def _expr(self, node):
        kind = type(node).__name__
        if kind == "IntImm":
            return _np_dtype(_dtype(node)).type(node.value)
        if kind == "FloatImm":
            return _np_dtype(_dtype(node)).type(node.value)
        if kind == "Var":
            return self.env[node]
        if kind in ("BufferLoad", "TensorLoad"):
            return self._load(node.source, self._flat_index(node.source,
                                                       [self._expr(i) for i in node.indices]))
        if kind in self._BINARY:
            return self._BINARY[kind](self._expr(node.a), self._expr(node.b))
        if kind == "Div":
            return np.divide(self._expr(node.a), self._expr(node.b))
        if kind == "Not":
            return np.logical_not(self._expr(node.a))
        if kind == "Cast":
            return np.asarray(self._expr(node.value)).astype(_np_dtype(_dtype(node)))[()]
        if kind == "Select":
            return np.where(self._expr(node.condition), self._expr(node.true_value),
                            self._expr(node.false_value))
        if kind == "Call":
            return self._call(node, None)
        if kind == "Let":
            self.env[node.var] = self._expr(node.value)
            return self._expr(node.body)
        raise NotImplementedError(f"expression {kind}: {node}")

    def _call(self, node, mask):
        op = node.op.name
        args = node.args
        if op in ("tirx.tvm_storage_sync", "tirx.cuda.grid_sync"):
            return None
        if op == "tirx.tvm_thread_allreduce":
            return self._allreduce(args, mask)
        if op == "prim.if_then_else" or op == "tirx.if_then_else":
            return self._select(args)
        if op == "tirx.bitwise_and":
            return np.bitwise_and(self._expr(args[0]), self._expr(args[1]))
        if op == "tirx.bitwise_or":
            return np.bitwise_or(self._expr(args[0]), self._expr(args[1]))
        if op == "tirx.bitwise_xor":
            return np.bitwise_xor(self._expr(args[0]), self._expr(args[1]))
        if op == "tirx.shift_left":
            return np.left_shift(self._expr(args[0]), self._expr(args[1]))
        if op == "tirx.shift_right":
            return np.right_shift(self._expr(args[0]), self._expr(args[1]))
        if op == "tirx.reinterpret":
            if isinstance(self._expr(args[0]), _TensorMap):
                return self._expr(args[0])
            value = np.asarray(self._expr(args[0]))
            return value.view(_np_dtype(_dtype(node)))[()]
        if op == "tirx.address_of":
            load = args[0]
            if isinstance(load, tirx.Var):  # a tensor map
                return self.env[load]
            return _Pointer(load.source, self._flat_index(
                load.source, [self._expr(i) for i in load.indices]))
        if op == "tirx.tvm_stack_alloca":
            return _TensorMap()
        if op == "tirx.tensormap_encode_tiled":
            return self._encode(args)
        if op.startswith("tirx.ptx.mbarrier"):
            return self._mbarrier(op, args, mask)
        if op == "tirx.tvm_access_ptr":  # (type, data, offset, extent, rw)
            return _Pointer(args[1].args[0], self._expr(args[2]))  # data: a call on the buffer
        if op == "tirx.tanh":
            return np.tanh(self._expr(args[0]))
        if op == "tirx.exp":
            return np.exp(self._expr(args[0]))
        if op == "tirx.sigmoid":
            return 1 / (1 + np.exp(-self._expr(args[0])))
        if op == "tirx.rsqrt":
            with np.errstate(invalid="ignore", divide="ignore"):  # threads masked out too
                return 1 / np.sqrt(self._expr(args[0]))
        if op == "tirx.call_pure_extern":
            return self._extern(str(args[0].value), [self._expr(a) for a in args[1:]])
        if op == "tirx.cuda.func_call":
            return self._device(str(args[0].value), args[1:-1], mask)
        if op == "tirx.ptx_legacy.mma":
            return self._mma(args)
        if op == "tirx.ptx_legacy.ldmatrix":
            return self._ldmatrix(args, mask)
        if op.startswith("tirx.ptx.cp_async_bulk_tensor"):
            return self._tma_copy(args, mask)
        if op.startswith("tirx.ptx.cp"):
            return self._ptx_copy(args, mask)
        if op == "tirx.cuda.cvta_generic_to_shared":
            return self._expr(args[0])
        if op.startswith("tirx.ptx.fence"):
            return None
        if op.startswith("tirx.ptx.wgmma"):
            return self._wgmma(args)
        if op == "tirx.cuda.wgmma_encode_matrix_descriptor":
            return self._describe(args, mask)
        raise NotImplementedError(f"call {op}")

    def _select(self, args):
        """``if_then_else``: each branch evaluated only for the threads that take it."""
        outer = self.mask
        cond = np.broadcast_to(np.asarray(self._expr(args[0]), bool), (self.lanes,))
        self.mask = outer & cond
        yes = self._expr(args[1]) if self.mask.any() else None
        self.mask = outer & ~cond
        no = self._expr(args[2]) if self.mask.any() else None
        self.mask = outer
        if yes is None or no is None:
            return no if yes is None else yes
        return np.where(cond, yes, no)

    def _allreduce(self, args, mask):
        """``tvm_thread_allreduce(1, value, cond, out, *thread vars)``: the sum of ``value``
        over the threads that differ only in the given threads' indices, into ``out`` (each
        thread's register) for every one of them."""
        count, value, cond, out, *over = args
        assert int(count.value) == 1, "one value a reduction"
        value = np.broadcast_to(np.where(self._expr(cond), self._expr(value), 0), (self.lanes,))
        axes = set()
        for var in over:
            ids = np.broadcast_to(self.env[var], (self.lanes,))
            axes |= {a for a in range(3) if (ids == self._thread_index(a)).all()
                     and self.dims[a] > 1}
        size = int(np.prod(self.dims))  # the kernel's threads, a block's first
        shape = (self.blocks, *reversed(self.dims))  # [block][z][y][x]
        picked = tuple(3 - a for a in axes)
        value = np.where(mask, value, 0).reshape(self.blocks, self.threads)[:, :size]
        total = np.zeros((self.blocks, self.threads), value.dtype)
        total[:, :size] = np.broadcast_to(
            value.reshape(shape).sum(axis=picked, keepdims=True), shape).reshape(self.blocks, -1)
        total = total.reshape(-1)
        self._write(out.source, self._flat_index(out.source, [self._expr(i)
                                                             for i in out.indices]),
                    total, mask)
        return None

    @staticmethod
    def _extern(name, values):
        if name == "__expf":
            return np.exp(values[0]).astype(np.float32)
        if name == "__fdividef":
            return (values[0] / values[1]).astype(np.float32)
        if name == "__float_as_uint":
            return np.asarray(values[0], np.float32).view(np.uint32)
        raise NotImplementedError(f"extern {name}")

    # -- device functions ----------------------------------------------------------------------

    def _device(self, name, args, mask):
        values = [self._expr(a) for a in args]
        # in one thread of simulation the tagged loads' orders (acquire, relaxed) are alike
        if name in ("rnncc_ldcg", "rnncc_grid_load", "rnncc_grid_load_relaxed"):
            return self._load(values[0].buffer, values[0].flat)
        if name in ("rnncc_grid_wait", "rnncc_grid_wait_relaxed"):
            step = np.uint64(values[2])
            word = np.where((values[1] >> np.uint64(32)) == step, values[1],
                            self._load(values[0].buffer, values[0].flat))
            if np.any((word >> np.uint64(32)) != step):
                raise Deadlock(f"a tagged word's tag is not step {values[2]}")
            return word
        if name == "rnncc_grid_store":
            self._write(values[0].buffer, values[0].flat, values[1], mask)
            return None
        if name == "rnncc_grid_arrive":
            _, counter = self.store[values[0].buffer]
            flat = np.broadcast_to(values[0].flat, (self.lanes,))[mask]
            np.add.at(counter, flat, np.uint32(1))
            return None
        if name == "rnncc_grid_barrier":
            count = self._load(values[0].buffer, values[0].flat)
            if np.any((count < values[1])[mask]):
                raise Deadlock(f"the barrier's count {count[mask].min()} stays under "
                               f"{np.asarray(values[1]).max()}")
            return None
        if name == "rnncc_any_in_warp":
            warps = np.broadcast_to(np.asarray(values[0]) != 0, (self.lanes,)).reshape(-1, 32)
            return np.repeat(warps.any(axis=1), 32).astype(np.int32)
        if name == "rnncc_shfl_xor":
            value = np.broadcast_to(np.asarray(values[0]), (self.lanes,))
            return value[self.lane ^ int(values[1])]
        if name == "rnncc_cp_async":
            dst, src, size = values
            flat = np.broadcast_to(np.asarray(src.flat, np.int64), (self.lanes,))
            for v in range(16 // np.dtype(_np_dtype(src.buffer.ty.dtype)).itemsize):  # 16 bytes
                value = np.where(np.asarray(size) > 0, self._load(src.buffer, flat + v), 0)
                self._write(dst.buffer, np.asarray(dst.flat) + v, value, mask)
            return None
        if name in ("rnncc_ld_stream4", "rnncc_ld_stream4_keep", "rnncc_ld4_keep",
                    "rnncc_ld2_early"):
            dst, src = values[:2]  # 4 float32 (past L1; with an L2 policy's fraction), or 2
            for v in range(2 if name == "rnncc_ld2_early" else 4):
                self._write(dst.buffer, np.asarray(dst.flat) + v,
                            self._load(src.buffer, np.asarray(src.flat) + v), mask)
            return None
        if name in ("rnncc_cp_async_wait", "rnncc_cluster_sync", "rnncc_fence_cluster_init"):
            return None
        if name == "rnncc_cluster_put":
            return self._cluster_put(values, mask)
        if name == "rnncc_cluster_wait":
            return self._tma_wait(values[0], values[1], mask)
        if name == "rnncc_tma_arrive":  # on that barrier of block ``cta`` of the cluster
            flat = np.broadcast_to(np.asarray(values[0].flat, np.int64), (self.lanes,))
            cta = np.broadcast_to(np.asarray(values[1], np.int64), (self.lanes,))
            block = self.lane // self.threads
            for b, f, c in zip(block[mask], flat[mask], cta[mask]):
                key = (int(b - b % self.cluster + c), int(f))
                self.arrivals[key] = self.arrivals.get(key, 0) + 1
            return None
        if name == "rnncc_tma_wait":
            return self._tma_wait(values[0], values[1], mask)
        if name == "rnncc_split_tf32x4":  # 4 float32: TF32 parts in place, the rest beside
            flat, small = (np.broadcast_to(np.asarray(v.flat, np.int64), (self.lanes,))
                           for v in values[:2])
            for v in range(4):
                value = self._load(values[0].buffer, flat + v)
                big = round_tf32(value)
                self._write(values[0].buffer, flat + v, big, mask)
                self._write(values[1].buffer, small + v, (value - big).astype(np.float32), mask)
            return None
        raise NotImplementedError(f"device function {name}")

    def _ptx_copy(self, args, mask):
        """``cp.async`` of 16 or 8 bytes (done at once; its source aligned to them, as the
        hardware requires); its groups' commits and waits do nothing."""
        if any(type(a).__name__ == "StringImm" and a.value in ("commit_group", "wait_group")
               for a in args):
            return None
        dst, src, size = (self._expr(a) for a in args[:3])
        itemsize = np.dtype(_np_dtype(src.buffer.ty.dtype)).itemsize
        count = int(size) // itemsize
        flat = np.broadcast_to(np.asarray(src.flat, np.int64), (self.lanes,))
        if (flat[mask] * itemsize % int(size)).any():  # the hardware's misaligned address
            raise ValueError(f"a cp.async of {int(size)} bytes from {src.buffer.name} at an "
                             "address that is not a multiple of its size")
        # the src-size form: bytes past the source's size are zeros
        given = (np.broadcast_to(np.asarray(self._expr(args[3])), (self.lanes,))
                 if len(args) > 3 and type(args[3]).__name__ != "StringImm" else None)
        for v in range(count):
            value = self._load(src.buffer, flat + v)
            if given is not None:
                value = np.where(given > v * itemsize, value, 0)
            self._write(dst.buffer, np.asarray(dst.flat) + v, value, mask)
        return None

    # -- the TMA engine ----------------------------------------------------------------------

    def _encode(self, args):
        """``tensormap_encode_tiled(map, address, dims (2), row stride in bytes, box (2),
        element strides (2))`` of a 2-D map."""
        tmap, address = self._expr(args[0]), self._expr(args[1])
        dims, stride, box = ([int(self._expr(a)) for a in args[i:j]]
                             for i, j in ((2, 4), (4, 5), (5, 7)))
        size = np.dtype(_np_dtype(address.buffer.ty.dtype)).itemsize
        assert stride[0] == dims[0] * size, "compact rows only"
        tmap.buffer, tmap.flat, tmap.depth, tmap.rows = address.buffer, int(address.flat), *dims
        tmap.box = box
        return None

    def _mbarrier(self, op, args, mask):
        """``mbarrier.init``: the arrivals a phase of the barrier takes; ``arrive.expect_tx``
        (an arrival): the barrier's next phase begins (the copies issued after it are of that
        phase)."""
        if op.endswith("init"):
            count = np.broadcast_to(np.asarray(self._expr(args[1]), np.int64), (self.lanes,))
            flat = np.broadcast_to(np.asarray(self._expr(args[0]).flat, np.int64),
                                   (self.lanes,))
            for b, f, c in zip(self.lane[mask] // self.threads, flat[mask], count[mask]):
                self.counts[(int(b), int(f))] = int(c)
        if op.endswith("expect_tx"):
            for key in self._barriers(self._expr(args[0]), mask):
                self.begun[key] = self.begun.get(key, 0) + 1
                self.arrivals[key] = self.arrivals.get(key, 0) + 1
                self.expected[key] = self.expected.get(key, 0) + int(self._expr(args[1]))
        return None

    def _cluster_put(self, values, mask):
        """``st.async`` of a float32 (at, bar, cta, value) into block ``cta`` of the cluster, at
        once, its 4 bytes counted on that block's barrier (which, over the kernel, must have
        expected as many)."""
        at, bar = values[0], values[1]
        cta = np.broadcast_to(np.asarray(values[2], np.int64), (self.lanes,))
        value = np.broadcast_to(np.asarray(values[3], np.float32), (self.lanes,))
        flat = np.broadcast_to(np.asarray(at.flat, np.int64), (self.lanes,))
        bars = np.broadcast_to(np.asarray(bar.flat, np.int64), (self.lanes,))
        smem = self.store[at.buffer][1]
        for lane in np.flatnonzero(mask):
            block = int(lane) // self.threads
            target = block - block % self.cluster + int(cta[lane])
            assert 0 <= flat[lane] < smem.shape[-1], (at.buffer.name, flat[lane])
            smem[target, flat[lane]] = value[lane]
            key = (target, int(bars[lane]))
            self.received[key] = self.received.get(key, 0) + 4
        return None

    def _check_arrivals(self):
        """Each barrier waited for had, in the whole kernel, the arrivals of every phase
        waited for (in lockstep a producer's waits for free stages come before the consumers
        give them back; over the kernel the counts must still add up, or the GPU would
        hang)."""
        for key, phases in self.waited.items():
            had, count = self.arrivals.get(key, 0), self.counts.get(key)
            if count is None:
                raise Deadlock(f"block {key[0]} waits on barrier element {key[1]}, never "
                               f"initialised")
            if had < phases * count:
                raise Deadlock(f"block {key[0]} waits for {phases} phases of barrier element "
                               f"{key[1]} ({count} arrivals each), which had {had} arrivals")
        for key, got in self.received.items():
            if got != self.expected.get(key, 0):
                raise Deadlock(f"block {key[0]}'s barrier element {key[1]} expected "
                               f"{self.expected.get(key, 0)} bytes and received {got}")

    def _barriers(self, pointer, mask):
        """(block, barrier element) of each thread the mask holds."""
        flat = np.broadcast_to(np.asarray(pointer.flat, np.int64), (self.lanes,))
        blocks = self.lane // self.threads
        return sorted({(int(b), int(f)) for b, f in zip(blocks[mask], flat[mask])})

    def _tma_copy(self, args, mask):
        """``cp.async.bulk.tensor.2d`` (dst, map, k, row, mbar[, cta mask]): queued on the
        barrier of each block it writes (``multicast::cluster``: the cluster's blocks in the
        mask) as that barrier's current phase."""
        names = [str(a.value) for a in args if type(a).__name__ == "StringImm"]
        dst, tmap, k0, row0, bar = (self._expr(a) for a in args[:5])
        ctas = self._expr(args[5]) if "multicast::cluster" in names else None
        size = np.dtype(_np_dtype(tmap.buffer.ty.dtype)).itemsize
        for lane in np.flatnonzero(mask):
            block = int(lane) // self.threads
            first = block - block % self.cluster
            targets = [first + r for r in range(self.cluster)
                       if int(np.broadcast_to(ctas, (self.lanes,))[lane]) >> r & 1] if (
                ctas is not None) else [block]
            at = [int(np.broadcast_to(v, (self.lanes,))[lane]) for v in (
                dst.flat, k0, row0, bar.flat)]
            phase = self.begun.get((block, at[3]), 0) - 1
            for target in targets:
                self.queued.setdefault((target, at[3]), []).append(
                    (phase, (target, dst.buffer, at[0] * np.dtype(_np_dtype(
                        dst.buffer.ty.dtype)).itemsize, tmap, at[1], at[2], size)))
        return None

    def _tma_wait(self, pointer, parity, mask):
        """A wait for a barrier's phase: the copies queued on it for the next phase not yet
        waited for are made (each block's, once). The k-th wait on a barrier must be for
        parity k % 2 (each phase is waited for once, in order)."""
        parity = np.broadcast_to(np.asarray(parity), (self.lanes,))
        for key in self._barriers(pointer, mask):
            phase = self.waited.get(key, 0)
            block = self.lane // self.threads == key[0]
            assert (parity[mask & block] == phase % 2).all(), (
                f"block {key[0]} waits for parity {parity[mask & block][0]} of barrier "
                f"element {key[1]}'s phase {phase}")
            self.waited[key] = phase + 1
            due = [copy for p, copy in self.queued.get(key, []) if p == phase]
            self.queued[key] = [(p, c) for p, c in self.queued.get(key, []) if p != phase]
            for copy in due:
                self._land(*copy)
        return None

    def _land(self, block, buffer, dst, tmap, k0, row0, size):
        """A box of ``tmap`` from (k0, row0) into the block's dynamic shared memory ``buffer``
        from byte ``dst``: box row r at 128 r bytes, 128-byte swizzled; past the tensor
        zeros."""
        smem = self.store[buffer][1]
        assert np.dtype(_np_dtype(buffer.ty.dtype)).itemsize == size
        box_k, box_rows = tmap.box
        assert box_k * size == 128, "boxes of 128-byte rows"
        r, kk = np.arange(box_rows)[:, None], np.arange(box_k)[None, :]
        rows, ks = row0 + r, k0 + kk
        inside = (rows < tmap.rows) & (ks < tmap.depth)
        _, source = self.store[tmap.buffer]
        flat = tmap.flat + np.where(inside, rows * tmap.depth + ks, 0)
        value = np.where(inside, source[flat], 0)
        addr = dst + r * 128 + kk * size
        addr = _swizzled(addr)
        smem[block, addr // size] = value

    def _uniform(self, expr) -> int:
        """The value of ``expr``, the same for every thread (an offset into registers)."""
        values = np.unique(np.asarray(self._expr(expr)))
        assert values.size == 1, f"{expr} differs between threads"
        return int(values[0])

    def _ldmatrix(self, args, mask):
        """``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` on every warp: lane l gives
        the address of row l % 8 of matrix l // 8 (8 16-bit elements; 16-byte aligned); lane l
        (g = l // 4, q = l % 4) receives of each matrix j its elements [g][2q], [g][2q + 1]
        (.trans: [2q][g], [2q + 1][g]) in its registers' elements 2j, 2j + 1 (from the local
        offset)."""
        trans, count = bool(args[0].value), int(args[1].value)
        _, local = self.store[args[3].args[0]]
        offset = self._uniform(args[4])
        access = args[5]  # tvm_access_ptr(type, data, offset, extent, rw)
        _, smem = self.store[access.args[1].args[0]]
        flat = np.broadcast_to(np.asarray(self._expr(access.args[2]) + self._expr(args[6]),
                                          np.int64), (self.lanes,))
        assert (flat % 8 == 0).all(), "ldmatrix: rows 16-byte aligned"
        warps = self.lanes // 32
        rows = flat.reshape(warps, 32)
        block = (self.lane // self.threads).reshape(warps, 32)[:, :1, None]
        g, q = np.arange(32) // 4, np.arange(32) % 4
        for j in range(count):
            matrix = smem[block, rows[:, 8 * j:8 * j + 8, None] + np.arange(8)]  # [warps, 8, 8]
            for v in range(2):
                value = matrix[:, 2 * q + v, g] if trans else matrix[:, g, 2 * q + v]
                local[self.lane[mask], offset + 2 * j + v] = value.reshape(-1)[mask]
        return None

    def _mma(self, args):
        """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 on every warp the mask holds: lane
        l (group g = l // 4, t = l % 4) holds A[g + 8*(i//2 % 2)][2t + i % 2 + 8*(i // 4)] in
        a_i, B[2t + i % 2 + 8*(i // 2)][g] in b_i, and C, D[g + 8*(i // 2)][2t + i % 2] in c_i.
        m16n8k8 with .tf32 operands: A[g + 8*(i % 2)][t + 4*(i // 2)] in a_i, B[t + 4*i][g] in
        b_i, the operands' 13 low mantissa bits ignored and D rounded toward zero (as the
        hardware does: TF32 sums' error grows with K, H200)."""
        a = self.store[args[6].args[0]][1][:, self._uniform(args[7]):]
        b = self.store[args[8].args[0]][1][:, self._uniform(args[9]):]
        if str(args[0].value) == "m16n8k8":
            assert str(args[3].value) == str(args[4].value) == "tf32", "m16n8k8: TF32 only"
            return self._mma_tf32(args, *(np.asarray(x, np.float32).view(np.uint32)
                                          & np.uint32(0xFFFFE000) for x in (a, b)))
        a, b = a.astype(np.float32), b.astype(np.float32)
        _, c_all = self.store[args[10].args[0]]
        off = int(self._expr(args[11]))
        c = c_all[:, off:off + 4].copy()  # the warps the mask holds written back below
        warps = self.lanes // 32
        g, t = (np.arange(32) // 4), (np.arange(32) % 4)
        big_a = np.zeros((warps, 16, 16), np.float32)
        big_b = np.zeros((warps, 16, 8), np.float32)
        big_c = np.zeros((warps, 16, 8), np.float32)
        a, b, c = (x.reshape(warps, 32, -1) for x in (a, b, c))
        for i in range(8):
            big_a[:, g + 8 * (i // 2 % 2), 2 * t + i % 2 + 8 * (i // 4)] = a[:, :, i]
        for i in range(4):
            big_b[:, 2 * t + i % 2 + 8 * (i // 2), g] = b[:, :, i]
            big_c[:, g + 8 * (i // 2), 2 * t + i % 2] = c[:, :, i]
        d = big_a @ big_b + big_c
        for i in range(4):
            c[:, :, i] = d[:, g + 8 * (i // 2), 2 * t + i % 2]
        c_all[self.mask, off:off + 4] = c.reshape(self.lanes, 4)[self.mask]
        return None

    def _mma_tf32(self, args, a_bits, b_bits):
        a, b = a_bits.view(np.float32).astype(np.float64), b_bits.view(np.float32)
        _, c_all = self.store[args[10].args[0]]
        off = int(self._expr(args[11]))
        warps = self.lanes // 32
        g, t = (np.arange(32) // 4), (np.arange(32) % 4)
        big_a = np.zeros((warps, 16, 8))
        big_b = np.zeros((warps, 8, 8))
        big_c = np.zeros((warps, 16, 8))
        a, b = a[:, :4].reshape(warps, 32, 4), b[:, :2].reshape(warps, 32, 2)
        c = c_all[:, off:off + 4].copy().reshape(warps, 32, 4)
        for i in range(4):
            big_a[:, g + 8 * (i % 2), t + 4 * (i // 2)] = a[:, :, i]
            big_c[:, g + 8 * (i // 2), 2 * t + i % 2] = c[:, :, i]
        for i in range(2):
            big_b[:, t + 4 * i, g] = b[:, :, i]
        d = big_a @ big_b + big_c
        nearest = d.astype(np.float32)
        d = np.where(np.abs(nearest) > np.abs(d), np.nextafter(nearest, np.float32(0)), nearest)
        for i in range(4):
            c[:, :, i] = d[:, g + 8 * (i // 2), 2 * t + i % 2]
        c_all[self.mask, off:off + 4] = c.reshape(self.lanes, 4)[self.mask]
        return None

    # -- warpgroup MMA -------------------------------------------------------------------------

    #: a matrix descriptor's layout field by TVM's swizzle code (3: the 128-byte swizzle)
    _LAYOUT = {0: 0, 1: 3, 2: 2, 3: 1}

    def _describe(self, args, mask):
        """``wgmma_encode_matrix_descriptor(desc, addr, ldo, sdo, swizzle)``: the descriptor's
        bits (start address and offsets in 16-byte units; addresses are byte offsets in the
        block's dynamic shared memory)."""
        desc, addr = self._expr(args[0]), self._expr(args[1])
        ldo, sdo, swizzle = (int(self._expr(a)) for a in args[2:])
        size = np.dtype(_np_dtype(addr.buffer.ty.dtype)).itemsize
        self.described = addr.buffer
        start = np.asarray(addr.flat, np.uint64) * np.uint64(size) >> np.uint64(4)
        value = (start & np.uint64(0x3FFF) | np.uint64(ldo << 16) | np.uint64(sdo << 32)
                 | np.uint64(self._LAYOUT[swizzle] << 62))
        self._write(desc.buffer, desc.flat, value, mask)
        return None

    def _matrix(self, desc, rows, k, block, transposed=False):
        """The [rows, k] operand a descriptor names, in the block's shared memory: K-major
        (8 rows of 128 bytes of k a core matrix, the next 8 rows ``sbo`` on), or
        ``transposed`` MN-major (k-rows of 128 bytes, 64 rows each; 8 k-rows, then the next 8
        ``sbo`` on; the next 64 rows ``lbo`` on)."""
        buffer, smem = self.described, self.store[self.described][1]
        size = np.dtype(_np_dtype(buffer.ty.dtype)).itemsize
        desc = int(desc)
        start, sbo = (desc & 0x3FFF) << 4, (desc >> 32 & 0x3FFF) << 4
        lbo = (desc >> 16 & 0x3FFF) << 4
        assert desc >> 62 == self._LAYOUT[3], "128-byte swizzled operands only"
        r, kk = np.arange(rows)[:, None], np.arange(k)[None, :]
        if transposed:
            per_row = 128 // size
            addr = start + r // per_row * lbo + r % per_row * size + kk // 8 * sbo + kk % 8 * 128
        else:
            addr = start + r // 8 * sbo + r % 8 * 128 + kk * size
        addr = _swizzled(addr)
        assert (addr % size == 0).all()
        return smem[block, addr // size]

    def _wgmma(self, args):
        """``wgmma.mma_async`` m64nNkK: D[64, N] = A[64, K] B[N, K]^T (+ D) for each warpgroup,
        both operands in shared memory (the 128-byte swizzle; 16-bit ones K-major or, where
        the instruction's transposition flag says so, MN-major), TF32 operands' low 13
        mantissa bits ignored and the float32 sums rounded toward zero, an instruction at a
        time; thread t of warp w holds D[16 w + t // 4 + 8 h][8 n + 2 (t % 4)
        + v] in its sum 4 n + 2 h + v. Fences, commits and waits do nothing."""
        names = [str(a.value) for a in args if type(a).__name__ == "StringImm"]
        if "mma_async" not in names:
            return None
        shape = next(n for n in names if n.startswith("m64n"))
        n, k = (int(x) for x in shape[4:].split("k"))
        tf32 = "tf32" in names
        count = n // 2
        acc = [(a.source, int(self._flat_index(a.source, [self._expr(i) for i in a.indices])))
               for a in args[:count]]
        descs = [np.broadcast_to(np.asarray(self._expr(a), np.uint64), (self.lanes,))
                 for a in args[count:count + 2]]
        keep = bool(self._expr(args[count + 2]))
        flags = [int(self._expr(a)) for a in args[count + 3:]
                 if type(a).__name__ != "StringImm"]
        transposed = (False, False) if tf32 else (bool(flags[2]), bool(flags[3]))
        t = np.arange(128)
        row, col = 16 * (t // 32) + t % 32 // 4, 2 * (t % 4)  # of sum 0
        firsts = [b * self.threads + w * 128 for b in range(self.blocks)
                  for w in range(self.threads // 128)]
        for g in (g for g in firsts if self.mask[g]):
            lanes = np.arange(g, g + 128)
            assert all((d[lanes] == d[g]).all() for d in descs), "a warpgroup's descriptors"
            block = g // self.threads
            a, b = (self._matrix(d[g], r, k, block, tr).astype(np.float32)
                    for d, r, tr in zip(descs, (64, n), transposed))
            if tf32:
                a, b = (x.view(np.uint32) & np.uint32(0xFFFFE000) for x in (a, b))
                a, b = a.view(np.float32), b.view(np.float32)
            d = a.astype(np.float64) @ b.astype(np.float64).T
            for e, (buffer, flat) in enumerate(acc):
                j, h, v = e // 4, e // 2 % 2, e % 2
                _, array = self.store[buffer]
                value = d[row + 8 * h, col + 8 * j + v] + (array[lanes, flat] if keep else 0)
                if tf32:  # the float32 sums round toward zero
                    nearest = value.astype(np.float32)
                    value = np.where(np.abs(nearest) > np.abs(value),
                                     np.nextafter(nearest, np.float32(0)), nearest)
                array[lanes, flat] = value
        return None
