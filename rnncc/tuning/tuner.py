"""``rnncc tune``: tune one configuration on the device this runs on, write its log."""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..runtime.files import write_json
from . import log as logs
from . import meta
from .apply import for_compile
from .device import cpu_key, local_gpu

#: MetaSchedule trials when none are given.
DEFAULT_TRIALS = 64


def default_work_dir(key: logs.LogKey) -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(base, "rnncc", "tune", key.device, key.name)


@dataclass
class _Session:
    """One tuning run: what it tunes, where, and until when."""

    problem: object
    tspec: object
    key: logs.LogKey
    device_name: str
    sms: int | None
    work_dir: str
    steps: int
    deadline: float
    progress: object

    def compiled(self, **kw):
        from ..compiler.driver import compile_module

        p, t = self.problem, self.tspec
        return compile_module(p.cell, p.input_size, p.hidden_size, p.batch, dtype=p.dtype,
                              target=t.kind, arch=t.arch, cpu=t.cpu, sms=self.sms,
                              allow_tf32=p.allow_tf32, directions=p.directions,
                              layers=p.layers, **kw)


def tune(cell, input_size: int, hidden_size: int, batch: int, *, dtype: str = "float32",
         target: str = "cuda", arch: str | None = None, cpu: str | None = None,
         trials: int = DEFAULT_TRIALS, time_budget: float = 300.0, log_dir: str = "tuning_logs",
         work_dir: str | None = None, steps: int = 100, rpc: str | None = None,
         allow_tf32: bool = False, directions: int = 1, layers: int = 1,
         progress=print) -> dict:
    """Tune one layer configuration here (CUDA: on this machine's GPU 0) within
    ``time_budget`` seconds, write its log under ``log_dir`` and return the summary.

    Persistent configurations search the kernel's knobs; the others tune their static
    components with MetaSchedule (``trials`` in all, measured here or through ``rpc``,
    "host:port:key" of a TVM RPC tracker). What was measured stays in ``work_dir`` (default
    ~/.cache/rnncc/tune/<device>/<config>; one configuration's only), so running the same
    command again resumes. The tuned module is kept only where it beats the default: a log
    never makes a module slower than its untuned schedule, as measured here. ``allow_tf32``:
    tune the module that allows TF32 (its own log, "tf32" in place of the dtype).
    ``directions`` 2: tune the bidirectional layer (its own log, which bidirectional modules
    and networks' layers then take); ``layers`` L > 1: the wavefront of L layers of input size
    H (its own log, which such wavefront modules and the networks that run on them take).
    """
    start = time.monotonic()
    if trials < 0 or time_budget <= 0 or steps < 1:
        raise ConfigError("trials must be >= 0, time budget > 0 and steps >= 1")
    _check_before_measuring(log_dir, rpc)
    session = _session(cell, input_size, hidden_size, batch, dtype, target, arch, cpu,
                       work_dir, steps, start + time_budget, progress, allow_tf32, directions,
                       layers)
    progress(f"tuning {logs.describe(session.key)} ({session.device_name}); budget "
             f"{time_budget:.0f} s, work directory {session.work_dir}")
    default = session.compiled(tuning="off")
    default_ms, cudnn_ms = _time(default, steps, session.tspec, cudnn=True)
    progress(f"default: {default.metadata['schedule']['kind']} schedule, "
             f"{default_ms * 1e3 / steps:.2f} us/step")
    found = _search(session, trials, rpc)
    tuned_ms = _keep_if_faster(session, found, default_ms)
    summary = {
        "default_ms": default_ms, "tuned_ms": tuned_ms, "cudnn_ms": cudnn_ms, "steps": steps,
        "schedule": default.metadata["schedule"]["kind"],
    }
    path = _write_log(session, found, summary, log_dir, start, bool(rpc))
    summary.update(log=path, knobs=found.knobs, components=found.kept_components,
                   speedup=default_ms / tuned_ms, seconds=time.monotonic() - start)
    progress(f"done in {summary['seconds']:.0f} s: default {default_ms * 1e3 / steps:.2f} "
             f"us/step, tuned {tuned_ms * 1e3 / steps:.2f} us/step "
             f"({summary['speedup']:.2f}x)"
             + (f", cuDNN {cudnn_ms * 1e3 / steps:.2f} us/step" if cudnn_ms else "")
             + f"; log {path}")
    return summary


