"""Turning trajectory segments into flat training samples with advantages (numpy, no Ray).

Role: the step between the trajectory queue and the learner's loss. Input: the segments of one
queue item (one episode, or one GRPO group: whole episodes produced by the behaviour policy)
and the ``AlgoConfig``. Output: one ``Samples`` with a row per decision point, in segment order,
carrying everything the decoupled PPO objective needs (behaviour log-probabilities, advantages,
returns, behaviour values).

Invariants:
- Advantages are computed per whole episode before anything is flattened, so a decision's
  advantage never mixes rewards of two episodes.
- PPO: GAE with the behaviour values recorded at rollout time and the segment's bootstrap value
  when it was truncated. Advantages leave here unstandardised: how many episodes one call sees
  depends on arrival timing, so standardisation belongs to the optimizer batch (the learner's
  ``AdvantageNormalizer``), never to a call or a micro-batch.
- GRPO: the segments given are one group, whatever its size: the queue releases a group short
  when members were lost to faults, and two groups of the same (task, initial state) are never
  pooled (each call is one queue item). A group of one gets advantage 0. The per-step
  advantage is the episode's group advantage; the return is the episode return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlvla3.algos.advantages import gae, grpo_advantages
from rlvla3.algos.config import AlgoConfig
from rlvla3.types import ObsBatch, TrajectorySegment


@dataclass(frozen=True, slots=True)
class Samples:
    """``N`` decision points flattened from several episodes, ready for the loss."""

    obs: ObsBatch
    """Observations, ``N`` rows."""
    actions: np.ndarray
    """float32 ``[N, chunk_len, action_dim]``: the executed action chunks."""
    latents: np.ndarray
    """float32 ``[N, ...]``: what the policy needs to recompute the log-probabilities."""
    log_probs: np.ndarray
    """float32 ``[N]``: behaviour log-probabilities recorded at rollout time."""
    advantages: np.ndarray
    """float32 ``[N]``."""
    returns: np.ndarray
    """float32 ``[N]``: value targets (PPO) or episode returns (GRPO)."""
    values: np.ndarray
    """float32 ``[N]``: behaviour value estimates recorded at rollout time."""
    policy_versions: np.ndarray
    """int64 ``[N]``: version of the weights behind each action."""
    env_steps: np.ndarray
    """int64 ``[N]``: low-level env steps each decision executed."""
    prox_log_probs: np.ndarray
    """float32 ``[N]``, or ``[N, E]`` per Gaussian when the policy reports them: proximal
    log-probabilities (decoupled PPO); the behaviour ones (``[N]``) until the learner computes
    them with its proximal copy."""

    def __len__(self) -> int:
        return len(self.log_probs)

    def select(self, index: np.ndarray) -> Samples:
        """Rows ``index`` (an integer array) as new samples, e.g. one micro-batch."""
        return Samples(
            obs=self.obs.select(index),
            actions=self.actions[index],
            latents=self.latents[index],
            log_probs=self.log_probs[index],
            advantages=self.advantages[index],
            returns=self.returns[index],
            values=self.values[index],
            policy_versions=self.policy_versions[index],
            env_steps=self.env_steps[index],
            prox_log_probs=self.prox_log_probs[index],
        )

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        """Rows of several ``Samples`` in order, e.g. a micro-batch that spans two arrivals."""
        return Samples(
            obs=ObsBatch.concat([p.obs for p in parts]),
            actions=np.concatenate([p.actions for p in parts]),
            latents=np.concatenate([p.latents for p in parts]),
            log_probs=np.concatenate([p.log_probs for p in parts]),
            advantages=np.concatenate([p.advantages for p in parts]),
            returns=np.concatenate([p.returns for p in parts]),
            values=np.concatenate([p.values for p in parts]),
            policy_versions=np.concatenate([p.policy_versions for p in parts]),
            env_steps=np.concatenate([p.env_steps for p in parts]),
            prox_log_probs=np.concatenate([p.prox_log_probs for p in parts]),
        )


def _ppo_advantages(
    segments: Sequence[TrajectorySegment], cfg: AlgoConfig
) -> tuple[np.ndarray, np.ndarray]:
    per_segment = [
        gae(s.rewards, s.values, s.terminated, s.bootstrap_value, cfg.gamma, cfg.lam)
        for s in segments
    ]
    advantages = np.concatenate([a for a, _ in per_segment])
    returns = np.concatenate([r for _, r in per_segment])
    return advantages.astype(np.float32), returns


def _grpo_advantages(
    segments: Sequence[TrajectorySegment], cfg: AlgoConfig
) -> tuple[np.ndarray, np.ndarray]:
    keys = {s.key for s in segments}
    if len(keys) > 1:
        raise ValueError(f"a GRPO group holds episodes of one (task, initial state), got "
                         f"{sorted((k.task_id, k.init_state_id) for k in keys)}")
    episode_advantage = grpo_advantages(np.array([s.episode_return for s in segments]))
    if cfg.positive_advantages_only:
        episode_advantage = np.maximum(episode_advantage, 0.0)
    lengths = [len(s) for s in segments]
    if cfg.episode_weight == "equal":  # each episode's decisions share one episode's weight
        episode_advantage = episode_advantage * (np.mean(lengths) / np.array(lengths))
    advantages = np.repeat(episode_advantage.astype(np.float32), lengths)
    returns = np.repeat(np.array([s.episode_return for s in segments], np.float32), lengths)
    return advantages, returns


_ESTIMATORS = {"ppo": _ppo_advantages, "grpo": _grpo_advantages}


def prepare_samples(segments: Sequence[TrajectorySegment], cfg: AlgoConfig) -> Samples:
    """Flatten the ``segments`` of one queue item (an episode, or a GRPO group) into ``Samples``
    with advantages and returns for ``cfg.name``."""
    if not segments:
        raise ValueError("prepare_samples needs at least one segment")
    advantages, returns = _ESTIMATORS[cfg.name](segments, cfg)
    log_probs = np.concatenate([s.log_probs for s in segments]).astype(np.float32, copy=False)
    return Samples(
        obs=ObsBatch.concat([s.obs for s in segments]),
        actions=np.concatenate([s.actions for s in segments]).astype(np.float32, copy=False),
        latents=np.concatenate([s.latents for s in segments]).astype(np.float32, copy=False),
        log_probs=log_probs,
        advantages=advantages,
        returns=returns,
        values=np.concatenate([s.values for s in segments]).astype(np.float32, copy=False),
        policy_versions=np.concatenate([s.policy_versions for s in segments]).astype(
            np.int64, copy=False
        ),
        env_steps=np.concatenate([s.decision_steps() for s in segments]),
        prox_log_probs=log_probs.copy(),
    )
