"""Cell variants cuDNN lacks (CIFG, peephole, the layer-normalised LSTM and GRU, the GRU that
resets before its product): rnncc.nn against the same cell written as a per-step PyTorch loop
(the input projections of all steps in one matmul first) and against rnncc's plain cell of the
same family (LSTM, or GRU for the GRUs)
and size, T = 100, C = H, IEEE float32 (TF32 off), all captured in
CUDA graphs, in one process; microseconds a time step, for inference (no_grad) and for a
training step (forward and backward of x and every weight). Then the LSTM with projections
(LSTMP, P = H/4; one and two directions), inference, against cuDNN's (torch.nn.LSTM(proj_size=P),
same weights).
Run on a GPU machine from the repository root:

    python3 benchmarks/variants.py [--repeat 50] [--jobs 16] [--hidden 1024] [--json out.json]
                                   [--projections-only] [--cells cifg ln_gru ...]

Before timing, each variant's rnncc outputs are compared with its PyTorch loop's (same
weights and input; the largest relative error is printed). The modules compile first,
``--jobs`` at a time in worker processes, into the on-disk cache the timed modules load from.
"""

import argparse
import datetime
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

#: Each variant and the plain cell it is compared with.
VARIANTS = {"cifg": "lstm", "peephole": "lstm", "ln_lstm": "lstm", "ln_gru": "gru",
            "gru_reset_before": "gru"}
BATCHES = (1, 4, 64)
STEPS = 100


def _compile(job):
    from rnncc.compiler import cache

    cell, hidden, batch, training, arch, proj, directions = job
    cache.compiled(cell, hidden, hidden, batch, target="cuda", arch=arch, training=training,
                   directions=directions, **({"proj_size": proj} if proj else {}))
    return job


def _loop(torch, cell, net):
    """The cell as a per-step PyTorch loop on ``net``'s parameters (one layer): x [T, N, C]
    -> y [T, N, H]."""
    from torch.nn.functional import layer_norm

    p = dict(net.named_parameters())
    w_ih, w_hh = p["weight_ih_l0"], p["weight_hh_l0"]
    b_ih, b_hh = p["bias_ih_l0"], p["bias_hh_l0"]
    rows, hidden = w_hh.shape

    def gates(name, order):  # a layer-normalised cell's per-gate parameters, stacked
        return torch.cat([p[f"{name}_{q}_l0"] for q in order])

    def run(x):
        steps, n, _ = x.shape
        h = c = x.new_zeros(n, w_hh.shape[1])
        xp = (x.reshape(steps * n, -1) @ w_ih.T + b_ih).reshape(steps, n, -1)
        out = []
        for t in range(steps):
            if cell == "ln_lstm":
                v = (layer_norm(xp[t], (rows,)) * gates("gamma_ih", "ifgo") + layer_norm(
                    h @ w_hh.T + b_hh, (rows,)) * gates("gamma_hh", "ifgo")
                    + gates("beta", "ifgo")).chunk(4, dim=1)
                c = torch.sigmoid(v[1]) * c + torch.sigmoid(v[0]) * torch.tanh(v[2])
                h = torch.sigmoid(v[3]) * torch.tanh(
                    layer_norm(c, (hidden,), p["gamma_c_l0"], p["beta_c_l0"]))
                out.append(h)
                continue
            if cell == "ln_gru":
                u = (layer_norm(xp[t], (rows,)) * gates("gamma_ih", "rzn")
                     + gates("beta_ih", "rzn")).chunk(3, dim=1)
                w = (layer_norm(h @ w_hh.T + b_hh, (rows,)) * gates("gamma_hh", "rzn")
                     + gates("beta_hh", "rzn")).chunk(3, dim=1)
                r, z = torch.sigmoid(u[0] + w[0]), torch.sigmoid(u[1] + w[1])
                h = (1 - z) * torch.tanh(u[2] + r * w[2]) + z * h
                out.append(h)
                continue
            if cell == "gru_reset_before":
                u, w = xp[t].chunk(3, dim=1), (h @ w_hh[:2 * hidden].T + b_hh[:2 * hidden])
                r, z = torch.sigmoid(u[0] + w[:, :hidden]), torch.sigmoid(u[1] + w[:, hidden:])
                n = torch.tanh(u[2] + (r * h) @ w_hh[2 * hidden:].T + b_hh[2 * hidden:])
                h = (1 - z) * n + z * h
                out.append(h)
                continue
            g = (xp[t] + h @ w_hh.T + b_hh).chunk(rows // hidden, dim=1)
            if cell == "cifg":
                f = torch.sigmoid(g[0])
                c = f * c + (1 - f) * torch.tanh(g[1])
                h = torch.sigmoid(g[2]) * torch.tanh(c)
            else:
                i = torch.sigmoid(g[0] + p["w_ci_l0"] * c)
                f = torch.sigmoid(g[1] + p["w_cf_l0"] * c)
                c = f * c + i * torch.tanh(g[2])
                h = torch.sigmoid(g[3] + p["w_co_l0"] * c) * torch.tanh(c)
            out.append(h)
        return torch.stack(out)
    return run


def _us(ms):
    return ms * 1e3 / STEPS


def _row(torch, cell, hidden, batch, repeat):
    """{name: us/step} for one variant and batch, and the largest relative error of rnncc's
    outputs and gradients against the loop's."""
    import rnncc.nn
    from rnncc.bench import _graph_ms

    torch.manual_seed(0)
    ours = rnncc.nn.Recurrent(cell, hidden, hidden).cuda()
    plain = rnncc.nn.Recurrent(VARIANTS[cell], hidden, hidden).cuda()
    loop = _loop(torch, cell, ours)
    x = torch.randn(STEPS, batch, hidden, device="cuda", requires_grad=True)
    dy = torch.randn(STEPS, batch, hidden, device="cuda")
    errors = []
    for fn in (lambda: ours(x)[0], lambda: loop(x)):
        ours.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        y.backward(dy)
        errors.append([y.detach()] + [q.grad.clone() for q in ours.parameters()] + [x.grad])
        del y  # no autograd graph kept alive into the captures
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(*errors))

    def train(fn):
        def step():
            fn(x).backward(dy)
        for net in (ours, plain):
            net.zero_grad(set_to_none=True)
        x.grad = None
        return step

    out = {}
    with torch.no_grad():
        out["rnncc"] = _us(_graph_ms(torch, lambda: ours(x), repeat))
        out["loop"] = _us(_graph_ms(torch, lambda: loop(x), repeat))
        out["rnncc plain"] = _us(_graph_ms(torch, lambda: plain(x), repeat))
    out["rnncc train"] = _us(_graph_ms(torch, train(lambda v: ours(v)[0]), repeat))
    out["loop train"] = _us(_graph_ms(torch, train(loop), repeat))
    out["rnncc plain train"] = _us(_graph_ms(torch, train(lambda v: plain(v)[0]), repeat))
    return out, error


