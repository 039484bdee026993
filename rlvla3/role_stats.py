"""What each role reports: one frozen record per role, read by attribute.

Role: the telemetry contract of an RL run. Every role's ``stats()`` returns its record (the env
worker ``EnvWorkerStats``, the rollout server ``RolloutServerStats``, a learner rank
``LearnerStats``, the trajectory queue ``QueueStats``); the run's monitor collects them across
restarts (``actors.observe.collect``) and computes the headline figures from them
(``actors.observe.figures``: throughput, staleness, the decision accounting, busy fractions),
which the progress rows, ``summary.json``, the watchdog and the benchmarks report.

Inputs: the roles' counters. Outputs: the records, and ``Snapshot`` (one of each role's records,
at one moment).

Invariants:
- Every field has a default, so a role that never answered counts as zeros (``type(record)()``).
- ``CARRIED`` names the counters that never go down across restarts: a restarted actor starts
  from zero and the collector adds its predecessor's last values back (histograms add per bin).
- ``held()`` is what dies with the actor (counted as lost); ``at_rest()`` is the record of an
  actor that does not run (nothing in flight, not busy).
- ``state`` is set by the collector (``ALIVE``, or why the actor does not run); a role reports
  ``ALIVE``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlvla3.gpu.costs import ClockStats


@dataclass(frozen=True, slots=True)
class MemorySample:
    """A process's resident memory (MB), with its children (simulator processes)."""

    rss_mb: float = 0.0
    rss_peak_mb: float = 0.0
    children_rss_mb: float = 0.0
    """All descendants, now."""
    children_rss_peak_mb: float = 0.0
    total_peak_mb: float = 0.0
    """Own peak plus the children's peak."""


@dataclass(frozen=True, slots=True)
class EnvWorkerStats:
    """An env worker: its slots, what they produced and what they wait on."""

    CARRIED: ClassVar[tuple[str, ...]] = (
        "env_steps", "decisions", "episodes", "successes", "dropped_faults", "dropped_decisions",
        "shipped_decisions", "shipped_env_steps", "env_busy_s", "admit_wait_s", "length_hist")

    incarnation: str = ""
    """This actor process (a restarted worker reports a new one)."""
    slots: int = 0
    env_steps: int = 0
    """Low-level simulator steps."""
    decisions: int = 0
    """Decisions produced: ``inflight_decisions + dropped_decisions + shipped_decisions``."""
    episodes: int = 0
    """Episodes finished (shipped or dropped)."""
    successes: int = 0
    dropped_faults: int = 0
    """Episodes cut by a simulator fault (never shipped)."""
    dropped_decisions: int = 0
    shipped_decisions: int = 0
    """Decisions of the episodes put into the queue."""
    shipped_env_steps: int = 0
    env_busy_s: float = 0.0
    """Seconds the simulators computed, summed over the slots."""
    infer_wait_s: float = 0.0
    """Seconds the slots waited for actions, summed."""
    infer_requests: int = 0
    queue_wait_s: float = 0.0
    """Seconds the slots waited on the queue's ``put`` (backpressure), summed."""
    admit_wait_s: float = 0.0
    """Seconds the slots waited for admission (pacing), summed."""
    lockstep_skips: int = 0
    """Lockstep steps a slot sat out (resetting in the background)."""
    inflight_decisions: int = 0
    """Decisions of the episodes running now."""
    busy_fraction: float = 0.0
    """``env_busy_s`` over wall time x slots."""
    recent_return: float = 0.0
    """Mean return of the recent episodes (``RECENT_EPISODES`` of them)."""
    recent_success: float = 0.0
    recent_episodes: int = 0
    recent_by_task: dict[str, list[int]] = field(default_factory=dict)
    """Task id -> ``[episodes, successes]`` over the recent episodes."""
    task_shares: dict[str, float] = field(default_factory=dict)
    """Task id -> the share of new keys it gets (``env_workers.task_weighting``)."""
    length_hist: dict[int, int] = field(default_factory=dict)
    """Decisions per finished episode -> episodes."""
    phases: dict[str, int] = field(default_factory=dict)
    """What the slots wait on now (admit, reset, step, infer, put, idle) -> slots."""
    restarts: int = 0
    """Simulator restarts (process-isolated envs)."""
    memory: MemorySample = field(default_factory=MemorySample)
    state: str = "ALIVE"

    def held(self) -> dict[str, int]:
        return {"episodes": self.slots, "decisions": self.inflight_decisions}

    def at_rest(self) -> EnvWorkerStats:
        return replace(self, inflight_decisions=0, busy_fraction=0.0, recent_episodes=0,
                       phases={})


