"""The network call as a PyTorch custom op (``torch.ops.rnncc.network``), so that
``torch.compile`` takes an rnncc.nn module as one node with its shapes, without a graph break.

The op names its module by a key (:func:`register`); the module's parameters travel as its
inputs, in the module's order, so the compiled graph sees them. Its fake implementation gives
the outputs' shapes: y [T, N, D*H] and one [L*D, N, H] a state (P for H in y and h with a
projection).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_modules: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_keys = itertools.count()


def register(module) -> str:
    """The key the op knows ``module`` by (an rnncc.nn module; kept only while it lives)."""
    key = f"rnncc.nn#{next(_keys)}"
    _modules[key] = module
    return key


@torch.library.custom_op("rnncc::network", mutates_args=())
def network(key: str, x: torch.Tensor, states: list[torch.Tensor],
            lengths: torch.Tensor | None, weights: list[torch.Tensor],
            training: bool) -> list[torch.Tensor]:
    """y and the final states of the registered module's network on ``x`` [T, N, C] (time
    major) from ``states``, with ``weights`` its parameters in order."""
    module = _modules[key]
    y, finals = module._run(x, states, lengths, weights, training)
    return [y, *finals]


@network.register_fake
def _(key, x, states, lengths, weights, training):
    module = _modules[key]
    steps, batch = x.shape[0], x.shape[1]
    lay = module._layout
    y = x.new_empty(steps, batch, lay.recurrent_size * lay.directions)
    return [y] + [x.new_empty(shape) for shape in lay.state_shapes(batch)]
