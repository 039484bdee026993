"""Isaac Lab's stock ``Isaac-Cartpole-Direct``, kit-less, on a cartpole USD that Newton ships.

Runs inside the Isaac Lab environment; imported only there.

The stock task loads its cartpole from NVIDIA's content bucket and a ground plane from the same
place; neither is reachable offline. Here the task's own config is kept and only its assets
change: the robot is ``newton/examples/assets/cartpole_single_pendulum.usda`` (the same joint
names, ``slider_to_cart`` and ``cart_to_pole``), referenced through a one-prim layer written
next to the Warp cache (that file's ``defaultPrim`` names a prim it does not have), and the
ground plane is dropped (nothing touches it). The smallest check that Isaac Lab runs at all.

One variant ("balance the pole"); ``success`` is surviving to the time limit (the task's own
success metric); a layout seeds the initial cart and pole state of that sub-env (torch's
generator is seeded per reset). State: the task's 4-d ``policy`` observation; no camera.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from envs.isaaclab.tasks import TaskDefinition

TASK = "Isaac-Cartpole-Direct"


def _local_cartpole() -> str:
    """A layer whose default prim references Newton's cartpole (written once per cache)."""
    import newton

    source = Path(newton.__file__).parent / "examples" / "assets" / "cartpole_single_pendulum.usda"
    cache = Path(os.environ.get("WARP_CACHE_PATH") or Path.home() / ".cache" / "warp")
    layer = cache.parent / "rlvla3-assets" / "cartpole.usda"
    text = ('#usda 1.0\n(\n    defaultPrim = "cartpole"\n    metersPerUnit = 1\n'
            '    upAxis = "Z"\n)\n\n'
            f'def Xform "cartpole" (\n    prepend references = @{source}@</cartpole>\n)\n{{\n}}\n')
    if not layer.is_file() or layer.read_text() != text:
        layer.parent.mkdir(parents=True, exist_ok=True)
        tmp = layer.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(layer)
    return str(layer)


def _configure(options: dict) -> Any:
    import isaaclab_tasks  # noqa: F401  (registers the Isaac-* Gym ids)
    from isaaclab_tasks.utils import parse_env_cfg

    cfg = parse_env_cfg(TASK, device=options["device"], num_envs=options["num_envs"])
    cfg.scene.cartpole.spawn.usd_path = _local_cartpole()
    cfg.scene.ground = None
    if options["max_steps"]:
        cfg.episode_length_s = options["max_steps"] * cfg.sim.dt * cfg.decimation
    return cfg


class CartpoleTask:
    """The stock cartpole behind ``envs.isaaclab.batched.Task``."""

    def __init__(self, cfg: Any):
        import gymnasium as gym

        self.env = cast(Any, gym.make(TASK, cfg=cfg).unwrapped)
        self.env.reset()
        self.num_envs = self.env.num_envs
        self.device = self.env.device
        self.action_dim = 1
        self.state_dim = 4
        self.cameras: dict[str, tuple[int, int]] = {}
        self.max_episode_steps = int(self.env.max_episode_length)
        self.instructions = ("balance the pole",)

    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> None:
        import torch

        for i, layout in zip(env_ids, layouts, strict=True):
            torch.manual_seed(int(layout))
            self.env._reset_idx(torch.as_tensor([int(i)], device=self.device, dtype=torch.int32))
        self.env.scene.write_data_to_sim()
        self.env.sim.forward()
        self.env.obs_buf = self.env._compute_observations()

    def step(self, actions: Any) -> tuple[Any, Any, Any]:
        _, reward, terminated, truncated, _ = self.env.step(actions)
        return reward, terminated, truncated

    def success(self) -> Any:
        return self.env.reset_time_outs & ~self.env.reset_terminated

    def state(self) -> Any:
        return self.env.obs_buf["policy"]

    def images(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.env.close()


DEFINITION = TaskDefinition(_configure, CartpoleTask)
