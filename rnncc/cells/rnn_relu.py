"""Elman RNN with ReLU, as torch.nn.RNN(nonlinearity="relu"): one gate, h' = relu(gi + gh)."""

import numpy as np

from . import ops
from ._base import Cell, register


def step(gi, gh, state):
    return (ops.relu(gi[0] + gh[0]),)


def reference(gi, gh, state):
    return (np.maximum(gi[0] + gh[0], 0.0),)


RNN_RELU = register(
    Cell(
        name="rnn_relu",
        gates=1,
        states=("h",),
        step=step,
        reference=reference,
        torch=("RNN", {"nonlinearity": "relu"}),
        doc="Elman RNN, h' = relu(W_ih x + b_ih + W_hh h + b_hh)",
    )
)
