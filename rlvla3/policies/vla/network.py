"""The pi0.5-style network on packed streams: prefix backbone, action expert, value head.

Inputs: a ``PrefixBatch`` (see ``processor.py``) and noisy action chunks ``x [S, H, A]`` at flow
times ``t [S]``, where each of the ``S = R * n`` action segments belongs to sample ``s % n``
(``R`` repeats serve the K denoising steps of one chain in a single pass).
Outputs: a ``PrefixCache`` (per-layer prefix keys/values and the final prefix hidden states),
values ``[n]``, velocities ``[S, H, A]`` and expert hidden states ``[S, H, We]``.

Attention structure (pi0/pi0.5), with no mask and no padding in packed mode:
- prefix tokens (images, instruction, state) attend bidirectionally to their own sample's
  prefix: one varlen call with ``cu_q = cu_k = cu_prefix``;
- action tokens attend to their sample's prefix and to their own segment: one varlen call
  whose key segments are ``[prefix_i, actions_s]`` gathered by ``joint_index``.
Since the prefix never attends to actions, its keys/values are computed once and reused by all
denoising steps (the KV cache of pi0 inference), and training uses the same two passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.model.fp8 import BlockLinear, Fp8Backend
from rlvla3.model.layers import AdaRMSNorm, DecoderLayer, RMSNorm, VisionEncoder, sinusoidal
from rlvla3.policies.vla.config import ModelShapes
from rlvla3.policies.vla.processor import PrefixBatch


@dataclass
class PrefixCache:
    """Everything action tokens need from the prefix."""

    keys: list[torch.Tensor]
    """Per layer, ``[T_prefix, Hkv, D]`` after RoPE."""
    values: list[torch.Tensor]
    hidden: torch.Tensor | None
    """``[T_prefix, width]`` final-normed prefix states (value head input; None where only
    the action expert reads the cache)."""


@dataclass
class SuffixLayout:
    """Index structure of ``R`` action segments per sample against the packed prefix."""

    reps: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_k: int
    joint_index: torch.Tensor
    """Rows of ``cat(prefix keys, action keys)`` in joint key order."""
    key_valid: torch.Tensor | None
    positions: torch.Tensor
    """``[S * H]`` RoPE positions: real prefix length of the sample + step in the chunk."""

    def attend(self, attention: AttentionBackend, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
               chunk: int) -> torch.Tensor:
        """Action queries ``q [S * H, Hq, D]`` over their sample's prefix keys and their own
        segment's keys, through the varlen backend."""
        keys = torch.cat([prefix_k, k])[self.joint_index]
        vals = torch.cat([prefix_v, v])[self.joint_index]
        return attention(q, keys, vals, self.cu_q, self.cu_k, chunk, self.max_k, self.key_valid)


@dataclass
class DenseSuffix:
    """The suffix at static shapes: ``B`` segments (one per sample of a batch bucket), each
    sample's prefix keys/values laid out in ``L`` slots (``StaticPrefix``), a key mask instead
    of a packed index. Every tensor keeps its shape from call to call, so a loop over it can be
    captured in a CUDA graph; attention is one masked SDPA with the query heads of each
    key/value head folded into the query length (no key/value repeat, any GQA group)."""

    reps: int
    positions: torch.Tensor
    """``[B * H]`` RoPE positions (filled per call)."""
    key_mask: torch.Tensor
    """bool ``[B, 1, 1, L + H]``: real prefix keys and the chunk's own keys (filled per call)."""

    def attend(self, attention, q, k, v, prefix_k, prefix_v, chunk):
        b = self.key_mask.shape[0]
        hq, d = q.shape[1:]
        hkv = k.shape[1]
        group = hq // hkv
        keys = torch.cat([prefix_k.view(b, -1, hkv, d), k.view(b, chunk, hkv, d)], 1)
        vals = torch.cat([prefix_v.view(b, -1, hkv, d), v.view(b, chunk, hkv, d)], 1)
        qg = q.view(b, chunk, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv,
                                                                            group * chunk, d)
        out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2),
                                             attn_mask=self.key_mask)
        return out.view(b, hkv, group, chunk, d).permute(0, 3, 1, 2, 4).reshape(b * chunk, hq, d)


