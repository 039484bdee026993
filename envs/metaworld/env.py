"""MetaWorld behind the ``Env`` protocol (registered as ``metaworld`` in ``envs.ENVS``).

Role: run MetaWorld's Sawyer tasks (PyPI ``metaworld``, MuJoCo; nothing downloaded) as a VLA
benchmark the way LIBERO runs: task ``i`` of the configured benchmark (``mt10``, ``ml10``,
``mt50``, ``envs.metaworld.tasks``), its instruction, two rendered cameras, success from the
env's own ``success`` flag.

- ``reset(task_id, init_state_id)``: the task's env (built on first use and kept) is set to
  the initial state ``init_state_id`` of the split (``split``: ``train`` draws fresh states,
  ``test`` takes the benchmark's own 50) and reset; MetaWorld's reset also moves the hand to
  its start (50 simulation steps).
- ``step(chunk)``: the ``[chunk_len, 4]`` actions (hand x, y, z moves and the gripper, in
  ``[-1, 1]``) run one by one; the first one after which ``info["success"]`` holds ends the
  episode (terminated, success, reward 1); ``max_steps`` low-level steps truncate it.
  Reward (``reward``): ``sparse``, 1 on success; or ``shaped``, MetaWorld's own reward
  (``info``'s, 0..10 per step) divided by 10 per executed step, and on success the steps left
  to ``max_steps`` credited at the maximum, 1 each: success is an absorbing state at the best
  reward, so succeeding sooner never returns less than going on. Success is the reported
  metric either way.
- observations: ``corner`` (a third-person camera; MetaWorld's ``corner``) and ``wrist``
  (``gripperPOV``) images, rotated upright (MuJoCo renders these cameras upside down), rendered
  once per chunk after its last step; state ``[hand x, y, z, gripper opening]`` (the first 4
  entries of MetaWorld's observation; the object and goal positions stay privileged).

Rendering: shadows are off by default (``shadows: false``): MetaWorld's light casts shadows
into a 4096-pixel shadow map, and on Mesa llvmpipe that alone makes a frame 10x slower (about
250 ms against 25 ms at 64-224 px here); multisampling stays as MetaWorld sets it.

Versions: ``metaworld`` 3.1.1 pins ``mujoco==3.3.0``, and LIBERO's results here were measured on
MuJoCo 3.17 (a scene settles differently on 3.3.0: libero_spatial task 5's fresh scene 0 leans
16 degrees instead of about 50). MetaWorld is therefore installed without its pin
(``pip install --no-deps metaworld==3.1.1`` beside the ``metaworld`` extra, which brings its
other dependencies) and ``envs.metaworld.tasks.import_metaworld`` fits its one incompatibility
with newer MuJoCo (the weld constraint data it writes); on 3.3.0 nothing is changed.

Crash isolation: the simulator runs in its own process (``envs.process_env.ProcessEnv``) unless
``process: false`` (the scripted expert reads the in-process env's privileged state).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from envs.metaworld.tasks import BENCHMARK_TASKS, INSTRUCTIONS, TestStates, TrainStates, task_data
from rlvla3.config import build, require
from rlvla3.protocols import Env
from rlvla3.types import EnvSpec, Observation, StepResult

CAMERAS: dict[str, str] = {"corner": "corner", "wrist": "gripperPOV", "corner2": "corner2",
                           "topview": "topview", "behind": "behindGripper"}
"""Observation camera name -> MetaWorld camera name."""
STATE_DIM = 4
ACTION_DIM = 4
MAX_STEP_REWARD = 10.0
"""MetaWorld's per-step reward lies in ``[0, 10]`` (10 once a task is solved)."""
Benchmark = Literal["mt10", "ml10", "mt50"]


