"""Float64 NumPy reference for a whole sequence, from a cell's NumPy step."""

from __future__ import annotations

import numpy as np

from .cells import Cell, autodiff


def run(cell: Cell, x, weights: dict, initial: dict | None = None, lengths=None):
    """Run ``cell`` over ``x`` [T, N, C] in float64.

    ``weights`` has ``weight_ih_l0`` [G*H, C], ``weight_hh_l0`` [G*H, H], ``bias_ih_l0`` and
    ``bias_hh_l0`` [G*H], and ``<p>_l0`` [H] for each of the cell's ``params``; with
    ``weight_hr_l0`` [P, H] (a projection, torch's ``proj_size``) the new h is W_hr h', h is
    [N, P] and W_hh [G*H, P]. ``initial`` maps state names to [1, N, H] arrays (h's [1, N, P]
    with a projection; zeros if absent). ``lengths`` [N]: sample n runs its first lengths[n]
    steps only (its final states are those of its own last step, its outputs past it zero).
    Returns ``(y [T, N, H or P], {state: [1, N, H or P]})``.
    """
    x = np.asarray(x, np.float64)
    w_ih = np.asarray(weights["weight_ih_l0"], np.float64)
    w_hh = np.asarray(weights["weight_hh_l0"], np.float64)
    b_ih = np.asarray(weights["bias_ih_l0"], np.float64)
    b_hh = np.asarray(weights["bias_hh_l0"], np.float64)
    w_hr = (np.asarray(weights["weight_hr_l0"], np.float64) if "weight_hr_l0" in weights
            else None)
    params = [np.asarray(weights[f"{p}_l0"], np.float64) for p in cell.params]
    steps, batch, _ = x.shape
    hidden = w_hh.shape[0] // cell.gates
    widths = [w_hh.shape[1]] + [hidden] * (len(cell.states) - 1)
    initial = initial or {}
    state = [np.asarray(initial[s], np.float64).reshape(batch, w) if s in initial
             else np.zeros((batch, w)) for s, w in zip(cell.states, widths)]
    recurrent = None
    if autodiff.trace(cell).products:
        def recurrent(g, v):
            rows = slice(g * hidden, (g + 1) * hidden)
            return np.asarray(v, np.float64) @ w_hh[rows].T + b_hh[rows]
    active = (np.ones((steps, batch), bool) if lengths is None
              else np.arange(steps)[:, None] < np.asarray(lengths)[None, :])
    ys = np.empty((steps, batch, widths[0]))
    for t in range(steps):
        gi = x[t] @ w_ih.T + b_ih
        gh = state[0] @ w_hh.T + b_hh
        split = [slice(g * hidden, (g + 1) * hidden) for g in range(cell.gates)]
        new = list(cell.reference_step([gi[:, s] for s in split], [gh[:, s] for s in split],
                                       state, params, recurrent))
        if w_hr is not None:
            new[0] = np.asarray(new[0], np.float64) @ w_hr.T
        state = [np.where(active[t][:, None], np.asarray(v, np.float64), old)
                 for v, old in zip(new, state)]
        ys[t] = np.where(active[t][:, None], state[0], 0.0)
    return ys, {s: v.reshape(1, batch, w) for s, v, w in zip(cell.states, state, widths)}


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| over all elements (ref nonzero); NaN or inf in out gives inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def reverse_steps(x, lengths=None):
    """Each sample's steps of ``x`` [T, N, F] reversed within its length (``x[len - 1 - t, n]``
    for t < len; the steps past it stay where they are)."""
    x = np.asarray(x)
    steps, batch = x.shape[:2]
    lengths = np.full(batch, steps) if lengths is None else np.asarray(lengths)
    t = np.arange(steps)[:, None]
    index = np.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)
    return x[index, np.arange(batch)[None, :]]


def run_bidirectional(cell: Cell, x, weights: dict, initial: dict | None = None, lengths=None):
    """A bidirectional layer in float64, as torch's ``bidirectional=True``: ``weights`` as for
    :func:`run` and the same names with ``_reverse``; ``initial`` maps state names to [2, N, H]
    (the forward direction first). The reverse direction runs each sample's steps backwards
    from its own last one. Returns ``(y [T, N, 2*H], {state: [2, N, H]})``."""
    initial = initial or {}
    ys, finals = [], []
    for d, suffix in enumerate(("", "_reverse")):
        own = {name: weights[name + suffix] for name in
               ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_hr_l0",
                *(f"{p}_l0" for p in cell.params)) if name + suffix in weights}
        start = {s: np.asarray(v)[d:d + 1] for s, v in initial.items()}
        seq = x if d == 0 else reverse_steps(x, lengths)
        y, states = run(cell, seq, own, start, lengths)
        ys.append(y if d == 0 else reverse_steps(y, lengths))
        finals.append(states)
    return np.concatenate(ys, axis=2), {s: np.concatenate([f[s] for f in finals])
                                        for s in cell.states}


def run_layers(cell: Cell, x, weights: dict, layers: int, initial: dict | None = None,
               lengths=None):
    """``layers`` L stacked one-direction layers in float64, as torch's ``num_layers``, each
    taking the y of the one below: ``weights`` as for :func:`run` for each layer k (``_l{k}``
    for ``_l0``); ``initial`` maps state names to [L, N, H]. Returns ``(y [T, N, H], {state:
    [L, N, H]})``."""
    initial = initial or {}
    finals = {s: [] for s in cell.states}
    for k in range(layers):
        own = {name.replace(f"_l{k}", "_l0"): w for name, w in weights.items()
               if name.endswith(f"_l{k}")}
        x, states = run(cell, x, own, {s: np.asarray(v)[k:k + 1] for s, v in initial.items()},
                        lengths)
        for s in cell.states:
            finals[s].append(states[s])
    return x, {s: np.concatenate(v) for s, v in finals.items()}


def run_module(cell: Cell, x, weights: dict, directions: int = 1, layers: int = 1,
               initial: dict | None = None, lengths=None):
    """The float64 reference of a module of ``directions`` (a bidirectional layer:
    :func:`run_bidirectional`) or ``layers`` (a wavefront: :func:`run_layers`), else
    :func:`run`; the same arguments and results as those."""
    if layers > 1:
        return run_layers(cell, x, weights, layers, initial, lengths)
    if directions == 2:
        return run_bidirectional(cell, x, weights, initial, lengths)
    return run(cell, x, weights, initial, lengths)
