"""The persistent kernel, generated as TVMScript for one cell, size and plan.

One launch runs all T steps. With a fused input projection (``plan.input_rows``), each block
first computes the input projections of its rows for all steps (:class:`_InputProjection`),
or, overlapped (``plan.input_steps``), for the first group of steps only. Then, per step, each
block:

1. prefetches the input projections of its (unit, batch) pairs for step t;
2. stages h_{t-1} [N, H] (float32) in shared memory. With ``sync="tagged"`` (the default)
   h travels between blocks as 8-byte words (the value and the step that wrote it): a block
   issues its loads (acquire loads at GPU scope), then re-reads only the words whose tag is
   not yet the step's, so no separate barrier is needed and a step costs about one L2 round
   trip of communication (data and flag in one store, as NCCL's low-latency protocol does).
   With ``"barrier"`` (rnncc's counter barrier) or ``"grid"`` (cooperative groups) h is plain
   float32, read past L1 (``ld.global.cg``) after the barrier;
3. multiplies: each lane its 16-byte weight chunks (registers first, then shared memory,
   then, for a streaming plan, global memory) by the matching chunks of h, for every batch
   row; accumulation in float32;
4. reduces over the 32 lanes with a halving butterfly (each exchange halves the values a lane
   carries, so RW*N sums cost about RW*N shuffles instead of 5*RW*N). A float16 plan on tensor
   cores (``plan.mma``, planner: "Tensor cores") does 3 and 4 as ``mma.sync`` instructions
   instead, from h staged in float16 fragments (``hs16``), in ``planner.MMA_CHAINS``
   independent accumulators;
5. applies the cell to its (unit, batch) pairs: gates from the sums plus b_hh and the
   prefetched input projections, the states kept in registers across steps; writes
   h_t to y[t] and to the other half of the h ping-pong buffer;
6. with a barrier variant, waits at the grid barrier, so that every block's h_t is visible
   before step t+1 (the counter barrier in two halves: the block arrives, then waits). An
   overlapped input projection computes a slab of a later group of steps between publishing
   h_t (the tagged stores, or the arrival) and the wait, where the block would otherwise
   idle. Every variant spins on other blocks, so the launch is cooperative: all
   blocks resident, or the driver refuses the launch (never a hang).

With batch groups (``plan.batch_groups`` NG > 1; planner: "Batch groups") block bx runs batch
rows bx // (B/NG) * N/NG + n, n < N/NG, with the weights of block bx % (B/NG): staging, the
tagged words and the counter (one a group) stay within its group, so each group runs as the
kernel of batch N/NG would (``"grid"`` still synchronises the whole grid).

Block-wide barriers are TVM storage syncs (``T.tvm_storage_sync``), which TVM's barrier
insertion counts: with ``T.cuda.cta_sync`` (opaque to it) it added barriers of its own next to
them, 8 a step where 4 (plus the grid barrier's) are needed; without them a step was 0.04-0.15
us shorter (H200, LSTM 512 batch 1 1.58 -> 1.44 us).

Register arrays are indexed only by unrolled loop indices, so they stay in registers. Every
wait on another block is bounded (:data:`WAIT_LIMIT_CYCLES`, about 8 s): past it the kernel
traps, so a fault shows up as a failed launch with an error, never as a hang.
"""

from __future__ import annotations

import math

from tvm import tirx

from rnncc.cells import ops
from rnncc.compiler.pipeline import FLAG_ARRIVE, FLAG_BARRIER, GRID_LOAD, GRID_STORE, GRID_WAIT

from .._common import prim_func_from_text
from . import planner
from .planner import Plan

#: GPU clock cycles a block waits on another before it gives up (__trap: the launch fails with
#: an error instead of hanging; a healthy step waits microseconds).
WAIT_LIMIT_CYCLES = 1 << 34


def _acquire_load(name: str, ctype: str, bits: int, ordering: bool) -> str:
    """A device function ``name(address)``: an acquire load at GPU scope (``ld.acquire.gpu``:
    on sm_90 a strong load followed by an L1 invalidation). ``ordering``: the compiler may not
    move other memory accesses across it (a barrier's wait, whose loads of h come after); a
    tagged word carries its data, so its loads need no such clobber."""
    reg = "r" if bits == 32 else "l"
    clobber = ' : "memory"' if ordering else ""
    return (f"__device__ __forceinline__ {ctype} {name}(const {ctype}* address) {{\n"
            f"  {ctype} value;\n"
            f'  asm volatile("ld.acquire.gpu.global.u{bits} %0, [%1];" : "={reg}"(value) : '
            f'"l"(address){clobber});\n'
            "  return value;\n}\n")


# The counter barrier, in two halves that thread 0 calls: the arrival, after a block barrier
# (so the block's stores of h_t are ordered before it), releases (they are visible before its
# count); the wait acquires, as cooperative groups' grid sync does on sm_70+; the block then
# waits for its thread 0 at the kernel's next block barrier. Between the two the block may
# work on what needs no other block (the overlapped input projection).
# A full fence (``__threadfence``) before a plain atomic and after the wait cost up to 0.3 us
# a step more (H200, 64-128 blocks).
ARRIVE_SOURCE = f"""
__device__ __forceinline__ void {FLAG_ARRIVE}(unsigned int* counter) {{
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}}
"""
BARRIER_SOURCE = "\n" + _acquire_load("rnncc_acquire_u32", "unsigned int", 32, True) + f"""\
__device__ __forceinline__ void {FLAG_BARRIER}(unsigned int* counter, unsigned int target) {{
  long long start = clock64();
  while (rnncc_acquire_u32(counter) < target) {{
    if (clock64() - start > {WAIT_LIMIT_CYCLES}LL) {{ __trap(); }}
  }}
}}
"""

SHFL_SOURCE = """
__device__ __forceinline__ float rnncc_shfl_xor(float value, int mask) {
  return __shfl_xor_sync(0xffffffffu, value, mask);
}
"""

GRID_STORE_SOURCE = f"""
__device__ __forceinline__ void {GRID_STORE}(uint64_t* address, uint64_t value) {{
  *((volatile uint64_t*)address) = value;
}}
"""

#: Tag of the slot that holds no step yet (steps count from 0 and stay below it).
EMPTY_TAG = 0x7FFFFFFF
#: Words of h a thread loads before it waits on their tags.
WAIT_BATCH = 8

