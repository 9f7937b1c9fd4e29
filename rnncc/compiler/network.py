"""A whole network's layer modules, chosen and compiled: the stages of a
:class:`rnncc.runtime.network.Network`.

The rules (measured on an H200, see docs/benchmarks.md; with a projection, ``proj_size`` P,
the layers run one after another, each above the first taking D*P inputs):

- Unidirectional layers of input size H, two or more of them, run on CUDA as one wavefront
  module (``layers=L``: one persistent launch, layer l at step t while layer l - 1 runs a few
  steps ahead): all the layers where C = H, else those above the first. Its fallback, for a
  device that cannot run its grid and for dropout between layers, is the one-layer module of
  input H. Where the wavefront does not fit (ConfigError, or a build that spills), the layers
  run one after another.
- A bidirectional layer runs on a module of both directions (one launch, the two recurrences
  side by side). On CUDA, where that module has no persistent kernel (at large batches one
  direction takes all the GPU's batch groups), each direction runs its own one-direction
  module in turn (LSTM 1024 x3 bidirectional at batch 64: 277 us a step against 300).
"""

from __future__ import annotations

from ..errors import BuildError, ConfigError
from ..runtime.network import Network, Stage
from .driver import compile_module, resolve_cell


def compile_network(cell, input_size: int, hidden_size: int, batch: int, *, layers: int = 1,
                    directions: int = 1, dtype: str = "float32", target: str = "cuda",
                    arch: str | None = None, lengths: bool = False, build=None,
                    proj_size: int = 0, **options) -> Network:
    """The :class:`Network` of ``layers`` layers and ``directions`` directions of ``cell``
    for x [T, N, C] (C = ``input_size``, N = ``batch``), its modules compiled by ``build``
    (default :func:`rnncc.compiler.compile_module`; :func:`rnncc.compiler.cache.compiled`
    keeps them on disk), with ``options`` (tuning, schedule options) for each."""
    cell = resolve_cell(cell)
    for name, value in (("layers", layers), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if directions not in (1, 2):
        raise ConfigError(f"directions must be 1 or 2, got {directions!r}")
    build = build or compile_module
    made: dict = {}

    def module(width: int, dirs: int = directions, count: int = 1):
        key = (width, dirs, count)
        if key not in made:
            made[key] = build(cell, width, hidden_size, batch, dtype=dtype, target=target,
                              arch=arch, lengths=lengths, directions=dirs, layers=count,
                              **options, **({"proj_size": proj_size} if proj_size else {}))
        return made[key]

    first = 0 if input_size == hidden_size else 1
    wave = None
    if target == "cuda" and directions == 1 and layers - first >= 2 and not proj_size:
        try:
            wave = module(hidden_size, 1, layers - first)
        except (ConfigError, BuildError):
            wave = None
    stages = []
    for layer in range(first if wave is not None else layers):
        width = input_size if layer == 0 else (proj_size or hidden_size) * directions
        one = module(width)
        if directions == 2 and target == "cuda" and not _persistent(one):
            stages.append(Stage("split", layer, 1, module(width, 1)))
        else:
            stages.append(Stage("layer", layer, 1, one))
    if wave is not None:
        stages.append(Stage("layers", first, layers - first, wave, module(hidden_size, 1)))
    meta = stages[0].module.metadata
    return Network({"cell": cell.name, "states": list(cell.states), "gates": cell.gates,
                    "params": list(cell.params), "proj_size": proj_size,
                    "input_size": input_size, "hidden_size": hidden_size, "layers": layers,
                    "directions": directions, "batch": batch, "dtype": dtype,
                    "lengths": bool(lengths), "allow_tf32": meta.get("allow_tf32", False),
                    "target": meta["target"],
                    "rnncc_version": meta["rnncc_version"],
                    "tvm_version": meta["tvm_version"]}, stages)


def _persistent(module) -> bool:
    return module.metadata["schedule"]["kind"] == "persistent"
