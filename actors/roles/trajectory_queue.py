"""TrajectoryQueue actor: the bounded hand-off between env workers and learners, and the pacer.

One module over 400 lines because admission pacing, the staleness filter and GRPO group assembly
all read and change the same queue state.

It carries ``ObjectRef``s to ``TrajectorySegment``s plus a small ``SegmentInfo`` each, never the
payloads, so its own memory stays flat. A queue item is one episode, or with GRPO one whole
group of episodes of the same (task, initial state), so a group is never split across learner
ranks.

Pacing (asynchronous rollout): before a slot starts an episode it asks ``admit``. The queue
estimates how many policy versions will pass before that episode's first decision is trained,

    lag = (backlog + (in_flight + 1) * mean_episode_decisions) * update_epochs / global_batch

(each batch of ``global_batch`` decisions is ``update_epochs`` optimizer steps, each a version:
the staleness bound counts versions, so pacing does too)
where ``backlog`` is what is shipped but not yet trained (queued here plus buffered in the
learners) and ``in_flight`` the episodes already admitted and unfinished, and admits the slot
only while ``lag <= pace_lag`` (``QueueConfig.pace_target``) and the backlog is at most
``pace_backlog`` global batches or one item (a GRPO group), whichever is more; otherwise the
slot waits until the learners have consumed enough. So no more work is in flight than the
learners can consume within the staleness bound: when the learners are the bottleneck, env
slots wait instead of producing data that only ages, and when the envs are, every slot runs.
Pacing never starves the learners (while less than one global batch of work is ahead of them,
slots are admitted whatever the target), one episode is always admitted when none is in flight,
in-flight episodes always finish, and GRPO episodes held for their group do not count, so
pacing cannot deadlock. Pacing admits GRPO groups rather than episodes: once a member of a group
is running or held, the group's other members are admitted at once (holding them back only
ages the members already done, until the group expires). (Learners pull only what their next
batch needs, ``get``'s ``max_decisions``, so no rank hoards data another rank waits for.)

Admission tickets belong to one incarnation of an env worker. A restarted worker announces its
new incarnation (``reset_worker``); the controller retires the incarnation of a worker that
stopped running (``retire``). The tickets of a replaced or retired incarnation are released at
once, and an ``admit`` of such an incarnation still waiting (its caller died while it waited)
is refused when it wakes, so the in-flight count returns to the episodes really running.
``close_admissions`` (the first act of a run's stop) refuses every admission from then on.

Invariants:
- At most ``capacity`` items are queued; ``put`` waits while the queue is full (backpressure).
- Staleness is judged per item by its oldest decision, as the learners judge it: ``get`` drops,
  and counts, items whose oldest decision is more than ``max_staleness`` versions behind the
  learner (whole: a GRPO group is never split).
- GRPO: an episode waits in ``held`` until its group has ``group_size`` members, minus members
  that can never arrive (a simulator fault, a lost env worker: ``drop``/``reset_worker``), and
  leaves as one item that keeps the group's boundaries: two groups of one key are never pooled.
  A held group whose oldest decision is more than ``max_staleness`` versions old expires,
  counted.
  With ``skip_uniform`` a complete group whose members all have the same return (every
  advantage 0) is skipped, counted, instead of queued.
- Items leave in arrival order; none is returned twice.
- Decision accounting: ``put_decisions = queued + held + got + dropped_stale + expired +
  uniform``, and
  segments put after ``close()`` are counted in ``discarded_at_stop``.
- ``set_version`` follows the learner, also backwards after a learner restored an older
  checkpoint (``restored=True``), so the staleness filter never rejects everything after a
  rollback.
- Waiters are woken per need: admissions, producers waiting for space and learners waiting for
  items wait on conditions of their own (one lock), each notified only by what can change its
  answer, and an admission's check is O(1) (running totals of the queued and buffered
  decisions, the tickets per key): with hundreds of slots waiting, an event costs one cheap
  check per waiting admission, not a scan of every ticket and item for each.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import ray

from actors.runtime.metrics import RoleMetrics
from rlvla3.run_config import QueueConfig
from rlvla3.types import EpisodeKey

UNIFORM_TOLERANCE = 1e-6
"""Returns closer than this are the same return (a group of them has no advantage to learn)."""


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
    max_version: int = -1
    """Newest policy version that acted in the segment (-1: same as ``min_version``)."""


def _uniform(members: list) -> bool:
    """Whether a group's episodes all have the same return (every GRPO advantage 0)."""
    returns = [info.episode_return for info, _ in members]
    return max(returns) - min(returns) <= UNIFORM_TOLERANCE


