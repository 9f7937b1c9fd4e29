"""Stage: the exchange of h between blocks, and the barrier that orders it.

Each step a block needs every block's h_{t-1} [N, H] (all of its batch group's), staged in
shared memory as the product stage wants it (its ``store_h``). Five variants (the plan's
``sync``):

- ``"tagged"``: h travels as 8-byte words, the value and the step that wrote it. A thread
  issues :data:`WAIT_BATCH` loads (acquire or relaxed: ``Plan.tagged_loads``), then its warp
  re-reads, as one, the words whose tag is not yet the step's (:func:`.device.wait_tagged`):
  no separate barrier, and a step costs about one L2 round trip of communication (data and
  flag in one store, as NCCL's low-latency protocol does).
- ``"barrier"``: rnncc's counter barrier, one counter a batch group: after a block barrier
  (every h_t stored), thread 0 arrives (a release) and waits for the group's count (an
  acquire); then the block reads h past L1.
- ``"grid"``: cooperative groups' grid sync (the whole grid), then as ``"barrier"``.
- ``"local"``: a batch group of one block (planner: "One block a group") keeps h to itself:
  each h_t goes to shared memory ``hn`` as staging wants it (the products' ``store_h``, zero
  where none is published), and after a block barrier the next step's products read it
  there (CUDA cores) or its staging copies it in 16-byte vectors (tensor cores); no global
  memory, no other block. The values of a step's rounds go through global memory as with
  the barrier, ordered by the block barrier alone.
- ``"cluster"``: a batch group of 2 to 16 blocks is a thread-block cluster (planner: "A
  cluster a group"): each h_t goes into ``hn`` of every block of the cluster, slot (t + 1) %
  2, by asynchronous stores that count their bytes on that block's barrier of the slot
  (``cb``); the next step waits for the barrier's phase and its products read h there (CUDA
  cores). Steps of one product of h only (no rounds).

With the barriers where the planner says so (on tensor cores in 16 bits:
:func:`..planner.publishes_staged_h`), a block publishes each h_t it computes a second time,
where the staging of the next step will want it (``hx``: the group's staged h, in the
products' order and type, by their ``store_h``), so that staging is a copy of 16-byte vectors
(asynchronous, past L1, no index arithmetic, half the bytes of float32): staging element by
element cost more than the products at batch 32 and 5-6 warps (GRU 1024 at batch 64, 2 groups
of 32 rows: 330 million instructions, three quarters of them indexing). The elements no block
publishes (rows past the batch of whole tensor-core tiles, k past K) are zeroed once by each
group's first block; step 0 stages h0 from the states' buffer, element by element, as the
other plans stage every step. The backward kernel's ``hx`` is all zeros before its launch
(dGH after the last step is zero; the entry zeroes it), so it copies every step, its step 0
too, and, in slices of K (planner: "Slices of K"), one slice while it multiplies another
(:func:`copy_slice`).

Between arriving and waiting the block may work on what needs no other block (the overlapped
input projection): ``arrive`` and ``wait``; with nothing between, ``arrive_and_wait``. Block
barriers are TVM storage syncs, which TVM's barrier insertion counts (with ``T.cuda.cta_sync``,
opaque to it, it added barriers of its own: 8 a step where 4 are needed).
"""

from __future__ import annotations

import functools
from functools import partial

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .. import device

#: Tag of the slot that holds no step yet (steps count from 0 and stay below it).
EMPTY_TAG = 0x7FFFFFFF
#: Words of h a thread loads before it waits on their tags.
WAIT_BATCH = 8


def _row(spec, row) -> tuple[int, int]:
    """(KP, K) of an exchanged vector's batch row: h's (``spec.width`` words, K =
    ``spec.exchange_width`` of them exchanged), or ``row`` words (a round's sums, one a
    block: :mod:`.means`)."""
    return (spec.width, spec.exchange_width) if row is None else (row, row)


