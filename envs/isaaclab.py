"""Isaac Lab's vectorised environments behind the per-slot ``Env`` protocol.

Role: an Isaac Lab ``ManagerBasedRLEnv`` simulates ``num_envs`` copies of a task on one GPU and
steps them all at once with batched torch tensors::

    obs, extras = venv.reset(env_ids=None)         # obs: {group: Tensor[N, ...] | {term: ...}}
    obs, reward, terminated, truncated, extras = venv.step(actions)   # actions: Tensor[N, A]

An rlvla3 env worker instead drives slots, one ``Env`` each, every slot in its own thread. This
module maps one onto the other:

- ``BatchedSlots`` (the mapping, no threads): sub-env ``i`` is slot ``i``. ``step`` takes action
  chunks for some slots, runs ``chunk_len`` batched steps, and gives each slot its own
  ``StepResult``: reward summed only while the slot's episode lasts, the first termination or
  time-out ends it (Isaac Lab then resets that sub-env by itself; it holds for the rest of
  the chunk), success from a named termination term. Slots not in the call receive
  the ``hold`` action (zeros). Rewards and masks accumulate on the device; one transfer per
  chunk brings back the small vectors and the observations of the slots that asked.
- ``IsaacLabSlot`` (the ``Env``): slot views over one shared ``LockstepSlots``. A ``step``
  blocks until every slot in an episode has submitted its chunk (or ``gather_timeout_s``
  passed; missing slots then hold), so the GPU simulator is stepped once per round for all.
- ``reset(task_id, init_state_id)`` resets only that sub-env (``venv.reset(env_ids=[i])``),
  unless Isaac Lab has just auto-reset it and it has not been stepped since. Isaac Lab draws
  initial states from its event manager, so ``init_state_id`` does not select a fixed state and
  the spec declares ``num_init_states`` as configured (default 1); one task per env.

Setup (GPU node with Isaac Sim): install Isaac Sim and Isaac Lab (``pip install isaaclab``
with the Isaac Sim pip packages, or Isaac Lab's ``isaaclab.sh --install``; see Isaac Lab's
installation guide), then choose ``env: {name: isaaclab, options: {task:
Isaac-Lift-Cube-Franka-v0, num_envs: 16}}``. The app is started headless through
``isaaclab.app.AppLauncher``; camera observations need ``enable_cameras: true``.

Verified here: the mapping against an in-process object with Isaac Lab's interface (tests).
Not verified here (no Isaac Sim on these machines): app launch, ``gym.make`` of real tasks, GPU
tensor layouts of real camera terms.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlvla3.config import build, require
from rlvla3.types import EnvSpec, Observation, StepResult

INSTALL_HINT = (
    "Isaac Lab is not installed: install Isaac Sim and Isaac Lab on a GPU node "
    "(`pip install isaaclab` with the Isaac Sim packages, or Isaac Lab's `./isaaclab.sh "
    "--install`), as described in Isaac Lab's installation guide"
)


@dataclass(frozen=True)
class IsaacLabConfig:
    """Which Isaac Lab task, how many sub-envs, and where slot data comes from in its obs."""

    task: str = "Isaac-Lift-Cube-Franka-v0"
    num_envs: int = 8
    device: str = "cuda:0"
    chunk_len: int = 1
    action_dim: int = 8
    state_dim: int = 0
    """Length of the state vector; 0 means read it from the env (``state_key``'s width)."""
    state_key: str = "policy"
    """Observation group (or ``group/term``) holding the flat state vector."""
    cameras: Mapping[str, str] = field(default_factory=dict)
    """Camera name -> ``group/term`` of a ``[N, H, W, 3|4]`` image term."""
    image_size: tuple[int, int] = (128, 128)
    instruction: str = ""
    success_term: str = ""
    """Termination term that means success (e.g. ``object_reached_goal``); empty: none."""
    max_decisions: int = 0
    """0: ``ceil(max_episode_length / chunk_len)`` from the env."""
    num_init_states: int = 1
    gather_timeout_s: float = 5.0
    headless: bool = True
    enable_cameras: bool = False

    def validate(self) -> None:
        require(self.num_envs >= 1, "num_envs", "must be >= 1")
        require(self.chunk_len >= 1, "chunk_len", "must be >= 1")
        require(self.action_dim >= 1, "action_dim", "must be >= 1")
        require(self.num_init_states >= 1, "num_init_states", "must be >= 1")
        require(self.gather_timeout_s > 0, "gather_timeout_s", "must be > 0")
        require(
            not self.cameras or self.enable_cameras,
            "enable_cameras",
            "must be true when cameras are configured",
        )


def isaaclab_spec(options: Mapping[str, Any], path: str = "env.options") -> EnvSpec:
    """Registry entry: the spec from the options alone (needs ``state_dim`` and
    ``max_decisions`` set, since reading them from the env would start Isaac Sim)."""
    cfg = build(IsaacLabConfig, options, path)
    require(
        cfg.state_dim > 0, f"{path}.state_dim", "set it to get a spec without starting Isaac Sim"
    )
    require(
        cfg.max_decisions > 0, f"{path}.max_decisions", "set it to get a spec without Isaac Sim"
    )
    return _spec(cfg, cfg.state_dim, cfg.max_decisions)


def _spec(cfg: IsaacLabConfig, state_dim: int, max_decisions: int) -> EnvSpec:
    return EnvSpec(
        cameras=tuple(cfg.cameras),
        image_size=cfg.image_size,
        state_dim=state_dim,
        action_dim=cfg.action_dim,
        chunk_len=cfg.chunk_len,
        max_decisions=max_decisions,
        num_tasks=1,
        num_init_states=cfg.num_init_states,
    )


def _lookup(obs: Mapping[str, Any], key: str) -> Any:
    value: Any = obs
    for part in key.split("/"):
        value = value[part]
    return value


def _to_uint8(images: Any) -> np.ndarray:
    array = images.detach().to("cpu").numpy()
    if array.dtype != np.uint8:
        scale = 255.0 if array.size and float(array.max()) <= 1.0 else 1.0
        array = np.clip(array * scale, 0, 255).astype(np.uint8)
    return array[..., :3]


class BatchedSlots:
    """Maps a ``ManagerBasedRLEnv``-like batched env onto slots; see the module docstring."""

    def __init__(self, venv: Any, cfg: IsaacLabConfig):
        import torch

        self.torch = torch
        self.venv = venv
        self.cfg = cfg
        self.n = int(venv.num_envs)
        self.device = venv.device
        self._obs, _ = venv.reset()
        self._stale = torch.zeros(self.n, dtype=torch.bool)
        """Sub-envs stepped since their last reset (a slot reset must reset them again)."""
        state = _lookup(self._obs, cfg.state_key)
        max_len = int(getattr(venv, "max_episode_length", 0))
        decisions = cfg.max_decisions or math.ceil(max_len / cfg.chunk_len)
        self.spec = _spec(cfg, cfg.state_dim or int(state.shape[-1]), decisions)

    def observation(self, slots: list[int]) -> dict[int, Observation]:
        """Current observations of ``slots`` (one device-to-host transfer per tensor)."""
        index = self.torch.as_tensor(slots, device=self.device, dtype=self.torch.long)
        state = _lookup(self._obs, self.cfg.state_key)[index].detach().to("cpu").numpy()
        images = {
            cam: _to_uint8(_lookup(self._obs, key)[index]) for cam, key in self.cfg.cameras.items()
        }
        return {
            slot: Observation(
                images={cam: images[cam][j] for cam in images},
                state=state[j].astype(np.float32),
                instruction=self.cfg.instruction,
            )
            for j, slot in enumerate(slots)
        }

    def reset(self, slot: int) -> Observation:
        """Reset one sub-env (unless Isaac Lab just did and it has not moved since)."""
        if self._stale[slot]:
            ids = self.torch.as_tensor([slot], device=self.device, dtype=self.torch.long)
            self._obs, _ = self.venv.reset(env_ids=ids)
            self._stale[slot] = False
        return self.observation([slot])[slot]

    def step(self, chunks: Mapping[int, np.ndarray]) -> dict[int, StepResult]:
        """Execute an action chunk on each slot in ``chunks``; the others hold."""
        torch = self.torch
        slots = sorted(chunks)
        actions = torch.zeros(self.cfg.chunk_len, self.n, self.cfg.action_dim, device=self.device)
        if slots:
            stacked = np.stack([np.asarray(chunks[s], dtype=np.float32) for s in slots], axis=1)
            index = torch.as_tensor(slots, device=self.device, dtype=torch.long)
            actions[:, index] = torch.as_tensor(stacked, device=self.device)
        alive = torch.zeros(self.n, dtype=torch.bool, device=self.device)
        alive[slots] = True
        reward = torch.zeros(self.n, device=self.device)
        steps = torch.zeros(self.n, dtype=torch.long, device=self.device)
        terminated = torch.zeros_like(alive)
        truncated = torch.zeros_like(alive)
        success = torch.zeros_like(alive)
        reset_now = torch.zeros_like(alive)
        for t in range(self.cfg.chunk_len):
            self._obs, rew, term, trunc, _ = self.venv.step(actions[t] * alive[:, None])
            reset_now = term.bool() | trunc.bool()
            reward += rew.to(reward.dtype) * alive
            steps += alive.long()
            if self.cfg.success_term:
                hit = self.venv.termination_manager.get_term(self.cfg.success_term)
                success |= hit.bool() & alive
            terminated |= term.bool() & alive
            truncated |= trunc.bool() & alive & ~term.bool()
            alive &= ~(term.bool() | trunc.bool())
            if not bool(alive.any()):
                break
        self._stale = ~reset_now.to("cpu")  # fresh: auto-reset by the last batched step
        host = {
            name: v.to("cpu").numpy()
            for name, v in (
                ("r", reward),
                ("n", steps),
                ("te", terminated),
                ("tr", truncated),
                ("s", success),
            )
        }
        observations = self.observation(slots) if slots else {}
        return {
            s: StepResult(
                obs=observations[s],
                reward=float(host["r"][s]),
                terminated=bool(host["te"][s]),
                truncated=bool(host["tr"][s]),
                success=bool(host["s"][s]),
                steps=int(host["n"][s]),
            )
            for s in slots
        }

    def close(self) -> None:
        self.venv.close()


class LockstepSlots:
    """Lets slot threads step one ``BatchedSlots`` together, one batched step per round."""

    def __init__(self, batch: BatchedSlots, gather_timeout_s: float):
        self.batch = batch
        self.timeout = gather_timeout_s
        self.cond = threading.Condition()
        self.active: set[int] = set()
        self.pending: dict[int, np.ndarray] = {}
        self.results: dict[int, StepResult] = {}
        self.attached = 0
        self.closed = 0

    def reset(self, slot: int) -> Observation:
        with self.cond:
            self.active.add(slot)
            obs = self.batch.reset(slot)
            self.cond.notify_all()
            return obs

    def step(self, slot: int, chunk: np.ndarray) -> StepResult:
        with self.cond:
            self.pending[slot] = chunk
            self.cond.notify_all()
            self.cond.wait_for(
                lambda: slot in self.results or self.active <= set(self.pending),
                timeout=self.timeout,
            )
            if slot not in self.results:  # this thread runs the round for everyone waiting
                round_ = dict(self.pending)
                self.pending.clear()
                self.results.update(self.batch.step(round_))
                self.cond.notify_all()
            result = self.results.pop(slot)
            if result.terminated or result.truncated:
                self.active.discard(slot)
            return result


class IsaacLabSlot:
    """One env slot of a shared Isaac Lab vectorised env (an ``Env``)."""

    def __init__(self, lockstep: LockstepSlots, slot: int):
        self.lockstep = lockstep
        self.slot = slot
        self.spec = lockstep.batch.spec

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        if task_id != 0:
            raise IndexError(f"an Isaac Lab env serves one task (id 0), got {task_id}")
        return self.lockstep.reset(self.slot)

    def step(self, actions: np.ndarray) -> StepResult:
        return self.lockstep.step(self.slot, actions)

    def close(self) -> None:
        with self.lockstep.cond:
            self.lockstep.active.discard(self.slot)
            self.lockstep.closed += 1
            last = self.lockstep.closed == self.lockstep.attached
        if last:
            self.lockstep.batch.close()


_SHARED: dict[tuple, LockstepSlots] = {}
_SHARED_LOCK = threading.Lock()


def slots_over(venv: Any, cfg: IsaacLabConfig) -> list[IsaacLabSlot]:
    """All ``num_envs`` slot views over an existing batched env (used by tests and tools)."""
    lockstep = LockstepSlots(BatchedSlots(venv, cfg), cfg.gather_timeout_s)
    lockstep.attached = lockstep.batch.n
    return [IsaacLabSlot(lockstep, i) for i in range(lockstep.batch.n)]


def _launch(cfg: IsaacLabConfig) -> Any:
    """Start Isaac Sim headless and create the task's vectorised env."""
    try:
        from isaaclab.app import AppLauncher
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from None
    AppLauncher(headless=cfg.headless, enable_cameras=cfg.enable_cameras)
    import gymnasium as gym
    import isaaclab_tasks  # noqa: F401  (registers the Isaac-* gym ids)
    from isaaclab_tasks.utils import parse_env_cfg

    env_cfg = parse_env_cfg(cfg.task, device=cfg.device, num_envs=cfg.num_envs)
    return gym.make(cfg.task, cfg=env_cfg).unwrapped


def make_isaaclab_env(
    options: Mapping[str, Any], path: str = "env.options", seed: int = 0
) -> IsaacLabSlot:
    """Registry entry: the next free slot of this process's shared Isaac Lab env."""
    cfg = build(IsaacLabConfig, options, path)
    key = tuple(sorted((k, repr(v)) for k, v in options.items()))
    with _SHARED_LOCK:
        lockstep = _SHARED.get(key)
        if lockstep is None or lockstep.attached >= lockstep.batch.n:
            lockstep = LockstepSlots(BatchedSlots(_launch(cfg), cfg), cfg.gather_timeout_s)
            _SHARED[key] = lockstep
        slot = lockstep.attached
        lockstep.attached += 1
    return IsaacLabSlot(lockstep, slot)
