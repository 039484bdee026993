"""ColorReach: a small language-conditioned reaching task with image observations, the task the
CPU pipeline learns for real. Task ``k`` is "reach the <colour k> block" among distractors; only
the ``top`` image shows where the blocks are, the 2-d state where the gripper is. A scene
depends only on the config's ``seed`` and the episode's ids, so every worker and GRPO group
member sees the same one. Reaching the target (within ``success_radius``; blocks lie at least
twice that apart, the gripper starts at least ``MIN_START_DISTANCE`` away) ends the episode
mid-chunk; ``max_decisions`` decisions without it truncate it. A step earns ``progress_scale``
times the distance gained, plus ``success_bonus`` on success::

    env = ReachEnv(ReachConfig(num_colors=4, num_objects=3))
    obs = env.reset(task_id=0, init_state_id=7)  # "reach the red block"
    result = env.step(env.oracle_actions())  # float32 [chunk_len, 2] deltas in [-1, 1]

Design notes: docs/concepts/simulators.md#colorreach"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlvla3.config import build, require
from rlvla3.types import EnvSpec, Observation, StepResult

PALETTE: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (220, 40, 40)),
    ("green", (40, 190, 60)),
    ("blue", (40, 80, 235)),
    ("yellow", (235, 215, 40)),
    ("purple", (150, 60, 200)),
    ("orange", (245, 135, 25)),
    ("cyan", (40, 205, 215)),
    ("pink", (245, 130, 195)),
)
"""Colour name and RGB of every possible block; task ``k`` targets colour ``k``."""

TABLE_RGB = (70, 62, 55)
GRIPPER_RGB = (235, 235, 235)
BLOCK_SIZE = 0.1
"""Side of a block as a fraction of the table width (drawn as a square)."""
GRIPPER_SIZE = 0.06
"""Diameter of the gripper marker as a fraction of the table width (drawn as a disc)."""
BLOCK_MARGIN = 0.1
"""Blocks are placed in ``[BLOCK_MARGIN, 1 - BLOCK_MARGIN]`` on both axes."""
MIN_START_DISTANCE = 0.3
"""The gripper starts at least this far from the target."""
CAMERA = "top"


@dataclass(frozen=True)
class ReachConfig:
    """Options of the ColorReach env (``env.options`` when ``env.name`` is ``reach``)."""

    num_objects: int = 3
    """Blocks in the scene (the target plus distractors); at most ``num_colors``."""
    num_colors: int = 4
    """Colours in play; also the number of tasks (one task per target colour)."""
    image_size: int = 32
    """Height and width of the ``top`` camera image."""
    chunk_len: int = 2
    """Low-level steps per decision."""
    max_decisions: int = 20
    """Decisions after which an unsolved episode is truncated."""
    num_init_states: int = 50
    """Fixed initial states per task."""
    step_size: float = 0.08
    """Largest move per low-level step along each axis, as a fraction of the table width."""
    success_radius: float = 0.08
    """The task is solved when the gripper is this close to the target block's centre."""
    progress_scale: float = 2.0
    """Multiplies the per-step reduction of the distance to the target in the reward."""
    success_bonus: float = 1.0
    """Reward added on the step that reaches the target."""
    seed: int = 0
    """Seed of the fixed initial states (the same on every worker)."""
    latency: str = ""
    """Simulated simulator latency: a latency file (as ``latency_replay``'s ``distribution``,
    e.g. ``data/libero_latency.json``), ``synthetic``, or empty for none."""
    latency_scale: float = 1.0
    """Multiplies every simulated latency."""
    fault_rate: float = 0.0
    """Probability that a step raises ``SimulatorFault`` instead of stepping (fault injection:
    a simulator that crashes mid-episode, for the fault-tolerance tests and benchmarks); 0:
    never."""

    def validate(self) -> None:
        require(
            1 <= self.num_colors <= len(PALETTE),
            "num_colors",
            f"must be in [1, {len(PALETTE)}], got {self.num_colors}",
        )
        require(
            1 <= self.num_objects <= self.num_colors,
            "num_objects",
            f"must be in [1, num_colors={self.num_colors}] (colours are distinct), "
            f"got {self.num_objects}",
        )
        require(self.image_size >= 8, "image_size", f"must be >= 8, got {self.image_size}")
        require(0.0 <= self.fault_rate < 1.0, "fault_rate",
                f"must be in [0, 1), got {self.fault_rate}")
        require(self.chunk_len >= 1, "chunk_len", f"must be >= 1, got {self.chunk_len}")
        require(self.max_decisions >= 1, "max_decisions", f"must be >= 1, got {self.max_decisions}")
        require(
            self.num_init_states >= 1,
            "num_init_states",
            f"must be >= 1, got {self.num_init_states}",
        )
        require(
            0.0 < self.step_size <= 0.5, "step_size", f"must be in (0, 0.5], got {self.step_size}"
        )
        require(
            0.0 < self.success_radius <= 0.12,
            "success_radius",
            f"must be in (0, 0.12] (blocks must fit apart), got {self.success_radius}",
        )
        require(
            self.progress_scale >= 0.0,
            "progress_scale",
            f"must be >= 0, got {self.progress_scale}",
        )
        require(
            self.success_bonus >= 0.0, "success_bonus", f"must be >= 0, got {self.success_bonus}"
        )
        require(self.latency_scale >= 0.0, "latency_scale", "must be >= 0")
        if self.latency:
            from envs.latency_replay import LatencyReplayConfig

            build(LatencyReplayConfig, {"distribution": self.latency}, "latency")