def _tagged_word(spec, hw, t, bx, e, row=None):
    """Address of element e = n*KP + k of the block's group's h_{t-1} in the tagged words
    (clamped into the group's words where e is past them)."""
    kp, h = _row(spec, row)
    n_ = spec.local_batch
    return T.address_of(hw[t % 2, spec.state_row(bx, T.min(e // kp, n_ - 1)),
                           T.min(e % kp, h - 1)])


def _behind(tv, count: int, step):
    """Whether any of the first ``count`` words in ``tv`` has a tag other than ``step``."""
    tags = [T.shift_right(tv[i], T.uint64(32)) != T.Cast("uint64", step) for i in range(count)]
    return functools.reduce(tirx.Or, tags)


def _tagged_batches(spec, arrays: int, row=None) -> tuple[int, int]:
    """(words of each of ``arrays`` arrays a thread loads in a batch, batches): at most
    :data:`WAIT_BATCH` words of all of them in flight."""
    per_thread = -(-spec.local_batch * _row(spec, row)[0] // spec.plan.threads)
    count = max(1, min(per_thread, WAIT_BATCH // arrays))
    return count, -(-per_thread // count)


@T.macro
def _load_words(spec, hw, tv, offset, count, bi, t, bx, tx, row=None):
    kp, h = T.meta_var(_row(spec, row))
    total, threads = T.meta_var((spec.local_batch * kp, spec.plan.threads))
    for i in T.unroll(count):
        e = T.meta_var((bi * count + i) * threads + tx)
        tv[offset + i] = T.if_then_else(
            e < total and e % kp < h, device.load_tagged(_tagged_word(spec, hw, t, bx, e, row),
                                                       spec.plan.tagged_loads),
            T.shift_left(T.Cast("uint64", t), T.uint64(32)))


@T.macro
def _wait_words(spec, hw, tv, offset, count, bi, t, bx, tx, row=None):
    threads = T.meta_var(spec.plan.threads)
    for i in T.unroll(count):
        e = T.meta_var((bi * count + i) * threads + tx)
        tv[offset + i] = device.wait_tagged(_tagged_word(spec, hw, t, bx, e, row),
                                            tv[offset + i], T.Cast("uint64", t),
                                            spec.plan.tagged_loads)


@T.macro
def _store_words(spec, tv, offset, count, store, bi, tx, row=None):
    total, threads = T.meta_var((spec.local_batch * _row(spec, row)[0], spec.plan.threads))
    for i in T.unroll(count):
        e = T.meta_var((bi * count + i) * threads + tx)
        if e < total:
            store(e, T.reinterpret("float32", T.Cast("uint32", T.bitwise_and(
                tv[offset + i], T.uint64(0xFFFFFFFF)))))


def _each_array(macro, spec, arrays, tv, count, *args):
    """``macro`` on each of ``arrays``, with its words' place in ``tv``."""
    for a, array in enumerate(arrays):
        macro(spec, array, tv, a * count, count, *args)


def _each_store(spec, tv, count, stores, bi, tx, row):
    for a, store in enumerate(stores):
        _store_words(spec, tv, a * count, count, store, bi, tx, row)


@T.macro
def _stage_tagged(spec, arrays, tv, stores, t, bx, tx, row=None):
    """Step t-1's vectors of the tagged words ``arrays`` (h_{t-1}, or the values of a round),
    ``stores[a](e, value)`` for element e of array a: a batch's loads of all of them first;
    then, where a tag is behind in any lane of the warp, the warp waits as one (every lane
    calls the wait: no lane waits in a branch of its own). A round's several vectors so take
    one L2 round trip a batch, not one each."""
    count, batches = T.meta_var(_tagged_batches(spec, len(arrays), row))
    for bi in range(batches):
        _each_array(_load_words, spec, arrays, tv, count, bi, t, bx, tx, row)
        if device.any_in_warp(T.Cast("int32", _behind(tv, count * len(arrays), t))) != 0:
            _each_array(_wait_words, spec, arrays, tv, count, bi, t, bx, tx, row)
        _each_store(spec, tv, count, stores, bi, tx, row)


@T.macro
def _stage_plain_element(spec, s0, store, t, bx, e, row=None):
    kp, h = T.meta_var(_row(spec, row))
    store(e, T.if_then_else(e % kp < h, device.load_past_l1(T.address_of(s0[
        t % 2, spec.state_row(bx, e // kp), T.min(e % kp, h - 1)])), T.float32(0)))


def _each_plain_element(spec, arrays, stores, t, bx, e, row):
    for s0, store in zip(arrays, stores):
        _stage_plain_element(spec, s0, store, t, bx, e, row)


@T.macro
def _stage_plain(spec, arrays, stores, t, bx, tx, row=None):
    """h_{t-1} (or a round's vectors, ``arrays``) as the other blocks stored it before the
    barrier, read past L1: whole rounds of the block's threads, each loading every array's
    element, then the rest under a guard (a guard in every round kept the compiler from
    batching the loads: each waited on L2 in turn, 4.5x slower at 6 warps)."""
    threads = T.meta_var(spec.plan.threads)
    full, rest = T.meta_var(divmod(spec.local_batch * _row(spec, row)[0], spec.plan.threads))
    for e in T.serial(0, full):
        _each_plain_element(spec, arrays, stores, t, bx, e * threads + tx, row)
    if rest > 0:
        if tx < rest:
            _each_plain_element(spec, arrays, stores, t, bx, full * threads + tx, row)


def _per_copy(buffer) -> int:
    """Elements of ``buffer`` in 16 bytes."""
    return 128 // tvm.DataType(buffer.dtype).bits


def _published_at(spec, t, bx):
    """Where the block's group's h_{t-1} (slot t % 2) starts in ``hx``."""
    return (t % 2 * spec.replicas + spec.group_of(bx)) * spec.staged_size


@T.macro
def _start_copies(spec, hx, staged, source, target, size, tx):
    """Start copying ``size`` elements from ``hx`` at ``source`` into ``staged`` at
    ``target``, 16 bytes a copy, spread over the block's threads."""
    threads = T.meta_var(spec.plan.threads)
    per = T.meta_var(_per_copy(staged))
    full, rest = T.meta_var(divmod(size // per, threads))
    for e in T.serial(0, full):
        device.copy_async(T.address_of(staged[target + (e * threads + tx) * per]),
                          T.address_of(hx[source + (e * threads + tx) * per]), 16)
    if rest > 0:
        if tx < rest:
            device.copy_async(T.address_of(staged[target + (full * threads + tx) * per]),
                              T.address_of(hx[source + (full * threads + tx) * per]), 16)


@T.macro
def stage_copied(spec, hx, staged, t, bx, tx):
    """h_{t-1} from ``hx`` (slot t % 2, the block's group) into ``staged``, 16 bytes a copy;
    the thread waits for its copies (a block barrier must follow). The backward kernel stages
    so every step (its step 0 copies the zeros ``hx`` holds before the launch)."""
    _start_copies(spec, hx, staged, _published_at(spec, t, bx), 0, spec.staged_size, tx)
    device.wait_copies()


@T.macro
def copy_slice(spec, hx, staged, t, sl, bx, tx):
    """Start copying slice ``sl`` of h_{t-1} (planner: "Slices of K"; ``hx`` holds it in the
    slices' order) into slot sl % 2 of ``staged`` (two slices); the thread waits for its
    copies (``device.wait_copies``) and a block barrier follows before the slice is read."""
    size = T.meta_var(spec.slice_size)
    _start_copies(spec, hx, staged, _published_at(spec, t, bx) + sl * size, sl % 2 * size,
                  size, tx)


def _in_slice(spec, sl, e):
    """Element e = n*W + i of slice ``sl`` (W = KQ*CL*32*VEC: a row's k in the slice, its
    parts' chunks one after another; planner: "Slices of K") as n*KP + k."""
    p, width = spec.plan, spec.slice_width
    part = width // p.k_parts
    return (e // width * spec.width
            + (e % width // part * p.warp_chunks + sl * p.slice_chunks) * 32 * p.vec + e % part)


@T.macro
def _stage_slice(spec, s0, store, sl, bx, tx):
    """Slice ``sl`` of h_0 from the states' buffer, element by element: ``store(e, value)``
    for e = n*KP + k (zero past K)."""
    threads = T.meta_var(spec.plan.threads)
    full, rest = T.meta_var(divmod(spec.local_batch * spec.slice_width, threads))
    for e in T.serial(0, full):
        _stage_plain_element(spec, s0, store, 0, bx, _in_slice(spec, sl, e * threads + tx))
    if rest > 0:
        if tx < rest:
            _stage_plain_element(spec, s0, store, 0, bx, _in_slice(spec, sl, full * threads + tx))


@T.macro
def start_slice(spec, s0, hx, staged, store_at, t, sl, bx, tx):
    """Start staging slice ``sl`` of h_{t-1} into half sl % 2 of ``staged`` (the forward's,
    planner: "Slices of K"): at step 0 from h_0 in the states' buffer ``s0``, element by
    element (``store_at(base, e, value)``: the products' ``store_h``), after it copied from
    ``hx`` (:func:`copy_slice`)."""
    if t == 0:
        _stage_slice(spec, s0, partial(store_at, (sl % 2 - sl) * spec.slice_size), sl, bx, tx)
    else:
        copy_slice(spec, hx, staged, t, sl, bx, tx)


@T.macro
def copy_local(spec, hn, staged, tx):
    """The ``"local"`` exchange's h_{t-1}: ``hn`` into ``staged``, 16-byte vectors spread over
    the block's threads (a block barrier must follow)."""
    per = T.meta_var(_per_copy(staged))
    count = T.meta_var(spec.staged_size // per)
    for i in spec.spread(count):
        if i * spec.plan.threads + tx < count:
            for v in T.vectorized(per):
                staged[(i * spec.plan.threads + tx) * per + v] = hn[
                    (i * spec.plan.threads + tx) * per + v]


@T.macro
def init_local(spec, s0, hn, store, bx, tx):
    """Once, before the time loop, the ``"local"`` exchange's ``hn``: on the CUDA cores, whose
    products read h where the cell leaves it (:attr:`.spec.KernelSpec.reads_hn`), h_0 from
    the states' buffer ``s0`` (``store(e, value)``: the products' ``store_h`` into ``hn``;
    the backward kernel's dGH after the last step: zeros, ``s0`` None); on tensor cores zeros
    (what no h_t takes stays so; staging copies ``hn`` from step 1 on). Then a block barrier:
    the first step reads what other threads wrote."""
    if spec.reads_hn and s0 is not None:
        _stage_plain(spec, [s0], [store], 0, bx, tx)
    else:
        for i in spec.spread(spec.staged_size):
            if i * spec.plan.threads + tx < spec.staged_size:
                hn[i * spec.plan.threads + tx] = T.Cast(hn.dtype, 0)
    T.tvm_storage_sync("shared.dyn")


@T.macro
def stage_h(spec, s0, hw, tv, store, t, bx, tx, hx=None, staged=None, hn=None):
    """Stage h_{t-1} (the exchanged vector of K = ``spec.exchange_width``): ``store(e, value)``
    for element e = n*KP + k (zero past K); with the published h ``hx`` (or the ``"local"``
    exchange's ``hn``), after step 0 a copy of it into ``staged``."""
    if spec.tagged:
        _stage_tagged(spec, [hw], tv, [store], t, bx, tx)
    elif hx is None and hn is None:
        _stage_plain(spec, [s0], [store], t, bx, tx)
    else:
        if t == 0:
            _stage_plain(spec, [s0], [store], t, bx, tx)
        elif hn is not None:
            copy_local(spec, hn, staged, tx)
        else:
            stage_copied(spec, hx, staged, t, bx, tx)


def published_by(spec, products, hx, hn, cb=None):
    """Where a block's h_t goes for the next step's staging besides the states' buffer, as
    ``published(base, e, value)`` (the products' ``store_h``): ``hx``, the ``"local"``
    exchange's ``hn``, every block of the cluster's ``hn`` (``cb``: their barriers), or
    nowhere (None)."""
    if hx is not None:
        return partial(products.store_h, spec, hx)
    if spec.cluster:
        return partial(_put_cluster, spec, hn, cb)
    return partial(products.store_h, spec, hn) if spec.local else None


@T.macro
def _put_cluster(spec, hn, cb, base, e, value):
    """Element e = n*KP + k of h_t into slot ``base`` of ``hn`` of every block of the
    cluster, its bytes counted on that block's barrier of the slot."""
    for c in T.unroll(spec.cluster_blocks):
        device.cluster_put(T.address_of(hn[base + e]), T.address_of(cb[base // spec.staged_size]),
                           T.uint32(c), value)


@T.macro
def init_cluster(spec, s0, hn, cb, store, bx, tx):
    """Once, before the time loop, the ``"cluster"`` exchange (planner: "A cluster a group"):
    h_0 into slot 0 of ``hn`` from the states' buffer ``s0`` (``store(e, value)``: the
    products' ``store_h``), the k past K of slot 1 zero (no block puts them), the slots'
    barriers ``cb`` initialised (an arrival a phase: the block's own, which expects the
    phase's bytes), all made visible to the cluster's asynchronous stores, and the cluster
    synchronised: no block puts h into another that has not started."""
    _stage_plain(spec, [s0], [store], 0, bx, tx)
    kp, h, size = T.meta_var((spec.width, spec.exchange_width, spec.staged_size))
    if kp > h:
        for i in spec.spread(size):
            if i * spec.plan.threads + tx < size:
                if (i * spec.plan.threads + tx) % kp >= h:
                    hn[size + i * spec.plan.threads + tx] = T.float32(0)
    if tx == 0:
        for slot in T.unroll(2):
            T.ptx.mbarrier.init.shared.b64(T.address_of(cb[slot]), 1)
    device.fence_cluster_init()
    T.tvm_storage_sync("shared")
    device.cluster_sync()


def cluster_bytes_a_step(spec) -> int:
    """Bytes of h a block receives a step: every unit of every row of its group."""
    return spec.exchange_width * spec.local_batch * 4


@T.macro
def wait_cluster(spec, cb, t, tx):
    """Before step t's products: h_{t-1} in, the phase (t - 1) // 2 of slot t % 2's barrier
    (from step 1; h_0 is the block's own); then thread 0 expects step t's h on slot (t + 1) %
    2's (whose previous phase, h_{t-2}, the block waited for at step t - 1)."""
    if t > 0:
        device.cluster_wait(T.address_of(cb[t % 2]), T.Cast("int32", (t - 1) // 2 % 2))
    if tx == 0:
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(cb[(t + 1) % 2]),
                                                   cluster_bytes_a_step(spec))


@T.macro
def drain_cluster(spec, cb, t_len):
    """After the last step: the other blocks' h_{T-1} in (no block exits while another still
    puts into its shared memory)."""
    if t_len > 0:
        device.cluster_wait(T.address_of(cb[t_len % 2]), T.Cast("int32", (t_len - 1) // 2 % 2))


@T.macro
def zero_unpublished(spec, published, bx, tx):
    """Once, before the first barrier: the elements of the published h that no block
    publishes (rows past N/NG, k past K) zero in both slots of the block's group, by its
    first block; ``published(base, e, value)``: the products' ``store_h`` into ``hx``."""
    rows, kp, n_, h = T.meta_var((spec.staged_rows, spec.width, spec.local_batch,
                                  spec.exchange_width))
    size, threads = T.meta_var((spec.staged_size, spec.plan.threads))
    if rows > n_ or kp > h:
        if spec.place(bx) == 0:
            for slot in T.unroll(2):
                for i in spec.spread(size):
                    e = T.meta_var(i * threads + tx)
                    if e < size and (e // kp >= n_ or e % kp >= h):
                        published((slot * spec.replicas + spec.group_of(bx)) * size, e,
                                  T.float32(0))


@T.macro
def publish_tagged(hw, t, value, row, j):
    """``value`` of unit j, batch row ``row``, as the tagged word of step t + 1."""
    device.store_tagged(T.address_of(hw[(t + 1) % 2, row, j]), T.bitwise_or(
        T.shift_left(T.Cast("uint64", t + 1), T.uint64(32)),
        T.Cast("uint64", device.float_bits(value))))


@T.macro
def publish(spec, s0, hw, t, value, row, j, published=None):
    """h_t of unit j (element j of the exchanged vector), batch row ``row``: into the states'
    buffer (the final state, and what step 0 of the barrier variants reads), and, tagged, as
    the word of step t + 1, or where the next step's staging copies it from (``published(base,
    e, value)``: the products' ``store_h`` into the published h; the backward kernel's, which
    stages every step from there, has no ``s0``)."""
    if s0 is not None:
        s0[(t + 1) % 2, row, j] = value
    if spec.tagged:
        publish_tagged(hw, t, value, row, j)
    elif published is not None:  # the next staging's: in hx, or the "local" exchange's hn
        n_ = T.meta_var(spec.local_batch)
        if spec.cluster:  # the cluster's hn, slot (t + 1) % 2
            published((t + 1) % 2 * spec.staged_size, row % n_ * spec.width + j, value)
        else:
            published(0 if spec.local else ((t + 1) % 2 * spec.replicas + row // n_)
                      * spec.staged_size, row % n_ * spec.width + j, value)


@T.macro
def arrive(spec, cnt, bx, tx):
    """After the cell: a block barrier (the cell has read the sums, every h_t is stored), then,
    with the counter barrier, thread 0's arrival."""
    T.tvm_storage_sync("shared.dyn")
    if spec.plan.sync == "barrier":
        if tx == 0:
            device.arrive(T.address_of(cnt[spec.group_of(bx)]))


@T.macro
def wait(spec, cnt, t, bx, tx):
    """Every block of the group has h_t out: the tagged exchange waits in the next step's
    staging, and the ``"local"`` one has (a block barrier here only, after the work between
    arriving and waiting); the barriers wait, then the block for thread 0."""
    if spec.plan.sync in ("tagged", "local", "cluster"):
        T.tvm_storage_sync("shared.dyn")
    elif spec.plan.sync == "grid":
        T.cuda.grid_sync()
    elif spec.plan.sync == "barrier":
        if tx == 0:
            device.wait_count(T.address_of(cnt[spec.group_of(bx)]),
                              T.Cast("uint32", spec.arrivals(t)))
        T.tvm_storage_sync("shared.dyn")


@T.macro
def arrive_and_wait(spec, cnt, t, bx, tx):
    """:func:`arrive` then :func:`wait` with nothing between (thread 0 of the counter barrier
    arrives and waits under one branch)."""
    if spec.plan.sync == "barrier":
        T.tvm_storage_sync("shared.dyn")
        if tx == 0:
            device.arrive(T.address_of(cnt[spec.group_of(bx)]))
            device.wait_count(T.address_of(cnt[spec.group_of(bx)]),
                              T.Cast("uint32", spec.arrivals(t)))
        T.tvm_storage_sync("shared.dyn")
    else:
        wait(spec, cnt, t, bx, tx)


@T.macro
def publish_value(spec, aw, t, value, row, j):
    """The value of unit j, batch row ``row``, that step t's recurrent product takes
    (:mod:`.cell`): tagged as h is, or plain for the barriers."""
    if spec.tagged:
        publish_tagged(aw, t, value, row, j)
    else:
        aw[(t + 1) % 2, row, j] = value


@T.macro
def value_barrier(spec, cnt, t, r, bx, tx):
    """Every block's value of step t's round r is out (:func:`publish_value`): a block
    barrier (the sums are read), then the barrier variants' wait, a round of the counter."""
    T.tvm_storage_sync("shared.dyn")
    if spec.plan.sync == "grid":
        T.cuda.grid_sync()
    elif spec.plan.sync == "barrier":
        if tx == 0:
            device.arrive(T.address_of(cnt[spec.group_of(bx)]))
            device.wait_count(T.address_of(cnt[spec.group_of(bx)]),
                              T.Cast("uint32", spec.arrivals(t, value=r)))
        T.tvm_storage_sync("shared.dyn")


def stage_values(spec, arrays, tv, stores, t, bx, tx, row=None):
    """Stage the values of step t of ``arrays`` (each :func:`publish_value`'s) as
    :func:`stage_h` stages h, ``stores[a](e, value)`` for array a, in one pass: tagged, a batch
    of loads of all of them before any wait; plain, each round of the threads loading all."""
    if spec.tagged:
        for first in range(0, len(arrays), WAIT_BATCH):  # a word of each in flight at least
            _stage_tagged(spec, arrays[first:first + WAIT_BATCH], tv,
                          stores[first:first + WAIT_BATCH], t + 1, bx, tx, row)
    else:
        _stage_plain(spec, arrays, stores, t + 1, bx, tx, row)
