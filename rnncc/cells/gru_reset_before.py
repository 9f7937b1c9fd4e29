"""GRU with the reset gate applied before the recurrent matrix product (Cho et al., "Learning
Phrase Representations using RNN Encoder-Decoder", 2014; Keras' GRU with reset_after=False):
gates r, z, n stacked in that order, as torch.nn.GRU, W_hn multiplying r * h:

    r = sigmoid(gi_r + gh_r)      z = sigmoid(gi_z + gh_z)
    n = tanh(gi_n + W_hn (r * h) + b_hn)      h' = (1 - z) * n + z * h

b_in + b_hn is Keras' one bias of the candidate (its gates stack z, r, h).
"""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    r = ops.sigmoid(gi[0] + gh[0])
    z = ops.sigmoid(gi[1] + gh[1])
    n = ops.tanh(gi[2] + ops.recurrent(2, r * state[0]))
    return ((1.0 - z) * n + z * state[0],)


def reference(gi, gh, state, recurrent):
    (h,) = state
    r = 1.0 / (1.0 + np.exp(-(gi[0] + gh[0])))
    z = 1.0 / (1.0 + np.exp(-(gi[1] + gh[1])))
    n = np.tanh(gi[2] + recurrent(2, r * h))
    return ((1.0 - z) * n + z * h,)


GRU_RESET_BEFORE = register(Cell(
    name="gru_reset_before", gates=3, states=("h",), step=step, reference=reference,
    doc="GRU, gates r, z, n, reset before the matmul: W_hn (r * h) (Cho et al., Keras "
        "reset_after=False)"))
