"""One batched Isaac Lab task stepped for many env slots: action chunks in, per-slot results out.

Role: an Isaac Lab task simulates ``num_envs`` sub-envs and steps them all at once with batched
torch tensors; rlvla3 slots each want their own episode. ``BatchedSlots`` runs inside the
Isaac Lab server process (``envs.isaaclab.server``) on a task adapter (``envs.isaaclab.tasks``)
and reads and writes the shared arrays of ``envs.isaaclab.wire.Layout``:

- ``reset(ids, variants, layouts)``: sub-env ``ids[j]`` starts an episode of task variant
  ``variants[j]`` from initial layout ``layouts[j]``; its observation is written.
- ``step(ids)``: the ``[chunk_len, N, A]`` actions the worker wrote run ``chunk_len`` batched
  steps. Sub-envs not in ``ids`` receive the hold action (zeros); their episode clocks run and
  the task may reset them, so a slot in an episode that sits a step out does not continue it
  (``envs.isaaclab.slots``). For each sub-env in ``ids``:
  reward summed only while its episode lasts, ``steps`` counted, the first termination or
  time-out ends it (the task then resets that sub-env by itself; it is held for the rest of the
  chunk and its next episode starts with an explicit ``reset``), ``success`` from the task's
  success term. The small per-env vectors come to the host once per chunk, with the
  observations of the sub-envs in ``ids``.

Imports torch lazily (the task's own torch); nothing here imports Isaac Lab, so the tests run
it in this project's interpreter on a torch stand-in with the task adapter's interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from envs.isaaclab.wire import FLAG_SUCCESS, FLAG_TERMINATED, FLAG_TRUNCATED, Layout, ServerSpec


class Task(Protocol):
    """What ``BatchedSlots`` needs of a task (``envs.isaaclab.tasks`` adapts Isaac Lab's)."""

    num_envs: int
    device: Any
    action_dim: int
    state_dim: int
    cameras: dict[str, tuple[int, int]]
    max_episode_steps: int
    instructions: tuple[str, ...]

    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> None:
        """Start episodes on those sub-envs (the latest observation then shows them)."""

    def step(self, actions: Any) -> tuple[Any, Any, Any]:
        """One batched step: ``(reward, terminated, truncated)`` tensors ``[N]``; finished
        sub-envs reset themselves."""

    def success(self) -> Any:
        """bool tensor ``[N]``: the success term of the last step."""

    def state(self) -> Any:
        """float tensor ``[N, state_dim]`` of the latest observation."""

    def images(self) -> dict[str, Any]:
        """Camera -> uint8 (or [0, 1] float) tensor ``[N, H, W, 3|4]`` of the latest
        observation (rendered when read)."""


def spec_of(task: Task, chunk_len: int) -> ServerSpec:
    return ServerSpec(task.num_envs, task.state_dim, task.action_dim, chunk_len,
                      dict(task.cameras), task.max_episode_steps, tuple(task.instructions))


def _to_uint8(images: Any) -> np.ndarray:
    array = images.detach().to("cpu").numpy()
    if array.dtype != np.uint8:
        scale = 255.0 if array.size and float(array.max()) <= 1.0 else 1.0
        array = np.clip(array * scale, 0, 255).astype(np.uint8)
    return array[..., :3]


class BatchedSlots:
    """Steps one ``Task`` for the sub-envs that ask, through ``layout``'s arrays."""

    def __init__(self, task: Task, chunk_len: int, layout: Layout):
        import torch

        self.torch = torch
        self.task = task
        self.chunk_len = chunk_len
        self.layout = layout
        self.n = task.num_envs

    def _write_observations(self, ids: Sequence[int]) -> None:
        if not len(ids):
            return
        index = self.torch.as_tensor(list(ids), device=self.task.device, dtype=self.torch.long)
        rows = np.asarray(ids)
        self.layout["state"][rows] = self.task.state()[index].detach().to("cpu").numpy()
        for cam, images in self.task.images().items():
            self.layout.image(cam)[rows] = _to_uint8(images[index])

    def reset(self, ids: Sequence[int], variants: Sequence[int],
              layouts: Sequence[int]) -> None:
        self.task.reset_to(ids, variants, layouts)
        self._write_observations(ids)

    def step(self, ids: Sequence[int]) -> None:
        torch = self.torch
        device = self.task.device
        actions = torch.as_tensor(self.layout["actions"], device=device)
        alive = torch.zeros(self.n, dtype=torch.bool, device=device)
        alive[list(ids)] = True
        reward = torch.zeros(self.n, device=device)
        steps = torch.zeros(self.n, dtype=torch.long, device=device)
        terminated = torch.zeros_like(alive)
        truncated = torch.zeros_like(alive)
        success = torch.zeros_like(alive)
        for t in range(self.chunk_len):
            rew, term, trunc = self.task.step(actions[t] * alive[:, None])
            term, trunc = term.bool(), trunc.bool()
            reward += rew.to(reward.dtype) * alive
            steps += alive.long()
            success |= self.task.success().bool() & alive
            terminated |= term & alive
            truncated |= trunc & alive & ~term
            alive &= ~(term | trunc)
            if not bool(alive.any()):
                break
        rows = np.asarray(list(ids), dtype=np.int64)
        self.layout["reward"][rows] = reward.to("cpu").numpy()[rows]
        self.layout["steps"][rows] = steps.to("cpu").numpy()[rows]
        flags = self.layout["flags"]
        for column, mask in ((FLAG_TERMINATED, terminated), (FLAG_TRUNCATED, truncated),
                             (FLAG_SUCCESS, success)):
            flags[rows, column] = mask.to("cpu").numpy()[rows]
        self._write_observations(ids)
