"""Tuning: measured choices for one configuration on one device, kept as a log and applied
when a module is compiled.

- :mod:`.log`: the log format (a directory a configuration: rnncc's record plus MetaSchedule's
  JSON database), reading with refusal of corrupt or foreign logs, atomic writing, lookup.
- :mod:`.device`: which device a log is for ("h100", "h200", "llvm-<cpu>").
- :mod:`.apply`: what a compile takes from the logs (exact match, or a nearby configuration's
  persistent knobs).
- :mod:`.meta`: MetaSchedule (XGBoost cost model) on the components it can tune, locally or
  through an RPC tracker.
- :mod:`.knob_search`: the persistent kernel's knobs, each candidate checked against the
  float64 reference before its time counts.
- :mod:`.tuner`: ``rnncc tune``: budget, progress, resume, summary, the log.
"""

from .log import LogError, LogKey, TuningLog

__all__ = ["LogError", "LogKey", "TuningLog", "tune"]


def tune(*args, **kwargs):
    """See :func:`rnncc.tuning.tuner.tune`."""
    from .tuner import tune as _tune

    return _tune(*args, **kwargs)
