"""What a compile takes from the tuning logs.

An exact log (same device and configuration) gives the persistent knobs and the MetaSchedule
records of the components it tuned. Without one, the log of the nearest hidden size for the
same device, cell, dtype and batch gives its persistent knobs only (a starting point: the
planner re-checks them for this size; component records are per shape and never carry over),
less those of the fused input projection and the grid's cap (:data:`SIZE_KNOBS`): whether
the projection fits, and how, and how many blocks a size takes, are the planner's to decide
at each size. A bidirectional layer takes its own log (``rnncc tune
--bidirectional``); without one, the nearest of its other sizes' and of its one direction's
logs the same way (each direction then runs that plan, its input projections as the planner
decides for two directions). A wavefront of layers takes only logs of as many layers
(``rnncc tune --layers``): a layer's log tunes a layer alone, on all the multiprocessors. A
module that allows TF32 takes a TF32 log (:func:`.log.precision`), else the float32 one's
knobs as a float32 module would (its component records schedule IEEE components, which a
TF32 module's are not). A GPU kind with no log of its own for a configuration takes its
sibling's (:data:`SIBLINGS`: the same architecture and size).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import log as logs
from .device import cpu_key, local_gpu

#: Knobs a nearby size's log does not pass on: forced at a size where they do not fit, those
#: of the fused input projection would leave the module without its persistent kernel, and a
#: cap on the grid tuned for one H gives another more weights a block (H200, us a step, LSTM
#: 256 at batch 1's max_blocks=8 passed on / not: LSTM 160 0.96 / 0.83, 288 1.75 / 1.24, 384
#: 2.13 / 1.20).
SIZE_KNOBS = ("input_rows", "input_steps", "max_blocks")
#: GPU kinds of one architecture and size (sm_90, 132 multiprocessors, the same registers,
#: shared memory and L2 a multiprocessor): each takes the other's logs where it has none of its
#: own. Measured on an H100 with the H200 logs (us a step): GRU 1024 float16 at batch 64 7.07
#: against 11.14 without, GRU 2048 at batch 4 9.34 against 9.88; none more than 4% slower.
SIBLINGS = {"h100": "h200", "h200": "h100"}
#: A nearby size's log passes its knobs on only within this ratio of hidden sizes: a plan
#: tuned for H 512 is not one for H 64 (H200, us a step: float32 GRU 64 at batch 64 with GRU
#: 512's sync="grid" 1.64, its own plan 0.66; LSTM 64 at batch 1 with LSTM 256's
#: sync="tagged" and 8 blocks 0.83, one block that keeps h to itself 0.55).
NEARBY_RATIO = 2


@dataclass
class Applied:
    """Knobs and database to compile with, and what the module's metadata says about them."""

    knobs: dict = field(default_factory=dict)
    database: object = None
    info: dict = field(default_factory=dict)


def device_for(tspec, gpu: str | None) -> tuple[str | None, str]:
    """(device key of the logs, how it was found) for a target; the key is None when no GPU
    kind is known (a CUDA compile on a machine without a GPU, and no ``gpu`` given)."""
    if tspec.kind == "llvm":
        return cpu_key(tspec.cpu), "llvm target"
    if gpu:
        return gpu.lower(), "given"
    found = local_gpu()
    if found is None:
        return None, "no GPU here; name one (gpu='h200', --gpu h200) to use its tuning logs"
    return found[0], f"this machine's {found[1]}"