#: The tagged exchange's loads are acquire loads (:func:`_acquire_load`). Plain volatile loads
#: (``ld.volatile``, strong at system scope) were measured to deadlock about once in 10 to 100
#: runs of 37 steps (float16 tanh and relu RNNs, H=33, N=7, 9 blocks on an H200: a block waited
#: on a word whose tag never came, and the wait limit trapped); with acquire loads 600 such
#: runs passed.
GRID_LOAD_SOURCE = _acquire_load(GRID_LOAD, "uint64_t", 64, False)

# TVM emits a device function's source once a called name, so the wait (a separate call) has
# its own copy of the load under a private name.
GRID_WAIT_SOURCE = _acquire_load("rnncc_acquire_u64", "uint64_t", 64, False) + f"""
__device__ __forceinline__ uint64_t {GRID_WAIT}(const uint64_t* address, uint64_t step) {{
  uint64_t value = rnncc_acquire_u64(address);
  long long start = clock64();
  while ((value >> 32) != step) {{
    if (clock64() - start > {WAIT_LIMIT_CYCLES}LL) {{ __trap(); }}
    value = rnncc_acquire_u64(address);
  }}
  return value;
}}
"""

LDCG_SOURCE = """
__device__ __forceinline__ float rnncc_ldcg(const float* address) {
  return __ldcg(address);
}
"""

# An asynchronous copy of 16 bytes from global to shared memory (``cp.async``, sm_80+): zeros
# where ``bytes`` is 0 (then nothing is read). The overlapped input projection copies the next
# slab's x while the step runs, so its slab does not wait on memory.
CP_ASYNC_SOURCE = """
__device__ __forceinline__ void rnncc_cp_async(float* shared, const float* global, int bytes) {
  unsigned int address = (unsigned int)__cvta_generic_to_shared(shared);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(address), "l"(global),
               "r"(bytes) : "memory");
}
"""
CP_WAIT_SOURCE = """
__device__ __forceinline__ void rnncc_cp_async_wait() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
"""


def _fast_exp(x):
    """e ** x by the GPU's exponential unit (``__expf``: CUDA gives at most 2 + |1.16 x| ulp),
    for float32; None (TVM's ``expf``) otherwise."""
    if ops.dtype_of(x) != "float32":
        return None
    return tirx.call_pure_extern("float32", "__expf", x)


def _fast_sigmoid(x):
    """1 / (1 + e ** -x) with :func:`_fast_exp` and ``__fdividef`` (2 ulp; 0 once the
    denominator passes 2 ** 126, where the exact quotient is below float32's normal range)."""
    if ops.dtype_of(x) != "float32":
        return None
    one = tirx.const(1.0, "float32")
    return tirx.call_pure_extern("float32", "__fdividef", one, one + _fast_exp(tirx.const(
        0.0, "float32") - x))


#: The cell's point-wise functions as the kernel builds them: the per-step cell sits on the
#: critical path of every step, and IEEE ``expf`` with an IEEE division cost about twice the
#: cycles (measured on an H200: 800 -> 410 cycles a step for an LSTM cell), for errors far below
#: the float32 tolerance of the outputs. ``tanh`` keeps CUDA's accurate ``tanhf``: its fast form
#: (``tanh.approx.f32``, 2 ** -11 relative) gave output errors of 5e-6, too near the 1e-5 bound.
FAST_FUNCTIONS = {"exp": _fast_exp, "sigmoid": _fast_sigmoid}


