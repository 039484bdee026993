"""Per-slot episode bookkeeping: which episode to run next, and recording it into a segment.

``TaskSampler`` hands out ``EpisodeKey``s (task, fixed initial state) in a seeded order, each key
``repeat`` times in a row, so that GRPO groups (episodes of one key) form inside one env worker,
on its next free slots.
``EpisodeRecorder`` accumulates one slot's decisions and returns a ``TrajectorySegment``; it
never holds more than one episode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlvla3.types import (
    ActionChunk,
    EpisodeKey,
    ObsBatch,
    Observation,
    StepResult,
    TrajectorySegment,
)


class TaskSampler:
    """Seeded, endless sequence of episode keys; each key repeated ``repeat`` times.

    Every pass hands out each key ``repeat`` times, in a new seeded order. A key's copies come
    before any new key: once a key is handed out, its remaining copies go to the next callers,
    whatever task they ask for, so the ``repeat`` episodes of a GRPO group start on the worker's
    next free slots, ``ceil(repeat / slots)`` episodes of a slot apart at most, and the group
    is trained while its first member is still fresh. ``next(task)`` lets a caller stay on
    ``task`` when a new key starts: it takes that task's first key among the next ``lead``
    rounds of keys (``lead`` x tasks), else the next key; the pass still hands out every key,
    only the order changes. A LIBERO reset that changes task builds another simulator (5.2 s
    here against 2.8 s), so an env slot that stays on its task spends that on episodes."""

    def __init__(self, task_ids: Sequence[int], init_state_ids: Sequence[int], seed: int,
                 repeat: int = 1, lead: int = 0):
        self.keys = [EpisodeKey(t, s) for t in task_ids for s in init_state_ids]
        if not self.keys:
            raise ValueError("TaskSampler needs at least one task id and one initial state id")
        self.rng = np.random.default_rng(seed)
        self.repeat = repeat
        self.window = lead * len(set(task_ids))
        self._order: list[EpisodeKey] = []
        """The keys not yet started in this pass, the next key last."""
        self._copies: list[EpisodeKey] = []
        """The copies still to hand out of the key started last."""

    def next(self, task: int | None = None) -> EpisodeKey:
        if self._copies:
            return self._copies.pop()
        if not self._order:
            self._order = [self.keys[i] for i in self.rng.permutation(len(self.keys))][::-1]
        key = self._order.pop(self._index_for(task))
        self._copies = [key] * (self.repeat - 1)
        return key

    def _index_for(self, task: int | None) -> int:
        """Where in ``_order`` the next key is: ``task``'s first within the window, else the
        next one."""
        if task is not None:
            for i in range(1, min(self.window, len(self._order)) + 1):
                if self._order[-i].task_id == task:
                    return -i
        return -1


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
