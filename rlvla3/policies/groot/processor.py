"""GR00T's processor: observations -> packed Eagle prompts, pixels, normalised state (LeRobot's
``groot_pack_inputs``, ``groot_eagle_encode`` and ``groot_eagle_collate`` steps, packed).

Inputs: an ``ObsBatch`` (uint8 frames per camera, float32 state, instruction strings) and the
Eagle processor assets directory (``GrootConfig.tokenizer``): ``vocab.json`` + ``merges.txt``
(a Qwen2 byte-level BPE; ``added_tokens.json`` / ``tokenizer_config.json`` add the special
tokens), ``chat_template.json``, ``processor_config.json`` (``tokens_per_tile``),
``preprocessor_config.json`` (the tile size). Output: a ``GrootBatch``.

What each sample becomes, as the reference makes it:
- the prompt: the chat template rendered for one user message holding one image per camera
  (in the sorted order of the cameras' LeRobot feature names) and the text ``str([instruction])``,
  with the generation prompt; each ``<image-k>`` placeholder becomes
  ``<image k><img>`` + ``<IMG_CONTEXT>`` x tokens_per_tile + ``</img>``; tokenised with the
  Qwen2 pipeline (NFC, Qwen2's split pattern, byte-level), special tokens kept whole;
- pixels: each frame resized to the tile (bicubic with antialiasing on the uint8 values, as
  torchvision resizes uint8 images on the CPU) and mapped to
  ``(x - 127.5) / 127.5``;
- state: min-max normalised to [-1, 1] (``2 (x - min) / (max - min) - 1``; 0 where
  ``min == max``; not clipped), zero-padded to ``max_state_dim`` with a mask;
- the embodiment id.

Invariants: packed mode lays the prompts end to end with no padding (``cu_seqlens``; RoPE
positions restart at 0 per sample); padded mode (the benchmark baseline) pads every prompt to
the batch's longest and flags the padding in ``key_valid``, so real tokens compute the same.
The reference batches samples differently (every sample gets the first sample's instruction;
shorter prompts are left-padded and the action head attends to the padding); each sample here
is what the reference computes for that sample alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F

from rlvla3.packing import cu_seqlens
from rlvla3.types import ObsBatch

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
IMG_CONTEXT, IMG_START, IMG_END = "<IMG_CONTEXT>", "<img>", "</img>"
IMAGES = "observation.images."


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


class PromptTokenizer(Protocol):
    """What the processor reads of a tokenizer: ``EagleTokenizer``, or a stand-in that makes
    prompts of the same layout without tokenizer files (the GPU check's)."""

    image_token_id: int
    pad_id: int
    tile: int
    """Side of an image tile the processor resizes to (0: the model's image size)."""

    def encode(self, instruction: str, images: int) -> list[int]:
        """The prompt's token ids for ``instruction`` after ``images`` images."""
        ...


def qwen2_bpe(d: Path, what: str):
    """Qwen2's byte-level BPE (NFC, Qwen2's split pattern) from ``vocab.json`` +
    ``merges.txt`` with the added tokens of ``tokenizer_config.json`` (or
    ``added_tokens.json``), special tokens kept whole; and ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    for name in ("vocab.json", "merges.txt"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"no {name} in {d} ({what}; nothing is downloaded)")
    vocab = _read_json(d / "vocab.json")
    merges = [cast(tuple[str, str], tuple(line.split(" ")))  # a pair per line
              for line in (d / "merges.txt").read_text().splitlines()
              if line and not line.startswith("#version")]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                        byte_fallback=False, continuing_subword_prefix="",
                        end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    config = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json"
                                                          ).is_file() else {}
    added = config.get("added_tokens_decoder") or {}
    if not added and (d / "added_tokens.json").is_file():
        added = {str(i): {"content": t, "special": True}
                 for t, i in _read_json(d / "added_tokens.json").items()}
    for index, entry in sorted(added.items(), key=lambda kv: int(kv[0])):
        token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False),
                           rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", not entry.get("special")),
                           special=entry.get("special", True))
        if tok.token_to_id(entry["content"]) is None:
            if tok.get_vocab_size(with_added_tokens=True) != int(index):
                raise ValueError(f"{d}: added token {entry['content']!r} has id {index}, "
                                 f"the vocabulary has {tok.get_vocab_size(True)} entries")
            tok.add_special_tokens([token]) if token.special else tok.add_tokens([token])
    return tok, config


class EagleTokenizer:
    """The Eagle prompt and its token ids, from a processor assets directory."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        if not (d / "chat_template.json").is_file():
            raise FileNotFoundError(f"no chat_template.json in {d} (the Eagle processor assets "
                                    "directory; nothing is downloaded)")
        tok, config = qwen2_bpe(d, "the Eagle processor assets directory")
        self.tokenizer, self.path = tok, d
        self.template = _read_json(d / "chat_template.json")["chat_template"]
        proc = _read_json(d / "processor_config.json") if (d / "processor_config.json"
                                                            ).is_file() else {}
        self.tokens_per_tile = int(proc.get("tokens_per_tile", 256))
        image_token_id = tok.token_to_id(IMG_CONTEXT)
        if image_token_id is None:
            raise ValueError(f"{d}: the tokenizer has no {IMG_CONTEXT} token")
        self.image_token_id = image_token_id
        self.pad_id = tok.token_to_id(config.get("pad_token") or "<|endoftext|>") or 0
        pre = _read_json(d / "preprocessor_config.json") if (d / "preprocessor_config.json"
                                                              ).is_file() else {}
        self.tile = int((pre.get("size") or {}).get("height", 0))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def prompt(self, instruction: str, images: int) -> str:
        """The chat-template text with each image's placeholder expanded."""
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        content = [{"type": "image"} for _ in range(images)]
        content.append({"type": "text", "text": str([instruction])})
        text = env.from_string(self.template).render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=True)
        tokens = IMG_CONTEXT * self.tokens_per_tile

        def expand(match: re.Match) -> str:
            return f"<image {match.group(1)}>{IMG_START}{tokens}{IMG_END}"

        return re.sub(r"<image-(\d+)>", expand, text)

    def encode(self, instruction: str, images: int) -> list[int]:
        return self.tokenizer.encode(self.prompt(instruction, images),
                                     add_special_tokens=True).ids


