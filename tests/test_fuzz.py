"""Property-based tests: random cells (built-in, and user cells generated here), sizes,
lengths, directions, dtypes, initial states, schedule options and array kinds, each compared
with the float64 reference.

The CPU run (llvm) is in the default suite with a small budget; ``RNNCC_FUZZ_EXAMPLES`` sets
how many configurations each test draws (the GPU run: ``--gpu -m gpu``, cuda). A failure
prints the configuration that shows it (shrunk); it becomes a regular test once fixed.
"""

import os
import zlib

import numpy as np
import pytest

import rnncc
from helpers import TOL, TOL_TF32, sequence_loss_grads, state_error
from rnncc import reference
from rnncc.cells import Cell, ops

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = int(os.environ.get("RNNCC_FUZZ_EXAMPLES", "6"))
SETTINGS = hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck),
                               print_blob=True)
TARGETS = ["llvm", pytest.param("cuda", marks=pytest.mark.gpu)]
#: The registered cells (the LSTM and GRU variants, with per-unit parameters, among them).
BUILTIN = tuple(rnncc.cells.names())
OPTIONS = [{}, {"input_gemm": False}, {"gate_gemm": False}, {"fuse_pointwise": False}]
CUDA_OPTIONS = [{"persistent": "off"}]


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


TE_FUNCTIONS = {"sigmoid": ops.sigmoid, "tanh": ops.tanh}
NUMPY_FUNCTIONS = {"sigmoid": _sigmoid, "tanh": np.tanh}


def _program(spec, fn):
    """The step of a generated cell, with the activation functions ``fn`` (TE or NumPy).

    Gate g is ``act_g(gi_g + gh_g)``, or ``act_g(gi_g + a_{g-1} * gh_g)`` where it is reset
    by the gate before it (as GRU's n). One state: ``h' = a_i * h + (1 - a_i) * a_j``. Two
    (h, c): ``c' = a_i * c + a_j * a_k [+ 0.5 * h]`` and ``h' = a_m * tanh(c')``."""
    acts, reset, two, (i, j, k, m), reads_h = spec

    def step(gi, gh, state):
        a = []
        for g, act in enumerate(acts):
            a.append(fn[act](gi[g] + (a[g - 1] * gh[g] if reset[g] and g else gh[g])))
        if not two:
            return (a[i] * state[0] + (1.0 - a[i]) * a[j],)
        c = a[i] * state[1] + a[j] * a[k]
        if reads_h:
            c = c + 0.5 * state[0]
        return a[m] * fn["tanh"](c), c

    return step


@st.composite
def user_cells(draw):
    """A cell a user could write: 1 to 4 gates, one state or two, some gates reset by
    others, c reading the previous h or not."""
    gates = draw(st.integers(1, 4))
    acts = tuple(draw(st.sampled_from(sorted(TE_FUNCTIONS))) for _ in range(gates))
    reset = tuple(draw(st.booleans()) for _ in range(gates))
    two = draw(st.booleans())
    picks = tuple(draw(st.integers(0, gates - 1)) for _ in range(4))
    spec = (acts, reset, two, picks, two and draw(st.booleans()))
    name = f"fuzz_{zlib.crc32(repr(spec).encode()):08x}"
    return Cell(name=name, gates=gates, states=("h", "c") if two else ("h",),
                step=_program(spec, TE_FUNCTIONS), reference=_program(spec, NUMPY_FUNCTIONS),
                doc=f"generated: {spec}")