def _projection_row(torch, hidden, batch, repeat, bidirectional):
    """(rnncc us/step, cuDNN us/step, relative difference of y) of LSTMP with P = H/4."""
    import rnncc.nn
    from rnncc.bench import _graph_ms

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(hidden, hidden, proj_size=hidden // 4,
                           bidirectional=bidirectional).cuda()
    ours = rnncc.nn.from_torch(theirs)
    x = torch.randn(STEPS, batch, hidden, device="cuda")
    with torch.no_grad():
        a, b = ours(x)[0], theirs(x)[0]
        return (_us(_graph_ms(torch, lambda: ours(x), repeat)),
                _us(_graph_ms(torch, lambda: theirs(x), repeat)),
                float((a - b).norm() / b.norm()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--json")
    parser.add_argument("--projections-only", action="store_true", help="only the LSTMP rows")
    parser.add_argument("--cells", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    variants = () if args.projections_only else tuple(args.cells)
    import torch

    from rnncc.nn.network import bucket

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    jobs = sorted({(cell, args.hidden, bucket(n), training, arch, 0, 1)
                   for cell in variants + tuple(VARIANTS[v] for v in variants) for n in BATCHES
                   for training in (False, True)})
    jobs += [("lstm", args.hidden, bucket(n), False, arch, args.hidden // 4, d)
             for n in BATCHES for d in (1, 2)]
    spawn = multiprocessing.get_context("spawn")  # this process has CUDA started: no fork
    with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        list(pool.map(_compile, jobs))
    rows = []
    for cell in variants:
        for batch in BATCHES:
            times, error = _row(torch, cell, args.hidden, batch, args.repeat)
            rows.append({"cell": cell, "H": args.hidden, "N": batch, "error": error, **times})
    projections = []
    for directions in (1, 2):
        for batch in BATCHES:
            mine, cudnn, error = _projection_row(torch, args.hidden, batch, args.repeat,
                                                 directions == 2)
            projections.append({"H": args.hidden, "P": args.hidden // 4, "D": directions,
                                "N": batch, "rnncc": mine, "cudnn": cudnn, "error": error})
    device = torch.cuda.get_device_name()
    print(f"{device}, {datetime.date.today()}, T={STEPS}, C=H={args.hidden}, TF32 off, us per "
          "time step; 'vs loop': the PyTorch loop's time over rnncc's; 'vs plain': rnncc's time "
          "over its plain cell's (LSTM; GRU for the GRUs)")
    if rows:
        print("\n| cell | N | rnncc | PyTorch loop | vs loop | rnncc plain | vs plain | train: "
              "rnncc | loop | vs loop | plain | vs plain | max rel. error |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['cell']} | {r['N']} | {r['rnncc']:.2f} | {r['loop']:.2f} | "
              f"{r['loop'] / r['rnncc']:.1f}x | {r['rnncc plain']:.2f} | "
              f"{r['rnncc'] / r['rnncc plain']:.2f} | {r['rnncc train']:.2f} | "
              f"{r['loop train']:.2f} | {r['loop train'] / r['rnncc train']:.1f}x | "
              f"{r['rnncc plain train']:.2f} | {r['rnncc train'] / r['rnncc plain train']:.2f} | "
              f"{r['error']:.1e} |")
    print("\nLSTMP, P = H/4, inference (D directions)\n\n| H | P | D | N | rnncc | cuDNN | "
          "speed-up | y rel. diff |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in projections:
        print(f"| {r['H']} | {r['P']} | {r['D']} | {r['N']} | {r['rnncc']:.2f} | "
              f"{r['cudnn']:.2f} | "
              f"{r['cudnn'] / r['rnncc']:.2f}x | {r['error']:.1e} |")
    if args.json:
        write_json(args.json, {"device": device, "date": str(datetime.date.today()),
                               "rows": rows, "projections": projections})


if __name__ == "__main__":
    main()
