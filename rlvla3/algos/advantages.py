"""Advantage estimators (numpy, one episode or one GRPO group at a time): ``gae`` for PPO with a
value head, ``grpo_advantages`` for a group of episodes of one key.

Example::

    advantages, returns = gae(rewards, values, terminated=True, bootstrap_value=0.0,
                              gamma=0.99, lam=0.95)
"""

from __future__ import annotations

import numpy as np


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: bool,
    bootstrap_value: float,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one episode segment of ``T`` decision points.

        V_T     = 0                  if terminated (the task ended the episode)
                = bootstrap_value    otherwise (truncated: the episode could have gone on)
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = sum_{k=0}^{T-1-t} (gamma * lam)^k * delta_{t+k}
                = delta_t + gamma * lam * A_{t+1},   A_T = 0
        R_t     = A_t + V_t          (the value target, a lambda-return)

    ``rewards`` and ``values`` are float32 ``[T]``; returns ``(advantages, returns)``, float32 ``[T]``.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    next_values = np.append(values[1:], 0.0 if terminated else float(bootstrap_value))
    deltas = rewards + gamma * next_values - values
    advantages = np.zeros_like(deltas)
    running = 0.0
    for t in reversed(range(len(deltas))):
        running = deltas[t] + gamma * lam * running
        advantages[t] = running
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)


def grpo_advantages(returns_by_episode: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Group-relative advantages of the ``G`` episodes of one group (same task, same init state).

        A_i = (R_i - mean_j R_j) / (std_j R_j + eps)

    with the population standard deviation (``ddof=0``), so a group whose episodes all scored
    the same gets zero advantages rather than a division by zero, and so does a group of one
    episode (a group shortened by faults: nothing to compare it with). The per-step advantage
    of episode ``i`` is ``A_i`` at every one of its steps. Returns float32 ``[G]``.
    """
    returns = np.asarray(returns_by_episode, dtype=np.float64)
    return ((returns - returns.mean()) / (returns.std() + eps)).astype(np.float32)