@dataclass(frozen=True)
class MetaWorldConfig:
    """Which MetaWorld tasks, how they are observed, where episodes start."""

    benchmark: Benchmark = "mt10"
    task_ids: tuple[int, ...] = ()
    """Benchmark task indices this env serves (env task ``i`` is ``task_ids[i]``); empty: all."""
    cameras: tuple[str, ...] = ("corner", "wrist")
    image_size: tuple[int, int] = (128, 128)
    chunk_len: int = 5
    max_steps: int = 200
    """Episode limit in low-level steps (MetaWorld's own is 500; its scripted expert needs
    under 200 on every MT10 task)."""
    reward: Literal["sparse", "shaped"] = "sparse"
    """``sparse``: 1 on success; ``shaped``: MetaWorld's reward (see the module docstring)."""
    split: Literal["train", "test"] = "train"
    """``train``: fresh states per (state_seed, task, id); ``test``: the benchmark's own 50."""
    train_states: int = 10_000
    state_seed: int = 0
    test_seed: int = 0
    """Seed of the benchmark whose states are the test split (``metaworld.MT10(seed=...)``)."""
    allow_eval_overlap: bool = False
    """Allow training on the test split (outputs then say so)."""
    shadows: bool = False
    cached_envs: int = 10
    """MetaWorld envs kept built, one per task (each a few MB)."""
    process: bool = True
    step_timeout_s: float = 60.0
    reset_timeout_s: float = 300.0

    def validate(self) -> None:
        n = len(BENCHMARK_TASKS[self.benchmark])
        for i, t in enumerate(self.task_ids):
            require(0 <= t < n, f"task_ids[{i}]", f"{self.benchmark} has tasks 0..{n - 1}, got {t}")
        require(len(set(self.task_ids)) == len(self.task_ids), "task_ids", "has duplicates")
        for cam in self.cameras:
            require(cam in CAMERAS, "cameras", f"unknown camera {cam!r} (known: {list(CAMERAS)})")
        require(min(self.image_size) >= 8, "image_size", "must be at least 8x8")
        require(self.chunk_len >= 1, "chunk_len", "must be >= 1")
        require(1 <= self.max_steps <= 500, "max_steps", "must be in 1..500 (MetaWorld's limit)")
        require(self.train_states >= 1, "train_states", "must be >= 1")
        require(self.cached_envs >= 1, "cached_envs", "must be >= 1")
        require(self.reward in ("sparse", "shaped"), "reward",
                f"must be sparse or shaped, got {self.reward!r}")

    @property
    def tasks(self) -> tuple[str, ...]:
        names = BENCHMARK_TASKS[self.benchmark]
        return tuple(names[i] for i in (self.task_ids or range(len(names))))

    @property
    def states(self) -> TestStates | TrainStates:
        if self.split == "test":
            return TestStates(self.benchmark, self.test_seed)
        return TrainStates(self.benchmark, self.test_seed, self.state_seed, self.train_states)


def spec_of(cfg: MetaWorldConfig) -> EnvSpec:
    return EnvSpec(
        cameras=cfg.cameras,
        image_size=(cfg.image_size[0], cfg.image_size[1]),
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        chunk_len=cfg.chunk_len,
        max_decisions=math.ceil(cfg.max_steps / cfg.chunk_len),
        num_tasks=len(cfg.tasks),
        num_init_states=cfg.states.num_states,
    )


def metaworld_spec(options: Mapping[str, Any], path: str = "env.options") -> EnvSpec:
    """Registry entry: validate ``options`` and return the spec (imports no simulator)."""
    return spec_of(build(MetaWorldConfig, options, path))


def make_metaworld_env(options: Mapping[str, Any], path: str = "env.options",
                       seed: int = 0) -> Env:
    """Registry entry: a MetaWorld env, in its own process unless ``process: false``."""
    cfg = build(MetaWorldConfig, options, path)
    if not cfg.process:
        return MetaWorldEnv(cfg, seed)
    from envs.process_env import ProcessEnv

    return ProcessEnv(MetaWorldEnv, {"cfg": cfg, "seed": seed}, spec=spec_of(cfg),
                      step_timeout_s=cfg.step_timeout_s, reset_timeout_s=cfg.reset_timeout_s)


