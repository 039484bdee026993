"""A torch-only task with the interface of ``envs.isaaclab.batched.Task``, for the tests.

It lets the Isaac Lab server, its process boundary, its shared memory and its fault handling
run in this project's interpreter without Isaac Lab: ``N`` points on a line; an action's first
component moves a point; reaching ``goal`` terminates (success); ``max_steps`` steps truncate;
finished sub-envs reset themselves, as Isaac Lab's do. A layout ``k`` starts the point at
``k / 100``. The second action component of sub-env 0 makes the server misbehave on purpose:
7 exits the process, 8 hangs, 9 raises; the option ``hang_at_start_if`` (a path) makes a
server hang while it builds the task whenever that file exists (a replacement that never
comes up).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from envs.isaaclab.tasks import TaskDefinition

GOAL = 3.0


class LineTask:
    def __init__(self, options: dict[str, Any]):
        hang = options.get("hang_at_start_if")
        if hang and os.path.exists(hang):
            time.sleep(3600)
        n = int(options["num_envs"])
        self.num_envs = n
        self.device = "cpu"
        self.action_dim = 2
        self.state_dim = 3
        self.cameras = {cam: (2, 2) for cam in options["cameras"]}
        self.max_episode_steps = int(options["max_steps"] or 6)
        self.instructions = ("reach the goal", "reach the goal again")
        self.pos = torch.zeros(n)
        self.length = torch.zeros(n, dtype=torch.long)
        self.reached = torch.zeros(n, dtype=torch.bool)
        self.step_calls = 0

    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> None:
        for i, layout in zip(env_ids, layouts, strict=True):
            self.pos[i] = layout / 100.0
            self.length[i] = 0

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        code = int(actions[0, 1])
        if code == 7:
            os._exit(3)
        if code == 8:
            time.sleep(3600)
        if code == 9:
            raise RuntimeError("the simulator raised")
        self.step_calls += 1
        self.pos += actions[:, 0]
        self.length += 1
        reward = actions[:, 0].clone()
        self.reached = self.pos >= GOAL
        terminated = self.reached.clone()
        truncated = self.length >= self.max_episode_steps
        done = terminated | truncated
        self.pos[done] = 0.0
        self.length[done] = 0
        return reward, terminated, truncated

    def success(self) -> torch.Tensor:
        return self.reached

    def state(self) -> torch.Tensor:
        ids = torch.arange(self.num_envs, dtype=torch.float32)
        return torch.stack([self.pos, self.length.float(), ids], dim=-1)

    def images(self) -> dict[str, torch.Tensor]:
        value = (self.pos / 10).clamp(0, 1)[:, None, None, None].expand(-1, 2, 2, 4).clone()
        return {cam: value for cam in self.cameras}

    def close(self) -> None:
        pass


DEFINITION = TaskDefinition(configure=dict, build=LineTask, standalone=True)
