"""The parts of a learner's optimizer step that stand on their own.

Role: what ``rlvla3.learner.core.LearnerCore`` computes each optimizer step with, beside its loop:
the standardisation of PPO advantages (``AdvantageNormalizer``: constants fixed for a whole
step and shared by every micro-batch and rank), the proximal policy of decoupled PPO
(``ProximalWindow``: the engine's frozen copy, refreshed every ``algo.proximal_window`` steps),
what of both a checkpoint keeps (``LearnerState``) and the step's report (``StepStats``, one
``steps.jsonl`` line).

Inputs: advantages, micro-batches of ``Samples``, the engine. Outputs: standardised
advantages, proximal log-probabilities, the step's figures.

Invariants: a step's standardisation constants never come from the micro-batch or queue pull
they standardise, so streaming, micro-batching or the rank count do not change the update; a
learner restored from a checkpoint (``LearnerState`` and the proximal copy's tensors) takes
the step the learner that saved it would have taken next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np
import torch

from rlvla3.config import build
from rlvla3.engine.engine import TrainingEngine
from rlvla3.learner.samples import Samples
from rlvla3.protocols import Policy

Reduce = Callable[[np.ndarray], np.ndarray]
"""Sums a float64 vector over the learner ranks (identity for one rank)."""


@dataclass(frozen=True, slots=True)
class NormalizerState:
    """What ``AdvantageNormalizer`` carries from one optimizer step to the next."""

    mu: float = 0.0
    sigma: float = 1.0
    ready: bool = False
    """The constants are set (the first step's batch seeded them)."""
    average: tuple[float, float, float] | None = None
    """The running moments (count, sum, sum of squares); None before the first whole batch."""


@dataclass(frozen=True, slots=True)
class LearnerState:
    """What the next optimizer step depends on beyond the weights, the optimizer state, the
    version and the RNG: a checkpoint's ``meta.json`` keeps it (``learner``), so that a resumed
    run takes the step the saving run would have taken. The proximal copy's parameters travel
    as the checkpoint's ``shadow/`` tensors; the learning rate ``algo.target_kl`` adapts lives
    in the optimizer's param groups. Not kept: a batch's stored micro-batches, so a checkpoint
    taken between the epochs of one batch (``algo.update_epochs`` > 1) resumes at the next
    batch."""

    normalizer: NormalizerState = NormalizerState()
    proximal_synced_at: int | None = None
    """The version whose parameters the proximal copy holds (``proximal: window``)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LearnerState:
        return build(cls, raw, "learner")


class AdvantageNormalizer:
    """Standardisation constants for PPO advantages, fixed per optimizer step.

        A_hat = (A - mu) / (sigma + 1e-8)

    ``mu`` and ``sigma`` come from the moments (count, sum, sum of squares) of the advantages
    of the previous optimizer batches, summed over all ranks and averaged with ``decay``:

        M_k = decay * M_{k-1} + m_k,    mu = S / N,    sigma = sqrt(S2 / N - mu^2)

    (``decay`` 0: the previous batch alone). The first step waits for its whole local batch and
    uses that batch's own statistics. A streaming learner starts a step before its batch is
    complete, so the batch's own statistics cannot be known in time; taking them from whole
    batches (never from a queue pull or a micro-batch) keeps a single good or bad episode from
    being normalised to mean zero and makes the update independent of how the batch arrived or
    was split; averaging over several batches keeps one rare success in a small batch from
    setting the next batch's mean (and so the sign of nearly all its advantages).
    """

    def __init__(self, enabled: bool, reduce: Reduce, decay: float = 0.0):
        self.enabled = enabled
        self.reduce = reduce
        self.decay = decay
        self.mu, self.sigma = 0.0, 1.0
        self.ready = not enabled
        self._step = np.zeros(3)
        self._average: np.ndarray | None = None

    def seed(self, advantages: np.ndarray) -> None:
        """Constants for the first step, from its own batch (all ranks)."""
        self._set(self.reduce(self._moments(advantages)))
        self.ready = True

    def apply(self, advantages: np.ndarray) -> np.ndarray:
        if not self.enabled:
            return advantages
        self._step += self._moments(advantages)
        return ((advantages - self.mu) / (self.sigma + 1e-8)).astype(np.float32)

    def end_step(self) -> None:
        """The step's batch is complete: its statistics join the average for the next step."""
        if self.enabled:
            moments, self._step = self.reduce(self._step), np.zeros(3)
            if np.isfinite(moments).all():  # a batch with a NaN sets nothing
                self._average = moments if self._average is None \
                    else self.decay * self._average + moments
                self._set(self._average)

    def abort_step(self) -> None:
        """The step was abandoned: its micro-batches will be standardised again."""
        self._step = np.zeros(3)

    @staticmethod
    def _moments(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float64)
        return np.array([len(a), a.sum(), np.square(a).sum()])

    def state(self) -> NormalizerState:
        """The constants and running moments (between two steps: a step's own moments join
        them at ``end_step``)."""
        average = None if self._average is None else (
            float(self._average[0]), float(self._average[1]), float(self._average[2]))
        return NormalizerState(float(self.mu), float(self.sigma), self.ready, average)

    def restore(self, state: NormalizerState) -> None:
        if self.enabled:
            self.mu, self.sigma, self.ready = state.mu, state.sigma, state.ready
            self._average = None if state.average is None else np.array(state.average)
        self._step = np.zeros(3)

    def _set(self, moments: np.ndarray) -> None:
        n, s, s2 = moments
        if n > 0 and np.isfinite(s) and np.isfinite(s2):
            self.mu = s / n
            self.sigma = float(np.sqrt(max(s2 / n - self.mu**2, 0.0)))


class ProximalWindow:
    """The proximal policy of decoupled PPO (``proximal: window``): the engine's frozen copy
    of the learner's parameters (held as the policy is: sharded under FSDP), refreshed every
    ``every`` optimizer steps and after any load."""

    def __init__(self, engine: TrainingEngine, every: int):
        self.engine = engine
        self.every = every
        self.synced_at = 0
        """Learner version whose parameters the copy holds."""

    @torch.no_grad()
    def log_probs(self, batch: Samples) -> np.ndarray:
        """``[n]``, or ``[n, E]`` per Gaussian when the policy reports them."""
        shadow = cast(Policy, self.engine.shadow)  # kept for ``proximal: window``
        ev = shadow.evaluate(batch.obs, torch.from_numpy(batch.actions),
                             torch.from_numpy(batch.latents))
        log_prob = ev.log_prob if ev.log_prob_elements is None else ev.log_prob_elements
        return log_prob.float().cpu().numpy()

    def after_step(self, version: int) -> None:
        if version % self.every == 0:
            self.sync(version)

    def sync(self, version: int) -> None:
        """Take the learner's current parameters (after a step, a restore or ``init_from``)."""
        self.engine.refresh_shadow()
        self.synced_at = version


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step reports (means over its samples unless said otherwise)."""

    version: int
    samples: int
    loss: float
    policy_loss: float
    value_loss: float
    entropy: float
    clip_fraction: float
    """Ratios whose gradient the clip removed (per Gaussian under ``ratio: element``)."""
    kl_per_element: float
    """Approximate ``KL(pi_prox || pi_theta)`` per Gaussian."""
    kl_per_decision: float
    """The same per decision."""
    no_grad_fraction: float
    """Decisions that gave no gradient at all (clipped, masked, or advantage 0)."""
    grad_norm: float
    mean_staleness: float
    behaviour_weight: float
    """Mean importance weight ``pi_prox / pi_behav`` after the cap."""
    weight_quantiles: tuple[float, float, float]
    """The 5%, 50% and 95% quantiles of the weight before the cap, over the step's samples."""
    truncated_fraction: float
    """Fraction of the step's samples whose importance weight was above the cap."""
    skipped: bool = False
    """The gradient was not finite: the weights were left as they were."""
    epoch: int = 0
    """Which of the batch's ``update_epochs`` steps this was (0: the batch's first; a later
    epoch reports ``samples`` 0, as it trains no new sample)."""
    lr: float = 0.0
    """The learning rate after this step (``algo.target_kl`` adapts it)."""
    update_kl: float | None = None
    """``KL(pi_start || pi_theta)`` per decision of the trust region that closed at this step,
    measured after its last update on the step's last micro-batch (averaged over the ranks):
    ``pi_start`` is the proximal copy with a window, the parameters before the step otherwise.
    What ``algo.target_kl`` steers by; None when no region closed or no target is set."""
    ref_kl: float = math.nan
    """``KL(pi_theta || pi_ref)`` per decision against the frozen ``init_from`` policy
    (``algo.ref_kl_coef``); NaN without one."""
    sft_loss: float = math.nan
    """The SFT loss on the demonstrations drawn beside the step's samples (``algo.sft_coef``),
    before its weight; NaN without one."""

    def as_row(self) -> dict:
        """One ``steps.jsonl`` line (plain JSON values)."""
        row = {k: getattr(self, k) for k in self.__slots__ if k != "weight_quantiles"}
        row.update(zip(("weight_p05", "weight_p50", "weight_p95"), self.weight_quantiles,
                       strict=True))
        return row
