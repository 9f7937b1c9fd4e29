"""A layer's training entries on the GPU: the persistent ones (``persistent_train_forward``,
``persistent_backward``) against the non-persistent ones (``train_forward``, ``backward``) and
torch's autograd in float64 on the CPU, and each entry's time (eager, CUDA events, median, us a
time step). Run on a GPU machine from the repository root:

    python3 benchmarks/training_entries.py [--steps 100] [--jobs 12] [--json out.json]

Each configuration compiles first (``--jobs`` at a time in worker processes, into the on-disk
cache). Per configuration it prints, for each kind of entry, the entries the module ran, the
relative errors of y and of the worst gradient against float64, and the forward and backward
times; then how far the two kinds' y, kept tensors and gradients are apart.
"""

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

#: (cell, H = C, N, dtype, lengths)
CONFIGS = [("lstm", 1024, 1, "float32", False), ("lstm", 1024, 4, "float32", False),
           ("gru", 1024, 1, "float32", False), ("gru", 1024, 4, "float32", False),
           ("lstm", 512, 16, "float32", False), ("lstm", 256, 3, "float32", True),
           ("gru", 33, 7, "float32", True), ("rnn_tanh", 257, 5, "float32", False),
           ("lstm", 1, 1, "float32", True), ("rnn_relu", 3, 3, "float32", True),
           ("lstm", 1024, 4, "float16", False), ("lstm", 512, 64, "float32", False)]
#: The entries of each kind: (forward, backward), as Module._training_function names them.
KINDS = {"non-persistent": ("train_forward", "backward"),
         "persistent": ("persistent_train_forward", "persistent_backward")}


def _module(config):
    from rnncc.compiler import cache

    cell, hidden, batch, dtype, lengths = config
    return cache.compiled(cell, hidden, hidden, batch, dtype=dtype, target="cuda",
                          training=True, lengths=lengths)


def _compile(config):
    _module(config)
    return config


def _reference(torch, module, config, steps):
    """Inputs and torch's float64 gradients on the CPU (same weights, lengths, dy)."""
    cell, hidden, batch, _, lengths = config
    gen = torch.Generator().manual_seed(1)
    kind = {"lstm": "LSTM", "gru": "GRU"}.get(cell, "RNN")
    options = {"nonlinearity": cell[4:]} if kind == "RNN" else {}
    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(hidden, hidden, **options).double()
    x = torch.randn(steps, batch, hidden, dtype=torch.float64, generator=gen,
                    requires_grad=True)
    states = [torch.randn(1, batch, hidden, dtype=torch.float64, generator=gen,
                          requires_grad=True) for _ in module.states]
    length = (torch.randint(1, steps + 1, (batch,), generator=gen) if lengths
              else torch.full((batch,), steps))
    length[0] = steps
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, length, enforce_sorted=False)
    y, finals = theirs(packed, tuple(states) if len(states) > 1 else states[0])
    y = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=steps)[0]
    finals = finals if isinstance(finals, tuple) else (finals,)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    d_finals = [torch.randn(f.shape, dtype=torch.float64, generator=gen) for f in finals]
    ((y * dy).sum() + sum((f * d).sum() for f, d in zip(finals, d_finals))).backward()
    grads = {"x": x.grad, **{f"{s}0": t.grad for s, t in zip(module.states, states)},
             **{k: p.grad for k, p in theirs.named_parameters()}}
    inputs = {"x": x.detach(), "states": [s.detach() for s in states], "dy": dy,
              "d_finals": d_finals, "lengths": length if lengths else None,
              "weights": theirs.state_dict()}
    return y.detach(), grads, inputs


def _relative(torch, a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _median_us(torch, fn, steps, repeat=15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def _run_kind(torch, module, entries, inputs, ref, steps):
    """One kind of entries (chosen through the module's private entry table, which a plain
    call fills with the persistent ones where they fit): their results and times. The backward
    timing reuses one step's kept tensors, whose sums the first call overwrote: the times
    hold, the values are not checked after the first call."""
    family = module_family(module, inputs["xc"])
    module._entries.clear()
    for name, entry in zip(("train_forward", "backward"), entries):
        module._entries[(name, "cuda", 0)] = entry
    chosen = [module._training_function(family, name) for name in ("train_forward",
                                                                    "backward")]
    x, weights, dy, d_finals, lengths, initial = (inputs[k] for k in (
        "xc", "wc", "dyc", "dfc", "lc", "initial"))

    def forward():
        return module.train_forward(x, weights, lengths=lengths, **initial)

    y, _, kept = forward()
    kept_copy = {k: v.clone() for k, v in kept.items()}  # backward overwrites Module.consumed
    grads = module.backward(x, weights, kept, dy, d_finals, lengths=lengths)
    torch.cuda.synchronize()
    errors = {k: _relative(torch, grads[k], v) for k, v in ref[1].items()}
    out = {"entries": chosen, "y_error": _relative(torch, y, ref[0]),
           "worst_gradient": max(errors, key=errors.get),
           "gradient_error": max(errors.values())}
    out["forward_us"] = _median_us(torch, forward, steps)
    out["backward_us"] = _median_us(torch, lambda: module.backward(
        x, weights, kept, dy, d_finals, lengths=lengths, input_grad=False), steps)
    return out, y, kept_copy, grads


def module_family(module, x):
    from rnncc.runtime.arrays import family_of

    return family_of(x, module.device_kind)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        list(pool.map(_compile, CONFIGS))
    rows = []
    for config in CONFIGS:
        module = _module(config)
        dtype = getattr(torch, config[3])
        y_ref, grads_ref, inputs = _reference(torch, module, config, args.steps)
        inputs.update(
            xc=inputs["x"].to(dtype).cuda(),
            wc={k: v.to(dtype).cuda() for k, v in inputs["weights"].items()},
            dyc=inputs["dy"].to(dtype).cuda(),
            dfc=tuple(d.to(dtype).cuda() for d in inputs["d_finals"]),
            lc=None if inputs["lengths"] is None else inputs["lengths"].to(torch.int32).cuda(),
            initial={f"{s}0": t.to(dtype).cuda() for s, t in zip(module.states,
                                                                 inputs["states"])})
        row, results = {"config": config}, {}
        for kind, entries in KINDS.items():
            if entries[0] not in module.metadata["functions"]:
                row[kind] = "not compiled (no plan)"
                continue
            row[kind], *results[kind] = _run_kind(torch, module, entries, inputs,
                                                  (y_ref, grads_ref), args.steps)
        if len(results) < 2:
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        (ya, kepta, ga), (yb, keptb, gb) = results["non-persistent"], results["persistent"]
        row["apart"] = {"y": _relative(torch, yb, ya),
                        "kept": max(_relative(torch, keptb[k], kepta[k]) for k in kepta),
                        "gradients": max(_relative(torch, gb[k], ga[k]) for k in ga)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
