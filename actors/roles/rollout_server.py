"""RolloutServer actor: the Ray shell of ``rlvla3.rollout.core.RolloutService``.

The service (Ray-free) serves env slots on one or more lanes, each a policy copy with its own
dynamic batcher: ``act(obs)`` for one env slot's request (asynchronous rollout), ``act_batch``
for a whole lockstep group (lockstep and pipelined rollout). This actor builds the lanes, names
the learners it takes weights from, receives weights (object store or a collective channel) and
answers the controller. A server stands for ``rollout.lanes`` GPUs: one on a real cluster; more
only on simulated GPUs, where each lane is its policy copy wrapped by
``rlvla3.gpu.sim.SimulatedRollout`` as ``rollout.cost_model`` says.

Invariant: weights offered by the learner (``update_weights``) are applied only between batches
of a lane, so every action of a batch carries one version. A lane applies offered weights once
they are ``rollout.weights_every`` versions ahead of its own (or forced, or of a newer lineage:
a rollback, which no late offer of the older lineage undoes).

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
from functools import partial

import ray
import torch

from actors.runtime.bootstrap import lookup, was_restarted
from actors.runtime.metrics import RoleMetrics
from actors.runtime.process_memory import ProcessMemory
from rlvla3.config import Named
from rlvla3.gpu.sim import rollout_lanes
from rlvla3.policies import build_policy
from rlvla3.protocols import as_module
from rlvla3.role_stats import RolloutServerStats
from rlvla3.rollout.batching import make_batching_rule
from rlvla3.rollout.core import RolloutCore, RolloutService
from rlvla3.run_config import RolloutConfig
from rlvla3.types import ActionChunk, EnvSpec, Observation, WeightsMessage


def sampling_seed(seed: int, server_id: int, incarnation: str = "") -> int:
    """The action-noise seed of one server incarnation: reproducible for the first incarnation
    of each server (``incarnation`` empty), fresh for every restarted one."""
    digest = hashlib.sha256(f"{seed}/{server_id}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RolloutServer:
    """One rollout server (see the module docstring)."""

    def __init__(self, server_id: int, policy: Named, spec: EnvSpec, cfg: RolloutConfig, seed: int,
                 weights_sources: tuple[str, ...] = (), time_dilation: float = 1.0):
        torch.set_num_threads(cfg.torch_threads)
        self.server_id = server_id
        self.restarted = was_restarted()
        self.incarnation = uuid.uuid4().hex
        incarnation = self.incarnation if self.restarted else ""
        noises = [sampling_seed(seed, server_id,
                                incarnation if lane == 0 else f"{incarnation}/lane{lane}")
                  for lane in range(cfg.lanes)]
        cores = []
        for noise in noises:
            model = build_policy(policy, spec)
            if cfg.num_gpus > 0 and torch.cuda.is_available():
                as_module(model).to("cuda", getattr(torch, cfg.gpu_dtype))
            model.seed_sampling(noise)
            cores.append(RolloutCore(model, cfg.deterministic))
        lanes, self.simulated = rollout_lanes(cores, cfg.cost_model, time_dilation,
                                              [noise + 1 for noise in noises])
        self.metrics = RoleMetrics("rollout", f"rollout-{server_id}")
        self.weights_sources = tuple(weights_sources)
        self.service = RolloutService(
            lanes, partial(make_batching_rule, cfg.batching, time_scale=time_dilation),
            cfg.weights_every, self.metrics, time_dilation,
            catch_up=self._latest_weights if self.restarted and self.weights_sources else None)
        self.memory = ProcessMemory()
        self._started = time.monotonic()

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

    async def act(self, obs: Observation) -> ActionChunk:
        """One env slot's request; batched with whatever else is pending on the next lane."""
        return await self.service.act(obs)

    async def act_batch(self, observations: list[Observation]) -> list[ActionChunk]:
        """A whole lockstep group's requests, split evenly over the lanes."""
        return await self.service.act_batch(observations)

    async def open_weight_channel(self, host: str, port: int, rank: int, world_size: int,
                                  backend: str) -> int:
        """Join learner 0's weight broadcast group; a thread then receives every version and
        offers it (applied between batches, like object-store weights). The group is opened
        once, with the run's first learner (lineage 0): a restarted learner publishes through
        the object store, under its own lineage."""
        import threading

        from rlvla3.weight_sync import WeightBroadcaster

        device = "cuda" if backend == "nccl" else "cpu"
        template = self.service.lanes[0].model.policy.state_dict()
        channel = await asyncio.to_thread(WeightBroadcaster, template, host, port, rank,
                                          world_size, backend, device)

        def receive_forever() -> None:
            while True:
                version, tensors = channel.receive()
                self.service.offer(WeightsMessage(version, tensors))

        threading.Thread(target=receive_forever, daemon=True, name="weights").start()
        return rank

    def update_weights(self, message: WeightsMessage, force: bool = False) -> int:
        """Offer new weights; each lane applies them at its next batch boundary. Returns the
        version held (the oldest lane's)."""
        self.service.offer(message, force)
        return self.service.version()

    async def load_weights_now(self, message: WeightsMessage) -> int:
        """Apply weights at once (between batches: waits for running batches to finish),
        whatever their version: the run's starting weights (``init_from``) are version 0, the
        same number as the weights this server was built with."""
        return await self.service.load_now(message)

    def version(self) -> int:
        return self.service.version()

    async def checksum(self) -> tuple[int, float]:
        """Version and sum of the parameters acting now (first lane, between batches)."""
        from rlvla3.weight_sync import parameter_sum

        return await self.service.between_batches(
            lambda model: (model.version, parameter_sum(as_module(model.policy))))

    def stats(self) -> RolloutServerStats:
        """Counters for the controller's progress line and summary."""
        service = self.service
        elapsed = max(time.monotonic() - self._started, 1e-9)
        sizes = service.batch_sizes()
        batches = sum(sizes.values())
        busy = min(service.busy_s() / (elapsed * len(service.lanes)), 1.0)
        self.metrics.set("busy_fraction", busy)
        simulated = self.simulated
        return RolloutServerStats(
            incarnation=self.incarnation, restarted=self.restarted,
            requests=service.requests, batches=batches, batch_sizes=dict(sizes),
            mean_batch_size=service.requests / batches if batches else 0.0,
            mean_batch_wait_ms=service.mean_batch_wait_ms(), answered=service.answered,
            answer_s=service.answer_s, busy_fraction=busy, busy_s=service.busy_s(),
            version=service.version(), lanes=len(service.lanes),
            weight_swaps=service.weight_swaps(), batch_policy=service.batch_policy(),
            cost=simulated.compute() if simulated is not None else None,
            sync_cost=simulated.weight_sync() if simulated is not None else None,
            memory=self.memory.sample())
