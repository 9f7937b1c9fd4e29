"""One layer built by two versions of rnncc, timed alternately in one process: the before and
after of a change, on the same GPU at the same moment (cuDNN beside them). Each tree builds its
modules (``build``, run with that tree first on PYTHONPATH); one process then loads both sets
(the runtime reads either), checks each against float64 and times them round by round, the best
of each side's rounds. Run on a GPU machine from the repository root:

    git archive OLD rnncc schedules tuning_logs benchmarks pyproject.toml | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:$PYTHONPATH RNNCC_CACHE_DIR=/tmp/ca \\
        python3 benchmarks/ab.py build /tmp/A lstm,2048,2048,16,float32 gru,1536,1536,16,tf32
    RNNCC_CACHE_DIR=/tmp/cb python3 benchmarks/ab.py build /tmp/B lstm,2048,2048,16,float32 ...
    python3 benchmarks/ab.py time /tmp/A /tmp/B lstm,2048,2048,16,float32 ... [--json out.json]

A knob of the persistent kernel against its default, in one tree: ``build /tmp/B ...
--knobs '{"mean_partials": true}'`` (a configuration whose plan the knobs do not fit is a row
that says so); compile options likewise, ``--options '{"persistent": "off"}'`` (any of
:func:`rnncc.compile`'s options). More sides in the same rounds: ``time /tmp/A /tmp/B --also
/tmp/C ...`` (each against A).

A configuration is CELL,C,H,N,DTYPE (float32, tf32: float32 with allow_tf32, float16,
bfloat16). Separate cache directories: the cache key does not see a code change. Prints a
markdown table, a row as each configuration is measured (``--json`` rewritten after each, so
a run cut short keeps what it measured), the GPU's name last: us a step (T = ``--steps``) of A,
B and cuDNN, B's gain, and both errors.
"""

import argparse
import datetime
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

DTYPES = ("float32", "tf32", "float16", "bfloat16")


def _config(text: str) -> tuple:
    fields = text.split(",")
    if len(fields) != 5 or not all(f.isdigit() for f in fields[1:4]) or fields[4] not in DTYPES:
        raise SystemExit(f"a configuration is CELL,C,H,N,DTYPE (DTYPE: {', '.join(DTYPES)}), "
                         f"got {text!r}")
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3]), fields[4]


def _file(config) -> str:
    return "{}_{}_{}_{}_{}.so".format(*config)


def _build(job) -> str:
    import rnncc

    config, folder, knobs, options = job
    cell, c, h, n, dtype = config
    precision = {"dtype": "float32", "allow_tf32": True} if dtype == "tf32" else {"dtype": dtype}
    precision.update(options or {})
    if knobs:
        precision["knobs"] = knobs
    try:
        rnncc.compile(cell, c, h, n, target="cuda", **precision).export(
            os.path.join(folder, _file(config)))
        return "built"
    except Exception as err:  # noqa: BLE001 - a configuration that does not build is a row
        return f"error: {type(err).__name__}: {str(err).splitlines()[0]}"


def _error(module) -> float:
    """The module's relative error against float64 on fresh inputs (20 steps)."""
    import torch

    import rnncc
    from rnncc import reference
    from rnncc.bench import random_problem

    x64, w64 = random_problem(module, 20, seed=1)
    dt = getattr(torch, module.dtype)
    x = torch.tensor(x64, dtype=dt, device="cuda")
    weights = {k: torch.tensor(v, dtype=dt, device="cuda") for k, v in w64.items()}
    y, _ = module(x, module.pack(weights))
    ref, _ = reference.run_module(rnncc.cells.get(module.cell), x64, w64, module.directions,
                                  module.layers)
    return reference.relative_error(y.double().cpu().numpy(), ref)


