"""Learner actor: one rank of the learner group, a thin shell around ``rlvla3.learner.core``.
The rank's ``LearnerCore`` trains through a ``TrainingEngine`` (one rank, DDP or FSDP2); this
actor pulls queue items, drives the core, publishes weights, answers the controller, and never
writes the core's state. After every optimizer step the weights go to every rollout server in
one ``WeightsMessage`` and the new version to the queue; every rank reports the decisions it
holds untrained (the backlog that paces the env slots). Ranks stop together, after a step they
agreed on. A checkpoint holds what the next step depends on (proximal copy and ``LearnerState``
included); a rank Ray restarted resumes from it, or from ``init_from`` before the first one::

    learner = ray.remote(Learner).remote(0, 1, policy, spec, algo, cfg, "streaming", seed,
                                         servers, queue, run_dir)  # as actors.rl.topology
    learner.run.remote()  # until stop(); synchronous: train_available(), train_steps(n)

Design notes: docs/concepts/pipeline.md#the-learner-rank"""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray
import torch

from actors.runtime.bootstrap import lookup, was_restarted
from actors.runtime.metrics import RoleMetrics
from actors.runtime.process_memory import ProcessMemory
from datalake.demos import DemoSet, load_demos
from rlvla3.algos.config import AlgoConfig
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    SavedCheckpoint,
    StateSnapshot,
    load_policy,
    row_source,
    save_run_checkpoint,
    save_sharded_run_checkpoint,
)
from rlvla3.checkpoint.storage import basename
from rlvla3.checkpoint.trust import listed_files, locate_checkpoint
from rlvla3.config import Named
from rlvla3.engine import group
from rlvla3.engine.engine import TrainingEngine
from rlvla3.engine.group import Ranks, free_port
from rlvla3.gpu.costs import TrainingCost
from rlvla3.gpu.sim import SimulatedEngine
from rlvla3.learner.core import LEARNER_STARTS, LearnerCore, rl_engine
from rlvla3.learner.step import LearnerState, StepStats
from rlvla3.policies import build_policy
from rlvla3.protocols import Policy, as_module
from rlvla3.role_stats import LearnerStats
from rlvla3.run_config import LearnerConfig
from rlvla3.types import EnvSpec, WeightsMessage

if TYPE_CHECKING:
    from rlvla3.weight_sync import WeightBroadcaster

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

FLUSH_AFTER_S = 2.0
"""A rank asked to stop that made no progress for this long abandons the step under way."""


