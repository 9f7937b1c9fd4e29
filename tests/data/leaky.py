"""A user's cell file with a per-unit parameter: a leaky tanh RNN, one gate, whose units
each learn how fast they forget (a leak rate sigmoid(w_leak) in (0, 1) per unit, as the
leaky-integrator units of echo state networks, Jaeger et al. 2007, with the rate learned).

    h' = h + sigmoid(w_leak) * (tanh(gi + gh) - h)
"""

import numpy as np

from rnncc.cells import Cell, ops, register


def step(gi, gh, state, params):
    return (state[0] + ops.sigmoid(params[0]) * (ops.tanh(gi[0] + gh[0]) - state[0]),)


def reference(gi, gh, state, params):
    rate = 1.0 / (1.0 + np.exp(-params[0]))
    return (state[0] + rate * (np.tanh(gi[0] + gh[0]) - state[0]),)


register(Cell(name="leaky", gates=1, states=("h",), step=step, reference=reference,
              params=("w_leak",), doc="leaky tanh RNN, a learned leak rate a unit (test cell)"))
