"""Record demonstrations: an expert drives envs in parallel Ray workers; successes become a dataset.

``record_dataset`` is env-agnostic: it takes ``make_env`` (builds an ``Env`` in the worker) and
``run_expert`` (plays one episode and returns a ``Demonstration``, or None when the expert does
not cover the task). Each worker is a Ray task over a slice of the (task, initial state) jobs;
workers return whole episodes and the driver writes the successful ones with
``LeRobotWriter`` in job order, so the dataset does not depend on which worker finished first.
``libero_recorder`` wires the scripted LIBERO pick-and-place expert (``envs.libero_expert``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from datalake.writer import EpisodeRecord, LeRobotWriter, WriterConfig
from rlvla3.protocols import Env
from rlvla3.types import Observation

log = logging.getLogger("datalake.record")


@dataclass(frozen=True)
class Demonstration:
    """One expert episode: what the policy saw and did at every low-level step."""

    success: bool
    observations: Sequence[Observation]
    actions: Sequence[np.ndarray]


EnvFactory = Callable[[], Env]
Expert = Callable[[Env, int, int], Demonstration | None]


def to_record(demo: Demonstration) -> EpisodeRecord:
    """A demonstration as writer input (images stacked per camera)."""
    obs = demo.observations
    return EpisodeRecord(
        images={cam: np.stack([o.images[cam] for o in obs]) for cam in obs[0].images},
        state=np.stack([o.state for o in obs]).astype(np.float32),
        action=np.stack(demo.actions).astype(np.float32),
        task=obs[0].instruction,
    )


def _work(
    make_env: EnvFactory, run_expert: Expert, jobs: Sequence[tuple[int, int, int]]
) -> list[tuple[int, Any]]:
    env = make_env()
    out: list[tuple[int, Any]] = []
    try:
        for order, task_id, init_id in jobs:
            try:
                demo = run_expert(env, task_id, init_id)
            except Exception as exc:  # a simulator fault loses this episode, not the recording
                out.append((order, f"task {task_id} init {init_id}: {type(exc).__name__}: {exc}"))
                continue
            if demo is None:
                out.append((order, f"task {task_id}: not covered by the expert"))
            elif not demo.success:
                out.append((order, f"task {task_id} init {init_id}: expert failed"))
            else:
                out.append((order, to_record(demo)))
    finally:
        env.close()
    return out


def record_dataset(
    out: str,
    make_env: EnvFactory,
    run_expert: Expert,
    jobs: Sequence[tuple[int, int]],
    workers: int,
    writer_config: WriterConfig,
) -> dict[str, Any]:
    """Run ``jobs`` ((task_id, init_state_id) pairs) over ``workers`` Ray tasks; write successes."""
    import ray

    remote = ray.remote(num_cpus=1)(_work)
    indexed = [(i, t, s) for i, (t, s) in enumerate(jobs)]
    slices = [indexed[w::workers] for w in range(workers) if indexed[w::workers]]
    refs = [remote.remote(make_env, run_expert, part) for part in slices]
    results: dict[int, Any] = {}
    for part in ray.get(refs):
        results.update(dict(part))
    writer: LeRobotWriter | None = None
    failures: list[str] = []
    for order in sorted(results):
        item = results[order]
        if isinstance(item, str):
            failures.append(item)
            log.warning("not recorded: %s", item)
            continue
        if writer is None:
            cams = {c: tuple(v.shape[1:3]) for c, v in item.images.items()}
            writer = LeRobotWriter(
                out, cams, item.state.shape[1], item.action.shape[1], writer_config
            )
        writer.add_episode(item)
    recorded = 0 if writer is None else len(writer.episodes)
    if writer is not None:
        writer.close()
    return {"out": out, "jobs": len(jobs), "recorded": recorded, "failed": failures}


def libero_recorder(suite: str, image_size: tuple[int, int]) -> tuple[EnvFactory, Expert]:
    """``make_env`` / ``run_expert`` for the scripted LIBERO pick-and-place expert."""
    from envs.libero import LiberoConfig, LiberoEnv
    from envs.libero_expert import run_expert_episode

    cfg = LiberoConfig(suite=suite, image_size=image_size, process=False)

    def make_env() -> Env:
        return LiberoEnv(cfg)

    def run_expert(env: Env, task_id: int, init_id: int) -> Demonstration | None:
        episode = run_expert_episode(env, task_id, init_id, record=True)
        if episode is None:
            return None
        return Demonstration(episode.success, episode.observations, episode.actions)

    return make_env, run_expert
