"""Staleness control in one place: the rule that says what is too old, and the pacing arithmetic
that keeps it rare.

Role: every figure of the pipeline that counts policy versions between acting and training. The
trajectory queue (``rlvla3.queue.core``) admits episodes by ``Pacing`` and drops stale items by
``StalenessBound``; the learner (``rlvla3.learner.core`` through ``rlvla3.learner.group_buffer``) discards
stale unstarted items by the same ``StalenessBound``; the controller's start-up note reads
``inherent_lag``; the GPU planner (``rlvla3.gpu.plan``) sizes ``queue.pace_lag`` and
``queue.max_staleness`` with ``planned_pace_lag`` and ``planned_max_staleness``.

Inputs: plain numbers (versions, decisions, batch sizes). Outputs: lags in policy versions,
decision bounds, and yes/no answers. No state, no clock.

Invariants:
- One staleness rule: an item (an episode, or a whole GRPO group) is stale when its *oldest*
  decision is more than ``max_staleness`` versions behind the learner's version; the queue's
  filter, the learner's discard and the expiry of held GRPO groups all ask ``StalenessBound``,
  so they never disagree on an item.
- One lag formula: ``decisions x update_epochs / global_batch`` versions (each batch of
  ``global_batch`` decisions is ``update_epochs`` optimizer steps, each a version).
- Pacing never holds a slot back while none is running or while less than one global batch of
  work is ahead of the learners (holding back then only idles them), so it cannot deadlock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PACE_FRACTION = 0.75
"""``queue.pace_lag`` when unset: this fraction of ``queue.max_staleness``."""


def lag(decisions: float, update_epochs: int, global_batch: int) -> float:
    """Policy versions the learners advance while they train ``decisions`` decisions."""
    return decisions * update_epochs / global_batch


def pace_target(max_staleness: int, pace_lag: float | None) -> float:
    """The lag pacing admits up to: ``pace_lag``, or ``PACE_FRACTION x max_staleness``."""
    return PACE_FRACTION * max_staleness if pace_lag is None else pace_lag


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """The staleness rule (see the module docstring); ``max_staleness`` None: no bound (a
    synchronous round bounds staleness by itself)."""

    max_staleness: int | None

    def stale(self, oldest: int, version: int) -> bool:
        """Whether an item whose oldest decision acted at version ``oldest`` is too old to
        train at learner version ``version``."""
        return self.max_staleness is not None and version - oldest > self.max_staleness


@dataclass(frozen=True, slots=True)
class Pacing:
    """When a new episode may start (asynchronous rollout).

    An episode admitted now has its first decision trained after everything ahead of it:

        lag = (backlog + (running + 1) x mean_decisions) x update_epochs / global_batch

    where ``backlog`` is shipped but untrained (queued plus buffered in the learners) and
    ``running`` the episodes admitted and unfinished. It is admitted while that lag is within
    ``target_lag`` and the backlog within ``backlog_limit``."""

    target_lag: float
    """Versions (``queue.pace_lag``, resolved); 0: no pacing."""
    backlog_batches: float
    """The backlog bound in global batches (``queue.pace_backlog``); 0: no bound."""
    global_batch: int
    update_epochs: int = 1
    group_size: int = 1
    """Episodes per queue item (a GRPO group arrives whole)."""

    def expected_lag(self, backlog: float, running: int, mean_decisions: float) -> float:
        """Versions before the first decision of an episode started after the ``running`` ones
        is trained (``running`` counts it, if it is one of them)."""
        return lag(backlog + running * mean_decisions, self.update_epochs, self.global_batch)

    def backlog_limit(self, mean_decisions: float) -> float:
        """Decisions the backlog may hold: ``backlog_batches`` global batches, but never less
        than one queue item (a GRPO group of mean-length episodes, or one episode). An item
        arrives whole, so a smaller bound would hold every slot back each time one arrives."""
        return max(self.backlog_batches * self.global_batch, self.group_size * mean_decisions)

    def admits(self, backlog: float, running: int, mean_decisions: float) -> bool:
        """Whether one more episode may start now (see the class docstring): always with pacing
        off, with none running, or with less than one global batch of work ahead of the
        learners."""
        if self.target_lag <= 0 or not running:
            return True
        if backlog + running * mean_decisions < self.global_batch:
            return True
        return (self.expected_lag(backlog, running + 1, mean_decisions) <= self.target_lag
                and (self.backlog_batches <= 0 or backlog <= self.backlog_limit(mean_decisions)))


def group_rounds(group_size: int, slots_per_worker: int) -> int:
    """Episodes a slot runs in a row for one GRPO group of ``group_size``, at most: a group's
    episodes are the next its env worker starts (``rlvla3.episode.tasks.TaskSampler``), on its free
    slots (1 without GRPO: ``group_size`` 1)."""
    return math.ceil(group_size / slots_per_worker)


def inherent_lag(slots: int, max_decisions: int, rounds: int, update_epochs: int,
                 global_batch: int) -> float:
    """Versions the learner can advance, when it trains all that every slot produces, while the
    oldest decision of a longest episode (or GRPO group of ``rounds`` episodes a slot) waits to
    be trained."""
    return lag(slots * max_decisions * rounds, update_epochs, global_batch)


def planned_pace_lag(backlog_batches: float, slots: int, max_decisions: int, global_batch: int,
                     update_epochs: int) -> float:
    """The pace target a plan sets so that pacing admits every slot: the queue's lag estimate
    stays below it even when every slot is in flight, the backlog is at its bound and the
    recent episodes are all of the longest length (a bound at the mean length held slots back
    whenever a run of failures raised the mean), plus one version of margin."""
    ahead = backlog_batches * global_batch + (slots + 1) * max_decisions
    return lag(ahead, update_epochs, global_batch) + 1.0


def planned_max_staleness(pace_lag: float, inherent: float, backlog_batches: float,
                          weights_every: int) -> int:
    """The staleness bound a plan sets: above its pace target (as the default pace target is
    ``PACE_FRACTION`` of the bound) and above a longest episode's inherent lag plus the
    backlog, plus the versions a rollout server may lag behind (``weights_every``)."""
    return math.ceil(max(pace_lag / PACE_FRACTION, inherent + backlog_batches) + weights_every)
