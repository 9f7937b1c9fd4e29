"""The schedule-rule contract shared by every file of rnncc.schedules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """A named ``apply(func, target) -> Schedule | None``."""

    name: str
    apply: Callable
