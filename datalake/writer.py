"""Write LeRobot v3.0 datasets from episodes held as arrays (demonstrations, RL rollouts).

``LeRobotWriter.add_episode`` appends one episode to the current data parquet file (one row
group per episode) and to one mp4 per camera; files roll over to the next ``file-YYY`` (and
``chunk-XXX`` after ``chunks_size`` files) when they reach ``episodes_per_file`` or their size
limit, so a file holds many episodes as in LeRobot. ``close`` writes ``meta/episodes``,
``meta/tasks.parquet``, ``meta/stats.json`` and ``meta/info.json`` last: a dataset with an
``info.json`` is complete.

Invariants: frame ``index`` runs 0..total_frames-1 over the dataset in episode order;
``timestamp`` is ``frame_index / fps``; an episode's camera frames are at
``from_timestamp + timestamp`` of its video file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from datalake.format import (
    CAMERA_PREFIX,
    CODEBASE_VERSION,
    DATA_PATH,
    DEFAULT_FEATURES,
    EPISODES_PATH,
    INFO_PATH,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    resolve_filesystem,
)
from datalake.video import CODECS, VideoEncoder, probe
from rlvla3.config import require

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)


@dataclass(frozen=True)
class EpisodeRecord:
    """One episode to write."""

    images: Mapping[str, np.ndarray]
    """Camera name -> uint8 ``[T, H, W, 3]`` (upright)."""
    state: np.ndarray
    """float32 ``[T, state_dim]``."""
    action: np.ndarray
    """float32 ``[T, action_dim]``: the action taken at each frame."""
    task: str
    """Natural-language instruction."""


@dataclass(frozen=True)
class WriterConfig:
    """Layout and encoding of a written dataset."""

    fps: int = 10
    codec: str = "av1"
    """A key of ``datalake.video.CODECS``."""
    robot_type: str | None = None
    episodes_per_file: int = 0
    """Start a new data / video file after this many episodes (0: only by size)."""
    chunks_size: int = 1000
    data_files_size_in_mb: int = 100
    video_files_size_in_mb: int = 500

    def validate(self) -> None:
        require(self.fps > 0, "fps", "must be positive")
        require(self.codec in CODECS, "codec", f"unknown codec (known: {', '.join(CODECS)})")
        require(self.episodes_per_file >= 0, "episodes_per_file", "must be >= 0")
        require(self.chunks_size > 0, "chunks_size", "must be positive")


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot statistics of ``[N, ...]`` values over axis 0."""
    values = np.asarray(values, dtype=np.float64)
    out = {
        "min": values.min(axis=0),
        "max": values.max(axis=0),
        "mean": values.mean(axis=0),
        "std": values.std(axis=0),
        "count": np.array([len(values)]),
    }
    for q in QUANTILES:
        out[f"q{round(q * 100):02d}"] = np.quantile(values, q, axis=0)
    return out


