"""Helpers for the tests (not fixtures)."""

import functools

import numpy as np

import rnncc
from rnncc import reference
from rnncc.cells import autodiff
from rnncc.cells.autodiff import reduces

#: Bounds on ||out - ref|| / ||ref|| against the float64 reference (computed from the same
#: inputs rounded to the module's dtype).
TOL_F32 = 1e-5
TOL = {"float32": TOL_F32, "float16": 2e-3, "bfloat16": 1e-2}
#: The bound with ``allow_tf32=True`` (products of operands rounded to 10-bit mantissas).
TOL_TF32 = 5e-3


def round_tf32(x) -> np.ndarray:
    """``x`` (float32) rounded to TF32, to nearest with ties away from zero (``cvt.rna``)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def truncate_tf32(x) -> np.ndarray:
    """``x`` (float32) as the tensor cores read it in TF32: its low 13 bits dropped."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def persistent_cells() -> list[str]:
    """The registered cells the persistent kernels run in every form (inference, training,
    layers as a wavefront): all but those whose step reduces over the hidden units, by means
    (``ops.mean``) or a recurrent product of a value (``ops.recurrent``): the persistent
    kernels take those one layer a module (means: not the backward kernel; tested on their
    own)."""
    return [name for name in rnncc.cells.names() if not reduces(rnncc.cells.get(name))]


def takes_means(cell) -> bool:
    """Whether a registered cell's step takes means over the hidden units (``ops.mean``)."""
    return autodiff.takes_means(rnncc.cells.get(cell))


@functools.cache
def compiled(cell, input_size, hidden_size, batch, target="llvm", **options):
    """Compile once per configuration for the whole session."""
    return rnncc.compile(cell, input_size, hidden_size, batch, target=target, **options)


def check_against_reference(module, rng, steps, with_initial, to_array=np.asarray,
                            lengths=False):
    """Run ``module`` on fresh random inputs (rounded to its dtype), return the worst
    relative error against the float64 reference over y and every final state. ``lengths``:
    random lengths of the samples (the first 1 step, the last all T). A bidirectional module
    gets both directions' weights and states."""

    cell = rnncc.cells.get(module.cell)
    h, n, c = module.hidden_size, module.batch, module.input_size
    grids, dt = max(module.directions, module.layers), module.dtype
    weights = _random_weights(module, rng)
    x = rng.standard_normal((steps, n, c)).astype(dt)
    initial = ({s: rng.standard_normal((grids, n, h)).astype(dt) for s in cell.states}
               if with_initial else {})
    ln = None
    if lengths:
        ln = rng.integers(1, steps + 1, n)
        ln[0], ln[-1] = 1, steps
    ref_y, ref_states = reference.run_module(cell, x, weights, module.directions,
                                             module.layers, initial, ln)
    extra = {} if ln is None else {"lengths": to_array(ln)}
    y, finals = module(to_array(x.astype(dt)), {k: to_array(v.astype(dt)) for k, v in
                                                 weights.items()},
                       **{f"{s}0": to_array(v.astype(dt)) for s, v in initial.items()}, **extra)
    finals = finals if isinstance(finals, tuple) else (finals,)
    errors = [reference.relative_error(np.asarray(_host(y)), ref_y)]
    step_norm = np.linalg.norm(ref_y) / np.sqrt(steps)
    errors += [state_error(np.asarray(_host(f)), ref_states[s], step_norm)
               for f, s in zip(finals, cell.states)]
    return max(errors)


def state_error(out, ref, floor: float) -> float:
    """A final state's relative error, against its norm or ``floor`` (one step's output
    norm) where that is larger: a state that ends near zero is a cancellation of far larger
    terms (c = f * c + i * g), whose float32 error is absolute; at N = H = 1 that is one
    scalar (seen: c_T = 0.0038 off by 5e-8, 1.4e-5 relative, where float32 NumPy gave 5e-6)."""
    err, norm = reference.relative_error(out, ref), float(np.linalg.norm(ref))
    if not np.isfinite(err) or norm >= floor or norm == 0.0:
        return err
    return err * norm / floor


def check_across_steps(module, rng, lengths=False):
    """Assert ``module`` within TOL of float64 on fresh inputs at T = 1 and 100 (with initial
    states) and 37 (without); ``lengths``: random lengths of the samples."""
    for steps, initial in ((1, True), (37, False), (100, True)):
        err = check_against_reference(module, rng, steps, initial, lengths=lengths)
        assert err < TOL[module.dtype], f"T={steps}: relative error {err:.3e}"


def check_repeats_exactly(module, rng, steps=61, repeats=20, pack=True, entry=None):
    """Assert that ``repeats`` more runs of ``module`` on one fresh input of ``steps`` steps
    (weights packed once, or passed as arrays each call) give the first run's y bit for bit:
    a race between blocks shows as run-to-run differences. ``entry``: the schedule the packed
    weights must run ("persistent" or "sequence")."""

    dt = module.dtype
    w = _random_weights(module, rng)
    x = rng.standard_normal((steps, module.batch, module.input_size)).astype(dt)
    weights = module.pack(w) if pack else w
    if entry is not None:
        assert weights.entry == entry
    first = module(x, weights)[0]
    for _ in range(repeats):
        np.testing.assert_array_equal(module(x, weights)[0], first)


def _random_weights(module, rng) -> dict:
    """Fresh weights of every direction (``_l0``, ``_l0_reverse``) or layer (``_l{k}``) of
    ``module``, in its dtype."""
    from conftest import random_weights

    cell = rnncc.cells.get(module.cell)
    tags = ([f"_l{k}" for k in range(module.layers)] if module.layers > 1
            else ["_l0", "_l0_reverse"][:module.directions])
    return {k.replace("_l0", tag): v.astype(module.dtype) for tag in tags
            for k, v in random_weights(rng, cell.gates, module.input_size, module.hidden_size,
                                       params=cell.params).items()}


def _host(a):
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    if hasattr(a, "get"):
        return a.get()
    return a


def sequence_loss_grads(cell, x, weights, initial, lengths, dy, d_finals):
    """Central differences of sum(y * dy) + sum(final_s * d_finals[s]) through the float64
    reference, for every input (tiny sizes)."""
    def loss(x_, w_, s_):
        y, finals = reference.run(cell, x_, w_, s_, lengths)
        return float((y * dy).sum()) + sum(float((finals[k] * d_finals[k]).sum())
                                           for k in cell.states)

    def numeric(arr, f):
        out = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            keep = arr[idx]
            arr[idx] = keep + 1e-6
            up = f()
            arr[idx] = keep - 1e-6
            down = f()
            arr[idx] = keep
            out[idx] = (up - down) / 2e-6
        return out

    grads = {"x": numeric(x, lambda: loss(x, weights, initial))}
    for k, v in weights.items():
        grads[k] = numeric(v, lambda: loss(x, weights, initial))
    for k, v in initial.items():
        grads[f"{k}0"] = numeric(v, lambda: loss(x, weights, initial))
    return grads
