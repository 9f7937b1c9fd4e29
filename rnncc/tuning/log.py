"""Tuning logs: one directory a (device, configuration).

    <root>/<device>/<cell>_c<C>_h<H>_n<N>_<precision>[_bidirectional][_l<L>]/
        rnncc.json                    rnncc's record (below)
        database_workload.json        MetaSchedule's JSON database, best record a workload
        database_tuning_record.json   (only when a tuned component beat its default schedule)

``rnncc.json``: {"format", "rnncc_version", "tvm_version", "device", "device_name", "config":
{cell, input_size, hidden_size, batch, dtype, target, and "directions": 2 for a
bidirectional layer, "layers": L for a wavefront of L layers}, "knobs" (the persistent
kernel's, {} for its defaults), "components" (the components the database schedules),
"measured" (milliseconds a call at "steps": default, tuned, cudnn), "search" (what was
tried), "created"}.

A log is refused (:class:`LogError`) when a file does not parse, a field is missing or wrong,
it was written by another TVM (MetaSchedule traces are not portable across versions), or it is
for another device or configuration than the one it is applied to.

The precision (a key's and a record's "dtype") is the storage dtype, or "tf32" for float32
with ``allow_tf32=True`` on CUDA (:func:`precision`): such a module's products are other
kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from ..errors import RnnccError

FORMAT = 1
RECORD = "rnncc.json"
WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
#: Where logs are looked for after the ones named: this variable (paths separated by ":"),
#: then the logs shipped with rnncc.
ENV = "RNNCC_TUNING_LOGS"


class LogError(RnnccError):
    """A tuning log that cannot be used; the message says which and why."""


def precision(problem, target_kind: str) -> str:
    """The precision a log of ``problem`` for a ``target_kind`` ("cuda", "llvm") is for: its
    dtype, or "tf32" where it allows TF32 on CUDA (on a CPU TF32 changes no kernel)."""
    return "tf32" if problem.allow_tf32 and target_kind == "cuda" else problem.dtype


@dataclass(frozen=True)
class LogKey:
    """What a log is for: a device and one configuration (``dtype``: :func:`precision`;
    ``directions`` 2: a bidirectional layer; ``layers`` L > 1: a wavefront of L layers of
    input size H, one module)."""

    device: str
    cell: str
    input_size: int
    hidden_size: int
    batch: int
    dtype: str
    directions: int = 1
    layers: int = 1

    @property
    def name(self) -> str:
        return (f"{self.cell}_c{self.input_size}_h{self.hidden_size}_n{self.batch}"
                f"_{self.dtype}" + _variant(self.directions, self.layers))

    def config(self) -> dict:
        return {"cell": self.cell, "input_size": self.input_size,
                "hidden_size": self.hidden_size, "batch": self.batch, "dtype": self.dtype,
                **({"directions": 2} if self.directions == 2 else {}),
                **({"layers": self.layers} if self.layers > 1 else {})}


def _variant(directions: int, layers: int) -> str:
    """The end of a log's name past its precision."""
    return ("_bidirectional" if directions == 2 else "") + (f"_l{layers}" if layers > 1 else "")


@dataclass
class TuningLog:
    """A log read from ``path``: its record and, if it has one, its MetaSchedule database."""

    path: str
    key: LogKey
    record: dict
    has_database: bool

    @property
    def knobs(self) -> dict:
        return dict(self.record["knobs"])

    def database(self):
        """The MetaSchedule database (records of the components it schedules), or None."""
        if not self.has_database:
            return None
        from tvm.s_tir import meta_schedule as ms

        try:
            return ms.database.JSONDatabase(
                path_workload=os.path.join(self.path, WORKLOADS),
                path_tuning_record=os.path.join(self.path, RECORDS), allow_missing=False)
        except Exception as err:  # noqa: BLE001 - TVM's loader reports any damage this way
            raise LogError(f"tuning log {self.path}: its MetaSchedule database does not load "
                           f"({str(err).strip().splitlines()[-1]})") from err


def shipped_root() -> str:
    """The logs shipped with rnncc (the repository's tuning_logs/)."""
    from .. import tuning_logs

    return os.path.dirname(tuning_logs.__file__)


def roots(extra=()) -> list[str]:
    """Log roots in lookup order: ``extra``, then $RNNCC_TUNING_LOGS, then the shipped logs."""
    env = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    out = []
    for root in [*extra, *env, shipped_root()]:
        if root not in out:
            out.append(root)
    return out


def _need(record: dict, field: str, kind, path: str):
    if field not in record or not isinstance(record[field], kind) \
            or isinstance(record[field], bool) and kind is not bool:
        raise LogError(f"tuning log {path}: field {field!r} is missing or not a "
                       f"{getattr(kind, '__name__', kind)}")
    return record[field]


def _check_database(path: str) -> bool:
    """Whether the directory has a database; each of its lines must be JSON that points at a
    workload of the file."""
    have = [os.path.exists(os.path.join(path, f)) for f in (WORKLOADS, RECORDS)]
    if not any(have):
        return False
    if not all(have):
        raise LogError(f"tuning log {path}: {WORKLOADS} and {RECORDS} come together; one is "
                       "missing")
    counts = []
    for name in (WORKLOADS, RECORDS):
        rows = []
        with open(os.path.join(path, name)) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise LogError(f"tuning log {path}: {name} line {number} is not JSON "
                                   f"({err.msg})") from err
        counts.append(rows)
    workloads, records = counts
    for number, row in enumerate(records, 1):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], int)
                and 0 <= row[0] < len(workloads)):
            raise LogError(f"tuning log {path}: {RECORDS} line {number} does not name one of "
                           f"the {len(workloads)} workloads")
    return True


