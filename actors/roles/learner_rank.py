"""Learner actor: one rank of the learner group (torch.distributed + DDP) around ``rlvla3.learner``.

One module over 400 lines because the two driving loops, weight publication, checkpointing and
DDP evaluation share one rank's state.

Rank 0 publishes weights after every optimizer step: a ``WeightsMessage`` put once into the
object store and offered to every rollout server (they swap between batches), and the new
version told to the queue (its staleness filter); after a restore from an older checkpoint the
queue follows the version backwards. Every rank tells the queue how many decisions it holds
untrained (the backlog that paces the env slots). On GPU clusters the same message carries no
tensors and the weights travel by a collective broadcast instead (``broadcast_weights``).

Two ways to drive it, chosen by the training strategy:
- ``run()``: pull from the queue and train until ``stop()`` (asynchronous training). Each pull
  asks for the decisions this rank still needs for its batch (a decision budget), so no rank
  hoards what another waits for. The pull is sent before the rank trains what it holds and
  collected after (prefetch): fetching the next decisions (the queue call, the observations'
  transfer) overlaps the micro-batches under way instead of following them; only a rank out of
  data waits (its data wait). Several ranks leave together, after the optimizer step at
  which they agreed to (the step agreement of ``LearnerCore``), so none is left waiting in a
  collective; a rank asked to stop that gets no data for ``FLUSH_AFTER_S`` abandons the step
  under way on every rank (``LearnerCore.flush``) instead of leaving the others in its
  all-reduce.
- ``train_available()``: drain what the queue holds now, train every full batch, return
  (synchronous training: rollout, then train, then sync weights).
The learner strategy (batch or streaming) decides when a micro-batch may start.

Restarts: a rank that Ray restarted (its process or node died) restores the last checkpoint
(weights, optimizer state, policy version, RNG), or the ``init_from`` weights when no checkpoint
exists yet. A lone learner then trains on by itself (its ``run`` call is retried); ranks of a
group wait for ``init_group`` with the group's new size and their new rank, since a process
group cannot take a new member (``actors.roles.learner_group`` rebuilds it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import numpy as np
import ray
import torch
import torch.distributed as dist

from actors.runtime.bootstrap import lookup, was_restarted
from actors.runtime.metrics import RoleMetrics
from actors.runtime.process_memory import ProcessMemory
from rlvla3.algos import AlgoConfig
from rlvla3.checkpoint import (
    CheckpointMeta,
    SavedCheckpoint,
    listed_files,
    load_optimizer_state,
    load_rng_state,
    locate_checkpoint,
    save_run_checkpoint,
    snapshot,
)
from rlvla3.config import Named
from rlvla3.gpu_costs import TrainingCost
from rlvla3.learner import LEARNER_STRATEGIES, LearnerCore, StepStats, rank_batches
from rlvla3.policies import build_policy
from rlvla3.protocols import Evaluation
from rlvla3.run_config import LearnerConfig
from rlvla3.storage import basename
from rlvla3.types import EnvSpec, WeightsMessage

FLUSH_AFTER_S = 2.0
"""A rank asked to stop that made no progress for this long abandons the step under way."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Learner:
    """One learner rank."""

    def __init__(self, rank: int, world_size: int, policy: Named, spec: EnvSpec,
                 algo: AlgoConfig, cfg: LearnerConfig, strategy: str, seed: int,
                 servers: list[str], queue: str, run_dir: str = "",
                 max_staleness: int | None = None, init_from: str = "",
                 cost: TrainingCost | None = None):
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.rank = rank
        self.world_size = world_size
        self.policy_choice = policy
        self.spec = spec
        self.cfg = cfg
        self.policy = build_policy(policy, spec)
        if cfg.num_gpus > 0 and torch.cuda.is_available():
            self.policy.to("cuda")
        self.core = LearnerCore(self.policy, algo, rank_batches(cfg.global_batch, world_size)[rank],
                                cfg.micro_batch, cfg.lr, LEARNER_STRATEGIES[strategy](),
                                max_staleness=max_staleness, reduce=self._all_reduce, cost=cost,
                                grad_share=cfg.global_batch / world_size)
        self.metrics = RoleMetrics("learner", f"learner-{rank}")
        self.memory = ProcessMemory()
        self.servers = [lookup(name) for name in servers]
        self.queue = lookup(queue)
        self.incarnation = uuid.uuid4().hex
        self._channel = None
        self._stop = threading.Event()
        self._stepping = threading.RLock()
        """Held through every optimizer step and weight load: what reads the weights from
        another call (a checkpoint, a restarted server's pull) sees one whole version."""
        self._saving = threading.Lock()
        self._snapshot = None  # the last checkpoint's copy, reused as the next one's buffers
        self._started = time.monotonic()
        self.wait_s = 0.0
        self.lost_segments = 0
        self.lost_decisions = 0
        self._reported_buffered = -1
        self.last: StepStats | None = None
        self.history: list[dict] = []
        self.run_dir = run_dir
        self.restored_from = ""
        if run_dir and was_restarted():
            # Ray restarted this actor after a crash: continue from the last checkpoint.
            try:
                self.restored_from = basename(locate_checkpoint(run_dir))
            except FileNotFoundError:
                self.restored_from = "initial weights (no checkpoint yet)"
                if init_from:
                    self.load_weights(init_from)
                    self.restored_from = f"init_from weights (no checkpoint yet): {init_from}"
            else:
                self.restore(run_dir)
            self._report_buffered()
            if rank == 0:
                self._broadcast_to_servers(force=True)

    # ---- setup -------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def init_group(self, master_addr: str, master_port: int, rank: int | None = None,
                   world_size: int | None = None) -> bool:
        """Join the process group and wrap the policy in DDP (only when world_size > 1).
        ``rank``/``world_size``: this rank's place in a rebuilt group (a fresh process: every
        rank of a rebuilt group was restarted); each rank then takes ``global_batch /
        world_size`` samples per optimizer step."""
        if rank is not None and world_size is not None:
            if rank != self.rank:
                self.queue.learner_buffered.remote(self.rank, 0)  # the old rank's report
            self.rank, self.world_size = rank, world_size
            self.core.take_share(self.cfg.global_batch, world_size, rank)
            self._reported_buffered = -1
            self._report_buffered()
            if rank == 0:  # the servers and the queue follow the restored version
                self._broadcast_to_servers(force=True)
        if self.world_size == 1:
            return True
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and self.cfg.num_gpus > 0 else "gloo"
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        ddp = torch.nn.parallel.DistributedDataParallel(
            _EvaluateModule(self.policy), find_unused_parameters=True)
        self.core.model = _DDPEvaluate(ddp)
        return True

    def _all_reduce(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 vector over the learner ranks."""
        if self.world_size == 1:
            return values
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.as_tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return tensor.cpu().numpy()

    def _report_buffered(self) -> None:
        if self.core.buffered != self._reported_buffered:
            self._reported_buffered = self.core.buffered
            self.queue.learner_buffered.remote(self.rank, self.core.buffered)

    def load_weights(self, path: str) -> int:
        """Initialise from another run's weights (e.g. SFT); optimizer and version stay fresh."""
        from rlvla3.checkpoint import load_policy

        policy, meta = load_policy(path)
        if meta.policy.name != self.policy_choice.name:
            raise ValueError(f"init_from {path}: checkpoint holds a {meta.policy.name!r} policy, "
                             f"this run builds {self.policy_choice.name!r}")
        with self._stepping:
            self.policy.load_state_dict(policy.state_dict())
            if self.core.proximal is not None:
                self.core.proximal.sync(self.core.version)
            return self.core.version

    def restore(self, path: str) -> int:
        """Load weights, optimizer state and version from a checkpoint; returns the version."""
        from rlvla3.checkpoint import load_policy

        policy, meta = load_policy(path)
        state = load_optimizer_state(path)
        rng = load_rng_state(path)
        with self._stepping:
            self.policy.load_state_dict(policy.state_dict())
            if state is not None:
                self.core.optimizer.load_state_dict(state)
            if rng is not None:
                torch.set_rng_state(rng)
            self.core.version = meta.version
            if self.core.proximal is not None:
                self.core.proximal.sync(meta.version)
        return meta.version

    # ---- training ----------------------------------------------------------------------
    def _publish(self, stats: StepStats) -> None:
        self.last = stats
        self.metrics.inc("optimizer_steps")
        self.metrics.inc("samples_trained", stats.samples)
        self.metrics.set("loss", stats.loss)
        self.metrics.set("policy_version", stats.version)
        self.history.append(stats.as_row())
        self._report_buffered()
        if self.rank == 0:
            self._broadcast_to_servers()

    def _broadcast_to_servers(self, force: bool = False) -> None:
        """Send the current weights to every rollout server: over the collective channel if
        one is open, else one object-store copy that every server pulls."""
        if self._channel is not None:
            self._channel.send(self.policy.state_dict(), self.core.version)
        else:
            ref = ray.put(self.weights_message())
            for server in self.servers:
                server.update_weights.remote(ref, force)
        self.queue.set_version.remote(self.core.version, force)

    def open_weight_channel(self, host: str, port: int, world_size: int, backend: str) -> str:
        """Join the weight broadcast group as its sender (rank 0)."""
        from rlvla3.weight_sync import WeightBroadcaster

        device = "cuda" if backend == "nccl" else "cpu"
        self._channel = WeightBroadcaster(self.policy.state_dict(), host, port, 0, world_size,
                                          backend, device)
        return backend

    def weights_message(self) -> WeightsMessage:
        with self._stepping:
            return WeightsMessage(self.core.version, self.core.weights())

    def _pull(self, max_items: int, timeout_s: float, max_decisions: int | None = None) -> int:
        """Take up to ``max_items`` queue items (fewer once they hold ``max_decisions``)."""
        return self._receive(self.queue.get.remote(max_items, timeout_s, max_decisions))

    def _receive(self, request: ray.ObjectRef) -> int:
        """Wait for a queue ``get`` already sent, fetch its payloads and buffer them; the time
        spent waiting here is the rank's data wait."""
        start = time.monotonic()
        items = ray.get(request)
        groups = []
        for item in items:  # one episode, or one whole GRPO group: its boundaries are kept
            group = []
            for info, refs in item:
                try:
                    group.append(ray.get(refs[0]))
                except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
                    # its payload died with its producer or node: counted, not fatal
                    self.lost_segments += 1
                    self.lost_decisions += info.decisions
            groups.append(group)
        self.wait_s += time.monotonic() - start
        self.core.add_groups(groups)
        self._report_buffered()
        return len(items)

    def run(self) -> dict:
        """Asynchronous training: pull and train until ``stop()``.

        One rank stops at once (a partial accumulation stays untrained, ``in_step``). Several
        ranks stop only together, at the step agreement before an optimizer step: a rank that
        stopped on its own could leave another waiting in that step's all-reduce forever, and
        any version picked from outside can be overtaken by a step already under way. A rank
        asked to stop that gets no data for ``FLUSH_AFTER_S`` (the rollout has stopped) flushes:
        the step under way is abandoned on every rank and its decisions go back to the buffers.
        """
        self._stop.clear()
        core = self.core
        core.stop_requested = core.stop_agreed = False
        progress = time.monotonic()
        request = None  # a queue get in flight while this rank trains (prefetch)
        while not (core.stop_agreed if self.world_size > 1 else self._stop.is_set()):
            budget = core.pull_budget()
            if budget and request is None:
                request = self.queue.get.remote(64, 0.2, budget)
            # one step per call, so that the agreement before it is seen before the next
            with self._stepping:
                before = core.micro_steps
                core.run_available(self._publish, until_version=core.version + 1)
            trained = core.micro_steps != before
            if request is not None and (not trained or ray.wait([request], timeout=0)[0]):
                self._receive(request)  # out of data (wait for it), or it has arrived
                request = None
            if trained:
                progress = time.monotonic()
            elif (self._stop.is_set() and self.world_size > 1 and not core.stop_agreed
                  and time.monotonic() - progress > FLUSH_AFTER_S):
                with self._stepping:
                    if not core.flush():
                        raise RuntimeError(f"learner {self.rank}: asked to stop partway through "
                                           f"a step with no sample to join the other ranks")
                self._report_buffered()
        if request is not None:  # items taken from the queue are buffered, never dropped
            try:
                self._receive(request)
            except ray.exceptions.RayActorError:  # the queue is gone: the run is ending
                pass
        return self.stats()

    def train_available(self) -> dict:
        """Synchronous training (one rank): take everything queued now, train every full batch."""
        while self._pull(max_items=1024, timeout_s=0.05):
            pass
        with self._stepping:
            self.core.run_available(self._publish)
        return self.stats()

    def train_steps(self, steps: int, timeout_s: float = 120.0) -> dict:
        """Synchronous training (any rank count): exactly ``steps`` batches (each
        ``algo.update_epochs`` optimizer steps), pulling only the samples this rank needs, so
        every rank takes the same number of steps."""
        epochs = self.core.algo.update_epochs  # optimizer steps per batch
        target = self.core.version + steps * epochs + (epochs - self.core.epoch) % epochs
        need = steps * self.core.local_batch - self.core.in_step
        deadline = time.monotonic() + timeout_s
        while self.core.buffered < need:
            if time.monotonic() > deadline:
                raise TimeoutError(f"learner {self.rank}: no data for {steps} steps")
            self._pull(max_items=64, timeout_s=0.5, max_decisions=need - self.core.buffered)
        with self._stepping:
            self.core.run_available(self._publish, until_version=target)
        return self.stats()

    def stop(self) -> None:
        """Leave ``run()``: at once with one rank; with several, at the next step agreement,
        which every rank takes (see ``run``)."""
        self._stop.set()
        self.core.stop_requested = True

    def buffered(self) -> int:
        return self.core.buffered

    def broadcast_weights(self) -> int:
        """GPU path: broadcast parameters from rank 0 over the process group (NCCL)."""
        if self.world_size > 1:
            for tensor in self.policy.state_dict().values():
                dist.broadcast(tensor, src=0)
        return self.core.version

    # ---- checkpoints and reporting --------------------------------------------------------
    def save(self, run_dir: str, counters: dict, samplers: list | None = None,
             pinned: list[str] | None = None) -> SavedCheckpoint:
        """Copy weights, optimizer state and version between two optimizer steps, then write
        them to the run's storage (a path or URI) while training goes on (with the env
        workers' sampler states, if given). ``pinned`` checkpoints are never pruned (a
        periodic evaluation is still loading them)."""
        with self._saving:  # one save at a time: the next copies into this one's buffers
            start = time.perf_counter()
            with self._stepping:
                meta = CheckpointMeta(self.policy_choice, self.spec, self.core.version, counters,
                                      list(samplers or []))
                weights, optimizer, rng = snapshot(self.policy, self.core.optimizer,
                                                   self._snapshot)
            paused = time.perf_counter()
            path = save_run_checkpoint(run_dir, weights, meta, optimizer, rng=rng,
                                       pinned=pinned or ())
            written = time.perf_counter() - paused
            self._snapshot = (weights, optimizer)
        size = sum(f["size"] for f in listed_files(path).values())
        return SavedCheckpoint(path, meta.version, paused - start, written, size)

    def version(self) -> int:
        return self.core.version

    def checksum(self) -> tuple[int, float]:
        """Version and sum of all parameters, read between two optimizer steps: ranks of one
        group at one version must agree."""
        from rlvla3.weight_sync import parameter_sum

        with self._stepping:
            return self.core.version, parameter_sum(self.policy)

    def distance_from(self, path: str) -> float:
        """How far the weights moved from the checkpoint at ``path`` (e.g. ``init_from``):
        ``||theta - theta_0|| / ||theta_0||`` over all floating-point tensors."""
        from rlvla3.checkpoint import load_policy
        from rlvla3.weight_sync import relative_change

        reference, _ = load_policy(path)
        with self._stepping:
            return relative_change(reference.state_dict(), self.policy.state_dict())

    def stats(self) -> dict:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        self.metrics.set("busy_fraction", min(self.core.busy_s / elapsed, 1.0))
        self.metrics.set("data_wait_fraction", min(self.wait_s / elapsed, 1.0))
        out = {
            "version": self.core.version,
            "samples_trained": self.core.samples_trained,
            **self.core.counts,
            "buffered": self.core.buffered,
            "in_step": self.core.in_step,
            "busy_fraction": min(self.core.busy_s / elapsed, 1.0),
            "busy_s": self.core.busy_s,
            "data_wait_fraction": min(self.wait_s / elapsed, 1.0),
            "incarnation": self.incarnation,
            "restored_from": self.restored_from,
            "lost_segments": self.lost_segments,
            "lost_decisions": self.lost_decisions,
            "rank": self.rank,
            "world_size": self.world_size,
            "memory": self.memory.sample(),
            "staleness_hist": dict(self.core.staleness_hist),
            "length_hist": dict(self.core.length_hist),
        }
        if self.core.clock is not None:  # simulated GPU cost (rlvla3.gpu_costs)
            out["cost"] = self.core.clock.stats.as_dict()
        if self.last is not None:
            out.update(loss=self.last.loss, entropy=self.last.entropy,
                       kl_per_decision=self.last.kl_per_decision,
                       clip_fraction=self.last.clip_fraction, staleness=self.last.mean_staleness)
        return out

    def take_history(self) -> list[dict]:
        out, self.history = self.history, []
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _EvaluateModule(torch.nn.Module):
    """``forward`` = ``policy.evaluate`` as a tuple, the form DDP's gradient hooks need."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions, latents):
        ev = self.policy.evaluate(obs, actions, latents)
        return ev.log_prob, ev.value, ev.entropy, ev.log_prob_elements


class _DDPEvaluate:
    """Gives the learner core ``evaluate`` and ``no_sync`` on a DDP-wrapped policy."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel):
        self.ddp = ddp

    def evaluate(self, obs, actions, latents) -> Evaluation:
        return Evaluation(*self.ddp(obs, actions, latents))

    def no_sync(self):
        return self.ddp.no_sync()
