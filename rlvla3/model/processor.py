"""Processor: ObsBatch -> token inputs and packed layout for the VLA model (LeRobot style).

Tokenisation and normalisation live here, outside the model. Inputs: an ``ObsBatch`` (uint8
images per camera + ``image_mask``, float32 state, instruction strings). Output: a
``PrefixBatch`` holding pixels of the *present* images only, byte-level instruction token ids
(not padded), discretised state token ids, and the index that lays them out as one packed
prefix stream ``[sample 0: images, text, state | sample 1: ... ]`` with ``cu_seqlens``.

Invariants:
- packed mode: an absent camera contributes zero tokens and zero pixels; an instruction
  contributes exactly its own tokens; no padding token exists in the stream.
- padded mode (benchmark baseline): every camera slot is encoded (blank when absent) and
  instructions are padded to the batch maximum; such tokens are flagged in ``key_valid`` and
  excluded from attention and pooling, so outputs on real tokens equal the packed ones.
- RoPE positions count real tokens only (``cumsum(valid) - 1`` per sample).

Vocabulary of the built-in byte tokenizer: ids 0..255 are UTF-8 bytes, ``256 + b`` is state bin
``b``, ``BOS`` opens every instruction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rlvla3.model.config import ModelShapes
from rlvla3.packing import cu_seqlens
from rlvla3.types import ObsBatch

STATE_OFFSET = 256
BOS = 512
PAD = 513


def tokenize(text: str, max_tokens: int) -> list[int]:
    """Normalise (lower case, single spaces) and byte-encode; ``BOS`` first; truncated."""
    norm = " ".join(text.lower().split())
    return [BOS, *norm.encode("utf-8")][:max_tokens]


def sample_token_count(shapes: ModelShapes, cameras_present: int, instruction: str,
                       state_dim: int, chunk_len: int, max_text_tokens: int) -> int:
    """Tokens one sample puts into a packed row: present images, instruction, state, actions.

    The data lake calls this (through ``VLAPolicy.token_counts`` or directly) to pack rows."""
    text = len(tokenize(instruction, max_text_tokens))
    return cameras_present * shapes.image_tokens + text + state_dim + chunk_len


@dataclass(frozen=True)
class PrefixBatch:
    """Model-ready prefix inputs of ``n`` samples, laid out as one packed stream."""

    n: int
    pixels: torch.Tensor
    """float32 ``[M, 3, S, S]`` in [-1, 1]: encoded images, sample-major, camera order."""
    text_ids: torch.Tensor
    """int64 ``[T_text]``: instruction tokens of all samples, concatenated."""
    state_ids: torch.Tensor
    """int64 ``[n * state_dim]``: discretised state tokens."""
    prefix_index: torch.Tensor
    """int64 ``[T_prefix]``: stream position -> row of ``cat(image tokens, text, state)``."""
    cu_prefix: torch.Tensor
    """int32 ``[n + 1]`` segment boundaries of the prefix stream."""
    max_prefix: int
    positions: torch.Tensor
    """int64 ``[T_prefix]`` RoPE positions (real tokens counted only)."""
    key_valid: torch.Tensor | None
    """bool ``[T_prefix]``: False on padding tokens (padded mode only); None when packed."""
    real_prefix: np.ndarray
    """int64 ``[n]`` real (non-padding) prefix tokens per sample."""
    sample_of_token: torch.Tensor
    """int64 ``[T_prefix]`` owning sample of each stream token."""


class Processor:
    """Turns observations into a ``PrefixBatch`` for one model's shapes."""

    def __init__(
        self,
        shapes: ModelShapes,
        cameras: Sequence[str],
        state_dim: int,
        max_text_tokens: int,
        state_bins: int = 256,
        state_low: np.ndarray | None = None,
        state_high: np.ndarray | None = None,
    ):
        self.shapes = shapes
        self.cameras = tuple(cameras)
        self.state_dim = state_dim
        self.max_text_tokens = max_text_tokens
        self.state_bins = state_bins
        self.state_low = np.full(state_dim, -1.0, np.float32) if state_low is None else state_low
        self.state_high = np.full(state_dim, 1.0, np.float32) if state_high is None else state_high

    # -- token accounting (used by the data lake to pack) ---------------------------------
    def prefix_token_counts(self, obs: ObsBatch) -> np.ndarray:
        """Real prefix tokens per sample: present images, instruction, state."""
        cams = self._present(obs).sum(1)
        return np.array([
            sample_token_count(self.shapes, int(c), text, self.state_dim, 0, self.max_text_tokens)
            for c, text in zip(cams, obs.instruction, strict=True)
        ], dtype=np.int64)

    def _present(self, obs: ObsBatch) -> np.ndarray:
        unknown = set(obs.images) - set(self.cameras)
        if unknown:
            raise ValueError(f"unknown cameras {sorted(unknown)} (model built for {self.cameras})")
        n = len(obs)
        cols = [
            np.asarray(obs.image_mask[c], bool) if c in obs.images else np.zeros(n, bool)
            for c in self.cameras
        ]
        return np.stack(cols, 1) if cols else np.zeros((n, 0), bool)

    # -- conversion -----------------------------------------------------------------------
    def _pixels(self, images: np.ndarray, device: torch.device) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).float()
        side = self.shapes.image_size
        if x.shape[-2:] != (side, side) and len(x):
            x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        return x / 127.5 - 1.0

    def state_tokens(self, state: np.ndarray) -> np.ndarray:
        """Normalise each dimension to [-1, 1] by the processor's bounds, then bin it."""
        unit = (state - self.state_low) / np.maximum(self.state_high - self.state_low, 1e-8)
        bins = np.clip(np.floor(unit * self.state_bins), 0, self.state_bins - 1).astype(np.int64)
        return bins + STATE_OFFSET

    def __call__(self, obs: ObsBatch, device: torch.device | str = "cpu",
                 padded: bool = False) -> PrefixBatch:
        device = torch.device(device)
        n, p, sd = len(obs), self.shapes.image_tokens, self.state_dim
        present = self._present(obs)
        slots = np.ones_like(present) if padded else present
        # Encoded images, sample-major: image j of sample i sits at img_row[i, c].
        img_row = np.full(present.shape, -1, np.int64)
        order = np.argwhere(slots)  # rows sorted by sample, then camera
        img_row[order[:, 0], order[:, 1]] = np.arange(len(order))
        shape = next((v.shape[1:] for v in obs.images.values()),
                     (self.shapes.image_size, self.shapes.image_size, 3))
        blank = np.zeros(shape, np.uint8)  # padded mode encodes absent slots as blank frames
        frames = [obs.images[self.cameras[c]][i] if present[i, c] else blank for i, c in order]
        stack = np.stack(frames) if frames else blank[None][:0]
        pixels = self._pixels(stack, device)

        texts = [tokenize(t, self.max_text_tokens) for t in obs.instruction]
        lens = np.array([len(t) for t in texts], np.int64)
        width = int(lens.max()) if padded and n else 0
        if padded:
            texts = [t + [PAD] * (width - len(t)) for t in texts]
        text_ids = np.array([tok for t in texts for tok in t], np.int64)
        text_start = cu_seqlens([len(t) for t in texts])
        state_ids = self.state_tokens(np.asarray(obs.state, np.float32)).reshape(-1)

        text_base, state_base = len(order) * p, len(order) * p + len(text_ids)
        index, valid, seg_lens = [], [], []
        for i in range(n):
            parts, ok = [], []
            for c in range(present.shape[1]):
                if slots[i, c]:
                    parts.append(np.arange(p) + img_row[i, c] * p)
                    ok.append(np.full(p, bool(present[i, c])))
            t0, t1 = text_start[i], text_start[i + 1]
            parts.append(np.arange(t0, t1) + text_base)
            ok.append(np.arange(t1 - t0) < lens[i])
            parts.append(np.arange(sd) + state_base + i * sd)
            ok.append(np.ones(sd, bool))
            index.append(np.concatenate(parts))
            valid.append(np.concatenate(ok))
            seg_lens.append(len(index[-1]))
        flat_index = np.concatenate(index) if n else np.zeros(0, np.int64)
        flat_valid = np.concatenate(valid) if n else np.zeros(0, bool)
        positions = np.concatenate([np.cumsum(v) - 1 for v in valid]) if n else flat_index
        owner = np.repeat(np.arange(n), seg_lens)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return PrefixBatch(
            n=n,
            pixels=pixels,
            text_ids=as_t(text_ids),
            state_ids=as_t(state_ids),
            prefix_index=as_t(flat_index.astype(np.int64)),
            cu_prefix=as_t(cu_seqlens(seg_lens)),
            max_prefix=max(seg_lens, default=0),
            positions=as_t(positions.astype(np.int64)),
            key_valid=as_t(flat_valid) if padded else None,
            real_prefix=present.sum(1) * p + lens + sd,
            sample_of_token=as_t(owner.astype(np.int64)),
        )
