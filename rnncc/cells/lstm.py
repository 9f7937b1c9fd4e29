"""LSTM, as torch.nn.LSTM and cuDNN: gates i, f, g, o stacked in that order.

    i = sigmoid(gi_i + gh_i)      f = sigmoid(gi_f + gh_f)
    g = tanh(gi_g + gh_g)         o = sigmoid(gi_o + gh_o)
    c' = f * c + i * g            h' = o * tanh(c')
"""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    i = ops.sigmoid(gi[0] + gh[0])
    f = ops.sigmoid(gi[1] + gh[1])
    g = ops.tanh(gi[2] + gh[2])
    o = ops.sigmoid(gi[3] + gh[3])
    c = f * state[1] + i * g
    return o * ops.tanh(c), c


def reference(gi, gh, state):
    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))

    h, c = state
    i, f = sig(gi[0] + gh[0]), sig(gi[1] + gh[1])
    g, o = np.tanh(gi[2] + gh[2]), sig(gi[3] + gh[3])
    c_new = f * c + i * g
    return o * np.tanh(c_new), c_new


LSTM = register(
    Cell(
        name="lstm",
        gates=4,
        states=("h", "c"),
        step=step,
        reference=reference,
        torch=("LSTM", {}),
        doc="LSTM, gates i, f, g, o (torch.nn.LSTM, cuDNN)",
    )
)
