"""LeRobot v3.0 dataset layout: reading the metadata and the per-frame parquet data.

A v3.0 dataset is a directory (local, or any pyarrow / fsspec filesystem URI) holding::

    meta/info.json                        codebase_version "v3.0", fps, features, path templates
    meta/stats.json                       per-feature min / max / mean / std / count / quantiles
    meta/tasks.parquet                    task string (index column "task") -> task_index
    meta/episodes/chunk-XXX/file-YYY.parquet
                                          one row per episode: length, tasks, dataset_from_index,
                                          dataset_to_index, data/chunk_index, data/file_index,
                                          videos/<key>/{chunk_index,file_index,from_timestamp,
                                          to_timestamp}, stats/<feature>/<stat>
    data/chunk-XXX/file-YYY.parquet       one row per frame, many episodes per file
    videos/<key>/chunk-XXX/file-YYY.mp4   many episodes concatenated per file

The frame at episode timestamp ``t`` of camera ``key`` is the video frame at
``videos/<key>/from_timestamp + t`` of that episode's video file.

``open_dataset`` validates once, at the boundary: an unreadable or unknown-version dataset is a
``DatasetError`` naming the file. Everything after that trusts the parsed ``DatasetMeta``.
"""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rlvla3.checkpoint.storage import resolve_filesystem

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
EPISODES_PATH = EPISODES_DIR + "/" + CHUNK_FILE + ".parquet"
DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 500
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
CAMERA_PREFIX = "observation.images."


class DatasetError(RuntimeError):
    """A dataset (or one of its files) cannot be read; the message names the file."""


@dataclass(frozen=True)
class Episode:
    """Where one episode lives."""

    index: int
    """``episode_index``."""
    length: int
    """Number of frames."""
    tasks: tuple[str, ...]
    """Task strings of the episode."""
    data_file: str
    """Path of the data parquet file, relative to the dataset root."""
    from_index: int
    """Global frame ``index`` of the first frame (``dataset_from_index``)."""
    videos: Mapping[str, tuple[str, float, float]] = field(default_factory=dict)
    """Video key -> (relative mp4 path, from_timestamp, to_timestamp)."""


@dataclass(frozen=True)
class DatasetMeta:
    """The parsed metadata of one LeRobot v3.0 dataset."""

    uri: str
    """Root as given (local path or URI)."""
    fs: pafs.FileSystem
    """Filesystem the dataset lives on."""
    base: str
    """Root path inside ``fs``."""
    info: Mapping[str, Any]
    """``meta/info.json`` as loaded."""
    episodes: tuple[Episode, ...]
    """Episodes sorted by index."""
    tasks: Mapping[int, str]
    """task_index -> task string."""
    stats: Mapping[str, Mapping[str, np.ndarray]]
    """``meta/stats.json`` as arrays (empty when the file is absent)."""

    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    @property
    def features(self) -> Mapping[str, Mapping[str, Any]]:
        return self.info["features"]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def camera_keys(self) -> list[str]:
        """Video features and ``image`` features (frames stored in the parquet rows)."""
        return [k for k, ft in self.features.items() if ft["dtype"] in ("video", "image")]

    @property
    def total_frames(self) -> int:
        return sum(ep.length for ep in self.episodes)

    def path(self, relative: str) -> str:
        """Path inside ``fs`` of a file given relative to the dataset root."""
        return posixpath.join(self.base, relative)

    def feature_shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.features[key]["shape"])


def camera_name(video_key: str) -> str:
    """Model-facing camera name of a LeRobot video key (``observation.images.wrist`` -> ``wrist``)."""
    return video_key[len(CAMERA_PREFIX) :] if video_key.startswith(CAMERA_PREFIX) else video_key


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def _read_parquet(fs: pafs.FileSystem, path: str, columns: list[str] | None = None) -> pa.Table:
    try:
        with fs.open_input_file(path) as f:
            return pq.read_table(f, columns=columns)
    except FileNotFoundError as exc:
        raise DatasetError(f"missing file {path}") from exc
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"unreadable parquet {path}: {exc}") from exc


def _list_parquet(fs: pafs.FileSystem, directory: str) -> list[str]:
    selector = pafs.FileSelector(directory, recursive=True, allow_not_found=True)
    return sorted(i.path for i in fs.get_file_info(selector) if i.path.endswith(".parquet"))


def _validate_info(info: Any, where: str) -> None:
    if not isinstance(info, Mapping):
        raise DatasetError(f"{where}: not a JSON object")
    version = info.get("codebase_version")
    if version != CODEBASE_VERSION:
        raise DatasetError(
            f"{where}: unsupported codebase_version {version!r} (this reader reads {CODEBASE_VERSION!r})"
        )
    for key in ("fps", "features", "data_path"):
        if key not in info:
            raise DatasetError(f"{where}: missing key {key!r}")
    for name, ft in info["features"].items():
        if not isinstance(ft, Mapping) or "dtype" not in ft or "shape" not in ft:
            raise DatasetError(f"{where}: feature {name!r} lacks dtype/shape")
    if any(ft["dtype"] == "video" for ft in info["features"].values()) and not info.get(
        "video_path"
    ):
        raise DatasetError(f"{where}: video features but no video_path template")


