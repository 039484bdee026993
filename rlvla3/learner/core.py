"""The learner core: trains queue items, as samples, on a ``TrainingEngine`` (one rank, DDP or
FSDP2), one policy version per optimizer step. A step takes exactly this rank's ``rank_batches``
share of the global batch, no sample twice, and its gradient is that of one step on the whole
batch, advantages standardised by constants fixed for the step on all ranks, whatever the
micro-batches and the start rule (``StreamingStart``, ``BatchStart``); a batch gets
``algo.update_epochs`` steps and counts as trained once. All ranks run ``micro_per_step``
micro-batches and abandon a step together; an unstarted item with a stale oldest decision is
discarded whole; a decision given to ``add_groups`` is trained, discarded, in step or buffered::

    core = LearnerCore(policy, AlgoConfig("ppo"), 64, 16, 3e-4, StreamingStart(), max_staleness=4)
    core.add_groups(items)        # queue items, each a list of TrajectorySegment
    steps = core.run_available()  # optimizer steps taken; core.weights(): the new parameters

Design notes: docs/concepts/pipeline.md#the-learner-core"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import numpy as np
import torch

from rlvla3.algos.config import AlgoConfig
from rlvla3.algos.losses import approx_kl, objective
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    StateSnapshot,
    load_rng_state,
    read_meta,
    row_source,
    snapshot,
)
from rlvla3.engine.config import EngineConfig
from rlvla3.engine.engine import Published, TrainingEngine
from rlvla3.engine.group import Ranks
from rlvla3.engine.sharded import RowSource
from rlvla3.learner.group_buffer import GroupBuffer
from rlvla3.learner.kl_control import KlLearningRate
from rlvla3.learner.samples import Samples, prepare_samples
from rlvla3.learner.step import (
    AdvantageNormalizer,
    LearnerState,
    ProximalWindow,
    Reduce,
    StepStats,
)
from rlvla3.protocols import Demonstrations, Policy, as_module
from rlvla3.queue.pacing import StalenessBound
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


LEARNER_STARTS: dict[str, type[BatchStart | StreamingStart]] = {
    "batch": BatchStart, "streaming": StreamingStart}


def rank_batches(global_batch: int, world_size: int) -> list[int]:
    """Samples per optimizer step of each rank: ``global_batch`` shared out exactly (the first
    ``global_batch % world_size`` ranks take one more), e.g. 64 over 3 ranks: 22, 21, 21."""
    base, extra = divmod(global_batch, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


_AVERAGED = ("loss", "policy_loss", "value_loss", "entropy", "clip_fraction", "kl_per_element",
             "kl_per_decision", "no_grad_fraction", "staleness", "behaviour_weight",
             "truncated_fraction", "ref_kl", "sft_loss")


def rl_engine(policy: Policy, algo: AlgoConfig, lr: float, cfg: EngineConfig | None = None,
              ranks: Ranks | None = None) -> TrainingEngine:
    """The engine an RL learner rank trains through: Adam (eps 1e-5) at ``lr``, gradients of
    ``evaluate``, a frozen proximal copy under ``proximal: window``."""
    module = as_module(policy)
    return TrainingEngine(module, cfg or EngineConfig(), ranks or Ranks(), "evaluate",
                          lambda params: torch.optim.Adam(params, lr=lr, eps=1e-5),
                          keep_shadow=algo.proximal == "window")


@dataclass(frozen=True)
class WholeCopy:
    """What a whole checkpoint of one rank holds, copied at one moment (``copy_whole``)."""

    version: int
    weights: StateSnapshot
    optimizer: StateSnapshot | None
    rng: torch.Tensor
    state: LearnerState
    shadow: StateSnapshot | None
    """The proximal copy (``proximal: window``), else None."""


class LearnerCore:
    """Micro-batched, accumulating PPO/GRPO learner over a ``TrainingEngine``."""

    def __init__(self, policy: Policy, algo: AlgoConfig, local_batch: int, micro_batch: int,
                 lr: float, start: BatchStart | StreamingStart,
                 engine: TrainingEngine | None = None, max_staleness: int | None = None,
                 reduce: Reduce | None = None, grad_share: float | None = None,
                 micro_per_step: int | None = None, reference: Policy | None = None,
                 demos: Demonstrations | None = None):
        """``engine``: the policy under its strategy (default: one rank, the plain module; on
        simulated GPUs, ``rlvla3.gpu.sim.SimulatedEngine`` around it); ``grad_share`` and
        ``micro_per_step``: this rank's place in a group (``take_share``); ``reference``: the
        frozen policy ``algo.ref_kl_coef`` measures the distance from (needed when it is
        above 0); ``demos``: what ``algo.sft_coef``'s loss draws from (needed when it is above
        0)."""
        if algo.ref_kl_coef > 0 and reference is None:
            raise ValueError("algo.ref_kl_coef > 0 needs a reference policy (init_from's weights)")
        if algo.sft_coef > 0 and demos is None:
            raise ValueError("algo.sft_coef > 0 needs demonstrations (algo.sft_datasets)")
        self.reference = reference
        """Evaluated under no_grad only: it never trains."""
        self.demos = demos if algo.sft_coef > 0 else None
        self.engine = engine or rl_engine(policy, algo, lr)
        self.policy = self.engine.policy
        self.algo = algo
        self.local_batch = local_batch
        self.grad_share = float(grad_share or local_batch)
        """What this rank's accumulated gradient is an average over (``global_batch /
        world_size``; DDP then averages over the ranks): ``local_batch`` when every rank takes
        the same share."""
        self.micro_batch = micro_batch
        self.micro_per_step = micro_per_step or math.ceil(local_batch / micro_batch)
        """Micro-batches of every optimizer step, the same on every rank."""
        self.start = start
        self.staleness = StalenessBound(max_staleness)
        """Unstarted items it calls stale are discarded (``max_staleness`` None: none is)."""
        self.reduce = reduce or self.engine.reduce
        self.optimizer = self.engine.optimizer
        self.last_publish: Published | None = None
        """What the last ``weights`` call cost (``rlvla3.engine.engine.Published``)."""
        self.kl_lr = (KlLearningRate(self.optimizer, lr, algo.target_kl, algo.kl_lr_factor,
                                     algo.kl_lr_min_scale, algo.kl_lr_max_scale)
                      if algo.target_kl is not None else None)
        """Adaptive learning rate (``algo.target_kl``); None: fixed."""
        self.normalizer = AdvantageNormalizer(algo.normalize_advantages and algo.name == "ppo",
                                              self.reduce, algo.advantage_ema)
        self.version = 0
        self.buffer = GroupBuffer()
        self._done_in_step = 0
        self._micro_done = 0
        """Micro-batches of the step under way run so far (this epoch)."""
        self._acc: list[dict[str, float]] = []
        self._weights: list[np.ndarray] = []
        self._step_raw: list[Samples] = []
        """The step's new micro-batches as taken (epoch 0): what an abandoned step puts back."""
        self._step_lags: list[np.ndarray] = []
        self._last_micro: Samples | None = None
        """The latest micro-batch trained: ``flush``'s stand-in."""
        self._probe: tuple[Samples, torch.Tensor] | None = None
        """The step's last micro-batch and its log-probs under the parameters it was trained
        with (before the step): where ``algo.target_kl`` measures the update's drift."""
        self.micro_steps = 0
        """Micro-batches run so far (progress, for a rank that waits on data)."""
        self.stop_requested = False
        """Set (from another thread) when this rank is asked to stop: the next step agreement
        tells every rank."""
        self.stop_agreed = False
        """Some rank was asked to stop, as of the last step agreement."""
        self.snapshot_wanted = False
        """Set (from another thread) when a sharded checkpoint is asked of this rank: at the
        first step agreement where every rank wants one, each copies its shard of that
        version (``snapshot``)."""
        self.snapshot: tuple[int, dict[str, torch.Tensor], LearnerState] | None = None
        """``(version, this rank's checkpoint tensors, the core's state)`` of the last agreed
        snapshot."""
        self.busy_s = 0.0
        self.samples_trained = 0
        self.counts = {"received_decisions": 0, "received_episodes": 0, "received_groups": 0,
                       "short_groups": 0, "singleton_groups": 0, "trained_env_steps": 0,
                       "discarded_decisions": 0, "discarded_env_steps": 0, "discarded_groups": 0,
                       "skipped_steps": 0, "abandoned_steps": 0}
        self.proximal = ProximalWindow(self.engine, algo.proximal_window) \
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

    def take_share(self, global_batch: int, world_size: int, rank: int) -> None:
        """This rank's share of each optimizer step in a group of ``world_size`` ranks (after
        a rebuild with fewer ranks: the global batch stays exactly ``global_batch``), in as
        many micro-batches as the largest share needs."""
        shares = rank_batches(global_batch, world_size)
        self.local_batch = shares[rank]
        self.grad_share = global_batch / world_size
        self.micro_per_step = math.ceil(max(shares) / self.micro_batch)

    # -- control from the rank's other threads -----------------------------------------------
    def request_stop(self) -> None:
        """This rank was asked to stop: the next step agreement tells every rank."""
        self.stop_requested = True

    def reset_stop(self) -> None:
        self.stop_requested = self.stop_agreed = False

    def want_snapshot(self) -> None:
        """A sharded checkpoint is asked of this rank (see ``snapshot_wanted``)."""
        self.snapshot = None
        self.snapshot_wanted = True

    def take_snapshot(self) -> None:
        """Copy this rank's checkpoint tensors and the core's state now (between two steps),
        for a save."""
        self.snapshot = (self.version, self.engine.checkpoint_tensors(), self.state())
        self.snapshot_wanted = False

    @property
    def snapshot_ready(self) -> bool:
        return self.snapshot is not None

    def pop_snapshot(self) -> tuple[int, dict[str, torch.Tensor], LearnerState]:
        """The snapshot taken (call once ``snapshot_ready``), handed over once."""
        taken, self.snapshot = self.snapshot, None
        return cast(tuple[int, dict[str, torch.Tensor], LearnerState], taken)

    def copy_whole(self, reuse: tuple[StateSnapshot, StateSnapshot | None] | None = None
                   ) -> WholeCopy:
        """Copies of what a whole checkpoint holds, taken now (between two steps; written
        while training goes on): ``reuse``, an earlier copy's weights and optimizer state
        whose write has finished, lends its buffers (``rlvla3.checkpoint.files.snapshot``)."""
        weights, optimizer, rng = snapshot(self.policy, self.optimizer, reuse)
        shadow = self.engine.shadow
        return WholeCopy(self.version, weights, optimizer, rng, self.state(),
                         None if shadow is None else StateSnapshot(
                             {k: v.detach().clone() for k, v in shadow.state_dict().items()}))

    def restore(self, path: str) -> CheckpointMeta:
        """Resume from the checkpoint at ``path`` (either format, any rank count): weights,
        optimizer state, version, RNG, the core's state and the proximal copy."""
        meta = read_meta(path)
        rng = load_rng_state(path)
        self.load(row_source(path, optimizer=True), meta.version, optimizer=True,
                  state=LearnerState.from_json(meta.learner) if meta.learner else None)
        if rng is not None:
            torch.set_rng_state(rng)
        return meta

    def state(self) -> LearnerState:
        """What the next step depends on beyond weights, optimizer, version and RNG (read
        between two steps; a checkpoint's ``learner`` entry)."""
        return LearnerState(self.normalizer.state(),
                            None if self.proximal is None else self.proximal.synced_at)

    def load(self, source: RowSource, version: int, optimizer: bool,
             state: LearnerState | None = None) -> None:
        """Weights (and the optimizer state, with the version and the core's ``state``:
        a resume) from a checkpoint (``rlvla3.engine.sharded.RowSource``). The proximal copy
        is the checkpoint's where it holds one, else it takes the loaded weights."""
        shadow = self.engine.restore(source, optimizer=optimizer)
        if optimizer:
            self.version = version
            if state is not None:
                self.normalizer.restore(state.normalizer)
        if self.proximal is not None:
            if shadow and state is not None and state.proximal_synced_at is not None:
                self.proximal.synced_at = state.proximal_synced_at
            else:
                self.proximal.sync(self.version)

    @property
    def buffered(self) -> int:
        """Decisions received and not yet taken into a step."""
        return self.buffer.size

    @property
    def in_step(self) -> int:
        """Decisions taken from the buffer for the step under way, its micro-batch running now
        included (0 in a batch's later epochs): not trained until the step is taken."""
        return sum(len(raw) for raw in self._step_raw)

    def pull_budget(self) -> int:
        """Decisions this rank still needs for its current batch (0 in a batch's later epochs:
        their data is at hand)."""
        return 0 if self.epoch else max(0, self.local_batch - self.in_step - self.buffered)

    def add_groups(self, groups: Iterable[Sequence[TrajectorySegment]]) -> None:
        """Turn queue items (an episode, or one whole GRPO group of any size each) into samples
        (advantages computed here, per item) and buffer them."""
        for group in groups:
            group = list(group)
            if not group:
                continue
            for s in group:
                self.length_hist[len(s)] = self.length_hist.get(len(s), 0) + 1
            samples = prepare_samples(group, self.algo)
            self.counts["received_decisions"] += len(samples)
            self.counts["received_episodes"] += len(group)
            self.counts["received_groups"] += 1
            if self.algo.name == "grpo":
                self.counts["short_groups"] += len(group) < self.algo.group_size
                self.counts["singleton_groups"] += len(group) == 1
            self.buffer.add(samples)
        self._discard_stale()

    def _discard_stale(self) -> None:
        """Drop whole unstarted items whose oldest decision is more than ``max_staleness``
        versions behind (counted)."""
        for part in self.buffer.discard_stale(self.staleness, self.version):
            self.counts["discarded_decisions"] += len(part)
            self.counts["discarded_env_steps"] += int(part.env_steps.sum())
            self.counts["discarded_groups"] += 1

    def run_available(self, on_step: Callable[[StepStats], None] | None = None,
                      until_version: int | None = None) -> int:
        """Run every micro-batch the start rule allows now (and, if given, until the version
        reaches ``until_version``); return how many optimizer steps ran. Stops early when the
        ranks abandon a step (another rank flushed)."""
        steps = 0
        while until_version is None or self.version < until_version:
            if self._replay:  # a later epoch: its micro-batches are at hand
                self._micro_step(self._replay.popleft())
            else:
                remaining = self.local_batch - self._done_in_step
                size = self._next_size()
                if not self.normalizer.ready:
                    if self.buffered < self.local_batch:
                        return steps
                    self.normalizer.seed(self.buffer.peek_advantages(self.local_batch))
                if not self.start.may_start(self.buffered, remaining, size):
                    return steps
                raw = self.buffer.take(size)
                self._step_raw.append(raw)
                self._micro_step(self._standardise(raw))
            if self._micro_done == self.micro_per_step:
                stats = self._optimizer_step()
                if stats is None:  # abandoned by the ranks' agreement
                    return steps
                steps += 1
                if on_step is not None:
                    on_step(stats)
        return steps

    def _next_size(self) -> int:
        """Samples of the next micro-batch: ``micro_batch``, but at least one left for each
        micro-batch still to run (so every rank runs ``micro_per_step``, also the one whose
        share is a sample short)."""
        remaining = self.local_batch - self._done_in_step
        left = max(self.micro_per_step - self._micro_done, 1)
        return max(1, min(self.micro_batch, remaining - (left - 1)))

    def loss(self, batch: Samples) -> tuple[torch.Tensor, dict]:
        """The PPO/GRPO objective on one micro-batch (mean over its samples); advantages
        and proximal log-probs taken as given (``with_proximal`` adds those of the window)."""
        ev = self.engine.call("evaluate", batch.obs, torch.from_numpy(batch.actions),
                              torch.from_numpy(batch.latents))
        own = ev.log_prob if ev.log_prob_elements is None else ev.log_prob_elements

        def t(a: np.ndarray) -> torch.Tensor:  # recorded data, on the policy's device
            return torch.from_numpy(np.ascontiguousarray(a)).to(ev.log_prob.device)

        ref = None
        if self.reference is not None and self.algo.ref_kl_coef > 0:
            with torch.no_grad():
                ref = self.reference.evaluate(batch.obs, torch.from_numpy(batch.actions),
                                              torch.from_numpy(batch.latents)).log_prob
        total, stats = objective(self.algo, ev, t(batch.log_probs), t(batch.advantages),
                                 t(batch.returns), t(batch.values), t(batch.prox_log_probs),
                                 None if ref is None else ref.to(ev.log_prob.device))
        sft_loss = math.nan
        if self.demos is not None:  # as many demonstration samples as the micro-batch has
            obs, actions, mask = self.demos.draw(len(batch))
            sft = self.engine.call("sft_loss", obs, torch.from_numpy(actions),
                                   torch.from_numpy(mask))
            total = total + self.algo.sft_coef * sft
            sft_loss = float(sft.detach())
        policy = stats.policy
        return total, {"loss": stats.loss, "policy_loss": stats.policy_loss,
                       "value_loss": stats.value_loss, "entropy": stats.entropy,
                       "clip_fraction": policy.clip_fraction,
                       "kl_per_element": stats.kl_per_element,
                       "kl_per_decision": stats.kl_per_decision,
                       "no_grad_fraction": policy.no_grad_fraction,
                       "behaviour_weight": policy.behaviour_weight_mean,
                       "truncated_fraction": policy.truncated_fraction,
                       "ref_kl": stats.ref_kl,
                       "sft_loss": sft_loss,
                       "weights": policy.behaviour_weights,
                       "own_log_probs": own.detach(),
                       "staleness": float(self.version - batch.policy_versions.mean())}

    def _standardise(self, batch: Samples) -> Samples:
        """A new micro-batch as every epoch trains it: standardised advantages and, with a
        proximal window, the proximal log-probs (kept for the later epochs)."""
        start = time.perf_counter()
        batch = replace(batch, advantages=self.normalizer.apply(batch.advantages))
        batch = self.with_proximal(batch)
        if self.algo.update_epochs > 1:
            self._epoch_batches.append(batch)
        self.busy_s += time.perf_counter() - start
        return batch

    def with_proximal(self, batch: Samples) -> Samples:
        """``batch`` with the proximal copy's log-probs (per Gaussian where the policy reports
        them); as it is without a proximal window."""
        if self.proximal is None:
            return batch
        return replace(batch, prox_log_probs=self.proximal.log_probs(batch))

    def _backward(self, batch: Samples, sync: bool, scale: float) -> dict:
        """Forward and backward of one micro-batch, its loss scaled by ``scale`` (0: a stand-in
        that trains no sample); with ``sync`` the ranks reduce the accumulated gradients (the
        step's last micro-batch)."""
        def scaled() -> tuple[torch.Tensor, dict]:
            loss, info = self.loss(batch)
            return loss * scale, info

        return self.engine.backward(scaled, sync, len(batch) if scale else 0)

    def _micro_step(self, batch: Samples) -> None:
        start = time.perf_counter()
        last = self._micro_done + 1 == self.micro_per_step
        info = self._backward(batch, last, len(batch) / self.grad_share)
        self._weights.append(info.pop("weights"))
        own = info.pop("own_log_probs")
        if last and self.kl_lr is not None:
            self._probe = (batch, own)
        info["n"] = len(batch)
        self._acc.append(info)
        self._done_in_step += len(batch)
        self._micro_done += 1
        self.micro_steps += 1
        self._last_micro = batch
        if self.epoch == 0:  # a later epoch trains no new decision
            self._step_lags.append(self.version - batch.policy_versions)
        self.busy_s += time.perf_counter() - start

    def flush(self) -> bool:
        """Leave a step this rank cannot finish (the run is stopping and no more data comes)
        in step with the other ranks, which may wait for it in a collective: run the
        collectives the step would run (the first step's normaliser seed, one forward and
        backward for each micro-batch this rank has not run, here a stand-in whose loss is
        scaled by 0, the last one reducing the gradients, and the step agreement), which
        abandons the step on every rank: no optimizer step, and the micro-batches taken for it
        go back to the buffer, untrained. Returns False when this rank holds no sample to stand
        in with (it cannot join; the caller's timeout applies)."""
        stand_in = self._last_micro
        if stand_in is None and self.buffered:
            stand_in = self.with_proximal(self.buffer.peek(min(self.micro_batch, self.buffered)))
        if stand_in is None:
            return False
        if not self.normalizer.ready:
            self.normalizer.seed(np.zeros(0))
        for left in range(self.micro_per_step - self._micro_done, 0, -1):
            self._backward(stand_in, sync=left == 1, scale=0.0)
        self._optimizer_step(abandon=True)
        return True

    def _optimizer_step(self, abandon: bool = False) -> StepStats | None:
        """Agree with the other ranks, then step (or abandon the step on every rank)."""
        start = time.perf_counter()
        flags = self.reduce(np.array([float(abandon), float(self.stop_requested),
                                      float(self.snapshot_wanted), 1.0]))  # ..., ranks
        self.stop_agreed = bool(flags[1] > 0)
        snapshot_now = flags[2] >= flags[3]  # every rank wants one
        if flags[0] > 0:
            self._abandon_step()
            return None
        result = self.engine.step()  # clipped; a NaN or inf gradient: no update, counted
        grad_norm, skipped = result.grad_norm, result.skipped
        self.counts["skipped_steps"] += skipped
        self.version += 1
        epoch = self.epoch
        if epoch == 0:
            self.normalizer.end_step()
            self._commit()
        self.epoch = (epoch + 1) % self.algo.update_epochs
        if self.epoch:
            self._replay = deque(self._epoch_batches)
        else:
            self._epoch_batches = []
        if self.proximal is not None:
            self.proximal.after_step(self.version)
        acc, self._acc = self._acc, []
        weights_seen = np.concatenate(self._weights) if self._weights else np.ones(1)
        self._weights = []
        shares = np.asarray([a["n"] for a in acc], dtype=np.float64) / self.local_batch
        avg = {k: float(sum(w * a[k] for w, a in zip(shares, acc, strict=True)))
               for k in _AVERAGED}
        update_kl = None
        if self.kl_lr is not None and not skipped and (
                self.proximal is None or self.proximal.synced_at == self.version):
            total = self.reduce(np.array([self._drift(), 1.0]))  # a trust region closed
            update_kl = float(total[0] / total[1])
            self.kl_lr.update(update_kl)
        self._probe = None
        self._done_in_step = self._micro_done = 0
        self._discard_stale()
        self.busy_s += time.perf_counter() - start
        if snapshot_now:  # every rank at this same version
            self.take_snapshot()
        q05, q50, q95 = np.quantile(weights_seen, (0.05, 0.5, 0.95))
        return StepStats(
            self.version, 0 if epoch else self.local_batch, avg["loss"], avg["policy_loss"],
            avg["value_loss"], avg["entropy"], avg["clip_fraction"], avg["kl_per_element"],
            avg["kl_per_decision"], avg["no_grad_fraction"], float(grad_norm),
            avg["staleness"], avg["behaviour_weight"],
            (float(q05), float(q50), float(q95)),
            avg["truncated_fraction"], skipped, epoch, self.optimizer.param_groups[0]["lr"],
            update_kl, ref_kl=avg["ref_kl"], sft_loss=avg["sft_loss"])

    @torch.no_grad()
    def _drift(self) -> float:
        """``KL(pi_start || pi_theta)`` per decision on the step's last micro-batch, after the
        update: one no-grad forward pass of the updated parameters against the log-probs of
        the trust region's start (the proximal copy's with a window, else those the step was
        computed with). Taken before the update, as the forward pass of the closing step, it
        would miss that step: zero for a region of one step."""
        # set on a step's last micro-batch when the learning rate follows the KL, the only
        # steps that measure the drift
        batch, before = cast(tuple[Samples, torch.Tensor], self._probe)
        if self.proximal is not None:
            before = torch.from_numpy(np.ascontiguousarray(batch.prox_log_probs))
        ev = self.engine.call("evaluate", batch.obs, torch.from_numpy(batch.actions),
                              torch.from_numpy(batch.latents))
        elements = ev.log_prob_elements
        per_element = (before.dim() == 2 and elements is not None
                       and elements.shape[1] == before.shape[1])
        after = elements if per_element else ev.log_prob
        before = before.to(after.device, after.dtype)
        if not per_element and before.dim() == 2:
            before = before.sum(-1)
        count = 1 if elements is None else int(elements.shape[1])
        return approx_kl(after, before, count)[1]

    def _commit(self) -> None:
        """The batch's first step was taken: its decisions count as trained."""
        for raw in self._step_raw:
            self.samples_trained += len(raw)
            self.counts["trained_env_steps"] += int(raw.env_steps.sum())
        lags, counts = np.unique(np.concatenate(self._step_lags), return_counts=True)
        for lag, count in zip(lags.tolist(), counts.tolist(), strict=True):
            self.staleness_hist[lag] = self.staleness_hist.get(lag, 0) + count
        self._step_raw, self._step_lags = [], []

    def _abandon_step(self) -> None:
        """Every rank agreed to drop the step under way (only ever a batch's first epoch: a
        rank never lacks data for a later one): gradients zeroed, its decisions back in the
        buffer, the version unchanged."""
        self.engine.zero_grad()
        self.normalizer.abort_step()
        self.buffer.put_back(self._step_raw)
        self._step_raw, self._step_lags, self._epoch_batches = [], [], []
        self._acc, self._weights = [], []
        self._done_in_step = self._micro_done = 0
        self.counts["abandoned_steps"] += 1

    def weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """Current parameters and buffers, whole, on the host (in ``dtype`` where given), on
        rank 0; None elsewhere. A collective under FSDP (every rank calls it)."""
        weights, self.last_publish = self.engine.gather_weights(dtype)
        return weights
