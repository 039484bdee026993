"""Messages that cross actor boundaries.

Every value that travels between an env worker, a rollout server, the trajectory queue and a
learner is one of these frozen, slotted dataclasses. They hold numpy arrays (cheap to serialise
through Ray's object store, zero-copy on read) and never torch tensors, so that a message can be
produced on one device and consumed on another.

Invariants:
- An ``Observation`` describes one env slot at one decision point; cameras that a task does not
  have are absent from ``images`` (they cost no tokens downstream), never filled with zeros.
- An ``ActionChunk`` is tagged with the ``policy_version`` of the weights that produced it; a
  rollout server never mixes two versions inside one batch.
- A ``TrajectorySegment`` is one whole episode (or the part of it that ran before truncation)
  with everything the learner needs to recompute the decoupled PPO ratio without the behaviour
  policy: the behaviour log-probabilities, values and policy-specific ``latents``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Observation:
    """What one env slot shows the policy at one decision point."""

    images: Mapping[str, np.ndarray]
    """Camera name -> uint8 image ``[H, W, 3]``, upright. Absent cameras are simply missing."""
    state: np.ndarray
    """Proprioceptive state, float32 ``[state_dim]``."""
    instruction: str
    """The task's natural-language instruction."""


@dataclass(frozen=True, slots=True)
class ObsBatch:
    """Observations of ``n`` decision points stacked for a policy forward pass."""

    images: Mapping[str, np.ndarray]
    """Camera name -> uint8 ``[n, H, W, 3]``; rows whose camera is absent hold zeros."""
    image_mask: Mapping[str, np.ndarray]
    """Camera name -> bool ``[n]``: True where the camera is present for that row."""
    state: np.ndarray
    """float32 ``[n, state_dim]``."""
    instruction: tuple[str, ...]
    """One instruction per row."""

    def __len__(self) -> int:
        return len(self.instruction)

    @staticmethod
    def stack(observations: Sequence[Observation]) -> ObsBatch:
        """Stack single observations; the camera set is the union over rows."""
        cameras = sorted({cam for obs in observations for cam in obs.images})
        images: dict[str, np.ndarray] = {}
        masks: dict[str, np.ndarray] = {}
        for cam in cameras:
            shape = next(obs.images[cam].shape for obs in observations if cam in obs.images)
            stacked = np.zeros((len(observations), *shape), dtype=np.uint8)
            present = np.zeros(len(observations), dtype=bool)
            for i, obs in enumerate(observations):
                if cam in obs.images:
                    stacked[i] = obs.images[cam]
                    present[i] = True
            images[cam] = stacked
            masks[cam] = present
        state = np.stack([np.asarray(obs.state, dtype=np.float32) for obs in observations])
        return ObsBatch(images, masks, state, tuple(obs.instruction for obs in observations))

    @staticmethod
    def concat(batches: Sequence[ObsBatch]) -> ObsBatch:
        """Concatenate batches along rows (all batches must share one camera set)."""
        cameras = batches[0].images.keys()
        return ObsBatch(
            images={c: np.concatenate([b.images[c] for b in batches]) for c in cameras},
            image_mask={c: np.concatenate([b.image_mask[c] for b in batches]) for c in cameras},
            state=np.concatenate([b.state for b in batches]),
            instruction=tuple(i for b in batches for i in b.instruction),
        )

    def select(self, index: np.ndarray) -> ObsBatch:
        """Rows ``index`` (an integer array) as a new batch."""
        return ObsBatch(
            images={c: v[index] for c, v in self.images.items()},
            image_mask={c: v[index] for c, v in self.image_mask.items()},
            state=self.state[index],
            instruction=tuple(self.instruction[i] for i in index),
        )


@dataclass(frozen=True, slots=True)
class PolicyOutput:
    """A policy's answer for a batch of ``n`` observations (numpy, on CPU)."""

    actions: np.ndarray
    """float32 ``[n, chunk_len, action_dim]``: the action chunk to execute open loop."""
    log_prob: np.ndarray
    """float32 ``[n]``: log-probability of the whole chunk under the acting policy."""
    value: np.ndarray
    """float32 ``[n]``: the value head's estimate for the observation."""
    latents: np.ndarray
    """float32 ``[n, ...]``: what the policy needs to recompute ``log_prob`` later (for a
    flow-matching head, the denoising chain); ``[n, 0]`` for policies that need nothing."""

    def __len__(self) -> int:
        return len(self.log_prob)


