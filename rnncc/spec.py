"""What a module computes (:class:`Problem`) and which schedule computes it (:class:`Options`)."""

from __future__ import annotations

from dataclasses import dataclass

from .cells import Cell
from .dtypes import check_dtype
from .errors import ConfigError


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Problem:
    """One recurrent layer: a cell, C input features, H hidden units, batch N, a dtype.

    The sequence length T is not part of it: a module takes any T at run time. ``lengths``:
    the module also takes each sample's length (1 to T): a sample's states stop at its own
    last step, and its outputs past it are zero. ``directions`` D = 2: a bidirectional layer,
    the second direction running each sample's steps in reverse (from its own last step), as
    torch's ``bidirectional=True`` does; y is [T, N, D*H] (the forward direction's H first)
    and each state [D, N, H]. ``layers`` L > 1: a stack of L unidirectional layers (C = H),
    each taking the one below's outputs, as torch's ``num_layers`` does; y is the last layer's
    [T, N, H] and each state [L, N, H]. It runs only as the persistent wavefront (layer l at
    step t while layer l - 1 is a few steps ahead), CUDA only. ``training``: the module also
    has the entries of a training step (:mod:`rnncc.lowering.training`; one direction, one
    layer). ``proj_size`` P > 0 (LSTMP, torch's ``proj_size``; a cell whose step reads h only
    through W_hh): the new h is W_hr h' [P] of the cell's h' [H], with W_hr
    (``weight_hr_l0``) [P, H]; then h and y are P wide (y [T, N, D*P], h's state [D, N, P],
    W_hh [G*H, P]); the other states stay [D, N, H]. ``allow_tf32`` (float32 only, as
    torch's ``allow_tf32``): the matrix products may round their operands to TF32 (10-bit
    mantissas, float32 sums) on tensor cores where a schedule has such a form; the cell's
    element-wise step stays IEEE float32. Off: every product is IEEE float32.
    """

    cell: Cell
    input_size: int
    hidden_size: int
    batch: int
    dtype: str = "float32"
    lengths: bool = False
    directions: int = 1
    layers: int = 1
    training: bool = False
    proj_size: int = 0
    allow_tf32: bool = False

    def __post_init__(self):
        if not isinstance(self.cell, Cell):
            raise ConfigError(f"cell must be an rnncc Cell, got {type(self.cell).__name__}")
        _positive("input_size", self.input_size)
        _positive("hidden_size", self.hidden_size)
        _positive("batch", self.batch)
        check_dtype(self.dtype)
        if not isinstance(self.lengths, bool):
            raise ConfigError(f"lengths must be True or False, got {self.lengths!r}")
        if isinstance(self.directions, bool) or self.directions not in (1, 2):
            raise ConfigError(f"directions must be 1 or 2 (bidirectional), got "
                              f"{self.directions!r}")
        _positive("layers", self.layers)
        if self.layers > 1 and (self.directions > 1 or self.input_size != self.hidden_size):
            raise ConfigError(
                f"a module of {self.layers} layers is a stack of unidirectional layers whose "
                f"input size is their hidden size (the layers above a network's first); got "
                f"directions={self.directions}, input_size={self.input_size}, hidden_size="
                f"{self.hidden_size}")

        if not isinstance(self.training, bool):
            raise ConfigError(f"training must be True or False, got {self.training!r}")
        if self.training and (self.layers > 1 or self.directions > 1):
            raise ConfigError(
                f"training=True compiles one layer of one direction (rnncc.nn trains stacked "
                f"and bidirectional networks on such modules); got directions="
                f"{self.directions}, layers={self.layers}")

        self._check_projection()
        if not isinstance(self.allow_tf32, bool):
            raise ConfigError(f"allow_tf32 must be True or False, got {self.allow_tf32!r}")
        if self.allow_tf32 and self.dtype != "float32":
            raise ConfigError(f"allow_tf32=True applies to float32 (TF32 rounds float32's "
                              f"products); got dtype {self.dtype!r}, whose products already "
                              "run on tensor cores in its own precision")

    def _check_projection(self) -> None:
        proj = self.proj_size
        if isinstance(proj, bool) or not isinstance(proj, int) or proj < 0:
            raise ConfigError(f"proj_size must be an int >= 0 (0: no projection), got {proj!r}")
        if not proj:
            return
        if proj >= self.hidden_size:
            raise ConfigError(f"proj_size={proj} must be below hidden_size={self.hidden_size} "
                              f"(cell {self.cell.name!r})")
        from .cells import autodiff

        graph = autodiff.trace(self.cell)
        if autodiff.uses(graph, graph.inputs[2 * self.cell.gates]):
            raise ConfigError(
                f"cell {self.cell.name!r} reads h in its step: a projection (proj_size={proj}) "
                "makes h P wide, so it needs a cell that reads h only through W_hh (lstm, "
                "cifg, peephole, the Elman RNNs)")
        if self.layers > 1:
            raise ConfigError(f"proj_size={proj} runs one layer a module (rnncc.nn stacks "
                              f"them); got layers={self.layers}")

    @property
    def gates(self) -> int:
        return self.cell.gates

    @property
    def recurrent_size(self) -> int:
        """R: the width of h, y's per direction and W_hh's K (P with a projection, else H)."""
        return self.proj_size or self.hidden_size

    @property
    def state_widths(self) -> list[int]:
        """Each state's width, in the cell's order: h's R, the others' H."""
        return [self.recurrent_size] + [self.hidden_size] * (len(self.cell.states) - 1)

    def describe(self) -> str:
        return (f"{self.cell.name} C={self.input_size} H={self.hidden_size} N={self.batch} "
                f"{self.dtype}" + (" bidirectional" if self.directions == 2 else "")
                + (f" {self.layers} layers" if self.layers > 1 else "")
                + (f" proj {self.proj_size}" if self.proj_size else "")
                + (" with lengths" if self.lengths else "")
                + (" for training" if self.training else "")
                + (" (TF32 allowed)" if self.allow_tf32 else ""))


