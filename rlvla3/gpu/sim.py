"""The simulated GPU regime as wrappers: a simulated rollout model and a simulated training engine.

Role: run the real pipeline on CPUs as if its GPU stages ran on the GPUs our users train on,
without a cost clock in the production code. Each wrapper holds the real object (a
``RolloutCore``, a ``TrainingEngine``), lets it compute for real, and then sleeps what remains
of the stage's simulated cost (``rlvla3.gpu.costs``: the figures and the ``CostClock``).
Selected by config: ``rollout.cost_model`` (with ``rollout.lanes`` simulated GPUs per server)
and ``learner.cost_model`` (with ``learner.ranks_per_actor`` GPUs per learner actor), both
scaled by ``time_dilation``; ``real`` wraps nothing.

Inputs: the real core or engine, the cost figures, the run's dilation. Outputs: the same
interface as the wrapped object (``rlvla3.rollout.core.Acting`` / the engine's), plus the clocks'
``ClockStats`` for the role's stats.

Invariants:
- The wrapped object computes exactly as it would alone: same actions, same log-probabilities,
  same gradients; only time passes differently.
- A rollout batch of B costs ``inference_ms(B)`` x a jitter factor; applying a new version on a
  lane costs ``sync_ms`` (a swap that applies nothing costs nothing).
- A learner micro-batch of n samples costs ``train_per_sample_ms x n / ranks_per_actor``
  (a stand-in that trains no sample, ``flush``'s, costs nothing) and an optimizer step
  ``train_per_step_ms``; a step abandoned by the ranks never reaches the engine's ``step`` and
  costs nothing.
- The real compute is hidden inside the simulated cost; only what exceeds it is added (counted
  as an overrun).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from rlvla3.config import Named
from rlvla3.engine.engine import StepResult, TrainingEngine
from rlvla3.gpu.costs import (
    ClockStats,
    CostClock,
    GpuCosts,
    TrainingCost,
    jitter_factor,
    resolve_costs,
)
from rlvla3.protocols import Policy
from rlvla3.rollout.core import Acting, RolloutCore
from rlvla3.types import ActionChunk, Observation, WeightsMessage

T = TypeVar("T")


class SimulatedRollout:
    """A rollout core on one simulated GPU (see the module docstring)."""

    def __init__(self, core: RolloutCore, costs: GpuCosts, dilation: float, seed: int,
                 clock: CostClock | None = None, sync_clock: CostClock | None = None):
        """``seed``: the jitter's stream; ``clock``/``sync_clock``: the batches' and the weight
        transfers' clocks (real time unless given)."""
        self.core = core
        self.costs = costs
        self.rng = np.random.default_rng(seed)
        self.clock = clock or CostClock(dilation)
        self.sync_clock = sync_clock or CostClock(dilation)

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def swaps(self) -> int:
        return self.core.swaps

    def offer_weights(self, message: WeightsMessage, force: bool = False) -> None:
        self.core.offer_weights(message, force)

    def swap_pending(self, min_lead: int = 1) -> bool:
        """The core's swap, then the rest of the weight transfer's cost if one was applied."""
        start = self.sync_clock.now()
        swapped = self.core.swap_pending(min_lead)
        if swapped:
            self.sync_clock.pay(self.costs.sync_ms, start)
        return swapped

    def act_batch(self, observations: Sequence[Observation]) -> list[ActionChunk]:
        """The core's forward, then the rest of the batch's simulated cost."""
        start = self.clock.now()
        chunks = self.core.act_batch(observations)
        cost = (self.costs.inference_ms(len(observations))
                * jitter_factor(self.rng, self.costs.infer_jitter))
        self.clock.pay(cost, start)
        return chunks


class RolloutSimulation:
    """The simulated lanes of one rollout server, and what their clocks paid."""

    def __init__(self, lanes: list[SimulatedRollout]):
        self.lanes = lanes

    def compute(self) -> ClockStats:
        """The lanes' batches, summed."""
        return sum((lane.clock.stats for lane in self.lanes), ClockStats())

    def weight_sync(self) -> ClockStats:
        """The lanes' weight transfers, summed."""
        return sum((lane.sync_clock.stats for lane in self.lanes), ClockStats())


def rollout_lanes(cores: list[RolloutCore], cost_model: Named, dilation: float,
                  seeds: list[int]) -> tuple[list[Acting], RolloutSimulation | None]:
    """What a rollout server computes with, as ``rollout.cost_model`` says: the cores
    themselves (``real``), or each core on a simulated GPU whose jitter draws from its seed."""
    costs = resolve_costs(cost_model, "rollout.cost_model")
    if costs is None:
        return list(cores), None
    lanes = [SimulatedRollout(core, costs, dilation, seed)
             for core, seed in zip(cores, seeds, strict=True)]
    return list(lanes), RolloutSimulation(lanes)


class SimulatedEngine:
    """A ``TrainingEngine`` standing for ``cost.ranks`` simulated GPUs: ``backward`` and
    ``step`` take as long as on them; every other member is the wrapped engine's."""

    def __init__(self, engine: TrainingEngine, cost: TrainingCost,
                 clock: CostClock | None = None):
        self.engine = engine
        self.cost = cost
        self.clock = clock or cost.clock()

    def backward(self, loss_fn: Callable[[], tuple[Any, T]], last: bool, samples: int) -> T:
        """The engine's micro-batch, then the rest of its simulated cost."""
        start = self.clock.now()
        info = self.engine.backward(loss_fn, last, samples)
        if samples:
            self.clock.pay(self.cost.micro_batch_ms(samples), start)
        return info

    def step(self) -> StepResult:
        """The engine's optimizer step, then the rest of its simulated cost."""
        start = self.clock.now()
        result = self.engine.step()
        self.clock.pay(self.cost.step_ms, start)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

