"""The tasks an Isaac Lab server can run, each behind ``envs.isaaclab.batched.Task``.

Runs inside the Isaac Lab environment (``envs.isaaclab.server``); Isaac Lab is imported only
when a task is built.

Modules:
    reach     ``reach``: Franka colour reach on the Panda converted here (wrist + front camera)
    cartpole  ``cartpole``: Isaac Lab's stock ``Isaac-Cartpole-Direct`` on Newton's local USD

A task definition is ``configure(options) -> cfg`` (the Isaac Lab env config, which the server
hands to ``isaaclab.app.launch_simulation`` so that it starts whatever runtime the config
needs: nothing for Newton kit-less, Isaac Sim for kit tasks) and ``build(cfg) -> Task``, called
inside that runtime. ``TASKS`` names ours; any other name is a registered Gym id of Isaac Lab
(``GymTask``: a manager-based task, its state, cameras and success term named in the options;
stock tasks fetch their assets from NVIDIA's servers, so this is the kit path of a machine
that has them), and ``module:attribute`` names a definition elsewhere (the tests' torch-only
stand-in).

``options`` (from ``envs.isaaclab.env.IsaacLabConfig``): ``num_envs``, ``device``,
``cameras``, ``image_size``, ``max_steps`` (0: the task's own limit), and for Gym tasks
``state_key``, ``camera_keys``, ``success_term``, ``instruction``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

TASKS: dict[str, str] = {
    "reach": "envs.isaaclab.tasks.reach:DEFINITION",
    "cartpole": "envs.isaaclab.tasks.cartpole:DEFINITION",
}


@dataclass(frozen=True)
class TaskDefinition:
    """How to configure and build one task (see the module docstring)."""

    configure: Any
    build: Any
    standalone: bool = False
    """Needs no Isaac Lab runtime (the tests' torch-only stand-in)."""


def definition(name: str) -> TaskDefinition:
    """The definition of task ``name`` (ours, ``module:attribute``, or a Gym id)."""
    target = TASKS.get(name, name if ":" in name else "")
    if not target:
        return TaskDefinition(lambda options: _gym_cfg(name, options),
                              lambda cfg: GymTask(name, cfg))
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _gym_cfg(task: str, options: Mapping[str, Any]) -> Any:
    import isaaclab_tasks  # noqa: F401  (registers the Isaac-* Gym ids)
    from isaaclab_tasks.utils import parse_env_cfg

    cfg = parse_env_cfg(task, device=options["device"], num_envs=options["num_envs"])
    cfg._rlvla3_options = dict(options)
    return cfg


def _lookup(obs: Mapping[str, Any], key: str) -> Any:
    value: Any = obs
    for part in key.split("/"):
        value = value[part]
    return value


class GymTask:
    """A registered Isaac Lab manager-based task: ``reset(env_ids=...)`` resets sub-envs, the
    success term is read from its termination manager."""

    def __init__(self, name: str, cfg: Any):
        import gymnasium as gym

        options = cfg._rlvla3_options
        self.env = cast(Any, gym.make(name, cfg=cfg).unwrapped)
        self.options = options
        self.num_envs = int(self.env.num_envs)
        self.device = self.env.device
        self.obs, _ = self.env.reset()
        self.state_dim = int(_lookup(self.obs, options["state_key"]).shape[-1])
        self.action_dim = int(self.env.action_manager.total_action_dim)
        self.cameras = {cam: tuple(options["image_size"]) for cam in options["camera_keys"]}
        self.max_episode_steps = int(options["max_steps"] or self.env.max_episode_length)
        self.instructions = (options["instruction"],)

    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> None:
        import torch

        ids = torch.as_tensor(list(env_ids), device=self.device, dtype=torch.long)
        self.obs, _ = self.env.reset(env_ids=ids)

    def step(self, actions: Any) -> tuple[Any, Any, Any]:
        self.obs, reward, terminated, truncated, _ = self.env.step(actions)
        return reward, terminated, truncated

    def success(self) -> Any:
        term = self.options["success_term"]
        if not term:
            import torch

            return torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self.env.termination_manager.get_term(term)

    def state(self) -> Any:
        return _lookup(self.obs, self.options["state_key"])

    def images(self) -> dict[str, Any]:
        return {cam: _lookup(self.obs, key) for cam, key in self.options["camera_keys"].items()}

    def close(self) -> None:
        self.env.close()