def _tasks(table: pa.Table) -> dict[int, str]:
    names = table.column_names
    task_col = (
        "task" if "task" in names else "__index_level_0__" if "__index_level_0__" in names else None
    )
    if task_col is None or "task_index" not in names:
        raise DatasetError(f"{TASKS_PATH}: expected columns 'task' and 'task_index', got {names}")
    return {
        int(i): str(t)
        for t, i in zip(table[task_col].to_pylist(), table["task_index"].to_pylist(), strict=True)
    }


def _episodes(table: pa.Table, info: Mapping[str, Any]) -> tuple[Episode, ...]:
    rows = table.to_pylist()
    video_keys = [k for k, ft in info["features"].items() if ft["dtype"] == "video"]
    out = []
    for row in rows:
        videos = {}
        for key in video_keys:
            rel = info["video_path"].format(
                video_key=key,
                chunk_index=row[f"videos/{key}/chunk_index"],
                file_index=row[f"videos/{key}/file_index"],
            )
            videos[key] = (
                rel,
                float(row[f"videos/{key}/from_timestamp"]),
                float(row[f"videos/{key}/to_timestamp"]),
            )
        out.append(
            Episode(
                index=int(row["episode_index"]),
                length=int(row["length"]),
                tasks=tuple(row.get("tasks") or ()),
                data_file=info["data_path"].format(
                    chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                ),
                from_index=int(row["dataset_from_index"]),
                videos=videos,
            )
        )
    return tuple(sorted(out, key=lambda e: e.index))


def open_dataset(uri: str | Path) -> DatasetMeta:
    """Read and validate the metadata of the LeRobot v3.0 dataset at ``uri``."""
    fs, base = resolve_filesystem(uri)
    info_path = posixpath.join(base, INFO_PATH)
    try:
        info = _read_json(fs, info_path)
    except FileNotFoundError as exc:
        raise DatasetError(f"no LeRobot dataset at {uri}: missing {INFO_PATH}") from exc
    except (OSError, ValueError) as exc:
        raise DatasetError(f"unreadable {info_path}: {exc}") from exc
    _validate_info(info, info_path)
    tasks = _tasks(_read_parquet(fs, posixpath.join(base, TASKS_PATH)))
    files = _list_parquet(fs, posixpath.join(base, EPISODES_DIR))
    if not files:
        raise DatasetError(f"no episode metadata under {posixpath.join(base, EPISODES_DIR)}")
    tables = []
    for path in files:
        t = _read_parquet(fs, path)
        tables.append(t.select([c for c in t.column_names if not c.startswith("stats/")]))
    try:
        episodes = _episodes(pa.concat_tables(tables, promote_options="permissive"), info)
    except (KeyError, pa.ArrowException) as exc:
        raise DatasetError(f"episode metadata under {EPISODES_DIR} lacks column {exc}") from exc
    stats: dict[str, dict[str, np.ndarray]] = {}
    stats_path = posixpath.join(base, STATS_PATH)
    if fs.get_file_info(stats_path).type == pafs.FileType.File:
        raw = _read_json(fs, stats_path)
        stats = {
            k: {s: np.asarray(v, dtype=np.float64) for s, v in d.items()} for k, d in raw.items()
        }
    return DatasetMeta(str(uri), fs, base, info, episodes, tasks, stats)


@functools.lru_cache(maxsize=16)
def open_dataset_cached(uri: str) -> DatasetMeta:
    """``open_dataset`` memoised per process (Ray workers reopen each dataset once)."""
    return open_dataset(uri)


def read_episode_table(
    meta: DatasetMeta, episode: Episode, columns: list[str] | None = None
) -> pa.Table:
    """The frames of ``episode`` from its data file, in frame order.

    Only the row groups whose ``episode_index`` statistics can hold the episode are read (LeRobot
    and ``LeRobotWriter`` write one row group per episode), so reading one episode of a large
    file does not read the file."""
    path = meta.path(episode.data_file)
    cols = None if columns is None else sorted(set(columns) | {"episode_index", "frame_index"})
    try:
        with meta.fs.open_input_file(path) as f:
            table = pq.read_table(f, columns=cols, filters=[("episode_index", "==", episode.index)])
    except FileNotFoundError as exc:
        raise DatasetError(f"missing file {path}") from exc
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"unreadable parquet {path}: {exc}") from exc
    order = np.argsort(table["frame_index"].to_numpy(), kind="stable")
    return table.take(pa.array(order))