def for_compile(problem, tspec, gpu: str | None, tuning) -> Applied:
    """``tuning``: "auto" (the logs' lookup order), "off", or the path of one log directory
    (refused with a ConfigError when it does not fit the configuration)."""
    if tuning == "off":
        return Applied(info={"log": None, "reason": "tuning logs off"})
    if problem.proj_size:
        return Applied(info={"log": None, "reason": "no tuning logs for projections yet"})
    device, how = device_for(tspec, gpu)
    if tuning != "auto":
        try:
            found = logs.read(tuning)
        except logs.LogError as err:
            raise ConfigError(str(err)) from err
        want = _key(problem, tspec, device or found.key.device)
        if found.key != want:
            raise ConfigError(f"tuning log {tuning} is for {logs.describe(found.key)}, not "
                              f"{logs.describe(want)}")
        return _exact(found)
    if device is None:
        return Applied(info={"log": None, "reason": how})
    found = _for_device(problem, tspec, device)
    sibling = SIBLINGS.get(device)
    if found.info["log"] is None and sibling is not None:
        theirs = _for_device(problem, tspec, sibling)
        if theirs.info["log"] is not None:
            theirs.info["for_device"] = f"{device}, which has no log of its own"
            return theirs
    return found


def _for_device(problem, tspec, device: str) -> Applied:
    """The logs of ``device`` for ``problem``: its own precision's, else (TF32) float32's
    knobs."""
    key = _key(problem, tspec, device)
    found = _lookup(problem, key)
    if found.info["log"] is None and key.dtype == "tf32":  # no TF32 log: float32's knobs
        ieee = _lookup(problem, _key(problem, tspec, device, "float32"), records=False)
        if ieee.info["log"] is not None:
            ieee.info["precision"] = "float32 log"
            return ieee
    return found


def _lookup(problem, key: logs.LogKey, records: bool = True) -> Applied:
    """The exact log of ``key``, else the nearest size's knobs (H within
    :data:`NEARBY_RATIO`), else none; ``records``: an exact log's component records too (its
    MetaSchedule database, read only then)."""
    device = key.device
    exact, others = logs.find(key)
    refused = {}
    if exact is not None:
        try:
            return _exact(logs.read(exact, key), records)
        except logs.LogError as err:
            warnings.warn(f"rnncc: {err}; compiling without it", stacklevel=3)
            refused = {"refused": exact, "reason": str(err)}
    near = [(o, p) for o, p in others
            if max(o.hidden_size, key.hidden_size) <= NEARBY_RATIO * min(o.hidden_size,
                                                                        key.hidden_size)]
    for other, path in sorted(near, key=lambda o: _distance(o[0], key)):
        try:
            near = logs.read(path, other)
        except logs.LogError as err:
            warnings.warn(f"rnncc: {err}; a nearby size's log skipped", stacklevel=3)
            continue
        knobs = {k: v for k, v in near.knobs.items() if k not in SIZE_KNOBS}
        return Applied(knobs=knobs, info={
            "log": path, "match": "nearby", "device": device, **refused,
            "applied": {"knobs": knobs, "components": []}})
    return Applied(info={"log": None, **(refused or {
        "reason": f"no tuning log for {logs.describe(key)}"})})


def refuse_knobs(applied: Applied, reason: str) -> Applied:
    """``applied`` without its log's knobs, which do not fit the configuration (``reason``),
    nor its records: the metadata names the log as refused."""
    warnings.warn(f"rnncc: the knobs of tuning log {applied.info['log']} do not fit: "
                  f"{reason}; compiling without the log", stacklevel=3)
    return Applied(info={"log": None, "refused": applied.info["log"], "reason": reason})


def _exact(found: logs.TuningLog, records: bool = True) -> Applied:
    components = list(found.record["components"]) if records else []
    return Applied(knobs=found.knobs, database=found.database() if records else None, info={
        "log": found.path, "match": "exact", "device": found.key.device,
        "tvm_version": found.record["tvm_version"],
        "applied": {"knobs": found.knobs, "components": components}})


def _key(problem, tspec, device: str, precision: str | None = None) -> logs.LogKey:
    return logs.LogKey(device, problem.cell.name, problem.input_size, problem.hidden_size,
                       problem.batch, precision or logs.precision(problem, tspec.kind),
                       problem.directions, problem.layers)


def _distance(a: logs.LogKey, b: logs.LogKey) -> tuple:
    """The sizes first: a bidirectional layer's one direction at its size comes before its
    own log of another size."""
    return (abs(a.hidden_size - b.hidden_size), abs(a.input_size - b.input_size),
            a.directions != b.directions)
