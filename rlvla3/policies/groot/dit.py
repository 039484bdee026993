"""The transformer blocks of GR00T's action head: the DiT and its pieces.

``Block`` is diffusers' ``BasicTransformerBlock`` as GR00T configures it (attention with biases,
a tanh-GELU feed-forward of 4x width; a plain LayerNorm, or under ``ada`` an AdaLN whose scale
and shift come from the timestep embedding). The DiT (``DiT``) runs ``dit_layers`` blocks over
the action tokens ``[S, L, D]`` (``L`` = state token + future tokens + horizon), interleaving
cross-attention to the sample's VL tokens (even blocks) with self-attention (odd blocks), then
an AdaLN-modulated output LayerNorm and ``proj_out_2``.

Inputs: tokens ``[S, L, D]``, integer timesteps ``[S]`` (flow time x buckets), and for the
cross-attention blocks a ``CrossKV``: every VL token's keys/values per block, computed once per
observation and reused by every denoising step, with the varlen layout that maps action
segment ``s`` to the VL tokens of its sample. Output: ``[S, L, hidden]`` and, on request, every
block's output.

Invariants: module names follow the checkpoint (``transformer_blocks.N.attn1.to_q``...); no
padding reaches the cross-attention (varlen over real VL tokens); dropout is applied only when
a probability is passed (training on request), never from ``nn.Module.training``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.attention import AttentionBackend


class AdaLayerNorm(nn.Module):
    """``LayerNorm(x) * (1 + scale) + shift`` with ``(scale, shift) = linear(silu(temb))``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Projections of diffusers' ``Attention`` (the attention itself is computed outside)."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(kv_dim, inner)
        self.to_v = nn.Linear(kv_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])


class GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor, p: float) -> torch.Tensor:
        h = F.dropout(self.net[0](x), p) if p else self.net[0](x)
        h = self.net[2](h)
        return F.dropout(h, p) if p else h


class Block(nn.Module):
    """One transformer block; ``cross_dim`` makes its attention a cross-attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, cross_dim: int = 0,
                 ada: bool = False, affine: bool = True):
        super().__init__()
        self.ada = ada
        self.norm1 = AdaLayerNorm(dim) if ada else nn.LayerNorm(dim, 1e-5, affine)
        self.attn1 = Attention(dim, heads, head_dim, cross_dim or dim)
        self.norm3 = nn.LayerNorm(dim, 1e-5, affine)
        self.ff = FeedForward(dim)
        self.cross = bool(cross_dim)

    def forward(self, x: torch.Tensor, attend, temb: torch.Tensor | None, p: float = 0.0
                ) -> torch.Tensor:
        """``attend(q [S, L, H, d]) -> [S, L, H * d]`` computes this block's attention."""
        h = self.norm1(x, temb) if self.ada else self.norm1(x)
        a = self.attn1
        q = a.to_q(h).view(*h.shape[:-1], a.heads, a.head_dim)
        o = a.to_out[0](attend(q, h))
        if p:
            o = F.dropout(F.dropout(o, p), p)  # to_out's dropout, then the block's final one
        x = x + o
        return x + self.ff(self.norm3(x), p)

    def self_attention(self, q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each segment (all segments have the same length)."""
        a = self.attn1
        k = a.to_k(h).view(*h.shape[:-1], a.heads, a.head_dim)
        v = a.to_v(h).view(*h.shape[:-1], a.heads, a.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2).reshape(*q.shape[:-2], -1)


@dataclass
class KeyLayout:
    """The varlen layout from action segments (``S`` of ``L`` tokens) to the VL tokens a
    cross-attention block reads of their sample."""

    index: torch.Tensor
    """Rows of those VL tokens in segment order (a sample's rows repeated per repeat)."""
    cu_k: torch.Tensor
    max_k: int
    key_valid: torch.Tensor | None


@dataclass
class CrossKV:
    """Keys/values of every VL token for each cross-attention block, and each block's
    ``KeyLayout`` (N1.5: every block reads all of its sample's tokens; N1.7's
    ``AlternateVLDiT``: its text tokens or its image tokens, block by block)."""

    keys: list[torch.Tensor]
    """Per cross block ``[T_vl, H, d]``."""
    values: list[torch.Tensor]
    layouts: list[KeyLayout]


def timestep_embedding(t: torch.Tensor, channels: int = 256) -> torch.Tensor:
    """diffusers' ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)``."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device)
    exponent = exponent / (half - 1)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(256, dim)
        self.linear_2 = nn.Linear(dim, dim)


class TimestepEncoder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        e = self.timestep_embedder
        x = timestep_embedding(t).to(e.linear_1.weight.dtype)
        return e.linear_2(F.silu(e.linear_1(x)))


class DiT(nn.Module):
    """GR00T's diffusion transformer (``action_head.model``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, layers: int, out_dim: int,
                 cross_dim: int):
        super().__init__()
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList(
            Block(dim, heads, head_dim, cross_dim=0 if i % 2 else cross_dim, ada=True,
                  affine=False) for i in range(layers))
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, out_dim)

    def cross_blocks(self) -> list[Block]:
        return [b for b in cast(Sequence[Block], self.transformer_blocks) if b.cross]

    def cross_kv(self, vl: torch.Tensor, layouts: list[KeyLayout]) -> CrossKV:
        """Keys/values of ``vl`` for every cross block; ``layouts`` one per cross block."""
        keys, values = [], []
        for b in self.cross_blocks():
            a = b.attn1
            keys.append(a.to_k(vl).view(len(vl), a.heads, a.head_dim))
            values.append(a.to_v(vl).view(len(vl), a.heads, a.head_dim))
        return CrossKV(keys, values, layouts)

    def forward(self, x: torch.Tensor, t: torch.Tensor, kv: CrossKV,
                attention: AttentionBackend, p: float = 0.0,
                record: list[torch.Tensor] | None = None) -> torch.Tensor:
        temb = self.timestep_encoder(t)
        s, n = x.shape[:2]
        cu_q = torch.arange(0, s * n + 1, n, dtype=torch.int32, device=x.device)
        cross = 0
        for block in self.transformer_blocks:
            if block.cross:
                lay = kv.layouts[cross]
                k = kv.keys[cross][lay.index]
                v = kv.values[cross][lay.index]
                cross += 1

                def attend(q, h, k=k, v=v, lay=lay):
                    o = attention(q.reshape(s * n, *q.shape[2:]), k, v, cu_q, lay.cu_k, n,
                                  lay.max_k, lay.key_valid)
                    return o.reshape(s, n, -1)

                x = block(x, attend, temb, p)
            else:
                x = block(x, block.self_attention, temb, p)
            if record is not None:
                record.append(x)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(x)
