"""``rnncc tune``: tune one configuration on the device this runs on, write its log."""

from __future__ import annotations

import datetime
import os
import time

from ..errors import ConfigError
from . import log as logs
from . import meta
from .apply import for_compile
from .device import cpu_key, local_gpu

#: MetaSchedule trials when none are given.
DEFAULT_TRIALS = 64


def default_work_dir(key: logs.LogKey) -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(base, "rnncc", "tune", key.device, key.name)


def tune(cell, input_size: int, hidden_size: int, batch: int, *, dtype: str = "float32",
         target: str = "cuda", arch: str | None = None, cpu: str | None = None,
         trials: int = DEFAULT_TRIALS, time_budget: float = 300.0, log_dir: str = "tuning_logs",
         work_dir: str | None = None, steps: int = 100, rpc: str | None = None,
         progress=print) -> dict:
    """Tune one layer configuration here (CUDA: on this machine's GPU 0) within
    ``time_budget`` seconds, write its log under ``log_dir`` and return the summary.

    Persistent configurations search the kernel's knobs; the others tune their static
    components with MetaSchedule (``trials`` in all, measured here or through ``rpc``,
    "host:port:key" of a TVM RPC tracker). What was measured stays in ``work_dir`` (default
    ~/.cache/rnncc/tune/<device>/<config>), so running the same command again resumes. The
    tuned module is kept only where it beats the default: a log never makes a module slower
    than its untuned schedule, as measured here.
    """
    from ..compiler.driver import _options, _persistent_plan, compile_module, resolve_cell
    from ..schedules.persistent.planner import REG_MARGIN
    from ..spec import Problem
    from ..target import TargetSpec

    start = time.monotonic()
    deadline = start + time_budget
    if trials < 0 or time_budget <= 0 or steps < 1:
        raise ConfigError("trials must be >= 0, time budget > 0 and steps >= 1")
    problem = Problem(resolve_cell(cell), input_size, hidden_size, batch, dtype)
    tspec = TargetSpec(target, arch, cpu)
    if tspec.kind == "cuda":
        here = local_gpu()
        if here is None:
            raise ConfigError("tuning measures on the GPU it runs on, and this machine has no "
                              "CUDA GPU; run rnncc tune on the GPU machine (or --target llvm)")
        device, device_name, sms = here
    else:
        device, device_name, sms = cpu_key(tspec.cpu), cpu_key(tspec.cpu), None
    key = logs.LogKey(device, problem.cell.name, input_size, hidden_size, batch, dtype)
    work_dir = work_dir or default_work_dir(key)
    os.makedirs(work_dir, exist_ok=True)
    common = dict(dtype=dtype, target=tspec.kind, arch=tspec.arch, cpu=tspec.cpu, sms=sms)

    def compiled(**kw):
        return compile_module(problem.cell, input_size, hidden_size, batch, **common, **kw)

    progress(f"tuning {logs.describe(key)} ({device_name}); budget {time_budget:.0f} s, "
             f"work directory {work_dir}")
    default = compiled(tuning="off")
    default_ms, cudnn_ms = _time(default, steps, tspec, cudnn=True)
    progress(f"default: {default.metadata['schedule']['kind']} schedule, "
             f"{default_ms * 1e3 / steps:.2f} us/step")

    plan, gpu = _persistent_plan(problem, _options({}), tspec, sms, REG_MARGIN, {})
    knobs, components, search, database = {}, [], {}, None
    if plan is not None:
        from .knob_search import search as knob_search

        near = for_compile(problem, tspec, device, "auto")
        start_knobs = near.knobs if near.info.get("match") == "nearby" else {}
        spec = {**key.config(), "cell": _cell_ref(problem.cell), "arch": tspec.arch,
                "sms": sms}
        results = knob_search(problem, spec, gpu, os.path.join(work_dir, "persistent"), steps,
                              deadline, start_knobs, progress)
        valid = [r for r in results if r["ms"] is not None]
        search = {"persistent_candidates": len(results),
                  "rejected": {json_key(r["knobs"]): r["why"] for r in results
                               if r["ms"] is None}}
        if valid:
            knobs = min(valid, key=lambda r: r["ms"])["knobs"]
    else:
        lowered = _lowered(problem, tspec)
        funcs = meta.tunable(lowered)
        if funcs and trials > 0:
            database = meta.tune(funcs, tspec.tvm_target(), os.path.join(work_dir, "ms"),
                                 trials, deadline, rpc, progress)
            search = {"meta_schedule_trials": len(database), "tasks": sorted(funcs)}
            components = sorted(funcs)
        elif not funcs:
            progress("no component with static shapes to tune")
    pruned = None
    if database is not None and len(database):
        pruned = meta.prune(database, os.path.join(work_dir, "pruned"))
    tuned_ms = default_ms
    if knobs or pruned:
        record = {"knobs": knobs, "components": components}
        trial_log = logs.write(os.path.join(work_dir, "candidate"), key, record, pruned)
        tuned = compiled(tuning=trial_log)
        tuned_ms, _ = _time(tuned, steps, tspec)
        if tuned_ms >= default_ms:
            progress(f"tuned {tuned_ms * 1e3 / steps:.2f} us/step is not faster than the "
                     "default: the log keeps the default schedule")
            knobs, components, pruned, tuned_ms = {}, [], None, default_ms
    summary = {
        "default_ms": default_ms, "tuned_ms": tuned_ms, "cudnn_ms": cudnn_ms, "steps": steps,
        "schedule": default.metadata["schedule"]["kind"],
    }
    record = {
        "device_name": device_name,
        "config": {"target": tspec.as_dict()},
        "knobs": knobs, "components": components if pruned else [],
        "measured": summary,
        "search": {**search, "seconds": round(time.monotonic() - start, 1), "rpc": bool(rpc)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = logs.write(log_dir, key, record, pruned)
    summary.update(log=path, knobs=knobs, components=record["components"],
                   speedup=default_ms / tuned_ms, seconds=time.monotonic() - start)
    progress(f"done in {summary['seconds']:.0f} s: default {default_ms * 1e3 / steps:.2f} "
             f"us/step, tuned {tuned_ms * 1e3 / steps:.2f} us/step "
             f"({summary['speedup']:.2f}x)"
             + (f", cuDNN {cudnn_ms * 1e3 / steps:.2f} us/step" if cudnn_ms else "")
             + f"; log {path}")
    return summary


def json_key(knobs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "default"


def _cell_ref(cell):
    """What a build process needs to find the cell: its name, or its file for a user cell."""
    return cell.source if cell.source else cell.name


def _lowered(problem, tspec):
    from ..compiler.driver import _options
    from ..lowering import sequence

    return sequence.build(problem, _options({}), tspec.tvm_target())


def _time(module, steps: int, tspec, cudnn: bool = False):
    """(ms a call of ``module``, ms of cuDNN or None) measured here."""
    from .. import bench

    if tspec.kind == "cuda":
        out = bench.time_gpu(module, steps, cudnn=cudnn)
        return out["rnncc"], out["cudnn"]
    return bench.time_cpu(module, steps), None

