"""The learner core: consumes trajectory segments, runs micro-batches, steps the optimizer.

Inputs: ``TrajectorySegment``s (turned into per-decision samples with advantages on arrival;
GRPO segments arrive as whole groups). Outputs: optimizer steps; after each, the policy version
increases by one and ``weights()`` gives the new parameters.

Invariants:
- One optimizer step consumes exactly ``local_batch`` samples (``global_batch / world_size``),
  split into micro-batches of ``micro_batch``; a segment may straddle two steps, no sample is
  used in two batches. With ``algo.update_epochs = E`` a batch gets E consecutive optimizer
  steps (E versions): the first as it streams in, the others on its stored micro-batches, with
  the advantages and proximal log-probs of the first; only the first counts as trained. Each
  micro-batch's loss is scaled by its share of ``local_batch``, so the accumulated gradient
  equals that of one full-batch step on the same samples.
- Staleness is bounded per decision: a buffered sample whose behaviour version is more than
  ``max_staleness`` versions behind the learner is discarded and counted (a last resort: the
  rollout side paces itself so that this stays rare). Only the stale decisions of an episode are
  dropped, never the fresh rest, so long episodes are not the ones that lose.
- PPO advantages are standardised with constants that are fixed for a whole optimizer step and
  shared by every micro-batch and every rank (``AdvantageNormalizer``), so splitting a batch
  into micro-batches or streaming it in does not change the update.
- Under DDP, gradients are all-reduced only on the last micro-batch of a step (``no_sync``
  elsewhere); every rank runs the same number of micro-batches per step.
- The learner strategy decides only *when* a micro-batch may start: ``StreamingStart`` as soon
  as one is full, ``BatchStart`` once the whole local batch has arrived. The update is the same.
- Every decision handed to ``add_segments`` ends up in exactly one of ``trained_decisions``,
  ``discarded_decisions`` or ``buffered``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from rlvla3.algos import AlgoConfig, objective
from rlvla3.gpu_costs import TrainingCost
from rlvla3.protocols import Policy
from rlvla3.samples import Samples, prepare_samples
from rlvla3.types import TrajectorySegment


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

Reduce = Callable[[np.ndarray], np.ndarray]
"""Sums a float64 vector over the learner ranks (identity for one rank)."""


class AdvantageNormalizer:
    """Standardisation constants for PPO advantages, fixed per optimizer step.

        A_hat = (A - mu) / (sigma + 1e-8)

    ``mu`` and ``sigma`` are the mean and standard deviation of the advantages of the previous
    optimizer batch, summed over all ranks; the first step waits for its whole local batch and
    uses that batch's own statistics. A streaming learner starts a step before its batch is
    complete, so the batch's own statistics cannot be known in time; taking them from a whole
    batch (never from a queue pull or a micro-batch) is what keeps a single good or bad episode
    from being normalised to mean zero, and makes the update independent of how the batch
    arrived or was split.
    """

    def __init__(self, enabled: bool, reduce: Reduce):
        self.enabled = enabled
        self.reduce = reduce
        self.mu, self.sigma = 0.0, 1.0
        self.ready = not enabled
        self._step = np.zeros(3)

    def seed(self, advantages: np.ndarray) -> None:
        """Constants for the first step, from its own batch (all ranks)."""
        self._set(self._moments(advantages))
        self.ready = True

    def apply(self, advantages: np.ndarray) -> np.ndarray:
        if not self.enabled:
            return advantages
        self._step += self._moments(advantages)
        return ((advantages - self.mu) / (self.sigma + 1e-8)).astype(np.float32)

    def end_step(self) -> None:
        """The step's batch is complete: its statistics become the next step's constants."""
        if self.enabled:
            self._set(self._step)
            self._step = np.zeros(3)

    @staticmethod
    def _moments(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float64)
        return np.array([len(a), a.sum(), np.square(a).sum()])

    def _set(self, moments: np.ndarray) -> None:
        n, s, s2 = self.reduce(moments)
        if n > 0 and np.isfinite(s) and np.isfinite(s2):  # a batch with a NaN sets nothing
            self.mu = s / n
            self.sigma = float(np.sqrt(max(s2 / n - self.mu**2, 0.0)))


class ProximalWindow:
    """The proximal policy of decoupled PPO (``proximal: window``): a frozen copy of the
    learner's parameters, refreshed every ``every`` optimizer steps and after any load."""

    def __init__(self, policy: Policy, every: int):
        import copy

        self.policy = policy
        self.every = every
        self.copy = copy.deepcopy(policy).requires_grad_(False)

    @torch.no_grad()
    def log_probs(self, batch: Samples) -> np.ndarray:
        ev = self.copy.evaluate(batch.obs, torch.from_numpy(batch.actions),
                                torch.from_numpy(batch.latents))
        return ev.log_prob.float().cpu().numpy()

    def after_step(self, version: int) -> None:
        if version % self.every == 0:
            self.sync()

    def sync(self) -> None:
        """Take the learner's current parameters (after a step, a restore or ``init_from``)."""
        self.copy.load_state_dict(self.policy.state_dict())


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
    behaviour_weight: float
    """Mean truncated importance weight ``pi_prox / pi_behav`` of the step's samples."""
    truncated_fraction: float
    """Fraction of the step's samples whose importance weight was truncated."""
    epoch: int = 0
    """Which of the batch's ``update_epochs`` steps this was (0: the batch's first; a later
    epoch reports ``samples`` 0, as it trains no new sample)."""


