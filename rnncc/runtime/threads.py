"""How many threads CPU modules run on: TVM's thread pool, sized before its first use.

Unless ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS`` says, TVM sizes its pool at half the logical
CPUs on x86 (it takes every other one for a second hardware thread of a core) and counts the
host's CPUs in a container. On this repository's CPU machine (2 CPUs, one thread a core) that
ran every module on one core of two, and slower than with ``TVM_NUM_THREADS=1`` (LSTM 256 at
batch 1, T = 100: 62.5 us a step; with 1 thread 39.5, with 2 threads 25.6). Where neither
variable is set, rnncc sets ``TVM_NUM_THREADS`` to :func:`cores` before it loads a CPU module;
TVM reads it when a thread first runs parallel work.
"""

from __future__ import annotations

import math
import os

_CPU_SYS = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _quota() -> int | None:
    """CPUs a cgroup quota allows this process (cgroup v2 ``cpu.max``, v1 ``cfs_quota_us``),
    rounded up; None where none is set."""
    v2 = _read("/sys/fs/cgroup/cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        pair = (quota, period)
    else:
        pair = (_read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    try:
        quota, period = int(pair[0]), int(pair[1])
    except (TypeError, ValueError):  # "max", -1 or unreadable: no quota
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def cores() -> int:
    """The physical cores this process may run on: the CPUs of its affinity, the hardware
    threads of one core counted once (Linux's topology; each CPU its own core where that is
    not readable), at most what a cgroup CPU quota allows."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    found = len({_read(_CPU_SYS.format(cpu)) or f"cpu{cpu}" for cpu in cpus})
    quota = _quota()
    return max(1, min(found, quota) if quota else found)


def configure() -> None:
    """Set ``TVM_NUM_THREADS`` to :func:`cores` where neither it nor ``OMP_NUM_THREADS`` is
    set (a thread whose TVM pool already exists keeps its size)."""
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(cores())
