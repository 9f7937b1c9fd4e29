"""The batch-64 table (or any batches of the standard set): rnncc as `rnncc compile` builds it
(shipped tuning logs applied), the same without tuning logs, and cuDNN through PyTorch, each
CUDA-graph captured, T = 100, C = H, float32 with TF32 off on both sides. Run on a GPU machine
from the repository root:

    python3 benchmarks/batch64.py [--repeat 100] [--batch 1 4 64] [--jobs 8]

Prints a markdown table with the GPU's name and the date, as in docs/benchmarks.md. The modules
are compiled first, ``--jobs`` at a time in worker processes, then timed one by one.
"""

import argparse
import datetime
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

import rnncc
from rnncc.bench import time_gpu

CONFIGS = [("lstm", h) for h in (256, 512, 1024, 1536)] + [("gru", h) for h in (512, 1024, 2048)]


def _compile(job):
    (cell, hidden, batch, tuning), folder = job
    path = os.path.join(folder, f"{cell}_{hidden}_{batch}_{tuning}.so")
    return rnncc.compile(cell, hidden, hidden, batch, target="cuda", tuning=tuning).export(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="modules compiled at once")
    args = parser.parse_args()
    per = 1e3 / args.steps
    configs = [(cell, hidden, batch) for batch in args.batch for cell, hidden in CONFIGS]
    jobs = [(c + (tuning,)) for c in configs for tuning in ("auto", "off")]
    rows, device = [], None
    with tempfile.TemporaryDirectory() as folder:
        with ProcessPoolExecutor(args.jobs) as pool:
            paths = list(pool.map(_compile, [(job, folder) for job in jobs]))
        for (cell, hidden, batch), tuned_path, untuned_path in zip(configs, paths[::2],
                                                                   paths[1::2]):
            tuned = rnncc.load(tuned_path)
            t = time_gpu(tuned, args.steps, args.repeat)
            u = time_gpu(rnncc.load(untuned_path), args.steps, args.repeat, cudnn=False)
            device = t["device"]
            schedule = tuned.metadata["schedule"]
            rules = schedule["rules"]
            how = (f"persistent, {schedule['persistent']['plan']['batch_groups']} batch groups"
                   if schedule["kind"] == "persistent"
                   else f"{rules['input_gemm']} / {rules['recurrent_gemm']}")
            rows.append((cell, hidden, batch, how, u["rnncc"] * per, t["rnncc"] * per,
                         t["cudnn"] * per))
    print(f"{device}, {datetime.date.today().isoformat()}, T={args.steps}, TF32 off\n")
    print("| cell | H | N | schedule (rules: input / recurrent) | no logs us/step "
          "| with logs us/step | cuDNN us/step | vs cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell, hidden, batch, rules, off, on, cudnn in rows:
        print(f"| {cell} | {hidden} | {batch} | {rules} | {off:.2f} | {on:.2f} | {cudnn:.2f} "
              f"| {cudnn / on:.2f}x |")


if __name__ == "__main__":
    main()
