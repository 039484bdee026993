"""TrajectoryQueue actor: the Ray shell of ``rlvla3.queue.core.QueueCore``.

The core holds the queue's state and makes every decision (pacing, GRPO groups, staleness,
tickets, accounting); this actor names it, waits for it and nothing else: an ``admit`` waits
until the core admits, a ``put`` while the queue is full (backpressure), a ``get`` until an
item is queued. A payload shipped by value is put into the object store here, so the queue owns
it and it outlives its producer.

Invariants:
- Waiters are woken per need: admissions, producers waiting for space and learners waiting for
  items wait on conditions of their own (one lock), each notified only by what can change its
  answer, so with hundreds of slots waiting an event costs one cheap check (``may_admit`` is
  O(1)) per waiting admission.
- An ``admit`` of an incarnation replaced or retired while it waited (its caller died), or
  still waiting when admissions close, is refused when it wakes: the caller must not start the
  episode.
- ``close`` releases producers waiting on a full queue and learners waiting for items; what is
  put from then on is counted as discarded at stop.
"""

from __future__ import annotations

import asyncio
import time

import ray

from actors.runtime.metrics import RoleMetrics
from rlvla3.queue.core import Item, QueueCore
from rlvla3.role_stats import QueueStats
from rlvla3.run_config import QueueConfig
from rlvla3.types import Admission, EpisodeKey, SegmentInfo


class TrajectoryQueue:
    """The queue actor (see the module docstring); arguments as ``QueueCore``'s."""

    def __init__(self, cfg: QueueConfig, group_size: int = 1, global_batch: int = 1,
                 initial_decisions: float = 1.0, skip_uniform: bool = False,
                 update_epochs: int = 1, redraw_rounds: int = 0):
        self.core = QueueCore(cfg, RoleMetrics("queue", "queue-0"), group_size, global_batch,
                              initial_decisions, skip_uniform, update_epochs, redraw_rounds)
        self._lock: asyncio.Lock | None = None

    def _conditions(self) -> None:
        """The three conditions, made in the actor's event loop on first use."""
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._admission = asyncio.Condition(self._lock)
            """Admissions wait here: tickets freed, backlog consumed, groups started, closing."""
            self._space = asyncio.Condition(self._lock)
            """Producers of a full queue wait here: items taken, closing."""
            self._arrival = asyncio.Condition(self._lock)
            """Learners wait here for items."""

    @property
    def admission(self) -> asyncio.Condition:
        self._conditions()
        return self._admission

    @property
    def space(self) -> asyncio.Condition:
        self._conditions()
        return self._space

    @property
    def arrival(self) -> asyncio.Condition:
        self._conditions()
        return self._arrival

    async def _notify(self, *conditions: asyncio.Condition) -> None:
        async with self.admission:  # the lock all three share
            for cond in conditions:
                cond.notify_all()

    # ---- admission -------------------------------------------------------------------------
    async def admit(self, worker_id: int, key: EpisodeKey,
                    incarnation: str = "") -> Admission | None:
        """Wait until a new episode of ``key`` may start; returns its admission (ticket, and
        the key to run: another one when a GRPO group of this incarnation draws again), or
        None when this worker incarnation was replaced or retired, or admissions closed,
        meanwhile."""
        core, cond = self.core, self.admission
        start = time.monotonic()
        async with cond:
            await cond.wait_for(lambda: core.may_admit(key, incarnation)
                                or not core.live(worker_id, incarnation))
            ticket = core.admit(worker_id, incarnation, key, time.monotonic() - start)
            return None if ticket is None else Admission(ticket, core.ticket_key(ticket))

    async def close_admissions(self) -> None:
        """No new episode starts from now on (waiting and later ``admit`` calls get None);
        episodes already admitted run to their end and are shipped."""
        self.core.close_admissions()
        await self._notify(self.admission)

    async def drop(self, key: EpisodeKey, decisions: int, ticket: int | None = None) -> None:
        """An admitted or running episode that will never be shipped (simulator fault)."""
        self.core.drop(key, decisions, ticket)
        await self._notify(self.admission, self.arrival)  # a group may have completed

    async def cancel(self, ticket: int) -> None:
        """An admitted episode that never started (the rollout is stopping)."""
        self.core.cancel(ticket)
        await self._notify(self.admission)

    async def reset_worker(self, worker_id: int, incarnation: str) -> int:
        """A restarted env worker announces its ``incarnation``; returns how many of its
        predecessors' tickets were released."""
        released = self.core.reset_worker(worker_id, incarnation)
        await self._notify(self.admission, self.arrival)
        return released

    async def retire(self, worker_id: int, incarnation: str) -> int:
        """An env worker incarnation that stopped running (its node was lost); returns how many
        of its tickets were released."""
        released = self.core.retire(worker_id, incarnation)
        await self._notify(self.admission, self.arrival)
        return released

    async def learner_buffered(self, rank: int, decisions: int) -> None:
        """A learner rank reports the decisions it holds but has not trained yet."""
        self.core.learner_buffered(rank, decisions)
        await self._notify(self.admission)

    # ---- put / get -------------------------------------------------------------------------
    async def put(self, info: SegmentInfo, refs: list, ticket: int | None = None,
                  by_value: bool = False) -> int:
        """Enqueue one segment (``refs`` = [ObjectRef]); waits while full. Returns the depth.
        ``by_value``: ``refs`` holds the payload itself, which the queue puts into the object
        store."""
        if by_value:
            refs = [ray.put(r) for r in refs]
        core = self.core
        start = time.monotonic()
        async with self.space:
            group_id = core.finished(info, ticket)
            self.admission.notify_all()  # a finished episode frees its admission
            await self.space.wait_for(core.has_space)
            depth = core.put(info, refs, time.monotonic() - start, group_id)
            if not core.closed:
                self.admission.notify_all()  # a GRPO group has started: its members may start
                self.arrival.notify_all()
        return depth

    async def get(self, max_items: int, timeout_s: float,
                  max_decisions: int | None = None) -> list[Item]:
        """Up to ``max_items`` items (``QueueCore.take``); waits up to ``timeout_s`` for the
        first (an empty list after that)."""
        cond = self.arrival
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(self.core.ready), timeout_s)
            except asyncio.TimeoutError:
                return []
            out = self.core.take(max_items, max_decisions)
            self.space.notify_all()
            self.admission.notify_all()  # the backlog went down
        return out

    async def close(self) -> None:
        """The learners have stopped: release producers waiting on a full queue or on
        admission (their segments are counted as discarded) so the rollout stops at once."""
        self.core.close()
        await self._notify(self.admission, self.space, self.arrival)

    async def set_version(self, version: int, restored: bool = False,
                          lineage: int = 0) -> None:
        """The learner's current policy version (``QueueCore.set_version``)."""
        self.core.set_version(version, restored, lineage)
        await self._notify(self.admission)

    def depth(self) -> int:
        return self.core.depth()

    def queued_decisions(self) -> int:
        return self.core.queued_decisions()

    def stats(self) -> QueueStats:
        return self.core.stats()