def _check_before_measuring(log_dir: str, rpc: str | None) -> None:
    """Refuse, before any time is spent, a log folder that cannot be written and an ``rpc``
    that is not HOST:PORT:KEY."""
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write tuning logs under {log_dir!r}: {err.strerror}") from err
    if not os.access(log_dir, os.W_OK):
        raise ConfigError(f"cannot write tuning logs under {log_dir!r}: permission denied")
    if rpc is not None:
        parts = rpc.rsplit(":", 2)
        if len(parts) != 3 or not (parts[0] and parts[1].isdigit() and parts[2]):
            raise ConfigError(f"--rpc must be HOST:PORT:KEY (e.g. 127.0.0.1:9190:h200), got "
                              f"{rpc!r}")


def _session(cell, input_size, hidden_size, batch, dtype, target, arch, cpu, work_dir, steps,
             deadline, progress, allow_tf32=False, directions=1, layers=1) -> _Session:
    """The problem and the device it is tuned on (CUDA: this machine's GPU, or an error)."""
    from ..compiler.driver import resolve_cell
    from ..spec import Problem
    from ..target import TargetSpec

    problem = Problem(resolve_cell(cell), input_size, hidden_size, batch, dtype,
                      directions=directions, layers=layers, allow_tf32=allow_tf32)
    tspec = TargetSpec(target, arch, cpu)
    if layers > 1 and tspec.kind != "cuda":
        raise ConfigError(f"a wavefront of {layers} layers runs only on the cuda target (one "
                          f"persistent kernel); got {tspec.kind}: tune it on the GPU machine")
    if tspec.kind == "cuda":
        here = local_gpu()
        if here is None:
            raise ConfigError("tuning measures on the GPU it runs on, and this machine has no "
                              "CUDA GPU; run rnncc tune on the GPU machine (or --target llvm)")
        device, device_name, sms = here
    else:
        device, device_name, sms = cpu_key(tspec.cpu), cpu_key(tspec.cpu), None
    key = logs.LogKey(device, problem.cell.name, input_size, hidden_size, batch,
                      logs.precision(problem, tspec.kind), directions, layers)
    work_dir = _claim(work_dir or default_work_dir(key), key)
    return _Session(problem, tspec, key, device_name, sms, work_dir, steps, deadline, progress)


def _claim(work_dir: str, key: logs.LogKey) -> str:
    """``work_dir``, made and stamped (``config.json``) with the configuration whose
    measurements it keeps; a ConfigError where it keeps another's (a resumed tune would take
    them for its own)."""
    os.makedirs(work_dir, exist_ok=True)
    stamp = os.path.join(work_dir, "config.json")
    mine = {"device": key.device, "config": key.name}
    try:
        with open(stamp) as f:
            theirs = json.load(f)
    except FileNotFoundError:
        write_json(stamp, mine)
        return work_dir
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {stamp!r} ({err}); give another work directory") from err
    if not isinstance(theirs, dict):
        raise ConfigError(f"{stamp!r} is not a work directory's stamp; give another work "
                          "directory")
    if theirs != mine:
        raise ConfigError(
            f"work directory {work_dir!r} keeps the measurements of {theirs.get('config')} on "
            f"{theirs.get('device')}, not of {key.name} on {key.device}: give another work "
            "directory (by default each configuration has its own, under "
            f"{os.path.dirname(os.path.dirname(default_work_dir(key)))})")
    return work_dir


