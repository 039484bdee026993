"""Processor: ObsBatch -> token inputs and packed layout for the VLA model (LeRobot style).

Tokenisation and normalisation live here, outside the model. Inputs: an ``ObsBatch`` (uint8
images per camera + ``image_mask``, float32 state, instruction strings). Output: a
``PrefixBatch`` holding pixels of the *present* images only, instruction token ids (not
padded), the state's separate token ids (byte tokenizer only), and the index that lays them
out as one packed prefix stream ``[sample 0: images, text, state | sample 1: ... ]`` with
``cu_seqlens``. The state reaches the tokenizer as bins (``rlvla3.policies.vla.normalize``); the
tokenizer (``rlvla3.policies.vla.tokenizer``) puts them into the text or beside it.

Invariants:
- packed mode: an absent camera contributes zero tokens and zero pixels; an instruction
  contributes exactly its own tokens; no padding token exists in the stream.
- padded mode (benchmark baseline): every camera slot is encoded (blank when absent) and
  instructions are padded to the batch maximum; such tokens are flagged in ``key_valid`` and
  excluded from attention and pooling, so outputs on real tokens equal the packed ones.
- RoPE positions count real tokens only (``cumsum(valid) - 1`` per sample).
- cameras are encoded in the processor's camera order (a pi0.5 checkpoint's feature order);
  each camera's frames are transformed on their own, so cameras may differ in size.

Image transforms (``VLAConfig.image_resize``): ``stretch`` resizes to the model's square
(bilinear) and maps ``[0, 255]`` to ``[-1, 1]`` as ``x / 127.5 - 1``; ``pad`` is openpi's and
LeRobot's ``resize_with_pad`` (``x / 255``, bilinear resize keeping the aspect ratio, clamp to
``[0, 1]``, centred black padding, ``2 x - 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rlvla3.packing import cu_seqlens
from rlvla3.policies.vla.config import ModelShapes
from rlvla3.policies.vla.normalize import Normalizer
from rlvla3.policies.vla.tokenizer import BOS, PAD, STATE_OFFSET, Tokenizer, tokenize
from rlvla3.types import ObsBatch

__all__ = ["BOS", "PAD", "STATE_OFFSET", "PrefixBatch", "Processor", "sample_token_count",
           "tokenize"]


def stretch_images(frames: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 ``[m, 3, H, W]`` -> float ``[m, 3, side, side]`` in [-1, 1], stretched."""
    x = frames.float()
    if x.shape[-2:] != (side, side) and len(x):
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
    return x / 127.5 - 1.0


