"""RolloutServer actor: dynamic-batched policy inference for env slots.

Two entry points, one per rollout strategy:
- ``act(obs)``: one request per env slot (asynchronous rollout); a ``DynamicBatcher`` fires at
  ``b_max`` pending requests or ``t_max`` after the first one.
- ``act_batch(observations)``: a whole lockstep group in one call (lockstep/pipelined rollout).

Invariant: weights offered by the learner (``update_weights``) are applied only between batches,
under the same lock that serialises batches, so every action of a batch carries one version.

Sampling noise: every server draws action noise from its own stream (``sampling_seed`` of the
run seed, the server id and, after a restart, the new incarnation), so no two servers, and no
restarted server and its predecessor, sample the same noise.

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

import ray
import torch

from actors.memory import ProcessMemory
from actors.metrics import RoleMetrics
from actors.runtime import lookup, was_restarted
from rlvla3.batcher import BatcherConfig, DynamicBatcher
from rlvla3.config import Named
from rlvla3.policies import build_policy
from rlvla3.rollout import RolloutCore
from rlvla3.run_config import RolloutConfig
from rlvla3.types import ActionChunk, EnvSpec, Observation, WeightsMessage


def sampling_seed(seed: int, server_id: int, incarnation: str = "") -> int:
    """The action-noise seed of one server incarnation: reproducible for the first incarnation
    of each server (``incarnation`` empty), fresh for every restarted one."""
    digest = hashlib.sha256(f"{seed}/{server_id}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RolloutServer:
    """Holds one policy copy; serves actions to env slots."""

    def __init__(self, server_id: int, policy: Named, spec: EnvSpec, cfg: RolloutConfig, seed: int,
                 weights_sources: tuple[str, ...] = ()):
        torch.set_num_threads(cfg.torch_threads)
        self.server_id = server_id
        self.cfg = cfg
        self.restarted = was_restarted()
        self.incarnation = uuid.uuid4().hex
        model = build_policy(policy, spec)
        if cfg.num_gpus > 0 and torch.cuda.is_available():
            model.to("cuda")
        self.sampling_seed = sampling_seed(seed, server_id,
                                           self.incarnation if self.restarted else "")
        model.seed_sampling(self.sampling_seed)
        self.core = RolloutCore(model, cfg.deterministic)
        self.metrics = RoleMetrics("rollout", f"rollout-{server_id}")
        self.memory = ProcessMemory()
        self._lock: asyncio.Lock | None = None
        self._batcher: DynamicBatcher | None = None
        self._started = time.monotonic()
        self._requests = 0
        self._lockstep_sizes: dict[int, int] = {}
        self.weights_sources = tuple(weights_sources)
        self._caught_up = not (self.restarted and self.weights_sources)

    def _ensure(self) -> tuple[asyncio.Lock, DynamicBatcher]:
        if self._batcher is None:
            self._lock = asyncio.Lock()
            self._batcher = DynamicBatcher(self._process, BatcherConfig(self.cfg.b_max, self.cfg.t_max_ms),
                                           between_batches=self._swap)
        return self._lock, self._batcher

    async def _swap(self) -> None:
        if not self._caught_up:
            self.core.offer_weights(await self._latest_weights(), force=True)
            self._caught_up = True
        if self.core.swap_pending():
            self.metrics.set("policy_version", self.core.version)

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

    async def _process(self, requests: list[tuple[float, Observation]]) -> list[ActionChunk]:
        lock, _ = self._ensure()
        self.metrics.observe("batch_wait_ms", 1000 * (time.monotonic() - requests[0][0]))
        observations = [obs for _, obs in requests]
        async with lock:
            chunks = await asyncio.to_thread(self.core.act_batch, observations)
        self.metrics.observe("batch_size", len(observations))
        self.metrics.inc("requests", len(observations))
        self._requests += len(observations)
        return chunks

    async def act(self, obs: Observation) -> ActionChunk:
        """One env slot's request; batched with whatever else is pending."""
        _, batcher = self._ensure()
        return await batcher.submit((time.monotonic(), obs))

    async def act_batch(self, observations: list[Observation]) -> list[ActionChunk]:
        """A whole lockstep group's requests as one batch (weights swapped before it)."""
        lock, _ = self._ensure()
        async with lock:
            await self._swap()
            chunks = await asyncio.to_thread(self.core.act_batch, observations)
        n = len(observations)
        self._lockstep_sizes[n] = self._lockstep_sizes.get(n, 0) + 1
        self.metrics.observe("batch_size", n)
        self.metrics.inc("requests", n)
        self._requests += n
        return chunks

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
                self.core.offer_weights(WeightsMessage(version, tensors))

        threading.Thread(target=receive_forever, daemon=True, name="weights").start()
        return rank

    def update_weights(self, message: WeightsMessage, force: bool = False) -> int:
        """Offer new weights; they apply at the next batch boundary. Returns the held version."""
        self.core.offer_weights(message, force)
        return self.core.version

    async def load_weights_now(self, message: WeightsMessage) -> int:
        """Apply weights at once (between batches: waits for a running batch to finish),
        whatever their version: the run's starting weights (``init_from``) are version 0, the
        same number as the weights this server was built with."""
        lock, _ = self._ensure()
        async with lock:
            self.core.offer_weights(message, force=True)
            await self._swap()
        return self.core.version

    def version(self) -> int:
        return self.core.version

    async def checksum(self) -> tuple[int, float]:
        """Version and sum of the parameters acting now (between batches)."""
        from rlvla3.weight_sync import parameter_sum

        lock, _ = self._ensure()
        async with lock:
            return self.core.version, parameter_sum(self.core.policy)

    def stats(self) -> dict:
        """Counters for the controller's progress line and summary."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        sizes = dict(self._lockstep_sizes)
        mean_wait = 0.0
        if self._batcher is not None:
            b = self._batcher.stats()
            for size, count in b.batch_sizes.items():
                sizes[size] = sizes.get(size, 0) + count
            mean_wait = b.mean_wait_s
        batches = sum(sizes.values())
        busy = min(self.core.busy_s / elapsed, 1.0)
        self.metrics.set("busy_fraction", busy)
        return {
            "requests": self._requests,
            "batches": batches,
            "batch_sizes": sizes,
            "mean_batch_size": self._requests / batches if batches else 0.0,
            "mean_batch_wait_ms": 1000 * mean_wait,
            "busy_fraction": busy,
            "busy_s": self.core.busy_s,
            "version": self.core.version,
            "restarted": self.restarted,
            "incarnation": self.incarnation,
            "memory": self.memory.sample(),
        }
