"""``rlvla3 bench lake``: the data lake against the torch ``DataLoader`` a LeRobot user writes.

Both loaders read the same generated LeRobot v3.0 dataset (several episodes per file, two
cameras, AV1 with LeRobot's keyframe interval of 2 unless ``--codec`` says otherwise) and
deliver the same samples of one epoch: the lake's episode plan for the seed, frames resized to
the model's resolution, rows packed by the same best-fit packer (``datalake.pipeline.
PackedLoader``) with the model's own token counts. The consumer, identical for both, trains the
VLA (``--preset``, forward + backward + AdamW step of the flow-matching SFT loss) on every
packed row.

- ``lake``: ``datalake.pipeline.Lake``: episodes expanded in Ray tasks, decoded by a pool of
  ``--decoders`` Ray actors that keep files open and decode forward, a local shuffle buffer.
- ``dataloader``: ``torch.utils.data.DataLoader`` over ``SampleDataset``, a map-style dataset
  with one item per sample of the same plan: ``--loader-workers`` processes (default: the
  machine's cores), persistent, ``--prefetch`` batches each in flight; each worker keeps its
  video files open (as LeRobot's decoder cache does) and seeks to each sample's frame. The
  order comes from ``EpisodeShuffleSampler``: the plan's episode order through a seeded
  shuffle buffer of the same size as the lake's. Decoding and resizing run the lake's own code
  (``FrameDecoder``), so only the pipeline differs.

Reported per loader (from the first row on, start-up apart as ``startup_s``):
``samples_per_s``, ``decoded_frames_per_s`` and the consumer's ``data_wait_fraction`` (time
blocked on the loader / wall time), plus ``ratio_lake_over_dataloader``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from datalake import synthetic
from datalake.format import open_dataset_cached
from datalake.pipeline import FrameDecoder, Lake, LakeConfig, PackedBatch, PackedLoader, SkipLedger
from datalake.samples import episode_samples
from datalake.writer import WriterConfig, write_dataset
from rlvla3.machine import usable_cpus
from rlvla3.types import ObsBatch


class SampleDataset(Dataset):
    """Map-style: item ``k`` is sample ``k`` of the lake's epoch plan (episodes in plan order,
    frames in order), decoded into the lake's row schema (a one-row column batch).

    A worker keeps the rows of its last ``cache_episodes`` episodes (a LeRobot dataset holds
    its parquet data in memory) and one ``FrameDecoder`` (open containers; a frame behind the
    cursor or far ahead is a seek). An episode whose rows cannot be read is one problem row at
    its first frame (standing for all its frames, as in the lake) and empty items after it."""

    def __init__(self, lake: Lake, epoch: int = 0, cache_episodes: int = 8):
        cfg = lake.config
        self.uris = [m.uri if m is not None else "" for m in lake.metas]
        self.cameras = tuple(lake.cameras)
        self.image_size = lake.image_size
        self.chunk_len, self.normalize = cfg.chunk_len, cfg.normalize
        self.max_open, self.tolerance_s = cfg.max_open_files, cfg.tolerance_s
        self.plan = lake.plan(epoch)
        self.index: list[tuple[int, int]] = []
        for j, (d, pos) in enumerate(self.plan):
            meta = lake.metas[d]
            assert meta is not None  # the plan draws from live datasets only
            self.index += [(j, t) for t in range(meta.episodes[pos].length)]
        self.cache_episodes = cache_episodes
        self._rows: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._decoder: FrameDecoder | None = None

    def __len__(self) -> int:
        return len(self.index)

    def _episode_rows(self, j: int) -> dict[str, np.ndarray]:
        rows = self._rows.get(j)
        if rows is None:
            d, pos = self.plan[j]
            meta = open_dataset_cached(self.uris[d])
            rows = episode_samples(meta, d, meta.episodes[pos], self.cameras, self.chunk_len,
                                   self.normalize)
            self._rows[j] = rows
            while len(self._rows) > self.cache_episodes:
                self._rows.popitem(last=False)
        self._rows.move_to_end(j)
        return rows

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        j, t = self.index[k]
        rows = self._episode_rows(j)
        if len(rows["frame"]) <= t or rows["skips"][0] > 1:  # one row for the whole episode
            t = 0 if t == 0 else len(rows["frame"])
        one = {key: value[t : t + 1] for key, value in rows.items()}
        if self._decoder is None:
            self._decoder = FrameDecoder(self.uris, self.cameras, self.image_size, self.max_open,
                                         self.tolerance_s)
        return self._decoder(one)


class EpisodeShuffleSampler(Sampler[int]):
    """Sample indices in episode-plan order (frames in order) through a seeded shuffle buffer
    of ``buffer`` samples: each draw takes a random buffered index and refills its place."""

    def __init__(self, dataset: SampleDataset, buffer: int, seed: int, epoch: int = 0):
        self.n, self.buffer, self.seed, self.epoch = len(dataset), buffer, seed, epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch, 7])
        pool: list[int] = []
        for k in range(self.n):
            if len(pool) < max(self.buffer, 1):
                pool.append(k)
                continue
            i = int(rng.integers(len(pool)))
            yield pool[i]
            pool[i] = k
        yield from (pool[i] for i in rng.permutation(len(pool)))


def collate_rows(items: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate one-row column batches (numpy, so the main process packs as the lake does)."""
    return {key: np.concatenate([item[key] for item in items]) for key in items[0]}


