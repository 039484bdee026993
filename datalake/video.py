"""MP4 encoding and sequential decoding with PyAV.

Encoding: frames of several episodes go into one mp4 per camera and file index, with
presentation timestamps continuous across episodes (frame ``k`` of the file at ``k / fps``
seconds) and a forced keyframe at each episode start, so an episode's frames are at
``from_timestamp + t`` exactly as LeRobot's concatenated files are.

Decoding: ``VideoFileReader`` keeps one container open and a cursor on the decoded stream.
Requests for increasing timestamps within a file (the order the lake asks in: one episode's
frames, in frame order) are served by decoding forward; a request behind the cursor or far
ahead seeks to the preceding keyframe. ``DecoderCache`` keeps a bounded set of readers open
and remembers files that failed, so a broken file costs one attempt, not one per sample.

Invariant: a returned frame is the one whose timestamp is within ``tolerance_s`` of the
request, or the call raises ``VideoError`` naming the file; never a neighbouring frame.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, cast

import av
import numpy as np
import pyarrow.fs as pafs
from av.video.stream import VideoStream

logging.getLogger("libav").setLevel(logging.ERROR)


class VideoError(RuntimeError):
    """A video file cannot be opened or does not hold a requested frame."""

    def __init__(self, message: str, path: str = "", reason: str = ""):
        super().__init__(message)
        self.path = path
        self.reason = reason or message

    @property
    def per_file(self) -> str:
        """The problem without per-frame detail, so a bad file is one log line, not one per frame."""
        return f"video {self.path}: {self.reason}" if self.path else str(self)


@dataclass(frozen=True)
class VideoCodec:
    """How camera streams are encoded."""

    encoder: str
    """FFmpeg encoder name (``libx264``, ``libx264rgb``, ``libsvtav1``)."""
    pix_fmt: str
    """Pixel format of the stream."""
    options: Mapping[str, str] = field(default_factory=dict)
    """Encoder options (``crf``, ``qp``, ``g``, ``preset``, ``svtav1-params``...)."""


CODECS: dict[str, VideoCodec] = {
    # LeRobot's default: AV1, yuv420p, a keyframe every 2 frames for random access.
    "av1": VideoCodec("libsvtav1", "yuv420p", {"crf": "30", "g": "2", "preset": "8"}),
    # Lossless AV1 coding; the 4:2:0 chroma subsampling still rounds colours (a few levels).
    "av1-lossless": VideoCodec(
        "libsvtav1", "yuv420p", {"svtav1-params": "lossless=1", "preset": "8"}
    ),
    "h264": VideoCodec("libx264", "yuv420p", {"crf": "23", "g": "2", "preset": "veryfast"}),
    # Bit-exact: RGB H.264 with qp 0 decodes to exactly the frames written.
    "h264-lossless": VideoCodec("libx264rgb", "rgb24", {"qp": "0", "preset": "veryfast"}),
}


class VideoEncoder:
    """Encode RGB frames into one mp4 file; timestamps run on across ``start_episode`` calls."""

    def __init__(self, path: str, fps: int, width: int, height: int, codec: VideoCodec):
        self.path = path
        self.fps = fps
        self.frames = 0
        self._container = av.open(path, "w")
        self._stream = cast(
            VideoStream,
            self._container.add_stream(codec.encoder, rate=fps, options=dict(codec.options)),
        )
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = codec.pix_fmt
        self._stream.time_base = Fraction(1, fps * 1024)
        self._keyframe_next = True

    def start_episode(self) -> float:
        """Mark the next frame as an episode start (a keyframe); return its file timestamp."""
        self._keyframe_next = True
        return self.frames / self.fps

    def add(self, image: np.ndarray) -> None:
        """Append one ``[H, W, 3]`` uint8 frame."""
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
        frame.pts = self.frames * 1024
        frame.time_base = self._stream.time_base
        if self._keyframe_next:
            frame.pict_type = av.video.frame.PictureType.I
            self._keyframe_next = False
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        self.frames += 1

    def close(self) -> None:
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()


def probe(path: str) -> dict[str, Any]:
    """LeRobot's ``info`` entry of a video feature (``video.height``, ``video.codec``, ...)."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        rate = stream.base_rate or stream.average_rate
        if rate is None:
            raise TypeError(f"video {path} has no frame rate")
        return {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec.canonical_name,
            "video.pix_fmt": stream.pix_fmt,
            "is_depth_map": False,
            "video.fps": int(rate),
            "video.channels": 3,
            "has_audio": any(s.type == "audio" for s in container.streams),
        }