@dataclass(frozen=True, slots=True)
class RolloutServerStats:
    """A rollout server: requests, batches, weight swaps, and (simulated GPUs) their clocks."""

    CARRIED: ClassVar[tuple[str, ...]] = ("requests", "batches")

    incarnation: str = ""
    restarted: bool = False
    """This incarnation was restarted by Ray."""
    requests: int = 0
    """Observations served."""
    batches: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Batch size -> batches, over every lane (batched and lockstep)."""
    mean_batch_size: float = 0.0
    mean_batch_wait_ms: float = 0.0
    """Mean simulated ms from a batch's first request to its firing."""
    answered: int = 0
    """Single requests answered (asynchronous rollout)."""
    answer_s: float = 0.0
    """Their time in the server, summed."""
    busy_fraction: float = 0.0
    """Seconds computing over wall time x lanes."""
    busy_s: float = 0.0
    version: int = 0
    """The policy version held (the oldest lane's)."""
    lanes: int = 1
    weight_swaps: int = 0
    batch_policy: dict[str, float] = field(default_factory=dict)
    """The first lane's batching policy's figures (``b_max``, ``t_max_ms``, fitted costs)."""
    cost: ClockStats | None = None
    """Simulated GPUs (``rollout.cost_model``): what the batches' clocks paid."""
    sync_cost: ClockStats | None = None
    """... and the weight transfers'."""
    memory: MemorySample = field(default_factory=MemorySample)
    state: str = "ALIVE"

    def held(self) -> dict[str, int]:
        return {}

    def at_rest(self) -> RolloutServerStats:
        return replace(self, busy_fraction=0.0)


