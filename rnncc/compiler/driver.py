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
from ..cells.autodiff import takes_means, trace
from ..errors import BuildError, ConfigError, RnnccError
from ..runtime import metadata as md
from ..runtime.module import Module
from ..spec import Options, Problem
from ..target import TargetSpec


class Spilled(BuildError):
    """The persistent kernel spills registers with every plan that fits, where nothing else
    may run it (a wavefront, or persistent="on"): the same for every build of the
    configuration (the compile cache keeps it)."""


def resolve_cell(cell) -> Cell:
    """A Cell (checked as :func:`rnncc.cells.register` checks, where it is not registered), a
    registered name, or the path of a cell file (which must register one cell, or several of
    which one is named like the file)."""
    if isinstance(cell, Cell):
        if cells.registry().get(cell.name) is not cell:  # made, not registered: its checks
            cells.check(cell)
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


def _persistent_plan(problem: Problem, opts: Options, tspec: TargetSpec, sms, reg_margin,
                     knobs, tight=True):
    """(plan or None, why not) for the persistent kernel."""
    from ..schedules import persistent

    if problem.layers > 1 and (opts.persistent == "off" or tspec.kind != "cuda"
                               or not opts.all_optimisations):
        raise ConfigError(_wavefront_only(problem, "that needs the cuda target with "
                                          "persistent, input_gemm, gate_gemm and "
                                          "fuse_pointwise on"))
    if opts.persistent == "off":
        return None, "persistent=off"
    why = _not_persistent(problem)
    if why:
        if problem.layers > 1:
            raise ConfigError(_wavefront_only(problem, why))
        if opts.persistent == "on":
            raise ConfigError(f"persistent=on, but {why}")
        return None, why
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
        return persistent.knobs.plan_for(problem, gpu, knobs, reg_margin, tight), gpu
    except persistent.Unfit as err:
        if problem.layers > 1:
            raise ConfigError(_wavefront_only(problem, str(err))) from err
        if opts.persistent == "on":
            raise ConfigError(f"persistent=on, but {err}") from err
        return None, str(err)


def _backward_plan(problem: Problem, opts: Options, tspec: TargetSpec, sms, reg_margin,
                   min_blocks: int | None = None):
    """(plan or None, why not) for the persistent backward kernel of a training module; in 16
    bits on tensor cores where their plan takes at least ``min_blocks`` blocks (default
    :data:`~rnncc.schedules.persistent.planner.MMA_BACKWARD_MIN_BLOCKS`), else the CUDA
    cores' plan where one fits."""
    from ..lowering.training import kept_parts
    from ..schedules import persistent

    if tspec.kind != "cuda" or opts.persistent == "off":
        return None, "the persistent backward kernel is CUDA only, and not with persistent=off"
    why = _not_persistent(problem)
    if why:
        return None, why
    if takes_means(problem.cell):
        return None, (f"cell {problem.cell.name!r} takes means over the hidden units "
                      "(ops.mean): the persistent backward kernel does not take them (the "
                      "forward does)")
    gpu = persistent.gpu_for_arch(tspec.arch, sms)
    why, few = "", None
    if min_blocks is None:
        min_blocks = persistent.planner.MMA_BACKWARD_MIN_BLOCKS
    kept, product = len(kept_parts(problem.cell)), bool(trace(problem.cell).products)
    # 16-bit weights: the products on tensor cores where they fit (K split among a row
    # group's warps: a block's units are few, their K = G*H deep) on enough blocks, else on
    # CUDA cores
    for mma in (True, False) if problem.dtype in ("float16", "bfloat16") else (False,):
        try:
            found = persistent.planner.backward(
                problem.gates, problem.hidden_size, problem.batch, problem.dtype, gpu,
                len(problem.cell.states), kept, reg_margin, params=len(problem.cell.params),
                mma=mma, product=product)
        except persistent.Unfit as err:
            why = why or str(err)
            continue
        if mma and found.blocks < min_blocks:
            few = found  # the CUDA cores' plan first, if one fits
            continue
        return found, None
    return (few, None) if few is not None else (None, why)


