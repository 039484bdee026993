"""The trajectory queue's core: the bounded hand-off from env workers to learners and every
decision about it (``actors.roles.trajectory_queue`` only waits). Items (an episode, or a whole
GRPO group instance) leave in arrival order, once, never split; a stale one (``StalenessBound``)
is dropped whole, counted. A group instance leaves once every member it expects has arrived or
never can, never pooled with another of its key; a replaced or retired incarnation's tickets are
released at once. ``put_decisions = queued + held + got + dropped_stale + expired + uniform``;
``set_version`` moves back on a restore, never for an older lineage; ``may_admit`` is O(1)::

    core = QueueCore(cfg, metrics, group_size=8, global_batch=256)
    ticket = core.admit(worker_id, incarnation, key, 0.0)  # when may_admit(key, incarnation)
    core.put(info, refs, 0.0, core.finished(info, ticket))  # the episode of ticket_key(ticket)
    items = core.take(max_items=4, max_decisions=256)

Design notes: docs/concepts/pipeline.md#the-trajectory-queue"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlvla3.protocols import Metrics
from rlvla3.queue.pacing import Pacing, StalenessBound
from rlvla3.role_stats import QueueStats
from rlvla3.run_config import QueueConfig
from rlvla3.types import EpisodeKey, SegmentInfo

UNIFORM_TOLERANCE = 1e-6
"""Returns closer than this are the same return (a group of them has no advantage to learn)."""

Item = list[tuple[SegmentInfo, list[Any]]]
"""One queue item: an episode, or a whole GRPO group, each member with its ``ObjectRef``s."""


def _uniform(members: Item) -> bool:
    """Whether a group's episodes all have the same return (every GRPO advantage 0)."""
    returns = [info.episode_return for info, _ in members]
    return max(returns) - min(returns) <= UNIFORM_TOLERANCE


@dataclass
class _Group:
    """One GRPO group instance: its episodes shipped so far and what became of the others."""

    key: EpisodeKey
    size: int
    """Members it expects: ``group_size``, or the episodes it admitted once closed early."""
    owner: tuple[int, str] | None
    """The (worker, incarnation) whose admissions it takes; None: ticketless."""
    joined: int = 0
    """Episodes admitted into it (ticketless: shipped or dropped)."""
    members: Item = field(default_factory=list)
    missing: int = 0
    """Members that will never arrive (dropped by a fault or lost with a worker)."""
    expired: bool = False
    """Its members went stale: later ones are counted expired as they arrive."""
    rounds: int = 0
    """Extra rounds it drew (dynamic sampling): members shipped since are redrawn ones."""

    def resolved(self) -> bool:
        """Every member it expects has arrived or will never arrive."""
        return len(self.members) + self.missing >= self.size


