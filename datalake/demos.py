"""Demonstrations held decoded in memory, drawn at random: the SFT loss beside RL
(``algo.sft_coef``) takes its micro-batches from here on every learner rank.

Invariants: every sample is a real frame of a listed dataset (state, the action chunk from that
frame with its mask, the task string, every camera decoded at the model's size); a frame that
cannot be read is counted and dropped, and loading fails with ``LakeError`` past
``max_skip_fraction`` (as the lake does). A dataset whose state or action size or cameras do not
match the env's spec is refused with ``DatasetError`` before anything is decoded. Draws are
seeded: the same seed draws the same samples.

    demos = load_demos(["mw_demos"], spec, max_samples=20_000, seed=rank)
    obs, actions, mask = demos.draw(16)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from datalake.format import DatasetError, DatasetMeta, camera_name, open_dataset
from datalake.pipeline import FrameDecoder, SkipLedger
from datalake.samples import ACTION_KEY, STATE_KEY, episode_samples
from rlvla3.types import EnvSpec, ObsBatch

MAX_SKIP_FRACTION = 0.05


@dataclass
class DemoSet:
    """Samples of demonstrations, stacked: ``draw`` picks ``n`` of them at random."""

    images: dict[str, np.ndarray]
    """Camera -> uint8 ``[N, H, W, 3]``."""
    image_mask: dict[str, np.ndarray]
    state: np.ndarray
    instruction: np.ndarray
    """object ``[N]``: the task string of each sample."""
    actions: np.ndarray
    """float32 ``[N, chunk_len, action_dim]``."""
    action_mask: np.ndarray
    """bool ``[N, chunk_len]``: False past the episode's end."""
    skipped: int
    """Frames dropped because they could not be read."""
    rng: np.random.Generator

    def __len__(self) -> int:
        return len(self.state)

    def draw(self, n: int) -> tuple[ObsBatch, np.ndarray, np.ndarray]:
        """``n`` samples drawn uniformly (with replacement): observations, actions, mask."""
        idx = np.sort(self.rng.integers(0, len(self), size=n))
        obs = ObsBatch(images={c: v[idx] for c, v in self.images.items()},
                       image_mask={c: v[idx] for c, v in self.image_mask.items()},
                       state=self.state[idx],
                       instruction=tuple(str(t) for t in self.instruction[idx]))
        return obs, self.actions[idx], self.action_mask[idx]


def check_demos(meta: DatasetMeta, spec: EnvSpec) -> None:
    """Refuse a dataset recorded for another robot or camera set than ``spec`` describes."""
    def size(key: str) -> int:
        if key not in meta.features:
            raise DatasetError(f"{meta.uri}: no {key!r} feature")
        return meta.feature_shape(key)[0]

    if (size(STATE_KEY), size(ACTION_KEY)) != (spec.state_dim, spec.action_dim):
        raise DatasetError(
            f"{meta.uri}: state/action sizes {size(STATE_KEY)}/{size(ACTION_KEY)}, the env's "
            f"are {spec.state_dim}/{spec.action_dim} (a dataset of another robot?)")
    cameras = {camera_name(k) for k in meta.camera_keys}
    missing = [c for c in spec.cameras if c not in cameras]
    if missing:
        raise DatasetError(f"{meta.uri}: no camera {missing} (it has {sorted(cameras)})")
    if not meta.episodes:
        raise DatasetError(f"{meta.uri}: no episodes")


def load_demos(uris: Sequence[str], spec: EnvSpec, max_samples: int, seed: int) -> DemoSet:
    """Every frame of ``uris`` decoded at ``spec``'s image size with ``spec.chunk_len``-step
    action chunks, actions and states as recorded (unnormalised: the policy holds its own
    ranges); beyond ``max_samples`` a seeded subset of the frames is kept."""
    metas = [open_dataset(uri) for uri in uris]
    for meta in metas:
        check_demos(meta, spec)
    cameras = list(spec.cameras)
    ledger = SkipLedger(MAX_SKIP_FRACTION, 1)
    parts = []
    for meta in metas:
        decoder = FrameDecoder([meta.uri], cameras, spec.image_size, 4, 1e-3)
        for episode in meta.episodes:
            rows = episode_samples(meta, 0, episode, cameras, spec.chunk_len)
            rows = decoder(rows)
            bad = rows["problem"] != ""
            for i in np.flatnonzero(bad):
                ledger.skip(str(rows["problem"][i]), int(rows["skips"][i]))
            keep = np.flatnonzero(~bad)
            ledger.used += len(keep)
            parts.append({k: rows[k][keep] for k in
                          ("state", "actions", "action_mask", "task",
                           *(f"image.{c}" for c in cameras), *(f"has.{c}" for c in cameras))})
    ledger.check(final=True)
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    rng = np.random.default_rng(seed)
    total = len(rows["state"])
    if total > max_samples:
        keep = np.sort(rng.choice(total, size=max_samples, replace=False))
        rows = {k: v[keep] for k, v in rows.items()}
    return DemoSet(images={c: rows[f"image.{c}"] for c in cameras},
                   image_mask={c: rows[f"has.{c}"] for c in cameras},
                   state=rows["state"].astype(np.float32), instruction=rows["task"],
                   actions=rows["actions"].astype(np.float32), action_mask=rows["action_mask"],
                   skipped=ledger.skipped, rng=rng)
