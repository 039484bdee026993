"""The Ray Data lake: mixed, shuffled, decoded, packed samples streamed to learners.

One module over 400 lines because the stages of one Ray Data pipeline share its plan and its
skip accounting.

Stages (one Ray Data pipeline per epoch):

1. plan (driver): an episode order. Each draw picks dataset ``i`` with probability
   ``w_i / mean_episode_length_i`` (so the share of *samples* follows the weights), then the
   next episode of that dataset's own seeded permutation (reshuffled on each pass).
2. expand (Ray tasks): an episode's data rows -> samples (``datalake.samples``).
3. decode (Ray actor pool, ``FrameDecoder``): each actor keeps containers open and decodes
   forward within a file; frames are resized to the model resolution.
4. consume (in the learner, ``PackedLoader``): a seeded local shuffle buffer, bad rows counted
   and dropped (``SkipLedger``), token lengths from ``length_fn``, then
   ``rlvla3.packing.pack_best_fit`` into rows of at most ``max_tokens`` with ``cu_seqlens``.

Invariants: for a given config and seed a single consumer sees the same sample order run
after run (``preserve_order`` plus seeded shuffles); with ``streaming_split`` the epoch's
samples are the same but which learner gets which block depends on timing. A sample that cannot be built is counted and named
in the log, never silently replaced; the run aborts with ``LakeError`` only when the skipped
fraction exceeds ``max_skip_fraction``. Backpressure comes from Ray Data's streaming executor
within ``max_cpus`` / ``object_store_mb``, so the lake can neither starve nor swamp learners.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from datalake.format import (
    DatasetError,
    DatasetMeta,
    camera_name,
    open_dataset,
    open_dataset_cached,
    resolve_filesystem,
)
from datalake.samples import ACTION_KEY, STATE_KEY, episode_samples
from datalake.video import DecoderCache, VideoError, decode_image
from rlvla3.config import ConfigError, require
from rlvla3.packing import cu_seqlens, pack_best_fit
from rlvla3.types import ObsBatch

log = logging.getLogger("datalake")

LengthFn = Callable[[ObsBatch, np.ndarray], np.ndarray]
"""``length_fn(obs, action_mask) -> int [n]``: tokens each sample costs the model."""


class LakeError(RuntimeError):
    """Too much of the data was unusable (or none was usable); the message says what and where."""


@dataclass(frozen=True)
class LakeConfig:
    """What the lake reads and how it feeds learners."""

    datasets: tuple[str, ...]
    """Dataset roots (local paths or filesystem URIs)."""
    weights: tuple[float, ...] = ()
    """Sampling weight per dataset (share of samples); empty: equal."""
    cameras: tuple[str, ...] = ()
    """Model camera names; empty: those of the first dataset."""
    image_size: tuple[int, ...] = ()
    """(H, W) frames are resized to (the model's resolution); empty: the native size of the
    first dataset's first camera."""
    chunk_len: int = 8
    normalize: Literal["none", "mean_std", "min_max"] = "mean_std"
    seed: int = 0
    samples_per_epoch: int = 0
    """Samples per epoch (0: the total frames of all datasets)."""
    shuffle_buffer: int = 256
    """Local shuffle buffer (samples) in the consumer; 0 disables it."""
    decode_actors: int = 2
    decode_batch_size: int = 32
    cpus_per_decoder: float = 0.5
    expand_cpus: float = 0.25
    """CPUs reserved per episode-expansion task."""
    max_open_files: int = 16
    tolerance_s: float = 1e-3
    max_tokens: int = 2048
    max_segments: int = 64
    pack_window: int = 128
    """Samples gathered before packing (larger: fuller rows, more latency)."""
    max_skip_fraction: float = 0.05
    min_samples_before_abort: int = 64
    max_cpus: float = 0.0
    """CPU limit of the lake's Ray Data execution (0: no limit)."""
    object_store_mb: int = 0
    """Object store limit of the lake's Ray Data execution (0: Ray's default)."""

    def validate(self) -> None:
        require(len(self.datasets) > 0, "datasets", "at least one dataset is needed")
        require(
            not self.weights or len(self.weights) == len(self.datasets),
            "weights",
            "one weight per dataset",
        )
        require(
            all(w >= 0 for w in self.weights) and (not self.weights or sum(self.weights) > 0),
            "weights",
            "must be >= 0 and not all zero",
        )
        require(self.chunk_len >= 1, "chunk_len", "must be >= 1")
        require(
            len(self.image_size) in (0, 2) and all(d > 0 for d in self.image_size),
            "image_size",
            "must be empty or (H, W) > 0",
        )
        require(self.decode_actors >= 1, "decode_actors", "must be >= 1")
        require(0.0 <= self.max_skip_fraction <= 1.0, "max_skip_fraction", "must be in [0, 1]")
        require(
            self.max_tokens >= 1 and self.max_segments >= 1,
            "max_tokens",
            "max_tokens and max_segments must be >= 1",
        )


def estimate_tokens(
    obs: ObsBatch, action_mask: np.ndarray, tokens_per_image: int = 64
) -> np.ndarray:
    """Default token estimate: image patches of present cameras, ~4 bytes per text token,
    one state token and one token per action step."""
    images = sum(mask.astype(np.int64) for mask in obs.image_mask.values()) if obs.image_mask else 0
    text = np.array([math.ceil(len(s.encode()) / 4) + 1 for s in obs.instruction], dtype=np.int64)
    return (images * tokens_per_image + text + 1 + action_mask.shape[1]).astype(np.int64)


class SkipLedger:
    """Counts used and skipped samples, logs each problem once, aborts past the threshold."""

    def __init__(self, max_fraction: float, min_samples: int):
        self.max_fraction = max_fraction
        self.min_samples = min_samples
        self.used = 0
        self.skipped = 0
        self.problems: Counter[str] = Counter()

    def skip(self, problem: str, count: int) -> None:
        if problem not in self.problems:
            log.warning("skipping %d sample(s): %s", count, problem)
        self.problems[problem] += count
        self.skipped += count

    @property
    def fraction(self) -> float:
        total = self.used + self.skipped
        return self.skipped / total if total else 0.0

    def check(self, final: bool = False) -> None:
        total = self.used + self.skipped
        if total == 0 or (not final and total < self.min_samples):
            return
        if self.fraction > self.max_fraction or (final and self.used == 0):
            worst = "; ".join(f"{p} ({n})" for p, n in self.problems.most_common(5))
            raise LakeError(
                f"skipped {self.skipped} of {total} samples ({self.fraction:.1%}), more than "
                f"max_skip_fraction={self.max_fraction:.1%}; problems: {worst}"
            )


@dataclass(frozen=True)
class PackedBatch:
    """One packed row: samples whose token lengths sum to at most ``max_tokens``."""

    obs: ObsBatch
    actions: np.ndarray
    """float32 ``[n, chunk_len, action_dim]``."""
    action_mask: np.ndarray
    """bool ``[n, chunk_len]``: False for steps padded past the episode end."""
    lengths: np.ndarray
    """int32 ``[n]`` token length of each sample."""
    cu_seqlens: np.ndarray
    """int32 ``[n + 1]`` segment boundaries in the packed token stream."""
    source: np.ndarray
    """int64 ``[n, 3]``: dataset, episode, frame of each sample."""

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def plan_episodes(
    metas: Sequence[DatasetMeta | None],
    weights: Sequence[float],
    seed: int,
    epoch: int,
    samples: int,
) -> list[tuple[int, int]]:
    """(dataset, episode position) draws for one epoch, deterministic in (seed, epoch)."""
    by_index = {i: m for i, m in enumerate(metas) if m is not None and m.episodes}
    live = list(by_index)
    if not live:
        return []
    w = np.array([weights[i] if weights else 1.0 for i in live], dtype=np.float64)
    mean_len = np.array([by_index[i].total_frames / len(by_index[i].episodes) for i in live])
    p = w / mean_len
    p = p / p.sum()
    rng = np.random.default_rng([seed, epoch])
    perms: dict[int, list[int]] = {i: [] for i in live}
    plan: list[tuple[int, int]] = []
    frames = 0
    while frames < samples:
        i = live[int(rng.choice(len(live), p=p))]
        if not perms[i]:
            perms[i] = rng.permutation(len(by_index[i].episodes)).tolist()
        pos = perms[i].pop()
        plan.append((i, pos))
        frames += by_index[i].episodes[pos].length
    return plan


def expand_episodes(
    batch: dict[str, np.ndarray],
    uris: Sequence[str],
    cameras: Sequence[str],
    chunk_len: int,
    normalize: str,
) -> dict[str, np.ndarray]:
    """Ray Data stage: planned episodes -> sample rows."""
    parts = []
    for d, pos in zip(batch["dataset"], batch["position"], strict=True):
        meta = open_dataset_cached(uris[int(d)])
        parts.append(
            episode_samples(meta, int(d), meta.episodes[int(pos)], cameras, chunk_len, normalize)
        )
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class FrameDecoder:
    """Ray Data actor: decodes the camera frames of sample rows, keeping containers open."""

    def __init__(
        self,
        uris: Sequence[str],
        cameras: Sequence[str],
        image_size: tuple[int, int],
        max_open: int,
        tolerance_s: float,
    ):
        self.fs = [resolve_filesystem(u)[0] for u in uris]
        self.cameras = list(cameras)
        h, w = image_size
        self.size = (h, w)
        self.cache = DecoderCache(max_open, tolerance_s)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["frame"])
        h, w = self.size
        out = {k: v for k, v in batch.items() if not k.startswith(("video.", "ts.", "png."))}
        out["problem"] = batch["problem"].copy()
        out["skips"] = batch["skips"].copy()
        for cam in self.cameras:
            images = np.zeros((n, h, w, 3), np.uint8)
            present = np.zeros(n, bool)
            paths, stamps, stills = batch[f"video.{cam}"], batch[f"ts.{cam}"], batch[f"png.{cam}"]
            for i in range(n):
                if out["problem"][i] or not (paths[i] or stills[i]):
                    continue
                try:
                    if stills[i]:
                        images[i] = decode_image(stills[i], self.size)
                    else:
                        fs = self.fs[int(batch["dataset"][i])]
                        images[i] = self.cache.frame(fs, paths[i], float(stamps[i]), self.size)
                    present[i] = True
                except VideoError as exc:
                    out["problem"][i], out["skips"][i] = exc.per_file, 1
            out[f"image.{cam}"] = images
            out[f"has.{cam}"] = present
        return out


