"""The persistent plan of a layer under tuning knobs: the planner's decisions, in order.

:func:`plan_for` is what ``rnncc compile`` plans and ``rnncc tune`` searches over; it decides,
one named step after another:

0. a layer of 16-bit weights past :data:`HALF_MAX_BATCH` batch rows (both directions, a
   projection, or W_hh of more than :data:`HALF_GROUPS_MAX_WEIGHTS` bytes), or at it with
   W_hh of :data:`HALF_LARGE_WEIGHTS` bytes or more: none, unless knobs ask;
1. the products on tensor cores (:func:`tensor_cores`) where they apply, unless the knobs say
   no, or H is one chunk of theirs and the CUDA cores' plan fits on-chip
   (:func:`cuda_cores_first`): a plan of their own (the weights on-chip, the input projection
   a separate GEMM, h exchanged through the barrier: :data:`.planner.MMA_HALF_SYNC`); else
2. where the weights live (:func:`weights_on_chip`): on-chip with the register margin, else
   with none (ptxas then says whether it spills), else streamed in part from L2;
3. the knobs that only set a field (sync, unroll);
4. the input projection (:func:`input_projection`): forced overlapped, overlapped where it fits
   by default, fused before the time loop, or the separate GEMM;
5. with the separate GEMM, the batch groups, one row each where :func:`one_row_groups` says,
   and their blocks, at most a cluster's where :func:`cluster_groups` says;
6. the exchange of h, unless the knobs set it: within a cluster where a batch group is 2 to 16
   blocks (:func:`.planner.clusters`), else :func:`.planner.exchange` (where the input
   projection is overlapped, the tagged exchange on larger grids too);
7. a step's row means exchanged as each block's sums, unless the knobs say
   (:func:`block_sums`);
8. where no plan fits the batch N, all of this again for a padded batch, a few rows past N
   (:func:`padded_batches`; planner: "Padded batch").

Pure arithmetic on the planner's :class:`~.planner.Plan`; no TVM.
"""

from __future__ import annotations

import dataclasses

from rnncc.cells.autodiff import mean_levels, product_gates, trace
from rnncc.errors import ConfigError

from . import planner
from .planner import Plan, Unfit

#: The persistent kernel's knobs (what ``rnncc tune`` searches): the synchronisation variant,
#: a cap on the grid (so more hidden units a block), the warps a block, the registers kept
#: free under the limit (more moves weight chunks from registers to shared memory), the
#: unrolling of the loop over the weight chunks in shared memory, the rows of x a group of
#: the fused input projection before the time loop (0: the input projection is a separate
#: GEMM), the steps a group of the fused input projection overlapped with the time loop (0:
#: not overlapped), the batch groups (a divisor of N: the grid split into that many groups, a
#: slice of the batch each), the products on tensor cores, a step's row means exchanged
#: as each block's sums rather than its units' values (``mean_partials``), and at small K the
#: CUDA cores' chunks of 16 bytes over groups of lanes (``lane_groups``, the default) or
#: narrower chunks over all 32 (planner: "Small K on the CUDA cores").
KNOBS = ("sync", "max_blocks", "warps", "reg_margin", "unroll", "input_rows", "input_steps",
         "batch_groups", "mma", "mean_partials", "lane_groups")
SYNCS = ("tagged", "barrier", "grid", "local", "cluster")
WARPS = (4, 8, 16)