@dataclass(frozen=True, slots=True)
class ReachScene:
    """One fixed initial state. Block 0 is the target."""

    colors: tuple[int, ...]
    """Palette index of each block; ``colors[0]`` is the task id."""
    blocks: tuple[tuple[float, float], ...]
    """Centre ``(x, y)`` of each block on the unit-square table."""
    gripper: tuple[float, float]
    """Initial gripper position."""

    @property
    def target(self) -> tuple[float, float]:
        return self.blocks[0]


def instruction(task_id: int) -> str:
    """The instruction of task ``task_id``."""
    return f"reach the {PALETTE[task_id][0]} block"


def to_pixel(xy: tuple[float, float], image_size: int) -> tuple[int, int]:
    """``(row, col)`` of table point ``xy`` in the ``top`` image (row 0 is ``y = 1``)."""
    x, y = xy
    col = min(image_size - 1, max(0, int(x * image_size)))
    row = min(image_size - 1, max(0, int((1.0 - y) * image_size)))
    return row, col


def make_scene(config: ReachConfig, task_id: int, init_state_id: int) -> ReachScene:
    """The fixed initial state ``init_state_id`` of task ``task_id`` (pure function of ids)."""
    rng = np.random.default_rng([config.seed, task_id, init_state_id])
    others = [c for c in range(config.num_colors) if c != task_id]
    distractors = rng.choice(others, size=config.num_objects - 1, replace=False)
    colors = (task_id, *(int(c) for c in distractors))
    separation = max(2.0 * config.success_radius + 0.04, BLOCK_SIZE * 1.5)
    lo, hi = BLOCK_MARGIN, 1.0 - BLOCK_MARGIN
    while True:  # sequential placement; restart the layout if it jams (rare, bounded density)
        blocks: list[tuple[float, float]] = []
        for _ in range(200):
            x, y = rng.uniform(lo, hi, size=2)
            if all(math.hypot(x - bx, y - by) >= separation for bx, by in blocks):
                blocks.append((float(x), float(y)))
                if len(blocks) == config.num_objects:
                    break
        if len(blocks) == config.num_objects:
            break
    tx, ty = blocks[0]
    while True:
        gx, gy = rng.uniform(0.05, 0.95, size=2)
        if math.hypot(gx - tx, gy - ty) >= MIN_START_DISTANCE:
            break
    return ReachScene(colors, tuple(blocks), (float(gx), float(gy)))


def _disc(radius: int) -> np.ndarray:
    ii, jj = np.mgrid[-radius : radius + 1, -radius : radius + 1]
    return ii**2 + jj**2 <= radius**2 + radius // 2


def _paint(image: np.ndarray, center: tuple[int, int], mask: np.ndarray, rgb: np.ndarray) -> None:
    """Paint ``mask`` (odd square) centred at pixel ``center``, clipped to the image."""
    r = mask.shape[0] // 2
    row, col = center
    size = image.shape[0]
    r0, r1 = max(row - r, 0), min(row + r + 1, size)
    c0, c1 = max(col - r, 0), min(col + r + 1, size)
    sub = mask[r0 - row + r : r1 - row + r, c0 - col + r : c1 - col + r]
    image[r0:r1, c0:c1][sub] = rgb


class SimulatorFault(RuntimeError):
    """An injected simulator crash (``ReachConfig.fault_rate``)."""


