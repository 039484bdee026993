"""Isaac Lab behind the ``Env`` protocol (registered as ``isaaclab`` in ``envs.ENVS``).

Role: ``make_isaaclab_env`` gives an env worker's slots their ``Env``: the first slot of a
process starts an Isaac Lab server (``envs.isaaclab.client``) with ``num_envs`` sub-envs, and
that slot and the next ``num_envs - 1`` are views of it (``envs.isaaclab.slots``); a
worker with more slots starts more servers. Set ``env_workers.slots_per_worker`` to
``num_envs`` (or a multiple).

Runtimes (``kit``): Newton physics kit-less (the default: Isaac Lab 3.0 in its own Python 3.12
environment, ``python -m rlvla3 envs setup isaaclab``, Warp on ``device`` ``cpu`` or
``cuda:0``), or Isaac Sim (``kit: true``: the environment built with ``--kit``, or a
``python`` that has Isaac Sim; needs an RTX GPU and Isaac Sim's own set-up).

Tasks: ``reach`` (Franka colour reach, our assets; task ids are the cube colours),
``cartpole`` (the stock Cartpole on a local USD), or any registered Isaac Lab Gym id
(``Isaac-...``: name its ``state_dim``, ``action_dim``, ``max_decisions``, ``state_key``,
``camera_keys``, ``success_term`` and ``instruction``; stock tasks fetch their assets from
NVIDIA's servers).

Initial states and the split (``split``): an initial state id ``k`` names a seeded layout of
the task (for ``reach``, where the cubes stand). ``train`` layouts are ``k`` itself
(``train_states`` of them), ``test`` layouts are ``TEST_OFFSET + k`` (``test_states``):
evaluation (``actors.eval.rounds.protocol_env``) runs on ``test``, training on ``train``, so
no training episode starts from a scene evaluation uses.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.isaaclab.catalog import REACH_OPTIONS, REACH_STATES, TASKS, TaskShape, task_shape
from rlvla3.config import build, require
from rlvla3.types import EnvSpec

TEST_OFFSET = 1_000_000
"""Test layout ``k`` is task layout ``TEST_OFFSET + k``; training layouts stay below it."""


@dataclass(frozen=True)
class IsaacLabConfig:
    """Which Isaac Lab task, how many sub-envs, which runtime and where its data comes from."""

    task: str = "reach"
    task_ids: tuple[int, ...] = ()
    """Task variants this env serves (env task ``i`` is variant ``task_ids[i]``); empty: all."""
    num_envs: int = 4
    """Sub-envs of one server (slots of a worker share servers of this size)."""
    device: str = "cpu"
    """Warp and torch device of the simulation: ``cpu`` or ``cuda:0``."""
    kit: bool = False
    """Run through Isaac Sim instead of Newton kit-less."""
    python: str = ""
    """Interpreter of the Isaac Lab environment; empty: the one ``rlvla3 envs setup isaaclab``
    built."""
    chunk_len: int = 4
    cameras: tuple[str, ...] | None = None
    """Cameras to render; None: all the task has."""
    image_size: tuple[int, int] = (64, 64)
    max_steps: int = 0
    """Episode limit in low-level steps; 0: the task's own."""
    split: Literal["train", "test"] = "train"
    train_states: int = 10_000
    test_states: int = 50
    allow_eval_overlap: bool = False
    """Allow training on the test split (outputs then say so)."""
    state_dim: int = 0
    """Gym tasks only: length of the state vector (ours know theirs)."""
    action_dim: int = 0
    """Gym tasks only: length of one action."""
    max_decisions: int = 0
    """Gym tasks only: decisions per episode."""
    state_key: str = "policy"
    """Gym tasks only: observation group (or ``group/term``) of the state vector."""
    camera_keys: Mapping[str, str] = field(default_factory=dict)
    """Gym tasks only: camera name -> ``group/term`` of a ``[N, H, W, 3|4]`` image term."""
    success_term: str = ""
    """Gym tasks only: termination term that means success."""
    instruction: str = ""
    """Gym tasks only: the task's instruction."""
    task_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of one of our tasks; ``reach``: ``state`` (``proprio``, or the privileged
    ``cubes`` / ``target`` of ``catalog.REACH_STATES``), ``max_move`` (m of tool motion per
    env step at action 1), ``progress_scale`` (reward per metre of distance to the target
    gained), ``success_bonus``."""
    reward: Literal["shaped", "sparse"] = "shaped"
    """``shaped``: the task's own reward (the reach's progress term plus its success bonus);
    ``sparse``: 1 on the step that succeeds, else 0. Success is the reported metric either
    way."""
    gather_timeout_s: float = 5.0
    step_timeout_s: float = 120.0
    start_timeout_s: float = 1200.0
    """A first start compiles Warp's kernels (about 90 s alone here, minutes when loaded)."""
    restart_timeout_s: float = 90.0
    """A replacement server's start (kernels compiled: about 20 s here). A reset waits for it
    up to ``1 + reset_retries`` (3) times on fresh servers, within the env worker's
    ``step_timeout_s`` (300 s), then stops with the fault named."""

    def validate(self) -> None:
        require(self.num_envs >= 1, "num_envs", "must be >= 1")
        require(self.chunk_len >= 1, "chunk_len", "must be >= 1")
        require(self.device == "cpu" or self.device.startswith("cuda"), "device",
                f"must be cpu or cuda[:N], got {self.device!r}")
        require(min(self.image_size) >= 8, "image_size", "must be at least 8x8")
        require(self.max_steps >= 0, "max_steps", "must be >= 0")
        require(self.train_states >= 1 and self.test_states >= 1, "train_states",
                "train_states and test_states must be >= 1")
        require(self.train_states <= TEST_OFFSET, "train_states", f"must be <= {TEST_OFFSET}")
        require(self.gather_timeout_s > 0, "gather_timeout_s", "must be > 0")
        shape = TASKS.get(self.task)
        known = REACH_OPTIONS if self.task == "reach" else set()
        unknown_options = sorted(set(self.task_options) - known)
        require(not unknown_options, "task_options",
                f"task {self.task!r} takes {sorted(known) or 'no options'}, not {unknown_options}")
        variants = len(shape.instructions) if shape is not None else 1
        for i, t in enumerate(self.task_ids):
            require(0 <= t < variants, f"task_ids[{i}]",
                    f"task {self.task!r} has variants 0..{variants - 1}, got {t}")
        require(len(set(self.task_ids)) == len(self.task_ids), "task_ids", "has duplicates")
        if self.task == "reach":
            mode = self.task_options.get("state", "proprio")
            require(mode in REACH_STATES, "task_options.state",
                    f"must be one of {sorted(REACH_STATES)}, got {mode!r}")
            for name in ("max_move", "progress_scale", "success_bonus"):
                value = self.task_options.get(name, 1.0)
                require(isinstance(value, (int, float)) and value >= 0, f"task_options.{name}",
                        f"must be a number >= 0, got {value!r}")
            require(self.task_options.get("max_move", 1.0) > 0, "task_options.max_move",
                    "must be > 0")
        require(self.reward in ("shaped", "sparse"), "reward",
                f"must be shaped or sparse, got {self.reward!r}")
        require(self.reward == "shaped" or self.task == "reach", "reward",
                f"sparse is implemented for reach; task {self.task!r} has its own reward only")
        if shape is not None:
            unknown = [c for c in self.cameras or () if c not in shape.cameras]
            require(not unknown, "cameras",
                    f"task {self.task!r} has cameras {list(shape.cameras)}, not {unknown}")
        else:
            require(self.task.startswith("Isaac-"), "task",
                    f"unknown task {self.task!r}: ours are {sorted(TASKS)}, or an Isaac Lab "
                    "Gym id (Isaac-...)")
            for name in ("state_dim", "action_dim", "max_decisions"):
                require(getattr(self, name) > 0, name, f"set it for Gym task {self.task}")
            require(self.cameras is None or set(self.cameras) <= set(self.camera_keys),
                    "camera_keys", "must name the observation term of every camera")

    @property
    def shape(self) -> TaskShape:
        """The task's shapes (ours from the catalog, a Gym task's from the options)."""
        if self.task in TASKS:
            return task_shape(self.task, dict(self.task_options))
        return TaskShape(self.state_dim, self.action_dim, tuple(self.camera_keys),
                         self.max_decisions * self.chunk_len, (self.instruction,))

    @property
    def camera_names(self) -> tuple[str, ...]:
        return self.shape.cameras if self.cameras is None else tuple(self.cameras)

    def variant(self, task_id: int) -> int:
        """The task variant env task ``task_id`` names."""
        if not self.task_ids:
            return task_id
        if not 0 <= task_id < len(self.task_ids):
            raise IndexError(f"task_id {task_id} out of range 0..{len(self.task_ids) - 1}")
        return self.task_ids[task_id]

    def layout(self, init_state_id: int) -> int:
        """The task layout an initial state id names in this split."""
        limit = self.train_states if self.split == "train" else self.test_states
        if not 0 <= init_state_id < limit:
            raise IndexError(f"init_state_id {init_state_id} out of range 0..{limit - 1} "
                             f"({self.split} split)")
        return init_state_id + (TEST_OFFSET if self.split == "test" else 0)


