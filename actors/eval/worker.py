"""Evaluation worker, the unit of parallelism of ``rlvla3 eval``: ``EvalWorker`` (a plain class;
``actors.eval.evaluate`` applies ``ray.remote``) runs whole episodes on one env from the env
registry (LIBERO's in its own process: a simulator crash costs one episode,
``EpisodeOutcome.fault``) with the policy an ``ActionSource`` names: random chunks, a
checkpoint's mode, or the checkpoint sampled as RL samples it, told its own instruction or
another. An episode is a function of (policy, task, initial state, seeds, settings) alone, never
of the worker, what ran before or the host CPU (per-episode seeds, ``rlvla3.numerics`` pinned);
``EpisodeOutcome.digest``, a hash of every action executed, checks that bit for bit::

    worker = EvalWorker(Named("libero", {"suite": "libero_spatial"}), ActionSource("random"))
    worker.set_source(ActionSource("checkpoint", "runs/RUN", sampling=(("noise_level", 0.5),)))
    outcome = worker.run_episode(task_id=0, init_state_id=3, record=True)  # with its frames

Design notes: docs/concepts/evaluation.md#the-worker"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from rlvla3.config import Named
from rlvla3.numerics import PINNED_BLAS
from rlvla3.types import EnvSpec, ObsBatch, Observation


@dataclass(frozen=True)
class ActionSource:
    """Where actions come from: ``kind`` is ``"random"`` or ``"checkpoint"`` (with ``path``)."""

    kind: str
    path: str = ""
    sampling: tuple[tuple[str, float], ...] | None = None
    """None: act deterministically. Otherwise sample, with these ``(policy option, value)``
    overrides applied to the checkpoint's policy config."""
    seed: int = 0
    """Seed of sampled episodes' noise (with the task and initial state)."""
    instructions: tuple[str, ...] | None = None
    """What the policy is told in env task ``i`` (None: the env's own instruction)."""


LANGUAGE_MODES = ("own", "blank", "shifted")
"""What an evaluated policy is told: each task's own instruction (the protocol), an empty
one, or the next task's."""


def given_instructions(
    mode: str, suite_instructions: Sequence[str], tasks: Sequence[int]
) -> tuple[str, ...] | None:
    """The instruction the policy is told in each evaluated task (``tasks``: suite task ids, in
    env task order) under ``mode``: None for ``own``; ``""`` for ``blank``; for ``shifted``,
    suite task ``t`` is told task ``(t + 1) % N``'s instruction, a valid instruction of the
    suite that asks for something else in this scene."""
    if mode not in LANGUAGE_MODES:
        raise ValueError(f"unknown language mode {mode!r}; choose one of {LANGUAGE_MODES}")
    if mode == "own":
        return None
    if mode == "blank":
        return tuple("" for _ in tasks)
    n = len(suite_instructions)
    if n < 2 or len(set(suite_instructions)) < n:
        raise ValueError("shifted instructions need a suite of at least two distinct ones")
    return tuple(suite_instructions[(t + 1) % n] for t in tasks)


def episode_seed(seed: int, task_id: int, init_state_id: int) -> int:
    """The noise seed of one sampled episode: a fixed function of what the episode is."""
    return int(np.random.SeedSequence([seed, task_id, init_state_id]).generate_state(1)[0])


def float_options(cfg: Any) -> dict[str, float]:
    """The float fields of a policy config (what sampled acting may override)."""
    return {f.name: v for f in fields(cfg)
            if isinstance(v := getattr(cfg, f.name), float)}


def apply_sampling_options(policy: Any, options: tuple[tuple[str, float], ...]) -> None:
    """Override float options of ``policy``'s config (``noise_level``, ``init_noise``, ...),
    validated; a name the config lacks, or one that is not a float, is refused."""
    from rlvla3.config import ConfigError

    if not options:
        return
    cfg = policy.cfg
    floats = sorted(float_options(cfg))
    for name, _ in options:
        if name not in floats:
            raise ConfigError(f"policy.options.{name}", f"not a sampling option of "
                              f"{type(cfg).__name__}; its float options: {floats}")
    cfg = replace(cfg, **{k: float(v) for k, v in options})
    cfg.validate()
    policy.cfg = cfg


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """What one evaluation episode produced."""

    task_id: int
    """Env task id (index into the evaluated task list)."""
    init_state_id: int
    success: bool
    steps: int
    """Low-level simulator steps."""
    decisions: int
    """Action chunks executed."""
    seconds: float
    instruction: str
    fault: str = ""
    """Non-empty when a simulator fault ended the episode."""
    digest: str = ""
    """sha256 (16 hex digits) of every action executed, as float32: equal digests mean the
    same trajectory, bit for bit."""
    frames: np.ndarray | None = None
    """uint8 ``[T, H, W_total, 3]`` when the episode was recorded."""
    trace: tuple[dict[str, str], ...] | None = None
    """When traced: per decision, hashes of each camera image, the state and the action
    (``actors.eval.trace.decision_hashes``)."""


