"""A user's cell file: the minimal gated unit (MGU), two gates f, n.

    f = sigmoid(gi_f + gh_f)       n = tanh(gi_n + f * gh_n)       h' = (1 - f) * h + f * n
"""

import numpy as np

from rnncc.cells import Cell, ops, register


def step(gi, gh, state):
    f = ops.sigmoid(gi[0] + gh[0])
    n = ops.tanh(gi[1] + f * gh[1])
    return ((1.0 - f) * state[0] + f * n,)


def reference(gi, gh, state):
    f = 1.0 / (1.0 + np.exp(-(gi[0] + gh[0])))
    n = np.tanh(gi[1] + f * gh[1])
    return ((1.0 - f) * state[0] + f * n,)


register(Cell(name="mgu", gates=2, states=("h",), step=step, reference=reference,
              doc="minimal gated unit (test cell)"))
