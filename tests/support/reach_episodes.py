"""Real episodes of the reach env for the Ray-free learner tests: a small policy, episodes acted
through a ``RolloutCore``, and PPO queue items (one episode each)."""

from __future__ import annotations

import torch

from envs import env_spec, make_env
from rlvla3.config import Named
from rlvla3.episode.tasks import TaskSampler
from rlvla3.policies import build_policy
from rlvla3.rollout.core import RolloutCore, collect_episodes

REACH = Named("reach", {"image_size": 16, "max_decisions": 6})


def collect_segments(policy, n_episodes: int, seed: int = 0):
    """Real episodes of the reach env acted by ``policy`` through a RolloutCore."""
    return collect_episodes(make_env(REACH), RolloutCore(policy),
                            TaskSampler(range(4), range(5), seed), n_episodes, "test")


def episodes(segments) -> list[list]:
    """PPO queue items: one episode each."""
    return [[s] for s in segments]


def make_policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_policy(Named("small", {"channels": 8, "hidden": 32}), env_spec(REACH))
