"""GR00T's processing of the VL features before the DiT: ``vlln`` and the VL self-attention.

Input: the backbone's packed VL features ``[T, W]`` (every sample's prompt tokens laid end to
end, ``cu_seqlens``). Output: ``vlln`` (a LayerNorm) then ``vl_layers`` transformer blocks of
bidirectional self-attention within each sample, ``[T, W]``.

Invariant: a sample's tokens attend to their own sample's real tokens only (one varlen call per
block; no padding, unlike the reference, whose batched call lets shorter prompts attend to the
left padding); module names follow the checkpoint (``vlln``,
``vl_self_attention.transformer_blocks.N``).
"""

from __future__ import annotations

import torch
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.policies.groot.dit import Block


class SelfAttentionTransformer(nn.Module):
    def __init__(self, width: int, heads: int, head_dim: int, layers: int):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(Block(width, heads, head_dim)
                                                for _ in range(layers))


def vl_features(vlln: nn.LayerNorm, blocks: SelfAttentionTransformer, x: torch.Tensor,
                cu: torch.Tensor, max_len: int, attention: AttentionBackend,
                key_valid: torch.Tensor | None, p: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vlln(x), blocks(vlln(x)))`` on the packed stream (the action head's ``vlln`` and
    ``vl_self_attention``)."""
    normed = vlln(x)
    h = normed
    for block in blocks.transformer_blocks:
        a = block.attn1

        def attend(q, hn, a=a):
            k = a.to_k(hn).view(len(hn), a.heads, a.head_dim)
            v = a.to_v(hn).view(len(hn), a.heads, a.head_dim)
            return attention(q, k, v, cu, cu, max_len, max_len, key_valid).reshape(len(hn), -1)

        h = block(h, attend, None, p)
    return normed, h
