"""Tuning logs shipped with rnncc (data only): see README.md here and :mod:`rnncc.tuning.log`."""
