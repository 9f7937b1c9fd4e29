"""Cell + sizes + target -> lowered IRModule -> TVM build -> one shared library + metadata."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile

from .. import cells
from .._version import __version__
from ..cells import Cell
from ..errors import BuildError, ConfigError, RnnccError
from ..runtime import metadata as md
from ..runtime.module import Module
from ..spec import Options, Problem
from ..target import TargetSpec


def resolve_cell(cell) -> Cell:
    """A Cell, a registered name, or the path of a cell file (which must register one cell,
    or several of which one is named like the file)."""
    if isinstance(cell, Cell):
        return cell
    if not isinstance(cell, str):
        raise ConfigError(f"cell must be a name, a Cell or a file path, got {type(cell).__name__}")
    if cell.endswith(".py") or os.sep in cell:
        found = cells.load_file(cell)
        if len(found) == 1:
            return found[0]
        stem = os.path.splitext(os.path.basename(cell))[0]
        named = [c for c in found if c.name == stem]
        if named:
            return named[0]
        raise ConfigError(f"cell file {cell!r} registers {[c.name for c in found]}; name one")
    return cells.get(cell)


def _options(options: dict) -> Options:
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"unknown schedule option(s) {unknown}; allowed: {sorted(fields)}")
    for key, value in options.items():
        if key != "persistent" and not isinstance(value, bool):
            raise ConfigError(f"schedule option {key} must be True or False, got {value!r}")
    return Options(**options)


#: The persistent kernel's knobs (what ``rnncc tune`` searches): the synchronisation variant,
#: a cap on the grid (so more hidden units a block), the warps a block, the registers kept
#: free under the limit (more moves weight chunks from registers to shared memory), the
#: unrolling of the loop over the weight chunks in shared memory, the rows of x a group of
#: the fused input projection before the time loop (0: the input projection is a separate
#: GEMM), the steps a group of the fused input projection overlapped with the time loop (0:
#: not overlapped), the batch groups (a divisor of N: the grid split into that many groups, a
#: slice of the batch each), and the products on tensor cores.
KNOBS = ("sync", "max_blocks", "warps", "reg_margin", "unroll", "input_rows", "input_steps",
         "batch_groups", "mma")
SYNCS = ("tagged", "barrier", "grid")
WARPS = (4, 8, 16)


def plan_with_knobs(problem: Problem, gpu, knobs: dict, reg_margin: int, tight: bool = True):
    """The persistent plan of ``problem`` on ``gpu`` (a planner GPU) under ``knobs``, or
    :class:`Unfit`. A configuration that does not fit on-chip with ``reg_margin`` registers
    kept free is planned again with none (``tight``, unless the knobs fix reg_margin; ptxas
    then says whether it spills: :func:`compile_module` falls back if it does), then as a
    streaming plan (the weights that do not fit read from L2 every step). Shared with
    ``rnncc tune``."""
    from ..schedules import persistent

    def attempt(margin, stream=False):
        return persistent.plan(problem.gates, problem.hidden_size, problem.batch,
                               problem.dtype, gpu, len(problem.cell.states),
                               max_blocks=knobs.get("max_blocks"), reg_margin=margin,
                               warps=knobs.get("warps"), stream=stream, batch_groups=groups)

    groups = knobs.get("batch_groups")  # None: the planner's choice
    tries = [(reg_margin, False)]
    if tight and "reg_margin" not in knobs and reg_margin > 0:
        tries.append((0, False))
    if groups in (None, 1):  # batch groups keep the weights on-chip
        tries.append((reg_margin, True))
    for i, (margin, stream) in enumerate(tries):
        try:
            found = attempt(margin, stream)
            break
        except persistent.Unfit:
            if i == len(tries) - 1:
                raise
    fixed = {k: knobs[k] for k in ("sync", "unroll") if k in knobs}
    found = dataclasses.replace(found, **fixed)

    def overlapped(steps=None):  # W_hh's chunks moved to shared memory to make room
        for more in OVERLAP_ROOM if "reg_margin" not in knobs else (0,):
            try:
                base = found if not more else dataclasses.replace(
                    attempt(found.reg_margin + more), **fixed)
            except persistent.Unfit:
                return None
            fused = persistent.overlap_input(base, problem.gates, problem.input_size,
                                             problem.batch, gpu, steps)
            if fused is not None:
                return fused
        return None

    rows, steps = knobs.get("input_rows"), knobs.get("input_steps")
    if steps:  # forced overlapped
        fused = overlapped(steps)
        if fused is None:
            raise persistent.Unfit(
                f"input_steps={steps}, but the overlapped input projection needs S*N (N a batch "
                f"group) a multiple of {persistent.planner.X_GROUPS}, no streamed chunks, and "
                "W_ih's rows, its accumulators and x's slabs held on-chip next to W_hh (whose "
                "chunks move to shared memory to make room, unless reg_margin is given); this "
                f"plan has N={problem.batch // found.batch_groups}"
                f"{', streamed chunks' if found.global_chunks else ''}")
        found = fused
    elif rows != 0 and (rows is not None or fuses_input(problem)):
        fused = None
        if rows is None and steps is None:
            fused = overlapped()  # where it fits
        if fused is None:
            fused = persistent.fuse_input(found, problem.gates, problem.input_size,
                                          problem.batch, gpu, rows)
            if fused is not None and rows is None and fused.input_slab \
                    and problem.batch > FUSE_SLAB_MAX_BATCH:
                fused = None
        found = fused or found
    mma = knobs.get("mma")  # None: tensor cores wherever they apply
    if mma is False:
        return found
    tensor = persistent.tensor_cores(found, problem.dtype, problem.batch, gpu)
    if tensor is None and mma:
        planner = persistent.planner
        raise persistent.Unfit(
            f"mma=True, but tensor-core products need float16, {planner.MMA_ROWS} rows a warp, at "
            f"most {planner.MMA_MAX_BATCH} batch rows a group, at least {planner.MMA_MIN_CHUNKS} "
            f"chunks of K, no fused input projection and no streamed chunks; this plan has "
            f"{problem.dtype}, {found.rows_per_warp} rows a warp, "
            f"{problem.batch // found.batch_groups} batch row(s) a group, {found.chunks} "
            f"chunk(s) of K{', a fused input projection' if found.fused else ''}"
            f"{', streamed chunks' if found.global_chunks else ''}")
    return tensor or found


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
#: ... and overlapped with the time loop (:func:`rnncc.schedules.persistent.overlap_input`)
#: where it fits, W_hh's chunks moved to shared memory OVERLAP_ROOM registers at a time to
#: make room (H200, us/step, before the loop / overlapped: GRU 1024 N=4 3.33 / 3.06, LSTM
#: 1024 N=4 3.61 / 3.30 with one chunk of W_hh moved, GRU 1024 N=1 2.02 / 1.86 and LSTM 1024
#: N=1 2.08 / 1.95 with the counter barrier).
OVERLAP_ROOM = (0, 24, 48)


def fuses_input(problem: Problem) -> bool:
    """Whether the persistent kernel computes its input projections itself by default
    (:func:`rnncc.schedules.persistent.fuse_input`)."""
    return (problem.dtype == "float32" and problem.input_size >= FUSE_MIN_INPUT
            and problem.batch <= FUSE_MAX_BATCH)


def _persistent_plan(problem: Problem, opts: Options, tspec: TargetSpec, sms, reg_margin,
                     knobs, tight=True):
    """(plan or None, why not) for the persistent kernel."""
    from ..schedules import persistent

    if opts.persistent == "off":
        return None, "persistent=off"
    if tspec.kind != "cuda":
        if opts.persistent == "on":
            raise ConfigError("persistent kernels are CUDA only; use --target cuda")
        return None, "persistent kernels are CUDA only"
    if not opts.all_optimisations:
        why = "the persistent kernel runs with input_gemm, gate_gemm and fuse_pointwise on"
        if opts.persistent == "on":
            raise ConfigError(why)
        return None, why
    gpu = persistent.gpu_for_arch(tspec.arch, sms)
    try:
        return plan_with_knobs(problem, gpu, knobs, reg_margin, tight), gpu
    except persistent.Unfit as err:
        if opts.persistent == "on":
            raise ConfigError(f"persistent=on, but {err}") from err
        return None, str(err)


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
    if not isinstance(knobs.get("mma", False), bool):
        raise ConfigError(f"mma must be true or false, got {knobs['mma']!r}")
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


def compile_module(cell, input_size: int, hidden_size: int, batch: int, *,
                   dtype: str = "float32", target: str = "cuda", arch: str | None = None,
                   cpu: str | None = None, sms: int | None = None, knobs: dict | None = None,
                   gpu: str | None = None, tuning: str = "auto", **options) -> Module:
    """Compile one layer of ``cell`` into a :class:`rnncc.Module`.

    The module is built into a shared library at once (for CUDA, with a cubin from nvcc), so
    what you call is what :meth:`Module.export` writes and :func:`rnncc.load` reads. ``sms``:
    plan the persistent kernel for a GPU with that many multiprocessors (default: the
    architecture's usual part, e.g. 132 for sm_90). ``knobs``: overrides of the persistent
    planner's choices (see :data:`KNOBS`), over those of a tuning log.

    Tuning logs (:mod:`rnncc.tuning`): ``gpu`` names the GPU kind the module is for ("h100",
    "h200"; default: this machine's GPU, if it has one), whose logs apply; ``tuning`` is "auto"
    (the matching log, if any), "off", or the path of one log directory. The metadata's
    "tuning" entry names the log used and what it applied.
    """
    problem = Problem(resolve_cell(cell), input_size, hidden_size, batch, dtype)
    tspec = TargetSpec(target, arch, cpu)
    opts = _options(options)
    knobs = check_knobs(knobs)
    groups = knobs.get("batch_groups", 1)
    if batch % groups:
        raise ConfigError(f"batch_groups must divide the batch {batch}, got {groups}; allowed: "
                          f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
    if not isinstance(tuning, str):
        raise ConfigError(f"tuning must be 'auto', 'off' or a log directory, got {tuning!r}")
    from ..schedules.persistent.planner import REG_MARGIN
    from ..tuning import apply

    applied = apply.for_compile(problem, tspec, gpu, tuning)
    knobs = {**applied.knobs, **knobs}
    margin, tight, notes, spilled = knobs.get("reg_margin", REG_MARGIN), True, [], set()
    for _ in range(12):
        plan, gpu_or_reason = _persistent_plan(problem, opts, tspec, sms, margin, knobs, tight)
        chunks = None if plan is None else dataclasses.replace(plan, reg_margin=0)
        if chunks in spilled:
            margin += 24  # a larger margin that plans the same chunks: not built again
            continue
        module = _build(problem, opts, tspec, plan, gpu_or_reason, notes, applied)
        if plan is None:
            return module
        spills = _persistent_spills(module)
        if not spills:
            return module
        if plan.input_steps and not knobs.get("input_steps"):  # before the loop instead
            notes.append(f"persistent plan with its input projection overlapped ("
                         f"{plan.input_steps} steps a group) spilled ({spills}); built with it "
                         "before the time loop")
            knobs = {**knobs, "input_steps": 0}
            continue
        if plan.fused:  # the same plan with the separate input GEMM first
            notes.append(f"persistent plan with its input projection fused ({plan.input_rows} "
                         f"rows a group) spilled ({spills}); built with the input GEMM")
            knobs = {k: v for k, v in knobs.items() if k != "input_steps"} | {"input_rows": 0}
            continue
        spilled.add(chunks)
        notes.append(f"persistent plan with {plan.reg_estimate} estimated registers spilled "
                     f"({spills})")
        if len(spilled) == 5:
            break
        if plan.reg_margin < margin:  # the plan that keeps no register free spilled: stream
            tight = False
        else:
            margin += 24
    why = (f"the persistent kernel for {problem.describe()} spills registers with every plan "
           f"that fits (reg_margin {plan.reg_margin})")
    if opts.persistent == "on":
        raise BuildError(why)
    return _build(problem, opts, tspec, None, why, notes, applied)


def _persistent_spills(module) -> list[str]:
    """The persistent kernels of ``module`` that ptxas reports spilling or using a stack."""
    from .cuda_binary import cooperative_kernels

    ptxas = module.metadata.get("ptxas", {})
    return sorted(k for k in cooperative_kernels(module.source("cuda"))
                  if ptxas.get(k, {}).get("spill_stores") or ptxas.get(k, {}).get("stack"))


def _build(problem, opts, tspec, plan, gpu_or_reason, notes, applied) -> Module:
    import tvm

    from ..lowering import sequence
    from . import pipeline
    from .cuda_binary import nvcc_callback, pack_imports_with_cubin

    tvm_target = tspec.tvm_target()
    try:
        lowered = sequence.build(problem, opts, tvm_target, plan, applied.database)
    except RnnccError:
        raise
    except Exception as err:
        raise BuildError(f"lowering {problem.describe()} failed: {err}") from err
    ptxas: dict = {}
    workdir = tempfile.mkdtemp(prefix="rnncc_build_")
    path = os.path.join(workdir, f"{problem.cell.name}.so")
    try:
        if tspec.kind == "cuda":
            with nvcc_callback(tspec.arch, ptxas):
                executable = tvm.compile(lowered.mod, target=tvm_target,
                                         tir_pipeline=pipeline.register())
            cuda_source = executable.mod.imports[0].inspect_source()
        else:
            executable = tvm.compile(lowered.mod, target=tvm_target)
            cuda_source = None
    except RnnccError:
        raise
    except Exception as err:
        raise BuildError(f"TVM failed to build {problem.describe()} for {tspec.describe()}: "
                         f"{str(err).strip().splitlines()[-1]}") from err
    if plan is not None:
        persistent_info = {"plan": plan.as_dict(), "planned_for": gpu_or_reason.name,
                           "sms": gpu_or_reason.sms}
    else:
        persistent_info = {"reason": gpu_or_reason}
    meta = {
        "format": md.FORMAT,
        "rnncc_version": __version__,
        "tvm_version": tvm.__version__,
        "cell": problem.cell.name,
        "cell_source": problem.cell.source or "builtin",
        "gates": problem.gates,
        "states": list(problem.cell.states),
        "input_size": problem.input_size,
        "hidden_size": problem.hidden_size,
        "batch": problem.batch,
        "dtype": problem.dtype,
        "target": tspec.as_dict(),
        "schedule": {
            "kind": "persistent" if plan is not None else "sequence",
            "options": dataclasses.asdict(opts),
            "layout": dataclasses.asdict(lowered.layout),
            "rules": lowered.rules,
            "notes": lowered.notes + notes,
            "persistent": persistent_info,
        },
        "tuning": applied.info,
        "functions": lowered.signatures,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    fpack = pack_imports_with_cubin(tspec.arch, ptxas) if tspec.kind == "cuda" else None
    _export(executable.mod, path, workdir, fpack, meta, ptxas, cuda_source,
            lowered.mod.script())
    return Module(path, meta, owned_dir=workdir)


def _export(lib, path, workdir, fpack, meta, ptxas, cuda_source, tir_text):
    """export_library, with the metadata sections linked in."""
    addon = os.path.join(workdir, "rnncc_meta.c")

    def pack_then_meta(mod, is_system_lib, prefix, wdir):
        # The packer compiles the cubin; its ptxas report belongs in the metadata.
        out = fpack(mod, is_system_lib, prefix, wdir) if fpack else None
        _write_meta(addon, meta, ptxas, cuda_source, tir_text)
        return out

    try:
        if fpack is None:
            _write_meta(addon, meta, ptxas, cuda_source, tir_text)
            lib.export_library(path, addons=[addon], workspace_dir=workdir)
        else:
            lib.export_library(path, fpack_imports=pack_then_meta, addons=[addon],
                               workspace_dir=workdir)
    except RnnccError:
        raise
    except Exception as err:
        raise BuildError(f"linking the module library failed: {str(err).strip()[-2000:]}") from err


def _write_meta(path, meta, ptxas, cuda_source, tir_text):
    if ptxas:
        meta["ptxas"] = ptxas
    sections = {md.META: json.dumps(meta, sort_keys=True).encode(), md.TIR: tir_text.encode()}
    if cuda_source is not None:
        sections[md.CUDA] = cuda_source.encode()
    with open(path, "w") as f:
        f.write(md.c_source(sections))
