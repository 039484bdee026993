"""The rollout cores: batched policy inference that tags every action with its weight version,
and the serving core a rollout server runs on.

Inputs: lists of ``Observation``s (one per requesting env slot, or a whole lockstep group) and
published weights. Outputs: one ``ActionChunk`` per observation.

``RolloutCore`` is one policy copy used for acting. ``RolloutService`` is what a rollout server
does, without Ray (``actors.roles.rollout_server`` names and restarts it): it serves requests
on one or more lanes, each a policy copy (``Acting``: a ``RolloutCore``, or one on a simulated
GPU, ``rlvla3.gpu.sim``) with its own ``DynamicBatcher`` (``rlvla3.rollout.batcher``; the batching
policy, fixed or adaptive, chooses ``b_max`` and ``t_max``), its own lock and its own thread.
Single requests (``act``, asynchronous rollout) go to the lanes in turn; a lockstep group
(``act_batch``) is split evenly over them.

Invariants:
- Weights change only in ``swap_pending``, called between batches of a lane (the batcher's
  ``between_batches``, or under the lane's lock before a lockstep part); a batch is always
  computed by one version, and each chunk carries that version. A lane applies offered weights
  once they are ``weights_every`` versions ahead of its own, or forced, or of a newer lineage
  (``WeightsMessage.lineage``: a rollback); weights of an older lineage than the lane holds or
  was offered are ignored, forced or not, so a late offer from before a rollback never undoes
  it.
- A lane's batches and weight swaps run one at a time in the lane's own thread, so the event
  loop keeps taking requests (and their timestamps stay true) while a lane computes.
- A service given ``catch_up`` (a restarted server) loads the weights it returns, on every
  lane, before its first batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol, TypeVar

import numpy as np
import torch

from rlvla3.episode.recorder import EpisodeRecorder
from rlvla3.episode.tasks import TaskSampler
from rlvla3.protocols import Env, Metrics, Policy
from rlvla3.rollout.batcher import DynamicBatcher
from rlvla3.rollout.batching import BatchingRule
from rlvla3.types import ActionChunk, ObsBatch, Observation, TrajectorySegment, WeightsMessage

T = TypeVar("T")


class RolloutCore:
    """A policy copy used only for acting."""

    def __init__(self, policy: Policy, deterministic: bool = False):
        self.policy = policy
        self.deterministic = deterministic
        self.version = 0
        self.lineage = 0
        """The lineage of the weights held (``WeightsMessage.lineage``)."""
        self._pending: WeightsMessage | None = None
        self._forced = False
        self._offers = threading.Lock()
        """Offers arrive from other threads (the actor's loop, a weight channel) than the one
        that swaps (a lane's): an offer is never lost between a swap's read and its reset."""
        self.swaps = 0

    def offer_weights(self, message: WeightsMessage, force: bool = False) -> None:
        """Keep ``message`` to be applied at the next batch boundary (the newest lineage, then
        the newest version, wins). ``force`` accepts an older version of the lineage too;
        a newer lineage is a rollback and applies whatever its version; an older one is
        ignored."""
        with self._offers:
            held = (self.lineage, self.version)
            pending = self._pending
            newest = max(held, (pending.lineage, pending.version)) if pending else held
            if message.lineage < newest[0]:
                return  # from before a rollback
            if force or (message.lineage, message.version) > newest:
                self._pending = message
                self._forced = force

    def swap_pending(self, min_lead: int = 1) -> bool:
        """Apply offered weights if they are at least ``min_lead`` versions ahead, forced or of
        a newer lineage; call only between batches."""
        with self._offers:
            pending = self._pending
            if pending is None or (not self._forced and pending.lineage == self.lineage
                                   and pending.version - self.version < min_lead):
                return False
            self._pending, self._forced = None, False
        self.load(pending.tensors, pending.version, pending.lineage)
        return True

    def load(self, tensors: Mapping[str, np.ndarray | torch.Tensor], version: int,
             lineage: int = 0) -> None:
        self.policy.load_state_dict({k: v if isinstance(v, torch.Tensor) else
                                     torch.tensor(np.asarray(v)) for k, v in tensors.items()})
        self.version = version
        self.lineage = lineage
        self.swaps += 1

    def act_batch(self, observations: Sequence[Observation]) -> list[ActionChunk]:
        """One forward pass for all ``observations``, by the current version."""
        out = self.policy.act(ObsBatch.stack(observations), deterministic=self.deterministic)
        n = len(observations)
        chunks = [
            ActionChunk(out.actions[i], float(out.log_prob[i]), float(out.value[i]),
                        out.latents[i], self.version, n)
            for i in range(n)
        ]
        return chunks


class Acting(Protocol):
    """What a lane of a rollout server computes with: a ``RolloutCore``, or a wrapper of one
    (``rlvla3.gpu.sim.SimulatedRollout``)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def version(self) -> int: ...

    @property
    def swaps(self) -> int: ...

    def offer_weights(self, message: WeightsMessage, force: bool = False) -> None: ...

    def swap_pending(self, min_lead: int = 1) -> bool: ...

    def act_batch(self, observations: Sequence[Observation]) -> list[ActionChunk]: ...


class Lane:
    """One policy copy of a rollout server, with its batcher, lock and thread."""

    def __init__(self, model: Acting):
        self.model = model
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lane")
        self.lock: asyncio.Lock | None = None
        self.batcher: DynamicBatcher | None = None
        self.busy_s = 0.0
        """Seconds spent computing batches."""
        self.lockstep_sizes: Counter[int] = Counter()
        """Lockstep parts computed, by size."""

    async def compute(self, observations: list[Observation]) -> list[ActionChunk]:
        """One batch, in the lane's thread."""
        start = time.perf_counter()
        chunks = await asyncio.get_running_loop().run_in_executor(
            self.thread, self.model.act_batch, observations)
        self.busy_s += time.perf_counter() - start
        return chunks

    async def swap(self, min_lead: int) -> bool:
        """Apply offered weights (``Acting.swap_pending``), in the lane's thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self.thread, self.model.swap_pending, min_lead)


class RolloutService:
    """Serves env slots' requests on lanes (see the module docstring).

    ``batching`` makes a lane's batching policy; ``dilation`` (the run's ``time_dilation``)
    turns the batch waits it reports into simulated milliseconds."""

    def __init__(self, models: Sequence[Acting], batching: Callable[[], BatchingRule],
                 weights_every: int, metrics: Metrics, dilation: float = 1.0,
                 catch_up: Callable[[], Awaitable[WeightsMessage]] | None = None):
        self.lanes = [Lane(model) for model in models]
        self.batching = batching
        self.weights_every = weights_every
        self.metrics = metrics
        self.dilation = dilation
        self._catch_up = catch_up
        self._catching_up: asyncio.Lock | None = None
        self.requests = 0
        """Observations served (single requests and lockstep groups)."""
        self.answered = 0
        """Single requests answered."""
        self.answer_s = 0.0
        """Their time in this service, summed."""
        self._next_lane = 0

    def _ensure(self, lane: Lane) -> tuple[asyncio.Lock, DynamicBatcher]:
        """The lane's lock and batcher, made on its first use (in the serving event loop)."""
        if lane.lock is None or lane.batcher is None:
            lane.lock = asyncio.Lock()
            lane.batcher = DynamicBatcher(partial(self._process, lane), self.batching(),
                                          between_batches=partial(self._swap, lane))
        return lane.lock, lane.batcher

    async def _swap(self, lane: Lane) -> None:
        if self._catch_up is not None:
            if self._catching_up is None:
                self._catching_up = asyncio.Lock()
            async with self._catching_up:
                if self._catch_up is not None:
                    self.offer(await self._catch_up(), force=True)
                    self._catch_up = None
        if await lane.swap(self.weights_every):
            self.metrics.set("policy_version", lane.model.version)

    async def _process(self, lane: Lane, requests: list[tuple[float, Observation]]
                       ) -> list[ActionChunk]:
        self.metrics.observe("batch_wait_ms", 1000 * (time.monotonic() - requests[0][0])
                             / self.dilation)
        observations = [obs for _, obs in requests]
        lock, _ = self._ensure(lane)
        async with lock:
            chunks = await lane.compute(observations)
        self.metrics.observe("batch_size", len(observations))
        self.metrics.inc("requests", len(observations))
        self.requests += len(observations)
        return chunks

    async def act(self, obs: Observation) -> ActionChunk:
        """One env slot's request; batched with whatever else is pending on the next lane."""
        _, batcher = self._ensure(self.lanes[self._next_lane])
        self._next_lane = (self._next_lane + 1) % len(self.lanes)
        start = time.monotonic()
        try:
            return await batcher.submit((start, obs))
        finally:
            self.answered += 1
            self.answer_s += time.monotonic() - start

    async def act_batch(self, observations: list[Observation]) -> list[ActionChunk]:
        """A whole lockstep group's requests, split evenly over the lanes (each swaps weights
        before its part)."""
        parts = np.array_split(np.arange(len(observations)), len(self.lanes))

        async def run(lane: Lane, index: np.ndarray) -> list[ActionChunk]:
            if not len(index):
                return []
            lock, _ = self._ensure(lane)
            async with lock:
                await self._swap(lane)
                chunks = await lane.compute([observations[i] for i in index])
            lane.lockstep_sizes[len(index)] += 1
            self.metrics.observe("batch_size", len(index))
            return chunks

        results = await asyncio.gather(*(run(lane, idx) for lane, idx in
                                         zip(self.lanes, parts, strict=True)))
        n = len(observations)
        self.metrics.inc("requests", n)
        self.requests += n
        return [chunk for part in results for chunk in part]

    def offer(self, message: WeightsMessage, force: bool = False) -> None:
        """Offer weights to every lane (applied at its next batch boundary)."""
        for lane in self.lanes:
            lane.model.offer_weights(message, force)

    async def load_now(self, message: WeightsMessage) -> int:
        """Apply weights on every lane at once (between batches: waits for running batches),
        whatever their version. Returns the version held."""
        for lane in self.lanes:
            lock, _ = self._ensure(lane)
            async with lock:
                lane.model.offer_weights(message, force=True)
                await self._swap(lane)
        return self.version()

    def version(self) -> int:
        """The version held (the oldest lane's)."""
        return min(lane.model.version for lane in self.lanes)

    async def between_batches(self, fn: Callable[[Acting], T]) -> T:
        """``fn`` of the first lane's model, between two of its batches."""
        lock, _ = self._ensure(self.lanes[0])
        async with lock:
            return fn(self.lanes[0].model)

    def batch_sizes(self) -> Counter[int]:
        """Batches computed, by size, over every lane (batched and lockstep)."""
        sizes: Counter[int] = Counter()
        for lane in self.lanes:
            sizes.update(lane.lockstep_sizes)
            if lane.batcher is not None:
                sizes.update(lane.batcher.stats().batch_sizes)
        return sizes

    def mean_batch_wait_ms(self) -> float:
        """Mean simulated ms from a batch's first request to its firing (batched lanes)."""
        waits, batched = 0.0, 0
        for lane in self.lanes:
            if lane.batcher is not None:
                b = lane.batcher.stats()
                waits += b.mean_wait_s * b.batches
                batched += b.batches
        return 1000 * waits / batched / self.dilation if batched else 0.0

    def busy_s(self) -> float:
        return sum(lane.busy_s for lane in self.lanes)

    def weight_swaps(self) -> int:
        return sum(lane.model.swaps for lane in self.lanes)

    def batch_policy(self) -> dict[str, float]:
        """The first lane's batching rule's figures (empty before its first request)."""
        first = self.lanes[0].batcher
        return first.rule.state() if first is not None else {}


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
