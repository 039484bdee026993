"""Recording one env slot's episode into a ``TrajectorySegment``.

``EpisodeRecorder`` accumulates one slot's decisions (observation, action chunk, step result)
and ``finish`` returns them as one ``TrajectorySegment``; it never holds more than one episode.
"""

from __future__ import annotations

import numpy as np

from rlvla3.types import (
    ActionChunk,
    EpisodeKey,
    ObsBatch,
    Observation,
    StepResult,
    TrajectorySegment,
)


class EpisodeRecorder:
    """Accumulates one episode of one slot."""

    def __init__(self, key: EpisodeKey, source: str):
        self.key = key
        self.source = source
        self.obs: list[Observation] = []
        self.chunks: list[ActionChunk] = []
        self.rewards: list[float] = []
        self.steps: list[int] = []
        self.env_steps = 0

    def __len__(self) -> int:
        return len(self.rewards)

    def record(self, obs: Observation, chunk: ActionChunk, result: StepResult) -> None:
        self.obs.append(obs)
        self.chunks.append(chunk)
        self.rewards.append(result.reward)
        self.steps.append(result.steps)
        self.env_steps += result.steps

    def finish(self, last: StepResult, bootstrap_value: float) -> TrajectorySegment:
        """The recorded episode; ``last`` is the final step's result."""
        chunks = self.chunks
        return TrajectorySegment(
            key=self.key,
            source=self.source,
            obs=ObsBatch.stack(self.obs),
            actions=np.stack([c.actions for c in chunks]).astype(np.float32),
            latents=np.stack([c.latents for c in chunks]).astype(np.float32),
            rewards=np.asarray(self.rewards, dtype=np.float32),
            log_probs=np.asarray([c.log_prob for c in chunks], dtype=np.float32),
            values=np.asarray([c.value for c in chunks], dtype=np.float32),
            policy_versions=np.asarray([c.policy_version for c in chunks], dtype=np.int64),
            terminated=last.terminated,
            truncated=not last.terminated,
            success=last.success,
            bootstrap_value=float(bootstrap_value),
            env_steps=self.env_steps,
            step_counts=np.asarray(self.steps, dtype=np.int32),
            fault=last.fault,
        )
