"""The reach task's scripted expert: the hand driven straight at the cube the instruction names.

Role: the demonstrator of ``rlvla3 datalake record --suite isaaclab_reach``. The expert reads
the target's centre from the privileged ``target`` state (positions 10..13) and commands the
clipped direction to it; what is recorded is what a pixel policy sees (the cameras and the
proprioceptive state, positions 0..10), so the dataset never holds the answer. Take 0 is the
clean expert; take k > 0 executes its actions with Gaussian noise (seeded by k) while the
recorded labels stay the expert's, so the data covers recoveries from states off its path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from envs.isaaclab.catalog import REACH_STATES
from rlvla3.protocols import Env
from rlvla3.types import Observation

TCP, TARGET = slice(0, 3), slice(10, 13)
"""The reach state's layout: TCP position, 7 joints, then (``target`` state) the target."""
STEP_M = 0.03
"""Metres of hand travel an action of 1 asks for in one step (the task's ``max_move``)."""
PROPRIO = REACH_STATES["proprio"]


def reach_action(target: np.ndarray, tcp: np.ndarray) -> np.ndarray:
    """The expert's action: the clipped direction from the hand to ``target``."""
    return np.clip((target - tcp) / STEP_M, -1.0, 1.0).astype(np.float32)


@dataclass
class ExpertEpisode:
    success: bool = False
    steps: int = 0
    observations: list[Observation] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)


def run_expert_episode(env: Env, task_id: int, init_state_id: int, action_noise: float = 0.0,
                       seed: int = 0) -> ExpertEpisode:
    """One episode of the expert on ``env`` (an Isaac Lab reach env with the ``target`` state
    and ``chunk_len: 1``): every step's observation without the target, and the expert's
    action for it."""
    if env.spec.chunk_len != 1 or env.spec.state_dim != REACH_STATES["target"]:
        raise ValueError("the reach expert needs the 'target' state and chunk_len 1, got "
                         f"state_dim {env.spec.state_dim}, chunk_len {env.spec.chunk_len}")
    rng = np.random.default_rng([seed, task_id, init_state_id])
    obs = env.reset(task_id, init_state_id)
    episode = ExpertEpisode()
    while True:
        action = reach_action(obs.state[TARGET], obs.state[TCP])
        episode.observations.append(replace(obs, state=np.array(obs.state[:PROPRIO])))
        episode.actions.append(action)
        executed = action
        if action_noise > 0:
            executed = np.clip(action + rng.normal(0.0, action_noise, action.shape), -1, 1)
        result = env.step(executed[None].astype(np.float32))
        episode.steps += result.steps
        if result.terminated or result.truncated:
            episode.success = bool(result.success)
            return episode
        obs = result.obs