@dataclass(frozen=True, slots=True)
class LearnerStats:
    """A learner rank: what it received, trained and discarded, and its last step."""

    CARRIED: ClassVar[tuple[str, ...]] = (
        "samples_trained", "received_decisions", "received_episodes", "trained_env_steps",
        "discarded_decisions", "discarded_env_steps", "lost_segments", "lost_decisions",
        "staleness_hist", "length_hist", "busy_s", "skipped_steps")

    incarnation: str = ""
    rank: int = 0
    world_size: int = 1
    restored_from: str = ""
    """The checkpoint a restarted rank restored (empty: none)."""
    waiting_for: str = ""
    """Non-empty while the rank waits to join its group: it has no core yet."""
    version: int = 0
    samples_trained: int = 0
    """Decisions that went into an optimizer step taken."""
    received_decisions: int = 0
    received_episodes: int = 0
    received_groups: int = 0
    """Queue items received (an episode, or a GRPO group)."""
    short_groups: int = 0
    """GRPO groups that arrived with fewer than ``group_size`` episodes."""
    singleton_groups: int = 0
    trained_env_steps: int = 0
    """Env steps behind the trained decisions."""
    discarded_decisions: int = 0
    """Discarded as stale (``rlvla3.queue.pacing.StalenessBound``)."""
    discarded_env_steps: int = 0
    discarded_groups: int = 0
    skipped_steps: int = 0
    """Optimizer steps skipped for a non-finite gradient."""
    abandoned_steps: int = 0
    """Steps every rank abandoned at a stop."""
    buffered: int = 0
    """Decisions received and not yet taken into a step."""
    in_step: int = 0
    """Decisions taken into the step under way (not trained until it is taken)."""
    busy_fraction: float = 0.0
    busy_s: float = 0.0
    data_wait_fraction: float = 0.0
    """Wall time spent waiting for queue items."""
    lost_segments: int = 0
    """Episodes whose payload died with its producer (counted, not trained)."""
    lost_decisions: int = 0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    """Learner version minus behaviour version -> trained decisions."""
    length_hist: dict[int, int] = field(default_factory=dict)
    """Decisions per received episode -> episodes."""
    cost: ClockStats | None = None
    """Simulated GPUs (``learner.cost_model``): what the engine's clock paid."""
    engine: str = ""
    """The engine's strategy (``single``, ``ddp``, ``fsdp``), once weights were published."""
    publish_s: float | None = None
    """What gathering the weights for the servers last cost this rank: seconds, ..."""
    publish_peak_mb: float | None = None
    """... extra memory, ..."""
    publish_dtype: str = ""
    """... and the dtype they travel in."""
    loss: float = math.nan
    """The last optimizer step's (NaN before the first) ..."""
    entropy: float = math.nan
    kl_per_decision: float = math.nan
    clip_fraction: float = math.nan
    staleness: float = math.nan
    """... mean staleness of its decisions."""
    memory: MemorySample = field(default_factory=MemorySample)
    state: str = "ALIVE"

    def held(self) -> dict[str, int]:
        return {"decisions": self.buffered + self.in_step}

    def at_rest(self) -> LearnerStats:
        return replace(self, buffered=0, in_step=0, busy_fraction=0.0, data_wait_fraction=0.0)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The trajectory queue: what went in, what came out or was dropped, and pacing."""

    put: int = 0
    """Episodes queued (or held for their GRPO group)."""
    put_decisions: int = 0
    """``queued + held + got + dropped_stale + expired + uniform`` decisions."""
    got: int = 0
    """Episodes taken by the learners."""
    got_decisions: int = 0
    dropped_stale: int = 0
    """Episodes dropped at ``get`` for staleness ..."""
    dropped_stale_decisions: int = 0
    dropped_stale_items: int = 0
    """... and the items (episodes or whole GRPO groups) they were in."""
    expired: int = 0
    """Episodes of held GRPO groups that grew stale before completing ..."""
    expired_decisions: int = 0
    expired_groups: int = 0
    uniform: int = 0
    """Episodes of complete GRPO groups skipped as uniform (``algo.skip_uniform_groups``) ..."""
    uniform_decisions: int = 0
    uniform_groups: int = 0
    redraws: int = 0
    """Extra rounds drawn for uniform GRPO groups (dynamic sampling, ``algo.redraw_rounds``) ..."""
    redrawn: int = 0
    """... the episodes they shipped (within ``put``) ..."""
    redrawn_decisions: int = 0
    rescued_groups: int = 0
    """... the groups that drew a round and left mixed, queued whole ..."""
    rescued_decisions: int = 0
    redraw_skipped_groups: int = 0
    """... and those still uniform after their rounds, skipped (within ``uniform_groups``)."""
    discarded_at_stop: int = 0
    """Episodes put after the learners stopped ..."""
    discarded_decisions: int = 0
    producer_wait_s: float = 0.0
    """Seconds producers waited on a full queue, summed."""
    admit_wait_s: float = 0.0
    """Seconds admitted episodes waited for admission, summed."""
    admitted: int = 0
    dropped_by_producer: int = 0
    """Admitted episodes cut by a simulator fault."""
    refused_admissions: int = 0
    released_tickets: int = 0
    """Admissions of replaced or retired env worker incarnations, released."""
    depth: int = 0
    """Items queued now."""
    version: int = 0
    """The learner version the staleness rule compares with."""
    queued_decisions: int = 0
    held_episodes: int = 0
    held_decisions: int = 0
    in_flight_episodes: int = 0
    """Admitted, unfinished episodes."""
    backlog_decisions: int = 0
    """Shipped but untrained: queued plus buffered in the learners."""
    expected_lag: float = 0.0
    """Versions before an episode admitted now would have its first decision trained."""
    mean_episode_decisions: float = 0.0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    """Learner version minus oldest behaviour version -> episodes taken."""
    groups_by_task: dict[str, dict[str, int]] = field(default_factory=dict)
    """Env task id -> its settled GRPO groups: ``mixed``, ``all_failed``, ``all_succeeded``
    (uniform, return 0 / above 0) and ``queued_decisions`` (what it gave the learners)."""


Role = EnvWorkerStats | RolloutServerStats | LearnerStats


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every role's record at one moment (the monitor's tick)."""

    workers: Sequence[EnvWorkerStats]
    servers: Sequence[RolloutServerStats]
    learners: Sequence[LearnerStats]
    queue: QueueStats
