"""Tune the standard set on this machine's GPU and print default / tuned / cuDNN per step.

    python3 benchmarks/tune_standard.py [--batch 1 4 64] [--cells lstm gru] \
        [--log-dir tuning_logs] [--budget 300] [--trials 64] [--json out.json]

Each configuration runs ``rnncc tune`` (rnncc.tuning.tune): default, tuned and cuDNN are timed
in the same process, each CUDA-graph captured, float32 with TF32 off, T = 100, C = H. The logs
go to ``--log-dir``; the markdown table (with the GPU's name and the date) is what
docs/benchmarks.md shows.
"""

import argparse
import datetime

from rnncc.runtime.files import write_json
from rnncc.tuning import tune

HIDDEN = {"lstm": (256, 512, 1024, 1536), "gru": (512, 1024, 2048)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--cells", nargs="+", default=["lstm", "gru"])
    parser.add_argument("--hidden", type=int, nargs="+", help="only these hidden sizes")
    parser.add_argument("--log-dir", default="tuning_logs")
    parser.add_argument("--work-dir", default=None, help="parent of each tune's work directory")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds a configuration")
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for cell in args.cells:
        for hidden in HIDDEN[cell]:
            if args.hidden and hidden not in args.hidden:
                continue
            for batch in args.batch:
                work = (f"{args.work_dir}/{cell}_h{hidden}_n{batch}" if args.work_dir
                        else None)
                s = tune(cell, hidden, hidden, batch, trials=args.trials,
                         time_budget=args.budget, log_dir=args.log_dir, work_dir=work,
                         progress=lambda line: print(f"[tune] {line}", flush=True))
                per = 1e3 / s["steps"]
                rows.append({"cell": cell, "H": hidden, "N": batch, "schedule": s["schedule"],
                             "knobs": s["knobs"], "components": s["components"],
                             "default_us": s["default_ms"] * per,
                             "tuned_us": s["tuned_ms"] * per,
                             "cudnn_us": s["cudnn_ms"] * per, "seconds": s["seconds"]})
                if args.json:  # after each configuration, so a cut-off run keeps its rows
                    write_json(args.json, rows)
    print(f"\n{datetime.date.today().isoformat()}, T=100, float32 (TF32 off)\n")
    print("| cell | H | N | schedule | tuned with | default us/step | tuned us/step "
          "| cuDNN us/step | tuned vs cuDNN | tune s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        what = ", ".join([*(f"{k}={v}" for k, v in sorted(r["knobs"].items())),
                          *r["components"]]) or "defaults kept"
        print(f"| {r['cell']} | {r['H']} | {r['N']} | {r['schedule']} | {what} "
              f"| {r['default_us']:.2f} | {r['tuned_us']:.2f} | {r['cudnn_us']:.2f} "
              f"| {r['cudnn_us'] / r['tuned_us']:.2f}x | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
