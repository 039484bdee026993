"""RolloutServer actor: dynamic-batched policy inference for env slots.

Two entry points, one per rollout strategy:
- ``act(obs)``: one request per env slot (asynchronous rollout); a ``DynamicBatcher`` fires at
  ``b_max`` pending requests or ``t_max`` after the first one (the batching policy,
  ``rollout.batching``, fixed or adaptive, chooses both).
- ``act_batch(observations)``: a whole lockstep group in one call (lockstep/pipelined rollout).

Lanes: a server stands for ``rollout.lanes`` GPUs (1 on a real cluster). Each lane holds its
own policy copy, batcher and weight version; requests go to the lanes in turn, and a lockstep
group is split evenly over them. With a simulated ``rollout.cost_model`` (``rlvla3.gpu_costs``)
a lane still runs the small policy but a batch of B lasts ``per_call + per_sample x B`` (with
jitter) simulated ms, and applying a new version lasts the weight transfer, each x the run's
``time_dilation``; the server's stats say how much of that was real compute (``cost``).

Invariant: weights offered by the learner (``update_weights``) are applied only between batches
of a lane, under the lane's lock, so every action of a batch carries one version. A lane applies
offered weights once they are ``rollout.weights_every`` versions ahead of its own (or forced).

Sampling noise: every lane draws action noise from its own stream (``sampling_seed`` of the
run seed, the server id, the lane and, after a restart, the new incarnation), so no two lanes,
and no restarted server and its predecessor, sample the same noise.

Fault tolerance: the controller starts servers with unlimited restarts and task retries, so a
request in flight when a server dies is re-sent to the restarted server and answered once (an
env slot applies an action only when its answer arrives: nothing is applied twice). A restarted
server fetches the latest weights from a live learner (``weights_sources``: every rank holds the
same weights, so any rank that still lives will do, e.g. after rank 0 was lost with its node)
before serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import Counter
from functools import partial

import numpy as np
import ray
import torch

from actors.runtime.bootstrap import lookup, was_restarted
from actors.runtime.metrics import RoleMetrics
from actors.runtime.process_memory import ProcessMemory
from rlvla3.batch_policy import make_batch_policy
from rlvla3.batcher import DynamicBatcher
from rlvla3.config import Named
from rlvla3.gpu_costs import ClockStats, CostClock, GpuCosts, jitter_factor, resolve_costs
from rlvla3.policies import build_policy
from rlvla3.rollout import RolloutCore
from rlvla3.run_config import RolloutConfig
from rlvla3.types import ActionChunk, EnvSpec, Observation, WeightsMessage


def sampling_seed(seed: int, server_id: int, incarnation: str = "") -> int:
    """The action-noise seed of one server incarnation: reproducible for the first incarnation
    of each server (``incarnation`` empty), fresh for every restarted one."""
    digest = hashlib.sha256(f"{seed}/{server_id}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Lane:
    """One GPU of a server: a policy copy, its batcher, and (simulated) its cost clock."""

    def __init__(self, core: RolloutCore, seed: int, costs: GpuCosts | None, dilation: float):
        self.core = core
        self.costs = costs
        self.clock = CostClock(dilation) if costs is not None else None
        self.sync_clock = CostClock(dilation) if costs is not None else None
        self.rng = np.random.default_rng(seed)
        self.lock: asyncio.Lock | None = None
        self.batcher: DynamicBatcher | None = None
        self.busy_s = 0.0
        self.lockstep_sizes: Counter[int] = Counter()

    async def compute(self, observations: list[Observation]) -> list[ActionChunk]:
        """One batch: the real forward, then (simulated) the rest of the GPU's cost."""
        start = time.perf_counter()
        chunks = await asyncio.to_thread(self.core.act_batch, observations)
        if self.clock is not None:
            cost = (self.costs.inference_ms(len(observations))
                    * jitter_factor(self.rng, self.costs.infer_jitter))
            await self.clock.pay_async(cost, start)
        self.busy_s += time.perf_counter() - start
        return chunks


