"""The learner core: consumes trajectory segments, runs micro-batches, steps the optimizer.

Inputs: ``TrajectorySegment``s (turned into per-decision samples with advantages on arrival).
Outputs: optimizer steps; after each, the policy version increases by one and ``weights()``
gives the new parameters.

Invariants:
- One optimizer step consumes exactly ``local_batch`` samples (``global_batch / world_size``),
  split into micro-batches of ``micro_batch``; a segment may straddle two steps, no sample is
  dropped or used twice. Each micro-batch's loss is scaled by its share of ``local_batch``, so
  the accumulated gradient equals that of one full-batch step on the same samples.
- Under DDP, gradients are all-reduced only on the last micro-batch of a step (``no_sync``
  elsewhere); every rank runs the same number of micro-batches per step.
- The learner strategy decides only *when* a micro-batch may start: ``StreamingStart`` as soon
  as one is full, ``BatchStart`` once the whole local batch has arrived. The update is the same.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlvla3.algos import AlgoConfig, objective
from rlvla3.protocols import Policy
from rlvla3.samples import Samples, prepare_samples
from rlvla3.types import EpisodeKey, TrajectorySegment


class BatchStart:
    """Start computing only when the rest of the local batch is buffered (classic PPO)."""

    name = "batch"

    def may_start(self, buffered: int, remaining_in_step: int, micro_batch: int) -> bool:
        return buffered >= remaining_in_step


class StreamingStart:
    """Start a micro-batch as soon as it is full (the RL-VLA3 streamer)."""

    name = "streaming"

    def may_start(self, buffered: int, remaining_in_step: int, micro_batch: int) -> bool:
        return buffered >= min(micro_batch, remaining_in_step)


LEARNER_STRATEGIES = {"batch": BatchStart, "streaming": StreamingStart}


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step reports."""

    version: int
    samples: int
    loss: float
    policy_loss: float
    value_loss: float
    entropy: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    mean_staleness: float


class LearnerCore:
    """Micro-batched, accumulating PPO/GRPO learner over a policy (optionally DDP-wrapped)."""

    def __init__(self, policy: Policy, algo: AlgoConfig, local_batch: int, micro_batch: int,
                 lr: float, strategy: BatchStart | StreamingStart,
                 ddp_model: nn.Module | None = None):
        self.policy = policy
        self.model = ddp_model if ddp_model is not None else policy
        self.algo = algo
        self.local_batch = local_batch
        self.micro_batch = micro_batch
        self.strategy = strategy
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=lr, eps=1e-5)
        self.version = 0
        self._pending: deque[Samples] = deque()
        self.buffered = 0
        self._groups: dict[EpisodeKey, list[TrajectorySegment]] = defaultdict(list)
        self._done_in_step = 0
        self._micro_index = 0
        self._acc: list[dict[str, float]] = []
        self.busy_s = 0.0
        self.samples_trained = 0

    @property
    def micro_done(self) -> int:
        """Samples already consumed toward the current optimizer step."""
        return self._done_in_step

    @property
    def held_episodes(self) -> int:
        """GRPO: episodes waiting for the rest of their group."""
        return sum(len(g) for g in self._groups.values())

    def _complete_groups(self, segments: list[TrajectorySegment]) -> list[TrajectorySegment]:
        """GRPO needs whole groups, but asynchronous slots finish a group's episodes at
        different times: hold each episode until ``group_size`` of its (task, initial state)
        have arrived, then release them together."""
        ready: list[TrajectorySegment] = []
        for segment in segments:
            group = self._groups[segment.key]
            group.append(segment)
            if len(group) == self.algo.group_size:
                ready.extend(self._groups.pop(segment.key))
        return ready

    def add_segments(self, segments: Iterable[TrajectorySegment]) -> None:
        """Turn segments into samples (advantages computed here) and buffer them."""
        segments = list(segments)
        if self.algo.name == "grpo":
            segments = self._complete_groups(segments)
        if not segments:
            return
        samples = prepare_samples(segments, self.algo)
        self._pending.append(samples)
        self.buffered += len(samples)

    def _take(self, n: int) -> Samples:
        parts, need = [], n
        while need > 0:
            head = self._pending[0]
            if len(head) <= need:
                parts.append(self._pending.popleft())
                need -= len(head)
            else:
                parts.append(head.select(np.arange(need)))
                self._pending[0] = head.select(np.arange(need, len(head)))
                need = 0
        self.buffered -= n
        return parts[0] if len(parts) == 1 else Samples.concat(parts)

    def run_available(self, on_step: Callable[[StepStats], None] | None = None,
                      until_version: int | None = None) -> int:
        """Run every micro-batch the strategy allows now (and, if given, until the version
        reaches ``until_version``); return how many optimizer steps ran."""
        steps = 0
        while until_version is None or self.version < until_version:
            remaining = self.local_batch - self._done_in_step
            size = min(self.micro_batch, remaining)
            if not self.strategy.may_start(self.buffered, remaining, self.micro_batch):
                return steps
            self._micro_step(self._take(size))
            if self._done_in_step == self.local_batch:
                stats = self._optimizer_step()
                steps += 1
                if on_step is not None:
                    on_step(stats)
        return steps

    def loss(self, batch: Samples) -> tuple[torch.Tensor, dict[str, float]]:
        """The PPO/GRPO objective on one micro-batch (mean over its samples)."""
        ev = self.model.evaluate(batch.obs, torch.from_numpy(batch.actions),
                                 torch.from_numpy(batch.latents))

        def t(a: np.ndarray) -> torch.Tensor:  # recorded data, on the policy's device
            return torch.from_numpy(a).to(ev.log_prob.device)

        total, stats = objective(self.algo, ev, t(batch.log_probs), t(batch.advantages),
                                 t(batch.returns), t(batch.values))
        return total, {"loss": stats.loss, "policy_loss": stats.policy_loss,
                       "value_loss": stats.value_loss, "entropy": stats.entropy,
                       "clip_fraction": stats.policy.clip_fraction,
                       "approx_kl": stats.policy.approx_kl,
                       "staleness": float(self.version - batch.policy_versions.mean())}

    def _micro_step(self, batch: Samples) -> None:
        start = time.perf_counter()
        self._micro_index += 1
        last = self._done_in_step + len(batch) == self.local_batch
        sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") \
            else self.model.no_sync()
        with sync:
            loss, info = self.loss(batch)
            (loss * (len(batch) / self.local_batch)).backward()
        info["n"] = len(batch)
        self._acc.append(info)
        self._done_in_step += len(batch)
        self.samples_trained += len(batch)
        self.busy_s += time.perf_counter() - start

    def _optimizer_step(self) -> StepStats:
        start = time.perf_counter()
        grad_norm = nn.utils.clip_grad_norm_(self.policy.parameters(), self.algo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        acc, self._acc = self._acc, []
        weights = np.asarray([a["n"] for a in acc], dtype=np.float64) / self.local_batch

        def avg(key: str) -> float:
            return float(sum(w * a[key] for w, a in zip(weights, acc, strict=False)))

        self._done_in_step = 0
        self.busy_s += time.perf_counter() - start
        return StepStats(self.version, self.local_batch, avg("loss"), avg("policy_loss"),
                         avg("value_loss"), avg("entropy"), avg("clip_fraction"),
                         avg("approx_kl"), float(grad_norm), avg("staleness"))

    def weights(self) -> dict[str, np.ndarray]:
        """Current parameters and buffers as numpy arrays (CPU copies)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.policy.state_dict().items()}
