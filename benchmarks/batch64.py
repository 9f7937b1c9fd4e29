"""The batch-64 table: rnncc as `rnncc compile` builds it (shipped tuning logs applied), the
same without tuning logs, and cuDNN through PyTorch, each CUDA-graph captured, T = 100, C = H,
float32 with TF32 off on both sides. Run on a GPU machine from the repository root:

    python3 benchmarks/batch64.py [--repeat 100] [--batch 64]

Prints a markdown table with the GPU's name and the date, as in docs/benchmarks.md.
"""

import argparse
import datetime

import rnncc
from rnncc.bench import time_gpu

CONFIGS = [("lstm", h) for h in (256, 512, 1024, 1536)] + [("gru", h) for h in (512, 1024, 2048)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    per = 1e3 / args.steps
    rows, device = [], None
    for cell, hidden in CONFIGS:
        tuned = rnncc.compile(cell, hidden, hidden, args.batch, target="cuda")
        untuned = rnncc.compile(cell, hidden, hidden, args.batch, target="cuda", tuning="off")
        t = time_gpu(tuned, args.steps, args.repeat)
        u = time_gpu(untuned, args.steps, args.repeat, cudnn=False)
        device = t["device"]
        schedule = tuned.metadata["schedule"]
        rules = schedule["rules"]
        how = (f"persistent, {schedule['persistent']['plan']['batch_groups']} batch groups"
               if schedule["kind"] == "persistent"
               else f"{rules['input_gemm']} / {rules['recurrent_gemm']}")
        rows.append((cell, hidden, how, u["rnncc"] * per, t["rnncc"] * per, t["cudnn"] * per))
    print(f"{device}, {datetime.date.today().isoformat()}, N={args.batch}, T={args.steps}, "
          "TF32 off\n")
    print("| cell | H | schedule (rules: input / recurrent) | no logs us/step | with logs us/step "
          "| cuDNN us/step | vs cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cell, hidden, rules, off, on, cudnn in rows:
        print(f"| {cell} | {hidden} | {rules} | {off:.2f} | {on:.2f} | {cudnn:.2f} "
              f"| {cudnn / on:.2f}x |")


if __name__ == "__main__":
    main()