#: The persistent kernel computes its input projections itself by default (float32, where
#: shared memory holds W_ih or slabs of it) at C >= FUSE_MIN_INPUT and N <= FUSE_MAX_BATCH:
#: measured faster there than the separate GEMM (H200: LSTM 1024 N=1 2.43 -> 2.19 us/step,
#: N=4 3.94 -> 3.75), slower at C = 256-512 and at N = 8 (docs/benchmarks.md); the
#: ``input_rows`` knob decides elsewhere.
FUSE_MIN_INPUT = 1024
FUSE_MAX_BATCH = 4
#: ... and, where W_ih goes through W_hh's shared memory in slabs, at N <= FUSE_SLAB_MAX_BATCH
#: (H200: LSTM 1536 N=1 3.99 -> 3.59 us/step; N=4 6.99 -> 7.20, GRU 1024 N=4 in 2 batch groups
#: 3.38 -> 3.44).
FUSE_SLAB_MAX_BATCH = 1
#: ... and overlapped with the time loop (:func:`.planner.overlap_input`) where it fits,
#: W_hh's chunks moved to shared memory OVERLAP_ROOM registers at a time to make room (H200,
#: us/step, before the loop / overlapped: GRU 1024 N=4 3.33 / 3.06, LSTM 1024 N=4 3.61 / 3.30
#: with one chunk of W_hh moved, GRU 1024 N=1 2.02 / 1.86 and LSTM 1024 N=1 2.08 / 1.95 with
#: the counter barrier).
OVERLAP_ROOM = (0, 24, 48)
#: Both directions' input projections are overlapped with the time loop by default (float32,
#: where it fits and its blocks exchange h as tagged words; never before the loop) at C >=
#: BIDIR_OVERLAP_MIN_INPUT and N <= BIDIR_OVERLAP_MAX_BATCH, S*N rows a group the first of
#: BIDIR_OVERLAP_ROWS that fits with S >= MIN_STEPS: their GEMM before the launch is twice one
#: direction's, while each block's share of the overlapped one is what it is alone. H200, us a
#: step, the GEMM / overlapped (S*N rows, S): LSTM 512 batch 4 2.43 / 1.79 (8, 4), 2.21 (12,
#: 6), batch 2 1.63 / 1.42 (8, 8), 1.72 (12, 12), batch 1 1.48 / 1.35 (8, 8), 1.65 (12, 12),
#: batch 8 3.52 / 3.29 (32, 4), 3.73 (16, 2); GRU 512 batch 1 1.40 / 1.27 (8), 1.25 (16), 1.38
#: (32), batch 4 2.03 / 1.64 (16), 1.80 (32), batch 8 3.23 / 2.58 (16, 4); LSTM 448 batch 6
#: 3.09 / 2.44 (12, 4); LSTM 384 batch 4 1.75 / 1.58; GRU 384 batch 4 1.69 / 1.54; GRU 448
#: batch 8 3.21 / 2.52; GRU 768 batch 2 2.65 / 1.96; LSTM 576 batch 2 2.29 / 1.94; RNN 512
#: batch 4 1.25 / 1.01; RNN 1024 batch 4 2.45 / 1.90. All these exchange tagged words; those
#: with the barrier gained less or lost (LSTM 512 batch 4 in one group 2.21, LSTM 640 batch 3
#: 2.93 / 2.80, GRU 640 batch 5 3.21 / 3.48). At C = 256 it lost where it took fewer batch
#: groups (LSTM 256 batch 4 1.24 / 1.40) and won where it did not (GRU 256 batch 16 1.89 /
#: 1.61).
BIDIR_OVERLAP_MIN_INPUT, BIDIR_OVERLAP_MAX_BATCH = 384, 8
BIDIR_OVERLAP_ROWS, MIN_STEPS = (16, 8, 12), 4
#: A layer of 16-bit weights runs persistently by default past HALF_MAX_BATCH batch rows
#: (in batch groups) only in one direction, without a projection (neither measured), with W_hh
#: of at most HALF_GROUPS_MAX_WEIGHTS bytes: larger, one step's tensor-core GEMMs of the
#: non-persistent schedule, their slices of K filling the GPU, were as fast (H200, float16,
#: us a step, persistent / not, cuDNN: GRU 1024 N128 (6 MiB) 9.38 / 8.90 (9.19)). Below it
#: the batch groups won, on tensor cores through the barrier: LSTM 256 N256 4.20 / 16.93
#: (6.70), GRU 320 N256 4.96 / 19.02 (6.78), LSTM 448 N192 6.32 / 20.07 (7.49), GRU 512 N128
#: 4.29 / 11.44 (6.91), GRU 768 N256 11.29 / 14.14 (9.45), LSTM 768 N128 (4.5 MiB) 8.21 /
#: 8.89 (14.93), LSTM 512 N256 7.95 / 8.32 (8.32); and on the CUDA cores where H is one chunk
#: (:func:`cuda_cores_first`): GRU 64 N256 1.83 / 8.37 (1.50), LSTM 128 N128 2.69 / 6.04
#: (2.03), GRU 200 N128 3.46 / 10.59 (5.66). Knobs that ask for a plan still get one.
HALF_MAX_BATCH = 64
HALF_GROUPS_MAX_WEIGHTS = 9 << 19  # 4.5 MiB
#: At HALF_MAX_BATCH rows, a layer whose W_hh takes this many bytes or more is not persistent
#: by default either: its step holds W_hh in 128 blocks whose warps each read all of h from
#: shared memory, while one step's product on warpgroup MMA (one wave of slices of K) streams
#: it. H200, us a step, persistent / not (cuDNN): float16 LSTM 2048 N64 19.5 / 15.2 (15.7),
#: bfloat16 19.4 / 15.0 (16.4), float16 GRU 2048 N64 16.1 / 12.3 (13.2), LSTM 1536 N64 13.0 /
#: 11.3 (11.7); below it bfloat16 LSTM 1024 N64 6.6 / 8.2, and at N32 float16 LSTM 2048 11.3 /
#: 17.6, float16 GRU 1024 N48 5.1 / 7.3.
HALF_LARGE_WEIGHTS = 16 << 20
#: A batch with no plan of its own pads to one of up to max(N/8, PAD_MIN_ROWS) rows more
#: (:func:`padded_batches`): with N/8, 17 to 23 could take no more than 2 rows.
PAD_MIN_ROWS = 3