class MetaWorldEnv:
    """MetaWorld in this process; see the module docstring."""

    def __init__(self, cfg: MetaWorldConfig, seed: int = 0):
        os.environ.setdefault("MUJOCO_GL", "egl")
        self.cfg = cfg
        self.spec = spec_of(cfg)
        self.seed = seed
        self.states = cfg.states
        self._envs: OrderedDict[str, Any] = OrderedDict()
        self._renderers: dict[int, Any] = {}
        self._env: Any = None
        self._task_id = 0
        self._t = 0
        self._done = True
        self._last_obs: Observation | None = None
        self.raw_obs: np.ndarray | None = None
        """MetaWorld's own observation vector (privileged: object and goal positions)."""

    @property
    def raw(self) -> Any:
        """The MetaWorld env of the current task (for the scripted expert and tests)."""
        return self._env

    @property
    def task_name(self) -> str:
        return self.cfg.tasks[self._task_id]

    def _task_env(self, name: str) -> Any:
        env = self._envs.pop(name, None)
        if env is None:
            from envs.metaworld.tasks import import_metaworld

            import_metaworld()
            from metaworld.env_dict import ALL_V3_ENVIRONMENTS

            while len(self._envs) >= self.cfg.cached_envs:
                _, old = self._envs.popitem(last=False)
                self._renderers.pop(id(old), None)
                old.close()
            env = ALL_V3_ENVIRONMENTS[name]()
            env.max_path_length = 500  # the episode limit is ours (max_steps <= 500)
            if not self.cfg.shadows:
                env.model.light_castshadow[:] = 0
        self._envs[name] = env
        return env

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        if not 0 <= task_id < len(self.cfg.tasks):
            raise IndexError(f"task_id {task_id} out of range 0..{len(self.cfg.tasks) - 1}")
        if not 0 <= init_state_id < self.states.num_states:
            raise IndexError(f"init_state_id {init_state_id} out of range "
                             f"0..{self.states.num_states - 1} ({self.cfg.split} split)")
        name = self.cfg.tasks[task_id]
        env = self._task_env(name)
        vector = self.states.vector(env, name, init_state_id)
        env.set_task(task_data(env, name, vector))
        self.raw_obs, _ = env.reset()
        self._env, self._task_id = env, task_id
        self._t, self._done = 0, False
        self._last_obs = self._observation()
        return self._last_obs

    def step(self, actions: np.ndarray) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        actions = np.asarray(actions, dtype=np.float64).reshape(-1, ACTION_DIM)
        success, steps, shaped = False, 0, 0.0
        for action in actions:
            self.raw_obs, reward, _, _, info = self._env.step(np.clip(action, -1.0, 1.0))
            steps += 1
            self._t += 1
            shaped += float(reward) / MAX_STEP_REWARD
            if info["success"]:
                success = True
                break
            if self._t >= self.cfg.max_steps:
                break
        truncated = not success and self._t >= self.cfg.max_steps
        self._done = success or truncated
        self._last_obs = self._observation()
        if self.cfg.reward == "shaped":
            reward = shaped + (self.cfg.max_steps - self._t if success else 0)
        else:
            reward = float(success)
        return StepResult(self._last_obs, reward, success, truncated, success, steps)

    def _renderer(self) -> Any:
        import mujoco

        key = id(self._env)
        if key not in self._renderers:
            h, w = self.cfg.image_size
            self._renderers[key] = mujoco.Renderer(self._env.model, h, w)
        return self._renderers[key]

    def render(self) -> dict[str, np.ndarray]:
        """The configured cameras of the current state, upright."""
        if not self.cfg.cameras:
            return {}
        renderer = self._renderer()
        images = {}
        for cam in self.cfg.cameras:
            renderer.update_scene(self._env.data, camera=CAMERAS[cam])
            images[cam] = np.ascontiguousarray(renderer.render()[::-1, ::-1])
        return images

    def _observation(self) -> Observation:
        assert self.raw_obs is not None
        state = np.asarray(self.raw_obs[:STATE_DIM], dtype=np.float32)
        return Observation(images=self.render(), state=state,
                           instruction=INSTRUCTIONS[self.task_name])

    def describe(self) -> dict[str, Any]:
        from envs.libero.simulator import renderer_info

        renderer = self._renderers.get(id(self._env)) if self._env is not None else None
        context = getattr(renderer, "_gl_context", None)
        info: dict[str, Any] = {"renderer": renderer_info(None if context is None else
                                                          _Context(context)),
                                "shadows": self.cfg.shadows}
        if self._env is not None:
            info["control_freq"] = round(1.0 / float(self._env.dt), 3)
        return info

    def close(self) -> None:
        self._renderers.clear()
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self._env = None


@dataclass
class _Context:
    """A MuJoCo GL context in the shape ``renderer_info`` makes current (``gl_ctx``)."""

    gl_ctx: Any
