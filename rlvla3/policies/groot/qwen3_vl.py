"""The VL backbone of GR00T-N1.7: Qwen3-VL (Cosmos-Reason2) on packed prompts.

Inputs: the pixel patches of the M images of a batch (``[M * P, 3 * temporal * patch^2]``, as
Qwen2-VL's image processor lays them: each image's patches in 2 x 2 merge blocks, the still
frame repeated over the temporal patch), every image of the same ``(1, h, w)`` patch grid; a
``PromptBatch`` (``rlvla3.policies.groot.processor``) whose ``mrope`` holds the 3-row M-RoPE
positions. Output: the output of the last kept LLM layer on the packed stream
``[T, llm_width]``, before the final norm (what N1.7's action head reads).

The vision tower: a Conv3d patch embedding, learned positions bilinearly interpolated from a
square table to the image's grid (``fast_pos_embed_interpolate``, in merge-block order), 2-D
rotary embeddings (row and column frequencies, half the head each), blocks of bidirectional
attention within each image, the merger (LayerNorm per patch, 2 x 2 patches concatenated, an
MLP to the LLM width) and, after the blocks named in ``deepstack``, DeepStack mergers (the
LayerNorm on the concatenated patches) whose outputs are added to the LLM's image rows after
LLM layers 0, 1, ... The LLM: Qwen3 layers (RMSNorm q/k, GQA) with interleaved M-RoPE: text
tokens advance all three rows together, an image's tokens share their time row and take
height / width rows from their merged-grid cell, and the text after an image resumes at the
image start plus the grid's larger side.

Invariants: module names follow the checkpoint (``backbone.model.model.visual...``,
``backbone.model.model.language_model...``; the tied LM head is not built and the loader reads
``backbone.model.lm_head.weight`` as the embedding when the file holds only that); every image
and every prompt sees only itself (varlen, no padding); formulas keep the reference's order of
operations (float32 rotary, RMSNorm in float32) so float32 outputs agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.policies.groot.backbone import Qwen3Layer, RMSNorm
from rlvla3.policies.groot.config import GrootShapes


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.shape = (3, s.temporal_patch, s.patch, s.patch)
        k = (s.temporal_patch, s.patch, s.patch)
        self.proj = nn.Conv3d(3, s.vision_width, kernel_size=k, stride=k, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(len(x), -1)


class VisionAttention(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.heads = s.vision_heads
        self.qkv = nn.Linear(s.vision_width, 3 * s.vision_width)
        self.proj = nn.Linear(s.vision_width, s.vision_width)


class VisionMLP(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.linear_fc1 = nn.Linear(s.vision_width, s.vision_mlp)
        self.linear_fc2 = nn.Linear(s.vision_mlp, s.vision_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.norm1 = nn.LayerNorm(s.vision_width, eps=1e-6)
        self.norm2 = nn.LayerNorm(s.vision_width, eps=1e-6)
        self.attn = VisionAttention(s)
        self.mlp = VisionMLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor,
                max_len: int, attention: AttentionBackend) -> torch.Tensor:
        a = self.attn
        q, k, v = a.qkv(self.norm1(x)).reshape(len(x), 3, a.heads, -1).permute(1, 0, 2, 3) \
            .unbind(0)
        dtype = q.dtype
        c, sn = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q = (q.float() * c + rotate_half(q.float()) * sn).to(dtype)
        k = (k.float() * c + rotate_half(k.float()) * sn).to(dtype)
        o = attention(q, k, v, cu, cu, max_len, max_len, None)
        x = x + a.proj(o.reshape(len(x), -1))
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2 x 2 patches -> one LLM token; ``post_norm`` normalises the concatenated patches
    (DeepStack's mergers), otherwise each patch before concatenation."""

    def __init__(self, s: GrootShapes, post_norm: bool):
        super().__init__()
        self.wide = s.vision_width * s.spatial_merge ** 2
        self.post_norm = post_norm
        self.norm = nn.LayerNorm(self.wide if post_norm else s.vision_width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.wide, self.wide)
        self.linear_fc2 = nn.Linear(self.wide, s.llm_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.wide) if self.post_norm else x).view(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """``visual``: patches of images of one grid -> (merged tokens, DeepStack features)."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.shapes = s
        self.patch_embed = PatchEmbed(s)
        self.pos_embed = nn.Embedding(s.vision_positions, s.vision_width)
        self.blocks = nn.ModuleList(VisionBlock(s) for _ in range(s.vision_depth))
        self.merger = PatchMerger(s, post_norm=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(s, post_norm=True)
                                                   for _ in s.deepstack)

    def _merge_order(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``[h * w, ...]`` in row-major patch order -> the 2 x 2 merge-block order."""
        m = self.shapes.spatial_merge
        return x.view(h // m, m, w // m, m, *x.shape[1:]).permute(0, 2, 1, 3, *range(
            4, x.dim() + 3)).reshape(h * w, *x.shape[1:])

    def positions(self, h: int, w: int) -> torch.Tensor:
        """Learned positions for an ``h x w`` grid: bilinear interpolation of the square table
        at ``linspace(0, side - 1, h)`` x ``linspace(0, side - 1, w)``, merge-block order."""
        side = int(self.shapes.vision_positions ** 0.5)
        table = self.pos_embed.weight
        hi, wi = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        hf, wf = hi.int(), wi.int()
        hc, wc = (hf + 1).clip(max=side - 1), (wf + 1).clip(max=side - 1)
        dh, dw = hi - hf, wi - wf
        corners = [(hf, wf, (1 - dh)[:, None] * (1 - dw)[None]),
                   (hf, wc, (1 - dh)[:, None] * dw[None]),
                   (hc, wf, dh[:, None] * (1 - dw)[None]),
                   (hc, wc, dh[:, None] * dw[None])]
        parts = []
        for rows, cols, weight in corners:
            idx = (rows[:, None] * side + cols[None]).flatten().to(table.device)
            parts.append(table[idx] * weight.flatten().to(table)[:, None])
        pos = parts[0] + parts[1] + parts[2] + parts[3]
        return self._merge_order(pos, h, w)

    def rotary(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[h * w, head_dim]`` of the 2-D rotary embedding, merge-block order."""
        head = self.shapes.vision_width // self.shapes.vision_heads
        dim = head // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        rows = torch.arange(h, device=device)[:, None].expand(h, w).reshape(-1)
        cols = torch.arange(w, device=device)[None].expand(h, w).reshape(-1)
        ids = self._merge_order(torch.stack([rows, cols], -1), h, w)
        table = torch.outer(torch.arange(max(h, w), device=device, dtype=torch.float), inv)
        emb = table[ids].flatten(1)
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, images: int, attention: AttentionBackend
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        s = self.shapes
        side = s.image_size // s.patch
        x = self.patch_embed(patches)
        x = x + self.positions(side, side).to(x.dtype).repeat(images, 1)
        cos, sin = self.rotary(side, side, x.device)
        cos, sin = cos.repeat(images, 1), sin.repeat(images, 1)
        n = side * side
        cu = torch.arange(0, images * n + 1, n, dtype=torch.int32, device=x.device)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu, n, attention)
            if i in s.deepstack:
                deep.append(self.deepstack_merger_list[s.deepstack.index(i)](x))
        return self.merger(x), deep


def mrope(positions: torch.Tensor, s: GrootShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[T, llm_head_dim]`` of interleaved M-RoPE at ``positions [3, T]``."""
    d = s.llm_head_dim
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=positions.device)
                                  .float() / d))
    freqs = positions.float()[:, :, None] * inv[None, None, :]  # [3, T, d / 2]
    out = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        idx = slice(offset, s.mrope_section[axis] * 3, 3)
        out[..., idx] = freqs[axis, ..., idx]
    emb = torch.cat((out, out), dim=-1)
    return emb.cos(), emb.sin()


