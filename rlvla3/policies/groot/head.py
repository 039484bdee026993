"""GR00T's flow-matching action head (``action_head``): token assembly, DiT, velocity, loss.

Inputs: the packed VL features (after ``vlln`` and the VL self-attention, cached as a
``CrossKV`` per observation), the state encoding of each sample, noisy action chunks
``x [S, H, A]`` at integer timesteps ``[S]`` and the segments' embodiment ids. Output: the
velocity ``[S, H, A]``: the action decoder applied to the DiT's output on the last ``H``
tokens of ``[state token, future tokens, action tokens + position embedding]`` (N1.7 has no
future tokens).

GR00T's flow convention (the reverse of pi0's): ``x_t = (1 - t) noise + t action``, velocity
``action - noise``, t from 0 (noise) to 1 (action), fed to the network as
``int(t * buckets)``; training times ``t = (0.999 - u) / 0.999`` with ``u ~ Beta(1.5, 1)``;
Euler steps ``x += v / K`` at ``t = k / K``. ``flow_loss`` is the masked mean squared error of
the reference: ``sum(((v - target) * mask)^2... ) / sum(mask)`` over the real action dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.policies.groot.config import GrootShapes
from rlvla3.policies.groot.dit import CrossKV, DiT
from rlvla3.policies.groot.embodiment import ActionEncoder, CategoryMLP
from rlvla3.policies.groot.vl_attention import SelfAttentionTransformer

NOISE_S = 0.999


class FlowHead(nn.Module):
    def __init__(self, s: GrootShapes):
        super().__init__()
        self.shapes = s
        e, c = s.embed_dim, s.embodiments
        self.model = DiT(e, s.dit_heads, s.dit_head_dim, s.dit_layers, s.hidden, s.vl_width)
        self.state_encoder = CategoryMLP(c, s.max_state_dim, s.hidden, e)
        self.action_encoder = ActionEncoder(c, s.max_action_dim, e)
        self.action_decoder = CategoryMLP(c, s.hidden, s.hidden, s.max_action_dim)
        self.future_tokens = nn.Embedding(s.future_tokens, e) if s.future_tokens else None
        self.vlln = nn.LayerNorm(s.vl_width)
        self.vl_self_attention = SelfAttentionTransformer(s.vl_width, s.vl_heads, s.vl_head_dim,
                                                          s.vl_layers)
        self.position_embedding = nn.Embedding(s.max_seq_len, e)

    def bucket(self, t: torch.Tensor) -> torch.Tensor:
        """Integer timesteps of float flow times ``t [S]`` (``(t * buckets).long()``)."""
        return (t * self.shapes.buckets).long()

    def velocity(self, state: torch.Tensor, x: torch.Tensor, steps: torch.Tensor,
                 ids: torch.Tensor, kv: CrossKV, attention: AttentionBackend, p: float = 0.0,
                 record: list[torch.Tensor] | None = None,
                 encodings: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Velocity ``[S, H, A]`` of chunks ``x`` at integer timesteps ``steps [S]``;
        ``state [S, 1, E]`` is each segment's state encoding."""
        h = x.shape[1]
        a = self.action_encoder(x.to(self.position_embedding.weight.dtype), steps, ids)
        if encodings is not None:
            encodings.append(a)
        a = a + self.position_embedding.weight[:h][None]
        if self.future_tokens is None:  # N1.7: [state token, action tokens]
            tokens = torch.cat([state, a], dim=1)
        else:
            future = self.future_tokens.weight[None].expand(len(x), -1, -1)
            tokens = torch.cat([state, future, a], dim=1)
        out = self.model(tokens, steps, kv, attention, p, record)
        return self.action_decoder(out, ids)[:, -h:]


def training_time(u: torch.Tensor, version: str = "n1.5") -> torch.Tensor:
    """GR00T's flow time from a Beta(1.5, 1) draw ``u``: ``(0.999 - u) / 0.999`` (N1.5),
    ``(1 - u) * 0.999`` (N1.7)."""
    if version == "n1.7":
        return (1 - u) * NOISE_S
    return (NOISE_S - u) / NOISE_S


def flow_loss(velocity: torch.Tensor, target: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked squared errors, number of masked elements) (``mask`` as ``target``)."""
    err = F.mse_loss(velocity, target, reduction="none") * mask
    return err.sum(), mask.sum()
