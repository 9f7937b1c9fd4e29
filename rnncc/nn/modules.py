"""``torch.nn.LSTM`` / ``GRU`` / ``RNN`` as rnncc modules, and the same for any cell.

Constructors, parameter names and shapes (``weight_ih_l{k}[_reverse]`` [G*H, C or D*H],
``weight_hh_l{k}[_reverse]`` [G*H, H], ``bias_ih_l{k}[_reverse]``, ``bias_hh_l{k}[_reverse]``
[G*H]; gates in torch's order; a cell's per-unit parameters ``<name>_l{k}[_reverse]`` [H]),
initialisation (uniform in +-1/sqrt(H)), ``state_dict`` and ``forward`` are torch's: input
[T, N, C] (``batch_first``: [N, T, C]; unbatched: [T, C]) or a ``PackedSequence``, ``hx``
optional ([L*D, N, H] a state; a tuple for cells with several states, in the cell's order:
LSTM's (h, c)), outputs (y [T, N, D*H], h_n or the tuple of final states) of the same shapes
and kinds (a ``PackedSequence`` in gives one out). rnncc adds ``lengths`` ([N], 1 to T) for
padded input of samples of their own lengths.

The network runs on compiled layer modules (:mod:`.network`); they compile on first use for a
device, dtype and sizes and are kept on disk. A call that needs gradients (grad mode on, and
the input, a state or a parameter requiring grad) runs layer by layer on modules compiled for
training (:mod:`.training`): gradients of the input, the initial states and every weight.
"""

from __future__ import annotations

import collections
import math
import warnings

import torch
from torch.nn.utils.rnn import PackedSequence

