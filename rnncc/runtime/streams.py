"""The second CUDA stream of a bidirectional layer (PyTorch): its reverse direction runs there
beside the forward direction on the current stream, in inference (:mod:`.network`'s split
stages) and in training (:mod:`rnncc.nn.training`), and in a CUDA graph capture too (the
capture follows the streams' waits)."""

from __future__ import annotations

_SIDE: dict = {}


def side_stream(device):
    """The side stream of torch device ``device`` (a CUDA device), one a device, made once."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def fork(device):
    """The side stream of ``device``, after the work queued so far on the current stream."""
    import torch

    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(side.device))
    return side


def join(side, results) -> None:
    """The current stream waits for the work queued on ``side``; ``results`` (tensors made
    there) are recorded as used on the current stream, where they are used and freed."""
    import torch

    main = torch.cuda.current_stream(side.device)
    main.wait_stream(side)
    for r in results:
        r.record_stream(main)
