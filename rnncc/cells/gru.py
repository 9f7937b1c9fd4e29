"""GRU, as torch.nn.GRU and cuDNN: gates r, z, n stacked in that order, with the reset gate
applied after the recurrent matrix product (to W_hn h + b_hn):

    r = sigmoid(gi_r + gh_r)      z = sigmoid(gi_z + gh_z)
    n = tanh(gi_n + r * gh_n)     h' = (1 - z) * n + z * h
"""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    r = ops.sigmoid(gi[0] + gh[0])
    z = ops.sigmoid(gi[1] + gh[1])
    n = ops.tanh(gi[2] + r * gh[2])
    return ((1.0 - z) * n + z * state[0],)


def reference(gi, gh, state):
    (h,) = state
    r = 1.0 / (1.0 + np.exp(-(gi[0] + gh[0])))
    z = 1.0 / (1.0 + np.exp(-(gi[1] + gh[1])))
    n = np.tanh(gi[2] + r * gh[2])
    return ((1.0 - z) * n + z * h,)


GRU = register(
    Cell(
        name="gru",
        gates=3,
        states=("h",),
        step=step,
        reference=reference,
        torch=("GRU", {}),
        doc="GRU, gates r, z, n, reset after the matmul (torch.nn.GRU, cuDNN)",
    )
)
