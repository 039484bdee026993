"""The VL backbone adapter of GR00T-N1.5: Eagle 2.5 (SigLIP, pixel shuffle, MLP connector,
Qwen3 cut at ``select_layer``, its final norm) on packed prompts.

Inputs: pixels ``[M, 3, S, S]`` of the M images of a batch (sample-major, camera order) and a
``PromptBatch`` (``rlvla3.policies.groot.processor``): the token ids of every sample's prompt laid
end to end, where each image's ``<IMG_CONTEXT>`` placeholders stand, ``cu_seqlens`` and RoPE
positions. Output: the hidden states of the last kept Qwen3 layer on the packed stream
``[T, llm_width]`` (after ``eagle_linear`` when ``project_to_dim`` is set): GR00T's
"LLM hidden at the selected layer", its VL features.

Invariants: module names follow the Isaac-GR00T checkpoint (``backbone.eagle_model...``), so
``state_dict`` keys are the reference's; the LLM is causal within each sample and never sees
another sample's tokens (one varlen call per layer, no padding); image tokens replace the
placeholder embeddings in order; SigLIP's pooling head and the LM head, which GR00T never
uses, are not built (``rlvla3.policies.groot.loader`` lists them as unused keys). Each formula is
written in the reference's order of operations (LayerNorm/RMSNorm in float32, pixel shuffle's
exact reshapes) so float32 outputs agree to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.model.fp8 import BlockLinear
from rlvla3.model.layers import VisionLayer, rope
from rlvla3.policies.groot.config import GrootShapes


class RMSNorm(nn.Module):
    """Qwen's RMSNorm: ``w * x / rms(x)`` (float32 inside)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SiglipEmbeddings(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, s.vision_width, s.patch, stride=s.patch)
        self.position_embedding = nn.Embedding((s.image_size // s.patch) ** 2, s.vision_width)


class SiglipEncoder(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(s.vision_width, s.vision_heads, s.vision_mlp)
                                    for _ in range(s.vision_depth))


class SiglipTower(nn.Module):
    """SigLIP vision transformer: patches + positions, layers, post-LayerNorm."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.embeddings = SiglipEmbeddings(s)
        self.encoder = SiglipEncoder(s)
        self.post_layernorm = nn.LayerNorm(s.vision_width, eps=s.vision_eps)
        for layer in cast(Sequence[VisionLayer], self.encoder.layers):
            layer.layer_norm1.eps = layer.layer_norm2.eps = s.vision_eps

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        x = e.patch_embedding(pixels.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + e.position_embedding.weight[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipModel(nn.Module):
    """Holds the tower under ``vision_model`` (the Hugging Face ``SiglipVisionModel`` layout)."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.vision_model = SiglipTower(s)


def pixel_shuffle(x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """Eagle's pixel shuffle ``[n, w, h, c] -> [n, w * scale, h * scale, c / scale^2]``."""
    n, w, h, c = x.size()
    x = x.view(n, w, int(h * scale), int(c / scale))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * scale), int(w * scale), int(c / (scale * scale)))
    return x.permute(0, 2, 1, 3).contiguous()


class Qwen3Attention(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.llm_heads, s.llm_kv_heads, s.llm_head_dim
        self.q_proj = BlockLinear(s.llm_width, s.llm_heads * s.llm_head_dim, bias=False)
        self.k_proj = BlockLinear(s.llm_width, s.llm_kv_heads * s.llm_head_dim, bias=False)
        self.v_proj = BlockLinear(s.llm_width, s.llm_kv_heads * s.llm_head_dim, bias=False)
        self.o_proj = BlockLinear(s.llm_heads * s.llm_head_dim, s.llm_width, bias=False)
        self.q_norm = RMSNorm(s.llm_head_dim, s.rms_eps)
        self.k_norm = RMSNorm(s.llm_head_dim, s.rms_eps)


class Qwen3MLP(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.gate_proj = BlockLinear(s.llm_width, s.llm_mlp, bias=False)
        self.up_proj = BlockLinear(s.llm_width, s.llm_mlp, bias=False)
        self.down_proj = BlockLinear(s.llm_mlp, s.llm_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.input_layernorm = RMSNorm(s.llm_width, s.rms_eps)
        self.self_attn = Qwen3Attention(s)
        self.post_attention_layernorm = RMSNorm(s.llm_width, s.rms_eps)
        self.mlp = Qwen3MLP(s)
        self.rope_theta = s.rope_theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, max_len: int,
                attention: AttentionBackend, key_valid: torch.Tensor | None) -> torch.Tensor:
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(-1, a.heads, a.head_dim))
        k = a.k_norm(a.k_proj(h).view(-1, a.kv_heads, a.head_dim))
        v = a.v_proj(h).view(-1, a.kv_heads, a.head_dim)
        q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        o = attention(q, k, v, cu, cu, max_len, max_len, key_valid, causal=True)
        x = x + a.o_proj(o.reshape(len(x), -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.llm_width)
        self.layers = nn.ModuleList(Qwen3Layer(s) for _ in range(s.llm_layers))
        self.norm = RMSNorm(s.llm_width, s.rms_eps)


class Qwen3LM(nn.Module):
    """``language_model.model``: embedding, the kept decoder layers and the final norm. GR00T
    reads ``hidden_states[select_layer]`` of the cut model, which is the last entry: the last
    kept layer's output after the final RMSNorm."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.model = Qwen3Body(s)


class EagleModel(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.shapes = s
        self.vision_model = SiglipModel(s)
        wide = s.vision_width * (4 if s.pixel_shuffle else 1)
        if s.connector_layers == 2:
            self.mlp1 = nn.Sequential(nn.LayerNorm(wide), nn.Linear(wide, s.llm_width), nn.GELU(),
                                      nn.Linear(s.llm_width, s.llm_width))
        else:
            self.mlp1 = nn.Sequential(nn.Linear(wide, s.llm_width))
        self.language_model = Qwen3LM(s)

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[M, 3, S, S]`` -> ``[M, image_tokens, llm_width]``: SigLIP's last hidden state,
        pixel shuffle, the connector."""
        x = self.vision_model.vision_model(pixels)
        if self.shapes.pixel_shuffle:
            side = int(x.shape[1] ** 0.5)
            x = pixel_shuffle(x.reshape(x.shape[0], side, side, -1))
            x = x.reshape(x.shape[0], -1, x.shape[-1])
        return self.mlp1(x)


class EagleBackbone(nn.Module):
    """``backbone``: the Eagle model and the optional ``eagle_linear`` projection."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.eagle_model = EagleModel(s)
        self.eagle_linear = nn.Linear(s.llm_width, s.project_to_dim) if s.project_to_dim else None

    def embed(self, ids: torch.Tensor, image_slots: torch.Tensor,
              image_tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, W]`` with the image tokens in their placeholders' rows."""
        emb = self.eagle_model.language_model.model.embed_tokens(ids)
        if len(image_slots):
            emb = emb.index_copy(0, image_slots, image_tokens.reshape(-1, emb.shape[-1])
                                 .to(emb.dtype))
        return emb

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, max_len: int,
                attention: AttentionBackend, key_valid: torch.Tensor | None = None
                ) -> torch.Tensor:
        body = self.eagle_model.language_model.model
        for layer in body.layers:
            x = layer(x, positions, cu, max_len, attention, key_valid)
        x = body.norm(x)
        return x if self.eagle_linear is None else self.eagle_linear(x)
