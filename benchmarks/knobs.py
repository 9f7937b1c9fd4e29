"""A planner decision measured: each configuration's persistent module built with the planner's
plan and with each given set of knobs (``rnncc.compile(..., knobs=...)``), each checked against
float64 and timed (CUDA graph captured, the best of ``--rounds`` medians, the modules
alternated round by round), with cuDNN on the same inputs. Run on a GPU machine from the
repository root:

    python3 benchmarks/knobs.py lstm,512,512,8,bidirectional gru,640,640,4,bidirectional \\
        --knobs '{"batch_groups": 1}' [--knobs '{"sync": "barrier"}'] [--json out.json]

A configuration is CELL,C,H,N with an optional fifth field, ``bidirectional`` or ``l<L>`` (a
wavefront of L layers, C = H). Tuning logs are not applied (``tuning="off"``), so that the
planner's own plan is what "default" measures. Prints a markdown table with the GPU's name and
the date: the plan's batch groups, exchange, overlapped input steps and W_hh chunks in shared
memory, us a step, the error against float64 and cuDNN's us a step.
"""

import argparse
import datetime
import json
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

import rnncc
from rnncc.bench import random_problem, time_gpu
from rnncc.runtime.files import write_json


def _config(text: str) -> dict:
    fields = text.split(",")
    if len(fields) not in (4, 5):
        raise SystemExit(f"a configuration is CELL,C,H,N[,bidirectional|l<L>], got {text!r}")
    cell, sizes, variant = fields[0], [int(f) for f in fields[1:4]], fields[4:]
    out = {"cell": cell, "input_size": sizes[0], "hidden_size": sizes[1], "batch": sizes[2],
           "directions": 1, "layers": 1}
    if variant == ["bidirectional"]:
        out["directions"] = 2
    elif variant and variant[0].startswith("l") and variant[0][1:].isdigit():
        out["layers"] = int(variant[0][1:])
    elif variant:
        raise SystemExit(f"the fifth field is 'bidirectional' or l<L>, got {variant[0]!r}")
    return out


def _build(job):
    config, knobs, path = job
    try:
        rnncc.compile(config["cell"], config["input_size"], config["hidden_size"],
                      config["batch"], directions=config["directions"], layers=config["layers"],
                      target="cuda", tuning="off", persistent="on", knobs=knobs).export(path)
        return None
    except rnncc.RnnccError as err:
        return str(err)


def _error(module) -> float:
    """The module's relative error against float64 on fresh inputs (20 steps)."""
    import torch

    from rnncc import reference

    x64, w64 = random_problem(module, 20, seed=1)
    x = torch.tensor(x64, dtype=torch.float32, device="cuda")
    weights = {k: torch.tensor(v, dtype=torch.float32, device="cuda") for k, v in w64.items()}
    y, _ = module(x, module.pack(weights, entry="persistent"))
    ref, _ = reference.run_module(rnncc.cells.get(module.cell), x64, w64, module.directions,
                                  module.layers)
    return reference.relative_error(y.double().cpu().numpy(), ref)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="CELL,C,H,N[,bidirectional|l<L>]")
    parser.add_argument("--knobs", action="append", default=[], type=json.loads,
                        help="a JSON object of knobs, measured beside the default (repeatable)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json")
    args = parser.parse_args()
    configs = [_config(c) for c in args.configs]
    variants = [{}] + args.knobs
    folder = tempfile.mkdtemp(prefix="rnncc_knobs_")
    jobs = [(c, k, os.path.join(folder, f"{i}_{j}.so")) for i, c in enumerate(configs)
            for j, k in enumerate(variants)]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        failures = list(pool.map(_build, jobs))
    rows = []
    for (config, knobs, path), failure in zip(jobs, failures):
        row = {**config, "knobs": knobs, "failure": failure, "us": None, "cudnn_us": None}
        if failure is None:
            module = rnncc.load(path)
            row["plan"] = module.metadata["schedule"]["persistent"]["plan"]
            row["error"] = _error(module)
            row["module"] = module
        rows.append(row)
    device = None
    for round_ in range(args.rounds):
        for row in rows:
            if row["failure"] is None:
                timed = time_gpu(row["module"], args.steps, cudnn=round_ == 0 and not row["knobs"],
                                 entry="persistent")
                us = timed["rnncc"] * 1e3 / args.steps
                row["us"] = us if row["us"] is None else min(row["us"], us)
                if timed["cudnn"] is not None:
                    row["cudnn_us"] = timed["cudnn"] * 1e3 / args.steps
                device = timed["device"]
    print(f"{device}, {datetime.date.today()}, T = {args.steps}, float32, us a step\n")
    print("| configuration | knobs | groups, exchange, input steps, smem chunks | us | error "
          "| cuDNN |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        name = ",".join(str(row[k]) for k in ("cell", "input_size", "hidden_size", "batch"))
        name += ",bidirectional" if row["directions"] == 2 else ""
        name += f",l{row['layers']}" if row["layers"] > 1 else ""
        knobs = json.dumps(row["knobs"]) if row["knobs"] else "default"
        if row["failure"] is not None:
            print(f"| {name} | {knobs} | not built: {row['failure'][:120]} | | | |")
            continue
        p = row["plan"]
        cudnn = f"{row['cudnn_us']:.2f}" if row["cudnn_us"] is not None else ""
        print(f"| {name} | {knobs} | {p['batch_groups']}, {p['sync']}, {p['input_steps']}, "
              f"{p['smem_chunks']} | {row['us']:.2f} | {row['error']:.1e} | {cudnn} |")
        row.pop("module")
    if args.json:
        write_json(args.json, {"device": device, "date": str(datetime.date.today()),
                               "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
