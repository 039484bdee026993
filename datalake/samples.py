"""Training samples of one episode: frame, action chunk with mask, state, task, camera timestamps.

A sample at frame ``t`` of an episode of length ``n`` carries the action chunk
``action[t : t + chunk_len]``; steps past the episode end repeat the last action and are
``False`` in ``action_mask``. Camera frames are not decoded here: a sample names, per camera,
the video file and the file timestamp (``from_timestamp + timestamp``) to decode later.

Rows are plain column batches (a dict of numpy arrays) with one fixed schema for every
dataset of a mix, so Ray Data blocks from different datasets concatenate:

    dataset int32, episode int64, frame int64, task str, state f32[S], actions f32[C, A],
    action_mask bool[C], video.<cam> str, ts.<cam> f64, png.<cam> bytes, problem str, skips int64

(``png.<cam>`` holds the encoded image of cameras stored as LeRobot ``image`` features.)

A row with a non-empty ``problem`` stands for ``skips`` samples that could not be built (an
unreadable data file, a row whose feature has the wrong shape); its arrays are zeros. The
consumer counts and logs such rows and drops them (see ``datalake.pipeline``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datalake.format import DatasetError, DatasetMeta, Episode, camera_name, read_episode_table

STATE_KEY = "observation.state"
ACTION_KEY = "action"


class Normalizer:
    """Identity: values pass unchanged."""

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return values


@dataclass(frozen=True)
class MeanStd(Normalizer):
    """``(x - mean) / (std + eps)`` from ``meta/stats.json``."""

    mean: np.ndarray
    std: np.ndarray

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return ((values - self.mean) / (self.std + 1e-8)).astype(np.float32)


@dataclass(frozen=True)
class MinMax(Normalizer):
    """Map ``[min, max]`` from ``meta/stats.json`` to ``[-1, 1]``."""

    low: np.ndarray
    high: np.ndarray

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return (2.0 * (values - self.low) / (self.high - self.low + 1e-8) - 1.0).astype(np.float32)


def build_normalizer(
    kind: str, stats: Mapping[str, Mapping[str, np.ndarray]], key: str
) -> Normalizer:
    """The normaliser ``kind`` ("none", "mean_std", "min_max") for feature ``key``."""
    if kind == "none":
        return Normalizer()
    if key not in stats:
        raise DatasetError(f"normalisation {kind!r} needs stats for {key!r} in meta/stats.json")
    s = stats[key]
    if kind == "mean_std":
        return MeanStd(s["mean"].astype(np.float32), s["std"].astype(np.float32))
    if kind == "min_max":
        return MinMax(s["min"].astype(np.float32), s["max"].astype(np.float32))
    raise ValueError(f"unknown normalisation {kind!r}")


def _vector_rows(column: pa.ChunkedArray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A list column as ``[n, width]`` float32 plus a mask of rows that had exactly ``width`` values."""
    arr = column.combine_chunks()
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        if arr.type.list_size != width:
            return np.zeros((n, width), np.float32), np.zeros(n, bool)
        values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
        return values.reshape(n, width), np.ones(n, bool)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        if width == 1:
            return arr.to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, 1), np.ones(
                n, bool
            )
        return np.zeros((n, width), np.float32), np.zeros(n, bool)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    ok = lengths == width
    out = np.zeros((n, width), np.float32)
    offsets = arr.offsets.to_numpy()
    flat = arr.values.to_numpy(zero_copy_only=False).astype(np.float32)
    for i in np.flatnonzero(ok):
        out[i] = flat[offsets[i] : offsets[i] + width]
    return out, ok


def empty_rows(
    cameras: Sequence[str], state_dim: int, action_dim: int, chunk_len: int, n: int
) -> dict[str, np.ndarray]:
    """``n`` zero rows of the sample schema."""
    rows: dict[str, np.ndarray] = {
        "dataset": np.zeros(n, np.int32),
        "episode": np.zeros(n, np.int64),
        "frame": np.zeros(n, np.int64),
        "task": np.full(n, "", dtype=object),
        "state": np.zeros((n, state_dim), np.float32),
        "actions": np.zeros((n, chunk_len, action_dim), np.float32),
        "action_mask": np.zeros((n, chunk_len), bool),
        "problem": np.full(n, "", dtype=object),
        "skips": np.zeros(n, np.int64),
    }
    for cam in cameras:
        rows[f"video.{cam}"] = np.full(n, "", dtype=object)
        rows[f"ts.{cam}"] = np.zeros(n, np.float64)
        rows[f"png.{cam}"] = np.full(n, b"", dtype=object)
    return rows