class VideoFileReader:
    """One open container with a forward-decoding cursor."""

    def __init__(self, fs: pafs.FileSystem, path: str, tolerance_s: float):
        self.path = path
        self.tolerance_s = tolerance_s
        try:
            if isinstance(fs, pafs.LocalFileSystem):
                self._file = None
                self._container = av.open(path)
            else:
                self._file = fs.open_input_file(path)
                self._container = av.open(self._file)
            self._stream = self._container.streams.video[0]
        except FileNotFoundError as exc:
            raise VideoError(f"missing video {path}", path, "missing video file") from exc
        except (av.FFmpegError, IndexError, OSError) as exc:
            raise VideoError(
                f"cannot open video {path}: {exc}", path, f"cannot open: {exc}"
            ) from exc
        self._stream.thread_type = "AUTO"
        assert self._stream.time_base is not None
        self._time_base = float(self._stream.time_base)
        self._frames: Iterator[av.VideoFrame] | None = None
        self._current: tuple[float, av.VideoFrame] | None = None
        self.decoded = 0
        self.seeks = 0
        self.end_s: float | None = None
        """Timestamp of the last frame, once decoding has reached it."""
        self.max_forward_s = 2.0
        """Farther ahead than this, seeking beats decoding forward."""

    def _seek(self, ts: float) -> None:
        self._container.seek(max(0, int(ts / self._time_base)), stream=self._stream, backward=True)
        self._frames = self._container.decode(self._stream)
        self._current = None
        self.seeks += 1

    def _next(self) -> tuple[float, av.VideoFrame] | None:
        assert self._frames is not None
        try:
            frame = next(self._frames)
        except StopIteration:
            return None
        except av.FFmpegError as exc:
            raise VideoError(
                f"decoding {self.path} failed: {exc}", self.path, "decoding failed"
            ) from exc
        self.decoded += 1
        if frame.pts is None:
            raise TypeError(f"frame without pts in {self.path}")
        return float(frame.pts * self._time_base), frame

    def frame_at(self, ts: float, size: tuple[int, int] | None = None) -> np.ndarray:
        """The ``[H, W, 3]`` uint8 frame at file timestamp ``ts``, resized to ``size`` (H, W)."""
        tol = self.tolerance_s
        if self.end_s is not None and ts > self.end_s + tol:
            raise VideoError(
                f"no frame at t={ts:.4f}s in {self.path} (stream ends at {self.end_s:.4f}s)",
                self.path,
                "requested frames lie past the end of the stream",
            )
        cur = self._current
        if (
            self._frames is None
            or cur is None
            or ts < cur[0] - tol
            or ts > cur[0] + self.max_forward_s
        ):
            self._seek(ts)
        while self._current is None or self._current[0] < ts - tol:
            nxt = self._next()
            if nxt is None:
                last = "none" if self._current is None else f"{self._current[0]:.4f}s"
                if self._current is not None:
                    self.end_s = self._current[0]
                self._frames = None
                raise VideoError(
                    f"no frame at t={ts:.4f}s in {self.path} (stream ends, last frame {last})",
                    self.path,
                    "requested frames lie past the end of the stream",
                )
            self._current = nxt
        found, frame = self._current
        if abs(found - ts) > tol:
            raise VideoError(
                f"no frame at t={ts:.4f}s in {self.path} (nearest decoded {found:.4f}s)",
                self.path,
                "requested timestamps have no frame within tolerance",
            )
        if size is not None and (frame.height, frame.width) != tuple(size):
            return frame.to_ndarray(
                height=size[0], width=size[1], format="rgb24", interpolation="BILINEAR"
            )
        return frame.to_ndarray(format="rgb24")

    def close(self) -> None:
        self._container.close()
        if self._file is not None:
            self._file.close()


class DecoderCache:
    """A bounded LRU of open ``VideoFileReader``s plus the files known to be broken."""

    def __init__(self, max_open: int = 16, tolerance_s: float = 1e-3):
        self.max_open = max_open
        self.tolerance_s = tolerance_s
        self._open: OrderedDict[str, VideoFileReader] = OrderedDict()
        self.failed: dict[str, VideoError] = {}
        self.decoded = 0

    def reader(self, fs: pafs.FileSystem, path: str) -> VideoFileReader:
        if path in self.failed:
            raise self.failed[path]
        reader = self._open.get(path)
        if reader is None:
            try:
                reader = VideoFileReader(fs, path, self.tolerance_s)
            except VideoError as exc:
                self.failed[path] = exc
                raise
            self._open[path] = reader
            while len(self._open) > self.max_open:
                _, old = self._open.popitem(last=False)
                self.decoded += old.decoded
                old.close()
        self._open.move_to_end(path)
        return reader

    def frame(
        self, fs: pafs.FileSystem, path: str, ts: float, size: tuple[int, int] | None
    ) -> np.ndarray:
        return self.reader(fs, path).frame_at(ts, size)

    def frames_decoded(self) -> int:
        return self.decoded + sum(r.decoded for r in self._open.values())

    def close(self) -> None:
        for reader in self._open.values():
            self.decoded += reader.decoded
            reader.close()
        self._open.clear()


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of a uint8 ``[H, W, 3]`` image (how LeRobot stores ``image`` features)."""
    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt = image.shape[1], image.shape[0], "rgb24"
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def decode_image(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """A PNG / JPEG image stored in parquet as ``[H, W, 3]`` uint8, resized to ``size`` (H, W)."""
    codec: Literal["png", "mjpeg"] = "png" if data[:4] == b"\x89PNG" else "mjpeg"
    try:
        frames = av.CodecContext.create(codec, "r").decode(av.Packet(data))
    except av.FFmpegError as exc:
        raise VideoError(
            f"undecodable {codec} image: {exc}", reason=f"undecodable {codec} image"
        ) from exc
    if not frames:
        raise VideoError(f"empty {codec} image", reason=f"empty {codec} image")
    if size is None:
        return frames[0].to_ndarray(format="rgb24")
    return frames[0].to_ndarray(
        height=size[0], width=size[1], format="rgb24", interpolation="BILINEAR"
    )