from ..errors import ConfigError, InputError
from ..runtime.module import vouch_lengths
from ..spec import Options, Problem
from . import op, training
from .network import Layout, Network

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Recurrent(torch.nn.Module):
    """A multi-layer, optionally bidirectional network of ``cell`` (a registered cell's name,
    an :class:`rnncc.cells.Cell`, or a cell file's path), as ``torch.nn.LSTM`` is of LSTM
    cells. Arguments as torch's; ``proj_size`` P > 0 (LSTMP: h = W_hr h', ``weight_hr_l{k}``
    [P, H]) takes a cell whose step reads h only through W_hh. ``allow_tf32``: float32
    products may run on tensor cores in TF32, as torch's ``allow_tf32`` lets cuDNN (default
    off: IEEE float32; the half types are unaffected). ``tf32x3``: float32's large products
    on tensor cores as three TF32 products each, with IEEE float32's error (the schedule
    option of that name, and its default)."""

    def __init__(self, cell, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None,
                 allow_tf32: bool = False, tf32x3: bool = Options.tf32x3):
        super().__init__()
        from ..compiler.driver import resolve_cell

        for name, value, low in (("input_size", input_size, 1), ("hidden_size", hidden_size, 1),
                                 ("num_layers", num_layers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not (
                0 <= dropout <= 1):
            raise ConfigError(f"dropout must be a number from 0 to 1, got {dropout!r}")
        for name, value in (("allow_tf32", allow_tf32), ("tf32x3", tf32x3)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        self.cell = resolve_cell(cell)
        if proj_size:  # checked as a module of it would be (P below H, the cell fits)
            Problem(self.cell, input_size, hidden_size, 1, proj_size=proj_size)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bool(bias), bool(batch_first), bool(
            bidirectional)
        self.dropout, self.proj_size = float(dropout), int(proj_size)
        self.allow_tf32, self.tf32x3 = allow_tf32, tf32x3
        self._layout = Layout(self.cell, input_size, hidden_size, num_layers,
                              2 if bidirectional else 1, self.proj_size, allow_tf32, tf32x3)
        self._networks: dict = {}
        self._said_autocast = False
        self._names = self._weight_names()
        self._key = op.register(self)
        rows = self.cell.gates * hidden_size
        kw = {"device": device, "dtype": dtype}
        for layer in range(num_layers):
            for suffix in self._suffixes():
                width = self._layout.layer_input(layer)
                self.register_parameter(f"weight_ih_l{layer}{suffix}",
                                        torch.nn.Parameter(torch.empty(rows, width, **kw)))
                self.register_parameter(f"weight_hh_l{layer}{suffix}", torch.nn.Parameter(
                    torch.empty(rows, self._layout.recurrent_size, **kw)))
                if self.bias:
                    for which in ("ih", "hh"):
                        self.register_parameter(f"bias_{which}_l{layer}{suffix}",
                                                torch.nn.Parameter(torch.empty(rows, **kw)))
                if self.proj_size:
                    self.register_parameter(f"weight_hr_l{layer}{suffix}", torch.nn.Parameter(
                        torch.empty(self.proj_size, hidden_size, **kw)))
                for name in self.cell.params:  # the cell's per-unit parameters, [H] each
                    self.register_parameter(f"{name}_l{layer}{suffix}", torch.nn.Parameter(
                        torch.empty(hidden_size, **kw)))
        self.reset_parameters()

    def _suffixes(self):
        return ("", "_reverse") if self.bidirectional else ("",)

    def reset_parameters(self) -> None:
        """Every weight and bias uniform in [-1/sqrt(H), 1/sqrt(H)], as torch does, and so
        are a cell's per-unit parameters but those its ``initial`` sets (a gain's 1.0)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters():
            value = self.cell.initial.get(name.rsplit("_l", 1)[0])
            if value is None:
                torch.nn.init.uniform_(p, -bound, bound)
            else:
                torch.nn.init.constant_(p, value)

    def extra_repr(self) -> str:
        s = f"{self.cell.name}, {self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        for name, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                              ("bidirectional", False), ("proj_size", 0),
                              ("allow_tf32", False), ("tf32x3", Options.tf32x3)):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)}"
        return s

    def _weight_names(self):
        """The parameters' names in order: layer by layer, direction by direction."""
        names = (("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if self.bias else ())
                 + (("weight_hr",) if self.proj_size else ()) + self.cell.params)
        return [f"{name}_l{layer}{suffix}" for layer in range(self.num_layers)
                for suffix in self._suffixes() for name in names]

    def _run(self, x, states, lengths, weights, training):
        """The network on ``x`` [T, N, C]: y and the list of final states (the op's body;
        ``weights``: the parameters in ``_names``' order)."""
        between = self._between if training and self.dropout else None
        named = dict(zip(self._names, weights))
        return self._network(x, weights[0].dtype).run(x, states, lengths, named, between)

    def forward(self, input, hx=None, lengths=None):  # noqa: A002 - torch's name
        packed = isinstance(input, PackedSequence)
        if packed:
            if lengths is not None:
                raise InputError("lengths come with the PackedSequence; pass lengths only "
                                 "with a padded tensor")
            layout = _packed_layout(input)
            x, lengths = _unpacked(input, layout), layout[3]
            vouch_lengths(lengths, x.shape[0])  # 1 to T by the making: not read back
            unbatched = False
        else:
            x, unbatched = self._check_input(input)
            if lengths is not None:
                lengths = self._check_lengths(lengths, x)
        # no hx: no states ([]), the modules start from zeros of their own
        states = [] if hx is None else self._initial_states(hx, x, unbatched)
        weights = [getattr(self, n) for n in self._names]
        half = self._autocast_dtype(x)
        if half is not None:  # torch.autocast: float16 or bfloat16 modules, as torch's run
            x, states = x.to(half), [s.to(half) for s in states]
            weights = [w.to(half) for w in weights]
        if self._needs_grad(x, states, weights):
            states = states or self._initial_states(None, x, unbatched)
            y, finals = training.run(self, self._network(x, weights[0].dtype), x, states,
                                     lengths, dict(zip(self._names, weights)))
        elif torch.compiler.is_compiling():  # one node of the graph, with its shapes
            y, *finals = op.network(self._key, x, states, lengths, weights, self.training)
        else:  # eager: the op's body, without its dispatch (a tenth of a small call)
            y, finals = self._run(x, states, lengths, weights, self.training)
        if packed:
            return _repacked(y, input, layout), _finals(finals)
        return self._outputs(y, finals, unbatched)

    # -- the parts of forward ----------------------------------------------------------------

    def _check_input(self, x):
        """(x time major [T, N, C], whether it came unbatched)."""
        if not isinstance(x, torch.Tensor):
            raise InputError(f"input must be a torch.Tensor or a PackedSequence, got "
                             f"{type(x).__name__}")
        if x.dim() not in (2, 3):
            layout = "[N, T, C]" if self.batch_first else "[T, N, C]"
            raise InputError(f"input must be 3-D ({layout}) or 2-D ([T, C], unbatched), got "
                             f"shape {list(x.shape)}")
        unbatched = x.dim() == 2
        if unbatched:
            x = x[:, None]
        elif self.batch_first:
            x = x.transpose(0, 1)
        if x.shape[2] != self.input_size:
            raise InputError(f"input has {x.shape[2]} features (its last dimension), but this "
                             f"module's input_size is {self.input_size}")
        if x.shape[0] < 1 or x.shape[1] < 1:
            raise InputError(f"input has {x.shape[0]} steps and batch {x.shape[1]}; both must "
                             "be at least 1")
        return x, unbatched

    def _check_lengths(self, lengths, x):
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.as_tensor(lengths)
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex:
            raise InputError(f"lengths must be integers, got {lengths.dtype}")
        if tuple(lengths.shape) != (x.shape[1],):
            raise InputError(f"lengths has shape {list(lengths.shape)}, expected "
                             f"[{x.shape[1]}] (one a sample)")
        if lengths.device.type == "cpu" and x.device.type != "cpu":
            lengths = _to_device(lengths, x.device)
        if lengths.device != x.device:
            raise InputError(f"lengths is on {lengths.device}, but input is on {x.device}")
        return lengths

    def _needs_grad(self, x, states, weights) -> bool:
        """Whether the call must give gradients (then it runs :mod:`.training`'s way)."""
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, *states, *weights))

    def _autocast_dtype(self, x):
        """float16 or bfloat16 where torch.autocast asks for it on x's device and the module
        and x are float32, else None (another autocast dtype: the module runs float32, and
        says so once)."""
        kind = x.device.type
        if not torch.is_autocast_enabled(kind) or x.dtype != torch.float32 or next(
                self.parameters()).dtype != torch.float32:
            return None
        dtype = torch.get_autocast_dtype(kind)
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
        if not self._said_autocast:
            self._said_autocast = True
            warnings.warn(f"rnncc.nn: autocast to {dtype} is not supported (float16 and "
                          "bfloat16 are); this module runs in float32", stacklevel=3)
        return None

    def _initial_states(self, hx, x, unbatched):
        """The initial states, a list of [L*D, N, H] (zeros where hx is None), checked."""
        count, names = len(self.cell.states), self.cell.states
        shapes = self._layout.state_shapes(x.shape[1])
        if hx is None:
            return [x.new_zeros(shape) for shape in shapes]
        given = hx if isinstance(hx, (tuple, list)) else (hx,)
        if len(given) != count:
            raise InputError(f"hx must be {'a tuple of ' if count > 1 else ''}{count} "
                             f"tensor{'s' if count > 1 else ''} ({', '.join(names)}), got "
                             f"{len(given)}")
        out = []
        for name, h, shape in zip(names, given, shapes):
            if not isinstance(h, torch.Tensor):
                raise InputError(f"hx's {name} must be a torch.Tensor, got {type(h).__name__}")
            h = h[:, None] if unbatched and h.dim() == 2 else h
            if tuple(h.shape) != shape:
                want = [shape[0], shape[2]] if unbatched else list(shape)
                got = list(h.shape[:1]) + list(h.shape[2:]) if unbatched else list(h.shape)
                raise InputError(f"hx's {name} has shape {got}, expected {want}")
            if h.device != x.device or h.dtype != x.dtype:
                raise InputError(f"hx's {name} is {h.dtype} on {h.device}, but input is "
                                 f"{x.dtype} on {x.device}")
            out.append(h)
        return out

    def _network(self, x, dtype=None) -> Network:
        """The network for x's device; ``dtype``: that of the weights it runs (default the
        parameters')."""
        dtype = dtype or next(self.parameters()).dtype
        if dtype not in DTYPES:
            raise InputError(f"rnncc runs float32, float16 or bfloat16 parameters, got {dtype}; "
                             "convert with .float(), .half() or .bfloat16()")
        if x.dtype != dtype:
            raise InputError(f"input is {x.dtype}, but the parameters are {dtype}")
        device = next(self.parameters()).device
        if x.device != device:
            raise InputError(f"input is on {x.device}, but the parameters are on {device}")
        key = (x.device.type, x.device.index)
        if key not in self._networks:
            if x.device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(x.device)
                target, arch = "cuda", f"sm_{major}{minor}"
            elif x.device.type == "cpu":
                target, arch = "llvm", None
            else:
                raise InputError(f"rnncc runs on cpu or cuda devices, not {x.device}")
            self._networks[key] = Network(self._layout, target, arch)
        return self._networks[key]

    def _between(self, y):
        """Dropout on a layer's output before the next layer (in training mode)."""
        if self.dropout:
            return torch.nn.functional.dropout(y, self.dropout, training=True)
        return y

    def _outputs(self, y, finals, unbatched):
        if unbatched:
            y, finals = y[:, 0], [f[:, 0] for f in finals]
        elif self.batch_first:
            y = y.transpose(0, 1)
        return y, _finals(finals)


def _finals(finals):
    return finals[0] if len(finals) == 1 else tuple(finals)


def _to_device(host, device):
    """A CPU tensor copied to ``device`` from pinned memory (allowed in a CUDA graph capture;
    a plain copy from pageable memory is not)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class _Rows(torch.autograd.Function):
    """The rows of ``src`` [R, F] at ``index``, with a gradient that is a gather too (no
    scatter with accumulation, which autograd gives an indexing: a sort and a kernel that took
    a quarter of a packed training step, H200, LSTM 256 at batch 256). Each row of src has one
    place of the output, ``inverse`` [R], whose gradient is its gradient (the places where a
    row only stands in must get none: the modules give x none past the lengths); with
    ``zeros``, ``inverse`` holds the output's row count for the rows of src that have no
    place: their gradients are zeros."""

    @staticmethod
    def forward(ctx, src, index, inverse, zeros):
        ctx.save_for_backward(inverse)
        ctx.zeros = zeros
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if ctx.zeros:
            grad = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return grad.index_select(0, inverse), None, None, None


def _rows(src, index, inverse, zeros: bool):
    """``src.index_select(0, index)``, through :class:`_Rows` where a gradient will flow."""
    if torch.is_grad_enabled() and src.requires_grad:
        return _Rows.apply(src, index, inverse, zeros)
    return src.index_select(0, index)


#: The device tables of the PackedSequence layouts seen last (:func:`_layout_tables`), by
#: device and ``batch_sizes``: a layout seen before costs no copy from the host, and a CUDA
#: graph captured after warm-up calls holds none (H200, LSTM 512 at batch 4: the copy's node
#: took about 20 us a call).
_LAYOUTS: collections.OrderedDict = collections.OrderedDict()
LAYOUTS_KEPT = 64
#: The tables a CUDA graph capture took (with their host copies): a graph reads them at every
#: replay, so they are never freed (nor, made during a capture, written before a replay: those
#: are not kept in :data:`_LAYOUTS` for other calls).
_CAPTURED: list = []


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _layout_tables(sizes, device):
    """What :func:`_packed_layout` takes from ``batch_sizes`` [T] alone (the samples sorted by
    length, as packed), int32 on ``device``: (``table`` [2T + 1, N]: each sample's length,
    then a row a step of its pad indices, then of its source indices; ``base`` [P]: each
    packed row's step t times N; ``within`` [P]: its sample among the sorted ones; ``pack``
    [P]: ``base + within``; and the table's parts as :func:`_packed_layout` gives them).
    Made in one copy to the device and kept for the last :data:`LAYOUTS_KEPT` layouts (so
    callers never write them), and for good where a CUDA graph captures them
    (:data:`_CAPTURED`)."""
    key = (device, sizes.numpy().tobytes())
    found = _LAYOUTS.get(key)
    if found is not None:
        _LAYOUTS.move_to_end(key)
        if _capturing(device) and not any(held is found for held in _CAPTURED):
            _CAPTURED.append(found)
        return found
    steps, rows, total = sizes.shape[0], int(sizes[0]), int(sizes.sum())
    if steps * rows >= 2 ** 31:
        raise InputError(f"a PackedSequence of {steps} steps and {rows} samples pads to "
                         f"{steps * rows} rows; rnncc.nn takes at most 2 ** 31 - 1")
    starts = torch.cumsum(sizes, 0) - sizes
    sample = torch.arange(rows)
    pad = torch.where(sample[None, :] < sizes[:, None], starts[:, None] + sample[None, :], total)
    lengths = (sizes[None, :] > sample[:, None]).sum(1)
    step = torch.repeat_interleave(torch.arange(steps), sizes)  # of each packed row
    within = torch.arange(total) - starts[step]  # its place among the sorted samples
    table = torch.cat([lengths[None], pad, pad.clamp(max=total - 1)])
    parts = [table.flatten(), step * rows, within, step * rows + within]
    host = torch.cat(parts).to(torch.int32)
    host = host.pin_memory() if device.type == "cuda" else host  # what a graph's copy reads
    table, base, within, pack = torch.split(_to_device(host, device), [p.numel() for p in parts])
    table = table.view(2 * steps + 1, rows)
    found = (table, base, within, pack, _split(table))
    if _capturing(device):
        _CAPTURED.append((host, found))
        return found
    _LAYOUTS[key] = found
    if len(_LAYOUTS) > LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return found


def _packed_layout(seq: PackedSequence):
    """Where a PackedSequence's rows go in its padded form [T, N, F] (the samples in their
    original order) and back, on its data's device, whatever T: (``pad`` [T*N], the packed row
    at each padded place, P = the number of packed rows past a sample's length; ``source``
    [T*N], the same with the last packed row past them, the rows x gathers; ``pack`` [P], each
    packed row's padded place t*N + n; the samples' lengths [N] int32). The parts that follow
    from ``batch_sizes`` come from :func:`_layout_tables`; the samples' order takes a gather
    of the table and, for ``pack``, a gather and a sum on the device (each kernel is one more
    node of a CUDA graph)."""
    # batch_sizes, on the CPU: how many samples run at each step
    table, base, within, pack, parts = _layout_tables(seq.batch_sizes, seq.data.device)
    if seq.unsorted_indices is not None:  # original sample m is sorted sample unsorted[m]
        parts = _split(table.index_select(1, seq.unsorted_indices))
    if seq.sorted_indices is not None:  # sorted sample s is original sample sorted[s]
        pack = base + seq.sorted_indices.index_select(0, within)
    pad, source, lengths = parts
    return pad, source, pack, lengths


def _split(table):
    """A layout's ``table`` [2T + 1, N] (contiguous) as pad [T*N], source [T*N] and the
    lengths [N], views of it."""
    steps = table.shape[0] // 2
    lengths, pad, source = torch.split(table, [1, steps, steps])
    return pad.view(-1), source.view(-1), lengths.view(-1)


def _unpacked(seq: PackedSequence, layout):
    """x [T, N, C] of a PackedSequence (its :func:`_packed_layout` given), in one gather on
    the device (torch's pad_packed_sequence copies step by step, a kernel a step). x past a
    sample's length holds other rows of the data, not zeros: the modules that take lengths
    never read it (nor give it a gradient)."""
    _, source, pack, lengths = layout
    return _rows(seq.data, source, pack, False).view(-1, lengths.shape[0], *seq.data.shape[1:])


def _repacked(y, like: PackedSequence, layout) -> PackedSequence:
    """y [T, N, F] (the samples in their original order) as a PackedSequence laid out as
    ``like`` (:func:`_packed_layout`): step by step, the samples sorted by length; one
    gather on the device (and its gradient, zeros past the lengths, one too)."""
    pad, _, pack, _ = layout
    data = _rows(y.reshape(-1, y.shape[2]), pack, pad, True)
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


class LSTM(Recurrent):
    """``torch.nn.LSTM``: gates i, f, g, o; states (h, c)."""

    def __init__(self, *args, **kwargs):
        super().__init__("lstm", *args, **kwargs)


class GRU(Recurrent):
    """``torch.nn.GRU``: gates r, z, n (the reset gate applied after the matrix product)."""

    def __init__(self, *args, **kwargs):
        super().__init__("gru", *args, **kwargs)


class RNN(Recurrent):
    """``torch.nn.RNN``: ``nonlinearity`` "tanh" or "relu"."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", *args, **kwargs):
        if nonlinearity not in ("tanh", "relu"):
            raise ConfigError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, num_layers, *args,
                         **kwargs)


