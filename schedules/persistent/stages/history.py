"""Stage: what a training forward keeps for the backward pass (a kernel whose spec has
``kept`` parts; :mod:`rnncc.lowering.training`).

Every step, each pair stores its new states, ``<s>_steps[t + 1]`` [T+1, N, H] (the initial
ones at 0, once), and the parts of its gate projections the cell's derivative needs, ``pre``
[T, N, P*H], part i at columns i*H ..: gate g's ``gi + gh`` ("sum"), ``gi`` or ``gh``, or the
value of the step's recurrent product of a value ("product"; biases included). The backward
pass reads them; nothing of a step is computed twice.
"""

from __future__ import annotations

from functools import partial

from .cell import each_pair, store


def keep_initial(spec, steps, st, bx, tx):
    """The pairs' initial states (in ``st``) into ``steps[k][0]``."""
    states = spec.states

    def body(it, n, j):
        for k in range(states):
            store(steps[k], st[it * states + k], 0, spec.batch_row(bx, n), j)
    each_pair(spec, bx, tx, body)


def keep(spec, pre, steps, gates_i, gates_h, products, new, step, row, j):
    """A pair's step ``step``: its kept parts of ``gates_i`` and ``gates_h`` (lists of G
    values) and ``products`` (the values of its recurrent products of values, in the step's
    order), and its ``new`` states (after its length's mask)."""
    h = spec.hidden
    for i, (g, part) in enumerate(spec.kept):
        value = {"sum": lambda g=g: gates_i[g] + gates_h[g], "gi": lambda g=g: gates_i[g],
                 "gh": lambda g=g: gates_h[g], "product": lambda g=g: products[g]}[part]()
        store(pre, value, step, row, i * h + j)
    for k, value in enumerate(new):
        store(steps[k], value, step + 1, row, j)


def keeper(spec, pre, steps):
    """The cell stage's ``keep`` of a training forward (None for inference)."""
    return partial(keep, spec, pre, steps) if spec.kept else None