def _time(folders, configs, steps: int, rounds: int):
    """(device, row) for each configuration, as it is measured."""
    import rnncc
    from rnncc.bench import time_gpu

    device = ""
    for config in configs:
        paths = [os.path.join(folder, _file(config)) for folder in folders]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            yield device, {"config": config, "missing": missing}
            continue
        modules = [rnncc.load(p) for p in paths]
        row = {"config": config, "errors": [_error(m) for m in modules],
               "us": [None] * len(modules), "cudnn_us": None}
        for _ in range(rounds):
            for side, module in enumerate(modules):
                timed = time_gpu(module, steps, cudnn=row["cudnn_us"] is None)
                us = timed["rnncc"] * 1e3 / steps
                row["us"][side] = us if row["us"][side] is None else min(row["us"][side], us)
                if timed["cudnn"] is not None:
                    row["cudnn_us"] = timed["cudnn"] * 1e3 / steps
                device = timed["device"]
        yield device, row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="this tree's modules into FOLDER")
    build.add_argument("folder")
    build.add_argument("configs", nargs="+", type=_config, help="CELL,C,H,N,DTYPE")
    build.add_argument("--jobs", type=int, default=os.cpu_count())
    build.add_argument("--knobs", type=json.loads, default=None,
                       help="the persistent kernel's knobs, JSON")
    build.add_argument("--options", type=json.loads, default=None,
                       help="rnncc.compile's options, JSON (e.g. {\"persistent\": \"off\"})")
    timing = sub.add_parser("time", help="A's and B's modules, alternately")
    timing.add_argument("a")
    timing.add_argument("b")
    timing.add_argument("--also", action="append", default=[], metavar="FOLDER",
                        help="more sides, each timed in the same rounds against A")
    timing.add_argument("configs", nargs="+", type=_config, help="CELL,C,H,N,DTYPE")
    timing.add_argument("--steps", type=int, default=100)
    timing.add_argument("--rounds", type=int, default=4)
    timing.add_argument("--json")
    args = parser.parse_args()
    if args.command == "build":
        os.makedirs(args.folder, exist_ok=True)
        with ProcessPoolExecutor(max(1, args.jobs)) as pool:
            for config, result in zip(args.configs, pool.map(
                    _build, [(c, args.folder, args.knobs, args.options)
                             for c in args.configs])):
                print(",".join(map(str, config)), result)
        return
    sides = [args.a, args.b, *args.also]
    names = "ABCDEFGH"[:len(sides)]
    print(f"{datetime.date.today()}, T = {args.steps}, us a step, best of {args.rounds} "
          f"rounds; " + ", ".join(f"{n}: {s}" for n, s in zip(names, sides)) + "\n")
    heads = ["A"] + [c for n in names[1:] for c in (n, f"A / {n}")]
    print("| configuration | " + " | ".join(heads) + f" | cuDNN | errors {', '.join(names)} |")
    print("| --- " * (len(heads) + 3) + "|", flush=True)
    rows, device = [], ""
    for device, row in _time(sides, args.configs, args.steps, args.rounds):
        rows.append(row)
        name = ",".join(map(str, row["config"]))
        if "missing" in row:
            print(f"| {name} | not built: {', '.join(row['missing'])} |" + " |" * (len(heads) + 1))
        else:
            a, *others = row["us"]
            cells = [f"{a:.2f}"] + [c for o in others for c in (f"{o:.2f}", f"{a / o:.2f}x")]
            cudnn = f"{row['cudnn_us']:.2f}" if row["cudnn_us"] is not None else "-"
            errors = ", ".join(f"{e:.1e}" for e in row["errors"])
            print(f"| {name} | " + " | ".join(cells) + f" | {cudnn} | {errors} |", flush=True)
        if args.json:  # after each row: a run cut short keeps what it measured
            write_json(args.json, {"device": device, "date": str(datetime.date.today()),
                                   "a": args.a, "b": args.b, "also": args.also, "rows": rows})
    print(f"\n{device or 'no GPU timed'}")


if __name__ == "__main__":
    sys.exit(main())
