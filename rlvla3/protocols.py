"""The seams of rlvla3: what an env, a policy and a trajectory source must provide.

Anything that satisfies these protocols plugs into the pipeline without changing it: a new
simulator implements ``Env``; a new model implements ``Policy``. Nothing here imports Ray.

Invariants:
- ``Env.step`` executes a whole action chunk and blocks until the simulator is done; env workers
  run each slot in its own thread, so a blocking simulator never stalls the other slots.
- ``Policy.evaluate`` on the (observations, actions, latents) recorded by ``Policy.act`` returns
  the same log-probabilities for the same weights: that is what makes the decoupled PPO ratio
  exact for fresh data. Where the action distribution is a product of Gaussians it also returns
  each one's log-probability (``Evaluation.log_prob_elements``), in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import numpy as np

from rlvla3.types import EnvSpec, ObsBatch, Observation, PolicyOutput, StepResult

if TYPE_CHECKING:  # annotations only: env workers and the queue load this without torch
    import torch


@runtime_checkable
class Env(Protocol):
    """A simulator with fixed tasks and fixed initial states."""

    spec: EnvSpec

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        """Start an episode of ``task_id`` from fixed initial state ``init_state_id``."""
        ...

    def step(self, actions: np.ndarray) -> StepResult:
        """Execute one action chunk ``[chunk_len, action_dim]``."""
        ...

    def close(self) -> None:
        """Release the simulator (processes, GL contexts)."""
        ...


@dataclass(frozen=True, slots=True)
class Evaluation:
    """A policy's differentiable view of recorded decisions."""

    log_prob: torch.Tensor
    """``[n]`` log-probability of the recorded action chunks under the current weights."""
    value: torch.Tensor
    """``[n]`` value estimates."""
    entropy: torch.Tensor
    """``[n]`` entropy (or an estimate of it) of the action distribution."""
    log_prob_elements: torch.Tensor | None = None
    """``[n, E]`` log-probability of each of the ``E`` Gaussians whose product is the action
    distribution (summing to ``log_prob``): what a trust region per Gaussian needs
    (``algo.ratio``). None: the policy gives only the decision's total (``E = 1``)."""


@runtime_checkable
class Policy(Protocol):
    """An image + instruction + state policy with a value head. Also a ``torch.nn.Module``."""

    def act(self, obs: ObsBatch, deterministic: bool = False) -> PolicyOutput:
        """Sample (or take the mode of) action chunks; no gradient."""
        ...

    def evaluate(self, obs: ObsBatch, actions: torch.Tensor, latents: torch.Tensor) -> Evaluation:
        """Log-probability, value and entropy of recorded decisions; differentiable."""
        ...

    def sft_loss(self, obs: ObsBatch, actions: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        """Supervised (behaviour cloning) loss on demonstration action chunks."""
        ...

    def seed_sampling(self, seed: int) -> None:
        """Draw ``act``'s sampling noise from a stream of its own, seeded ``seed``."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True): ...

    def parameters(self): ...

    def eval(self) -> object:
        """Inference mode (``torch.nn.Module.eval``): no dropout, no batch-statistics updates."""
        ...


def as_module(policy: Policy) -> torch.nn.Module:
    """The ``torch.nn.Module`` every policy also is: the typed view of a policy for what takes a
    module (moving it to a device, an engine, a checkpoint writer)."""
    return cast("torch.nn.Module", policy)


class Metrics(Protocol):
    """Where a role core reports its live figures (Prometheus, through ``ray.util.metrics``,
    in a Ray actor): counters, gauges and histograms by name."""

    def inc(self, name: str, value: float = 1.0) -> None:
        """Add ``value`` to counter ``name``."""
        ...

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name``."""
        ...

    def observe(self, name: str, value: float) -> None:
        """Add one observation to histogram ``name``."""
        ...


class Demonstrations(Protocol):
    """Where the SFT loss beside RL (``algo.sft_coef``) draws its samples
    (``datalake.demos.DemoSet``)."""

    def draw(self, n: int) -> tuple[ObsBatch, np.ndarray, np.ndarray]:
        """``n`` samples: observations, action chunks ``[n, chunk, action_dim]``, their mask."""
        ...
