"""Drop-in ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` (and any cell, :class:`Recurrent`) run by
rnncc's compiled modules: ``rnncc.nn.LSTM(...)`` where ``torch.nn.LSTM(...)`` was, or
``rnncc.nn.from_torch(module)``. Needs PyTorch."""

from .modules import GRU, LSTM, RNN, Recurrent, from_torch

__all__ = ["GRU", "LSTM", "RNN", "Recurrent", "from_torch"]
