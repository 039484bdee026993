"""GR00T-N1.7's processor: observations -> packed Qwen3-VL prompts, pixel patches, normalised
state (LeRobot 0.6.1's ``groot_n1_7_pack_inputs_v1`` and ``groot_n1_7_vlm_encode_v1`` steps,
packed).

Inputs: an ``ObsBatch`` and the backbone's processor assets directory (``GrootConfig.tokenizer``:
what ``nvidia/Cosmos-Reason2-2B`` holds: ``vocab.json`` + ``merges.txt``, ``tokenizer_config.json``
with the added tokens and the chat template, ``preprocessor_config.json``). Output: a
``GrootBatch`` whose pixels are patches and whose prompt carries M-RoPE positions.

What each sample becomes, as the reference makes it:
- the instruction formalised (lower case; only letters, digits, whitespace and ``_`` kept);
- the prompt: the chat template rendered for one user message holding one image per camera
  (sorted LeRobot feature names) then the instruction, no generation prompt; each
  ``<|image_pad|>`` repeated once per merged image token; tokenised as Qwen2 does;
- pixels: LeRobot's float frame made uint8 again (``trunc(clamp(x / 255, 0, 1) * 255)``),
  resized to ``image_size`` square (bicubic, antialiased, on uint8), centre-cropped to
  ``image_crop`` (offset floored) and resized back, mapped to ``(x - 127.5) / 127.5``, the frame
  repeated over the temporal patch and cut into patches in 2 x 2 merge-block order;
- M-RoPE positions: text tokens advance the three rows together; an image's tokens take
  ``start`` / ``start + row`` / ``start + column`` of their merged-grid cell and the text after
  it resumes at ``start + max(rows, columns)``;
- state: min-max normalised to [-1, 1] and clipped there (0 where ``min == max``), zero-padded.

Invariants: as ``GrootProcessor``: packed prompts end to end (positions restart per sample),
padded mode flags its padding in ``key_valid``; the reference's left padding of a batch is not
reproduced (each sample here is what the reference computes for that sample alone).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from rlvla3.packing import cu_seqlens
from rlvla3.policies.groot.config import GrootShapes
from rlvla3.policies.groot.processor import (
    GrootProcessor,
    MinMax,
    PromptBatch,
    PromptTokenizer,
    _read_json,
    normalise_pixels,
    qwen2_bpe,
    resize_uint8,
)
from rlvla3.types import ObsBatch

IMAGE_PAD = "<|image_pad|>"
DEFAULT_TASK = "Perform the task."


def formalize(instruction: str) -> str:
    """LeRobot 0.6.1's ``formalize_language``: lower case, only alphanumerics, whitespace, _."""
    text = (instruction or DEFAULT_TASK).lower()
    return "".join(ch for ch in text if ch.isalnum() or ch.isspace() or ch == "_")


class QwenVLTokenizer:
    """The Qwen3-VL prompt and its token ids, from the backbone's processor assets."""

    def __init__(self, directory: str | Path, tokens_per_image: int = 0):
        d = Path(directory)
        tok, config = qwen2_bpe(d, "the Qwen3-VL processor assets directory")
        template = config.get("chat_template")
        if not template and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if not template:
            raise ValueError(f"{d}: no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
        self.tokenizer, self.path, self.template = tok, d, template
        image_token_id = tok.token_to_id(IMAGE_PAD)
        if image_token_id is None:
            raise ValueError(f"{d}: the tokenizer has no {IMAGE_PAD} token")
        self.image_token_id = image_token_id
        self.pad_id = tok.token_to_id(config.get("pad_token") or "<|endoftext|>") or 0
        self.tokens_per_image = tokens_per_image
        pre = _read_json(d / "preprocessor_config.json") if (d / "preprocessor_config.json"
                                                              ).is_file() else {}
        self.image_processor = pre
        self.tile = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def prompt(self, instruction: str, images: int) -> str:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        content: list[dict] = [{"type": "image", "image": None} for _ in range(images)]
        content.append({"type": "text", "text": formalize(instruction)})
        text = env.from_string(self.template).render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=False)
        return re.sub(re.escape(IMAGE_PAD), IMAGE_PAD * self.tokens_per_image, text)

    def encode(self, instruction: str, images: int) -> list[int]:
        return self.tokenizer.encode(self.prompt(instruction, images),
                                     add_special_tokens=True).ids


def lerobot_uint8(frames: torch.Tensor) -> torch.Tensor:
    """uint8 frames as LeRobot's pack step gets them back from its float frames:
    ``trunc(clamp(x / 255, 0, 1) * 255)`` (a value can drop by one)."""
    return ((frames.float() / 255.0).clamp(0, 1) * 255.0).to(torch.uint8)


