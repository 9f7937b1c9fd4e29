"""The persistent kernel's CUDA device functions (inline PTX and intrinsics TVM does not emit),
and the calls that stages make to them.

TVM emits a device function's source once for each name called (``T.cuda.func_call`` with
``source_code``). Every function that waits on another block starts with
:data:`COOPERATIVE_PREFIX`: rnncc's TIR pipeline (:mod:`rnncc.compiler.pipeline`) launches a
kernel that calls one cooperatively, so that all its blocks are resident. Every wait is bounded
(:data:`WAIT_LIMIT_CYCLES`): past it the kernel traps, and a fault shows up as a failed launch
with an error, never as a hang.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .._tma import CLUSTER_SYNC, CLUSTER_SYNC_SOURCE

#: Names of the device functions that wait on other blocks (or publish for them) start so.
COOPERATIVE_PREFIX = "rnncc_grid_"
ARRIVE = COOPERATIVE_PREFIX + "arrive"
BARRIER = COOPERATIVE_PREFIX + "barrier"
GRID_LOAD = COOPERATIVE_PREFIX + "load"
GRID_STORE = COOPERATIVE_PREFIX + "store"
GRID_WAIT = COOPERATIVE_PREFIX + "wait"

#: GPU clock cycles a block waits on another before it gives up (__trap: the launch fails with
#: an error instead of hanging; a healthy step waits microseconds).
WAIT_LIMIT_CYCLES = 1 << 34


def _strong_load(name: str, ctype: str, bits: int, order: str, ordering: bool = False) -> str:
    """A device function ``name(address)``: a strong load at GPU scope, ``order`` "acquire"
    (``ld.acquire.gpu``: on sm_90 the load, then an invalidation of the whole L1, which the
    load waits for) or "relaxed" (``ld.relaxed.gpu``: the load alone, from L2). ``ordering``:
    the compiler may not move other memory accesses across it (a barrier's wait, whose loads
    of h come after); a tagged word carries its data, so its loads need no such clobber."""
    reg = "r" if bits == 32 else "l"
    clobber = ' : "memory"' if ordering else ""
    return (f"__device__ __forceinline__ {ctype} {name}(const {ctype}* address) {{\n"
            f"  {ctype} value;\n"
            f'  asm volatile("ld.{order}.gpu.global.u{bits} %0, [%1];" : "={reg}"(value) : '
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
__device__ __forceinline__ void {ARRIVE}(unsigned int* counter) {{
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}}
"""
BARRIER_SOURCE = "\n" + _strong_load("rnncc_acquire_u32", "unsigned int", 32, "acquire",
                                       True) + f"""\
__device__ __forceinline__ void {BARRIER}(unsigned int* counter, unsigned int target) {{
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

#: The tagged exchange's loads, by the plan's :attr:`..planner.Plan.tagged_loads`: acquire
#: loads (:func:`_strong_load`), or relaxed loads where the block reads input projections it
#: wrote itself (a fused input projection, every layer of a wavefront). A word carries its
#: value, so nothing after it needs ordering; an acquire also invalidates the whole L1 (which
#: the load waits for), and with it the block's own projections, read again every step.
#: History: plain volatile loads deadlocked about once in 10 to 100 runs of 37 steps (float16
#: tanh and relu RNNs, H=33, N=7, 9 blocks on an H200) and acquire loads were taken (600 runs
#: passed); the cause found later was a wait spun by single lanes (below). With the warp
#: waiting as one, relaxed loads passed 4000 runs of each of those two plans, and 1000 runs of
#: LSTM 512 at batch 1 and 4, two layers as a wavefront, and LSTM 40 -> 132 at batch 33 both
#: directions, each run repeating the first exactly (H200, fiftieth session).
TAGGED_LOADS = ("acquire", "relaxed")

# TVM emits a device function's source once a called name, so the wait (a separate call) has
# its own copy of the load under a private name. A warp waits as one: every lane calls the
# wait with the word it loaded, and while any lane's tag is behind (``__any_sync``) each such
# lane reloads. A wait spun only by the lanes whose tag was behind, in a branch of their own,
# let those lanes fall behind their block: on an H200 (LSTM 40 -> 132, batch 33, both
# directions, 132 blocks) lanes spun on step 4 while the rest of their block went on past its
# block barriers to the last step, and the launch trapped in nearly every process
# (docs/benchmarks.md, forty-fifth session).


def _tagged_sources(order: str) -> tuple:
    """(load name, its source, wait name, its source) of the tagged exchange with ``order``
    loads (the acquire ones keep the names they always had)."""
    if order not in TAGGED_LOADS:
        raise ValueError(f"tagged loads are one of {TAGGED_LOADS}, got {order!r}")
    suffix = "" if order == "acquire" else "_" + order
    load, wait, private = GRID_LOAD + suffix, GRID_WAIT + suffix, f"rnncc_{order}_u64"
    return load, _strong_load(load, "uint64_t", 64, order), wait, _strong_load(
        private, "uint64_t", 64, order) + f"""