def image_stats(frames: np.ndarray, max_samples: int = 64) -> dict[str, np.ndarray]:
    """Per-channel statistics of uint8 ``[T, H, W, 3]`` frames in [0, 1], shaped ``[3, 1, 1]``."""
    step = max(1, len(frames) // max_samples)
    pixels = frames[::step].reshape(-1, 3) / 255.0
    stats = {k: v.reshape(3, 1, 1) for k, v in feature_stats(pixels).items() if k != "count"}
    return stats | {"count": np.array([len(frames)])}


def aggregate_stats(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Combine per-episode statistics (exact mean / std; quantiles as a conservative envelope)."""
    counts = np.array([p["count"][0] for p in parts], dtype=np.float64)
    means = np.stack([p["mean"] for p in parts])
    w = counts.reshape(-1, *([1] * (means.ndim - 1))) / counts.sum()
    mean = (means * w).sum(axis=0)
    var = ((np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2) * w).sum(axis=0)
    out = {
        "min": np.min([p["min"] for p in parts], axis=0),
        "max": np.max([p["max"] for p in parts], axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(counts.sum())]),
    }
    for key in parts[0]:
        if key.startswith("q"):
            fn = np.min if int(key[1:]) <= 50 else np.max
            out[key] = fn([p[key] for p in parts], axis=0)
    return out


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, Any]:
    return {k: {s: np.asarray(v).tolist() for s, v in d.items()} for k, d in stats.items()}


class LeRobotWriter:
    """Append episodes to a new LeRobot v3.0 dataset at ``root`` (local path or URI)."""

    def __init__(
        self,
        root: str | Path,
        cameras: Mapping[str, tuple[int, int]],
        state_dim: int,
        action_dim: int,
        config: WriterConfig = WriterConfig(),
    ):
        self.uri = str(root)
        self._remote = "://" in self.uri and not self.uri.startswith("file://")
        local = (
            tempfile.mkdtemp(prefix="lerobot-")
            if self._remote
            else self.uri.removeprefix("file://")
        )
        self.root = Path(local)
        if (self.root / INFO_PATH).exists():
            raise FileExistsError(f"a dataset already exists at {root}")
        self.config = config
        self.cameras = dict(cameras)
        self.state_dim, self.action_dim = state_dim, action_dim
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict[str, Any]] = []
        self._ep_stats: list[dict[str, dict[str, np.ndarray]]] = []
        self._chunk = self._file = 0
        self._in_file = 0
        self._pq: pq.ParquetWriter | None = None
        self._enc: dict[str, VideoEncoder] = {}
        self._video_info: dict[str, dict[str, Any]] = {}
        self._frames = 0
        self._schema = pa.schema(
            [
                ("action", pa.list_(pa.float32(), action_dim)),
                ("observation.state", pa.list_(pa.float32(), state_dim)),
                ("timestamp", pa.float32()),
                ("frame_index", pa.int64()),
                ("episode_index", pa.int64()),
                ("index", pa.int64()),
                ("task_index", pa.int64()),
            ]
        )

    def _path(self, template: str, **kw: Any) -> Path:
        path = self.root / template.format(chunk_index=self._chunk, file_index=self._file, **kw)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _roll_if_full(self) -> None:
        if self._pq is None:
            return
        cfg = self.config
        mb = 1024 * 1024
        full = cfg.episodes_per_file and self._in_file >= cfg.episodes_per_file
        full = full or os.path.getsize(self._pq.where) >= cfg.data_files_size_in_mb * mb
        full = full or any(
            _size(e.path) >= cfg.video_files_size_in_mb * mb for e in self._enc.values()
        )
        if full:
            self._close_files()
            self._file += 1
            if self._file == cfg.chunks_size:
                self._chunk, self._file = self._chunk + 1, 0

    def _close_files(self) -> None:
        if self._pq is not None:
            self._pq.close()
            self._pq = None
        for key, enc in self._enc.items():
            enc.close()
            self._video_info.setdefault(key, probe(enc.path))
        self._enc = {}
        self._in_file = 0

    def add_episode(self, episode: EpisodeRecord) -> int:
        """Write one episode; returns its ``episode_index``."""
        n = len(episode.action)
        if n == 0:
            raise ValueError("an episode needs at least one frame")
        if episode.state.shape != (n, self.state_dim) or episode.action.shape != (
            n,
            self.action_dim,
        ):
            raise ValueError(
                f"state {episode.state.shape} / action {episode.action.shape} do not match "
                f"({n}, {self.state_dim}) / ({n}, {self.action_dim})"
            )
        if set(episode.images) != set(self.cameras):
            raise ValueError(f"cameras {sorted(episode.images)} != {sorted(self.cameras)}")
        self._roll_if_full()
        ep_index = len(self.episodes)
        task_index = self.tasks.setdefault(episode.task, len(self.tasks))
        frame_index = np.arange(n, dtype=np.int64)
        columns: dict[str, np.ndarray] = {
            "action": np.asarray(episode.action, dtype=np.float32),
            "observation.state": np.asarray(episode.state, dtype=np.float32),
            "timestamp": (frame_index / self.config.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.full(n, ep_index, dtype=np.int64),
            "index": np.arange(self._frames, self._frames + n, dtype=np.int64),
            "task_index": np.full(n, task_index, dtype=np.int64),
        }
        arrays = []
        for value in columns.values():
            if value.ndim == 2:
                arrays.append(
                    pa.FixedSizeListArray.from_arrays(pa.array(value.reshape(-1)), value.shape[1])
                )
            else:
                arrays.append(pa.array(value))
        table = pa.Table.from_arrays(arrays, schema=self._schema)
        if self._pq is None:
            self._pq = pq.ParquetWriter(
                str(self._path(DATA_PATH)), self._schema, compression="snappy"
            )
        self._pq.write_table(table)
        row: dict[str, Any] = {
            "episode_index": ep_index,
            "tasks": [episode.task],
            "length": n,
            "data/chunk_index": self._chunk,
            "data/file_index": self._file,
            "dataset_from_index": self._frames,
            "dataset_to_index": self._frames + n,
        }
        stats = {name: feature_stats(value) for name, value in columns.items()}
        for cam, frames in episode.images.items():
            key = CAMERA_PREFIX + cam
            h, w = self.cameras[cam]
            if frames.shape != (n, h, w, 3) or frames.dtype != np.uint8:
                raise ValueError(
                    f"camera {cam}: frames {frames.shape} {frames.dtype}, expected ({n}, {h}, {w}, 3) uint8"
                )
            enc = self._enc.get(key)
            if enc is None:
                path = str(self._path(VIDEO_PATH, video_key=key))
                enc = self._enc[key] = VideoEncoder(
                    path, self.config.fps, w, h, CODECS[self.config.codec]
                )
            start = enc.start_episode()
            for image in frames:
                enc.add(image)
            row |= {
                f"videos/{key}/chunk_index": self._chunk,
                f"videos/{key}/file_index": self._file,
                f"videos/{key}/from_timestamp": start,
                f"videos/{key}/to_timestamp": start + n / self.config.fps,
            }
            stats[key] = image_stats(frames)
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0
        for feature, fstats in stats.items():
            for name, value in fstats.items():
                row[f"stats/{feature}/{name}"] = np.asarray(value).tolist()
        self.episodes.append(row)
        self._ep_stats.append(stats)
        self._frames += n
        self._in_file += 1
        return ep_index

    def features(self) -> dict[str, Any]:
        feats: dict[str, Any] = {
            "action": {"dtype": "float32", "shape": [self.action_dim], "names": None},
            "observation.state": {"dtype": "float32", "shape": [self.state_dim], "names": None},
        }
        for cam, (h, w) in self.cameras.items():
            key = CAMERA_PREFIX + cam
            feats[key] = {
                "dtype": "video",
                "shape": [h, w, 3],
                "names": ["height", "width", "channels"],
            }
            if key in self._video_info:
                feats[key]["info"] = self._video_info[key]
        return feats | DEFAULT_FEATURES

    def close(self) -> str:
        """Finish the files and write the metadata; returns the dataset URI."""
        if not self.episodes:
            raise ValueError("no episodes were added")
        self._close_files()
        import pandas as pd

        tasks = pd.DataFrame(
            {"task_index": list(self.tasks.values())}, index=pd.Index(list(self.tasks), name="task")
        )
        (self.root / TASKS_PATH).parent.mkdir(parents=True, exist_ok=True)
        tasks.to_parquet(self.root / TASKS_PATH)
        ep_path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        ep_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.episodes), str(ep_path))
        keys = self._ep_stats[0].keys()
        stats = {k: aggregate_stats([s[k] for s in self._ep_stats]) for k in keys}
        (self.root / STATS_PATH).write_text(json.dumps(_to_json(stats), indent=4))
        cfg = self.config
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": cfg.robot_type,
            "total_episodes": len(self.episodes),
            "total_frames": self._frames,
            "total_tasks": len(self.tasks),
            "chunks_size": cfg.chunks_size,
            "data_files_size_in_mb": cfg.data_files_size_in_mb,
            "video_files_size_in_mb": cfg.video_files_size_in_mb,
            "fps": cfg.fps,
            "splits": {"train": f"0:{len(self.episodes)}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.cameras else None,
            "features": self.features(),
        }
        (self.root / INFO_PATH).write_text(json.dumps(info, indent=4))
        if self._remote:
            fs, path = resolve_filesystem(self.uri)
            pafs.copy_files(str(self.root), path, destination_filesystem=fs)
            shutil.rmtree(self.root, ignore_errors=True)
        return self.uri


def write_dataset(
    root: str | Path,
    episodes: list[EpisodeRecord],
    config: WriterConfig = WriterConfig(),
) -> str:
    """Write ``episodes`` (all with the same cameras and shapes) as one dataset."""
    if not episodes:
        raise ValueError("nothing to write")
    first = episodes[0]
    cameras = {cam: tuple(v.shape[1:3]) for cam, v in first.images.items()}
    writer = LeRobotWriter(root, cameras, first.state.shape[1], first.action.shape[1], config)
    for ep in episodes:
        writer.add_episode(ep)
    return writer.close()
