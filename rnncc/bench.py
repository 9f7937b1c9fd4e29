"""Timing a module, and cuDNN (through PyTorch) on the same problem in the same process.

GPU times are per call, from CUDA events around replays of a CUDA graph (both rnncc and cuDNN
are captured, so kernel-launch and Python overheads stay out), median of many replays; at
float32 TF32 is off for cuDNN, so both sides compute IEEE float32, unless the module allows
TF32 (``allow_tf32``): then cuDNN may use it too. CPU times are wall-clock
medians.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .errors import ConfigError


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_problem(module, steps: int, seed: int = 0):
    """x [T, N, C] and PyTorch-named weights (of every layer and direction), as float64 NumPy
    arrays (uniform like torch); ``module``: a :class:`rnncc.Module` or
    :class:`rnncc.Network`."""
    rng = np.random.default_rng(seed)
    g, h, c, n = module.metadata["gates"], module.hidden_size, module.input_size, module.batch
    p = module.metadata.get("proj_size", 0)
    k = 1.0 / np.sqrt(h)

    def shape(name):
        kind, layer = name.split("_l")[0], int(name.split("_l")[1].split("_")[0])
        width = c if layer == 0 else module.directions * (p or h)
        return {"weight_ih": (g * h, width), "weight_hh": (g * h, p or h),
                "weight_hr": (p, h), "bias_ih": (g * h,), "bias_hh": (g * h,)}.get(kind, (h,))

    weights = {name: rng.uniform(-k, k, shape(name)) for name in module.weight_names}
    return rng.standard_normal((steps, n, c)), weights


def time_cpu(module, steps: int, repeat: int = 20) -> float:
    """Median milliseconds per call of a CPU module (T = steps)."""
    x, weights = random_problem(module, steps)
    dt = module.dtype
    x = x.astype(dt)
    packed = module.pack({k: v.astype(dt) for k, v in weights.items()})
    module(x, packed)
    return _median_ms(lambda: module(x, packed), repeat)


def _graph_ms(torch, fn, repeat: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cudnn_module(torch, cell_torch, input_size, hidden_size, dtype, bidirectional=False,
                 num_layers=1, proj_size=0):
    """The torch.nn module equivalent of a cell, on the GPU, or None if the cell has none
    (or none with a projection: torch's LSTM alone takes ``proj_size``)."""
    if cell_torch is None or (proj_size and cell_torch[0] != "LSTM"):
        return None
    cls, kwargs = cell_torch
    kwargs = {**kwargs, **({"proj_size": proj_size} if proj_size else {})}
    return getattr(torch.nn, cls)(input_size, hidden_size, num_layers=num_layers,
                                  bidirectional=bidirectional,
                                  **kwargs).cuda().to(getattr(torch, dtype))


def time_gpu(module, steps: int, repeat: int = 100, cudnn: bool = True,
             entry: str | None = None) -> dict:
    """rnncc and (when torch knows the cell) cuDNN, each CUDA-graph captured, same inputs;
    ``module``: a :class:`rnncc.Module` or :class:`rnncc.Network`.

    Returns milliseconds per call: {"rnncc": ..., "cudnn": ... or None, "entry": ...}.
    ``entry`` forces a module's "sequence" or "persistent" schedule.
    """
    try:
        import torch
    except ImportError as err:
        raise ConfigError("timing a CUDA module needs PyTorch (for CUDA graphs)") from err
    if not torch.cuda.is_available():
        raise ConfigError("timing a CUDA module needs a GPU that PyTorch can use; this PyTorch "
                          f"({torch.__version__}) sees none")
    from .cells import registry

    # cuDNN in the module's precision: IEEE float32, or TF32 where the module allows it
    torch.backends.cudnn.allow_tf32 = module.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = module.allow_tf32
    dt = getattr(torch, module.dtype)
    x64, w64 = random_problem(module, steps)
    x = torch.tensor(x64, dtype=dt, device="cuda")
    weights = {k: torch.tensor(v, dtype=dt, device="cuda") for k, v in w64.items()}
    packed = module.pack(weights, entry=entry) if entry else module.pack(weights)
    out = {"rnncc": _graph_ms(torch, lambda: module(x, packed), repeat), "cudnn": None,
           "entry": getattr(packed, "entry", "network")}
    cell = registry().get(module.cell)
    ref = cudnn_module(torch, cell.torch if cell else None, module.input_size,
                       module.hidden_size, module.dtype, module.directions == 2,
                       module.layers, module.metadata.get("proj_size", 0)) if cudnn else None
    if ref is not None:
        with torch.no_grad():
            for name, value in weights.items():
                getattr(ref, name).copy_(value)
            ref.flatten_parameters()
            out["cudnn"] = _graph_ms(torch, lambda: ref(x), repeat)
    out["device"] = torch.cuda.get_device_name()
    out["cudnn_version"] = torch.backends.cudnn.version()
    return out
