"""Gradients through rnncc.nn: each layer and direction of a network one
``torch.autograd.Function`` on a layer module compiled with ``training=True``.

Shapes as in :mod:`.network`: x [T, N, C], states [L*D, N, H], y [T, N, D*H]. The layers run
one after another (dropout between them in training mode, as torch's); the reverse direction
runs its module on each sample's steps reversed (from its own last step), its y reversed back,
on CUDA on a stream of its own beside the forward direction's (in both passes).
The batch is padded to the bucket the inference path uses (:func:`.network.bucket`). A layer's
forward keeps its states of every step and what the cell's derivative needs of its projections
(``Module.train_forward``); its backward (``Module.backward``) computes the gates again from
them, and where the cell uses every gate as a sum writes their gradients over the kept sums
(a second backward through the same graph is then refused, as torch refuses one through a
tensor changed in place).
"""

from __future__ import annotations

import functools
import gc

import torch
from torch.autograd.graph import increment_version

from ..errors import InputError
from ..runtime import streams
from .network import aligned, bucket


class _Layer(torch.autograd.Function):
    """One layer, one direction: ``(y, *finals)`` of ``module`` on x [T, N, C] from the
    states ([1, N, H] each; h's [1, N, P] with a projection), with the weights ``w_ih, w_hh,
    b_ih, b_hh`` (biases None: zero), W_hr where the module has a projection, and the cell's
    per-unit parameters."""

    @staticmethod
    def forward(ctx, module, x, lengths, count, *tensors):
        states, (w_ih, w_hh, b_ih, b_hh, *rest) = tensors[:count], tensors[count:]
        split = 1 if module.proj_size else 0  # W_hr first, where the module projects
        projected, params = rest[:split], rest[split:]
        weights = {"weight_ih_l0": w_ih, "weight_hh_l0": w_hh,
                   **dict(zip(["weight_hr_l0"], projected)),
                   **{f"{p}_l0": v for p, v in zip(module.params, params)}}
        if b_ih is not None:
            weights.update(bias_ih_l0=b_ih, bias_hh_l0=b_hh)
        packed = module.pack(weights, entry="sequence", copy=False)
        initial = {f"{s}0": v for s, v in zip(module.states, states)}
        y, finals, kept = module.train_forward(x, packed, lengths=lengths, **initial)
        ctx.module, ctx.packed, ctx.lengths = module, packed, lengths
        ctx.biases = b_ih is not None
        # the weights, which packed may share: changed in place before backward, torch says so
        ctx.save_for_backward(x, *kept.values(), w_ih, w_hh, b_ih, b_hh, *projected, *params)
        ctx.kept_names = list(kept)
        return (y, *(finals if isinstance(finals, tuple) else (finals,)))

    @staticmethod
    def backward(ctx, dy, *finals_grad):
        if torch.is_grad_enabled():
            raise InputError("rnncc's gradients cannot be differentiated again (double "
                             "backward, create_graph=True): not supported")
        module = ctx.module
        x, *kept = ctx.saved_tensors[:-4 - bool(module.proj_size) - len(module.params)]
        grads = module.backward(x, ctx.packed, dict(zip(ctx.kept_names, kept)),
                                aligned(dy), tuple(aligned(g) for g in finals_grad),
                                lengths=ctx.lengths, input_grad=ctx.needs_input_grad[1])
        consumed = module.consumed
        for name, tensor in zip(ctx.kept_names, kept):
            if name in consumed:  # overwritten: a second backward says so (torch)
                increment_version(tensor)
        biases = ((grads["bias_ih_l0"], grads["bias_hh_l0"]) if ctx.biases else (None, None))
        return (None, grads.get("x"), None, None, *(grads[f"{s}0"] for s in module.states),
                grads["weight_ih_l0"], grads["weight_hh_l0"], *biases,
                *([grads["weight_hr_l0"]] if module.proj_size else []),
                *(grads[f"{p}_l0"] for p in module.params))