@dataclass(frozen=True, slots=True)
class ActionChunk:
    """A rollout server's answer to one env slot."""

    actions: np.ndarray
    """float32 ``[chunk_len, action_dim]``."""
    log_prob: float
    """Behaviour log-probability of ``actions``."""
    value: float
    """Behaviour value estimate of the observation."""
    latents: np.ndarray
    """Policy-specific record needed to recompute ``log_prob`` (see ``PolicyOutput``)."""
    policy_version: int
    """Version of the weights that produced this chunk."""
    batch_size: int
    """How many requests the server batched together with this one (for the histogram)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an env returns after executing one action chunk."""

    obs: Observation
    """Observation after the chunk (meaningless once the episode is over, but always valid)."""
    reward: float
    """Sum of the rewards of the executed low-level steps."""
    terminated: bool
    """The episode ended by the task itself (success or failure state)."""
    truncated: bool
    """The episode was cut by the time limit or by a simulator fault."""
    success: bool
    """The task's success check holds."""
    steps: int
    """How many low-level simulator steps were executed (a chunk may stop early)."""
    fault: str = ""
    """Non-empty when the simulator crashed or hung during the chunk (the episode is then
    truncated and the simulator restarted); says what happened."""


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """Shapes an env promises; the policy is built from these."""

    cameras: tuple[str, ...]
    """Camera names the env may provide."""
    image_size: tuple[int, int]
    """(H, W) of every camera image."""
    state_dim: int
    """Length of ``Observation.state``."""
    action_dim: int
    """Length of one low-level action."""
    chunk_len: int
    """Low-level actions per decision (the action chunk executed open loop)."""
    max_decisions: int
    """Decision points after which an episode is truncated."""
    num_tasks: int
    """Number of distinct tasks (task ids are ``0..num_tasks-1``)."""
    num_init_states: int
    """Number of fixed initial states per task (ids ``0..num_init_states-1``)."""


@dataclass(frozen=True, slots=True)
class EpisodeKey:
    """Which task and fixed initial state an episode started from (the GRPO group key)."""

    task_id: int
    init_state_id: int


@dataclass(frozen=True, slots=True)
class Admission:
    """The trajectory queue's answer to an env slot asking to start an episode."""

    ticket: int
    """The admission, named again when the episode is shipped, dropped or cancelled."""
    key: EpisodeKey
    """The episode to run: the key asked for, or a GRPO group's key drawn again (dynamic
    sampling, ``algo.redraw_rounds``); the slot then gives the key it asked for back to its
    sampler."""


@dataclass(frozen=True, slots=True)
class TrajectorySegment:
    """One episode of one env slot, as produced by the behaviour policy.

    Arrays have a leading time dimension ``T`` (decision points)."""

    key: EpisodeKey
    """Task and initial state of the episode."""
    source: str
    """Which env worker and slot produced it, ``"w<worker>/s<slot>"``."""
    obs: ObsBatch
    """Observations at each decision point, ``T`` rows."""
    actions: np.ndarray
    """float32 ``[T, chunk_len, action_dim]``."""
    latents: np.ndarray
    """float32 ``[T, ...]``, see ``PolicyOutput.latents``."""
    rewards: np.ndarray
    """float32 ``[T]``."""
    log_probs: np.ndarray
    """float32 ``[T]`` behaviour log-probabilities."""
    values: np.ndarray
    """float32 ``[T]`` behaviour value estimates."""
    policy_versions: np.ndarray
    """int64 ``[T]`` version of the weights behind each action."""
    terminated: bool
    """The last step ended the episode by the task (no bootstrap)."""
    truncated: bool
    """The episode was cut (time limit or fault); ``bootstrap_value`` then applies."""
    success: bool
    """The task's success check held at the end."""
    bootstrap_value: float
    """Value of the observation after the last step; used only when ``truncated``."""
    env_steps: int
    """Low-level simulator steps the episode took."""
    step_counts: np.ndarray | None = None
    """int32 ``[T]``: low-level steps each decision executed (sums to ``env_steps``); what
    ``trained_env_steps`` counts. None: spread ``env_steps`` evenly (older producers)."""
    fault: str = ""
    """Non-empty when the episode was cut by a simulator fault (see ``StepResult.fault``)."""

    def __len__(self) -> int:
        return len(self.rewards)

    def decision_steps(self) -> np.ndarray:
        """int64 ``[T]``: low-level env steps behind each decision."""
        if self.step_counts is not None:
            return np.asarray(self.step_counts, dtype=np.int64)
        base, extra = divmod(self.env_steps, max(len(self), 1))
        return np.full(len(self), base, np.int64) + (np.arange(len(self)) < extra)

    @property
    def episode_return(self) -> float:
        return float(self.rewards.sum())


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What the trajectory queue and the controller know of a shipped segment without fetching
    its payload (the segment itself travels as an ``ObjectRef`` beside it)."""

    source: str
    """Producing worker and slot."""
    key: EpisodeKey
    """Task and initial state."""
    decisions: int
    """Decision points (training samples) in the segment."""
    env_steps: int
    """Low-level env steps in the segment."""
    min_version: int
    """Oldest policy version that acted in the segment."""
    episode_return: float
    success: bool
    max_version: int = -1
    """Newest policy version that acted in the segment (-1: same as ``min_version``)."""


@dataclass(frozen=True, slots=True)
class WeightsMessage:
    """Published weights of one policy version."""

    version: int
    """Policy version; increases by one per optimizer step."""
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    """Parameter name -> array (CPU path: travels through the object store). Empty when the
    weights travel by collective broadcast instead."""
    lineage: int = 0
    """The line of versions it belongs to: 0 for the run's first learner; a learner that
    restores an older version (a rollback) publishes under a new, larger lineage. A receiver
    ignores weights of a lineage older than its own, so no late message undoes a rollback."""
