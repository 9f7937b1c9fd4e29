"""The sweep: one layer of rnncc against cuDNN through PyTorch over the regimes a new user
meets (on-chip persistent, streamed weights, batch groups, per-step GEMMs): cells lstm and
gru, hidden 64 to 4096, batch 1 to 256, float32 (TF32 off on both sides), TF32 (float32
with ``allow_tf32=True``, and cuDNN with TF32 on), float16 and bfloat16, C = H and C = H/2,
T = 100, each side captured in a CUDA graph, median of
``--repeat`` replays, in one process. Run on a GPU machine from the repository root:

    python3 benchmarks/sweep.py [--jobs 16] [--part 1/2] [--where H=2048 N=4,16] [--json out.json]
    python3 benchmarks/sweep.py --random 40 --seed 7 [--json out.json]
    python3 benchmarks/sweep.py --plot sweep.json [sweep2.json ...] --out docs/sweep.png

Prints a markdown table (GPU name, date): us a step for rnncc and cuDNN and their ratio
(cuDNN / rnncc: above 1, rnncc is faster), and which schedule ran; the JSON's rows also name
the rules that took the layer's products (``rules``); it is rewritten after each row.
``--part k/n`` times the k-th of n slices of the configurations (a GPU session's command
has a time limit). ``--plot`` draws the ratio over hidden size, one curve a batch size, a
panel a cell and dtype; a later file's row replaces an earlier file's of the same
configuration (a partial re-run on top).
``--random COUNT`` times COUNT configurations drawn instead of the grid's (``--seed``): shapes
off the grid as a user brings them, to find where rnncc loses (:func:`random_configs`).
"""

import argparse
import datetime
import json
import os
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

