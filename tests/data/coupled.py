"""A cell whose second state reads the first previous state (h), to catch in-place hazards:
three gates, c' = tanh(gi_0 + gh_0) + 0.5 * h,  h' = sigmoid(gi_1 + gh_1) * tanh(c' - gi_2)."""

import numpy as np

from rnncc.cells import Cell, ops, register


def step(gi, gh, state):
    c = ops.tanh(gi[0] + gh[0]) + 0.5 * state[0]
    return ops.sigmoid(gi[1] + gh[1]) * ops.tanh(c - gi[2]), c


def reference(gi, gh, state):
    c = np.tanh(gi[0] + gh[0]) + 0.5 * state[0]
    return 1.0 / (1.0 + np.exp(-(gi[1] + gh[1]))) * np.tanh(c - gi[2]), c


register(Cell(name="coupled", gates=3, states=("h", "c"), step=step, reference=reference,
              doc="test cell: c reads the previous h"))