class LearnerCore:
    """Micro-batched, accumulating PPO/GRPO learner over a policy (optionally DDP-wrapped)."""

    def __init__(self, policy: Policy, algo: AlgoConfig, local_batch: int, micro_batch: int,
                 lr: float, strategy: BatchStart | StreamingStart,
                 ddp_model: nn.Module | None = None, max_staleness: int | None = None,
                 reduce: Reduce | None = None, cost: TrainingCost | None = None):
        self.policy = policy
        self.cost = cost
        """Simulated GPU cost (``rlvla3.gpu_costs``): each micro-batch and optimizer step then
        lasts as long as on the GPUs it stands for (None: as long as it takes here)."""
        self.clock = cost.clock() if cost is not None else None
        self.model = ddp_model if ddp_model is not None else policy
        self.algo = algo
        self.local_batch = local_batch
        self.micro_batch = micro_batch
        self.strategy = strategy
        self.max_staleness = max_staleness
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=lr, eps=1e-5)
        self.normalizer = AdvantageNormalizer(algo.normalize_advantages and algo.name == "ppo",
                                              reduce or (lambda x: x))
        self.version = 0
        self._pending: deque[Samples] = deque()
        self.buffered = 0
        self._done_in_step = 0
        self._acc: list[dict[str, float]] = []
        self.busy_s = 0.0
        self.samples_trained = 0
        self.counts = {"received_decisions": 0, "received_episodes": 0, "trained_env_steps": 0,
                       "discarded_decisions": 0, "discarded_env_steps": 0, "skipped_steps": 0}
        self.proximal = ProximalWindow(policy, algo.proximal_window) \
            if algo.proximal == "window" else None
        self.epoch = 0
        """Epoch of the step under way (0: the batch is still streaming in)."""
        self._epoch_batches: list[Samples] = []
        """The batch's micro-batches as trained in epoch 0 (kept only if update_epochs > 1)."""
        self._replay: deque[Samples] = deque()
        self.staleness_hist: dict[int, int] = {}
        """Per trained decision: learner version minus behaviour version."""
        self.length_hist: dict[int, int] = {}
        """Decisions per episode received (the episodes that reached training)."""

    @property
    def micro_done(self) -> int:
        """New samples already consumed toward the current batch (0 in its later epochs)."""
        return 0 if self.epoch else self._done_in_step

    def add_segments(self, segments: Iterable[TrajectorySegment]) -> None:
        """Turn segments into samples (advantages computed here) and buffer them. GRPO segments
        must come as whole groups (the trajectory queue releases them so)."""
        segments = list(segments)
        if not segments:
            return
        for s in segments:
            self.length_hist[len(s)] = self.length_hist.get(len(s), 0) + 1
        samples = prepare_samples(segments, self.algo)
        self.counts["received_decisions"] += len(samples)
        self.counts["received_episodes"] += len(segments)
        self._pending.append(samples)
        self.buffered += len(samples)
        self._discard_stale()

    def _discard_stale(self) -> None:
        """Drop buffered decisions more than ``max_staleness`` versions behind (counted)."""
        if self.max_staleness is None:
            return
        floor = self.version - self.max_staleness
        kept: deque[Samples] = deque()
        for part in self._pending:
            fresh = part.policy_versions >= floor
            if fresh.all():
                kept.append(part)
                continue
            self.counts["discarded_decisions"] += int((~fresh).sum())
            self.counts["discarded_env_steps"] += int(part.env_steps[~fresh].sum())
            self.buffered -= int((~fresh).sum())
            if fresh.any():
                kept.append(part.select(np.flatnonzero(fresh)))
        self._pending = kept

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

    def _peek_advantages(self, n: int) -> np.ndarray:
        out, need = [], n
        for part in self._pending:
            out.append(part.advantages[:need])
            need -= len(out[-1])
            if need <= 0:
                break
        return np.concatenate(out)

    def run_available(self, on_step: Callable[[StepStats], None] | None = None,
                      until_version: int | None = None) -> int:
        """Run every micro-batch the strategy allows now (and, if given, until the version
        reaches ``until_version``); return how many optimizer steps ran."""
        steps = 0
        while until_version is None or self.version < until_version:
            if self._replay:  # a later epoch: its micro-batches are at hand
                self._micro_step(self._replay.popleft())
            else:
                remaining = self.local_batch - self._done_in_step
                size = min(self.micro_batch, remaining)
                if not self.normalizer.ready:
                    if self.buffered < self.local_batch:
                        return steps
                    self.normalizer.seed(self._peek_advantages(self.local_batch))
                if not self.strategy.may_start(self.buffered, remaining, self.micro_batch):
                    return steps
                self._micro_step(self._standardise(self._take(size)))
            if self._done_in_step == self.local_batch:
                stats = self._optimizer_step()
                steps += 1
                if on_step is not None:
                    on_step(stats)
        return steps

    def loss(self, batch: Samples) -> tuple[torch.Tensor, dict[str, float]]:
        """The PPO/GRPO objective on one micro-batch (mean over its samples); advantages are
        taken as given (standardise them first, as ``_micro_step`` does)."""
        ev = self.model.evaluate(batch.obs, torch.from_numpy(batch.actions),
                                 torch.from_numpy(batch.latents))

        def t(a: np.ndarray) -> torch.Tensor:  # recorded data, on the policy's device
            return torch.from_numpy(np.ascontiguousarray(a)).to(ev.log_prob.device)

        total, stats = objective(self.algo, ev, t(batch.log_probs), t(batch.advantages),
                                 t(batch.returns), t(batch.values), t(batch.prox_log_probs))
        return total, {"loss": stats.loss, "policy_loss": stats.policy_loss,
                       "value_loss": stats.value_loss, "entropy": stats.entropy,
                       "clip_fraction": stats.policy.clip_fraction,
                       "approx_kl": stats.policy.approx_kl,
                       "behaviour_weight": stats.policy.behaviour_weight_mean,
                       "truncated_fraction": stats.policy.truncated_fraction,
                       "staleness": float(self.version - batch.policy_versions.mean())}

    def _standardise(self, batch: Samples) -> Samples:
        """A new micro-batch as every epoch trains it: standardised advantages and, with a
        proximal window, the proximal log-probs (kept for the later epochs)."""
        start = time.perf_counter()
        batch = replace(batch, advantages=self.normalizer.apply(batch.advantages))
        if self.proximal is not None:
            batch = replace(batch, prox_log_probs=self.proximal.log_probs(batch))
        if self.algo.update_epochs > 1:
            self._epoch_batches.append(batch)
        self.busy_s += time.perf_counter() - start
        return batch

    def _micro_step(self, batch: Samples) -> None:
        start = time.perf_counter()
        begun = self.clock.now() if self.clock is not None else 0.0
        last = self._done_in_step + len(batch) == self.local_batch
        sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") \
            else self.model.no_sync()
        with sync:
            loss, info = self.loss(batch)
            (loss * (len(batch) / self.local_batch)).backward()
        info["n"] = len(batch)
        self._acc.append(info)
        self._done_in_step += len(batch)
        if self.epoch == 0:  # a later epoch trains no new decision
            self.samples_trained += len(batch)
            self.counts["trained_env_steps"] += int(batch.env_steps.sum())
            lags, counts = np.unique(self.version - batch.policy_versions, return_counts=True)
            for lag, count in zip(lags.tolist(), counts.tolist(), strict=True):
                self.staleness_hist[lag] = self.staleness_hist.get(lag, 0) + count
        if self.clock is not None:
            self.clock.pay(self.cost.micro_batch_ms(len(batch)), begun)
        self.busy_s += time.perf_counter() - start

    def _optimizer_step(self) -> StepStats:
        start = time.perf_counter()
        begun = self.clock.now() if self.clock is not None else 0.0
        grad_norm = nn.utils.clip_grad_norm_(self.policy.parameters(), self.algo.max_grad_norm)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN or inf loss or gradient: the weights stay as they are, the step is counted
            self.counts["skipped_steps"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        epoch = self.epoch
        if epoch == 0:
            self.normalizer.end_step()
        self.epoch = (epoch + 1) % self.algo.update_epochs
        if self.epoch:
            self._replay = deque(self._epoch_batches)
        else:
            self._epoch_batches = []
        if self.proximal is not None:
            self.proximal.after_step(self.version)
        acc, self._acc = self._acc, []
        weights = np.asarray([a["n"] for a in acc], dtype=np.float64) / self.local_batch

        def avg(key: str) -> float:
            return float(sum(w * a[key] for w, a in zip(weights, acc, strict=False)))

        self._done_in_step = 0
        self._discard_stale()
        if self.clock is not None:
            self.clock.pay(self.cost.step_ms, begun)
        self.busy_s += time.perf_counter() - start
        return StepStats(self.version, 0 if epoch else self.local_batch, avg("loss"),
                         avg("policy_loss"), avg("value_loss"), avg("entropy"),
                         avg("clip_fraction"), avg("approx_kl"), float(grad_norm),
                         avg("staleness"), avg("behaviour_weight"), avg("truncated_fraction"),
                         epoch)

    def weights(self) -> dict[str, np.ndarray]:
        """Current parameters and buffers as numpy arrays (CPU copies)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.policy.state_dict().items()}
