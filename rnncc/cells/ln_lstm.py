"""Layer-normalised LSTM (Ba et al., "Layer normalization", 2016, as haste's LayerNormLSTM):
gates i, f, g, o stacked in that order, as torch.nn.LSTM. Each projection is normalised over
the G*H values of its batch row, with a gain a gate unit; the new cell state over its H values,
with a gain and a bias, before the output's tanh (LN(v) = (v - mean) / sqrt(var + 1e-5)):

    v_q = LN(gi)_q * gamma_ih_q + LN(gh)_q * gamma_hh_q + beta_q        (q = i, f, g, o)
    c' = sigmoid(v_f) * c + sigmoid(v_i) * tanh(v_g)
    h' = sigmoid(v_o) * tanh(LN(c') * gamma_c + beta_c)

gi and gh include bias_ih and bias_hh; with ``bias=False`` (or zero biases) this is haste's
LayerNormLSTM: its gamma [2, 4H] is gamma_ih, gamma_hh; its bias [4H] is beta; gamma_h and
beta_h are gamma_c and beta_c (haste stacks its gates i, g, f, o).
"""

import numpy as np

from . import ops
from ._base import Cell, register

GATES = "ifgo"
PARAMS = tuple(f"gamma_{w}_{q}" for w in ("ih", "hh") for q in GATES) + tuple(
    f"beta_{q}" for q in GATES) + ("gamma_c", "beta_c")


def step(gi, gh, state, params):
    p = dict(zip(PARAMS, params))
    a, b = ops.layer_norm(gi), ops.layer_norm(gh)
    v = {q: a[k] * p[f"gamma_ih_{q}"] + b[k] * p[f"gamma_hh_{q}"] + p[f"beta_{q}"]
         for k, q in enumerate(GATES)}
    c = ops.sigmoid(v["f"]) * state[1] + ops.sigmoid(v["i"]) * ops.tanh(v["g"])
    (c_norm,) = ops.layer_norm([c])
    return ops.sigmoid(v["o"]) * ops.tanh(c_norm * p["gamma_c"] + p["beta_c"]), c


def layer_norm(x):
    """x [N, K] normalised over K, in NumPy."""
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)


def reference(gi, gh, state, params):
    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))

    p = dict(zip(PARAMS, params))
    a = np.split(layer_norm(np.concatenate(gi, -1)), 4, -1)
    b = np.split(layer_norm(np.concatenate(gh, -1)), 4, -1)
    v = {q: a[k] * p[f"gamma_ih_{q}"] + b[k] * p[f"gamma_hh_{q}"] + p[f"beta_{q}"]
         for k, q in enumerate(GATES)}
    c = sig(v["f"]) * state[1] + sig(v["i"]) * np.tanh(v["g"])
    return sig(v["o"]) * np.tanh(layer_norm(c) * p["gamma_c"] + p["beta_c"]), c


LN_LSTM = register(Cell(
    name="ln_lstm", gates=4, states=("h", "c"), step=step, reference=reference, params=PARAMS,
    initial={p: 1.0 if p.startswith("gamma") or p == "beta_f" else 0.0 for p in PARAMS},
    doc="layer-normalised LSTM, gates i, f, g, o (haste's LayerNormLSTM; Ba et al. 2016)"))
