"""EnvWorker actor: several env slots, each running episodes against a rollout server.

Each slot owns one ``Env`` and steps it in its own thread (a simulator call blocks; the other
slots go on). Finished episodes are put into ``ray.put`` and shipped to the trajectory queue as
``ObjectRef``s; a full queue makes ``put`` wait, which pauses that slot (backpressure).

Two ways to drive the slots, chosen by the controller's rollout strategy:
- ``run()``: every slot runs its own episode loop until ``stop()``; no slot waits for another
  (asynchronous rollout). Before each episode the slot asks the queue for admission (pacing:
  it waits while the learners could not train the episode within the staleness bound); the
  admission names the key to run, which is a uniform GRPO group's when the queue draws it
  again (dynamic sampling: the key the slot asked with goes back to the sampler, next).
- ``begin_episodes()`` / ``step_slots(chunks)``: the controller steps all slots of a group in
  lockstep and batches their inference itself (synchronous and pipelined rollout);
  ``continue_episodes()`` / ``step_slots(chunks, autoreset=True)`` keep every slot busy for a
  fixed number of steps per round, a finished episode resetting in place in the background
  while the other slots go on stepping (autoreset rollout).

An episode cut by a simulator fault (a step that timed out, crashed its process or raised) is
dropped and counted, never shipped: its last transition is not a real one (the queue is told,
so a GRPO group does not wait for it). Admissions belong to this worker's incarnation: a
restarted worker tells the queue its new incarnation, which releases its predecessor's
admitted episodes and refuses the admissions its predecessor still waited for; a slot whose
admission is refused (admissions closed at the end of a run, or this incarnation replaced)
ends its loop.

Accounting: ``decisions`` (produced) = decisions of running episodes (``inflight_decisions``) +
``dropped_decisions`` (faults) + ``shipped_decisions``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from actors.runtime.bootstrap import lookup, was_restarted
from actors.runtime.metrics import RoleMetrics
from actors.runtime.process_memory import ProcessMemory
from envs import make_env
from rlvla3.confidence import tally
from rlvla3.config import Named
from rlvla3.episode.recorder import EpisodeRecorder
from rlvla3.episode.tasks import InformativeTasks, TaskSampler
from rlvla3.role_stats import EnvWorkerStats
from rlvla3.run_config import RECENT_EPISODES, EnvWorkerConfig
from rlvla3.types import (
    ActionChunk,
    EnvSpec,
    EpisodeKey,
    Observation,
    SegmentInfo,
    StepResult,
    TrajectorySegment,
)


class EnvWorker:
    """A group of env slots."""

    def __init__(self, worker_id: int, env: Named, spec: EnvSpec, cfg: EnvWorkerConfig,
                 task_ids: list[int], init_state_ids: list[int], seed: int, repeat: int,
                 servers: list[str], queue: str):
        self.worker_id = worker_id
        self.spec = spec
        self.cfg = cfg
        self.envs = [make_env(env, seed=seed * 100_003 + worker_id * 1009 + i)
                     for i in range(cfg.slots_per_worker)]
        self.pool = ThreadPoolExecutor(max_workers=cfg.slots_per_worker,
                                       thread_name_prefix=f"env{worker_id}")
        weighting = (InformativeTasks(task_ids, repeat, floor=cfg.task_weight_floor)
                     if cfg.task_weighting == "informative" else None)
        self.sampler = TaskSampler(task_ids, init_state_ids, seed * 31 + worker_id, repeat,
                                   lead=cfg.task_lead, weighting=weighting)
        self.servers = [lookup(name) for name in servers]
        self.queue = lookup(queue)
        self.metrics = RoleMetrics("env", f"env-{worker_id}")
        self.memory = ProcessMemory()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._recorders: list[EpisodeRecorder | None] = [None] * cfg.slots_per_worker
        self._tickets: list[int | None] = [None] * cfg.slots_per_worker
        self._slot_tasks: list[int | None] = [None] * cfg.slots_per_worker
        """The task each slot's simulator last reset to (the sampler keeps a slot on it)."""
        self._resetting: dict[int, asyncio.Future] = {}
        """Autoreset rounds: slots resetting in the background."""
        self._obs: list[Observation | None] = [None] * cfg.slots_per_worker
        self._phases: list[str] = ["idle"] * cfg.slots_per_worker
        """What each slot waits on now (admit, reset, step, infer, put, idle): the watchdog's
        answer to "what is this run waiting on"."""
        self.incarnation = uuid.uuid4().hex
        self.counts: dict[str, Any] = {
            "env_steps": 0, "decisions": 0, "episodes": 0, "successes": 0, "dropped_faults": 0,
            "dropped_decisions": 0, "shipped_decisions": 0, "shipped_env_steps": 0,
            "env_busy_s": 0.0, "infer_wait_s": 0.0, "infer_requests": 0, "queue_wait_s": 0.0,
            "admit_wait_s": 0.0, "lockstep_skips": 0}
        self.length_hist: dict[int, int] = {}
        """Decisions per finished episode (shipped or dropped): what was produced."""
        self.recent: deque[tuple[float, bool, int]] = deque(maxlen=RECENT_EPISODES)
        self._reported_restarts = 0
        if was_restarted():
            self.queue.reset_worker.remote(worker_id, self.incarnation)
            self.sampler.restore(None, salt=int(self.incarnation[:8], 16))

    # ---- env calls (threaded, with a timeout) -------------------------------------------
    async def _call(self, fn, *args):
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.pool, fn, *args),
                                          self.cfg.step_timeout_s)
        finally:
            self.counts["env_busy_s"] += time.monotonic() - start

    async def _reset(self, slot: int, key: EpisodeKey | None = None,
                     ticket: int | None = None) -> Observation:
        key = key or self.sampler.next(self._slot_tasks[slot])
        self._slot_tasks[slot] = key.task_id
        self._tickets[slot] = ticket
        self._recorders[slot] = EpisodeRecorder(key, f"w{self.worker_id}/s{slot}")
        self._phases[slot] = "reset"
        obs = await self._call(self.envs[slot].reset, key.task_id, key.init_state_id)
        self._phases[slot] = "idle"
        self._obs[slot] = obs
        return obs

    async def _step(self, slot: int, chunk: ActionChunk) -> StepResult:
        """Execute ``chunk`` on ``slot``, record it, and ship the episode if it ended."""
        obs, rec = self._obs[slot], self._recorders[slot]
        assert obs is not None and rec is not None  # a slot steps inside an episode it began
        self._phases[slot] = "step"
        try:
            result = await self._call(self.envs[slot].step, chunk.actions)
        except asyncio.TimeoutError:
            result = StepResult(obs, 0.0, False, True, False, 0,
                                fault=f"step timed out after {self.cfg.step_timeout_s}s")
        except Exception as exc:  # noqa: BLE001 - an in-process simulator raised: a fault
            result = StepResult(obs, 0.0, False, True, False, 0,
                                fault=f"step raised {type(exc).__name__}: {exc}"[:300])
        rec.record(obs, chunk, result)
        self.counts["env_steps"] += result.steps
        self.counts["decisions"] += 1
        self.metrics.inc("env_steps", result.steps)
        self._obs[slot] = result.obs
        done = result.terminated or result.truncated or len(rec) >= self.spec.max_decisions
        if done:
            await self._finish(slot, result)
        self._phases[slot] = "idle"
        return result

    async def _finish(self, slot: int, last: StepResult) -> None:
        rec, self._recorders[slot] = self._recorders[slot], None
        assert rec is not None  # called by ``_step``, inside the episode
        ticket, self._tickets[slot] = self._tickets[slot], None
        self.length_hist[len(rec)] = self.length_hist.get(len(rec), 0) + 1
        if last.fault:
            self.counts["dropped_faults"] += 1
            self.counts["dropped_decisions"] += len(rec)
            self.metrics.inc("episodes_dropped")
            await self.queue.drop.remote(rec.key, len(rec), ticket)
            return
        bootstrap = 0.0
        if not last.terminated:
            self._phases[slot] = "infer"
            start = time.monotonic()
            bootstrap = (await self._server(slot).act.remote(last.obs)).value
            self.counts["infer_wait_s"] += time.monotonic() - start
            self.counts["infer_requests"] += 1
        segment = rec.finish(last, bootstrap)
        self.counts["episodes"] += 1
        self.counts["successes"] += int(segment.success)
        self.recent.append((segment.episode_return, segment.success, segment.key.task_id))
        self.sampler.observe(segment.key.task_id, segment.success)
        self.metrics.inc("episodes")
        self._phases[slot] = "put"
        await self._ship(segment, ticket)

    async def _ship(self, segment: TrajectorySegment, ticket: int | None) -> None:
        info = SegmentInfo(segment.source, segment.key, len(segment), segment.env_steps,
                           int(segment.policy_versions.min()), segment.episode_return,
                           segment.success, int(segment.policy_versions.max()))
        start = time.monotonic()
        self.counts["shipped_decisions"] += len(segment)
        self.counts["shipped_env_steps"] += segment.env_steps
        # payload_owner "queue": the episode goes by value and the queue puts it into the object
        # store itself, so the queue owns it and it outlives this worker (process and node).
        # "worker": a zero-copy reference this worker owns; if the worker dies, its shipped
        # episodes not yet fetched die with it and the learner counts them (``lost_segments``).
        by_value = self.cfg.payload_owner == "queue"
        payload = segment if by_value else ray.put(segment)
        await self.queue.put.remote(info, [payload], ticket, by_value)
        self.counts["queue_wait_s"] += time.monotonic() - start
        self.metrics.inc("trajectories")

    def _server(self, slot: int):
        return self.servers[(self.worker_id + slot) % len(self.servers)]

    # ---- asynchronous rollout ----------------------------------------------------------
    async def run(self) -> EnvWorkerStats:
        """Run every slot's own episode loop until ``stop()``."""
        self._stop.clear()
        await asyncio.gather(*(self._slot_loop(i) for i in range(len(self.envs))))
        return self.stats()

    async def _slot_loop(self, slot: int) -> None:
        server = self._server(slot)
        while not self._stop.is_set():
            key = self.sampler.next(self._slot_tasks[slot])
            start = time.monotonic()
            self._phases[slot] = "admit"
            admission = await self.queue.admit.remote(self.worker_id, key, self.incarnation)
            self.counts["admit_wait_s"] += time.monotonic() - start
            if admission is None:  # admissions closed, or this incarnation was replaced
                self._phases[slot] = "idle"
                break
            if admission.key != key:  # a GRPO group draws again: the slot runs its key
                self.sampler.put_back(key)
            if self._stop.is_set():
                await self.queue.cancel.remote(admission.ticket)
                break
            obs = await self._reset(slot, admission.key, admission.ticket)
            while not self._stop.is_set():
                start = time.monotonic()
                self._phases[slot] = "infer"
                chunk = await server.act.remote(obs)
                self.counts["infer_wait_s"] += time.monotonic() - start
                self.counts["infer_requests"] += 1
                result = await self._step(slot, chunk)
                if self._recorders[slot] is None:
                    break
                obs = result.obs

    def stop(self) -> None:
        self._stop.set()

    # ---- lockstep rollout (driven by the controller) ----------------------------------
    async def begin_episodes(self) -> list[Observation]:
        """Reset every slot to its next episode; returns one observation per slot."""
        return list(await asyncio.gather(*(self._reset(i) for i in range(len(self.envs)))))

    async def continue_episodes(self) -> list[Observation | None]:
        """Autoreset rounds: every slot's current observation (None while it resets), resetting
        the slots with no episode (the first round, or after a restart) before returning."""
        await asyncio.gather(*(self._reset(i) for i in range(len(self.envs))
                               if self._recorders[i] is None and i not in self._resetting))
        return await self._some_ready()

    async def _some_ready(self) -> list[Observation | None]:
        """The ready slots' observations, waiting for a reset when no slot is ready."""
        obs = self._ready_obs()
        if all(o is None for o in obs) and self._resetting:
            await asyncio.wait(list(self._resetting.values()), return_when=asyncio.FIRST_COMPLETED)
            obs = self._ready_obs()
        return obs

    def _ready_obs(self) -> list[Observation | None]:
        for i, task in list(self._resetting.items()):
            if task.done():
                del self._resetting[i]
                task.result()  # a reset that failed raises here
        return [self._obs[i] if self._recorders[i] is not None and i not in self._resetting
                else None for i in range(len(self.envs))]

    async def step_slots(self, chunks: list[ActionChunk | None],
                         autoreset: bool = False) -> list[Observation | None]:
        """Step the slots whose chunk is given, all at once; None for slots now finished.

        With ``autoreset`` a finished slot starts its next episode's reset in the background
        and sits out the lockstep steps until it is done (counted in ``lockstep_skips``), so a
        slow reset delays only its own slot, never the others' steps; at least one slot of the
        worker is ready when this returns."""
        live = [(i, c) for i, c in enumerate(chunks)
                if c is not None and self._recorders[i] is not None]
        await asyncio.gather(*(self._step(i, c) for i, c in live))
        if not autoreset:
            return [self._obs[i] if self._recorders[i] is not None else None
                    for i in range(len(self.envs))]
        self.counts["lockstep_skips"] += len(self.envs) - len(live)
        for i in range(len(self.envs)):
            if self._recorders[i] is None and i not in self._resetting:
                self._resetting[i] = asyncio.ensure_future(self._reset(i))
        return await self._some_ready()

    # ---- resuming ----------------------------------------------------------------------
    def sampler_state(self) -> dict:
        """The episode sampler's state, saved with each checkpoint."""
        return self.sampler.state()

    def restore_sampler(self, state: dict | None, salt: int) -> bool:
        """Continue the sequence a checkpoint saved (before the first episode starts); see
        ``TaskSampler.restore``."""
        return self.sampler.restore(state, salt)

    # ---- reporting ---------------------------------------------------------------------
    def stats(self) -> EnvWorkerStats:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        returns = [r for r, _, _ in self.recent]
        succ = [s for _, s, _ in self.recent]
        by_task = tally((str(task), 1, int(success)) for _, success, task in self.recent)
        restarts = sum(getattr(env, "restarts", 0) for env in self.envs)
        busy = min(self.counts["env_busy_s"] / (elapsed * len(self.envs)), 1.0)
        self.metrics.set("busy_fraction", busy)
        if returns:
            self.metrics.set("episode_return", float(np.mean(returns)))
            self.metrics.set("success_rate", float(np.mean(succ)))
        self.metrics.inc("restarts", restarts - self._reported_restarts)
        self._reported_restarts = restarts
        return EnvWorkerStats(
            incarnation=self.incarnation, slots=len(self.envs), **self.counts,
            inflight_decisions=sum(len(r) for r in self._recorders if r is not None),
            busy_fraction=busy,
            recent_return=float(np.mean(returns)) if returns else 0.0,
            recent_success=float(np.mean(succ)) if succ else 0.0,
            recent_episodes=len(self.recent), recent_by_task=by_task,
            task_shares={str(t): share for t, share in self.sampler.weighting.shares().items()},
            length_hist=dict(self.length_hist),
            phases={p: self._phases.count(p) for p in set(self._phases)},
            restarts=restarts, memory=self.memory.sample())

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
