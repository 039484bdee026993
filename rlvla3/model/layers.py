"""Building blocks of the VLA model: norms, rotary embedding, gated MLP, SigLIP-style vision
encoder, and the decoder layer shared by the backbone and the action expert.

Inputs/outputs are plain tensors on packed token streams (``[T, width]``) or, for the action
expert, ``[S, H, width]`` (S action segments of H tokens). Names of sub-modules follow the
Gemma/SigLIP layout of openpi checkpoints so that ``loader.py`` maps keys one to one.

Invariants: RMSNorm is Gemma's ``x / rms(x) * (1 + w)`` (weight 0 = identity); adaptive RMSNorm
derives (scale, shift, gate) from a conditioning vector with a ``dense`` layer initialised to
the identity modulation (scale 0, shift 0, gate 1); only ``BlockLinear`` layers (backbone and
expert projections) ever run in FP8.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.fp8 import BlockLinear


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` computed in float32 (bf16 squares lose too much)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        return (_rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """RMSNorm modulated by ``cond``: returns ``(norm(x) * (1 + scale) + shift, gate)``."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)
        with torch.no_grad():
            self.dense.bias.zero_()
            self.dense.bias[2 * dim:] = 1.0

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        scale, shift, gate = self.dense(cond).chunk(3, dim=-1)
        return (_rms(x, self.eps) * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of ``x [..., T, heads, D]`` at ``positions [T]``."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def sinusoidal(t: torch.Tensor, dim: int, min_period: float = 4e-3,
               max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine embedding of scalar times ``t [B]`` -> ``[B, dim]`` (pi0 periods)."""
    frac = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** frac
    arg = (2 * math.pi / period)[None, :] * t.double()[:, None]
    return torch.cat([arg.sin(), arg.cos()], -1).to(torch.float32)


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = BlockLinear(dim, hidden, bias=False)
        self.up_proj = BlockLinear(dim, hidden, bias=False)
        self.down_proj = BlockLinear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SelfAttentionProj(nn.Module):
    """Q/K/V/O projections of grouped-query attention (the attention itself is external)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = BlockLinear(dim, heads * head_dim, bias=False)
        self.k_proj = BlockLinear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = BlockLinear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = BlockLinear(heads * head_dim, dim, bias=False)


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer; ``cond_dim`` makes its norms adaptive (action expert)."""

    def __init__(self, dim: int, mlp: int, heads: int, kv_heads: int, head_dim: int,
                 cond_dim: int = 0):
        super().__init__()
        norm = (lambda: AdaRMSNorm(dim, cond_dim)) if cond_dim else (lambda: RMSNorm(dim))
        self.input_layernorm = norm()
        self.self_attn = SelfAttentionProj(dim, heads, kv_heads, head_dim)
        self.post_attention_layernorm = norm()
        self.mlp = GatedMLP(dim, mlp)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, cond: torch.Tensor | None = None):
        """Normalised input -> (q ``[T, Hq, D]``, k, v ``[T, Hkv, D]`` with RoPE, gate)."""
        h, gate = self.input_layernorm(x, cond)
        a = self.self_attn
        shape = x.shape[:-1]
        q = a.q_proj(h).view(*shape, a.heads, a.head_dim).reshape(-1, a.heads, a.head_dim)
        k = a.k_proj(h).view(*shape, a.kv_heads, a.head_dim).reshape(-1, a.kv_heads, a.head_dim)
        v = a.v_proj(h).view(*shape, a.kv_heads, a.head_dim).reshape(-1, a.kv_heads, a.head_dim)
        return rope(q, positions), rope(k, positions), v, gate

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, (gated) residual, MLP block."""
        out = self.self_attn.o_proj(attn.reshape(*x.shape[:-1], -1))
        x = x + (out if gate is None else out * gate)
        h, gate = self.post_attention_layernorm(x, cond)
        out = self.mlp(h)
        return x + (out if gate is None else out * gate)


class VisionAttentionProj(nn.Module):
    """SigLIP's biased Q/K/V/out projections (the attention itself is in ``VisionLayer``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)


class VisionMLP(nn.Module):
    """SigLIP's two-layer MLP weights (the tanh GELU between them is in ``VisionLayer``)."""

    def __init__(self, dim: int, mlp: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)


class VisionLayer(nn.Module):
    """SigLIP encoder layer: LayerNorm, biased MHA, LayerNorm, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attn = VisionAttentionProj(dim)
        self.layer_norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = VisionMLP(dim, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, p, d = x.shape
        h = self.layer_norm1(x)
        a = self.self_attn
        split = lambda t: t.view(b, p, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(split(a.q_proj(h)), split(a.k_proj(h)),
                                           split(a.v_proj(h)))
        x = x + a.out_proj(o.transpose(1, 2).reshape(b, p, d))
        h = self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))
        return x + h


class VisionEncoder(nn.Module):
    """ViT over each encoded image: ``[M, 3, S, S]`` -> ``[M, P, out_dim]`` (stays bf16/fp32)."""

    def __init__(self, image_size: int, patch: int, dim: int, depth: int, heads: int, mlp: int,
                 out_dim: int, conv_stem: int = 0):
        super().__init__()
        self.patch_embedding: nn.Module
        if conv_stem:  # channels double up to ``dim``; each conv halves the side
            widths = [3] + [max(8, dim >> (conv_stem - 1 - i)) for i in range(conv_stem)]
            convs: list[nn.Module] = []
            for i, (cin, cout) in enumerate(zip(widths, widths[1:], strict=False)):
                convs += [nn.Conv2d(cin, cout, 3, stride=2, padding=1)]
                convs += [nn.GELU()] if i < conv_stem - 1 else []
            self.patch_embedding = nn.Sequential(*convs)
        else:
            self.patch_embedding = nn.Conv2d(3, dim, patch, stride=patch)
        self.position_embedding = nn.Embedding((image_size // patch) ** 2, dim)
        self.layers = nn.ModuleList(VisionLayer(dim, heads, mlp) for _ in range(depth))
        self.post_layernorm = nn.LayerNorm(dim, eps=1e-6)
        self.projector = nn.Linear(dim, out_dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight[None]
        for layer in self.layers:
            x = layer(x)
        return self.projector(self.post_layernorm(x))