def check_split(env: Any, train_init_ids: Any = (), field: str = "env.options.split") -> None:
    """Refuse training on the test split unless ``allow_eval_overlap`` is set."""
    from rlvla3.config import ConfigError

    cfg = build(IsaacLabConfig, env.options, "env.options")
    if cfg.split == "test" and not cfg.allow_eval_overlap:
        raise ConfigError(field, "training would start from the test layouts, "
                          "which evaluation uses: train on split: train, or set "
                          "env.options.allow_eval_overlap: true")


def training_overlap(checkpoint: str, _seen: set[str] | None = None) -> list[str]:
    """Why a checkpoint's training touched the test layouts (empty: it did not, as far as its
    run directory, its datasets' ``meta/record.json`` and its ``init_from`` chain record)."""
    from rlvla3.checkpoint.files import saved_run

    seen = _seen if _seen is not None else set()
    run, config = saved_run(checkpoint)
    if run in seen:
        return []
    seen.add(run)
    reasons: list[str] = []
    env = config.get("env") or {}
    if env.get("name") == "isaaclab" and (env.get("options") or {}).get("split") == "test":
        reasons.append(f"RL run {run} trained on the test layouts")
    if "lake" in config:  # an SFT run: its datasets
        from envs.libero.scenes import recorded_on_test

        reasons += recorded_on_test((config.get("lake") or {}).get("datasets"))
    if config.get("init_from"):
        reasons += training_overlap(config["init_from"], seen)
    return reasons