@dataclass(frozen=True)
class Options:
    """Which of cuDNN's optimisations the schedule applies; each can be switched off to
    measure it.

    input_gemm:
        the input projection of all T steps as one GEMM before the loop (else one a step).
    gate_gemm:
        the G gates' projections as one GEMM over the concatenated weights (else G GEMMs).
    fuse_pointwise:
        the cell's whole point-wise step in one kernel (else one kernel an operation).
    fused_step:
        CUDA on sm_90: one step's recurrent product and the cell in one kernel, the cell as
        the warpgroup-MMA product's epilogue, where that rule takes the product (else a kernel
        each, the sums in between stored). It needs fuse_pointwise on.
    persistent:
        "auto" (CUDA: the persistent kernel where its planner says the weights fit on-chip, with
        the non-persistent schedule as the fallback), "on" (required: an error if it does not
        fit), "off" (the non-persistent schedule only). It needs the three optimisations on.
    tf32x3:
        CUDA, float32 without ``allow_tf32`` (default on): the products of many rows that the
        tensor-core rules take (all steps' input projection, each step's recurrent product at
        a large batch; in training also dx and the larger weight gradients) as three TF32
        products each ("3xTF32": each operand split into a TF32 part and the rest), whose
        error is that of IEEE float32's FMAs; off: on the CUDA cores. Inputs with infinities
        give NaN in such products.
    """

    input_gemm: bool = True
    gate_gemm: bool = True
    fuse_pointwise: bool = True
    fused_step: bool = True
    persistent: str = "auto"
    tf32x3: bool = True

    def __post_init__(self):
        if self.persistent not in ("auto", "on", "off"):
            raise ConfigError(f"persistent must be 'auto', 'on' or 'off', got {self.persistent!r}")

    @property
    def all_optimisations(self) -> bool:
        return self.input_gemm and self.gate_gemm and self.fuse_pointwise

    def describe(self) -> str:
        on = {True: "on", False: "off"}
        return (f"input_gemm={on[self.input_gemm]} gate_gemm={on[self.gate_gemm]} "
                f"fuse_pointwise={on[self.fuse_pointwise]} fused_step={on[self.fused_step]} "
                f"persistent={self.persistent} "
                f"tf32x3={on[self.tf32x3]}")
