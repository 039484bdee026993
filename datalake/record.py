"""Record demonstrations: an expert drives envs in parallel Ray workers; successes become a dataset.

``record_dataset`` is env-agnostic: it takes ``make_env`` (builds an ``Env`` in the worker) and
``run_expert`` (plays one episode and returns a ``Demonstration``, or None when the expert does
not cover the task). Each worker is a Ray actor holding one env; (task, initial state, take)
jobs are spread over them.

Resumable: every finished job is staged on disk as it ends (``Staging``: one ``.npz`` per
episode and a line in ``outcomes.jsonl``, in ``<out>.partial``); re-running the same recording
skips finished jobs. When all are done the driver writes the successful episodes with
``LeRobotWriter`` in job order (so the dataset depends neither on which worker finished first
nor on interruptions), adds ``meta/record.json`` (the recording's provenance, including the
train/test split it used) and removes the staging directory. ``libero_recorder`` wires the
scripted LIBERO pick-and-place expert (``envs.libero.expert``); its episodes start from fresh
placements unless told otherwise (``envs.libero.scenes``). ``metaworld_recorder`` wires
MetaWorld's scripted policies (``envs.metaworld.expert``) on the training split;
``isaaclab_recorder`` the Isaac Lab reach's scripted expert (``envs.isaaclab.expert``) on the
training layouts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datalake.writer import EpisodeRecord, LeRobotWriter, WriterConfig
from envs.libero.scenes import RECORD_SIDECAR
from rlvla3.protocols import Env
from rlvla3.types import ObsBatch, Observation

if TYPE_CHECKING:
    from envs.libero.env import Suite
    from envs.metaworld.env import Benchmark

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

    def run_job(self, job: Job) -> tuple[Job, EpisodeRecord | str, bool]:
        """``(job, the recorded episode or why there is none, whether a fault lost it)``."""
        task_id, init_id, take = job
        where = f"task {task_id} init {init_id} take {take}"
        try:
            demo = self.run_expert(self.env, task_id, init_id, take)
        except Exception as exc:  # a simulator fault loses this episode, not the recording
            return job, f"{where}: {type(exc).__name__}: {exc}", True
        if demo is None:
            return job, f"task {task_id}: not covered by the expert", False
        if not demo.success:
            return job, f"{where}: expert failed", False
        return job, to_record(demo), False

    def close(self) -> None:
        self.env.close()


def staging_dir(out: str) -> Path:
    """Where a recording keeps finished episodes until the dataset is written: beside a local
    ``out`` (``<out>.partial``), or under ``.record-partial/`` here for a remote URI."""
    if "://" in out and not out.startswith("file://"):
        digest = hashlib.sha1(out.encode()).hexdigest()[:16]
        return Path(".record-partial") / digest
    return Path(out.removeprefix("file://").rstrip("/") + ".partial")


def _job_name(job: Job) -> str:
    return "-".join(str(x) for x in job)


class Staging:
    """Finished episodes of an unfinished recording, one file each, plus an outcome log.

    ``outcomes.jsonl`` gets a line per finished job (``recorded`` or why not) after the
    episode's ``.npz`` is in place, so a recording killed at any point resumes without
    losing or duplicating an episode. Jobs lost to a simulator fault run again on resume;
    an expert failure or an uncovered task is final (the expert is deterministic)."""

    def __init__(self, root: Path, provenance: Mapping[str, Any]):
        self.root = root
        self.episodes = root / "episodes"
        self.log = root / "outcomes.jsonl"
        manifest = root / "manifest.json"
        if manifest.is_file():
            stored = json.loads(manifest.read_text()).get("provenance", {})
            diff = [f"{k}: {stored.get(k)!r} != {provenance.get(k)!r}"
                    for k in sorted(set(stored) | set(provenance))
                    if k not in RESUME_FREE and stored.get(k) != provenance.get(k)]
            if diff:
                raise ValueError(
                    f"{root} holds an unfinished recording with other settings "
                    f"({'; '.join(diff)}): re-run that command, or delete {root}"
                )
        self.episodes.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"provenance": dict(provenance)}, indent=2))
        self.outcomes: dict[Job, dict[str, Any]] = {}
        if self.log.is_file():
            for line in self.log.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # cut short by a crash: that job runs again
                    continue
                job = tuple(row["job"])
                if row["recorded"] and not self.path(job).is_file():
                    continue
                self.outcomes[job] = row

    def path(self, job: Job) -> Path:
        return self.episodes / f"{_job_name(job)}.npz"

    def finished(self, job: Job) -> bool:
        row = self.outcomes.get(job)
        return row is not None and (row["recorded"] or not row.get("fault", False))

    def add(self, job: Job, item: EpisodeRecord | str, fault: bool) -> None:
        if isinstance(item, EpisodeRecord):
            tmp = self.path(job).with_suffix(".tmp.npz")
            images: dict[str, Any] = {f"image.{cam}": v for cam, v in item.images.items()}
            np.savez(
                tmp, state=item.state, action=item.action, task=np.array(item.task), **images
            )
            tmp.replace(self.path(job))
            row = {"job": list(job), "recorded": True}
        else:
            row = {"job": list(job), "recorded": False, "why": item, "fault": fault}
        self.outcomes[job] = row
        with self.log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def load(self, job: Job) -> EpisodeRecord:
        with np.load(self.path(job)) as data:
            images = {
                k.removeprefix("image."): data[k] for k in data.files if k.startswith("image.")
            }
            return EpisodeRecord(images, data["state"], data["action"], str(data["task"]))


RESUME_FREE = ("workers", "codec", "fps")
"""Recording settings a resume may change (they do not change which episodes are recorded)."""


def record_dataset(
    out: str,
    make_env: EnvFactory,
    run_expert: Expert,
    jobs: Sequence[Job],
    workers: int,
    writer_config: WriterConfig,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Play ``jobs`` ((task_id, init_state_id, take)) on ``workers`` Ray actors; write successes.

    Each finished episode is staged on disk as it arrives (``Staging``, in ``staging_dir``), so
    re-running the same recording continues where it stopped; once every job has finished the
    dataset is written from the staged episodes in job order (the dataset does not depend on
    which worker finished first, nor on how often the recording was interrupted), together
    with ``meta/record.json`` (``provenance``, the jobs and why each missing one is missing),
    and the staging directory is removed."""
    import ray
    from ray.util import ActorPool

    provenance = dict(provenance or {})
    sidecar = Path(out.removeprefix("file://")) / RECORD_SIDECAR
    if sidecar.is_file():  # a finished recording: the same command has nothing left to do
        done = json.loads(sidecar.read_text())
        return {"out": out, "jobs": len(jobs), "recorded": done["recorded"],
                "failed": done["failed"], "already_complete": True}
    staging = Staging(staging_dir(out), provenance)
    todo = [job for job in jobs if not staging.finished(job)]
    if len(todo) < len(jobs):
        print(f"[record] resuming: {len(jobs) - len(todo)} of {len(jobs)} jobs already done",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if todo:
        # A simulator that crashes its process takes the actor down: restart it, retry the job.
        actor = ray.remote(num_cpus=1, max_restarts=2, max_task_retries=1)(RecordWorker)
        pool_actors = [
            actor.remote(make_env, run_expert) for _ in range(max(1, min(workers, len(todo))))
        ]
        try:
            pool = ActorPool(pool_actors)
            results = pool.map_unordered(lambda a, job: a.run_job.remote(job), todo)
            for done, (job, item, fault) in enumerate(results, 1):
                staging.add(job, item, fault)
                if isinstance(item, str):
                    log.warning("not recorded: %s", item)
                lost = sum(1 for row in staging.outcomes.values() if not row["recorded"])
                rate = (time.perf_counter() - t0) / done
                print(f"[record] {len(jobs) - len(todo) + done}/{len(jobs)} episodes "
                      f"({lost} not recorded), {rate:.1f} s/episode", file=sys.stderr, flush=True)
        finally:
            ray.get([a.close.remote() for a in pool_actors])  # type: ignore[attr-defined]
    faults = [job for job in jobs if not staging.finished(job)]
    failed = [staging.outcomes[job]["why"] for job in jobs
              if job in staging.outcomes and not staging.outcomes[job]["recorded"]]
    if faults:  # keep the staging: the next run retries these
        return {"out": out, "jobs": len(jobs), "recorded": 0, "failed": failed,
                "unfinished": [list(j) for j in faults],
                "faults": [staging.outcomes[j]["why"] for j in faults if j in staging.outcomes]}
    recorded = [job for job in jobs if staging.outcomes[job]["recorded"]]
    writer: LeRobotWriter | None = None
    for job in recorded:
        item = staging.load(job)
        if writer is None:
            cams = {c: tuple(v.shape[1:3]) for c, v in item.images.items()}
            writer = LeRobotWriter(out, cams, item.state.shape[1], item.action.shape[1],
                                   writer_config)
        writer.add_episode(item)
    if writer is not None:
        writer.close()
        meta = {"provenance": provenance, "jobs": [list(j) for j in jobs],
                "recorded_jobs": [list(j) for j in recorded], "recorded": len(recorded),
                "failed": failed, "split": provenance.get("split", {})}
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        sidecar.write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(staging.root, ignore_errors=True)
    return {"out": out, "jobs": len(jobs), "recorded": len(recorded), "failed": failed}


def libero_recorder(
    suite: Suite,
    image_size: tuple[int, int],
    action_noise: float = 0.0,
    policy: str = "",
    policy_share: float = 0.5,
    scenes: Mapping[str, Any] | None = None,
) -> tuple[EnvFactory, Expert]:
    """``make_env`` / ``run_expert`` for the scripted LIBERO pick-and-place expert.

    Take 0 of an initial state is the clean expert; take k > 0 executes its motion with
    ``action_noise`` (seeded by k). Given a ``policy`` checkpoint, that policy drives a
    ``policy_share`` of the decisions of every take (its chunks, deterministic actions). Either
    way the recorded actions are the expert's for the states reached (DAgger-style labels).
    ``scenes``: ``LiberoConfig`` scene options (``placements``, ``placement_seed``,
    ``allow_eval_overlap``); default: fresh placements, seed 0."""
    from envs.libero.env import LiberoConfig, LiberoEnv
    from envs.libero.expert import run_expert_episode

    cfg = LiberoConfig(suite=suite, image_size=image_size, process=False, **dict(scenes or {}))
    driver_cache: dict[str, Any] = {}

    def make_env() -> Env:
        return LiberoEnv(cfg)

    def driver(obs: Observation) -> np.ndarray:
        if "policy" not in driver_cache:
            from rlvla3.checkpoint.files import load_policy

            driver_cache["policy"], _ = load_policy(policy)
        return driver_cache["policy"].act(ObsBatch.stack([obs]), deterministic=True).actions[0]

    def run_expert(env: Env, task_id: int, init_id: int, take: int) -> Demonstration | None:
        noise = action_noise if take > 0 else 0.0
        drive = driver if policy else None
        assert isinstance(env, LiberoEnv)
        episode = run_expert_episode(
            env, task_id, init_id, True, noise, seed=take, driver=drive, driver_share=policy_share
        )
        if episode is None:
            return None
        return Demonstration(episode.success, episode.observations, episode.actions)

    return make_env, run_expert


def metaworld_recorder(
    benchmark: Benchmark,
    image_size: tuple[int, int],
    action_noise: float = 0.0,
    options: Mapping[str, Any] | None = None,
) -> tuple[EnvFactory, Expert]:
    """``make_env`` / ``run_expert`` for MetaWorld's scripted policies (``envs.metaworld.expert``).

    Take 0 of an initial state is the clean expert; take k > 0 executes its motion with
    ``action_noise`` (seeded by k) while recording the expert's actions. ``options``:
    ``MetaWorldConfig`` fields (``split``, ``state_seed``, ``allow_eval_overlap``, ``cameras``,
    ``max_steps``); default: the training split, seed 0."""
    from envs.metaworld.env import MetaWorldConfig, MetaWorldEnv
    from envs.metaworld.expert import run_expert_episode

    cfg = MetaWorldConfig(benchmark=benchmark, image_size=image_size, process=False,
                          **dict(options or {}))

    def make_env() -> Env:
        return MetaWorldEnv(cfg)

    def run_expert(env: Env, task_id: int, init_id: int, take: int) -> Demonstration | None:
        noise = action_noise if take > 0 else 0.0
        assert isinstance(env, MetaWorldEnv)
        episode = run_expert_episode(env, task_id, init_id, True, noise, seed=take)
        return Demonstration(episode.success, episode.observations, episode.actions)

    return make_env, run_expert


def isaaclab_recorder(
    image_size: tuple[int, int],
    action_noise: float = 0.0,
    options: Mapping[str, Any] | None = None,
) -> tuple[EnvFactory, Expert]:
    """``make_env`` / ``run_expert`` for the Isaac Lab reach's scripted expert
    (``envs.isaaclab.expert``): one server of one sub-env per worker, stepped one action at a
    time, with the target's position in its state for the expert (never recorded).

    Take 0 of a layout is the clean expert; take k > 0 executes its actions with
    ``action_noise`` (seeded by k) while recording the expert's. ``options``:
    ``IsaacLabConfig`` fields (``split``, ``train_states``, ``allow_eval_overlap``,
    ``cameras``); default: the training layouts."""
    from envs.isaaclab.env import make_isaaclab_env
    from envs.isaaclab.expert import run_expert_episode

    env_options = {"task": "reach", "num_envs": 1, "chunk_len": 1,
                   "image_size": list(image_size), **dict(options or {}),
                   "task_options": {"state": "target"}}

    def make_env() -> Env:
        return make_isaaclab_env(env_options, "--suite isaaclab_reach")

    def run_expert(env: Env, task_id: int, init_id: int, take: int) -> Demonstration | None:
        noise = action_noise if take > 0 else 0.0
        episode = run_expert_episode(env, task_id, init_id, noise, seed=take)
        return Demonstration(episode.success, episode.observations, episode.actions)

    return make_env, run_expert