__device__ __forceinline__ uint64_t {wait}(const uint64_t* address, uint64_t value,
                                               uint64_t step) {{
  if (__any_sync(0xffffffffu, (value >> 32) != step)) {{
    long long start = clock64();
    do {{
      uint64_t fresh = {private}(address);
      value = (value >> 32) != step ? fresh : value;
      if (clock64() - start > {WAIT_LIMIT_CYCLES}LL) {{ __trap(); }}
    }} while (__any_sync(0xffffffffu, (value >> 32) != step));
  }}
  return value;
}}
"""


LDCG_SOURCE = """
__device__ __forceinline__ float rnncc_ldcg(const float* address) {
  return __ldcg(address);
}
"""

# An asynchronous copy of 16 bytes from global to shared memory (``cp.async``, sm_80+, past
# L1): zeros where ``bytes`` is 0 (then nothing is read). The overlapped input projection
# copies the next slab's x while the step runs, so its slab does not wait on memory; the
# barrier variants of the exchange copy h as the blocks published it.
CP_ASYNC_SOURCE = """
__device__ __forceinline__ void rnncc_cp_async(void* shared, const void* global, int bytes) {
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


def arrive(counter):
    """Count this block in at the barrier ``counter`` (a release: call it from one thread,
    after a block barrier that follows the block's stores)."""
    return T.cuda.func_call(ARRIVE, counter, source_code=ARRIVE_SOURCE)


def wait_count(counter, target):
    """Wait until the barrier ``counter`` reaches ``target`` (an acquire)."""
    return T.cuda.func_call(BARRIER, counter, target, source_code=BARRIER_SOURCE)


def load_tagged(address, order):
    """A load (``order``: one of :data:`TAGGED_LOADS`) of the tagged word at ``address``
    (uint64: the step's tag above the value's bits)."""
    name, source, _, _ = _tagged_sources(order)
    return T.cuda.func_call(name, address, source_code=source, return_type="uint64")


ANY_SOURCE = """
__device__ __forceinline__ int rnncc_any_in_warp(int predicate) {
  return __any_sync(0xffffffffu, predicate);
}
"""


def any_in_warp(predicate):
    """Whether ``predicate`` (int32) is nonzero in any lane of the warp (every lane calls it)."""
    return T.cuda.func_call("rnncc_any_in_warp", predicate, source_code=ANY_SOURCE,
                            return_type="int32")


def wait_tagged(address, word, step, order):
    """The tagged word at ``address`` once its tag is ``step`` (uint64), ``word`` as this lane
    loaded it (kept if its tag is ``step``): every lane of the warp calls it, and the warp
    waits as one, reloading with ``order`` loads."""
    _, _, name, source = _tagged_sources(order)
    return T.cuda.func_call(name, address, word, step, source_code=source,
                            return_type="uint64")


def store_tagged(address, word):
    """Store the tagged word ``word`` at ``address`` (one 8-byte store: data and tag)."""
    return T.cuda.func_call(GRID_STORE, address, word, source_code=GRID_STORE_SOURCE)


def float_bits(value):
    """The bits of float32 ``value`` as a uint32 (``__float_as_uint``: TVM's reinterpret of a
    constant, e.g. a value the simplifier folded to 0, took the constant's address in CUDA)."""
    return tirx.call_pure_extern("uint32", "__float_as_uint", value)


def load_past_l1(address):
    """A float32 load from L2 (``ld.global.cg``): what another block stored before a barrier."""
    return T.cuda.func_call("rnncc_ldcg", address, source_code=LDCG_SOURCE,
                            return_type="float32")


def shfl_xor(value, mask):
    """``value`` of the lane whose index differs from this lane's by the bits of ``mask``."""
    return T.cuda.func_call("rnncc_shfl_xor", value, mask, source_code=SHFL_SOURCE,
                            return_type="float32")


def copy_async(shared, source, size):
    """Start copying 16 bytes from ``source`` to ``shared`` (zeros where ``size`` is 0)."""
    return T.cuda.func_call("rnncc_cp_async", shared, source, size, source_code=CP_ASYNC_SOURCE)


def wait_copies():
    """This thread's asynchronous copies are complete (a block barrier must follow)."""
    return T.cuda.func_call("rnncc_cp_async_wait", source_code=CP_WAIT_SOURCE)


# The "cluster" exchange (:mod:`.stages.exchange`): a block's h_t goes straight into the shared
# memory of every block of its cluster, each value an asynchronous store that counts its bytes
# on the receiving block's barrier (``st.async ... mbarrier::complete_tx``: the order comes with
# the barrier's phase, no fence; a ``barrier.cluster`` with release semantics is a fence of the
# whole GPU, which waits for the step's global stores: H200, 8 blocks, 476 ns a step against 247
# relaxed). The names stay off COOPERATIVE_PREFIX: a cluster is resident as one by its launch.
CLUSTER_PUT = "rnncc_cluster_put"
CLUSTER_PUT_SOURCE = """
__device__ __forceinline__ void rnncc_cluster_put(void* at, void* bar, unsigned int cta,
                                                  float value) {
  unsigned int local = (unsigned int)__cvta_generic_to_shared(at);
  unsigned int local_bar = (unsigned int)__cvta_generic_to_shared(bar);
  unsigned int remote, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(cta));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar)
               : "r"(local_bar), "r"(cta));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(remote), "f"(value), "r"(remote_bar) : "memory");
}
"""
CLUSTER_WAIT = "rnncc_cluster_wait"
CLUSTER_WAIT_SOURCE = f"""
__device__ __forceinline__ void {CLUSTER_WAIT}(void* bar, int parity) {{
  unsigned int addr = (unsigned int)__cvta_generic_to_shared(bar);
  long long start = clock64();
  unsigned int done = 0;
  while (true) {{
    asm volatile("{{\\n.reg .pred p;\\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\\n"
                 "selp.u32 %0, 1, 0, p;\\n}}" : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    if (done) {{ break; }}
    if (clock64() - start > {WAIT_LIMIT_CYCLES}LL) {{ __trap(); }}
  }}
}}
"""


def cluster_put(at, bar, cta, value):
    """Store float32 ``value`` at ``at`` (an address in this block's shared memory) in block
    ``cta`` of the cluster, counting its 4 bytes on that block's barrier at ``bar``'s offset."""
    return T.cuda.func_call(CLUSTER_PUT, at, bar, cta, value, source_code=CLUSTER_PUT_SOURCE)


def cluster_wait(bar, parity):
    """Wait for the phase of parity ``parity`` of this block's barrier at ``bar``."""
    return T.cuda.func_call(CLUSTER_WAIT, bar, parity, source_code=CLUSTER_WAIT_SOURCE)


def cluster_sync():
    """Every block of the cluster has arrived (no memory order: what it orders is fenced for
    the cluster before it)."""
    return T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)


FENCE_CLUSTER_INIT_SOURCE = """
__device__ __forceinline__ void rnncc_fence_cluster_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
"""


def fence_cluster_init():
    """The block's barriers' initialisation visible to the cluster, and its stores to shared
    memory ordered before the asynchronous stores into it (once, before a cluster barrier)."""
    return T.cuda.func_call("rnncc_fence_cluster_init", source_code=FENCE_CLUSTER_INIT_SOURCE)
