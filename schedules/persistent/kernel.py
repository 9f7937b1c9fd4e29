"""The persistent kernel, generated as TVMScript for one cell, size and plan.

One launch runs all T steps. With a fused input projection (``plan.input_rows``), each block
first computes the input projections of its rows for all steps (:func:`_fused_input`). Then,
per step, each block:

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
   before step t+1. Every variant spins on other blocks, so the launch is cooperative: all
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
from rnncc.compiler.pipeline import FLAG_BARRIER, GRID_LOAD, GRID_STORE, GRID_WAIT

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


# Release on arrival (the block's stores of h_t, ordered by the block barrier, are visible
# before its count), acquire while waiting, as cooperative groups' grid sync does on sm_70+;
# the block then waits for its thread 0 at the kernel's next block barrier.
# A full fence (``__threadfence``) before a plain atomic and after the wait cost up to 0.3 us
# a step more (H200, 64-128 blocks).
BARRIER_SOURCE = "\n" + _acquire_load("rnncc_acquire_u32", "unsigned int", 32, True) + f"""\
__device__ __forceinline__ void {FLAG_BARRIER}(unsigned int* counter, unsigned int target) {{
  __syncthreads();
  if (threadIdx.x == 0) {{
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
    long long start = clock64();
    while (rnncc_acquire_u32(counter) < target) {{
      if (clock64() - start > {WAIT_LIMIT_CYCLES}LL) {{ __trap(); }}
    }}
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
        fused_floats = sn * max((p.input_slab or kc) * vec + 4,
                                wn * (rl * planner.ROW_GROUPS + 1))
    else:
        fused_floats = 0
    # h_{t-1} for the products, then (once they are done) the gate sums: one buffer (first
    # the rows of x of the fused input projection)
    staged = 0 if mma else n_ * kp  # with tensor cores, h goes to hs16 instead
    emit(f'{i1}hs = T.sblock_alloc_buffer(({max(staged, wn * rw * n_, fused_floats)},), '
         '"float32", scope="shared.dyn")')
    emit(f'{i1}for bx in T.thread_binding({p.blocks}, thread="blockIdx.x"):')
    emit(f'{i1}    for tx in T.thread_binding({threads}, thread="threadIdx.x"):')
    i3 = " " * 16
    emit(f'{i3}warp = T.meta_var(tx // 32)')
    emit(f'{i3}lane = T.meta_var(tx % 32)')
    if fused:
        _fused_input(emit, guard, cell, hidden, n_, p, input_size, i3, blk, nb)
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
    # 6. grid barrier (the tagged exchange needs none: only the block's own threads sync)
    if tagged:
        emit(f'{i4}T.tvm_storage_sync("shared.dyn")')
    elif p.sync == "grid":
        emit(f'{i4}T.cuda.grid_sync()')
    else:
        emit(f'{i4}T.cuda.func_call("{FLAG_BARRIER}", '
             f'T.address_of(cnt[{0 if ng == 1 else f"bx // {b_}"}]), '
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


def _fused_input(emit, guard, cell, hidden: int, batch: int, p: Plan, input_size: int,
                 ind: str, blk: str, nb: str) -> None:
    """Emit the fused input projection (planner: "Fused input projection"). ``batch``: the
    block's group's N, whose rows start at ``nb``; ``blk``: the block whose weights it holds.
    For each slab of W_ih's K chunks (one, all of them, where W_ih's rows stay in shared
    memory; else each is copied into W_hh's shared memory first) and each group of SN rows
    m = t*N + n of x: stage them (the slab's columns) in shared memory (float32, zero past C
    and past T*N, rows padded by 16 bytes so the 4 x groups' loads hit different banks); warp
    w multiplies its range of the slab's K chunks, lane (x group xg, row group rg) rows
    r = rg*RL + q of W_ih by rows m = 4*s + xg of x; the warps' sums go through shared memory
    ([Wn, SN, 8*RL + 1], padded: a stride of SN floats made 16-way bank conflicts, 1.7x slower
    on an H200), and thread i adds them up for outputs (n, r) = divmod(i, R) and writes
    xp[t, n, g*H + j] = sum + b_ih[g*H + j] (later slabs add to it)."""
    g_count, h, n_, vec = cell.gates, hidden, batch, p.vec
    u_, threads, sn, kc, c = p.units, p.threads, p.input_rows, p.input_chunks, input_size
    wn, r_ = p.warps, g_count * p.units
    rl, rg_n = planner.fused_row_split(p, g_count), planner.ROW_GROUPS
    snl = sn // planner.X_GROUPS
    ksl = p.input_slab or kc  # K chunks a slab
    slabs = -(-kc // ksl)
    wbuf = "wsm" if p.input_slab else "wis"
    xstride = ksl * vec + 4
    rp = rl * rg_n + 1  # a row of the warps' sums [Wn, SN, 8*RL + 1], padded against conflicts
    cw = -(-ksl // wn)  # K chunks a warp
    rows = f"T_len * {n_}"
    rg, xg = f"(lane % {rg_n})", f"(lane // {rg_n})"
    # the slab's W_ih rows into shared memory (the first group's barrier orders them; the last
    # group's barrier keeps the next slab from overwriting rows still read)
    if p.input_slab:
        emit(f'{ind}for sl in range({slabs}):')
        ind += "    "
        first = f"sl * {ksl} + "
    else:
        first = ""
    total = ksl * rl * rg_n * vec
    e = _block_loop(emit, ind, total // vec, threads)
    emit(f'{ind}    for v in T.vectorized({vec}):')
    guard(ind + "        ", f'{e} * {vec} < {total}')
    cidx = f"{first}{e} // {rl * rg_n}"
    if kc % ksl:  # the last slab's chunks past KC are zero
        value = (f'T.if_then_else({cidx} < {kc}, wi[{blk}, T.min({cidx}, {kc - 1}), '
                 f'{e} // {rg_n} % {rl}, {e} % {rg_n}, v], T.Cast(wi.dtype, 0))')
    else:
        value = f'wi[{blk}, {cidx}, {e} // {rg_n} % {rl}, {e} % {rg_n}, v]'
    emit(f'{ind}                {wbuf}[{e} * {vec} + v] = {value}')
    emit(f'{ind}for m0 in range(({rows} + {sn - 1}) // {sn}):')
    i5 = ind + "    "
    # stage SN rows of x: 16-byte vectors where C keeps them aligned, else one element each
    step = vec if c % vec == 0 else 1
    width = ksl * vec // step
    slots = sn * width
    e = _block_loop(emit, i5, slots, threads, unroll=True)
    r, k = f"{e} // {width}", f"{e} % {width} * {step}"
    col = f"sl * {ksl * vec} + {k}" if p.input_slab else k
    m = f"m0 * {sn} + {r}"
    inner = i5 + "    "
    if slots % threads:
        guard(inner, f"{e} < {slots}")
        inner += "        "
    emit(f'{inner}with T.If({col} < {c} and {m} < {rows}):')
    emit(f'{inner}    with T.Then():')
    emit(f'{inner}        for v in T.vectorized({step}):')
    emit(f'{inner}            hs[{r} * {xstride} + {k} + v] = T.Cast("float32", '
         f'x[({m}) // {n_}, {nb}({m}) % {n_}, {col} + v])')
    emit(f'{inner}    with T.Else():')
    emit(f'{inner}        for v in T.vectorized({step}):')
    emit(f'{inner}            hs[{r} * {xstride} + {k} + v] = T.float32(0)')
    emit(f'{i5}T.tvm_storage_sync("shared.dyn")')
    emit(f'{i5}for a in T.unroll({rl * snl}):')
    emit(f'{i5}    pacc[a] = T.float32(0)')
    unroll = max(d for d in range(1, min(FUSED_UNROLL, cw) + 1) if cw % d == 0)
    emit(f'{i5}for co in range({cw // unroll}):')
    emit(f'{i5}    for cu in T.unroll({unroll}):')
    i6 = i5 + "        "
    chunk = f"(warp * {cw} + co * {unroll} + cu)"
    if ksl % wn:
        guard(i6, f"{chunk} < {ksl}")
        i6 += "        "
    emit(f'{i6}for s in T.unroll({snl}):')
    emit(f'{i6}    for v in T.vectorized({vec}):')
    emit(f'{i6}        xv[s * {vec} + v] = hs[(s * {planner.X_GROUPS} + {xg}) * {xstride} + '
         f'{chunk} * {vec} + v]')
    emit(f'{i6}for q in T.unroll({rl}):')
    emit(f'{i6}    for v in T.vectorized({vec}):')
    emit(f'{i6}        wq[q * {vec} + v] = {wbuf}[(({chunk} * {rl} + q) * {rg_n} + {rg}) * {vec} '
         '+ v]')
    emit(f'{i6}for q in T.unroll({rl}):')
    emit(f'{i6}    for s in T.unroll({snl}):')
    emit(f'{i6}        for v in T.unroll({vec}):')
    emit(f'{i6}            pacc[q * {snl} + s] = pacc[q * {snl} + s] + '
         f'T.Cast("float32", wq[q * {vec} + v]) * xv[s * {vec} + v]')
    # the warps' sums where x was: [Wn, SN, 8*RL + 1]
    emit(f'{i5}T.tvm_storage_sync("shared.dyn")')
    emit(f'{i5}for q in T.unroll({rl}):')
    emit(f'{i5}    for s in T.unroll({snl}):')
    emit(f'{i5}        hs[(warp * {sn} + s * {planner.X_GROUPS} + {xg}) * {rp} + {rg} * {rl} + q] '
         f'= pacc[q * {snl} + s]')
    emit(f'{i5}T.tvm_storage_sync("shared.dyn")')
    outs = r_ * sn
    o = _block_loop(emit, i5, outs, threads, unroll=True)
    n, row = f"({o} // {r_})", f"({o} % {r_})"
    mm = f"(m0 * {sn} + {n})"
    j = f"({blk} * {u_} + {row} % {u_})"
    out = f"{row} // {u_} * {h} + {j}"
    cond = f"{j} < {h} and {mm} < {rows}" + (f" and {o} < {outs}" if outs % threads else "")
    guard(i5 + "    ", cond)
    i7 = i5 + "            "
    target = f"xp[{mm} // {n_}, {nb}{mm} % {n_}, {out}]"
    start = f'T.Cast("float32", b_ih[{out}])'
    if p.input_slab:  # later slabs add to what the earlier ones wrote
        start = f"T.if_then_else(sl == 0, {start}, {target})"
    emit(f'{i7}xs[0] = {start}')
    emit(f'{i7}for w in T.unroll({wn}):')
    emit(f'{i7}    xs[0] = xs[0] + hs[(w * {sn} + {n}) * {rp} + {row}]')
    emit(f'{i7}{target} = xs[0]')
    # the next group's rows go where these sums were; the time loop reads xp
    emit(f'{i5}T.tvm_storage_sync("shared.dyn")')


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
                                   SHFL=SHFL_SOURCE, LDCG=LDCG_SOURCE,
                                   GRID_LOAD_SRC=GRID_LOAD_SOURCE,
                                   GRID_STORE_SRC=GRID_STORE_SOURCE,
                                   GRID_WAIT_SRC=GRID_WAIT_SOURCE)
