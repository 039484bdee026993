"""The GR00T network on packed prompts: the VL backbone (N1.5: Eagle 2.5; N1.7: Qwen3-VL),
VL self-attention, flow head (N1.7: text / image cross-attention alternating), and a value
head for RL.

Inputs: a ``GrootBatch`` (``rlvla3.policies.groot.processor``) and noisy action chunks
``x [S, H, A]`` at integer timesteps ``[S]``, where each of the ``S = R * n`` segments belongs
to sample ``s % n`` (``R`` repeats serve the K denoising steps of one chain in one pass).
Outputs: a ``VLCache`` per batch (the packed VL features after ``vlln`` and the VL
self-attention, the state encodings, every cross-attention block's keys/values), values
``[n]`` and velocities ``[S, H, A]``.

Invariants: the VL side does not depend on the action chunk, so it runs once per observation
and every denoising step reuses its keys/values (the cross-attention's KV cache); the
parameter names are the Isaac-GR00T checkpoint's (``backbone.*``, ``action_head.*``) plus
``value_head.*``, which GR00T does not have and RL trains from its initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.model.fp8 import BlockLinear, Fp8Backend
from rlvla3.policies.groot.backbone import EagleBackbone
from rlvla3.policies.groot.config import GrootShapes
from rlvla3.policies.groot.dit import CrossKV, KeyLayout
from rlvla3.policies.groot.head import FlowHead
from rlvla3.policies.groot.processor import GrootBatch
from rlvla3.policies.groot.qwen3_vl import Qwen3VLBackbone
from rlvla3.policies.groot.vl_attention import vl_features


@dataclass
class VLCache:
    """What the action tokens need from an observation."""

    llm_hidden: torch.Tensor
    """``[T, W]`` packed backbone output (the selected layer's hidden states)."""
    vlln: torch.Tensor
    features: torch.Tensor
    """``[T, W]`` after ``vlln`` and the VL self-attention."""
    state: torch.Tensor
    """``[n, 1, E]`` state encodings."""
    embodiment: torch.Tensor
    batch: GrootBatch


class GrootNetwork(nn.Module):
    def __init__(self, shapes: GrootShapes):
        super().__init__()
        self.shapes = shapes
        self.backbone: EagleBackbone | Qwen3VLBackbone = EagleBackbone(shapes) \
            if shapes.version == "n1.5" else Qwen3VLBackbone(shapes)
        self.action_head = FlowHead(shapes)
        w = shapes.vl_width
        self.value_head = nn.Sequential(nn.Linear(w, shapes.hidden), nn.SiLU(),
                                        nn.Linear(shapes.hidden, 1))
        self.attention: AttentionBackend
        """Varlen attention, set by the policy before the first forward."""
        self.dropout = 0.0
        """Dropout probability of the head's blocks in the next forwards (training only)."""
        self.state_dropout = 0.0
        """N1.7: probability that a sample's state encoding is zeroed (training only)."""

    def set_fp8(self, backend: Fp8Backend | None) -> None:
        for m in self.modules():
            if isinstance(m, BlockLinear):
                m.fp8 = backend

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """N1.5: ``[M, 3, S, S]`` -> ``[M, image_tokens, W]``; N1.7: pixel patches
        ``[M * P, D]`` -> ``[M * image_tokens, W]`` (``vision_features`` adds DeepStack's)."""
        if isinstance(self.backbone, Qwen3VLBackbone):
            return self.vision_features(pixels)[0]
        return self.backbone.eagle_model.image_tokens(pixels)

    def vision_features(self, patches: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """N1.7: the merged image tokens and the DeepStack features of pixel patches."""
        assert isinstance(self.backbone, Qwen3VLBackbone)
        images = len(patches) // self.shapes.image_patches
        return self.backbone.image_tokens(patches, images, self.attention)

    def encode(self, batch: GrootBatch) -> VLCache:
        pb = batch.prompt
        if isinstance(self.backbone, Qwen3VLBackbone):
            images, deep = self.vision_features(batch.pixels) if len(batch.pixels) else \
                (batch.pixels, [])
            x = self.backbone.embed(pb.ids, pb.image_slots, images)
            assert pb.mrope is not None
            hidden = self.backbone(x, pb.mrope, pb.image_slots, deep, pb.cu, pb.max_len,
                                   self.attention, pb.key_valid)
        else:
            images = self.image_tokens(batch.pixels) if len(batch.pixels) else batch.pixels
            x = self.backbone.embed(pb.ids, pb.image_slots, images)
            hidden = self.backbone(x, pb.positions, pb.cu, pb.max_len, self.attention,
                                   pb.key_valid)
        head = self.action_head
        normed, features = vl_features(head.vlln, head.vl_self_attention, hidden, pb.cu,
                                       pb.max_len, self.attention, pb.key_valid, self.dropout)
        state = head.state_encoder(batch.state.to(features.dtype), batch.embodiment)
        if self.state_dropout:
            drop = torch.rand(len(state), device=state.device) < self.state_dropout
            state = state * (1 - drop[:, None, None].to(state.dtype))
        return VLCache(hidden, normed, features, state, batch.embodiment, batch)

    def value(self, cache: VLCache) -> torch.Tensor:
        """Value ``[n]`` from the mean of each sample's real VL features."""
        pb, f = cache.batch.prompt, cache.features
        w = torch.ones(len(f), device=f.device, dtype=f.dtype)
        if pb.key_valid is not None:
            w = pb.key_valid.to(f.dtype)
        pooled = f.new_zeros(pb.n, f.shape[1]).index_add_(0, pb.sample_of_token, f * w[:, None])
        count = torch.as_tensor(pb.lengths, device=f.device, dtype=f.dtype)
        return self.value_head(pooled / count[:, None])[:, 0].float()

    def cross_kv(self, cache: VLCache, reps: int) -> CrossKV:
        pb = cache.batch.prompt
        cross = self.action_head.model.cross_blocks()
        if self.shapes.version == "n1.5":
            everything = self._layout(cache, reps, None)
            return self.action_head.model.cross_kv(cache.features, [everything] * len(cross))
        valid = np.ones(len(pb.ids), bool) if pb.key_valid is None else \
            pb.key_valid.cpu().numpy()
        image = np.zeros(len(pb.ids), bool)
        image[pb.image_slots.cpu().numpy()] = True
        text_rows = self._layout(cache, reps, ~image & valid)
        image_rows = self._layout(cache, reps, image & valid)
        every = 2 * self.shapes.attend_text_every
        layouts = [text_rows if (2 * j) % every == 0 else image_rows for j in range(len(cross))]
        return self.action_head.model.cross_kv(cache.features, layouts)

    def _layout(self, cache: VLCache, reps: int, keep: np.ndarray | None) -> KeyLayout:
        """Each of the ``reps * n`` segments reads its sample's rows (those ``keep`` marks)."""
        pb = cache.batch.prompt
        cu = pb.cu.cpu().numpy().astype(np.int64)
        rows = [np.arange(cu[i], cu[i + 1]) for i in range(pb.n)]
        if keep is not None:
            rows = [r[keep[r]] for r in rows]
        owner = np.tile(np.arange(pb.n), reps)
        index = np.concatenate([rows[i] for i in owner]) if len(owner) \
            else np.zeros(0, np.int64)
        seg = np.array([len(rows[i]) for i in owner], np.int64)
        cu_k = np.zeros(len(owner) + 1, np.int32)
        cu_k[1:] = np.cumsum(seg)
        dev = cache.features.device
        index_t = torch.from_numpy(index.astype(np.int64)).to(dev)
        valid = None if pb.key_valid is None or keep is not None else pb.key_valid[index_t]
        return KeyLayout(index_t, torch.from_numpy(cu_k).to(dev),
                         int(seg.max()) if len(seg) else 0, valid)

    def velocity(self, cache: VLCache, kv: CrossKV, x: torch.Tensor, steps: torch.Tensor,
                 record: list[torch.Tensor] | None = None,
                 encodings: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Velocity ``[S, H, A]`` (GR00T's convention: toward the action) of ``x`` at integer
        timesteps ``steps [S]``; ``S`` is a multiple of the batch size."""
        reps = len(x) // cache.state.shape[0]
        state = cache.state.repeat(reps, 1, 1)
        ids = cache.embodiment.repeat(reps)
        return self.action_head.velocity(state, x, steps, ids, kv, self.attention, self.dropout,
                                         record, encodings).float()
