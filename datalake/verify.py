"""Deep check of a LeRobot v3.0 dataset: decode what training will decode, read what it will read.

``inspect`` (``datalake.report``) reads metadata only: file footers, stream headers. A file can
pass that and still fail in training: an mp4 cut short whose header (LeRobot writes it first)
still announces the full duration, a parquet file whose footer is intact but whose data pages
are corrupt. ``verify_dataset`` finds both before a job starts:

- every video file is decoded from its first frame through the last frame its episodes need,
  and each episode's frames (``from_timestamp + t / fps``, ``t < length``) must each have a
  decoded frame within ``tolerance_s``;
- every row group of every data file is read in full (all columns, page checksums verified
  when the file has them).

Output: one ``Problem`` per damaged file, naming the file and the episodes it affects (those
the lake would skip), plus counts of what was checked. Files are checked in a thread pool
(PyAV and Arrow release the GIL while decoding). Nothing here raises for bad data.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import av
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from datalake.format import DatasetMeta, Episode


@dataclass(frozen=True)
class Problem:
    """One damaged file and the episodes it makes unusable."""

    path: str
    """Path of the file inside the dataset's filesystem."""
    reason: str
    """What is wrong, without the file name."""
    episodes: tuple[int, ...]
    """``episode_index`` of every episode that needs the damaged part."""
    frames: tuple[int, ...]
    """Per episode, its frames (samples) that cannot be read: those without a decoded video
    frame, or all of them when its data rows are unreadable (the lake reads an episode's rows
    at once)."""

    def __str__(self) -> str:
        return (f"{self.path}: {self.reason}; affects {format_episodes(self.episodes)} "
                f"({sum(self.frames)} frames)")


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_dataset`` checked and what it found."""

    problems: tuple[Problem, ...]
    videos: int
    """Video files decoded."""
    frames_decoded: int
    row_groups: int
    """Parquet row groups read."""
    seconds: float
    affected_frames: int
    """Frames that cannot be read (a frame named by two problems counts once, at most its
    episode's length)."""


def format_episodes(indices: Iterable[int]) -> str:
    """``episodes 0-3, 7`` for [0, 1, 2, 3, 7]."""
    values = sorted(set(indices))
    if not values:
        return "no episode"
    runs: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ("episode " if len(values) == 1 else "episodes ") + ", ".join(runs)


def _open_video(meta: DatasetMeta, path: str):
    if isinstance(meta.fs, pafs.LocalFileSystem):
        return av.open(path), None
    handle = meta.fs.open_input_file(path)
    return av.open(handle), handle


def _decode_timestamps(meta: DatasetMeta, path: str, until: float) -> tuple[np.ndarray, str]:
    """Timestamps of the frames decoded from the start through ``until``, and why decoding
    stopped early ("" when it reached ``until``)."""
    stamps: list[float] = []
    reason = ""
    try:
        container, handle = _open_video(meta, path)
    except FileNotFoundError:
        return np.zeros(0), "missing video file"
    except (av.FFmpegError, OSError) as exc:
        return np.zeros(0), f"cannot open video: {exc}"
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        base = float(stream.time_base)
        for frame in container.decode(stream):
            if frame.pts is None:
                continue
            stamps.append(frame.pts * base)
            if stamps[-1] >= until:
                break
        else:
            last = f"{stamps[-1]:.3f}s" if stamps else "no frame"
            reason = f"stream ends at {last}, frames are needed up to {until:.3f}s"
    except (av.FFmpegError, IndexError, OSError) as exc:
        last = f"{stamps[-1]:.3f}s" if stamps else "the first frame"
        reason = f"decoding fails after {last}: {exc}"
    finally:
        container.close()
        if handle is not None:
            handle.close()
    return np.sort(np.asarray(stamps)), reason


def _missing(stamps: np.ndarray, wanted: np.ndarray, tolerance_s: float) -> int:
    """How many ``wanted`` timestamps have no decoded frame within ``tolerance_s``."""
    if not len(stamps):
        return len(wanted)
    i = np.searchsorted(stamps, wanted)
    left = stamps[np.clip(i - 1, 0, len(stamps) - 1)]
    right = stamps[np.clip(i, 0, len(stamps) - 1)]
    return int((np.minimum(np.abs(left - wanted), np.abs(right - wanted)) > tolerance_s).sum())


def _verify_video(
    meta: DatasetMeta, rel: str, uses: list[tuple[Episode, float]], tolerance_s: float
) -> tuple[Problem | None, int]:
    """Decode ``rel`` through the last frame of the episodes that use it (``(episode,
    from_timestamp)``); a problem names the episodes with a frame that was not decoded."""
    path = meta.path(rel)
    wanted = {ep.index: start + np.arange(ep.length) / meta.fps for ep, start in uses}
    until = max((float(ts[-1]) for ts in wanted.values() if len(ts)), default=0.0)
    stamps, reason = _decode_timestamps(meta, path, until - tolerance_s)
    missing = {ep.index: _missing(stamps, wanted[ep.index], tolerance_s) for ep, _ in uses}
    bad = sorted(i for i, n in missing.items() if n)
    if not bad:
        return None, len(stamps)
    if not reason:
        reason = f"no frame within {tolerance_s * 1000:g} ms of some of the episodes' timestamps"
    return Problem(path, reason, tuple(bad), tuple(missing[i] for i in bad)), len(stamps)


def _verify_data(meta: DatasetMeta, rel: str, episodes: list[Episode]) -> tuple[list[Problem], int]:
    """Read every row group of data file ``rel``; a problem per unreadable row group names the
    episodes whose rows lie in it (rows are in episode order from the file's first episode)."""
    path = meta.path(rel)
    episodes = sorted(episodes, key=lambda e: e.from_index)
    first = episodes[0].from_index
    spans = [(ep, ep.from_index - first, ep.from_index - first + ep.length) for ep in episodes]

    def problem(reason: str, lo: int, hi: int) -> Problem:
        hit = [ep for ep, a, b in spans if a < hi and b > lo]
        return Problem(path, reason, tuple(e.index for e in hit), tuple(e.length for e in hit))

    try:
        handle = meta.fs.open_input_file(path)
    except FileNotFoundError:
        return [problem("missing data file", 0, 1 << 62)], 0
    except OSError as exc:
        return [problem(f"cannot open: {exc}", 0, 1 << 62)], 0
    problems: list[Problem] = []
    groups = 0
    try:
        try:
            reader = pq.ParquetFile(handle, page_checksum_verification=True)
        except (pa.ArrowException, OSError) as exc:
            return [problem(f"unreadable parquet footer: {exc}", 0, 1 << 62)], 0
        row = 0
        for g in range(reader.metadata.num_row_groups):
            n = reader.metadata.row_group(g).num_rows
            try:
                reader.read_row_group(g)
            except (pa.ArrowException, OSError) as exc:
                problems.append(problem(f"row group {g} (rows {row}-{row + n - 1}) unreadable: "
                                        f"{exc}", row, row + n))
            groups += 1
            row += n
    finally:
        handle.close()
    return problems, groups


def verify_dataset(
    meta: DatasetMeta, tolerance_s: float = 1e-3, workers: int = 4
) -> VerifyReport:
    """Decode every video through the last frame its episodes need and read every parquet row
    group of ``meta``'s dataset; see the module docstring."""
    start = time.perf_counter()
    videos: dict[str, list[tuple[Episode, float]]] = defaultdict(list)
    data: dict[str, list[Episode]] = defaultdict(list)
    for ep in meta.episodes:
        data[ep.data_file].append(ep)
        for rel, from_ts, _ in ep.videos.values():
            videos[rel].append((ep, from_ts))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        video_jobs = [pool.submit(_verify_video, meta, rel, uses, tolerance_s)
                      for rel, uses in sorted(videos.items())]
        data_jobs = [pool.submit(_verify_data, meta, rel, eps) for rel, eps in sorted(data.items())]
        video_results = [j.result() for j in video_jobs]
        data_results = [j.result() for j in data_jobs]
    problems = [p for p, _ in video_results if p is not None]
    problems += [p for found, _ in data_results for p in found]
    lost: dict[int, int] = defaultdict(int)
    for p in problems:
        for i, n in zip(p.episodes, p.frames, strict=True):
            lost[i] = max(lost[i], n)
    return VerifyReport(
        problems=tuple(problems),
        videos=len(video_results),
        frames_decoded=sum(n for _, n in video_results),
        row_groups=sum(n for _, n in data_results),
        seconds=time.perf_counter() - start,
        affected_frames=sum(lost.values()),
    )