HIDDEN = (256, 512, 1024, 2048, 4096)
BATCHES = (1, 4, 16, 64, 256)
#: (cell, C, H, N, dtype): float32 over the whole grid, TF32 ("tf32": float32 products in
#: TF32 on both sides), the half types and C != H on a part; small H (64, 256) at batch 64 and
#: 256 in every precision (the half types there were 5-28x slower than cuDNN, unmeasured,
#: until 2026-11-30).
CONFIGS = ([(cell, h, h, n, "float32") for cell in ("lstm", "gru") for h in HIDDEN
            for n in BATCHES]
           + [(cell, h, h, n, dtype) for dtype in ("float16", "bfloat16")
              for cell, hs in (("lstm", (512, 1024, 2048)), ("gru", (1024,)))
              for h in hs for n in (1, 8, 64, 256)]
           + [(cell, h, h, n, dtype) for dtype in ("float32", "tf32", "float16", "bfloat16")
              for cell in ("lstm", "gru") for h in (64, 256) for n in (64, 256)
              if (dtype, h) != ("float32", 256)]
           + [(cell, h // 2, h, n, "float32") for cell in ("lstm", "gru") for h in (1024,)
              for n in (1, 32, 128)]
           + [(cell, h, h, n, "tf32") for cell in ("lstm", "gru") for h in (512, 1024, 2048)
              for n in (1, 16, 64, 256)])
STEPS = 100


def random_configs(count: int, seed: int) -> list[tuple]:
    """``count`` configurations drawn with ``seed``: cell lstm or gru (rnn_tanh one in eight),
    H log-uniform over 64-4096 in multiples of 8 (one in four any integer), C = H (else
    log-uniform over 16-4096), N log-uniform over 1-256, dtype float32 (half of them), tf32,
    float16 or bfloat16."""
    draw = random.Random(seed)

    def log_uniform(low, high):
        return round(low * (high / low) ** draw.random())

    configs = []
    for _ in range(count):
        cell = "rnn_tanh" if draw.random() < 1 / 8 else draw.choice(("lstm", "gru"))
        h = log_uniform(64, 4096)
        h = h if draw.random() < 1 / 4 else max(8, h // 8 * 8)
        c = h if draw.random() < 1 / 2 else log_uniform(16, 4096)
        dtype = "float32" if draw.random() < 1 / 2 else draw.choice(("tf32", "float16",
                                                                    "bfloat16"))
        configs.append((cell, c, h, log_uniform(1, 256), dtype))
    return configs


def _compile(job):
    import rnncc

    (cell, c, h, n, dtype), folder = job
    path = os.path.join(folder, f"{cell}_{c}_{h}_{n}_{dtype}.so")
    precision = {"dtype": "float32", "allow_tf32": True} if dtype == "tf32" else {"dtype": dtype}
    try:
        return rnncc.compile(cell, c, h, n, target="cuda", **precision).export(path)
    except Exception as err:  # noqa: BLE001 - a configuration that does not build is a row
        return f"error: {type(err).__name__}: {str(err).splitlines()[0]}"


def _row(config, path, repeat):
    import rnncc
    from rnncc.bench import time_gpu

    cell, c, h, n, dtype = config
    row = {"cell": cell, "C": c, "H": h, "N": n, "dtype": dtype}
    if path.startswith("error"):
        return {**row, "error": path}
    module = rnncc.load(path)
    try:
        result = time_gpu(module, STEPS, repeat)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory: a row that says so
        return {**row, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    plan = module.metadata["schedule"].get("persistent", {}).get("plan")
    schedule = result["entry"]
    if schedule == "persistent" and plan.get("global_chunks"):
        schedule += " (streaming)"
    per = 1e3 / STEPS
    rules = {key: rule for key, rule in module.metadata["schedule"]["rules"].items()
             if "gemm" in key or key in ("step", "persistent")}
    return {**row, "schedule": schedule, "rnncc_us": result["rnncc"] * per,
            "cudnn_us": result["cudnn"] * per, "ratio": result["cudnn"] / result["rnncc"],
            "device": result["device"], "rules": rules}


def _selected(config, where) -> bool:
    """Whether ``config`` passes every KEY=V[,V] of ``where`` (keys: cell, C, H, N, dtype)."""
    values = dict(zip(("cell", "C", "H", "N", "dtype"), config))
    for term in where:
        key, _, allowed = term.partition("=")
        if key not in values:
            raise SystemExit(f"--where {term}: the keys are {', '.join(values)}")
        if str(values[key]) not in allowed.split(","):
            return False
    return True


def _table(rows) -> str:
    lines = ["| cell | C | H | N | dtype | schedule | rnncc | cuDNN | cuDNN / rnncc |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = f"| {r['cell']} | {r['C']} | {r['H']} | {r['N']} | {r['dtype']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | |")
        else:
            lines.append(f"{head} {r['schedule']} | {r['rnncc_us']:.2f} | {r['cudnn_us']:.2f} "
                         f"| {r['ratio']:.2f}x |")
    return "\n".join(lines)


def _plot(paths, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest, device = {}, ""
    for path in paths:
        with open(path) as f:
            found = json.load(f)
        latest.update({tuple(r[k] for k in ("cell", "C", "H", "N", "dtype")): r
                       for r in found["rows"] if "ratio" in r})
        device = found["device"]
    rows = list(latest.values())
    panels = sorted({(r["cell"], r["dtype"]) for r in rows if r["C"] == r["H"]},
                    key=lambda p: (p[1], p[0]))
    cols = min(4, len(panels))
    grid = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.2 * cols, 3.6 * grid), sharey=True,
                             squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (cell, dtype) in zip(axes, panels):
        own = [r for r in rows if (r["cell"], r["dtype"]) == (cell, dtype) and r["C"] == r["H"]]
        for n in sorted({r["N"] for r in own}):
            line = sorted((r["H"], r["ratio"]) for r in own if r["N"] == n)
            ax.plot(*zip(*line), marker="o", label=f"N = {n}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{cell} {dtype}, C = H")
        ax.set_xlabel("hidden size H")
        ax.legend(fontsize=7)
    for ax in axes[::cols]:
        ax.set_ylabel("cuDNN time / rnncc time")
    fig.suptitle(f"One layer, T = {STEPS}, {device}: above 1, rnncc is faster", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--part", default="1/1", help="k/n: the k-th of n slices")
    parser.add_argument("--where", nargs="+", default=[], metavar="KEY=V[,V]",
                        help="only the configurations whose cell, C, H, N or dtype is one of "
                             "the values, e.g. H=2048,4096 N=4,16")
    parser.add_argument("--random", type=int, metavar="COUNT",
                        help="COUNT configurations drawn at random instead of the grid's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--plot", nargs="+", help="JSON files of earlier runs to plot")
    parser.add_argument("--out", default="sweep.png")
    args = parser.parse_args()
    if args.plot:
        _plot(args.plot, args.out)
        return
    k, n = (int(v) for v in args.part.split("/"))
    grid = random_configs(args.random, args.seed) if args.random else CONFIGS
    configs = [c for c in grid if _selected(c, args.where)][k - 1::n]
    folder = tempfile.mkdtemp(prefix="rnncc_sweep_")
    with ProcessPoolExecutor(args.jobs) as pool:
        paths = list(pool.map(_compile, [(c, folder) for c in configs]))
    rows, device = [], "no GPU"
    for config, path in zip(configs, paths):
        rows.append(_row(config, path, args.repeat))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
        device = rows[-1].get("device", device)
        if args.json:  # after each row: a run cut short keeps what it measured
            write_json(args.json, {"device": device, "date": str(datetime.date.today()),
                                   "rows": rows})
    print(f"\n{device}, {datetime.date.today()}, T = {STEPS}, us a step, TF32 off but in "
          "the tf32 rows\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