@st.composite
def layers(draw, target):
    cell = draw(st.one_of(st.sampled_from(BUILTIN).map(rnncc.cells.get), user_cells()))
    options = draw(st.sampled_from(OPTIONS + (CUDA_OPTIONS if target == "cuda" else [])))
    return {
        "cell": cell,
        "input_size": draw(st.integers(1, 40)),
        "hidden": draw(st.one_of(st.sampled_from([1, 3, 33]), st.integers(1, 48))),
        "batch": draw(st.integers(1, 8)),
        "steps": draw(st.integers(1, 24)),
        "directions": draw(st.sampled_from([1, 2])),
        "lengths": draw(st.booleans()),
        "initial": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float32", "float16"] if target == "cuda"
                                      else ["float32"])),
        "options": options,
        "arrays": draw(st.sampled_from(["numpy", "torch"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _arrays(kind, target):
    """Turn NumPy inputs into the kind of array the call takes."""
    if kind == "numpy":
        return np.asarray
    torch = pytest.importorskip("torch")
    device = "cuda" if target == "cuda" else "cpu"
    return lambda a: torch.tensor(a, device=device)


def _host(value):
    return value.cpu().numpy() if hasattr(value, "cpu") else np.asarray(value)


@pytest.mark.parametrize("target", TARGETS)
def test_random_layers_match_the_float64_reference(target):
    @SETTINGS
    @hypothesis.given(layers(target))
    def check(case):
        cell, h, n, c = case["cell"], case["hidden"], case["batch"], case["input_size"]
        steps, dirs, dt = case["steps"], case["directions"], case["dtype"]
        module = rnncc.compile(cell, c, h, n, dtype=dt, target=target, tuning="off",
                               lengths=case["lengths"], directions=dirs, **case["options"])
        rng = np.random.default_rng(case["seed"])
        k = 1.0 / np.sqrt(h)
        weights = {}
        for suffix in ("", "_reverse")[:dirs]:
            for name, shape in (("weight_ih_l0", (cell.gates * h, c)),
                                ("weight_hh_l0", (cell.gates * h, h)),
                                ("bias_ih_l0", (cell.gates * h,)),
                                ("bias_hh_l0", (cell.gates * h,))):
                weights[name + suffix] = rng.uniform(-k, k, shape).astype(dt)
            for name in cell.params:  # per unit, [H]
                weights[f"{name}_l0{suffix}"] = rng.uniform(-1, 1, h).astype(dt)
        x = rng.standard_normal((steps, n, c)).astype(dt)
        initial = ({s: rng.standard_normal((dirs, n, h)).astype(dt) for s in cell.states}
                   if case["initial"] else {})
        lengths = rng.integers(1, steps + 1, n) if case["lengths"] else None
        expect_y, expect_states = reference.run_module(cell, x, weights, dirs, 1, initial,
                                                       lengths)
        array = _arrays(case["arrays"], target)
        extra = {} if lengths is None else {"lengths": array(lengths.astype(np.int32))}
        y, finals = module(array(x), {k: array(v) for k, v in weights.items()},
                           **{f"{s}0": array(v) for s, v in initial.items()}, **extra)
        finals = finals if isinstance(finals, tuple) else (finals,)
        errors = [reference.relative_error(_host(y), expect_y)]
        step_norm = np.linalg.norm(expect_y) / np.sqrt(steps)  # a state near zero: absolute
        errors += [state_error(_host(f), expect_states[s], step_norm)
                   for f, s in zip(finals, cell.states)]
        assert max(errors) < TOL[dt], (f"relative error {max(errors):.3e} for "
                                       f"{cell.doc or cell.name}, {case}")

    check()



@st.composite
def trained_layers(draw):
    """Tiny layers for training: central differences run the reference once an input
    element."""
    return {
        "cell": draw(st.one_of(st.sampled_from(BUILTIN).map(rnncc.cells.get), user_cells())),
        "input_size": draw(st.integers(1, 3)),
        "hidden": draw(st.integers(1, 4)),
        "batch": draw(st.integers(1, 3)),
        "steps": draw(st.integers(1, 5)),
        "lengths": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_random_layers_train_as_central_differences(target):
    """A layer's training step (``train_forward``, ``backward``) of drawn cells, built-in and
    generated (a cell a user writes trains as it compiles), against central differences of
    the float64 reference: the gradients of x, the initial states and every weight and bias,
    with lengths or without (a third as many as the other tests draw)."""
    @hypothesis.settings(SETTINGS, max_examples=max(1, EXAMPLES // 3))
    @hypothesis.given(trained_layers())
    def check(case):
        cell, c, h, n = case["cell"], case["input_size"], case["hidden"], case["batch"]
        steps = case["steps"]
        module = rnncc.compile(cell, c, h, n, target=target, tuning="off", training=True,
                               lengths=case["lengths"])
        rng = np.random.default_rng(case["seed"])

        def f32(shape, scale=1.0):  # float32 values, in float64
            return (rng.uniform(-scale, scale, shape).astype(np.float32).astype(np.float64))

        k = 1.0 / np.sqrt(h)
        weights = {"weight_ih_l0": f32((cell.gates * h, c), k),
                   "weight_hh_l0": f32((cell.gates * h, h), k),
                   "bias_ih_l0": f32(cell.gates * h, k), "bias_hh_l0": f32(cell.gates * h, k),
                   **{f"{name}_l0": f32(h) for name in cell.params}}
        x = f32((steps, n, c), 2.0)
        initial = {s: f32((1, n, h)) for s in cell.states}
        lengths = rng.integers(1, steps + 1, n) if case["lengths"] else None
        dy = rng.standard_normal((steps, n, h))
        d_finals = {s: rng.standard_normal((1, n, h)) for s in cell.states}
        want = sequence_loss_grads(cell, x, weights, initial, lengths, dy, d_finals)
        single = {k_: v.astype(np.float32) for k_, v in weights.items()}
        _, _, kept = module.train_forward(
            x.astype(np.float32), single, lengths=lengths,
            **{f"{s}0": v.astype(np.float32) for s, v in initial.items()})
        got = module.backward(x.astype(np.float32), single, kept, dy.astype(np.float32),
                              tuple(d_finals[s].astype(np.float32) for s in cell.states),
                              lengths=lengths)
        assert set(got) == set(want)
        # a gradient summed from terms that cancel (a layer norm's beta of one unit: 3e-4 from
        # terms of 1e-1) is measured against 1% of the largest gradient: float32 sums of such
        # terms are off by about 1e-7 of their size, not of the sum's
        floor = 1e-2 * max(np.abs(value).max() for value in want.values())
        for name, value in want.items():
            diff = np.abs(np.asarray(_host(got[name]), np.float64) - value).max()
            err = diff / max(np.abs(value).max(), floor)
            assert err < 1e-4, (f"{name}: relative error {err:.3e} for "
                                f"{cell.doc or cell.name}, {case}")

    check()

@st.composite
def networks(draw):
    kind = draw(st.sampled_from(["LSTM", "GRU", "RNN", "RNN_relu"]))
    hidden = draw(st.one_of(st.sampled_from([1, 3, 33]), st.integers(1, 40)))
    projects = kind == "LSTM" and hidden > 1 and draw(st.booleans())
    return {
        "kind": kind,
        "input_size": draw(st.integers(1, 24)),
        "hidden": hidden,
        "proj_size": draw(st.integers(1, hidden - 1)) if projects else 0,
        "layers": draw(st.integers(1, 3)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "batch": draw(st.integers(1, 7)),
        "steps": draw(st.integers(1, 16)),
        "form": draw(st.sampled_from(["tensor", "lengths", "packed", "packed_sorted"])),
        "hx": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _network(torch, case, device):
    """The drawn network: torch's module in float64, rnncc.nn's made from it on ``device`` in
    float32, x (batch-first where the module is), the samples' lengths and the initial states
    (a list: h, and c for an LSTM; empty where none are drawn), all float64 on the CPU."""
    gen = torch.Generator().manual_seed(case["seed"])
    kind, extra = ((case["kind"], {}) if case["kind"] != "RNN_relu"
                   else ("RNN", {"nonlinearity": "relu"}))
    if case["proj_size"]:
        extra["proj_size"] = case["proj_size"]
    with torch.random.fork_rng():
        torch.manual_seed(case["seed"])
        theirs = getattr(torch.nn, kind)(
            case["input_size"], case["hidden"], num_layers=case["layers"],
            bias=case["bias"], batch_first=case["batch_first"],
            bidirectional=case["bidirectional"], **extra).double()
    ours = rnncc.nn.from_torch(theirs).to(device, torch.float32)
    n, steps = case["batch"], case["steps"]
    shape = (n, steps) if case["batch_first"] else (steps, n)
    x = torch.randn(*shape, case["input_size"], generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, steps + 1, (n,), generator=gen)
    if case["form"] == "packed_sorted":
        lengths = lengths.sort(descending=True).values
    states = case["layers"] * (2 if case["bidirectional"] else 1)
    sizes = [case["proj_size"] or case["hidden"]] + ([case["hidden"]] if kind == "LSTM" else [])
    hx = [torch.randn(states, n, size, generator=gen, dtype=torch.float64)
          for size in sizes] if case["hx"] else []
    return theirs, ours, x, lengths, hx


def _run(torch, module, case, lengths, inputs, where, ours):
    """``module`` on ``inputs`` (x, then the initial states) in the drawn form: padded, padded
    with ``lengths`` (rnncc.nn takes them; torch a PackedSequence, padded back) or packed.
    Returns y (padded, or the packed data) and the final states as a tuple."""
    utils = torch.nn.utils.rnn
    data, kwargs = inputs[0], {}
    if case["form"] == "lengths" and module is ours:
        kwargs["lengths"] = lengths.to(where)
    elif case["form"] != "tensor":
        data = utils.pack_padded_sequence(data, lengths, batch_first=case["batch_first"],
                                          enforce_sorted=case["form"] == "packed_sorted")
    state = (None if len(inputs) == 1 else tuple(inputs[1:]) if len(inputs) > 2
             else inputs[1])
    out, finals = module(data, state, **kwargs)
    if case["form"] == "lengths" and module is not ours:
        out, _ = utils.pad_packed_sequence(out, batch_first=case["batch_first"],
                                           total_length=case["steps"])
    elif case["form"] in ("packed", "packed_sorted"):
        out = out.data
    return out, finals if isinstance(finals, tuple) else (finals,)


@pytest.mark.parametrize("target", TARGETS)
def test_random_networks_match_torch_in_float64(target, tmp_path, monkeypatch):
    """rnncc.nn against torch's own module in float64 on the CPU, the same weights: layers,
    directions, LSTM projections (``proj_size``) or none, batch-first, bias or none, padded
    with lengths or packed (sorted or not), initial states or none."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("RNNCC_CACHE_DIR", str(tmp_path))
    device = "cuda" if target == "cuda" else "cpu"

    @SETTINGS
    @hypothesis.given(networks())
    def check(case):
        theirs, ours, x, lengths, hx = _network(torch, case, device)

        def call(module, dtype, where):
            with torch.no_grad():
                out, finals = _run(torch, module, case, lengths,
                                   [t.to(where, dtype) for t in (x, *hx)], where, ours)
            return [t.double().cpu().numpy() for t in (out, *finals)]

        for a, b in zip(call(ours, torch.float32, device), call(theirs, torch.float64, "cpu")):
            err = reference.relative_error(a, b)
            assert err < TOL["float32"], f"relative error {err:.3e} for {case}"

    check()


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_random_networks_train_as_torch_in_float64(target, tmp_path, monkeypatch):
    """rnncc.nn's gradients against torch's own module in float64 on the CPU, the same
    weights and the same loss (random weights on y and the final states): of x, the initial
    states and every weight and bias, over the networks the inference test draws (a third as
    many: each compiles a training module a layer and direction)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("RNNCC_CACHE_DIR", str(tmp_path))
    device = "cuda" if target == "cuda" else "cpu"

    @hypothesis.settings(SETTINGS, max_examples=max(1, EXAMPLES // 3))
    @hypothesis.given(networks())
    def check(case):
        theirs, ours, x, lengths, hx = _network(torch, case, device)

        def grads(module, dtype, where):
            leaves = [t.to(where, dtype).requires_grad_() for t in (x, *hx)]
            out, finals = _run(torch, module, case, lengths, leaves, where, ours)
            weights = torch.Generator().manual_seed(case["seed"] + 1)
            loss = 0
            for t in (out, *finals):
                loss = loss + (t * torch.randn(t.shape, generator=weights,
                                               dtype=torch.float64).to(where, dtype)).sum()
            loss.backward()
            named = [(f"input {i}", t.grad) for i, t in enumerate(leaves)]
            named += [(k, p.grad) for k, p in module.named_parameters()]
            return {k: g.double().cpu().numpy() for k, g in named}

        mine, want = grads(ours, torch.float32, device), grads(theirs, torch.float64, "cpu")
        assert set(mine) == set(want)
        for name, value in want.items():
            err = reference.relative_error(mine[name], value)
            assert err < 1e-4, f"{name}: relative error {err:.3e} for {case}"

    check()


#: Sizes a GPU network of :func:`gpu_networks` draws its C and H from: odd ones, multiples of 8
#: off the tensor-core rules' tiles, and whole tiles.
GPU_SIZES = (1, 3, 33, 40, 64, 130, 136, 257, 416, 512, 700, 1000, 1024, 1536, 2048)


@st.composite
def gpu_networks(draw):
    """:func:`networks` at the sizes and types users bring to a GPU: C and H from GPU_SIZES,
    batch 1-256, T 1-40, float32, TF32, float16 or bfloat16."""
    case = draw(networks())
    hidden = draw(st.sampled_from(GPU_SIZES))
    case.update(input_size=draw(st.sampled_from(GPU_SIZES)), hidden=hidden,
                batch=draw(st.sampled_from([1, 3, 7, 8, 16, 33, 64, 100, 128, 256])),
                steps=draw(st.sampled_from([1, 7, 40])),
                dtype=draw(st.sampled_from(["float32", "tf32", "float16", "bfloat16"])))
    if case["proj_size"]:
        case["proj_size"] = (draw(st.integers(1, hidden - 1)) if hidden > 1 else 0)
    # torch's float64 reference on the CPU in seconds: at most about 2e11 multiply-adds
    gates = {"LSTM": 4, "GRU": 3}.get(case["kind"], 1)
    directions = 2 if case["bidirectional"] else 1
    for key, fewer in (("steps", 1), ("batch", 16)):
        work = (gates * hidden * (case["input_size"] + hidden) * case["batch"] * case["steps"]
                * case["layers"] * directions)
        if work > 2e11:
            case[key] = min(case[key], fewer)
    return case


@pytest.mark.gpu
@pytest.mark.slow
def test_random_gpu_networks_match_torch_in_float64(tmp_path, monkeypatch):
    """rnncc.nn on CUDA at the sizes, batches and types of :func:`gpu_networks` (the products'
    rules past whole tiles, the persistent plans, batch groups, one kernel a step), against
    torch's module in float64 on the CPU from the same weights and inputs rounded to the
    type, within the type's bound (TF32: TOL_TF32)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("RNNCC_CACHE_DIR", str(tmp_path))

    @SETTINGS
    @hypothesis.given(gpu_networks())
    def check(case):
        dtype = case["dtype"]
        stored = getattr(torch, "float32" if dtype == "tf32" else dtype)
        theirs, _, x, lengths, hx = _network(torch, case, "cpu")
        theirs.to(stored)  # the weights as the type holds them, for both modules
        ours = rnncc.nn.from_torch(theirs, allow_tf32=dtype == "tf32").cuda()
        theirs.double()
        inputs = [t.to(stored).double() for t in (x, *hx)]
        with torch.no_grad():
            mine = _run(torch, ours, case, lengths, [t.to("cuda", stored) for t in inputs],
                        "cuda", ours)
            want = _run(torch, theirs, case, lengths, inputs, "cpu", ours)
        bound = TOL_TF32 if dtype == "tf32" else TOL[dtype]
        for a, b in zip((mine[0], *mine[1]), (want[0], *want[1])):
            err = reference.relative_error(a.double().cpu().numpy(), b.numpy())
            assert err < bound, f"relative error {err:.3e} for {case}"

    check()