class _LoaderSource:
    """Presents a ``DataLoader`` to ``PackedLoader`` as a block source (already shuffled)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def iter_batches(self, **_: Any) -> Iterator[dict[str, np.ndarray]]:
        yield from self.loader


def dataloader_rows(
    lake: Lake, workers: int, prefetch: int, epoch: int = 0
) -> tuple[PackedLoader, DataLoader]:
    """Packed rows of one epoch through a ``DataLoader`` (see the module docstring)."""
    cfg = lake.config
    dataset = SampleDataset(lake, epoch)
    loader = DataLoader(
        dataset,
        batch_size=cfg.decode_batch_size,
        sampler=EpisodeShuffleSampler(dataset, cfg.shuffle_buffer, cfg.seed, epoch),
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch if workers > 0 else None,
        collate_fn=collate_rows,
        # Ray may already run in this process: spawned workers do not inherit its threads.
        multiprocessing_context="spawn" if workers > 0 else None,
    )
    ledger = SkipLedger(cfg.max_skip_fraction, cfg.min_samples_before_abort)
    rows = PackedLoader(_LoaderSource(loader), cfg, lake.cameras, lake.length_fn, ledger, epoch)
    return rows, loader


def _consume(rows, step) -> dict[str, float]:
    """Drive an iterator of ``PackedBatch`` rows as a learner would; time the waits."""
    wait = 0.0
    samples = frames = steps = 0
    start = time.perf_counter()
    first = None
    t = start
    for batch in rows:
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            wait += now - t
        samples += len(batch)
        frames += int(sum(m.sum() for m in batch.obs.image_mask.values()))
        step(batch)
        steps += 1
        t = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    steady = max(end - first, 1e-9)
    return {
        "samples": samples,
        "steps": steps,
        "samples_per_s": samples / steady,
        "decoded_frames_per_s": frames / steady,
        "data_wait_fraction": wait / steady,
        "startup_s": first - start,
        "wall_s": end - start,
    }


def _trainer(spec, preset: str, image_size: int, seed: int):
    """A fresh VLA's token counts (the lake's ``length_fn``) and a step function: forward +
    backward + AdamW on one packed row."""
    from rlvla3.config import Named
    from rlvla3.policies import build_policy
    from rlvla3.policies.vla.policy import VLAPolicy

    torch.manual_seed(seed)
    policy = cast(VLAPolicy, build_policy(
        Named("vla", {"preset": preset, "image_size": image_size, "seed": seed}), spec))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def step(batch: PackedBatch) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = policy.sft_loss(batch.obs, torch.as_tensor(batch.actions),
                               torch.as_tensor(batch.action_mask))
        loss.backward()
        optimizer.step()

    def length_fn(obs: ObsBatch, action_mask: np.ndarray) -> np.ndarray:
        return policy.token_counts(obs)

    return length_fn, step


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from rlvla3.types import EnvSpec

    workdir = Path(args.dir or tempfile.mkdtemp(prefix="bench-lake-"))
    root = workdir / f"bench-{args.codec}-{args.episodes}x{args.length}-{args.image_size[0]}"
    if not (root / "meta/info.json").exists():
        eps = synthetic.episodes(
            args.episodes, args.length, args.length, size=tuple(args.image_size)
        )
        write_dataset(root, eps, WriterConfig(fps=10, codec=args.codec, episodes_per_file=10))
    cfg = LakeConfig(
        datasets=(str(root),),
        image_size=(args.model_size, args.model_size),
        chunk_len=8,
        normalize="none",
        decode_actors=args.decoders,
        cpus_per_decoder=0.5,
        decode_batch_size=32,
        shuffle_buffer=args.shuffle_buffer,
        max_tokens=args.max_tokens,
        pack_window=128,
        seed=args.seed,
    )
    probe = Lake(cfg)
    spec = EnvSpec(cameras=probe.cameras, image_size=probe.image_size, state_dim=probe.state_dim,
                   action_dim=probe.action_dim, chunk_len=cfg.chunk_len, max_decisions=1,
                   num_tasks=3, num_init_states=1)
    torch.set_num_threads(args.train_threads)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 configure_logging=False, log_to_driver=False)
    results = {}
    for name in ("dataloader", "lake"):
        length_fn, step = _trainer(spec, args.preset, args.model_size, args.seed)
        lake = Lake(cfg, length_fn=length_fn)
        if name == "lake":
            results[name] = _consume(lake.packed(), step)
        else:
            rows, loader = dataloader_rows(lake, args.loader_workers, args.prefetch)
            results[name] = _consume(rows, step)
            del rows, loader  # persistent workers end with the loader
    lake_r, base = results["lake"], results["dataloader"]
    ratio = lake_r["samples_per_s"] / base["samples_per_s"]
    return {
        "machine": {"cpus": usable_cpus(), "ray_cpus": args.cpus},
        "dataset": {
            "episodes": args.episodes,
            "frames": args.episodes * args.length,
            "cameras": 2,
            "size": args.image_size[0],
            "codec": args.codec,
            "path": str(root),
        },
        "output_resolution": args.model_size,
        "shuffle_buffer": args.shuffle_buffer,
        "consumer": {"model": f"vla {args.preset}", "image_size": args.model_size,
                     "train_threads": args.train_threads, "max_tokens": args.max_tokens,
                     "step": "forward + backward + AdamW of the SFT loss per packed row"},
        "baseline": (f"torch DataLoader, map-style dataset, {args.loader_workers} workers, "
                     f"persistent, prefetch_factor {args.prefetch}, files kept open per worker, "
                     "same episode plan and shuffle buffer"),
        "lake_setup": f"Ray Data, {args.decoders} decoder actors x 0.5 CPU, {args.cpus} Ray CPUs",
        "lake": lake_r,
        "dataloader": base,
        "ratio_lake_over_dataloader": ratio,
        "targets": {
            "ratio_at_least_1.5": ratio >= 1.5,
            "lake_data_wait_below_0.05": lake_r["data_wait_fraction"] < 0.05,
        },
    }