class VLANetwork(nn.Module):
    """Vision encoder + token embedding + Gemma-style backbone + adaRMS action expert."""

    def __init__(self, shapes: ModelShapes, action_dim: int, chunk_len: int, flow_noise: bool):
        super().__init__()
        s = shapes
        self.shapes, self.chunk_len = s, chunk_len
        self.action_dim = action_dim
        self.action_width = max(s.max_action_dim, action_dim)
        self.vision = VisionEncoder(s.image_size, s.patch, s.vision_width, s.vision_depth,
                                    s.vision_heads, s.vision_mlp, s.width, s.conv_stem)
        self.embed_tokens = nn.Embedding(s.vocab, s.width)
        self.layers = nn.ModuleList(
            DecoderLayer(s.width, s.mlp, s.heads, s.kv_heads, s.head_dim) for _ in range(s.depth)
        )
        self.norm = RMSNorm(s.width)
        we = s.expert_width
        self.expert_layers = nn.ModuleList(
            DecoderLayer(we, s.expert_mlp, s.heads, s.kv_heads, s.head_dim, cond_dim=we)
            for _ in range(s.depth)
        )
        self.expert_norm = AdaRMSNorm(we, we)
        self.action_in_proj = nn.Linear(self.action_width, we)
        self.action_out_proj = nn.Linear(we, self.action_width)
        self.time_mlp_in = nn.Linear(we, we)
        self.time_mlp_out = nn.Linear(we, we)
        self.value_head = nn.Sequential(nn.Linear(s.width, s.width), nn.SiLU(),
                                        nn.Linear(s.width, 1))
        self.noise_head = nn.Linear(we, self.action_width) if flow_noise else None
        self.attention: AttentionBackend
        """Varlen attention, set by the policy (``set_attention``) before the first forward."""
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.is_meta:  # shape-only build (e.g. to list a checkpoint layout)
                continue
            if p.dim() >= 2 and ".dense." not in name:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") and ".dense." not in name:
                nn.init.zeros_(p)

    def set_fp8(self, backend: Fp8Backend | None) -> None:
        """Route every backbone/expert projection through ``backend`` (None: plain linears)."""
        for m in self.modules():
            if isinstance(m, BlockLinear):
                m.fp8 = backend

    # -- prefix ----------------------------------------------------------------------------
    def embed_prefix(self, pb: PrefixBatch) -> torch.Tensor:
        """Packed prefix embeddings ``[T_prefix, width]`` (images, instruction, state)."""
        parts = []
        if len(pb.pixels):
            dtype = self.vision.position_embedding.weight.dtype
            parts.append(self.vision(pb.pixels.to(dtype)).flatten(0, 1).to(self.norm.weight.dtype))
        ids = torch.cat([pb.text_ids, pb.state_ids])
        parts.append(self.embed_tokens(ids) * math.sqrt(self.shapes.width))
        return torch.cat(parts)[pb.prefix_index]

    def encode_prefix(self, pb: PrefixBatch) -> PrefixCache:
        x = self.embed_prefix(pb)
        keys, values = [], []
        for layer in cast(Sequence[DecoderLayer], self.layers):
            q, k, v, _ = layer.qkv(x, pb.positions)
            a = self.attention(q, k, v, pb.cu_prefix, pb.cu_prefix, pb.max_prefix, pb.max_prefix,
                               pb.key_valid)
            keys.append(k)
            values.append(v)
            x = layer.finish(x, a, None)
        return PrefixCache(keys, values, self.norm(x)[0])

    def value(self, cache: PrefixCache, pb: PrefixBatch) -> torch.Tensor:
        """Value ``[n]`` from the mean of each sample's real prefix states (``cache`` from
        ``encode_prefix``, which keeps them)."""
        hidden = cast(torch.Tensor, cache.hidden)
        w = torch.ones(len(hidden), device=hidden.device, dtype=hidden.dtype)
        if pb.key_valid is not None:
            w = pb.key_valid.to(w.dtype)
        pooled = hidden.new_zeros(pb.n, hidden.shape[1])
        pooled.index_add_(0, pb.sample_of_token, hidden * w[:, None])
        count = pb.real_counts.to(w.dtype)
        return self.value_head(pooled / count[:, None])[:, 0].float()

    # -- action expert ---------------------------------------------------------------------
    def suffix_layout(self, pb: PrefixBatch, reps: int) -> SuffixLayout:
        h, n = self.chunk_len, pb.n
        plen = pb.segment_lengths
        cu_p = np.r_[0, np.cumsum(plen)].astype(np.int64)
        total_p = int(cu_p[-1])
        owner = np.tile(np.arange(n), reps)
        seg_k = plen[owner] + h
        index = [
            np.concatenate([np.arange(cu_p[i], cu_p[i + 1]), total_p + s * h + np.arange(h)])
            for s, i in enumerate(owner)
        ]
        dev = pb.cu_prefix.device
        cu_k = np.zeros(len(owner) + 1, np.int32)
        cu_k[1:] = np.cumsum(seg_k)
        valid = None
        if pb.key_valid is not None:
            valid = torch.cat([pb.key_valid, torch.ones(len(owner) * h, dtype=torch.bool,
                                                        device=dev)])
        joint = torch.from_numpy(np.concatenate(index) if index else np.zeros(0, np.int64))
        pos = (np.asarray(pb.real_prefix)[owner][:, None] + np.arange(h)[None, :]).reshape(-1)
        return SuffixLayout(
            reps=reps,
            cu_q=torch.arange(0, len(owner) * h + 1, h, dtype=torch.int32, device=dev),
            cu_k=torch.from_numpy(cu_k).to(dev),
            max_k=int(seg_k.max()) if len(seg_k) else 0,
            joint_index=joint.to(dev),
            key_valid=None if valid is None else valid[joint.to(dev)],
            positions=torch.from_numpy(pos.astype(np.int64)).to(dev),
        )

    def time_condition(self, t: torch.Tensor) -> torch.Tensor:
        emb = sinusoidal(t, self.shapes.expert_width).to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(
            F.silu(self.time_mlp_in(emb))))

    def velocity(self, cache: PrefixCache, layout: SuffixLayout | DenseSuffix, x: torch.Tensor,
                 t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow velocity ``[S, H, A]`` and expert states ``[S, H, We]`` for chunks ``x``
        (packed ``SuffixLayout`` or static ``DenseSuffix``: the same arithmetic)."""
        s, h, a = x.shape
        if a < self.action_width:
            x = F.pad(x, (0, self.action_width - a))
        y = self.action_in_proj(x.to(self.action_in_proj.weight.dtype))
        cond = self.time_condition(t)[:, None, :]
        layers = cast(Sequence[DecoderLayer], self.expert_layers)
        for layer, pk, pv in zip(layers, cache.keys, cache.values, strict=True):
            q, k, v, gate = layer.qkv(y, layout.positions, cond)
            att = layout.attend(self.attention, q, k, v, pk, pv, h)
            y = layer.finish(y, att.view(s, h, *att.shape[1:]), gate, cond)
        y, _ = self.expert_norm(y, cond)
        return self.action_out_proj(y)[..., :a].float(), y