def _frame(obs: Observation) -> np.ndarray:
    return np.concatenate([obs.images[c] for c in sorted(obs.images)], axis=1)


class EvalWorker:
    """Runs episodes one at a time; see the module docstring."""

    def __init__(self, env: Named, source: ActionSource, seed: int = 0, torch_threads: int = 1,
                 numerics: str = "native", blas: str = PINNED_BLAS):
        """``numerics``: ``rlvla3.numerics`` mode of the policy's and the simulator's arithmetic;
        ``pinned`` needs this process to have started with
        ``rlvla3.numerics.env_vars("pinned", blas)`` (the simulator process inherits it)."""
        from envs import make_env
        from rlvla3 import numerics as numerics_mod

        self.numerics = numerics_mod.apply(numerics, torch_threads, blas)
        self.env = make_env(env, seed=seed)
        self._suite_tasks = tuple(env.options.get("task_ids") or ())
        """Env task id ``i`` is suite task ``_suite_tasks[i]`` (empty: the same number)."""
        self.spec: EnvSpec = self.env.spec
        self.source = source
        self.rng = np.random.default_rng(seed)
        """Random actions; reseeded at each episode's start (``episode_seed``)."""
        self.policy: Any = None
        self.set_source(source)

    def set_source(self, source: ActionSource) -> None:
        """Act with ``source`` from the next episode on (a source that fails to load leaves
        the previous one in place)."""
        policy = None
        if source.kind == "checkpoint":
            from rlvla3.checkpoint.files import load_policy

            policy, _ = load_policy(source.path)
            policy.eval()
            apply_sampling_options(policy, source.sampling or ())
        elif source.kind != "random":
            raise ValueError(f"unknown action source {source.kind!r}")
        elif source.sampling is not None:
            raise ValueError("a random action source has nothing to sample")
        self.source, self.policy = source, policy

    def describe(self) -> dict[str, Any]:
        """Package versions here, the policy's arithmetic and the host CPU, and the env's own
        description (renderer, control rate)."""
        from rlvla3.fingerprint import package_versions
        from rlvla3.numerics import host

        describe = getattr(self.env, "describe", None)
        out = {"packages": package_versions(), "numerics": self.numerics, "host": host(),
               **(describe() if describe is not None else {})}
        if self.policy is not None and self.source.sampling is not None:
            out["sampling"] = float_options(self.policy.cfg)  # what the episodes sample with
        return out

    def _act(self, obs: Observation, task_id: int) -> np.ndarray:
        if self.source.instructions is not None:
            obs = replace(obs, instruction=self.source.instructions[task_id])
        if self.policy is None:
            return self.rng.uniform(-1.0, 1.0, size=(self.spec.chunk_len, self.spec.action_dim))
        sampled = self.source.sampling is not None
        return self.policy.act(ObsBatch.stack([obs]), deterministic=not sampled).actions[0]

    def run_episode(self, task_id: int, init_state_id: int, record: bool = False,
                    trace: bool = False) -> EpisodeOutcome:
        """One whole episode; ``record``: with its frames, ``trace``: with its trace."""
        from actors.eval.trace import decision_hashes

        t0 = time.perf_counter()
        task = self._suite_tasks[task_id] if self._suite_tasks else task_id
        seed = episode_seed(self.source.seed, task, init_state_id)
        if self.policy is None:
            self.rng = np.random.default_rng(seed)
        elif self.source.sampling is not None:
            self.policy.seed_sampling(seed)
        obs = self.env.reset(task_id, init_state_id)
        frames = [_frame(obs)] if record else []
        hashes = []
        steps = decisions = 0
        digest = hashlib.sha256()
        while True:
            action = self._act(obs, task_id)
            digest.update(np.asarray(action, dtype=np.float32).tobytes())
            if trace:
                hashes.append(decision_hashes(obs, action))
            result = self.env.step(action)
            obs = result.obs
            steps += result.steps
            decisions += 1
            if record and not result.fault:
                frames.append(_frame(obs))
            if result.terminated or result.truncated:
                break
        return EpisodeOutcome(
            task_id=task_id,
            init_state_id=init_state_id,
            success=bool(result.success),
            steps=steps,
            decisions=decisions,
            seconds=time.perf_counter() - t0,
            instruction=obs.instruction,
            fault=result.fault,
            frames=np.stack(frames) if record else None,
            digest=digest.hexdigest()[:16],
            trace=tuple(hashes) if trace else None,
        )

    def stats(self) -> Mapping[str, int]:
        """Simulator restarts so far (0 for an env without process isolation)."""
        return {"restarts": int(getattr(self.env, "restarts", 0))}

    def close(self) -> None:
        self.env.close()