def transform(frames: torch.Tensor, size: int, crop: int) -> torch.Tensor:
    """LeRobot 0.6.1's N1.7 image transform on uint8 ``[m, 3, H, W]``: resize to ``size``
    square, centre crop of ``round(size * crop / size)`` (offset floored), resize back."""
    x = resize_uint8(frames, size)
    if 0 < crop < size:
        c = max(1, int(round(size * (crop / float(size)))))
        top = left = max(0, (size - c) // 2)
        x = resize_uint8(x[..., top:top + c, left:left + c].contiguous(), size)
    return x


def patchify(x: torch.Tensor, s: GrootShapes) -> torch.Tensor:
    """Float ``[m, 3, S, S]`` -> ``[m * P, 3 * temporal * patch^2]`` (Qwen2-VL's layout: 2 x 2
    merge blocks, each patch channel-major, the still frame repeated over time)."""
    m, c, h, w = x.shape
    t, p, g = s.temporal_patch, s.patch, s.spatial_merge
    x = x[:, None].expand(m, t, c, h, w)
    x = x.reshape(m, 1, t, c, h // p // g, g, p, w // p // g, g, p)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(m * (h // p) * (w // p), c * t * p * p)


def mrope_positions(ids: np.ndarray, image_token_id: int, per_image: int, side: int
                    ) -> np.ndarray:
    """``[3, len(ids)]`` M-RoPE positions of one prompt whose images are runs of
    ``per_image`` image tokens on a ``side x side`` merged grid."""
    out = np.zeros((3, len(ids)), np.int64)
    pos, i = 0, 0
    while i < len(ids):
        if ids[i] == image_token_id:
            cell = np.arange(per_image)
            out[0, i:i + per_image] = pos
            out[1, i:i + per_image] = pos + cell // side
            out[2, i:i + per_image] = pos + cell % side
            pos += side
            i += per_image
        else:
            out[:, i] = pos
            pos += 1
            i += 1
    return out


class VLPromptTokenizer(PromptTokenizer, Protocol):
    """What N1.7's processor reads of a tokenizer: ``QwenVLTokenizer``, or a stand-in that
    makes prompts of the same layout (the GPU check's); ``tokens_per_image`` is set by the
    processor."""

    tokens_per_image: int


class Groot17Processor(GrootProcessor):
    """``GrootProcessor`` with N1.7's prompt, pixels and positions."""

    def __init__(self, tokenizer: VLPromptTokenizer, cameras: Sequence[str],
                 camera_keys: Mapping[str, str], shapes: GrootShapes, normalizer: MinMax,
                 embodiment_id: int):
        tokenizer.tokens_per_image = shapes.image_tokens
        super().__init__(tokenizer, cameras, camera_keys, shapes.image_size,
                         shapes.max_state_dim, normalizer, embodiment_id)
        self.shapes = shapes

    def pixels(self, obs: ObsBatch, device: torch.device) -> torch.Tensor:
        missing = [c for c in self.cameras if c not in obs.images]
        if missing:
            raise ValueError(f"GR00T needs every camera it was built for; missing {missing}")
        s = self.shapes
        per_cam = []
        for cam in self.cameras:
            frames = torch.from_numpy(np.ascontiguousarray(obs.images[cam])).permute(0, 3, 1, 2)
            per_cam.append(transform(lerobot_uint8(frames), s.image_size, s.image_crop))
        images = torch.stack(per_cam, 1).flatten(0, 1)
        return patchify(normalise_pixels(images), s).to(device)

    def prompts(self, obs: ObsBatch, device: torch.device, padded: bool) -> PromptBatch:
        ids = [self.encode_text(t) for t in obs.instruction]
        lengths = np.array([len(i) for i in ids], np.int64)
        n = len(ids)
        width = int(lengths.max()) if padded and n else 0
        if padded:
            ids = [i + [self.tokenizer.pad_id] * (width - len(i)) for i in ids]
        seg = [len(i) for i in ids]
        flat = np.array([t for i in ids for t in i], np.int64)
        side = self.shapes.image_size // self.shapes.patch // self.shapes.spatial_merge
        rope = [mrope_positions(np.asarray(i[:L]), self.tokenizer.image_token_id,
                                self.shapes.image_tokens, side) for i, L in zip(ids, lengths,
                                                                               strict=True)]
        rope = [np.concatenate([r, r[:, -1:] + 1 + np.arange(s - r.shape[1])], 1)
                if s > r.shape[1] else r for r, s in zip(rope, seg, strict=True)]
        valid = np.concatenate([np.arange(s) < L for s, L in zip(seg, lengths, strict=True)]) \
            if n else np.zeros(0, bool)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        mrope = np.concatenate(rope, 1) if n else np.zeros((3, 0), np.int64)
        return PromptBatch(
            n=n, ids=as_t(flat),
            image_slots=as_t(np.flatnonzero((flat == self.tokenizer.image_token_id) & valid)),
            cu=as_t(cu_seqlens(seg)), max_len=max(seg, default=0),
            positions=as_t(mrope[0]), key_valid=as_t(valid) if padded else None,
            lengths=lengths,
            sample_of_token=as_t(np.repeat(np.arange(n), seg).astype(np.int64)),
            mrope=as_t(mrope))