@dataclass
class _Found:
    """What a search found: persistent knobs, or MetaSchedule's components and database."""

    knobs: dict = field(default_factory=dict)
    components: list = field(default_factory=list)
    search: dict = field(default_factory=dict)
    pruned: str | None = None

    @property
    def kept_components(self) -> list:
        return self.components if self.pruned else []


def _search(session: _Session, trials: int, rpc: str | None) -> _Found:
    """The persistent kernel's knobs where it has a plan, else MetaSchedule on the static
    components."""
    from ..compiler.driver import _options, _persistent_plan
    from ..schedules.persistent.planner import REG_MARGIN

    plan, gpu = _persistent_plan(session.problem, _options({}), session.tspec, session.sms,
                                 REG_MARGIN, {})
    if plan is not None:
        return _search_knobs(session, gpu)
    return _tune_components(session, trials, rpc)


def _search_knobs(session: _Session, gpu) -> _Found:
    """Knob search from the planner's default and a nearby configuration's tuned knobs; the
    fastest candidate that passed its check."""
    from .knob_search import search as knob_search

    problem, tspec = session.problem, session.tspec
    near = for_compile(problem, tspec, session.key.device, "auto")
    start_knobs = near.knobs if near.info.get("match") == "nearby" else {}
    spec = {**session.key.config(), "cell": _cell_ref(problem.cell), "arch": tspec.arch,
            "sms": session.sms, "dtype": problem.dtype, "allow_tf32": problem.allow_tf32}
    results = knob_search(problem, spec, gpu, os.path.join(session.work_dir, "persistent"),
                          session.steps, session.deadline, start_knobs, session.progress)
    valid = [r for r in results if r["ms"] is not None]
    search = {"persistent_candidates": len(results),
              "rejected": {json_key(r["knobs"]): r["why"] for r in results if r["ms"] is None}}
    return _Found(knobs=min(valid, key=lambda r: r["ms"])["knobs"] if valid else {},
                  search=search)


def _tune_components(session: _Session, trials: int, rpc: str | None) -> _Found:
    """MetaSchedule on the components with static shapes (``trials`` in all), its database
    pruned to the best record of each."""
    funcs = meta.tunable(_lowered(session.problem, session.tspec))
    if not funcs:
        session.progress("no component with static shapes to tune")
        return _Found()
    if trials == 0:
        return _Found()
    database = meta.tune(funcs, session.tspec.tvm_target(),
                         os.path.join(session.work_dir, "ms"), trials, session.deadline, rpc,
                         session.progress)
    pruned = meta.prune(database, os.path.join(session.work_dir, "pruned")) if len(
        database) else None
    return _Found(components=sorted(funcs), pruned=pruned,
                  search={"meta_schedule_trials": len(database), "tasks": sorted(funcs)})


def _keep_if_faster(session: _Session, found: _Found, default_ms: float) -> float:
    """Time the module the found log gives; keep it only if faster than the default (else
    ``found`` is emptied). The ms a call that the log stands for."""
    if not (found.knobs or found.pruned):
        return default_ms
    record = {"knobs": found.knobs, "components": found.components}
    trial_log = logs.write(os.path.join(session.work_dir, "candidate"), session.key, record,
                           found.pruned)
    tuned_ms, _ = _time(session.compiled(tuning=trial_log), session.steps, session.tspec)
    if tuned_ms < default_ms:
        return tuned_ms
    session.progress(f"tuned {tuned_ms * 1e3 / session.steps:.2f} us/step is not faster than "
                     "the default: the log keeps the default schedule")
    found.knobs, found.components, found.pruned = {}, [], None
    return default_ms


def _write_log(session: _Session, found: _Found, summary: dict, log_dir: str, start: float,
               rpc: bool) -> str:
    record = {
        "device_name": session.device_name,
        "config": {"target": session.tspec.as_dict()},
        "knobs": found.knobs, "components": found.kept_components,
        "measured": summary,
        "search": {**found.search, "seconds": round(time.monotonic() - start, 1), "rpc": rpc},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return logs.write(log_dir, session.key, record, found.pruned)


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

