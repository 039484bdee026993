"""What this machine lends this process: the CPU cores it may run on.

Role: the one count of this machine's CPUs that a local run sizes itself by and that every
message about them names (``rl``'s learner check and local Ray, ``--print-plan``, ``sft``,
``eval``, the benchmarks' records). ``os.cpu_count()`` counts the host's cores, which a
container, a cgroup quota or ``taskset`` may not let this process use: on one machine it said
78 where 2 were usable.

Invariant: ``usable_cpus()`` is at least 1 and at most ``os.cpu_count()``.

Example::

    >>> from rlvla3.machine import usable_cpus
    >>> usable_cpus() >= 1
    True
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group: ``<quota> <period>`` or ``max <period>``."""


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``; the
    host's count where the OS has no affinity), capped by a cgroup CPU quota rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _quota() or cores))


def local_ray_cpus(need: float) -> int:
    """Logical CPUs for a local Ray: the usable cores, or what the roles ask for when that is
    more (env workers and rollout servers mostly wait on each other, so they may share)."""
    return max(usable_cpus(), math.ceil(need))


def _quota() -> int | None:
    try:
        quota, period = CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))
