"""Elman RNN with tanh, as torch.nn.RNN(nonlinearity="tanh"): one gate, h' = tanh(gi + gh)."""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    return (ops.tanh(gi[0] + gh[0]),)


def reference(gi, gh, state):
    return (np.tanh(gi[0] + gh[0]),)


RNN_TANH = register(
    Cell(
        name="rnn_tanh",
        gates=1,
        states=("h",),
        step=step,
        reference=reference,
        torch=("RNN", {"nonlinearity": "tanh"}),
        doc="Elman RNN, h' = tanh(W_ih x + b_ih + W_hh h + b_hh)",
    )
)