class ReachEnv:
    """The ColorReach env; satisfies ``rlvla3.protocols.Env``."""

    def __init__(self, config: ReachConfig, seed: int = 0):
        self.config = config
        self._faults = np.random.default_rng([seed, 7919]) if config.fault_rate else None
        self._latency = None
        if config.latency:
            from envs.latency_replay import LatencyReplayConfig, make_latency_model

            self._latency = make_latency_model(LatencyReplayConfig(distribution=config.latency))
            self._rng = np.random.default_rng(seed)
            self._regime = None
        self.spec = reach_spec_of(config)
        size = config.image_size
        self._block_mask = np.ones((2 * max(1, round(BLOCK_SIZE * size / 2)) + 1,) * 2, bool)
        self._gripper_mask = _disc(max(1, round(GRIPPER_SIZE * size / 2)))
        self._colors = np.array([rgb for _, rgb in PALETTE], dtype=np.uint8)
        self._gripper_rgb = np.array(GRIPPER_RGB, dtype=np.uint8)
        self._background = np.empty((size, size, 3), dtype=np.uint8)
        self.scene: ReachScene | None = None
        self._x = self._y = 0.0
        self._tx = self._ty = 0.0
        self._decisions = 0
        self._done = True
        self._instruction = ""

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        cfg = self.config
        if not (0 <= task_id < cfg.num_colors and 0 <= init_state_id < cfg.num_init_states):
            raise ValueError(
                f"task_id {task_id} / init_state_id {init_state_id} out of range "
                f"({cfg.num_colors} tasks, {cfg.num_init_states} initial states)"
            )
        scene = make_scene(cfg, task_id, init_state_id)
        self.scene = scene
        if self._latency is not None:
            self._regime = self._latency.scene(self._rng)
            self._sleep(self._latency.reset_ms(self._rng))
        self._background[:] = TABLE_RGB
        for color, xy in zip(scene.colors, scene.blocks, strict=True):
            _paint(
                self._background,
                to_pixel(xy, cfg.image_size),
                self._block_mask,
                self._colors[color],
            )
        self._x, self._y = scene.gripper
        self._tx, self._ty = scene.target
        self._decisions = 0
        self._done = False
        self._instruction = instruction(task_id)
        return self._observe()

    def step(self, actions: np.ndarray) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        cfg = self.config
        if self._faults is not None and self._faults.random() < cfg.fault_rate:
            self._done = True
            raise SimulatorFault(f"injected simulator fault (fault_rate={cfg.fault_rate:g})")
        deltas = (np.clip(actions, -1.0, 1.0) * cfg.step_size).tolist()
        x, y, tx, ty = self._x, self._y, self._tx, self._ty
        dist = math.hypot(x - tx, y - ty)
        reward = 0.0
        steps = 0
        success = False
        for dx, dy in deltas:
            x = min(1.0, max(0.0, x + dx))
            y = min(1.0, max(0.0, y + dy))
            new_dist = math.hypot(x - tx, y - ty)
            reward += cfg.progress_scale * (dist - new_dist)
            dist = new_dist
            steps += 1
            if dist <= cfg.success_radius:
                reward += cfg.success_bonus
                success = True
                break
        self._x, self._y = x, y
        if self._latency is not None:
            self._sleep(float(self._latency.steps_ms(self._regime, self._rng, steps).sum()))
        self._decisions += 1
        truncated = not success and self._decisions >= cfg.max_decisions
        self._done = success or truncated
        return StepResult(self._observe(), reward, success, truncated, success, steps)

    def oracle_actions(self) -> np.ndarray:
        """A chunk that moves straight to the target: float32 ``[chunk_len, 2]``."""
        cfg = self.config
        x, y = self._x, self._y
        out = np.zeros((cfg.chunk_len, 2), dtype=np.float32)
        for i in range(cfg.chunk_len):
            dx = min(1.0, max(-1.0, (self._tx - x) / cfg.step_size))
            dy = min(1.0, max(-1.0, (self._ty - y) / cfg.step_size))
            out[i] = dx, dy
            x, y = x + dx * cfg.step_size, y + dy * cfg.step_size
        return out

    def close(self) -> None:
        pass

    def _sleep(self, ms: float) -> None:
        seconds = ms * 1e-3 * self.config.latency_scale
        if seconds > 0:
            time.sleep(seconds)

    def _observe(self) -> Observation:
        image = self._background.copy()
        _paint(
            image,
            to_pixel((self._x, self._y), self.config.image_size),
            self._gripper_mask,
            self._gripper_rgb,
        )
        state = np.array((2.0 * self._x - 1.0, 2.0 * self._y - 1.0), dtype=np.float32)
        return Observation({CAMERA: image}, state, self._instruction)


def reach_spec_of(config: ReachConfig) -> EnvSpec:
    """The ``EnvSpec`` of a validated config."""
    return EnvSpec(
        cameras=(CAMERA,),
        image_size=(config.image_size, config.image_size),
        state_dim=2,
        action_dim=2,
        chunk_len=config.chunk_len,
        max_decisions=config.max_decisions,
        num_tasks=config.num_colors,
        num_init_states=config.num_init_states,
    )


def make_reach_env(options: Mapping[str, Any], path: str, seed: int) -> ReachEnv:
    """Registry factory. ``seed`` seeds only the simulated latencies: the task is
    deterministic given the episode ids, and the initial states come from ``options.seed`` so
    that all workers share them."""
    return ReachEnv(build(ReachConfig, options, path), seed)


def reach_spec(options: Mapping[str, Any], path: str) -> EnvSpec:
    """Registry spec function: validates ``options`` and returns the shapes."""
    return reach_spec_of(build(ReachConfig, options, path))
