"""One rollout GPU and its env slots, simulated event by event: the planner's check on its own
closed-form queueing.

Role: ``rlvla3.gpu.plan`` predicts a rollout GPU's steady state in closed form (a request
waits half the running batch plus its own, a weight transfer slows every batch by the share
of time it takes). Two things that form escapes are what the pipeline measured: batches vary
in size, and a request is more likely to land in a large one than the mean batch says; and a
weight transfer is not spread thinly, it stops the GPU for ``sync_ms`` while every slot of it
piles up, then the backlog drains in large, slow batches. This module runs the same closed
loop with the pipeline's own batching policy (``rlvla3.rollout.batching.AdaptiveBatching``, on a
virtual clock), so both show up. Pure Python, no Ray, deterministic for a seed; a lane of 64
slots over 300 simulated seconds takes a fraction of a second.

The model (simulated seconds, one rollout GPU):
- ``slots`` env slots in a closed loop: each runs a decision's env steps (gamma distributed
  with the latency model's mean and coefficient of variation), one decision in ``decisions``
  after an episode's reset (``reset_s``), then asks for an action and waits for it; a share
  of decisions asks once more (a cut episode's bootstrap value: ``requests_per_decision -
  1``);
- the GPU batches as the rollout server does: when it is free and requests are pending, it
  asks the policy for ``Limits`` (fire at ``fire_at`` pending or ``t_max`` after the first),
  takes up to ``b_max``, and serves them in ``per_call + per_sample x B`` (x the cost model's
  jitter);
- a new policy version lands every ``version_s``; the GPU applies one before the next batch
  it fires once ``weights_every`` versions have landed since its last, stalling ``sync_ms``
  with the fired batch waiting (the server swaps between batches).

Output: ``LaneResult`` (decisions/s, mean batch, the mean request's response, the share of
time in transfers), over the simulated span after a warm-up.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from rlvla3.gpu.costs import GpuCosts, jitter_factor
from rlvla3.rollout.batching import AdaptiveBatching, AdaptiveConfig


@dataclass(frozen=True)
class LaneResult:
    """A simulated rollout GPU's steady state."""

    decisions_per_s: float
    mean_batch: float
    response_s: float
    """Mean time from a request to its answer."""
    busy: float
    """Share of time serving batches (transfers not included)."""
    sync_fraction: float
    """Share of time applying weights."""


_ARRIVE, _TIMER, _DONE = 0, 1, 2


@dataclass(frozen=True)
class SlotTiming:
    """A slot's env time, simulated seconds (``rlvla3.gpu.plan.EnvTiming`` gives it)."""

    steps_s: float
    """Mean env time of one decision's steps, the runtime's own time per decision included."""
    steps_cv: float
    """Their coefficient of variation."""
    reset_s: float
    """An episode's reset, before its first decision."""
    decisions: float
    """Mean decisions per episode (a decision follows a reset with probability 1 / this)."""
    requests_per_decision: float


def simulate_lane(costs: GpuCosts, timing: SlotTiming, slots: int, b_limit: int,
                  version_s: float, weights_every: int, seconds: float = 300.0,
                  warmup: float = 60.0, seed: int = 0) -> LaneResult:
    """Run one rollout GPU serving ``slots`` env slots (module docstring). ``version_s``: the
    time between policy versions (``math.inf``: no transfers)."""
    rng = np.random.default_rng(seed)
    decision_s = timing.steps_s + timing.reset_s / timing.decisions
    requests_per_decision = timing.requests_per_decision
    policy = AdaptiveBatching(AdaptiveConfig(b_limit=b_limit))
    a, b = costs.infer_per_call_ms / 1000.0, costs.infer_per_sample_ms / 1000.0
    sync_s = costs.sync_ms / 1000.0
    extra = min(max(requests_per_decision - 1.0, 0.0), 1.0)
    shape = 1.0 / timing.steps_cv ** 2 if timing.steps_cv > 0 else 0.0

    def env_time() -> float:
        steps = float(rng.gamma(shape, timing.steps_s / shape)) if shape else timing.steps_s
        return steps + (timing.reset_s if rng.random() < 1.0 / timing.decisions else 0.0)

    events: list[tuple[float, int, int, int]] = []  # (time, kind, sequence, slot)
    sequence = 0

    def push(t: float, kind: int, slot: int = -1) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (t, kind, sequence, slot))

    for s in range(slots):  # slots start spread over one decision, as a running loop has them
        push(float(rng.uniform(0.0, decision_s)), _ARRIVE, s)
    pending: list[tuple[float, int]] = []  # (submitted, slot), oldest first
    bonus = [False] * slots  # the slot's next answer is a bootstrap value: ask again at once
    busy_until, timer_at = -1.0, math.inf
    applied, end = 0, warmup + seconds
    counted = {"decisions": 0, "batches": 0, "batched": 0, "response": 0.0, "answers": 0,
               "busy": 0.0, "sync": 0.0}

    def measured(t: float) -> bool:
        return warmup <= t < end

    def try_fire(now: float) -> None:
        nonlocal busy_until, timer_at, applied
        if busy_until > now or not pending:
            return
        limits = policy.limits(len(pending), now)
        if len(pending) < limits.fire_at and pending[0][0] + limits.t_max_s > now:
            if pending[0][0] + limits.t_max_s < timer_at:
                timer_at = pending[0][0] + limits.t_max_s
                push(timer_at, _TIMER)
            return
        batch, pending[:] = pending[:limits.b_max], pending[limits.b_max:]
        timer_at = math.inf
        start = now
        landed = int(now / version_s) if math.isfinite(version_s) else 0
        if landed - applied >= weights_every:
            applied = landed
            start += sync_s
            if measured(now):
                counted["sync"] += sync_s
        service = (a + b * len(batch)) * jitter_factor(rng, costs.infer_jitter)
        busy_until = start + service
        policy.served(len(batch), service)
        if measured(now):
            counted["batches"] += 1
            counted["batched"] += len(batch)
            counted["busy"] += service
        for submitted, index in batch:
            push(busy_until, _DONE, index)
            if measured(submitted):
                counted["response"] += busy_until - submitted
                counted["answers"] += 1

    while events:
        now, kind, _, slot = heapq.heappop(events)
        if now >= end:
            break
        if kind == _ARRIVE:
            policy.arrived(now)
            pending.append((now, slot))
        elif kind == _DONE:
            if bonus[slot]:
                bonus[slot] = False
                push(now, _ARRIVE, slot)
            else:
                if measured(now):
                    counted["decisions"] += 1
                bonus[slot] = bool(rng.random() < extra)
                push(now + env_time(), _ARRIVE, slot)
        elif now < timer_at:
            continue  # a timer a fired batch made stale
        else:
            timer_at = math.inf  # this one is due; try_fire sets the next if it waits on
        try_fire(now)
    span = seconds
    return LaneResult(
        decisions_per_s=counted["decisions"] / span,
        mean_batch=counted["batched"] / counted["batches"] if counted["batches"] else 0.0,
        response_s=counted["response"] / counted["answers"] if counted["answers"] else math.inf,
        busy=counted["busy"] / span, sync_fraction=counted["sync"] / span)