def _not_persistent(problem: Problem) -> str:
    """Why ``problem`` runs on the non-persistent schedule whatever the GPU, or ""."""
    if problem.proj_size and problem.training:
        return (f"a projection (proj_size={problem.proj_size}) runs on the persistent kernel "
                "in inference only; training runs on the non-persistent schedule")
    means, products = takes_means(problem.cell), trace(problem.cell).products
    if means and problem.layers > 1:
        return (f"cell {problem.cell.name!r} takes means over the hidden units (ops.mean); "
                "the persistent kernel takes them one layer a module")
    if products and means:
        return (f"cell {problem.cell.name!r} takes means and a recurrent product of a value; "
                "the persistent kernel takes one or the other")
    if products and (len(products) > 1 or problem.layers > 1):
        return (f"cell {problem.cell.name!r} takes {len(products)} recurrent product(s) "
                "of values of its step (ops.recurrent); the persistent kernel takes one, one "
                "layer a module")
    return ""


#: A TF32 layer (``allow_tf32``) of one direction for inference without lengths (with them:
#: not run on a GPU yet), past one tensor-core batch group (batch over 64) and of H at least
#: this, runs its persistent kernel on the tensor cores
#: (the knob mma=True; in TF32 they are not the default: :func:`~rnncc.schedules.persistent.
#: knobs.tensor_cores`) where the non-persistent schedule would take each step's product on
#: the CUDA cores: too few tiles for the tensor-core rules. H200, us a step, T 100, that
#: schedule / the persistent kernel on tensor cores (cuDNN in TF32): LSTM 256 N256 10.70 / 5.00
#: (9.08), N128 4.28 / 3.69 (8.65), GRU 256 N256 10.04 / 9.01 (8.36), LSTM 192 N200 9.55 /
#: 4.29 (30.98), GRU 384 N256 17.36 / 11.22 (10.24); but LSTM 128 N255 8.07 / 8.86 (5.19),
#: and LSTM 512 N256 9.58 / 18.80 (12.74), whose step's product is on cuda.wgmma_gemm.
TF32_PERSISTENT_MIN_HIDDEN = 192


def _tf32_tensor_cores(problem: Problem, opts: Options, tspec: TargetSpec, sms,
                       knobs: dict) -> dict:
    """``knobs`` with mma=True where :data:`TF32_PERSISTENT_MIN_HIDDEN` says and a plan on
    the tensor cores fits, else ``knobs`` (a knob mma given is kept)."""
    from ..lowering import sequence
    from ..schedules import TENSOR_CORE_RULES, persistent

    if (not problem.allow_tf32 or "mma" in knobs or tspec.kind != "cuda"
            or opts.persistent == "off" or not opts.all_optimisations or problem.training
            or problem.lengths or problem.layers > 1 or problem.directions > 1 or problem.proj_size
            or problem.batch <= persistent.planner.MMA_MAX_BATCH
            or problem.hidden_size < TF32_PERSISTENT_MIN_HIDDEN or _not_persistent(problem)):
        return knobs
    try:
        rules = sequence.build(problem, dataclasses.replace(opts, persistent="off"),
                               tspec.tvm_target()).rules
    except Exception:  # noqa: BLE001 - the module's own build then says what failed
        return knobs
    if rules.get("step", rules.get("recurrent_gemm_parts", rules["recurrent_gemm"])) in (
            TENSOR_CORE_RULES):
        return knobs
    tensor = {**knobs, "mma": True}
    try:
        persistent.knobs.plan_for(problem, persistent.gpu_for_arch(tspec.arch, sms), tensor,
                                  knobs.get("reg_margin", persistent.planner.REG_MARGIN))
    except persistent.Unfit:
        return knobs
    return tensor


def _wavefront_only(problem: Problem, why: str) -> str:
    return (f"{problem.describe()} runs only as the persistent wavefront kernel, and {why}; "
            "run its layers as modules of one layer each (rnncc.nn does so where the wavefront "
            "does not fit)")