def pad_images(frames: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 ``[m, 3, H, W]`` -> float ``[m, 3, side, side]`` in [-1, 1], resized with pad."""
    x = frames.float() / 255.0
    h, w = x.shape[-2:]
    if (h, w) != (side, side) and len(x):
        ratio = max(w / side, h / side)
        rh, rw = int(h / ratio), int(w / ratio)
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
        top, left = (side - rh) // 2, (side - rw) // 2
        x = F.pad(x, (left, side - rw - left, top, side - rh - top), value=0.0)
    return x * 2.0 - 1.0


IMAGE_TRANSFORMS = {"stretch": stretch_images, "pad": pad_images}


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
    """int64 ``[n * k]``: separate state tokens (``k = state_dim`` for the byte tokenizer, 0 when
    the state is part of the prompt)."""
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
    segment_lengths: np.ndarray
    """int64 ``[n]`` prefix tokens per sample in the stream (padding included): the host copy
    of ``diff(cu_prefix)``, so that layouts are built without reading the device back."""
    real_counts: torch.Tensor
    """float32 ``[n]`` ``real_prefix`` on the device (the value head's pooling divisor), sent
    with the other inputs before any kernel runs."""


class Processor:
    """Turns observations into a ``PrefixBatch`` for one model's shapes."""

    def __init__(self, shapes: ModelShapes, cameras: Sequence[str], state_dim: int,
                 tokenizer: Tokenizer, normalizer: Normalizer, image_resize: str = "stretch"):
        self.shapes = shapes
        self.cameras = tuple(cameras)
        self.state_dim = state_dim
        self.tokenizer, self.normalizer = tokenizer, normalizer
        self.transform = IMAGE_TRANSFORMS[image_resize]

    # -- token accounting (used by the data lake to pack) ---------------------------------
    def encode_text(self, obs: ObsBatch) -> list[tuple[list[int], list[int]]]:
        """Per sample: instruction token ids and separate state token ids."""
        bins = self.normalizer.state_bins(np.asarray(obs.state, np.float32))
        return [self.tokenizer.encode(text, b)
                for text, b in zip(obs.instruction, bins, strict=True)]

    def prefix_token_counts(self, obs: ObsBatch) -> np.ndarray:
        """Real prefix tokens per sample: present images, instruction, state."""
        cams = self._present(obs).sum(1)
        lens = [len(t) + len(s) for t, s in self.encode_text(obs)]
        return (cams * self.shapes.image_tokens + np.asarray(lens, np.int64)).astype(np.int64)

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

    def max_prefix_tokens(self) -> int:
        """The longest prefix one sample can have: every camera, the longest instruction and
        the state tokens (the static layout of graph-ready acting is this long)."""
        return (len(self.cameras) * self.shapes.image_tokens + self.tokenizer.max_tokens
                + self.tokenizer.state_tokens)

    # -- conversion -----------------------------------------------------------------------
    def _pixels(self, obs: ObsBatch, present: np.ndarray, slots: np.ndarray,
                img_row: np.ndarray, device: torch.device) -> torch.Tensor:
        """Encoded images ``[M, 3, S, S]``, sample-major: image (i, c) at ``img_row[i, c]``."""
        side = self.shapes.image_size
        # Channels-last, the layout of frames that arrive as [m, H, W, 3]: the vision stem's
        # convolution rounds differently on another layout (checkpoints act as they did).
        pixels = torch.empty((int(slots.sum()), 3, side, side), device=device,
                             memory_format=torch.channels_last)
        for c, cam in enumerate(self.cameras):
            rows = np.flatnonzero(slots[:, c])
            if not len(rows):
                continue
            if cam in obs.images:
                frames = np.asarray(obs.images[cam])[rows]
                # padded mode encodes absent slots as blank frames
                frames = frames * present[rows, c, None, None, None].astype(np.uint8)
            else:
                shape = next((v.shape[1:] for v in obs.images.values()), (side, side, 3))
                frames = np.zeros((len(rows), *shape), np.uint8)
            x = torch.from_numpy(np.ascontiguousarray(frames)).to(device).permute(0, 3, 1, 2)
            pixels[torch.from_numpy(img_row[rows, c]).to(device)] = self.transform(x, side)
        return pixels

    def __call__(self, obs: ObsBatch, device: torch.device | str = "cpu",
                 padded: bool = False) -> PrefixBatch:
        device = torch.device(device)
        n, p = len(obs), self.shapes.image_tokens
        present = self._present(obs)
        slots = np.ones_like(present) if padded else present
        # Encoded images, sample-major: image j of sample i sits at img_row[i, c].
        img_row = np.full(present.shape, -1, np.int64)
        order = np.argwhere(slots)  # rows sorted by sample, then camera
        img_row[order[:, 0], order[:, 1]] = np.arange(len(order))
        pixels = self._pixels(obs, present, slots, img_row, device)

        encoded = self.encode_text(obs)
        texts = [t for t, _ in encoded]
        sd = self.tokenizer.state_tokens
        lens = np.array([len(t) for t in texts], np.int64)
        width = int(lens.max()) if padded and n else 0
        if padded:
            texts = [t + [self.tokenizer.pad_id] * (width - len(t)) for t in texts]
        text_ids = np.array([tok for t in texts for tok in t], np.int64)
        text_start = cu_seqlens([len(t) for t in texts])
        state_ids = np.array([tok for _, s in encoded for tok in s], np.int64)
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
        real = (present.sum(1) * p + lens + sd).astype(np.int64)
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
            real_prefix=real,
            sample_of_token=as_t(owner.astype(np.int64)),
            segment_lengths=np.asarray(seg_lens, np.int64),
            real_counts=as_t(real.astype(np.float32)),
        )