def reversed_steps(x, lengths):
    """Each sample's steps of x [T, N, F] reversed within its length (all T: lengths None);
    its own inverse, and differentiable (a gather)."""
    if lengths is None:
        return x.flip(0)
    steps = x.shape[0]
    t = torch.arange(steps, device=x.device)[:, None]
    length = lengths.to(torch.int64)[None, :]
    index = torch.where(t < length, length - 1 - t, t)
    return x.gather(0, index[:, :, None].expand(-1, -1, x.shape[2]))


def _on_side(device, module, args):
    """``_Layer.apply(module, *args)`` on the side stream of ``device``
    (:func:`rnncc.runtime.streams.fork`), after the work queued so far on the current stream;
    the current stream then waits for it. Tensors made on one stream and used on the other are
    recorded there (the allocator keeps them until both are done)."""
    side = streams.fork(device)
    for a in args:
        if isinstance(a, torch.Tensor):
            a.record_stream(side)
    with torch.cuda.stream(side):
        results = _Layer.apply(module, *args)
    streams.join(side, results)
    return results


def run(recurrent, network, x, states, lengths, weights: dict):
    """y [T, N, D*H] and the final states (a list, [L*D, N, H] each) of ``recurrent`` (an
    rnncc.nn module) on x [T, N, C] from ``states``, with ``weights`` by torch's names (the
    parameters, or their half copies under autocast), with gradients, on the layer modules
    of ``network`` (its :class:`~.network.Network` for x's device). Under ``torch.compile``
    it runs eagerly (a graph break; inference is one custom op, :mod:`.op`)."""
    return _eager()(recurrent, network, x, states, lengths, weights)


@functools.cache
def _eager():
    """:func:`_run` kept out of torch.compile's graphs, made on first use: ``torch.compiler.
    disable`` imports torch._dynamo, which took most of ``import rnncc.nn`` (4.0 of 4.1 s,
    -X importtime on 2 busy cores). That import leaves the caller's frames in reference
    cycles, so what they hold (the autograd graph of the step that called: AccumulateGrad
    nodes that a CUDA graph capture of the next steps must not meet) would live until Python's
    next full collection: collected now, once."""
    eager = torch.compiler.disable(_run)
    gc.collect()
    return eager


def _run(recurrent, network, x, states, lengths, weights: dict):
    lay = network.layout
    steps, n, _ = x.shape
    rows = bucket(n)
    if rows != n:  # the padded rows: zero inputs and states, length 1
        x = torch.cat([x, x.new_zeros(steps, rows - n, x.shape[2])], dim=1)
        states = [torch.cat([s, s.new_zeros(s.shape[0], rows - n, s.shape[2])], dim=1)
                  for s in states]
        if lengths is not None:
            lengths = torch.cat([lengths, lengths.new_ones(rows - n)])
    if lengths is not None:
        lengths = aligned(lengths.to(torch.int32))
    dtype = str(x.dtype).replace("torch.", "")
    beside = x.is_cuda and lay.directions == 2  # the reverse direction on the side stream
    finals: list = [[] for _ in states]
    layer_input = x
    for layer in range(lay.layers):
        module = network.training_module(lay.layer_input(layer), rows, dtype,
                                         lengths is not None)
        outputs = []
        for d, suffix in enumerate(("", "_reverse")[:lay.directions]):
            given = [weights.get(f"{name}_l{layer}{suffix}")
                     for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh",
                                  *(("weight_hr",) if lay.proj_size else ()),
                                  *lay.cell.params)]
            row = layer * lay.directions + d
            seq = layer_input if d == 0 else reversed_steps(layer_input, lengths)
            args = (aligned(seq), lengths, len(states),
                    *(aligned(s[row:row + 1]) for s in states), *given)
            if d == 1 and beside:
                y, *last = _on_side(x.device, module, args)
            else:
                y, *last = _Layer.apply(module, *args)
            outputs.append(y if d == 0 else reversed_steps(y, lengths))
            for found, value in zip(finals, last):
                found.append(value)
        layer_input = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        if recurrent.dropout and recurrent.training and layer < lay.layers - 1:
            layer_input = torch.nn.functional.dropout(layer_input, recurrent.dropout, True)
    finals = [torch.cat(f) for f in finals]
    if rows == n:
        return layer_input, finals
    return layer_input[:, :n], [f[:, :n] for f in finals]