def trained_options(checkpoint: str) -> dict[str, Any]:
    """The env options of the run a checkpoint comes from that shape what its policy sees
    (``task``, ``task_options``, ``max_steps``), so an evaluation runs the task it learnt."""
    from rlvla3.checkpoint.files import saved_run

    env = saved_run(checkpoint)[1].get("env") or {}
    options = env.get("options") or {} if env.get("name") == "isaaclab" else {}
    return {k: options[k] for k in ("task", "task_options", "max_steps") if k in options}


def spec_of(cfg: IsaacLabConfig) -> EnvSpec:
    shape = cfg.shape
    steps = cfg.max_steps or shape.max_steps
    return EnvSpec(
        cameras=cfg.camera_names,
        image_size=(cfg.image_size[0], cfg.image_size[1]),
        state_dim=shape.state_dim,
        action_dim=shape.action_dim,
        chunk_len=cfg.chunk_len,
        max_decisions=cfg.max_decisions or math.ceil(steps / cfg.chunk_len),
        num_tasks=len(cfg.task_ids) or len(shape.instructions),
        num_init_states=cfg.train_states if cfg.split == "train" else cfg.test_states,
    )


def isaaclab_spec(options: Mapping[str, Any], path: str = "env.options") -> EnvSpec:
    """Registry entry: the spec from the options alone (starts no Isaac Lab)."""
    return spec_of(build(IsaacLabConfig, options, path))


def server_config(cfg: IsaacLabConfig, seed: int) -> Any:
    from envs.isaaclab.client import ServerConfig

    gym = {} if cfg.task in TASKS else {
        "state_key": cfg.state_key, "camera_keys": dict(cfg.camera_keys),
        "success_term": cfg.success_term, "instruction": cfg.instruction}
    task_options = dict(cfg.task_options)
    if cfg.reward == "sparse":
        task_options.update(progress_scale=0.0, success_bonus=1.0)
    return ServerConfig(task=cfg.task, num_envs=cfg.num_envs, device=cfg.device,
                        task_options=task_options, cameras=cfg.camera_names,
                        image_size=(cfg.image_size[0], cfg.image_size[1]),
                        max_steps=cfg.max_steps, chunk_len=cfg.chunk_len, kit=cfg.kit,
                        python=cfg.python, seed=seed, gym=gym,
                        step_timeout_s=cfg.step_timeout_s, start_timeout_s=cfg.start_timeout_s,
                        restart_timeout_s=cfg.restart_timeout_s)


def open_server_slots(cfg: IsaacLabConfig, seed: int = 0) -> Any:
    """Start one server for ``cfg`` and return its ``ServerSlots``."""
    from envs.isaaclab.client import IsaacLabServer
    from envs.isaaclab.slots import ServerSlots

    expect = cfg.shape if cfg.task in TASKS else None
    server = IsaacLabServer(server_config(cfg, seed), expect=expect)
    return ServerSlots(server, spec_of(cfg), cfg.layout, cfg.variant)


_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def make_isaaclab_env(options: Mapping[str, Any], path: str = "env.options",
                      seed: int = 0) -> Any:
    """Registry entry: the next free slot of this process's Isaac Lab server for ``options``
    (a full server, or none yet, starts a new one)."""
    from envs.isaaclab.slots import IsaacLabSlot, LockstepSlots

    cfg = build(IsaacLabConfig, options, path)
    key = tuple(sorted((k, repr(v)) for k, v in options.items()))
    with _SHARED_LOCK:
        lockstep = _SHARED.get(key)
        if lockstep is None or lockstep.attached >= lockstep.batch.n:
            lockstep = LockstepSlots(open_server_slots(cfg, seed), cfg.gather_timeout_s)
            _SHARED[key] = lockstep
        slot = lockstep.attached
        lockstep.attached += 1
    return IsaacLabSlot(lockstep, slot)