def compile_module(cell, input_size: int, hidden_size: int, batch: int, *,
                   dtype: str = "float32", target: str = "cuda", arch: str | None = None,
                   cpu: str | None = None, sms: int | None = None, knobs: dict | None = None,
                   gpu: str | None = None, tuning: str = "auto", lengths: bool = False,
                   directions: int = 1, layers: int = 1, training: bool = False,
                   proj_size: int = 0, allow_tf32: bool = False, **options) -> Module:
    """Compile one layer of ``cell`` into a :class:`rnncc.Module`.

    The module is built into a shared library at once (for CUDA, with a cubin from nvcc), so
    what you call is what :meth:`Module.export` writes and :func:`rnncc.load` reads. ``sms``:
    plan the persistent kernel for a GPU with that many multiprocessors (default: the
    architecture's usual part, e.g. 132 for sm_90). ``knobs``: overrides of the persistent
    planner's choices (see :data:`rnncc.schedules.persistent.knobs.KNOBS`), over those of a
    tuning log.

    Tuning logs (:mod:`rnncc.tuning`): ``gpu`` names the GPU kind the module is for ("h100",
    "h200"; default: this machine's GPU, if it has one), whose logs apply; ``tuning`` is "auto"
    (the matching log, if any), "off", or the path of one log directory. The metadata's
    "tuning" entry names the log used and what it applied. ``lengths``: the module takes each
    sample's length at run time; ``directions=2``: a bidirectional layer; ``layers`` L > 1: a
    stack of L unidirectional layers of input size H, run as one persistent wavefront (see
    :class:`rnncc.spec.Problem`; a ConfigError where it does not fit). ``training``: the
    module also has a training step's entries (:meth:`rnncc.Module.train_forward`,
    :meth:`rnncc.Module.backward`; one layer, one direction). ``proj_size`` P > 0: an LSTM
    with projections (LSTMP, torch's ``proj_size``; the module takes ``weight_hr_l0`` [P, H],
    and h and y are P wide; the non-persistent schedule). ``allow_tf32``: float32 products
    may run on tensor cores in TF32 (see :class:`rnncc.spec.Problem`; off by default, as IEEE
    float32); the metadata's "allow_tf32" says so and its "rules" which products did.
    """
    from ..schedules.persistent.knobs import check_knobs
    from ..schedules.persistent.planner import REG_MARGIN
    from ..tuning import apply

    problem = Problem(resolve_cell(cell), input_size, hidden_size, batch, dtype, lengths,
                      directions, layers, training, proj_size, allow_tf32)
    if training and not _options(options).all_optimisations:
        raise ConfigError("training=True needs input_gemm, gate_gemm and fuse_pointwise on")
    tspec = TargetSpec(target, arch, cpu)
    opts = _options(options)
    knobs = check_knobs(knobs)
    groups = knobs.get("batch_groups", 1)
    if batch % groups:
        raise ConfigError(f"batch_groups must divide the batch {batch}, got {groups}; allowed: "
                          f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
    if not isinstance(tuning, str):
        raise ConfigError(f"tuning must be 'auto', 'off' or a log directory, got {tuning!r}")

    applied = _fitting(apply.for_compile(problem, tspec, gpu, tuning), problem, opts, tspec,
                       sms, knobs)
    merged = {**applied.knobs, **knobs}
    knobs = _tf32_tensor_cores(problem, opts, tspec, sms, merged)
    margin, tight, notes, spilled = knobs.get("reg_margin", REG_MARGIN), True, [], set()
    if knobs is not merged:  # the TF32 default chose the tensor cores
        notes.append("TF32 past batch 64: the persistent kernel on tensor cores (mma=True), "
                     "where the non-persistent schedule would take each step's product on the "
                     "CUDA cores")
    back_margin, min_blocks = REG_MARGIN, None  # the backward plan's (None: the planner's)
    backward = _backward_plan(problem, opts, tspec, sms, back_margin) if training else None
    for _ in range(16):
        plan, gpu_or_reason = _persistent_plan(problem, opts, tspec, sms, margin, knobs, tight)
        chunks = None if plan is None else dataclasses.replace(plan, reg_margin=0)
        if chunks in spilled:
            margin += 24  # a larger margin that plans the same chunks: not built again
            continue
        module = _build(problem, opts, tspec, plan, gpu_or_reason, notes, applied, backward)
        spills = _persistent_spills(module) if tspec.kind == "cuda" else []
        if any("backward" in k for k in spills):  # the backward kernel's plan, margin by margin
            notes.append(f"persistent backward plan with {backward[0].reg_estimate} estimated "
                         f"registers spilled")
            back_margin += 24
            backward = _backward_plan(problem, opts, tspec, sms, back_margin, min_blocks)
            if back_margin > REG_MARGIN + 3 * 24 and backward[0] is not None:
                tensor = _backward_plan(problem, opts, tspec, sms, REG_MARGIN, min_blocks=0)
                if (min_blocks is None and not backward[0].mma and tensor[0] is not None
                        and tensor[0].mma):  # once
                    notes.append("persistent backward plans on the CUDA cores spilled; planned "
                                 "on the tensor cores' few blocks")
                    min_blocks, back_margin, backward = 0, REG_MARGIN, tensor
                else:
                    backward = (None, "the persistent backward kernel spilled registers with "
                                      "every plan tried")
            continue
        if plan is None or not spills:
            return module
        if layers == 1 and plan.input_steps and not knobs.get("input_steps"):
            roomier = _overlapped_with_room(problem, opts, tspec, sms, margin, knobs, tight,
                                            spilled | {chunks})
            if roomier is not None:  # the same overlap with fewer chunks in registers
                notes.append(f"persistent plan with its input projection overlapped and "
                             f"reg_margin {margin} spilled ({spills}); planned with "
                             f"reg_margin {roomier}")
                spilled.add(chunks)
                margin = roomier
                continue
            margin = knobs.get("reg_margin", REG_MARGIN)  # the projection before the loop
            notes.append(f"persistent plan with its input projection overlapped ("
                         f"{plan.input_steps} steps a group) spilled ({spills}); built with it "
                         "before the time loop")
            knobs = {**knobs, "input_steps": 0}
            continue
        if layers == 1 and plan.fused:  # the same plan with the separate input GEMM first
            notes.append(f"persistent plan with its input projection fused ({plan.input_rows} "
                         f"rows a group) spilled ({spills}); built with the input GEMM")
            knobs = {k: v for k, v in knobs.items() if k != "input_steps"} | {"input_rows": 0}
            continue
        # a step's means as each block's sums before a larger margin: a thread then stages a
        # row's B values a mean, not its H (H200, us a step, T 100: LN-GRU 1024 at batch 16
        # spilled with every plan, 20.8 on the sequence schedule; with the blocks' sums 14.6)
        if not plan.mean_partials and "mean_partials" not in knobs and takes_means(
                problem.cell):
            notes.append(f"persistent plan with its means exchanged as units' values spilled "
                         f"({spills}); planned with them as each block's sums (mean_partials)")
            knobs = {**knobs, "mean_partials": True}
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
    if layers > 1:
        raise Spilled(_wavefront_only(problem, f"its kernel spills registers with every plan "
                                      f"that fits (reg_margin {plan.reg_margin})"))
    if opts.persistent == "on":
        raise Spilled(why)
    return _build(problem, opts, tspec, None, why, notes, applied, backward)


#: Registers more that a spilling plan with an overlapped input projection is planned again
#: with, before the projection goes before the time loop. H200, us a step, bidirectional GRU
#: 640 (C 384) at batch 6: 2 batch groups overlapped at reg_margin 48, 2.64, against 3.21 for
#: one group with the projection first (its plan at the default margin spilled).
OVERLAP_EXTRA_MARGINS = (24, 48)


def _overlapped_with_room(problem, opts, tspec, sms, margin, knobs, tight, spilled):
    """The first reg_margin past ``margin`` (the default's plus one of
    :data:`OVERLAP_EXTRA_MARGINS`) whose plan still overlaps the input projection with the time
    loop and is none of ``spilled`` (plans with reg_margin 0), or None; none where the knobs
    set the margin."""
    from ..schedules.persistent.planner import REG_MARGIN

    if "reg_margin" in knobs:
        return None
    for tried in (REG_MARGIN + extra for extra in OVERLAP_EXTRA_MARGINS):
        if tried <= margin:
            continue
        plan, _ = _persistent_plan(problem, opts, tspec, sms, tried, knobs, tight)
        if (plan is not None and plan.input_steps
                and dataclasses.replace(plan, reg_margin=0) not in spilled):
            return tried
    return None


def _fitting(applied, problem, opts, tspec, sms, knobs):
    """``applied``, or nothing of its log where the log's knobs (valid, but for another
    configuration: batch_groups=3 at batch 1) leave no persistent plan where the
    configuration has one without them."""
    from ..schedules.persistent.planner import REG_MARGIN
    from ..tuning import apply

    if not applied.knobs:
        return applied
    opts = dataclasses.replace(opts, persistent="auto")  # asked for or not: compare the two
    margin = knobs.get("reg_margin", REG_MARGIN)
    plan, why = _persistent_plan(problem, opts, tspec, sms, margin, {**applied.knobs, **knobs})
    if plan is not None or _persistent_plan(problem, opts, tspec, sms, margin, knobs)[0] is None:
        return applied
    return apply.refuse_knobs(applied, why)


def _persistent_spills(module) -> list[str]:
    """The persistent kernels of ``module`` that ptxas reports spilling or using a stack."""
    from .cuda_binary import persistent_kernels

    ptxas = module.metadata.get("ptxas", {})
    return sorted(k for k in persistent_kernels(module.source("cuda"))
                  if ptxas.get(k, {}).get("spill_stores") or ptxas.get(k, {}).get("stack"))


def _build(problem, opts, tspec, plan, gpu_or_reason, notes, applied, backward=None
           ) -> Module:
    """The module of ``plan`` (the persistent kernel's, or None: ``gpu_or_reason`` says why)
    and, in a training module, ``backward``: (the persistent backward kernel's plan, or None
    and why not)."""
    import tvm

    from ..lowering import sequence
    from . import pipeline
    from .cuda_binary import nvcc_callback, pack_imports_with_cubin

    tvm_target = tspec.tvm_target()
    try:
        lowered = sequence.build(problem, opts, tvm_target, plan, applied.database,
                                 backward[0] if backward else None)
    except RnnccError:
        raise
    except Exception as err:
        raise BuildError(f"lowering {problem.describe()} failed: {err}") from err
    ptxas: dict = {}
    workdir = tempfile.mkdtemp(prefix="rnncc_build_")
    path = os.path.join(workdir, f"{problem.cell.name}.so")
    try:
        if tspec.kind == "cuda":
            with (nvcc_callback(tspec.arch, ptxas),
                  tvm.transform.PassContext(config=pipeline.CONFIG)):
                executable = tvm.compile(lowered.mod, target=tvm_target,
                                         tir_pipeline=pipeline.register())
            cuda_source = executable.mod.imports[0].inspect_source()
        else:
            executable = tvm.compile(lowered.mod, target=tvm_target,
                                     tir_pipeline=pipeline.register("llvm"))
            cuda_source = None
    except RnnccError:
        raise
    except Exception as err:
        raise BuildError(f"TVM failed to build {problem.describe()} for {tspec.describe()}: "
                         f"{str(err).strip().splitlines()[-1]}") from err
    if plan is not None:
        persistent_info = {"plan": plan.as_dict(), "planned_for": gpu_or_reason.name,
                           "sms": gpu_or_reason.sms}
        if plan.pad:
            notes = notes + [f"batch {problem.batch}: no split into equal batch groups fits; the "
                             f"persistent kernel runs {problem.batch + plan.pad} rows, "
                             f"{plan.pad} of them zeros"]
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
        "params": list(problem.cell.params),
        "input_size": problem.input_size,
        "hidden_size": problem.hidden_size,
        "batch": problem.batch,
        "dtype": problem.dtype,
        "lengths": problem.lengths,
        "directions": problem.directions,
        "layers": problem.layers,
        "training": problem.training,
        "proj_size": problem.proj_size,
        "allow_tf32": problem.allow_tf32,
        "target": tspec.as_dict(),
        "schedule": {
            "kind": "persistent" if plan is not None else "sequence",
            "options": dataclasses.asdict(opts),
            "layout": dataclasses.asdict(lowered.layout),
            "rules": lowered.rules,
            "notes": lowered.notes + notes,
            "persistent": persistent_info,
            **({"persistent_backward": {"plan": backward[0].as_dict()} if backward[0]
                else {"reason": backward[1]}} if backward else {}),
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
