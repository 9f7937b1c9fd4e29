"""A component that MetaSchedule tuned: the best record of its workload in a tuning log's
database (see :mod:`rnncc.tuning`). Not in the static rule lists: :func:`rnncc.schedules.schedule`
tries it first when a compile applies a log."""

import tvm

from ._rule import Rule


def workload(func) -> tvm.IRModule:
    """The IRModule MetaSchedule tunes and looks records up by (structurally) for a component."""
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def rule(database) -> Rule:
    """A rule that applies ``database``'s best record for the component, or declines."""

    def apply(func, target):
        return database.query_schedule(workload(func), target, "main")

    return Rule("meta_schedule", apply)
