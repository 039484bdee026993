"""Latency replay: an env that reproduces a simulator's step and reset times, and nothing else,
to benchmark the asynchronous pipeline at LIBERO scale (64+ env slots) on a 2-core machine.
Each ``step`` and ``reset`` sleeps for a latency drawn from a ``LatencyModel`` (``distribution``:
a measured JSON file, by default ``data/libero_latency.json``, or ``"synthetic"``) times
``time_scale`` (0: no sleep). The actions are ignored: an episode succeeds with probability
``success_rate`` after a drawn number of steps, or is truncated with reward 0 after
``max_decisions * chunk_len`` steps. A slot's draws depend only on the factory ``seed``; a step
allocates no image::

    env = make_latency_replay_env({"distribution": "synthetic"}, "env.options", seed=3)
    obs = env.reset(task_id=0, init_state_id=0)  # sleeps one drawn reset latency
    stats = summarize_latency({"distribution": "data/libero_latency.json"})  # for benchmarks

Design notes: docs/concepts/simulators.md#latency-replay"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rlvla3.config import ConfigError, build, require
from rlvla3.types import EnvSpec, Observation, StepResult

CAMERA = "top"
SYNTHETIC = "synthetic"
MEASURED = "data/libero_latency.json"
"""The default: LIBERO libero_spatial step and reset latencies measured on this kind of machine."""
Z99 = 2.3263478740408408
"""The 0.99 quantile of the standard normal."""


@dataclass(frozen=True)
class LatencyReplayConfig:
    """Options of the latency-replay env (``env.options`` when ``env.name`` is
    ``latency_replay``)."""

    distribution: str = MEASURED
    """A latency JSON file (its format: docs/concepts/simulators.md#latency-replay; default:
    LIBERO as measured here, with the command that re-measures it inside) or ``"synthetic"``
    (the parametric model below)."""
    time_scale: float = 1.0
    """Multiplies every latency before sleeping (small values for fast tests; 0: no sleep)."""
    step_ms_min: float = 60.0
    """Synthetic: lowest scene mean latency of one low-level step, ms."""
    step_ms_max: float = 180.0
    """Synthetic: highest scene mean latency of one low-level step, ms."""
    step_p99_ratio: float = 1.2
    """Synthetic: p99 / mean of the step latency within one scene."""
    reset_ms_min: float = 1500.0
    """Synthetic: shortest hard reset, ms."""
    reset_ms_max: float = 2300.0
    """Synthetic: longest hard reset outside the contention tail, ms."""
    reset_tail_fraction: float = 0.1
    """Synthetic: fraction of resets drawn from the tail ``[reset_ms_max, reset_tail_ms_max]``."""
    reset_tail_ms_max: float = 6000.0
    """Synthetic: longest reset of the contention tail, ms."""
    success_rate: float = 0.5
    """Probability that an episode ends in success."""
    success_steps_min: int = 80
    """Shortest successful episode, low-level steps."""
    success_steps_max: int = 200
    """Longest successful episode, low-level steps (at most ``max_decisions * chunk_len``)."""
    chunk_len: int = 5
    """Low-level steps per decision."""
    max_decisions: int = 44
    """Decisions after which an episode is truncated (44 x 5 = 220 steps)."""
    num_tasks: int = 10
    """Number of task ids."""
    num_init_states: int = 50
    """Number of initial-state ids per task."""
    image_size: int = 16
    """Height and width of the ``top`` camera image."""
    state_dim: int = 8
    """Length of the state vector."""
    action_dim: int = 7
    """Length of one low-level action (ignored, but it sizes the policy)."""

    def validate(self) -> None:
        require(self.time_scale >= 0.0, "time_scale", f"must be >= 0, got {self.time_scale}")
        require(
            0.0 < self.step_ms_min <= self.step_ms_max,
            "step_ms_max",
            f"need 0 < step_ms_min <= step_ms_max, got {self.step_ms_min}, {self.step_ms_max}",
        )
        require(
            1.0 <= self.step_p99_ratio <= 2.0,
            "step_p99_ratio",
            f"must be in [1, 2], got {self.step_p99_ratio}",
        )
        require(
            0.0 < self.reset_ms_min <= self.reset_ms_max <= self.reset_tail_ms_max,
            "reset_tail_ms_max",
            "need 0 < reset_ms_min <= reset_ms_max <= reset_tail_ms_max, got "
            f"{self.reset_ms_min}, {self.reset_ms_max}, {self.reset_tail_ms_max}",
        )
        require(
            0.0 <= self.reset_tail_fraction <= 1.0,
            "reset_tail_fraction",
            f"must be in [0, 1], got {self.reset_tail_fraction}",
        )
        require(
            0.0 <= self.success_rate <= 1.0,
            "success_rate",
            f"must be in [0, 1], got {self.success_rate}",
        )
        require(self.chunk_len >= 1, "chunk_len", f"must be >= 1, got {self.chunk_len}")
        require(self.max_decisions >= 1, "max_decisions", f"must be >= 1, got {self.max_decisions}")
        limit = self.chunk_len * self.max_decisions
        require(
            1 <= self.success_steps_min <= self.success_steps_max <= limit,
            "success_steps_max",
            f"need 1 <= success_steps_min <= success_steps_max <= max_decisions * chunk_len "
            f"= {limit}, got {self.success_steps_min}, {self.success_steps_max}",
        )
        for name in ("num_tasks", "num_init_states", "state_dim", "action_dim"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be >= 1, got {value}")
        require(self.image_size >= 1, "image_size", f"must be >= 1, got {self.image_size}")
        if self.distribution != SYNTHETIC:
            try:
                load_latency_file(self.distribution)
            except ValueError as exc:
                raise ConfigError("distribution", str(exc)) from None


class LatencyModel(Protocol):
    """Where latencies come from. A *scene* is the per-episode draw (e.g. its mean step time)."""

    @property
    def description(self) -> str: ...

    def reset_ms(self, rng: np.random.Generator) -> float:
        """One hard-reset latency, ms."""
        ...

    def scene(self, rng: np.random.Generator) -> Any:
        """Draw the per-episode latency regime."""
        ...

    def steps_ms(self, scene: Any, rng: np.random.Generator, n: int) -> np.ndarray:
        """Latencies of ``n`` consecutive low-level steps of ``scene``, ms (float64 ``[n]``)."""
        ...


@dataclass(frozen=True)
class SyntheticLatency:
    """The parametric LIBERO-like model (docs/concepts/simulators.md#latency-replay)."""

    step_ms_min: float
    step_ms_max: float
    step_p99_ratio: float
    reset_ms_min: float
    reset_ms_max: float
    reset_tail_fraction: float
    reset_tail_ms_max: float

    @property
    def description(self) -> str:
        return (
            f"synthetic: step scene mean U[{self.step_ms_min:g}, {self.step_ms_max:g}] ms, "
            f"p99 {self.step_p99_ratio:g}x mean; reset U[{self.reset_ms_min:g}, "
            f"{self.reset_ms_max:g}] ms, {self.reset_tail_fraction:.0%} tail up to "
            f"{self.reset_tail_ms_max:g} ms"
        )

    def reset_ms(self, rng: np.random.Generator) -> float:
        if rng.random() < self.reset_tail_fraction:
            return float(rng.uniform(self.reset_ms_max, self.reset_tail_ms_max))
        return float(rng.uniform(self.reset_ms_min, self.reset_ms_max))

    def scene(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.step_ms_min, self.step_ms_max))

    def steps_ms(self, scene: float, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma = (self.step_p99_ratio - 1.0) / Z99
        return scene * np.maximum(1.0 + sigma * rng.standard_normal(n), 0.1)


@dataclass(frozen=True)
class EmpiricalLatency:
    """Bootstrap replay of measured samples, one step-latency group per episode."""

    description: str
    command: str
    step_groups: tuple[np.ndarray, ...]
    """float64 samples (ms) of each group."""
    group_names: tuple[str, ...]
    reset_samples: np.ndarray
    """float64 samples (ms) of hard resets."""

    def reset_ms(self, rng: np.random.Generator) -> float:
        return float(self.reset_samples[rng.integers(len(self.reset_samples))])

    def scene(self, rng: np.random.Generator) -> np.ndarray:
        return self.step_groups[rng.integers(len(self.step_groups))]

    def steps_ms(self, scene: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
        return scene[rng.integers(len(scene), size=n)]


def _samples(value: Any, where: str, source: str) -> np.ndarray:
    ok = (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )
    if ok:
        array = np.asarray(value, dtype=np.float64)
        ok = bool(np.all(np.isfinite(array)) and np.all(array > 0))
    if not ok:
        raise ValueError(f"{source}: {where} must be a non-empty list of positive numbers (ms)")
    return array


def resolve_latency_path(path: str | Path) -> Path:
    """``path`` as given if it exists, else relative to the ``envs`` package directory."""
    given = Path(path)
    if given.is_file() or given.is_absolute():
        return given
    return Path(__file__).parent / given


def load_latency_file(path: str | Path) -> EmpiricalLatency:
    """Read and check a latency JSON file; any problem is a ``ValueError`` naming the key."""
    file = resolve_latency_path(path)
    if not file.is_file():
        raise ValueError(f"no such latency file: {path} (nor {file})")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: top level must be an object")
    missing = [k for k in ("description", "command", "step_ms", "reset_ms") if k not in data]
    if missing:
        raise ValueError(
            f"{file}: missing key(s) {missing}; expected {{'description': str, 'command': str, "
            "'step_ms': {group: [ms, ...]}, 'reset_ms': [ms, ...]}"
        )
    for key in ("description", "command"):
        if not isinstance(data[key], str):
            raise ValueError(f"{file}: {key} must be a string")
    groups = data["step_ms"]
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{file}: step_ms must be a non-empty object {{group: [ms, ...]}}")
    names = tuple(str(name) for name in groups)
    steps = tuple(_samples(groups[n], f"step_ms[{n!r}]", str(file)) for n in names)
    resets = _samples(data["reset_ms"], "reset_ms", str(file))
    return EmpiricalLatency(data["description"], data["command"], steps, names, resets)


def make_latency_model(config: LatencyReplayConfig) -> LatencyModel:
    """The latency source chosen by ``config.distribution``."""
    if config.distribution != SYNTHETIC:
        return load_latency_file(config.distribution)
    return SyntheticLatency(
        config.step_ms_min,
        config.step_ms_max,
        config.step_p99_ratio,
        config.reset_ms_min,
        config.reset_ms_max,
        config.reset_tail_fraction,
        config.reset_tail_ms_max,
    )


def draw_success_step(config: LatencyReplayConfig, rng: np.random.Generator) -> int | None:
    """The low-level step at which an episode succeeds, or ``None`` for a failed episode."""
    if rng.random() >= config.success_rate:
        return None
    return int(rng.integers(config.success_steps_min, config.success_steps_max + 1))


def _task_images(config: LatencyReplayConfig) -> np.ndarray:
    """uint8 ``[num_tasks, S, S, 3]``: a flat colour and a bright row, both set by the task."""
    size = config.image_size
    images = np.empty((config.num_tasks, size, size, 3), dtype=np.uint8)
    for task in range(config.num_tasks):
        hue = task * 0.6180339887 % 1.0  # golden-ratio hues: distinct for nearby ids
        rgb = [int(127 + 100 * math.cos(2 * math.pi * (hue + k / 3))) for k in range(3)]
        images[task] = rgb
        images[task, task % size] = 255
    images.flags.writeable = False
    return images


def _task_states(config: LatencyReplayConfig) -> np.ndarray:
    """float32 ``[num_tasks, state_dim]``: a fixed per-task vector in ``[-1, 1]``."""
    rng = np.random.default_rng(0)
    return rng.uniform(-1.0, 1.0, (config.num_tasks, config.state_dim)).astype(np.float32)


class LatencyReplayEnv:
    """A timing model of a simulator; satisfies ``rlvla3.protocols.Env``. Actions are ignored."""

    def __init__(self, config: LatencyReplayConfig, seed: int):
        self.config = config
        self.spec = latency_replay_spec_of(config)
        self.model = make_latency_model(config)
        self._rng = np.random.default_rng(seed)
        self._images = tuple(_task_images(config))  # one read-only view per task
        self._states = _task_states(config)
        self._limit = config.chunk_len * config.max_decisions
        self._scene: Any = None
        self._success_step: int | None = None
        self._task = 0
        self._steps = 0
        self._decisions = 0
        self._done = True
        self.last_latency_s = 0.0
        """Seconds the last ``reset``/``step`` slept for (after ``time_scale``)."""
        self.last_latency_ms = 0.0
        """The latency the last ``reset``/``step`` drew, ms before ``time_scale`` (a caller that
        sleeps itself, with ``time_scale`` 0, reads it)."""

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        del init_state_id  # the timing model has no scene geometry
        self._sleep(self.model.reset_ms(self._rng))
        self._scene = self.model.scene(self._rng)
        self._success_step = draw_success_step(self.config, self._rng)
        self._task = task_id
        self._steps = 0
        self._decisions = 0
        self._done = False
        return self._observe()

    def step(self, actions: np.ndarray) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        end = self._limit if self._success_step is None else self._success_step
        n = min(self.config.chunk_len, end - self._steps)
        self._sleep(float(self.model.steps_ms(self._scene, self._rng, n).sum()))
        self._steps += n
        self._decisions += 1
        success = self._steps == self._success_step
        truncated = not success and self._decisions >= self.config.max_decisions
        self._done = success or truncated
        return StepResult(self._observe(), float(success), success, truncated, success, n)

    def close(self) -> None:
        pass

    def _sleep(self, ms: float) -> None:
        self.last_latency_ms = ms
        self.last_latency_s = ms * 1e-3 * self.config.time_scale
        if self.last_latency_s > 0.0:
            time.sleep(self.last_latency_s)

    def _observe(self) -> Observation:
        state = self._states[self._task].copy()
        state[0] = self._steps / self._limit
        return Observation({CAMERA: self._images[self._task]}, state, f"task {self._task}")


def _stats(values: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "mean": float(values.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
    }


def summarize_latency(
    options: Mapping[str, Any] | LatencyReplayConfig | None = None,
    episodes: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Statistics of the workload ``options`` describes, from ``episodes`` simulated episodes.

    Returns a JSON-able dict: ``source`` (description), ``step_ms``, ``reset_ms`` and
    ``episode_steps`` (each ``{mean, p50, p90, p99}``; step latencies weighted as an env sees
    them, i.e. per executed step), ``scene_p99_over_mean`` (median over scenes of the
    within-scene p99 / mean), ``success_rate``, ``episode_s`` (mean episode wall time with its
    reset, before ``time_scale``), ``episode_decisions`` (mean decisions per episode),
    ``max_decisions``, ``slot_steps_per_s`` (low-level steps per second one slot delivers
    when the policy answers instantly) and ``chunk_cv`` (coefficient of variation of the env
    steps one decision runs, resets apart).
    """
    if isinstance(options, LatencyReplayConfig):
        config = options
    else:
        config = build(LatencyReplayConfig, options, "latency_replay")
    model = make_latency_model(config)
    rng = np.random.default_rng(seed)
    limit = config.chunk_len * config.max_decisions
    resets = np.empty(episodes)
    lengths = np.empty(episodes, dtype=np.int64)
    successes = 0
    step_chunks: list[np.ndarray] = []
    chunk_ms: list[np.ndarray] = []  # the env steps of each decision (resets apart)
    ratios = []
    for i in range(episodes):
        resets[i] = model.reset_ms(rng)
        scene = model.scene(rng)
        success_step = draw_success_step(config, rng)
        successes += success_step is not None
        lengths[i] = limit if success_step is None else success_step
        step_chunks.append(model.steps_ms(scene, rng, int(lengths[i])))
        chunk_ms.append(np.add.reduceat(step_chunks[-1], np.arange(0, lengths[i],
                                                                   config.chunk_len)))
        if i < 100:
            within = model.steps_ms(scene, rng, 2000)
            ratios.append(np.percentile(within, 99) / within.mean())
    steps = np.concatenate(step_chunks)
    chunks = np.concatenate(chunk_ms)
    total_s = (resets.sum() + steps.sum()) / 1e3
    return {
        "source": model.description,
        "step_ms": _stats(steps),
        "reset_ms": _stats(resets),
        "episode_steps": _stats(lengths.astype(np.float64)),
        "scene_p99_over_mean": float(np.median(ratios)),
        "success_rate": successes / episodes,
        "episode_s": total_s / episodes,
        "episode_decisions": float(np.ceil(lengths / config.chunk_len).mean()),
        "max_decisions": config.max_decisions,
        "slot_steps_per_s": float(lengths.sum() / total_s),
        "chunk_cv": float(chunks.std() / chunks.mean()),
    }


def latency_replay_spec_of(config: LatencyReplayConfig) -> EnvSpec:
    """The ``EnvSpec`` of a validated config."""
    return EnvSpec(
        cameras=(CAMERA,),
        image_size=(config.image_size, config.image_size),
        state_dim=config.state_dim,
        action_dim=config.action_dim,
        chunk_len=config.chunk_len,
        max_decisions=config.max_decisions,
        num_tasks=config.num_tasks,
        num_init_states=config.num_init_states,
    )


def make_latency_replay_env(options: Mapping[str, Any], path: str, seed: int) -> LatencyReplayEnv:
    """Registry factory; ``seed`` drives this slot's latency and episode-outcome draws."""
    return LatencyReplayEnv(build(LatencyReplayConfig, options, path), seed)


def latency_replay_spec(options: Mapping[str, Any], path: str) -> EnvSpec:
    """Registry spec function: validates ``options`` and returns the shapes."""
    return latency_replay_spec_of(build(LatencyReplayConfig, options, path))
