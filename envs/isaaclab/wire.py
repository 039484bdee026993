"""What crosses the boundary between an env worker and its Isaac Lab server process.

Role: the env worker (Python 3.11, this project's torch) and the Isaac Lab server (Python 3.12,
Isaac Lab's torch, ``envs.isaaclab.server``) share this module and nothing else of each other,
so it imports only the standard library and NumPy.

Two channels:
- Control: one JSON object per line. The worker writes commands to the server's stdin; the
  server answers on a pipe of its own (its stdout is pointed at stderr, where Isaac Lab's log
  goes). Commands: ``attach`` (the shared-memory name), ``reset`` (sub-envs, variants,
  layouts), ``step`` (sub-envs), ``describe``, ``close``. Answers: ``{"ok": ...}`` or
  ``{"error": "<traceback>"}``; the first line the server writes is ``{"ready": spec}`` or an
  error.
- Data: one shared-memory segment the worker creates once the server has said its shapes
  (``Layout``): the action chunks the worker writes before a ``step``, and the state, images,
  rewards, step counts and flags the server writes before it answers. Nothing per step is
  pickled or copied through a pipe; the worker reads a slot's arrays straight from the segment.

Invariant: a region of the segment is written by one side only while the other waits for the
answer to the command that asked for it (one command in flight at a time), so no lock is
needed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FLAG_TERMINATED, FLAG_TRUNCATED, FLAG_SUCCESS = 0, 1, 2


@dataclass(frozen=True)
class ServerSpec:
    """What the server says about its task once it is built (``{"ready": ...}``)."""

    num_envs: int
    state_dim: int
    action_dim: int
    chunk_len: int
    cameras: Mapping[str, tuple[int, int]]
    """Camera name -> (H, W)."""
    max_episode_steps: int
    """Low-level steps after which the task times out."""
    instructions: tuple[str, ...]
    """The instruction of each task variant (task id ``k`` is variant ``k``)."""

    def to_json(self) -> dict[str, Any]:
        return {"num_envs": self.num_envs, "state_dim": self.state_dim,
                "action_dim": self.action_dim, "chunk_len": self.chunk_len,
                "cameras": {k: list(v) for k, v in self.cameras.items()},
                "max_episode_steps": self.max_episode_steps,
                "instructions": list(self.instructions)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerSpec:
        return cls(int(data["num_envs"]), int(data["state_dim"]), int(data["action_dim"]),
                   int(data["chunk_len"]),
                   {k: (int(v[0]), int(v[1])) for k, v in data["cameras"].items()},
                   int(data["max_episode_steps"]), tuple(data["instructions"]))


class Layout:
    """NumPy views of every array in one shared buffer laid out for ``spec``."""

    def __init__(self, spec: ServerSpec, buffer: Any = None):
        n = spec.num_envs
        shapes: list[tuple[str, tuple[int, ...], Any]] = [
            ("actions", (spec.chunk_len, n, spec.action_dim), np.float32),
            ("state", (n, spec.state_dim), np.float32),
            ("reward", (n,), np.float32),
            ("steps", (n,), np.int32),
            ("flags", (n, 3), np.uint8),
        ]
        shapes += [(f"image/{cam}", (n, h, w, 3), np.uint8)
                   for cam, (h, w) in spec.cameras.items()]
        offsets, size = [], 0
        for _, shape, dtype in shapes:
            size = (size + 63) // 64 * 64  # each array on its own cache line
            offsets.append(size)
            size += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.nbytes = max(size, 1)
        self.arrays: dict[str, np.ndarray] = {}
        if buffer is not None:
            for (name, shape, dtype), offset in zip(shapes, offsets, strict=True):
                self.arrays[name] = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def image(self, camera: str) -> np.ndarray:
        return self.arrays[f"image/{camera}"]


def encode(message: Mapping[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    return json.loads(line.decode())