def _block_loop(emit, ind: str, count: int, threads: int, unroll: bool = False) -> str:
    """Emit ``for e in ...`` that spreads ``count`` items over the block's threads (unrolled
    when ``unroll`` and at most 32 a thread); the TVMScript of a thread's item index."""
    per = -(-count // threads)
    emit(f'{ind}for e in {"T.unroll" if unroll and per <= 32 else "range"}({per}):')
    return f"(e * {threads} + tx)"


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def source(cell, hidden: int, batch: int, p: Plan, name: str = "persistent",
           dtype: str = "float32", chunk: int = 1, input_size: int = 0) -> str:
    """TVMScript text of the kernel (exposed for tests and ``rnncc inspect``). ``dtype`` is
    the storage dtype of the weights, the bias and y; the input projections, the states'
    workspaces, products, sums, h's staging and exchange, and the cell are float32. ``chunk``
    S > 1: the input projections are in chunks of S steps, [ceil(T/S), S, N, G*H]. A plan
    with a fused input projection (``p.fused``) needs ``input_size`` C. ``batch``: N, all
    batch groups together."""
    g_count, states = cell.gates, len(cell.states)
    h, n_, vec, ki, kr, ks = hidden, batch, p.vec, p.chunks, p.reg_chunks, p.smem_chunks
    rw, wn, u_, it_, b_ = p.rows_per_warp, p.warps, p.units, p.items, p.group_blocks
    threads = p.threads
    # Batch groups (planner): block bx runs batch rows nb + n, n < N/NG, with the weights of
    # block blk; one group is written as the kernel was before groups.
    ng, n_all = p.batch_groups, batch
    n_ = batch // ng
    blk, nb = ("bx", "") if ng == 1 else (f"(bx % {b_})", f"bx // {b_} * {n_} + ")
    kp = ki * 32 * vec
    gh = g_count * h
    acc_n = _next_pow2(rw * n_)
    lines = []
    emit = lines.append

    def guard(indent: str, condition: str) -> None:
        """Open ``if condition:`` (its body goes at ``indent`` + 8 spaces)."""
        emit(f'{indent}with T.If({condition}):')
        emit(f'{indent}    with T.Then():')

    tagged = p.sync == "tagged"
    fused = p.fused
    if fused and (chunk != 1 or input_size < 1 or (p.input_slab and not ks)):
        raise ValueError(f"a fused input projection needs chunk 1, an input size and, in slabs, "
                         f"shared memory for W_hh, got chunk {chunk}, input size {input_size} "
                         f"and {ks} chunks of W_hh in shared memory")
    # inputs first, outputs last (a fused kernel writes xp)
    params = (["x", "wi", "bi", "w", "b", "xp"] if fused else ["xp", "w", "b"]) + ["y"]
    params += [f"s{k}" for k in range(states)] + ["hw" if tagged else "cnt"]
    emit(f"@T.prim_func(s_tir=True)\ndef {name}("
         + ", ".join(f"{a}_h: T.handle" for a in params) + "):")
    emit('    T.func_attr({"tirx.noalias": True})')
    emit('    T_len = T.int64()')
    dt = dtype
    sn, kc = p.input_rows, p.input_chunks
    if fused:
        emit(f'    x = T.match_buffer(x_h, (T_len, {n_all}, {input_size}), "{dt}")')
        emit(f'    wi = T.match_buffer(wi_h, {input_weight_shape(cell, p)}, "{dt}")')
        emit(f'    b_ih = T.match_buffer(bi_h, ({gh},), "{dt}")')
    if chunk == 1:
        emit(f'    xp = T.match_buffer(xp_h, (T_len, {n_all}, {gh}), "float32")')
        step = "t"
    else:
        emit(f'    xp = T.match_buffer(xp_h, ((T_len + {chunk - 1}) // {chunk}, {chunk}, {n_all}, '
             f'{gh}), "float32")')
        step = f"t // {chunk}, t % {chunk}"
    emit(f'    w = T.match_buffer(w_h, ({b_}, {wn}, {ki}, {rw}, 32, {vec}), "{dt}")')
    emit(f'    b_hh = T.match_buffer(b_h, ({gh},), "{dt}")')
    emit(f'    y = T.match_buffer(y_h, (T_len, {n_all}, {h}), "{dt}")')
    for k in range(states):
        emit(f'    s{k} = T.match_buffer(s{k}_h, (2, {n_all}, {h}), "float32")')
    if tagged:
        emit(f'    hw = T.match_buffer(hw_h, (2, {n_all}, {h}), "uint64")')
    else:
        emit(f'    cnt = T.match_buffer(cnt_h, ({ng},), "uint32")')
    emit('    with T.sblock("root"):')
    i1 = " " * 8
    if kr:
        emit(f'{i1}wreg = T.sblock_alloc_buffer(({kr * rw * vec},), "{dt}", scope="local")')
    mma, chains = p.mma, planner.MMA_CHAINS
    if mma:  # the mma's A fragment (h), B fragment (weights) and sums (see planner)
        emit(f'{i1}af = T.sblock_alloc_buffer((8,), "float16", scope="local")')
        emit(f'{i1}wb = T.sblock_alloc_buffer((4,), "{dt}", scope="local")')
        emit(f'{i1}dacc = T.sblock_alloc_buffer(({4 * chains},), "float32", scope="local")')
        emit(f'{i1}hs16 = T.sblock_alloc_buffer(({planner.MMA_ROWS * kp},), "float16", '
             'scope="shared.dyn")')
    else:
        emit(f'{i1}acc = T.sblock_alloc_buffer(({acc_n},), "float32", scope="local")')
        emit(f'{i1}hv = T.sblock_alloc_buffer(({n_ * vec},), "float32", scope="local")')
    emit(f'{i1}wv = T.sblock_alloc_buffer(({vec},), "{dt}", scope="local")')
    emit(f'{i1}gi = T.sblock_alloc_buffer(({it_ * g_count},), "float32", scope="local")')
    emit(f'{i1}bh = T.sblock_alloc_buffer(({it_ * g_count},), "float32", scope="local")')
    emit(f'{i1}st = T.sblock_alloc_buffer(({it_ * states},), "float32", scope="local")')
    if tagged:
        emit(f'{i1}tv = T.sblock_alloc_buffer(({WAIT_BATCH},), "uint64", scope="local")')
    if ks:
        emit(f'{i1}wsm = T.sblock_alloc_buffer(({wn * ks * rw * 32 * vec},), "{dt}", '
             'scope="shared.dyn")')
    if fused:
        rl, snl = planner.fused_row_split(p, g_count), sn // planner.X_GROUPS
        emit(f'{i1}pacc = T.sblock_alloc_buffer(({rl * snl},), "float32", scope="local")')
        emit(f'{i1}xv = T.sblock_alloc_buffer(({snl * vec},), "float32", scope="local")')
        emit(f'{i1}wq = T.sblock_alloc_buffer(({rl * vec},), "{dt}", scope="local")')
        emit(f'{i1}xs = T.sblock_alloc_buffer((1,), "float32", scope="local")')
        if not p.input_slab:  # else W_ih goes through wsm
            emit(f'{i1}wis = T.sblock_alloc_buffer(({kc * rl * planner.ROW_GROUPS * vec},), '
                 f'"{dt}", scope="shared.dyn")')
        sums_floats = sn * wn * (rl * planner.ROW_GROUPS + 1)
        if p.input_steps:  # x's slabs in a buffer of their own
            emit(f'{i1}xsl = T.sblock_alloc_buffer(({sn * (p.input_width * vec + 4)},), '
                 '"float32", scope="shared.dyn")')
            fused_floats = sums_floats
        else:
            fused_floats = max(sn * (p.input_width * vec + 4), sums_floats)
    else:
        fused_floats = 0
    # h_{t-1} for the products, then (once they are done) the gate sums: one buffer (also
    # for the rows of x of the fused input projection, and its warps' sums)
    staged = 0 if mma else n_ * kp  # with tensor cores, h goes to hs16 instead
    emit(f'{i1}hs = T.sblock_alloc_buffer(({max(staged, wn * rw * n_, fused_floats)},), '
         '"float32", scope="shared.dyn")')
    emit(f'{i1}for bx in T.thread_binding({p.blocks}, thread="blockIdx.x"):')
    emit(f'{i1}    for tx in T.thread_binding({threads}, thread="threadIdx.x"):')
    i3 = " " * 16
    emit(f'{i3}warp = T.meta_var(tx // 32)')
    emit(f'{i3}lane = T.meta_var(tx % 32)')
    proj = _InputProjection(emit, guard, cell, hidden, n_, p, input_size, blk, nb) if fused \
        else None
    if proj:
        proj.before_loop(i3)
    # weights into registers and shared memory, once
    if kr:
        emit(f'{i3}for i in T.unroll({kr}):')
        emit(f'{i3}    for q in T.unroll({rw}):')
        emit(f'{i3}        for v in T.vectorized({vec}):')
        emit(f'{i3}            wreg[(i * {rw} + q) * {vec} + v] = w[{blk}, warp, i, q, lane, v]')
    if ks:
        total = wn * ks * rw * 32 * vec
        per = rw * 32 * vec
        _block_loop(emit, i3, total // vec, threads)
        emit(f'{i3}    for v in T.vectorized({vec}):')
        guard(i3 + "        ", f'(e * {threads} + tx) * {vec} < {total}')
        emit(f'{i3}                wsm[(e * {threads} + tx) * {vec} + v] = w[{blk}, '
             f'(e * {threads} + tx) * {vec} // {ks * per}, '
             f'{kr} + (e * {threads} + tx) * {vec} % {ks * per} // {per}, '
             f'(e * {threads} + tx) * {vec} % {per} // {32 * vec}, '
             f'(e * {threads} + tx) % 32, v]')

    if mma:
        # h's fragments: batch rows past N stay zero; so do the A registers of rows 8-15
        _block_loop(emit, i3, planner.MMA_ROWS * kp, threads)
        guard(i3 + "    ", f'e * {threads} + tx < {planner.MMA_ROWS * kp}')
        emit(f'{i3}            hs16[e * {threads} + tx] = T.float16(0)')
        emit(f'{i3}for c in T.unroll(8):')
        emit(f'{i3}    af[c] = T.float16(0)')
        emit(f'{i3}T.tvm_storage_sync("shared.dyn")')  # zeros before the first staging

    def staged_h(e: str, value: str) -> str:
        """The statement that stages element ``e`` (n = e // KP, k = e % KP) of h_{t-1}."""
        if not mma:
            return f"hs[{e}] = {value}"
        n, k = f"({e}) // {kp}", f"({e}) % {kp}"
        at = (f"(({k}) // 16 * 32 + {n} * 4 + ({k}) % 8 // 2) * 4 + ({k}) % 16 // 8 * 2 "
              f"+ ({k}) % 2")
        return f'hs16[{at}] = T.Cast("float16", {value})'

    def item(it):  # (valid, n, j) of the thread's it-th (unit, batch) pair
        e = f"({it} * {threads} + tx)"
        return (f"{e} < {u_ * n_} and {blk} * {u_} + {e} % {u_} < {h}", f"{e} // {u_}",
                f"{blk} * {u_} + {e} % {u_}")

    # per-pair constants and the initial states (kept in registers across steps)
    for it in range(it_):
        valid, n, j = item(it)
        guard(i3, valid)
        for g in range(g_count):
            emit(f'{i3}        bh[{it * g_count + g}] = T.Cast("float32", b_hh[{g * h} + {j}])')
        for k in range(states):
            emit(f'{i3}        st[{it * states + k}] = s{k}[0, {nb}{n}, {j}]')
    emit(f'{i3}for t in range(T_len):')
    i4 = " " * 20
    # 1. prefetch this step's input projections
    for it in range(it_):
        valid, n, j = item(it)
        guard(i4, valid)
        for g in range(g_count):
            emit(f'{i4}        gi[{it * g_count + g}] = xp[{step}, {nb}{n}, {g * h} + {j}]')
    overlap = proj is not None and p.input_steps
    if overlap:  # the copies of this step's slab of x
        proj.start_copies(i4)
    # 2. stage h_{t-1}
    total_h = n_ * kp
    if tagged:
        per_thread = -(-total_h // threads)
        batches = -(-per_thread // WAIT_BATCH)
        emit(f'{i4}for bi in range({batches}):')
        e = f"((bi * {WAIT_BATCH} + i) * {threads} + tx)"
        addr = (f"T.address_of(hw[t % 2, {nb}T.min({e} // {kp}, {n_ - 1}), "
                f"T.min({e} % {kp}, {h - 1})])")
        valid = f"{e} < {total_h} and {e} % {kp} < {h}"
        emit(f'{i4}    for i in T.unroll({WAIT_BATCH}):')
        emit(f'{i4}        tv[i] = T.if_then_else({valid}, T.cuda.func_call("{GRID_LOAD}", '
             f'{addr}, source_code=GRID_LOAD_SRC, return_type="uint64"), '
             f'T.shift_left(T.Cast("uint64", t), T.uint64(32)))')
        emit(f'{i4}    for i in T.unroll({WAIT_BATCH}):')
        guard(i4 + "        ", 'T.shift_right(tv[i], T.uint64(32)) != T.Cast("uint64", t)')
        emit(f'{i4}                tv[i] = T.cuda.func_call("{GRID_WAIT}", {addr}, '
             f'T.Cast("uint64", t), source_code=GRID_WAIT_SRC, return_type="uint64")')
        guard(i4 + "        ", f'{e} < {total_h}')
        emit(f'{i4}                ' + staged_h(e, 'T.reinterpret("float32", T.Cast('
                                                 f'"uint32", T.bitwise_and(tv[i], '
                                                 f'T.uint64({0xFFFFFFFF}))))'))
    else:
        _block_loop(emit, i4, total_h, threads)
        guard(i4 + "    ", f'e * {threads} + tx < {total_h}')
        emit(f'{i4}            ' + staged_h(
            f"e * {threads} + tx", f'T.if_then_else((e * {threads} + tx) % {kp} < {h}, '
            f'T.cuda.func_call("rnncc_ldcg", T.address_of(s0[t % 2, {nb}(e * {threads} + tx) '
            f'// {kp}, T.min((e * {threads} + tx) % {kp}, {h - 1})]), source_code=LDCG, '
            f'return_type="float32"), T.float32(0))'))
    emit(f'{i4}T.tvm_storage_sync("shared.dyn")')
    # 3. products
    if mma:
        emit(f'{i4}for a in T.unroll({4 * chains}):')
        emit(f'{i4}    dacc[a] = T.float32(0)')
    else:
        emit(f'{i4}for a in T.unroll({acc_n}):')
        emit(f'{i4}    acc[a] = T.float32(0)')

    def products(chunk, weight, ind=i4):
        if mma:  # wv: the B fragments of two k-steps of 16 (planner: "Tensor cores")
            emit(f'{ind}    for q in T.unroll({rw}):')
            weight(ind)
            emit(f'{ind}        for s in T.unroll(2):')
            at = f"((({chunk}) * {vec * 2} + q * 2 + s) * 32 + lane) * 4"
            emit(f'{ind}            for v in T.vectorized(2):')
            emit(f'{ind}                af[v] = hs16[{at} + v]')
            emit(f'{ind}            for v in T.vectorized(2):')
            emit(f'{ind}                af[4 + v] = hs16[{at} + 2 + v]')
            emit(f'{ind}            for v in T.vectorized(4):')
            emit(f'{ind}                wb[v] = wv[s * 4 + v]')
            chain = f"(q * 2 + s) % {chains} * 4"
            emit(f'{ind}            T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", '
                 f'"fp16", "fp16", "fp32", af.data, 0, wb.data, 0, dacc.data, {chain}, False, '
                 'dtype="float32"))')
            return
        emit(f'{ind}    for n in T.unroll({n_}):')
        emit(f'{ind}        for v in T.vectorized({vec}):')
        emit(f'{ind}            hv[n * {vec} + v] = '
             f'hs[n * {kp} + (({chunk}) * 32 + lane) * {vec} + v]')
        emit(f'{ind}    for q in T.unroll({rw}):')
        weight(ind)
        emit(f'{ind}        for n in T.unroll({n_}):')
        emit(f'{ind}            for v in T.unroll({vec}):')
        emit(f'{ind}                acc[q * {n_} + n] = acc[q * {n_} + n] + '
             f'T.Cast("float32", wv[v]) * hv[n * {vec} + v]')

    if kr:
        emit(f'{i4}for i in T.unroll({kr}):')
        products("i", lambda ind: (
            emit(f'{ind}        for v in T.vectorized({vec}):'),
            emit(f'{ind}            wv[v] = wreg[(i * {rw} + q) * {vec} + v]')))
    if ks:
        # The shared-memory chunks: a loop, unrolled by p.unroll (a divisor of KS) so that
        # the loads of one chunk overlap the products of another.
        unroll = max(d for d in range(1, min(p.unroll, ks) + 1) if ks % d == 0)
        emit(f'{i4}for so in range({ks // unroll}):')
        emit(f'{i4}    for si in T.unroll({unroll}):')
        products(f"{kr} + so * {unroll} + si", lambda ind: (
            emit(f'{ind}        for v in T.vectorized({vec}):'),
            emit(f'{ind}            wv[v] = wsm[(((warp * {ks} + so * {unroll} + si) * {rw} + q) '
                 f'* 32 + lane) * {vec} + v]')), i4 + "    ")
    if p.global_chunks:
        # Streamed: read from global memory (L2) every step, in a loop (unrolled, ptxas hoists
        # the loads of all chunks at once: a plan streaming 6 of 7 chunks then needed 255
        # registers and spilled, and before the launch bounds had a minimum it failed on an
        # H200 with "unspecified launch failure" in 15 of 22 runs; as a loop 30 of 30 passed).
        emit(f"{i4}for gc in range({p.global_chunks}):")
        products(f"{kr + ks} + gc", lambda ind: (
            emit(f'{ind}        for v in T.vectorized({vec}):'),
            emit(f'{ind}            wv[v] = w[{blk}, warp, {kr + ks} + gc, q, lane, v]')))
    # 4. the sums over K: the mma's own (lane l holds batch row l // 4 of rows (l % 4)*2 +
    # {0, 1}), else a halving butterfly over the lanes
    if not mma:
        length, base, free_bits = _butterfly(emit, "acc", acc_n, i4)
    # The gate sums go where h_{t-1} was: wait until every warp's products have read it (with
    # tensor cores h is in hs16, but it shares the dynamic shared memory with hs, so TVM's
    # barrier insertion would add this barrier anyway).
    emit(f'{i4}T.tvm_storage_sync("shared.dyn")')
    if mma:
        guard(i4, f'lane // 4 < {n_}')
        for c in range(2):
            total = " + ".join(f"dacc[{4 * m + c}]" for m in range(chains))
            emit(f'{i4}        hs[(warp * {rw} + lane % 4 * 2 + {c}) * {n_} + lane // 4] = '
                 f'{total}')
    else:
        for c in range(length):
            idx = f"({base} + {c})"
            guard(i4, f'T.bitwise_and(lane, {free_bits}) == 0 and {idx} < {rw * n_}')
            emit(f'{i4}        hs[(warp * {rw} + {idx} // {n_}) * {n_} + {idx} % {n_}] = '
                 f'acc[{c}]')
    emit(f'{i4}T.tvm_storage_sync("shared.dyn")')
    # 5. the cell
    for it in range(it_):
        valid, n, j = item(it)
        guard(i4, valid)
        emit(f'{i4}        new = T.meta_var(apply_cell(gi, bh, hs, st, {it}, {n}, '
             f'{j} - {blk} * {u_}))')
        emit(f'{i4}        y[t, {nb}{n}, {j}] = T.Cast("{dt}", new[0])')
        emit(f'{i4}        s0[(t + 1) % 2, {nb}{n}, {j}] = new[0]')
        if tagged:
            emit(f'{i4}        T.cuda.func_call("{GRID_STORE}", '
                 f'T.address_of(hw[(t + 1) % 2, {nb}{n}, {j}]), T.bitwise_or('
                 f'T.shift_left(T.Cast("uint64", t + 1), T.uint64(32)), '
                 f'T.Cast("uint64", T.reinterpret("uint32", new[0]))), '
                 f'source_code=GRID_STORE_SRC)')
        for k in range(states):
            emit(f'{i4}        st[{it * states + k}] = new[{k}]')
    # 6. h_t is published (the tagged words) or arrives at the counter barrier; then the
    # overlapped input projection's slab (needs no other block); then the wait for the other
    # blocks' h_t (the tagged exchange waits in the next step's staging)
    if tagged or p.sync == "grid":
        if overlap:
            proj.wait(i4)
            emit(f'{i4}T.tvm_storage_sync("shared.dyn")')  # the cell has read the sums
            proj.in_loop(i4)
        emit(f'{i4}T.tvm_storage_sync("shared.dyn")' if tagged else f'{i4}T.cuda.grid_sync()')
    else:
        counter = f'T.address_of(cnt[{0 if ng == 1 else f"bx // {b_}"}])'
        if overlap:
            proj.wait(i4)
        emit(f'{i4}T.tvm_storage_sync("shared.dyn")')  # every h_t stored before the arrival
        guard(i4, "tx == 0")
        emit(f'{i4}        T.cuda.func_call("{FLAG_ARRIVE}", {counter}, source_code=ARRIVE)')
        if overlap:
            proj.in_loop(i4)
            guard(i4, "tx == 0")
        emit(f'{i4}        T.cuda.func_call("{FLAG_BARRIER}", {counter}, '
             f'T.Cast("uint32", (t + 1) * {b_}), source_code=BARRIER)')
        emit(f'{i4}T.tvm_storage_sync("shared.dyn")')  # the block waits for its thread 0
    # final states other than h
    for it in range(it_):
        valid, n, j = item(it)
        if states > 1:
            guard(i3, valid)
            for k in range(1, states):
                emit(f'{i3}        s{k}[T_len % 2, {nb}{n}, {j}] = st[{it * states + k}]')
    return "\n".join(lines) + "\n"


def _butterfly(emit, buf: str, size: int, ind: str):
    """Emit the halving butterfly that sums ``buf[:size]`` (a power of two) over the 32 lanes
    of a warp; (values a lane keeps, the TVMScript of the index of its first, the lane bits
    that do not select values: lanes with them set hold copies)."""
    length, masks, halving = size, [16, 8, 4, 2, 1], []
    for m in masks:
        if length > 1:
            half = length // 2
            halving.append(m)
            for a in range(half):
                emit(f'{ind}{buf}[{a}] = T.if_then_else(T.bitwise_and(lane, {m}) != 0, '
                     f'{buf}[{a + half}], {buf}[{a}]) + T.cuda.func_call("rnncc_shfl_xor", '
                     f'T.if_then_else('
                     f'T.bitwise_and(lane, {m}) != 0, {buf}[{a}], {buf}[{a + half}]), {m}, '
                     f'source_code=SHFL, return_type="float32")')
            length = half
        else:
            emit(f'{ind}{buf}[0] = {buf}[0] + T.cuda.func_call("rnncc_shfl_xor", {buf}[0], '
                 f'{m}, source_code=SHFL, return_type="float32")')
    spread = [size >> (s + 1) for s in range(len(halving))]
    base = " + ".join(f"T.if_then_else(T.bitwise_and(lane, {m}) != 0, {sp}, 0)"
                      for m, sp in zip(halving, spread)) or "0"
    return length, base, sum(m for m in masks if m not in halving)


def input_weight_shape(cell, p: Plan) -> tuple:
    """Shape of W_ih packed for a fused input projection: [B, KC, RL, 8, VEC], block b, chunk c,
    row q of the lane's RL, row group rg, element v holding W_ih[g*H + j, c*VEC + v] with
    r = rg*RL + q, g = r // U and j = b*U + r % U (zero outside)."""
    rl = planner.fused_row_split(p, cell.gates)
    return (p.group_blocks, p.input_chunks, rl, planner.ROW_GROUPS, p.vec)


#: K chunks a warp of the fused input projection takes an iteration (unrolled; rounded down to a
#: divisor of its chunks). H200, us a step, 1 -> 4: LSTM 1024 N=4 3.86 -> 3.75, GRU 1024 N=4
#: 3.50 -> 3.40, N=1 within 0.02; 8 and all of them no better.
FUSED_UNROLL = 4


class _InputProjection:
    """Emits the fused input projection (planner: "Fused input projection"): the block's rows
    of W_ih (packed [B, KC, RL, 8, VEC]) by groups of SN rows m = t*N + n of x. ``batch``: the
    block's group's N, whose rows start at ``nb``; ``blk``: the block whose weights it holds.

    A group's product over one width of K chunks (:attr:`Plan.input_width`: all of them, a
    slab through W_hh's shared memory, or a slab of the overlapped projection): stage the SN
    rows' columns in shared memory (float32, zero past C and past T*N, rows padded by 16 bytes
    so the 4 x groups' loads hit different banks); warp w multiplies its range of the chunks,
    lane (x group xg, row group rg) rows r = rg*RL + q of W_ih by rows m = 4*s + xg of x into
    its accumulators. Then the warps' sums go through shared memory ([Wn, SN, 8*RL + 1],
    padded: a stride of SN floats made 16-way bank conflicts, 1.7x slower on an H200), and
    thread i adds them up for outputs (n, r) = divmod(i, R) and writes xp[t, n, g*H + j] =
    sum + b_ih[g*H + j] (in slabs through W_hh's shared memory, later slabs add to it)."""

    def __init__(self, emit, guard, cell, hidden: int, batch: int, p: Plan, input_size: int,
                 blk: str, nb: str):
        self.emit, self.guard, self.p, self.blk, self.nb = emit, guard, p, blk, nb
        self.h, self.n_, self.c = hidden, batch, input_size
        self.rl = planner.fused_row_split(p, cell.gates)
        self.r_ = cell.gates * p.units
        self.snl = p.input_rows // planner.X_GROUPS
        self.ksl = p.input_width
        self.wbuf = "wsm" if p.input_slab else "wis"
        self.xstride = self.ksl * p.vec + 4
        # overlapped, x's slab has its own buffer (h is staged meanwhile), filled by
        # asynchronous copies where C keeps 16-byte vectors aligned
        self.xbuf = "xsl" if p.input_steps else "hs"
        self.copies = bool(p.input_steps) and input_size % p.vec == 0
        self.cw = -(-self.ksl // p.warps)  # K chunks a warp
        self.rows = f"T_len * {batch}"
        self.rg = f"(lane % {planner.ROW_GROUPS})"
        self.xg = f"(lane // {planner.ROW_GROUPS})"

    def copy_w_ih(self, ind: str, first: str = "") -> None:
        """W_ih's rows (the slab's, from chunk ``first``) into shared memory."""
        p, emit, kc, rl, rg_n = self.p, self.emit, self.p.input_chunks, self.rl, planner.ROW_GROUPS
        chunks = p.input_slab or kc
        vec, total = p.vec, chunks * rl * rg_n * p.vec
        e = _block_loop(emit, ind, total // vec, p.threads)
        emit(f'{ind}    for v in T.vectorized({vec}):')
        self.guard(ind + "        ", f'{e} * {vec} < {total}')
        cidx = f"{first}{e} // {rl * rg_n}"
        if kc % chunks:  # the last slab's chunks past KC are zero
            value = (f'T.if_then_else({cidx} < {kc}, wi[{self.blk}, T.min({cidx}, {kc - 1}), '
                     f'{e} // {rg_n} % {rl}, {e} % {rg_n}, v], T.Cast(wi.dtype, 0))')
        else:
            value = f'wi[{self.blk}, {cidx}, {e} // {rg_n} % {rl}, {e} % {rg_n}, v]'
        emit(f'{ind}                {self.wbuf}[{e} * {vec} + v] = {value}')

    def stage_x(self, ind: str, m0: str, sl: str | None) -> None:
        """Stage the SN rows of group ``m0`` (columns of slab ``sl``; None: from 0): 16-byte
        vectors where C keeps them aligned, else one element each; asynchronous copies where
        :attr:`copies` (complete after :meth:`wait`)."""
        if self.copies:
            self.copy_x(ind, m0, sl)
            return
        emit, c = self.emit, self.c
        step = self.p.vec if c % self.p.vec == 0 else 1
        inner, r, k, col, m = self._x_slots(ind, m0, sl, step)
        emit(f'{inner}with T.If({col} < {c} and {m} < {self.rows}):')
        emit(f'{inner}    with T.Then():')
        emit(f'{inner}        for v in T.vectorized({step}):')
        emit(f'{inner}            {self.xbuf}[{r} * {self.xstride} + {k} + v] = T.Cast('
             f'"float32", x[({m}) // {self.n_}, {self.nb}({m}) % {self.n_}, {col} + v])')
        emit(f'{inner}    with T.Else():')
        emit(f'{inner}        for v in T.vectorized({step}):')
        emit(f'{inner}            {self.xbuf}[{r} * {self.xstride} + {k} + v] = T.float32(0)')

    def _x_slots(self, ind: str, m0: str, sl: str | None, step: int):
        """Emit the loop over the SN rows of group ``m0`` by the slab's columns, ``step``
        elements a thread's item; (indent of its body, row r, column k in the slab, column of
        x, row m of x)."""
        p, vec = self.p, self.p.vec
        width = self.ksl * vec // step
        slots = p.input_rows * width
        e = _block_loop(self.emit, ind, slots, p.threads, unroll=True)
        r, k = f"{e} // {width}", f"{e} % {width} * {step}"
        col = f"{sl} * {self.ksl * vec} + {k}" if sl is not None else k
        inner = ind + "    "
        if slots % p.threads:
            self.guard(inner, f"{e} < {slots}")
            inner += "        "
        return inner, r, k, col, f"{m0} * {p.input_rows} + {r}"

    def copy_x(self, ind: str, m0: str, sl: str) -> None:
        """Start the copies of slab ``sl`` of group ``m0``'s rows of x into xsl."""
        c, vec = self.c, self.p.vec
        inner, r, k, col, m = self._x_slots(ind, m0, sl, vec)
        row = f"T.min({m}, {self.rows} - 1)"
        source = (f"x[{row} // {self.n_}, {self.nb}{row} % {self.n_}, "
                  f"T.min({col}, {c - vec})]")
        self.emit(f'{inner}T.cuda.func_call("rnncc_cp_async", T.address_of(xsl[{r} * '
                  f'{self.xstride} + {k}]), T.address_of({source}), T.if_then_else({col} < {c} '
                  f'and {m} < {self.rows}, 16, 0), source_code=CP_ASYNC)')

    def wait(self, ind: str) -> None:
        """The thread's copies of x are complete (a block barrier must follow)."""
        if self.copies:
            self.emit(f'{ind}T.cuda.func_call("rnncc_cp_async_wait", source_code=CP_WAIT)')

    def zero(self, ind: str) -> None:
        """The lane's accumulators start from zero."""
        self.emit(f'{ind}for a in T.unroll({self.rl * self.snl}):')
        self.emit(f'{ind}    pacc[a] = T.float32(0)')

    def products(self, ind: str, sl: str | None) -> None:
        """Add the warp's chunks of the staged columns to the lane's accumulators (W_ih's
        chunks from chunk ``sl`` * width of the resident rows, or those of the slab)."""
        p, emit, vec, rl, snl = self.p, self.emit, self.p.vec, self.rl, self.snl
        kc, ksl, cw = p.input_chunks, self.ksl, self.cw
        unroll = max(d for d in range(1, min(FUSED_UNROLL, cw) + 1) if cw % d == 0)
        emit(f'{ind}for co in range({cw // unroll}):')
        emit(f'{ind}    for cu in T.unroll({unroll}):')
        i6 = ind + "        "
        chunk = f"(warp * {cw} + co * {unroll} + cu)"
        wchunk = f"({sl} * {ksl} + {chunk})" if sl is not None else chunk
        bounds = [f"{chunk} < {ksl}"] if ksl % p.warps else []
        if sl is not None and ksl * p.input_steps > kc:
            bounds.append(f"{wchunk} < {kc}")
        if bounds:
            self.guard(i6, " and ".join(bounds))
            i6 += "        "
        emit(f'{i6}for s in T.unroll({snl}):')
        emit(f'{i6}    for v in T.vectorized({vec}):')
        emit(f'{i6}        xv[s * {vec} + v] = {self.xbuf}[(s * {planner.X_GROUPS} + '
             f'{self.xg}) * {self.xstride} + {chunk} * {vec} + v]')
        emit(f'{i6}for q in T.unroll({rl}):')
        emit(f'{i6}    for v in T.vectorized({vec}):')
        emit(f'{i6}        wq[q * {vec} + v] = {self.wbuf}[(({wchunk} * {rl} + q) * '
             f'{planner.ROW_GROUPS} + {self.rg}) * {vec} + v]')
        emit(f'{i6}for q in T.unroll({rl}):')
        emit(f'{i6}    for s in T.unroll({snl}):')
        emit(f'{i6}        for v in T.unroll({vec}):')
        emit(f'{i6}            pacc[q * {snl} + s] = pacc[q * {snl} + s] + '
             f'T.Cast("float32", wq[q * {vec} + v]) * xv[s * {vec} + v]')

    def write(self, ind: str, m0: str, first: str | None = None) -> None:
        """The warps' sums where x was, then xp of group ``m0``: b_ih plus the sums (where
        ``first``, TVMScript of a condition, holds, if given; else xp plus the sums)."""
        p, emit, rl, snl, sn, r_ = self.p, self.emit, self.rl, self.snl, self.p.input_rows, self.r_
        rp = rl * planner.ROW_GROUPS + 1  # a row of the warps' sums, padded against conflicts
        emit(f'{ind}for q in T.unroll({rl}):')
        emit(f'{ind}    for s in T.unroll({snl}):')
        emit(f'{ind}        hs[(warp * {sn} + s * {planner.X_GROUPS} + {self.xg}) * {rp} + '
             f'{self.rg} * {rl} + q] = pacc[q * {snl} + s]')
        emit(f'{ind}T.tvm_storage_sync("shared.dyn")')
        outs = r_ * sn
        o = _block_loop(emit, ind, outs, p.threads, unroll=True)
        n, row = f"({o} // {r_})", f"({o} % {r_})"
        mm = f"({m0} * {sn} + {n})"
        j = f"({self.blk} * {p.units} + {row} % {p.units})"
        out = f"{row} // {p.units} * {self.h} + {j}"
        cond = f"{j} < {self.h} and {mm} < {self.rows}" + (
            f" and {o} < {outs}" if outs % p.threads else "")
        self.guard(ind + "    ", cond)
        i7 = ind + "            "
        target = f"xp[{mm} // {self.n_}, {self.nb}{mm} % {self.n_}, {out}]"
        start = f'T.Cast("float32", b_ih[{out}])'
        if first is not None:
            start = f"T.if_then_else({first}, {start}, {target})"
        emit(f'{i7}xs[0] = {start}')
        emit(f'{i7}for w in T.unroll({p.warps}):')
        emit(f'{i7}    xs[0] = xs[0] + hs[(w * {sn} + {n}) * {rp} + {row}]')
        emit(f'{i7}{target} = xs[0]')

    def before_loop(self, ind: str) -> None:
        """All groups (slab by slab of W_ih through W_hh's shared memory, where it goes
        there), or, overlapped, group 0 only."""
        p, emit, sync = self.p, self.emit, 'T.tvm_storage_sync("shared.dyn")'
        if p.input_steps:
            self.copy_w_ih(ind)
            self.zero(ind)
            emit(f'{ind}for sl in range({p.input_steps}):')
            self.stage_x(ind + "    ", "T.int64(0)", "sl")
            self.wait(ind + "    ")
            emit(f'{ind}    {sync}')
            self.products(ind + "    ", "sl")
            emit(f'{ind}    {sync}')  # the next slab's x, or the sums, go where this was
            self.finish(ind, "T.int64(0)")
            return
        # the slab's W_ih rows into shared memory (the first group's barrier orders them; the
        # last group's barrier keeps the next slab from overwriting rows still read)
        sl = None
        if p.input_slab:
            emit(f'{ind}for sl in range({-(-p.input_chunks // self.ksl)}):')
            ind += "    "
            sl = "sl"
        self.copy_w_ih(ind, f"sl * {self.ksl} + " if sl else "")
        emit(f'{ind}for m0 in range(({self.rows} + {p.input_rows - 1}) // {p.input_rows}):')
        i5 = ind + "    "
        self.stage_x(i5, "m0", sl)
        emit(f'{i5}{sync}')
        self.zero(i5)
        self.products(i5, None)
        emit(f'{i5}{sync}')
        self.write(i5, "m0", "sl == 0" if sl else None)
        # the next group's rows go where these sums were; the time loop reads xp
        emit(f'{i5}{sync}')

    def finish(self, ind: str, m0: str) -> None:
        """Write group ``m0``'s xp from the accumulators, which start again from zero."""
        self.write(ind, m0)
        self.emit(f'{ind}T.tvm_storage_sync("shared.dyn")')
        self.zero(ind)

    def has_slab(self) -> str:
        """TVMScript of: step t has a slab (group t // S + 1 has steps)."""
        s = self.p.input_steps
        return f"(t // {s} + 1) * {s} < T_len"

    def start_copies(self, ind: str) -> None:
        """Overlapped, at the start of step t: the copies of its slab's x (if asynchronous)."""
        if self.copies:
            s = self.p.input_steps
            self.guard(ind, self.has_slab())
            self.copy_x(ind + "        ", f"(t // {s} + 1)", f"t % {s}")

    def in_loop(self, ind: str) -> None:
        """Overlapped, in step t, after a block barrier that follows :meth:`wait`: slab t % S
        of group t // S + 1 (if it has steps), and after its last slab that group's xp. The
        staging of h_{t+1} comes after a block barrier."""
        emit, s = self.emit, self.p.input_steps
        group = f"(t // {s} + 1)"
        self.guard(ind, self.has_slab())
        i5 = ind + "        "
        if not self.copies:
            self.stage_x(i5, group, f"t % {s}")
            emit(f'{i5}T.tvm_storage_sync("shared.dyn")')
        self.products(i5, f"t % {s}")
        self.guard(i5, f"t % {s} == {s - 1}")
        emit(f'{i5}        T.tvm_storage_sync("shared.dyn")')
        self.finish(i5 + "        ", group)


def kernel(cell, hidden: int, batch: int, p: Plan, name: str = "persistent",
           dtype: str = "float32", chunk: int = 1, input_size: int = 0):
    """The kernel as a PrimFunc: params (xp [T,N,G*H], or [ceil(T/S),S,N,G*H] in chunks of
    ``chunk`` S steps, w (packed), b_hh [G*H], y [T,N,H],
    one [2,N,H] ping-pong buffer a state (h first), then for ``sync="tagged"`` the tagged h
    [2,N,H] uint64, else the barrier counters [NG] uint32, one a batch group). With a fused
    input projection
    (``p.fused``) the params start x [T,N,C], W_ih (packed as w, C wide), b_ih [G*H], w,
    b_hh, then xp [T,N,G*H] (written), y and the rest as above."""
    g_count, states = cell.gates, len(cell.states)

    def apply_cell(gi, bh, gsum, st, it, n, u):
        gates_i = [gi[it * g_count + g] for g in range(g_count)]
        gates_h = [gsum[(g * p.units + u) * (batch // p.batch_groups) + n]
                   + bh[it * g_count + g]
                   for g in range(g_count)]
        return cell.evaluate(gates_i, gates_h, [st[it * states + k] for k in range(states)])

    text = source(cell, hidden, batch, p, name, dtype, chunk, input_size)
    with ops.lowered_with(FAST_FUNCTIONS):
        return prim_func_from_text(text, apply_cell=apply_cell, BARRIER=BARRIER_SOURCE,
                                   ARRIVE=ARRIVE_SOURCE, CP_ASYNC=CP_ASYNC_SOURCE,
                                   CP_WAIT=CP_WAIT_SOURCE,
                                   SHFL=SHFL_SOURCE, LDCG=LDCG_SOURCE,
                                   GRID_LOAD_SRC=GRID_LOAD_SOURCE,
                                   GRID_STORE_SRC=GRID_STORE_SOURCE,
                                   GRID_WAIT_SRC=GRID_WAIT_SOURCE)
