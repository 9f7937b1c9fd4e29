"""LSTM with coupled input and forget gates (CIFG: Greff et al., "LSTM: A Search Space
Odyssey", IEEE TNNLS 2017, variant CIFG), the input gate being 1 - f: three gates f, g, o
stacked in that order.

    f = sigmoid(gi_f + gh_f)      g = tanh(gi_g + gh_g)      o = sigmoid(gi_o + gh_o)
    c' = f * c + (1 - f) * g      h' = o * tanh(c')
"""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    f = ops.sigmoid(gi[0] + gh[0])
    g = ops.tanh(gi[1] + gh[1])
    o = ops.sigmoid(gi[2] + gh[2])
    c = f * state[1] + (1.0 - f) * g
    return o * ops.tanh(c), c


def reference(gi, gh, state):
    h, c = state
    f = 1.0 / (1.0 + np.exp(-(gi[0] + gh[0])))
    g = np.tanh(gi[1] + gh[1])
    o = 1.0 / (1.0 + np.exp(-(gi[2] + gh[2])))
    c_new = f * c + (1.0 - f) * g
    return o * np.tanh(c_new), c_new


CIFG = register(
    Cell(
        name="cifg",
        gates=3,
        states=("h", "c"),
        step=step,
        reference=reference,
        doc="LSTM with coupled input-forget gate (CIFG), gates f, g, o; i = 1 - f",
    )
)