class Lake:
    """The data lake over ``config.datasets``; builds one Ray Data pipeline per epoch."""

    def __init__(self, config: LakeConfig, length_fn: LengthFn | None = None):
        self.config = config
        self.length_fn = length_fn or estimate_tokens
        self.metas: list[DatasetMeta | None] = []
        self.dataset_problems: list[tuple[str, int]] = []
        for uri in config.datasets:
            try:
                self.metas.append(open_dataset(uri))
            except DatasetError as exc:
                self.metas.append(None)
                self.dataset_problems.append((f"dataset {uri} skipped: {exc}", 1))
        live = [m for m in self.metas if m is not None]
        if not live:
            raise LakeError(
                "no readable dataset: " + "; ".join(p for p, _ in self.dataset_problems)
            )
        first = live[0]
        self.cameras = tuple(config.cameras) or tuple(camera_name(k) for k in first.camera_keys)
        native = first.feature_shape(first.camera_keys[0])[:2] if first.camera_keys else (224, 224)
        h, w = tuple(config.image_size) or native
        self.image_size = (h, w)
        self.state_dim = first.feature_shape(STATE_KEY)[0]
        self.action_dim = first.feature_shape(ACTION_KEY)[0]
        for i, m in enumerate(self.metas):
            if m is None:
                continue
            shapes = (m.feature_shape(STATE_KEY)[0], m.feature_shape(ACTION_KEY)[0])
            if shapes != (self.state_dim, self.action_dim):
                self.metas[i] = None
                self.dataset_problems.append(
                    (
                        f"dataset {m.uri} skipped: state/action dims {shapes} != {(self.state_dim, self.action_dim)}",
                        m.total_frames,
                    )
                )
            elif config.normalize != "none" and not {STATE_KEY, ACTION_KEY} <= set(m.stats):
                raise ConfigError(
                    "normalize", f"{m.uri} has no meta/stats.json entries for state and action"
                )

    @property
    def total_frames(self) -> int:
        return sum(m.total_frames for m in self.metas if m is not None)

    def min_max(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-dimension (min, max) of feature ``key`` over every dataset's
        ``meta/stats.json``; None when a dataset has no min/max of it."""
        live = [m for m in self.metas if m is not None]
        if not live or not all({"min", "max"} <= set(m.stats.get(key, {})) for m in live):
            return None
        return (np.min([m.stats[key]["min"] for m in live], axis=0),
                np.max([m.stats[key]["max"] for m in live], axis=0))

    def state_range(self, margin: float = 0.05) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-dimension (low, high) of the state over every dataset's ``meta/stats.json``,
        each side widened by ``margin`` of the span; None when a dataset has no state stats."""
        bounds = self.min_max(STATE_KEY)
        if bounds is None:
            return None
        low, high = bounds
        pad = np.maximum(high - low, 1e-3) * margin
        return low - pad, high + pad

    def action_stats(self, floor: float = 1e-3) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-dimension (mean, std) of the action over every dataset's ``meta/stats.json``,
        pooled by frame count, the std floored at ``floor``; None when a dataset has none."""
        live = [m for m in self.metas if m is not None]
        if not live or not all({"mean", "std"} <= set(m.stats.get(ACTION_KEY, {})) for m in live):
            return None
        frames = np.array([max(m.total_frames, 1) for m in live], np.float64)[:, None]
        means = np.array([m.stats[ACTION_KEY]["mean"] for m in live], np.float64)
        stds = np.array([m.stats[ACTION_KEY]["std"] for m in live], np.float64)
        mean = (frames * means).sum(0) / frames.sum()
        second = (frames * (stds**2 + means**2)).sum(0) / frames.sum()
        return mean, np.maximum(np.sqrt(np.maximum(second - mean**2, 0.0)), floor)

    def plan(self, epoch: int = 0) -> list[tuple[int, int]]:
        samples = self.config.samples_per_epoch or self.total_frames
        return plan_episodes(self.metas, self.config.weights, self.config.seed, epoch, samples)

    def samples(self, epoch: int = 0) -> Any:
        """The decoded-sample ``ray.data.Dataset`` of one epoch (rows in a deterministic order)."""
        import ray.data
        from ray.data import ActorPoolStrategy, DataContext, ExecutionResources

        cfg = self.config
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if cfg.decode_actors * cfg.cpus_per_decoder + cfg.expand_cpus > cpus:
            raise ConfigError(
                "decode_actors",
                f"{cfg.decode_actors} decoders x {cfg.cpus_per_decoder} CPU + {cfg.expand_cpus} CPU for "
                f"expansion exceed the cluster's {cpus:g} CPUs (the pipeline would stall)",
            )
        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.execution_options.resource_limits = ExecutionResources(
            cpu=cfg.max_cpus or None, object_store_memory=cfg.object_store_mb * 2**20 or None
        )
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False  # the job prints its own progress
        plan = self.plan(epoch)
        uris = [m.uri if m is not None else "" for m in self.metas]
        items = [{"dataset": d, "position": p} for d, p in plan]
        ds: ray.data.Dataset = ray.data.from_items(
            items, override_num_blocks=max(1, min(len(items), 1000))
        )
        ds = ds.map_batches(
            expand_episodes,  # type: ignore[arg-type]
            batch_size=1,
            batch_format="numpy",
            fn_kwargs={
                "uris": uris,
                "cameras": self.cameras,
                "chunk_len": cfg.chunk_len,
                "normalize": cfg.normalize,
            },
            num_cpus=cfg.expand_cpus,
        )
        return ds.map_batches(
            FrameDecoder,
            batch_size=cfg.decode_batch_size,
            batch_format="numpy",
            fn_constructor_kwargs={
                "uris": uris,
                "cameras": self.cameras,
                "image_size": self.image_size,
                "max_open": cfg.max_open_files,
                "tolerance_s": cfg.tolerance_s,
            },
            compute=ActorPoolStrategy(size=cfg.decode_actors),
            num_cpus=cfg.cpus_per_decoder,
        )

    def split(self, n: int, epoch: int = 0) -> list[Any]:
        """``n`` streaming shards (``DataIterator``s) for learner actors."""
        return self.samples(epoch).streaming_split(n, equal=True)

    def loader(self, source: Any, epoch: int = 0) -> PackedLoader:
        """A packed-row iterator over a ``Dataset`` or a ``DataIterator`` shard."""
        ledger = SkipLedger(self.config.max_skip_fraction, self.config.min_samples_before_abort)
        for problem, count in self.dataset_problems:
            ledger.skip(problem, count)
        return PackedLoader(source, self.config, self.cameras, self.length_fn, ledger, epoch)

    def packed(self, epoch: int = 0) -> PackedLoader:
        """Packed rows of one epoch for a single consumer."""
        return self.loader(self.samples(epoch), epoch)


class PackedLoader:
    """Consumer side: shuffle buffer, skip accounting, token lengths, best-fit packing."""

    def __init__(
        self,
        source: Any,
        config: LakeConfig,
        cameras: Sequence[str],
        length_fn: LengthFn,
        ledger: SkipLedger,
        epoch: int = 0,
    ):
        self.source = source
        self.config = config
        self.cameras = list(cameras)
        self.length_fn = length_fn
        self.ledger = ledger
        self.epoch = epoch
        self.samples = 0

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        cfg = self.config
        yield from self.source.iter_batches(
            batch_size=cfg.decode_batch_size,
            batch_format="numpy",
            local_shuffle_buffer_size=cfg.shuffle_buffer or None,
            local_shuffle_seed=(cfg.seed * 1_000_003 + self.epoch) if cfg.shuffle_buffer else None,
        )

    def _take(self, rows: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in rows.items()}

    def _emit(self, pool: dict[str, np.ndarray], index: list[int]) -> PackedBatch:
        idx = np.asarray(sorted(index))
        rows = self._take(pool, idx)
        obs = ObsBatch(
            images={c: rows[f"image.{c}"] for c in self.cameras},
            image_mask={c: rows[f"has.{c}"] for c in self.cameras},
            state=rows["state"],
            instruction=tuple(str(t) for t in rows["task"]),
        )
        lengths = rows["_len"].astype(np.int32)
        source = np.stack([rows["dataset"], rows["episode"], rows["frame"]], axis=1).astype(
            np.int64
        )
        return PackedBatch(
            obs, rows["actions"], rows["action_mask"], lengths, cu_seqlens(lengths.tolist()), source
        )

    def _pack(
        self, pool: dict[str, np.ndarray], final: bool
    ) -> tuple[list[PackedBatch], dict[str, np.ndarray] | None]:
        cfg = self.config
        rows = pack_best_fit(pool["_len"].tolist(), cfg.max_tokens, cfg.max_segments)
        # Best-fit fills rows in order; the emptiest row waits for the next window unless final.
        fill = [int(pool["_len"][r].sum()) for r in rows]
        keep = [] if final or len(rows) < 2 else [int(np.argmin(fill))]
        out = [self._emit(pool, r) for j, r in enumerate(rows) if j not in keep]
        rest = self._take(pool, np.asarray(sorted(rows[keep[0]]))) if keep else None
        return out, rest

    def __iter__(self) -> Iterator[PackedBatch]:
        pool: dict[str, np.ndarray] | None = None
        for batch in self._batches():
            bad = batch["problem"] != ""
            for i in np.flatnonzero(bad):
                self.ledger.skip(str(batch["problem"][i]), int(batch["skips"][i]))
            good = self._take(batch, np.flatnonzero(~bad))
            self.ledger.used += len(good["frame"])
            self.ledger.check()
            if len(good["frame"]) == 0:
                continue
            obs = ObsBatch(
                images={c: good[f"image.{c}"] for c in self.cameras},
                image_mask={c: good[f"has.{c}"] for c in self.cameras},
                state=good["state"],
                instruction=tuple(str(t) for t in good["task"]),
            )
            good["_len"] = np.asarray(self.length_fn(obs, good["action_mask"]), dtype=np.int64)
            pool = good if pool is None else {k: np.concatenate([pool[k], good[k]]) for k in good}
            if len(pool["frame"]) >= self.config.pack_window:
                out, pool = self._pack(pool, final=False)
                for packed in out:
                    self.samples += len(packed)
                    yield packed
        self.ledger.check(final=True)
        if pool is not None and len(pool["frame"]):
            out, _ = self._pack(pool, final=True)
            for packed in out:
                self.samples += len(packed)
                yield packed