@dataclass
class _Group:
    """GRPO episodes of one key waiting for the rest of their group."""

    members: list = field(default_factory=list)
    missing: int = 0
    """Members that will never arrive (dropped by a fault or lost with a worker)."""


class TrajectoryQueue:
    """Bounded FIFO of items (lists of (SegmentInfo, [ObjectRef])) with pacing and staleness."""

    def __init__(self, cfg: QueueConfig, group_size: int = 1, global_batch: int = 1,
                 initial_decisions: float = 1.0, skip_uniform: bool = False,
                 update_epochs: int = 1):
        self.cfg = cfg
        self.group_size = group_size
        self.skip_uniform = skip_uniform
        self.global_batch = global_batch
        self.update_epochs = update_epochs
        self._items: deque[list] = deque()
        self._queued = 0
        """Decisions in ``_items`` (a running total)."""
        self._version = 0
        self._lock: asyncio.Lock | None = None
        self.metrics = RoleMetrics("queue", "queue-0")
        self.counts = {"put": 0, "put_decisions": 0, "got": 0, "got_decisions": 0,
                       "dropped_stale": 0, "dropped_stale_decisions": 0, "dropped_stale_items": 0,
                       "expired": 0, "expired_decisions": 0, "expired_groups": 0,
                       "uniform": 0, "uniform_decisions": 0, "uniform_groups": 0,
                       "discarded_at_stop": 0, "discarded_decisions": 0,
                       "producer_wait_s": 0.0, "admit_wait_s": 0.0, "admitted": 0,
                       "dropped_by_producer": 0, "refused_admissions": 0,
                       "released_tickets": 0}
        self._closed = False
        self._admitting = True
        self._current: dict[int, str] = {}
        """Env worker -> its live incarnation (first seen, or announced by ``reset_worker``)."""
        self._retired: set[str] = set()
        self.staleness: dict[int, int] = {}
        self._held: dict[EpisodeKey, _Group] = defaultdict(_Group)
        self._credits: dict[EpisodeKey, int] = defaultdict(int)
        self._tickets: dict[int, tuple[int, str, EpisodeKey]] = {}
        self._ticket_keys: Counter[EpisodeKey] = Counter()
        """Admitted, unfinished episodes per key (GRPO: a group under way)."""
        self._serial = itertools.count()
        self._learner_buffered: dict[int, int] = {}
        self._buffered = 0
        """The learners' buffered decisions, summed (a running total)."""
        self._recent_lengths: deque[int] = deque(maxlen=64)
        self._initial_decisions = initial_decisions

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

    def _pop_ticket(self, ticket: int | None) -> tuple[int, str, EpisodeKey] | None:
        held = self._tickets.pop(ticket, None)
        if held is not None:
            self._ticket_keys[held[2]] -= 1
            if not self._ticket_keys[held[2]]:
                del self._ticket_keys[held[2]]
        return held

    def _push_item(self, item: list) -> None:
        self._items.append(item)
        self._queued += sum(info.decisions for info, _ in item)

    def _pop_item(self) -> list:
        item = self._items.popleft()
        self._queued -= sum(info.decisions for info, _ in item)
        return item

    # ---- pacing --------------------------------------------------------------------------
    def _mean_decisions(self) -> float:
        if not self._recent_lengths:
            return self._initial_decisions
        return sum(self._recent_lengths) / len(self._recent_lengths)

    def backlog(self) -> int:
        """Decisions shipped but not yet trained: queued here plus buffered in learners."""
        return self._queued + self._buffered

    def _ahead(self, extra: int) -> float:
        """Decisions the learners will train before a newly admitted episode's first one."""
        return self.backlog() + (len(self._tickets) + extra) * self._mean_decisions()

    def expected_lag(self, extra: int = 1) -> float:
        """Policy versions before a newly admitted episode's first decision is trained."""
        return self._ahead(extra) * self.update_epochs / self.global_batch

    def _may_admit(self, key: EpisodeKey | None = None) -> bool:
        """Within the pace targets, or with less than one batch of work ahead of the learners
        (holding slots back then would only idle them), or (GRPO) for a member of a group that
        has started: its first members age while it waits, and expire if it waits too long."""
        target, backlog = self.cfg.pace_target, self.cfg.pace_backlog
        if (self._closed or target <= 0 or not self._tickets  # closing, pacing off, none running
                or self._ahead(extra=0) < self.global_batch or self._group_started(key)):
            return True
        return (self.expected_lag() <= target
                and (backlog <= 0 or self.backlog() <= self.backlog_limit()))

    def _group_started(self, key: EpisodeKey | None) -> bool:
        if self.group_size == 1 or key is None:
            return False
        return key in self._held or key in self._ticket_keys

    def backlog_limit(self) -> float:
        """Decisions the backlog may hold: ``pace_backlog`` global batches, but never less than
        one queue item (a GRPO group of mean-length episodes, or one episode). An item arrives
        whole, so a smaller bound would hold every slot back each time one arrives."""
        item = self.group_size * self._mean_decisions()
        return max(self.cfg.pace_backlog * self.global_batch, item)

    def _live(self, worker_id: int, incarnation: str) -> bool:
        """Whether ``incarnation`` is ``worker_id``'s live one (the first one seen is)."""
        if not self._admitting or incarnation in self._retired:
            return False
        return self._current.setdefault(worker_id, incarnation) == incarnation

    async def admit(self, worker_id: int, key: EpisodeKey, incarnation: str = "") -> int | None:
        """Wait until a new episode of ``key`` may start (see pacing); returns its ticket, or
        None when this worker incarnation was replaced or retired, or admissions closed,
        meanwhile (the caller must not start the episode)."""
        cond = self.admission
        start = time.monotonic()
        async with cond:
            await cond.wait_for(lambda: self._may_admit(key) or not self._live(worker_id,
                                                                              incarnation))
            if not self._live(worker_id, incarnation):
                self.counts["refused_admissions"] += 1
                return None
            ticket = next(self._serial)
            self._tickets[ticket] = (worker_id, incarnation, key)
            self._ticket_keys[key] += 1
            self.counts["admitted"] += 1
        self.counts["admit_wait_s"] += time.monotonic() - start
        return ticket

    async def close_admissions(self) -> None:
        """No new episode starts from now on (waiting and later ``admit`` calls get None);
        episodes already admitted run to their end and are shipped."""
        self._admitting = False
        await self._notify(self.admission)

    async def drop(self, key: EpisodeKey, decisions: int, ticket: int | None = None) -> None:
        """An admitted or running episode that will never be shipped (simulator fault)."""
        self.counts["dropped_by_producer"] += 1
        self._recent_lengths.append(decisions)
        self._pop_ticket(ticket)
        await self._missing(key, 1)

    async def cancel(self, ticket: int) -> None:
        """An admitted episode that never started (the rollout is stopping)."""
        self._pop_ticket(ticket)
        await self._notify(self.admission)

    async def reset_worker(self, worker_id: int, incarnation: str) -> int:
        """A restarted env worker announces its ``incarnation``: its predecessors' admitted
        episodes died with them, and their waiting admissions are refused. Returns how many
        tickets were released."""
        old = self._current.get(worker_id)
        if old is not None and old != incarnation:
            self._retired.add(old)
        self._current[worker_id] = incarnation
        return await self._release(lambda w, inc: w == worker_id and inc != incarnation)

    async def retire(self, worker_id: int, incarnation: str) -> int:
        """An env worker incarnation that stopped running (its node was lost): release its
        tickets and refuse its waiting admissions. Returns how many tickets were released."""
        self._retired.add(incarnation)
        if self._current.get(worker_id) == incarnation:
            del self._current[worker_id]
        return await self._release(lambda w, inc: inc == incarnation)

    async def _release(self, which) -> int:
        lost = [t for t, (w, inc, _) in self._tickets.items() if which(w, inc)]
        keys = [self._pop_ticket(t)[2] for t in lost]
        self.counts["released_tickets"] += len(keys)
        for key in keys:
            await self._missing(key, 1)
        await self._notify(self.admission)
        return len(keys)

    async def _missing(self, key: EpisodeKey, n: int) -> None:
        if self.group_size > 1:
            if key in self._held:
                self._held[key].missing += n
                self._release_if_complete(key)
            else:
                self._credits[key] += n
        await self._notify(self.admission, self.arrival)  # a group may have completed

    async def _notify(self, *conditions: asyncio.Condition) -> None:
        async with self.admission:  # the lock all three share
            for cond in conditions:
                cond.notify_all()

    async def learner_buffered(self, rank: int, decisions: int) -> None:
        """A learner rank reports the decisions it holds but has not trained yet."""
        self._buffered += decisions - self._learner_buffered.get(rank, 0)
        self._learner_buffered[rank] = decisions
        await self._notify(self.admission)

    # ---- put / get -----------------------------------------------------------------------
    def _release_if_complete(self, key: EpisodeKey) -> None:
        group = self._held[key]
        if len(group.members) + group.missing >= self.group_size and group.members:
            del self._held[key]
            if self.skip_uniform and _uniform(group.members):
                self._discard_group("uniform", group)
                return
            self._push_item(list(group.members))
        elif not group.members and group.missing >= self.group_size:
            del self._held[key]

    async def put(self, info: SegmentInfo, refs: list, ticket: int | None = None,
                  by_value: bool = False) -> int:
        """Enqueue one segment (``refs`` = [ObjectRef]); waits while full. Returns the depth.
        ``by_value``: ``refs`` holds the payload itself, which the queue puts into the object
        store (so the queue owns it and it outlives its producer)."""
        if by_value:
            refs = [ray.put(r) for r in refs]
        start = time.monotonic()
        async with self.space:
            self._pop_ticket(ticket)
            self._recent_lengths.append(info.decisions)
            self.admission.notify_all()  # a finished episode frees its admission
            await self.space.wait_for(lambda: len(self._items) < self.cfg.capacity
                                      or self._closed)
            if self._closed:  # the run is stopping and no learner will take it: count, drop
                self.counts["discarded_at_stop"] += 1
                self.counts["discarded_decisions"] += info.decisions
                return len(self._items)
            self.counts["put"] += 1
            self.counts["put_decisions"] += info.decisions
            self.counts["producer_wait_s"] += time.monotonic() - start
            if self.group_size > 1:
                group = self._held[info.key]
                if not group.members and self._credits.get(info.key):
                    group.missing, self._credits[info.key] = self._credits.pop(info.key), 0
                group.members.append((info, refs))
                self._release_if_complete(info.key)
                self._expire_held()
                self.admission.notify_all()  # its group has started: its members may start
            else:
                self._push_item([(info, refs)])
            self.arrival.notify_all()
            depth = len(self._items)
        self.metrics.set("queue_depth", depth)
        return depth

    def _expire_held(self) -> None:
        """Held groups that can no longer be trained fresh: drop and count them."""
        for key in [k for k, g in self._held.items()
                    if g.members and self._stale([i for i, _ in g.members])]:
            self._discard_group("expired", self._held.pop(key))

    def _discard_group(self, why: str, group: _Group) -> None:
        """Count a GRPO group that leaves without being queued (``expired`` or ``uniform``)."""
        self.counts[f"{why}_groups"] += 1
        self.counts[why] += len(group.members)
        self.counts[f"{why}_decisions"] += sum(i.decisions for i, _ in group.members)
        self.metrics.inc("episodes_dropped", len(group.members))

    def _lag(self, version: int) -> int:
        return self._version - version

    def _stale(self, infos: list[SegmentInfo]) -> bool:
        """An item (or held group) whose oldest decision is beyond the staleness bound."""
        return self._lag(min(i.min_version for i in infos)) > self.cfg.max_staleness

    async def get(self, max_items: int, timeout_s: float, max_decisions: int | None = None) -> list:
        """Up to ``max_items`` items (each a list of (SegmentInfo, [ObjectRef]); one episode,
        or one whole GRPO group), dropping stale ones; waits up to ``timeout_s`` for the first.
        ``max_decisions``: stop once the items taken hold that many decisions (a learner's
        budget: what its batch still needs; at least one item)."""
        cond = self.arrival
        out = []
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: len(self._items) > 0), timeout_s)
            except asyncio.TimeoutError:
                return out
            taken = 0
            while self._items and len(out) < max_items and (
                    max_decisions is None or taken < max_decisions):
                item = self._pop_item()
                if self._stale([info for info, _ in item]):
                    self.counts["dropped_stale"] += len(item)
                    self.counts["dropped_stale_items"] += 1
                    self.counts["dropped_stale_decisions"] += sum(i.decisions for i, _ in item)
                    self.metrics.inc("episodes_dropped", len(item))
                    continue
                for info, _ in item:
                    lag = max(self._lag(info.min_version), 0)
                    self.staleness[lag] = self.staleness.get(lag, 0) + 1
                    self.metrics.observe("staleness", lag)
                out.append(item)
                taken += sum(info.decisions for info, _ in item)
            self.counts["got"] += sum(len(item) for item in out)
            self.counts["got_decisions"] += sum(i.decisions for item in out for i, _ in item)
            self.space.notify_all()
            self.admission.notify_all()  # the backlog went down
        self.metrics.inc("trajectories", sum(len(item) for item in out))
        self.metrics.set("queue_depth", len(self._items))
        return out

    async def close(self) -> None:
        """The learners have stopped: release producers waiting on a full queue or on
        admission (their segments are counted as discarded) so the rollout stops at once."""
        self._closed = True
        await self._notify(self.admission, self.space, self.arrival)

    async def set_version(self, version: int, restored: bool = False) -> None:
        """The learner's current policy version (for the staleness filter and expiry); a
        restored learner may move it backwards."""
        self._version = version if restored else max(self._version, version)
        if self.group_size > 1:
            self._expire_held()
        await self._notify(self.admission)

    def depth(self) -> int:
        return len(self._items)

    def queued_decisions(self) -> int:
        """Decision samples queued (before the staleness filter), held groups excluded."""
        return self._queued

    def held_decisions(self) -> int:
        return sum(i.decisions for g in self._held.values() for i, _ in g.members)

    def stats(self) -> dict:
        return {**self.counts, "depth": len(self._items), "version": self._version,
                "queued_decisions": self.queued_decisions(),
                "held_episodes": sum(len(g.members) for g in self._held.values()),
                "held_decisions": self.held_decisions(),
                "in_flight_episodes": len(self._tickets),
                "backlog_decisions": self.backlog(),
                "expected_lag": round(self.expected_lag(extra=0), 2),
                "mean_episode_decisions": round(self._mean_decisions(), 2),
                "staleness_hist": dict(sorted(self.staleness.items()))}