def check_knobs(knobs) -> dict:
    """``knobs`` as a dict, or a ConfigError naming the wrong one and what is allowed."""
    knobs = dict(knobs or {})
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ConfigError(f"unknown persistent knob(s) {unknown}; allowed: {list(KNOBS)}")
    if knobs.get("sync", "tagged") not in SYNCS:
        raise ConfigError(f"sync must be one of {list(SYNCS)}, got {knobs['sync']!r}")
    if knobs.get("warps", 8) not in WARPS or isinstance(knobs.get("warps"), bool):
        raise ConfigError(f"warps must be one of {list(WARPS)}, got {knobs['warps']!r}")
    for name in ("mma", "mean_partials", "lane_groups"):
        if not isinstance(knobs.get(name, False), bool):
            raise ConfigError(f"{name} must be true or false, got {knobs[name]!r}")
    for name, low in (("max_blocks", 1), ("reg_margin", 0), ("unroll", 1), ("input_rows", 0),
                      ("input_steps", 0), ("batch_groups", 1)):
        value = knobs.get(name, low)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 4096:
            raise ConfigError(f"{name} must be an integer from {low} to 4096, got {value!r}")
    if knobs.get("input_steps") and knobs.get("input_rows") is not None:
        raise ConfigError(f"input_rows={knobs['input_rows']} and input_steps="
                          f"{knobs['input_steps']}: give input_rows (the fused input projection "
                          "before the time loop, 0: the separate GEMM) or input_steps (fused and "
                          "overlapped with the time loop), not both")
    return knobs


def fuses_input(problem) -> bool:
    """Whether the persistent kernel computes its input projections itself by default
    (:func:`.planner.fuse_input`; both directions' only overlapped)."""
    if problem.dtype != "float32":
        return False
    if problem.directions > 1:
        return (problem.input_size >= BIDIR_OVERLAP_MIN_INPUT
                and problem.batch <= BIDIR_OVERLAP_MAX_BATCH)
    return problem.input_size >= FUSE_MIN_INPUT and problem.batch <= FUSE_MAX_BATCH


@dataclasses.dataclass(frozen=True)
class _Request:
    """A layer (an :class:`rnncc.spec.Problem`) to plan on ``gpu`` under ``knobs``."""

    problem: object
    gpu: planner.GPU
    knobs: dict

    def weights(self, margin: int, stream: bool = False, mma: bool = False,
                groups: int | None = None) -> Plan:
        """The planner's plan with ``margin`` registers kept free (``stream``: in part from
        L2; ``mma``: its products on tensor cores; ``groups``: batch groups, if not the
        knobs'), the knobs' fixed fields set."""
        p, k = self.problem, self.knobs
        found = planner.plan(p.gates, p.hidden_size, p.batch, p.dtype, self.gpu,
                             len(p.cell.states), max_blocks=k.get("max_blocks"),
                             reg_margin=margin, warps=k.get("warps"), stream=stream,
                             batch_groups=groups or k.get("batch_groups"),
                             directions=p.directions, layers=p.layers,
                             pair_regs=(2 * p.gates + len(p.cell.states) + len(p.cell.params)
                                        if p.cell.params else None), mma=mma,
                             # slices copy h as published after a barrier: not tagged
                             slices=mma and one_product(p.cell) and k.get("sync") != "tagged",
                             # a fused input projection asked for takes 16-byte chunks
                             narrow=not (k.get("input_rows") or k.get("input_steps")),
                             lane_groups=k.get("lane_groups", True))
        return dataclasses.replace(found, **{f: k[f] for f in ("sync", "unroll",
                                                                "mean_partials") if f in k})


def one_product(cell) -> bool:
    """Whether ``cell``'s step takes one recurrent product, of h, and no row means: its
    staging of h may go in slices of K (planner: "Slices of K")."""
    return not product_gates(trace(cell)) and not mean_levels(cell)


def plan_for(problem, gpu: planner.GPU, knobs: dict, reg_margin: int,
             tight: bool = True) -> Plan:
    """The persistent plan of ``problem`` on ``gpu`` (a planner GPU) under ``knobs``, or
    :class:`~.planner.Unfit` saying why there is none (see the module docstring for the
    order of the decisions). ``tight``: a configuration that does not fit with ``reg_margin``
    registers kept free may be planned with none. Where none fits the batch N, the plan of the
    first of :func:`padded_batches` that fits, its rows past N padding (planner: "Padded
    batch")."""
    try:
        return _plan_exact(problem, gpu, knobs, reg_margin, tight)
    except Unfit as err:
        for rows in padded_batches(problem, knobs):
            try:
                found = _plan_exact(dataclasses.replace(problem, batch=rows), gpu, knobs,
                                    reg_margin, tight)
            except Unfit:
                continue
            return dataclasses.replace(found, pad=rows - problem.batch)
        raise err