class QueueCore:
    """Bounded FIFO of items with pacing and staleness (see the module docstring)."""

    def __init__(self, cfg: QueueConfig, metrics: Metrics, group_size: int = 1,
                 global_batch: int = 1, initial_decisions: float = 1.0,
                 skip_uniform: bool = False, update_epochs: int = 1, redraw_rounds: int = 0):
        self.cfg = cfg
        self.metrics = metrics
        self.group_size = group_size
        self.skip_uniform = skip_uniform
        self.redraw_rounds = redraw_rounds if group_size > 1 else 0
        self.pacing = Pacing(cfg.pace_target, cfg.pace_backlog, global_batch, update_epochs,
                             group_size)
        self.bound = StalenessBound(cfg.max_staleness)
        self._items: deque[Item] = deque()
        self._queued = 0
        """Decisions in ``_items`` (a running total)."""
        self.version = 0
        self.lineage = 0
        """The lineage of ``version`` (``WeightsMessage.lineage``)."""
        self.counts: dict[str, Any] = {
            "put": 0, "put_decisions": 0, "got": 0, "got_decisions": 0,
            "dropped_stale": 0, "dropped_stale_decisions": 0, "dropped_stale_items": 0,
            "expired": 0, "expired_decisions": 0, "expired_groups": 0,
            "uniform": 0, "uniform_decisions": 0, "uniform_groups": 0,
            "redraws": 0, "redrawn": 0, "redrawn_decisions": 0, "rescued_groups": 0,
            "rescued_decisions": 0, "redraw_skipped_groups": 0,
            "discarded_at_stop": 0, "discarded_decisions": 0,
            "producer_wait_s": 0.0, "admit_wait_s": 0.0, "admitted": 0,
            "dropped_by_producer": 0, "refused_admissions": 0,
            "released_tickets": 0}
        self.closed = False
        """The learners have stopped: nothing more is queued."""
        self._admitting = True
        self._current: dict[int, str] = {}
        """Env worker -> its live incarnation (first seen, or announced by ``reset_worker``)."""
        self._retired: set[str] = set()
        self.staleness: dict[int, int] = {}
        """Per episode taken: learner version minus its oldest decision's version."""
        self._groups: dict[int, _Group] = {}
        """GRPO group instances not yet resolved, by id."""
        self._open: dict[tuple[str | None, EpisodeKey], int] = {}
        """(incarnation, or None without tickets; key) -> the instance still taking members."""
        self._drawing: dict[str, deque[int]] = {}
        """Incarnation -> its uniform group instances drawing a round with members still to
        admit, oldest first (dynamic sampling)."""
        self._group_ids = itertools.count()
        self._tickets: dict[int, tuple[int, str, EpisodeKey, int | None]] = {}
        """Ticket -> (worker, incarnation, key, its GRPO group instance)."""
        self._serial = itertools.count()
        self._learner_buffered: dict[int, int] = {}
        self._buffered = 0
        """The learners' buffered decisions, summed (a running total)."""
        self._recent_lengths: deque[int] = deque(maxlen=64)
        self._initial_decisions = initial_decisions
        self.groups_by_task: dict[str, dict[str, int]] = {}
        """Env task id -> its settled GRPO groups by outcome (``mixed``: queued with an
        advantage; ``all_failed`` / ``all_succeeded``: uniform) and the decisions queued."""

    # ---- pacing --------------------------------------------------------------------------
    def mean_decisions(self) -> float:
        """Mean decisions of the recent episodes (the initial guess before any finished)."""
        if not self._recent_lengths:
            return self._initial_decisions
        return sum(self._recent_lengths) / len(self._recent_lengths)

    def backlog(self) -> int:
        """Decisions shipped but not yet trained: queued here plus buffered in learners."""
        return self._queued + self._buffered

    def expected_lag(self) -> float:
        """Policy versions before the first decision of an episode admitted after those
        running now is trained."""
        return self.pacing.expected_lag(self.backlog(), len(self._tickets), self.mean_decisions())

    def may_admit(self, key: EpisodeKey | None = None, incarnation: str = "") -> bool:
        """Within the pacing (``Pacing.admits``), closing, or (GRPO) a member of a group that
        ``incarnation`` has started or draws again: its first members age while it waits, and
        expire if it waits too long."""
        return (self.closed or self._group_started(key, incarnation)
                or incarnation in self._drawing
                or self.pacing.admits(self.backlog(), len(self._tickets), self.mean_decisions()))

    def _group_started(self, key: EpisodeKey | None, incarnation: str) -> bool:
        if self.group_size == 1 or key is None:
            return False
        gid = self._open.get((incarnation, key))
        return gid is not None and not self._groups[gid].expired

    def live(self, worker_id: int, incarnation: str) -> bool:
        """Whether ``incarnation`` is ``worker_id``'s live one (the first one seen is) and
        admissions are open."""
        if not self._admitting or incarnation in self._retired:
            return False
        return self._current.setdefault(worker_id, incarnation) == incarnation

    def admit(self, worker_id: int, incarnation: str, key: EpisodeKey,
              waited_s: float) -> int | None:
        """A new episode of ``key`` starts (asked after ``may_admit`` or ``live`` changed):
        its ticket, or None (counted) when this incarnation is not live; ``waited_s``: how
        long the admission waited (counted for admitted episodes). While a group instance of
        this incarnation draws a round, the episode joins it and runs its key instead
        (``ticket_key``)."""
        if not self.live(worker_id, incarnation):
            self.counts["refused_admissions"] += 1
            return None
        ticket = next(self._serial)
        gid = self._redraw_member(incarnation)
        if gid is not None:
            key = self._groups[gid].key
        elif self.group_size > 1:
            gid = self._join(key, (worker_id, incarnation))
        self._tickets[ticket] = (worker_id, incarnation, key, gid)
        self.counts["admitted"] += 1
        self.counts["admit_wait_s"] += waited_s
        return ticket

    def ticket_key(self, ticket: int) -> EpisodeKey:
        """The key the episode of an admission still running must run."""
        return self._tickets[ticket][2]

    def _redraw_member(self, incarnation: str) -> int | None:
        """The group instance drawing a round that a new episode of ``incarnation`` joins (the
        oldest), or None."""
        waiting = self._drawing.get(incarnation)
        if waiting is None:
            return None
        gid = waiting[0]
        group = self._groups[gid]
        group.joined += 1
        if group.joined >= group.size:
            waiting.popleft()
            if not waiting:
                del self._drawing[incarnation]
        return gid

    def close_admissions(self) -> None:
        """No new episode starts from now on; episodes already admitted run to their end (a
        GRPO group under way leaves with the members it admitted)."""
        self._admitting = False
        self._close(lambda owner: True)

    def _join(self, key: EpisodeKey, owner: tuple[int, str] | None) -> int:
        """The GRPO group instance a new episode of ``key`` belongs to (``owner``'s open one,
        or a new one); an instance that has all its members joined takes no more."""
        slot = (owner[1] if owner is not None else None, key)
        gid = self._open.get(slot)
        if gid is None:
            gid = next(self._group_ids)
            self._groups[gid] = _Group(key, self.group_size, owner)
            self._open[slot] = gid
        group = self._groups[gid]
        group.joined += 1
        if group.joined >= self.group_size:
            del self._open[slot]
        return gid

    def _close(self, which: Callable[[tuple[int, str]], bool]) -> None:
        """The open ticketed instances of the owners ``which`` picks admit no more, nor draw
        again: each expects only the episodes it admitted."""
        for slot, gid in list(self._open.items()):
            owner = self._groups[gid].owner
            if owner is not None and which(owner):
                del self._open[slot]
                self._groups[gid].size = self._groups[gid].joined
                self._settle(gid)
        for gid in [g for waiting in self._drawing.values() for g in waiting]:
            owner = self._groups[gid].owner
            if owner is not None and which(owner):
                self._stop_drawing(gid)
                self._settle(gid)

    def _stop_drawing(self, gid: int) -> None:
        """Group instance ``gid`` admits no more members of the round it draws (if any)."""
        group = self._groups[gid]
        incarnation = group.owner[1] if group.owner is not None else ""
        waiting = self._drawing.get(incarnation)
        if waiting is not None and gid in waiting:
            waiting.remove(gid)
            if not waiting:
                del self._drawing[incarnation]
            group.size = group.joined

    def _pop_ticket(self, ticket: int | None) -> tuple[int, str, EpisodeKey, int | None] | None:
        return self._tickets.pop(ticket, None) if ticket is not None else None

    def _group_of(self, key: EpisodeKey, ticket: int | None) -> int | None:
        """The GRPO group instance of an episode leaving now: its ticket's (popped), or the
        open ticketless one of its key; None when its ticket was already released (it was
        counted missing then) or without groups."""
        if ticket is not None:
            held = self._pop_ticket(ticket)
            return held[3] if held is not None else None
        return self._join(key, None) if self.group_size > 1 else None

    def drop(self, key: EpisodeKey, decisions: int, ticket: int | None) -> None:
        """An admitted or running episode that will never be shipped (simulator fault)."""
        self.counts["dropped_by_producer"] += 1
        self._recent_lengths.append(decisions)
        gid = self._group_of(key, ticket)
        if gid is not None:
            self._missing(gid)

    def cancel(self, ticket: int) -> None:
        """An admitted episode that never started (the rollout is stopping)."""
        held = self._pop_ticket(ticket)
        if held is not None and held[3] is not None:
            self._missing(held[3])

    def reset_worker(self, worker_id: int, incarnation: str) -> int:
        """A restarted env worker announces its ``incarnation``: its predecessors' admitted
        episodes died with them. Returns how many tickets were released."""
        old = self._current.get(worker_id)
        if old is not None and old != incarnation:
            self._retired.add(old)
        self._current[worker_id] = incarnation
        return self._release(lambda w, inc: w == worker_id and inc != incarnation)

    def retire(self, worker_id: int, incarnation: str) -> int:
        """An env worker incarnation that stopped running (its node was lost): its tickets are
        released. Returns how many."""
        self._retired.add(incarnation)
        if self._current.get(worker_id) == incarnation:
            del self._current[worker_id]
        return self._release(lambda w, inc: inc == incarnation)

    def _release(self, which: Callable[[int, str], bool]) -> int:
        self._close(lambda owner: which(*owner))
        lost = [t for t, (w, inc, _, _) in self._tickets.items() if which(w, inc)]
        groups = [held[3] for held in map(self._pop_ticket, lost) if held is not None]
        self.counts["released_tickets"] += len(groups)
        for gid in groups:
            if gid is not None:
                self._missing(gid)
        return len(groups)

    def _missing(self, gid: int) -> None:
        """A member of group instance ``gid`` will never arrive."""
        self._groups[gid].missing += 1
        self._settle(gid)

    def learner_buffered(self, rank: int, decisions: int) -> None:
        """A learner rank reports the decisions it holds but has not trained yet."""
        self._buffered += decisions - self._learner_buffered.get(rank, 0)
        self._learner_buffered[rank] = decisions

    # ---- put / take ------------------------------------------------------------------------
    def finished(self, info: SegmentInfo, ticket: int | None) -> int | None:
        """An admitted episode finished and is being shipped: its admission is free. Returns
        its GRPO group instance, for ``put``."""
        self._recent_lengths.append(info.decisions)
        return self._group_of(info.key, ticket)

    def has_space(self) -> bool:
        """Whether a ``put`` may go ahead now (room, or closed: it is then discarded)."""
        return len(self._items) < self.cfg.capacity or self.closed

    def put(self, info: SegmentInfo, refs: list[Any], waited_s: float,
            group_id: int | None = None) -> int:
        """Queue one segment (with GRPO, hold it until its group instance ``group_id``, from
        ``finished``, is complete); after ``close`` count it as discarded at stop instead.
        Returns the depth."""
        if self.closed:  # the run is stopping and no learner will take it
            self.counts["discarded_at_stop"] += 1
            self.counts["discarded_decisions"] += info.decisions
            return len(self._items)
        self.counts["put"] += 1
        self.counts["put_decisions"] += info.decisions
        self.counts["producer_wait_s"] += waited_s
        if self.group_size > 1:
            gid = group_id if group_id is not None else self._join(info.key, None)
            group = self._groups[gid]
            if group.rounds:
                self.counts["redrawn"] += 1
                self.counts["redrawn_decisions"] += info.decisions
            if group.expired:
                self._discard_members("expired", [(info, refs)])
            else:
                group.members.append((info, refs))
            self._settle(gid)
            self._expire_held()
        else:
            self._push_item([(info, refs)])
        self.metrics.set("queue_depth", len(self._items))
        return len(self._items)

    def _push_item(self, item: Item) -> None:
        self._items.append(item)
        self._queued += sum(info.decisions for info, _ in item)

    def _pop_item(self) -> Item:
        item = self._items.popleft()
        self._queued -= sum(info.decisions for info, _ in item)
        return item

    def _settle(self, gid: int) -> None:
        """Queue group instance ``gid`` whole once every member it expects is accounted for
        (or, when uniform, draw another round, or skip it, counted); a group with no member
        shipped just ends."""
        group = self._groups[gid]
        if not group.resolved():
            return
        if group.expired or not group.members:
            del self._groups[gid]
            return
        uniform = _uniform(group.members)
        if uniform and self._redraw(gid):
            return
        del self._groups[gid]
        self._count_task(group, uniform)
        if uniform and self.skip_uniform:
            self.counts["redraw_skipped_groups"] += group.rounds > 0
            self._discard_group("uniform", group.members)
            return
        if group.rounds and not uniform:
            self.counts["rescued_groups"] += 1
            self.counts["rescued_decisions"] += sum(i.decisions for i, _ in group.members)
        self._push_item(list(group.members))

    def _count_task(self, group: _Group, uniform: bool) -> None:
        """Count a settled group under its task: which tasks the updates come from."""
        row = self.groups_by_task.setdefault(str(group.key.task_id), {
            "mixed": 0, "all_failed": 0, "all_succeeded": 0, "queued_decisions": 0})
        if not uniform:
            row["mixed"] += 1
        else:
            row["all_succeeded" if group.members[0][0].episode_return > 0 else "all_failed"] += 1
        if not (uniform and self.skip_uniform):
            row["queued_decisions"] += sum(i.decisions for i, _ in group.members)

    def _redraw(self, gid: int) -> bool:
        """Start another round of resolved uniform group instance ``gid`` (dynamic sampling),
        if it has rounds left and its owner admits: it expects ``group_size`` more members,
        the next admissions of its owner's incarnation."""
        group = self._groups[gid]
        if group.rounds >= self.redraw_rounds or group.owner is None:
            return False
        worker, incarnation = group.owner
        if not self._admitting or incarnation in self._retired or \
                self._current.get(worker) != incarnation:
            return False
        group.rounds += 1
        group.size = group.joined + self.group_size
        self._drawing.setdefault(incarnation, deque()).append(gid)
        self.counts["redraws"] += 1
        return True

    def _expire_held(self) -> None:
        """Held groups that can no longer be trained fresh: drop and count them; members
        still to come of such a group are counted expired as they arrive."""
        for gid in [g for g, group in self._groups.items()
                    if group.members and self._stale(group.members)]:
            group = self._groups[gid]
            self._discard_group("expired", group.members)
            group.members, group.expired = [], True
            self._stop_drawing(gid)
            self._settle(gid)

    def _discard_group(self, why: str, members: Item) -> None:
        """Count a GRPO group that leaves without being queued (``expired`` or ``uniform``)."""
        self.counts[f"{why}_groups"] += 1
        self._discard_members(why, members)

    def _discard_members(self, why: str, members: Item) -> None:
        self.counts[why] += len(members)
        self.counts[f"{why}_decisions"] += sum(i.decisions for i, _ in members)
        self.metrics.inc("episodes_dropped", len(members))

    def _stale(self, item: Item) -> bool:
        return self.bound.stale(min(info.min_version for info, _ in item), self.version)

    def ready(self) -> bool:
        """Whether an item is queued (a learner waiting may go on)."""
        return len(self._items) > 0

    def take(self, max_items: int, max_decisions: int | None = None) -> list[Item]:
        """Up to ``max_items`` items in arrival order, dropping (and counting) stale ones;
        ``max_decisions``: stop once the items taken hold that many decisions (a learner's
        budget: what its batch still needs; at least one item)."""
        out: list[Item] = []
        taken = 0
        while self._items and len(out) < max_items and (
                max_decisions is None or taken < max_decisions):
            item = self._pop_item()
            if self._stale(item):
                self.counts["dropped_stale"] += len(item)
                self.counts["dropped_stale_items"] += 1
                self.counts["dropped_stale_decisions"] += sum(i.decisions for i, _ in item)
                self.metrics.inc("episodes_dropped", len(item))
                continue
            for info, _ in item:
                lag = max(self.version - info.min_version, 0)
                self.staleness[lag] = self.staleness.get(lag, 0) + 1
                self.metrics.observe("staleness", lag)
            out.append(item)
            taken += sum(info.decisions for info, _ in item)
        self.counts["got"] += sum(len(item) for item in out)
        self.counts["got_decisions"] += sum(i.decisions for item in out for i, _ in item)
        self.metrics.inc("trajectories", sum(len(item) for item in out))
        self.metrics.set("queue_depth", len(self._items))
        return out

    def close(self) -> None:
        """The learners have stopped: what is put from now on is discarded at stop."""
        self.closed = True

    def set_version(self, version: int, restored: bool = False, lineage: int = 0) -> None:
        """The learner's current policy version (for the staleness filter and expiry) in
        ``lineage``; a restored learner, or a newer lineage, may move it backwards; a report
        of an older lineage (sent before a rollback, arriving after it) is ignored."""
        if lineage < self.lineage:
            return
        rollback = restored or lineage > self.lineage
        self.lineage = lineage
        self.version = version if rollback else max(self.version, version)
        if self.group_size > 1:
            self._expire_held()

    def depth(self) -> int:
        return len(self._items)

    def queued_decisions(self) -> int:
        """Decision samples queued (before the staleness filter), held groups excluded."""
        return self._queued

    def held_decisions(self) -> int:
        return sum(i.decisions for g in self._groups.values() for i, _ in g.members)

    def stats(self) -> QueueStats:
        return QueueStats(**self.counts, depth=len(self._items), version=self.version,
                          queued_decisions=self.queued_decisions(),
                          held_episodes=sum(len(g.members) for g in self._groups.values()),
                          held_decisions=self.held_decisions(),
                          in_flight_episodes=len(self._tickets),
                          backlog_decisions=self.backlog(),
                          expected_lag=round(self.expected_lag(), 2),
                          mean_episode_decisions=round(self.mean_decisions(), 2),
                          staleness_hist=dict(sorted(self.staleness.items())),
                          groups_by_task={k: dict(v) for k, v in sorted(
                              self.groups_by_task.items(), key=lambda kv: int(kv[0]))})
