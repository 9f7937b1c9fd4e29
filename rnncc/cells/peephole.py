"""The peephole LSTM (Gers et al., "Learning precise timing with LSTM recurrent networks",
JMLR 2002; TensorFlow's ``LSTMCell(use_peepholes=True)``): gates i, f, g, o stacked in that
order, as torch.nn.LSTM, and peephole weights w_ci, w_cf, w_co [H]: i and f see c_{t-1},
o sees c_t.

    i = sigmoid(gi_i + gh_i + w_ci * c)     f = sigmoid(gi_f + gh_f + w_cf * c)
    g = tanh(gi_g + gh_g)                   c' = f * c + i * g
    o = sigmoid(gi_o + gh_o + w_co * c')    h' = o * tanh(c')
"""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state, params):
    w_ci, w_cf, w_co = params
    c = state[1]
    i = ops.sigmoid(gi[0] + gh[0] + w_ci * c)
    f = ops.sigmoid(gi[1] + gh[1] + w_cf * c)
    c_new = f * c + i * ops.tanh(gi[2] + gh[2])
    o = ops.sigmoid(gi[3] + gh[3] + w_co * c_new)
    return o * ops.tanh(c_new), c_new


def reference(gi, gh, state, params):
    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))

    w_ci, w_cf, w_co = params
    c = state[1]
    i, f = sig(gi[0] + gh[0] + w_ci * c), sig(gi[1] + gh[1] + w_cf * c)
    c_new = f * c + i * np.tanh(gi[2] + gh[2])
    return sig(gi[3] + gh[3] + w_co * c_new) * np.tanh(c_new), c_new


PEEPHOLE = register(
    Cell(
        name="peephole",
        gates=4,
        states=("h", "c"),
        step=step,
        reference=reference,
        params=("w_ci", "w_cf", "w_co"),
        doc="peephole LSTM, gates i, f, g, o; i, f see c, o sees c' (Gers et al. 2002)",
    )
)