class Learner:
    """One learner rank."""

    def __init__(self, rank: int, world_size: int, policy: Named, spec: EnvSpec,
                 algo: AlgoConfig, cfg: LearnerConfig, start: str, seed: int,
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
        self.algo = algo
        self.start = start
        self.max_staleness = max_staleness
        self.seed = seed
        self.cost = cost
        self.init_from = init_from
        self.device = torch.device("cuda" if cfg.num_gpus > 0 and torch.cuda.is_available()
                                   else "cpu")
        self.policy = build_policy(policy, spec)
        as_module(self.policy).to(self.device)
        self._core: LearnerCore | None = None
        """Made once this rank knows its group (``init_group``; at once for a lone rank)."""
        self.simulated: SimulatedEngine | None = None
        """The engine on simulated GPUs (``learner.cost_model``), with its clock."""
        self.metrics = RoleMetrics("learner", f"learner-{rank}")
        self.memory = ProcessMemory()
        self.servers = [lookup(name) for name in servers]
        self.queue = lookup(queue)
        self.incarnation = uuid.uuid4().hex
        self._channel: WeightBroadcaster | None = None
        self._stop = threading.Event()
        self._stepping = threading.RLock()
        """Held through every optimizer step and weight load: what reads the weights from
        another call (a checkpoint, a restarted server's pull) sees one whole version."""
        self._saving = threading.Lock()
        self._training = threading.Event()
        """``run`` is training: a sharded snapshot waits for its step agreement."""
        self._snapshot: tuple[StateSnapshot, StateSnapshot | None] | None = None
        """The last checkpoint's copy, reused as the next one's buffers."""
        self._message: WeightsMessage | None = None
        """The weights last published (rank 0): what a server that asks gets."""
        self._started = time.monotonic()
        self.wait_s = 0.0
        self.lost_segments = 0
        self.lost_decisions = 0
        self._reported_buffered = -1
        self.last: StepStats | None = None
        self.history: list[dict] = []
        self.run_dir = run_dir
        self.restored_from = ""
        self._restart = bool(run_dir) and was_restarted()
        """Ray restarted this actor after a crash: it continues from the last checkpoint once
        its core exists."""
        self.lineage = time.time_ns() if self._restart else 0
        """What its weights are published under (``WeightsMessage.lineage``): a restarted
        learner rolls back to its checkpoint, a new lineage. Wall-clock ns, so a later restart
        has a larger one on any node whose clock is right to within the seconds a restart
        takes."""
        if world_size == 1:
            self._make_core(Ranks(0, 1, self.device))

    @property
    def core(self) -> LearnerCore:
        """This rank's learner core, made once it knows its group (``_make_core``)."""
        if self._core is None:
            raise RuntimeError(f"learner {self.rank}: its group is not formed yet (init_group)")
        return self._core

    # ---- setup -------------------------------------------------------------------------
    def _make_core(self, ranks: Ranks) -> None:
        """The engine and the learner core for this rank's place in the group; then, after
        a restart, the state of the last checkpoint, and the first published weights."""
        engine = rl_engine(self.policy, self.algo, self.cfg.lr, self.cfg.engine(), ranks)
        self.simulated = SimulatedEngine(engine, self.cost) if self.cost is not None else None
        self._core = LearnerCore(
            self.policy, self.algo, 0, self.cfg.micro_batch, self.cfg.lr,
            LEARNER_STARTS[self.start](), engine=cast(TrainingEngine, self.simulated or engine),
            max_staleness=self.max_staleness,
            reference=self._reference() if self.algo.ref_kl_coef > 0 else None,
            demos=self._demos(ranks.rank) if self.algo.sft_coef > 0 else None)
        self.core.take_share(self.cfg.global_batch, ranks.world, ranks.rank)
        if self._restart:
            try:
                self.restored_from = basename(locate_checkpoint(self.run_dir))
            except FileNotFoundError:
                self.restored_from = "initial weights (no checkpoint yet)"
                if self.init_from:
                    self.load_weights(self.init_from)
                    self.restored_from = (f"init_from weights (no checkpoint yet): "
                                          f"{self.init_from}")
            else:
                self.restore(self.run_dir)
            self._report_buffered()
        self._publish_weights(announce=self._restart, force=self._restart)

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def init_group(self, master_addr: str, master_port: int, rank: int | None = None,
                   world_size: int | None = None) -> bool:
        """Join the process group and build this rank's engine on it (DDP or FSDP2 as
        ``learner.sharding`` says; the plain module for one rank). ``rank``/``world_size``:
        this rank's place in a rebuilt group (a fresh process: every rank of a rebuilt group
        was restarted); each rank then takes its share of the global batch."""
        if rank is not None and world_size is not None:
            if rank != self.rank:
                self.queue.learner_buffered.remote(self.rank, 0)  # the old rank's report
            self.rank, self.world_size = rank, world_size
            self._reported_buffered = -1
        if self._core is not None and self._core.engine.ranks.world == self.world_size:
            return True  # a lone rank: made at construction
        ranks = group.join(self.cfg.backend, master_addr, master_port, self.rank,
                           self.world_size, self.device, host_state=self.cfg.offload)
        self._make_core(ranks)
        self._report_buffered()
        return True

    def _report_buffered(self) -> None:
        if self.core.buffered != self._reported_buffered:
            self._reported_buffered = self.core.buffered
            self.queue.learner_buffered.remote(self.rank, self.core.buffered)

    def _reference(self) -> Policy:
        """``init_from``'s weights in this run's policy (its likelihood options), frozen and
        whole on this rank: what ``algo.ref_kl_coef`` measures the distance from. Loaded from
        ``init_from`` whatever the rank restores, so a resumed run keeps the same reference
        (the run config refuses ``algo.ref_kl_coef`` without ``init_from``)."""
        reference = build_policy(self.policy_choice, self.spec)
        loaded, _ = load_policy(self.init_from)
        reference.load_state_dict(loaded.state_dict())
        as_module(reference).to(self.device)
        reference.eval()
        return reference

    def _demos(self, rank: int) -> DemoSet:
        """``algo.sft_datasets`` decoded into this rank's memory, drawn with a seed of its own
        (checked against the env before the run started: ``actors.rl.controller``)."""
        start = time.monotonic()
        demos = load_demos(self.algo.sft_datasets, self.spec, self.algo.sft_max_samples,
                           seed=self.seed * 1000 + rank)
        if rank == 0:
            skipped = f", {demos.skipped} unreadable frame(s) skipped" if demos.skipped else ""
            print(f"[learner] algo.sft_coef={self.algo.sft_coef}: {len(demos)} demonstration "
                  f"samples of {len(self.algo.sft_datasets)} dataset(s) in memory "
                  f"({time.monotonic() - start:.0f} s{skipped})", flush=True)
        return demos

    def load_weights(self, path: str) -> int:
        """Initialise from another run's weights (e.g. SFT); optimizer and version stay fresh.
        Every rank calls it (under FSDP each loads its shard)."""
        from rlvla3.checkpoint.files import read_meta

        meta = read_meta(path)
        if meta.policy.name != self.policy_choice.name:
            raise ValueError(f"init_from {path}: checkpoint holds a {meta.policy.name!r} policy, "
                             f"this run builds {self.policy_choice.name!r}")
        with self._stepping:
            self.core.load(row_source(path, optimizer=False), self.core.version,
                           optimizer=False)
        self._publish_weights()
        return self.core.version

    def restore(self, path: str) -> int:
        """Load weights, optimizer state and version from a checkpoint (either format, any
        rank count); returns the version. Every rank calls it."""
        with self._stepping:
            meta = self.core.restore(path)
        self._publish_weights()
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
        self._publish_weights(announce=True)

    def _publish_weights(self, announce: bool = False, force: bool = False) -> None:
        """Gather the current weights (every rank takes part: under FSDP each parameter is
        gathered in turn) into rank 0's message; ``announce``: offer it to every rollout
        server, over the collective channel if one is open, else as one object-store copy
        that every server pulls, and tell the queue the version (``force``: a restored
        version, older than what the servers and the queue hold)."""
        dtype = _DTYPES.get(self.cfg.publish_dtype)
        weights = self.core.weights(dtype)
        if self.rank != 0:
            return
        assert weights is not None  # gathered whole on rank 0
        self._message = WeightsMessage(self.core.version, {
            k: v.numpy() if v.dtype != torch.bfloat16 else cast(np.ndarray, v)  # numpy: no bf16
            for k, v in weights.items()}, self.lineage)
        if not announce:
            return
        if self._channel is not None:
            self._channel.send({k: torch.as_tensor(v) for k, v in weights.items()},
                               self.core.version)
        else:
            ref = ray.put(self._message)
            for server in self.servers:
                server.update_weights.remote(ref, force)
        self.queue.set_version.remote(self.core.version, force, self.lineage)

    def open_weight_channel(self, host: str, port: int, world_size: int, backend: str) -> str:
        """Join the weight broadcast group as its sender (rank 0)."""
        from rlvla3.weight_sync import WeightBroadcaster

        device = "cuda" if backend == "nccl" else "cpu"
        template = {k: torch.as_tensor(v) for k, v in self._published.tensors.items()}
        self._channel = WeightBroadcaster(template, host, port, 0, world_size, backend, device)
        return backend

    def weights_message(self) -> WeightsMessage | None:
        """The weights last published (rank 0; None on the others)."""
        with self._stepping:
            return self._message

    @property
    def _published(self) -> WeightsMessage:
        """The weights last published: rank 0's, from ``_make_core`` on."""
        if self._message is None:
            raise RuntimeError(f"learner {self.rank}: no weights published (rank 0 publishes)")
        return self._message

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

    def run(self) -> LearnerStats:
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
        core.reset_stop()
        self._training.set()
        try:
            request = self._train_until_stopped(core)
        finally:
            with self._stepping:  # a snapshot asked from now on is taken at this version
                self._training.clear()
        if request is not None:  # items taken from the queue are buffered, never dropped
            try:
                self._receive(request)
            except ray.exceptions.RayActorError:  # the queue is gone: the run is ending
                pass
        return self.stats()

    def _train_until_stopped(self, core: LearnerCore) -> ray.ObjectRef | None:
        """``run``'s loop; returns a queue pull still in flight."""
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
        return request

    def train_available(self) -> LearnerStats:
        """Synchronous training (one rank): take everything queued now, train every full batch."""
        while self._pull(max_items=1024, timeout_s=0.05):
            pass
        with self._stepping:
            self.core.run_available(self._publish)
        return self.stats()

    def train_steps(self, steps: int, timeout_s: float = 120.0) -> LearnerStats:
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
        self.core.request_stop()

    def buffered(self) -> int:
        return self.core.buffered

    # ---- checkpoints and reporting --------------------------------------------------------
    def save(self, run_dir: str, counters: dict, samplers: list | None = None,
             pinned: list[str] | None = None) -> SavedCheckpoint:
        """Copy weights, optimizer state and version between two optimizer steps, then write
        them to the run's storage (a path or URI) while training goes on (with the env
        workers' sampler states, if given). ``pinned`` checkpoints are never pruned (a
        periodic evaluation is still loading them).

        Whole (DDP, one rank): rank 0 alone is asked, and writes ``policy.safetensors`` and
        ``optimizer.pt``. Sharded (FSDP): every rank is asked, and each copies its shard at
        one agreed version (the first step agreement at which every rank has been asked, or
        at once when the ranks are not training), then writes and uploads it in parallel;
        rank 0 lists them in ``meta.json``."""
        with self._saving:  # one save at a time: the next copies into this one's buffers
            start = time.perf_counter()
            if self.core.engine.sharded:
                version, tensors, state = self._agreed_snapshot()
                meta = CheckpointMeta(self.policy_choice, self.spec, version, counters,
                                      list(samplers or []), state.as_json())
                paused = time.perf_counter()
                path = save_sharded_run_checkpoint(
                    run_dir, tensors, meta, self.core.engine.ranks,
                    self.core.engine.optimizer_meta(), torch.get_rng_state(),
                    pinned=pinned or ())
            else:
                with self._stepping:
                    copy = self.core.copy_whole(self._snapshot)
                meta = CheckpointMeta(self.policy_choice, self.spec, copy.version, counters,
                                      list(samplers or []), copy.state.as_json())
                paused = time.perf_counter()
                path = save_run_checkpoint(run_dir, copy.weights, meta, copy.optimizer,
                                           rng=copy.rng, pinned=pinned or (),
                                           shadow=copy.shadow)
                self._snapshot = (copy.weights, copy.optimizer)
            written = time.perf_counter() - paused
        size = sum(f["size"] for f in listed_files(path).values())
        return SavedCheckpoint(path, meta.version, paused - start, written, size)

    def _agreed_snapshot(self) -> tuple[int, dict[str, torch.Tensor], LearnerState]:
        """This rank's checkpoint tensors at a version every rank copies at: taken by the
        training loop at the next step agreement where every rank wants one, or here when
        no loop runs (the ranks then stand at one version)."""
        core = self.core
        core.want_snapshot()
        while True:
            with self._stepping:
                if not self._training.is_set() and not core.snapshot_ready:
                    core.take_snapshot()  # nothing steps: copy now
                if core.snapshot_ready:
                    return core.pop_snapshot()
            time.sleep(0.01)

    def version(self) -> int:
        return self.core.version

    def checkpoint_format(self) -> str:
        """``sharded`` (every rank writes its shard: FSDP over several ranks) or ``whole``."""
        return "sharded" if self.core.engine.sharded else "whole"

    def checksum(self) -> tuple[int, float]:
        """Version and sum of the parameters this rank holds (its shards under FSDP), read
        between two optimizer steps: ranks of a DDP group at one version agree."""
        from rlvla3.engine.sharded import local_rows

        with self._stepping:
            total = sum(float(local_rows(p, self.core.engine.ranks)[0].detach().double().sum())
                        for p in self.policy.parameters())
            return self.core.version, total

    def distance_from(self, path: str) -> float:
        """How far the published weights moved from the checkpoint at ``path`` (e.g.
        ``init_from``): ``||theta - theta_0|| / ||theta_0||`` over all floating-point tensors
        (rank 0)."""
        from rlvla3.checkpoint.files import load_policy
        from rlvla3.weight_sync import relative_change

        reference, _ = load_policy(path)
        with self._stepping:
            now = {k: torch.as_tensor(v) for k, v in self._published.tensors.items()}
        return relative_change(reference.state_dict(), now)

    def stats(self) -> LearnerStats:
        if self._core is None:  # a rank of a group not formed yet (``init_group``)
            return LearnerStats(incarnation=self.incarnation, rank=self.rank,
                                world_size=self.world_size, restored_from=self.restored_from,
                                waiting_for="the learner group (init_group)")
        core = self.core
        elapsed = max(time.monotonic() - self._started, 1e-9)
        busy, wait = min(core.busy_s / elapsed, 1.0), min(self.wait_s / elapsed, 1.0)
        self.metrics.set("busy_fraction", busy)
        self.metrics.set("data_wait_fraction", wait)
        published, last = core.last_publish, self.last
        counts: dict[str, Any] = core.counts
        # what gathering the weights for the servers cost this rank
        publish: dict[str, Any] = {} if published is None else dict(
            engine=core.engine.name, publish_s=round(published.seconds, 4),
            publish_peak_mb=round(published.peak_bytes / 2**20, 2),
            publish_dtype=published.dtype)
        step: dict[str, Any] = {} if last is None else dict(
            loss=last.loss, entropy=last.entropy, kl_per_decision=last.kl_per_decision,
            clip_fraction=last.clip_fraction, staleness=last.mean_staleness)
        return LearnerStats(
            incarnation=self.incarnation, rank=self.rank, world_size=self.world_size,
            restored_from=self.restored_from, version=core.version,
            samples_trained=core.samples_trained, **counts, buffered=core.buffered,
            in_step=core.in_step, busy_fraction=busy, busy_s=core.busy_s,
            data_wait_fraction=wait, lost_segments=self.lost_segments,
            lost_decisions=self.lost_decisions, staleness_hist=dict(core.staleness_hist),
            length_hist=dict(core.length_hist),
            cost=self.simulated.clock.stats if self.simulated is not None else None,
            **publish, **step, memory=self.memory.sample())

    def take_history(self) -> list[dict]:
        out, self.history = self.history, []
        return out

    def close(self) -> None:
        group.leave()
