"""TrajectoryQueue actor: the bounded hand-off between env workers and learners.

It carries ``ObjectRef``s to ``TrajectorySegment``s plus a small ``SegmentInfo`` each, never the
payloads, so its own memory stays flat. Invariants:
- At most ``capacity`` segments are held; ``put`` waits while the queue is full, which pauses the
  producing env slot (backpressure) instead of growing memory.
- ``get`` drops, and counts, segments whose oldest action is more than ``max_staleness`` policy
  versions behind the learner's current version; what it returns is fresh enough to train on.
- Segments leave in arrival order; none is returned twice.
- After ``close()`` (the learners stopped), ``put`` no longer waits: it counts the segment as
  discarded, so a run never hangs at shutdown on a full queue.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from actors.metrics import RoleMetrics
from rlvla3.run_config import QueueConfig
from rlvla3.types import EpisodeKey


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What the queue and the controller need to know about a segment without fetching it."""

    source: str
    """Producing worker and slot."""
    key: EpisodeKey
    """Task and initial state."""
    decisions: int
    """Decision points (training samples) in the segment."""
    env_steps: int
    """Low-level env steps in the segment."""
    min_version: int
    """Oldest policy version that acted in the segment."""
    episode_return: float
    success: bool


class TrajectoryQueue:
    """Bounded FIFO of (SegmentInfo, [ObjectRef]) with a staleness filter."""

    def __init__(self, cfg: QueueConfig):
        self.cfg = cfg
        self._items: deque = deque()
        self._version = 0
        self._cond: asyncio.Condition | None = None
        self.metrics = RoleMetrics("queue", "queue-0")
        self.counts = {"put": 0, "put_decisions": 0, "got": 0, "got_decisions": 0,
                       "dropped_stale": 0, "discarded_at_stop": 0, "discarded_decisions": 0,
                       "producer_wait_s": 0.0}
        self._closed = False
        self.staleness: dict[int, int] = {}

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def put(self, info: SegmentInfo, refs: list) -> int:
        """Enqueue one segment (``refs`` = [ObjectRef]); waits while full. Returns the depth."""
        cond = self._condition()
        start = time.monotonic()
        async with cond:
            await cond.wait_for(lambda: len(self._items) < self.cfg.capacity or self._closed)
            if self._closed:  # the run is stopping and no learner will take it: count, drop
                self.counts["discarded_at_stop"] += 1
                self.counts["discarded_decisions"] += info.decisions
                return len(self._items)
            self._items.append((info, refs))
            self.counts["put"] += 1
            self.counts["put_decisions"] += info.decisions
            self.counts["producer_wait_s"] += time.monotonic() - start
            cond.notify_all()
            depth = len(self._items)
        self.metrics.set("queue_depth", depth)
        return depth

    async def get(self, max_items: int, timeout_s: float) -> list:
        """Up to ``max_items`` fresh segments; waits up to ``timeout_s`` for the first one."""
        cond = self._condition()
        out = []
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: len(self._items) > 0), timeout_s)
            except asyncio.TimeoutError:
                return out
            while self._items and len(out) < max_items:
                info, refs = self._items.popleft()
                lag = self._version - info.min_version
                if lag > self.cfg.max_staleness:
                    self.counts["dropped_stale"] += 1
                    self.metrics.inc("episodes_dropped")
                    continue
                self.staleness[lag] = self.staleness.get(lag, 0) + 1
                self.metrics.observe("staleness", lag)
                out.append((info, refs))
            self.counts["got"] += len(out)
            self.counts["got_decisions"] += sum(info.decisions for info, _ in out)
            cond.notify_all()
        self.metrics.inc("trajectories", len(out))
        self.metrics.set("queue_depth", len(self._items))
        return out

    async def close(self) -> None:
        """The learners have stopped: release producers waiting on a full queue (their
        segments are counted as discarded) so the rollout can stop without waiting."""
        self._closed = True
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def set_version(self, version: int) -> None:
        """The learner's current policy version (for the staleness filter)."""
        self._version = max(self._version, version)

    def depth(self) -> int:
        return len(self._items)

    def queued_decisions(self) -> int:
        """Decision samples held (before the staleness filter)."""
        return sum(info.decisions for info, _ in self._items)

    def stats(self) -> dict:
        return {**self.counts, "depth": len(self._items), "version": self._version,
                "staleness_hist": dict(sorted(self.staleness.items()))}