def resize_uint8(frames: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 ``[m, 3, H, W]`` -> uint8 ``[m, 3, side, side]``: bicubic with antialiasing on
    the uint8 values (torch's native uint8 kernel, which torchvision's resize uses on CPU)."""
    if frames.shape[-2:] == (side, side) or not len(frames):
        return frames
    return F.interpolate(frames, size=(side, side), mode="bicubic", align_corners=False,
                         antialias=True)


def normalise_pixels(frames: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 ``(x - 127.5) / 127.5`` (rescale 1/255 and mean/std 0.5 fused)."""
    return (frames.float() - 127.5) / 127.5


class MinMax:
    """Min-max normalisation of state and actions to [-1, 1] (0 where min == max).

    Without statistics (an empty ``state_min`` ... ``action_max``) min is -1 and max 1: the
    identity, which is what LeRobot 0.5.1 does with a groot directory saved without them (its
    pack and unpack steps then hold none: state, targets and actions pass raw). A LeRobot
    postprocessor built afresh with no dataset statistics differs: it holds an empty mapping
    and unnormalises actions by its default min 0, max 1 while its preprocessor leaves the
    targets raw. rlvla3 never writes that case (an export writes the min/max it acts with)
    and refuses to read it (``loader.lerobot_stats``)."""

    def __init__(self, state_dim: int, action_dim: int, stats: Mapping[str, Sequence[float]],
                 clip: bool = False):
        self.clip = clip
        """N1.7 (LeRobot 0.6.1's ``clip_outliers`` / ``clip_normalized_action``): normalised
        state and targets clipped to [-1, 1], and the model's actions before unnormalising."""

        def vec(key: str, dim: int, default: float) -> torch.Tensor:
            v = stats.get(key) or [default] * dim
            return torch.tensor(list(v), dtype=torch.float32)

        self.state_min, self.state_max = vec("state_min", state_dim, -1), vec("state_max",
                                                                            state_dim, 1)
        self.action_min = vec("action_min", action_dim, -1)
        self.action_max = vec("action_max", action_dim, 1)

    def _norm(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        lo, hi = lo.to(x), hi.to(x)
        denom = hi - lo
        mask = denom != 0
        mapped = 2 * (x - lo) / torch.where(mask, denom, torch.ones_like(denom)) - 1
        out = torch.where(mask, mapped, torch.zeros_like(mapped))
        return out.clamp(-1.0, 1.0) if self.clip else out

    def state(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.state_min, self.state_max)

    def to_model(self, actions: torch.Tensor) -> torch.Tensor:
        return self._norm(actions, self.action_min, self.action_max)

    def to_env(self, y: torch.Tensor) -> torch.Tensor:
        y = y.cpu()
        if self.clip:
            y = y.clamp(-1.0, 1.0)
        denom = self.action_max - self.action_min
        mask = denom != 0
        inv = (y + 1.0) * 0.5 * torch.where(mask, denom, torch.ones_like(denom)) + self.action_min
        return torch.where(mask, inv, self.action_min.expand_as(inv))


@dataclass(frozen=True)
class PromptBatch:
    """``n`` prompts laid out as one packed stream."""

    n: int
    ids: torch.Tensor
    """int64 ``[T]`` token ids (padding included in padded mode)."""
    image_slots: torch.Tensor
    """int64 ``[M * image_tokens]``: stream rows of the image placeholders, in image order."""
    cu: torch.Tensor
    """int32 ``[n + 1]`` segment boundaries."""
    max_len: int
    positions: torch.Tensor
    """int64 ``[T]`` RoPE positions (from 0 in each sample)."""
    key_valid: torch.Tensor | None
    """bool ``[T]``: False on padding (padded mode only)."""
    lengths: np.ndarray
    """int64 ``[n]`` real tokens per sample."""
    sample_of_token: torch.Tensor
    mrope: torch.Tensor | None = None
    """int64 ``[3, T]`` N1.7's M-RoPE positions (time, height, width; from 0 per sample)."""


@dataclass(frozen=True)
class GrootBatch:
    pixels: torch.Tensor
    """float32 ``[M, 3, S, S]``: every sample's images, sample-major, camera order."""
    prompt: PromptBatch
    state: torch.Tensor
    """float32 ``[n, 1, max_state_dim]`` normalised, zero-padded."""
    embodiment: torch.Tensor
    """int64 ``[n]``."""


class GrootProcessor:
    def __init__(self, tokenizer: PromptTokenizer, cameras: Sequence[str],
                 camera_keys: Mapping[str, str], tile: int, max_state_dim: int,
                 normalizer: MinMax, embodiment_id: int):
        self.tokenizer, self.tile, self.max_state_dim = tokenizer, tile, max_state_dim
        self.feature_keys = {c: camera_keys.get(c, IMAGES + c) for c in cameras}
        """Env camera -> LeRobot image feature."""
        keyed = {k: c for c, k in self.feature_keys.items()}
        self.cameras = tuple(keyed[k] for k in sorted(keyed))  # LeRobot sorts the features
        self.normalizer, self.embodiment_id = normalizer, embodiment_id
        self._cache: dict[str, list[int]] = {}

    def encode_text(self, instruction: str) -> list[int]:
        if instruction not in self._cache:
            self._cache[instruction] = self.tokenizer.encode(instruction, len(self.cameras))
        return self._cache[instruction]

    def token_counts(self, obs: ObsBatch) -> np.ndarray:
        return np.array([len(self.encode_text(t)) for t in obs.instruction], np.int64)

    def pixels(self, obs: ObsBatch, device: torch.device) -> torch.Tensor:
        missing = [c for c in self.cameras if c not in obs.images]
        if missing:
            raise ValueError(f"GR00T needs every camera it was built for; missing {missing}")
        per_cam = []
        for cam in self.cameras:
            frames = torch.from_numpy(np.ascontiguousarray(obs.images[cam])).permute(0, 3, 1, 2)
            per_cam.append(normalise_pixels(resize_uint8(frames, self.tile)))
        return torch.stack(per_cam, 1).flatten(0, 1).to(device)

    def state(self, obs: ObsBatch, device: torch.device) -> torch.Tensor:
        s = self.normalizer.state(torch.as_tensor(np.asarray(obs.state, np.float32)))
        s = F.pad(s, (0, self.max_state_dim - s.shape[-1]))
        return s[:, None, :].to(device)

    def prompts(self, obs: ObsBatch, device: torch.device, padded: bool) -> PromptBatch:
        ids = [self.encode_text(t) for t in obs.instruction]
        lengths = np.array([len(i) for i in ids], np.int64)
        n = len(ids)
        width = int(lengths.max()) if padded and n else 0
        if padded:
            ids = [i + [self.tokenizer.pad_id] * (width - len(i)) for i in ids]
        seg = [len(i) for i in ids]
        flat = np.array([t for i in ids for t in i], np.int64)
        positions = np.concatenate([np.arange(s) for s in seg]) if n else flat
        valid = np.concatenate([np.arange(s) < L for s, L in zip(seg, lengths, strict=True)]) \
            if n else np.zeros(0, bool)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return PromptBatch(
            n=n, ids=as_t(flat),
            image_slots=as_t(np.flatnonzero((flat == self.tokenizer.image_token_id) & valid)),
            cu=as_t(cu_seqlens(seg)), max_len=max(seg, default=0),
            positions=as_t(positions.astype(np.int64)),
            key_valid=as_t(valid) if padded else None, lengths=lengths,
            sample_of_token=as_t(np.repeat(np.arange(n), seg).astype(np.int64)))

    def __call__(self, obs: ObsBatch, device: torch.device | str = "cpu",
                 padded: bool = False) -> GrootBatch:
        device = torch.device(device)
        return GrootBatch(
            pixels=self.pixels(obs, device), prompt=self.prompts(obs, device, padded),
            state=self.state(obs, device),
            embodiment=torch.full((len(obs),), self.embodiment_id, dtype=torch.long,
                                  device=device))