def padded_batches(problem, knobs: dict) -> range:
    """The batches past N that a plan may pad N to (planner: "Padded batch"), the smallest
    first: up to max(N/8, :data:`PAD_MIN_ROWS`) rows more, past :data:`.planner.MAX_BATCH`
    (below it every batch fits whole or not at all), for one direction of one layer at
    inference without a projection, where the knobs leave the batch groups open."""
    if (problem.batch <= planner.MAX_BATCH or problem.layers > 1 or problem.directions > 1
            or problem.training or problem.proj_size or "batch_groups" in knobs):
        return range(0)
    return range(problem.batch + 1, problem.batch + max(problem.batch // 8, PAD_MIN_ROWS) + 1)


def _plan_exact(problem, gpu: planner.GPU, knobs: dict, reg_margin: int,
                tight: bool = True) -> Plan:
    """:func:`plan_for` at the batch N itself."""
    if problem.dtype in ("float16", "bfloat16") and problem.layers == 1 and not knobs:
        weights = problem.gates * problem.hidden_size * (problem.proj_size
                                                         or problem.hidden_size) * 2
        past = f"batch {problem.batch} in {problem.dtype} is over {HALF_MAX_BATCH}"
        if problem.batch > HALF_MAX_BATCH and (problem.directions > 1 or problem.proj_size):
            raise Unfit(f"{past} "
                        + ("in two directions" if problem.directions > 1 else "with a projection")
                        + ": past it the batch groups run by default in one direction, without "
                        "a projection")
        if problem.batch > HALF_MAX_BATCH and weights > HALF_GROUPS_MAX_WEIGHTS:
            raise Unfit(f"{past} with W_hh of {weights / 2**20:.2f} MiB (over "
                        f"{HALF_GROUPS_MAX_WEIGHTS / 2**20:.1f}), where the non-persistent "
                        "schedule's tensor-core products are as fast")
        if (problem.batch == HALF_MAX_BATCH and problem.directions == 1
                and weights >= HALF_LARGE_WEIGHTS):
            raise Unfit(f"batch {problem.batch} in {problem.dtype} with W_hh of "
                        f"{weights / 2**20:.1f} MiB (at least {HALF_LARGE_WEIGHTS >> 20}): the "
                        "non-persistent schedule's tensor-core products are faster")
    request = _Request(problem, gpu, knobs)
    found = cuda_cores_first(request, reg_margin, tight)
    if found is None:
        tensor = tensor_cores(request, reg_margin, tight)
        if tensor is not None:
            return _clustered(request, tensor)
        found = weights_on_chip(request, reg_margin, tight)
    found = one_row_groups(request, input_projection(request, found))
    found = cluster_groups(request, found)
    if "sync" not in knobs:
        found = dataclasses.replace(found, sync="cluster" if _clusters(request, found)
                                    else planner.exchange(found, problem.batch))
    elif found.sync == "cluster":
        found = _clustered(request, found)
    elif found.sync == "local" and not planner.local_bytes(
            found, problem.batch // found.batch_groups):
        raise Unfit(f"sync='local' keeps h in one block: it takes a batch group of one block "
                    f"and h staged whole, got {found.group_blocks} blocks a group and "
                    f"{found.k_slices} slice(s) of K (give 'tagged', 'barrier' or 'grid', or "
                    "fewer blocks: max_blocks, batch_groups)")
    return block_sums(request, found)


def _clusters(request: _Request, found: Plan) -> bool:
    """Whether ``found`` may exchange h within clusters (:func:`.planner.clusters`, and a step
    of one product of h)."""
    return (planner.clusters(found, request.problem.batch, request.gpu)
            and one_product(request.problem.cell))


def _clustered(request: _Request, found: Plan) -> Plan:
    """``found``, or where its sync (a knob's) is "cluster" and it may not exchange h so,
    :class:`~.planner.Unfit` saying why."""
    if found.sync != "cluster" or _clusters(request, found):
        return found
    cell = request.problem.cell
    most = max(request.gpu.cluster, request.gpu.wide_cluster)
    raise Unfit(f"sync='cluster' exchanges h within a cluster of 2 to {most} "
                f"blocks (one a batch group, at most {planner.CLUSTER_MAX_BLOCKS} in all), on "
                f"the CUDA cores, for a step of one product of h, got {found.group_blocks} "
                f"blocks a group, {found.blocks} in all"
                + (" on tensor cores" if found.mma else "")
                + ("" if one_product(cell) else f", and {cell.name!r}, whose step exchanges "
                   "values before h"))


def block_sums(request: _Request, found: Plan) -> Plan:
    """``found`` with a step's row means exchanged as each block's sums (``mean_partials``,
    :mod:`.stages.means`) where the knobs leave it open and the cell takes means: on the CUDA
    cores, with h exchanged as tagged words, where a round's words of a batch group (its rows
    times H) are more than the block's threads load at once. There a block's sums cut the
    tagged loads of a round to one a thread; at one load a thread they only add the block's
    sums. H200, us a step, T 100, the units' values / the blocks' sums (benchmarks/ab.py):
    LN-LSTM 1024 at batch 1 5.35 / 4.93, 512 at 1, 2, 4 (4 groups) 4.53 / 4.02, 4.55 / 4.16,
    4.58 / 4.20, 384 at 1 4.24 / 3.92, 320 at 1 4.36 / 4.07; LN-GRU 1024 at 1 3.95 / 3.43, 512
    at 1, 2, 4 3.34 / 3.02, 3.47 / 3.04, 3.51 / 3.12, 384 at 1 3.40 / 2.93, 320 at 2 3.23 /
    2.84; float16 LN-GRU 512 3.44 / 2.99, bfloat16 LN-LSTM 512 at 4 4.55 / 4.15. At H 256 (one
    load a thread) they lost: LN-LSTM at 1, 4, 16 3.12 / 3.64, 3.19 / 3.77, 3.16 / 3.72, LN-GRU
    at 1 and 8 2.37 / 2.62, 2.56 / 2.91. Behind the counter barrier they moved both ways, so
    stay off there: LN-GRU 1024 at 4 5.73 / 5.59 and at 16 20.77 / 14.58 but at 8 and 12 8.61
    / 9.01, 10.64 / 11.76; LN-LSTM 1024 at 8 11.24 / 11.91, 768 at 1 4.85 / 5.21."""
    problem = request.problem
    if ("mean_partials" in request.knobs or found.mma or found.sync != "tagged"
            or not mean_levels(problem.cell)):
        return found
    words = problem.batch // found.batch_groups * problem.hidden_size
    return dataclasses.replace(found, mean_partials=words > found.threads)


def tensor_cores(request: _Request, reg_margin: int, tight: bool) -> Plan | None:
    """The plan on tensor cores (planner: "Tensor cores") where they apply: float16 or
    bfloat16, or float32 where the problem allows TF32 and the knobs ask for it (``mma=True``);
    one layer or two directions, the input projection a separate GEMM (neither input_rows nor
    input_steps set), the weights on-chip with ``reg_margin`` registers kept free, else
    (``tight``, unless the knobs fix reg_margin) with none. None where they do not apply,
    unless the knobs say ``mma=True``: then an Unfit saying why; ``mma=False``: None."""
    problem, knobs = request.problem, request.knobs
    mma = knobs.get("mma")
    # float32 (TF32 allowed) only with the knob mma=True: on an H200 (us a step, TF32 tensor
    # cores / float32 CUDA cores, both with TF32 input projections) it lost at most sizes,
    # LSTM 256 N64 16.8 / 3.1, LSTM 512 N16 6.6 / 3.1, LSTM 1024 N16 13.2 / 8.2, GRU 1024 N16
    # 13.0 / 7.4, GRU 512 N64 9.7 / 6.9, and won at LSTM 512 N64, 5.9 / 7.9
    if mma is False or (mma is None and problem.dtype == "float32"):
        return None
    why = ""
    if problem.dtype not in planner.MMA_DTYPES:
        why = f"they take {' or '.join(planner.MMA_DTYPES)} weights, not {problem.dtype}"
    elif problem.dtype == "float32" and not problem.allow_tf32:
        why = "float32 products run on them only in TF32 (allow_tf32=True)"
    elif problem.layers > 1:
        why = (f"they run one layer or two directions, not a wavefront of {problem.layers} "
               "layers (whose input projections are overlapped, in float32)")
    elif knobs.get("input_rows") or knobs.get("input_steps"):
        why = ("they take the input projection as a separate GEMM (input_rows and input_steps "
               f"0 or unset), not input_rows={knobs.get('input_rows')} "
               f"input_steps={knobs.get('input_steps')}")
    else:
        for margin in _margins(request, reg_margin, tight):
            try:
                return request.weights(margin, mma=True)
            except Unfit as err:
                why = str(err)
    if mma:
        raise Unfit(f"mma=True, but the tensor-core products do not apply: {why}")
    return None


#: A layer of 16-bit weights runs on the CUDA cores by default, not the tensor cores, where H
#: (its K) is under MMA_MIN_K (one chunk of theirs, 256 values) and that plan fits on-chip
#: (:func:`cuda_cores_first`): a tensor-core block takes at least 8 units (4 warps of 8 rows),
#: so a layer that small gets only a few. H200, float16, us a step, CUDA cores / tensor cores
#: through the barrier: LSTM 64 N64 0.88 / 3.09, LSTM 256 N64 2.79 / 3.20, GRU 128 N128 2.20 /
#: 3.34; it lost LSTM 256 N128 5.12 / 3.73, LSTM 128 N256 4.76 / 3.65 (K of two chunks: LSTM
#: 320 N64 6.13 / 3.07).
MMA_MIN_K = 257


def cuda_cores_first(request: _Request, reg_margin: int, tight: bool) -> Plan | None:
    """The CUDA cores' plan, weights on-chip, of a layer of 16-bit weights whose K = H is
    under :data:`MMA_MIN_K` (no projection: unmeasured) and whose knobs are unset (but
    ``lane_groups``, which only shapes that plan); else (or where that plan does not fit)
    None: the tensor cores' plan is tried first."""
    problem = request.problem
    if (set(request.knobs) - {"lane_groups"} or problem.dtype not in ("float16", "bfloat16")
            or problem.layers > 1 or problem.proj_size or problem.hidden_size >= MMA_MIN_K):
        return None
    for margin in _margins(request, reg_margin, tight):
        try:
            return request.weights(margin)
        except Unfit:
            continue
    return None


def _margins(request: _Request, reg_margin: int, tight: bool) -> list:
    """The register margins to plan with: ``reg_margin``, then (``tight``, unless the knobs fix
    reg_margin) none."""
    loose = tight and "reg_margin" not in request.knobs and reg_margin > 0
    return [reg_margin, 0] if loose else [reg_margin]


def weights_on_chip(request: _Request, reg_margin: int, tight: bool) -> Plan:
    """With ``reg_margin`` registers kept free; else (``tight``, unless the knobs fix
    reg_margin) with none, where ptxas then says whether it spills (the driver falls back if
    it does); else streaming, the weights that do not fit read from L2 every step (not with
    batch groups, which keep the weights on-chip)."""
    tries = [(margin, False) for margin in _margins(request, reg_margin, tight)]
    if (request.knobs.get("batch_groups") in (None, 1) and request.problem.directions == 1
            and request.problem.layers == 1):
        tries.append((reg_margin, True))
    for margin, stream in tries[:-1]:
        try:
            return request.weights(margin, stream)
        except Unfit:
            pass
    return request.weights(*tries[-1])


#: A layer of several batch rows runs one row a batch group where that plan's groups exchange
#: h as tagged words and its weights take at most ONE_ROW_SMEM_CHUNKS chunks of shared memory,
#: rather than in fewer groups of several rows with every weight in registers (the planner's
#: choice). H200, us a step, one row a group / the planner's: GRU 512 batch 8 1.97 / 2.36 (8
#: groups / 4), both directions at batch 4 2.03 / 2.40 (4 / 2 a direction); LSTM 512 batch 8
#: 2.38 / 2.47, both directions at batch 4 2.45 / 2.54; GRU 768 batch 4 2.60 / 2.71 (2
#: chunks). With 3 chunks it lost: LSTM 768 batch 4 2.95 / 2.79, RNN 1024 both directions
#: batch 4 2.51 / 2.46; so did LSTM 256 both directions at batch 16 (16 groups of 4 blocks,
#: 1 chunk) 2.00 / 1.93, whence groups of at least ONE_ROW_MIN_BLOCKS blocks (the gains had
#: 16-32).
ONE_ROW_SMEM_CHUNKS, ONE_ROW_MIN_BLOCKS = 2, 16


def one_row_groups(request: _Request, found: Plan) -> Plan:
    """``found``, or the plan of one batch row a group where :data:`ONE_ROW_SMEM_CHUNKS` says
    (unless the knobs set batch_groups, ``found`` fuses the input projection, or one
    direction's is fused by default); one layer, inference, float32 on the CUDA cores, weights
    not streamed."""
    problem = request.problem
    if ("batch_groups" in request.knobs or problem.layers > 1 or problem.training
            or problem.dtype != "float32" or found.global_chunks
            or found.fused or (fuses_input(problem) and problem.directions == 1)
            or not 1 < problem.batch <= planner.MAX_BATCH or found.batch_groups == problem.batch):
        return found
    try:
        one_row = request.weights(found.reg_margin, groups=problem.batch)
    except Unfit:
        return found
    if (one_row.smem_chunks <= ONE_ROW_SMEM_CHUNKS and one_row.group_blocks >= ONE_ROW_MIN_BLOCKS
            and planner.exchange(one_row, problem.batch) == "tagged"):
        return one_row
    return found


#: Where the plan's batch groups are not clusters (more than a cluster's blocks each, or more
#: than :data:`.planner.CLUSTER_MAX_BLOCKS` blocks in all), a batch of at most
#: :data:`.planner.MAX_BATCH` rows runs in groups of a cluster's blocks each, exchanging h
#: within the cluster, where those blocks hold the weights on-chip with at most
#: CLUSTER_SMEM_WEIGHTS bytes of them in shared memory: each block multiplies more of W_hh,
#: and the exchange costs about 240 ns a step where the tagged words of 16 blocks cost 600.
#: The groups are the plan's, or where those would take more than CLUSTER_MAX_BLOCKS blocks,
#: the most that do not. H200, us a step, the planner's groups tagged / a cluster's blocks
#: each (cuDNN): float32 LSTM 256 at batch 1 0.97 / 0.80 (4.72), at 2 1.02 / 0.80, at 4 1.04 /
#: 0.82, at 8 1.13 / 0.89 (5.41), at 16 (8 groups, not 16) 1.08 / 1.05, GRU 256 at 1, 2, 4, 8
#: 0.96 / 0.84, 0.98 / 0.83, 1.00 / 0.86, 1.05 / 0.91, LSTM 224 at 3 1.05 / 0.87, LSTM 200 at
#: 5 1.00 / 0.92, LSTM 96 at 16 0.81 / 0.73, GRU 320 at 1 and 3 (62 KiB of weights in shared
#: memory) 1.14 / 1.02, 1.18 / 1.01, tanh RNN 512 at 1 1.13 / 0.73, 640 at 2 1.32 / 0.93;
#: float16 LSTM 256 at 8 1.07 / 0.77 (1.46), at 16 1.04 / 0.99 (1.43), LSTM 200 at 16 1.32 /
#: 1.15, GRU 256 at 8 and 16 1.01 / 0.83, 1.15 / 1.01, bfloat16 LSTM 241 at 1 1.21 / 1.02.
#: With more in shared memory it lost or barely won: GRU 352 at 1 (68 KiB) 1.28 / 1.22, LSTM
#: 288 at 2 (144 KiB) 1.23 / 1.47, LSTM 300 at 3 1.24 / 1.54, GRU 384 at 1 1.21 / 1.39; so did
#: larger batches, in fewer groups of more rows: float32 LSTM 256 at 32 1.70 / 1.78, at 64
#: 3.00 / 3.73, GRU 200 at 48 1.76 / 1.89, float16 LSTM 128 at 64 0.86 / 1.24, GRU 256 at 32
#: 1.24 / 1.42.
CLUSTER_SMEM_WEIGHTS = 64 << 10
#: Where no portable cluster's blocks hold the weights, a wide cluster's (a non-portable size:
#: 16 blocks on an H200) may, in groups of more rows than the plan's only where a block's
#: multiply-adds a step grow by at most this many. H200, us a step, the planner's groups
#: tagged or with the counter / wide clusters (cuDNN): float32 LSTM 320 at 1 1.16 / 0.88
#: (4.86), LSTM 384 at 1 and 4 1.20 / 0.90, 1.33 / 1.02, GRU 384 at 1 1.18 / 0.92, GRU 512 at
#: 1 and 4 1.32 / 1.01, 1.47 / 1.22, tanh RNN 768 at 1 1.43 / 0.83, float16 LSTM 512 at 1, 2,
#: 4 1.28 / 1.25, 1.31 / 1.26, 1.32 / 1.26, GRU 640 at 1 1.73 / 1.50; at batch 8, 8 groups
#: of 16 blocks / 4 clusters of 16, 36 Ki to 48 Ki more a block: float32 LSTM 384 1.64 / 1.55
#: (6.77), float16 LSTM 384 1.56 / 1.45 (1.50), GRU 512 1.53 / 1.41; 64 Ki more lost: float16
#: LSTM 512 1.73 / 1.90 (1.70).
CLUSTER_WIDE_MORE_MACS = 48 << 10


def _weight_count(problem) -> int:
    """Elements of W_hh [G*H, H] (or [G*H, P] with a projection)."""
    return problem.gates * problem.hidden_size * (problem.proj_size or problem.hidden_size)


def cluster_groups(request: _Request, found: Plan) -> Plan:
    """``found``, or where :data:`CLUSTER_SMEM_WEIGHTS` says, its batch in groups of at most a
    cluster's blocks each (planner: "A cluster a group"), a portable cluster's if its blocks
    hold the weights, else a wide one's where :data:`CLUSTER_WIDE_MORE_MACS` says: unless the
    knobs set the grid, the batch groups or the exchange; at most :data:`.planner.MAX_BATCH`
    rows, one direction of one layer, inference, the CUDA cores, the input projection a
    separate GEMM, the weights with ``found``'s register margin, none streamed."""
    problem, gpu = request.problem, request.gpu
    if ({"max_blocks", "batch_groups", "sync"} & set(request.knobs)
            or problem.batch > planner.MAX_BATCH or found.group_blocks == 1
            or _clusters(request, found) or problem.layers > 1
            or problem.directions > 1 or problem.training or found.mma or found.global_chunks
            or found.fused or found.input_steps):
        return found
    for size in sorted({gpu.cluster, gpu.wide_cluster} - {1}):
        groups = max(g for g in range(1, min(planner.CLUSTER_MAX_BLOCKS // size,
                                             found.batch_groups) + 1)
                     if problem.batch % g == 0)
        more = problem.batch // groups - problem.batch // found.batch_groups
        if size > gpu.cluster and more * _weight_count(problem) // size > CLUSTER_WIDE_MORE_MACS:
            continue
        narrow = _Request(problem, gpu, {**request.knobs, "batch_groups": groups,
                                         "max_blocks": size * groups})
        try:
            clustered = narrow.weights(found.reg_margin)
        except Unfit:
            continue
        if (not clustered.global_chunks and clustered.smem_chunks * clustered.chunk_bytes
                <= CLUSTER_SMEM_WEIGHTS and _clusters(request, clustered)):
            return clustered
    return found


def input_projection(request: _Request, found: Plan) -> Plan:
    """Forced overlapped (``input_steps``); else, by default where :func:`fuses_input` (or
    forced with ``input_rows`` > 0): overlapped where it fits, else fused before the time loop
    (in slabs only at small batches); else the separate GEMM."""
    problem, knobs = request.problem, request.knobs
    rows, steps = knobs.get("input_rows"), knobs.get("input_steps")
    if problem.layers > 1:
        return _wavefront(request, found, rows, steps)
    if steps:
        overlapped = _overlapped(request, found, steps)
        if overlapped is None:
            raise Unfit(
                f"input_steps={steps}, but the overlapped input projection needs S*N (N a batch "
                f"group) a multiple of {planner.X_GROUPS}, no streamed chunks, and W_ih's rows, "
                "its accumulators and x's slabs held on-chip next to W_hh (whose chunks move to "
                "shared memory to make room, unless reg_margin is given); this plan has "
                f"N={problem.batch // found.batch_groups}"
                f"{', streamed chunks' if found.global_chunks else ''}")
        return overlapped
    if rows == 0 or (rows is None and not fuses_input(problem)):
        return found
    if problem.directions > 1 and rows is None:  # overlapped (unless input_steps=0), or the GEMM
        return _overlapped_in_groups(request, found) if steps is None else found
    fused = _overlapped(request, found) if rows is None and steps is None else None
    if fused is None:
        fused = planner.fuse_input(found, problem.gates, problem.input_size, problem.batch,
                                   request.gpu, rows)
        if (fused is not None and rows is None and fused.input_slab
                and problem.batch > FUSE_SLAB_MAX_BATCH):
            fused = None
    return fused or found


#: Where both directions' input projections cannot be overlapped in the planner's batch groups,
#: they are in more groups (fewer rows a group, so S*N makes S >= MIN_STEPS) where those keep
#: at most BIDIR_GROUPS_SMEM_CHUNKS chunks of W_hh in shared memory. H200, us a step, 2 groups
#: overlapped / 1 group and the separate GEMM: LSTM 512 batch 8 2.78 / 3.40 (1 chunk / 0),
#: GRU 640 batch 4 2.16 / 2.91 (1 / 0), RNN 1088 (C 1024) batch 4 3.04 / 3.92 (2 / 3); with
#: 4 chunks it lost, RNN 1216 (C 384) batch 8 5.37 / 4.28 (4 / 1).
BIDIR_GROUPS_SMEM_CHUNKS = 2


def _overlapped_in_groups(request: _Request, found: Plan) -> Plan:
    """Both directions' input projections overlapped (:data:`BIDIR_OVERLAP_ROWS`), their
    blocks exchanging tagged words: in ``found``'s batch groups, else (unless the knobs set
    them) in the fewest more where :data:`BIDIR_GROUPS_SMEM_CHUNKS` says, else ``found``
    (the separate GEMM)."""
    batch = request.problem.batch
    more = [] if "batch_groups" in request.knobs else [
        g for g in range(found.batch_groups + 1, batch + 1) if batch % g == 0]
    for groups in [found.batch_groups, *more]:
        try:
            base = found if groups == found.batch_groups else request.weights(
                found.reg_margin, groups=groups)
        except Unfit:
            continue
        overlapped = _overlapped(request, base, rows=BIDIR_OVERLAP_ROWS)
        if (overlapped and planner.exchange(overlapped, batch) == "tagged"
                and (groups == found.batch_groups
                     or overlapped.smem_chunks <= BIDIR_GROUPS_SMEM_CHUNKS)):
            return overlapped
    return found


def _wavefront(request: _Request, found: Plan, rows, steps) -> Plan:
    """A wavefront of layers: every layer's input projection overlapped with its time loop,
    ``steps`` a group (default: the first of :func:`.planner.wavefront_steps` that fits)."""
    if rows:
        raise Unfit(f"input_rows={rows}: the layers of a wavefront compute their input "
                    "projections overlapped with the time loop (give input_steps, or neither)")
    if request.knobs.get("sync") == "grid":
        raise Unfit("sync='grid' holds every block of the grid at the same step, and a "
                    "wavefront's layers run steps apart (give 'tagged' or 'barrier')")
    local = request.problem.batch // found.batch_groups
    for tried in [steps] if steps else planner.wavefront_steps(local):
        overlapped = _overlapped(request, found, tried)
        if overlapped is not None:
            return overlapped
    raise Unfit(f"a wavefront of {request.problem.layers} layers needs each layer's input "
                "projection overlapped with its time loop (float32, W_ih's rows, the "
                f"accumulators and x's slabs on-chip next to W_hh, on "
                f"{found.blocks // found.grids} blocks a layer), and it does not fit")


def _overlapped(request: _Request, found: Plan, steps: int | None = None,
                rows: tuple = ()) -> Plan | None:
    """``found`` with its input projection overlapped (``steps`` a group, or the planner's;
    ``rows``: S*N the first of these that fits, S at least :data:`MIN_STEPS`), W_hh's chunks
    moved to shared memory :data:`OVERLAP_ROOM` registers at a time to make room for the
    accumulators (unless the knobs fix reg_margin); None where it does not fit."""
    problem = request.problem
    for more in OVERLAP_ROOM if "reg_margin" not in request.knobs else (0,):
        try:
            base = request.weights(found.reg_margin + more) if more else found
        except Unfit:
            return None
        local = problem.batch // base.batch_groups
        tries = [steps]
        if rows:
            tries = [r // local for r in rows if r % local == 0 and r // local >= MIN_STEPS]
        for tried in tries:
            overlapped = planner.overlap_input(base, problem.gates, problem.input_size,
                                               problem.batch, request.gpu, tried)
            if overlapped is not None:
                return overlapped
    return None
