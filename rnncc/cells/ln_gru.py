"""Layer-normalised GRU (Ba et al., "Layer normalization", 2016, as haste's LayerNormGRU):
gates r, z, n stacked in that order, as torch.nn.GRU, the reset gate applied after the
recurrent product. Each projection is normalised over the G*H values of its batch row, with a
gain and a bias a gate unit (LN(v) = (v - mean) / sqrt(var + 1e-5)):

    u_q = LN(gi)_q * gamma_ih_q + beta_ih_q    w_q = LN(gh)_q * gamma_hh_q + beta_hh_q
    r = sigmoid(u_r + w_r)    z = sigmoid(u_z + w_z)    n = tanh(u_n + r * w_n)
    h' = (1 - z) * n + z * h

gi and gh include bias_ih and bias_hh; with ``bias=False`` (or zero biases) this is haste's
LayerNormGRU: its gamma [2, 3H] is gamma_ih, gamma_hh; bias and recurrent_bias are beta_ih
and beta_hh (haste stacks its gates z, r, n).
"""

import numpy as np

from . import ops
from ._base import Cell, register
from .ln_lstm import layer_norm

GATES = "rzn"
PARAMS = tuple(f"{kind}_{w}_{q}" for kind in ("gamma", "beta") for w in ("ih", "hh")
               for q in GATES)


def step(gi, gh, state, params):
    p = dict(zip(PARAMS, params))
    a, b = ops.layer_norm(gi), ops.layer_norm(gh)
    u = [a[k] * p[f"gamma_ih_{q}"] + p[f"beta_ih_{q}"] for k, q in enumerate(GATES)]
    w = [b[k] * p[f"gamma_hh_{q}"] + p[f"beta_hh_{q}"] for k, q in enumerate(GATES)]
    r, z = ops.sigmoid(u[0] + w[0]), ops.sigmoid(u[1] + w[1])
    n = ops.tanh(u[2] + r * w[2])
    return ((1.0 - z) * n + z * state[0],)


def reference(gi, gh, state, params):
    p = dict(zip(PARAMS, params))
    a = np.split(layer_norm(np.concatenate(gi, -1)), 3, -1)
    b = np.split(layer_norm(np.concatenate(gh, -1)), 3, -1)
    u = [a[k] * p[f"gamma_ih_{q}"] + p[f"beta_ih_{q}"] for k, q in enumerate(GATES)]
    w = [b[k] * p[f"gamma_hh_{q}"] + p[f"beta_hh_{q}"] for k, q in enumerate(GATES)]
    r, z = 1.0 / (1.0 + np.exp(-(u[0] + w[0]))), 1.0 / (1.0 + np.exp(-(u[1] + w[1])))
    n = np.tanh(u[2] + r * w[2])
    return ((1.0 - z) * n + z * state[0],)


LN_GRU = register(Cell(
    name="ln_gru", gates=3, states=("h",), step=step, reference=reference, params=PARAMS,
    initial={p: 1.0 if p.startswith("gamma") else 0.0 for p in PARAMS},
    doc="layer-normalised GRU, gates r, z, n, reset after the matmul (haste's LayerNormGRU)"))
