"""Stage: layers as a wavefront (planner: "Layers as a wavefront").

Layer l > 0 reads layer l - 1's outputs as its x. Every block counts the steps whose y it has
written on its layer's progress counter, one a batch group (:func:`publish`, after the block
barrier that follows the step's stores, a release). Before a block of layer l > 0 stages the
rows of x of a group of steps, its thread 0 waits until layer l - 1's counter says they are
written (:func:`wait_for_steps`, an acquire), and the block waits for its thread 0.

A block can be two arrivals ahead of another of its batch group (with the tagged exchange it
goes on once the others' h is out, before they arrive), so the wait asks for one step more a
block than it reads (at most T): a count of (s + 1) arrivals a block means every block has
written s steps. x's rows are then read past L1 (:mod:`.input_projection`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .. import device


@T.macro
def publish(spec, prog, bx, tx):
    """The block has written y of one more step (after a block barrier that follows the
    stores)."""
    if spec.layers > 1:
        if tx == 0:
            device.arrive(T.address_of(prog[spec.group_of(bx)]))


@T.macro
def wait_for_steps(spec, prog, steps, t_len, bx, tx):
    """Layer l - 1 has written y of its first ``steps`` steps (all of them past T), for the
    blocks of layer l > 0; then a block barrier."""
    if tx == 0:
        if spec.layer(bx) > 0:
            device.wait_count(
                T.address_of(prog[spec.group_of(bx) - spec.plan.batch_groups]),
                T.Cast("uint32", T.min(steps + 1, t_len) * spec.plan.group_blocks))
    T.tvm_storage_sync("shared.dyn")
