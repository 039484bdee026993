"""Record demonstrations: an expert drives envs in parallel Ray workers; successes become a dataset.

``record_dataset`` is env-agnostic: it takes ``make_env`` (builds an ``Env`` in the worker) and
``run_expert`` (plays one episode and returns a ``Demonstration``, or None when the expert does
not cover the task). Each worker is a Ray actor holding one env; (task, initial state) jobs
are spread over them and the driver writes the successful episodes with ``LeRobotWriter`` in
job order as they arrive, so the dataset does not depend on which worker finished first.
``libero_recorder`` wires the scripted LIBERO pick-and-place expert (``envs.libero_expert``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from datalake.writer import EpisodeRecord, LeRobotWriter, WriterConfig
from rlvla3.protocols import Env
from rlvla3.types import ObsBatch, Observation

log = logging.getLogger("datalake.record")


@dataclass(frozen=True)
class Demonstration:
    """One expert episode: what the policy saw and did at every low-level step."""

    success: bool
    observations: Sequence[Observation]
    actions: Sequence[np.ndarray]


EnvFactory = Callable[[], Env]
Expert = Callable[[Env, int, int, int], Demonstration | None]
"""``(env, task_id, init_state_id, take)``: take 0 is the clean expert, later takes may differ
(the LIBERO recorder perturbs them; see ``libero_recorder``)."""
Job = tuple[int, int, int]
"""(task_id, init_state_id, take)."""


def to_record(demo: Demonstration) -> EpisodeRecord:
    """A demonstration as writer input (images stacked per camera)."""
    obs = demo.observations
    return EpisodeRecord(
        images={cam: np.stack([o.images[cam] for o in obs]) for cam in obs[0].images},
        state=np.stack([o.state for o in obs]).astype(np.float32),
        action=np.stack(demo.actions).astype(np.float32),
        task=obs[0].instruction,
    )


class RecordWorker:
    """Holds one env (built once: a LIBERO build takes seconds) and plays jobs on it."""

    def __init__(self, make_env: EnvFactory, run_expert: Expert):
        self.env = make_env()
        self.run_expert = run_expert

    def run(self, job: Job) -> EpisodeRecord | str:
        """The recorded episode, or why there is none."""
        task_id, init_id, take = job
        where = f"task {task_id} init {init_id} take {take}"
        try:
            demo = self.run_expert(self.env, task_id, init_id, take)
        except Exception as exc:  # a simulator fault loses this episode, not the recording
            return f"{where}: {type(exc).__name__}: {exc}"
        if demo is None:
            return f"task {task_id}: not covered by the expert"
        if not demo.success:
            return f"{where}: expert failed"
        return to_record(demo)

    def close(self) -> None:
        self.env.close()


def record_dataset(
    out: str,
    make_env: EnvFactory,
    run_expert: Expert,
    jobs: Sequence[Job],
    workers: int,
    writer_config: WriterConfig,
) -> dict[str, Any]:
    """Play ``jobs`` ((task_id, init_state_id, take)) on ``workers`` Ray actors; write successes.

    Results stream back in job order (``ActorPool.map``), so the driver holds only the episodes
    that finished ahead of an earlier, slower one."""
    import ray
    from ray.util import ActorPool

    # A simulator that crashes its process takes the actor down: restart it and retry the job.
    actor = ray.remote(num_cpus=1, max_restarts=2, max_task_retries=1)(RecordWorker)
    pool_actors = [
        actor.remote(make_env, run_expert) for _ in range(max(1, min(workers, len(jobs))))
    ]
    writer: LeRobotWriter | None = None
    failures: list[str] = []
    t0 = time.perf_counter()
    try:
        results = ActorPool(pool_actors).map(lambda a, job: a.run.remote(job), list(jobs))
        for done, item in enumerate(results, 1):
            failed = isinstance(item, str)
            if failed:
                failures.append(item)
                log.warning("not recorded: %s", item)
            rate = (time.perf_counter() - t0) / done
            print(f"[record] {done}/{len(jobs)} episodes ({len(failures)} not recorded), "
                  f"{rate:.1f} s/episode", file=sys.stderr, flush=True)
            if failed:
                continue
            if writer is None:
                cams = {c: tuple(v.shape[1:3]) for c, v in item.images.items()}
                writer = LeRobotWriter(
                    out, cams, item.state.shape[1], item.action.shape[1], writer_config
                )
            writer.add_episode(item)
    finally:
        ray.get([a.close.remote() for a in pool_actors])
    recorded = 0 if writer is None else len(writer.episodes)
    if writer is not None:
        writer.close()
    return {"out": out, "jobs": len(jobs), "recorded": recorded, "failed": failures}


def libero_recorder(
    suite: str,
    image_size: tuple[int, int],
    action_noise: float = 0.0,
    policy: str = "",
    policy_share: float = 0.5,
) -> tuple[EnvFactory, Expert]:
    """``make_env`` / ``run_expert`` for the scripted LIBERO pick-and-place expert.

    Take 0 of an initial state is the clean expert; take k > 0 executes its motion with
    ``action_noise`` (seeded by k). Given a ``policy`` checkpoint, that policy drives a
    ``policy_share`` of the decisions of every take (its chunks, deterministic actions). Either
    way the recorded actions are the expert's for the states reached (DAgger-style labels)."""
    from envs.libero import LiberoConfig, LiberoEnv
    from envs.libero_expert import run_expert_episode

    cfg = LiberoConfig(suite=suite, image_size=image_size, process=False)
    driver_cache: dict[str, Any] = {}

    def make_env() -> Env:
        return LiberoEnv(cfg)

    def driver(obs: Observation) -> np.ndarray:
        if "policy" not in driver_cache:
            from rlvla3.checkpoint import load_policy

            driver_cache["policy"], _ = load_policy(policy)
        return driver_cache["policy"].act(ObsBatch.stack([obs]), deterministic=True).actions[0]

    def run_expert(env: Env, task_id: int, init_id: int, take: int) -> Demonstration | None:
        noise = action_noise if take > 0 else 0.0
        drive = driver if policy else None
        episode = run_expert_episode(
            env, task_id, init_id, True, noise, seed=take, driver=drive, driver_share=policy_share
        )
        if episode is None:
            return None
        return Demonstration(episode.success, episode.observations, episode.actions)

    return make_env, run_expert
