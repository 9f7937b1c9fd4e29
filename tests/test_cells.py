"""The cell registry, user cell files, and the cells' NumPy references."""

import os

import numpy as np
import pytest

import rnncc
from helpers import TOL_F32, check_against_reference
from rnncc import cells
from rnncc.errors import CellError, ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_builtin_cells_registered():
    names = cells.names()
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        assert name in names
    assert cells.get("lstm").gates == 4 and cells.get("lstm").states == ("h", "c")
    assert cells.get("gru").gates == 3 and cells.get("gru").states == ("h",)


def test_unknown_cell_lists_registered():
    with pytest.raises(ConfigError, match="unknown cell 'nope'.*lstm"):
        cells.get("nope")


@pytest.mark.parametrize("bad, match", [
    (dict(name="Bad Name"), "not allowed"),
    (dict(gates=0), "gates must be a positive int"),
    (dict(states=("c", "h")), "must start with 'h'"),
    (dict(states=("h", "h")), "repeat"),
])
def test_bad_cell_definitions(bad, match):
    args = dict(name="x", gates=1, states=("h",), step=lambda gi, gh, s: (gi[0],),
                reference=lambda gi, gh, s: (gi[0],))
    with pytest.raises(CellError, match=match):
        cells.Cell(**{**args, **bad})


@pytest.mark.parametrize("params, match", [
    (("w", "w"), "distinct names"), (("W",), "distinct names"),
    (("bias_ih_extra",), "not starting with weight_ih or weight_hh or bias_ih or bias_hh")])
def test_bad_cell_parameters(params, match):
    with pytest.raises(CellError, match=match):
        cells.Cell("x", 1, ("h",), lambda gi, gh, s, p: (gi[0] * p[0],),
                   lambda gi, gh, s, p: (gi[0] * p[0],), params=params)


@pytest.mark.parametrize("initial", [{"b": 1.0}, {"a": "one"}])
def test_initial_values_only_of_its_parameters_and_numbers(initial):
    with pytest.raises(CellError, match="cell 'x': initial takes numbers for its params"):
        cells.Cell("x", 1, ("h",), lambda gi, gh, s, p: (gi[0] * p[0],),
                   lambda gi, gh, s, p: (gi[0] * p[0],), params=("a",), initial=initial)


def test_a_parameter_the_step_never_uses_is_refused():
    cell = cells.Cell("unused_param", 1, ("h",), lambda gi, gh, s, p: (gi[0] * p[0] + gh[0],),
                      lambda gi, gh, s, p: (gi[0] * p[0] + gh[0],), params=("a", "b"))
    with pytest.raises(CellError, match="cell 'unused_param' declares parameter.s. b that its "
                                        "step never uses"):
        cells.register(cell)
    with pytest.raises(CellError, match="cell 'unused_param' declares parameter.s. b"):
        rnncc.compile(cell, 3, 4, 2, target="llvm")  # not registered: checked the same
    with pytest.raises(CellError, match="1 parameter values for its params"):
        cell.evaluate([1.0], [2.0], [0.0], [3.0])


def test_duplicate_name_refused():
    with pytest.raises(CellError, match="already registered"):
        cells.register(cells.Cell("lstm", 1, ("h",), lambda *a: a, lambda *a: a))


def test_step_with_wrong_arity_is_reported():
    cell = cells.Cell("wrong_arity", 1, ("h", "c"), lambda gi, gh, s: (gi[0],),
                      lambda gi, gh, s: (gi[0],))
    with pytest.raises(CellError, match="returned 1 values"):
        rnncc.compile(cell, 3, 4, 1, target="llvm")


@pytest.mark.parametrize("fname, name", [("mgu.py", "mgu"), ("coupled.py", "coupled"),
                                         ("leaky.py", "leaky")])
def test_cell_file_compiles_and_matches_reference(fname, name, rng):
    path = os.path.join(DATA, fname)
    (cell,) = cells.load_file(path)
    assert cell.name == name and cell.source == path
    assert name in cells.names()
    for options in ({}, {"fuse_pointwise": False}, {"gate_gemm": False}):
        module = rnncc.compile(path, 5, 9, 3, target="llvm", **options)
        assert module.metadata["cell"] == name
        assert check_against_reference(module, rng, 11, True) < TOL_F32


def test_cell_file_without_register(tmp_path):
    f = tmp_path / "empty_cell.py"
    f.write_text("x = 1\n")
    with pytest.raises(CellError, match="registered no cell"):
        cells.load_file(str(f))


def test_cell_file_that_raises(tmp_path):
    f = tmp_path / "broken_cell.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(CellError, match="failed to import: RuntimeError: boom"):
        cells.load_file(str(f))


@pytest.mark.parametrize("cell", cells.names())
def test_reference_step_matches_torch_cell(cell, rng):
    """Each cell's NumPy step against torch's single-step cell (where torch has one)."""
    torch = pytest.importorskip("torch")
    spec = cells.get(cell).torch
    if spec is None:
        pytest.skip("no torch equivalent")
    c = cells.get(cell)
    mod = getattr(torch.nn, spec[0] + "Cell")(4, 6, **spec[1]).double()
    x = rng.standard_normal((3, 4))
    state = [rng.standard_normal((3, 6)) for _ in c.states]
    sd = {k: v.numpy() for k, v in mod.state_dict().items()}
    gi = x @ sd["weight_ih"].T + sd["bias_ih"]
    gh = state[0] @ sd["weight_hh"].T + sd["bias_hh"]
    parts = [slice(g * 6, (g + 1) * 6) for g in range(c.gates)]
    ours = c.reference([gi[:, p] for p in parts], [gh[:, p] for p in parts], state)
    with torch.no_grad():
        t_state = tuple(torch.tensor(s) for s in state)
        theirs = mod(torch.tensor(x), t_state if len(state) > 1 else t_state[0])
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-12, atol=1e-12)