class RolloutServer:
    """Holds one policy copy per lane; serves actions to env slots."""

    def __init__(self, server_id: int, policy: Named, spec: EnvSpec, cfg: RolloutConfig, seed: int,
                 weights_sources: tuple[str, ...] = (), time_dilation: float = 1.0):
        torch.set_num_threads(cfg.torch_threads)
        self.server_id = server_id
        self.cfg = cfg
        self.time_dilation = time_dilation
        self.restarted = was_restarted()
        self.incarnation = uuid.uuid4().hex
        self.costs = resolve_costs(cfg.cost_model, "rollout.cost_model")
        self.lanes: list[Lane] = []
        for lane in range(cfg.lanes):
            model = build_policy(policy, spec)
            if cfg.num_gpus > 0 and torch.cuda.is_available():
                model.to("cuda", getattr(torch, cfg.gpu_dtype))
            incarnation = self.incarnation if self.restarted else ""
            noise = sampling_seed(seed, server_id,
                                  incarnation if lane == 0 else f"{incarnation}/lane{lane}")
            model.seed_sampling(noise)
            self.lanes.append(Lane(RolloutCore(model, cfg.deterministic), noise + 1, self.costs,
                                   time_dilation))
        self.metrics = RoleMetrics("rollout", f"rollout-{server_id}")
        self.memory = ProcessMemory()
        self._started = time.monotonic()
        self._requests = 0
        self._answered, self._answer_s = 0, 0.0  # env-slot requests, their time in this actor
        self._next_lane = 0
        self.weights_sources = tuple(weights_sources)
        self._caught_up = not (self.restarted and self.weights_sources)
        self._catching_up: asyncio.Lock | None = None

    @property
    def core(self) -> RolloutCore:
        """The first lane's policy copy (the only one on a real cluster)."""
        return self.lanes[0].core

    def _ensure(self, lane: Lane) -> Lane:
        if lane.batcher is None:
            lane.lock = asyncio.Lock()
            policy = make_batch_policy(self.cfg.batching, self.cfg.b_max, self.cfg.t_max_ms,
                                       self.time_dilation)
            lane.batcher = DynamicBatcher(partial(self._process, lane), policy,
                                          between_batches=partial(self._swap, lane))
        return lane

    async def _swap(self, lane: Lane) -> None:
        if not self._caught_up:
            if self._catching_up is None:
                self._catching_up = asyncio.Lock()
            async with self._catching_up:
                if not self._caught_up:
                    message = await self._latest_weights()
                    for other in self.lanes:
                        other.core.offer_weights(message, force=True)
                    self._caught_up = True
        start = time.perf_counter()
        if lane.core.swap_pending(self.cfg.weights_every):
            if lane.sync_clock is not None:  # the weight transfer onto this lane's GPU
                await lane.sync_clock.pay_async(self.costs.sync_ms, start)
            self.metrics.set("policy_version", lane.core.version)

    async def _latest_weights(self) -> WeightsMessage:
        """The weights of the first learner rank that answers."""
        error: Exception | None = None
        for name in self.weights_sources:
            try:
                return await lookup(name).weights_message.remote()
            except (ValueError, ray.exceptions.RayActorError) as exc:  # gone: try the next rank
                error = exc
        raise RuntimeError(f"rollout server {self.server_id}: no learner answered for weights "
                           f"({', '.join(self.weights_sources)})") from error

    async def _process(self, lane: Lane, requests: list[tuple[float, Observation]]
                       ) -> list[ActionChunk]:
        self.metrics.observe("batch_wait_ms", 1000 * (time.monotonic() - requests[0][0])
                             / self.time_dilation)
        observations = [obs for _, obs in requests]
        async with lane.lock:
            chunks = await lane.compute(observations)
        self.metrics.observe("batch_size", len(observations))
        self.metrics.inc("requests", len(observations))
        self._requests += len(observations)
        return chunks

    async def act(self, obs: Observation) -> ActionChunk:
        """One env slot's request; batched with whatever else is pending on the next lane."""
        lane = self._ensure(self.lanes[self._next_lane])
        self._next_lane = (self._next_lane + 1) % len(self.lanes)
        start = time.monotonic()
        try:
            return await lane.batcher.submit((start, obs))
        finally:
            self._answered += 1
            self._answer_s += time.monotonic() - start

    async def act_batch(self, observations: list[Observation]) -> list[ActionChunk]:
        """A whole lockstep group's requests, split evenly over the lanes (each swaps weights
        before its part)."""
        parts = np.array_split(np.arange(len(observations)), len(self.lanes))

        async def run(lane: Lane, index: np.ndarray) -> list[ActionChunk]:
            if not len(index):
                return []
            self._ensure(lane)
            async with lane.lock:
                await self._swap(lane)
                chunks = await lane.compute([observations[i] for i in index])
            lane.lockstep_sizes[len(index)] += 1
            self.metrics.observe("batch_size", len(index))
            return chunks

        results = await asyncio.gather(*(run(lane, idx) for lane, idx in
                                         zip(self.lanes, parts, strict=True)))
        n = len(observations)
        self.metrics.inc("requests", n)
        self._requests += n
        return [chunk for part in results for chunk in part]

    def _offer(self, message: WeightsMessage, force: bool = False) -> None:
        for lane in self.lanes:
            lane.core.offer_weights(message, force)

    async def open_weight_channel(self, host: str, port: int, rank: int, world_size: int,
                                  backend: str) -> int:
        """Join learner 0's weight broadcast group; a thread then receives every version and
        offers it (applied between batches, like object-store weights)."""
        import threading

        from rlvla3.weight_sync import WeightBroadcaster

        device = "cuda" if backend == "nccl" else "cpu"
        channel = await asyncio.to_thread(WeightBroadcaster, self.core.policy.state_dict(), host,
                                          port, rank, world_size, backend, device)

        def receive_forever() -> None:
            while True:
                version, tensors = channel.receive()
                self._offer(WeightsMessage(version, tensors))

        threading.Thread(target=receive_forever, daemon=True, name="weights").start()
        return rank

    def update_weights(self, message: WeightsMessage, force: bool = False) -> int:
        """Offer new weights; each lane applies them at its next batch boundary. Returns the
        version held (the oldest lane's)."""
        self._offer(message, force)
        return self.version()

    async def load_weights_now(self, message: WeightsMessage) -> int:
        """Apply weights at once (between batches: waits for running batches to finish),
        whatever their version: the run's starting weights (``init_from``) are version 0, the
        same number as the weights this server was built with."""
        for lane in self.lanes:
            self._ensure(lane)
            async with lane.lock:
                lane.core.offer_weights(message, force=True)
                await self._swap(lane)
        return self.version()

    def version(self) -> int:
        return min(lane.core.version for lane in self.lanes)

    async def checksum(self) -> tuple[int, float]:
        """Version and sum of the parameters acting now (first lane, between batches)."""
        from rlvla3.weight_sync import parameter_sum

        lane = self._ensure(self.lanes[0])
        async with lane.lock:
            return lane.core.version, parameter_sum(lane.core.policy)

    def stats(self) -> dict:
        """Counters for the controller's progress line and summary."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        sizes: Counter[int] = Counter()
        waits, batched, cost, sync = 0.0, 0, ClockStats(), ClockStats()
        for lane in self.lanes:
            sizes.update(lane.lockstep_sizes)
            if lane.batcher is not None:
                b = lane.batcher.stats()
                sizes.update(b.batch_sizes)
                waits += b.mean_wait_s * b.batches
                batched += b.batches
            for total, clock in ((cost, lane.clock), (sync, lane.sync_clock)):
                if clock is not None:
                    for k, v in vars(clock.stats).items():
                        setattr(total, k, getattr(total, k) + v)
        batches = sum(sizes.values())
        busy = min(sum(lane.busy_s for lane in self.lanes) / (elapsed * len(self.lanes)), 1.0)
        self.metrics.set("busy_fraction", busy)
        first = self.lanes[0].batcher
        return {
            "requests": self._requests,
            "batches": batches,
            "batch_sizes": dict(sizes),
            "mean_batch_size": self._requests / batches if batches else 0.0,
            "mean_batch_wait_ms": 1000 * waits / batched / self.time_dilation if batched else 0.0,
            "answered": self._answered,
            "answer_s": self._answer_s,
            "busy_fraction": busy,
            "busy_s": sum(lane.busy_s for lane in self.lanes),
            "version": self.version(),
            "lanes": len(self.lanes),
            "weight_swaps": sum(lane.core.swaps for lane in self.lanes),
            "batch_policy": first.policy.state() if first is not None else {},
            **({"cost": cost.as_dict(), "sync_cost": sync.as_dict()}
               if self.costs is not None else {}),
            "restarted": self.restarted,
            "incarnation": self.incarnation,
            "memory": self.memory.sample(),
        }