def from_torch(module, allow_tf32: bool = False, tf32x3: bool = Options.tf32x3) -> Recurrent:
    """The rnncc module for a ``torch.nn.LSTM``, ``GRU`` or ``RNN``: the same configuration
    (``batch_first`` included), device, dtype and weights; ``allow_tf32`` and ``tf32x3`` as
    :class:`Recurrent` takes them (torch's own flag is global, and not read here)."""
    kinds = {torch.nn.LSTM: LSTM, torch.nn.GRU: GRU, torch.nn.RNN: RNN}
    kind = kinds.get(type(module))
    if kind is None:
        raise ConfigError(f"from_torch takes a torch.nn.LSTM, GRU or RNN, got "
                          f"{type(module).__name__}")
    first = next(module.parameters())
    kw = dict(num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
              dropout=module.dropout, bidirectional=module.bidirectional,
              device=first.device, dtype=first.dtype, allow_tf32=allow_tf32, tf32x3=tf32x3)
    if getattr(module, "proj_size", 0):
        kw["proj_size"] = module.proj_size
    if kind is RNN:
        kw["nonlinearity"] = module.nonlinearity
    ours = kind(module.input_size, module.hidden_size, **kw)
    ours.load_state_dict(module.state_dict())
    ours.train(module.training)
    return ours