def problem_rows(
    cameras: Sequence[str],
    state_dim: int,
    action_dim: int,
    chunk_len: int,
    dataset: int,
    episode: int,
    problem: str,
    skips: int,
) -> dict[str, np.ndarray]:
    """One row that stands for ``skips`` samples lost to ``problem``."""
    rows = empty_rows(cameras, state_dim, action_dim, chunk_len, 1)
    rows["dataset"][0], rows["episode"][0] = dataset, episode
    rows["problem"][0], rows["skips"][0] = problem, skips
    return rows


def episode_samples(
    meta: DatasetMeta,
    dataset: int,
    episode: Episode,
    cameras: Sequence[str],
    chunk_len: int,
    normalize: str = "none",
) -> dict[str, np.ndarray]:
    """All samples of ``episode`` in frame order, plus problem rows for frames that are bad."""
    state_dim = meta.feature_shape(STATE_KEY)[0]
    action_dim = meta.feature_shape(ACTION_KEY)[0]
    image_keys = {
        camera_name(k): k
        for k, ft in meta.features.items()
        if ft["dtype"] == "image" and camera_name(k) in cameras
    }
    def skipped(reason: str) -> dict[str, np.ndarray]:
        return problem_rows(cameras, state_dim, action_dim, chunk_len, dataset, episode.index,
                            reason, episode.length)

    try:
        columns = [STATE_KEY, ACTION_KEY, "timestamp", "task_index", *image_keys.values()]
        table = read_episode_table(meta, episode, columns)
    except DatasetError as exc:
        return skipped(str(exc))
    n = table.num_rows
    if n == 0:
        return skipped(f"episode {episode.index} has no rows in {meta.path(episode.data_file)}")
    state, state_ok = _vector_rows(table[STATE_KEY], state_dim)
    action, action_ok = _vector_rows(table[ACTION_KEY], action_dim)
    state = build_normalizer(normalize, meta.stats, STATE_KEY)(state)
    action = build_normalizer(normalize, meta.stats, ACTION_KEY)(action)
    timestamps = table["timestamp"].to_numpy().astype(np.float64)
    task_index = table["task_index"].to_numpy()

    steps = np.arange(n)[:, None] + np.arange(chunk_len)[None, :]
    mask = steps < n
    steps = np.minimum(steps, n - 1)
    ok = state_ok & (action_ok[steps] | ~mask).all(axis=1)

    rows = empty_rows(cameras, state_dim, action_dim, chunk_len, n)
    rows["dataset"][:] = dataset
    rows["episode"][:] = episode.index
    rows["frame"] = table["frame_index"].to_numpy().astype(np.int64)
    rows["task"] = np.array([meta.tasks.get(int(i), "") for i in task_index], dtype=object)
    rows["state"] = state
    rows["actions"] = action[steps]
    rows["action_mask"] = mask
    by_name = {camera_name(k): v for k, v in episode.videos.items()}
    for cam in cameras:
        if cam in by_name:
            rel, start, _ = by_name[cam]
            rows[f"video.{cam}"][:] = meta.path(rel)
            rows[f"ts.{cam}"] = start + timestamps
    for cam, key in image_keys.items():
        # LeRobot ``image`` features: a struct {bytes, path} per row, the bytes a PNG / JPEG file.
        cells = table[key].to_pylist()
        rows[f"png.{cam}"] = np.array([(c or {}).get("bytes") or b"" for c in cells], dtype=object)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        where = meta.path(episode.data_file)
        rows["problem"][bad] = (
            f"wrong feature shape in {where} (episode {episode.index}: expected state[{state_dim}], action[{action_dim}])"
        )
        rows["skips"][bad] = 1
    return rows
