"""Synthetic episodes whose every value says where it came from (tests, benchmarks, SFT smoke runs).

Frame ``t`` of episode ``e`` on camera ``c`` has a red level that changes by 37 per frame,
a green 8x8 checkerboard whose phase moves with ``t`` and a blue level per camera; blocks are
8-pixel aligned so 4:2:0 codecs keep them nearly intact. Neighbouring frames therefore differ
by far more than codec error, which lets a test tell "the right frame" from "a frame off by one".

``action[t] = [e, t, sin(t / 5), ...]`` and ``state[t] = [e, t, cos(t / 5), ...]``, so an action
chunk identifies its episode and steps exactly; ``action[2:]`` is a fixed linear function of
``state`` (a learnable target for SFT smoke runs).
"""

from __future__ import annotations

import numpy as np

from datalake.writer import EpisodeRecord


def frame(episode: int, t: int, camera: int, height: int, width: int) -> np.ndarray:
    """The uint8 ``[H, W, 3]`` frame ``t`` of ``episode`` on camera number ``camera``."""
    img = np.empty((height, width, 3), np.uint8)
    img[..., 0] = (episode * 53 + t * 37) % 256
    yy, xx = np.mgrid[0:height, 0:width]
    img[..., 1] = np.where(((yy // 8) + (xx // 8) + t) % 2 == 0, 40, 200)
    img[..., 2] = (camera * 90 + 30) % 256
    return img


def episode(
    index: int,
    length: int,
    cameras: tuple[str, ...] = ("agentview", "wrist"),
    size: tuple[int, int] = (64, 64),
    state_dim: int = 8,
    action_dim: int = 7,
    task: str | None = None,
) -> EpisodeRecord:
    """Synthetic episode number ``index`` with ``length`` frames."""
    t = np.arange(length, dtype=np.float32)
    state = np.zeros((length, state_dim), np.float32)
    state[:, 0], state[:, 1] = index, t
    state[:, 2:] = np.cos(t[:, None] / 5 + np.arange(state_dim - 2)[None, :])
    mix = (
        np.random.default_rng(7).standard_normal((state_dim - 2, action_dim - 2)).astype(np.float32)
        / 2
    )
    action = np.zeros((length, action_dim), np.float32)
    action[:, 0], action[:, 1] = index, t
    action[:, 2:] = np.tanh(state[:, 2:] @ mix)
    images = {
        cam: np.stack([frame(index, i, c, *size) for i in range(length)])
        for c, cam in enumerate(cameras)
    }
    return EpisodeRecord(images, state, action, task or f"task {index % 3}: pick up the block")


def episodes(
    count: int, min_len: int = 10, max_len: int = 20, seed: int = 0, **kwargs
) -> list[EpisodeRecord]:
    """``count`` synthetic episodes with lengths drawn in ``[min_len, max_len]``."""
    rng = np.random.default_rng(seed)
    return [episode(i, int(rng.integers(min_len, max_len + 1)), **kwargs) for i in range(count)]