class TextLayer(Qwen3Layer):
    """A Qwen3 decoder layer with precomputed (M-RoPE) cos / sin."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                cu: torch.Tensor, max_len: int, attention: AttentionBackend,
                key_valid: torch.Tensor | None) -> torch.Tensor:
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(-1, a.heads, a.head_dim))
        k = a.k_norm(a.k_proj(h).view(-1, a.kv_heads, a.head_dim))
        v = a.v_proj(h).view(-1, a.kv_heads, a.head_dim)
        c, sn = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q, k = q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
        o = attention(q, k, v, cu, cu, max_len, max_len, key_valid, causal=True)
        x = x + a.o_proj(o.reshape(len(x), -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """``language_model``: embedding, the kept layers, the (unused by GR00T) final norm."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.llm_width)
        self.layers = nn.ModuleList(TextLayer(s) for _ in range(s.llm_layers))
        self.norm = RMSNorm(s.llm_width, s.rms_eps)


class Qwen3VLModel(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.visual = VisionTower(s)
        self.language_model = TextModel(s)


class Qwen3VLOuter(nn.Module):
    """``Qwen3VLForConditionalGeneration`` without its (tied, unused) LM head."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.model = Qwen3VLModel(s)


class Qwen3VLBackbone(nn.Module):
    """``backbone``: embeds a packed prompt with its images and runs the kept LLM layers."""

    def __init__(self, s: GrootShapes):
        super().__init__()
        self.shapes = s
        self.model = Qwen3VLOuter(s)

    @property
    def visual(self) -> VisionTower:
        return self.model.model.visual

    def image_tokens(self, patches: torch.Tensor, images: int, attention: AttentionBackend
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.visual(patches, images, attention)

    def embed(self, ids: torch.Tensor, image_slots: torch.Tensor,
              image_tokens: torch.Tensor) -> torch.Tensor:
        emb = self.model.model.language_model.embed_tokens(ids)
        if len(image_slots):
            emb = emb.index_copy(0, image_slots, image_tokens.to(emb.dtype))
        return emb

    def forward(self, x: torch.Tensor, positions: torch.Tensor, image_slots: torch.Tensor,
                deepstack: list[torch.Tensor], cu: torch.Tensor, max_len: int,
                attention: AttentionBackend, key_valid: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The last kept layer's output (before DeepStack's addition after it, if any, and
        before the final norm); ``positions [3, T]`` M-RoPE rows."""
        lm = self.model.model.language_model
        cos, sin = mrope(positions, self.shapes)
        out = x
        for i, layer in enumerate(lm.layers):
            x = layer(x, cos, sin, cu, max_len, attention, key_valid)
            out = x
            if i < len(deepstack) and len(image_slots):
                x = x.index_add(0, image_slots, deepstack[i].to(x.dtype))
        return out
