"""Inspect a LeRobot v3.0 dataset: its shape, its codecs, its size, and every problem found.

``inspect_dataset`` never raises for bad data: it reads what it can and lists each problem
(unreadable metadata, unknown version, unreadable or short data files, features whose stored
shape differs from ``info.json``, missing or unopenable videos, episodes whose frames lie past
the end of their video) with the file it concerns. That check reads metadata only (footers,
stream headers) and stays fast; ``verify=True`` adds the deep check of ``datalake.verify``
(decode every video through the last frame its episodes need, read every parquet row group),
whose problems also name the episodes affected. ``unreadable_frames`` is the quick check as
``rlvla3 sft`` runs it before it starts: the files that cannot be opened and the frames they
take with them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import av
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from datalake.format import DatasetError, DatasetMeta, camera_name, open_dataset, resolve_filesystem


def _size_on_disk(fs: pafs.FileSystem, base: str) -> int:
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)


def _check_data(meta: DatasetMeta, problems: list[str],
                bad: dict[str, str] | None = None) -> None:
    """Footers of the data files: rows and feature widths; ``bad`` gets each file that cannot
    be read at all (relative path -> the problem)."""
    bad = {} if bad is None else bad
    rows_expected: dict[str, int] = defaultdict(int)
    for ep in meta.episodes:
        rows_expected[ep.data_file] += ep.length
    for rel, expected in sorted(rows_expected.items()):
        path = meta.path(rel)
        try:
            with meta.fs.open_input_file(path) as f:
                schema = pq.read_schema(f)
                f.seek(0)
                rows = pq.read_metadata(f).num_rows
        except FileNotFoundError:
            problems.append(bad.setdefault(rel, f"missing data file {path}"))
            continue
        except (pa.ArrowException, OSError) as exc:
            problems.append(bad.setdefault(rel, f"unreadable data file {path}: {exc}"))
            continue
        if rows != expected:
            problems.append(f"{path}: {rows} rows, episode metadata expects {expected}")
        for name, ft in meta.features.items():
            if ft["dtype"] in ("video", "image", "string") or len(ft["shape"]) != 1:
                continue
            if name not in schema.names:
                problems.append(f"{path}: feature {name!r} missing")
                continue
            typ = schema.field(name).type
            width = (
                typ.list_size
                if pa.types.is_fixed_size_list(typ)
                else None
                if pa.types.is_list(typ)
                else 1
            )
            if width is not None and width != ft["shape"][0]:
                problems.append(
                    f"{path}: feature {name!r} has width {width}, info.json says {ft['shape'][0]}"
                )


def _check_videos(meta: DatasetMeta, problems: list[str],
                  bad: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Stream headers of the videos: codec, size, duration against the frames the episodes
    need; ``bad`` gets each video that cannot be opened (relative path -> the problem)."""
    bad = {} if bad is None else bad
    needed: dict[str, float] = defaultdict(float)
    for ep in meta.episodes:
        for rel, _, end in ep.videos.values():
            needed[rel] = max(needed[rel], end)
    found: dict[str, dict[str, Any]] = {}
    for rel, end in sorted(needed.items()):
        path = meta.path(rel)
        try:
            handle = (
                None if isinstance(meta.fs, pafs.LocalFileSystem) else meta.fs.open_input_file(path)
            )
            with av.open(path if handle is None else handle) as container:
                stream = container.streams.video[0]
                assert stream.time_base is not None
                duration = (
                    float(stream.duration * stream.time_base)
                    if stream.duration
                    else float(container.duration or 0) / av.time_base
                )
                key = rel.split("/")[1]
                found.setdefault(
                    key,
                    {
                        "codec": stream.codec.canonical_name,
                        "pix_fmt": stream.pix_fmt,
                        "height": stream.height,
                        "width": stream.width,
                    },
                )
            if duration + 0.5 / meta.fps < end:
                problems.append(
                    f"{path}: video ends at {duration:.3f}s, episodes need frames up to {end:.3f}s"
                )
        except FileNotFoundError:
            problems.append(bad.setdefault(rel, f"missing video {path}"))
        except (av.FFmpegError, IndexError, AttributeError, OSError) as exc:  # no stream
            problems.append(bad.setdefault(rel, f"unreadable video {path}: {exc}"))
    return found


def unreadable_frames(meta: DatasetMeta) -> tuple[list[str], int]:
    """The quick check of ``inspect`` (headers and footers only) as the lake will meet it:
    the problems of files that cannot be opened at all, and how many frames lie in the
    episodes that need one of them (the lake skips those). Problems a file can still be read
    around (a short video, a wrong width) are left to the lake, which skips and counts them."""
    bad: dict[str, str] = {}
    _check_data(meta, [], bad)
    _check_videos(meta, [], bad)
    lost = sum(ep.length for ep in meta.episodes
               if ep.data_file in bad or any(v[0] in bad for v in ep.videos.values()))
    return list(bad.values()), lost


def inspect_dataset(uri: str, verify: bool = False, workers: int = 4) -> dict[str, Any]:
    """A JSON-able report of the dataset at ``uri`` (``problems`` lists what is wrong);
    ``verify`` adds the deep check (``verified``: what it decoded and read, in how long)."""
    fs, base = resolve_filesystem(uri)
    report: dict[str, Any] = {
        "path": str(uri),
        "size_on_disk": _size_on_disk(fs, base),
        "problems": [],
    }
    try:
        meta = open_dataset(uri)
    except DatasetError as exc:
        report["problems"].append(str(exc))
        return report
    problems: list[str] = report["problems"]
    videos = _check_videos(meta, problems)
    _check_data(meta, problems)
    report |= {
        "codebase_version": meta.info["codebase_version"],
        "episodes": len(meta.episodes),
        "frames": meta.total_frames,
        "fps": meta.fps,
        "robot_type": meta.info.get("robot_type"),
        "features": {
            k: {"dtype": ft["dtype"], "shape": list(ft["shape"])} for k, ft in meta.features.items()
        },
        "cameras": {
            camera_name(k): {"key": k, "storage": meta.features[k]["dtype"], **videos.get(k, {})}
            for k in meta.camera_keys
        },
        "tasks": [meta.tasks[i] for i in sorted(meta.tasks)],
        "codec": sorted({v["codec"] for v in videos.values()}),
        "stats": sorted(meta.stats),
    }
    if report["frames"] != meta.info.get("total_frames", report["frames"]):
        problems.append(
            f"info.json total_frames {meta.info['total_frames']} != {report['frames']} in episodes"
        )
    if verify:
        from datalake.verify import verify_dataset

        deep = verify_dataset(meta, workers=workers)
        problems.extend(str(p) for p in deep.problems)
        report["verified"] = {
            "videos": deep.videos,
            "frames_decoded": deep.frames_decoded,
            "row_groups": deep.row_groups,
            "affected_episodes": sorted({i for p in deep.problems for i in p.episodes}),
            "affected_frames": deep.affected_frames,
            "seconds": round(deep.seconds, 3),
        }
    return report