def read(path: str, expect: LogKey | None = None) -> TuningLog:
    """Read and check the log in directory ``path``; with ``expect``, refuse a log for another
    device or configuration."""
    import tvm

    record_path = os.path.join(path, RECORD)
    try:
        with open(record_path) as f:
            record = json.load(f)
    except FileNotFoundError as err:
        raise LogError(f"tuning log {path}: no {RECORD}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LogError(f"tuning log {path}: {RECORD} is not JSON ({err})") from err
    if not isinstance(record, dict):
        raise LogError(f"tuning log {path}: {RECORD} is not a JSON object")
    if record.get("format") != FORMAT:
        raise LogError(f"tuning log {path}: format {record.get('format')!r}, this rnncc reads "
                       f"format {FORMAT}")
    version = _need(record, "tvm_version", str, path)
    if version != tvm.__version__:
        raise LogError(f"tuning log {path} was written with TVM {version}; this is TVM "
                       f"{tvm.__version__}, whose schedules may differ: tune again")
    device = _need(record, "device", str, path)
    config = _need(record, "config", dict, path)
    for field, kind in (("cell", str), ("input_size", int), ("hidden_size", int),
                        ("batch", int), ("dtype", str)):
        _need(config, field, kind, path)
    knobs = _need(record, "knobs", dict, path)
    _need(record, "components", list, path)
    from ..errors import ConfigError
    from ..schedules.persistent.knobs import check_knobs

    try:
        check_knobs(knobs)
    except ConfigError as err:
        raise LogError(f"tuning log {path}: {err}") from err
    directions, layers = config.get("directions", 1), config.get("layers", 1)
    if directions not in (1, 2) or isinstance(directions, bool):
        raise LogError(f"tuning log {path}: config's directions must be 1 or 2, got "
                       f"{directions!r}")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise LogError(f"tuning log {path}: config's layers must be an integer >= 1, got "
                       f"{layers!r}")
    key = LogKey(device, config["cell"], config["input_size"], config["hidden_size"],
                 config["batch"], config["dtype"], directions, layers)
    if expect is not None and key != expect:
        raise LogError(f"tuning log {path} is for {describe(key)}, not {describe(expect)}")
    has_db = _check_database(path)
    if record["components"] and not has_db:
        raise LogError(f"tuning log {path}: names tuned components {record['components']} but "
                       "has no MetaSchedule database")
    return TuningLog(path, key, record, has_db)


def describe(key: LogKey) -> str:
    both = " bidirectional" if key.directions == 2 else ""
    stacked = f" {key.layers} layers" if key.layers > 1 else ""
    return (f"{key.cell} C={key.input_size} H={key.hidden_size} N={key.batch} {key.dtype}"
            f"{both}{stacked} on {key.device}")


def write(root: str, key: LogKey, record: dict, database_dir: str | None = None) -> str:
    """Write the log of ``key`` under ``root`` at once (a complete directory replaces the old
    one by rename, so a reader never sees half a log). ``database_dir``: a directory with a
    pruned MetaSchedule database to include. Returns the log's path."""
    import tvm

    from .._version import __version__

    record = {"format": FORMAT, "rnncc_version": __version__, "tvm_version": tvm.__version__,
              "device": key.device, **record, "config": {**key.config(),
                                                          **record.get("config", {})}}
    parent = os.path.join(root, key.device)
    os.makedirs(parent, exist_ok=True)
    final = os.path.join(parent, key.name)
    staging = tempfile.mkdtemp(prefix=f".{key.name}.", dir=parent)
    try:
        with open(os.path.join(staging, RECORD), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        if database_dir is not None:
            for name in (WORKLOADS, RECORDS):
                shutil.copyfile(os.path.join(database_dir, name), os.path.join(staging, name))
        read(staging, key)  # never leave a log this rnncc would refuse
        old = None
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=f".{key.name}.old.", dir=parent)
            os.rename(final, os.path.join(old, "log"))
        os.rename(staging, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.chmod(final, 0o755)
    return final


def find(key: LogKey, extra_roots=()):
    """(path of the exact log for ``key``, or None; logs of the same device, cell, dtype,
    batch, directions and layers for other sizes, and for a bidirectional key also the
    one-direction logs of every size, as (key, path) pairs) over the roots in lookup order."""
    exact, others = None, []
    for root in roots(extra_roots):
        base = os.path.join(root, key.device)
        if not os.path.isdir(base):
            continue
        if exact is None and os.path.isfile(os.path.join(base, key.name, RECORD)):
            exact = os.path.join(base, key.name)
        prefix = f"{key.cell}_c"
        suffixes = {directions: f"_n{key.batch}_{key.dtype}" + _variant(directions, key.layers)
                    for directions in (1, key.directions)}
        for name in sorted(os.listdir(base)):
            for directions, suffix in suffixes.items():
                if name == key.name or not (name.startswith(prefix) and name.endswith(suffix)):
                    continue
                try:
                    c, h = name[len(prefix):-len(suffix)].split("_h")
                    other = LogKey(key.device, key.cell, int(c), int(h), key.batch, key.dtype,
                                   directions, key.layers)
                except ValueError:
                    continue
                others.append((other, os.path.join(base, name)))
    return exact, others
