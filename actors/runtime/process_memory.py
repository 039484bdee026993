"""Measured memory of one actor process (and the processes it spawned, e.g. simulators).

Every role reports ``ProcessMemory.sample()`` in its stats (``rlvla3.role_stats.MemorySample``): resident set size now and at its
peak, in MB, for the actor's own process and for its child processes together. The controller
puts them next to the pre-flight estimate (``rlvla3.plan.memory``) in the summary, so a plan
can be checked against what a run really used.

The own peak is the kernel's high-water mark (``ru_maxrss``), so no spike between two samples
is missed; children (simulator processes) are sampled when stats are read.
"""

from __future__ import annotations

import resource

import psutil

from rlvla3.role_stats import MemorySample

MB = 2**20


class ProcessMemory:
    """RSS of this process and its children, now and at the peak seen."""

    def __init__(self):
        self._proc = psutil.Process()
        self._children_peak = 0.0

    def sample(self) -> MemorySample:
        """``rss_mb`` (own), ``children_rss_mb`` (all descendants), their peaks, and
        ``total_peak_mb`` (own peak + children peak)."""
        own = self._proc.memory_info().rss / MB
        children = 0.0
        for child in self._proc.children(recursive=True):
            try:
                children += child.memory_info().rss / MB
            except psutil.Error:  # it ended between listing and reading
                continue
        self._children_peak = max(self._children_peak, children)
        own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
        return MemorySample(round(own, 1), round(max(own_peak, own), 1), round(children, 1),
                            round(self._children_peak, 1),
                            round(max(own_peak, own) + self._children_peak, 1))
