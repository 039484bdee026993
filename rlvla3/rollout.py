"""The rollout core: batched policy inference that tags every action with its weight version.

Inputs: lists of ``Observation``s (one per requesting env slot) and published weights.
Outputs: one ``ActionChunk`` per observation.

Invariant: weights change only in ``swap_pending``, which the rollout server calls between
batches; a batch is always computed by one version, and each chunk carries that version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from rlvla3.episode import EpisodeRecorder, TaskSampler
from rlvla3.protocols import Env, Policy
from rlvla3.types import ActionChunk, ObsBatch, Observation, TrajectorySegment, WeightsMessage


class RolloutCore:
    """A policy copy used only for acting."""

    def __init__(self, policy: Policy, deterministic: bool = False):
        self.policy = policy
        self.deterministic = deterministic
        self.version = 0
        self._pending: WeightsMessage | None = None
        self._forced = False
        self.swaps = 0
        self.busy_s = 0.0

    def offer_weights(self, message: WeightsMessage, force: bool = False) -> None:
        """Keep ``message`` to be applied at the next batch boundary (newest wins). ``force``
        accepts an older version too: a learner restored from a checkpoint rolls back."""
        if force or (message.version > self.version and (
            self._pending is None or message.version > self._pending.version
        )):
            self._pending = message
            self._forced = force

    def swap_pending(self, min_lead: int = 1) -> bool:
        """Apply offered weights if they are at least ``min_lead`` versions ahead (or were
        forced); call only between batches."""
        if self._pending is None:
            return False
        if not self._forced and self._pending.version - self.version < min_lead:
            return False
        self.load(self._pending.tensors, self._pending.version)
        self._pending = None
        self._forced = False
        return True

    def load(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self.policy.load_state_dict({k: v if isinstance(v, torch.Tensor) else
                                     torch.tensor(np.asarray(v)) for k, v in tensors.items()})
        self.version = version
        self.swaps += 1

    def act_batch(self, observations: Sequence[Observation]) -> list[ActionChunk]:
        """One forward pass for all ``observations``, by the current version."""
        start = time.perf_counter()
        out = self.policy.act(ObsBatch.stack(observations), deterministic=self.deterministic)
        n = len(observations)
        chunks = [
            ActionChunk(out.actions[i], float(out.log_prob[i]), float(out.value[i]),
                        out.latents[i], self.version, n)
            for i in range(n)
        ]
        self.busy_s += time.perf_counter() - start
        return chunks


def collect_episodes(env: Env, core: RolloutCore, sampler: TaskSampler, n: int,
                     source: str = "local") -> list[TrajectorySegment]:
    """``n`` whole episodes in this process, one decision at a time (no Ray, no latency
    hiding): for debugging, tests and benchmarks that need real behaviour data. Episodes cut
    by the time limit get a bootstrap value of 0."""
    segments = []
    for _ in range(n):
        key = sampler.next()
        obs, rec = env.reset(key.task_id, key.init_state_id), EpisodeRecorder(key, source)
        while True:
            chunk = core.act_batch([obs])[0]
            result = env.step(chunk.actions)
            rec.record(obs, chunk, result)
            obs = result.obs
            if result.terminated or result.truncated:
                segments.append(rec.finish(result, 0.0))
                break
    return segments
